//! Helpers for the end-to-end tests: build the C fixtures, run memleak
//! against them, and read its JSON reports.

use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use serde_json::Value;

/// How long any one wait may take before the test gives up. A guard
/// against hangs, never an assertion about speed.
pub const PATIENCE: Duration = Duration::from_secs(60);

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is in the workspace").to_path_buf()
}

/// The memleak binary under test (`cargo xtask test` builds it first).
pub fn memleak_binary() -> PathBuf {
    let binary = std::env::var_os("MEMLEAK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/debug/memleak"));
    assert!(binary.exists(), "{} is missing: run the tests with `cargo xtask test`", binary.display());
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the end-to-end tests load BPF programs: run them as root");
    binary
}

/// Compiles tests/fixtures/NAME.c or NAME.cpp (unoptimised, with frame
/// pointers, as a debug build would be) and returns the executable.
pub fn fixture(name: &str) -> PathBuf {
    let c_source = workspace_root().join(format!("tests/fixtures/{name}.c"));
    let (source, compiler) =
        if c_source.exists() { (c_source, "gcc") } else { (c_source.with_extension("cpp"), "g++") };
    let dir = workspace_root().join("target/fixtures");
    fs::create_dir_all(&dir).expect("create target/fixtures");
    let output = dir.join(name);
    // Tests run in parallel: build under a private name, then rename, so no
    // test ever runs a half-written file.
    let private = dir.join(format!("{name}.{}.{:?}", std::process::id(), thread::current().id()));
    let status = Command::new(compiler)
        .args(["-g", "-O0", "-fno-omit-frame-pointer", "-pthread", "-o"])
        .arg(&private)
        .arg(&source)
        .status()
        .expect("run gcc");
    assert!(status.success(), "gcc failed on {}", source.display());
    fs::rename(&private, &output).expect("rename fixture");
    output
}

/// The leaker built against musl (Debian's musl-tools) instead of glibc.
pub fn musl_leaker() -> PathBuf {
    let dir = workspace_root().join("target/fixtures");
    fs::create_dir_all(&dir).expect("create target/fixtures");
    let output = dir.join("leaker-musl");
    let private = dir.join(format!("leaker-musl.{}.{:?}", std::process::id(), thread::current().id()));
    let status = Command::new("musl-gcc")
        .args(["-g", "-O0", "-fno-omit-frame-pointer", "-o"])
        .arg(&private)
        .arg(workspace_root().join("tests/fixtures/leaker.c"))
        .status()
        .expect("run musl-gcc (cargo xtask test installs musl-tools)");
    assert!(status.success(), "musl-gcc failed on leaker.c");
    fs::rename(&private, &output).expect("rename fixture");
    output
}

/// The line of the fixture that carries `/* ALLOC(marker) */`.
/// Checks that `svg` is well-formed XML with an `<svg>` root, and returns
/// the text of its `<title>` elements: a flame graph names each frame in
/// one, with its weight.
pub fn svg_titles(svg: &str) -> Vec<String> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(svg);
    reader.config_mut().check_end_names = true;
    let (mut titles, mut in_title, mut root) = (Vec::new(), false, None);
    loop {
        match reader.read_event() {
            Ok(Event::Start(tag)) => {
                let name = String::from_utf8_lossy(tag.name().as_ref()).into_owned();
                in_title = name == "title";
                root.get_or_insert(name);
            }
            Ok(Event::Text(text)) if in_title => titles.push(String::from_utf8_lossy(&text).into_owned()),
            Ok(Event::End(_)) => in_title = false,
            Ok(Event::Eof) => break,
            Ok(_) => {}
            Err(error) => panic!("not well-formed XML at byte {}: {error}", reader.buffer_position()),
        }
    }
    assert_eq!(root.as_deref(), Some("svg"), "an SVG document");
    titles
}

