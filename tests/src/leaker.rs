//! The leaker fixture run by a test, for memleak to attach to with -p.

use std::{
    fs,
    io::Write as _,
    process::{Child, ChildStdin, Command, Stdio},
};

use crate::{fixtures::fixture, memleak::Lines};

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

    /// As `start_waiting`, with extra environment (`LD_PRELOAD`, say).
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

/// What `leaker all` leaves outstanding through each allocation function,
/// per allocating line: function, marker, bytes, allocations. Its
/// `fail_allocations` leaks 10 bytes more, after two requests that fail.
pub const ALLOCATION_FUNCTION_LEAKS: [(&str, &str, u64, u64); 10] = [
    ("leak_malloc", "malloc", 3000, 3),
    ("leak_calloc", "calloc", 3000, 3),
    ("leak_realloc", "realloc", 5000, 1),
    ("leak_realloc", "realloc-null", 300, 1),
    ("leak_reallocarray", "reallocarray", 700, 1),
    ("leak_posix_memalign", "posix_memalign", 1234, 1),
    ("leak_aligned_alloc", "aligned_alloc", 640, 1),
    ("leak_memalign", "memalign", 1280, 1),
    ("leak_valloc", "valloc", 2000, 1),
    ("leak_pvalloc", "pvalloc", 100, 1),
];
