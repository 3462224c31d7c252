//! What a `-c` command starts ends with memleak, however memleak ends:
//! its forks, a worker ignoring SIGTERM, one in a process group of its
//! own, a daemon that double-forked into a session of its own, a shell's
//! background children; SIGTERM first, SIGKILL after the grace period.

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use memleak_tests::{memleak_binary, tempdir::TempDir, Memleak};

/// Longer than memleak's grace period (3 s) plus the time SIGKILL takes,
/// many times over: only a process that is never ended waits this long.
const ENDED_WITHIN: Duration = Duration::from_mins(1);

/// A command that starts every kind of process that used to outlive
/// memleak, each writing its pid to `pids`, then waits.
/// Its output goes nowhere: a worker left running must not hold memleak's
/// pipes open, which would hang the test instead of failing it.
fn command_script(dir: &Path) -> PathBuf {
    let d = dir.display();
    let script = format!(
        r#"#!/bin/sh
exec >/dev/null 2>&1
# Every path below is in this directory, whose name has parentheses.
cd '{d}'
# A forked worker.
sleep 1001 & echo $! >> pids
# A worker that ignores SIGTERM, and writes down that it got one.
sh -c 'trap "echo term >> terms" TERM; echo $$ >> pids; while :; do sleep 1; done' &
# A worker in a process group of its own.
perl -e 'setpgrp(0, 0); exec "sleep", "1003"' & echo $! >> pids
# A daemon: a fork into a session of its own, whose own fork is orphaned.
setsid -f sh -c 'sleep 1004 & echo $! >> pids'
# A shell's background children.
sh -c 'sleep 1005 & echo $! >> pids; sleep 1006 & echo $! >> pids; wait' &
echo $$ >> pids
echo $$ > command
wait
"#
    );
    let path = dir.join("command.sh");
    fs::write(&path, script).expect("write the command");
    let status = std::process::Command::new("chmod").arg("+x").arg(&path).status().expect("chmod");
    assert!(status.success());
    path
}

