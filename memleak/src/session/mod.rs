//! A tracing session: the loaded tracer, the processes it traces with
//! their per-process state, and the stacks read so far. Drivers add and
//! remove targets and ask for reports; nothing here prints to stdout or
//! decides when reports are due. `crate::report_loop` is the command
//! line's driver: a report every interval until the end.
//!
//! `targets`: what the user named, and each process traced with the
//! state its reports need; `newcomers`: processes that start or join
//! after the session began.

mod holds;
mod newcomers;
mod targets;

use std::{collections::HashSet, io, path::Path, sync::Arc};

use memleak_common::{
    python::PY_DEFAULT_MAX_FRAMES, FunctionSet, MappingChange, MappingEvent, TraceEvent, WalkCounts,
    KERNEL_TGID,
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

pub(crate) use newcomers::runs_one_of;
use targets::PythonFrames;
pub use targets::{ReportRequest, Selector, Target, TargetSpec};

use crate::{
    attach::{self, kernel_btf, AllocatorChoice, AttachPlan},
    bpf::{
        mapping_calls_in_kernel::SeenBy, rings, EventRing, MapContents, MapFill, StackCatalog, Tracer,
        TracerConfig, TracerError, TracerSettings,
    },
    process::{
        cgroup::{Cgroup, CgroupError},
        command::{CommandError, GatedCommand, SpawnedCommand},
        container,
        feedback::{self, Excluded},
        identity::{HeldProcess, ProcessKey},
        kubernetes,
        lifecycle::{self, ProcessError},
        AddressSpace, TargetEvent,
    },
    python::{
        self,
        code::{CodeCache, CodeLayout},
        frames::PythonStacks,
        Detection,
    },
    report::{culprit::SkipRules, Report},
    unwind::tables::{UnwindStats, UnwindTables},
};
use aya::programs::uprobe::UProbeScope;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error(transparent)]
    Plan(#[from] attach::PlanError),
    #[error(transparent)]
    Tracer(#[from] TracerError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A selector that cannot select (a --pod that is no expression).
    #[error("{0}")]
    Selector(String),
    #[error(transparent)]
    Btf(#[from] kernel_btf::BtfError),
    /// Where the kernel keeps a thread's fsbase, not found.
    #[error("{0}")]
    Fsbase(String),
    #[error("cannot read the mappings of pid {pid}: {source}")]
    Maps { pid: u32, source: io::Error },
    #[error("cannot watch pid {pid} for its exit: {source}")]
    Watch { pid: u32, source: io::Error },
    #[error("cannot read the BPF ring buffers: {0}")]
    Rings(io::Error),
    #[error("{pids} processes given, more than --max-processes {max}")]
    TooManyProcesses { pids: usize, max: u32 },
    #[error("memleak does not trace pid {pid}: {why}")]
    Excluded { pid: u32, why: &'static str },
    #[error("memleak does not trace `{program}`: {why}")]
    ExcludedCommand { program: String, why: &'static str },
}

/// How often the walkers' rescan requests are looked at.
const RESCAN_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// How often a newcomer whose loader is still mapping its libraries is
/// planned again (see `newcomers::LOADING_WATCH`).
const LOADING_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// How a session traces, whatever it traces.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub tracer: TracerSettings,
    pub allocator: AllocatorChoice,
    /// What each stack's culprit is looked for past.
    pub skips: Arc<SkipRules>,
    /// Processes never traced: memleak, and with --trace its output's
    /// readers.
    pub excluded: Vec<Excluded>,
    /// Trace the processes the targets fork, and theirs (-c by default,
    /// -p with --follow-forks).
    pub follow_forks: bool,
    /// Note the OOM killer's victims, for `take_oom_victims` (serve).
    pub oom_kills: bool,
}

/// Whether `memleak serve` will give the session cgroups not there yet
/// (containers not started): it waits for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CgroupsToCome {
    No,
    Awaited,
}

/// How many processes of a cgroup's subtree were added at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupCensus {
    pub processes: usize,
    /// Of them, those in descendant cgroups.
    pub in_descendants: usize,
}

/// What a session has to say between reports.
#[derive(Debug)]
pub enum SessionEvent {
    /// --trace events, in the order they happened.
    Trace(Vec<TraceEvent>),
    /// A target is exiting: its final report is due. See
    /// `TargetEvent::Exiting` for `ack`.
    Exiting { pid: u32, ack: Option<std::sync::mpsc::Sender<()>> },
    /// A target called execve: the old program's final report is due,
    /// then `restart_target`.
    Exec { pid: u32 },
    /// A process forked by target `parent` is traced from now on.
    Followed { pid: u32, parent: u32 },
    /// A process that a selector names is traced from now on, found at
    /// its execve.
    Joined { pid: u32 },
}

pub struct Session {
    tracer: Tracer,
    allocator: AllocatorChoice,
    /// What each stack's culprit is looked for past.
    skips: Arc<SkipRules>,
    sample_rate: u32,
    max_processes: u32,
    /// In the order they were added.
    targets: Vec<Target>,
    stacks: StackCatalog,
    /// How full the bounded maps were at the last collection.
    map_fill: MapFill,
    /// With --cgroup (or serve's --cgroup and --container): the cgroups
    /// whose processes are followed.
    cgroups: Vec<Cgroup>,
    /// Whether BPF records only the tasks of the first of `cgroups` (and
    /// of its descendants), by its id: with one cgroup and nothing else
    /// followed.
    cgroup_filter: bool,
    /// Whether cgroups not there yet will be given (`follow_cgroup`): the
    /// session waits for them with nothing else to follow.
    cgroups_to_come: CgroupsToCome,
    /// With serve's --exe: the executables' file names whose processes
    /// are followed.
    exes: Vec<String>,
    /// With serve's --namespace, --pod or --container-name: the
    /// containers whose processes are followed.
    workloads: Option<kubernetes::Selection>,
    /// Where the cgroup v2 hierarchy is mounted, to place a process's
    /// cgroup path; known when cgroups are followed.
    cgroup2_root: Option<std::path::PathBuf>,
    /// Processes named by pid: an execve keeps them followed, whatever
    /// their new program is.
    named: HashSet<u32>,
    /// Processes that called execve untraced, to check against what is
    /// followed.
    launched: std::collections::VecDeque<u32>,
    /// The ring of stacks with Python frames BPF announces, to resolve
    /// at each look (`PY_NEW_STACKS_MAP`).
    new_python_stacks: Option<EventRing>,
    /// Processes left untraced because --max-processes was reached: how
    /// many in all, and those still running (each counted once).
    not_followed: u64,
    refused: HashSet<ProcessKey>,
    /// Newcomers that could not be planned (no allocator memleak knows
    /// mapped): when that was first seen, and whether memleak gave up on
    /// them, which is said once, and then not tried again while they run.
    unplannable: std::collections::HashMap<ProcessKey, newcomers::PlanFailure>,
    /// With --cgroup: the processes traced from the start.
    cgroup_census: CgroupCensus,
    /// Processes never traced, and with --cgroup those of them already
    /// said to be left out.
    excluded: Vec<Excluded>,
    excluded_said: HashSet<u32>,
    /// With -c: the command memleak started.
    command: Option<SpawnedCommand>,
    exits: UnboundedSender<TargetEvent>,
    exit_events: UnboundedReceiver<TargetEvent>,
    /// --trace events, if asked for.
    trace_events: Option<EventRing>,
    /// mmap, munmap and mremap calls.
    mapping_events: Option<EventRing>,
    /// Each process's table of executable mappings, and with --unwind
    /// dwarf every object's rows; none in kernel mode.
    unwind: Option<UnwindTables>,
    /// How often the walkers' requests to rescan a process are taken: a
    /// library loaded since gets its rows before it allocates much.
    rescan_poll: tokio::time::Interval,
    /// Newcomers found at their execve before their allocator was mapped,
    /// with when memleak stops trying them this often.
    loading: std::collections::HashMap<u32, std::time::Instant>,
    loading_poll: tokio::time::Interval,
    /// The plans of the programs newcomers ran, for their next runs.
    plans_by_program: std::collections::HashMap<newcomers::ProgramKey, AttachPlan>,
    /// Targets that called execve, their old program's report not taken.
    execs: std::collections::VecDeque<u32>,
    /// Whether the targets' children are followed.
    follow_forks: bool,
    /// Whether the fork tracepoint is attached.
    watching_forks: bool,
    /// Processes forked by targets, (child, parent), not followed yet.
    forks: std::collections::VecDeque<(u32, u32)>,
    /// The newcomers held at their execve now.
    holds: holds::ExecHolds,
}

impl Session {
    /// Loads the tracer and attaches it to what `spec` names. For `-p`,
    /// every pid is checked and planned before the BPF object is loaded,
    /// so a wrong pid is reported as such even without privileges.
    pub fn start(spec: &TargetSpec, config: &SessionConfig) -> Result<Self, SessionError> {
        match spec {
            TargetSpec::Kernel { percpu } => Self::start_kernel(*percpu, config),
            TargetSpec::Pids(pids) => Self::start_processes(pids, config),
            TargetSpec::Cgroup(path) => Self::start_cgroup(path, config),
            TargetSpec::Command(command_line) => Self::start_command(command_line, config),
            TargetSpec::Selected(selectors) => Self::start_selected(selectors, config),
        }
    }

    fn new(tracer: Tracer, config: &SessionConfig) -> Result<Self, SessionError> {
        let (exits, exit_events) = tokio::sync::mpsc::unbounded_channel();
        let mut session = Self {
            tracer,
            allocator: config.allocator.clone(),
            skips: Arc::clone(&config.skips),
            sample_rate: config.tracer.sample_rate,
            max_processes: config.tracer.max_processes,
            targets: Vec::new(),
            stacks: StackCatalog::default(),
            map_fill: MapFill {
                max_allocations: u64::from(config.tracer.max_allocations),
                max_stacks: u64::from(config.tracer.max_stacks),
                ..MapFill::default()
            },
            cgroups: Vec::new(),
            cgroup_filter: false,
            cgroups_to_come: CgroupsToCome::No,
            exes: Vec::new(),
            workloads: None,
            cgroup2_root: None,
            named: HashSet::new(),
            launched: std::collections::VecDeque::new(),
            new_python_stacks: None,
            not_followed: 0,
            refused: HashSet::new(),
            unplannable: std::collections::HashMap::new(),
            cgroup_census: CgroupCensus::default(),
            excluded: config.excluded.clone(),
            excluded_said: HashSet::new(),
            command: None,
            exits,
            exit_events,
            trace_events: None,
            mapping_events: None,
            unwind: None,
            rescan_poll: tokio::time::interval(RESCAN_POLL),
            loading: std::collections::HashMap::new(),
            loading_poll: tokio::time::interval(LOADING_POLL),
            plans_by_program: std::collections::HashMap::new(),
            execs: std::collections::VecDeque::new(),
            follow_forks: config.follow_forks,
            watching_forks: false,
            forks: std::collections::VecDeque::new(),
            holds: holds::ExecHolds::default(),
        };
        let rows = session.tracer.unwind_rows(config.tracer.unwind_rows())?;
        session.unwind = Some(UnwindTables::new(rows, config.tracer.unwinding));
        if config.tracer.trace_events {
            session.trace_events =
                Some(EventRing::new(session.tracer.take_events()?).map_err(SessionError::Rings)?);
        }
        session.mapping_events =
            Some(EventRing::new(session.tracer.take_mapping_events()?).map_err(SessionError::Rings)?);
        if session.tracer.walks_python_frames() {
            session.new_python_stacks =
                Some(EventRing::new(session.tracer.take_new_python_stacks()?).map_err(SessionError::Rings)?);
        }
        Ok(session)
    }

    /// The kernel's own allocations, as one target with tgid 0.
    fn start_kernel(percpu: bool, config: &SessionConfig) -> Result<Self, SessionError> {
        let btf = Path::new(kernel_btf::VMLINUX_BTF);
        let cache_size_offset = kernel_btf::member_offset(btf, "kmem_cache", "size")?;
        // Inserting into memleak's own maps makes the BPF memory allocator
        // refill them with kmalloc: counting those would feed on itself.
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let ignored_callers = kernel_btf::bpf_refill_range(&kallsyms).unwrap_or_else(|| {
            log::warn!("alloc_bulk is not in /proc/kallsyms: memleak's own map refills may be counted");
            0..0
        });
        let tracer_config = TracerConfig {
            cache_size_offset,
            ignored_callers,
            ignored_processes: excluded_pids(config),
            ..TracerConfig::new(config.tracer.clone())
        };
        let mut tracer = Tracer::load(&tracer_config)?;
        tracer.attach_kernel(percpu)?;
        let mut session = Self::new(tracer, config)?;
        let plan = AttachPlan {
            path: btf.to_path_buf(),
            display_path: "kernel".to_owned(),
            sites: Vec::new(),
            object: None,
            mapping_object: None,
            operator_objects: Vec::new(),
            not_probed: Vec::new(),
            interpreter: None,
            interpreter_object: None,
        };
        session.targets.push(Target::kernel(plan));
        Ok(session)
    }

    fn start_processes(pids: &[u32], config: &SessionConfig) -> Result<Self, SessionError> {
        let planned = plan_named(pids, config)?;
        let mut tracer = Tracer::load(&process_tracer_config(config)?)?;
        tracer.watch_processes()?;
        let mut session = Self::new(tracer, config)?;
        session.add_named(planned)?;
        Ok(session)
    }

    /// Attaches to processes named by pid, planned by `plan_named`.
    fn add_named(
        &mut self,
        planned: Vec<(HeldProcess, AttachPlan, AddressSpace)>,
    ) -> Result<(), SessionError> {
        for (held, plan, space) in planned {
            let pid = held.key.pid;
            self.add(Target::process(pid, plan, space), UProbeScope::OneProcess(nonzero(pid)))?;
            // The probes are in: if the process held still runs, they
            // reached it; if not, they may be in another given its pid.
            if let Err(error) = held.check_same() {
                self.remove_target(pid)?;
                return Err(error.into());
            }
            self.follow_children_of(pid)?;
            self.named.insert(pid);
        }
        Ok(())
    }

    /// `memleak serve`: the processes the selectors name now, and from
    /// then on those that start or join: each found at its execve (the
    /// exec tracepoint reports every process's), or failing that by
    /// `refresh`'s look through /proc. A pid or a cgroup that is wrong is
    /// an error before anything is loaded.
    fn start_selected(selectors: &[Selector], config: &SessionConfig) -> Result<Self, SessionError> {
        let pids: Vec<u32> = selectors
            .iter()
            .filter_map(|selector| if let Selector::Pid(pid) = selector { Some(*pid) } else { None })
            .collect();
        let planned = plan_named(&pids, config)?;
        let mut cgroups = Vec::new();
        let mut exes = Vec::new();
        let mut cgroups_to_come = CgroupsToCome::No;
        let mut workloads = None;
        for selector in selectors {
            match selector {
                Selector::Pid(_) => {}
                Selector::CgroupToCome => cgroups_to_come = CgroupsToCome::Awaited,
                Selector::Cgroup(path) => {
                    // As the kernel names it, to place processes' cgroups.
                    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
                    cgroups.push(Cgroup::open(&path)?);
                }
                Selector::Exe(name) => exes.push(name.clone()),
                Selector::Workload(filter) => {
                    workloads =
                        Some(kubernetes::Selection::new(filter.clone()).map_err(SessionError::Selector)?);
                }
            }
        }
        let mut tracer_config = TracerConfig {
            newcomer_execs: !cgroups.is_empty()
                || !exes.is_empty()
                || cgroups_to_come == CgroupsToCome::Awaited
                || workloads.is_some(),
            ignored_processes: excluded_pids(config),
            ..process_tracer_config(config)?
        };
        tracer_config.exec_hold = holds::exec_hold(tracer_config.newcomer_execs, &exes);
        // BPF can check one cgroup subtree: with one cgroup and nothing
        // else followed, a process that leaves it stops being recorded.
        let cgroup_filter = cgroups_to_come == CgroupsToCome::No
            && matches!(
                (cgroups.as_slice(), pids.is_empty(), exes.is_empty(), workloads.is_none()),
                ([_], true, true, true)
            );
        if let (true, Some(cgroup)) = (cgroup_filter, cgroups.first()) {
            tracer_config.cgroup_id = cgroup.id;
            tracer_config.cgroup_level = cgroup.level;
        }
        let mut tracer = Tracer::load(&tracer_config)?;
        tracer.watch_processes()?;
        watch_oom_kills(&mut tracer, config);
        let mut session = Self::new(tracer, config)?;
        session.add_named(planned)?;
        session.cgroup2_root = if cgroups.is_empty() && cgroups_to_come == CgroupsToCome::No {
            None
        } else {
            container::cgroup2_mount()
        };
        session.cgroups = cgroups;
        session.cgroup_filter = cgroup_filter;
        session.cgroups_to_come = cgroups_to_come;
        session.exes = exes;
        session.workloads = workloads;
        session.holds.enabled = tracer_config.exec_hold.enabled != 0;
        session.follow_newcomers();
        Ok(session)
    }

    /// `--cgroup`: the processes in the cgroup now; `refresh` picks up
    /// those that join later.
    fn start_cgroup(path: &Path, config: &SessionConfig) -> Result<Self, SessionError> {
        let cgroup = Cgroup::open(path)?;
        let tracer_config = TracerConfig {
            cgroup_id: cgroup.id,
            cgroup_level: cgroup.level,
            ignored_processes: excluded_pids(config),
            ..process_tracer_config(config)?
        };
        let mut tracer = Tracer::load(&tracer_config)?;
        tracer.watch_processes()?;
        let mut session = Self::new(tracer, config)?;
        session.cgroups.push(cgroup);
        session.cgroup_filter = true;
        session.cgroup_census = session.follow_newcomers();
        Ok(session)
    }

    /// `-c`: forks the command held before exec, attaches, then lets it run.
    fn start_command(command_line: &str, config: &SessionConfig) -> Result<Self, SessionError> {
        let gated = GatedCommand::spawn(command_line)?;
        if config.tracer.trace_events && feedback::is_memleak(&gated.program) {
            let program = gated.program.display().to_string();
            gated.abandon();
            return Err(SessionError::ExcludedCommand { program, why: feedback::ANOTHER_MEMLEAK });
        }
        // Everything that can fail happens before the command may run: on
        // a failure it is abandoned, never left to run untraced.
        let prepared = attach::plan::plan_for_program(&gated.program, &config.allocator)
            .map_err(SessionError::from)
            .and_then(|plan| {
                let mut tracer = Tracer::load(&process_tracer_config(config)?)?;
                tracer.watch_processes()?;
                let links = tracer.attach(&plan, UProbeScope::OneProcess(nonzero(gated.pid)))?;
                let mut session = Self::new(tracer, config)?;
                // Before the command runs: its first fork is followed too.
                session.follow_children_of(gated.pid)?;
                Ok((plan, session, links))
            });
        let (plan, mut session, links) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                gated.abandon();
                return Err(error);
            }
        };
        let pid = gated.pid;
        let program = std::fs::canonicalize(&gated.program).unwrap_or_else(|_| gated.program.clone());
        let command = gated.release(session.exits.clone())?;
        // The command has not exec'd yet: its address space and program
        // are read as it runs, not from memleak's fork of itself.
        let mut target = Target::process(pid, plan, AddressSpace::new(pid));
        // Not /proc/PID/exe: the command may not have reached its exec yet.
        target.program = program.display().to_string();
        target.links = Some(links);
        // The exec has happened: the program and its loader are mapped.
        target.refresh();
        target.name_as_mapped();
        if target.naming_pending() {
            // Its libraries are not mapped yet: the kernel names a mapped
            // file by its path with every link resolved, so this is the
            // name it will have until `refresh` finds it mapped.
            if let Ok(resolved) = std::fs::canonicalize(&target.plan.display_path) {
                target.plan.display_path = resolved.display().to_string();
            }
        }
        session.command = Some(command);
        session.push(target)?;
        Ok(session)
    }

    /// With fork following on, has the fork tracepoint report the children
    /// of `pid` (and theirs).
    fn follow_children_of(&mut self, pid: u32) -> Result<(), SessionError> {
        if self.follow_forks {
            if !self.watching_forks {
                self.tracer.watch_forks()?;
                self.watching_forks = true;
            }
            self.tracer.follow(pid)?;
        }
        Ok(())
    }

    /// Starts tracing `child`, forked by target `parent`. A child that is
    /// gone already, or whose allocator cannot be planned, is let go with
    /// a line of its own: the session goes on.
    fn follow_child(&mut self, child: u32, parent: u32) -> Option<SessionEvent> {
        if self.targets.iter().any(|target| target.pid == child) {
            return None;
        }
        let followed = if self.targets.len() >= self.max_processes as usize {
            Err(format!("--max-processes {} reached", self.max_processes))
        } else {
            plan_process(child, &self.allocator)
                .and_then(|(plan, space)| {
                    self.add(Target::process(child, plan, space), UProbeScope::OneProcess(nonzero(child)))
                })
                .map_err(|error| error.to_string())
        };
        match followed {
            Ok(()) => Some(SessionEvent::Followed { pid: child, parent }),
            Err(why) => {
                // Short-lived children often exit before they are planned.
                self.let_go(child, &format!(", forked by pid {parent}"), &why);
                None
            }
        }
    }

    /// Lets go of process `pid` (described by `whose`), which could not be
    /// traced because of `why`: said as a warning if it still runs, as
    /// debug if it exited meanwhile. Nothing of it is kept, nor are its
    /// children followed.
    fn let_go(&mut self, pid: u32, whose: &str, why: &dyn std::fmt::Display) {
        if lifecycle::check_process(pid).is_ok() {
            log::warn!("not tracing pid {pid}{whose}: {why}");
        } else {
            log::debug!("pid {pid}{whose}: exited before it was traced");
        }
        let _ = self.remove_target(pid);
        let _ = self.tracer.unfollow(pid);
    }

    /// Attaches to process `pid` and follows it until it exits.
    fn add(&mut self, mut target: Target, scope: UProbeScope) -> Result<(), SessionError> {
        let pid = target.pid;
        // The unwind table goes in before the probes: a walk that found
        // none, in the moment between, would go by frame pointers and stop
        // short in code built without them, making each allocation of that
        // moment a truncated copy of a real stack.
        self.load_process_tables(&mut target)?;
        if matches!(scope, UProbeScope::OneProcess(_)) {
            match self.tracer.attach(&target.plan, scope) {
                Ok(links) => target.links = Some(links),
                Err(error) => {
                    self.forget_process_tables(pid)?;
                    return Err(error.into());
                }
            }
        }
        match lifecycle::watch_exit(pid, self.exits.clone()) {
            Ok(watch) => target.exit_watch = Some(watch),
            Err(source) => {
                // Gone already (a child that lived a moment): its probes go too.
                if let Some(links) = target.links.take() {
                    self.tracer.detach(links);
                }
                self.forget_process_tables(pid)?;
                return Err(SessionError::Watch { pid, source });
            }
        }
        self.targets.push(target);
        Ok(())
    }

    /// Starts keeping `target`, with its unwind table.
    fn push(&mut self, mut target: Target) -> Result<(), SessionError> {
        self.load_process_tables(&mut target)?;
        self.targets.push(target);
        Ok(())
    }

    /// Gives the walkers `target`'s table of executable mappings, and the
    /// free probe where its allocator's code lies; counts it as traced for
    /// the probes in the kernel, which fire for every process.
    fn load_process_tables(&mut self, target: &mut Target) -> Result<(), SessionError> {
        self.tracer.mark_traced(target.pid)?;
        target.unwinding = self.unwind.as_ref().map(UnwindTables::unwinding);
        if let Some(tables) = self.unwind.as_mut() {
            update_unwind_table(tables, &mut self.tracer, target)?;
        }
        update_allocator_code(&mut self.tracer, target)?;
        if self.tracer.walks_python_frames() {
            update_python_frames(&mut self.tracer, target)?;
        }
        Ok(())
    }

    /// Takes back what `load_process_tables` gave for a process not kept.
    fn forget_process_tables(&mut self, pid: u32) -> Result<(), SessionError> {
        self.tracer.forget_process(pid)?;
        if let Some(tables) = self.unwind.as_mut() {
            tables.forget(pid);
        }
        Ok(())
    }

    /// Re-reads the mappings of the target at `index`, and gives it a new
    /// unwind table if they changed.
    fn refresh_target(&mut self, index: usize) -> Result<(), SessionError> {
        let Some(target) = self.targets.get_mut(index) else { return Ok(()) };
        let changed = target.refresh();
        if changed {
            if let Some(tables) = self.unwind.as_mut() {
                update_unwind_table(tables, &mut self.tracer, target)?;
            }
            update_allocator_code(&mut self.tracer, target)?;
            if matches!(target.python, PythonFrames::NotPython) {
                target.python = PythonFrames::Unknown;
            }
        }
        if self.tracer.walks_python_frames() {
            // Also unchanged: an interpreter not ready at the last look
            // may be now.
            update_python_frames(&mut self.tracer, target)?;
        }
        Ok(())
    }

    /// Looks again for the interpreter of each target whose CPython had
    /// not initialised when last looked for, for `PYTHON_PENDING_FOR`
    /// after it was first seen: an interpreter starts running its script
    /// some tens of milliseconds after it initialises, well before the
    /// next refresh. Says whether any is still to be looked for.
    pub fn detect_pending_python(&mut self) -> Result<bool, SessionError> {
        let mut pending = false;
        for target in &mut self.targets {
            let PythonFrames::Pending { since } = target.python else { continue };
            if since.elapsed() < PYTHON_PENDING_FOR {
                update_python_frames(&mut self.tracer, target)?;
                pending |= matches!(target.python, PythonFrames::Pending { .. });
            }
        }
        Ok(pending)
    }

    /// Rescans the processes whose walks met code they did not know.
    fn take_rescan_requests(&mut self) -> Result<(), SessionError> {
        if self.unwind.is_none() {
            return Ok(());
        }
        for pid in self.tracer.take_rescan_requests()? {
            if let Some(index) = self.targets.iter().position(|target| target.pid == pid) {
                self.refresh_target(index)?;
            }
        }
        Ok(())
    }

    /// The processes traced, in the order they were added.
    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// How the kernel sees munmap and mprotect, whose uprobes it stands in
    /// for (`Tracer::mapping_calls_seen_by`).
    pub fn mapping_calls_seen_by(&self) -> Option<SeenBy> {
        self.tracer.mapping_calls_seen_by()
    }

    /// The path each part of the tracer takes on this kernel, also said
    /// with -v.
    pub fn kernel_paths(&self) -> crate::bpf::kernel_features::Paths {
        let paths = self.tracer.kernel_paths();
        log::debug!(
            "kernel {}: uprobes: {}; munmap and mprotect: {}; stack walks loop with {}",
            paths.release,
            paths.uprobes,
            paths.munmap_mprotect,
            paths.loops
        );
        paths
    }

    /// How long loading the BPF programs took.
    pub fn load_time(&self) -> std::time::Duration {
        self.tracer.load_time()
    }

    /// When the first uprobe was attached, if one was (not in kernel mode).
    pub fn first_attached(&self) -> Option<std::time::Instant> {
        self.tracer.first_attached()
    }

    /// What the unwind tables hold for every process, if there are any.
    pub fn unwind_stats(&self) -> Option<UnwindStats> {
        self.unwind.as_ref().map(UnwindTables::stats)
    }

    /// The cgroup followed, with --cgroup.
    pub fn cgroup(&self) -> Option<&Cgroup> {
        self.cgroups.first()
    }

    /// With --cgroup: the processes traced from the start.
    pub fn cgroup_census(&self) -> CgroupCensus {
        self.cgroup_census
    }

    /// Re-reads the targets' mappings, and picks up processes that joined
    /// the cgroups followed or run the executables followed. Returns how
    /// many were added: the last of `targets()`.
    pub fn refresh(&mut self) -> Result<usize, SessionError> {
        for index in 0..self.targets.len() {
            self.refresh_target(index)?;
        }
        self.forget_untraced()?;
        self.confirm_early_plans();
        let before = self.targets.len();
        // A process found in /proc has made its execve, which the exec
        // tracepoint has put in the ring by then: taken from there first,
        // it is known to be found at its exec.
        self.take_mapping_events();
        self.resolve_new_python_stacks()?;
        while self.take_launched().is_some() {}
        let launched = self.targets.len() - before;
        self.refused.retain(|key| ProcessKey::of(key.pid) == Some(*key));
        self.unplannable.retain(|key, _| ProcessKey::of(key.pid) == Some(*key));
        Ok(launched + self.follow_newcomers().processes)
    }

    /// With --cgroup, processes come and go between memleak's looks: a
    /// child of a traced process is counted and followed from its fork,
    /// before memleak has probed it, and one that exits before that would
    /// leave its entries in the maps for good. Those of processes gone and
    /// never traced are deleted.
    fn forget_untraced(&mut self) -> Result<(), SessionError> {
        if !self.follows_newcomers() {
            return Ok(());
        }
        let traced: HashSet<u32> = self.targets.iter().map(|target| target.pid).collect();
        let gone: HashSet<u32> = self
            .tracer
            .counted_processes()?
            .into_iter()
            .filter(|pid| !traced.contains(pid) && !Path::new(&format!("/proc/{pid}")).exists())
            .collect();
        if !gone.is_empty() {
            log::debug!("forgetting {} processes that left the cgroup untraced", gone.len());
            self.tracer.forget_processes(&gone)?;
            for &pid in &gone {
                self.stacks.forget(pid);
            }
        }
        Ok(())
    }

    /// Waits for the next thing to say: trace events, or a target's exit.
    /// mmap events are taken in as they come.
    pub async fn next_event(&mut self) -> Result<SessionEvent, SessionError> {
        loop {
            self.release_handled();
            if let Some(pid) = self.execs.pop_front() {
                return Ok(SessionEvent::Exec { pid });
            }
            if let Some(pid) = self.take_launched() {
                return Ok(SessionEvent::Joined { pid });
            }
            if let Some((child, parent)) = self.forks.pop_front() {
                match self.follow_child(child, parent) {
                    Some(event) => return Ok(event),
                    None => continue,
                }
            }
            tokio::select! {
                ready = rings::readable(&mut self.trace_events) => {
                    ready.map_err(SessionError::Rings)?;
                    return Ok(SessionEvent::Trace(self.drain_trace_events()));
                }
                ready = rings::readable(&mut self.mapping_events) => {
                    ready.map_err(SessionError::Rings)?;
                    self.take_mapping_events();
                }
                Some(event) = self.exit_events.recv() => match event {
                    TargetEvent::Exiting { pid, ack } => return Ok(SessionEvent::Exiting { pid, ack }),
                    TargetEvent::Mapped { pid, ack } => {
                        // An exec noticed first keeps the old program's
                        // mappings for its final report.
                        self.take_mapping_events();
                        if let Some(index) = self.targets.iter().position(|target| target.pid == pid) {
                            self.refresh_target(index)?;
                        }
                        drop(ack);
                    }
                },
                _ = self.rescan_poll.tick(), if self.unwind.is_some() => self.take_rescan_requests()?,
                _ = self.loading_poll.tick(), if !self.loading.is_empty() => {
                    if let Some(pid) = self.take_loaded() {
                        return Ok(SessionEvent::Joined { pid });
                    }
                }
            }
        }
    }

    /// The --trace events waiting, if any.
    pub fn drain_trace_events(&mut self) -> Vec<TraceEvent> {
        self.trace_events.as_mut().map(EventRing::drain).unwrap_or_default()
    }

    fn take_mapping_events(&mut self) {
        let Some(ring) = self.mapping_events.as_mut() else { return };
        let events: Vec<MappingEvent> = ring.drain();
        for event in &events {
            let change = MappingChange::try_from(event.change);
            let traced = self.targets.iter().any(|target| target.pid == event.tgid);
            let launched = matches!(change, Ok(MappingChange::Launched | MappingChange::LoaderReady));
            let execs = launched || change == Ok(MappingChange::Exec);
            if execs && event.address == memleak_common::HELD {
                // Continued once handled (see `release_handled`).
                self.holds.stopped(event.tgid);
            }
            if launched && !traced {
                self.launched.push_back(event.tgid);
                continue;
            }
            if MappingChange::try_from(event.change) == Ok(MappingChange::Fork) {
                // The BPF side follows only the children of followed processes.
                #[allow(clippy::cast_possible_truncation, reason = "the parent's tgid, sent as a u64")]
                self.forks.push_back((event.tgid, event.address as u32));
                continue;
            }
            let Some(target) = self.targets.iter_mut().find(|target| target.pid == event.tgid) else {
                continue;
            };
            // A target whose execve BPF saw as an untraced process's
            // (`Launched`) called it while memleak was taking it in. Made
            // after its address space was read, the execve left its plan
            // and table those of the program it ran before (a container's
            // `runc init`, found in the cgroup, then running the
            // container's program): taken as its exec, it is planned
            // again. Made before, it is the program planned.
            if change == Ok(MappingChange::Launched) && event.timestamp_ns < target.space.read_ns() {
                continue;
            }
            if matches!(change, Ok(MappingChange::Exec | MappingChange::Launched)) {
                if target.exec_ns.is_none() {
                    target.exec_ns = Some(event.timestamp_ns);
                    self.execs.push_back(target.pid);
                }
                continue;
            }
            target.regions.apply(event);
        }
    }

    /// How the table walks went so far; `None` if the counts cannot be
    /// read, which only --stats would show.
    pub fn walk_counts(&self) -> Option<WalkCounts> {
        self.tracer.walk_counts().map_err(|error| log::debug!("{error}")).ok()
    }

    /// A report for each target, or only for `pid`, from one read of the
    /// maps.
    pub fn collect(
        &mut self,
        pid: Option<u32>,
        request: &ReportRequest,
    ) -> Result<Vec<Report>, SessionError> {
        // mmap events that came before the report count in it, and libraries
        // loaded since the last refresh are symbolized.
        self.take_mapping_events();
        for index in 0..self.targets.len() {
            if pid.is_none_or(|pid| pid == self.targets[index].pid) {
                self.refresh_target(index)?;
            }
        }
        let maps = MapContents::read(&self.tracer, request.collect.reads_each_allocation())?;
        let region_stacks =
            self.targets.iter().flat_map(|target| target.regions.iter().map(|(_, r)| r.stack_id));
        let ids: Vec<u64> = maps.stack_ids().chain(region_stacks).collect();
        self.stacks.ensure(&self.tracer, ids.iter().copied())?;
        if self.tracer.walks_python_frames() {
            // Not only the new stacks: a forked child's first stacks may
            // have come before memleak had looked at its interpreter.
            self.resolve_python_stacks(&ids);
        }
        self.map_fill.allocations = maps.recorded_allocations();
        self.map_fill.stacks = self.stacks.len() as u64;
        let sample_rate = self.sample_rate;
        Ok(self
            .targets
            .iter_mut()
            .filter(|target| pid.is_none_or(|pid| pid == target.pid))
            .map(|target| target.report(&maps, &self.stacks, request, sample_rate, &self.skips))
            .collect())
    }

    /// Resolves the Python frames of the stacks BPF announced since the
    /// last look, before their code objects can be freed, rather than at
    /// the next report.
    fn resolve_new_python_stacks(&mut self) -> Result<(), SessionError> {
        let Some(ring) = self.new_python_stacks.as_mut() else { return Ok(()) };
        let ids: Vec<u64> = ring.drain();
        if ids.is_empty() {
            return Ok(());
        }
        self.stacks.ensure(&self.tracer, ids.iter().copied())?;
        self.resolve_python_stacks(&ids);
        Ok(())
    }

    /// Resolves the Python frames of each of `stack_ids` that has any,
    /// while the code objects they ran are alive.
    fn resolve_python_stacks(&mut self, stack_ids: &[u64]) {
        for &id in stack_ids {
            let words = self.stacks.python_words(id);
            if words.is_empty() {
                continue;
            }
            let Some(owner) = self.stacks.owner(id) else { continue };
            let Some(target) = self.targets.iter_mut().find(|target| target.pid == owner) else { continue };
            // Stopped: stacks walked before are still resolved.
            if let PythonFrames::Walked { codes, stacks, .. } | PythonFrames::Stopped { codes, stacks, .. } =
                &mut target.python
            {
                let checks = self.stacks.python_checks(id);
                if let Some(innermost) = stacks.resolve(id, words, checks, codes) {
                    let shown = crate::report::text::describe(&innermost);
                    log::debug!("pid {owner}: stack {id:#x}: Python frames resolved, the innermost {shown}");
                }
            }
        }
    }

    /// How full the allocation and stack maps were at the last
    /// `collect` (entries zero before the first).
    pub fn map_fill(&self) -> MapFill {
        self.map_fill
    }

    /// Stops tracing process `pid` and forgets it: its probes, what it
    /// left in every BPF map and its stacks. For a process that has exited
    /// and had its final report.
    pub fn remove_target(&mut self, pid: u32) -> Result<(), SessionError> {
        self.remove(pid, false)
    }

    /// As `remove_target`, for a process that has exited: its probes can
    /// no longer fire, and are taken out without waiting for the kernel.
    pub fn remove_exited_target(&mut self, pid: u32) -> Result<(), SessionError> {
        self.remove(pid, true)
    }

    fn remove(&mut self, pid: u32, exited: bool) -> Result<(), SessionError> {
        let Some(index) = self.targets.iter().position(|target| target.pid == pid) else { return Ok(()) };
        let target = self.targets.remove(index);
        if let Some(watch) = &target.exit_watch {
            watch.abort();
        }
        match target.links {
            Some(links) if exited => self.tracer.detach_exited(links),
            Some(links) => self.tracer.detach(links),
            None => {}
        }
        if pid != KERNEL_TGID {
            self.tracer.forget_process(pid)?;
            self.stacks.forget(pid);
        }
        if let Some(tables) = self.unwind.as_mut() {
            tables.forget(pid);
        }
        Ok(())
    }

    /// `memleak serve --watch`: starts tracing process `pid`, found
    /// growing, as if it had been named by pid (an execve keeps it traced)
    /// until `stop_tracing`.
    pub fn trace_process(&mut self, pid: u32) -> Result<(), SessionError> {
        if self.targets.len() >= self.max_processes as usize {
            return Err(SessionError::TooManyProcesses {
                pids: self.targets.len() + 1,
                max: self.max_processes,
            });
        }
        if let Some(why) = left_out(&self.excluded, self.trace_events.is_some(), pid) {
            return Err(SessionError::Excluded { pid, why });
        }
        let held = HeldProcess::hold(pid)?;
        lifecycle::check_process(pid)?;
        let (plan, space) = plan_process(pid, &self.allocator)?;
        self.add_named(vec![(held, plan, space)])
    }

    /// What a probe's trap costs on this machine (`bpf::overhead`).
    pub fn price_traps(&mut self) -> Result<crate::bpf::overhead::TrapCost, SessionError> {
        Ok(self.tracer.price_traps()?)
    }

    /// The kernel's count of run time and runs of the uprobe programs:
    /// (ns, runs).
    pub fn uprobe_run_time(&self) -> (u64, u64) {
        self.tracer.uprobe_run_time()
    }

    /// The processes the OOM killer picked since the last call, by tgid;
    /// none unless the session was started with `oom_kills`.
    pub fn take_oom_victims(&mut self) -> Vec<u32> {
        self.tracer.take_oom_victims()
    }

    /// Stops tracing process `pid`, which runs on: its probes are
    /// detached, and what it left in the maps is forgotten.
    pub fn stop_tracing(&mut self, pid: u32) -> Result<(), SessionError> {
        self.named.remove(&pid);
        self.remove_target(pid)
    }

    /// Starts process `pid`'s books afresh after its execve, its old
    /// program's final report taken: the new program's allocator is
    /// planned and probed, and what the old one left is forgotten.
    /// Returns the new target, or `None` if the process is no longer
    /// traced: it is gone, its new program has no allocator memleak knows,
    /// or (with --cgroup) it will be picked up again as a newcomer.
    pub fn restart_target(&mut self, pid: u32) -> Result<Option<&Target>, SessionError> {
        let Some(old) = self.targets.iter().find(|target| target.pid == pid) else { return Ok(None) };
        let watched = old.exit_watch.is_some();
        self.remove_target(pid)?;
        if self.follows_newcomers() && !self.named.contains(&pid) {
            return Ok(None);
        }
        if let Some(why) = left_out(&self.excluded, self.trace_events.is_some(), pid) {
            log::warn!("pid {pid} is no longer traced after its execve: {why}");
            return Ok(None);
        }
        let planned = plan_process(pid, &self.allocator);
        let (plan, space) = match planned {
            Ok(planned) => planned,
            Err(error) => {
                log::warn!("pid {pid} is no longer traced after its execve: {error}");
                return Ok(None);
            }
        };
        let mut target = Target::process(pid, plan, space);
        // Before its uprobes, as `add` does: the tracepoint that sees
        // munmap sends only the calls of processes marked.
        self.tracer.mark_traced(pid)?;
        target.links = Some(self.tracer.attach(&target.plan, UProbeScope::OneProcess(nonzero(pid)))?);
        if watched {
            target.exit_watch = Some(
                lifecycle::watch_exit(pid, self.exits.clone())
                    .map_err(|source| SessionError::Watch { pid, source })?,
            );
        }
        self.push(target)?;
        self.release(pid, true);
        Ok(self.targets.last())
    }

    /// Whether the session still has something to trace: a cgroup may be
    /// joined later, or an executable started, so its session goes on even
    /// with no process.
    pub fn is_done(&self) -> bool {
        self.targets.is_empty() && !self.follows_newcomers()
    }
}

