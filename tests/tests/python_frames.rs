//! Python frames in reports, end to end: real interpreters (Debian's
//! python3.11, every CPython 3.8 to 3.13 under pyenv) running small
//! scripts, traced with -p and -c. Each eval-loop call of a stack is
//! replaced by the Python functions it ran, with their files and lines
//! (`"kind": "python"` in JSON), and a Python line is a stack of its own
//! with its exact bytes and allocations. Processes memleak does not walk
//! (not Python, a refused interpreter, `--python off`) and a native
//! thread that never ran Python have native stacks only.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Command,
};

use memleak_tests::{frame_functions, shared_library, workspace_root, Leaker, Memleak};
use serde_json::Value;

const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";

/// tests/fixtures/NAME.py.
fn script(name: &str) -> PathBuf {
    workspace_root().join(format!("tests/fixtures/{name}.py"))
}

/// The line of tests/fixtures/NAME.py that carries `# ALLOC(marker)`.
fn line_of(name: &str, marker: &str) -> u64 {
    let source = std::fs::read_to_string(script(name)).unwrap();
    let needle = format!("# ALLOC({marker})");
    let index = source.lines().position(|line| line.ends_with(&needle));
    index.unwrap_or_else(|| panic!("no {needle} in {name}.py")) as u64 + 1
}

/// A Python frame as the tests expect it: function, file, line.
#[derive(Debug, PartialEq, Eq)]
struct PyFrame {
    function: String,
    file: String,
    line: u64,
}

impl PyFrame {
    /// The frame of `function` in tests/fixtures/NAME.py, running the
    /// line of `marker`.
    fn at(function: &str, name: &str, marker: &str) -> Self {
        let file = script(name).display().to_string();
        Self { function: function.to_owned(), file, line: line_of(name, marker) }
    }

    fn of(frame: &Value) -> Self {
        Self {
            function: frame["function"].as_str().unwrap_or("?").to_owned(),
            file: frame["file"].as_str().unwrap_or("?").to_owned(),
            line: frame["line"].as_u64().unwrap_or(0),
        }
    }
}

fn is_python(frame: &Value) -> bool {
    frame["kind"] == "python"
}

/// The frames of a JSON stack.
fn frames(stack: &Value) -> &[Value] {
    stack["frames"].as_array().expect("frames is an array")
}

/// A stack's Python frames, innermost first.
fn python_frames(stack: &Value) -> Vec<PyFrame> {
    frames(stack).iter().filter(|frame| is_python(frame)).map(PyFrame::of).collect()
}

fn stacks(report: &Value) -> &[Value] {
    report["stacks"].as_array().expect("stacks is an array")
}

/// (bytes, allocations) of a JSON stack.
fn usage(stack: &Value) -> (u64, u64) {
    (stack["bytes"].as_u64().unwrap(), stack["allocations"].as_u64().unwrap())
}

/// What memleak must have said about the interpreter before the script
/// may allocate.
#[derive(Clone, Copy)]
enum Said<'a> {
    /// `pid N runs python VERSION (...)`: its stacks get Python frames.
    Runs(&'a str),
    /// `no Python frames: ...`.
    NoPythonFrames,
    /// Nothing to wait for (`--python off`).
    Nothing,
}

impl Said<'_> {
    fn holds(self, line: &str) -> bool {
        match self {
            Self::Runs(version) => {
                line.starts_with("memleak: pid ") && line.contains(&format!(" runs python {version} ("))
            }
            Self::NoPythonFrames => line.contains("no Python frames: "),
            Self::Nothing => true,
        }
    }
}

/// What memleak printed: its reports on stdout, and stderr.
struct Run {
    stdout: Vec<String>,
    stderr: Vec<String>,
}

impl Run {
    /// The last JSON report: the one memleak made at SIGINT, once the
    /// script had allocated everything, while it was alive.
    fn report(&self) -> Value {
        let last = self.stdout.last().unwrap_or_else(|| panic!("no report; stderr: {:#?}", self.stderr));
        serde_json::from_str(last).unwrap_or_else(|error| panic!("not JSON ({error}): {last}"))
    }
}

