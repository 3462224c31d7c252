//! Full stacks without frame pointers: release builds of C, C++, a
//! library loaded later, a signal handler, and real interpreters, each
//! walked through its unwind tables in BPF.

use std::{collections::BTreeMap, process::Command};

use memleak_tests::{Leaker, Memleak};
use serde_json::Value;

/// Attaches memleak to a program started by the test and held at
/// "ready", lets it leak, and returns memleak's final report.
fn final_report(program: Command, memleak_args: &[&str]) -> Value {
    final_report_and_stderr(program, memleak_args).0
}

/// As `final_report`, with what memleak said on stderr.
fn final_report_and_stderr(program: Command, memleak_args: &[&str]) -> (Value, Vec<String>) {
    let mut target = Leaker::start_command(program);
    let (reports, stderr) = memleak_tests::trace_running(&mut target, memleak_args);
    target.exit();
    (reports.last().cloned().expect("a final report"), stderr)
}

/// The function names of a stack's frames, innermost first.
fn functions(stack: &Value) -> Vec<&str> {
    stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|frame| frame["function"].as_str().unwrap_or("?"))
        .collect()
}

/// The stacks of a report whose frames include `function`.
fn stacks_through<'a>(report: &'a Value, function: &str) -> Vec<&'a Value> {
    let stacks = report["stacks"].as_array().expect("stacks");
    stacks.iter().filter(|stack| functions(stack).contains(&function)).collect()
}

fn sessions_command() -> Command {
    let mut program = Command::new(memleak_tests::optimized("sessions"));
    program.args(["1000", "--wait"]);
    program
}

fn sessions(memleak_args: &[&str]) -> Value {
    final_report(sessions_command(), memleak_args)
}

#[test]
fn a_cxx_release_build_has_whole_stacks_and_one_path_is_one_stack() {
    let report = sessions(&[]);
    assert_eq!(report["unwinding"], "dwarf");
    let sessions = stacks_through(&report, "make_session(int)");
    assert_eq!(sessions.len(), 1, "1000 leaks along one call path are one stack: {report:#}");
    let stack = sessions[0];
    assert_eq!((stack["bytes"].as_u64(), stack["allocations"].as_u64()), (Some(64_000), Some(1000)));
    assert_eq!(
        functions(stack)[..6],
        [
            "operator new(unsigned long)",
            "make_session(int)",
            "open_session(int)",
            "handle_request(int)",
            "main",
            "__libc_start_call_main"
        ],
        "{stack:#}"
    );
    assert_eq!(stack["frames"][1]["line"], memleak_tests::marker_line("sessions", "session"));
    assert_eq!(stack.get("truncated"), None, "the walk reached the root: {stack:#}");
}

#[test]
fn frame_pointers_alone_cannot_see_past_new_but_keep_one_stack() {
    let report = sessions(&["--unwind", "fp"]);
    assert_eq!(report["unwinding"], "frame_pointers");
    assert!(stacks_through(&report, "make_session(int)").is_empty(), "no frame pointer leads there");
    let stacks = report["stacks"].as_array().unwrap();
    let sessions: Vec<&Value> = stacks.iter().filter(|stack| stack["bytes"] == 64_000).collect();
    assert_eq!(sessions.len(), 1, "no junk frame splits the path: {report:#}");
    assert_eq!(functions(sessions[0]), ["operator new(unsigned long)"]);
    assert_eq!(sessions[0]["truncated"], "no_unwind_info", "{:#}", sessions[0]);
}

/// Builds the sessions program with its call frame information only in
/// `.debug_frame`, then moves that into a separate debug file, as
/// distributions ship them, linked by `.gnu_debuglink`.
fn sessions_with_a_separate_debug_file() -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = memleak_tests::workspace_root().join("target/fixtures/debuglink");
    std::fs::create_dir_all(&dir).unwrap();
    let program = dir.join("sessions");
    let source = memleak_tests::workspace_root().join("tests/fixtures/sessions.cpp");
    let run = |command: &mut Command| assert!(command.status().unwrap().success(), "{command:?}");
    run(Command::new("g++")
        .args([
            "-g",
            "-O2",
            "-fomit-frame-pointer",
            "-fno-asynchronous-unwind-tables",
            "-fno-exceptions",
            "-o",
        ])
        .arg(&program)
        .arg(&source));
    let debug_file = memleak_tests::fixtures::split_debug_file(&program, "--strip-debug");
    (program, debug_file)
}

