//! Allocation entry probes and the shared return probe.
//!
//! The entry probe saves what the call asked for, per thread; the return
//! probe sees the result and takes the user stack, which at entry would
//! miss the caller's frame.

use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use memleak_common::{AllocationKey, CallKind, Counter, OVERFLOWED_SIZE};

use crate::{
    calls::{self, enter},
    counters, deferred, events, record, scratch, tunables,
};

/// `malloc(size)`, `valloc(size)`, `pvalloc(size)`, `mallocx(size, flags)`.
#[uprobe]
pub fn malloc_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let size: u64 = ctx.arg(0).unwrap_or(0);
    enter(&ctx, size, 0, CallKind::Allocate);
    0
}

/// `calloc(count, size)`.
#[uprobe]
pub fn calloc_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let count: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    enter(&ctx, array_size(count, size), 0, CallKind::Allocate);
    0
}

/// `realloc(ptr, size)`, `rallocx(ptr, size, flags)`.
#[uprobe]
pub fn realloc_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    enter(&ctx, size, old, CallKind::Reallocate);
    0
}

/// `reallocarray(ptr, count, size)`.
#[uprobe]
pub fn reallocarray_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let count: u64 = ctx.arg(1).unwrap_or(0);
    let size: u64 = ctx.arg(2).unwrap_or(0);
    enter(&ctx, array_size(count, size), old, CallKind::Reallocate);
    0
}

/// `memalign(alignment, size)`, `aligned_alloc(alignment, size)`.
#[uprobe]
pub fn memalign_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    enter(&ctx, size, 0, CallKind::Allocate);
    0
}

/// `posix_memalign(out, alignment, size)`.
#[uprobe]
pub fn posix_memalign_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let out: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(2).unwrap_or(0);
    enter(&ctx, size, out, CallKind::AllocateThroughPointer);
    0
}

/// The return of every function above.
#[uretprobe]
pub fn allocation_return(ctx: RetProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let returned: u64 = ctx.ret();
    let Some(call) = calls::leave() else { return 0 };
    let address = match CallKind::try_from(call.kind) {
        Ok(CallKind::Allocate) | Err(_) => returned,
        Ok(CallKind::Reallocate) => {
            // realloc(p, n) that fails leaves p allocated. One that succeeds,
            // or realloc(p, 0), which glibc treats as free(p), releases it.
            if returned != 0 || call.size == 0 {
                record::release_resized(calls::process_id(), call.argument);
            }
            returned
        }
        Ok(CallKind::AllocateThroughPointer) => {
            if returned as i32 != 0 || call.argument == 0 {
                0
            } else {
                // SAFETY: reads the caller's out-pointer, which posix_memalign
                // has just written; a fault only yields an error.
                unsafe { bpf_probe_read_user(call.argument as *const u64) }.unwrap_or(0)
            }
        }
    };
    events::send(call.function, address, call.size);
    let tgid = calls::process_id();
    if address == 0 {
        if call.size != 0 {
            counters::increment(tgid, Counter::FailedAllocations);
        }
        return 0;
    }
    counters::increment(tgid, Counter::Allocations);
    if call.sampled == 0
        || call.size == OVERFLOWED_SIZE
        || call.size < tunables::min_size()
        || call.size > tunables::max_size()
    {
        return 0;
    }
    deferred::store_allocation(&ctx, AllocationKey { tgid, _padding: 0, address }, call.size);
    0
}

/// `count * size`, or `OVERFLOWED_SIZE` when the product overflows (the
/// call then fails and returns NULL). Division, because BPF has no
/// overflow-checked multiply.
fn array_size(count: u64, size: u64) -> u64 {
    if count != 0 && size > (OVERFLOWED_SIZE - 1) / count {
        OVERFLOWED_SIZE
    } else {
        count * size
    }
}
