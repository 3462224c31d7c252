//! The end-to-end tests again in other kernels: Debian's, booted by
//! `vm` with this machine's / shared, so the same test binaries, fixtures
//! and memleak run there, and assert the same exact bytes, frames and
//! lines as on the host.
//!
//! Each x86-64 kernel runs its share of the set (see `amd64`): a C
//! leak's bytes and `file:line`, a C++ -O2 stack without frame pointers
//! to `main`, Python frames of a live python3, `serve` scraped, kernel
//! mode, a cgroup followed, and threads preempted mid-walk, and memleak's
//! one-line refusal of a kernel without BTF. The arm64 set (see `arm64`),
//! cross-built, is a job of the same matrix. Under emulation (no KVM for
//! distribution kernels here) a test takes about 30 times its time on the
//! host, so the set is small and the VMs run side by side, one per host
//! CPU.

mod amd64;
mod arm64;
mod cases;

use std::{
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};

pub use self::amd64::KERNELS;
use self::cases::{test_binaries, Plan};
use crate::{root, vm};

/// A kernel of one architecture to run its set in: a series such as 6.1,
/// `newest`, or a .deb, as `vm` takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub arch: vm::Arch,
    pub kernel: String,
}

impl Job {
    /// How the job is named in xtask's lines and its files' names.
    fn label(&self) -> String {
        match self.arch {
            vm::Arch::Amd64 => self.kernel.clone(),
            vm::Arch::Arm64 => format!("arm64-{}", self.kernel),
        }
    }
}

/// The matrix CI runs: `KERNELS`, and the arm64 set in Debian 12's arm64
/// kernel, whose cloud images Graviton and Ampere nodes boot, and its
/// kernel-bound cases in Debian 13's. Longest first, so that two lanes
/// end about together: in CI's last runs, each beside another, 5.10 took
/// 292 to 335 s, 6.12 185 to 218 s, 6.1 140 s, arm64 6.1 130 to 136 s and
/// arm64 6.12 71 to 94 s. In this order the lanes end within about a
/// minute of each other; with arm64 6.1 second, 6.1 started last and
/// ran alone for two minutes.
const MATRIX: [(vm::Arch, &str); 5] = [
    (vm::Arch::Amd64, "5.10"),
    (vm::Arch::Amd64, "6.12"),
    (vm::Arch::Amd64, "6.1"),
    (vm::Arch::Arm64, "6.1"),
    (vm::Arch::Arm64, "6.12"),
];

/// The jobs `cargo xtask kernels` runs: `kernels` of `arch` (amd64 when
/// not given); when no kernel is named, the matrix, or its share of `arch`.
pub fn jobs(kernels: &[String], arch: Option<vm::Arch>) -> Vec<Job> {
    if kernels.is_empty() {
        MATRIX
            .into_iter()
            .filter(|&(of, _)| arch.is_none_or(|arch| arch == of))
            .map(|(arch, kernel)| Job { arch, kernel: kernel.to_owned() })
            .collect()
    } else {
        let arch = arch.unwrap_or(vm::Arch::Amd64);
        kernels.iter().map(|kernel| Job { arch, kernel: kernel.clone() }).collect()
    }
}

/// Fetches what the jobs' VMs boot, building nothing: each kernel, the
/// initramfs's busybox, and for arm64 its root and Rust targets. Mostly
/// downloads: `cargo xtask test` runs it beside its builds and host tests,
/// and `run` then finds it all made.
pub fn fetch(jobs: &[Job]) -> Result<()> {
    for arch in [vm::Arch::Amd64, vm::Arch::Arm64] {
        if jobs.iter().any(|job| job.arch == arch) {
            vm::fetch_for(arch, vm::Verbosity::Normal)?;
        }
    }
    for job in jobs {
        vm::resolve_kernel_for(&job.kernel, job.arch, vm::Verbosity::Normal)?;
    }
    if jobs.iter().any(|job| job.arch == vm::Arch::Arm64) {
        arm64::install_rust_targets()?;
    }
    Ok(())
}