/// Polls `done` until it holds, or panics with `what` after `limit`.
fn wait_until(limit: Duration, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `pid` is a process that still runs (a zombie has ended).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// The processes the command wrote down: the 7 the script names.
fn started_pids(dir: &Path) -> Vec<u32> {
    let pids = fs::read_to_string(dir.join("pids")).unwrap_or_default();
    pids.lines().filter_map(|line| line.trim().parse().ok()).collect()
}

/// The cgroup memleak `pid` makes for its command: a child of the
/// cgroup memleak inherited from this test.
fn command_cgroup(memleak: u32) -> PathBuf {
    let mount = cgroup2_mount();
    let own = fs::read_to_string("/proc/self/cgroup").unwrap();
    let own = own.lines().find_map(|line| line.strip_prefix("0::")).expect("a cgroup v2").to_owned();
    mount.join(own.trim_start_matches('/')).join(format!("memleak-command-{memleak}"))
}

fn cgroup2_mount() -> PathBuf {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
    mountinfo
        .lines()
        .find_map(|line| {
            let (fields, filesystem) = line.split_once(" - ")?;
            filesystem.starts_with("cgroup2 ").then(|| fields.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .expect("a cgroup v2 mount")
}

#[derive(Clone, Copy, Debug)]
enum Ending {
    /// COUNT reports were written.
    Count,
    Signal(libc::c_int),
}

/// How memleak is started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cgroups {
    Writable,
    /// In a mount namespace of its own where the cgroup v2 file system is
    /// read-only: it cannot make the command a cgroup.
    ReadOnly,
}

/// Runs the command under memleak with `args`, ends memleak with
/// `ending`, and checks that nothing the command started outlives it.
fn nothing_outlives_memleak(ending: Ending, args: &[&str]) {
    nothing_outlives(ending, args, Cgroups::Writable);
}

fn nothing_outlives(ending: Ending, args: &[&str], cgroups: Cgroups) {
    let dir = TempDir::new("memleak-command-lifecycle");
    let script = command_script(dir.path());
    let script = script.to_str().unwrap();
    let mut memleak_args = vec!["-c", script, "--format", "json"];
    memleak_args.extend_from_slice(args);
    if let Ending::Count = ending {
        // Long enough for the command to start everything first.
        memleak_args.extend_from_slice(&["4", "2"]);
    }
    let memleak = match cgroups {
        Cgroups::Writable => Memleak::start(&memleak_args),
        Cgroups::ReadOnly => {
            let mount = cgroup2_mount();
            let script = format!("mount -o remount,bind,ro '{}' && exec \"$0\" \"$@\"", mount.display());
            let mut command = std::process::Command::new("unshare");
            command.args(["--mount", "sh", "-c", &script]).arg(memleak_binary()).args(&memleak_args);
            Memleak::spawn(&mut command)
        }
    };
    let memleak_pid = memleak.child.id();
    let ready = || started_pids(dir.path()).len() == 7;
    match ending {
        Ending::Count => {}
        Ending::Signal(signal) => {
            wait_until(ENDED_WITHIN, "the command to start its workers", ready);
            memleak.signal(signal);
        }
    }
    let mut memleak = memleak;
    if cgroups == Cgroups::ReadOnly {
        memleak.stderr.wait_for("memleak to say it cannot make a cgroup", |line| {
            line.starts_with("memleak: warn: cannot make a cgroup for the command (Read-only file system")
        });
    }
    let (status, reports) = memleak.finish();
    let started = started_pids(dir.path());
    assert_eq!(started.len(), 7, "{ending:?}: every process wrote its pid before memleak ended: {started:?}");
    match ending {
        Ending::Count => {
            // Its children have reports too.
            let command: u32 =
                fs::read_to_string(dir.path().join("command")).unwrap().trim().parse().unwrap();
            let its_reports = reports.iter().filter(|report| report["pid"] == command).count();
            assert_eq!((status.code(), its_reports), (Some(0), 2), "{ending:?}");
        }
        Ending::Signal(libc::SIGKILL) => {}
        Ending::Signal(_) => assert_eq!(status.code(), Some(0), "{ending:?}: a clean end"),
    }
    wait_until(ENDED_WITHIN, &format!("{ending:?}: every process the command started to end"), || {
        started.iter().all(|&pid| !alive(pid))
    });
    let terms = fs::read_to_string(dir.path().join("terms")).unwrap_or_default();
    assert!(terms.starts_with("term"), "{ending:?}: SIGTERM came before SIGKILL");
    // The worker ignoring SIGTERM was killed after it, as the rest were.
    let cgroup = command_cgroup(memleak_pid);
    wait_until(ENDED_WITHIN, &format!("{ending:?}: {} to be removed", cgroup.display()), || !cgroup.exists());
}

#[test]
fn a_commands_processes_end_when_count_reports_are_written() {
    nothing_outlives_memleak(Ending::Count, &[]);
}

#[test]
fn a_commands_processes_end_on_sigint() {
    nothing_outlives_memleak(Ending::Signal(libc::SIGINT), &[]);
}

#[test]
fn a_commands_processes_end_on_sigterm() {
    nothing_outlives_memleak(Ending::Signal(libc::SIGTERM), &[]);
}

#[test]
fn a_commands_processes_end_when_memleak_is_killed() {
    nothing_outlives_memleak(Ending::Signal(libc::SIGKILL), &[]);
}

#[test]
fn a_commands_processes_end_with_memleak_even_untraced() {
    nothing_outlives_memleak(Ending::Signal(libc::SIGTERM), &["--no-follow-forks"]);
    nothing_outlives_memleak(Ending::Count, &["--no-follow-forks"]);
}

#[test]
fn without_a_cgroup_a_commands_processes_end_when_memleak_ends_normally() {
    // memleak is then their subreaper: the daemon's orphan comes to it.
    nothing_outlives(Ending::Signal(libc::SIGTERM), &[], Cgroups::ReadOnly);
    nothing_outlives(Ending::Count, &[], Cgroups::ReadOnly);
}
