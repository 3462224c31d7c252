//! Kernel allocations, with no -p or -c, as bcc traces them: kmalloc,
//! `kmem_cache`, pages and (--percpu) per-CPU memory. Raw tracepoints
//! need neither tracefs nor kernel headers, and read each argument as the
//! word it is: BTF-enabled ones refuse `void *` arguments before 6.x.
//! Recorded under tgid 0 with kernel stacks.

use aya_ebpf::{helpers::bpf_probe_read_kernel, macros::raw_tracepoint, programs::RawTracePointContext};
use memleak_common::{AllocationKey, Counter, KERNEL_TGID};

use crate::{counters, record, tunables};
#[cfg(not(feature = "legacy-kernels"))]
use crate::{scratch, stack};

const PAGE_SIZE: u64 = 4096;

// Argument positions follow the tracepoints' prototypes:
// kmalloc(call_site, ptr, bytes_req, bytes_alloc, gfp[, node]) and so on.
// Before 6.1, kmalloc_node, kmem_cache_alloc and kmem_cache_alloc_node
// had kmalloc's, and user space attaches `kmalloc` to them all.

#[raw_tracepoint(tracepoint = "kmalloc")]
pub fn kmalloc(ctx: RawTracePointContext) -> i32 {
    if !tunables::ignored_caller(ctx.arg(0)) {
        record(&ctx, ctx.arg(1), ctx.arg(3));
    }
    0
}

#[raw_tracepoint(tracepoint = "kfree")]
pub fn kfree(ctx: RawTracePointContext) -> i32 {
    release(ctx.arg(1));
    0
}

#[raw_tracepoint(tracepoint = "kmem_cache_alloc")]
pub fn kmem_cache_alloc(ctx: RawTracePointContext) -> i32 {
    if tunables::ignored_caller(ctx.arg(0)) {
        return 0;
    }
    let cache: u64 = ctx.arg(2);
    // From 6.1 the tracepoint gives the cache, not the size: read the
    // cache's object size at the offset user space found in the kernel's
    // BTF.
    let size_field = (cache + u64::from(tunables::cache_size_offset())) as *const u32;
    // SAFETY: a kernel read that fails cleanly on a bad address.
    let size = unsafe { bpf_probe_read_kernel(size_field) }.unwrap_or(0);
    record(&ctx, ctx.arg(1), u64::from(size));
    0
}

#[raw_tracepoint(tracepoint = "kmem_cache_free")]
pub fn kmem_cache_free(ctx: RawTracePointContext) -> i32 {
    release(ctx.arg(1));
    0
}

#[raw_tracepoint(tracepoint = "mm_page_alloc")]
pub fn mm_page_alloc(ctx: RawTracePointContext) -> i32 {
    let order: u32 = ctx.arg(1);
    // Pages are keyed by their struct page.
    record(&ctx, ctx.arg(0), PAGE_SIZE << (order & 31));
    0
}

#[raw_tracepoint(tracepoint = "mm_page_free")]
pub fn mm_page_free(ctx: RawTracePointContext) -> i32 {
    release(ctx.arg(0));
    0
}

// percpu_alloc_percpu(call_site, reserved, is_atomic, size, align,
//                     base_addr, off, ptr, bytes_alloc, gfp)
#[raw_tracepoint(tracepoint = "percpu_alloc_percpu")]
pub fn percpu_alloc_percpu(ctx: RawTracePointContext) -> i32 {
    record(&ctx, ctx.arg(7), ctx.arg(8));
    0
}

// percpu_free_percpu(base_addr, off, ptr)
#[raw_tracepoint(tracepoint = "percpu_free_percpu")]
pub fn percpu_free_percpu(ctx: RawTracePointContext) -> i32 {
    release(ctx.arg(2));
    0
}

// Inlined where it tail-calls (see `staged`): the kernel allows a tail
// call only in a function that returns an int, which this one is not.
#[cfg_attr(feature = "legacy-kernels", expect(clippy::inline_always, reason = "a tail call: see above"))]
#[cfg_attr(feature = "legacy-kernels", inline(always))]
fn record(ctx: &RawTracePointContext, address: u64, size: u64) {
    if address == 0 {
        counters::increment(KERNEL_TGID, Counter::FailedAllocations);
        return;
    }
    if tunables::ignored_process(crate::calls::process_id()) {
        return;
    }
    counters::increment(KERNEL_TGID, Counter::Allocations);
    if size < tunables::min_size() || size > tunables::max_size() || !tunables::sample() {
        return;
    }
    let key = AllocationKey { tgid: KERNEL_TGID, _padding: 0, address };
    record_with_stack(ctx, key, size);
}

