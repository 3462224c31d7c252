//! The names both sides look each other's maps, programs and tunables up
//! by.

/// [`AllocationKey`](crate::AllocationKey) -> [`Allocation`](crate::Allocation).
pub const ALLOCATIONS_MAP: &str = "ALLOCATIONS";
/// Stack id (u64) -> [`StackKey`](crate::StackKey).
pub const STACKS_MAP: &str = "STACKS";
/// [`StackSlot`](crate::StackSlot) -> stack id (u64).
pub const STACK_IDS_MAP: &str = "STACK_IDS";
/// Stack id (u64) -> [`StackTotals`](crate::StackTotals).
pub const STACK_TOTALS_MAP: &str = "STACK_TOTALS";
/// [`AllocationKey`](crate::AllocationKey) -> release time (u64,
/// `CLOCK_MONOTONIC` ns): blocks memleak never saw allocated, released
/// lately.
pub const REPLACEABLE_MAP: &str = "REPLACEABLE";
/// Thread id (u32) -> [`PendingCall`](crate::PendingCall).
pub const PENDING_MAP: &str = "PENDING";
/// Program array whose slot 0 user space sets to
/// [`programs::RECORD_WITH_USER_STACK`].
pub const USER_STACK_RECORDER_MAP: &str = "USER_STACK_RECORDER";
/// The programs in [`USER_STACK_RECORDER_MAP`], each at its index: the
/// recorder, and on kernels without `bpf_loop` the later stages of its
/// walk (see memleak-ebpf's `probes::recorder`).
pub const USER_STACK_STAGES: [&str; 4] = [
    programs::RECORD_WITH_USER_STACK,
    programs::WALK_USER_STACK,
    programs::STORE_USER_STACK,
    programs::INSERT_USER_STACK,
];
/// The index of the stage that takes more frames.
pub const STAGE_WALK: u32 = 1;
/// The index of the stage that completes the stack, and records it if it
/// is the CPU's last.
pub const STAGE_STORE: u32 = 2;
/// The index of the stage that stores a stack the CPU did not see last,
/// trying one slot of its hash a run and calling itself again for the
/// next, and records.
pub const STAGE_INSERT: u32 = 3;
/// Program array of kernel mode's later stages on kernels without
/// `bpf_loop`, where one program cannot both take a kernel stack and
/// store it within the verifier's budget (see memleak-ebpf's
/// `probes::kernel`): the programs of [`KERNEL_STACK_STAGES`], each at its
/// index.
pub const KERNEL_STACK_RECORDER_MAP: &str = "KERNEL_STACK_RECORDER";
/// See [`KERNEL_STACK_RECORDER_MAP`].
pub const KERNEL_STACK_STAGES: [&str; 2] = [programs::STORE_KERNEL_STACK, programs::INSERT_KERNEL_STACK];
/// The index of the kernel stage that completes the stack, and records it
/// if it is the CPU's last.
pub const KERNEL_STAGE_STORE: u32 = 0;
/// The index of the kernel stage that stores a stack the CPU did not see
/// last, like [`STAGE_INSERT`].
pub const KERNEL_STAGE_INSERT: u32 = 1;
/// Process id (u32) -> [`ProcessCounters`](crate::ProcessCounters).
pub const PROCESS_COUNTERS_MAP: &str = "PROCESS_COUNTERS";
/// Process id (u32) -> 1 (u32): processes whose new children are
/// followed; the fork tracepoint adds each child it reports.
pub const FOLLOWED_MAP: &str = "FOLLOWED";
/// Process id (u32) -> flags (u32): the processes memleak traces, from
/// before their probes are attached until they are forgotten.
/// [`programs::MAPPING_SYSTEM_CALLS`] (or [`programs::MAPPING_LOCK_TAKEN`])
/// fire for every process on the machine, and send only these processes'
/// calls. Flag
/// [`RESERVES_ADDRESS_SPACE`]: the process has reserved address space of
/// its own (see [`crate::MappingEvent::reserves_address_space`]); until then,
/// an mprotect that gives access changes nothing memleak tracks, and is
/// not sent (a JIT flipping its pages between writable and executable).
pub const TRACED_PROCESSES_MAP: &str = "TRACED_PROCESSES";
/// See [`TRACED_PROCESSES_MAP`].
pub const RESERVES_ADDRESS_SPACE: u32 = 1;
/// Array of one u64: with --cgroup (or `memleak serve` following one
/// cgroup and nothing else), the cgroup v2 id whose tasks, and those of
/// its descendant cgroups, are recorded; 0 records every task the probes
/// fire for. A map, not a load-time tunable: a cgroup removed and made
/// again at the same path (a container restarted) has a new id, which
/// user space writes here.
pub const CGROUP_FILTER_MAP: &str = "CGROUP_FILTER";
/// Ring buffer of [`TraceEvent`](crate::TraceEvent)s, written only with --trace.
pub const EVENTS_MAP: &str = "EVENTS";
/// Ring buffer of [`MappingEvent`](crate::MappingEvent)s.
pub const MAPPING_EVENTS_MAP: &str = "MAPPING_EVENTS";
/// Ring buffer of the ids (u64) of stacks with Python frames, each sent
/// when the stack is first stored: user space reads their code objects
/// while they are alive. A full ring loses ids, which are then resolved
/// at the next report.
pub const PY_NEW_STACKS_MAP: &str = "PY_NEW_STACKS";
/// Array of [`UnwindRow`](crate::UnwindRow)s, every object's table in a
/// range of its own; memory-mapped by user space, which writes them.
pub const UNWIND_ROWS_MAP: &str = "UNWIND_ROWS";
/// Process id (u32) -> [`ProcessMappings`](crate::ProcessMappings).
pub const PROCESS_MAPPINGS_MAP: &str = "PROCESS_MAPPINGS";
/// Process id (u32) -> [`AllocatorCode`](crate::AllocatorCode).
pub const ALLOCATOR_CODE_MAP: &str = "ALLOCATOR_CODE";
/// Process id (u32) -> `CLOCK_MONOTONIC` ns (u64) of the first walk since
/// the last rescan that met code in no known mapping: user space rescans
/// that process's mappings and deletes the entry.
pub const UNWIND_RESCANS_MAP: &str = "UNWIND_RESCANS";
/// Process id (u32) -> [`PyProcConfig`](crate::PyProcConfig): the CPython
/// processes whose stacks get their Python frames.
pub const PY_PROCS_MAP: &str = "PY_PROCS";
/// Array of one u32: 1 from before user space first puts a process in
/// [`PY_PROCS_MAP`], 0 until then. A stack walk looks a process up there
/// only when it is 1: most processes traced run no Python, and the
/// lookup cost each allocation a hash of its pid. BPF adds entries only
/// for the children of processes in the map, so it is never 0 while the
/// map holds one.
pub const PY_WALKING_MAP: &str = "PY_WALKING";
/// Per-CPU [`WalkCounts`](crate::WalkCounts): how much of their stacks
/// the table walks took from the last walk of their thread.
pub const WALK_COUNTS_MAP: &str = "WALK_COUNTS";
/// The processes the OOM killer picked, by tgid, with when (ns since
/// boot): user space takes and removes them.
pub const OOM_VICTIMS_MAP: &str = "OOM_VICTIMS";

