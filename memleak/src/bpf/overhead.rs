//! What memleak's probes cost the processes they are in, priced on this
//! machine: each call of a probed function traps into the kernel (twice
//! for an allocation, at its entry and its return), and runs a program.
//!
//! The traps are priced at start: empty programs are attached to a
//! function of memleak's own, for memleak alone, and the function is
//! called in a loop with none, with the entry probe, and with both; what
//! the calls cost more is the kernel's trap. The programs' own time is
//! the kernel's count (`BPF_ENABLE_STATS`, which memleak's daemon turns
//! on while it traces a process, if it may), per run, over memleak's
//! uprobe programs.
//! A process's probe hits are its calls memleak counted: so its estimate
//! is hits times those prices.

use std::{
    num::NonZeroU32,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
};

use aya::programs::{
    uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
    UProbe,
};
use memleak_common::programs;

use super::{Tracer, TracerError};
use crate::model::HealthCounters;

/// Calls timed per run, and runs whose median is kept.
const CALLS: u32 = 4_000;
const RUNS: usize = 5;

/// What a probe's trap costs a call on this machine, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrapCost {
    pub entry_ns: f64,
    pub return_ns: f64,
}

/// The prices of a probe hit: its trap, and what a run of memleak's
/// programs takes on average, when the kernel counts it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pricing {
    pub trap: TrapCost,
    pub bpf_ns_per_run: Option<f64>,
}

impl Pricing {
    /// What the probes cost a process whose calls memleak counted as
    /// `health` says, in seconds: each allocation call (returned or
    /// failed) traps at its entry and its return, each free at its entry,
    /// and each trap runs a program.
    pub fn seconds(&self, health: &HealthCounters) -> f64 {
        let calls = (health.allocations + health.failed_allocations) as f64;
        let entries = calls + health.frees as f64;
        let bpf_ns = self.bpf_ns_per_run.unwrap_or(0.0) * (entries + calls);
        (entries * self.trap.entry_ns + calls * self.trap.return_ns + bpf_ns) / 1e9
    }
}

// The function the calibration probes: memleak's own, called nowhere
// else, written out so that its first instruction is a nop. The kernel
// emulates a nop under a probe, as it does the instructions memleak
// places its probes on (see `attach::placement`); an instruction it
// single-steps instead costs about ten times as much.
#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".globl memleak_calibration_site",
    ".type memleak_calibration_site, @function",
    "memleak_calibration_site:",
    "nop",
    "lea rax, [rdi + 1]",
    "ret",
    ".size memleak_calibration_site, . - memleak_calibration_site",
);
#[cfg(target_arch = "aarch64")]
std::arch::global_asm!(
    ".globl memleak_calibration_site",
    ".type memleak_calibration_site, %function",
    "memleak_calibration_site:",
    "nop",
    "add x0, x0, #1",
    "ret",
    ".size memleak_calibration_site, . - memleak_calibration_site",
);

unsafe extern "C" {
    /// Returns `value + 1`.
    fn memleak_calibration_site(value: u64) -> u64;
}

/// The median CPU time of one call of the calibration site, in ns: the
/// thread's own time, user and system, which the traps are charged to,
/// and which other processes running meanwhile do not lengthen.
fn time_a_call() -> f64 {
    let site: unsafe extern "C" fn(u64) -> u64 = std::hint::black_box(memleak_calibration_site);
    let mut runs: Vec<f64> = (0..RUNS)
        .map(|_| {
            let started = thread_cpu_ns();
            for call in 0..CALLS {
                // SAFETY: the site reads its argument register alone.
                std::hint::black_box(unsafe { site(u64::from(call)) });
            }
            thread_cpu_ns().saturating_sub(started) as f64 / f64::from(CALLS)
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[RUNS / 2]
}

/// The calling thread's CPU time, in ns.
fn thread_cpu_ns() -> u64 {
    // SAFETY: timespec is plain data; all zeroes is a valid value.
    let mut time: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a pointer to a live local.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut time) } != 0 {
        return 0;
    }
    u64::try_from(time.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(time.tv_nsec).unwrap_or(0)
}

/// Where in memleak's own executable file the calibration site is.
fn site_offset() -> Result<u64, String> {
    let address = memleak_calibration_site as *const () as u64;
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|error| error.to_string())?;
    maps.lines()
        .find_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
            let offset = u64::from_str_radix(fields.nth(1)?, 16).ok()?;
            (start..end).contains(&address).then(|| address - start + offset)
        })
        .ok_or_else(|| "memleak's own code is in none of its mappings".to_owned())
}

