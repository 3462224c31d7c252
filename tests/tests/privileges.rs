//! What memleak needs of privileges, tried as a real user that is not
//! root: nobody, with `CAP_BPF` and `CAP_PERFMON` as ambient capabilities, or
//! with none. On this kernel (multi-uprobe links, Linux 6.6 and later)
//! the two capabilities trace a process of that user, with `-p` and with
//! `-c`; the kernel takes `CAP_SYSLOG` too, for its addresses in
//! /proc/kallsyms; perf-event uprobes (`MEMLEAK_PERF_EVENT_UPROBES`) take
//! `CAP_SYS_ADMIN`; and memleak says which before it attaches anything.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use memleak_tests::{fixture, memleak_binary, tempdir::TempDir, Leaker, Lines, Memleak, PERF_EVENT_UPROBES};

/// `setpriv` turning the command after it into user nobody's, with
/// `capabilities` (`+bpf,+perfmon`, or none) inheritable and ambient,
/// so that they survive the change of user and the exec.
fn as_nobody(capabilities: Option<&str>) -> Command {
    let mut command = Command::new("setpriv");
    command.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"]);
    match capabilities {
        Some(capabilities) => command
            .args([format!("--inh-caps=-all,{capabilities}"), format!("--ambient-caps=-all,{capabilities}")]),
        None => command.arg("--inh-caps=-all"),
    };
    command
}

/// `path`, or a copy in `dir` when nobody could not run it there (a
/// directory on the way that others cannot search).
fn runnable_by_nobody(path: &Path, dir: &TempDir) -> PathBuf {
    let searchable = path.ancestors().skip(1).all(|directory| {
        std::fs::metadata(directory).is_ok_and(|metadata| metadata.permissions().mode() & 0o001 != 0)
    });
    let runnable =
        std::fs::metadata(path).is_ok_and(|metadata| metadata.permissions().mode() & 0o005 == 0o005);
    if searchable && runnable {
        return path.to_path_buf();
    }
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = dir.path().join(path.file_name().unwrap());
    memleak_tests::fixtures::copy_executable(path, &copy);
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    copy
}