/// Load-time tunables: read-only globals in the BPF object, set by the
/// loader (libbpf-tools' `const volatile` pattern).
pub mod tunables {
    /// u64: smallest allocation recorded, in bytes.
    pub const MIN_SIZE: &str = "MIN_SIZE";
    /// u64: largest allocation recorded, in bytes.
    pub const MAX_SIZE: &str = "MAX_SIZE";
    /// u32: frames kept per stack, at most [`crate::MAX_STACK_DEPTH`].
    pub const STACK_DEPTH: &str = "STACK_DEPTH";
    /// u32: 1 to take the frames a thread's stack still shares with its
    /// last walk, checked; 0 to walk every frame (--no-stack-reuse).
    pub const STACK_REUSE: &str = "STACK_REUSE";
    /// u32: record about one allocation in this many (1: all).
    pub const SAMPLE_RATE: &str = "SAMPLE_RATE";
    /// u32: 1 to send a [`crate::TraceEvent`] per allocation and free.
    pub const TRACE: &str = "TRACE";
    /// u32: 1 to tell the blocks that replace blocks from before the
    /// attach from new memory, which only works when every allocation is
    /// recorded.
    pub const REPLACEMENTS: &str = "REPLACEMENTS";
    /// u32: the level of the cgroup in [`crate::CGROUP_FILTER_MAP`] below
    /// the cgroup2 root (the root is 0), or [`crate::CGROUP_LEVEL_UNKNOWN`]:
    /// then only tasks directly in it are recorded. A cgroup made again at
    /// the same path has the same level.
    pub const CGROUP_LEVEL: &str = "CGROUP_LEVEL";
    /// [`crate::CgroupWalk`]: where the kernel keeps what the object for
    /// kernels before 5.17 reads to find a task's ancestor cgroups.
    pub const CGROUP_WALK: &str = "CGROUP_WALK";
    /// u32: offset of `size` in the kernel's struct `kmem_cache`.
    pub const CACHE_SIZE_OFFSET: &str = "CACHE_SIZE_OFFSET";
    /// u32: offset of `tgid` in the kernel's struct `task_struct`, to tell
    /// a new process from a new thread.
    pub const TASK_TGID_OFFSET: &str = "TASK_TGID_OFFSET";
    /// u32: offset of `thread.fsbase` in the kernel's struct
    /// `task_struct`, where a thread's libc data is found; 0 walks no
    /// Python frames.
    pub const PY_FSBASE_OFFSET: &str = "PY_FSBASE_OFFSET";
    /// u32: 1 to report each execve of a process memleak does not trace
    /// as a [`crate::MappingChange::Launched`] event, so that a process
    /// `memleak serve` follows by name or cgroup is found at its start.
    pub const NEWCOMER_EXECS: &str = "NEWCOMER_EXECS";
    /// u64, u64: kernel code range whose allocations are left out (the BPF
    /// memory allocator's refill, which serves memleak's own maps).
    pub const IGNORED_CALLER_START: &str = "IGNORED_CALLER_START";
    pub const IGNORED_CALLER_END: &str = "IGNORED_CALLER_END";
    /// [u32; [`crate::MAX_IGNORED_PROCESSES`]]: processes never recorded,
    /// 0 past the last: memleak itself, and with --trace the processes
    /// that read its output. Recording them would feed on itself, each
    /// event printed causing more. Checked where one probe serves many
    /// processes (--cgroup, the kernel); elsewhere they are never probed.
    pub const IGNORED_PROCESSES: &str = "IGNORED_PROCESSES";
    /// [`crate::ExecHold`]: which newcomers BPF stops at their execve
    /// until their probes are placed.
    pub const EXEC_HOLD: &str = "EXEC_HOLD";
}

