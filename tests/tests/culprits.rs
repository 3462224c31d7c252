//! What a report names a stack by, and whether its reader can find the
//! code: the culprit past the allocation plumbing, offsets in functions
//! with cold parts, stable ids with and without debug symbols, stripped
//! programs, and one stack per call path.

use std::{path::Path, process::Command};

use memleak_tests::{Leaker, Memleak};
use serde_json::Value;

/// The C++ service (tests/fixtures/service.cpp), g++ -O2 -g.
fn service() -> Command {
    let mut program = Command::new(memleak_tests::optimized("service"));
    program.args(["100", "--wait"]);
    program
}

/// memleak -p on `program`, held at "ready" until attached: its final
/// report, and the text of every report when `--format text` is asked.
fn final_report(program: Command, memleak_args: &[&str]) -> Value {
    let mut target = Leaker::start_command(program);
    let (reports, _) = memleak_tests::trace_running(&mut target, memleak_args);
    target.exit();
    reports.last().cloned().expect("a final report")
}

fn function(frame: &Value) -> &str {
    frame["function"].as_str().unwrap_or("?")
}

/// (bytes, allocations) of the stacks whose culprit is `culprit`.
fn held_by(report: &Value, culprit: &str) -> (u64, u64) {
    let stacks = report["stacks"].as_array().unwrap();
    stacks.iter().filter(|stack| function(&stack["culprit"]) == culprit).fold(
        (0, 0),
        |(bytes, count), stack| {
            (bytes + stack["bytes"].as_u64().unwrap(), count + stack["allocations"].as_u64().unwrap())
        },
    )
}

/// The one stack whose frames go through `function_name` with
/// `size` bytes per allocation.
fn stack_of<'a>(report: &'a Value, function_name: &str, bytes: u64) -> &'a Value {
    let stacks: Vec<&Value> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| {
            stack["bytes"] == bytes
                && stack["frames"].as_array().unwrap().iter().any(|f| function(f) == function_name)
        })
        .collect();
    assert_eq!(stacks.len(), 1, "one stack of {bytes} bytes through {function_name}: {report:#}");
    stacks[0]
}

#[test]
fn a_cxx_leak_is_named_by_the_code_that_made_it_not_by_operator_new() {
    let report = final_report(service(), &[]);
    // 100 sessions: the Session by new in make_session, its name and
    // buffer by std::string and std::vector in the (inlined) constructor.
    assert_eq!(held_by(&report, "make_session(int)"), (5_600, 100), "{report:#}");
    assert_eq!(held_by(&report, "Session::Session(int)"), (8_100 + 6_400, 200), "{report:#}");
    let session = stack_of(&report, "make_session(int)", 5_600);
    assert_eq!(function(&session["frames"][0]), "operator new(unsigned long)", "the frames stay whole");
    assert_eq!(session["culprit"]["line"], memleak_tests::marker_line("service", "session"));

    // --skip-frames adds to the table; --no-default-skips empties it.
    let report = final_report(service(), &["--skip-frames", "^make_session$"]);
    assert_eq!(held_by(&report, "open_session(int)"), (5_600, 100), "{report:#}");
    let report = final_report(service(), &["--no-default-skips"]);
    assert_eq!(held_by(&report, "operator new(unsigned long)"), (5_600 + 8_100 + 6_400, 300), "{report:#}");
    let report = final_report(service(), &["--no-default-skips", "--skip-frames", "^operator new"]);
    assert_eq!(held_by(&report, "make_session(int)"), (5_600, 100), "{report:#}");
}

/// The culprit of each stack holding `count` allocations whose frames go
/// through `function_name`, as (function, line).
fn culprits_through(report: &Value, function_name: &str, count: u64) -> Vec<(String, u64)> {
    let stacks = memleak_tests::stacks_through(report, function_name);
    let held: u64 = stacks.iter().map(|stack| stack["allocations"].as_u64().unwrap()).sum();
    assert_eq!(held, count, "{count} allocations through {function_name}: {report:#}");
    let culprit = |stack: &&Value| {
        let culprit = &stack["culprit"];
        (function(culprit).to_owned(), culprit["line"].as_u64().unwrap_or(0))
    };
    stacks.iter().map(culprit).collect()
}