/// Waits until memleak has `said` what it should of the interpreter:
/// the script may allocate then. Detection may be said before the
/// script is ready or after.
fn wait_said(memleak: &mut Memleak, said: Said) {
    if !memleak.stderr.seen.iter().any(|line| said.holds(line)) {
        memleak.stderr.wait_for("memleak to find the interpreter", |line| said.holds(line));
    }
}

/// Stops memleak with SIGINT: its last report is made then.
fn stop(mut memleak: Memleak) -> Run {
    memleak.signal(libc::SIGINT);
    let stdout = memleak.stdout.rest();
    let stderr = memleak.stderr.rest();
    let status = memleak.child.wait().expect("wait for memleak");
    assert!(status.success(), "memleak exited with {status}; stderr: {stderr:#?}");
    Run { stdout, stderr }
}

fn go(stdin: &mut impl Write) {
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
}

/// Runs `python NAME.py ARGS` with memleak -c (reports every second, as
/// `format`, `extra` arguments), lets it allocate once memleak has
/// `said` what it should, and stops memleak while the script is alive.
fn run_with_command(
    python: &Path,
    name: &str,
    args: &[&str],
    said: Said,
    format: &str,
    extra: &[&str],
) -> Run {
    assert!(python.exists(), "{} is part of the test machine", python.display());
    let mut command = format!("{} {}", python.display(), script(name).display());
    for arg in args {
        command = format!("{command} {arg}");
    }
    let mut memleak_args = vec!["-c", &command, "--format", format, "-T", "1000", "1"];
    memleak_args.extend_from_slice(extra);
    let mut memleak = Memleak::start(&memleak_args);
    memleak.stderr.wait_for("the script to start", |line| line == "ready");
    wait_said(&mut memleak, said);
    if matches!(said, Said::NoPythonFrames) {
        // Two reports more, each of which would say it again if memleak
        // looked for Python again at each.
        for _ in 0..2 {
            memleak.stdout.wait_for("a report", |line| line.starts_with('{'));
        }
    }
    go(memleak.stdin.as_mut().unwrap());
    memleak.stderr.wait_for("the script to finish", |line| line == "done");
    stop(memleak)
}

/// Starts `python NAME.py ARGS`, attaches memleak -p to it once it is
/// ready (as `format`, `extra` arguments, one report at the end), lets
/// it allocate once memleak has `said` what it should, and stops memleak
/// while the script is alive.
fn run_attached(python: &Path, name: &str, args: &[&str], said: Said, format: &str, extra: &[&str]) -> Run {
    assert!(python.exists(), "{} is part of the test machine", python.display());
    let mut command = Command::new(python);
    command.arg(script(name)).args(args);
    let mut service = Leaker::start_command(command);
    let pid = service.pid().to_string();
    let mut memleak_args = vec!["-p", &pid, "--format", format, "-T", "1000", "3600"];
    memleak_args.extend_from_slice(extra);
    let mut memleak = Memleak::start(&memleak_args);
    memleak.wait_attached();
    wait_said(&mut memleak, said);
    if matches!(said, Said::Runs(_)) {
        let about_the_script = format!("memleak: pid {pid} runs python ");
        let seen = &memleak.stderr.seen;
        assert!(seen.iter().any(|line| line.starts_with(&about_the_script)), "{about_the_script}: {seen:#?}");
    }
    service.go();
    let run = stop(memleak);
    service.exit();
    run
}

