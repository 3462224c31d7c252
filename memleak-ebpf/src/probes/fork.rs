//! A followed process that forks has a new process to follow: its child
//! is followed too (and so its own children), and user space is told, to
//! plan and attach the child's probes.

use aya_ebpf::{helpers::bpf_probe_read_kernel, macros::btf_tracepoint, programs::BtfTracePointContext};
use memleak_common::{MappingChange, MappingEvent};

use crate::{
    calls,
    maps::{FOLLOWED, PY_PROCS},
    process_events::send,
    tunables,
};

/// `sched_process_fork(parent, child)`: fires in the parent, for new
/// threads as well as new processes.
#[btf_tracepoint(function = "sched_process_fork")]
pub fn sched_process_fork(ctx: BtfTracePointContext) -> i32 {
    let parent = calls::process_id();
    // SAFETY: only tested for presence, never read.
    if unsafe { FOLLOWED.get(parent) }.is_none() {
        return 0;
    }
    let child: u64 = ctx.arg(1);
    let tgid_field = (child + u64::from(tunables::task_tgid_offset())) as *const u32;
    // SAFETY: reads the child task's tgid at the offset user space found in
    // the kernel's BTF; a kernel read that fails cleanly on a bad address.
    let Ok(child_tgid) = (unsafe { bpf_probe_read_kernel(tgid_field) }) else { return 0 };
    // A new thread shares its parent's tgid; only a new process is news.
    if child_tgid == parent {
        return 0;
    }
    let _ = FOLLOWED.insert(child_tgid, 1, 0);
    // A forked interpreter is a copy of its parent's, at the same
    // addresses: its Python frames are walked from its first allocation,
    // before user space has looked at it (a gunicorn worker's).
    // SAFETY: the value of a live entry, copied at once.
    if let Some(config) = unsafe { PY_PROCS.get(parent) }.copied() {
        let _ = PY_PROCS.insert(child_tgid, config, 0);
    }
    send(MappingEvent {
        tgid: child_tgid,
        address: u64::from(parent),
        change: MappingChange::Fork as u32,
        ..MappingEvent::default()
    });
    0
}
