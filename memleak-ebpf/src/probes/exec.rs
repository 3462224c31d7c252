//! A traced process that calls execve runs a new program: user space is
//! told, to close the old program's books and probe the new one.

use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};
use memleak_common::{MappingChange, MappingEvent};

use super::mmap::send;
use crate::{calls, maps::PROCESS_MAPPINGS};

/// `sched_process_exec`: fires in the process, its new program mapped.
#[btf_tracepoint(function = "sched_process_exec")]
pub fn sched_process_exec(_ctx: BtfTracePointContext) -> i32 {
    let tgid = calls::process_id();
    // Every process memleak traces has a table of its mappings; the old
    // one describes the old program, and must not walk the new one's
    // stacks.
    // SAFETY: only tested for presence, never read.
    if unsafe { PROCESS_MAPPINGS.get(tgid) }.is_none() {
        return 0;
    }
    let _ = PROCESS_MAPPINGS.remove(tgid);
    send(MappingEvent { tgid, change: MappingChange::Exec as u32, ..MappingEvent::default() });
    0
}