/// Checks that `stack` shows `expected` (innermost first) as its Python
/// frames, merged into its native stack: native frames above them (the
/// allocator's side) and below them down to `Py_BytesMain`, none of the
/// eval loop left, and its culprit the innermost Python frame. `grouped`:
/// one eval call ran them all (3.11 and later), so they are consecutive.
fn assert_merged(stack: &Value, expected: &[PyFrame], grouped: bool) {
    let frames = frames(stack);
    let names = frame_functions(stack);
    assert_eq!(python_frames(stack), expected, "{names:?}");
    let at: Vec<usize> = (0..frames.len()).filter(|&index| is_python(&frames[index])).collect();
    let (first, last) = (at[0], at[at.len() - 1]);
    // Both scripts allocate with bytearray(n), whose C code calls malloc.
    assert!(
        names[..first].contains(&"PyByteArray_Resize"),
        "native frames from the allocation up to the first Python frame: {names:?}"
    );
    if grouped {
        assert_eq!(last - first + 1, at.len(), "one eval call's Python frames, together: {names:?}");
    }
    assert!(names[last..].contains(&"Py_BytesMain"), "native frames down to the root: {names:?}");
    assert!(
        !names.contains(&"_PyEval_EvalFrameDefault"),
        "each eval-loop call replaced by the Python frames it ran: {names:?}"
    );
    let culprit = &stack["culprit"];
    assert!(is_python(culprit) && PyFrame::of(culprit) == expected[0], "culprit {culprit}");
}

/// `python_service.py`: what the stack of its kept blocks holds.
mod service {
    use super::PyFrame;

    /// `bytearray(100_003)` asks malloc for a trailing NUL too.
    pub const MALLOC: u64 = 100_003 + 1;
    pub const COUNT: u64 = 30;

    /// The Python frames of the stack of the kept blocks, innermost first.
    pub fn frames() -> Vec<PyFrame> {
        [
            ("Cache.remember", "remember"),
            ("Service.handle", "handle calls remember"),
            ("serve", "serve calls handle"),
            ("main", "main calls serve"),
            ("<module>", "module calls main"),
        ]
        .into_iter()
        .map(|(function, marker)| PyFrame::at(function, "python_service", marker))
        .collect()
    }
}

/// The service's stack of kept blocks is a report's first (by bytes),
/// with its exact bytes and its Python frames, `depth` of them.
fn assert_service_stack(report: &Value, depth: usize) {
    let top = &stacks(report)[0];
    assert_eq!(usage(top), (service::COUNT * service::MALLOC, service::COUNT), "{top:#}");
    assert_merged(top, &service::frames()[..depth], true);
}

#[test]
fn debian_python_attached_with_p_shows_the_methods_that_keep_memory() {
    let run =
        run_attached(Path::new(DEBIAN_PYTHON), "python_service", &[], Said::Runs("3.11.2"), "json", &[]);
    assert_service_stack(&run.report(), 5);
}

#[test]
fn debian_python_run_with_c_shows_the_methods_that_keep_memory() {
    let run =
        run_with_command(Path::new(DEBIAN_PYTHON), "python_service", &[], Said::Runs("3.11.2"), "json", &[]);
    assert_service_stack(&run.report(), 5);
}

#[test]
fn max_python_depth_keeps_the_innermost_python_frames() {
    let run = run_attached(
        Path::new(DEBIAN_PYTHON),
        "python_service",
        &[],
        Said::Runs("3.11.2"),
        "json",
        &["--max-python-depth", "2"],
    );
    assert_service_stack(&run.report(), 2);
}

/// `python_frames.py`: two functions allocate through the same native
/// path, COUNT blocks each, of their own sizes.
mod two_lines {
    pub const COUNT: u64 = 50;
    /// What `bytearray(n)` asks malloc for: room for a trailing NUL too.
    pub const SMALL_MALLOC: u64 = 30_011 + 1;
    pub const LARGE_MALLOC: u64 = 70_013 + 1;
}

/// Runs `python_frames.py` under `python` (CPython `version`) with -c: each
/// function's line is a stack of its own, with that function's blocks
/// exactly, and Python frames merged into the native stack.
fn each_python_line_is_a_stack_of_its_own(python: &str, version: &str, interpreter: &str, grouped: bool) {
    let run = run_with_command(Path::new(python), "python_frames", &[], Said::Runs(version), "json", &[]);
    let said = run.stderr.iter().find(|line| Said::Runs(version).holds(line)).unwrap();
    assert!(said.contains(&format!(" ({interpreter}): ")), "the interpreter is {interpreter}: {said}");
    let report = run.report();
    for (function, malloc) in [("small", two_lines::SMALL_MALLOC), ("large", two_lines::LARGE_MALLOC)] {
        let expected = [
            PyFrame::at(function, "python_frames", function),
            PyFrame::at("allocate", "python_frames", &format!("calls {function}")),
            PyFrame::at("<module>", "python_frames", "calls allocate"),
        ];
        // Blocks from malloc: not an arena CPython's allocator might map
        // for its small objects meanwhile, under the same Python frames.
        let at: Vec<&Value> = stacks(&report)
            .iter()
            .filter(|stack| python_frames(stack) == expected && stack["mapping"].is_null())
            .collect();
        assert_eq!(at.len(), 1, "one stack for {function}'s line: {report:#}");
        assert_eq!(usage(at[0]), (two_lines::COUNT * malloc, two_lines::COUNT), "{function}: {:#}", at[0]);
        assert_merged(at[0], &expected, grouped);
    }
}

