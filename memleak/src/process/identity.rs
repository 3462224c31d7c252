//! Which process a pid names: a pid is reused once its process has gone,
//! so a process followed for long is known by its pid and its start time
//! together. Two processes with the same pid and different start times
//! are two processes, never one.

use std::fs;

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
