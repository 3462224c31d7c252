//! Per-stack totals, kept in BPF so that a report reads one entry per
//! stack instead of one per allocation: what each stack holds now, and
//! what it allocated since attach. Updated with atomic adds: many threads
//! of the target allocate from the same stack at once.

use aya_ebpf::bindings::BPF_NOEXIST;
use memleak_common::StackTotals;

use crate::maps::STACK_TOTALS;

/// Adds an allocation of `size` bytes to its stack, `replaced` of them
/// standing in for bytes from before the attach.
pub fn add(stack_id: u64, size: u64, replaced: u64) {
    update(stack_id, size, 1, replaced, true);
}

/// Takes an allocation of `size` bytes off its stack.
pub fn subtract(stack_id: u64, size: u64, replaced: u64) {
    update(stack_id, size.wrapping_neg(), 1u64.wrapping_neg(), replaced.wrapping_neg(), false);
}

/// Adds to the outstanding amounts, and for a new allocation to the
/// amounts ever allocated too: the same cache line, two more adds, and
/// two for a block that replaces one from before the attach.
fn update(stack_id: u64, bytes: u64, allocations: u64, replaced: u64, allocated: bool) {
    let totals = if let Some(totals) = STACK_TOTALS.get_ptr_mut(stack_id) {
        totals
    } else {
        // First allocation from this stack. Another CPU may insert it at
        // the same moment; NOEXIST keeps whichever came first.
        let _ = STACK_TOTALS.insert(stack_id, StackTotals::default(), u64::from(BPF_NOEXIST));
        match STACK_TOTALS.get_ptr_mut(stack_id) {
            Some(totals) => totals,
            None => return,
        }
    };
    // SAFETY: `totals` points at a live map value, 8-byte aligned, and
    // atomic adds are the only writes to it.
    unsafe {
        atomic_add(&raw mut (*totals).bytes, bytes);
        atomic_add(&raw mut (*totals).allocations, allocations);
        if allocated {
            atomic_add(&raw mut (*totals).allocated_bytes, bytes);
            atomic_add(&raw mut (*totals).allocated_count, 1);
        }
        if replaced != 0 {
            atomic_add(&raw mut (*totals).replacing_bytes, replaced);
            atomic_add(&raw mut (*totals).replacing_allocations, allocations);
            if !allocated {
                // Released (`replaced` is negative here): the stack's next
                // block takes its place.
                atomic_add(&raw mut (*totals).replacement_owed, replaced.wrapping_neg());
            }
        }
    }
}

/// Takes up to `size` bytes of what stack `stack_id` owes
/// (`StackTotals::replacement_owed`) for a new block; returns them.
pub fn take_replacement(stack_id: u64, size: u64) -> u64 {
    let Some(totals) = STACK_TOTALS.get_ptr_mut(stack_id) else { return 0 };
    // SAFETY: a live map value, 8-byte aligned; a torn read is impossible
    // for an aligned u64, and a stale one only moves bytes between blocks.
    let owed = unsafe { core::ptr::read_volatile(&raw const (*totals).replacement_owed) } as i64;
    if owed <= 0 {
        return 0;
    }
    let taken = size.min(owed as u64);
    // SAFETY: as above.
    unsafe { atomic_add(&raw mut (*totals).replacement_owed, taken.wrapping_neg()) };
    taken
}

/// `*target += value`, atomically, giving the old value (`BPF_ATOMIC` |
/// `BPF_ADD` | `BPF_FETCH`, Linux 5.12).
///
/// # Safety
/// `target` must be valid for writes and 8-byte aligned.
pub unsafe fn atomic_fetch_add(target: *mut u64, value: u64) -> u64 {
    let mut value = value;
    // SAFETY: guaranteed by the caller.
    unsafe {
        core::arch::asm!("{0} = atomic_fetch_add((u64 *)({1} + 0), {0})", inout(reg) value, in(reg) target);
    };
    value
}

/// `*target += value`, atomically (`BPF_ATOMIC` | `BPF_ADD`, which every
/// kernel with BPF supports). Wrapping, so that adding `x.wrapping_neg()`
/// subtracts `x`.
///
/// # Safety
/// `target` must be valid for writes and 8-byte aligned.
pub unsafe fn atomic_add(target: *mut u64, value: u64) {
    // SAFETY: guaranteed by the caller.
    unsafe { core::arch::asm!("lock *(u64 *)({0} + 0) += {1}", in(reg) target, in(reg) value) };
}
