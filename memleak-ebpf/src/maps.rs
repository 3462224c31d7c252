//! The maps. The sizes here are what the verifier sees; user space sets
//! those of ALLOCATIONS, STACKS, `STACK_IDS` and `STACK_TOTALS` at load time
//! from --max-allocs, --max-stacks and the number of processes traced.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray, RingBuf},
};
use memleak_common::{
    Allocation, AllocationKey, AllocatorCode, MappingEvent, PendingCall, PendingMapping, ProcessCounters,
    ProcessMappings, PyProcConfig, RuleCacheEntry, StackKey, StackSlot, StackTotals, UnwindRow, WalkCounts,
    MAX_STACK_DEPTH, RULE_CACHE_ENTRIES,
};

/// (process, address) -> outstanding allocation. Not preallocated: kernel
/// memory grows with what the targets really hold, not with --max-allocs.
#[map(name = "ALLOCATIONS")]
pub static ALLOCATIONS: HashMap<AllocationKey, Allocation> =
    HashMap::with_max_entries(1_000_000, BPF_F_NO_PREALLOC);

/// Stack id -> (process, whole stack); see `stack`.
#[map(name = "STACKS")]
pub static STACKS: HashMap<u64, StackKey> = HashMap::with_max_entries(65_536, BPF_F_NO_PREALLOC);

/// (process, stack hash) -> stack id; see `stack`.
#[map(name = "STACK_IDS")]
pub static STACK_IDS: HashMap<StackSlot, u64> = HashMap::with_max_entries(65_536, BPF_F_NO_PREALLOC);

/// Stack id -> outstanding bytes and allocations. User space sizes it as
/// STACKS plus room for the lost-stack entry of each process it may trace
/// at once.
#[map(name = "STACK_TOTALS")]
pub static STACK_TOTALS: HashMap<u64, StackTotals> = HashMap::with_max_entries(65_537, BPF_F_NO_PREALLOC);

/// (process, address) -> when a block memleak never saw allocated was
/// released there; a block allocated at the address soon after takes its
/// place (see `record`). LRU: the oldest releases make room, and their
/// addresses are long handed out again.
#[map(name = "REPLACEABLE")]
pub static REPLACEABLE: LruHashMap<AllocationKey, u64> = LruHashMap::with_max_entries(16_384, 0);

/// Thread id -> allocation call in flight, or the thread's idle entry
/// (depth 0), which its next call reuses in place: no insert or delete per
/// call. LRU, so that the entries of threads gone make room for new ones.
#[map(name = "PENDING")]
pub static PENDING: LruHashMap<u32, PendingCall> = LruHashMap::with_max_entries(16_384, 0);

/// Process id -> its health counters, one copy per CPU: every allocation
/// and free counts, and a shared copy would bounce one cache line between
/// the CPUs a process's threads run on. Sized at load from --max-processes.
#[map(name = "PROCESS_COUNTERS")]
pub static PROCESS_COUNTERS: PerCpuHashMap<u32, ProcessCounters> = PerCpuHashMap::with_max_entries(1024, 0);

/// Process id -> 1: the processes whose children are followed.
#[map(name = "FOLLOWED")]
pub static FOLLOWED: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);

/// Process id -> 1: the processes memleak traces; see
/// `memleak_common::TRACED_PROCESSES_MAP`.
#[map(name = "TRACED_PROCESSES")]
pub static TRACED_PROCESSES: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);

/// Slot 0: the id of the cgroup whose tasks are recorded, 0 for all; see
/// `memleak_common::CGROUP_FILTER_MAP`.
#[map(name = "CGROUP_FILTER")]
pub static CGROUP_FILTER: Array<u64> = Array::with_max_entries(1, 0);

/// The cgroups whose newcomers are held at their execve; see
/// `memleak_common::HELD_CGROUPS_MAP`.
#[map(name = "HELD_CGROUPS")]
pub static HELD_CGROUPS: Array<memleak_common::HeldCgroup> =
    Array::with_max_entries(memleak_common::MAX_HELD_CGROUPS, 0);

/// Slot 0: whether `PY_PROCS` may hold a process; see
/// `memleak_common::PY_WALKING_MAP`.
#[map(name = "PY_WALKING")]
pub static PY_WALKING: Array<u32> = Array::with_max_entries(1, 0);

/// Process id -> how to walk its Python frames; see
/// `memleak_common::PY_PROCS_MAP`. Sized at load from --max-processes.
#[map(name = "PY_PROCS")]
pub static PY_PROCS: HashMap<u32, PyProcConfig> = HashMap::with_max_entries(1024, 0);

