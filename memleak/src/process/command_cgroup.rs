//! Everything a `-c` command starts ends with it: its forks, a worker in a
//! process group or a session of its own, a daemon that double-forked
//! away. A process group misses the last two and a PID namespace changes
//! the pids memleak reports, so the command runs in a cgroup v2 of its own
//! (`memleak-command-PID`, a child of memleak's own cgroup, so the limits
//! memleak runs under hold for the command too): no fork leaves it.
//!
//! memleak ends it on its way out: SIGTERM to every process in it, then
//! after `GRACE` SIGKILL through `cgroup.kill`, then the directory is
//! removed. A reaper process (memleak's own binary, started with
//! `REAPER_FLAG`) does the same when memleak dies without doing it, even
//! by SIGKILL: it waits for the end of a pipe whose writing end only
//! memleak holds.
//!
//! Without a cgroup (no cgroup v2, or one memleak may not write), memleak
//! becomes a child subreaper instead: the command's orphans are handed to
//! memleak, which ends them the same way, but only when memleak itself
//! ends normally.

use std::{
    fs,
    io::{self, Read as _},
    os::fd::{FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// How long the command's processes have between SIGTERM and SIGKILL.
pub const GRACE: Duration = Duration::from_secs(3);

/// How long memleak waits for killed processes to be gone: SIGKILL is not
/// refused, so this bounds only a kernel that is very slow.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// How often an ending is looked at.
const POLL: Duration = Duration::from_millis(20);

/// The first argument that makes memleak's binary a reaper, followed by
/// the cgroup's path. Not a flag users see.
pub const REAPER_FLAG: &str = "--internal-command-reaper";

/// How the command's processes are kept together.
pub enum Containment {
    Cgroup(CommandCgroup),
    /// memleak is their subreaper: orphans become its children.
    Subreaper,
}

impl Containment {
    /// A cgroup for a command, with its reaper; failing that, memleak as
    /// subreaper, said in one line.
    pub fn new() -> Self {
        match CommandCgroup::create() {
            Ok(cgroup) => Self::Cgroup(cgroup),
            Err(error) => {
                log::warn!(
                    "cannot make a cgroup for the command ({error}): what it starts is ended with it only \
                     when memleak ends normally, not if memleak is killed"
                );
                become_subreaper();
                Self::Subreaper
            }
        }
    }

    /// Puts the command's process `pid`, not yet running the command, in.
    /// On failure the command is not held, and falls back to the
    /// subreaper, said in one line.
    pub fn enter(&mut self, pid: u32) {
        let Self::Cgroup(cgroup) = self else { return };
        if let Err(error) = cgroup.add(pid) {
            log::warn!(
                "cannot move the command into {} ({error}): what it starts is ended with it only when \
                 memleak ends normally, not if memleak is killed",
                cgroup.path.display()
            );
            let Self::Cgroup(cgroup) = std::mem::replace(self, Self::Subreaper) else { return };
            cgroup.remove();
            become_subreaper();
        }
    }

    /// Ends every process the command started (`command`, reaped by its
    /// watcher, aside): SIGTERM, then SIGKILL after `GRACE`.
    /// `command_done` says when the command itself is gone.
    pub fn end(self, command: u32, command_done: &dyn Fn() -> bool) {
        match self {
            Self::Cgroup(cgroup) => cgroup.end(command_done),
            Self::Subreaper => end_descendants(std::process::id(), command, command_done),
        }
    }
}

/// A cgroup v2 made for the command, and the reaper that empties and
/// removes it if memleak cannot.
pub struct CommandCgroup {
    path: PathBuf,
    reaper: Child,
    /// Its end tells the reaper that memleak is gone.
    reaper_pipe: OwnedFd,
}

impl CommandCgroup {
    fn create() -> io::Result<Self> {
        let root = super::container::cgroup2_mount()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no cgroup v2 file system is mounted"))?;
        let own = super::container::cgroup2_path("self")
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "memleak is in no cgroup v2"))?;
        let path =
            root.join(own.trim_start_matches('/')).join(format!("memleak-command-{}", std::process::id()));
        if let Err(error) = fs::create_dir(&path) {
            // Left by an earlier memleak of this pid, killed with its reaper.
            if error.kind() != io::ErrorKind::AlreadyExists {
                return Err(error);
            }
            fs::remove_dir(&path)?;
            fs::create_dir(&path)?;
        }
        match start_reaper(&path) {
            Ok((reaper, reaper_pipe)) => Ok(Self { path, reaper, reaper_pipe }),
            Err(error) => {
                let _ = fs::remove_dir(&path);
                Err(error)
            }
        }
    }

    fn add(&self, pid: u32) -> io::Result<()> {
        fs::write(self.path.join("cgroup.procs"), pid.to_string())
    }

    /// Ends the processes in the cgroup and removes it, then lets the
    /// reaper go.
    fn end(self, command_done: &dyn Fn() -> bool) {
        end_cgroup(&self.path, command_done);
        self.remove();
    }

    /// Lets the reaper go (it removes the cgroup if it is still there) and
    /// waits for it.
    fn remove(self) {
        let Self { path, mut reaper, reaper_pipe } = self;
        let _ = fs::remove_dir(&path);
        drop(reaper_pipe);
        let _ = reaper.wait();
    }
}

