use aya_ebpf::{macros::uprobe, programs::ProbeContext};
use memleak_common::Counter;

use crate::{counters, maps::ALLOCATIONS};

/// free(ptr): forgets the allocation at `ptr`.
#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let address: u64 = ctx.arg(0).unwrap_or(0);
    release(address);
    0
}

/// Forgets the allocation at `address`, if it is one we recorded.
pub fn release(address: u64) {
    if address == 0 {
        return;
    }
    counters::increment(Counter::Frees);
    let _ = ALLOCATIONS.remove(address);
}