/// The Python frames of the stack being walked, before they join it; one
/// entry per scratch slot, as for each map that has `SCRATCH_SLOTS`.
#[map(name = "PY_SCRATCH")]
pub static PY_SCRATCH: PerCpuArray<PyScratch> = PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// Scratch space for one stack key: too big for the 512-byte BPF stack.
#[map(name = "STACK_SCRATCH")]
pub static STACK_SCRATCH: PerCpuArray<StackKey> = PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// The stack this CPU's slot stored or found last, with its id: a loop
/// that allocates from one place finds its stack here without a hash
/// lookup.
#[map(name = "LAST_STACK")]
pub static LAST_STACK: PerCpuArray<LastStack> = PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// Where the search of `STACK_IDS` for a stack stands, per scratch slot;
/// see `stack::find_or_insert`.
#[map(name = "STACK_PROBES")]
pub static STACK_PROBES: PerCpuArray<StackProbe> = PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// A search's outcome, in map memory, where the verifier knows no value:
/// each slot's step then starts from the same state, whichever way the
/// step before ended.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct StackProbe {
    /// The stack's id, once `FOUND`.
    pub id: u64,
    /// `SEARCHING`, `FOUND` or `FULL`.
    pub outcome: u32,
    /// Kernels without `bpf_loop`, where the search goes a slot a stage:
    /// the slot tried next, after the stack's own.
    pub index: u32,
    /// The same: the stack's hash.
    pub hash: u64,
}

/// Per-CPU count of stack ids handed out; see `stack::new_stack_id`.
#[map(name = "STACK_ID_COUNTERS")]
pub static STACK_ID_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// --trace events for user space: 1 MiB, about 26,000 events between two
/// reads; more are counted as lost.
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

/// mmap, munmap and mremap calls, for user space's region bookkeeping.
#[map(name = "MAPPING_EVENTS")]
pub static MAPPING_EVENTS: RingBuf = RingBuf::with_byte_size(256 << 10, 0);

/// Stacks with Python frames, as first stored (`PY_NEW_STACKS_MAP`): a
/// ring of their own, so that a program's thousands of start-up stacks
/// never crowd out the mapping events.
#[map(name = "PY_NEW_STACKS")]
pub static PY_NEW_STACKS: RingBuf = RingBuf::with_byte_size(64 << 10, 0);

/// Thread id -> mmap or mremap in flight.
#[map(name = "PENDING_MAPPINGS")]
pub static PENDING_MAPPINGS: LruHashMap<u32, PendingMapping> = LruHashMap::with_max_entries(16_384, 0);

/// Every object's unwind rows, each object a range of its own; sized at
/// load from --max-unwind-rows, and written by user space through a
/// memory mapping of the array (one write per row would take seconds).
#[map(name = "UNWIND_ROWS")]
pub static UNWIND_ROWS: Array<UnwindRow> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// Process id -> its executable mappings and their rows. Not preallocated:
/// an update swaps the whole value, so a walk sees the old table or the
/// new one.
#[map(name = "PROCESS_MAPPINGS")]
pub static PROCESS_MAPPINGS: HashMap<u32, ProcessMappings> =
    HashMap::with_max_entries(1024, BPF_F_NO_PREALLOC);

/// Process id -> where its allocator's code lies (see
/// `memleak_common::AllocatorCode`).
#[map(name = "ALLOCATOR_CODE")]
pub static ALLOCATOR_CODE: HashMap<u32, AllocatorCode> = HashMap::with_max_entries(1024, 0);

/// Process id -> when a walk first met code in no mapping it knows; user
/// space rescans the process and deletes the entry.
#[map(name = "UNWIND_RESCANS")]
pub static UNWIND_RESCANS: HashMap<u32, u64> = HashMap::with_max_entries(1024, 0);

/// Each CPU's cache of unwind rules by pc, per slot; see
/// `memleak_common::RuleCacheEntry`.
#[map(name = "RULE_CACHE")]
pub static RULE_CACHE: PerCpuArray<[RuleCacheEntry; RULE_CACHE_ENTRIES]> =
    PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// Each CPU's table walks under way, per slot: see `unwind::tables`.
#[map(name = "WALK_STATE")]
pub static WALK_STATE: PerCpuArray<WalkState> = PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// Each CPU's last table walk and the one under way, per slot: see
/// `unwind::reuse`.
#[map(name = "WALK_CACHES")]
pub static WALK_CACHES: PerCpuArray<WalkCaches> = PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// Each CPU's counts of its table walks: see `memleak_common::WalkCount`.
#[map(name = "WALK_COUNTS")]
pub static WALK_COUNTS: PerCpuArray<WalkCounts> = PerCpuArray::with_max_entries(1, 0);

