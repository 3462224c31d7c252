//! Processes that start or join after the session began: those that a
//! cgroup or executable followed names, found at their execve (the exec
//! tracepoint reports them) or by a look through /proc, each taken in on
//! its own unless a bound or an exclusion leaves it out.

use std::{
    collections::HashSet,
    os::unix::fs::MetadataExt as _,
    path::Path,
    time::{Duration, Instant},
};

use super::{nonzero, plan_process, CgroupCensus, CgroupsToCome, Session, SessionError, Target, UProbeScope};
use crate::process::{
    cgroup::{Cgroup, CgroupProcess},
    container,
    identity::ProcessKey,
    lifecycle,
};
use crate::{attach::AttachPlan, process::AddressSpace};

/// How long a newcomer's allocator may stay unmapped before memleak
/// takes it to have none it knows. A process found just after its
/// execve, its loader still at work, has only its program and the loader
/// mapped; under load that lasts longer than one look.
const LOADER_GRACE: Duration = Duration::from_secs(1);

/// How long a newcomer found at its execve, its allocator not mapped
/// yet, is planned again every `LOADING_POLL`: its loader maps its
/// libraries within milliseconds, and each allocation made before its
/// probes are in is not seen. After that the look through /proc takes
/// over.
const LOADING_WATCH: Duration = Duration::from_millis(200);

/// Programs whose plans are kept for their next runs, at most: past it,
/// the plans are dropped and made again.
const PLANS_KEPT: usize = 64;

/// A program as its dynamic loader loads it: its executable file, and the
/// `LD_` variables of its environment, which may change what it loads.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct ProgramKey {
    device: u64,
    inode: u64,
    loader_environment: Vec<Vec<u8>>,
}

impl ProgramKey {
    fn of(pid: u32) -> Option<Self> {
        let executable = std::fs::metadata(format!("/proc/{pid}/exe")).ok()?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let loader_environment = environ
            .split(|&byte| byte == 0)
            .filter(|variable| variable.starts_with(b"LD_"))
            .map(<[u8]>::to_vec)
            .collect();
        Some(Self { device: executable.dev(), inode: executable.ino(), loader_environment })
    }
}

/// Whether two plans probe the same allocator file.
fn same_file(a: &AttachPlan, b: &AttachPlan) -> bool {
    let id = |plan: &AttachPlan| {
        let metadata = plan.object.as_ref()?.metadata().ok()?;
        Some((metadata.dev(), metadata.ino()))
    };
    id(a).is_some() && id(a) == id(b)
}

/// A newcomer memleak could not plan.
#[derive(Clone, Copy, Debug)]
pub(super) struct PlanFailure {
    first_seen: Instant,
    given_up: bool,
}

impl Session {
    /// Records that newcomer `pid` could not be planned; whether memleak
    /// gives up on it now, `LOADER_GRACE` after it was first seen so: true
    /// once, for the warning.
    fn give_up_planning(&mut self, pid: u32) -> bool {
        let Some(key) = ProcessKey::of(pid) else { return false };
        let failure = self
            .unplannable
            .entry(key)
            .or_insert(PlanFailure { first_seen: Instant::now(), given_up: false });
        if failure.given_up || failure.first_seen.elapsed() < LOADER_GRACE {
            return false;
        }
        failure.given_up = true;
        true
    }

    /// Starts following the processes the cgroups (and their descendants)
    /// and the executables name that are not followed yet, each probed on
    /// its own. Returns how many were added.
    pub(super) fn follow_newcomers(&mut self) -> CgroupCensus {
        self.follow_remade_cgroup();
        self.hold_cgroups();
        let mut known: HashSet<u32> = self.targets.iter().map(|target| target.pid).collect();
        known.extend(self.unplannable.iter().filter(|(_, failure)| failure.given_up).map(|(key, _)| key.pid));
        // Those found at their execve are taken in there, each once.
        known.extend(self.launched.iter().copied().chain(self.holds.pending()));
        let mut seen = HashSet::new();
        let mut candidates: Vec<CgroupProcess> = self
            .cgroups
            .iter()
            .flat_map(Cgroup::processes)
            .filter(|process| !known.contains(&process.pid) && seen.insert(process.pid))
            .collect();
        if !self.exes.is_empty() {
            let running = processes_running(&self.exes).into_iter();
            let newcomers = running.filter(|pid| !known.contains(pid) && seen.insert(*pid));
            candidates.extend(newcomers.map(|pid| CgroupProcess { pid, in_descendant: false }));
        }
        if let Some(workloads) = &mut self.workloads {
            let running = workloads.processes().into_iter();
            let newcomers = running.filter(|pid| !known.contains(pid) && seen.insert(*pid));
            candidates.extend(newcomers.map(|pid| CgroupProcess { pid, in_descendant: false }));
        }
        let whose = if self.exes.is_empty() && self.workloads.is_none() { " of the cgroup" } else { "" };
        let mut added = CgroupCensus::default();
        for CgroupProcess { pid, in_descendant } in candidates {
            if self.take_in(pid, whose, false) {
                added.processes += 1;
                added.in_descendants += usize::from(in_descendant);
            }
        }
        added
    }