#[test]
fn rows_come_from_a_separate_debug_file_when_the_object_has_none() {
    let (program, debug_file) = sessions_with_a_separate_debug_file();
    let command = || {
        let mut command = Command::new(&program);
        command.args(["1000", "--wait"]);
        command
    };
    let report = final_report(command(), &[]);
    let stacks = stacks_through(&report, "make_session(int)");
    assert_eq!(stacks.len(), 1, "{report:#}");
    assert_eq!(
        functions(stacks[0])[..5],
        [
            "operator new(unsigned long)",
            "make_session(int)",
            "open_session(int)",
            "handle_request(int)",
            "main"
        ]
    );
    // Without the debug file, the program's code has no unwind rows: the
    // walk gets past libstdc++'s operator new, not past make_session.
    std::fs::remove_file(&debug_file).unwrap();
    let report = final_report(command(), &[]);
    let sessions: Vec<&Value> =
        report["stacks"].as_array().unwrap().iter().filter(|s| s["bytes"] == 64_000).collect();
    assert_eq!(functions(sessions[0]), ["operator new(unsigned long)", "make_session(int)"], "{report:#}");
    assert_eq!(sessions[0]["truncated"], "no_unwind_info");
}

#[test]
fn objects_that_do_not_fit_the_table_are_walked_with_frame_pointers() {
    // Room for the program's own rows, not for libstdc++'s 28,000.
    let (report, stderr) = final_report_and_stderr(sessions_command(), &["--max-unwind-rows", "1000"]);
    let warned = stderr.iter().any(|line| {
        line.starts_with("memleak: warn: no room for the ")
            && line.contains("libstdc++")
            && line.ends_with("(--max-unwind-rows): its code is walked with frame pointers")
    });
    assert!(warned, "a full table is said, never a failure: {stderr:#?}");
    let stacks = report["stacks"].as_array().unwrap();
    let sessions: Vec<&Value> = stacks.iter().filter(|stack| stack["bytes"] == 64_000).collect();
    assert_eq!(sessions.len(), 1, "{report:#}");
    assert_eq!(functions(sessions[0]), ["operator new(unsigned long)"]);
    assert_eq!(sessions[0]["truncated"], "no_unwind_info");
}

#[test]
fn a_signal_frame_is_crossed() {
    let mut program = Command::new(memleak_tests::optimized("unwind"));
    program.args(["signal", "--wait"]);
    let report = final_report(program, &[]);
    let stacks = stacks_through(&report, "leak_in_handler");
    assert_eq!(stacks.len(), 1, "{report:#}");
    let names = functions(stacks[0]);
    let at = |name: &str| names.iter().position(|function| *function == name);
    // The handler, then what the signal interrupted, down to main.
    let (handler, interrupted, main) = (at("on_signal"), at("interrupted"), at("main"));
    assert!(handler.is_some() && handler < interrupted && interrupted < main, "{names:?}");
    assert_eq!(stacks[0]["bytes"], 777);
    assert_eq!(stacks[0].get("truncated"), None, "{:#}", stacks[0]);
}