impl Drop for Session {
    /// A command memleak started does not outlive the session; then the
    /// tracer, dropped with it, detaches every probe.
    fn drop(&mut self) {
        // An exit or mapping event not taken holds the command at a stop
        // until its acknowledgement is dropped: drop them all, and refuse
        // new ones, before waiting for the command to end.
        self.exit_events.close();
        while self.exit_events.try_recv().is_ok() {}
        if self.holds.enabled {
            // No process is held from now on; those BPF stopped, told of
            // or not yet, are continued (`holds::Stopped`).
            self.tracer.stop_holding();
            self.take_mapping_events();
            self.holds.continue_all();
        }
        if let Some(command) = self.command.take() {
            command.finish();
        }
    }
}

/// Gives `target` the table of its executable mappings as they are now,
/// unless BPF has that one already.
fn update_unwind_table(
    tables: &mut UnwindTables,
    tracer: &mut Tracer,
    target: &mut Target,
) -> Result<(), TracerError> {
    if target.is_kernel() {
        return Ok(());
    }
    let (table, built) = tables.table_for(target.pid, &target.space);
    if built.new_objects > 0 {
        log::debug!(
            "pid {}: {} rows for {} new objects in {} ms",
            target.pid,
            built.new_rows,
            built.new_objects,
            built.elapsed.as_millis()
        );
    }
    target.unwind_built.get_or_insert(built);
    let mut table = table;
    table.generation = target.unwind_table.as_ref().map_or(0, |previous| previous.generation);
    if target.unwind_table.as_ref() == Some(&table) {
        return Ok(());
    }
    // A new table: the walkers' caches of the old one no longer hold.
    table.generation = tables.new_generation();
    tracer.set_process_mappings(target.pid, &table)?;
    log::debug!("pid {}: unwind table of {} executable mappings in use", target.pid, table.count);
    target.unwind_table = Some(table);
    Ok(())
}

