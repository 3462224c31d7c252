//! The end-to-end set again on arm64 (issue 39), in Debian's arm64
//! kernel booted by `vm --arch arm64`: the tests crate's own test
//! binaries, cross-compiled, assert the same exact bytes, frames and lines
//! as on the host. memleak is the static aarch64 musl build a release
//! would ship; the fixtures the cases run are cross-compiled here with
//! Debian's cross compilers into target/vm/arm64/fixtures, which the VM
//! sees as target/fixtures (the tests reuse a fixture found there, as in
//! the other kernels). Emulated, an arm64 CPU is slower still than an x86
//! one, so the set is the and no more.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result};

use super::cases::{
    run_case_line, test_binaries, version_of, Plan, CROSS_TARGET_DIR, KERNEL_TAKES_FENTRY, RUN_CASE,
};
use crate::{cargo, linker_variable, root, run, vm};

/// (test target, test name): the list.
const CASES: [(&str, &str); 6] = [
    // -c on a leaking C program: exact bytes, and the frames' functions
    // and lines, through a thread's start.
    ("allocations", "seed_case_fibonacci_in_a_thread"),
    // munmap and mprotect seen by fentry programs at arm64's system
    // call wrappers from 6.4, by uprobes before; the tracepoint's
    // program, x86-64's only, refused.
    ("report_truths", "munmap_and_mprotect_are_seen_from_the_kernel_where_it_can"),
    // A C++ -O2 stack without frame pointers, to main.
    ("unwind", "a_cxx_release_build_has_whole_stacks_and_one_path_is_one_stack"),
    // Python 3.11's frames, read from the live interpreter.
    ("python_frames", "debian_python_attached_with_p_shows_the_methods_that_keep_memory"),
    ("serve", "metrics_show_the_exact_outstanding_bytes_of_the_followed_process"),
    ("kernel", "open_files_show_up_as_kmem_cache_objects"),
];

/// The kernel the whole set runs in: Debian 12's. Later kernels run only
/// the cases whose path through the kernel differs (see `cases_for`).
const WHOLE_SET_IN: (u32, u32) = (6, 1);

/// The cases a kernel release runs, to keep CI's run within its time:
/// Debian 12's kernel all; others, only munmap and mprotect (fentry from
/// 6.4, see `FENTRY_FROM`) and kernel mode (Debian 13's kernel has the
/// BPF memory allocator's `__alloc` apart, which once filled memleak's
/// maps with its refills).
fn cases_for(release: &str) -> Vec<(&'static str, &'static str)> {
    let whole = version_of(release) == WHOLE_SET_IN;
    CASES.into_iter().filter(|&(target, _)| whole || matches!(target, "report_truths" | "kernel")).collect()
}

/// The Rust targets: memleak's, static as a release ships it, and the
/// test binaries', which link the root's glibc as the fixtures do.
const MEMLEAK_TARGET: &str = vm::Arch::Arm64.musl_target();
const TESTS_TARGET: &str = "aarch64-unknown-linux-gnu";

/// Debian's cross compilers, which link the test binaries too.
const CROSS_PACKAGES: [&str; 2] = ["gcc-aarch64-linux-gnu", "g++-aarch64-linux-gnu"];
const CROSS_PREFIX: &str = "aarch64-linux-gnu-";

/// A fixture the cases run, built as the tests crate's fixtures.rs builds
/// it (a unit test checks the flags are its), by the cross compiler.
struct Fixture {
    /// Its name in target/fixtures.
    name: &'static str,
    /// In tests/fixtures.
    source: &'static str,
    /// gcc or g++, without the cross prefix.
    compiler: &'static str,
    flags: &'static [&'static str],
}

/// The leaker (every case but two runs it: fixtures.rs's `fixture`) and
/// the sessions program as a release build (`optimized`).
const FIXTURES: [Fixture; 2] = [
    Fixture {
        name: "leaker",
        source: "leaker.c",
        compiler: "gcc",
        flags: &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"],
    },
    Fixture {
        name: "sessions-O2",
        source: "sessions.cpp",
        compiler: "g++",
        flags: &["-g", "-O2", "-fomit-frame-pointer", "-pthread"],
    },
];

/// How long a phase took, said on stderr.
fn timed<T>(phase: &str, work: impl FnOnce() -> Result<T>) -> Result<T> {
    let started = Instant::now();
    let done = work()?;
    eprintln!("xtask: arm64: {phase}: {:.1} s", started.elapsed().as_secs_f64());
    Ok(done)
}

/// What the set runs, built: memleak, the test binaries and the fixtures.
pub struct Built {
    memleak: PathBuf,
    binaries: Vec<(String, PathBuf)>,
    fixtures: PathBuf,
}

/// Installs the cross toolchains and builds what the set runs.
pub fn prepare() -> Result<Built> {
    timed("cross toolchains", install_cross_toolchains)?;
    let memleak = timed("memleak for aarch64 musl", build_memleak)?;
    let binaries = timed("test binaries for aarch64", || {
        let targets: Vec<&str> = CASES.iter().map(|&(target, _)| target).collect();
        test_binaries(Some((TESTS_TARGET, &format!("{CROSS_PREFIX}gcc"))), &targets)
    })?;
    let fixtures = timed("fixtures for aarch64", build_fixtures)?;
    Ok(Built { memleak, binaries, fixtures })
}

