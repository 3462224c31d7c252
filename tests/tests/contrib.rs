//! The files under contrib/, checked by the programs that read them:
//! Prometheus' scrape config and alert rules by promtool (the alerts'
//! behaviour too, with its unit tests), the systemd unit by
//! systemd-analyze.

use std::{
    fs,
    path::Path,
    process::{Command, Output},
};

use memleak_tests::{tempdir::TempDir, workspace_root};

fn contrib(file: &str) -> std::path::PathBuf {
    workspace_root().join("contrib").join(file)
}

/// Runs `program args`; fails the test with its output unless it
/// succeeded.
fn run_ok(program: &str, args: &[&Path]) -> Output {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("run {program} (`cargo xtask test` installs it): {error}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[test]
fn promtool_accepts_the_scrape_config_and_its_alert_rules() {
    // The config names the rule file, which promtool checks with it.
    let output = run_ok("promtool", &[Path::new("check"), Path::new("config"), &contrib("prometheus.yml")]);
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("SUCCESS: 1 rule files found"), "the alert rules are loaded: {said}");
    run_ok("promtool", &[Path::new("check"), Path::new("rules"), &contrib("memleak-alerts.yml")]);
}

#[test]
fn the_growth_alert_fires_for_a_leak_and_not_for_a_cache_or_a_young_process() {
    run_ok("promtool", &[Path::new("test"), Path::new("rules"), &contrib("memleak-alerts.test.yml")]);
}

/// systemd-analyze verify checks that `ExecStart`'s program exists: the unit
/// is checked as shipped, but for its /usr/local/bin/memleak, which is
/// this build's memleak. A warning fails the test as an error would
/// (systemd-analyze exits 0 on an unknown key, say).
#[test]
fn systemd_analyze_verifies_the_unit() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        // Debian's systemd package has it; a build host without systemd
        // has nothing to verify the unit with, and nothing that would run it.
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    }
    let memleak = workspace_root().join("target/debug/memleak");
    assert!(memleak.exists(), "{} is missing: run `cargo build -p memleak` first", memleak.display());
    let unit =
        fs::read_to_string(contrib("memleak-serve.service")).expect("read contrib/memleak-serve.service");
    assert!(unit.contains("ExecStart=/usr/local/bin/memleak serve "), "{unit}");
    let directory = TempDir::new("memleak-unit");
    let copy = directory.path().join("memleak-serve.service");
    fs::write(&copy, unit.replace("/usr/local/bin/memleak", &memleak.display().to_string())).unwrap();
    let output = run_ok("systemd-analyze", &[Path::new("verify"), &copy]);
    let complaints = String::from_utf8_lossy(&output.stderr);
    assert!(complaints.trim().is_empty(), "systemd-analyze verify: {complaints}");
}