/// How often a target whose CPython has not initialised yet is looked at
/// again (`Session::detect_pending_python`): its script's first lines run
/// tens of milliseconds after it initialises. A look is a read of its
/// maps and of a few words of its memory; the files are read once.
pub const PYTHON_PENDING_RETRY: std::time::Duration = std::time::Duration::from_millis(2);

/// How long after memleak first sees a CPython that has not initialised
/// it keeps looking again every few milliseconds: a process that maps an
/// interpreter it never starts (a program embedding it for plugins) is
/// then looked at only at each refresh.
const PYTHON_PENDING_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// Stops walking the Python frames of `target`, walked until now, if it
/// has started a sub-interpreter since: one read or two.
fn stop_at_subinterpreters(tracer: &mut Tracer, target: &mut Target) -> Result<(), TracerError> {
    let PythonFrames::Walked { runtime, codes, .. } = &target.python else { return Ok(()) };
    if !python::runs_subinterpreters(codes.memory(), runtime.runtime_address, &runtime.offsets)
        .unwrap_or(false)
    {
        return Ok(());
    }
    let pid = target.pid;
    tracer.forget_python_process(pid)?;
    log::warn!("pid {pid}: no more Python frames: {}", python::SUBINTERPRETERS);
    if let PythonFrames::Walked { runtime, codes, stacks } = std::mem::take(&mut target.python) {
        target.python = PythonFrames::Stopped { runtime, codes, stacks };
    }
    Ok(())
}

