//! The end-to-end tests again in other kernels: Debian's, booted by
//! `vm` with this machine's / shared, so the same test binaries, fixtures
//! and memleak run there, and assert the same exact bytes, frames and
//! lines as on the host.
//!
//! Each kernel of `KERNELS` runs its share of `CASES` (see `cases_for`),
//! the set the kernels page promises: a C leak's bytes and `file:line`, a C++ -O2 stack without frame
//! pointers to `main`, Python frames of a live python3, `serve` scraped,
//! kernel mode, a cgroup followed, and threads preempted mid-walk (the
//! kernels boot with `BOOT_ARGUMENTS`), and memleak's one-line refusal
//! of a kernel without BTF (`MISSING_BTF`). Under emulation (no KVM
//! for distribution kernels here) a test takes about 30 times its time on
//! the host, so the set is small and the VMs run side by side, one per
//! host CPU.

use std::{fmt::Write as _, fs, path::PathBuf, process::Stdio, time::Instant};

use anyhow::{bail, Context as _, Result};
use serde::Deserialize;

use crate::{cargo, root, vm};

/// The kernels the tests run in: Debian 11's (without `bpf_loop`, so
/// with the object built for older kernels), Debian 12's and Debian 13's.
/// The host's generation (6.18) is the host suite's; the newest of all
/// (7.3 today) is left out, to keep CI's run short: `cargo xtask kernels
/// 6.18 newest` runs them, the newest on one CPU (see `cpus_for`). What it
/// alone showed, an oops in memleak's walk when a uprobe program is
/// preempted, the matrix's kernels booted with `BOOT_ARGUMENTS` show too.
pub const KERNELS: [&str; 3] = ["5.10", "6.1", "6.12"];

/// (test target, test name): one test of each kind the kernels page
/// promises.
const CASES: [(&str, &str); 10] = [
    ("allocations", "every_allocation_function_is_recorded_exactly"),
    ("report_truths", "munmap_and_mprotect_are_seen_from_the_kernel_where_it_can"),
    ("allocations", "frames_name_function_file_line_and_module"),
    ("unwind", "a_cxx_release_build_has_whole_stacks_and_one_path_is_one_stack"),
    ("python_frames", "debian_python_attached_with_p_shows_the_methods_that_keep_memory"),
    ("serve", "metrics_show_the_exact_outstanding_bytes_of_the_followed_process"),
    ("kernel", "open_files_show_up_as_kmem_cache_objects"),
    ("cgroup", "processes_that_join_later_are_traced_and_others_are_not"),
    ("serve_follow", "cgroup_counts_what_a_process_allocates_at_its_start"),
    ("preemption", "threads_preempted_mid_walk_keep_their_own_whole_stacks"),
];

/// How the matrix's kernels boot: preempting anywhere in the kernel, as
/// Linux 7 on x86 always does, so that uprobe programs are preempted
/// mid-walk (Debian's kernels default to `voluntary`, where they are not).
const BOOT_ARGUMENTS: &str = "preempt=full";

/// A check of memleak's own refusal: after `setup`, `memleak -c true`
/// exits 2 with one line holding `expected_line`.
struct Refusal {
    name: &'static str,
    /// Run before memleak, to take something away from the kernel.
    setup: &'static str,
    expected_line: &'static str,
}

/// BTF hidden by a mount, as a container without /sys/kernel/btf would.
const MISSING_BTF: Refusal = Refusal {
    name: "a_kernel_without_btf_is_refused_in_one_line",
    setup: "mount --bind /dev/null /sys/kernel/btf/vmlinux",
    expected_line:
        "has no BTF at /sys/kernel/btf/vmlinux: memleak needs a kernel built with CONFIG_DEBUG_INFO_BTF",
};

/// Virtual CPUs for a kernel release: one for Linux 7, which under
/// emulation with two panicked at boot in 2 of 4 boots (with one, 6 of 6
/// booted); two for the rest.
fn cpus_for(release: &str) -> u32 {
    if major_of(release) >= 7 {
        1
    } else {
        vm::VmOptions::default().cpus
    }
}

