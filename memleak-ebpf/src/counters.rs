use memleak_common::Counter;

use crate::maps::COUNTERS;

/// Adds one to a health counter. Per-CPU slots, so no atomics are needed.
pub fn increment(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: the pointer is this CPU's slot, valid for this program run.
        unsafe { *slot += 1 };
    }
}
