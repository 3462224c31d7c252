//! Loading memleak's BPF object, attaching it per the attach plan,
//! reading its maps and forgetting what a gone process left in them.
//! Dropping the tracer detaches every probe.

use std::{collections::HashSet, os::fd::OwnedFd};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues, ProgramArray, RingBuf},
    programs::{
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
        BtfTracePoint, ProgramError, RawTracePoint, UProbe,
    },
    Ebpf, EbpfError, EbpfLoader, Pod,
};
use memleak_common::{
    lost_stack_id, programs, tunables, Allocation, AllocationKey, AllocatorCode, CgroupWalk, Counter,
    ExecHold, HeldCgroup, PendingCall, ProcessCounters, ProcessMappings, PyProcConfig, StackKey, StackSlot,
    StackTotals, WalkCounts, ALLOCATIONS_MAP, ALLOCATOR_CODE_MAP, ALLOCATOR_FUNCTIONS, CGROUP_FILTER_MAP,
    EVENTS_MAP, FOLLOWED_MAP, HELD_CGROUPS_MAP, KERNEL_STACK_RECORDER_MAP, KERNEL_STACK_STAGES,
    MAPPING_EVENTS_MAP, MAPPING_FUNCTIONS, MAX_HELD_CGROUPS, MAX_IGNORED_PROCESSES, OOM_VICTIMS_MAP,
    PENDING_MAP, PROCESS_COUNTERS_MAP, PROCESS_MAPPINGS_MAP, PY_NEW_STACKS_MAP, PY_PROCS_MAP, PY_WALKING_MAP,
    REPLACEABLE_MAP, STACKS_MAP, STACK_IDS_MAP, STACK_TOTALS_MAP, TRACED_PROCESSES_MAP, UNWIND_RESCANS_MAP,
    UNWIND_ROWS_MAP, USER_STACK_RECORDER_MAP, USER_STACK_STAGES, WALK_COUNTS_MAP,
};

use super::{
    kernel_features::{self, Loops},
    map_costs::{self, MapCost},
    mapping_calls_in_kernel::{self, SeenBy},
    multi_uprobes::{self, LoadError, MultiUprobePrograms},
    privileges::{self, Traced},
};
use crate::{
    attach::{plan::ProbeSite, AttachPlan},
    model::{HealthCounters, Unwinding},
    status,
};

