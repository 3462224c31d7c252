//! Read-only globals that user space sets at load time, and what the
//! probes decide from them (with the cgroup filter, which is a map: see
//! `memleak_common::CGROUP_FILTER_MAP`).

use memleak_common::{CGROUP_LEVEL_UNKNOWN, MAX_IGNORED_PROCESSES, MAX_STACK_DEPTH};

#[unsafe(no_mangle)]
static MIN_SIZE: u64 = 0;
#[unsafe(no_mangle)]
static MAX_SIZE: u64 = u64::MAX;
#[unsafe(no_mangle)]
static STACK_DEPTH: u32 = MAX_STACK_DEPTH as u32;
#[unsafe(no_mangle)]
static STACK_REUSE: u32 = 1;
#[unsafe(no_mangle)]
static SAMPLE_RATE: u32 = 1;
#[unsafe(no_mangle)]
static TRACE: u32 = 0;
#[unsafe(no_mangle)]
static REPLACEMENTS: u32 = 0;
#[unsafe(no_mangle)]
static CACHE_SIZE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TASK_TGID_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static PY_FSBASE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static NEWCOMER_EXECS: u32 = 0;
#[unsafe(no_mangle)]
static CGROUP_LEVEL: u32 = CGROUP_LEVEL_UNKNOWN;
#[cfg(feature = "legacy-kernels")]
#[unsafe(no_mangle)]
static CGROUP_WALK: memleak_common::CgroupWalk = memleak_common::CgroupWalk {
    task_cgroups: 0,
    css_set_cgroup: 0,
    cgroup_level: 0,
    cgroup_self: 0,
    state_parent: 0,
    cgroup_node: 0,
    node_id: 0,
};
#[unsafe(no_mangle)]
static IGNORED_CALLER_START: u64 = 0;
#[unsafe(no_mangle)]
static IGNORED_CALLER_END: u64 = 0;
#[unsafe(no_mangle)]
static IGNORED_PROCESSES: [u32; MAX_IGNORED_PROCESSES] = [0; MAX_IGNORED_PROCESSES];
#[unsafe(no_mangle)]
static EXEC_HOLD: memleak_common::ExecHold = memleak_common::ExecHold {
    enabled: 0,
    task_signal: 0,
    signal_tty: 0,
    task_real_parent: 0,
    task_tgid: 0,
    _padding: 0,
    names: [[0; 16]; memleak_common::MAX_HELD_NAMES],
};

// Volatile reads: without them the compiler folds in the defaults above
// and the values the loader writes would never be seen.

pub fn min_size() -> u64 {
    // SAFETY: a plain read of an initialised static.
    unsafe { core::ptr::read_volatile(&raw const MIN_SIZE) }
}

pub fn max_size() -> u64 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const MAX_SIZE) }
}

/// Frames to keep, clamped so the verifier sees a bounded copy size.
pub fn stack_depth() -> u32 {
    // SAFETY: as above.
    let depth = unsafe { core::ptr::read_volatile(&raw const STACK_DEPTH) };
    if depth == 0 || depth > MAX_STACK_DEPTH as u32 {
        MAX_STACK_DEPTH as u32
    } else {
        depth
    }
}

/// Whether stack walks take the frames a thread's stack still shares
/// with its last walk.
pub fn stack_reuse() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const STACK_REUSE) != 0 }
}

/// Whether to record the allocation call starting now: about one in
/// `SAMPLE_RATE`, chosen at random so that no call site is favoured.
pub fn sample() -> bool {
    // SAFETY: as above.
    let rate = unsafe { core::ptr::read_volatile(&raw const SAMPLE_RATE) };
    // SAFETY: a helper without arguments.
    rate <= 1 || unsafe { aya_ebpf::helpers::generated::bpf_get_prandom_u32() } % rate == 0
}

/// Whether to tell blocks that replace blocks from before the attach from
/// new memory: only when every allocation is recorded, or a block left out
/// by sampling would pass for one from before the attach.
pub fn replacements() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const REPLACEMENTS) != 0 }
}

