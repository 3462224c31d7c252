//! What a session traces: the target the user named, and per process
//! traced, the state its reports need.

use std::{path::PathBuf, sync::Arc};

use memleak_common::{ProcessMappings, WalkEnd};
use tokio::task::AbortHandle;

use crate::{
    attach::AttachPlan,
    bpf::{Links, MapContents, StackCatalog},
    collect::{
        self,
        regions::{Region, Regions},
        trend::TrendTracker,
        CollectOptions,
    },
    model::{Frame, MappingKind, ModuleMapping, ResidentMemory, Truncation, Unwinding},
    process::{container, identity::ProcessKey, kubernetes, lifecycle, AddressSpace},
    python::{code::CodeCache, frames::PythonStacks, PythonRuntime},
    report::{
        culprit::SkipRules, memory::ResidentGrowth, options::SortKey, Report, ReportContext, StackSource,
    },
    symbolize::{
        self,
        call_paths::{CallPaths, Met},
        missing::{self, Advice},
        StackSymbolizer,
    },
    unwind::tables::TableBuilt,
};

/// What to trace, as the user named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetSpec {
    /// The kernel's own allocations; with `percpu`, per-CPU ones too.
    Kernel { percpu: bool },
    /// Running processes.
    Pids(Vec<u32>),
    /// Every process of a cgroup v2 directory, those that join later too.
    Cgroup(PathBuf),
    /// A command line to run and trace from its first instruction.
    Command(String),
    /// What `memleak serve` follows: every process any of these selects,
    /// those that start or join later included.
    Selected(Vec<Selector>),
}

/// One way of naming processes to follow; several may be combined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// A running process.
    Pid(u32),
    /// Every process of a cgroup v2 directory and its descendants (a
    /// container's, found from its id or name).
    Cgroup(PathBuf),
    /// Every process whose executable's file name is this.
    Exe(String),
    /// A cgroup not there yet (a container not started), given later to
    /// `Session::follow_cgroup`: the session waits for it.
    CgroupToCome,
    /// Every process of the containers whose pod and container names
    /// match (serve's --namespace, --pod, --container-name).
    Workload(kubernetes::WorkloadFilter),
}

/// Which stacks a round of reports keeps, and how many.
#[derive(Clone, Copy, Debug)]
pub struct ReportRequest {
    pub collect: CollectOptions,
    pub sort: SortKey,
    /// Stacks kept per report; `usize::MAX` for all.
    pub top: usize,
    /// Whether these reports are the next of the series each stack's
    /// trend compares, or reports taken aside (a query to `memleak
    /// serve`) that leave the series as it was.
    pub in_series: bool,
}

/// A traced process (or the kernel) and what its reports need.
pub struct Target {
    pub pid: u32,
    /// Its executable, as it names it.
    pub program: String,
    pub plan: AttachPlan,
    /// Its pid inside its own pid namespace, when that differs.
    pub namespace_pid: Option<u32>,
    pub(super) space: AddressSpace,
    symbolizer: StackSymbolizer,
    /// Which of its BPF stacks are one call path.
    call_paths: CallPaths,
    /// Where the symbols its frames lack would come from, per object.
    advice: Advice,
    trends: TrendTracker,
    pub(super) regions: Regions,
    /// The probes placed for this process alone, taken out when it is
    /// forgotten; none for the kernel.
    pub(super) links: Option<Links>,
    /// Its exit watch, for a process memleak did not start.
    pub(super) exit_watch: Option<AbortHandle>,
    /// How its user stacks are walked; `None` for the kernel.
    pub unwinding: Option<Unwinding>,
    /// Its table of executable mappings, as last given to BPF.
    pub(super) unwind_table: Option<Box<ProcessMappings>>,
    /// What building its first table took.
    pub unwind_built: Option<TableBuilt>,
    /// When (`CLOCK_MONOTONIC` ns) it called execve, until its books are
    /// closed: its mappings are no longer re-read, and its last report
    /// counts only what the old program allocated.
    pub(super) exec_ns: Option<u64>,
    /// Whether the program and allocator are still named as planned, not
    /// yet as the process maps them: see `name_as_mapped`.
    naming_pending: bool,
    /// When it started, which tells it from a later process given the
    /// same pid; 0 for the kernel, or if it was gone before it was read.
    pub start_time: u64,
    /// The full id of the container it runs in, from its cgroup's name.
    pub container: Option<String>,
    /// It was found at its execve (see `MappingChange::Launched`), not by
    /// a look through /proc.
    pub found_at_exec: bool,
    /// Its probes were placed at its execve with the plan of an earlier
    /// run of its program, before its loader mapped the allocator; the
    /// session checks the plan once it has.
    pub planned_before_loading: bool,
    /// Where its Python frames stand (--python).
    pub(super) python: PythonFrames,
    /// Its resident memory and the bytes tracked at its first report of
    /// the series, and when (ms since 1970): what growth is counted from.
    first_resident: Option<(ResidentMemory, u64, u64)>,
}