    /// Starts tracing newcomer `pid` (described by `whose`) unless it is
    /// one memleak leaves alone, gone, past --max-processes or cannot be
    /// planned or probed: then it is let go with a line, and the session
    /// goes on. Returns whether it is traced. `at_exec`: it has just
    /// called execve, and its loader may not have mapped its allocator
    /// yet; then a failed plan is left to the next look, unsaid.
    fn take_in(&mut self, pid: u32, whose: &str, at_exec: bool) -> bool {
        if let Some(why) = super::left_out(&self.excluded, self.trace_events.is_some(), pid) {
            if self.excluded_said.insert(pid) {
                log::warn!("not tracing pid {pid}{whose}: {why}");
            }
            return false;
        }
        if lifecycle::check_process(pid).is_err() {
            return false;
        }
        if self.targets.len() >= self.max_processes as usize {
            self.refuse_past_bound(pid, whose);
            return false;
        }
        let Some((plan, space, planned_before_loading)) = self.plan_newcomer(pid, whose, at_exec) else {
            return false;
        };
        let mut target = Target::process(pid, plan, space);
        target.planned_before_loading = planned_before_loading;
        let traced = self
            .add(target, UProbeScope::OneProcess(nonzero(pid)))
            .and_then(|()| self.follow_children_of(pid));
        if let Err(error) = traced {
            // Processes come and go: one that exits while memleak
            // attaches, or cannot be probed, must not end the trace.
            self.let_go(pid, whose, &error);
            return false;
        }
        true
    }

    /// Plans newcomer `pid`'s probes, or says why not. At its execve its
    /// loader has mapped none of its libraries yet: if an earlier run of
    /// the same program was planned, its plan is taken at once, the
    /// probes placed on the allocator's file before it is mapped (the
    /// kernel puts them in when it is), and `true` says the plan awaits
    /// confirmation; else it is planned again as it loads (`loading`).
    fn plan_newcomer(
        &mut self,
        pid: u32,
        whose: &str,
        at_exec: bool,
    ) -> Option<(AttachPlan, AddressSpace, bool)> {
        // The program is named before it is planned, and the plan kept
        // for it only if it still runs it after: a process that calls
        // execve meanwhile (`runc init` running a container's program)
        // would have its old program's plan kept for its new one.
        let program = ProgramKey::of(pid);
        match plan_process(pid, &self.allocator) {
            Ok((plan, space)) => {
                if let Some(program) = program.filter(|program| ProgramKey::of(pid).as_ref() == Some(program))
                {
                    self.remember_plan(program, &plan);
                }
                Some((plan, space, false))
            }
            Err(error) if at_exec => {
                if let Some((plan, space)) = self.plan_of_an_earlier_run(pid) {
                    log::debug!(
                        "pid {pid}{whose}: probed at its execve as an earlier run of its program was"
                    );
                    return Some((plan, space, true));
                }
                // Its loader has yet to map its libraries: it is planned
                // again as soon as they may be there.
                let watched_until = Instant::now() + LOADING_WATCH;
                if self.loading.insert(pid, watched_until).is_none() {
                    log::debug!(
                        "pid {pid}{whose}: not planned at its execve, tried again as it loads: {error}"
                    );
                }
                None
            }
            Err(error) => {
                if self.give_up_planning(pid) {
                    log::warn!("not tracing pid {pid}{whose}: {error}");
                } else {
                    log::debug!("pid {pid}{whose}: not planned yet, left to the next look: {error}");
                }
                None
            }
        }
    }

