//! Running the commands the bench measures: to their end, with the CPU
//! time and peak memory the kernel accounts to them, or held at the start
//! until probes are attached to them.

use std::{
    io::{self, BufRead, BufReader, PipeReader, Read, Write as _},
    os::{
        fd::AsRawFd as _,
        unix::process::{CommandExt as _, ExitStatusExt as _},
    },
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc::{self, Receiver},
    thread,
    time::Instant,
};

use anyhow::{bail, Context as _, Result};

/// What the kernel accounts to a process and the children it reaped.
#[derive(Clone, Copy)]
pub struct Usage {
    /// User plus system time.
    pub cpu_ns: u64,
    pub max_rss_kib: u64,
}

/// A command that ran to its end.
pub struct Finished {
    pub stdout: String,
    pub stderr: String,
    pub usage: Usage,
}

/// Runs `command` to its end, failing with its stderr if it fails.
pub fn run_to_end(command: &mut Command) -> Result<Finished> {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", program_name(command)))?;
    finish(child, command)
}

/// Runs `program args`, held before its `exec` until `attach(pid)` is
/// done: for probes that need the process to exist, yet must be in place
/// before it runs. `attach`'s result lives until the program has ended.
pub fn run_attached<T>(
    program: &std::path::Path,
    args: &[String],
    env: &[(String, String)],
    attach: impl FnOnce(u32) -> Result<T>,
) -> Result<Finished> {
    // The shell's pid becomes the program's: `exec` keeps it.
    let mut command = Command::new("sh");
    command.args(["-c", "read -r _ && exec \"$0\" \"$@\""]).arg(program).args(args);
    command.envs(env.iter().map(|(name, value)| (name, value)));
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run sh")?;
    let attached = match attach(child.id()) {
        Ok(attached) => attached,
        Err(error) => {
            // Our own child, still waiting on its stdin.
            let _ = child.kill();
            let _ = child.wait();
            return Err(error);
        }
    };
    release(&mut child.stdin.take().context("no stdin")?)?;
    let finished = finish(child, &command);
    drop(attached);
    finished
}

/// Spawns `command` with `option /dev/fd/N` added, N the write end of a
/// pipe: for a file the command writes as it runs, to be read as it comes.
/// Only the child keeps the write end, so the pipe ends when it does.
pub fn spawn_with_pipe(command: &mut Command, option: &str) -> Result<(Child, PipeReader)> {
    let (reader, writer) = io::pipe().context("cannot make a pipe")?;
    let fd = writer.as_raw_fd();
    command.arg(option).arg(format!("/dev/fd/{fd}"));
    // SAFETY: between fork and exec the closure only calls fcntl, which is
    // async-signal-safe, on a descriptor `writer` keeps open until after
    // the spawn.
    unsafe {
        command.pre_exec(move || {
            // The pipe is made close-on-exec, for no other child to hold it.
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().with_context(|| format!("cannot run {}", program_name(command)))?;
    drop(writer);
    Ok((child, reader))
}

/// Lets a process waiting on its stdin for a line go on.
pub fn release(stdin: &mut ChildStdin) -> Result<()> {
    stdin.write_all(b"go\n").context("cannot release the process")
}

fn finish(mut child: Child, command: &Command) -> Result<Finished> {
    let stdout = read_in_background(child.stdout.take());
    let stderr = read_in_background(child.stderr.take());
    let (status, usage) = wait_with_usage(&child)?;
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        bail!("{} failed with {status}: {}", program_name(command), last_line(&stderr));
    }
    Ok(Finished { stdout, stderr, usage })
}

/// Waits for `child` with wait4, which alone of the wait calls says what
/// that one child used. The `Child` must not be waited for again.
fn wait_with_usage(child: &Child) -> Result<(ExitStatus, Usage)> {
    let pid = i32::try_from(child.id()).context("pid out of range")?;
    let mut status = 0;
    // SAFETY: rusage is plain old data; all zeroes is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live, writable locals.
    if unsafe { libc::wait4(pid, &raw mut status, 0, &raw mut usage) } < 0 {
        return Err(std::io::Error::last_os_error()).context("wait4");
    }
    let ns = |time: libc::timeval| time.tv_sec as u64 * 1_000_000_000 + time.tv_usec as u64 * 1_000;
    let usage =
        Usage { cpu_ns: ns(usage.ru_utime) + ns(usage.ru_stime), max_rss_kib: usage.ru_maxrss as u64 };
    Ok((ExitStatus::from_raw(status), usage))
}

fn read_in_background(pipe: Option<impl Read + Send + 'static>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut text = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut text);
        }
        String::from_utf8_lossy(&text).into_owned()
    })
}

/// The lines of `pipe`, each with the moment it was read, as they come.
pub fn lines_as_they_come(pipe: impl Read + Send + 'static) -> Receiver<(Instant, String)> {
    let (sender, receiver) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if sender.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    receiver
}

/// Reads lines until one contains `marker`.
pub fn wait_for_line(reader: &mut impl BufRead, marker: &str) -> Result<()> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("the process ended before it printed {marker:?}");
        }
        if line.contains(marker) {
            return Ok(());
        }
    }
}

fn program_name(command: &Command) -> String {
    command.get_program().to_string_lossy().into_owned()
}

/// The last non-empty line of a program's stderr: usually its error.
pub fn last_line(text: &str) -> &str {
    text.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or("(no output)")
}

/// The CPU time process `pid` (every thread, living or gone) has used.
pub fn process_cpu_ns(pid: u32) -> Result<u64> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: a pointer to a live local.
    let error = unsafe { libc::clock_getcpuclockid(libc::pid_t::try_from(pid)?, &raw mut clock) };
    if error != 0 {
        return Err(std::io::Error::from_raw_os_error(error)).context("clock_getcpuclockid");
    }
    // SAFETY: timespec is plain old data; all zeroes is a valid value.
    let mut time: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a pointer to a live local.
    if unsafe { libc::clock_gettime(clock, &raw mut time) } != 0 {
        return Err(std::io::Error::last_os_error()).context("clock_gettime of memleak's CPU");
    }
    Ok(time.tv_sec as u64 * 1_000_000_000 + time.tv_nsec as u64)
}

/// A child killed and reaped when dropped, however the measurement went.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// memleak as `memleak` (a command with its target's flags) sets it up,
/// reporting once an hour, once it says it is tracing.
pub fn tracing(memleak: &mut Command) -> Result<Killed> {
    memleak.args(["-T", "1000", "3600"]).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = Killed(memleak.spawn().context("cannot run memleak")?);
    let stderr = child.0.stderr.take().context("no stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let Some(line) = lines.next() else {
            let args: Vec<_> = memleak.get_args().map(|arg| arg.to_string_lossy()).collect();
            bail!("memleak {} ended before tracing", args.join(" "))
        };
        if line?.starts_with("memleak: tracing ") {
            break;
        }
    }
    // Drained, so that memleak never blocks on a full pipe.
    thread::spawn(move || lines.for_each(drop));
    Ok(child)
}