/// Whether to send a trace event per allocation and free (--trace).
pub fn trace() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const TRACE) != 0 }
}

/// Whether execs of processes not traced are reported (`memleak serve`
/// following processes by name or cgroup).
pub fn newcomer_execs() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const NEWCOMER_EXECS) != 0 }
}

/// Which newcomers are held at their execve: see
/// `memleak_common::ExecHold`.
pub fn holds_at_exec() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const EXEC_HOLD.enabled) != 0 }
}

/// The offsets of `memleak_common::ExecHold`: `task_struct.signal`,
/// `signal_struct.tty`, `task_struct.real_parent`, `task_struct.tgid`.
pub fn hold_offsets() -> [u32; 4] {
    // SAFETY: as above, field by field: the whole would not fit the stack.
    unsafe {
        [
            core::ptr::read_volatile(&raw const EXEC_HOLD.task_signal),
            core::ptr::read_volatile(&raw const EXEC_HOLD.signal_tty),
            core::ptr::read_volatile(&raw const EXEC_HOLD.task_real_parent),
            core::ptr::read_volatile(&raw const EXEC_HOLD.task_tgid),
        ]
    }
}

/// The `index`th name held, all NUL past the last.
pub fn held_name(index: usize) -> [u8; 16] {
    match EXEC_HOLD.names.get(index) {
        // SAFETY: as above.
        Some(name) => unsafe { core::ptr::read_volatile(name) },
        None => [0; 16],
    }
}

/// Offset of `size` in the kernel's struct `kmem_cache`, from its BTF.
pub fn cache_size_offset() -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const CACHE_SIZE_OFFSET) }
}

/// Offset of `tgid` in the kernel's struct `task_struct`, from its BTF.
pub fn task_tgid_offset() -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const TASK_TGID_OFFSET) }
}

/// Offset of `thread.fsbase` in the kernel's struct `task_struct`, from
/// its BTF; 0 when Python frames are off.
pub fn py_fsbase_offset() -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&raw const PY_FSBASE_OFFSET) }
}

/// Whether a kernel allocation made from `call_site` is left out: the BPF
/// memory allocator refilling memleak's own maps. Counting those would
/// feed on itself, each recorded allocation causing more.
pub fn ignored_caller(call_site: u64) -> bool {
    // SAFETY: as above.
    let (start, end) = unsafe {
        (
            core::ptr::read_volatile(&raw const IGNORED_CALLER_START),
            core::ptr::read_volatile(&raw const IGNORED_CALLER_END),
        )
    };
    call_site >= start && call_site < end
}

/// Whether the current task is one memleak traces. The kernel's pid filter
/// has done most of the work: probes fire only in the processes memleak
/// attached them to. With --cgroup, a process that has left the cgroup
/// (and its descendants) since is not recorded any more.
pub fn in_scope() -> bool {
    // An array's lookup, which the verifier inlines: a few instructions.
    let cgroup = crate::maps::CGROUP_FILTER.get(0).copied().unwrap_or(0);
    cgroup == 0 || (in_cgroup_subtree(cgroup) && !ignored_process(current_process()))
}

/// Whether the current task's cgroup is `cgroup` or below it. Its ancestor
/// at `cgroup`'s level is `cgroup` exactly then: one helper call that
/// reads the kernel's array of a cgroup's ancestors, no map. Runs on every
/// allocator call of every process mapping a probed file, so the cheapest
/// correct test: `bpf_current_task_under_cgroup` is as exact but looks the
/// cgroup up in a cgroup-array map, which aya 0.14's user side cannot
/// fill, and walking ancestors in BPF costs one read per level (which
/// kernels before 5.17 need: see `ancestor_cgroup_id`).
fn in_cgroup_subtree(cgroup: u64) -> bool {
    // SAFETY: as above.
    let level = unsafe { core::ptr::read_volatile(&raw const CGROUP_LEVEL) };
    // CGROUP_LEVEL_UNKNOWN, past i32::MAX, is the only level that does not
    // fit: the kernel nests cgroups at most a few hundred deep.
    let Ok(level) = i32::try_from(level) else {
        // SAFETY: a helper without arguments.
        return unsafe { aya_ebpf::helpers::generated::bpf_get_current_cgroup_id() } == cgroup;
    };
    ancestor_cgroup_id(level) == cgroup
}