/// Slots of each CPU's scratch: entries of each per-CPU map a walk works
/// in, one for each program run preempted mid-walk on the CPU, and one for
/// the run going on (see `scratch`).
pub const SCRATCH_SLOTS: usize = 4;

/// Which thread holds each slot of this CPU's scratch (0: none): see
/// `scratch`.
#[map(name = "SCRATCH_HOLDERS")]
pub static SCRATCH_HOLDERS: PerCpuArray<[u64; SCRATCH_SLOTS]> = PerCpuArray::with_max_entries(1, 0);

/// Never filled: see `scratch::own_stack`.
#[map(name = "NO_PROGRAMS")]
pub static NO_PROGRAMS: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// What the return probes leave for `record_with_user_stack`: see
/// `deferred`.
#[map(name = "PENDING_RECORD")]
pub static PENDING_RECORD: PerCpuArray<PendingRecord> =
    PerCpuArray::with_max_entries(SCRATCH_SLOTS as u32, 0);

/// Slot 0: `record_with_user_stack`, which user space puts there.
#[map(name = "USER_STACK_RECORDER")]
pub static USER_STACK_RECORDER: ProgramArray =
    ProgramArray::with_max_entries(memleak_common::USER_STACK_STAGES.len() as u32, 0);

/// Kernel mode's later stages, on kernels without `bpf_loop`: see
/// `probes::kernel`.
#[cfg(feature = "legacy-kernels")]
#[map(name = "KERNEL_STACK_RECORDER")]
pub static KERNEL_STACK_RECORDER: ProgramArray =
    ProgramArray::with_max_entries(memleak_common::KERNEL_STACK_STAGES.len() as u32, 0);

/// An allocation or a mapping to record with the current stack.
#[repr(C)]
pub struct PendingRecord {
    /// `deferred::ALLOCATION`, `deferred::MAPPING` or `deferred::NOTHING`.
    pub kind: u32,
    /// The process whose stack it is.
    pub tgid: u32,
    pub key: AllocationKey,
    pub size: u64,
    pub mapping: MappingEvent,
}

/// A stack and its id, the value of `LAST_STACK`.
#[repr(C)]
pub struct LastStack {
    /// 0 until a stack is remembered (ids start at 0).
    pub known: u64,
    pub id: u64,
    pub key: StackKey,
}

/// Frames a `WalkCache` holds, a power of two past `MAX_STACK_DEPTH`:
/// indices are masked with it.
pub const CACHED_FRAMES: usize = 128;
const _: () = assert!(CACHED_FRAMES >= MAX_STACK_DEPTH && CACHED_FRAMES.is_power_of_two());

/// Words of `WalkCaches::window`: 8 KiB, a power of two. A stack 100
/// frames deep spans about 8 KiB, read at once: each read costs about
/// 40 ns besides the bytes.
pub const STACK_WINDOW_WORDS: usize = 1024;

/// One table walk's frames, innermost first: each one's registers as the
/// walk found them, and where its rbp came from (see `unwind::reuse`).
#[repr(C)]
pub struct WalkCache {
    /// The thread walked.
    pub tid: u32,
    pub tgid: u32,
    /// The generation of the process's table the walk used.
    pub generation: u32,
    /// Frames walked; 0 for none.
    pub depth: u32,
    /// How the walk ended, a `WalkEnd`.
    pub end: u32,
    /// 1 if `stack_id` is the id its stack was stored under.
    pub stack_known: u32,
    pub stack_id: u64,
    /// Each frame's fields side by side: checking a frame then takes one
    /// pointer, where four arrays took four, more than the BPF registers
    /// could hold beside the rest.
    pub frames: [Frame; CACHED_FRAMES],
}

/// A frame's registers, as a walk found them, and where its rbp came from.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Frame {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    /// See `unwind::reuse`: `0..=MAX_CHECKED_SLOT`, `SLOT_UNCHECKED` or
    /// `SLOT_SIGNAL`. A whole word, so that the frame has no padding to
    /// copy.
    pub slot: u64,
}

/// The value of `WALK_CACHES`: the last walk and the one under way, which
/// swap when it ends.
#[repr(C)]
pub struct WalkCaches {
    /// Which of `caches` holds the last walk.
    pub current: u32,
    pub _padding: u32,
    pub progress: ReuseProgress,
    pub caches: [WalkCache; 2],
    /// A copy of a stretch of the stack, to check cached frames against.
    /// Here rather than in a map of its own: the check's loop then looks
    /// up one value, not two.
    pub window: [u64; STACK_WINDOW_WORDS],
}

