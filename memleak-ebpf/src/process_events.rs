//! Events of the processes memleak follows, through `MAPPING_EVENTS`:
//! their mappings changing, their execs and forks, their new Python
//! stacks. Rare next to malloc and free; user space acts on each.

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::generated::bpf_ktime_get_ns,
};
use memleak_common::{Counter, MappingChange, MappingEvent};

use crate::{counters, maps::MAPPING_EVENTS};

/// Bytes waiting in the ring past which a mapping change wakes user
/// space: a quarter of it, so that a burst of changes is taken in long
/// before the ring fills.
const WAKE_AT_BYTES: u64 = 64 << 10;

/// Sends `event`, stamped now; a full ring is counted.
///
/// Only execs and forks wake user space at once: it acts on them as they
/// come. A change of a mapping waits for the next report, which takes in
/// the ring first, or for the ring to fill up to `WAKE_AT_BYTES`. Waking
/// a reader on another CPU cost the changing call 8 µs here (an IPI,
/// which a VM traps), where the call itself takes 1: programs that
/// mprotect or munmap often paid it on every call.
pub fn send(event: MappingEvent) {
    let event = stamped(event);
    let acted_on_at_once = matches!(
        MappingChange::try_from(event.change),
        Ok(MappingChange::Exec | MappingChange::Launched | MappingChange::Fork | MappingChange::LoaderReady)
    );
    let wake = if acted_on_at_once || MAPPING_EVENTS.query(u64::from(BPF_RB_AVAIL_DATA)) >= WAKE_AT_BYTES {
        // Forced: after records sent without waking, the ring's own choice
        // (wake only a reader that has taken everything) would not wake.
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    if MAPPING_EVENTS.output::<MappingEvent>(&event, u64::from(wake)).is_err() {
        counters::increment(event.tgid, Counter::EventsLost);
    }
}

/// `event`, stamped now.
pub fn stamped(mut event: MappingEvent) -> MappingEvent {
    // SAFETY: a helper without arguments.
    event.timestamp_ns = unsafe { bpf_ktime_get_ns() };
    event
}