#[test]
fn what_the_c_library_allocates_for_a_caller_is_named_by_the_caller_on_every_allocator() {
    let libraries = Path::new("/usr/lib/x86_64-linux-gnu");
    let programs = [
        ("glibc", memleak_tests::optimized("libc_callers"), None),
        (
            "tcmalloc",
            memleak_tests::optimized_linked("libc_callers", &libraries.join("libtcmalloc_minimal.so.4")),
            None,
        ),
        (
            "mimalloc",
            memleak_tests::optimized_linked("libc_callers", &libraries.join("libmimalloc.so.2")),
            None,
        ),
        ("jemalloc", memleak_tests::optimized("libc_callers"), Some(libraries.join("libjemalloc.so.2"))),
    ];
    for (allocator, program, preload) in programs {
        let mut command = Command::new(program);
        command.args(["7", "--wait"]);
        if let Some(library) = preload {
            command.env("LD_PRELOAD", library);
        }
        let report = final_report(command, &[]);
        // opendir's buffer, made in libc; the new thread's vector of
        // thread-local storage, made in the dynamic loader.
        let opened = ("open_directories".to_owned(), memleak_tests::marker_line("libc_callers", "opendir"));
        assert_eq!(culprits_through(&report, "open_directories", 7), [opened], "{allocator}: {report:#}");
        let started =
            ("start_threads".to_owned(), memleak_tests::marker_line("libc_callers", "pthread_create"));
        assert_eq!(culprits_through(&report, "start_threads", 7), [started], "{allocator}: {report:#}");
    }
}

#[test]
fn the_text_report_says_the_culprit_first() {
    let mut target = Leaker::start_command(service());
    let pid = target.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "-T", "10", "3600"]);
    memleak.wait_attached();
    target.go();
    memleak.signal(libc::SIGINT);
    let stdout = memleak.stdout.rest();
    assert!(memleak.child.wait().unwrap().success());
    let at = stdout
        .iter()
        .position(|line| line.starts_with("\t5600 bytes in 100 allocations"))
        .expect("the stack");
    assert!(stdout[at + 1].starts_with("\t\tculprit: make_session(int)+0x"), "{stdout:#?}");
    assert!(
        stdout[at + 1].ends_with(&format!(
            "service.cpp:{}) [{}]",
            memleak_tests::marker_line("service", "session"),
            memleak_tests::optimized("service").display()
        )),
        "{stdout:#?}"
    );
    assert!(
        stdout[at + 2].starts_with("\t\toperator new(unsigned long)+0x"),
        "then every frame: {stdout:#?}"
    );
}

/// The size of the symbol `name` (demangled) in `binary`, by nm.
fn symbol_size(binary: &Path, name: &str) -> u64 {
    let output = Command::new("nm").args(["-C", "-S"]).arg(binary).output().expect("nm");
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .find(|line| line.splitn(4, ' ').nth(3) == Some(name))
        .unwrap_or_else(|| panic!("{name} in {text}"));
    u64::from_str_radix(line.split(' ').nth(1).unwrap(), 16).unwrap()
}

#[test]
fn offsets_count_from_the_function_even_when_it_has_a_cold_part() {
    let binary = memleak_tests::optimized("service");
    // The premise: gcc moved make_session's unwinding path away.
    let hot = symbol_size(&binary, "make_session(int)");
    assert!(symbol_size(&binary, "make_session(int) [clone .cold]") > 0);
    let report = final_report(service(), &[]);
    let frame = &stack_of(&report, "make_session(int)", 5_600)["frames"][1];
    assert_eq!(function(frame), "make_session(int)");
    let offset = frame["offset"].as_u64().unwrap();
    assert!(
        (1..=hot).contains(&offset),
        "make_session(int)+{offset:#x} in a function of {hot:#x} bytes: {frame:#}"
    );
}

/// The service built with -g, stripped of every symbol, with its debug
/// information in a file of its own that its `.gnu_debuglink` names.
fn stripped_service() -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = memleak_tests::workspace_root().join("target/fixtures/stripped-service");
    std::fs::create_dir_all(&dir).unwrap();
    let program = dir.join("service");
    let source = memleak_tests::workspace_root().join("tests/fixtures/service.cpp");
    let run = |command: &mut Command| assert!(command.status().unwrap().success(), "{command:?}");
    run(Command::new("g++").args(["-g", "-O2", "-pthread", "-o"]).arg(&program).arg(&source));
    let debug_file = memleak_tests::fixtures::split_debug_file(&program, "--strip-all");
    (program, debug_file)
}

