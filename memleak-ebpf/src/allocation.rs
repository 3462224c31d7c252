//! Allocation entry probes and the shared return probe.
//!
//! The entry probe saves what the call asked for, per thread; the return
//! probe sees the result and takes the user stack, which at entry would
//! miss the caller's frame.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_user,
        generated::{bpf_get_attach_cookie, bpf_ktime_get_ns},
    },
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext as _,
};
use memleak_common::{Allocation, AllocationKey, CallKind, Counter, PendingCall, OVERFLOWED_SIZE};

use crate::{
    counters, events, free,
    maps::{ALLOCATIONS, PENDING},
    stack, totals, tunables,
};

/// The map helpers' "key exists" error.
const EEXIST: i32 = 17;

/// malloc(size), valloc(size), pvalloc(size).
#[uprobe]
pub fn malloc_enter(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    enter(&ctx, size, 0, CallKind::Allocate);
    0
}

/// calloc(count, size).
#[uprobe]
pub fn calloc_enter(ctx: ProbeContext) -> u32 {
    let count: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    enter(&ctx, array_size(count, size), 0, CallKind::Allocate);
    0
}

/// realloc(ptr, size).
#[uprobe]
pub fn realloc_enter(ctx: ProbeContext) -> u32 {
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    enter(&ctx, size, old, CallKind::Reallocate);
    0
}

/// reallocarray(ptr, count, size).
#[uprobe]
pub fn reallocarray_enter(ctx: ProbeContext) -> u32 {
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let count: u64 = ctx.arg(1).unwrap_or(0);
    let size: u64 = ctx.arg(2).unwrap_or(0);
    enter(&ctx, array_size(count, size), old, CallKind::Reallocate);
    0
}

/// memalign(alignment, size), aligned_alloc(alignment, size).
#[uprobe]
pub fn memalign_enter(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(1).unwrap_or(0);
    enter(&ctx, size, 0, CallKind::Allocate);
    0
}

/// posix_memalign(out, alignment, size).
#[uprobe]
pub fn posix_memalign_enter(ctx: ProbeContext) -> u32 {
    let out: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(2).unwrap_or(0);
    enter(&ctx, size, out, CallKind::AllocateThroughPointer);
    0
}

/// The return of every function above.
#[uretprobe]
pub fn allocation_return(ctx: RetProbeContext) -> u32 {
    let returned: u64 = ctx.ret();
    let Some(call) = leave() else { return 0 };
    let address = match kind_of(call.kind) {
        CallKind::Allocate => returned,
        CallKind::Reallocate => {
            // realloc(p, n) that fails leaves p allocated. One that succeeds,
            // or realloc(p, 0), which glibc treats as free(p), releases it.
            if returned != 0 || call.size == 0 {
                let _ = free::release(call.argument);
            }
            returned
        }
        CallKind::AllocateThroughPointer => {
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
    if address == 0 {
        if call.size != 0 {
            counters::increment(Counter::FailedAllocations);
        }
        return 0;
    }
    if call.sampled == 0
        || call.size == OVERFLOWED_SIZE
        || call.size < tunables::min_size()
        || call.size > tunables::max_size()
    {
        return 0;
    }
    record(&ctx, address, call.size);
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

fn thread_id() -> u32 {
    bpf_get_current_pid_tgid() as u32
}

fn enter(ctx: &ProbeContext, size: u64, argument: u64, kind: CallKind) {
    if !tunables::in_scope() {
        return; // no pending call, so the return probe does nothing either
    }
    let tid = thread_id();
    // A thread keeps its entry between calls (at depth 0), so that a call
    // costs one lookup, not an insert and a delete.
    let pending = PENDING.get_ptr_mut(tid);
    // SAFETY: only this thread touches its own entry.
    if let Some(pending) = pending.filter(|pending| unsafe { (**pending).depth } > 0) {
        // An allocator entry point called from inside another one: only the
        // outer call is the program's allocation.
        // SAFETY: as above.
        unsafe { (*pending).depth += 1 };
        return;
    }
    let sampled = tunables::sample() as u32;
    // SAFETY: reads this attachment's cookie: which function was called.
    let function = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let call = PendingCall { size, argument, kind: kind as u32, depth: 1, sampled, function };
    match pending {
        // SAFETY: as above.
        Some(pending) => unsafe { *pending = call },
        None => {
            let _ = PENDING.insert(tid, call, 0);
        }
    }
}

/// Ends this thread's call; `None` while still inside a nested one, or
/// when no call was seen starting (memleak attached during it).
fn leave() -> Option<PendingCall> {
    let tid = thread_id();
    let pending = PENDING.get_ptr_mut(tid)?;
    // SAFETY: only this thread touches its own entry.
    unsafe {
        match (*pending).depth {
            0 => None,
            1 => {
                (*pending).depth = 0;
                Some(*pending)
            }
            _ => {
                (*pending).depth -= 1;
                None
            }
        }
    }
}

fn kind_of(raw: u32) -> CallKind {
    match raw {
        1 => CallKind::Reallocate,
        2 => CallKind::AllocateThroughPointer,
        _ => CallKind::Allocate,
    }
}

fn record(ctx: &RetProbeContext, address: u64, size: u64) {
    let tgid = free::current_tgid();
    store(AllocationKey { tgid, _padding: 0, address }, size, stack::current_stack_id(ctx, tgid));
}

/// Records an allocation under `key`, with its stack.
pub fn store(key: AllocationKey, size: u64, stack_id: u64) {
    let allocation = Allocation {
        size,
        // SAFETY: a helper without arguments.
        timestamp_ns: unsafe { bpf_ktime_get_ns() },
        stack_id,
    };
    // One map operation in the common case. Only when the address is
    // still recorded does it take more: the allocator handed it out again,
    // so its free was not seen (bcc's --wa-missing-free case) and the old
    // block comes off its stack's totals first.
    let mut inserted = ALLOCATIONS.insert(key, allocation, BPF_NOEXIST as u64);
    if inserted == Err(-EEXIST) {
        let _ = free::forget(&key);
        inserted = ALLOCATIONS.insert(key, allocation, 0);
    }
    if inserted.is_err() {
        counters::increment(Counter::AllocationsNotTracked);
        return;
    }
    totals::add(allocation.stack_id, size);
}