/// Looks for CPython in `target`, unless looked for already, and has the
/// BPF side walk its Python frames if it is found and passes every check.
/// Says the interpreter found, or once why its frames are not read.
fn update_python_frames(tracer: &mut Tracer, target: &mut Target) -> Result<(), TracerError> {
    let pid = target.pid;
    if matches!(target.python, PythonFrames::Walked { .. }) {
        return stop_at_subinterpreters(tracer, target);
    }
    let since = match target.python {
        PythonFrames::Unknown => std::time::Instant::now(),
        PythonFrames::Pending { since } => since,
        PythonFrames::NotPython
        | PythonFrames::Walked { .. }
        | PythonFrames::Stopped { .. }
        | PythonFrames::Off => return Ok(()),
    };
    if target.is_kernel() {
        return Ok(());
    }
    target.python = match python::detect(pid) {
        Detection::Enabled(runtime) => {
            // Detection enables 3.8 to 3.13 only.
            let minor = u8::try_from(runtime.version.minor).unwrap_or(u8::MAX);
            let layout = CodeLayout::from_offsets(minor, runtime.pycode_type, &runtime.offsets);
            match CodeCache::open(pid, layout) {
                Ok(codes) => {
                    tracer.set_python_process(pid, runtime.config)?;
                    crate::status::say(&format!(
                        "pid {pid} runs python {} ({}): its stacks show Python frames",
                        runtime.version, runtime.path
                    ));
                    log::info!("pid {pid}: {runtime}");
                    PythonFrames::Walked {
                        runtime,
                        codes: Box::new(codes),
                        stacks: PythonStacks::new(
                            tracer.python_frame_limit().unwrap_or(PY_DEFAULT_MAX_FRAMES),
                        ),
                    }
                }
                Err(error) => {
                    log::warn!("pid {pid}: no Python frames: its memory cannot be read: {error}");
                    PythonFrames::Off
                }
            }
        }
        Detection::NotPython => PythonFrames::NotPython,
        Detection::TryLater(why) => {
            if matches!(target.python, PythonFrames::Unknown) {
                log::debug!("pid {pid}: Python frames later: {why}");
            }
            PythonFrames::Pending { since }
        }
        Detection::Disabled(why) => {
            log::warn!("pid {pid}: no Python frames: {why}");
            PythonFrames::Off
        }
    };
    Ok(())
}