#[test]
fn a_stack_keeps_its_id_when_the_debug_file_is_installed() {
    let (program, debug_file) = stripped_service();
    let hidden = debug_file.with_extension("away");
    std::fs::rename(&debug_file, &hidden).unwrap();
    let run = || {
        let mut command = Command::new(&program);
        command.args(["100", "--wait"]);
        final_report(command, &[])
    };
    let sessions = |report: &Value| -> Value {
        let stacks = report["stacks"].as_array().unwrap();
        let found: Vec<&Value> = stacks.iter().filter(|stack| stack["bytes"] == 5_600).collect();
        assert_eq!(found.len(), 1, "{report:#}");
        found[0].clone()
    };
    let without = sessions(&run());
    // Every frame of the program is its file and an offset in it.
    let own = &without["frames"][1];
    assert_eq!(
        (own["function"].clone(), own["module"].as_str()),
        (Value::Null, program.to_str()),
        "{without:#}"
    );
    assert!(own["file_offset"].as_u64().is_some_and(|offset| offset > 0), "{own:#}");
    std::fs::rename(&hidden, &debug_file).unwrap();
    let with = sessions(&run());
    assert_eq!(function(&with["frames"][1]), "make_session(int)", "named from the debug file: {with:#}");
    assert_eq!(with["frames"][1]["line"], memleak_tests::marker_line("service", "session"));
    assert_eq!(with["stable_id"], without["stable_id"], "the id is where the code is, not its name");
    assert_eq!(with["stable_id"].as_str().map(str::len), Some(12));
}

/// Debian's memcached (a stripped build) attached with -p while it takes a
/// connection and stores a key: memleak's final report.
fn memcached_report(memcached: &Path) -> Value {
    let port = memleak_tests::http::free_port();
    let mut server = Command::new(memcached)
        .args(["-u", "nobody", "-l", "127.0.0.1", "-p", &port.to_string(), "-m", "64", "-t", "1"])
        .spawn()
        .unwrap();
    let connect = || memleak_tests::http::connect_when_listening(port);
    drop(connect());
    let pid = server.id().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "3600"]);
    memleak.wait_attached();
    // A connection memleak sees accepted: memcached allocates its state.
    let mut client = connect();
    std::io::Write::write_all(&mut client, b"set key 0 0 5\r\nvalue\r\n").unwrap();
    let mut answer = [0u8; 8];
    std::io::Read::read_exact(&mut client, &mut answer).unwrap();
    assert_eq!(&answer, b"STORED\r\n");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    let _ = server.kill();
    let _ = server.wait();
    assert!(status.success());
    reports.last().cloned().expect("a final report")
}

#[test]
fn a_stripped_program_shows_where_its_frames_are_and_what_to_install() {
    let memcached = Path::new("/usr/bin/memcached");
    assert!(memcached.exists(), "cargo xtask test installs memcached");
    let report = &memcached_report(memcached);
    let frames: Vec<&Value> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|stack| stack["frames"].as_array().unwrap())
        .collect();
    let own: Vec<&&Value> = frames.iter().filter(|frame| frame["module"] == "/usr/bin/memcached").collect();
    assert!(
        !own.is_empty()
            && own.iter().all(|frame| frame["function"].is_null() && frame["file_offset"].is_u64()),
        "{report:#}"
    );
    let build_id = memleak_tests::build_id(memcached);
    let missing = &report["missing_symbols"];
    let memcached_missing: Vec<&Value> = missing
        .as_array()
        .expect("missing_symbols")
        .iter()
        .filter(|entry| entry["module"] == "/usr/bin/memcached")
        .collect();
    assert_eq!(memcached_missing.len(), 1, "{missing:#}");
    let entry = memcached_missing[0];
    assert_eq!(
        (entry["lacking"].as_str(), entry["build_id"].as_str()),
        (Some("names"), Some(build_id.as_str()))
    );
    let os_release = std::fs::read_to_string("/etc/os-release").unwrap();
    let release = os_release.lines().find_map(|line| line.strip_prefix("VERSION_CODENAME=")).unwrap();
    assert_eq!(
        entry["advice"],
        format!(
            "install memcached-dbgsym (from Debian's debug archive: add the {release}-debug suite to APT's sources), \
             or put its debug file at /usr/lib/debug/.build-id/{}/{}.debug",
            &build_id[..2],
            &build_id[2..]
        )
    );
}

#[test]
fn attaching_to_a_busy_program_gives_no_truncated_copies_of_its_stacks() {
    for _ in 0..3 {
        let mut program = Command::new(memleak_tests::optimized("service"));
        program.arg("busy");
        let target = Leaker::start_command(program);
        let pid = target.pid().to_string();
        let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "3600"]);
        memleak.wait_attached();
        // Some thousands of sessions opened while attached.
        std::thread::sleep(std::time::Duration::from_millis(300));
        memleak.signal(libc::SIGINT);
        let (status, reports) = memleak.finish();
        drop(target);
        assert!(status.success());
        let report = reports.last().unwrap();
        assert_eq!(report.get("truncated_stacks"), None, "{report:#}");
        for stack in report["stacks"].as_array().unwrap() {
            let functions: Vec<&str> = stack["frames"].as_array().unwrap().iter().map(function).collect();
            assert!(
                functions.contains(&"start_thread")
                    || functions.contains(&"main")
                    || functions.contains(&"_dl_start_user"),
                "whole: {functions:?}"
            );
        }
    }
}