/// What the jobs' sets run, built: the host's test binaries for the x86
/// kernels, and the arm64 set's cross build.
pub struct Built {
    pub amd64: Vec<(String, PathBuf)>,
    pub arm64: Option<arm64::Built>,
}

/// Builds what `jobs` run (see `amd64_binaries` and `cross_build`).
pub fn build(jobs: &[Job]) -> Result<Built> {
    Ok(Built { amd64: amd64_binaries(jobs)?, arm64: cross_build(jobs)? })
}

/// The x86 kernels' test binaries: the host's, which its own suite built.
pub fn amd64_binaries(jobs: &[Job]) -> Result<Vec<(String, PathBuf)>> {
    if jobs.iter().any(|job| job.arch == vm::Arch::Amd64) {
        test_binaries(None, &[])
    } else {
        Ok(Vec::new())
    }
}

/// The arm64 set's cross build, if a job needs it: minutes of CPU. Never
/// beside a VM: beside two VMs, tried, it took a third of the host, as
/// each of them did, and cases of 5.10 waited past the tests' patience.
/// `cargo xtask test` builds it beside the host's tests instead, at idle
/// priority (see `crate::in_background`).
pub fn cross_build(jobs: &[Job]) -> Result<Option<arm64::Built>> {
    jobs.iter().any(|job| job.arch == vm::Arch::Arm64).then(arm64::prepare).transpose()
}

