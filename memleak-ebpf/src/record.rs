//! Recording and forgetting allocations: the core that the uprobes on an
//! allocator and the kernel tracepoints share. An allocation is one entry
//! in ALLOCATIONS plus its stack's totals; forgetting it takes both back.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated::bpf_ktime_get_ns};
use memleak_common::{Allocation, AllocationKey, Counter};

use crate::{counters, maps::ALLOCATIONS, totals};

/// The map helpers' "key exists" error.
const EEXIST: i32 = 17;

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
    let mut inserted = ALLOCATIONS.insert(key, allocation, u64::from(BPF_NOEXIST));
    if inserted == Err(-EEXIST) {
        let _ = forget(&key);
        inserted = ALLOCATIONS.insert(key, allocation, 0);
    }
    if inserted.is_err() {
        counters::increment(key.tgid, Counter::AllocationsNotTracked);
        return;
    }
    totals::add(allocation.stack_id, size);
}

/// A release of the block at `address` by process `tgid` (0: the kernel):
/// counted, and the allocation forgotten if it was recorded. Returns its
/// size then; a block memleak had not recorded is counted apart, unless
/// `allocators_own` says the allocator released a block of its own.
pub fn release(tgid: u32, address: u64, allocators_own: impl FnOnce() -> bool) -> Option<u64> {
    if address == 0 {
        return None;
    }
    counters::increment(tgid, Counter::Frees);
    let size = forget(&AllocationKey { tgid, _padding: 0, address });
    if size.is_none() && !allocators_own() {
        counters::increment(tgid, Counter::UnrecordedFrees);
    }
    size
}

/// A release that an outer one has counted already (see
/// `calls::Release::InsideDelete`): it counts only if the block is
/// recorded, as it is if it was allocated again and recorded since the
/// outer release.
pub fn release_if_recorded(tgid: u32, address: u64) -> Option<u64> {
    let size = forget(&AllocationKey { tgid, _padding: 0, address })?;
    counters::increment(tgid, Counter::Frees);
    Some(size)
}

/// The size of the block at `address` of process `tgid`, if it is
/// recorded.
pub fn recorded_size(tgid: u32, address: u64) -> Option<u64> {
    let allocation = ALLOCATIONS.get_ptr(AllocationKey { tgid, _padding: 0, address })?;
    // SAFETY: a live entry, read once.
    Some(unsafe { (*allocation).size })
}

/// Removes a recorded allocation, takes it off its stack's totals and
/// returns its size.
fn forget(key: &AllocationKey) -> Option<u64> {
    let allocation = ALLOCATIONS.get_ptr(key)?;
    // SAFETY: a live entry; copied out before the entry is removed.
    let allocation = unsafe { *allocation };
    // Only the caller that really removed it updates the totals, so a block
    // freed twice at once is not subtracted twice.
    ALLOCATIONS.remove(key).ok()?;
    totals::subtract(allocation.stack_id, allocation.size);
    Some(allocation.size)
}
