//! Python frames in the shapes real services take: threads, code that
//! allocates with the GIL released, forked workers, a process that execs
//! into Python, a script traced from its first line, and a container.
//! Each test checks the exact Python frames (function, file and line, the
//! lines found by `# ALLOC(marker)` in the fixture), bytes and counts of
//! the JSON report.

use std::{
    io::Write as _,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use memleak_tests::{tempdir::TempDir, workspace_root, Leaker, Memleak};
use serde_json::Value;

const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";
const PYENV_PYTHON: &str = "/root/.pyenv/versions/3.12.1/bin/python3.12";

/// Native frames between a thread's function and `Thread.run` on
/// Debian's 3.11 (`_PyFunction_Vectorcall`): see `assert_threads`.
const DEBIAN_BETWEEN_THREAD_GROUPS: usize = 1;

/// Blocks each allocating function of the fixture keeps.
const COUNT: u64 = 20;

fn fixture(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures").join(name)
}

fn workers_script() -> PathBuf {
    fixture("python_workers.py")
}

/// The line of `file` that carries `# ALLOC(marker)`.
fn line_of(file: &Path, marker: &str) -> u64 {
    let source = std::fs::read_to_string(file).unwrap();
    let needle = format!("# ALLOC({marker})");
    let index = source.lines().position(|line| line.ends_with(&needle));
    index.unwrap_or_else(|| panic!("no {needle} in {}", file.display())) as u64 + 1
}

/// A Python frame as the JSON report says it: function, file, line.
type PyFrame = (String, String, u64);

fn frame(function: &str, file: &Path, line: u64) -> PyFrame {
    (function.to_owned(), file.display().to_string(), line)
}

/// The frame of `function` at the line of `marker` of `script`, `script`
/// named as `shown` (the path the process sees).
fn at(function: &str, script: &Path, shown: &Path, marker: &str) -> PyFrame {
    frame(function, shown, line_of(script, marker))
}

/// The Python frames of a stack, innermost first.
fn python_frames(stack: &Value) -> Vec<PyFrame> {
    stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|frame| frame["kind"] == "python")
        .map(|frame| {
            (
                frame["function"].as_str().unwrap_or("?").to_owned(),
                frame["file"].as_str().unwrap_or("?").to_owned(),
                frame["line"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// The stacks of a report whose Python frames are `expected`.
fn stacks_with<'a>(report: &'a Value, expected: &[PyFrame]) -> Vec<&'a Value> {
    let stacks = report["stacks"].as_array().unwrap();
    stacks.iter().filter(|stack| python_frames(stack) == expected).collect()
}

/// (bytes, allocations) of the stacks whose Python frames are `expected`.
fn usage_with(report: &Value, expected: &[PyFrame]) -> (u64, u64) {
    stacks_with(report, expected).iter().fold((0, 0), |(bytes, count), stack| {
        (bytes + stack["bytes"].as_u64().unwrap(), count + stack["allocations"].as_u64().unwrap())
    })
}

/// The native function names of a stack, innermost first.
fn native_functions(stack: &Value) -> Vec<&str> {
    let frames = stack["frames"].as_array().unwrap();
    let native = frames.iter().filter(|frame| frame["kind"] != "python");
    native.map(|frame| frame["function"].as_str().unwrap_or("?")).collect()
}

/// Where the allocating Python frames end and the native root begins: the
/// frames after the last Python one.
fn native_root(stack: &Value) -> Vec<&str> {
    let frames = stack["frames"].as_array().unwrap();
    let last_python = frames.iter().rposition(|frame| frame["kind"] == "python").unwrap();
    frames[last_python + 1..].iter().map(|frame| frame["function"].as_str().unwrap_or("?")).collect()
}

/// What `bytearray(n)` asks malloc for: room for a trailing NUL too.
fn bytearray_malloc(n: u64) -> u64 {
    n + 1
}

/// Starts memleak -c `command`, a JSON report every second.
fn start(command: &str, extra: &[&str]) -> Memleak {
    let mut args = vec!["-c", command, "--format", "json", "-T", "1000", "1"];
    args.extend_from_slice(extra);
    Memleak::start(&args)
}

/// Waits for a report of process `pid` (any process if `None`) for
/// which `complete` holds; returns it.
fn wait_report(
    memleak: &mut Memleak,
    pid: Option<u64>,
    what: &str,
    complete: impl Fn(&Value) -> bool,
) -> Value {
    let line = memleak.stdout.wait_for(what, |line| {
        serde_json::from_str::<Value>(line)
            .is_ok_and(|report| pid.is_none_or(|pid| report["pid"] == pid) && complete(&report))
    });
    serde_json::from_str(&line).unwrap()
}

/// Writes a line to memleak's stdin, which a -c command inherited.
fn send(memleak: &mut Memleak, line: &str) {
    let stdin = memleak.stdin.as_mut().unwrap();
    stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
    stdin.flush().unwrap();
}

/// Waits for memleak to say it found the interpreter of a process.
fn wait_python_found(memleak: &mut Memleak) -> u64 {
    let found = |line: &str| line.starts_with("memleak: pid ") && line.contains(" runs python ");
    let line = match memleak.stderr.seen.iter().find(|line| found(line)) {
        Some(line) => line.clone(),
        None => memleak.stderr.wait_for("the interpreter found", found),
    };
    line.split(' ').nth(2).unwrap().parse().unwrap()
}

/// Lets the -c command exit (its stdin closes) and checks that memleak
/// ended well.
fn finish(mut memleak: Memleak) {
    memleak.close_stdin();
    let stderr = memleak.stderr.rest();
    let (status, _) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}; stderr: {stderr:#?}");
}

/// The file of `python`'s threading module, and the lines of `Thread.run`,
/// `Thread._bootstrap_inner` and `Thread._bootstrap` that call the next.
fn threading_frames(python: &str, shown_root: &Path) -> Vec<PyFrame> {
    let output =
        Command::new(python).args(["-c", "import threading; print(threading.__file__)"]).output().unwrap();
    let file = PathBuf::from(String::from_utf8(output.stdout).unwrap().trim());
    let source = std::fs::read_to_string(&file).unwrap();
    let line = |text: &str| {
        let index = source.lines().position(|line| line.trim() == text);
        index.unwrap_or_else(|| panic!("no {text} in {}", file.display())) as u64 + 1
    };
    let shown = shown_root.join(file.strip_prefix("/").unwrap());
    vec![
        frame("Thread.run", &shown, line("self._target(*self._args, **self._kwargs)")),
        frame("Thread._bootstrap_inner", &shown, line("self.run()")),
        frame("Thread._bootstrap", &shown, line("self._bootstrap_inner()")),
    ]
}

/// The Python stacks of the fixture's two threads, with their bytes: each
/// thread's function, then the threading module's frames that ran it.
fn thread_stacks(python: &str, script: &Path, shown: &Path, shown_root: &Path) -> [(Vec<PyFrame>, u64); 2] {
    let threading = threading_frames(python, shown_root);
    let stack = |function: &str| {
        let mut frames = vec![at(function, script, shown, function)];
        frames.extend(threading.iter().cloned());
        frames
    };
    [
        (stack("resize_images"), COUNT * bytearray_malloc(40_009)),
        (stack("parse_requests"), COUNT * bytearray_malloc(50_021)),
    ]
}

/// Checks a report of the threads mode: each thread's blocks under its
/// own Python frames, none under the main thread's, the thread's native
/// root (`start_thread`, not `Py_BytesMain`) after its frames, and
/// `native_between` native frames between the thread's function and
/// `Thread.run`.
fn assert_threads(report: &Value, expected: &[(Vec<PyFrame>, u64); 2], native_between: usize) {
    for (frames, bytes) in expected {
        assert_eq!(usage_with(report, frames), (*bytes, COUNT), "{frames:?} in {report:#}");
        for stack in stacks_with(report, frames) {
            let root = native_root(stack);
            assert!(root.contains(&"start_thread") && !root.contains(&"Py_BytesMain"), "{stack:#}");
            // Where the merge puts native frames between the thread's
            // function and Thread.run: 3.11 runs `self._target(*args,
            // **kwargs)` (CALL_FUNCTION_EX) through PyObject_Call, a new
            // eval call whose native callers come between the two groups;
            // 3.12 runs a Python target in the same eval call.
            let functions: Vec<&str> = stack["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["function"].as_str().unwrap_or("?"))
                .collect();
            let own = functions.iter().position(|f| *f == frames[0].0).unwrap();
            let run = functions.iter().position(|f| *f == "Thread.run").unwrap();
            assert_eq!(run - own - 1, native_between, "native frames between them: {functions:?}");
        }
    }
    let main_thread_function = |stack: &&Value| {
        python_frames(stack).first().is_some_and(|frame| frame.0 == "run_threads")
            && stack["bytes"].as_u64().unwrap() >= bytearray_malloc(40_009)
    };
    let stacks = report["stacks"].as_array().unwrap();
    assert!(
        !stacks.iter().any(|stack| main_thread_function(&stack)),
        "no blocks on the main thread: {report:#}"
    );
}

/// Runs the threads mode under `python` with -c; checks its report.
fn threads_keep_their_own_python_frames(python: &str, native_between: usize) {
    let script = workers_script();
    let command = format!("{python} {} threads", script.display());
    let mut memleak = start(&command, &[]);
    memleak.stderr.wait_for("the fixture to start", |line| line == "ready");
    wait_python_found(&mut memleak);
    send(&mut memleak, "go");
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    let expected = thread_stacks(python, &script, &script, Path::new("/"));
    let report = wait_report(&mut memleak, None, "a report holding both threads' blocks", |report| {
        expected.iter().all(|(frames, bytes)| usage_with(report, frames).0 == *bytes)
    });
    assert_threads(&report, &expected, native_between);
    finish(memleak);
}

#[test]
fn debian_python_threads_keep_their_own_python_frames() {
    threads_keep_their_own_python_frames(DEBIAN_PYTHON, DEBIAN_BETWEEN_THREAD_GROUPS);
}

#[test]
fn pyenv_python_3_12_threads_keep_their_own_python_frames() {
    threads_keep_their_own_python_frames(PYENV_PYTHON, 0);
}

#[test]
fn an_allocation_made_with_the_gil_released_has_its_python_line() {
    // os.scandir() calls opendir() between Py_BEGIN_ALLOW_THREADS and
    // Py_END_ALLOW_THREADS (CPython's os_scandir_impl): with the GIL
    // released, _PyRuntime's current thread state is NULL (measured with
    // gdb at opendir: gilstate.tstate_current is 0 there, and not in
    // PyObject_Free), but the thread's TSS slot, which the walk reads,
    // still holds its thread state, whose frames are those of the line
    // that called scandir. (zlib.compress releases the GIL around
    // deflate() only, which allocates nothing: deflateInit2 allocates
    // with the GIL held.) The iterator keeps its DIR, which glibc 2.36's
    // __alloc_dir mallocs as the 48 bytes of struct __dirstream and a
    // buffer of st_blksize bytes, at least 32 KiB and at most 1 MiB.
    let script = workers_script();
    let command = format!("{DEBIAN_PYTHON} {} released-gil", script.display());
    let mut memleak = start(&command, &[]);
    memleak.stderr.wait_for("the fixture to start", |line| line == "ready");
    wait_python_found(&mut memleak);
    send(&mut memleak, "go");
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    let block_size = std::fs::metadata("/").unwrap().blksize().clamp(32 * 1024, 1024 * 1024);
    let dir_bytes = 48 + block_size;
    let expected = [
        at("list_directories", &script, &script, "scandir"),
        at("<module>", &script, &script, "calls list_directories"),
    ];
    let report = wait_report(&mut memleak, None, "a report holding every DIR", |report| {
        usage_with(report, &expected).1 == COUNT
    });
    // Summed over two stacks: 3.11's adaptive interpreter calls scandir
    // through PyObject_Vectorcall until it has specialised the call, then
    // from the eval loop directly; both have the same Python frames.
    assert_eq!(usage_with(&report, &expected), (COUNT * dir_bytes, COUNT), "{report:#}");
    for stack in stacks_with(&report, &expected) {
        let native = native_functions(stack);
        assert!(native.iter().take(3).any(|function| function.contains("opendir")), "{native:?}");
    }
    finish(memleak);
}

/// The workers the fork mode forks.
const WORKERS: u64 = 3;

/// (child, parent) from "memleak: tracing pid CHILD, forked by pid PARENT".
fn forked(line: &str) -> (u64, u64) {
    let words: Vec<&str> = line.split([' ', ',']).collect();
    (words[3].parse().unwrap(), words[8].parse().unwrap())
}

/// Waits until memleak has said it traces each of the `WORKERS` workers
/// of `parent`; returns their pids.
fn wait_workers(memleak: &mut Memleak, parent: u64) -> Vec<u64> {
    let mut workers = Vec::new();
    for line in &memleak.stderr.seen {
        if line.contains(", forked by pid ") {
            workers.push(forked(line));
        }
    }
    while (workers.len() as u64) < WORKERS {
        let line = memleak.stderr.wait_for("a worker followed", |line| line.contains(", forked by pid "));
        workers.push(forked(&line));
    }
    assert!(workers.iter().all(|&(_, by)| by == parent), "{workers:?} forked by {parent}");
    workers.into_iter().map(|(child, _)| child).collect()
}

/// Worker `number`'s bytes: `COUNT` blocks of `30_011 + 1000 * number`.
fn worker_bytes(number: u64) -> u64 {
    COUNT * bytearray_malloc(30_011 + 1000 * number)
}

/// Waits for a report of each worker holding its blocks under the worker
/// function's frames, and checks them: each worker has its own blocks,
/// and the parent none of them.
fn assert_workers(memleak: &mut Memleak, parent: u64, workers: &[u64]) {
    let script = workers_script();
    let expected = [
        at("worker", &script, &script, "worker"),
        at("run_workers", &script, &script, "calls worker"),
        at("<module>", &script, &script, "calls run_workers"),
    ];
    let mut seen = Vec::new();
    for &worker in workers {
        let report = wait_report(memleak, Some(worker), "a report of the worker's blocks", |report| {
            usage_with(report, &expected).1 == COUNT
        });
        let (bytes, count) = usage_with(&report, &expected);
        assert_eq!(count, COUNT, "{report:#}");
        seen.push(bytes);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..WORKERS).map(worker_bytes).collect::<Vec<_>>(), "each worker its own blocks");
    let report = wait_report(memleak, Some(parent), "a report of the parent", |_| true);
    assert_eq!(usage_with(&report, &expected), (0, 0), "{report:#}");
}

#[test]
fn forked_workers_of_a_command_have_the_worker_functions_frames() {
    let script = workers_script();
    let command = format!("{DEBIAN_PYTHON} {} fork {WORKERS}", script.display());
    let mut memleak = start(&command, &[]);
    memleak.stderr.wait_for("the fixture to start", |line| line == "ready");
    let parent = wait_python_found(&mut memleak);
    send(&mut memleak, "go");
    memleak.stderr.wait_for("the workers forked", |line| line == "forked");
    let workers = wait_workers(&mut memleak, parent);
    send(&mut memleak, "go");
    memleak.stderr.wait_for("the workers to allocate", |line| line == "done");
    assert_workers(&mut memleak, parent, &workers);
    finish(memleak);
}

#[test]
fn forked_workers_of_a_running_interpreter_have_the_worker_functions_frames() {
    // gunicorn's shape: a master already running, attached with -p, that
    // forks its workers afterwards.
    let script = workers_script();
    let mut command = Command::new(DEBIAN_PYTHON);
    command.arg(&script).args(["fork", &WORKERS.to_string()]);
    let mut master = Leaker::start_command(command);
    let parent = master.pid().to_string();
    let mut memleak =
        Memleak::start(&["-p", &parent, "--follow-forks", "--format", "json", "-T", "1000", "1"]);
    memleak.wait_attached();
    wait_python_found(&mut memleak);
    master.send("go", "forked");
    let workers = wait_workers(&mut memleak, u64::from(master.pid()));
    master.send("go", "done");
    assert_workers(&mut memleak, u64::from(master.pid()), &workers);
    memleak.signal(libc::SIGINT);
    let (status, _) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    master.exit();
}

#[test]
fn a_process_that_execs_into_python_has_python_frames() {
    let script = workers_script();
    let command = format!("sh -c 'exec {DEBIAN_PYTHON} {} threads'", script.display());
    let mut memleak = start(&command, &[]);
    let now_runs = memleak.stderr.wait_for("the exec", |line| line.contains(" now runs "));
    assert!(now_runs.contains(&format!("now runs {DEBIAN_PYTHON}")), "{now_runs}");
    memleak.stderr.wait_for("the fixture to start", |line| line == "ready");
    let pid = wait_python_found(&mut memleak);
    assert!(now_runs.starts_with(&format!("memleak: pid {pid} now runs")), "{now_runs}");
    send(&mut memleak, "go");
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    let expected = thread_stacks(DEBIAN_PYTHON, &script, &script, Path::new("/"));
    let report = wait_report(&mut memleak, Some(pid), "a report holding both threads' blocks", |report| {
        expected.iter().all(|(frames, bytes)| usage_with(report, frames).0 == *bytes)
    });
    assert_eq!(report["program"], DEBIAN_PYTHON);
    assert_threads(&report, &expected, DEBIAN_BETWEEN_THREAD_GROUPS);
    finish(memleak);
}

/// Runs the first-line fixture under `python` with -c, nothing waiting
/// for memleak: the block its first line keeps has that line's frame.
fn a_scripts_first_line_has_its_python_frame(python: &str) {
    let script = fixture("python_first_line.py");
    let mut memleak = start(&format!("{python} {}", script.display()), &[]);
    memleak.stderr.wait_for("the fixture to allocate", |line| line == "done");
    let expected = [at("<module>", &script, &script, "first line")];
    let bytes = bytearray_malloc(77_777);
    let report = wait_report(&mut memleak, None, "a report of a live interpreter", |_| true);
    assert_eq!(line_of(&script, "first line"), 1);
    assert_eq!(usage_with(&report, &expected), (bytes, 1), "{report:#}");
    finish(memleak);
}

#[test]
fn debian_python_a_scripts_first_line_has_its_python_frame() {
    a_scripts_first_line_has_its_python_frame(DEBIAN_PYTHON);
}

#[test]
fn pyenv_python_3_12_a_scripts_first_line_has_its_python_frame() {
    // Its interpreter is in libpython3.12.so, which its loader maps after
    // the exec.
    a_scripts_first_line_has_its_python_frame(PYENV_PYTHON);
}

#[test]
fn a_python_service_in_a_container_has_the_files_it_sees() {
    // The container's root has the host's /usr (read-only: its python3.11
    // and standard library) and the script at /app, which the host does
    // not have; its own pid namespace makes Python pid 1 there.
    let rootfs = TempDir::new("memleak-python-container");
    for (link, to) in [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")] {
        std::os::unix::fs::symlink(to, rootfs.path().join(link)).unwrap();
    }
    std::fs::create_dir_all(rootfs.path().join("app")).unwrap();
    let inside = Path::new("/app/python_workers.py");
    std::fs::copy(workers_script(), rootfs.path().join("app/python_workers.py")).unwrap();
    assert!(!inside.exists(), "the host has no {}", inside.display());
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--pid", "--fork", "sh"])
        .arg(fixture("enter-python-container.sh"))
        .arg(rootfs.path())
        .args([DEBIAN_PYTHON, "/app/python_workers.py", "threads"]);
    let mut container = Leaker::start_command(command);
    let pid = container.leaker_pid();
    let pid_text = pid.to_string();
    let mut memleak = Memleak::start(&["-p", &pid_text, "--format", "json", "-T", "1000", "1"]);
    memleak.wait_attached();
    assert_eq!(wait_python_found(&mut memleak), u64::from(pid));
    container.go();
    // The threading module is where the container has it: the host's,
    // bind-mounted at the same path.
    let expected = thread_stacks(DEBIAN_PYTHON, &workers_script(), inside, Path::new("/"));
    let report =
        wait_report(&mut memleak, Some(u64::from(pid)), "a report holding both threads' blocks", |report| {
            expected.iter().all(|(frames, bytes)| usage_with(report, frames).0 == *bytes)
        });
    assert_eq!(report["namespace_pid"], 1, "the pid the container sees");
    assert_threads(&report, &expected, DEBIAN_BETWEEN_THREAD_GROUPS);
    memleak.signal(libc::SIGINT);
    let (status, _) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    container.exit();
}