/// What BPF checks to stop a newcomer at its execve (with `SIGSTOP`,
/// before its first instruction) until user space has placed its probes
/// and sends `SIGCONT`: else what it allocates in its first milliseconds
/// is missed. Only a process with no controlling terminal is held (a
/// job-control shell would show the stop as "Stopped" and take the
/// terminal back), never a child of memleak's own (it may be waiting for
/// it), and only one that a name of `names` or a cgroup of
/// [`HELD_CGROUPS_MAP`] selects. Offsets from the kernel's BTF.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ExecHold {
    /// 0 holds no process.
    pub enabled: u32,
    /// `task_struct.signal`.
    pub task_signal: u32,
    /// `signal_struct.tty`: the controlling terminal, or null.
    pub signal_tty: u32,
    /// `task_struct.real_parent`.
    pub task_real_parent: u32,
    /// `task_struct.tgid`.
    pub task_tgid: u32,
    pub _padding: u32,
    /// Names a process is started under (its `comm`: at most 15 bytes,
    /// NUL-padded), an empty one past the last.
    pub names: [[u8; 16]; MAX_HELD_NAMES],
}

/// How many names [`ExecHold`] holds: `--exe` given more often holds only
/// the first ones' processes.
pub const MAX_HELD_NAMES: usize = 8;

/// Array of [`HeldCgroup`], [`MAX_HELD_CGROUPS`] entries: the cgroups
/// whose newcomers (and those of cgroups below them) are held at their
/// execve; an entry of id 0 is unused.
pub const HELD_CGROUPS_MAP: &str = "HELD_CGROUPS";

/// How many cgroups [`HELD_CGROUPS_MAP`] holds.
pub const MAX_HELD_CGROUPS: u32 = 8;

/// A cgroup whose newcomers are held, and its level below the cgroup2
/// root ([`CGROUP_LEVEL_UNKNOWN`]: only tasks directly in it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldCgroup {
    pub id: u64,
    pub level: u32,
    pub _padding: u32,
}

