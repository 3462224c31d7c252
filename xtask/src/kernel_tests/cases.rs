//! What each set's VM runs its cases with: the test binaries, built for
//! a target, and the script's way of running one case and saying how it
//! went.

use std::{path::PathBuf, process::Stdio};

use anyhow::{bail, Context as _, Result};
use serde::Deserialize;

use crate::{cargo, linker_variable, vm};

/// What a kernel's VM is to run: its script, the cases the script
/// reports on, and how the VM is made.
pub struct Plan {
    pub script: String,
    /// Each case's name, as the script writes it in the results.
    pub cases: Vec<&'static str>,
    pub options: vm::VmOptions,
}

/// A kernel release's (major, minor) version, 0 where it has none.
pub fn version_of(release: &str) -> (u32, u32) {
    let mut numbers = release.split(['.', '-', '+']).map(|number| number.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

/// A kernel release's major version, 0 if it has none.
pub fn major_of(release: &str) -> u32 {
    release.split('.').next().and_then(|major| major.parse().ok()).unwrap_or(0)
}

/// Told to the tests in Debian's kernels from 6.0: they take fentry
/// programs, so memleak must see munmap and mprotect with them (the
/// tests crate's `report_truths`).
pub const KERNEL_TAKES_FENTRY: &str = "MEMLEAK_TESTS_KERNEL_TAKES_FENTRY";

/// The bash function the scripts run each case with: `run_case NAME
/// BINARY` runs test NAME of test binary BINARY, alone, and appends its
/// outcome and seconds to `$results`.
pub const RUN_CASE: &str = "\
run_case() {
  started=${EPOCHREALTIME/./}
  if \"$2\" --exact \"$1\" --test-threads=1; then outcome=PASS; else outcome=FAIL; fi
  ms=$(( (${EPOCHREALTIME/./} - started) / 1000 ))
  echo \"$outcome $1 $((ms / 1000)).$((ms % 1000 / 100))\" >>$results
}
";

/// The line of a script that runs test `name` of `target` with `RUN_CASE`.
pub fn run_case_line(binaries: &[(String, PathBuf)], target: &str, name: &str) -> Result<String> {
    let binary = binaries
        .iter()
        .find(|(found, _)| found == target)
        .map(|(_, binary)| binary)
        .with_context(|| format!("no test binary {target}"))?;
    Ok(format!("run_case {name} {}", binary.display()))
}

#[derive(Deserialize)]
struct Artifact {
    reason: String,
    package_id: String,
    target: Option<Target>,
    executable: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
}

/// Where cross builds go, apart from the host's target/: beside the
/// host's tests, which hold no lock while they run, a cross build takes
/// none the host's builds wait for (it locks the host's directory too,
/// for its build scripts). And its BPF object, built for another
/// architecture, does not replace the host's in target/bpf.
pub const CROSS_TARGET_DIR: &str = "target/cross";

/// Builds the end-to-end test binaries, for the host or for `cross`
/// (a Rust target and the linker for it), each of `only` or all, and
/// returns (target, executable) for each. The host's are those `cargo
/// test --workspace` builds, with the features the workspace unifies: the
/// host's suite built them already.
pub fn test_binaries(cross: Option<(&str, &str)>, only: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    let mut cargo = cargo();
    cargo.args(["test", "--no-run", "--message-format=json"]);
    for target in only {
        cargo.args(["--test", target]);
    }
    match cross {
        Some((target, linker)) => {
            cargo.args(["--package", "memleak-tests", "--target", target, "--target-dir", CROSS_TARGET_DIR]);
            cargo.env(linker_variable(target), linker);
        }
        None => _ = cargo.args(["--workspace", "--exclude", "memleak-ebpf"]),
    }
    let output = cargo.stderr(Stdio::inherit()).output().context("cannot run cargo test --no-run")?;
    if !output.status.success() {
        bail!("cargo test --no-run failed");
    }
    let mut binaries = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(artifact) = serde_json::from_str::<Artifact>(line) else { continue };
        if !artifact.package_id.contains("#memleak-tests@") || artifact.reason != "compiler-artifact" {
            continue;
        }
        if let (Some(target), Some(executable)) = (artifact.target, artifact.executable) {
            if target.kind == ["test"] {
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
        let source = std::fs::read_to_string(crate::root().join(format!("tests/tests/{target}.rs")))
            .unwrap_or_else(|error| panic!("tests/tests/{target}.rs: {error}"));
        assert!(source.contains(&format!("fn {name}()")), "no test {name} in tests/tests/{target}.rs");
    }
}