#[test]
fn a_library_loaded_later_gets_its_tables() {
    let library = memleak_tests::shared_library("plugin");
    let mut target = Leaker::start_command({
        let mut program = Command::new(memleak_tests::optimized("unwind"));
        program.args(["dlopen".as_ref(), library.as_os_str(), "--wait".as_ref()]);
        program
    });
    let pid = target.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "-v", "3600"]);
    memleak.wait_attached();
    // It loads the library and leaks through it at once: that walk meets
    // code memleak does not know yet, and asks for a rescan.
    target.send("go", "loaded");
    let mapped = format!("memleak: debug: pid {pid} maps {}", library.display());
    memleak.stderr.wait_for("memleak to see the library", |line| line == mapped);
    let in_use = format!("memleak: debug: pid {pid}: unwind table of ");
    memleak.stderr.wait_for("the table with the library in use", |line| line.starts_with(&in_use));
    target.send("go", "done");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    target.exit();
    let report = reports.last().expect("a final report");
    let stacks = report["stacks"].as_array().unwrap();
    // Both leaks, 1111 and 4321 bytes, come from one call path. The first
    // came before the table: its walk stopped at the code not known yet,
    // and that stack cut short is counted in the one whole stack it begins.
    let through: Vec<&Value> = stacks.iter().filter(|stack| functions(stack)[0] == "plugin_inner").collect();
    assert_eq!(through.len(), 1, "one call path, one stack: {report:#}");
    let leak = through[0];
    assert_eq!(
        (leak["bytes"].as_u64(), leak["allocations"].as_u64()),
        (Some(1111 + 4321), Some(2)),
        "{leak:#}"
    );
    assert_eq!(functions(leak)[..4], ["plugin_inner", "plugin_leak", "load_and_leak", "main"], "{leak:#}");
    assert_eq!(leak["frames"][0]["line"], memleak_tests::marker_line("plugin", "plugin"));
    assert_eq!(leak.get("truncated"), None);
}

/// Debian's python3 leaking through ctypes: the stack of its 100 blocks
/// of 1000 bytes, with memleak's `extra` flags.
fn ctypes_leak(extra: &[&str]) -> Value {
    let script = memleak_tests::workspace_root().join("tests/fixtures/leak.py");
    let mut program = Command::new("/usr/bin/python3");
    program.arg(script);
    let report = final_report(program, extra);
    let stacks = report["stacks"].as_array().unwrap();
    let leak =
        stacks.iter().find(|stack| stack["bytes"] == 100_000).expect("100 blocks of 1000 bytes").clone();
    assert_eq!(leak["allocations"], 100);
    let modules: Vec<&str> =
        leak["frames"].as_array().unwrap().iter().filter_map(|f| f["module"].as_str()).collect();
    assert!(modules[0].contains("libffi"), "malloc is called by libffi: {leak:#}");
    assert_eq!(leak.get("truncated"), None);
    leak
}

#[test]
fn debian_python_through_ctypes_and_libffi() {
    // Native frames only: the walk crosses the stripped eval loop.
    let leak = ctypes_leak(&["--python", "off"]);
    let names = functions(&leak);
    let at = |name: &str| names.iter().position(|function| *function == name);
    let (eval_loop, root) = (at("_PyEval_EvalFrameDefault"), at("__libc_start_call_main"));
    assert!(eval_loop.is_some() && eval_loop < root, "through the eval loop to the root: {names:?}");
}

