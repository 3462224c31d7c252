//! Per-stack totals, kept in BPF so that a report reads one entry per
//! stack instead of one per allocation: what each stack holds now, and
//! what it allocated since attach. Updated with atomic adds: many threads
//! of the target allocate from the same stack at once.

use aya_ebpf::bindings::BPF_NOEXIST;
use memleak_common::StackTotals;

use crate::maps::STACK_TOTALS;

/// Adds an allocation of `size` bytes to its stack.
pub fn add(stack_id: u64, size: u64) {
    update(stack_id, size, 1, true);
}

/// Takes an allocation of `size` bytes off its stack.
pub fn subtract(stack_id: u64, size: u64) {
    update(stack_id, size.wrapping_neg(), 1u64.wrapping_neg(), false);
}

/// Adds to the outstanding amounts, and for a new allocation to the
/// amounts ever allocated too: the same cache line, two more adds.
fn update(stack_id: u64, bytes: u64, allocations: u64, allocated: bool) {
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
    }
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