/// As `each_python_line_is_a_stack_of_its_own` for pyenv's CPython
/// `version`, whose interpreter is in libpython3.X.so.1.0.
fn pyenv_lines_are_stacks_of_their_own(version: &str, grouped: bool) {
    let minor = &version[..version.rfind('.').unwrap()];
    let root = format!("/root/.pyenv/versions/{version}");
    let interpreter = format!("{root}/lib/libpython{minor}.so.1.0");
    each_python_line_is_a_stack_of_its_own(
        &format!("{root}/bin/python{minor}"),
        version,
        &interpreter,
        grouped,
    );
}

#[test]
fn debian_python_3_11_lines_are_stacks_of_their_own() {
    // Static: the interpreter is in the executable, not PIE.
    each_python_line_is_a_stack_of_its_own(DEBIAN_PYTHON, "3.11.2", DEBIAN_PYTHON, true);
}

// pyenv's builds link a shared libpython3.X.so, mapped after the exec.

#[test]
fn pyenv_python_3_8_lines_are_stacks_of_their_own() {
    // Up to 3.10 each Python frame has a native eval call of its own.
    pyenv_lines_are_stacks_of_their_own("3.8.18", false);
}

#[test]
fn pyenv_python_3_9_lines_are_stacks_of_their_own() {
    pyenv_lines_are_stacks_of_their_own("3.9.18", false);
}

#[test]
fn pyenv_python_3_10_lines_are_stacks_of_their_own() {
    pyenv_lines_are_stacks_of_their_own("3.10.13", false);
}

#[test]
fn pyenv_python_3_11_lines_are_stacks_of_their_own() {
    pyenv_lines_are_stacks_of_their_own("3.11.7", true);
}

#[test]
fn pyenv_python_3_12_lines_are_stacks_of_their_own() {
    pyenv_lines_are_stacks_of_their_own("3.12.1", true);
}

#[test]
fn pyenv_python_3_13_lines_are_stacks_of_their_own() {
    pyenv_lines_are_stacks_of_their_own("3.13.0", true);
}

/// No stack of `report` has a Python frame.
fn assert_native_only(report: &Value) {
    for stack in stacks(report) {
        assert!(!frames(stack).iter().any(is_python), "a Python frame in {stack:#}");
    }
}

/// Native stacks see both functions of `python_frames.py` as one stack.
fn assert_both_lines_in_one_stack(report: &Value) {
    let both = (two_lines::COUNT * (two_lines::SMALL_MALLOC + two_lines::LARGE_MALLOC), 2 * two_lines::COUNT);
    assert!(stacks(report).iter().any(|stack| usage(stack) == both), "one stack of {both:?}: {report:#}");
}

#[test]
fn an_interpreter_refused_is_traced_without_python_frames_said_once() {
    let run = run_with_command(
        Path::new("/root/.pyenv/versions/3.7.16/bin/python3.7"),
        "python_frames",
        &[],
        Said::NoPythonFrames,
        "json",
        &[],
    );
    let report = run.report();
    assert_native_only(&report);
    assert_both_lines_in_one_stack(&report);
    let said: Vec<&String> = run.stderr.iter().filter(|line| line.contains("no Python frames: ")).collect();
    assert_eq!(said.len(), 1, "said once: {:#?}", run.stderr);
    assert!(said[0].contains("3.7.16"), "{}", said[0]);
}

