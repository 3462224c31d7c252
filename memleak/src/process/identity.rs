//! Which process a pid names: a pid is reused once its process has gone,
//! so a process followed for long is known by its pid and its start time
//! together. Two processes with the same pid and different start times
//! are two processes, never one.

use std::{fs, io, os::fd::OwnedFd};

use super::lifecycle::{self, ProcessError};

/// A process as `memleak serve` keys it: its pid and when it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProcessKey {
    pub pid: u32,
    /// Clock ticks after boot at which it started: field 22 of
    /// /proc/PID/stat. An execve keeps it: the process is the same, its
    /// program new.
    pub start_time: u64,
}

impl ProcessKey {
    /// Process `pid` as it is now; `None` if it is gone.
    pub fn of(pid: u32) -> Option<Self> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(Self { pid, start_time: start_time(&stat)? })
    }
}

/// A process named by pid, held by a pidfd from memleak's first look at
/// it: its pid may be reused by another process once it exits, between
/// that look and the attach, but the pidfd stays the first process's.
#[derive(Debug)]
pub struct HeldProcess {
    pub key: ProcessKey,
    pidfd: OwnedFd,
}

impl HeldProcess {
    /// Holds process `pid` as it is now.
    pub fn hold(pid: u32) -> Result<Self, ProcessError> {
        let pidfd = lifecycle::pidfd_open(pid).map_err(|_| ProcessError::NoSuchProcess(pid))?;
        let key = ProcessKey::of(pid).ok_or(ProcessError::NoSuchProcess(pid))?;
        let held = Self { key, pidfd };
        // Still running after its start time was read: that was its own.
        held.check_same()?;
        Ok(held)
    }

    /// Whether the pid still names the process held: it has not exited
    /// (so its pid cannot have been given to another), and what runs as
    /// that pid started when it did. Checked after attaching to the pid,
    /// this proves that the attach reached the process held.
    pub fn check_same(&self) -> Result<(), ProcessError> {
        let pid = self.key.pid;
        let exited = has_exited(&self.pidfd).unwrap_or(true);
        match ProcessKey::of(pid) {
            Some(now) if now != self.key => Err(ProcessError::Replaced(pid)),
            Some(_) if !exited => Ok(()),
            _ => Err(ProcessError::ExitedBeforeAttach(pid)),
        }
    }
}

/// Whether the process of `pidfd` has exited: a pidfd polls readable then.
fn has_exited(pidfd: &OwnedFd) -> io::Result<bool> {
    use std::os::fd::AsRawFd as _;
    let mut poll = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, valid for the call; a zero timeout does not block.
    match unsafe { libc::poll(&raw mut poll, 1, 0) } {
        0 => Ok(false),
        1.. => Ok(poll.revents & libc::POLLIN != 0),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The start time in a /proc/PID/stat line. The command name (field 2)
/// is in parentheses and may itself hold spaces and parentheses, so the
/// fields are counted from after its last `)`.
fn start_time(stat: &str) -> Option<u64> {
    let (_, after_name) = stat.rsplit_once(") ")?;
    // after_name starts at field 3 (state): field 22 is the 20th from it.
    after_name.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stat line of pid 4242, named `name`, started at `start` ticks.
    fn stat_line(name: &str, start: u64) -> String {
        format!(
            "4242 ({name}) S 1 4242 4242 0 -1 4194560 130 0 0 0 0 0 0 0 20 0 1 0 {start} 2498560 193 \
             18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0"
        )
    }

    #[test]
    fn the_start_time_is_field_22_whatever_the_name_holds() {
        assert_eq!(start_time(&stat_line("leaker", 123_456)), Some(123_456));
        assert_eq!(start_time(&stat_line("a) b (c) 0 0", 77)), Some(77), "a name with ') ' in it");
        assert_eq!(start_time("4242 (cut"), None);
        assert_eq!(start_time(&stat_line("x", 1)[..40]), None, "a line cut short");
    }

    #[test]
    fn a_reused_pid_is_another_process() {
        let first = ProcessKey { pid: 4242, start_time: start_time(&stat_line("leaker", 100)).unwrap() };
        let reused = ProcessKey { pid: 4242, start_time: start_time(&stat_line("leaker", 9_000)).unwrap() };
        assert_ne!(first, reused, "same pid, same program, a later start: a new process");
        let again = ProcessKey { pid: 4242, start_time: start_time(&stat_line("leaker", 100)).unwrap() };
        assert_eq!(first, again, "the same process read twice");
        let mut keys = std::collections::BTreeMap::new();
        keys.insert(first, "old");
        keys.insert(reused, "new");
        assert_eq!(keys.len(), 2, "kept apart, never merged");
    }

    /// A `sleep 60` with pid `pid` if one can be made: the kernel gives
    /// the pid after `ns_last_pid` to the next fork, unless another fork
    /// of the machine's takes it first; then again.
    fn impostor_with_pid(pid: u32) -> Option<std::process::Child> {
        for _ in 0..200 {
            fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
            let mut child = std::process::Command::new("sleep").arg("60").spawn().ok()?;
            if child.id() == pid {
                return Some(child);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        None
    }

    #[test]
    fn a_process_held_stays_itself_and_a_pid_reused_is_refused() {
        let mut first = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = first.id();
        let held = HeldProcess::hold(pid).unwrap();
        held.check_same().expect("the same process, still running");
        first.kill().unwrap();
        first.wait().unwrap();
        assert!(matches!(held.check_same(), Err(ProcessError::ExitedBeforeAttach(p)) if p == pid));
        // Start times count in ticks of 10 ms: an impostor started in the
        // same tick has the same start time, and is refused by the pidfd
        // alone, as exited. Past that tick it is named for what it is.
        std::thread::sleep(std::time::Duration::from_millis(30));
        // The pid given to another process: the one that attaching to the
        // pid would reach.
        // Plain `cargo test` runs without privileges; the end-to-end test
        // of pid reuse (tests/robustness.rs) runs as root.
        let Some(mut impostor) = impostor_with_pid(pid) else {
            // SAFETY: geteuid has no preconditions.
            let euid = unsafe { libc::geteuid() };
            assert_ne!(euid, 0, "root can make a process with pid {pid}");
            return;
        };
        let checked = held.check_same();
        impostor.kill().unwrap();
        impostor.wait().unwrap();
        assert!(matches!(checked, Err(ProcessError::Replaced(p)) if p == pid), "{checked:?}");
        assert_eq!(
            checked.unwrap_err().to_string(),
            format!(
                "pid {pid} exited before memleak attached to it, and another process has its pid now: \
                 that one is not traced"
            )
        );
    }

    #[test]
    fn this_process_has_a_key_that_stays_the_same() {
        let pid = std::process::id();
        let key = ProcessKey::of(pid).expect("this process's stat");
        assert_eq!(key.pid, pid);
        assert!(key.start_time > 0);
        assert_eq!(ProcessKey::of(pid), Some(key));
        assert_eq!(ProcessKey::of(u32::MAX), None);
    }
}
