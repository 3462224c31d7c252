//! Holding a newcomer at its execve: a process that `memleak serve`
//! follows by name or cgroup is stopped before its first instruction
//! (`SIGSTOP`), and user space sends `SIGCONT` once its probes are in.
//! Without the hold, what it allocates in its first milliseconds is
//! missed: user space hears of the execve only after the program runs.
//! See `memleak_common::ExecHold` for which processes are held.

use aya_ebpf::helpers::{
    bpf_get_current_comm, bpf_probe_read_kernel,
    generated::{bpf_get_current_task, bpf_send_signal},
};
use memleak_common::{MappingChange, MappingEvent, HELD, MAX_HELD_CGROUPS, MAX_HELD_NAMES};

use crate::{maps::HELD_CGROUPS, process_events, tunables};

/// The signal that holds a process.
const SIGSTOP: u32 = 19;

/// Whether the current process, which has just called execve, is one to
/// hold.
pub fn wanted() -> bool {
    if !tunables::holds_at_exec() {
        return false;
    }
    let [task_signal, signal_tty, task_real_parent, task_tgid] = tunables::hold_offsets();
    // SAFETY: a helper without arguments.
    let task = unsafe { bpf_get_current_task() };
    !may_be_a_job(task, task_signal, signal_tty)
        && !child_of_memleak(task, task_real_parent, task_tgid)
        && (named() || in_held_cgroup())
}

/// Sends `event` for the current process with `address` [`HELD`],
/// stopping the process first: stopped after user space had already
/// answered, it would never be continued. A full ring holds nothing.
pub fn send_held(tgid: u32, change: MappingChange) {
    let Some(mut entry) = crate::maps::MAPPING_EVENTS.reserve::<MappingEvent>(0) else {
        crate::counters::increment(tgid, memleak_common::Counter::EventsLost);
        return;
    };
    // SAFETY: a helper taking a plain integer; the signal is taken on
    // the way back to user space, before the next instruction there.
    let stopped = unsafe { bpf_send_signal(SIGSTOP) } == 0;
    let event = MappingEvent {
        tgid,
        change: change as u32,
        address: if stopped { HELD } else { 0 },
        ..MappingEvent::default()
    };
    entry.write(process_events::stamped(event));
    entry.submit(u64::from(aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP));
}

/// Whether the process has a controlling terminal: a job-control shell
/// may be waiting for it, and would report a stop as "Stopped" and take
/// the terminal back. Unreadable counts as having one.
fn may_be_a_job(task: u64, task_signal: u32, signal_tty: u32) -> bool {
    let Some(signal) = kernel_word(task + u64::from(task_signal)) else { return true };
    kernel_word(signal + u64::from(signal_tty)) != Some(0)
}

/// Whether memleak started the process (a `podman inspect` it waits
/// for): held, it would wait for memleak, and memleak for it.
fn child_of_memleak(task: u64, task_real_parent: u32, task_tgid: u32) -> bool {
    let Some(parent) = kernel_word(task + u64::from(task_real_parent)) else { return true };
    // SAFETY: a kernel read that fails cleanly on a bad address.
    let tgid = unsafe { bpf_probe_read_kernel((parent + u64::from(task_tgid)) as *const u32) };
    tgid.map_or(true, tunables::ignored_process)
}

/// Whether the process was started under one of the names held.
fn named() -> bool {
    let Ok(comm) = bpf_get_current_comm() else { return false };
    let comm = words(&comm);
    for index in 0..MAX_HELD_NAMES {
        let name = words(&tunables::held_name(index));
        if name == [0, 0] {
            return false;
        }
        if name == comm {
            return true;
        }
    }
    false
}

/// A 16-byte name as two words: two comparisons, no byte loop.
fn words(name: &[u8; 16]) -> [u64; 2] {
    let mut low = [0; 8];
    let mut high = [0; 8];
    low.copy_from_slice(&name[..8]);
    high.copy_from_slice(&name[8..]);
    [u64::from_ne_bytes(low), u64::from_ne_bytes(high)]
}

/// Whether the process is in one of the cgroups held or below one.
fn in_held_cgroup() -> bool {
    for index in 0..MAX_HELD_CGROUPS {
        let Some(cgroup) = HELD_CGROUPS.get(index) else { return false };
        if cgroup.id == 0 {
            return false;
        }
        if tunables::in_cgroup(cgroup.id, cgroup.level) {
            return true;
        }
    }
    false
}

/// The kernel's word at `address`, if it can be read.
fn kernel_word(address: u64) -> Option<u64> {
    // SAFETY: a kernel read that fails cleanly on a bad address.
    unsafe { bpf_probe_read_kernel(address as *const u64) }.ok()
}
