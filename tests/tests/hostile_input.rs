//! Input made to hurt whoever reads it: a snapshot that inflates to a
//! gigabyte is refused with one line, in bounded memory, by a user
//! without privileges; perf maps and Python code objects of a traced
//! process are read in bounded memory however large they are.

use std::{
    io::Write as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use memleak_tests::{memleak_binary, tempdir::TempDir, Leaker, Memleak};
use serde_json::Value;

/// The address space memleak may take: a reader that held what the bomb
/// inflates to would need four times as much.
const ADDRESS_SPACE: u64 = 300 << 20;

/// A gzip bomb: a valid snapshot header, then a report whose `program` is
/// a string of 1 GiB, gzipped by gzip(1) to about 5 MB.
fn string_bomb(dir: &Path) -> PathBuf {
    let path = dir.join("bomb.snap");
    let file = std::fs::File::create(&path).expect("create the bomb");
    let mut gzip =
        Command::new("gzip").arg("-1").stdin(Stdio::piped()).stdout(file).spawn().expect("run gzip");
    let mut input = gzip.stdin.take().unwrap();
    input
        .write_all(b"{\"format\":\"memleak-snapshot\",\"version\":1,\"written_by\":\"0.1.0\"}\n{\"pid\":1,\"program\":\"")
        .unwrap();
    let filler = vec![b'A'; 1 << 20];
    for _ in 0..1024 {
        input.write_all(&filler).expect("feed gzip");
    }
    drop(input);
    assert!(gzip.wait().unwrap().success(), "gzip failed");
    path
}

/// Runs `memleak ARGS` as user nobody, its address space limited to
/// `ADDRESS_SPACE`; returns its exit code and stderr.
fn run_limited(args: &[&str]) -> (Option<i32>, String) {
    let mut command = Command::new(memleak_binary());
    command.args(args).stdin(Stdio::null()).uid(65534).gid(65534);
    // SAFETY: setrlimit is async-signal-safe, and the hook touches nothing
    // else of the parent.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: ADDRESS_SPACE, rlim_max: ADDRESS_SPACE };
            if libc::setrlimit(libc::RLIMIT_AS, &raw const limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command.output().expect("run memleak");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

fn assert_refused(args: &[&str], bomb: &Path) {
    let (code, stderr) = run_limited(args);
    let expected = format!(
        "memleak: error: {} is not a memleak snapshot (written with --save): it holds a value over 1 MiB long\n",
        bomb.display()
    );
    assert_eq!(
        (code, stderr.as_str()),
        (Some(2), expected.as_str()),
        "memleak {args:?} in {} MiB of address space",
        ADDRESS_SPACE >> 20
    );
}

#[test]
fn a_gzip_bomb_is_refused_in_bounded_memory() {
    let dir = TempDir::new("memleak-hostile");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let bomb = string_bomb(dir.path());
    let compressed = std::fs::metadata(&bomb).unwrap().len();
    assert!(compressed < 8 << 20, "the bomb is small: {compressed} bytes");
    let path = bomb.to_str().unwrap();
    assert_refused(&["report", path], &bomb);
    assert_refused(&["report", path, "--format", "folded"], &bomb);
    assert_refused(&["diff", path, path], &bomb);
}

/// Removes files however the test ends.
struct Removed(Vec<PathBuf>);

impl Drop for Removed {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The most memory process `pid` has held resident (`VmHWM`), in bytes.
fn peak_resident(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|line| line.starts_with("VmHWM:")).expect("a VmHWM line");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

#[test]
fn perf_maps_share_one_budget_and_a_map_past_its_share_is_dropped() {
    // Five JIT processes (a trampoline in anonymous memory calls malloc):
    // the first's perf map names its code; two write a 1 GiB line that never
    // ends, two write 1,500,000 lines that never name it. Held as they
    // were read, these took about 1 GB together.
    let jit = memleak_tests::fixture("jit");
    let mut targets: Vec<Leaker> = (0..5).map(|_| Leaker::start_command(Command::new(&jit))).collect();
    let pids: Vec<u32> = targets.iter().map(Leaker::pid).collect();
    let maps = Removed(pids.iter().map(|pid| PathBuf::from(format!("/tmp/perf-{pid}.map"))).collect());
    // Every address below 2^47: the trampoline, wherever mmap put it.
    std::fs::write(&maps.0[0], "0 7fffffffffff JIT:trampoline\n").unwrap();
    for map in &maps.0[1..3] {
        // Sparse: no disk.
        std::fs::File::create(map).unwrap().set_len(1 << 30).unwrap();
    }
    for map in &maps.0[3..5] {
        let mut file = std::io::BufWriter::new(std::fs::File::create(map).unwrap());
        for function in 0..1_500_000u64 {
            writeln!(file, "{:x} 10 JS:a_compiled_function_number_{function}", 0x1000 + function * 16)
                .unwrap();
        }
        file.flush().unwrap();
    }
    let pid_list = pids.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let mut memleak = Memleak::start(&["-p", &pid_list, "--format", "json", "-T", "1000", "1"]);
    memleak.wait_attached();
    for target in &mut targets {
        target.go();
    }
    // Each process's first report with the trampoline's allocation: by
    // then every map has been read.
    let mut named = std::collections::BTreeMap::new();
    while named.len() < pids.len() {
        let line = memleak.stdout.wait_for("a report", |_| true);
        let report: Value = serde_json::from_str(&line).unwrap();
        let stacks = report["stacks"].as_array().cloned().unwrap_or_default();
        if let Some(stack) = stacks.iter().find(|stack| stack["bytes"] == 4242) {
            let pid = u32::try_from(report["pid"].as_u64().unwrap()).unwrap();
            named.entry(pid).or_insert_with(|| stack["frames"][0]["function"].clone());
        }
    }
    let peak = peak_resident(memleak.child.id());
    memleak.signal(libc::SIGINT);
    let stderr = memleak.stderr.rest();
    let (status, _) = memleak.finish();
    assert!(status.success(), "{stderr:#?}");
    assert_eq!(named[&pids[0]], "JIT:trampoline", "a map within its share is used");
    for pid in &pids[1..] {
        assert_eq!(named[pid], Value::Null, "pid {pid}: {stderr:#?}");
    }
    let dropped: Vec<&String> = stderr.iter().filter(|line| line.contains("perf map")).collect();
    assert_eq!(dropped.len(), 4, "one line per map dropped: {stderr:#?}");
    for (pid, why) in [
        (pids[1], "has a line longer than 16 KiB"),
        (pids[2], "has a line longer than 16 KiB"),
        (pids[3], "passed its share of memory (64 MiB)"),
        (pids[4], "passed its share of memory (64 MiB)"),
    ] {
        let said =
            format!("memleak: warn: the perf map /tmp/perf-{pid}.map of pid {pid} {why}: it is left out");
        assert_eq!(dropped.iter().filter(|line| line.starts_with(&said)).count(), 1, "{said}: {dropped:#?}");
    }
    // All perf maps together hold at most 256 MiB; here, one map's share
    // at a time, and memleak's own memory besides.
    assert!(peak < 256 << 20, "memleak held {} MiB at its peak", peak >> 20);
    for target in targets {
        target.exit();
    }
}

/// memleak -p on the code-flood fixture after `command`, whose every
/// function's frame is named `generated_...`: the stack of their blocks
/// in the first report where it holds all `functions`, memleak's peak
/// resident memory then, and every line it said.
fn python_code_flood(command: &str, functions: u64) -> (Value, u64, Vec<String>) {
    let mut program = Command::new("/usr/bin/python3.11");
    program.arg(memleak_tests::workspace_root().join("tests/fixtures/python_code_flood.py"));
    let mut python = Leaker::start_command(program);
    let pid = python.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "10", "1"]);
    memleak.wait_attached();
    python.send(&format!("{command} {functions}"), "flooded");
    let name = Value::from("generated_".repeat(1000));
    let innermost_python = |stack: &Value| {
        stack["frames"]
            .as_array()
            .unwrap()
            .iter()
            .find(|frame| frame["kind"] == "python")
            .map(|frame| frame["function"].clone())
    };
    // By then every code object has been read.
    let top = loop {
        let line = memleak.stdout.wait_for("a report", |_| true);
        let report: Value = serde_json::from_str(&line).unwrap();
        let stacks = report["stacks"].as_array().cloned().unwrap_or_default();
        let kept = stacks.into_iter().find(|stack| innermost_python(stack).as_ref() == Some(&name));
        if let Some(kept) = kept.filter(|stack| stack["allocations"] == functions) {
            break kept;
        }
    };
    let peak = peak_resident(memleak.child.id());
    memleak.signal(libc::SIGINT);
    let stderr = memleak.stderr.rest();
    let (status, _) = memleak.finish();
    assert!(status.success(), "{stderr:#?}");
    python.exit();
    // bytearray(3000) asks malloc for room for a trailing NUL too.
    assert_eq!(top["bytes"], functions * 3001);
    (top, peak, stderr)
}

#[test]
fn python_code_objects_sharing_a_huge_name_and_line_table_are_kept_once() {
    // 1,000 code objects, each its own, sharing one qualified name of
    // 10,000 characters and one line table of 1 MiB: copied per code
    // object, memleak took 1 GiB for them.
    let (_, peak, stderr) = python_code_flood("flood", 1_000);
    assert!(peak < 300 << 20, "memleak held {} MiB at its peak", peak >> 20);
    assert!(!stderr.iter().any(|line| line.contains("Python code objects")), "{stderr:#?}");
}

#[test]
fn python_code_objects_past_the_budget_are_let_go_and_read_again() {
    // 48 line tables of 1 MiB each: past the 32 MiB kept a process, said
    // once; every frame still named.
    let (_, peak, stderr) = python_code_flood("distinct", 48);
    let said: Vec<&String> = stderr.iter().filter(|line| line.contains("Python code objects")).collect();
    assert_eq!(said.len(), 1, "{stderr:#?}");
    assert!(
        said[0].ends_with(
            "pass the 32 MiB memleak keeps of them a process: the least recently used are let go, and read \
             again when a stack needs them"
        ),
        "{said:?}"
    );
    assert!(peak < 300 << 20, "memleak held {} MiB at its peak", peak >> 20);
}

#[test]
fn the_daemon_counts_the_python_code_objects_it_let_go() {
    // 48 distinct line tables of 1 MiB in one process: past the 32 MiB
    // kept a process, at least 16 go (the strings and slots take room
    // too), and /metrics counts them.
    let mut program = Command::new("/usr/bin/python3.11");
    program.arg(memleak_tests::workspace_root().join("tests/fixtures/python_code_flood.py"));
    let mut python = Leaker::start_command(program);
    let (memleak, port) = memleak_tests::http::serve_pid(python.pid());
    python.send("distinct 48", "flooded");
    let counted = |body: &str| -> Option<u64> {
        body.lines()
            .find_map(|line| line.strip_prefix("memleak_python_code_objects_let_go_total ")?.parse().ok())
    };
    let metrics = memleak_tests::http::get_until(port, "/metrics", |response| {
        counted(&response.body).is_some_and(|let_go| let_go >= 16)
    });
    let let_go = counted(&metrics.body).unwrap();
    assert!(let_go <= 48, "{let_go} code objects let go, of 48");
    memleak_tests::http::stop(memleak);
    python.exit();
}