/// Whether the current task's cgroup is `cgroup`, at `level` below the
/// root, or below it; [`CGROUP_LEVEL_UNKNOWN`]: only `cgroup` itself.
pub fn in_cgroup(cgroup: u64, level: u32) -> bool {
    match i32::try_from(level) {
        Ok(level) => ancestor_cgroup_id(level) == cgroup,
        // SAFETY: a helper without arguments.
        Err(_) => (unsafe { aya_ebpf::helpers::generated::bpf_get_current_cgroup_id() }) == cgroup,
    }
}

/// The id of the current task's cgroup's ancestor at `level`, 0 if the
/// task is not that deep.
#[cfg(not(feature = "legacy-kernels"))]
fn ancestor_cgroup_id(level: i32) -> u64 {
    // SAFETY: a helper taking a plain integer.
    unsafe { aya_ebpf::helpers::generated::bpf_get_current_ancestor_cgroup_id(level) }
}

/// The same, in the object for kernels before 5.17: 5.10's verifier
/// refuses that helper in uprobe programs ("unknown func"). Read from
/// the kernel's structures, one read per level climbed, at the offsets
/// user space found in its BTF.
#[cfg(feature = "legacy-kernels")]
fn ancestor_cgroup_id(level: i32) -> u64 {
    // SAFETY: written by user space before loading, read-only since.
    let walk = unsafe { core::ptr::read_volatile(&raw const CGROUP_WALK) };
    // SAFETY: a helper without arguments.
    let task = unsafe { aya_ebpf::helpers::generated::bpf_get_current_task() };
    let mut cgroup =
        kernel_word(kernel_word(task + u64::from(walk.task_cgroups)) + u64::from(walk.css_set_cgroup));
    let depth_field = (cgroup + u64::from(walk.cgroup_level)) as *const i32;
    // SAFETY: a kernel read that fails cleanly on a bad address.
    let Ok(depth) = (unsafe { aya_ebpf::helpers::bpf_probe_read_kernel(depth_field) }) else { return 0 };
    let mut climb = depth - level;
    for _ in 0..memleak_common::MAX_CGROUP_CLIMB {
        if climb <= 0 {
            break;
        }
        let parent_state = kernel_word(cgroup + u64::from(walk.cgroup_self) + u64::from(walk.state_parent));
        cgroup = parent_state.wrapping_sub(u64::from(walk.cgroup_self));
        climb -= 1;
    }
    if climb != 0 {
        return 0;
    }
    kernel_word(kernel_word(cgroup + u64::from(walk.cgroup_node)) + u64::from(walk.node_id))
}

/// The kernel's word at `address`, 0 if it cannot be read.
#[cfg(feature = "legacy-kernels")]
fn kernel_word(address: u64) -> u64 {
    // SAFETY: a kernel read that fails cleanly on a bad address.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel(address as *const u64) }.unwrap_or(0)
}

/// Whether process `tgid` is one never recorded: see
/// `memleak_common::tunables::IGNORED_PROCESSES`.
pub fn ignored_process(tgid: u32) -> bool {
    // SAFETY: as above.
    let ignored = unsafe { core::ptr::read_volatile(&raw const IGNORED_PROCESSES) };
    for pid in ignored {
        if pid == 0 {
            return false;
        }
        if pid == tgid {
            return true;
        }
    }
    false
}

/// The current process's id, read here rather than through `calls`, which
/// asks this module whether a call is in scope.
fn current_process() -> u32 {
    (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32
}