/// Tells the free probe where `target`'s allocator code lies, once the
/// process maps it (a newcomer probed at its execve maps it later): a
/// release of an unknown block called from there is the allocator's own,
/// not counted as unrecorded. All the code of the allocator's library;
/// for an allocator linked into the program itself (tikv-jemallocator's
/// jemalloc), only its probed functions, from the first to the end of the
/// last: all of the program's code would have made every free it calls
/// the allocator's own.
fn update_allocator_code(tracer: &mut Tracer, target: &Target) -> Result<(), TracerError> {
    let Some(object) = target.plan.object.as_deref().filter(|_| !target.is_kernel()) else { return Ok(()) };
    let code = if target.space.is_executable(object) {
        let functions = target.plan.sites.iter().filter(|site| site.functions != FunctionSet::default());
        let start = functions.clone().map(|site| site.file_offset).min();
        let end = functions.map(|site| site.file_offset + site.code_length.max(1)).max();
        start.zip(end).and_then(|(start, end)| target.space.code_at_offsets(object, start..end))
    } else {
        target.space.code_of_file(object)
    };
    match code {
        Some((start, end)) => {
            tracer.set_allocator_code(target.pid, memleak_common::AllocatorCode { start, end })
        }
        None => Ok(()),
    }
}

/// Process `pid`'s address space as it is now, and the probes for its
/// allocator.
fn plan_process(pid: u32, allocator: &AllocatorChoice) -> Result<(AttachPlan, AddressSpace), SessionError> {
    let space = AddressSpace::read(pid).map_err(|source| SessionError::Maps { pid, source })?;
    Ok((attach::plan::plan_for_process(&space, allocator)?, space))
}

