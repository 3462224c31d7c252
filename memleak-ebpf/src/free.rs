use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::uprobe, programs::ProbeContext};
use memleak_common::{AllocationKey, Counter};

use crate::{counters, maps::ALLOCATIONS, totals};

/// free(ptr): forgets the allocation at `ptr`.
#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let address: u64 = ctx.arg(0).unwrap_or(0);
    release(address);
    0
}

/// Forgets the allocation at `address` of the current process, if it is
/// one we recorded.
pub fn release(address: u64) {
    if address == 0 {
        return;
    }
    counters::increment(Counter::Frees);
    let key = AllocationKey { tgid: current_tgid(), _padding: 0, address };
    forget(&key);
}

/// Removes a recorded allocation and takes it off its stack's totals.
pub fn forget(key: &AllocationKey) {
    let Some(allocation) = ALLOCATIONS.get_ptr(key) else { return };
    // SAFETY: a live entry; copied out before the entry is removed.
    let allocation = unsafe { *allocation };
    // Only the caller that really removed it updates the totals, so a block
    // freed twice at once is not subtracted twice.
    if ALLOCATIONS.remove(key).is_ok() {
        totals::subtract(allocation.stack_id, allocation.size);
    }
}

pub fn current_tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}