/// The cases a kernel release runs, to keep CI's run within its time
/// (each is half a minute of emulation): what differs between kernels
/// runs where it differs. Every allocation function only before 6.0,
/// where each has an entry program of its own (no attach cookies): from
/// 6.0 they share the host's entry programs, which the host's suite
/// checks. munmap and mprotect from 6.0, where fentry programs see them
/// (the host's kernel refuses them: uprobes). Preemption, kernel
/// mode and cgroups on the oldest and the newest kernel of the matrix:
/// uprobe programs became preemptible in 6.0; before 5.17 kernel mode
/// stores its stacks in programs of their own, and --cgroup (and the
/// hold of a cgroup's newcomers at their execve) climbs the task's
/// cgroups itself.
fn cases_for(release: &str) -> Vec<(&'static str, &'static str)> {
    let modern = major_of(release) >= 6;
    // The matrix's newest, or one newer (`cargo xtask kernels newest`).
    let newest = KERNELS.last().is_some_and(|newest| version_of(release) >= version_of(newest));
    CASES
        .into_iter()
        .filter(|&(_, name)| match name {
            "every_allocation_function_is_recorded_exactly" => !modern,
            "munmap_and_mprotect_are_seen_from_the_kernel_where_it_can" => modern,
            "threads_preempted_mid_walk_keep_their_own_whole_stacks" => newest,
            "open_files_show_up_as_kmem_cache_objects"
            | "processes_that_join_later_are_traced_and_others_are_not"
            | "cgroup_counts_what_a_process_allocates_at_its_start" => !modern || newest,
            _ => true,
        })
        .collect()
}