/// Processes named by pid, each checked and planned before the BPF
/// object is loaded, so that a wrong pid is reported as such even without
/// privileges.
fn plan_named(
    pids: &[u32],
    config: &SessionConfig,
) -> Result<Vec<(HeldProcess, AttachPlan, AddressSpace)>, SessionError> {
    if pids.len() > config.tracer.max_processes as usize {
        return Err(SessionError::TooManyProcesses { pids: pids.len(), max: config.tracer.max_processes });
    }
    let mut planned = Vec::new();
    for &pid in pids {
        if let Some(why) = left_out(&config.excluded, config.tracer.trace_events, pid) {
            return Err(SessionError::Excluded { pid, why });
        }
        // Held from this first look, so that the attach, later, is checked
        // to have reached this process and no other given its pid.
        let held = HeldProcess::hold(pid)?;
        lifecycle::check_process(pid)?;
        let (plan, space) = plan_process(pid, &config.allocator)?;
        planned.push((held, plan, space));
    }
    Ok(planned)
}

/// With `oom_kills`, has `tracer` note the OOM killer's victims, with
/// the program that reads the tracepoint as the kernel passes it; a
/// kernel where that fails is said once, and no kill is seen.
fn watch_oom_kills(tracer: &mut Tracer, config: &SessionConfig) {
    if !config.oom_kills {
        return;
    }
    let btf = Path::new(kernel_btf::VMLINUX_BTF);
    let watched = match kernel_btf::tracepoint_arguments(btf, memleak_common::programs::OOM_VICTIM_TRACEPOINT)
    {
        // mark_victim(int pid) before 6.8; (struct task_struct *, uid_t) after.
        Ok(Some(arguments)) => tracer.watch_oom_kills(arguments > 1).map_err(|error| error.to_string()),
        Ok(None) => Err("the kernel has no mark_victim tracepoint".to_owned()),
        Err(error) => Err(error.to_string()),
    };
    if let Err(why) = watched {
        crate::status::say(&format!("OOM kills will not be seen: {why}"));
    }
}