/// Runs `go tool pprof ARGS PROFILE` and returns what it printed. Go
/// keeps a cache under $HOME: the profile's directory serves.
pub fn go_pprof(profile: &Path, args: &[&str]) -> String {
    let output = Command::new("go")
        .args(["tool", "pprof"])
        .args(args)
        .arg(profile)
        .env("HOME", profile.parent().expect("a profile in a directory"))
        .output()
        .expect("run go tool pprof (cargo xtask test installs golang-go)");
    assert!(output.status.success(), "go tool pprof {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The GNU build id of an ELF file, in hex, as readelf prints it.
pub fn build_id(binary: &Path) -> String {
    let output = Command::new("readelf").arg("-n").arg(binary).output().expect("run readelf");
    let notes = String::from_utf8_lossy(&output.stdout);
    let line = notes.lines().find_map(|line| line.trim().strip_prefix("Build ID: "));
    line.unwrap_or_else(|| panic!("{} has no build id: {notes}", binary.display())).to_owned()
}

pub fn marker_line(name: &str, marker: &str) -> u64 {
    let source = fs::read_to_string(workspace_root().join(format!("tests/fixtures/{name}.c"))).unwrap();
    let needle = format!("ALLOC({marker})");
    let index = source.lines().position(|line| line.contains(&needle));
    index.unwrap_or_else(|| panic!("no {needle} in {name}.c")) as u64 + 1
}

/// Lines of a child's pipe, read on a thread so that waits can time out.
pub struct Lines {
    receiver: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Lines {
    pub fn new(pipe: impl std::io::Read + Send + 'static) -> Self {
        let (sender, receiver) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Self { receiver, seen: Vec::new() }
    }

    /// Waits for a line for which `predicate` holds and returns it.
    pub fn wait_for(&mut self, what: &str, predicate: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.receiver.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if predicate(&line) {
                        return line;
                    }
                }
                Err(_) => panic!("waited {PATIENCE:?} for {what}; saw instead: {:#?}", self.seen),
            }
        }
    }

    /// Every remaining line, until the pipe closes.
    pub fn rest(&mut self) -> Vec<String> {
        while let Ok(line) = self.receiver.recv_timeout(PATIENCE) {
            self.seen.push(line);
        }
        self.seen.clone()
    }
}

/// A running memleak with its output pipes.
pub struct Memleak {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub stdout: Lines,
    pub stderr: Lines,
}

impl Memleak {
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// Starts memleak with extra environment variables, which a -c command
    /// inherits (LD_PRELOAD, say).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(memleak_binary())
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start memleak");
        let stdin = child.stdin.take();
        let stdout = Lines::new(child.stdout.take().unwrap());
        let stderr = Lines::new(child.stderr.take().unwrap());
        Self { child, stdin, stdout, stderr }
    }

    /// Waits until the probes are attached.
    pub fn wait_attached(&mut self) {
        self.stderr.wait_for("memleak to attach", |line| line.starts_with("memleak: tracing "));
    }

    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own, unreaped child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
    }

    /// Closes memleak's stdin, which a `-c` command inherited.
    pub fn close_stdin(&mut self) {
        drop(self.stdin.take());
    }

    /// Waits for memleak to exit; returns its status and every JSON report.
    pub fn finish(mut self) -> (ExitStatus, Vec<Value>) {
        let lines = self.stdout.rest();
        let status = self.child.wait().expect("wait for memleak");
        let stderr = self.stderr.rest();
        let reports = lines
            .iter()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|error| panic!("not JSON ({error}): {line}\nstderr: {stderr:#?}"))
            })
            .collect();
        (status, reports)
    }
}

/// Runs memleak on `leaker KIND ARGS` with -c: waits for the fixture's
/// "done", lets it exit, and returns memleak's last report.
pub fn trace_command(leaker_args: &str, memleak_args: &[&str]) -> Value {
    trace_fixture("leaker", leaker_args, memleak_args)
}

/// Runs memleak with -c on a program and arguments, waits for its "done",
/// lets it exit, and returns every JSON line memleak printed.
pub fn trace_program(program: &Path, program_args: &str, memleak_args: &[&str]) -> Vec<Value> {
    let command = format!("{} {program_args}", program.display());
    run_traced_command(&command, memleak_args, &[])
}

/// Runs memleak on fixture NAME with -c, as `trace_command` does.
pub fn trace_fixture(name: &str, fixture_args: &str, memleak_args: &[&str]) -> Value {
    trace_fixture_output(name, fixture_args, memleak_args).pop().expect("memleak printed a final report")
}

/// Every JSON line memleak printed for fixture NAME run with -c.
pub fn trace_fixture_output(name: &str, fixture_args: &str, memleak_args: &[&str]) -> Vec<Value> {
    trace_fixture_output_with_env(name, fixture_args, memleak_args, &[])
}

/// As `trace_fixture_output`, with extra environment for memleak and so
/// for the command.
pub fn trace_fixture_output_with_env(
    name: &str,
    fixture_args: &str,
    memleak_args: &[&str],
    env: &[(&str, &str)],
) -> Vec<Value> {
    let command = format!("{} {fixture_args}", fixture(name).display());
    run_traced_command(&command, memleak_args, env)
}

fn run_traced_command(command: &str, memleak_args: &[&str], env: &[(&str, &str)]) -> Vec<Value> {
    // All allocations (memleak's default: no -o), all stacks, one report at
    // exit, unless told otherwise.
    let mut args = vec!["-c", command, "--format", "json", "-T", "1000", "3600"];
    args.extend_from_slice(memleak_args);
    let mut memleak = Memleak::start_with_env(&args, env);
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    memleak.close_stdin();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    reports
}

/// A process of the leaker fixture started by the test, for -p.
pub struct Leaker {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub stderr: Lines,
}

