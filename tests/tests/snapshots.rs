//! Snapshots saved with --save, rendered later with `memleak report` and
//! compared with `memleak diff`, without root and without the process.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use memleak_tests::{marker_line, memleak_binary, tempdir::TempDir, trace_command, Leaker, Memleak};
use serde_json::Value;

/// Runs `memleak ARGS` as user nobody: the offline subcommands need no
/// privileges.
fn offline(args: &[&str]) -> Output {
    Command::new(memleak_binary())
        .args(args)
        .stdin(Stdio::null())
        .uid(65534)
        .gid(65534)
        .output()
        .expect("run memleak")
}

fn offline_stdout(args: &[&str]) -> String {
    let output = offline(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "memleak {args:?} failed: {stderr}");
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

fn path(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Files a traced run leaves are readable by everyone, like any file root
/// writes: only the directory needs opening up for nobody.
fn world_readable(dir: &TempDir) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn a_snapshot_renders_later_in_every_format() {
    let dir = TempDir::new("memleak-snapshot");
    world_readable(&dir);
    let snapshot = dir.path().join("heap.snap");
    // COUNT 1: one report, so one file, named as given.
    let live = trace_command("all", &["--save", path(&snapshot), "1"]);
    let from_file: Value =
        serde_json::from_str(&offline_stdout(&["report", path(&snapshot), "--format", "json", "-T", "1000"]))
            .expect("a JSON report");
    for key in ["pid", "total_bytes", "total_allocations", "total_stacks", "allocator", "program"] {
        assert_eq!(from_file[key], live[key], "{key} is the same later as live");
    }
    assert_eq!(from_file["total_bytes"], 17_264);
    assert!(from_file["stacks"] == live["stacks"], "the same stacks, frames and all: {from_file:#}");

    // Each allocation is kept, with -a.
    let with_allocations = offline_stdout(&["report", path(&snapshot), "-a", "-T", "1"]);
    let sizes: Vec<&str> = with_allocations.lines().filter(|line| line.contains("addr = 0x")).collect();
    assert_eq!(sizes.len(), 1, "5000 bytes in 1 allocation from leak_realloc: {with_allocations}");
    assert!(sizes[0].contains(" size = 5000 age = "), "{with_allocations}");

    let folded = offline_stdout(&["report", path(&snapshot), "--format", "folded"]);
    assert!(folded.lines().any(|line| line.ends_with(";all;leak_malloc 3000")), "{folded}");
    let svg = offline_stdout(&["report", path(&snapshot), "--format", "svg"]);
    let titles = memleak_tests::svg_titles(&svg);
    assert!(titles.iter().any(|title| title.starts_with("leak_calloc (3,000 bytes, ")), "{titles:#?}");
}

/// A diff of two snapshots of one run: exactly what leaked in between.
#[test]
fn a_diff_shows_exactly_what_leaked_between_two_snapshots() {
    let dir = TempDir::new("memleak-diff");
    world_readable(&dir);
    let mut leaker = Leaker::start_waiting(&["steps"]);
    let pid = leaker.pid().to_string();
    let save = dir.path().join("heap.snap");
    let mut memleak =
        Memleak::start(&["-p", &pid, "--save", path(&save), "--format", "json", "-o", "0", "1"]);
    memleak.wait_attached();
    leaker.go();
    let step_line = marker_line("leaker", "step");
    let step_bytes = |line: &str| -> u64 {
        let report: Value = serde_json::from_str(line).unwrap();
        memleak_tests::stacks_at(&report, "step_leak", step_line)
            .iter()
            .map(|s| s["bytes"].as_u64().unwrap())
            .sum()
    };
    // Report N is saved as heap.N.snap.
    leaker.send("step", "stepped");
    memleak.stdout.wait_for("a report with one step", |line| step_bytes(line) == 8192);
    let base = memleak.stdout.seen.len();
    leaker.send("step", "stepped");
    leaker.send("step", "stepped");
    memleak.stdout.wait_for("a report with three steps", |line| step_bytes(line) == 3 * 8192);
    let new = memleak.stdout.seen.len();
    memleak.signal(libc::SIGINT);
    let (status, _) = memleak.finish();
    assert!(status.success());
    let numbered = |n: usize| dir.path().join(format!("heap.{n}.snap"));
    let (base, new) = (numbered(base), numbered(new));

    assert_diff_formats(dir.path(), &base, &new, step_line);
}

/// `memleak diff` of two snapshots a run of `leaker steps` saved, two
/// steps apart, in every format and read by its consumers.
fn assert_diff_formats(dir: &std::path::Path, base: &std::path::Path, new: &std::path::Path, step_line: u64) {
    let diff: Value =
        serde_json::from_str(&offline_stdout(&["diff", path(base), path(new), "--format", "json"]))
            .expect("a JSON diff");
    assert_eq!(diff["total_stacks"], 1, "only the stepping stack changed: {diff:#}");
    let stack = &diff["stacks"][0];
    assert_eq!((stack["delta_bytes"].as_i64(), stack["delta_allocations"].as_i64()), (Some(16_384), Some(2)));
    assert_eq!((stack["base_bytes"].as_u64(), stack["new_bytes"].as_u64()), (Some(8192), Some(24_576)));
    assert_eq!(stack["frames"][0]["function"], "step_leak");
    assert_eq!(stack["frames"][0]["line"], step_line);

    let text = offline_stdout(&["diff", path(base), path(new)]);
    assert!(text.contains("\t+16384 bytes in +2 allocations from stack (8192 -> 24576 bytes)"), "{text}");
    let folded = offline_stdout(&["diff", path(base), path(new), "--format", "folded"]);
    assert!(
        folded.trim_end().ends_with(";steps;step_leak 8192 24576"),
        "two columns, base then new: {folded}"
    );
    let svg = offline_stdout(&["diff", path(base), path(new), "--format", "svg"]);
    let titles = memleak_tests::svg_titles(&svg);
    // Widths are the new snapshot's; the title gives the growth.
    let step = titles.iter().find(|title| title.starts_with("step_leak (")).expect("step_leak is drawn");
    // inferno gives the change as a share of the new width: 16384 of 24576.
    assert_eq!(step, "step_leak (24,576 bytes, 100.00%; +66.67%)");

    // go tool pprof reads the growth as a profile.
    let profile = dir.join("growth.pb.gz");
    let output = Command::new(memleak_binary())
        .args(["diff", path(base), path(new), "--output", path(&profile)])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let top = memleak_tests::go_pprof(&profile, &["-top", "-unit=byte"]);
    assert!(top.contains("of 16384B total"), "{top}");
    assert!(
        top.lines().any(|line| line.trim_start().starts_with("16384B") && line.ends_with("step_leak")),
        "{top}"
    );
}

/// One snapshot to mangle, saved once per test.
fn saved_snapshot(dir: &TempDir) -> PathBuf {
    let snapshot = dir.path().join("good.snap");
    trace_command("all", &["--save", path(&snapshot), "1"]);
    snapshot
}

fn assert_one_line_error(args: &[&str], expected: &str) {
    let output = offline(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "exit status for {args:?}; stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line for {args:?}: {stderr}");
    assert!(stderr.starts_with("memleak: error: ") && stderr.contains(expected), "{args:?}: {stderr}");
}

#[test]
fn bad_snapshots_get_one_clear_line() {
    let dir = TempDir::new("memleak-bad-snapshots");
    world_readable(&dir);
    let good = saved_snapshot(&dir);
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, contents: &[u8]| {
        let file = dir.path().join(name);
        std::fs::write(&file, contents).unwrap();
        file
    };
    let truncated = write("truncated.snap", &bytes[..bytes.len() * 2 / 3]);
    let empty = write("empty.snap", b"");
    let text = write("text.snap", b"not a snapshot\n");
    let mut flipped_bytes = bytes.clone();
    let middle = flipped_bytes.len() / 2;
    flipped_bytes[middle] ^= 0x55;
    let flipped = write("flipped.snap", &flipped_bytes);
    let future = write(
        "future.snap",
        &gzip(b"{\"format\":\"memleak-snapshot\",\"version\":2,\"written_by\":\"9.9.9\"}\n{}\n"),
    );
    let missing = dir.path().join("missing.snap");

    for subcommand in [&["report"][..], &["diff", path(&good)][..]] {
        let run = |file: &Path, expected: &str| {
            let mut args = subcommand.to_vec();
            args.push(path(file));
            assert_one_line_error(&args, expected);
        };
        run(&truncated, "truncated.snap is truncated or corrupt: ");
        run(&flipped, "flipped.snap is truncated or corrupt: ");
        run(&empty, "empty.snap is not a memleak snapshot (written with --save): it is empty");
        run(&text, "text.snap is not a memleak snapshot (written with --save): it is not gzip-compressed");
        run(&future, "future.snap is snapshot version 2 (from memleak 9.9.9); this memleak reads version 1");
        run(&missing, "cannot read");
    }
    let unwritable = "/proc/memleak-cannot-write-here.svg";
    assert_one_line_error(
        &["report", path(&good), "--output", unwritable],
        "cannot write /proc/memleak-cannot",
    );
}

#[test]
fn diffing_different_programs_warns() {
    let dir = TempDir::new("memleak-diff-programs");
    world_readable(&dir);
    let good = saved_snapshot(&dir);
    // The same snapshot, said to be of another program.
    let body = gunzip(&std::fs::read(&good).unwrap());
    let leaker = memleak_tests::fixture("leaker");
    let other = String::from_utf8(body).unwrap().replace(path(&leaker), "/usr/bin/other-program");
    let other_snapshot = dir.path().join("other.snap");
    std::fs::write(&other_snapshot, gzip(other.as_bytes())).unwrap();
    let output = offline(&["diff", path(&good), path(&other_snapshot)]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("memleak: warn: the snapshots are of different programs")
            && stderr.contains("/usr/bin/other-program"),
        "{stderr}"
    );
    let same = offline(&["diff", path(&good), path(&good)]);
    assert!(same.stderr.is_empty(), "no warning for one program: {}", String::from_utf8_lossy(&same.stderr));
    assert!(String::from_utf8_lossy(&same.stdout).contains("0 stacks changed"));
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    pipe_through("gzip", &["-c"], bytes)
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    pipe_through("gzip", &["-dc"], bytes)
}

fn pipe_through(program: &str, args: &[&str], input: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("run {program}: {error}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{program} failed");
    output.stdout
}