/// [`tunables::CGROUP_LEVEL`] when the cgroup's level is not known.
pub const CGROUP_LEVEL_UNKNOWN: u32 = u32::MAX;

/// Where a kernel keeps a task's cgroup and the cgroup's ancestors, read
/// from its BTF: the object for kernels before 5.17 walks up from the
/// task's cgroup itself ([`tunables::CGROUP_WALK`]): 5.10's verifier
/// refuses `bpf_get_current_ancestor_cgroup_id` in uprobe programs. Byte
/// offsets, all 0 where there is no cgroup filter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CgroupWalk {
    /// `task_struct.cgroups`: the task's `css_set`.
    pub task_cgroups: u32,
    /// `css_set.dfl_cgrp`: its cgroup in the cgroup2 hierarchy.
    pub css_set_cgroup: u32,
    /// `cgroup.level`: its depth below the root (0).
    pub cgroup_level: u32,
    /// `cgroup.self`: the cgroup's own state, which its children's
    /// `parent` points at.
    pub cgroup_self: u32,
    /// `cgroup_subsys_state.parent`.
    pub state_parent: u32,
    /// `cgroup.kn`: its directory's kernfs node.
    pub cgroup_node: u32,
    /// `kernfs_node.id`: the cgroup's id.
    pub node_id: u32,
}

/// How far up [`CgroupWalk`] goes from a task's cgroup: deeper tasks are
/// not in the filter's subtree. Containers nest a handful of levels.
pub const MAX_CGROUP_CLIMB: u32 = 32;

/// How many processes [`tunables::IGNORED_PROCESSES`] holds.
pub const MAX_IGNORED_PROCESSES: usize = 8;

