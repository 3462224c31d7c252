//! Events of the processes memleak follows, through `MAPPING_EVENTS`:
//! their mappings changing, their execs and forks, their new Python
//! stacks. Rare next to malloc and free; user space acts on each.

use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use memleak_common::{Counter, MappingEvent};

use crate::{counters, maps::MAPPING_EVENTS};

/// Sends `event`, stamped now; a full ring is counted.
pub fn send(mut event: MappingEvent) {
    // SAFETY: a helper without arguments.
    event.timestamp_ns = unsafe { bpf_ktime_get_ns() };
    if MAPPING_EVENTS.output::<MappingEvent>(&event, 0).is_err() {
        counters::increment(event.tgid, Counter::EventsLost);
    }
}