    /// Keeps `plan` for the next runs of `program`.
    fn remember_plan(&mut self, program: ProgramKey, plan: &AttachPlan) {
        if self.plans_by_program.len() >= PLANS_KEPT && !self.plans_by_program.contains_key(&program) {
            self.plans_by_program.clear();
        }
        self.plans_by_program.insert(program, plan.clone());
    }

    /// The plan of an earlier run of the program process `pid` runs, and
    /// its address space as it is now.
    fn plan_of_an_earlier_run(&self, pid: u32) -> Option<(AttachPlan, AddressSpace)> {
        let plan = self.plans_by_program.get(&ProgramKey::of(pid)?)?.clone();
        Some((plan, AddressSpace::read(pid).ok()?))
    }

    /// Checks the plans of targets probed before their libraries were
    /// mapped, once they are: a target whose allocator turns out to be
    /// another file than its program's earlier run's is planned again.
    pub(super) fn confirm_early_plans(&mut self) {
        let unconfirmed: Vec<u32> = self
            .targets
            .iter()
            .filter(|target| target.planned_before_loading)
            .map(|target| target.pid)
            .collect();
        for pid in unconfirmed {
            let Some(target) = self.targets.iter_mut().find(|target| target.pid == pid) else { continue };
            let Ok(now) = crate::attach::plan::plan_for_process(&target.space, &self.allocator) else {
                continue; // Still loading.
            };
            if same_file(&now, &target.plan) {
                target.planned_before_loading = false;
                continue;
            }
            log::debug!(
                "pid {pid}: its allocator is {}, not its earlier run's: planned again",
                now.display_path
            );
            if self.remove_target(pid).is_ok() {
                self.take_in(pid, "", false);
            }
        }
    }

    /// With the BPF cgroup filter: a cgroup removed and made again at the
    /// path followed (a container restarted, stopped and started) is
    /// another cgroup, with another id, whose processes the filter would
    /// leave out though they are probed. The filter takes the new id
    /// before any of them is probed: each is looked for at its path.
    fn follow_remade_cgroup(&mut self) {
        if !self.cgroup_filter {
            return;
        }
        let Some(cgroup) = self.cgroups.first_mut() else { return };
        let Some(id) = cgroup.id_now().filter(|&id| id != cgroup.id) else { return };
        match self.tracer.set_cgroup_filter(id) {
            Ok(()) => {
                log::debug!("cgroup {} made again: id {} now, was {}", cgroup.path.display(), id, cgroup.id);
                cgroup.id = id;
            }
            Err(error) => log::warn!("cannot follow cgroup {} made again: {error}", cgroup.path.display()),
        }
    }

    /// Counts process `pid`, left untraced because --max-processes is
    /// reached, once however often it is seen; says so for the first.
    fn refuse_past_bound(&mut self, pid: u32, whose: &str) {
        let Some(key) = ProcessKey::of(pid) else { return };
        if !self.refused.insert(key) {
            return;
        }
        self.not_followed += 1;
        if self.not_followed == 1 {
            log::warn!(
                "not tracing pid {pid}{whose}: --max-processes {} reached; processes left untraced are \
                 counted from now on",
                self.max_processes
            );
        } else {
            log::debug!("not tracing pid {pid}{whose}: --max-processes {} reached", self.max_processes);
        }
    }

    /// How many processes were left untraced because --max-processes was
    /// reached, each counted once.
    pub fn processes_not_followed(&self) -> u64 {
        self.not_followed
    }

    /// Whether processes that start or join later are looked for: with
    /// cgroups, executables or pods followed.
    pub(super) fn follows_newcomers(&self) -> bool {
        !self.cgroups.is_empty()
            || !self.exes.is_empty()
            || self.cgroups_to_come == CgroupsToCome::Awaited
            || self.workloads.is_some()
    }

