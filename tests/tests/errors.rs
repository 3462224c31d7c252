//! What a user who gets something wrong sees: one line, exit status 2.

use memleak_tests::{assert_refused_in_one_line, fixture};

#[test]
fn a_pid_that_does_not_exist() {
    assert_refused_in_one_line(&["-p", "999999999"], "no process with pid 999999999");
}

#[test]
fn a_kernel_thread() {
    // pid 2 is kthreadd on Linux.
    assert_refused_in_one_line(&["-p", "2"], "kernel thread");
}

#[test]
fn a_command_that_cannot_run() {
    assert_refused_in_one_line(&["-c", "/nonexistent/program --flag"], "cannot run `/nonexistent/program`");
    assert_refused_in_one_line(&["-c", "no-such-program-anywhere"], "not found in PATH");
    assert_refused_in_one_line(&["-c", "/etc/hostname"], "cannot run `/etc/hostname`");
}

#[test]
fn a_bad_interval() {
    assert_refused_in_one_line(&["-p", "1", "0"], "at least 1 second");
    assert_refused_in_one_line(&["-p", "1", "soon"], "not a whole number");
}

#[test]
fn an_object_that_is_not_an_allocator() {
    let pid = std::process::id().to_string();
    assert_refused_in_one_line(&["-p", &pid, "-O", "/etc/hostname"], "is not an ELF file");
    let no_allocator = fixture("noalloc");
    let object = no_allocator.to_str().unwrap();
    assert_refused_in_one_line(&["-p", &pid, "-O", object], "has no malloc and free symbols");
}

#[test]
fn missing_privileges() {
    // Drop to nobody for this one run; stderr must say what is needed.
    let output = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
        .arg(memleak_tests::memleak_binary())
        .args(["-p", "1"])
        .output()
        .expect("run setpriv");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("run as root, or with CAP_BPF and CAP_PERFMON"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[test]
fn a_static_binary_with_no_known_allocator() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-static");
    let binary = dir.path().join("noalloc-static");
    let status = std::process::Command::new("musl-gcc")
        .args(["-static", "-O2", "-o"])
        .arg(&binary)
        .arg(memleak_tests::workspace_root().join("tests/fixtures/noalloc.c"))
        .status()
        .expect("run musl-gcc");
    assert!(status.success());
    let command = binary.to_str().unwrap();
    assert_refused_in_one_line(
        &["-c", command],
        &format!("no known allocator (malloc and free, plain or with a je_ or _rjem_ prefix) in {command}"),
    );
}

#[test]
fn output_files_are_refused_before_anything_is_attached() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-output");
    let existing = dir.path().join("report.json");
    std::fs::write(&existing, "precious").unwrap();
    let existing_path = existing.to_str().unwrap();
    assert_refused_in_one_line(
        &["-p", "1", "--output", existing_path],
        "exists: give --force to overwrite it",
    );
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "precious", "nothing the user had is lost");
    // Numbered files, one per report: any of an earlier run's is refused.
    std::fs::write(dir.path().join("report.7.svg"), "precious").unwrap();
    let numbered = dir.path().join("report.svg");
    assert_refused_in_one_line(&["-p", "1", "--output", numbered.to_str().unwrap()], "report.7.svg exists");
    let snapshot = dir.path().join("report.snap");
    std::fs::write(&snapshot, "precious").unwrap();
    assert_refused_in_one_line(
        &["-p", "1", "--save", snapshot.to_str().unwrap(), "1", "1"],
        "report.snap exists",
    );
    let unwritable = "/proc/memleak-cannot-write-here.json";
    assert_refused_in_one_line(
        &["-p", "1", "--output", unwritable],
        "cannot write /proc/memleak-cannot-write-here.json",
    );
    let unknown = dir.path().join("report.pb");
    assert_refused_in_one_line(
        &["-p", "1", "--output", unknown.to_str().unwrap()],
        "cannot tell the format of",
    );
    assert_refused_in_one_line(
        &["-p", "1", "--force"],
        "--force is for overwriting the --output (or --save) files",
    );
}

/// A mistyped flag or subcommand: one line, with what clap thinks was
/// meant, status 2; nothing attached, nothing on stdout.
#[test]
fn a_mistyped_flag_or_subcommand_is_refused_with_what_was_meant() {
    let refused = |args: &[&str], expected: &str| {
        let (code, stderr) = memleak_tests::run_to_end(args);
        assert_eq!(
            (code, stderr.as_str()),
            (Some(2), format!("memleak: error: {expected}\n").as_str()),
            "{args:?}"
        );
    };
    refused(
        &["--sample-rat", "10"],
        "unexpected argument `--sample-rat` found; did you mean `--sample-rate`?",
    );
    refused(&["serve", "--prot", "9943"], "unexpected argument `--prot` found; did you mean `--port`?");
    refused(
        &["serv", "--pid", "1"],
        "invalid value `serv` for `[INTERVAL]`: `serv` is not a whole number of seconds; did you mean `serve`?",
    );
    refused(
        &["--listen", "0.0.0.0"],
        "unexpected argument `--listen` found; `--listen` is a flag of `memleak serve`",
    );
}

/// --help and --version are answers, not errors: stdout, status 0.
#[test]
fn help_and_version_go_to_stdout() {
    for args in [&["--help"][..], &["--version"], &["serve", "--help"], &["diff", "-h"]] {
        let output = std::process::Command::new(memleak_tests::memleak_binary())
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(0), "{args:?}");
        assert!(output.stderr.is_empty(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(stdout.starts_with(if args[0] == "--version" { "memleak " } else { "" }), "{stdout}");
        assert!(args[0] == "--version" || stdout.contains("Usage: memleak"), "{args:?}: {stdout}");
    }
}