/// Where a target's Python frames stand (--python).
#[derive(Default)]
pub enum PythonFrames {
    /// Not looked for yet, or to look for again once the mappings change.
    #[default]
    Unknown,
    /// CPython that has not initialised yet (a process caught at its
    /// exec), first seen so `since`: looked for again every few
    /// milliseconds for a while (see `Session::detect_pending_python`), so
    /// that its first lines of Python have their frames, then at each
    /// refresh.
    Pending { since: std::time::Instant },
    /// No CPython was mapped when looked for: looked for again once the
    /// mappings change (a program's libraries map after its exec).
    NotPython,
    /// The BPF side walks them; `codes` resolves their words into
    /// `stacks`.
    Walked { runtime: Box<PythonRuntime>, codes: Box<CodeCache>, stacks: PythonStacks },
    /// Walked until the process started a sub-interpreter: its stacks
    /// from before keep their Python frames, new ones have none.
    Stopped { runtime: Box<PythonRuntime>, codes: Box<CodeCache>, stacks: PythonStacks },
    /// CPython whose frames memleak does not read, said once.
    Off,
}

impl Target {
    /// A process, with its address space read now.
    pub fn process(pid: u32, plan: AttachPlan, space: AddressSpace) -> Self {
        let namespace_pid = lifecycle::namespace_pid(pid);
        Self {
            pid,
            program: space.executable_name().map_or_else(|| lifecycle::program(pid), str::to_owned),
            plan,
            namespace_pid,
            space,
            symbolizer: StackSymbolizer::new(pid, namespace_pid),
            call_paths: CallPaths::default(),
            advice: Advice::default(),
            trends: TrendTracker::default(),
            regions: Regions::default(),
            links: None,
            exit_watch: None,
            unwinding: None,
            unwind_table: None,
            unwind_built: None,
            exec_ns: None,
            naming_pending: false,
            start_time: ProcessKey::of(pid).map_or(0, |key| key.start_time),
            container: container::container_of(pid),
            found_at_exec: false,
            planned_before_loading: false,
            python: PythonFrames::Unknown,
            first_resident: None,
        }
    }

    /// The process, told apart from any other that has or had its pid.
    pub fn key(&self) -> ProcessKey {
        ProcessKey { pid: self.pid, start_time: self.start_time }
    }

    /// The kernel, as a target of pid 0.
    pub fn kernel(plan: AttachPlan) -> Self {
        let pid = memleak_common::KERNEL_TGID;
        Self {
            pid,
            program: "kernel".to_owned(),
            plan,
            namespace_pid: None,
            // Never refreshed: kernel addresses are symbolized through
            // kallsyms, and every one is code.
            space: AddressSpace::new(pid),
            symbolizer: StackSymbolizer::kernel(),
            call_paths: CallPaths::default(),
            advice: Advice::default(),
            trends: TrendTracker::default(),
            regions: Regions::default(),
            links: None,
            exit_watch: None,
            unwinding: None,
            unwind_table: None,
            unwind_built: None,
            exec_ns: None,
            naming_pending: false,
            start_time: 0,
            container: None,
            found_at_exec: false,
            planned_before_loading: false,
            python: PythonFrames::Unknown,
            first_resident: None,
        }
    }