impl Built {
    /// The set's plan in an arm64 kernel, writing its outcomes to
    /// `results`: the fixtures shared where the tests look for them, and
    /// one vCPU. With two, a TCG guest stalls whenever the host is busy:
    /// a vCPU thread the host preempts holds a lock the other spins on.
    /// Beside two busy host threads, a case took over 60 s with two
    /// vCPUs, and 30 to 51 s with one.
    pub fn plan(&self, kernel: &vm::Kernel, results: &Path) -> Result<Plan> {
        let mut options = vm::VmOptions { cpus: 1, ..vm::VmOptions::default().sharing_target() };
        options.shares.push(vm::Share {
            host: self.fixtures.clone(),
            guest: root().join("target/fixtures"),
            writable: true,
        });
        Ok(Plan {
            script: script_for(&self.memleak, &self.binaries, results, &kernel.release)?,
            cases: cases_for(&kernel.release).into_iter().map(|(_, name)| name).collect(),
            options,
        })
    }
}

/// The cross compilers and the Rust targets.
fn install_cross_toolchains() -> Result<()> {
    crate::install_missing_packages(&CROSS_PACKAGES, "the arm64 tests")?;
    install_rust_targets()
}

/// The Rust targets alone: downloads, which `cargo xtask test` makes
/// beside its builds (see `kernel_tests::fetch`).
pub fn install_rust_targets() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("cannot run rustup")?;
    let installed = String::from_utf8_lossy(&installed.stdout);
    for target in [MEMLEAK_TARGET, TESTS_TARGET] {
        if !installed.lines().any(|line| line.trim() == target) {
            eprintln!("xtask: installing the Rust target {target}");
            run(Command::new("rustup").args(["target", "add", target]))?;
        }
    }
    Ok(())
}

/// memleak, static: rust-lld links musl's own C library, shipped with
/// the Rust target, so no aarch64 musl toolchain is needed.
fn build_memleak() -> Result<PathBuf> {
    run(cargo()
        .args(["build", "--package", "memleak", "--target", MEMLEAK_TARGET, "--target-dir", CROSS_TARGET_DIR])
        .env(linker_variable(MEMLEAK_TARGET), "rust-lld"))?;
    Ok(root().join(CROSS_TARGET_DIR).join(MEMLEAK_TARGET).join("debug/memleak"))
}

/// `FIXTURES`, into target/vm/arm64/fixtures, which it returns.
fn build_fixtures() -> Result<PathBuf> {
    let dir = root().join("target/vm/arm64/fixtures");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for fixture in FIXTURES {
        let source = root().join("tests/fixtures").join(fixture.source);
        run(Command::new(format!("{CROSS_PREFIX}{}", fixture.compiler))
            .args(fixture.flags)
            .arg("-o")
            .arg(dir.join(fixture.name))
            .arg(&source))?;
    }
    Ok(dir)
}

/// The kernels from which arm64 attaches fentry programs to kernel
/// functions: 6.4 brought its ftrace direct calls (6.0 its trampolines,
/// for BPF programs only). Before, memleak keeps munmap's and mprotect's
/// uprobes, saying the kernel's `ENOTSUPP`.
const FENTRY_FROM: (u32, u32) = (6, 4);

/// The script the VM runs: each case, with `RUN_CASE`.
fn script_for(
    memleak: &Path,
    binaries: &[(String, PathBuf)],
    results: &Path,
    release: &str,
) -> Result<String> {
    // MEMLEAK_TESTS_REUSE_FIXTURES: the tests crate's REUSE_FIXTURES;
    // MEMLEAK_BIN: the memleak its memleak.rs runs.
    let mut script = format!(
        "cd {root}\nresults={results}\n\
         export MEMLEAK_BIN={memleak} MEMLEAK_TESTS_REUSE_FIXTURES=1\n{RUN_CASE}",
        root = root().display(),
        results = results.display(),
        memleak = memleak.display(),
    );
    if version_of(release) >= FENTRY_FROM {
        writeln!(script, "export {KERNEL_TAKES_FENTRY}=1")?;
    }
    for (target, name) in cases_for(release) {
        writeln!(script, "{}", run_case_line(binaries, target, name)?)?;
    }
    Ok(script)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_tests::cases::assert_cases_exist;

    #[test]
    fn every_case_names_a_test_that_exists() {
        assert_cases_exist(&CASES);
    }

    #[test]
    fn debian_12s_kernel_runs_the_whole_set_and_later_ones_what_differs() {
        assert_eq!(cases_for("6.1.0-57-arm64").len(), CASES.len());
        let later: Vec<&str> =
            cases_for("6.12.118+deb13-arm64").into_iter().map(|(target, _)| target).collect();
        assert_eq!(later, ["report_truths", "kernel"]);
    }

    /// A fixture built with other flags than the tests crate's would be
    /// another program than the one the host's tests trace.
    #[test]
    fn fixtures_match() {
        let builder =
            fs::read_to_string(root().join("tests/src/fixtures.rs")).expect("tests/src/fixtures.rs");
        for fixture in FIXTURES {
            let flags = format!("&{:?}", fixture.flags);
            assert!(builder.contains(&flags), "{}: no {flags} in tests/src/fixtures.rs", fixture.name);
            assert!(root().join("tests/fixtures").join(fixture.source).is_file(), "{}", fixture.source);
        }
    }
}
