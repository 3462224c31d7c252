//! A process's life as memleak follows it: checking a pid, naming the
//! program, the pid it has in its own namespace, and noticing its exit.

use std::{
    fs, io,
    os::fd::{FromRawFd as _, OwnedFd},
};

use tokio::{
    io::{unix::AsyncFd, Interest},
    sync::mpsc::UnboundedSender,
    task::AbortHandle,
};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("no process with pid {0}: check the pid with `ps -p {0}`")]
    NoSuchProcess(u32),
    #[error("pid {0} is a kernel thread: it has no user-space allocator to trace")]
    KernelThread(u32),
    #[error("pid {0} exited while memleak was attaching to it")]
    ExitedBeforeAttach(u32),
    #[error("pid {0} exited before memleak attached to it, and another process has its pid now: that one is not traced")]
    Replaced(u32),
}

/// `PF_KTHREAD` from include/linux/sched.h: set in /proc/PID/stat's flags.
const PF_KTHREAD: u64 = 0x0020_0000;

/// Something that happened to a traced process.
#[derive(Debug)]
pub enum TargetEvent {
    /// The process is exiting. A command memleak started is held at its
    /// last breath, mappings intact, until `ack` is dropped or sent to, so
    /// that its stacks can still be symbolized; a process memleak did not
    /// start is already gone (`ack` is `None`).
    Exiting { pid: u32, ack: Option<std::sync::mpsc::Sender<()>> },
    /// A command memleak started has all its libraries mapped and none has
    /// run yet: it waits, stopped, until `ack` is dropped or sent to, so
    /// that their unwind tables are in before their code allocates.
    Mapped { pid: u32, ack: std::sync::mpsc::Sender<()> },
}

/// Checks that `pid` is a live user-space process.
pub fn check_process(pid: u32) -> Result<(), ProcessError> {
    let stat =
        fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|_| ProcessError::NoSuchProcess(pid))?;
    // Fields after the command name, which is in parentheses and may itself
    // contain spaces or parentheses: state is field 3, flags field 9.
    let after_name = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
    let flags: u64 = after_name.split(' ').nth(6).and_then(|f| f.parse().ok()).unwrap_or(0);
    if flags & PF_KTHREAD != 0 {
        return Err(ProcessError::KernelThread(pid));
    }
    if after_name.starts_with('Z') {
        return Err(ProcessError::NoSuchProcess(pid));
    }
    Ok(())
}

/// The pid the process has in its own pid namespace (a container's), if
/// that differs from `pid`: the last field of `NSpid` in /proc/PID/status.
pub fn namespace_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|line| line.strip_prefix("NSpid:"))?;
    let inner: u32 = line.split_whitespace().last()?.parse().ok()?;
    (inner != pid).then_some(inner)
}

/// The process's executable, as it names it, or `pid N` if that cannot be
/// read. Without the " (deleted)" the kernel adds once the file is
/// replaced (an upgrade, a rebuild), as the mappings' names are: a
/// process keeps its program's name.
pub fn program(pid: u32) -> String {
    let Ok(path) = fs::read_link(format!("/proc/{pid}/exe")) else { return format!("pid {pid}") };
    let path = path.display().to_string();
    path.strip_suffix(" (deleted)").map_or_else(|| path.clone(), str::to_owned)
}

/// Sends `TargetEvent::Exiting` for process `pid` once it has exited.
/// Waits on a pidfd, so a recycled pid cannot be mistaken for the process,
/// from a task on the caller's tokio runtime: watching costs no thread.
/// Abort the handle to stop watching.
pub fn watch_exit(pid: u32, events: UnboundedSender<TargetEvent>) -> io::Result<AbortHandle> {
    let pidfd = match pidfd_open(pid) {
        // SAFETY: an OwnedFd keeps its descriptor open, and always the same
        // one, until the AsyncFd that owns it is dropped.
        Ok(pidfd) => Some(
            unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
                .map_err(|error| error.into_parts().1)?,
        ),
        // Already gone.
        Err(error) if error.raw_os_error() == Some(libc::ESRCH) => None,
        Err(error) => return Err(error),
    };
    let task = tokio::spawn(async move {
        if let Some(pidfd) = pidfd {
            // A pidfd polls readable once the process has exited.
            if let Err(error) = pidfd.readable().await {
                log::warn!("cannot watch pid {pid} for exit, stop memleak with Ctrl-C: {error}");
                return;
            }
        }
        let _ = events.send(TargetEvent::Exiting { pid, ack: None });
    });
    Ok(task.abort_handle())
}

pub(super) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let result = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, libc::O_NONBLOCK) };
    let Ok(fd) = i32::try_from(result) else { return Err(io::Error::last_os_error()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_whose_file_was_replaced_keeps_its_name() {
        let dir = std::env::temp_dir().join(format!("memleak-program-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let copy = dir.join("sleeper");
        fs::copy("/bin/sleep", &copy).unwrap();
        let mut child = std::process::Command::new(&copy).arg("60").spawn().unwrap();
        fs::remove_file(&copy).unwrap();
        let named = program(child.id());
        child.kill().unwrap();
        child.wait().unwrap();
        let _ = fs::remove_dir(&dir);
        assert_eq!(named, copy.display().to_string());
    }

    #[test]
    fn this_process_is_a_live_user_process_and_pid_1_is_not_a_kernel_thread() {
        assert!(check_process(std::process::id()).is_ok());
        let kthreadd = 2;
        assert!(matches!(check_process(kthreadd), Err(ProcessError::KernelThread(2))));
        assert!(matches!(check_process(u32::MAX), Err(ProcessError::NoSuchProcess(_))));
    }

    /// Threads of this process that tokio started (its blocking pool's are
    /// named "tokio-runtime-worker").
    fn tokio_threads() -> usize {
        let tasks = fs::read_dir("/proc/self/task").unwrap();
        let names = tasks.filter_map(|task| fs::read_to_string(task.ok()?.path().join("comm")).ok());
        names.filter(|name| name.starts_with("tokio")).count()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_exit_is_noticed_without_a_thread_per_process() {
        let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        let mut children: Vec<std::process::Child> = (0..3)
            .map(|_| std::process::Command::new("sleep").arg("30").spawn().expect("run sleep"))
            .collect();
        let handles: Vec<AbortHandle> =
            children.iter().map(|child| watch_exit(child.id(), sender.clone()).unwrap()).collect();
        // The harness's own threads come and go with the tests running
        // beside this one: only threads tokio would start count.
        assert_eq!(tokio_threads(), 0, "no thread per process");
        let second = children.remove(1);
        let second_pid = second.id();
        let mut second = second;
        second.kill().unwrap();
        second.wait().unwrap();
        let Some(TargetEvent::Exiting { pid, ack }) = receiver.recv().await else { panic!("an exit") };
        assert_eq!((pid, ack.is_none()), (second_pid, true));
        for handle in handles {
            handle.abort();
        }
        for mut child in children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