    pub fn is_kernel(&self) -> bool {
        self.pid == memleak_common::KERNEL_TGID
    }

    /// Re-reads the process's mappings, so that libraries loaded since can
    /// be symbolized even if it exits before its next report; says whether
    /// they changed.
    pub fn refresh(&mut self) -> bool {
        if self.is_kernel() || self.exec_ns.is_some() {
            return false;
        }
        let changes = self.space.refresh();
        if self.naming_pending && changes.any {
            self.name_as_mapped();
        }
        for object in &changes.added {
            log::debug!("pid {} maps {}", self.pid, object.path);
        }
        for object in &changes.removed {
            log::debug!("pid {} no longer maps {}", self.pid, object.path);
        }
        changes.any
    }

    /// Names the program and the allocator as the process maps them, once
    /// it has: a command planned before its exec was planned from the
    /// paths memleak found (`./server`, or the dynamic loader's
    /// `/lib/x86_64-linux-gnu/libc.so.6` where the process maps
    /// `/usr/lib/x86_64-linux-gnu/libc.so.6`).
    /// Until the allocator is mapped, `refresh` tries again.
    pub fn name_as_mapped(&mut self) {
        if let Some(program) = self.space.executable_name() {
            program.clone_into(&mut self.program);
        }
        let planned = self.plan.object.as_ref().and_then(|file| self.space.object_of_file(file));
        self.naming_pending = planned.is_none();
        if let Some(object) = planned {
            self.plan.display_path.clone_from(&object.name);
        }
    }

    /// Whether `name_as_mapped` has yet to find the allocator mapped.
    pub fn naming_pending(&self) -> bool {
        self.naming_pending
    }

    /// The process's report from `maps`; `stacks` must know every stack
    /// id they mention.
    pub fn report(
        &mut self,
        maps: &MapContents,
        stacks: &StackCatalog,
        request: &ReportRequest,
        sample_rate: u32,
        skips: &SkipRules,
    ) -> Report {
        let mut options = request.collect;
        if let Some(exec_ns) = self.exec_ns {
            // Only what was allocated before the exec: the old program's.
            let since_exec = maps.now_ns.saturating_sub(exec_ns);
            options.min_age_ns = Some(options.min_age_ns.unwrap_or(0).max(since_exec));
        }
        let options = &options;
        let mut snapshot = collect::snapshot(self.pid, maps, |id| stacks.owner(id), options);
        let Self { space, symbolizer, regions, trends, plan, call_paths, unwinding, python, .. } = self;
        let mut python = python.merger();
        collect::add_regions(&mut snapshot, regions, maps.now_ns, options, |start, region| {
            let frames = frames_of(symbolizer, space, stacks, &mut python, region.stack_id);
            region_kind(plan, space, start, region, &frames)
        });
        call_paths.merge(&mut snapshot, |stack_id| {
            let frames = frames_of(symbolizer, space, stacks, &mut python, stack_id);
            Met { truncation: truncation_of(stacks, stack_id, *unwinding, &frames, python.as_ref()), frames }
        });
        let unrecorded_frees = trends.unrecorded_frees_since(&snapshot);
        let trends = if request.in_series { trends.observe(&snapshot) } else { trends.peek(&snapshot) };
        let context = ReportContext {
            program: &self.program,
            allocator: &self.plan.display_path,
            namespace_pid: self.namespace_pid,
            min_age_ms: request.collect.min_age_ns.unwrap_or(0) / 1_000_000,
            top: request.top,
            sort: request.sort,
            sample_rate,
            unwinding: self.unwinding,
            skips,
        };
        let source = TargetStacks {
            symbolizer: &mut self.symbolizer,
            space: &self.space,
            stacks,
            unwinding: self.unwinding,
            call_paths: &self.call_paths,
            python: self.python.merger(),
        };
        let mut report = Report::build(snapshot, &context, &trends, source);
        report.delta_unrecorded_frees = unrecorded_frees;
        if options.modules {
            report.modules = modules_of(&report, &self.space);
        }
        self.account_resident(&mut report, request.in_series);
        let space = &self.space;
        report.missing_symbols = missing::missing_symbols(
            report.stacks.iter().flat_map(|stack| &stack.frames).map(|frame| &**frame),
            report.stacks.iter().filter_map(|stack| stack.culprit.as_deref()),
            |frame| space.find(frame.address).map(|mapping| &*mapping.object),
            &mut self.advice,
            &report.program,
        );
        report
    }