/// The tracer's settings for processes (-p, -c): with fork following, the
/// kernel's layout of a task, to tell its new processes from new threads.
fn process_tracer_config(config: &SessionConfig) -> Result<TracerConfig, SessionError> {
    let mut tracer_config = TracerConfig::new(config.tracer.clone());
    // The OOM killer's victim comes as its task from Linux 6.8.
    if config.follow_forks || config.oom_kills {
        let btf = Path::new(kernel_btf::VMLINUX_BTF);
        tracer_config.task_tgid_offset = kernel_btf::member_offset(btf, "task_struct", "tgid")?;
    }
    if config.tracer.python_max_frames.is_some() {
        // Found here, before any process runs, and kept: the first look at
        // an interpreter needs it too, and races its script's first line.
        tracer_config.py_fsbase_offset = crate::python::fsbase_offset().map_err(SessionError::Fsbase)?;
    }
    Ok(tracer_config)
}

/// Why memleak leaves process `pid` alone, if it does: one of those it
/// never traces, or with --trace (`trace`) another memleak.
fn left_out(excluded: &[Excluded], trace: bool, pid: u32) -> Option<&'static str> {
    if let Some(excluded) = excluded.iter().find(|excluded| excluded.pid == pid) {
        return Some(excluded.why);
    }
    (trace && feedback::runs_memleak(pid)).then_some(feedback::ANOTHER_MEMLEAK)
}

fn excluded_pids(config: &SessionConfig) -> Vec<u32> {
    config.excluded.iter().map(|excluded| excluded.pid).collect()
}

fn nonzero(pid: u32) -> std::num::NonZeroU32 {
    // A user-space process never has pid 0 (the idle task's).
    std::num::NonZeroU32::new(pid).unwrap_or(std::num::NonZeroU32::MIN)
}
