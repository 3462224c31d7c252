//! Each process's health counters, see `memleak_common::Counter`.

use aya_ebpf::bindings::BPF_NOEXIST;
use memleak_common::{Counter, ProcessCounters};

use crate::maps::PROCESS_COUNTERS;

/// Adds one to process `tgid`'s `counter`, in this CPU's copy, which
/// user space sums. Atomically even so: a uprobe program can be preempted
/// by another thread's run on the same CPU (see `scratch`). A function of its own, not inlined: at
/// each call site it tripled the verifier's time on the return probes.
#[inline(never)]
pub fn increment(tgid: u32, counter: Counter) {
    let counters = if let Some(counters) = PROCESS_COUNTERS.get_ptr_mut(tgid) {
        counters
    } else {
        // The process's first count anywhere.
        let _ = PROCESS_COUNTERS.insert(tgid, [0; _], u64::from(BPF_NOEXIST));
        match PROCESS_COUNTERS.get_ptr_mut(tgid) {
            Some(counters) => counters,
            None => return,
        }
    };
    // SAFETY: this CPU's copy of a live entry.
    let counters: &mut ProcessCounters = unsafe { &mut *counters };
    if let Some(slot) = counters.get_mut(counter as usize) {
        // SAFETY: a u64 of map memory, 8-byte aligned.
        unsafe { crate::totals::atomic_add(slot, 1) };
    }
}