/// memleak as nobody with `capabilities` (`+bpf,+perfmon`), its output
/// read as it comes.
fn start_memleak_as_nobody(
    memleak: &Path,
    capabilities: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Memleak {
    let mut child = as_nobody(Some(capabilities))
        .arg(memleak)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run setpriv");
    let stdin = child.stdin.take();
    let stdout = Lines::new(child.stdout.take().unwrap());
    let stderr = Lines::new(child.stderr.take().unwrap());
    Memleak { child, stdin, stdout, stderr }
}

/// Runs memleak as nobody, with `capabilities` or none, to its end:
/// its exit code and stderr.
fn run_as_nobody(
    capabilities: Option<&str>,
    memleak: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let output = as_nobody(capabilities)
        .arg(memleak)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

fn totals(report: &serde_json::Value) -> (Option<u64>, Option<u64>) {
    (report["total_bytes"].as_u64(), report["total_allocations"].as_u64())
}

#[test]
fn cap_bpf_and_cap_perfmon_trace_a_process_of_their_user_with_p() {
    let dir = TempDir::new("memleak-privileges");
    let memleak = runnable_by_nobody(&memleak_binary(), &dir);
    let leaker = runnable_by_nobody(&fixture("leaker"), &dir);
    let mut command = as_nobody(None);
    command.arg(&leaker).args(["all", "--wait"]);
    let mut target = Leaker::start_command(command);
    let pid = target.pid().to_string();
    let mut memleak = start_memleak_as_nobody(
        &memleak,
        "+bpf,+perfmon",
        &["-p", &pid, "--format", "json", "-T", "1000", "3600"],
        &[],
    );
    memleak.wait_attached();
    target.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak -p as nobody: {status}");
    let report = reports.last().expect("a final report");
    assert_eq!(totals(report), (Some(17_264), Some(15)), "the leaker's exact bytes and blocks");
    target.exit();
}

#[test]
fn cap_bpf_and_cap_perfmon_trace_a_command_with_c() {
    let dir = TempDir::new("memleak-privileges");
    let memleak = runnable_by_nobody(&memleak_binary(), &dir);
    let command = format!("{} all --exit", runnable_by_nobody(&fixture("leaker"), &dir).display());
    let memleak = start_memleak_as_nobody(
        &memleak,
        "+bpf,+perfmon",
        &["-c", &command, "--format", "json", "-T", "1000", "3600"],
        &[],
    );
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak -c as nobody: {status}");
    assert_eq!(totals(reports.last().expect("a final report")), (Some(17_264), Some(15)));
}

#[test]
fn cap_bpf_cap_perfmon_and_cap_syslog_trace_the_kernel() {
    let dir = TempDir::new("memleak-privileges");
    let memleak = runnable_by_nobody(&memleak_binary(), &dir);
    let mut memleak = start_memleak_as_nobody(&memleak, "+bpf,+perfmon,+syslog", &["-T", "1"], &[]);
    memleak
        .stderr
        .wait_for("memleak to attach", |line| line.starts_with("memleak: tracing kernel allocations"));
    // A process that holds 100 open files: the kernel's allocations, which
    // the final report, at SIGINT, is sure to hold.
    let mut files = Command::new(fixture("leaker"));
    files.args(["files", "100", "--wait"]);
    let mut files = Leaker::start_command(files);
    files.go();
    memleak.signal(libc::SIGINT);
    let header = memleak.stdout.wait_for("a kernel report", |line| line.starts_with('['));
    let status = memleak.child.wait().unwrap();
    files.exit();
    assert!(status.success(), "memleak as nobody on the kernel: {status}; {:#?}", memleak.stderr.rest());
    assert!(header.ends_with("] Top 1 stacks with outstanding allocations in the kernel:"), "{header}");
    // The kernel's frames are named: /proc/kallsyms shows their addresses.
    // The first frame, past what a stack may say before its frames.
    let said_before = ["\t\tculprit:", "\t\treplacing:"];
    let frame = memleak.stdout.wait_for("a frame", |line| {
        line.starts_with("\t\t") && !said_before.iter().any(|said| line.starts_with(said))
    });
    assert!(frame.ends_with(" [kernel]") && !frame.contains("[unknown]"), "{frame}");
}

/// Without `CAP_SYSLOG`, /proc/kallsyms shows nobody the kernel's
/// addresses as 0: memleak would name none of its frames and count its own
/// map refills, and says so rather than report that.
#[test]
fn cap_bpf_and_cap_perfmon_alone_are_told_the_kernel_takes_cap_syslog() {
    let dir = TempDir::new("memleak-privileges");
    let memleak = runnable_by_nobody(&memleak_binary(), &dir);
    assert_eq!(
        run_as_nobody(Some("+bpf,+perfmon"), &memleak, &["-T", "1", "1", "1"], &[]),
        (
            Some(2),
            "memleak: error: tracing the kernel takes CAP_SYSLOG too here: /proc/kallsyms hides the kernel's \
             addresses from memleak, which could then name none of its frames nor leave out its own map \
             refills (run as root, or add CAP_SYSLOG)\n"
                .to_owned()
        )
    );
}

#[test]
fn without_capabilities_the_user_is_told_what_this_kernel_needs() {
    let dir = TempDir::new("memleak-privileges");
    let memleak = runnable_by_nobody(&memleak_binary(), &dir);
    let refused = |args: &[&str], env: &[(&str, &str)]| run_as_nobody(None, &memleak, args, env);
    // A process: on this kernel, multi-uprobe links take no more than
    // the kernel does.
    assert_eq!(
        refused(&["-p", "1"], &[]),
        (
            Some(2),
            "memleak: error: permission denied loading BPF programs: run as root, or with CAP_BPF and \
             CAP_PERFMON (enough on this kernel, which has multi-uprobe links)\n"
                .to_owned()
        )
    );
    assert_eq!(
        refused(&["-T", "1", "1", "1"], &[]),
        (
            Some(2),
            "memleak: error: permission denied loading BPF programs: run as root, or with CAP_BPF, \
             CAP_PERFMON and CAP_SYSLOG\n"
                .to_owned()
        ),
        "the kernel, whose addresses /proc/kallsyms hides from nobody"
    );
    assert_eq!(
        refused(&["-p", "1"], &[(PERF_EVENT_UPROBES, "1")]),
        (
            Some(2),
            "memleak: error: permission denied loading BPF programs: run as root, or with CAP_SYS_ADMIN: \
             MEMLEAK_PERF_EVENT_UPROBES is set, and perf-event uprobes need it (the kernel takes CAP_BPF, \
             CAP_PERFMON and CAP_SYSLOG)\n"
                .to_owned()
        )
    );
}

#[test]
fn perf_event_uprobes_are_refused_before_anything_is_attached() {
    let dir = TempDir::new("memleak-privileges");
    let memleak = runnable_by_nobody(&memleak_binary(), &dir);
    // A process of nobody's own, which waits on its stdin.
    let mut command = as_nobody(None);
    command.arg(runnable_by_nobody(&fixture("leaker"), &dir)).args(["none", "--wait"]);
    let target = Leaker::start_command(command);
    let pid = target.pid().to_string();
    let outcome =
        run_as_nobody(Some("+bpf,+perfmon"), &memleak, &["-p", &pid, "1", "1"], &[(PERF_EVENT_UPROBES, "1")]);
    target.exit();
    assert_eq!(
        outcome,
        (
            Some(2),
            "memleak: error: tracing a process takes root or CAP_SYS_ADMIN here: MEMLEAK_PERF_EVENT_UPROBES is \
             set, and perf-event uprobes need it (the kernel takes CAP_BPF, CAP_PERFMON and CAP_SYSLOG)\n"
                .to_owned()
        )
    );
}
