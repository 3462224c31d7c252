//! Running the memleak binary under test and reading what it prints.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use serde_json::Value;

use crate::fixtures::{fixture, marker_line, workspace_root};

/// How long any one wait may take before the test gives up. A guard
/// against hangs, never an assertion about speed.
pub const PATIENCE: Duration = Duration::from_mins(1);

/// The memleak binary under test (`cargo xtask test` builds it first).
/// Set, memleak attaches one perf-event uprobe per site rather than one
/// multi-uprobe link per program.
pub const PERF_EVENT_UPROBES: &str = "MEMLEAK_PERF_EVENT_UPROBES";

pub fn memleak_binary() -> PathBuf {
    let binary = std::env::var_os("MEMLEAK_BIN")
        .map_or_else(|| workspace_root().join("target/debug/memleak"), PathBuf::from);
    assert!(binary.exists(), "{} is missing: run the tests with `cargo xtask test`", binary.display());
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the end-to-end tests load BPF programs: run them as root");
    binary
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
                Err(timeout) => {
                    panic!("{timeout} after {PATIENCE:?} for {what}; saw instead: {:#?}", self.seen)
                }
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

/// A test that fails midway must not leave memleak running, its probes
/// in place (with --cgroup on an old memleak, in every process mapping
/// libc) for the tests after it.
impl Drop for Memleak {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Memleak {
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// Starts memleak with extra environment variables, which a -c command
    /// inherits (`LD_PRELOAD`, say).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn(Command::new(memleak_binary()).args(args).envs(env.iter().copied()))
    }

    /// Starts memleak in `directory`, where a -c command starts too.
    pub fn start_in(directory: &Path, args: &[&str]) -> Self {
        Self::spawn(Command::new(memleak_binary()).args(args).current_dir(directory))
    }

    /// Starts `command`, which runs memleak (through a wrapper that execs
    /// it, say), with memleak's pipes.
    pub fn spawn(command: &mut Command) -> Self {
        let mut child = command
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

/// Attaches memleak -p to `target` (JSON, one report at the end), lets it
/// allocate, and stops memleak with SIGINT; returns memleak's reports and
/// what it said on stderr.
pub fn trace_running(target: &mut crate::Leaker, memleak_args: &[&str]) -> (Vec<Value>, Vec<String>) {
    let pid = target.pid().to_string();
    let mut args = vec!["-p", &pid, "--format", "json", "-T", "1000", "3600"];
    args.extend_from_slice(memleak_args);
    let mut memleak = Memleak::start(&args);
    memleak.wait_attached();
    target.go();
    memleak.signal(libc::SIGINT);
    let stderr = memleak.stderr.rest();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    (reports, stderr)
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

/// Runs memleak with `args` and checks that it refused them as a user
/// should see it: one line on stderr, `memleak: error: ...` with
/// `expected` in it, and exit status 2.
pub fn assert_refused_in_one_line(args: &[&str], expected: &str) {
    let (code, stderr) = run_to_end(args);
    assert_eq!(code, Some(2), "exit status for {args:?}; stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line for {args:?}: {stderr}");
    assert!(stderr.starts_with("memleak: error: "), "{stderr}");
    assert!(stderr.contains(expected), "{args:?}: expected {expected:?} in {stderr}");
}

/// Runs memleak to completion with the given arguments; returns its exit
/// code and stderr. A run that has not ended after `PATIENCE` is killed and
/// the test fails: memleak must never hang on bad input.
pub fn run_to_end(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(memleak_binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run memleak");
    let mut stderr = Lines::new(child.stderr.take().unwrap());
    let deadline = std::time::Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for memleak") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("memleak {args:?} still ran after {PATIENCE:?}; stderr: {:#?}", stderr.rest());
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stderr: String = stderr.rest().iter().map(|line| line.clone() + "\n").collect();
    (status.code(), stderr)
}

/// The function names of a stack's frames, innermost first ("?" for a
/// frame without one).
pub fn frame_functions(stack: &Value) -> Vec<&str> {
    let frames = stack["frames"].as_array().expect("frames is an array");
    frames.iter().map(|frame| frame["function"].as_str().unwrap_or("?")).collect()
}

/// The stacks of a report with a frame in `function`.
pub fn stacks_through<'a>(report: &'a Value, function: &str) -> Vec<&'a Value> {
    let stacks = report["stacks"].as_array().expect("stacks is an array");
    stacks.iter().filter(|stack| frame_functions(stack).contains(&function)).collect()
}
