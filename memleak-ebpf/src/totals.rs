//! Per-stack totals, kept in BPF so that a report reads one entry per
//! stack instead of one per allocation: what each stack holds now, and
//! what it allocated since attach. Updated with atomic adds: many threads
//! of the target allocate from the same stack at once.

use aya_ebpf::bindings::BPF_NOEXIST;
use memleak_common::StackTotals;

use crate::maps::STACK_TOTALS;

/// One stack's entry in `STACK_TOTALS`.
pub struct Totals(*mut StackTotals);

impl Totals {
    /// The entry of stack `stack_id`, made if it is its first allocation.
    pub fn of(stack_id: u64) -> Option<Self> {
        if let Some(totals) = Self::find(stack_id) {
            return Some(totals);
        }
        // Another CPU may insert it at the same moment; NOEXIST keeps
        // whichever came first.
        let _ = STACK_TOTALS.insert(stack_id, StackTotals::default(), u64::from(BPF_NOEXIST));
        Self::find(stack_id)
    }

    /// The entry of stack `stack_id`, if it has one.
    pub fn find(stack_id: u64) -> Option<Self> {
        STACK_TOTALS.get_ptr_mut(stack_id).map(Self)
    }

    /// Adds an allocation of `size` bytes, `replaced` of them standing in
    /// for bytes from before the attach.
    pub fn add(&self, size: u64, replaced: u64) {
        self.update(size, 1, replaced, true);
    }

    /// Takes off an allocation of `size` bytes.
    pub fn subtract(&self, size: u64, replaced: u64) {
        self.update(size.wrapping_neg(), 1u64.wrapping_neg(), replaced.wrapping_neg(), false);
    }

    /// Takes up to `size` bytes of what the stack owes
    /// (`StackTotals::replacement_owed`) for a new block; returns them.
    pub fn take_replacement(&self, size: u64) -> u64 {
        let totals = self.0;
        // SAFETY: a live map value, 8-byte aligned, so never read torn; a
        // stale read only moves bytes between the stack's blocks.
        let owed = unsafe { core::ptr::read_volatile(&raw const (*totals).replacement_owed) } as i64;
        if owed <= 0 {
            return 0;
        }
        let taken = size.min(owed as u64);
        // SAFETY: as above.
        unsafe { atomic_add(&raw mut (*totals).replacement_owed, taken.wrapping_neg()) };
        taken
    }

    /// Adds to the outstanding amounts, and for a new allocation to the
    /// amounts ever allocated too: the same cache line, two more adds, and
    /// two for a block that replaces one from before the attach.
    fn update(&self, bytes: u64, allocations: u64, replaced: u64, allocated: bool) {
        let totals = self.0;
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
                    // Released (`replaced` is negative here): the stack's
                    // next block takes its place.
                    atomic_add(&raw mut (*totals).replacement_owed, replaced.wrapping_neg());
                }
            }
        }
    }
}

/// `*target += value`, atomically, giving the old value (`BPF_ATOMIC` |
/// `BPF_ADD` | `BPF_FETCH`, Linux 5.12).
///
/// # Safety
/// `target` must be valid for writes and 8-byte aligned.
#[cfg(not(feature = "legacy-kernels"))]
pub unsafe fn atomic_fetch_add(target: *mut u64, value: u64) -> u64 {
    let mut value = value;
    // SAFETY: guaranteed by the caller.
    unsafe {
        core::arch::asm!("{0} = atomic_fetch_add((u64 *)({1} + 0), {0})", inout(reg) value, in(reg) target);
    };
    value
}

/// The same for kernels before 5.12, which lack the instruction. Only
/// this CPU's own words are added to this way (`new_stack_id`), and those
/// kernels run tracing programs with preemption disabled: a load and a
/// store.
///
/// # Safety
/// `target` must be valid for writes and 8-byte aligned.
#[cfg(feature = "legacy-kernels")]
pub unsafe fn atomic_fetch_add(target: *mut u64, value: u64) -> u64 {
    // SAFETY: guaranteed by the caller.
    let was = unsafe { core::ptr::read_volatile(target) };
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(target, was.wrapping_add(value)) };
    was
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