    /// Puts the process's resident memory in `report`, and how it moved
    /// since its first report of the series (a report in the series
    /// before it is the first). Not for the kernel.
    fn account_resident(&mut self, report: &mut Report, in_series: bool) {
        if self.is_kernel() {
            return;
        }
        let Some(resident) = crate::process::resident::read(self.pid) else { return };
        // CPython's arenas hold its small objects, which only
        // --python-allocator tracks: their growth is not memory the
        // allocator keeps.
        let tracked = report.total_bytes.saturating_add(report.hidden_mappings.python_arena_bytes);
        match self.first_resident {
            Some((first, first_tracked, first_ms)) => {
                let seconds = (report.time_unix_ms.saturating_sub(first_ms) + 500) / 1000;
                let growth = ResidentGrowth::between((&first, first_tracked), (&resident, tracked), seconds);
                report.memory.not_a_leak = growth.not_a_leak(&report.allocator);
                report.memory.resident_growth = Some(growth);
            }
            None if in_series => {
                self.first_resident = Some((resident, tracked, report.time_unix_ms));
            }
            None => {}
        }
        report.memory.resident = Some(resident);
    }
}

/// A target's stacks as a report reads them: each call path as the stack
/// it is shown with.
struct TargetStacks<'a> {
    symbolizer: &'a mut StackSymbolizer,
    space: &'a AddressSpace,
    stacks: &'a StackCatalog,
    unwinding: Option<Unwinding>,
    call_paths: &'a CallPaths,
    python: Option<PythonMerger<'a>>,
}

impl StackSource for TargetStacks<'_> {
    fn frames(&mut self, stack_id: u64) -> Arc<[Arc<Frame>]> {
        let shown = self.call_paths.shown(stack_id);
        frames_of(self.symbolizer, self.space, self.stacks, &mut self.python, shown)
    }

    fn truncation(&self, stack_id: u64) -> Option<Truncation> {
        let shown = self.call_paths.shown(stack_id);
        let frames = self.symbolizer.cached(shown).unwrap_or_default();
        truncation_of(self.stacks, shown, self.unwinding, &frames, self.python.as_ref())
    }
}

/// Why the walk of a stack stopped short of its root, if it did, as its
/// symbolized `frames` end or its walk ended.
fn truncation_of(
    stacks: &StackCatalog,
    stack_id: u64,
    unwinding: Option<Unwinding>,
    frames: &[Arc<Frame>],
    python: Option<&PythonMerger<'_>>,
) -> Option<Truncation> {
    let native = native_truncation(stacks, stack_id, unwinding, frames);
    // The native walk's end says more: it comes after the Python frames.
    if native.is_none() && python.is_some_and(|python| python.stacks.reached_limit(stack_id)) {
        return Some(Truncation::PythonDepthLimit);
    }
    native
}