#[test]
fn python_off_leaves_stacks_native() {
    let run = run_with_command(
        Path::new(DEBIAN_PYTHON),
        "python_frames",
        &[],
        Said::Nothing,
        "json",
        &["--python", "off"],
    );
    let report = run.report();
    assert_native_only(&report);
    assert_both_lines_in_one_stack(&report);
    assert!(!run.stderr.iter().any(|line| line.contains("runs python")), "{:#?}", run.stderr);
}

/// What a report says of its stacks, as a test compares two runs: each
/// stack's frames (function, file, line, kind), bytes and allocations.
fn stack_summaries(report: &Value) -> Vec<String> {
    let mut summaries: Vec<String> = stacks(report)
        .iter()
        .map(|stack| {
            let frames: Vec<String> = frames(stack)
                .iter()
                .map(|frame| {
                    format!("{} {} {} {}", frame["function"], frame["file"], frame["line"], frame["kind"])
                })
                .collect();
            format!("{} {} {}", stack["bytes"], stack["allocations"], frames.join(" <- "))
        })
        .collect();
    summaries.sort();
    summaries
}

#[test]
fn a_process_that_is_not_python_is_reported_as_with_python_off() {
    let auto = memleak_tests::trace_command("all", &[]);
    let off = memleak_tests::trace_command("all", &["--python", "off"]);
    assert_native_only(&auto);
    assert_eq!(auto["total_bytes"], 17_264, "{auto:#}");
    assert_eq!(stack_summaries(&auto), stack_summaries(&off));
}

#[test]
fn a_native_thread_that_never_ran_python_has_no_python_frames() {
    let library = shared_library("native_thread");
    let run = run_attached(
        Path::new(DEBIAN_PYTHON),
        "python_service",
        &["native-thread", library.to_str().unwrap()],
        Said::Runs("3.11.2"),
        "json",
        &[],
    );
    let report = run.report();
    // The process is walked: its Python thread's blocks have their frames.
    assert_service_stack(&report, 5);
    // One stack, unless the compiler unrolled the loop into several calls.
    let mut native = (0, 0);
    for stack in stacks(&report).iter().filter(|stack| frame_functions(stack)[0] == "keep_blocks") {
        assert!(!frames(stack).iter().any(is_python), "{stack:#}");
        assert!(frame_functions(stack).contains(&"start_thread"), "{stack:#}");
        native = (native.0 + usage(stack).0, native.1 + usage(stack).1);
    }
    // NATIVE_BLOCKS blocks of NATIVE_BLOCK_SIZE bytes in native_thread.c.
    assert_eq!(native, (6 * 40_009, 6), "{report:#}");
}

#[test]
fn folded_stacks_name_the_python_functions() {
    let run =
        run_attached(Path::new(DEBIAN_PYTHON), "python_service", &[], Said::Runs("3.11.2"), "folded", &[]);
    // Root first, and the bytes last.
    let python = ";<module>;main;serve;Service.handle;Cache.remember;";
    let bytes = format!(" {}", service::COUNT * service::MALLOC);
    let kept: Vec<&String> =
        run.stdout.iter().filter(|line| line.contains(python) && line.ends_with(&bytes)).collect();
    assert_eq!(kept.len(), 1, "{python} and{bytes} in one line: {:#?}", run.stdout);
    assert!(kept[0].contains(";Py_BytesMain;"), "{}", kept[0]);
}

#[test]
fn pprof_profiles_hold_python_functions_with_file_and_line() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-python-pprof");
    let output = dir.path().join("service.pb.gz");
    let run = run_attached(
        Path::new(DEBIAN_PYTHON),
        "python_service",
        &[],
        Said::Runs("3.11.2"),
        "pprof",
        &["--output", output.to_str().unwrap()],
    );
    assert!(run.stdout.is_empty(), "{:#?}", run.stdout);
    let profiles: Vec<PathBuf> =
        std::fs::read_dir(dir.path()).unwrap().map(|entry| entry.unwrap().path()).collect();
    assert_eq!(profiles.len(), 1, "one report: {profiles:?}");
    let traces = memleak_tests::go_pprof(&profiles[0], &["-traces", "-lines"]);
    for frame in service::frames() {
        let shown = format!("{} {}:{}", frame.function, frame.file, frame.line);
        assert!(traces.contains(&shown), "{shown} in {traces}");
    }
}