#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    /// What memleak lacks, and what to do: see `privileges`.
    #[error("{0}")]
    NotPermitted(String),
    #[error("the kernel rejected memleak's BPF object: {0}")]
    Load(#[source] EbpfError),
    #[error("the kernel rejected BPF program `{program}`: {source}")]
    Verifier { program: &'static str, source: ProgramError },
    #[error("{0}")]
    MultiLoad(#[source] LoadError),
    #[error("cannot make the stack recorder the uretprobes' tail call: {0}")]
    TailCall(#[source] std::io::Error),
    #[error("failed to attach uprobe to `{function}` in {object}: {}", root_cause(source))]
    Attach { function: &'static str, object: String, source: ProgramError },
    #[error("the kernel refused a uprobe on `{function}` in {object} (permission denied): {advice}")]
    UprobesNotPermitted { function: &'static str, object: String, advice: String },
    #[error("failed to attach uprobes in {object}: {}", status::os_reason(source))]
    AttachMulti { object: String, source: std::io::Error },
    #[error("pid {pid} exited while memleak was attaching to it")]
    TargetGone { pid: u32 },
    #[error("failed to read BPF map {map}: {source}")]
    ReadMap { map: &'static str, source: aya::maps::MapError },
    #[error("this kernel lacks {feature}, which memleak needs: {detail}")]
    KernelFeature { feature: String, detail: String },
    #[error("{0}")]
    Kernel(#[from] kernel_features::KernelError),
    #[error("the BPF object lacks {0}: memleak was built wrongly")]
    Missing(&'static str),
    #[error("failed to write BPF map {map}: {source}")]
    WriteMap { map: &'static str, source: aya::maps::MapError },
    #[error("cannot map the unwind rows into memory: {0}")]
    MapRows(std::io::Error),
    #[error(
        "the kernel refused BPF map {map} ({}): its {} entries ask for {} of kernel memory at start, \
         up to {} when full; lower {}",
        status::os_reason(source),
        cost.entries,
        status::readable_bytes(cost.at_start),
        status::readable_bytes(cost.when_full),
        cost.flag
    )]
    MapRefused { map: String, cost: MapCost, source: std::io::Error },
}

/// What the user decides about the BPF side: filters and limits.
#[derive(Clone, Debug)]
pub struct TracerSettings {
    /// Smallest and largest allocation recorded, in bytes.
    pub min_size: u64,
    pub max_size: u64,
    /// Frames kept per stack.
    pub stack_depth: u32,
    pub max_allocations: u32,
    pub max_stacks: u32,
    /// Processes traced at once at most: each may need a lost-stack entry
    /// in the totals map.
    pub max_processes: u32,
    /// Record about one allocation in this many.
    pub sample_rate: u32,
    /// Send an event per allocation and free (--trace).
    pub trace_events: bool,
    /// How user stacks are walked (--unwind).
    pub unwinding: Unwinding,
    /// Whether a walk takes the frames a thread's stack still shares with
    /// its last walk (not --no-stack-reuse).
    pub stack_reuse: bool,
    /// Unwind rows the BPF array holds, for every object of every process
    /// (--max-unwind-rows).
    pub max_unwind_rows: u32,
    /// Walk at most this many Python frames per stack of the processes
    /// given a `PyProcConfig` (--max-python-depth); `None` with --python
    /// off.
    pub python_max_frames: Option<u16>,
}

impl TracerSettings {
    /// Whether every allocation is recorded (no -s, -z or -Z): only then
    /// can a block released unrecorded be told to be from before the
    /// attach, and a block that replaces it from new memory.
    pub fn records_every_allocation(&self) -> bool {
        self.sample_rate <= 1 && self.min_size == 0 && self.max_size == u64::MAX
    }

    /// The rows array's size: one row, unused, without unwind tables.
    pub fn unwind_rows(&self) -> u32 {
        match self.unwinding {
            Unwinding::Dwarf => self.max_unwind_rows,
            Unwinding::FramePointers => 1,
        }
    }
}

/// Load-time settings of the BPF side: the user's, and what the target
/// adds.
#[derive(Clone, Debug)]
pub struct TracerConfig {
    pub settings: TracerSettings,
    /// Offset of `size` in the kernel's struct `kmem_cache` (kernel mode).
    pub cache_size_offset: u32,
    /// Offset of `tgid` in the kernel's struct `task_struct` (following
    /// forks).
    pub task_tgid_offset: u32,
    /// Offset of `thread.fsbase` in the kernel's struct `task_struct`
    /// (--python); 0 walks no Python frames.
    pub py_fsbase_offset: u32,
    /// Kernel code whose allocations are left out (kernel mode).
    pub ignored_callers: std::ops::Range<u64>,
    /// With --cgroup, the only cgroup whose tasks (and those of its
    /// descendants) are recorded at first; 0 for every task.
    pub cgroup_id: u64,
    /// Report the execs of processes not traced (`MappingChange::Launched`):
    /// `memleak serve` following executables or cgroups.
    pub newcomer_execs: bool,
    /// The cgroup's level below the cgroup2 root; `None`: only the tasks
    /// directly in it are recorded.
    pub cgroup_level: Option<u32>,
    /// Processes never recorded where a probe serves many (--cgroup, the
    /// kernel): memleak, and with --trace the readers of its output.
    pub ignored_processes: Vec<u32>,
    /// Which newcomers BPF stops at their execve until user space has
    /// probed them (`enabled` 0: none).
    pub exec_hold: ExecHold,
}

impl TracerConfig {
    pub fn new(settings: TracerSettings) -> Self {
        Self {
            settings,
            cache_size_offset: 0,
            task_tgid_offset: 0,
            py_fsbase_offset: 0,
            ignored_callers: 0..0,
            cgroup_id: 0,
            newcomer_execs: false,
            cgroup_level: None,
            ignored_processes: Vec::new(),
            exec_hold: ExecHold::default(),
        }
    }
}

/// The probes one `attach` placed, to take them out again.
#[derive(Debug, Default)]
pub struct Links {
    /// One perf-event uprobe per site and program.
    links: Vec<(&'static str, UProbeLinkId)>,
    /// One multi-uprobe link per program: closing it detaches them all.
    multi: Vec<OwnedFd>,
}

impl Drop for Links {
    /// Closes the multi-uprobe links at once: each close waits for the
    /// kernel's RCU grace period, about 50 ms here, and closes waiting
    /// together share one.
    fn drop(&mut self) {
        std::thread::scope(|scope| {
            for link in self.multi.drain(..) {
                scope.spawn(move || drop(link));
            }
        });
    }
}

pub struct Tracer {
    pub(super) ebpf: Ebpf,
    /// The uprobe programs, when loaded for multi-uprobe links; `None`:
    /// aya loaded them in `ebpf` for one perf-event uprobe per site.
    pub(super) multi: Option<MultiUprobePrograms>,
    /// How the programs loop, which decided the object loaded.
    loops: Loops,
    /// How long loading took, the kernel's verifier most of it.
    load_time: std::time::Duration,
    /// The kernel's BTF, parsed once (tens of ms) for every tracepoint.
    btf: Option<aya::Btf>,
    /// The kernel's BTF as a thread parses it, from when `load` has made
    /// the maps: on another CPU while the kernel verifies the programs.
    btf_parsing: Option<std::thread::JoinHandle<Result<aya::Btf, TracerError>>>,
    /// When the first uprobe was attached.
    first_attached: Option<std::time::Instant>,
    /// Where the links of processes that exited go to be closed, by one
    /// thread started the first time (see `detach_exited`).
    closer: Option<std::sync::mpsc::Sender<Links>>,
    /// How many Python frames the BPF side walks per stack, if it does:
    /// loaded with the kernel's fsbase offset. Each takes two of a stack's
    /// frames, and the walk leaves one for the native frames.
    python_max_frames: Option<u16>,
    /// Whether `PY_WALKING_MAP` says to look processes up in
    /// `PY_PROCS_MAP`: from the first process put there on.
    python_walking: bool,
    /// The entry programs of the C library's mapping functions whose calls
    /// the kernel sees instead (`mapping_calls_in_kernel`): no `attach`
    /// places them.
    seen_in_kernel: Vec<&'static str>,
    /// How the kernel sees them, where it does.
    seen_by: Option<SeenBy>,
    /// Whether `attach_kernel` attached the kernel's allocation
    /// tracepoints.
    traces_kernel: bool,
}

static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memleak"));
/// The programs built for kernels 5.10 to 5.16 (memleak-ebpf's
/// `legacy-kernels`): bounded loops, and no attach cookies.
static LEGACY_BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memleak-legacy"));

/// Every uprobe program of the function tables, each once, and the stack
/// recorder they tail-call; on a kernel without attach cookies, the
/// programs that know their function in place of the shared ones.
fn uprobe_programs(loops: Loops) -> Vec<&'static str> {
    let allocator = ALLOCATOR_FUNCTIONS.iter().flat_map(|f| [Some(f.entry_program), f.return_program()]);
    let mapping = MAPPING_FUNCTIONS.iter().flat_map(|f| [Some(f.entry_program), f.return_program]);
    let mut programs: Vec<&'static str> = vec![programs::RECORD_WITH_USER_STACK];
    // Loaded with the others where they are attached by multi-uprobe
    // links, as those are (see `overhead`).
    if loops == Loops::BpfLoop {
        programs.extend([programs::CALIBRATION_ENTRY, programs::CALIBRATION_RETURN]);
    }
    let legacy = (loops == Loops::Bounded).then_some(programs::ENTRY_OF_FUNCTION).into_iter().flatten();
    let legacy = legacy.chain((loops == Loops::Bounded).then_some(programs::MPROTECT_PAST_CALL));
    let stages = USER_STACK_STAGES.into_iter().skip(1).filter(|_| loops == Loops::Bounded);
    let legacy = legacy.chain(stages);
    let shared = allocator.chain(mapping).flatten().filter(|program| {
        loops == Loops::BpfLoop || !ALLOCATOR_FUNCTIONS.iter().any(|f| f.entry_program == *program)
    });
    for program in shared.chain(legacy) {
        if !programs.contains(&program) {
            programs.push(program);
        }
    }
    programs
}

/// The program at a site's entry: the one its function table names,
/// which reads the attach cookie; on a kernel without attach cookies
/// (before 5.15, and so every kernel with bounded loops), the one that
/// knows the site's function (its first, for aliases).
fn entry_program(site: &ProbeSite, loops: Loops) -> &'static str {
    if loops == Loops::BpfLoop {
        return site.entry_program;
    }
    if site.entry_program == programs::MPROTECT_ENTER && site.after_system_call {
        return programs::MPROTECT_PAST_CALL;
    }
    let first = site.functions.0.trailing_zeros() as usize;
    programs::ENTRY_OF_FUNCTION.get(first).copied().unwrap_or(site.entry_program)
}

/// Where this kernel keeps a task's cgroup and the cgroup's ancestors,
/// for the object for kernels before 5.17 when it filters by cgroup or
/// holds a cgroup's newcomers (see `memleak_common::CgroupWalk`).
fn cgroup_walk(loops: Loops, config: &TracerConfig) -> Result<CgroupWalk, TracerError> {
    let walks_cgroups = config.cgroup_level.is_some() || config.exec_hold.enabled != 0;
    if loops == Loops::BpfLoop || !walks_cgroups {
        return Ok(CgroupWalk::default());
    }
    let btf = std::path::Path::new(crate::attach::kernel_btf::VMLINUX_BTF);
    let offset = |structure: &str, member: &str| {
        crate::attach::kernel_btf::member_offset(btf, structure, member).map_err(|error| {
            TracerError::KernelFeature {
                feature: "the cgroup fields --cgroup reads".to_owned(),
                detail: error.to_string(),
            }
        })
    };
    Ok(CgroupWalk {
        task_cgroups: offset("task_struct", "cgroups")?,
        css_set_cgroup: offset("css_set", "dfl_cgrp")?,
        cgroup_level: offset("cgroup", "level")?,
        cgroup_self: offset("cgroup", "self")?,
        state_parent: offset("cgroup_subsys_state", "parent")?,
        cgroup_node: offset("cgroup", "kn")?,
        node_id: offset("kernfs_node", "id")?,
    })
}

/// How many Python frames a stack may hold, if the BPF side walks them:
/// two slots a frame, and one native frame at least.
fn python_frame_limit(config: &TracerConfig) -> Option<u16> {
    config.settings.python_max_frames.filter(|_| config.py_fsbase_offset != 0).map(|max_frames| {
        let room = config.settings.stack_depth.saturating_sub(1) / 2;
        max_frames.min(u16::try_from(room).unwrap_or(u16::MAX))
    })
}

/// Loads the uprobe programs through aya, for perf-event uprobes, and
/// makes the stack recorder the uretprobes' tail call.
fn load_for_perf_events(ebpf: &mut Ebpf, loops: Loops) -> Result<(), TracerError> {
    for program in uprobe_programs(loops) {
        let loading = std::time::Instant::now();
        let probe = uprobe(ebpf, program)?;
        probe.load().map_err(|source| {
            if caused_by_eperm(&source) {
                not_permitted()
            } else {
                TracerError::Verifier { program, source }
            }
        })?;
        log::debug!("{program} verified and loaded in {} ms", loading.elapsed().as_millis());
    }
    // The recorder, and on a kernel without bpf_loop its walk's later
    // stages, each at its index.
    let stages =
        USER_STACK_STAGES.iter().take(if loops == Loops::Bounded { USER_STACK_STAGES.len() } else { 1 });
    for (index, &stage) in (0u32..).zip(stages) {
        let program = uprobe(ebpf, stage)?
            .fd()
            .and_then(|fd| fd.try_clone().map_err(ProgramError::from))
            .map_err(|source| TracerError::Verifier { program: stage, source })?;
        let map =
            ebpf.map_mut(USER_STACK_RECORDER_MAP).ok_or(TracerError::Missing(USER_STACK_RECORDER_MAP))?;
        let mut recorders: ProgramArray<&mut MapData> = ProgramArray::try_from(map)
            .map_err(|source| TracerError::ReadMap { map: USER_STACK_RECORDER_MAP, source })?;
        recorders
            .set(index, &program, 0)
            .map_err(|source| TracerError::ReadMap { map: USER_STACK_RECORDER_MAP, source })?;
    }
    Ok(())
}

/// Loads the uprobe programs: for multi-uprobe links where the kernel has
/// them (6.6), else through aya for perf-event uprobes.
fn load_uprobe_programs(ebpf: &mut Ebpf, loops: Loops) -> Result<Option<MultiUprobePrograms>, TracerError> {
    if loops == Loops::BpfLoop
        && multi_uprobes::supported()
        && std::env::var_os(multi_uprobes::PERF_EVENT_UPROBES).is_none()
    {
        log::debug!("uprobes: one multi-uprobe link per program and object");
        Ok(Some(load_for_multi_links(ebpf)?))
    } else {
        log::debug!("uprobes: one perf-event uprobe per site and program");
        load_for_perf_events(ebpf, loops)?;
        Ok(None)
    }
}

/// Loads the uprobe programs for multi-uprobe links, and makes the stack
/// recorder the uretprobes' tail call (a tail call's target must be
/// loaded for the same kind of attachment as its caller).
fn load_for_multi_links(ebpf: &Ebpf) -> Result<MultiUprobePrograms, TracerError> {
    let programs =
        MultiUprobePrograms::load(BPF_OBJECT, ebpf, &uprobe_programs(Loops::BpfLoop)).map_err(|error| {
            match error {
                LoadError::Verifier { ref source, .. } | LoadError::BtfRefused(ref source)
                    if source.raw_os_error() == Some(libc::EPERM) =>
                {
                    not_permitted()
                }
                error => TracerError::MultiLoad(error),
            }
        })?;
    let recorder = programs
        .program(programs::RECORD_WITH_USER_STACK)
        .ok_or(TracerError::Missing(programs::RECORD_WITH_USER_STACK))?;
    let map = ebpf.map(USER_STACK_RECORDER_MAP).ok_or(TracerError::Missing(USER_STACK_RECORDER_MAP))?;
    multi_uprobes::set_tail_call(map, 0, recorder).map_err(TracerError::TailCall)?;
    Ok(programs)
}

impl Tracer {
    /// Fails early, before any work, when memleak lacks what tracing
    /// `traced` takes on this kernel, with what to do (`privileges`).
    pub fn check_privileges(traced: Traced) -> Result<(), TracerError> {
        privileges::check(traced).map_err(TracerError::NotPermitted)
    }

    /// Fails early, with one line, on a kernel whose verifier or helpers
    /// cannot run memleak's programs (`kernel_features`).
    pub fn check_kernel() -> Result<(), TracerError> {
        kernel_features::check().map(|_| ()).map_err(TracerError::Kernel)
    }

    /// The path each part of the tracer takes on this kernel ("none" for
    /// the uprobes' parts when it traces the kernel's allocations).
    pub fn kernel_paths(&self) -> kernel_features::Paths {
        let kernel_mode = self.traces_kernel;
        let uprobes = match (&self.multi, kernel_mode, self.loops) {
            (_, true, _) => "none",
            (Some(_), false, _) => "multi-uprobe links",
            (None, false, Loops::BpfLoop) => "perf-event uprobes",
            // No attach cookies: see `entry_program`.
            (None, false, Loops::Bounded) => "perf-event uprobes, an entry program per function",
        };
        let munmap_mprotect = match (self.seen_by, kernel_mode) {
            (_, true) => "none",
            (Some(seen_by), false) => seen_by.label(),
            (None, false) => "uprobes",
        };
        kernel_features::Paths {
            release: kernel_features::release(),
            uprobes,
            munmap_mprotect,
            loops: self.loops.name(),
        }
    }

    /// Loads the programs with SIGINT and SIGTERM held since memleak's
    /// start, and lets them through once done, loaded or not: a signal
    /// pending in the verifier makes it give up with EAGAIN.
    pub fn load(config: &TracerConfig) -> Result<Self, TracerError> {
        let loaded = Self::load_holding_signals(config);
        crate::stop_signals::release();
        loaded
    }

    fn load_holding_signals(config: &TracerConfig) -> Result<Self, TracerError> {
        let started = std::time::Instant::now();
        let settings = &config.settings;
        let loops = kernel_features::check()?;
        log::debug!("loops: {}", loops.name());
        let cgroup_walk = cgroup_walk(loops, config)?;
        let cgroup_level = config.cgroup_level.unwrap_or(memleak_common::CGROUP_LEVEL_UNKNOWN);
        // One statement: the loader borrows the values until it loads.
        let mut ebpf = size_maps(
            EbpfLoader::new()
                .override_global(tunables::MIN_SIZE, &settings.min_size, true)
                .override_global(tunables::MAX_SIZE, &settings.max_size, true)
                .override_global(tunables::STACK_DEPTH, &settings.stack_depth, true)
                .override_global(tunables::SAMPLE_RATE, &settings.sample_rate, true)
                .override_global(tunables::TRACE, &u32::from(settings.trace_events), true)
                .override_global(
                    tunables::REPLACEMENTS,
                    &u32::from(settings.records_every_allocation()),
                    true,
                )
                .override_global(tunables::STACK_REUSE, &u32::from(settings.stack_reuse), true)
                .override_global(tunables::CACHE_SIZE_OFFSET, &config.cache_size_offset, true)
                .override_global(tunables::TASK_TGID_OFFSET, &config.task_tgid_offset, true)
                .override_global(tunables::PY_FSBASE_OFFSET, &config.py_fsbase_offset, true)
                .override_global(tunables::NEWCOMER_EXECS, &u32::from(config.newcomer_execs), true)
                .override_global(tunables::CGROUP_LEVEL, &cgroup_level, true)
                // Only in the object for kernels before 5.17.
                .override_global(tunables::CGROUP_WALK, &cgroup_walk, false)
                .override_global(tunables::IGNORED_CALLER_START, &config.ignored_callers.start, true)
                .override_global(tunables::IGNORED_CALLER_END, &config.ignored_callers.end, true)
                .override_global(
                    tunables::IGNORED_PROCESSES,
                    &ignored_processes(&config.ignored_processes),
                    true,
                )
                .override_global(tunables::EXEC_HOLD, &config.exec_hold, true),
            settings,
        )
        .load(match loops {
            Loops::BpfLoop => BPF_OBJECT,
            Loops::Bounded => LEGACY_BPF_OBJECT,
        })
        .map_err(|error| load_refused(error, settings))?;
        // Once the maps are made: a map the kernel refuses must fail the
        // start with that reason, not with what parsing took.
        let btf_parsing = Some(std::thread::spawn(kernel_btf));
        let multi = load_uprobe_programs(&mut ebpf, loops)?;
        // Before any probe is attached: none records a task it should not.
        write_cgroup_filter(&mut ebpf, config.cgroup_id)?;
        Ok(Self {
            ebpf,
            multi,
            loops,
            load_time: started.elapsed(),
            btf: None,
            btf_parsing,
            first_attached: None,
            closer: None,
            python_max_frames: python_frame_limit(config),
            python_walking: false,
            seen_in_kernel: Vec::new(),
            seen_by: None,
            traces_kernel: false,
        })
    }

    /// How long loading took, the kernel's verifier most of it.
    pub fn load_time(&self) -> std::time::Duration {
        self.load_time
    }

    /// Attaches the probes of `plan`, firing only for process `pid` and
    /// its threads (the kernel filters uprobes by address space): a
    /// process outside the targets never takes their trap.
    pub fn attach(&mut self, plan: &AttachPlan, scope: UProbeScope) -> Result<Links, TracerError> {
        let links = match &self.multi {
            Some(programs) => attach_multi(programs, plan, scope, &self.seen_in_kernel)?,
            None => self.attach_perf_events(plan, scope)?,
        };
        self.first_attached.get_or_insert_with(std::time::Instant::now);
        Ok(links)
    }

    /// When the first uprobe was attached, if one was.
    pub fn first_attached(&self) -> Option<std::time::Instant> {
        self.first_attached
    }

    /// `attach` with one perf-event uprobe per site and program.
    fn attach_perf_events(&mut self, plan: &AttachPlan, scope: UProbeScope) -> Result<Links, TracerError> {
        let fail = |function, source| attach_error(function, &plan.display_path, scope, source);
        // Frees (and munmap) first: an allocation recorded while its free is
        // not probed yet would stay outstanding for good.
        let (frees, allocations): (Vec<_>, Vec<_>) = plan
            .sites
            .iter()
            .filter(|site| !self.seen_in_kernel.contains(&site.entry_program))
            .partition(|site| site.return_program.is_none());
        let mut links = Links::default();
        for site in frees.into_iter().chain(allocations) {
            // The cookie tells the shared programs which function fired;
            // without cookies, each program knows (`entry_program`).
            let point = |offset| UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(offset),
                cookie: (self.loops == Loops::BpfLoop).then(|| site.cookie()),
            };
            // The entry and return probes share one breakpoint, past the
            // first instructions when `placement` found that safe.
            let entry = site.file_offset + site.entry_skip;
            // The return probe before the entry's: an entry that fired
            // before its return probe was placed would leave its thread
            // inside a call that never returns for BPF, which then takes
            // each of its later calls for one made inside that one (see
            // memleak-ebpf's `calls::enter`) and counts none of them. A
            // return probe alone records nothing.
            if let Some(return_program) = site.return_program {
                let ret = uprobe(&mut self.ebpf, return_program)?;
                let link = ret
                    .attach(point(entry), &plan.path, scope)
                    .map_err(|source| fail(site.function, source))?;
                links.links.push((return_program, link));
            }
            let program = entry_program(site, self.loops);
            let probe = uprobe(&mut self.ebpf, program)?;
            let link = probe
                .attach(point(entry), &plan.path, scope)
                .map_err(|source| fail(site.function, source))?;
            links.links.push((program, link));
            log::debug!("uprobe on {} at {entry:#x} in {}", site.function, plan.display_path);
        }
        for other in plan.other_objects() {
            let mut more = self.attach_perf_events(other, scope)?;
            links.links.append(&mut more.links);
        }
        Ok(links)
    }

    /// Takes out the probes of one `attach`.
    pub fn detach(&mut self, mut links: Links) {
        for (program, link) in std::mem::take(&mut links.links) {
            if let Ok(probe) = uprobe(&mut self.ebpf, program) {
                // A probe on a process that is gone may already be gone too.
                let _ = probe.detach(link);
            }
        }
    }

    /// As `detach`, for the probes of a process that has exited, which
    /// can no longer fire: its multi-uprobe links are closed by a thread
    /// of their own, one exit after another, so that their RCU grace
    /// period (50 to 100 ms) holds up nothing, a newcomer's pickup least
    /// of all.
    pub fn detach_exited(&mut self, mut links: Links) {
        let multi = std::mem::take(&mut links.multi);
        self.detach(links);
        if multi.is_empty() {
            return;
        }
        let closing = Links { links: Vec::new(), multi };
        let closer = self.closer.get_or_insert_with(|| {
            let (sender, receiver) = std::sync::mpsc::channel::<Links>();
            let started = std::thread::Builder::new()
                .name("memleak-unlink".to_owned())
                .spawn(move || receiver.into_iter().for_each(drop));
            if let Err(error) = started {
                log::debug!("no thread to close the probes of exited processes aside ({error}): they are closed at once");
            }
            sender
        });
        // With no thread to take them, they come back and are closed here.
        if let Err(std::sync::mpsc::SendError(links)) = closer.send(closing) {
            drop(links);
        }
    }

    /// Deletes every entry process `tgid` left in the maps: its
    /// allocations, stacks, stack ids, per-stack totals, its threads' call
    /// entries (which the LRU map would evict only in time), its unwind
    /// table, counters and follow mark. For a process that has exited and
    /// had its final report.
    pub fn forget_process(&mut self, tgid: u32) -> Result<(), TracerError> {
        self.forget_processes(&HashSet::from([tgid]))
    }

    /// Tells the free probe where process `pid`'s allocator code lies (see
    /// `memleak_common::AllocatorCode`).
    /// Records only the tasks of cgroup `id` and of its descendants, from
    /// now on: at load, and for the cgroup followed made again at its path
    /// (see `memleak_common::CGROUP_FILTER_MAP`).
    pub fn set_cgroup_filter(&mut self, id: u64) -> Result<(), TracerError> {
        write_cgroup_filter(&mut self.ebpf, id)
    }

    pub fn set_allocator_code(&mut self, pid: u32, code: AllocatorCode) -> Result<(), TracerError> {
        let mut map: HashMap<&mut MapData, u32, AllocatorCode> = self.map_mut(ALLOCATOR_CODE_MAP)?;
        map.insert(pid, code, 0).map_err(|source| TracerError::WriteMap { map: ALLOCATOR_CODE_MAP, source })
    }

    /// Whether processes given to `set_python_process` get their Python
    /// frames walked (--python).
    pub fn walks_python_frames(&self) -> bool {
        self.python_max_frames.is_some()
    }

    /// How many Python frames a stack holds at most, if they are walked.
    pub fn python_frame_limit(&self) -> Option<u16> {
        self.python_max_frames
    }

    /// Walks the Python frames of process `pid` as `config` says, from now
    /// on (`memleak_common::PY_PROCS_MAP`), as many as --max-python-depth
    /// allows.
    pub fn set_python_process(&mut self, pid: u32, config: PyProcConfig) -> Result<(), TracerError> {
        let Some(max_frames) = self.python_max_frames else { return Ok(()) };
        if !self.python_walking {
            write_python_walking(&mut self.ebpf)?;
            self.python_walking = true;
        }
        let config = PyProcConfig { max_frames, ..config };
        let mut map: HashMap<&mut MapData, u32, PyProcConfig> = self.map_mut(PY_PROCS_MAP)?;
        map.insert(pid, config, 0).map_err(|source| TracerError::WriteMap { map: PY_PROCS_MAP, source })
    }

    /// Stops walking the Python frames of process `pid`.
    pub fn forget_python_process(&mut self, pid: u32) -> Result<(), TracerError> {
        let mut map: HashMap<&mut MapData, u32, PyProcConfig> = self.map_mut(PY_PROCS_MAP)?;
        // Gone already if the process has exec'd since: nothing to do.
        let _ = map.remove(&pid);
        Ok(())
    }

    /// `forget_process` for each of `gone`, in one pass over each map.
    pub fn forget_processes(&mut self, gone: &HashSet<u32>) -> Result<(), TracerError> {
        self.remove_entries::<AllocationKey, Allocation>(ALLOCATIONS_MAP, |key, _| gone.contains(&key.tgid))?;
        self.remove_entries::<AllocationKey, u64>(REPLACEABLE_MAP, |key, _| gone.contains(&key.tgid))?;
        let stacks: HashSet<u64> = self
            .remove_entries::<u64, StackKey>(STACKS_MAP, |_, key| gone.contains(&key.tgid))?
            .into_iter()
            .collect();
        self.remove_entries::<StackSlot, u64>(STACK_IDS_MAP, |slot, _| gone.contains(&slot.tgid))?;
        let lost: HashSet<u64> = gone.iter().map(|&tgid| lost_stack_id(tgid)).collect();
        self.remove_entries::<u64, StackTotals>(STACK_TOTALS_MAP, |id, _| {
            lost.contains(id) || stacks.contains(id)
        })?;
        self.remove_entries::<u32, PendingCall>(PENDING_MAP, |_, call| gone.contains(&call.tgid))?;
        let by_pid = |pid: &u32| gone.contains(pid);
        self.remove_entries::<u32, ProcessMappings>(PROCESS_MAPPINGS_MAP, |pid, _| by_pid(pid))?;
        self.remove_entries::<u32, AllocatorCode>(ALLOCATOR_CODE_MAP, |pid, _| by_pid(pid))?;
        self.remove_entries::<u32, u64>(UNWIND_RESCANS_MAP, |pid, _| by_pid(pid))?;
        self.remove_entries::<u32, PyProcConfig>(PY_PROCS_MAP, |pid, _| by_pid(pid))?;
        let mut counters: PerCpuHashMap<&mut MapData, u32, ProcessCounters> =
            self.map_mut(PROCESS_COUNTERS_MAP)?;
        let counted: Vec<u32> = counters.keys().filter_map(Result::ok).filter(|pid| by_pid(pid)).collect();
        for pid in counted {
            let _ = counters.remove(&pid);
        }
        self.remove_entries::<u32, u32>(FOLLOWED_MAP, |pid, _| by_pid(pid))?;
        self.remove_entries::<u32, u32>(TRACED_PROCESSES_MAP, |pid, _| by_pid(pid))?;
        Ok(())
    }

    /// The processes that have counted anything: every one whose calls the
    /// probes saw, traced or not.
    pub fn counted_processes(&self) -> Result<Vec<u32>, TracerError> {
        let counters: PerCpuHashMap<&MapData, u32, ProcessCounters> = self.map(PROCESS_COUNTERS_MAP)?;
        Ok(counters.keys().filter_map(Result::ok).collect())
    }

    /// Deletes the entries of hash map `name` for which `doomed` holds, and
    /// returns their keys.
    fn remove_entries<K: Pod, V: Pod>(
        &mut self,
        name: &'static str,
        doomed: impl Fn(&K, &V) -> bool,
    ) -> Result<Vec<K>, TracerError> {
        let mut map: HashMap<&mut MapData, K, V> = self.map_mut(name)?;
        let keys: Vec<K> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, value)| doomed(key, value))
            .map(|(key, _)| key)
            .collect();
        for key in &keys {
            // Gone already: an entry the BPF side deleted meanwhile.
            let _ = map.remove(key);
        }
        Ok(keys)
    }

    /// Attaches what every process traced needs besides its uprobes: the
    /// exec tracepoint (an execve by a traced process comes as a
    /// `MappingChange::Exec` event, and its table of mappings is dropped)
    /// and the programs that see munmap and mprotect at their system
    /// calls, where the kernel takes them; before the first `attach`, which
    /// then leaves their uprobes out.
    pub fn watch_processes(&mut self) -> Result<(), TracerError> {
        self.attach_tracepoint(programs::PROCESS_EXEC)?;
        let btf = self.kernel_btf()?;
        self.seen_by = mapping_calls_in_kernel::attach(&mut self.ebpf, &btf);
        self.seen_in_kernel = match self.seen_by {
            Some(seen_by) => MAPPING_FUNCTIONS
                .iter()
                .filter(|function| seen_by.hook(function.entry_program).is_some())
                .map(|function| function.entry_program)
                .collect(),
            None => Vec::new(),
        };
        self.btf = Some(btf);
        Ok(())
    }

    /// Attaches the fork tracepoint: a process made by a followed one (see
    /// `follow`) is followed too, and comes as a `MappingChange::Fork`
    /// event. Needs `TracerConfig::task_tgid_offset`.
    pub fn watch_forks(&mut self) -> Result<(), TracerError> {
        self.attach_tracepoint(programs::PROCESS_FORK)
    }

    /// Loads and attaches the BTF tracepoint program of that name.
    fn attach_tracepoint(&mut self, tracepoint: &'static str) -> Result<(), TracerError> {
        let btf = self.kernel_btf()?;
        let missing = |error: ProgramError| TracerError::KernelFeature {
            feature: format!("the {tracepoint} tracepoint"),
            detail: error.to_string(),
        };
        let program = btf_tracepoint(&mut self.ebpf, tracepoint)?;
        let loaded = program.load(tracepoint, &btf).and_then(|()| program.attach().map(drop));
        self.btf = Some(btf);
        loaded.map_err(missing)
    }

    /// The kernel's BTF, parsed the first time only; put it back in
    /// `self.btf` after use.
    fn kernel_btf(&mut self) -> Result<aya::Btf, TracerError> {
        if let Some(btf) = self.btf.take() {
            return Ok(btf);
        }
        match self.btf_parsing.take().map(std::thread::JoinHandle::join) {
            Some(Ok(parsed)) => parsed,
            // The thread panicked: parse here, to fail here if it must.
            Some(Err(_)) | None => kernel_btf(),
        }
    }

    /// How the kernel sees munmap and mprotect, where it does.
    pub fn mapping_calls_seen_by(&self) -> Option<SeenBy> {
        self.seen_by
    }

    /// Counts process `tgid` among those traced, for the probes that fire
    /// for every process (see `memleak_common::TRACED_PROCESSES_MAP`).
    /// A process marked already keeps the flags BPF gave it.
    pub fn mark_traced(&mut self, tgid: u32) -> Result<(), TracerError> {
        let mut traced: HashMap<&mut MapData, u32, u32> = self.map_mut(TRACED_PROCESSES_MAP)?;
        if traced.get(&tgid, 0).is_ok() {
            return Ok(());
        }
        traced
            .insert(tgid, 0, 0)
            .map_err(|source| TracerError::WriteMap { map: TRACED_PROCESSES_MAP, source })
    }

    /// Has BPF hold the newcomers of `cgroups` (and of the cgroups below
    /// them) at their execve, the first `MAX_HELD_CGROUPS` of them; the
    /// rest are found as they run.
    pub fn hold_cgroups(&mut self, cgroups: &[HeldCgroup]) -> Result<(), TracerError> {
        let mut held: Array<&mut MapData, HeldCgroup> = self.map_mut(HELD_CGROUPS_MAP)?;
        let unused = std::iter::repeat(HeldCgroup::default());
        for (index, cgroup) in (0..MAX_HELD_CGROUPS).zip(cgroups.iter().copied().chain(unused)) {
            held.set(index, cgroup, 0)
                .map_err(|source| TracerError::WriteMap { map: HELD_CGROUPS_MAP, source })?;
        }
        Ok(())
    }

    /// Stops process `pid` (held at its execve) again at the breakpoint
    /// of its dynamic loader, `offset` in the file at `loader`, with a
    /// `MappingChange::LoaderReady` event each time.
    pub fn stop_at_loader(
        &mut self,
        loader: &std::path::Path,
        offset: u64,
        pid: std::num::NonZeroU32,
    ) -> Result<UProbeLinkId, TracerError> {
        let probe = uprobe(&mut self.ebpf, programs::LOADER_READY)?;
        if probe.fd().is_err() {
            probe
                .load()
                .map_err(|source| TracerError::Verifier { program: programs::LOADER_READY, source })?;
        }
        let point =
            UProbeAttachPoint { location: UProbeAttachLocation::AbsoluteOffset(offset), cookie: None };
        probe.attach(point, loader, UProbeScope::OneProcess(pid)).map_err(|source| {
            TracerError::KernelFeature {
                feature: format!("a uprobe on the loader {}", loader.display()),
                detail: source.to_string(),
            }
        })
    }

    /// Attaches the OOM killer's tracepoint: each victim's tgid is noted
    /// for `take_oom_victims`. `by_task`: the kernel passes the victim's
    /// task (6.8 and later), whose tgid is read at
    /// `TracerConfig::task_tgid_offset`, not its pid.
    pub fn watch_oom_kills(&mut self, by_task: bool) -> Result<(), TracerError> {
        let name = if by_task { programs::OOM_VICTIM_BY_TASK } else { programs::OOM_VICTIM_BY_PID };
        let btf = self.kernel_btf()?;
        let program = btf_tracepoint(&mut self.ebpf, name);
        let loaded = program.and_then(|program| {
            program
                .load(programs::OOM_VICTIM_TRACEPOINT, &btf)
                .and_then(|()| program.attach().map(drop))
                .map_err(|error| TracerError::KernelFeature {
                    feature: format!("the {} tracepoint", programs::OOM_VICTIM_TRACEPOINT),
                    detail: error.to_string(),
                })
        });
        self.btf = Some(btf);
        loaded
    }

    /// The processes the OOM killer picked since the last call, by tgid.
    pub fn take_oom_victims(&mut self) -> Vec<u32> {
        let Ok(mut victims) = self.map_mut::<HashMap<&mut MapData, u32, u64>>(OOM_VICTIMS_MAP) else {
            return Vec::new();
        };
        let picked: Vec<u32> = victims.keys().filter_map(Result::ok).collect();
        for tgid in &picked {
            let _ = victims.remove(tgid);
        }
        picked
    }

    /// Detaches the programs that stop processes (the exec tracepoint's
    /// and `stop_at_loader`'s): none is stopped once this returns.
    pub fn stop_holding(&mut self) {
        if let Ok(exec) = btf_tracepoint(&mut self.ebpf, programs::PROCESS_EXEC) {
            let _ = exec.unload();
        }
        if let Ok(loader) = uprobe(&mut self.ebpf, programs::LOADER_READY) {
            let _ = loader.unload();
        }
    }

    /// Takes out a `stop_at_loader` probe.
    pub fn remove_loader_stop(&mut self, link: UProbeLinkId) {
        if let Ok(probe) = uprobe(&mut self.ebpf, programs::LOADER_READY) {
            // Gone with its process, perhaps.
            let _ = probe.detach(link);
        }
    }

    /// Follows the children process `tgid` makes from now on.
    pub fn follow(&mut self, tgid: u32) -> Result<(), TracerError> {
        let mut followed: HashMap<&mut MapData, u32, u32> = self.map_mut(FOLLOWED_MAP)?;
        followed.insert(tgid, 1, 0).map_err(|source| TracerError::ReadMap { map: FOLLOWED_MAP, source })
    }

    /// Forgets process `tgid`, never traced: its children are not
    /// followed, and what it counted is dropped. Two deletions, not a
    /// walk of every map as `forget_process` does: short-lived children
    /// come and go often.
    pub fn unfollow(&mut self, tgid: u32) -> Result<(), TracerError> {
        let mut followed: HashMap<&mut MapData, u32, u32> = self.map_mut(FOLLOWED_MAP)?;
        let _ = followed.remove(&tgid);
        let mut counters: PerCpuHashMap<&mut MapData, u32, ProcessCounters> =
            self.map_mut(PROCESS_COUNTERS_MAP)?;
        let _ = counters.remove(&tgid);
        Ok(())
    }

    /// Attaches the kernel allocation tracepoints (and the per-CPU ones).
    pub fn attach_kernel(&mut self, percpu: bool) -> Result<(), TracerError> {
        let btf = self.kernel_btf()?;
        let sites = kernel_tracepoints(&btf, percpu);
        let missing = |tracepoint: &str, error: ProgramError| TracerError::KernelFeature {
            feature: format!("the {tracepoint} tracepoint"),
            detail: error.to_string(),
        };
        // All loaded before any is attached, and frees attached first: an
        // allocation recorded while its free is not traced yet would stay
        // outstanding for good.
        // On a kernel without bpf_loop, the stages that store the stacks
        // first, where the allocation programs tail-call them.
        let stages = KERNEL_STACK_STAGES.iter().filter(|_| self.loops == Loops::Bounded);
        for &program in stages.chain(sites.iter().map(|(program, _)| program)) {
            let loaded = raw_tracepoint(&mut self.ebpf, program)?;
            if loaded.fd().is_err() {
                let loading = std::time::Instant::now();
                loaded.load().map_err(|error| {
                    if KERNEL_STACK_STAGES.contains(&program) {
                        TracerError::Verifier { program, source: error }
                    } else {
                        missing(program, error)
                    }
                })?;
                log::debug!("{program} verified and loaded in {} ms", loading.elapsed().as_millis());
            }
        }
        if self.loops == Loops::Bounded {
            self.set_kernel_stages()?;
        }
        let (frees, allocations): (Vec<_>, Vec<_>) =
            sites.iter().partition(|(program, _)| programs::KERNEL_RELEASES.contains(program));
        for &(program, tracepoint) in frees.into_iter().chain(allocations) {
            raw_tracepoint(&mut self.ebpf, program)?
                .attach(tracepoint)
                .map_err(|error| missing(tracepoint, error))?;
            log::debug!("attached {program} to the {tracepoint} tracepoint");
        }
        self.traces_kernel = true;
        Ok(())
    }

    /// Puts kernel mode's stages in their program array, each at its
    /// index.
    fn set_kernel_stages(&mut self) -> Result<(), TracerError> {
        for (index, &stage) in (0u32..).zip(&KERNEL_STACK_STAGES) {
            let program = raw_tracepoint(&mut self.ebpf, stage)?
                .fd()
                .and_then(|fd| fd.try_clone().map_err(ProgramError::from))
                .map_err(|source| TracerError::Verifier { program: stage, source })?;
            let mut stages: ProgramArray<&mut MapData> = self.map_mut(KERNEL_STACK_RECORDER_MAP)?;
            stages
                .set(index, &program, 0)
                .map_err(|source| TracerError::ReadMap { map: KERNEL_STACK_RECORDER_MAP, source })?;
        }
        Ok(())
    }

    /// The ring buffer of --trace events, handed over to its reader.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, TracerError> {
        self.take_ring(EVENTS_MAP)
    }

    /// The ring buffer of mmap, munmap and mremap events.
    pub fn take_mapping_events(&mut self) -> Result<RingBuf<MapData>, TracerError> {
        self.take_ring(MAPPING_EVENTS_MAP)
    }

    /// The ring buffer of new stacks with Python frames.
    pub fn take_new_python_stacks(&mut self) -> Result<RingBuf<MapData>, TracerError> {
        self.take_ring(PY_NEW_STACKS_MAP)
    }

    fn take_ring(&mut self, name: &'static str) -> Result<RingBuf<MapData>, TracerError> {
        let map = self.ebpf.take_map(name).ok_or(TracerError::Missing(name))?;
        RingBuf::try_from(map).map_err(|source| TracerError::ReadMap { map: name, source })
    }

    /// Every outstanding allocation of every traced process.
    pub fn allocations(&self) -> Result<Vec<(AllocationKey, Allocation)>, TracerError> {
        let map: HashMap<&MapData, AllocationKey, Allocation> = self.map(ALLOCATIONS_MAP)?;
        // Entries freed while we iterate vanish under us: skip those.
        Ok(map.iter().filter_map(Result::ok).collect())
    }

    /// Every stored stack, with its id.
    pub fn stacks(
        &self,
        mut take: impl FnMut(u64, &StackKey),
        known: impl Fn(u64) -> bool,
    ) -> Result<(), TracerError> {
        let map: HashMap<&MapData, u64, StackKey> = self.map(STACKS_MAP)?;
        // Keys first: a stack's 1 KiB of frames is copied out only once.
        let new: Vec<u64> = map.keys().filter_map(Result::ok).filter(|&id| !known(id)).collect();
        for id in new {
            // Gone since the keys were read: nothing to take.
            if let Ok(stack) = map.get(&id, 0) {
                take(id, &stack);
            }
        }
        Ok(())
    }

    /// Outstanding totals of every stack, as the BPF side keeps them.
    pub fn stack_totals(&self) -> Result<Vec<(u64, StackTotals)>, TracerError> {
        let map: HashMap<&MapData, u64, StackTotals> = self.map(STACK_TOTALS_MAP)?;
        Ok(map.iter().filter_map(Result::ok).collect())
    }

    /// Each process's health counters. The allocations recorded are not
    /// among them: the per-stack totals count those.
    pub fn counters(&self) -> Result<std::collections::HashMap<u32, HealthCounters>, TracerError> {
        let counters: PerCpuHashMap<&MapData, u32, ProcessCounters> = self.map(PROCESS_COUNTERS_MAP)?;
        let health = |per_cpu: &PerCpuValues<ProcessCounters>| {
            let read = |counter: Counter| per_cpu.iter().map(|counters| counters[counter as usize]).sum();
            HealthCounters {
                allocations: read(Counter::Allocations),
                recorded_allocations: None,
                frees: read(Counter::Frees),
                failed_allocations: read(Counter::FailedAllocations),
                allocations_not_tracked: read(Counter::AllocationsNotTracked),
                stacks_lost: read(Counter::StacksLost),
                events_lost: read(Counter::EventsLost),
                unrecorded_frees: Some(read(Counter::UnrecordedFrees)),
            }
        };
        Ok(counters.iter().filter_map(Result::ok).map(|(pid, counters)| (pid, health(&counters))).collect())
    }

    /// How the table walks went so far, every CPU's counts summed, by
    /// `memleak_common::WalkCount` slot.
    pub fn walk_counts(&self) -> Result<WalkCounts, TracerError> {
        let counts: PerCpuArray<&MapData, WalkCounts> = self.map(WALK_COUNTS_MAP)?;
        let per_cpu =
            counts.get(&0, 0).map_err(|source| TracerError::ReadMap { map: WALK_COUNTS_MAP, source })?;
        Ok(per_cpu.iter().fold(WalkCounts::default(), |mut sum, cpu| {
            for (total, count) in sum.iter_mut().zip(cpu) {
                *total += count;
            }
            sum
        }))
    }

    fn map<'a, T>(&'a self, name: &'static str) -> Result<T, TracerError>
    where
        T: TryFrom<&'a aya::maps::Map, Error = aya::maps::MapError>,
    {
        let map = self.ebpf.map(name).ok_or(TracerError::Missing(name))?;
        T::try_from(map).map_err(|source| TracerError::ReadMap { map: name, source })
    }

    pub(super) fn map_mut<'a, T>(&'a mut self, name: &'static str) -> Result<T, TracerError>
    where
        T: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
    {
        let map = self.ebpf.map_mut(name).ok_or(TracerError::Missing(name))?;
        T::try_from(map).map_err(|source| TracerError::ReadMap { map: name, source })
    }
}

/// Has BPF record only the tasks of cgroup `id` and of its descendants;
/// 0: every task.
fn write_cgroup_filter(ebpf: &mut Ebpf, id: u64) -> Result<(), TracerError> {
    let map = ebpf.map_mut(CGROUP_FILTER_MAP).ok_or(TracerError::Missing(CGROUP_FILTER_MAP))?;
    let mut filter: Array<&mut MapData, u64> =
        Array::try_from(map).map_err(|source| TracerError::ReadMap { map: CGROUP_FILTER_MAP, source })?;
    filter.set(0, id, 0).map_err(|source| TracerError::WriteMap { map: CGROUP_FILTER_MAP, source })
}

/// Has the stack walks look processes up in `PY_PROCS_MAP`, from now on.
fn write_python_walking(ebpf: &mut Ebpf) -> Result<(), TracerError> {
    let map = ebpf.map_mut(PY_WALKING_MAP).ok_or(TracerError::Missing(PY_WALKING_MAP))?;
    let mut walking: Array<&mut MapData, u32> =
        Array::try_from(map).map_err(|source| TracerError::ReadMap { map: PY_WALKING_MAP, source })?;
    walking.set(0, 1, 0).map_err(|source| TracerError::WriteMap { map: PY_WALKING_MAP, source })
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut UProbe, TracerError> {
    ebpf.program_mut(name)
        .and_then(|program| <&mut UProbe>::try_from(program).ok())
        .ok_or(TracerError::Missing(name))
}

fn kernel_btf() -> Result<aya::Btf, TracerError> {
    aya::Btf::from_sys_fs().map_err(|error| TracerError::KernelFeature {
        feature: "BTF (CONFIG_DEBUG_INFO_BTF)".to_owned(),
        detail: error.to_string(),
    })
}

fn btf_tracepoint<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut BtfTracePoint, TracerError> {
    ebpf.program_mut(name)
        .and_then(|program| <&mut BtfTracePoint>::try_from(program).ok())
        .ok_or(TracerError::Missing(name))
}

fn raw_tracepoint<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut RawTracePoint, TracerError> {
    ebpf.program_mut(name)
        .and_then(|program| <&mut RawTracePoint>::try_from(program).ok())
        .ok_or(TracerError::Missing(name))
}

/// Each kernel allocation program with a tracepoint it attaches to. Before
/// 6.1, `kmalloc_node`, `kmem_cache_alloc` and `kmem_cache_alloc_node`
/// were tracepoints of their own with `kmalloc`'s arguments (the size
/// where 6.1's `kmem_cache_alloc` gives the cache): `kmalloc` serves them
/// all there. Told apart by `kmalloc_node`'s BTF type, which 6.1 dropped.
fn kernel_tracepoints(btf: &aya::Btf, percpu: bool) -> Vec<(&'static str, &'static str)> {
    let before_6_1 =
        btf.id_by_type_name_kind("btf_trace_kmalloc_node", aya_obj::btf::BtfKind::Typedef).is_ok();
    let mut sites: Vec<(&'static str, &'static str)> = Vec::new();
    for &program in programs::KERNEL.iter().chain(if percpu { &programs::KERNEL_PERCPU[..] } else { &[] }) {
        if before_6_1 && program == "kmem_cache_alloc" {
            continue;
        }
        sites.push((program, program));
    }
    if before_6_1 {
        sites.extend(
            ["kmalloc_node", "kmem_cache_alloc", "kmem_cache_alloc_node"]
                .map(|tracepoint| ("kmalloc", tracepoint)),
        );
    }
    sites
}

/// Why the kernel refused to load the object: privileges, or a map.
fn load_refused(error: EbpfError, settings: &TracerSettings) -> TracerError {
    if caused_by_eperm(&error) {
        not_permitted()
    } else {
        map_refused(error, settings)
    }
}

/// Whether `error` comes down to EPERM from the kernel: memleak lacks the
/// privileges to load BPF. Read from the error's chain of sources, each an
/// error value, so rewording a message cannot break it.
/// A map the kernel would not create, with what it asked for; any other
/// load error as it is.
fn map_refused(error: EbpfError, settings: &TracerSettings) -> TracerError {
    if let EbpfError::MapError(aya::maps::MapError::CreateError { name, io_error }) = &error {
        if let Some(cost) = map_costs::cost_of(name, settings) {
            let source = std::io::Error::from_raw_os_error(io_error.raw_os_error().unwrap_or(libc::ENOMEM));
            return TracerError::MapRefused { map: name.clone(), cost, source };
        }
    }
    TracerError::Load(error)
}

/// The maps' sizes, from the settings.
fn size_maps<'a, 'b>(loader: &'a mut EbpfLoader<'b>, settings: &TracerSettings) -> &'a mut EbpfLoader<'b> {
    loader
        .map_max_entries(ALLOCATIONS_MAP, settings.max_allocations)
        .map_max_entries(STACKS_MAP, settings.max_stacks)
        .map_max_entries(STACK_IDS_MAP, settings.max_stacks)
        .map_max_entries(STACK_TOTALS_MAP, settings.max_stacks.saturating_add(settings.max_processes))
        .map_max_entries(UNWIND_ROWS_MAP, settings.unwind_rows())
        .map_max_entries(PROCESS_MAPPINGS_MAP, settings.max_processes)
        .map_max_entries(ALLOCATOR_CODE_MAP, settings.max_processes)
        .map_max_entries(PY_PROCS_MAP, settings.max_processes)
        .map_max_entries(UNWIND_RESCANS_MAP, settings.max_processes)
        // Room for processes that are counted but not traced: a cgroup's
        // beyond --max-processes, children not followed yet.
        .map_max_entries(PROCESS_COUNTERS_MAP, settings.max_processes.saturating_mul(2))
        .map_max_entries(FOLLOWED_MAP, settings.max_processes.saturating_mul(2))
        .map_max_entries(TRACED_PROCESSES_MAP, settings.max_processes)
}

/// The ignored processes as the BPF global holds them: 0 past the last.
/// More than fit are left to be recorded, with a warning.
fn ignored_processes(pids: &[u32]) -> [u32; MAX_IGNORED_PROCESSES] {
    let mut ignored = [0; MAX_IGNORED_PROCESSES];
    for (slot, &pid) in ignored.iter_mut().zip(pids) {
        *slot = pid;
    }
    if let Some(left) = pids.get(MAX_IGNORED_PROCESSES..).filter(|left| !left.is_empty()) {
        log::warn!("{} more processes read memleak's output than it can leave out: {left:?}", left.len());
    }
    ignored
}

/// The sites one multi-uprobe link attaches a program to.
struct LinkGroup {
    program: &'static str,
    on_return: bool,
    offsets: Vec<u64>,
    cookies: Vec<u64>,
}

/// `Tracer::attach` with one multi-uprobe link per program, in the order
/// `attach_perf_events` places its probes: frees first, then the return
/// probes, then the entries of allocations.
fn attach_multi(
    programs: &MultiUprobePrograms,
    plan: &AttachPlan,
    scope: UProbeScope,
    seen_in_kernel: &[&'static str],
) -> Result<Links, TracerError> {
    let pid = match scope {
        UProbeScope::OneProcess(pid) => Some(pid.get()),
        UProbeScope::AllProcesses | UProbeScope::CallingProcess => None,
    };
    let (frees, allocations): (Vec<_>, Vec<_>) = plan
        .sites
        .iter()
        .filter(|site| !seen_in_kernel.contains(&site.entry_program))
        .partition(|site| site.return_program.is_none());
    // Each program's sites, in the order first seen.
    let mut groups: Vec<LinkGroup> = Vec::new();
    for &site in frees.iter().chain(&allocations) {
        let entry = site.file_offset + site.entry_skip;
        log::debug!("uprobe on {} at {entry:#x} in {}", site.function, plan.display_path);
        let programs =
            [(site.entry_program, false)].into_iter().chain(site.return_program.map(|ret| (ret, true)));
        for (program, on_return) in programs {
            let found =
                groups.iter().position(|group| group.program == program && group.on_return == on_return);
            let index = found.unwrap_or_else(|| {
                groups.push(LinkGroup { program, on_return, offsets: Vec::new(), cookies: Vec::new() });
                groups.len() - 1
            });
            groups[index].offsets.push(entry);
            // The cookie tells the shared programs which function fired.
            groups[index].cookies.push(site.cookie());
        }
    }
    // The return programs' links before any entry program's but the
    // frees' (which come first: see `attach_perf_events`): an entry that
    // fires before its return probe is placed leaves a call in flight
    // that never returns for BPF.
    let free_programs: Vec<&'static str> = frees.iter().map(|site| site.entry_program).collect();
    groups.sort_by_key(|group| (!free_programs.contains(&group.program), !group.on_return));
    let path = multi_uprobes::c_path(&plan.path)
        .map_err(|source| TracerError::AttachMulti { object: plan.display_path.clone(), source })?;
    let mut links = Links::default();
    for LinkGroup { program, on_return, offsets, cookies } in groups {
        let fd = programs.program(program).ok_or(TracerError::Missing(program))?;
        let link =
            multi_uprobes::link(fd, &path, &offsets, &cookies, pid, on_return).map_err(|source| {
                match (source.raw_os_error(), pid) {
                    (Some(libc::ESRCH), Some(pid)) => TracerError::TargetGone { pid },
                    _ => TracerError::AttachMulti { object: plan.display_path.clone(), source },
                }
            })?;
        links.multi.push(link);
    }
    for other in plan.other_objects() {
        let mut more = attach_multi(programs, other, scope, seen_in_kernel)?;
        links.multi.append(&mut more.multi);
    }
    Ok(links)
}

/// Why a uprobe could not be attached, in the terms of what to do about it.
fn attach_error(
    function: &'static str,
    object: &str,
    scope: UProbeScope,
    source: ProgramError,
) -> TracerError {
    let errno = match &source {
        ProgramError::SyscallError(error) => error.io_error.raw_os_error(),
        _ => None,
    };
    match (errno, scope) {
        (Some(libc::ESRCH), UProbeScope::OneProcess(pid)) => TracerError::TargetGone { pid: pid.get() },
        (Some(libc::EACCES | libc::EPERM), _) => {
            let advice = privileges::advice(Traced::Processes, true);
            TracerError::UprobesNotPermitted { function, object: object.to_owned(), advice }
        }
        _ => TracerError::Attach { function, object: object.to_owned(), source },
    }
}

/// The innermost error of a chain, which says what the kernel said:
/// "`perf_event_open` failed" alone does not.
fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut innermost = error;
    while let Some(cause) = innermost.source() {
        innermost = cause;
    }
    match innermost.downcast_ref::<std::io::Error>() {
        Some(io) if !std::ptr::addr_eq(innermost, error) => format!("{error}: {}", status::os_reason(io)),
        _ => innermost.to_string(),
    }
}

/// The kernel refused to load memleak's programs or maps: whatever is
/// traced, that takes `CAP_BPF` and `CAP_PERFMON`.
fn not_permitted() -> TracerError {
    TracerError::NotPermitted(format!(
        "permission denied loading BPF programs: {}",
        privileges::advice(Traced::Kernel, false)
    ))
}

fn caused_by_eperm(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if error.downcast_ref::<std::io::Error>().is_some_and(|io| io.raw_os_error() == Some(libc::EPERM)) {
            return true;
        }
        cause = error.source();
    }
    false
}
