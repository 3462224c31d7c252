//! Each process's health counters, see `memleak_common::Counter`.

use aya_ebpf::bindings::BPF_NOEXIST;
use memleak_common::{Counter, ProcessCounters};

use crate::{maps::PROCESS_COUNTERS, totals::atomic_add};

/// Adds one to process `tgid`'s `counter`. Atomic: the process's threads
/// count on several CPUs at once.
#[inline(never)]
pub fn increment(tgid: u32, counter: Counter) {
    let counters = if let Some(counters) = PROCESS_COUNTERS.get_ptr_mut(tgid) {
        counters
    } else {
        // The process's first count; NOEXIST keeps whichever CPU came first.
        let _ = PROCESS_COUNTERS.insert(tgid, [0; _], u64::from(BPF_NOEXIST));
        match PROCESS_COUNTERS.get_ptr_mut(tgid) {
            Some(counters) => counters,
            None => return,
        }
    };
    // SAFETY: a live map value, 8-byte aligned, written only by atomic adds.
    let counters: &mut ProcessCounters = unsafe { &mut *counters };
    if let Some(slot) = counters.get_mut(counter as usize) {
        // SAFETY: as above.
        unsafe { atomic_add(slot, 1) };
    }
}
