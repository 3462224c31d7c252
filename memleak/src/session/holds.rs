//! Newcomers held at their execve. BPF stops a process that a name or
//! cgroup followed selects with `SIGSTOP` as it calls execve, before its
//! first instruction (see `memleak_common::ExecHold`), and user space
//! continues it once its probes are in: what it allocates from its first
//! instruction on is counted. A program's first run under memleak has no
//! plan yet, and its allocator is not mapped at its execve: it is stopped
//! again at its dynamic loader's breakpoint, `_dl_debug_state`, which the
//! loader calls once it has mapped the program's libraries and before it
//! runs any of their code.

use std::{collections::HashMap, path::PathBuf};

use aya::programs::uprobe::UProbeLinkId;
use memleak_common::{ExecHold, HeldCgroup, CGROUP_LEVEL_UNKNOWN, MAX_HELD_NAMES};

use super::{Session, SessionError};
use crate::{
    attach::kernel_btf,
    elf,
    process::{cgroup::Cgroup, link_map::LOADER_HOOK},
};

/// Set to anything, no process is held: newcomers are found as they run,
/// and what they allocate before their probes are in is missed.
pub const NO_EXEC_HOLD: &str = "MEMLEAK_NO_EXEC_HOLD";

/// A process BPF stopped: continued when dropped, on every path out of
/// its handling, memleak's own exit included.
#[derive(Debug)]
struct Stopped(u32);

impl Drop for Stopped {
    fn drop(&mut self) {
        let Ok(pid) = libc::pid_t::try_from(self.0) else { return };
        // SAFETY: kill takes plain integers. A process that has exited
        // since is ESRCH, and nothing else can be done.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
}

/// The held processes and the probes that stop them at their loader.
#[derive(Debug, Default)]
pub(super) struct ExecHolds {
    /// Whether BPF holds newcomers at all.
    pub(super) enabled: bool,
    stopped: HashMap<u32, Stopped>,
    at_loader: HashMap<u32, UProbeLinkId>,
    /// The cgroups BPF holds the newcomers of, as last written.
    cgroups: Vec<HeldCgroup>,
}

impl ExecHolds {
    /// Takes in that BPF stopped process `pid`.
    pub(super) fn stopped(&mut self, pid: u32) {
        self.stopped.insert(pid, Stopped(pid));
    }

    /// Whether BPF stopped process `pid` and it is not continued yet.
    pub(super) fn is_stopped(&self, pid: u32) -> bool {
        self.stopped.contains_key(&pid)
    }

    /// The processes held, or to be stopped again at their loader: taken
    /// in by the events of their execve and their loader, never by a look.
    pub(super) fn pending(&self) -> impl Iterator<Item = u32> + '_ {
        self.stopped.keys().chain(self.at_loader.keys()).copied()
    }

    /// Continues every process held.
    pub(super) fn continue_all(&mut self) {
        self.stopped.clear();
    }
}

/// What BPF checks to hold the processes started under `names` (each
/// cut to the 15 bytes the kernel keeps) and those of the cgroups later
/// given to `Session::hold_cgroups`; disabled without `newcomer_execs`
/// (no execve is reported), by `NO_EXEC_HOLD`, or when the kernel's
/// layout cannot be read.
pub(super) fn exec_hold(newcomer_execs: bool, names: &[String]) -> ExecHold {
    if !newcomer_execs || std::env::var_os(NO_EXEC_HOLD).is_some() {
        return ExecHold::default();
    }
    let offsets = kernel_btf::member_offsets(
        std::path::Path::new(kernel_btf::VMLINUX_BTF),
        [
            ("task_struct", "signal"),
            ("signal_struct", "tty"),
            ("task_struct", "real_parent"),
            ("task_struct", "tgid"),
        ],
    );
    let [task_signal, signal_tty, task_real_parent, task_tgid] = match offsets {
        Ok(offsets) => offsets,
        Err(error) => {
            log::warn!("newcomers are not held at their execve, the kernel's task layout unread: {error}");
            return ExecHold::default();
        }
    };
    let mut hold =
        ExecHold { enabled: 1, task_signal, signal_tty, task_real_parent, task_tgid, ..ExecHold::default() };
    for (slot, name) in hold.names.iter_mut().zip(names) {
        let kept = &name.as_bytes()[..name.len().min(slot.len() - 1)];
        slot[..kept.len()].copy_from_slice(kept);
    }
    if names.len() > MAX_HELD_NAMES {
        log::warn!(
            "only the first {MAX_HELD_NAMES} --exe names are held at their execve: the processes of the others \
             are found as they run"
        );
    }
    hold
}

