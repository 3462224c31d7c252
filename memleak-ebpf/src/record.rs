//! Recording and forgetting allocations: the core that the uprobes on an
//! allocator and the kernel tracepoints share. An allocation is one entry
//! in ALLOCATIONS plus its stack's totals; forgetting it takes both back.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated::bpf_ktime_get_ns};
use memleak_common::{Allocation, AllocationKey, Counter, REPLACEMENT_WINDOW_NS};

use crate::{
    counters,
    maps::{ALLOCATIONS, REPLACEABLE},
    totals::Totals,
    tunables,
};

/// The map helpers' "key exists" error.
const EEXIST: i32 = 17;

/// Records an allocation under `key`, with its stack.
pub fn store(key: AllocationKey, size: u64, stack_id: u64) {
    let totals = Totals::of(stack_id);
    // SAFETY: a helper without arguments.
    let timestamp_ns = unsafe { bpf_ktime_get_ns() };
    let replaced =
        if tunables::replacements() { replaced_by(&key, size, totals.as_ref(), timestamp_ns) } else { 0 };
    let allocation = Allocation { size, timestamp_ns, stack_id, replaced };
    // One map operation in the common case. Only when the address is
    // still recorded does it take more: the allocator handed it out again,
    // so its free was not seen (bcc's --wa-missing-free case) and the old
    // block comes off its stack's totals first (what it stood in for, its
    // stack owes: see `Totals::subtract`).
    let mut inserted = ALLOCATIONS.insert(key, allocation, u64::from(BPF_NOEXIST));
    if inserted == Err(-EEXIST) {
        let _ = forget(&key);
        inserted = ALLOCATIONS.insert(key, allocation, 0);
    }
    if inserted.is_err() {
        counters::increment(key.tgid, Counter::AllocationsNotTracked);
        return;
    }
    if let Some(totals) = totals {
        totals.add(size, allocation.replaced);
    }
}

/// A release of the block at `address` by process `tgid` (0: the kernel):
/// counted, and the allocation forgotten if it was recorded. Returns its
/// size then; a block memleak had not recorded is counted apart, unless
/// `allocators_own` says the allocator released a block of its own. A
/// block allocated at its address soon after takes its place.
pub fn release(tgid: u32, address: u64, allocators_own: impl FnOnce() -> bool) -> Option<u64> {
    if address == 0 {
        return None;
    }
    counters::increment(tgid, Counter::Frees);
    let key = AllocationKey { tgid, _padding: 0, address };
    let size = forget(&key).map(|allocation| allocation.size);
    if size.is_none() && !allocators_own() {
        counters::increment(tgid, Counter::UnrecordedFrees);
        remember_unrecorded(&key);
    }
    size
}

/// The release of realloc's old block, as `release`, but a block memleak
/// had not recorded leaves nothing for a new block to replace: its size
/// is unknown, and the block realloc returns is that same memory resized.
pub fn release_resized(tgid: u32, address: u64) {
    if address == 0 {
        return;
    }
    counters::increment(tgid, Counter::Frees);
    if forget(&AllocationKey { tgid, _padding: 0, address }).is_none() {
        counters::increment(tgid, Counter::UnrecordedFrees);
    }
}

/// A release that an outer one has counted already (see
/// `calls::Release::InsideDelete`): it counts only if the block is
/// recorded, as it is if it was allocated again and recorded since the
/// outer release.
pub fn release_if_recorded(tgid: u32, address: u64) -> Option<u64> {
    let allocation = forget(&AllocationKey { tgid, _padding: 0, address })?;
    counters::increment(tgid, Counter::Frees);
    Some(allocation.size)
}

/// The size of the block at `address` of process `tgid`, if it is
/// recorded.
pub fn recorded_size(tgid: u32, address: u64) -> Option<u64> {
    let allocation = ALLOCATIONS.get_ptr(AllocationKey { tgid, _padding: 0, address })?;
    // SAFETY: a live entry, read once.
    Some(unsafe { (*allocation).size })
}

/// Removes a recorded allocation, takes it off its stack's totals and
/// returns it.
fn forget(key: &AllocationKey) -> Option<Allocation> {
    let allocation = ALLOCATIONS.get_ptr(key)?;
    // SAFETY: a live entry; copied out before the entry is removed.
    let allocation = unsafe { *allocation };
    // Only the caller that really removed it updates the totals, so a block
    // freed twice at once is not subtracted twice.
    ALLOCATIONS.remove(key).ok()?;
    if let Some(totals) = Totals::find(allocation.stack_id) {
        totals.subtract(allocation.size, allocation.replaced);
    }
    Some(allocation)
}

/// Remembers that the block at `key`, which memleak never saw allocated,
/// was released: a block allocated at its address soon after takes its
/// place.
fn remember_unrecorded(key: &AllocationKey) {
    if !tunables::replacements() {
        return;
    }
    // SAFETY: a helper without arguments.
    let released_ns = unsafe { bpf_ktime_get_ns() };
    let _ = REPLACEABLE.insert(key, released_ns, 0);
}

/// The bytes from before the attach that a block of `size` bytes,
/// allocated at `key` at `now_ns` by the stack of `totals`, takes the
/// place of, at most `size`; 0 for new memory. Either the block took the
/// address of one memleak never saw allocated, released within
/// `REPLACEMENT_WINDOW_NS`, or its stack released a block that replaced
/// one and has not made up for it yet (see `Totals::take_replacement`).
fn replaced_by(key: &AllocationKey, size: u64, totals: Option<&Totals>, now_ns: u64) -> u64 {
    // SAFETY: a lookup in a map of plain values, copied out.
    if let Some(released_ns) = unsafe { REPLACEABLE.get(key) }.copied() {
        let _ = REPLACEABLE.remove(key);
        // Its size is unknown: the whole new block stands in for it.
        if now_ns.wrapping_sub(released_ns) <= REPLACEMENT_WINDOW_NS {
            return size;
        }
    }
    totals.map_or(0, |totals| totals.take_replacement(size))
}
