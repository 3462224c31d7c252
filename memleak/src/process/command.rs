//! `-c`: a command spawned and held at the door until the probes are in,
//! then followed through ptrace so that it is held at its exit until its
//! final report is taken.

use std::{
    ffi::CString,
    fs::{self, File},
    io::{self, Read as _, Write as _},
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
};

use super::{
    command_cgroup::{self, Containment},
    lifecycle::TargetEvent,
    link_map::LinkMapHook,
};

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("the command to run is empty or has unbalanced quotes: {0:?}")]
    BadCommandLine(String),
    #[error("cannot run `{program}`: {source}")]
    Spawn { program: String, source: io::Error },
    #[error("cannot run `{0}`: not found in PATH")]
    NotInPath(String),
}

/// A command forked and held just before `execve` until `release`, so the
/// probes are in place before its first instruction runs.
///
/// std's `Command::spawn` waits for the exec, so it cannot hold the child
/// at the door; this forks by hand. Everything the child needs is built
/// before the fork: between fork and exec it only makes system calls, and
/// above all never allocates (that would be counted against the target).
pub struct GatedCommand {
    pub pid: u32,
    pub program: PathBuf,
    /// Closing this lets the child go on to `execve`.
    gate: OwnedFd,
    /// The child writes its exec error here; EOF means exec succeeded.
    exec_error: OwnedFd,
    name: String,
    /// What keeps everything the command starts together, to end it all.
    containment: Containment,
}

impl GatedCommand {
    /// Splits `command_line` like a shell and forks it, held before exec.
    pub fn spawn(command_line: &str) -> Result<Self, CommandError> {
        let words = shlex::split(command_line)
            .filter(|words| !words.is_empty())
            .ok_or_else(|| CommandError::BadCommandLine(command_line.to_owned()))?;
        let name = words[0].clone();
        let program = find_program(&name)?;
        let spawn_error = |source| CommandError::Spawn { program: name.clone(), source };
        let to_c = |text: &[u8]| {
            CString::new(text).map_err(|_| CommandError::BadCommandLine(command_line.to_owned()))
        };
        let program_c = to_c(program.as_os_str().as_bytes())?;
        let argv_c: Vec<CString> =
            words.iter().map(|word| to_c(word.as_bytes())).collect::<Result<_, _>>()?;
        let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|arg| arg.as_ptr()).collect();
        argv.push(std::ptr::null());
        // The mask memleak was started with: SIGINT and SIGTERM, held by
        // memleak until its tracer is loaded, are the command's as usual.
        let signal_mask = crate::stop_signals::started_with();
        let (gate_read, gate_write) = command_cgroup::pipe().map_err(spawn_error)?;
        let (error_read, error_write) = command_cgroup::pipe().map_err(spawn_error)?;
        // Made before the fork: the child must not allocate.
        let mut containment = Containment::new();
        // SAFETY: getpid has no preconditions.
        let memleak_pid = unsafe { libc::getpid() };
        // SAFETY: the child branch below only calls async-signal-safe
        // functions on memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(spawn_error(io::Error::last_os_error()));
        }
        if pid == 0 {
            // SAFETY: see above; `environ` is the parent's environment.
            unsafe {
                // Only memleak holds the gate's writing end: its death ends
                // the pipe as well as sending the death signal.
                libc::close(gate_write.as_raw_fd());
                run_when_let_in(
                    &gate_read,
                    &error_write,
                    memleak_pid,
                    signal_mask.as_ref(),
                    &program_c,
                    &argv,
                )
            }
        }
        drop((gate_read, error_write));
        // In before it may run, so that every process it starts is too.
        containment.enter(pid as u32);
        Ok(Self { pid: pid as u32, program, gate: gate_write, exec_error: error_read, name, containment })
    }

    /// Lets the command exec, watched for its exit, and reports whether
    /// the exec worked.
    pub fn release(
        self,
        events: tokio::sync::mpsc::UnboundedSender<TargetEvent>,
    ) -> Result<SpawnedCommand, CommandError> {
        let spawn_error = |source| CommandError::Spawn { program: self.name.clone(), source };
        let (exec_sender, exec_stopped) = std::sync::mpsc::channel();
        let watcher = match watch_command(self.pid, events, exec_sender) {
            Ok(watcher) => watcher,
            Err(source) => {
                let error = spawn_error(source);
                let Self { pid, containment, .. } = self;
                abandon(pid, containment);
                return Err(error);
            }
        };
        let command = SpawnedCommand { pid: self.pid, watcher, containment: self.containment };
        // The byte, not the end of the pipe, lets the child in: an end
        // without it means memleak died before it was ready.
        if let Err(error) = File::from(self.gate).write_all(&[GO]) {
            command.finish();
            return Err(spawn_error(error));
        }
        let mut errno = [0u8; 4];
        let mut exec_error = File::from(self.exec_error);
        // EOF: the close-on-exec pipe closed, so the exec happened.
        if let Ok(4) = exec_error.read(&mut errno) {
            let error = spawn_error(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
            command.finish();
            return Err(error);
        }
        // The exec stop comes after the kernel's exec tracepoint: past it,
        // that first exec cannot be taken for a later one.
        let _ = exec_stopped.recv();
        Ok(command)
    }

    /// Gives up on the command: it never gets to run.
    pub fn abandon(self) {
        abandon(self.pid, self.containment);
    }
}

