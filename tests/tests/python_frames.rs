//! --python-frames: the BPF side walks a CPython process's frames into
//! each stack, after its native frames. Two Python functions that
//! allocate through the same native path get a stack id each, every call
//! of one the same, and each stack's Python words resolve to the exact
//! function and line that allocated (said at debug level: reports do not
//! show Python frames yet, and merge stacks whose native frames are the
//! same, as these two are).

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use memleak_tests::{workspace_root, Memleak};
use serde_json::Value;

/// Blocks each function of the fixture allocates.
const COUNT: u64 = 50;
/// What `bytearray(n)` asks malloc for: room for a trailing NUL too.
const SMALL_MALLOC: u64 = 30_011 + 1;
const LARGE_MALLOC: u64 = 70_013 + 1;

fn script() -> PathBuf {
    workspace_root().join("tests/fixtures/python_frames.py")
}

/// The line of the fixture that carries `# ALLOC(marker)`.
fn line_of(marker: &str) -> usize {
    let source = std::fs::read_to_string(script()).unwrap();
    let needle = format!("# ALLOC({marker})");
    source.lines().position(|line| line.ends_with(&needle)).unwrap_or_else(|| panic!("no {needle}")) + 1
}

/// The Python frames memleak should say for a stack of `function`: it,
/// its caller, the module, one native eval call for all of them (3.11+).
fn expected_frames(function: &str, grouped: bool) -> String {
    let file = script().display().to_string();
    // " |" ends the frames one native eval call ran.
    let inner = |frame: String| if grouped { frame } else { format!("{frame} |") };
    [
        inner(format!("{function} ({file}:{})", line_of(function))),
        inner(format!("allocate ({file}:{})", line_of(&format!("calls {function}")))),
        format!("<module> ({file}:{}) |", line_of("calls allocate")),
    ]
    .join(" <- ")
}

/// Runs the fixture under `python` with memleak -c (reports every second,
/// `extra` arguments), once memleak has `found` the interpreter if told
/// to wait for it, until a report taken once it has allocated every
/// block, alive, is `complete`; lets it exit. Returns that report and
/// memleak's stderr, which has said each new stack's Python frames before
/// the report that first held it.
fn trace(
    python: &Path,
    extra: &[&str],
    found: Option<&str>,
    complete: fn(&Value) -> bool,
) -> (Value, Vec<String>) {
    let command = format!("{} {}", python.display(), script().display());
    let mut args = vec!["-c", &command, "--format", "json", "-T", "1000", "1"];
    args.extend_from_slice(extra);
    let mut memleak = Memleak::start(&args);
    memleak.stderr.wait_for("the fixture to start", |line| line == "ready");
    if let Some(version) = found {
        // Detection retries at each report until the interpreter is ready.
        // Said before "ready" or after, as the two processes run.
        let said = format!("python {version} (");
        let found = |line: &str| line.starts_with("memleak: info: pid ") && line.contains(&said);
        if !memleak.stderr.seen.iter().any(|line| found(line)) {
            memleak.stderr.wait_for("the interpreter found", found);
        }
    }
    let stdin = memleak.stdin.as_mut().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    let report = memleak.stdout.wait_for("a report holding every block", |line| {
        serde_json::from_str::<Value>(line).is_ok_and(|report| complete(&report))
    });
    memleak.close_stdin();
    let stderr = memleak.stderr.rest();
    let (status, _) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}; stderr: {stderr:#?}");
    (serde_json::from_str(&report).unwrap(), stderr)
}

/// Whether a report holds every block of both functions, under their
/// native stack, the same for both.
fn holds_both(report: &Value) -> bool {
    report["stacks"].as_array().unwrap().iter().any(|stack| {
        stack["allocations"] == 2 * COUNT && stack["bytes"] == COUNT * (SMALL_MALLOC + LARGE_MALLOC)
    })
}

/// The ids of the stacks memleak said have Python frames `frames`.
fn stacks_said(stderr: &[String], frames: &str) -> Vec<u64> {
    let mut ids: Vec<u64> = stderr
        .iter()
        .filter_map(|line| {
            let (head, said) = line.split_once(" frames: ")?;
            let id = head.split_once(": stack 0x")?.1.split_once(':')?.0;
            (said == frames).then(|| u64::from_str_radix(id, 16).unwrap())
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn python_lines_get_stacks_of_their_own(python: &str, version: &str, grouped: bool) {
    let python = Path::new(python);
    assert!(python.exists(), "{} is part of the test machine", python.display());
    let (report, stderr) = trace(python, &["-v", "--python-frames"], Some(version), holds_both);
    let small = stacks_said(&stderr, &expected_frames("small", grouped));
    let large = stacks_said(&stderr, &expected_frames("large", grouped));
    // One id for the 50 calls of each: the same Python path interns to one
    // stack, and the two lines to two.
    assert_eq!((small.len(), large.len()), (1, 1), "{stderr:#?}");
    assert_ne!(small, large);
    // The report's stack of both is one of them: these are the stacks
    // that hold the blocks.
    let merged = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|stack| stack["allocations"] == 2 * COUNT)
        .and_then(|stack| stack["stack_id"].as_u64())
        .unwrap();
    assert!([small[0], large[0]].contains(&merged), "{merged:#x} is {small:x?} or {large:x?}");
}

#[test]
fn debian_python_3_11_lines_get_stacks_of_their_own() {
    python_lines_get_stacks_of_their_own("/usr/bin/python3.11", "3.11.2", true);
}

#[test]
fn pyenv_python_3_12_lines_get_stacks_of_their_own() {
    python_lines_get_stacks_of_their_own("/root/.pyenv/versions/3.12.1/bin/python3.12", "3.12.1", true);
}

#[test]
fn pyenv_python_3_10_lines_get_stacks_of_their_own() {
    // Up to 3.10 each Python frame has a native eval call of its own.
    python_lines_get_stacks_of_their_own("/root/.pyenv/versions/3.10.13/bin/python3.10", "3.10.13", false);
}

#[test]
fn pyenv_python_3_13_lines_get_stacks_of_their_own() {
    python_lines_get_stacks_of_their_own("/root/.pyenv/versions/3.13.0/bin/python3.13", "3.13.0", true);
}