/// Why the native walk of a stack stopped short of its root, if it did.
fn native_truncation(
    stacks: &StackCatalog,
    stack_id: u64,
    unwinding: Option<Unwinding>,
    frames: &[Arc<Frame>],
) -> Option<Truncation> {
    // A walk that could not follow Go's switch back to the goroutine's
    // stack (its caller's frame pointer led to no code) says so.
    if frames.last().is_some_and(|last| symbolize::ends_at_stack_switch(last)) {
        return Some(Truncation::StackSwitch);
    }
    match WalkEnd::try_from(stacks.walk_end(stack_id)?) {
        Ok(WalkEnd::Root) | Err(_) => None,
        Ok(WalkEnd::DepthLimit) => Some(Truncation::DepthLimit),
        Ok(WalkEnd::NoUnwindInfo) => Some(Truncation::NoUnwindInfo),
        Ok(WalkEnd::UnknownCode) => Some(Truncation::UnknownCode),
        Ok(WalkEnd::BadFrame) => Some(Truncation::BadFrame),
        // Only news when the tables were meant to walk it.
        Ok(WalkEnd::FramePointers) => {
            (unwinding == Some(Unwinding::Dwarf)).then_some(Truncation::FramePointers)
        }
    }
}

/// What the region at `start` that `frames` mapped is. A return address
/// is one past its call: the call is what lies in the function.
fn region_kind(
    plan: &AttachPlan,
    space: &AddressSpace,
    start: u64,
    region: &Region,
    frames: &[Arc<Frame>],
) -> MappingKind {
    let object_of_call = |address: u64| {
        let call = address.saturating_sub(1);
        space.find(call).map(|mapping| (mapping, call))
    };
    let in_interpreter = |address: u64| {
        object_of_call(address).is_some_and(|(mapping, _)| plan.is_interpreter(mapping.object.file()))
    };
    if let Some(interpreter) = &plan.interpreter {
        if collect::regions::is_python_arena(
            region.end - start,
            frames,
            interpreter.arena_size,
            in_interpreter,
        ) {
            // Its objects tracked, an arena is the allocator's own, as
            // glibc's are; not tracked, the interpreter's.
            return if interpreter.objects_tracked {
                MappingKind::AllocatorMmap
            } else {
                MappingKind::PythonArena
            };
        }
    }
    let in_allocator = |address: u64| {
        object_of_call(address).is_some_and(|(mapping, call)| {
            plan.in_allocator_call(mapping.object.file(), mapping.file_offset(call))
        })
    };
    collect::regions::classify(region, frames, in_allocator)
}

/// The symbolized frames of a stack, symbolized once, with its Python
/// frames merged in if `python` has any.
fn frames_of(
    symbolizer: &mut StackSymbolizer,
    space: &AddressSpace,
    stacks: &StackCatalog,
    python: &mut Option<PythonMerger<'_>>,
    stack_id: u64,
) -> Arc<[Arc<Frame>]> {
    let native = symbolizer.cached(stack_id).unwrap_or_else(|| {
        let addresses = space.code_prefix(stacks.addresses(stack_id));
        symbolizer.symbolize(stack_id, addresses, space)
    });
    match python {
        Some(PythonMerger { runtime, stacks }) => stacks.merged(stack_id, native, runtime),
        None => native,
    }
}

/// What merges a walked CPython process's Python frames into its stacks.
struct PythonMerger<'a> {
    runtime: &'a PythonRuntime,
    stacks: &'a mut PythonStacks,
}

impl PythonFrames {
    fn merger(&mut self) -> Option<PythonMerger<'_>> {
        match self {
            Self::Walked { runtime, stacks, .. } | Self::Stopped { runtime, stacks, .. } => {
                Some(PythonMerger { runtime, stacks })
            }
            _ => None,
        }
    }
}

/// The program's code and the file mappings the report's frames fall in,
/// each once.
fn modules_of(report: &Report, space: &AddressSpace) -> Vec<ModuleMapping> {
    let mut found: Vec<ModuleMapping> = space.executable_mapping(&report.program).into_iter().collect();
    for frame in report.stacks.iter().flat_map(|stack| &stack.frames) {
        if found.iter().any(|module| module.start <= frame.address && frame.address < module.end) {
            continue;
        }
        found.extend(space.module_mapping(frame.address));
    }
    found
}
