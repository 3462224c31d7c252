//! A traced process that calls execve runs a new program: user space is
//! told, to close the old program's books and probe the new one. When
//! user space follows processes by executable or cgroup, the execs of
//! other processes are reported too: a newcomer is found as it starts,
//! not at the next look through /proc.

use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};
use memleak_common::{MappingChange, MappingEvent};

use crate::{
    calls, holds,
    maps::{PROCESS_MAPPINGS, PY_PROCS},
    process_events::send,
    tunables,
};

/// `sched_process_exec`: fires in the process, its new program mapped.
#[btf_tracepoint(function = "sched_process_exec")]
pub fn sched_process_exec(_ctx: BtfTracePointContext) -> i32 {
    let tgid = calls::process_id();
    // The new program's memory is no longer the interpreter that user
    // space checked: its Python frames wait until user space checks again.
    let _ = PY_PROCS.remove(tgid);
    // Every process memleak traces has a table of its mappings; the old
    // one describes the old program, and must not walk the new one's
    // stacks.
    // SAFETY: only tested for presence, never read.
    if unsafe { PROCESS_MAPPINGS.get(tgid) }.is_none() {
        // Rare next to allocations (a busy host execs hundreds of times a
        // second at most), and user space checks each against what it
        // follows. The hold's check is a first cut of that one (names,
        // cgroups), made here because the process must not run on first.
        if !tunables::newcomer_execs() {
            return 0;
        }
        if holds::wanted() {
            holds::send_held(tgid, MappingChange::Launched);
        } else {
            send(MappingEvent { tgid, change: MappingChange::Launched as u32, ..MappingEvent::default() });
        }
        return 0;
    }
    let _ = PROCESS_MAPPINGS.remove(tgid);
    // A followed process that runs a new program (a shell's `exec`) is
    // held as a newcomer is, until its new program is probed.
    if holds::wanted() {
        holds::send_held(tgid, MappingChange::Exec);
    } else {
        send(MappingEvent { tgid, change: MappingChange::Exec as u32, ..MappingEvent::default() });
    }
    0
}
