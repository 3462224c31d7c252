//! --python-allocator: CPython's small objects (512 bytes and less) come
//! from its own arenas, not from malloc. With the flag, `PyObject_Malloc`
//! & co. are probed in the interpreter's object, so that each object is
//! tracked with its Python line, and the arenas are the allocator's own;
//! without it, or where the interpreter has that allocator inlined into
//! its callers (Debian's, built with link-time optimisation), the arenas
//! are labelled as the interpreter's own and counted apart.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
};

use memleak_tests::{fixture, frame_functions, workspace_root, Memleak};
use serde_json::Value;

/// Strings the fixture keeps, from one line, and lists, from another.
const COUNT: u64 = 10_000;
/// obmalloc's `ARENA_SIZE` from 3.10 on (64-bit).
const ARENA_SIZE: u64 = 1 << 20;
/// Where pyenv's interpreters are: built from source without link-time
/// optimisation, each with a shared libpython.
const PYENV: &str = "/root/.pyenv/versions";
/// Debian's own.
const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";

fn script() -> PathBuf {
    workspace_root().join("tests/fixtures/python_allocator.py")
}

/// The line of the fixture that carries `# ALLOC(marker)`.
fn line_of(marker: &str) -> u64 {
    let source = std::fs::read_to_string(script()).unwrap();
    let needle = format!("# ALLOC({marker})");
    let index =
        source.lines().position(|line| line.ends_with(&needle)).unwrap_or_else(|| panic!("no {needle}"));
    u64::try_from(index).unwrap() + 1
}

/// What a run of the fixture showed: the report taken once it had made
/// every string and list, what memleak said on stderr (the fixture's
/// lines among them), the sizes the fixture measured (each string's, each
/// list's item array's), and the arenas it had in use.
struct Run {
    report: Value,
    stderr: Vec<String>,
    string_size: u64,
    items_size: u64,
    arenas: u64,
}

/// Runs the fixture under `python` with memleak -c (a JSON report every
/// second, the top 20 stacks, `extra` arguments), once memleak has found
/// the interpreter; takes the first report, after the fixture has made
/// its strings, for which `complete` holds given the run's numbers; lets
/// the fixture exit.
fn trace(python: &Path, extra: &[&str], complete: fn(&Value, &Run) -> bool) -> Run {
    assert!(python.exists(), "{} is part of the test machine", python.display());
    let command = format!("{} {}", python.display(), script().display());
    let mut args = vec!["-c", &command, "--format", "json", "-T", "20", "1"];
    args.extend_from_slice(extra);
    let mut memleak = Memleak::start(&args);
    let size = memleak.stderr.wait_for("the fixture's string size", |line| line.starts_with("size "));
    let string_size = size["size ".len()..].parse().unwrap();
    let items = memleak.stderr.wait_for("the fixture's item array size", |line| line.starts_with("items "));
    let items_size = items["items ".len()..].parse().unwrap();
    memleak.stderr.wait_for("the fixture to start", |line| line == "ready");
    // Python frames are read once memleak has found the interpreter
    // initialised, said before "ready" or after.
    let found = |line: &str| line.starts_with("memleak: pid ") && line.contains(" runs python ");
    if !memleak.stderr.seen.iter().any(|line| found(line)) {
        memleak.stderr.wait_for("the interpreter found", found);
    }
    let stdin = memleak.stdin.as_mut().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    // sys._debugmallocstats, on the fixture's stderr, once it allocates no
    // more.
    let arenas = memleak
        .stderr
        .wait_for("the fixture's arenas", |line| line.starts_with("# arenas allocated current "));
    let arenas = arenas.rsplit(' ').next().unwrap().parse().unwrap();
    let mut run = Run { report: Value::Null, stderr: Vec::new(), string_size, items_size, arenas };
    let report = memleak.stdout.wait_for("a report holding every string", |line| {
        serde_json::from_str::<Value>(line).is_ok_and(|report| complete(&report, &run))
    });
    memleak.close_stdin();
    run.stderr = memleak.stderr.rest();
    let (status, _) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}; stderr: {:#?}", run.stderr);
    run.report = serde_json::from_str(&report).unwrap();
    run
}

/// Whether the report's top stack holds every string, and another every
/// list's item array.
fn holds_every_string_and_list(report: &Value, run: &Run) -> bool {
    let top = &report["stacks"][0];
    top["allocations"] == COUNT
        && top["bytes"] == COUNT * run.string_size
        && item_arrays(report, run).is_some()
}

/// The stack that holds every list's item array, if one does.
fn item_arrays<'a>(report: &'a Value, run: &Run) -> Option<&'a Value> {
    let stacks = report["stacks"].as_array().unwrap();
    stacks.iter().find(|stack| stack["allocations"] == COUNT && stack["bytes"] == COUNT * run.items_size)
}

/// Whether the report counts the arenas the fixture has in use as the
/// interpreter's.
fn arenas_counted(report: &Value, run: &Run) -> bool {
    report["hidden_mappings"]["python_arena_bytes"] == run.arenas * ARENA_SIZE
}

/// The Python frames of a stack, as `function (file:line)`.
fn python_frames(stack: &Value) -> Vec<String> {
    let frames = stack["frames"].as_array().unwrap();
    frames
        .iter()
        .filter(|frame| frame["kind"] == "python")
        .map(|frame| {
            format!(
                "{} ({}:{})",
                frame["function"].as_str().unwrap(),
                frame["file"].as_str().unwrap(),
                frame["line"]
            )
        })
        .collect()
}