    /// Follows the processes of cgroup `path` from now on, instead of
    /// those of cgroup `instead_of` if given (a container's, removed and
    /// run again under the same name: the new one's cgroup has another
    /// path). Its processes are taken in by the next `refresh`. With the
    /// BPF cgroup filter, the filter takes the new cgroup if it is as
    /// deep as the old one (the depth is fixed at load), else it is
    /// lifted: each process is probed on its own anyway.
    pub fn follow_cgroup(&mut self, path: &Path, instead_of: Option<&Path>) -> Result<(), SessionError> {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let cgroup = Cgroup::open(&path)?;
        if self.cgroup2_root.is_none() {
            self.cgroup2_root = container::cgroup2_mount();
        }
        let replaced = instead_of.and_then(|old| self.cgroups.iter().position(|known| known.path == old));
        // The filter is on the first cgroup, the only one when it is on.
        let filtered_level = self.cgroups.first().map(|filtered| filtered.level);
        let (id, level) = (cgroup.id, cgroup.level);
        match replaced {
            Some(index) => self.cgroups[index] = cgroup,
            None => self.cgroups.push(cgroup),
        }
        if !self.cgroup_filter {
            return Ok(());
        }
        if replaced == Some(0) && filtered_level == Some(level) {
            self.tracer.set_cgroup_filter(id)?;
            log::debug!("cgroup filter now on {} (id {id})", path.display());
        } else {
            self.tracer.set_cgroup_filter(0)?;
            self.cgroup_filter = false;
            log::debug!("cgroup filter lifted: {} is not in place of the cgroup it was on", path.display());
        }
        Ok(())
    }

    /// Whether process `pid` is one a cgroup, executable or container
    /// followed names.
    fn selects(&mut self, pid: u32) -> bool {
        let exe_matches = !self.exes.is_empty() && runs_one_of(pid, &self.exes);
        exe_matches
            || (!self.cgroups.is_empty() && self.in_followed_cgroup(pid))
            || self.workloads.as_mut().is_some_and(|workloads| workloads.selects(pid))
    }

    /// Whether process `pid` is in a followed cgroup or below one (only in
    /// one, for a cgroup whose level is unknown).
    fn in_followed_cgroup(&self, pid: u32) -> bool {
        let Some(root) = &self.cgroup2_root else { return false };
        let Some(path) = container::cgroup2_path(pid) else { return false };
        let directory = root.join(path.trim_start_matches('/'));
        self.cgroups.iter().any(|cgroup| {
            if cgroup.level.is_some() {
                directory.starts_with(&cgroup.path)
            } else {
                directory == cgroup.path
            }
        })
    }

    /// Starts tracing process `pid` if a cgroup or executable followed
    /// names it and it is not traced yet: after its execve, say, once
    /// `restart_target` has let it go. Returns whether it is traced; held
    /// at its execve, it runs on from here.
    pub fn adopt(&mut self, pid: u32) -> bool {
        // Held at its execve, it has just called it.
        let held = self.holds.is_stopped(pid);
        let taken_in = self.adopt_at(pid, held);
        self.release(pid, taken_in);
        taken_in
    }

    /// Whether process `pid`, found at its execve before its loader
    /// mapped its allocator, is to be taken in once it has.
    pub fn is_loading(&self, pid: u32) -> bool {
        self.loading.contains_key(&pid)
    }

    /// `adopt`; `at_exec` as for `take_in`.
    fn adopt_at(&mut self, pid: u32, at_exec: bool) -> bool {
        if self.targets.iter().any(|target| target.pid == pid) || !self.selects(pid) {
            return false;
        }
        self.follow_remade_cgroup();
        self.take_in(pid, "", at_exec)
    }

    /// Plans again the newcomers whose loader was still mapping their
    /// libraries. Returns the first taken in, if any.
    pub(super) fn take_loaded(&mut self) -> Option<u32> {
        let now = Instant::now();
        self.loading.retain(|_, watched_until| *watched_until > now);
        // Those stopped at their loader are taken in there.
        let pending: HashSet<u32> = self.holds.pending().collect();
        let loading: Vec<u32> = self.loading.keys().copied().filter(|pid| !pending.contains(pid)).collect();
        let mut taken_in = None;
        for pid in loading {
            if self.adopt_at(pid, true) {
                self.loading.remove(&pid);
                if let Some(target) = self.targets.last_mut() {
                    target.found_at_exec = true;
                }
                taken_in = Some(pid);
                break;
            }
        }
        self.stop_no_more_at_loaders();
        taken_in
    }