/// Runs each job's set in its kernel with what `build` made, the VMs side
/// by side as the machine's CPUs allow (see `Lanes`); fails naming each
/// kernel where a case failed.
pub fn run(jobs: &[Job], built: &Built) -> Result<()> {
    let Built { amd64, arm64 } = built;
    let dir = root().join("target/vm/kernel-tests");
    fs::create_dir_all(&dir)?;
    // One after the other: apt's downloads and unpacking share a cache.
    let resolved = jobs
        .iter()
        .map(|job| Ok((job.clone(), vm::resolve_kernel_for(&job.kernel, job.arch, vm::Verbosity::Normal)?)))
        .collect::<Result<Vec<_>>>()?;
    let lanes = Lanes::for_machine(resolved.len());
    let queue = std::sync::Mutex::new(resolved.into_iter().collect::<std::collections::VecDeque<_>>());
    let outcomes = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..lanes.count {
            scope.spawn(|| loop {
                let Some((job, resolved)) =
                    queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front()
                else {
                    return;
                };
                let results = dir.join(format!("{}.results", job.label()));
                let plan = match job.arch {
                    vm::Arch::Amd64 => amd64::plan(amd64, &resolved, &results, lanes.count > 1),
                    vm::Arch::Arm64 => arm64
                        .as_ref()
                        .context("the arm64 set was not built")
                        .and_then(|built| built.plan(&resolved, &results)),
                };
                let outcome =
                    plan.and_then(|plan| run_kernel(&job, &resolved, &plan, &results, &dir, &lanes));
                outcomes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((job, outcome));
            });
        }
    });
    let (mut passed_in_all, mut failed_in_all, mut failed) = (0, 0, Vec::new());
    for (job, outcome) in outcomes.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        let Outcome { status, passed, failures } = outcome?;
        passed_in_all += passed;
        failed_in_all += failures.len();
        if status != 0 || !failures.is_empty() {
            failed.push(format!(
                "{}: {} (the VM's command exited {status}, {passed} passed)",
                job.label(),
                if failures.is_empty() { "not every case ran".to_owned() } else { failures.join(", ") }
            ));
        }
    }
    println!("kernels: {passed_in_all} passed, {failed_in_all} failed");
    if !failed.is_empty() {
        bail!("the end-to-end set failed in other kernels:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// How many VMs run at once, and their CPUs. Under emulation a vCPU is a
/// host thread, busy as long as the guest runs: one lane per host CPU,
/// each VM with one vCPU, takes the matrix in about half the time of one
/// VM after the other with two (a case runs one test at a time, and its
/// processes seldom use two CPUs at once).
struct Lanes {
    count: usize,
    /// Whether VMs write their output to a log each, not to xtask's.
    logged: bool,
}

impl Lanes {
    fn for_machine(kernels: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let count = cpus.min(kernels).max(1);
        Self { count, logged: count > 1 }
    }
}

/// What one kernel's VM said of its cases.
struct Outcome {
    /// The VM's command's exit status.
    status: i32,
    passed: usize,
    /// Each case that failed or never ran.
    failures: Vec<String>,
}

/// Runs `plan` in `kernel`'s VM, its output in a log of its own when VMs
/// run side by side; says how each case went.
fn run_kernel(
    job: &Job,
    kernel: &vm::Kernel,
    plan: &Plan,
    results: &Path,
    dir: &Path,
    lanes: &Lanes,
) -> Result<Outcome> {
    let started = Instant::now();
    let label = job.label();
    let _ = fs::remove_file(results);
    let script = dir.join(format!("{label}.sh"));
    let log = lanes.logged.then(|| dir.join(format!("{label}.log")));
    match &log {
        Some(log) => eprintln!("xtask: kernel {label}: the end-to-end set, its output in {}", log.display()),
        None => eprintln!("xtask: kernel {label}: the end-to-end set"),
    }
    fs::write(&script, &plan.script)?;
    let options = vm::VmOptions { output: log.clone(), ..plan.options.clone() };
    let status = vm::run_in_vm(kernel, &options, &format!("bash {}", script.display()))?;
    let (passed, failures) = outcome_of(&fs::read_to_string(results).unwrap_or_default(), &plan.cases);
    eprintln!(
        "xtask: kernel {label} ({}): {passed} passed, {} failed in {:.0} s",
        kernel.release,
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    if let (Some(log), true) = (&log, status != 0 || !failures.is_empty()) {
        // What the failed cases said: the log's end.
        let text = fs::read_to_string(log).unwrap_or_default();
        let logged: Vec<&str> = text.lines().collect();
        eprintln!("xtask: kernel {label}: the last lines of {}:", log.display());
        for line in &logged[logged.len().saturating_sub(LOG_LINES_SHOWN)..] {
            eprintln!("  {line}");
        }
    }
    Ok(Outcome { status, passed, failures })
}

/// (passed, each case failed or never run) from a script's results, whose
/// lines are `PASS NAME SECONDS` or `FAIL NAME SECONDS`.
fn outcome_of(results: &str, cases: &[&str]) -> (usize, Vec<String>) {
    let mut passed = 0;
    let mut failures = Vec::new();
    for &case in cases {
        let line = results.lines().find(|line| line.split_whitespace().nth(1) == Some(case));
        match line.and_then(|line| line.split_whitespace().next()) {
            Some("PASS") => passed += 1,
            Some(_) => failures.push(case.to_owned()),
            None => failures.push(format!("{case} (never ran)")),
        }
    }
    (passed, failures)
}

/// Lines of a failed kernel's log shown.
const LOG_LINES_SHOWN: usize = 60;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_holds_each_kernel_once_and_the_arm64_set() {
        let amd64: std::collections::BTreeSet<String> =
            jobs(&[], Some(vm::Arch::Amd64)).into_iter().map(|job| job.kernel).collect();
        assert_eq!(amd64, KERNELS.iter().map(|&kernel| kernel.to_owned()).collect());
        assert_eq!(
            jobs(&[], Some(vm::Arch::Arm64)),
            ["6.1", "6.12"].map(|kernel| Job { arch: vm::Arch::Arm64, kernel: kernel.to_owned() })
        );
        assert_eq!(jobs(&[], None).len(), KERNELS.len() + 2);
        let named = jobs(&["6.18".to_owned()], None);
        assert_eq!(named, [Job { arch: vm::Arch::Amd64, kernel: "6.18".to_owned() }]);
    }
}