/// Starts memleak's binary as the reaper of `cgroup`: in a process group
/// of its own, so that a Ctrl-C meant for memleak and the command does not
/// reach it, and reading a pipe that only memleak writes.
fn start_reaper(cgroup: &Path) -> io::Result<(Child, OwnedFd)> {
    use std::os::unix::process::CommandExt as _;
    let (read_end, write_end) = pipe()?;
    let reaper = Command::new("/proc/self/exe")
        // As `ps` shows it.
        .arg0("memleak")
        .arg(REAPER_FLAG)
        .arg(cgroup)
        .stdin(Stdio::from(read_end))
        // Nothing of memleak's output stays open after memleak: a reader
        // waits for its end.
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    Ok((reaper, write_end))
}

/// The reaper's life, if memleak was started as one: waits until memleak
/// is gone, then ends what is left in the cgroup and removes it. `None`
/// when memleak was started as itself.
pub fn reaper_main() -> Option<std::process::ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some(REAPER_FLAG.as_ref()) {
        return None;
    }
    let cgroup = PathBuf::from(args.next()?);
    // SAFETY: setting signal dispositions to SIG_IGN has no preconditions.
    unsafe {
        // memleak's end, not a signal to memleak's group or session, ends
        // the reaper.
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(signal, libc::SIG_IGN);
        }
    }
    // Until the end of the pipe: memleak is gone, or has let it go.
    let mut byte = [0u8; 1];
    let mut stdin = io::stdin().lock();
    while !matches!(stdin.read(&mut byte), Ok(0) | Err(_)) {}
    if cgroup.exists() {
        end_cgroup(&cgroup, &|| true);
        let _ = fs::remove_dir(&cgroup);
    }
    Some(std::process::ExitCode::SUCCESS)
}

/// SIGTERM to every process in `cgroup`, and once `GRACE` has passed with
/// some left, SIGKILL to all through `cgroup.kill`; returns when the
/// cgroup is empty and `command_done`, or `KILL_WAIT` later.
fn end_cgroup(cgroup: &Path, command_done: &dyn Fn() -> bool) {
    let empty = || {
        fs::read_to_string(cgroup.join("cgroup.events"))
            .map_or(true, |events| events.lines().any(|line| line == "populated 0"))
    };
    for pid in pids_in(cgroup) {
        signal(pid, libc::SIGTERM);
    }
    if wait_until(GRACE, &|| empty() && command_done()) {
        return;
    }
    log::debug!("processes of the command still run {} s after SIGTERM: killing them", GRACE.as_secs());
    if let Err(error) = fs::write(cgroup.join("cgroup.kill"), "1") {
        log::warn!("cannot kill the processes in {}: {error}", cgroup.display());
        // A kernel before cgroup.kill (5.14): one by one.
        for pid in pids_in(cgroup) {
            signal(pid, libc::SIGKILL);
        }
    }
    if !wait_until(KILL_WAIT, &|| empty() && command_done()) {
        log::warn!("processes of the command are still in {} after SIGKILL", cgroup.display());
    }
}

fn pids_in(cgroup: &Path) -> Vec<u32> {
    let procs = fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
    procs.lines().filter_map(|line| line.parse().ok()).collect()
}