/// The lines memleak said about --python-allocator.
fn said_about_the_flag(stderr: &[String]) -> Vec<&String> {
    stderr.iter().filter(|line| line.contains("--python-allocator: ")).collect()
}

fn small_strings_are_attributed_to_their_python_line(version: &str, header: u64) {
    let minor = &version[..version.rfind('.').unwrap()];
    let python = PathBuf::from(format!("{PYENV}/{version}/bin/python{minor}"));
    let run = trace(&python, &["--python-allocator"], holds_every_string_and_list);
    // `letter * 20` asks PyObject_Malloc for one compact ASCII str: the
    // header (sizeof(PyASCIIObject)), 20 characters and a NUL. The fixture
    // measured it with sys.getsizeof, exact for an object the garbage
    // collector does not track.
    assert_eq!(run.string_size, header + 20 + 1, "sys.getsizeof of a 20-character str on {version}");
    let top = &run.report["stacks"][0];
    let file = script().display().to_string();
    let frames = python_frames(top);
    assert_eq!(
        frames[..2],
        [
            format!("keep ({file}:{})", line_of("keep")),
            format!("<module> ({file}:{})", line_of("calls keep"))
        ],
        "{top:#}"
    );
    // A list's items are an array of pointers, from PyMem_Malloc, which
    // shares the allocator: 3 of them, 24 bytes.
    assert_eq!(run.items_size, 3 * 8);
    let items = item_arrays(&run.report, &run).unwrap();
    assert_eq!(
        python_frames(items)[0],
        format!("keep_lists ({file}:{})", line_of("keep_lists")),
        "{items:#}"
    );
    // Made by the one function that calls PyMem_Malloc for a new list.
    assert_eq!(frame_functions(items)[0], "list_new_prealloc", "{items:#}");
    assert_eq!(
        (top["allocations"].as_u64(), top["bytes"].as_u64()),
        (Some(COUNT), Some(COUNT * run.string_size))
    );
    let hidden = &run.report["hidden_mappings"];
    // Each object counted where it is, its arenas not again.
    assert_eq!(hidden.get("python_arena_bytes"), None, "{hidden:#}");
    assert!(
        hidden["allocator_bytes"].as_u64().unwrap() >= run.arenas * ARENA_SIZE,
        "{hidden:#} {}",
        run.arenas
    );
    // Blocks over 512 bytes go from PyObject_Malloc to malloc and from
    // PyObject_Free to free: each counted once, every free of a block
    // memleak saw allocated (it ran the interpreter from its start).
    assert_eq!(run.report["health"]["unrecorded_frees"], 0, "{:#}", run.report["health"]);
    assert!(said_about_the_flag(&run.stderr).is_empty(), "{:#?}", run.stderr);
    let tracing = run.stderr.iter().find(|line| line.starts_with("memleak: tracing ")).unwrap();
    let library = format!("{PYENV}/{version}/lib/libpython{minor}.so.1.0");
    assert!(
        tracing.ends_with(&format!(", with PyObject_Malloc & co. in {library}; Ctrl-C to stop")),
        "{tracing}"
    );
}

#[test]
fn pyenv_3_11_small_strings_are_attributed_to_their_python_line() {
    small_strings_are_attributed_to_their_python_line("3.11.7", 48);
}

#[test]
fn pyenv_3_12_small_strings_are_attributed_to_their_python_line() {
    // 3.12 dropped the `wstr` pointer from PyASCIIObject.
    small_strings_are_attributed_to_their_python_line("3.12.1", 40);
}

#[test]
fn without_the_flag_arenas_are_the_interpreters_own() {
    let run = trace(Path::new(DEBIAN_PYTHON), &[], arenas_counted);
    // `trace` took the report that counts every arena the fixture has
    // in use as the interpreter's own (before, they were mmap regions,
    // each blamed on the Python line that happened to open it).
    assert!(run.arenas >= 1);
    assert!(said_about_the_flag(&run.stderr).is_empty(), "{:#?}", run.stderr);
}

#[test]
fn debians_inlined_allocator_is_refused_once_and_its_arenas_are_its_own() {
    let run = trace(Path::new(DEBIAN_PYTHON), &["--python-allocator"], arenas_counted);
    let said = said_about_the_flag(&run.stderr);
    assert_eq!(said.len(), 1, "{said:#?}");
    assert!(
        said[0].starts_with(&format!(
            "memleak: warn: --python-allocator: {DEBIAN_PYTHON} has its small-object allocator inlined into "
        )),
        "{said:#?}"
    );
    let tracing = run.stderr.iter().find(|line| line.starts_with("memleak: tracing ")).unwrap();
    assert!(!tracing.contains("PyObject_Malloc"), "{tracing}");
}

#[test]
fn a_process_without_cpython_is_traced_as_ever_and_told_once() {
    let command = format!("{} all", fixture("leaker").display());
    let mut memleak = Memleak::start(&["-c", &command, "--format", "json", "--python-allocator", "3600"]);
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    memleak.close_stdin();
    let stderr = memleak.stderr.rest();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}; stderr: {stderr:#?}");
    assert!(reports.last().is_some_and(|report| report["total_allocations"].as_u64() > Some(0)));
    let said = said_about_the_flag(&stderr);
    assert_eq!(said.len(), 1, "{stderr:#?}");
    assert!(said[0].contains(": no CPython in "), "{said:#?}");
}
