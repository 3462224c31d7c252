//! Python frames over a process's life: a stack's frames are resolved as
//! soon as BPF stores the stack, not at the next report, so that a
//! function that allocated and was then freed keeps its name; code freed
//! and replaced by other code before that is never named as the other; a process
//! that starts a sub-interpreter is walked no more, said once, and keeps
//! the frames of its stacks from before.

use std::process::Command;

use memleak_tests::{workspace_root, Leaker, Memleak};
use serde_json::Value;

/// `bytearray(50000)` asks malloc for room for a trailing NUL too.
const KEPT: u64 = 50_001;

#[test]
fn a_freed_functions_frames_keep_their_name() {
    let mut program = Command::new("/usr/bin/python3.11");
    program.arg(workspace_root().join("tests/fixtures/python_transient.py"));
    let mut python = Leaker::start_command(program);
    let pid = python.pid().to_string();
    // One report, at the end: long after the function is gone.
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-v", "-T", "1000", "3600"]);
    memleak.wait_attached();
    python.send("allocate", "allocated");
    // Said when the stack's frames are resolved, at memleak's next look
    // at its processes (every 250 ms).
    memleak.stderr.wait_for("the new stack resolved", |line| {
        line.contains(": Python frames resolved, the innermost transient (<string>:2) [python]")
    });
    python.send("forget", "done");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let report = reports.last().expect("a final report");
    let stack = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|stack| stack["bytes"] == KEPT)
        .unwrap_or_else(|| panic!("the bytearray kept: {report:#}"));
    let python_frames: Vec<(&str, &Value)> = stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|frame| frame["kind"] == "python")
        .map(|frame| (frame["function"].as_str().unwrap(), &frame["line"]))
        .collect();
    assert_eq!(python_frames[0], ("transient", &Value::from(2)), "{stack:#}");
    assert_eq!(python_frames[1].0, "<module>", "{stack:#}");
    python.exit();
}

/// The Python functions of a stack, innermost first.
fn python_functions(stack: &Value) -> Vec<&str> {
    stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|frame| frame["kind"] == "python")
        .map(|frame| frame["function"].as_str().unwrap())
        .collect()
}

#[test]
fn a_process_that_starts_a_sub_interpreter_is_walked_no_more() {
    let python = "/root/.pyenv/versions/3.12.1/bin/python3.12";
    let mut program = Command::new(python);
    program.arg(workspace_root().join("tests/fixtures/python_subinterpreter.py"));
    let mut subject = Leaker::start_command(program);
    let pid = subject.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "3600"]);
    memleak.wait_attached();
    subject.send("keep", "kept");
    subject.send("sub", "created");
    memleak.stderr.wait_for("the sub-interpreter seen", |line| {
        line == format!("memleak: warn: pid {pid}: no more Python frames: it runs sub-interpreters, whose threads' current frames the thread-state key does not give")
    });
    subject.send("keep", "kept");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let report = reports.last().expect("a final report");
    let kept: Vec<&Value> =
        report["stacks"].as_array().unwrap().iter().filter(|stack| stack["bytes"] == 40_001).collect();
    assert_eq!(kept.len(), 2, "one stack before the sub-interpreter, one after: {report:#}");
    let mut functions: Vec<Vec<&str>> = kept.iter().map(|stack| python_functions(stack)).collect();
    functions.sort();
    assert_eq!(functions, [vec![], vec!["keep", "<module>"]], "{report:#}");
}

#[test]
fn a_process_running_sub_interpreters_is_traced_without_python_frames() {
    let python = "/root/.pyenv/versions/3.12.1/bin/python3.12";
    let mut program = Command::new(python);
    program.arg(workspace_root().join("tests/fixtures/python_subinterpreter.py"));
    let mut subject = Leaker::start_command(program);
    subject.send("sub", "created");
    let pid = subject.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "3600"]);
    memleak.wait_attached();
    subject.send("keep", "kept");
    memleak.signal(libc::SIGINT);
    // Every line, those seen while waiting for the attach included.
    let stderr = memleak.stderr.rest();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let refusal = format!(
        "memleak: warn: pid {pid}: no Python frames: it runs sub-interpreters, whose threads' current frames the thread-state key does not give"
    );
    assert_eq!(stderr.iter().filter(|line| **line == refusal).count(), 1, "{stderr:#?}");
    let report = reports.last().expect("a final report");
    let kept = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|stack| stack["bytes"] == 40_001)
        .expect("the bytearray");
    assert!(python_functions(kept).is_empty(), "{kept:#}");
}

/// CPython reuses a freed code object's memory for the next code object
/// of its size: without BPF's check of each frame's code object, the
/// module body that allocated showed as one compiled after it, from
/// another file.
#[test]
fn code_replaced_before_it_is_read_is_never_named_as_the_other() {
    let mut program = Command::new("/root/.pyenv/versions/3.12.1/bin/python3.12");
    program.arg(workspace_root().join("tests/fixtures/python_reused_code.py"));
    let mut python = Leaker::start_command(program);
    let pid = python.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "3600"]);
    memleak.wait_attached();
    python.send("allocate", "done");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let report = reports.last().expect("a final report");
    let stack = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|stack| stack["bytes"] == 60_001)
        .unwrap_or_else(|| panic!("the bytearray kept: {report:#}"));
    let innermost =
        stack["frames"].as_array().unwrap().iter().find(|frame| frame["kind"] == "python").unwrap();
    let function = innermost["function"].as_str().unwrap();
    assert!(
        (function == "<module>" && innermost["file"] == "<generated module>")
            || function.starts_with("<freed code 0x"),
        "the module body, or code said to be gone, never another file's: {innermost:#}"
    );
    python.exit();
}