/// A kernel release's (major, minor) version, 0 where it has none.
fn version_of(release: &str) -> (u32, u32) {
    let mut numbers = release.split(['.', '-', '+']).map(|number| number.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

/// A kernel release's major version, 0 if it has none.
fn major_of(release: &str) -> u32 {
    release.split('.').next().and_then(|major| major.parse().ok()).unwrap_or(0)
}

/// Runs the cases in each of `kernels` (all of `KERNELS` when empty),
/// after building the test binaries, the VMs side by side as the
/// machine's CPUs allow (see `Lanes`); fails naming each kernel where a
/// case failed.
pub fn run(kernels: &[String]) -> Result<()> {
    let kernels: Vec<String> = if kernels.is_empty() {
        KERNELS.iter().map(|&kernel| kernel.to_owned()).collect()
    } else {
        kernels.to_vec()
    };
    let binaries = test_binaries(None)?;
    let dir = root().join("target/vm/kernel-tests");
    fs::create_dir_all(&dir)?;
    // One after the other: apt's downloads and unpacking share a cache.
    let resolved = kernels
        .iter()
        .map(|kernel| Ok((kernel.clone(), vm::resolve_kernel(kernel)?)))
        .collect::<Result<Vec<_>>>()?;
    let lanes = Lanes::for_machine(resolved.len());
    let queue = std::sync::Mutex::new(resolved.into_iter().collect::<std::collections::VecDeque<_>>());
    let outcomes = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..lanes.count {
            scope.spawn(|| loop {
                let Some((kernel, resolved)) =
                    queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front()
                else {
                    return;
                };
                let outcome = run_kernel(&kernel, &resolved, &binaries, &dir, &lanes);
                outcomes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((kernel, outcome));
            });
        }
    });
    let (mut passed_in_all, mut failed_in_all, mut failed) = (0, 0, Vec::new());
    for (kernel, outcome) in outcomes.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        let Outcome { status, passed, failures, expected } = outcome?;
        passed_in_all += passed;
        // A case that never ran (the VM panicked, timed out) fails too.
        failed_in_all += expected.saturating_sub(passed).max(failures.len());
        if status != 0 || !failures.is_empty() || passed != expected {
            failed.push(format!(
                "{kernel}: {} (the VM's command exited {status}, {passed} of {expected} passed)",
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

    fn cpus_for(&self, release: &str) -> u32 {
        if self.count > 1 {
            1
        } else {
            cpus_for(release)
        }
    }
}

/// What one kernel's VM said of its cases.
struct Outcome {
    /// The VM's command's exit status.
    status: i32,
    passed: usize,
    failures: Vec<String>,
    /// Cases, the refusal included.
    expected: usize,
}

/// Runs `kernel`'s share of the cases in its VM.
fn run_kernel(
    kernel: &str,
    resolved: &vm::Kernel,
    binaries: &[(String, PathBuf)],
    dir: &std::path::Path,
    lanes: &Lanes,
) -> Result<Outcome> {
    let started = Instant::now();
    let results = dir.join(format!("{kernel}.results"));
    let _ = fs::remove_file(&results);
    let script = dir.join(format!("{kernel}.sh"));
    let log = lanes.logged.then(|| dir.join(format!("{kernel}.log")));
    match &log {
        Some(log) => eprintln!("xtask: kernel {kernel}: the end-to-end set, its output in {}", log.display()),
        None => eprintln!("xtask: kernel {kernel}: the end-to-end set"),
    }
    let cases = cases_for(&resolved.release);
    fs::write(&script, script_for(binaries, &cases, &results, &resolved.release)?)?;
    let status = vm::run_in_vm(
        resolved,
        &vm::VmOptions {
            cpus: lanes.cpus_for(&resolved.release),
            append: BOOT_ARGUMENTS.to_owned(),
            output: log.clone(),
            ..vm::VmOptions::default().sharing_target()
        },
        &format!("bash {}", script.display()),
    )?;
    let outcome = fs::read_to_string(&results).unwrap_or_default();
    let failures: Vec<String> =
        outcome.lines().filter_map(|line| line.strip_prefix("FAIL ")).map(str::to_owned).collect();
    let passed = outcome.lines().filter(|line| line.starts_with("PASS ")).count();
    let expected = cases.len() + 1;
    eprintln!(
        "xtask: kernel {kernel} ({}): {passed} passed, {} failed in {:.0} s",
        resolved.release,
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    if let (Some(log), true) = (&log, status != 0 || passed != expected) {
        // What the failed cases said: the log's end.
        let text = fs::read_to_string(log).unwrap_or_default();
        let logged: Vec<&str> = text.lines().collect();
        eprintln!("xtask: kernel {kernel}: the last lines of {}:", log.display());
        for line in &logged[logged.len().saturating_sub(LOG_LINES_SHOWN)..] {
            eprintln!("  {line}");
        }
    }
    Ok(Outcome { status, passed, failures, expected })
}

/// Lines of a failed kernel's log shown.
const LOG_LINES_SHOWN: usize = 60;

/// Told to the tests in Debian's kernels from 6.0: they take fentry
/// programs, so memleak must see munmap and mprotect with them (the
/// tests crate's `report_truths`).
const KERNEL_TAKES_FENTRY: &str = "MEMLEAK_TESTS_KERNEL_TAKES_FENTRY";

/// The script a VM runs: each case, its outcome appended to `results`
/// as `PASS NAME` or `FAIL NAME`.
fn script_for(
    binaries: &[(String, PathBuf)],
    cases: &[(&str, &str)],
    results: &std::path::Path,
    release: &str,
) -> Result<String> {
    let memleak = root().join("target/debug/memleak");
    // The setup runs in a mount namespace of its own: a mount it makes
    // stays out of the tests.
    let mut script = format!(
        // MEMLEAK_TESTS_REUSE_FIXTURES: the tests crate's REUSE_FIXTURES.
        "cd {root}\nresults={results}\nexport MEMLEAK_TESTS_REUSE_FIXTURES=1\n\
         refusal() {{ # NAME SETUP EXPECTED\n\
         \x20 err=$(unshare --mount bash -c \"$2\nexec {memleak} -c true\" 2>&1 >/dev/null); status=$?\n\
         \x20 if [ $status = 2 ] && [ \"$(printf '%s\\n' \"$err\" | wc -l)\" = 1 ] && [[ \"$err\" == *\"$3\"* ]]; then\n\
         \x20   echo \"PASS $1\" >>$results; echo \"test $1 ... ok\"\n\
         \x20 else\n\
         \x20   echo \"FAIL $1\" >>$results; echo \"test $1 ... FAILED: status $status, stderr: $err\"\n\
         \x20 fi\n}}\n",
        root = root().display(),
        results = results.display(),
        memleak = memleak.display(),
    );
    if major_of(release) >= 6 {
        writeln!(script, "export {KERNEL_TAKES_FENTRY}=1")?;
    }
    let quoted = |text: &str| format!("'{}'", text.replace('\'', "'\\''"));
    writeln!(
        script,
        "refusal {} {} {}",
        MISSING_BTF.name,
        quoted(MISSING_BTF.setup),
        quoted(MISSING_BTF.expected_line)
    )?;
    for &(target, name) in cases {
        let binary = binaries
            .iter()
            .find(|(found, _)| found == target)
            .map(|(_, binary)| binary)
            .with_context(|| format!("no test binary {target}"))?;
        writeln!(
            script,
            "if {binary} --exact {name} --test-threads=1; then echo \"PASS {name}\" >>$results; \
             else echo \"FAIL {name}\" >>$results; fi",
            binary = binary.display()
        )?;
    }
    Ok(script)
}

/// Cargo's variable naming `target`'s linker.
pub fn linker_variable(target: &str) -> String {
    format!("CARGO_TARGET_{}_LINKER", target.to_uppercase().replace('-', "_"))
}

#[derive(Deserialize)]
struct Artifact {
    reason: String,
    target: Option<Target>,
    executable: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
}

/// Builds the end-to-end test binaries, for the host or for `cross`
/// (a Rust target and the linker for it), and returns (target,
/// executable) for each.
pub fn test_binaries(cross: Option<(&str, &str)>) -> Result<Vec<(String, PathBuf)>> {
    let mut cargo = cargo();
    cargo.args(["test", "--package", "memleak-tests", "--no-run", "--message-format=json"]);
    if let Some((target, linker)) = cross {
        cargo.args(["--target", target]).env(linker_variable(target), linker);
    }
    let output = cargo.stderr(Stdio::inherit()).output().context("cannot run cargo test --no-run")?;
    if !output.status.success() {
        bail!("cargo test --no-run failed");
    }
    let mut binaries = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(artifact) = serde_json::from_str::<Artifact>(line) else { continue };
        if let (Some(target), Some(executable)) = (artifact.target, artifact.executable) {
            if artifact.reason == "compiler-artifact" && target.kind == ["test"] {
                binaries.push((target.name, executable));
            }
        }
    }
    Ok(binaries)
}

/// Fails unless every (test target, test name) of `cases` names a test
/// in tests/tests: a case renamed there would never run here.
#[cfg(test)]
pub fn assert_cases_exist(cases: &[(&str, &str)]) {
    for (target, name) in cases {
        let source = fs::read_to_string(root().join(format!("tests/tests/{target}.rs")))
            .unwrap_or_else(|error| panic!("tests/tests/{target}.rs: {error}"));
        assert!(source.contains(&format!("fn {name}()")), "no test {name} in tests/tests/{target}.rs");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kernel_runs_what_differs_on_it() {
        let names = |release: &str| cases_for(release).into_iter().map(|(_, name)| name).collect::<Vec<_>>();
        let (old, debian_12, debian_13, newer) = (
            names("5.10.0-46-amd64"),
            names("6.1.0-57-amd64"),
            names("6.12.118+deb13-amd64"),
            names("7.3.0"),
        );
        assert!(old.contains(&"every_allocation_function_is_recorded_exactly"));
        assert!(!old.contains(&"munmap_and_mprotect_are_seen_from_the_kernel_where_it_can"));
        assert!(old.contains(&"processes_that_join_later_are_traced_and_others_are_not"));
        assert!(debian_12.contains(&"munmap_and_mprotect_are_seen_from_the_kernel_where_it_can"));
        assert!(!debian_12.contains(&"threads_preempted_mid_walk_keep_their_own_whole_stacks"));
        assert_eq!(debian_13.len(), 9);
        assert_eq!(newer, debian_13);
    }

    #[test]
    fn every_case_names_a_test_that_exists() {
        assert_cases_exist(&CASES);
    }
}
