use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, generated::bpf_get_attach_cookie},
    macros::uprobe,
    programs::ProbeContext,
    EbpfContext as _,
};
use memleak_common::{AllocationKey, Counter};

use crate::{counters, events, maps::ALLOCATIONS, totals, tunables};

/// free(ptr): forgets the allocation at `ptr`.
#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let address: u64 = ctx.arg(0).unwrap_or(0);
    if address != 0 && tunables::in_scope() {
        let size = release(address);
        // SAFETY: reads this attachment's cookie, the function's index.
        let function = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
        events::send(function, address, size.unwrap_or(0));
    }
    0
}

/// Forgets the allocation at `address` of the current process, if it is
/// one we recorded, and returns its size.
pub fn release(address: u64) -> Option<u64> {
    release_for(current_tgid(), address)
}

/// As `release`, for process `tgid` (0: the kernel).
pub fn release_for(tgid: u32, address: u64) -> Option<u64> {
    if address == 0 {
        return None;
    }
    counters::increment(Counter::Frees);
    forget(&AllocationKey { tgid, _padding: 0, address })
}

/// Removes a recorded allocation, takes it off its stack's totals and
/// returns its size.
pub fn forget(key: &AllocationKey) -> Option<u64> {
    let allocation = ALLOCATIONS.get_ptr(key)?;
    // SAFETY: a live entry; copied out before the entry is removed.
    let allocation = unsafe { *allocation };
    // Only the caller that really removed it updates the totals, so a block
    // freed twice at once is not subtracted twice.
    ALLOCATIONS.remove(key).ok()?;
    totals::subtract(allocation.stack_id, allocation.size);
    Some(allocation.size)
}

pub fn current_tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}
