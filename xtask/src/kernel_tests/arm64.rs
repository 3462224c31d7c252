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

use anyhow::{bail, Context as _, Result};

use crate::{
    cargo,
    kernel_tests::{linker_variable, test_binaries},
    root, run, vm,
};

/// The kernels the set runs in when none is named: Debian 12's, whose
/// arm64 kernel cloud images (Graviton, Ampere) boot.
pub const KERNELS: [&str; 1] = ["6.1"];

/// (test target, test name): the list.
const CASES: [(&str, &str); 6] = [
    // -c on a leaking C program: exact bytes, and each frame's file:line.
    ("allocations", "seed_case_fibonacci_in_a_thread"),
    ("allocations", "frames_name_function_file_line_and_module"),
    // A C++ -O2 stack without frame pointers, to main.
    ("unwind", "a_cxx_release_build_has_whole_stacks_and_one_path_is_one_stack"),
    // Python 3.11's frames, read from the live interpreter.
    ("python_frames", "debian_python_attached_with_p_shows_the_methods_that_keep_memory"),
    ("serve", "metrics_show_the_exact_outstanding_bytes_of_the_followed_process"),
    ("kernel", "open_files_show_up_as_kmem_cache_objects"),
];

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

/// Builds what the set needs and runs it in each of `kernels` (`KERNELS`
/// when empty), one after the other; fails naming each case that failed.
pub fn run_set(kernels: &[String]) -> Result<()> {
    let kernels: Vec<String> = if kernels.is_empty() {
        KERNELS.iter().map(|&kernel| kernel.to_owned()).collect()
    } else {
        kernels.to_vec()
    };
    timed("cross toolchains", install_cross_toolchains)?;
    let memleak = timed("memleak for aarch64 musl", build_memleak)?;
    let binaries = timed("test binaries for aarch64", || {
        test_binaries(Some((TESTS_TARGET, &format!("{CROSS_PREFIX}gcc"))))
    })?;
    let fixtures = timed("fixtures for aarch64", build_fixtures)?;
    let dir = root().join("target/vm/kernel-tests");
    fs::create_dir_all(&dir)?;
    let mut failed = Vec::new();
    for kernel in &kernels {
        let resolved = vm::resolve_kernel_for(kernel, vm::Arch::Arm64, vm::Verbosity::Normal)?;
        let ran = timed(&format!("the set in {}", resolved.release), || {
            run_kernel(&resolved, &memleak, &binaries, &fixtures, &dir)
        })?;
        failed.extend(ran.into_iter().map(|case| format!("{}: {case}", resolved.release)));
    }
    if !failed.is_empty() {
        bail!("the end-to-end set failed on arm64:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// The cross compilers and the Rust targets.
fn install_cross_toolchains() -> Result<()> {
    crate::install_missing_packages(&CROSS_PACKAGES, "the arm64 tests")?;
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
        .args(["build", "--package", "memleak", "--target", MEMLEAK_TARGET])
        .env(linker_variable(MEMLEAK_TARGET), "rust-lld"))?;
    Ok(root().join("target").join(MEMLEAK_TARGET).join("debug/memleak"))
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

/// Runs the cases in `kernel`'s VM; returns the names of those that
/// failed or never ran.
fn run_kernel(
    kernel: &vm::Kernel,
    memleak: &Path,
    binaries: &[(String, PathBuf)],
    fixtures: &Path,
    dir: &Path,
) -> Result<Vec<String>> {
    let results = dir.join(format!("{}.results", kernel.release));
    let _ = fs::remove_file(&results);
    let script = dir.join(format!("{}.sh", kernel.release));
    fs::write(&script, script_for(memleak, binaries, &results)?)?;
    eprintln!("xtask: arm64: kernel {}: the end-to-end set", kernel.release);
    let mut options = vm::VmOptions::default().sharing_target();
    options.shares.push(vm::Share {
        host: fixtures.to_owned(),
        guest: root().join("target/fixtures"),
        writable: true,
    });
    let status = vm::run_in_vm(kernel, &options, &format!("bash {}", script.display()))?;
    let outcome = fs::read_to_string(&results).unwrap_or_default();
    let mut failed = Vec::new();
    for &(_, name) in &CASES {
        let line = outcome.lines().find(|line| line.split_whitespace().nth(1) == Some(name));
        let words: Vec<&str> = line.map(|line| line.split_whitespace().collect()).unwrap_or_default();
        match words.as_slice() {
            ["PASS", _, seconds] => eprintln!("xtask: arm64: {name}: passed in {seconds} s"),
            ["FAIL", _, seconds] => {
                eprintln!("xtask: arm64: {name}: FAILED in {seconds} s");
                failed.push(name.to_owned());
            }
            _ => {
                eprintln!("xtask: arm64: {name}: never ran");
                failed.push(format!("{name} (never ran)"));
            }
        }
    }
    if status != 0 && failed.is_empty() {
        failed.push(format!("the VM's command exited {status}"));
    }
    Ok(failed)
}

/// The script the VM runs: each case, its outcome appended to `results`
/// as `PASS NAME SECONDS` or `FAIL NAME SECONDS`.
fn script_for(memleak: &Path, binaries: &[(String, PathBuf)], results: &Path) -> Result<String> {
    // MEMLEAK_TESTS_REUSE_FIXTURES: the tests crate's REUSE_FIXTURES;
    // MEMLEAK_BIN: the memleak its memleak.rs runs.
    let mut script = format!(
        "cd {root}\nresults={results}\n\
         export MEMLEAK_BIN={memleak} MEMLEAK_TESTS_REUSE_FIXTURES=1\n\
         run_case() {{ # NAME BINARY\n\
         \x20 started=${{EPOCHREALTIME/./}}\n\
         \x20 if \"$2\" --exact \"$1\" --test-threads=1; then outcome=PASS; else outcome=FAIL; fi\n\
         \x20 ms=$(( (${{EPOCHREALTIME/./}} - started) / 1000 ))\n\
         \x20 echo \"$outcome $1 $((ms / 1000)).$((ms % 1000 / 100))\" >>$results\n\
         }}\n",
        root = root().display(),
        results = results.display(),
        memleak = memleak.display(),
    );
    for (target, name) in CASES {
        let binary = binaries
            .iter()
            .find(|(found, _)| found == target)
            .map(|(_, binary)| binary)
            .with_context(|| format!("no test binary {target}"))?;
        writeln!(script, "run_case {name} {}", binary.display())?;
    }
    Ok(script)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_names_a_test_that_exists() {
        crate::kernel_tests::assert_cases_exist(&CASES);
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
