//! The x86-64 kernels' set: the host's test binaries, memleak and root,
//! in Debian's kernels booted with this machine's / shared.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::Result;

use super::cases::{major_of, run_case_line, version_of, Plan, KERNEL_TAKES_FENTRY, RUN_CASE};
use crate::{root, vm};

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
const CASES: [(&str, &str); 11] = [
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
    ("serve_oom", "a_traced_leaker_killed_by_the_oom_killer_leaves_its_last_report_after_memleak_restarts"),
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
/// (the host's kernel refuses them: uprobes). An OOM kill seen where the
/// kernel names its victim by pid, in 6.1. Preemption, kernel
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
            // The OOM killer's tracepoint passes a pid before 6.8, a task
            // from then on, as on the host: one kernel of the older kind.
            "a_traced_leaker_killed_by_the_oom_killer_leaves_its_last_report_after_memleak_restarts" => {
                modern && !newest
            }
            "open_files_show_up_as_kmem_cache_objects"
            | "processes_that_join_later_are_traced_and_others_are_not"
            | "cgroup_counts_what_a_process_allocates_at_its_start" => !modern || newest,
            _ => true,
        })
        .collect()
}

/// The amd64 set's plan for `kernel`: its share of `CASES`, with the host's
/// test binaries, memleak and root.
/// Beside other VMs, it has one vCPU (see `Lanes`).
pub fn plan(
    binaries: &[(String, PathBuf)],
    kernel: &vm::Kernel,
    results: &Path,
    side_by_side: bool,
) -> Result<Plan> {
    let cases = cases_for(&kernel.release);
    Ok(Plan {
        script: script_for(binaries, &cases, results, &kernel.release)?,
        cases: std::iter::once(MISSING_BTF.name).chain(cases.iter().map(|&(_, name)| name)).collect(),
        options: vm::VmOptions {
            cpus: if side_by_side { 1 } else { cpus_for(&kernel.release) },
            append: BOOT_ARGUMENTS.to_owned(),
            ..vm::VmOptions::default().sharing_target()
        },
    })
}

/// The script a VM runs: memleak's refusal, then each case, its outcome
/// appended to `results` as `RUN_CASE` writes it.
fn script_for(
    binaries: &[(String, PathBuf)],
    cases: &[(&str, &str)],
    results: &Path,
    release: &str,
) -> Result<String> {
    let memleak = root().join("target/debug/memleak");
    // The setup runs in a mount namespace of its own: a mount it makes
    // stays out of the tests.
    let mut script = format!(
        // MEMLEAK_TESTS_REUSE_FIXTURES: the tests crate's REUSE_FIXTURES.
        "cd {root}\nresults={results}\nexport MEMLEAK_TESTS_REUSE_FIXTURES=1\n{RUN_CASE}\
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
        writeln!(script, "{}", run_case_line(binaries, target, name)?)?;
    }
    Ok(script)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_tests::cases::assert_cases_exist;

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