/// Records `key` with the current kernel stack, the scratch held until it
/// is stored: an allocation made in an interrupt on this CPU meanwhile
/// finds it held, and is left out (see `scratch`).
///
/// Such an interrupt is mostly memleak's own doing: storing an entry can
/// drain the BPF memory allocator's cache for memleak's maps, which
/// queues an `irq_work` that refills it, at once, with kmalloc and the
/// pages under it. Recorded, each refill would store an entry, and drain
/// the cache again. The refills' own call sites are left out too (see
/// `tunables::ignored_caller`), for a refill run later, outside any
/// program; but the pages a refill takes have no call site, and Debian's
/// arm64 6.12 filled the allocations map with a million refills in
/// seconds, each nested in a program run, before this.
#[cfg(not(feature = "legacy-kernels"))]
fn record_with_stack(ctx: &RawTracePointContext, key: AllocationKey, size: u64) {
    if scratch::hold().is_none() {
        return;
    }
    record::store(key, size, stack::current_kernel_stack_id(ctx));
    scratch::release();
}

/// Kernels without `bpf_loop`: a program that took the kernel stack and
/// stored it was past the verifier's million instructions (its frame
/// comparisons are loops it follows through). The stack is taken here, in
/// the scratch, and stored by `store_kernel_stack` and, if new,
/// `insert_kernel_stack`, tail-called through `KERNEL_STACK_RECORDER` as
/// the user stack's stages are (see `probes::recorder`).
#[cfg(feature = "legacy-kernels")]
mod staged {
    use aya_ebpf::{macros::raw_tracepoint, programs::RawTracePointContext};
    use memleak_common::{AllocationKey, KERNEL_STAGE_INSERT, KERNEL_STAGE_STORE, KERNEL_TGID};

    use crate::{
        deferred::{ALLOCATION, NOTHING},
        maps::{KERNEL_STACK_RECORDER, PENDING_RECORD},
        probes::recorder::pending,
        record, scratch,
        stack::{self, Completed, Probed},
    };

    /// Hands `key` and its stack to the stages, which record it; records
    /// it with its lost stack if that could not happen.
    ///
    /// A run that finds its thread holding the scratch runs nested in
    /// another: in an interrupt, or in the kernel's allocation of an entry
    /// of memleak's own maps, which kernels before 6.1 make with kmalloc
    /// inside the program that stores it, and which 5.10 does not keep
    /// from running the allocation programs again. Recorded, it would
    /// allocate again, nested deeper each time: it is left out, as in
    /// later kernels (see `record_with_stack` above).
    #[expect(clippy::inline_always, reason = "a tail call: see `record`")]
    #[inline(always)]
    pub(super) fn record_with_stack(ctx: &RawTracePointContext, key: AllocationKey, size: u64) {
        let Some(slot) = scratch::hold() else { return };
        if let Some(pending) = PENDING_RECORD.get_ptr_mut(slot.key()) {
            if stack::begin_kernel_stack(ctx).is_some() {
                // SAFETY: this CPU's slot, held until the last stage's end.
                let pending = unsafe { &mut *pending };
                pending.kind = ALLOCATION;
                pending.tgid = KERNEL_TGID;
                pending.key = key;
                pending.size = size;
                // SAFETY: the stages take the same context: a raw tracepoint's.
                unsafe { KERNEL_STACK_RECORDER.tail_call(ctx, KERNEL_STAGE_STORE) };
                pending.kind = NOTHING;
            }
        }
        record::store(key, size, stack::lost_stack(KERNEL_TGID));
        scratch::release();
    }

    #[raw_tracepoint]
    pub fn store_kernel_stack(ctx: RawTracePointContext) -> i32 {
        let stack_id = match stack::walked_kernel_stack() {
            Completed::Last(id) => id,
            Completed::New => inserted(&ctx),
            Completed::Lost => stack::lost_stack(KERNEL_TGID),
        };
        record_released(stack_id);
        0
    }

    #[raw_tracepoint]
    pub fn insert_kernel_stack(ctx: RawTracePointContext) -> i32 {
        let stack_id = match stack::probe_slot() {
            Probed::Stored(id) => id,
            Probed::Again => inserted(&ctx),
            Probed::Lost => stack::lost_stack(KERNEL_TGID),
        };
        record_released(stack_id);
        0
    }

    /// Hands the stack over to `insert_kernel_stack`, which does not come
    /// back; the lost stack if it could not. Inlined: a tail call.
    #[expect(clippy::inline_always, reason = "a tail call: see `record`")]
    #[inline(always)]
    fn inserted(ctx: &RawTracePointContext) -> u64 {
        // SAFETY: the stage takes the same context.
        unsafe { KERNEL_STACK_RECORDER.tail_call(ctx, KERNEL_STAGE_INSERT) };
        stack::lost_stack(KERNEL_TGID)
    }

    /// Records the pending allocation with stack `stack_id`, and gives
    /// the scratch back: last, so that allocations the record makes are
    /// left out (see `record_with_stack`).
    fn record_released(stack_id: u64) {
        if let Some(pending) = pending() {
            record::store(pending.key, pending.size, stack_id);
            pending.kind = NOTHING;
        }
        scratch::release();
    }
}

#[cfg(feature = "legacy-kernels")]
use staged::record_with_stack;

fn release(address: u64) {
    let _ = record::release(KERNEL_TGID, address, || false);
}
