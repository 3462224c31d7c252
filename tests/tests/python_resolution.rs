//! A stack's Python frames are resolved as soon as BPF stores the stack,
//! not at the next report: a function that allocated and was then freed
//! keeps its name.

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