impl Leaker {
    /// Starts `leaker KIND --wait`: it allocates once `go` is called.
    pub fn start_waiting(kind: &[&str]) -> Self {
        Self::start_waiting_with_env(kind, &[])
    }

    /// As `start_waiting`, with extra environment (LD_PRELOAD, say).
    pub fn start_waiting_with_env(kind: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(fixture("leaker"));
        command.args(kind).arg("--wait").envs(env.iter().copied());
        Self::start_command(command)
    }

    /// Starts a command that runs the leaker with --wait somewhere inside
    /// it (in a container, say).
    pub fn start_command(mut command: Command) -> Self {
        let mut child =
            command.stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the leaker's command");
        let stdin = child.stdin.take();
        let mut stderr = Lines::new(child.stderr.take().unwrap());
        stderr.wait_for("the leaker to start", |line| line == "ready");
        Self { child, stdin, stderr }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The pid of the leaker when it runs as the command's only child
    /// (unshare --fork), else the command's own pid.
    pub fn leaker_pid(&self) -> u32 {
        let pid = self.child.id();
        let children = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        children.split_whitespace().next().and_then(|child| child.parse().ok()).unwrap_or(pid)
    }

    /// Lets it allocate and waits until it has.
    pub fn go(&mut self) {
        self.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
        self.stderr.wait_for("the leaker to allocate", |line| line == "done");
    }

    /// Sends one line to its stdin and waits for the line it answers with.
    pub fn send(&mut self, line: &str, answer: &str) {
        // One write: the fixture may act on each read.
        self.stdin.as_mut().unwrap().write_all(format!("{line}\n").as_bytes()).unwrap();
        self.stderr.wait_for(answer, |seen| seen == answer);
    }

    /// Lets it exit and reaps it.
    pub fn exit(mut self) {
        drop(self.stdin.take());
        self.child.wait().unwrap();
    }
}

impl Drop for Leaker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Stacks of a report whose first frame is `function` at `line`.
pub fn stacks_at<'a>(report: &'a Value, function: &str, line: u64) -> Vec<&'a Value> {
    report["stacks"]
        .as_array()
        .expect("stacks is an array")
        .iter()
        .filter(|stack| {
            let frame = &stack["frames"][0];
            frame["function"] == function && frame["line"] == line
        })
        .collect()
}

/// (bytes, allocations) summed over the stacks whose first frame is
/// `function` at the line of `marker` in leaker.c.
pub fn usage_at(report: &Value, function: &str, marker: &str) -> (u64, u64) {
    let line = marker_line("leaker", marker);
    stacks_at(report, function, line).iter().fold((0, 0), |(bytes, count), stack| {
        (bytes + stack["bytes"].as_u64().unwrap(), count + stack["allocations"].as_u64().unwrap())
    })
}

/// Runs memleak to completion with the given arguments; returns its exit
/// code and stderr.
pub fn run_to_end(args: &[&str]) -> (Option<i32>, String) {
    let output =
        Command::new(memleak_binary()).args(args).stdin(Stdio::null()).output().expect("run memleak");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A root filesystem holding the leaker at /app/leaker and the libraries
/// it loads, at their own paths, for container tests.
pub fn leaker_rootfs() -> tempdir::TempDir {
    rootfs_with(&fixture("leaker"))
}

/// A root filesystem holding `leaker` at /app/leaker and the libraries it
/// loads (as ldd lists them), at their own paths.
pub fn rootfs_with(leaker: &Path) -> tempdir::TempDir {
    let root = tempdir::TempDir::new("memleak-rootfs");
    let copy = |from: &Path, to: &Path| {
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(from, to)
            .unwrap_or_else(|error| panic!("copy {} to {}: {error}", from.display(), to.display()));
    };
    copy(leaker, &root.path().join("app/leaker"));
    // Ask the program's own dynamic loader (glibc's or musl's) what it loads.
    let headers = Command::new("readelf").arg("-l").arg(leaker).output().expect("run readelf");
    let headers = String::from_utf8_lossy(&headers.stdout);
    let interpreter = headers
        .lines()
        .find_map(|line| line.split_once("program interpreter: ").map(|(_, rest)| rest.trim_end_matches(']')))
        .expect("a dynamically linked leaker");
    let listing = Command::new(interpreter).arg("--list").arg(leaker).output().expect("run the loader");
    for line in String::from_utf8_lossy(&listing.stdout).lines() {
        let path = line.split_whitespace().rfind(|word| word.starts_with('/'));
        if let Some(path) = path.filter(|path| Path::new(path) != leaker) {
            copy(Path::new(path), &root.path().join(path.trim_start_matches('/')));
        }
    }
    fs::create_dir_all(root.path().join("proc")).unwrap();
    root
}

/// A directory removed when dropped.
pub mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new(prefix: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "{prefix}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).expect("create a temporary directory");
            Self(path.to_path_buf())
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