/// Polls `done` until it holds (true) or `limit` has passed (false).
fn wait_until(limit: Duration, done: &dyn Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

fn become_subreaper() {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes a flag and has no other effect.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) } != 0 {
        log::warn!("cannot become the command's subreaper: {}", io::Error::last_os_error());
    }
}

/// Without a cgroup: the descendants of `ancestor` (memleak), SIGTERM
/// first and SIGKILL after `GRACE`; those handed to memleak as their
/// subreaper are reaped here, `command` aside (its watcher reaps it).
fn end_descendants(ancestor: u32, command: u32, command_done: &dyn Fn() -> bool) {
    let alive = || {
        let parents = parents();
        reap_orphans(ancestor, command, &parents);
        descendants(ancestor, &parents)
    };
    for pid in alive() {
        signal(pid, libc::SIGTERM);
    }
    if wait_until(GRACE, &|| alive().is_empty() && command_done()) {
        return;
    }
    for pid in alive() {
        signal(pid, libc::SIGKILL);
    }
    wait_until(KILL_WAIT, &|| alive().is_empty() && command_done());
}

/// Every live process's parent, from /proc.
fn parents() -> Vec<(u32, u32)> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let after_name = stat.rsplit_once(") ")?.1;
            let mut fields = after_name.split(' ');
            // A zombie has ended already.
            (fields.next()? != "Z").then_some(())?;
            Some((pid, fields.next()?.parse().ok()?))
        })
        .collect()
}

/// The live descendants of `ancestor` in `parents`.
fn descendants(ancestor: u32, parents: &[(u32, u32)]) -> Vec<u32> {
    let mut found = vec![ancestor];
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(parents.iter().filter(|(_, of)| *of == parent).map(|(pid, _)| *pid));
        next += 1;
    }
    found.remove(0);
    found
}

/// Reaps memleak's ended children other than `command`: orphans handed
/// to it as subreaper. Nothing if `ancestor` is not memleak.
fn reap_orphans(ancestor: u32, command: u32, live: &[(u32, u32)]) {
    if ancestor != std::process::id() {
        return;
    }
    let own = ancestor;
    let Ok(entries) = fs::read_dir("/proc") else { return };
    for pid in entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
        if pid == command || live.iter().any(|(live, _)| *live == pid) {
            continue;
        }
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let parent = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(1)?.parse::<u32>().ok());
        if parent == Some(own) {
            let mut status = 0;
            // SAFETY: reaps a zombie child of memleak's, which nobody else waits for.
            unsafe { libc::waitpid(pid as libc::pid_t, &raw mut status, libc::WNOHANG) };
        }
    }
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory preconditions. The pid was read from
    // the cgroup or /proc a moment ago; a pid reused since by a process
    // outside would be the only stray, and SIGKILL goes by cgroup.kill.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// A pipe whose ends close on exec: for the command's start-up gate and
/// errors, and the cgroup helper's report.
pub(super) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_are_found_through_every_generation_and_nothing_else() {
        let parents = [(10, 1), (11, 10), (12, 11), (13, 12), (20, 1), (14, 10)];
        let mut found = descendants(10, &parents);
        found.sort_unstable();
        assert_eq!(found, vec![11, 12, 13, 14]);
        assert!(descendants(13, &parents).is_empty());
    }

    #[test]
    fn the_fallback_ends_a_descendant_that_ignores_sigterm_after_the_grace() {
        // A process of its own stands for memleak: the walk must not reach
        // the children of the other tests running in this process.
        let mut standing_in =
            Command::new("sh").args(["-c", "(trap '' TERM; exec sleep 60) & wait"]).spawn().unwrap();
        let ancestor = standing_in.id();
        let ignoring_sigterm = || {
            descendants(ancestor, &parents())
                .into_iter()
                .find(|pid| fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe.ends_with("sleep")))
        };
        assert!(wait_until(Duration::from_secs(10), &|| ignoring_sigterm().is_some()), "sleep started");
        let started = Instant::now();
        end_descendants(ancestor, 0, &|| true);
        assert!(started.elapsed() >= GRACE, "SIGTERM was ignored: SIGKILL comes after the grace");
        assert_eq!(ignoring_sigterm(), None, "killed");
        // Its parent's `wait` ends with it.
        assert!(standing_in.wait().unwrap().success());
    }
}
