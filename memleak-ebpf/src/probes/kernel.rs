//! Kernel allocations, with no -p or -c, as bcc traces them: kmalloc,
//! `kmem_cache`, pages and (--percpu) per-CPU memory. Raw tracepoints
//! need neither tracefs nor kernel headers, and read each argument as the
//! word it is: BTF-enabled ones refuse `void *` arguments before 6.x.
//! Recorded under tgid 0 with kernel stacks.

use aya_ebpf::{helpers::bpf_probe_read_kernel, macros::raw_tracepoint, programs::RawTracePointContext};
use memleak_common::{AllocationKey, Counter, KERNEL_TGID};

use crate::{counters, record, scratch, stack, tunables};

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
    // An allocation in an interrupt may come in the middle of another's
    // program run, which holds the scratch: see `scratch`.
    let stack_id = if scratch::hold().is_some() {
        let stack_id = stack::current_kernel_stack_id(ctx);
        scratch::release();
        stack_id
    } else {
        stack::lost_stack(KERNEL_TGID)
    };
    record::store(key, size, stack_id);
}

fn release(address: u64) {
    let _ = record::release(KERNEL_TGID, address, || false);
}