/// Kills the command's process `pid`, held at the gate, and takes down
/// its containment.
fn abandon(pid: u32, containment: Containment) {
    signal(pid, libc::SIGKILL);
    let mut status = 0;
    // SAFETY: reaps our own child.
    unsafe { libc::waitpid(pid as libc::pid_t, &raw mut status, 0) };
    containment.end(pid, &|| true);
}

/// What the gate says when the command may run.
const GO: u8 = b'g';

/// The forked child's life before the command's: it dies with memleak
/// (`PR_SET_PDEATHSIG`, kept across the exec of a program that is not
/// set-user-ID), waits at the gate, and execs only when told to.
///
/// # Safety
/// Only between fork and exec in the child: it calls async-signal-safe
/// functions only, on memory prepared before the fork.
unsafe fn run_when_let_in(
    gate: &OwnedFd,
    exec_error: &OwnedFd,
    memleak_pid: libc::pid_t,
    signal_mask: Option<&libc::sigset_t>,
    program: &CString,
    argv: &[*const libc::c_char],
) -> ! {
    // SAFETY: the caller's promise.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        // memleak may have died before the line above: then the child was
        // handed to another parent and no death signal will come.
        if libc::getppid() != memleak_pid {
            libc::_exit(127);
        }
        let mut byte = 0u8;
        let read = loop {
            let read = libc::read(gate.as_raw_fd(), (&raw mut byte).cast(), 1);
            if read >= 0 || *libc::__errno_location() != libc::EINTR {
                break read;
            }
        };
        if read != 1 || byte != GO {
            libc::_exit(127);
        }
        if let Some(mask) = signal_mask {
            libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut());
        }
        libc::execv(program.as_ptr(), argv.as_ptr());
        let errno = *libc::__errno_location();
        libc::write(exec_error.as_raw_fd(), (&raw const errno).cast(), 4);
        libc::_exit(127)
    }
}

/// A command memleak started, watched through ptrace for its exit; it does
/// not outlive memleak, nor does anything it started.
pub struct SpawnedCommand {
    pub pid: u32,
    watcher: std::thread::JoinHandle<()>,
    containment: Containment,
}

impl SpawnedCommand {
    /// Ends the command and every process it started (SIGTERM, then
    /// SIGKILL after `command_cgroup::GRACE`), and waits until they are
    /// gone and the command reaped.
    pub fn finish(self) {
        let Self { pid, watcher, containment } = self;
        containment.end(pid, &|| watcher.is_finished());
        if !watcher.is_finished() {
            // Not ended with the rest: the watcher has not reaped it, so
            // the pid is still the command's.
            signal(pid, libc::SIGKILL);
        }
        let _ = watcher.join();
    }
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on our own child, which only our watcher reaps, so the
    // pid cannot have been reused while the watcher runs.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// Watches the forked command from a thread of its own: ptrace makes the
/// calling thread the tracer, and only the tracer may wait for and resume
/// the tracee. Returns once the command is seized.
fn watch_command(
    pid: u32,
    events: tokio::sync::mpsc::UnboundedSender<TargetEvent>,
    exec_stopped: std::sync::mpsc::Sender<()>,
) -> io::Result<std::thread::JoinHandle<()>> {
    let (seized_sender, seized) = std::sync::mpsc::channel();
    let watcher = std::thread::spawn(move || {
        let pid = pid as libc::pid_t;
        // PTRACE_O_TRACEEXIT: stop at exit with the mappings still there.
        // TRACEEXEC: a plain SIGTRAP would otherwise follow the exec.
        // EXITKILL: the command dies with memleak, even if memleak crashes.
        let options = libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC | libc::PTRACE_O_EXITKILL;
        // SAFETY: seizes our own child; SEIZE does not stop it.
        let seized_ok = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, 0, libc::c_long::from(options)) } == 0;
        let _ = seized_sender.send(if seized_ok { Ok(()) } else { Err(io::Error::last_os_error()) });
        if seized_ok {
            follow_tracee(pid, &events, &exec_stopped);
        }
    });
    match seized.recv() {
        Ok(Ok(())) => Ok(watcher),
        Ok(Err(error)) => Err(error),
        Err(_) => Err(io::Error::other("the ptrace watcher died")),
    }
}