#[test]
fn debian_python_through_ctypes_shows_the_python_lines_in_place_of_the_eval_loop() {
    let leak = ctypes_leak(&[]);
    let names = functions(&leak);
    let script = memleak_tests::workspace_root().join("tests/fixtures/leak.py").display().to_string();
    let python: Vec<(&str, &str, u64)> = leak["frames"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|frame| frame["kind"] == "python")
        .map(|frame| {
            (
                frame["function"].as_str().unwrap(),
                frame["file"].as_str().unwrap(),
                frame["line"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        python,
        [
            ("leak_buffers.<locals>.<listcomp>", script.as_str(), 13),
            ("leak_buffers", script.as_str(), 13),
            ("<module>", script.as_str(), 19)
        ],
        "{leak:#}"
    );
    assert_eq!(function_of(&leak["culprit"]), "leak_buffers.<locals>.<listcomp>");
    let at = |name: &str| names.iter().position(|function| *function == name);
    let (module, root) = (at("<module>"), at("__libc_start_call_main"));
    assert!(module.is_some() && module < root, "the Python frames, then the native root: {names:?}");
    assert_eq!(at("_PyEval_EvalFrameDefault"), None, "{names:?}");
}

fn function_of(frame: &Value) -> &str {
    frame["function"].as_str().unwrap_or("?")
}

#[test]
fn node_jit_frames_are_named_from_its_perf_map() {
    let script = memleak_tests::workspace_root().join("tests/fixtures/leak.js");
    let mut program = Command::new("node");
    // node leaves a V8 log in its working directory.
    // Interpreted frames too get a named copy of the interpreter entry in
    // the perf map: whether V8 compiles leakBuffers first is its choice.
    program
        .args(["--perf-basic-prof", "--interpreted-frames-native-stack"])
        .arg(script)
        .current_dir(std::env::temp_dir());
    let report = final_report(program, &[]);
    let stacks = report["stacks"].as_array().unwrap();
    let named = stacks.iter().find(|stack| {
        stack["frames"].as_array().unwrap().iter().any(|frame| {
            frame["module"] == "jit"
                && frame["function"].as_str().is_some_and(|name| name.contains("leakBuffers"))
        })
    });
    let stack = named.unwrap_or_else(|| panic!("a stack through the JS function leakBuffers: {report:#}"));
    // 50 Buffers of 100,000 bytes and more, from that JS function.
    assert!(stack["bytes"].as_u64().unwrap() >= 100_000, "{stack:#}");
    assert!(functions(stack).contains(&"node::Start(int, char**)"), "{:?}", functions(stack));
    // Past V8's and node's allocator plumbing, the JS function is the
    // culprit.
    let culprit = stack["culprit"]["function"].as_str().unwrap_or("?");
    assert!(culprit.contains("leakBuffers"), "the culprit is {culprit}: {:?}", functions(stack));
}

/// Code in anonymous executable memory that no perf map names (a JIT
/// without --perf-basic-prof, a trampoline) says where it is, and the
/// walk goes on through its frame pointers.
#[test]
fn code_in_anonymous_memory_is_named_as_such() {
    let report = final_report(Command::new(memleak_tests::fixture("jit")), &[]);
    let stacks = report["stacks"].as_array().unwrap();
    let through_jit: Vec<&Value> = stacks.iter().filter(|stack| stack["bytes"] == 4242).collect();
    assert_eq!(through_jit.len(), 1, "one stack of the allocation through the trampoline: {report:#}");
    let stack = through_jit[0];
    assert_eq!(stack["allocations"], 1, "{stack:#}");
    let trampoline = &stack["frames"][0];
    assert_eq!(trampoline["module"], "anonymous executable memory", "{stack:#}");
    assert!(trampoline["function"].is_null(), "no name for code nothing names: {stack:#}");
    assert_eq!(stack["frames"][1]["function"], "run_jit", "{stack:#}");
    assert_eq!(stack["frames"][1]["line"], memleak_tests::marker_line("jit", "jit-call"), "{stack:#}");
    assert_eq!(stack["frames"][2]["function"], "main", "{stack:#}");
    // Said once, with how a runtime names such code.
    let missing = report["missing_symbols"].as_array().unwrap();
    let jit: Vec<&Value> =
        missing.iter().filter(|entry| entry["module"] == "anonymous executable memory").collect();
    assert_eq!(jit.len(), 1, "{missing:#?}");
    assert!(jit[0]["advice"].as_str().unwrap().starts_with("JIT code without a perf map: "), "{:#}", jit[0]);
}

/// Rounds of `call_paths`: 24, so that each depth of `dive` is
/// interrupted by the signal twice.
const CALL_PATH_ROUNDS: u64 = 24;
/// `call_paths`'s recursion depth (its DIVE).
const DIVE: u64 = 12;

/// A report's stacks: by their frames' functions and lines, their bytes
/// and allocations.
type Stacks = BTreeMap<Vec<(String, u64)>, (u64, u64)>;

/// The stacks of a run of `call_paths` under memleak with `memleak_args`,
/// and memleak's --stats records.
fn call_path_stacks(memleak_args: &[&str]) -> (Stacks, Vec<Value>) {
    let dir = memleak_tests::workspace_root().join("target/fixtures/call-paths");
    std::fs::create_dir_all(&dir).unwrap();
    let stats = dir.join(format!("stats{}.jsonl", memleak_args.join("")));
    let _ = std::fs::remove_file(&stats);
    let stats_path = stats.to_str().unwrap();
    let mut program = Command::new(memleak_tests::optimized("call_paths"));
    program.args([&CALL_PATH_ROUNDS.to_string(), "--wait"]);
    let mut args = vec!["--stats", stats_path];
    args.extend_from_slice(memleak_args);
    let report = final_report(program, &args);
    let stacks = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|stack| {
            let frames = stack["frames"].as_array().unwrap().iter();
            let frames = frames
                .map(|frame| {
                    (
                        frame["function"].as_str().unwrap_or("?").to_owned(),
                        frame["line"].as_u64().unwrap_or(0),
                    )
                })
                .collect();
            (frames, (stack["bytes"].as_u64().unwrap(), stack["allocations"].as_u64().unwrap()))
        })
        .collect();
    let records = std::fs::read_to_string(&stats).unwrap();
    (stacks, records.lines().map(|line| serde_json::from_str(line).unwrap()).collect())
}

/// The last `stack_walks` record: (walks reusing frames, frames reused).
fn reuse_of(records: &[Value]) -> (u64, u64) {
    let walks =
        records.iter().rfind(|record| record["event"] == "stack_walks").expect("a stack_walks record");
    (walks["reusing_walks"].as_u64().unwrap(), walks["frames_reused"].as_u64().unwrap())
}

#[test]
fn call_paths_that_change_at_every_depth_are_the_stacks_a_full_walk_finds() {
    let (reusing, reuse) = call_path_stacks(&[]);
    let (full, full_walks) = call_path_stacks(&["--no-stack-reuse"]);
    assert_eq!(reuse_of(&full_walks), (0, 0), "--no-stack-reuse walks every frame");
    let (reusing_walks, frames_reused) = reuse_of(&reuse);
    assert!(reusing_walks > 0 && frames_reused > reusing_walks, "frames were reused: {reuse:#?}");
    assert_eq!(reusing, full, "the stacks found reusing frames are those of full walks");

    // The one stack whose blocks all have `size` bytes: its functions and
    // allocations.
    let of_size = |size: u64| -> (Vec<&str>, u64) {
        let stacks: Vec<_> =
            reusing.iter().filter(|(_, (bytes, allocations))| *bytes == size * allocations).collect();
        assert_eq!(stacks.len(), 1, "one stack of {size}-byte blocks: {reusing:#?}");
        let (frames, (_, allocations)) = stacks[0];
        (frames.iter().map(|(function, _)| function.as_str()).collect(), *allocations)
    };
    let main = ["run_round", "main", "__libc_start_call_main"];
    // One leaf, four callers with frames of one size.
    for (size, caller) in [(1001, "via_a"), (1002, "via_b"), (1003, "via_c"), (1004, "via_d")] {
        let (frames, allocations) = of_size(size);
        assert_eq!(frames[..5], [&["leaf", caller][..], &main].concat(), "{size}");
        assert_eq!(allocations, CALL_PATH_ROUNDS, "{size}");
    }
    for depth in 0..DIVE {
        let dives = vec!["dive"; usize::try_from(depth).unwrap() + 1];
        // Down and up: each depth's two allocations, below `depth + 1`
        // frames of dive.
        for size in [2000 + depth, 3000 + depth] {
            let (frames, allocations) = of_size(size);
            assert_eq!(frames[..dives.len() + 3], [&dives[..], &main].concat(), "{size}: {frames:?}");
            assert_eq!(allocations, CALL_PATH_ROUNDS, "{size}");
        }
        // The handler, on the stack it interrupted at that depth.
        let (frames, allocations) = of_size(4000 + depth);
        assert_eq!(frames[..2], ["leak_in_handler", "on_signal"], "{frames:?}");
        let interrupted =
            frames.iter().position(|function| *function == "dive").expect("dive under the handler");
        assert_eq!(
            frames[interrupted..interrupted + dives.len() + 3],
            [&dives[..], &main].concat(),
            "{frames:?}"
        );
        assert_eq!(allocations, CALL_PATH_ROUNDS / DIVE, "{}", 4000 + depth);
    }
    // Two threads, the second on the stack the first left.
    for (size, body) in [(5001, "first_thread"), (5002, "second_thread")] {
        let (frames, allocations) = of_size(size);
        assert_eq!(frames[..4], ["leaf", "thread_leak", body, "start_thread"], "{size}");
        assert_eq!(allocations, CALL_PATH_ROUNDS, "{size}");
    }
}
