//! Python frames over a process's life: a stack's frames are resolved as
//! soon as BPF stores the stack, not at the next report, so that a
//! function that allocated and was then freed keeps its name; code freed
//! and replaced by other code before that is never named as the other; a
//! process that starts a sub-interpreter is walked no more, said once, and
//! keeps the frames of its stacks from before.

use std::process::Command;

use memleak_tests::{workspace_root, Leaker, Memleak};
use serde_json::Value;

const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";
/// 3.12: sub-interpreters of its own (`_xxsubinterpreters`).
const PYENV_PYTHON_3_12: &str = "/root/.pyenv/versions/3.12.1/bin/python3.12";

const SUBINTERPRETERS: &str =
    "it runs sub-interpreters, whose threads' current frames the thread-state key does not give";

/// `python` running fixture `script`, waited for until it is ready.
fn start(python: &str, script: &str) -> Leaker {
    let mut program = Command::new(python);
    program.arg(workspace_root().join("tests/fixtures").join(script));
    Leaker::start_command(program)
}

/// memleak -p on `subject`, with one JSON report at the end (`extra`
/// flags too), attached.
fn attach(subject: &Leaker, extra: &[&str]) -> Memleak {
    let pid = subject.pid().to_string();
    let mut args = vec!["-p", &pid, "--format", "json", "-T", "1000", "3600"];
    args.extend_from_slice(extra);
    let mut memleak = Memleak::start(&args);
    memleak.wait_attached();
    memleak
}

/// Stops memleak; its final report, and every line it said on stderr.
fn final_report(mut memleak: Memleak) -> (Value, Vec<String>) {
    memleak.signal(libc::SIGINT);
    // Every line, those seen while waiting for the attach included.
    let stderr = memleak.stderr.rest();
    let (status, mut reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}: {stderr:#?}");
    (reports.pop().expect("a final report"), stderr)
}

/// The stacks of `report` holding `bytes`.
fn stacks_holding(report: &Value, bytes: u64) -> Vec<&Value> {
    report["stacks"].as_array().unwrap().iter().filter(|stack| stack["bytes"] == bytes).collect()
}

/// The Python frames of a stack, innermost first.
fn python_frames(stack: &Value) -> Vec<&Value> {
    stack["frames"].as_array().unwrap().iter().filter(|frame| frame["kind"] == "python").collect()
}

/// The Python functions of a stack, innermost first.
fn python_functions(stack: &Value) -> Vec<&str> {
    python_frames(stack).iter().map(|frame| frame["function"].as_str().unwrap()).collect()
}

#[test]
fn a_freed_functions_frames_keep_their_name() {
    let mut python = start(DEBIAN_PYTHON, "python_transient.py");
    let mut memleak = attach(&python, &["-v"]);
    python.send("allocate", "allocated");
    // Said when the stack's frames are resolved, at memleak's next look
    // at its processes (every 250 ms): long before the one report.
    memleak.stderr.wait_for("the new stack resolved", |line| {
        line.contains(": Python frames resolved, the innermost transient (<string>:2) [python]")
    });
    python.send("forget", "done");
    let (report, _) = final_report(memleak);
    // bytearray(50000) asks malloc for room for a trailing NUL too.
    let kept = stacks_holding(&report, 50_001);
    assert_eq!(kept.len(), 1, "{report:#}");
    let frames = python_frames(kept[0]);
    assert_eq!((&frames[0]["function"], &frames[0]["line"]), (&Value::from("transient"), &Value::from(2)));
    assert_eq!(frames[1]["function"], "<module>", "{:#}", kept[0]);
    python.exit();
}

/// CPython reuses a freed code object's memory for the next code object
/// of its size: without BPF's check of each frame's code object, the
/// module body that allocated showed as one compiled after it, from
/// another file.
#[test]
fn code_replaced_before_it_is_read_is_never_named_as_the_other() {
    let mut python = start(PYENV_PYTHON_3_12, "python_reused_code.py");
    let memleak = attach(&python, &[]);
    python.send("allocate", "done");
    let (report, _) = final_report(memleak);
    let kept = stacks_holding(&report, 60_001);
    assert_eq!(kept.len(), 1, "{report:#}");
    let innermost = python_frames(kept[0])[0];
    let function = innermost["function"].as_str().unwrap();
    assert!(
        (function == "<module>" && innermost["file"] == "<generated module>")
            || function.starts_with("<freed code 0x"),
        "the module body, or code said to be gone, never another file's: {innermost:#}"
    );
    python.exit();
}

#[test]
fn a_process_that_starts_a_sub_interpreter_is_walked_no_more() {
    let mut python = start(PYENV_PYTHON_3_12, "python_subinterpreter.py");
    let mut memleak = attach(&python, &[]);
    python.send("keep", "kept");
    python.send("sub", "created");
    let said = format!("memleak: warn: pid {}: no more Python frames: {SUBINTERPRETERS}", python.pid());
    memleak.stderr.wait_for("the sub-interpreter seen", |line| line == said);
    python.send("keep", "kept");
    let (report, _) = final_report(memleak);
    let kept = stacks_holding(&report, 40_001);
    assert_eq!(kept.len(), 2, "one stack before the sub-interpreter, one after: {report:#}");
    let mut functions: Vec<Vec<&str>> = kept.iter().map(|stack| python_functions(stack)).collect();
    functions.sort();
    assert_eq!(functions, [vec![], vec!["keep", "<module>"]], "{report:#}");
}

#[test]
fn a_process_running_sub_interpreters_is_traced_without_python_frames() {
    let mut python = start(PYENV_PYTHON_3_12, "python_subinterpreter.py");
    python.send("sub", "created");
    let memleak = attach(&python, &[]);
    python.send("keep", "kept");
    let (report, stderr) = final_report(memleak);
    let refusal = format!("memleak: warn: pid {}: no Python frames: {SUBINTERPRETERS}", python.pid());
    assert_eq!(stderr.iter().filter(|line| **line == refusal).count(), 1, "{stderr:#?}");
    let kept = stacks_holding(&report, 40_001);
    assert_eq!(kept.len(), 1, "{report:#}");
    assert!(python_functions(kept[0]).is_empty(), "{:#}", kept[0]);
}