/// CPython 3.13 runs a class's `__init__`, once the call is specialised,
/// under a frame of its own (`_Py_InitCleanup`, named `__init__`, with no
/// line) that tracebacks leave out: so do reports.
#[test]
fn python_3_13_specialised_init_calls_show_no_frame_of_cpython() {
    let run = run_attached(
        Path::new("/root/.pyenv/versions/3.13.0/bin/python3.13"),
        "python_init",
        &[],
        Said::Runs("3.13.0"),
        "json",
        &[],
    );
    let report = run.report();
    let expected = [
        PyFrame::at("Entry.__init__", "python_init", "init"),
        PyFrame::at("fill", "python_init", "fill calls init"),
        PyFrame::at("<module>", "python_init", "module calls fill"),
    ];
    let through_init: Vec<&Value> = stacks(&report)
        .iter()
        .filter(|stack| {
            frames(stack).iter().any(|frame| is_python(frame) && frame["function"] == "Entry.__init__")
        })
        .collect();
    // Unspecialised (the first) and specialised calls run through
    // different native frames: one stack each, the same Python frames.
    assert_eq!(through_init.len(), 2, "{report:#}");
    let mut total = (0, 0);
    for stack in &through_init {
        assert_eq!(python_frames(stack), expected, "{stack:#}");
        total = (total.0 + usage(stack).0, total.1 + usage(stack).1);
    }
    assert_eq!(total, (20 * (60_013 + 1), 20), "{report:#}");
}

/// Runs `memleak ARGS` to its end and returns its stdout.
fn memleak_output(args: &[&str]) -> String {
    let output = Command::new(memleak_tests::memleak_binary()).args(args).output().expect("run memleak");
    assert!(output.status.success(), "memleak {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("UTF-8")
}

/// A snapshot saved with --save keeps the Python frames: rendered later,
/// as JSON it holds the live report's, as text each is a line of its own
/// marked `[python]`, and a flame graph names them.
#[test]
fn saved_snapshots_render_python_frames_in_every_format() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-python-save");
    let save = dir.path().join("heap.snap");
    let run = run_attached(
        Path::new(DEBIAN_PYTHON),
        "python_service",
        &[],
        Said::Runs("3.11.2"),
        "json",
        &["--save", save.to_str().unwrap()],
    );
    let snapshots: Vec<PathBuf> =
        std::fs::read_dir(dir.path()).unwrap().map(|entry| entry.unwrap().path()).collect();
    assert_eq!(snapshots.len(), 1, "one report: {snapshots:?}");
    let snapshot = snapshots[0].to_str().unwrap();
    let json = memleak_output(&["report", snapshot, "--format", "json"]);
    let saved: Value = serde_json::from_str(json.trim_end()).unwrap();
    assert_service_stack(&saved, 5);
    assert_eq!(stacks(&saved)[0]["frames"], stacks(&run.report())[0]["frames"]);
    let text = memleak_output(&["report", snapshot, "--format", "text"]);
    let shown: Vec<String> = service::frames()
        .iter()
        .map(|frame| format!("\t\t{} ({}:{}) [python]", frame.function, frame.file, frame.line))
        .collect();
    assert!(text.contains(&shown.join("\n")), "{shown:#?} in {text}");
    assert!(text.contains(&format!("\t\tculprit: {}\n", &shown[0][2..])), "{text}");
    let svg = memleak_output(&["report", snapshot, "--format", "svg"]);
    // Well-formed; each frame named in a title of its own. Read raw:
    // svg_titles splits a title at an entity (`&lt;module&gt;`).
    memleak_tests::svg_titles(&svg);
    for frame in service::frames() {
        let title = format!("<title>{} (", frame.function.replace('<', "&lt;").replace('>', "&gt;"));
        assert!(svg.contains(&title), "{title} in {svg}");
    }
}