#[test]
fn redis_stacks_are_named_past_its_allocation_wrappers_in_metrics() {
    const KEYS: u64 = 5000;
    let mut redis = memleak_tests::redis::Redis::start();
    let (memleak, port) = memleak_tests::http::serve_pid(redis.pid());
    redis.set_keys(KEYS);
    // A round taken once every key is in: each holds its name, its value
    // and its dict entry.
    let allocations =
        format!("memleak_outstanding_allocations{{pid=\"{}\",exe=\"redis-server\"}} ", redis.pid());
    let response = memleak_tests::http::get_until(port, "/metrics", |response| {
        response
            .body
            .lines()
            .find_map(|line| line.strip_prefix(&allocations))
            .and_then(|count| count.parse::<u64>().ok())
            .is_some_and(|count| count >= 3 * KEYS)
    });
    let series_prefix = "memleak_stack_outstanding_bytes{";
    memleak_tests::http::stop(memleak);
    let frames: Vec<&str> = response
        .body
        .lines()
        .filter(|line| line.starts_with(series_prefix))
        .map(|line| {
            line.split("frame=\"").nth(1).and_then(|rest| rest.split('"').next()).expect("a frame label")
        })
        .collect();
    assert_eq!(frames.len(), 5, "--metrics-top-stacks' 5: {}", response.body);
    let wrappers = redis_wrappers();
    assert!(frames.iter().all(|frame| !wrappers.contains(frame)), "{frames:?}");
    // Each key: its name by dbAdd, its value by createStringObject.
    for culprit in ["dbAdd", "createStringObject"] {
        assert!(frames.contains(&culprit), "{culprit} in {frames:?}");
    }
}

/// redis's allocation wrappers, as Debian's redis-server names them.
fn redis_wrappers() -> [&'static str; 7] {
    ["zmalloc", "zmalloc_usable", "zcalloc", "zrealloc", "ztrymalloc_usable", "_sdsnewlen", "sdsnewlen"]
}

#[test]
fn a_rust_release_build_is_named_by_its_own_function_and_says_how_to_get_lines() {
    let program = memleak_tests::rust_jemalloc();
    let mut target = Leaker::start_command(Command::new(&program));
    let (reports, _) = memleak_tests::trace_running(&mut target, &[]);
    target.exit();
    let report = reports.last().expect("a final report");
    // Three leaks of 1000 bytes, each at a call site of its own (no line
    // tables tell they are one line), reached through alloc:: and the
    // global allocator.
    assert_eq!(held_by(report, "rust_jemalloc::leak_blocks"), (3000, 3), "{report:#}");
    let missing = report["missing_symbols"].as_array().expect("missing_symbols");
    let program_entry =
        missing.iter().find(|entry| entry["module"] == program.to_str().unwrap()).expect("the program");
    assert_eq!(program_entry["lacking"], "lines");
    assert_eq!(
        program_entry["advice"],
        "a Rust build without line tables: build it with debug = \"line-tables-only\" (or more) under [profile.release] in Cargo.toml"
    );
}

#[test]
fn a_python_object_is_named_past_the_interpreters_memory_api() {
    // pyenv's CPython keeps its symbols (Debian strips its static ones).
    let python = Path::new("/root/.pyenv/versions/3.11.7/bin/python3.11");
    let python = if python.exists() { python.to_path_buf() } else { which("python3.11") };
    let mut program = Command::new(python);
    program.arg("-c").arg(
        "import sys\nsys.stderr.write('ready\\n'); sys.stderr.flush(); sys.stdin.readline()\n\
         kept = [bytearray(100000) for _ in range(200)]\nsys.stderr.write('done\\n'); sys.stderr.flush(); sys.stdin.read()\n",
    );
    // Native frames only: with Python frames, the culprit is the Python
    // line (tests/tests/python_frames.rs).
    let report = final_report(program, &["--python", "off"]);
    // bytearray(100000) asks for its size and a terminating NUL.
    let stack = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|stack| stack["bytes"] == 200 * 100_001)
        .unwrap_or_else(|| panic!("200 bytearrays: {report:#}"));
    assert_eq!(stack["allocations"], 200);
    assert_eq!(function(&stack["frames"][0]), "_PyObject_Malloc", "the frames stay whole: {stack:#}");
    assert_eq!(function(&stack["culprit"]), "PyByteArray_Resize", "{stack:#}");
}

/// The path of `program` on PATH.
fn which(program: &str) -> std::path::PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.exists())
        .unwrap_or_else(|| panic!("{program} on PATH"))
}