/// Resumes the tracee after each stop until it is gone, and reaps it.
fn follow_tracee(
    pid: libc::pid_t,
    events: &tokio::sync::mpsc::UnboundedSender<TargetEvent>,
    exec_stopped: &std::sync::mpsc::Sender<()>,
) {
    let resume = |request, signal: libc::c_int| {
        // SAFETY: the tracee is in a ptrace stop, as waitpid just told us.
        unsafe { libc::ptrace(request, pid, 0, libc::c_long::from(signal)) };
    };
    // Set at the exec stop, until the libraries are all mapped.
    let mut hook: Option<LinkMapHook> = None;
    // Until the exec, the tracee is memleak's fork, not the command: if the
    // exec fails it exits with nothing to report, and nobody would take an
    // exit report while `release` waits for this thread.
    let mut exec_seen = false;
    loop {
        let mut status = 0;
        // SAFETY: waits for our own tracee.
        if unsafe { libc::waitpid(pid, &raw mut status, libc::__WALL) } < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if libc::WIFEXITED(status) {
            log::debug!("command {pid} exited with status {}", libc::WEXITSTATUS(status));
            return;
        }
        if libc::WIFSIGNALED(status) {
            log::debug!("command {pid} was killed by signal {}", libc::WTERMSIG(status));
            return;
        }
        let stop_signal = libc::WSTOPSIG(status);
        match status >> 16 {
            libc::PTRACE_EVENT_EXIT if !exec_seen => resume(libc::PTRACE_CONT, 0),
            libc::PTRACE_EVENT_EXIT => {
                let (ack, acked) = std::sync::mpsc::channel();
                if events.send(TargetEvent::Exiting { pid: pid as u32, ack: Some(ack) }).is_ok() {
                    // Returns once the report is taken, or memleak moved on.
                    let _ = acked.recv();
                }
                resume(libc::PTRACE_CONT, 0);
            }
            libc::PTRACE_EVENT_STOP => {
                // A group stop (SIGSTOP and friends): stay stopped, but keep
                // listening so that SIGCONT works as usual.
                let stopping =
                    matches!(stop_signal, libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU);
                resume(if stopping { libc::PTRACE_LISTEN } else { libc::PTRACE_CONT }, 0);
            }
            0 if stop_signal == libc::SIGTRAP && hook.as_ref().is_some_and(|hook| hook.hit(pid)) => {
                hook = hook.and_then(|hook| libraries_mapped(pid, hook, events));
                resume(libc::PTRACE_CONT, 0);
            }
            0 => {
                log::debug!("command {pid} got signal {stop_signal}");
                resume(libc::PTRACE_CONT, stop_signal); // deliver the signal as if untraced
            }
            libc::PTRACE_EVENT_EXEC => {
                if !exec_seen {
                    let _ = exec_stopped.send(());
                }
                exec_seen = true;
                hook = LinkMapHook::set(pid);
                resume(libc::PTRACE_CONT, 0);
            }
            _ => resume(libc::PTRACE_CONT, 0),
        }
    }
}

/// The tracee stopped at the linker's hook: once its libraries are all
/// mapped, the session loads their tables while it waits, and the hook is
/// gone; until then it steps on, the hook kept.
fn libraries_mapped(
    pid: libc::pid_t,
    hook: LinkMapHook,
    events: &tokio::sync::mpsc::UnboundedSender<TargetEvent>,
) -> Option<LinkMapHook> {
    if !hook.consistent(pid) {
        return match hook.step_over(pid) {
            Ok(()) => Some(hook),
            Err(error) => {
                log::debug!("command {pid}: the linker's hook is given up: {error}");
                None
            }
        };
    }
    let (ack, acked) = std::sync::mpsc::channel();
    if events.send(TargetEvent::Mapped { pid: pid as u32, ack }).is_ok() {
        // Returns once the tables are in, or memleak moved on.
        let _ = acked.recv();
    }
    None
}

/// Resolves a program name the way execvp would.
fn find_program(name: &str) -> Result<PathBuf, CommandError> {
    if name.contains('/') {
        return match fs::metadata(name) {
            Ok(_) => Ok(PathBuf::from(name)),
            Err(source) => Err(CommandError::Spawn { program: name.to_owned(), source }),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| CommandError::NotInPath(name.to_owned()))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}
