//! --trace: one event per allocation and free, for user space to print.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, generated::bpf_ktime_get_ns};
use memleak_common::{Counter, TraceEvent};

use crate::{counters, maps::EVENTS, tunables};

/// Sends an event if --trace asked for them; a full ring buffer is counted.
pub fn send(function: u32, address: u64, size: u64) {
    if !tunables::trace() {
        return;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let event = TraceEvent {
        // SAFETY: a helper without arguments.
        timestamp_ns: unsafe { bpf_ktime_get_ns() },
        address,
        size,
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        function,
        _padding: 0,
    };
    if EVENTS.output::<TraceEvent>(&event, 0).is_err() {
        counters::increment(event.tgid, Counter::EventsLost);
    }
}