    /// Takes in the processes that called execve untraced and that a
    /// selector names, and those held at their loader's breakpoint.
    /// Returns the first taken in, if any: the others wait for the next
    /// call.
    pub(super) fn take_launched(&mut self) -> Option<u32> {
        while let Some(pid) = self.launched.pop_front() {
            // A new program may have the allocator its old one lacked.
            self.unplannable.retain(|key, _| key.pid != pid);
            let taken_in = self.adopt_at(pid, true);
            if taken_in {
                self.loading.remove(&pid);
            }
            // Held, it runs on: probed, let go, or to be stopped again at
            // its loader.
            self.release(pid, taken_in);
            if taken_in {
                if let Some(target) = self.targets.last_mut() {
                    target.found_at_exec = true;
                }
                self.stop_no_more_at_loaders();
                return Some(pid);
            }
        }
        self.stop_no_more_at_loaders();
        None
    }
}

/// Whether process `pid` runs one of the programs `names` names: by its
/// executable's file name, or by the name it was started under, as `ps`
/// and `pgrep` show it. They differ for a program started through a
/// symlink: Debian's redis-server is a link to redis-check-rdb.
pub(crate) fn runs_one_of(pid: u32, names: &[String]) -> bool {
    let executable = executable_name(pid);
    let started_as = command_name(pid);
    names.iter().any(|name| {
        executable.as_deref() == Some(name.as_str())
            || started_as.as_deref().is_some_and(|comm| comm_names(comm, name))
    })
}

/// Whether `comm`, a process's name as the kernel keeps it (the file name
/// it was started under, cut to 15 bytes), is `name`.
fn comm_names(comm: &str, name: &str) -> bool {
    comm == name || (name.len() > MAX_COMM && name.as_bytes().get(..MAX_COMM) == Some(comm.as_bytes()))
}

/// The bytes of a name the kernel keeps of a process (`TASK_COMM_LEN`
/// less its NUL).
const MAX_COMM: usize = 15;

/// /proc/PID/comm, without its line feed.
fn command_name(pid: u32) -> Option<String> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_owned())
}

/// The file name of process `pid`'s executable, without the " (deleted)"
/// the kernel adds once the file is replaced; `None` for a kernel thread
/// or a process gone.
fn executable_name(pid: u32) -> Option<String> {
    let path = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let name = path.file_name()?.to_str()?;
    Some(name.strip_suffix(" (deleted)").unwrap_or(name).to_owned())
}

/// The processes running now that run one of the programs `exes` names.
fn processes_running(exes: &[String]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| runs_one_of(pid, exes))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_matches_the_comm_the_kernel_cut_to_15_bytes() {
        assert!(comm_names("redis-server", "redis-server"));
        assert!(comm_names("a-very-long-dae", "a-very-long-daemon-name"));
        assert!(!comm_names("a-very-long-dae", "a-very-long-da"), "a shorter name is another program");
        assert!(!comm_names("redis-server", "redis"));
    }

    #[test]
    fn a_program_is_known_by_its_file_and_its_loader_environment() {
        let start = |program: &str, environment: &[(&str, &str)]| {
            let argument = if program == "tail" { ["-f", "/dev/null"].as_slice() } else { ["30"].as_slice() };
            std::process::Command::new(program)
                .args(argument)
                .envs(environment.iter().copied())
                .stdin(std::process::Stdio::null())
                .spawn()
                .expect("start a program")
        };
        let mut processes = [
            start("sleep", &[]),
            start("sleep", &[("HOME", "/elsewhere")]),
            start("sleep", &[("LD_BIND_NOW", "1")]),
            start("tail", &[]),
        ];
        // Once each has run its program: a key taken before its execve
        // would be the test's own (which failed a run on a busy machine).
        let programs = ["sleep", "sleep", "sleep", "tail"];
        for (process, program) in processes.iter().zip(programs) {
            let exe = format!("/proc/{}/exe", process.id());
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !std::fs::read_link(&exe)
                .is_ok_and(|path| path.file_name().is_some_and(|name| name == program))
            {
                assert!(std::time::Instant::now() < deadline, "{program} never ran");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        let keys: Vec<Option<ProgramKey>> =
            processes.iter().map(|process| ProgramKey::of(process.id())).collect();
        for process in &mut processes {
            let _ = process.kill();
            let _ = process.wait();
        }
        assert!(keys.iter().all(Option::is_some), "{keys:?}");
        assert_eq!(keys[0], keys[1], "another environment, but the same for the loader");
        assert_ne!(keys[0], keys[2], "LD_BIND_NOW changes how the loader loads");
        assert_ne!(keys[0], keys[3], "another program");
    }
}