/// Where the walk under way stands in the last one. In map memory, not on
/// the BPF stack, where the verifier would know each value and check every
/// iteration of the walk once per value (see `unwind::tables::Walk`).
#[repr(C)]
pub struct ReuseProgress {
    /// 1 if the last walk is of the same thread under the same table, and
    /// the walk under way has taken none of its frames yet.
    pub usable: u32,
    /// 1 if the walk matched the last walk at the first frame of both.
    pub from_first: u32,
    /// The next cached frame to compare the walk's frames with.
    pub cursor: u32,
    /// Frames taken from the cache so far.
    pub reused: u32,
    /// While frames are checked: the cached frame to check next, and
    /// where it goes in the walk; and where the checking began.
    pub next: u32,
    pub index: u32,
    pub first_cached: u32,
    pub first_index: u32,
    /// The stack's bytes `low..high` are in `WalkCaches::window`.
    pub low: u64,
    pub high: u64,
}

/// Bytes of one Python frame `PyScratch` holds: more than any
/// `read_size` (0x70 at most), and a power of two, so that masking bounds
/// a read.
pub const PY_FRAME_BYTES: usize = 128;

/// One Python frame's bytes, as words: every field read is aligned in it.
pub type PyFrameWords = [u64; PY_FRAME_BYTES / 8];

/// The value of `PY_SCRATCH`: too big for the 512-byte BPF stack.
#[repr(C)]
pub struct PyScratch {
    /// The words of the frames walked.
    pub words: [u64; MAX_STACK_DEPTH],
    /// The frame being read.
    pub frame: PyFrameWords,
    /// Where the walk stands.
    pub walk: PyWalkState,
}

/// Where a walk of the Python frames stands: in map memory, where the
/// verifier knows no value, so that each step starts from the same state
/// (see `SearchBounds`).
#[repr(C)]
pub struct PyWalkState {
    /// The next frame to read, 0 at the end.
    pub frame: u64,
    /// The words written.
    pub count: u32,
    /// The index of the last word, kept apart from `count`: an index
    /// computed as `count - 1` loses its bounds for the verifier.
    pub last: u32,
}

/// Where a table walk stands (see `unwind::tables`).
#[repr(C)]
pub struct WalkState {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    pub tgid: u32,
    /// 1 when `pc` is the interrupted instruction itself (after a signal
    /// frame), not a return address that points past a call.
    pub exact_pc: u32,
    /// A `WalkEnd`, once the walk ends.
    pub end: u32,
    /// Frames to take at most.
    pub limit: u32,
    /// 1 when the key holds Python frames too.
    pub python_frames: u32,
    /// 1 while the frames taken from the last walk are not copied into
    /// the key yet (see `unwind::tables::take_unchanged`).
    pub copy_pending: u32,
    /// The scratch slot the walk is in (`scratch::Slot`), read from here
    /// by each step: a value the verifier does not follow from step to
    /// step, where the same value handed down the walk's calls tripled
    /// the instructions it checked.
    pub scratch: u32,
    /// 1 for a walk by the unwind tables, 0 for one by frame pointers
    /// alone (no table yet).
    pub by_tables: u32,
    /// 1 once the walk has ended, `end` saying why.
    pub ended: u32,
    pub _padding: u32,
    /// The executable mapping the walk found last, `[start, end)`: a
    /// frame-pointer step landing there is in known code without a search.
    pub code_start: u64,
    pub code_end: u64,
    /// The words just below a CFA, read at once by a CFA step. Here and
    /// not on the BPF stack: the saved rbp is picked among them by an
    /// index known only at run time, which verifiers before 6.x allow in
    /// map memory only. Written by each step before it is read.
    pub below_cfa: core::mem::MaybeUninit<[u64; 8]>,
    /// The binary search under way, of the mappings or of an object's
    /// rows.
    pub search: SearchBounds,
}

/// A binary search's bounds, kept in map memory, where the verifier knows
/// no value: each step then starts from the same state, whichever way
/// the step before went. Followed iteration by iteration (kernels before
/// 5.17, without `bpf_loop`), bounds on the BPF stack had the verifier
/// check every path down the search, 2 to the power of its steps.
#[repr(C)]
pub struct SearchBounds {
    pub low: u32,
    pub high: u32,
    /// The index found, or `u32::MAX`.
    pub found: u32,
    pub _padding: u32,
}

/// The processes the OOM killer picked, by tgid, with when (ns since
/// boot); see `OOM_VICTIMS_MAP`. A kill is rare: 64 outlast any backlog.
#[map]
pub static OOM_VICTIMS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(64, 0);
