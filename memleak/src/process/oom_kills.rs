//! Which processes the OOM killer killed, as the kernel says it in its
//! log: `Killed process PID (COMMAND) total-vm:…kB, anon-rss:…kB, …`,
//! from the system-wide killer and a memory cgroup's alike, in every
//! kernel memleak runs on, cgroup v1 or v2. Read from `/dev/kmsg`, from
//! where it stood when memleak opened it: no program is loaded for it,
//! and the line names the victim by its pid in the host's namespace, as
//! memleak names processes. The kernel logs it before the victim gets its
//! SIGKILL, so it is there to read when the victim's exit is seen.

use std::{
    fs::File,
    io::{self, Read as _},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
};

/// A process the OOM killer killed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Victim {
    pub pid: u32,
    /// Its command name, as the kernel keeps it (15 bytes at most).
    pub command: String,
    /// Its anonymous resident memory when it was killed.
    pub anon_rss_bytes: u64,
}

/// The kernel's log, read from where it stood at `open`.
pub struct OomKills {
    log: Option<File>,
}

/// A record of /dev/kmsg is one line of at most this (`LOG_LINE_MAX`
/// and its prefix); a read returns one record.
const RECORD_MAX: usize = 8192;

impl OomKills {
    /// Opens the kernel's log, past what it holds already. Without it (no
    /// privilege, or a container without /dev/kmsg), no kill is seen, as
    /// the error says.
    pub fn open() -> Result<Self, io::Error> {
        let log = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg")?;
        // SAFETY: lseek on a descriptor the File owns; /dev/kmsg takes
        // SEEK_END to mean "after the last record".
        if unsafe { libc::lseek(log.as_raw_fd(), 0, libc::SEEK_END) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { log: Some(log) })
    }

    /// Sees no kill: for a daemon that could not open the log.
    pub fn none() -> Self {
        Self { log: None }
    }

    /// The kills logged since the last call.
    pub fn drain(&mut self) -> Vec<Victim> {
        let Some(log) = self.log.as_mut() else { return Vec::new() };
        let mut victims = Vec::new();
        let mut record = vec![0u8; RECORD_MAX];
        loop {
            match log.read(&mut record) {
                Ok(0) => break,
                Ok(length) => {
                    if let Some(victim) = parse(&String::from_utf8_lossy(&record[..length])) {
                        victims.push(victim);
                    }
                }
                // Records overwritten before they were read: the next
                // read goes on from the oldest kept.
                Err(error) if error.raw_os_error() == Some(libc::EPIPE) => {}
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                Err(error) => {
                    log::warn!("OOM kills are no longer seen: cannot read /dev/kmsg: {error}");
                    self.log = None;
                    break;
                }
            }
        }
        victims
    }
}

/// The victim a record of the log names, if it is an OOM kill's:
/// `6,1234,5678,-;Memory cgroup out of memory: Killed process 42 (growth)
/// total-vm:60000kB, anon-rss:49000kB, file-rss:1000kB, …`.
fn parse(record: &str) -> Option<Victim> {
    let message = record.split_once(';').map_or(record, |(_, message)| message);
    let line = message.lines().next()?;
    let after = &line[line.find("Killed process ")? + "Killed process ".len()..];
    let (pid, rest) = after.split_once(' ')?;
    let pid = pid.parse().ok()?;
    // The command is in parentheses, and may itself hold some.
    let rest = rest.strip_prefix('(')?;
    let end = rest.rfind(") total-vm:").or_else(|| rest.rfind(')'))?;
    let command = rest[..end].to_owned();
    let anon_rss_bytes = rest[end..]
        .split_once("anon-rss:")
        .and_then(|(_, figure)| figure.split_once("kB"))
        .and_then(|(kilobytes, _)| kilobytes.trim().parse::<u64>().ok())
        .map_or(0, |kilobytes| kilobytes * 1024);
    Some(Victim { pid, command, anon_rss_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_cgroup_s_kill_names_its_victim() {
        let record = "3,2718,91827364,-;Memory cgroup out of memory: Killed process 4242 (growth) \
                      total-vm:70244kB, anon-rss:49152kB, file-rss:1280kB, shmem-rss:0kB, UID:0 pgtables:160kB \
                      oom_score_adj:0\n SUBSYSTEM=memory\n";
        assert_eq!(
            parse(record),
            Some(Victim { pid: 4242, command: "growth".to_owned(), anon_rss_bytes: 49152 * 1024 })
        );
    }

    #[test]
    fn the_system_wide_killer_and_odd_commands_are_read_too() {
        let record =
            "3,7,1,-;Out of memory: Killed process 77 (a (b) c) total-vm:1kB, anon-rss:8kB, file-rss:0kB";
        assert_eq!(
            parse(record),
            Some(Victim { pid: 77, command: "a (b) c".to_owned(), anon_rss_bytes: 8192 })
        );
    }

    #[test]
    fn other_records_name_no_victim() {
        for record in [
            "6,1,1,-;oom_reaper: reaped process 4242 (growth), now anon-rss:0kB",
            "4,2,2,-;growth invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
            "6,3,3,-;Killed process",
            "",
        ] {
            assert_eq!(parse(record), None, "{record}");
        }
    }
}