impl Session {
    /// Has BPF hold the newcomers of the cgroups followed, at the ids
    /// they have now (a container restarted has a new cgroup at the same
    /// path). Called at each look through /proc.
    pub(super) fn hold_cgroups(&mut self) {
        if !self.holds.enabled {
            return;
        }
        let cgroups: Vec<HeldCgroup> = self.cgroups.iter().map(held_cgroup).collect();
        if cgroups == self.holds.cgroups {
            return;
        }
        match self.tracer.hold_cgroups(&cgroups) {
            Ok(()) => self.holds.cgroups = cgroups,
            Err(error) => log::debug!("cannot hold the newcomers of the cgroups followed: {error}"),
        }
    }

    /// Done with held process `pid`: taken in or not, it runs on. One
    /// whose allocator was not mapped yet is stopped again at its
    /// loader's breakpoint, to be taken in there.
    pub(super) fn release(&mut self, pid: u32, taken_in: bool) {
        let Some(stopped) = self.holds.stopped.remove(&pid) else { return };
        if taken_in {
            self.stop_no_more_at_loader(pid);
        } else if self.loading.contains_key(&pid) && !self.holds.at_loader.contains_key(&pid) {
            match self.stop_at_loader(pid) {
                Ok(Some(link)) => {
                    log::debug!("pid {pid}: its libraries not mapped yet, stopped again at its loader's");
                    self.holds.at_loader.insert(pid, link);
                }
                Ok(None) => {
                    log::debug!("pid {pid}: its loader has no {LOADER_HOOK}: planned as it loads");
                }
                Err(error) => {
                    log::debug!("pid {pid}: not stopped at its loader, planned as it loads: {error}");
                }
            }
        }
        drop(stopped);
    }

    /// Continues the held processes whose events were handled: those
    /// not waiting in a queue of `next_event` (a newcomer to take in, a
    /// target's exec to report). The exec of a target is continued by
    /// `restart_target` or `adopt` once its new program is probed, and
    /// here if neither took it.
    pub(super) fn release_handled(&mut self) {
        let handled: Vec<u32> = self
            .holds
            .stopped
            .keys()
            .copied()
            .filter(|pid| !self.launched.contains(pid) && !self.execs.contains(pid))
            .collect();
        for pid in handled {
            self.release(pid, false);
        }
    }

    /// Takes out the loader probes of the processes no longer loading.
    pub(super) fn stop_no_more_at_loaders(&mut self) {
        let done: Vec<u32> =
            self.holds.at_loader.keys().copied().filter(|pid| !self.loading.contains_key(pid)).collect();
        for pid in done {
            self.stop_no_more_at_loader(pid);
        }
    }

    fn stop_no_more_at_loader(&mut self, pid: u32) {
        if let Some(link) = self.holds.at_loader.remove(&pid) {
            self.tracer.remove_loader_stop(link);
        }
    }

    /// Probes process `pid`'s loader breakpoint, if its loader has one.
    fn stop_at_loader(&mut self, pid: u32) -> Result<Option<UProbeLinkId>, SessionError> {
        let Some((loader, offset)) = loader_breakpoint(pid) else { return Ok(None) };
        Ok(Some(self.tracer.stop_at_loader(&loader, offset, super::nonzero(pid))?))
    }
}

/// A followed cgroup as BPF checks it, at the id its path has now.
fn held_cgroup(cgroup: &Cgroup) -> HeldCgroup {
    HeldCgroup {
        id: cgroup.id_now().unwrap_or(cgroup.id),
        level: cgroup.level.unwrap_or(CGROUP_LEVEL_UNKNOWN),
        _padding: 0,
    }
}

/// The file of process `pid`'s dynamic loader, as the process sees it,
/// and the file offset of its breakpoint function.
fn loader_breakpoint(pid: u32) -> Option<(PathBuf, u64)> {
    let interpreter = elf::interpreter_at(std::path::Path::new(&format!("/proc/{pid}/exe")))?;
    let loader = PathBuf::from(format!("/proc/{pid}/root{interpreter}"));
    let data = std::fs::read(&loader).ok()?;
    let parsed = object::File::parse(&*data).ok()?;
    let address = elf::dynamic_symbol(&parsed, LOADER_HOOK)?;
    Some((loader, elf::file_offset(&parsed, address)?))
}