impl Tracer {
    /// Prices a probe's trap on this machine (see the module's comment);
    /// the calibration's probes are gone when this returns.
    pub fn price_traps(&mut self) -> Result<TrapCost, TracerError> {
        let failed = |detail: String| TracerError::KernelFeature {
            feature: "a probe on memleak's own code, to price the probes".to_owned(),
            detail,
        };
        let exe = std::env::current_exe().map_err(|error| failed(error.to_string()))?;
        let offset = site_offset().map_err(failed)?;
        let own = NonZeroU32::new(std::process::id()).ok_or_else(|| failed("pid 0".to_owned()))?;
        let bare = time_a_call();
        let mut timed = Vec::new();
        if let Some(multi) = &self.multi {
            // As memleak's own probes are attached: multi-uprobe links,
            // which CAP_BPF and CAP_PERFMON may make.
            let path = super::multi_uprobes::c_path(&exe).map_err(|error| failed(error.to_string()))?;
            let mut links = Vec::new();
            for (name, on_return) in
                [(programs::CALIBRATION_ENTRY, false), (programs::CALIBRATION_RETURN, true)]
            {
                let program = multi.program(name).ok_or(TracerError::Missing(name))?;
                let link =
                    super::multi_uprobes::link(program, &path, &[offset], &[], Some(own.get()), on_return)
                        .map_err(|error| failed(error.to_string()))?;
                links.push(link);
                timed.push(time_a_call());
            }
            // Closing the links detaches the probes.
            drop(links);
        } else {
            let mut attached = Vec::new();
            for name in [programs::CALIBRATION_ENTRY, programs::CALIBRATION_RETURN] {
                let probe = calibration_probe(&mut self.ebpf, name)?;
                probe.load().map_err(|source| TracerError::Verifier { program: name, source })?;
                let point = UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(offset),
                    cookie: None,
                };
                let attachment = probe.attach(point, &exe, UProbeScope::OneProcess(own));
                attached.push(name);
                if let Err(error) = attachment {
                    unload(&mut self.ebpf, &attached);
                    return Err(failed(error.to_string()));
                }
                timed.push(time_a_call());
            }
            unload(&mut self.ebpf, &attached);
        }
        let (with_entry, with_both) = (timed[0], timed[1]);
        Ok(TrapCost { entry_ns: (with_entry - bare).max(0.0), return_ns: (with_both - with_entry).max(0.0) })
    }

    /// The kernel's count of run time and runs of memleak's uprobe
    /// programs, summed: (ns, runs). Zero while the count is off.
    pub fn uprobe_run_time(&self) -> (u64, u64) {
        let aya_programs = self
            .ebpf
            .programs()
            .filter(|(_, program)| matches!(program, aya::programs::Program::UProbe(_)))
            .filter_map(|(_, program)| program.fd().ok().map(|fd| fd.as_fd().as_raw_fd()));
        let multi = self
            .multi
            .iter()
            .flat_map(super::multi_uprobes::MultiUprobePrograms::programs)
            .map(|(_, fd)| fd.as_raw_fd());
        aya_programs
            .chain(multi)
            .filter_map(run_time_of)
            .fold((0, 0), |(ns, runs), (program_ns, program_runs)| (ns + program_ns, runs + program_runs))
    }
}

/// Unloads the calibration programs `names`, which detaches them.
fn unload(ebpf: &mut aya::Ebpf, names: &[&'static str]) {
    for name in names {
        if let Ok(probe) = calibration_probe(ebpf, name) {
            let _ = probe.unload();
        }
    }
}

fn calibration_probe<'a>(ebpf: &'a mut aya::Ebpf, name: &'static str) -> Result<&'a mut UProbe, TracerError> {
    ebpf.program_mut(name)
        .and_then(|program| <&mut UProbe>::try_from(program).ok())
        .ok_or(TracerError::Missing(name))
}

/// A program's run time and runs so far, from its descriptor's fdinfo.
fn run_time_of(fd: std::os::fd::RawFd) -> Option<(u64, u64)> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let field = |name: &str| -> Option<u64> {
        info.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
    };
    Some((field("run_time_ns")?, field("run_cnt")?))
}

/// Has the kernel count its BPF programs' run time for as long as the
/// descriptor returned lives. The count is the kernel's, for every
/// program: it adds two clock reads to each run while it is on.
pub fn count_run_time() -> Result<OwnedFd, String> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|error| {
        if error.io_error.raw_os_error() == Some(libc::EPERM) {
            "the kernel's count of it (BPF_ENABLE_STATS) takes CAP_SYS_ADMIN; the estimate counts the traps alone"
                .to_owned()
        } else {
            format!("BPF_ENABLE_STATS: {}", crate::status::os_reason(&error.io_error))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocation_traps_twice_a_free_once_and_each_trap_runs_a_program() {
        let pricing =
            Pricing { trap: TrapCost { entry_ns: 1000.0, return_ns: 2000.0 }, bpf_ns_per_run: Some(500.0) };
        let health = HealthCounters {
            allocations: 1_000,
            failed_allocations: 0,
            frees: 600,
            ..HealthCounters::default()
        };
        // 1,600 entries and 1,000 returns: 1.6 ms + 2 ms of traps, and
        // 2,600 runs of 0.5 us.
        let seconds = pricing.seconds(&health);
        assert!((seconds - (1.6e-3 + 2e-3 + 1.3e-3)).abs() < 1e-9, "{seconds}");
        let unknown_bpf = Pricing { bpf_ns_per_run: None, ..pricing };
        assert!((unknown_bpf.seconds(&health) - 3.6e-3).abs() < 1e-9);
    }

    #[test]
    fn the_calibration_site_is_found_in_memleak_s_own_file() {
        let offset = site_offset().expect("an offset");
        assert!(offset > 0);
    }
}