/// The BPF programs, by name. Which allocator function each uprobe
/// program serves is said in [`crate::ALLOCATOR_FUNCTIONS`] and
/// [`crate::MAPPING_FUNCTIONS`].
pub mod programs {
    pub const MALLOC_ENTER: &str = "malloc_enter";
    pub const CALLOC_ENTER: &str = "calloc_enter";
    pub const REALLOC_ENTER: &str = "realloc_enter";
    pub const REALLOCARRAY_ENTER: &str = "reallocarray_enter";
    pub const MEMALIGN_ENTER: &str = "memalign_enter";
    pub const POSIX_MEMALIGN_ENTER: &str = "posix_memalign_enter";
    /// The one return probe of every allocation function.
    pub const ALLOCATION_RETURN: &str = "allocation_return";
    pub const FREE_ENTER: &str = "free_enter";
    pub const MMAP_ENTER: &str = "mmap_enter";
    pub const MREMAP_ENTER: &str = "mremap_enter";
    /// The return probe of mmap and mremap.
    pub const MAPPING_RETURN: &str = "mapping_return";
    pub const MUNMAP_ENTER: &str = "munmap_enter";
    /// The one program that walks user stacks, tail-called by the return
    /// probes through [`crate::USER_STACK_RECORDER_MAP`]; never attached.
    pub const RECORD_WITH_USER_STACK: &str = "record_with_user_stack";
    /// Kernels without `bpf_loop`: the stage that takes a few more frames
    /// of the walk, and calls itself again until it ends.
    pub const WALK_USER_STACK: &str = "walk_user_stack";
    /// Kernels without `bpf_loop`: the stage that completes the walked
    /// stack, and records it if it is the CPU's last.
    pub const STORE_USER_STACK: &str = "store_user_stack";
    /// Kernels without `bpf_loop`: the stage that stores a new stack, a
    /// slot of its hash a run.
    pub const INSERT_USER_STACK: &str = "insert_user_stack";
    pub const MPROTECT_ENTER: &str = "mprotect_enter";
    /// Kernels without attach cookies (before 5.15): one entry program
    /// per function of `ALLOCATOR_FUNCTIONS`, in its order, each knowing
    /// which function it is; a site's aliases are named by its first.
    pub const ENTRY_OF_FUNCTION: [&str; crate::ALLOCATOR_FUNCTIONS.len()] = [
        "entry_0", "entry_1", "entry_2", "entry_3", "entry_4", "entry_5", "entry_6", "entry_7", "entry_8",
        "entry_9", "entry_10", "entry_11", "entry_12", "entry_13", "entry_14", "entry_15", "entry_16",
        "entry_17", "entry_18", "entry_19", "entry_20", "entry_21", "entry_22", "entry_23", "entry_24",
        "entry_25",
    ];
    /// Kernels without attach cookies: mprotect's entry probe when it
    /// is placed past the system call (`PROBED_AFTER_SYSTEM_CALL`).
    pub const MPROTECT_PAST_CALL: &str = "mprotect_past_call";
    /// Where the kernel cannot attach `MAPPING_SYSTEM_CALLS` (built
    /// without ftrace), munmap and mprotect are seen from the
    /// `mmap_lock_acquire_returned` tracepoint: program and tracepoint
    /// share the name.
    pub const MAPPING_LOCK_TAKEN: &str = "mmap_lock_acquire_returned";
    /// munmap and mprotect seen from the kernel, at their system calls'
    /// entry, where a uprobe costs a trap per call (see memleak-ebpf's
    /// `probes::mmap`): (program, kernel function) of each fentry program.
    pub const MAPPING_SYSTEM_CALLS: [(&str, &str); 3] = [
        ("munmap_called", SYS_MUNMAP),
        ("mprotect_called", SYS_MPROTECT),
        ("pkey_mprotect_called", SYS_PKEY_MPROTECT),
    ];
    /// The kernel's wrappers of those system calls, named by architecture:
    /// each takes the task's saved user registers.
    #[cfg(not(target_arch = "aarch64"))]
    pub const SYS_MUNMAP: &str = "__x64_sys_munmap";
    #[cfg(not(target_arch = "aarch64"))]
    pub const SYS_MPROTECT: &str = "__x64_sys_mprotect";
    #[cfg(not(target_arch = "aarch64"))]
    pub const SYS_PKEY_MPROTECT: &str = "__x64_sys_pkey_mprotect";
    #[cfg(target_arch = "aarch64")]
    pub const SYS_MUNMAP: &str = "__arm64_sys_munmap";
    #[cfg(target_arch = "aarch64")]
    pub const SYS_MPROTECT: &str = "__arm64_sys_mprotect";
    #[cfg(target_arch = "aarch64")]
    pub const SYS_PKEY_MPROTECT: &str = "__arm64_sys_pkey_mprotect";
    /// Kernel allocations: program name and tracepoint name are the same.
    pub const KERNEL: [&str; 6] =
        ["kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc", "mm_page_free"];
    /// Kernels without `bpf_loop`: the raw tracepoint programs that
    /// complete and store a kernel allocation's stack (see
    /// [`crate::KERNEL_STACK_RECORDER_MAP`]); never attached.
    pub const STORE_KERNEL_STACK: &str = "store_kernel_stack";
    pub const INSERT_KERNEL_STACK: &str = "insert_kernel_stack";
    /// The kernel tracepoints that release memory, attached before the
    /// others.
    pub const KERNEL_RELEASES: [&str; 4] = ["kfree", "kmem_cache_free", "mm_page_free", "percpu_free_percpu"];
    /// Per-CPU kernel allocations (--percpu).
    pub const KERNEL_PERCPU: [&str; 2] = ["percpu_alloc_percpu", "percpu_free_percpu"];
    /// The `sched_process_exec` tracepoint: a traced process's new program.
    pub const PROCESS_EXEC: &str = "sched_process_exec";
    /// The `sched_process_fork` tracepoint: a followed process's child.
    pub const PROCESS_FORK: &str = "sched_process_fork";
    /// The `mark_victim` tracepoint, the OOM killer's pick, as kernels
    /// before 6.8 pass it (its pid) and as later ones do (its task); the
    /// tracepoint both attach to is `OOM_VICTIM_TRACEPOINT`.
    pub const OOM_VICTIM_BY_PID: &str = "oom_victim_by_pid";
    pub const OOM_VICTIM_BY_TASK: &str = "oom_victim_by_task";
    pub const OOM_VICTIM_TRACEPOINT: &str = "mark_victim";
    /// Empty uprobe and uretprobe programs, which price a probe's trap:
    /// attached to a function of memleak's own, for memleak alone.
    pub const CALIBRATION_ENTRY: &str = "calibration_entry";
    pub const CALIBRATION_RETURN: &str = "calibration_return";
    /// Uprobe on the dynamic loader's `_dl_debug_state`, for a process
    /// held at its execve whose allocator was not mapped yet: stops it
    /// again there (`MappingChange::LoaderReady`).
    pub const LOADER_READY: &str = "loader_ready";
}
