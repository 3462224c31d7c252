//! The kernel's own count of the time BPF programs run: what
//! `kernel.bpf_stats_enabled` turns on, read per program from the fdinfo
//! of the programs a process holds (bpftool's `run_time_ns` and
//! `run_cnt`).

use std::{
    collections::BTreeMap,
    os::fd::{FromRawFd as _, OwnedFd},
};

use anyhow::{bail, Context as _, Result};

/// The kernel counts run time while this lives.
///
/// `BPF_ENABLE_STATS` turns on the same counting as the sysctl
/// `kernel.bpf_stats_enabled=1`, but for as long as its descriptor is
/// open: the count stops when the bench ends, however it ends, and the
/// sysctl is left as it was for whoever else on the machine set it.
pub struct StatsEnabled {
    _fd: OwnedFd,
}

const BPF_ENABLE_STATS: libc::c_long = 32;
const BPF_STATS_RUN_TIME: u32 = 0;

impl StatsEnabled {
    pub fn new() -> Result<Self> {
        // `union bpf_attr`'s `enable_stats`: the kind of stats alone.
        let kind: u32 = BPF_STATS_RUN_TIME;
        // SAFETY: the attribute outlives the call; the size passed is its.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_ENABLE_STATS, &raw const kind, size_of::<u32>()) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("cannot enable BPF run-time stats");
        }
        let Ok(fd) = i32::try_from(fd) else { bail!("BPF_ENABLE_STATS gave fd {fd}") };
        // SAFETY: the kernel just gave us this fd, and nothing else owns it.
        Ok(Self { _fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }
}

/// Run time and runs, summed over programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunTime {
    pub ns: u64,
    pub runs: u64,
}

impl RunTime {
    /// What ran between `earlier` and this.
    pub fn since(self, earlier: Self) -> Self {
        Self { ns: self.ns.saturating_sub(earlier.ns), runs: self.runs.saturating_sub(earlier.runs) }
    }
}

/// The run time so far of every uprobe program process `pid` holds open,
/// each counted once however many descriptors it has. Its other programs
/// (memleak's on exec and fork tracepoints) run for every process on the
/// machine, not for the one traced.
pub fn uprobes_of_process(pid: u32) -> Result<RunTime> {
    let directory = format!("/proc/{pid}/fdinfo");
    let entries = std::fs::read_dir(&directory).with_context(|| format!("cannot list {directory}"))?;
    // Fds closed while we look are simply skipped.
    let programs: BTreeMap<u64, RunTime> = entries
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .filter_map(|info| uprobe_run_time(&info))
        .collect();
    if programs.is_empty() {
        bail!("process {pid} holds no uprobe programs");
    }
    Ok(programs.values().fold(RunTime::default(), |sum, program| RunTime {
        ns: sum.ns + program.ns,
        runs: sum.runs + program.runs,
    }))
}

/// `BPF_PROG_TYPE_KPROBE`, which uprobe programs are too.
const PROG_TYPE_KPROBE: u64 = 2;

/// A uprobe program's id and run time from its fd's fdinfo; `None` for any
/// other program, or other kind of fd (a link's has a `prog_id` but no run
/// time).
fn uprobe_run_time(fdinfo: &str) -> Option<(u64, RunTime)> {
    let field = |name: &str| -> Option<u64> {
        fdinfo.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
    };
    if field("prog_type")? != PROG_TYPE_KPROBE {
        return None;
    }
    Some((field("prog_id")?, RunTime { ns: field("run_time_ns")?, runs: field("run_cnt")? }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_uprobe_programs_fdinfo_and_skips_others() {
        // As Linux 6.18 writes them for memleak's malloc return probe and
        // the multi-uprobe link that runs it.
        let program = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t2077\nprog_type:\t2\nprog_jited:\t1\n\
                       prog_tag:\t9b2d1a4c0c0b1d3e\nmemlock:\t8192\nprog_id:\t138282\nrun_time_ns:\t237610099\n\
                       run_cnt:\t100002\nrecursion_misses:\t0\nverified_insns:\t1630\n";
        let link = "pos:\t0\nflags:\t02000000\nmnt_id:\t16\nino:\t2077\nlink_type:\tuprobe_multi\n\
                    link_id:\t901\nprog_tag:\t9b2d1a4c0c0b1d3e\nprog_id:\t138282\n";
        let tracepoint = "pos:\t0\nflags:\t02000002\nprog_type:\t17\nprog_jited:\t1\nprog_id:\t138294\n\
                          run_time_ns:\t5000\nrun_cnt:\t40\n";
        assert_eq!(uprobe_run_time(program), Some((138_282, RunTime { ns: 237_610_099, runs: 100_002 })));
        assert_eq!(uprobe_run_time(link), None);
        assert_eq!(uprobe_run_time(tracepoint), None, "a raw tracepoint's program counted as a uprobe's");
    }

    #[test]
    fn a_difference_never_goes_below_zero() {
        let later = RunTime { ns: 5_000, runs: 3 };
        assert_eq!(later.since(RunTime { ns: 1_000, runs: 1 }), RunTime { ns: 4_000, runs: 2 });
        assert_eq!(RunTime::default().since(later), RunTime::default());
    }
}
