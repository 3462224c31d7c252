//! The records the BPF maps hold: stacks, allocations, per-stack totals
//! and calls in flight.

/// Deepest user stack recorded, in frames. It is also the kernel's default
/// `perf_event_max_stack`, so `bpf_get_stack` never returns more.
pub const MAX_STACK_DEPTH: usize = 127;

/// Return addresses, innermost first. Only the first `depth` count: the
/// rest is whatever the scratch buffer held.
pub type StackFrames = [u64; MAX_STACK_DEPTH];

/// Value of [`STACKS_MAP`](crate::STACKS_MAP): the whole stack with its
/// process, since equal addresses in two processes need not mean the same
/// code. A stack's id is found through [`STACK_IDS_MAP`](crate::STACK_IDS_MAP)
/// by hash, and every hit is checked against this, so two different
/// stacks never share an id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackKey {
    pub tgid: u32,
    /// Frames in `frames`, at most [`MAX_STACK_DEPTH`].
    pub depth: u32,
    /// How the walk ended, a [`WalkEnd`](crate::WalkEnd) as u32. Not part
    /// of the stack's identity: one call path walks the same way.
    pub end: u32,
    /// Python frames after the native ones in `frames`, each a word of
    /// [`py_frame_word`](crate::python::py_frame_word); part of the
    /// stack's identity, so each Python line has its own stack. As many
    /// checks of their code objects follow them in `frames`, taken when
    /// the stack was first stored, and not part of its identity.
    pub python_depth: u32,
    pub frames: StackFrames,
}

impl StackKey {
    /// The recorded return addresses.
    pub fn addresses(&self) -> &[u64] {
        &self.frames[..(self.depth as usize).min(MAX_STACK_DEPTH)]
    }

    /// The Python frames' words, innermost first.
    pub fn python_words(&self) -> &[u64] {
        let start = (self.depth as usize).min(MAX_STACK_DEPTH);
        let end = start.saturating_add(self.python_depth as usize).min(MAX_STACK_DEPTH);
        &self.frames[start..end]
    }

    /// The checks of the Python frames' code objects
    /// ([`py_code_check`](crate::python::py_code_check)), one per word,
    /// stored after the words; 0 where none was taken.
    pub fn python_checks(&self) -> &[u64] {
        let start = (self.depth as usize).saturating_add(self.python_depth as usize).min(MAX_STACK_DEPTH);
        let end = start.saturating_add(self.python_depth as usize).min(MAX_STACK_DEPTH);
        &self.frames[start..end]
    }
}

/// Key of [`STACK_IDS_MAP`](crate::STACK_IDS_MAP): a stack's hash and
/// process. A stack whose slot holds another stack (a 64-bit collision)
/// tries the next slots.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackSlot {
    pub tgid: u32,
    pub _padding: u32,
    pub hash: u64,
}

/// The tgid under which kernel allocations are recorded (no process has
/// it: it is the idle task's).
pub const KERNEL_TGID: u32 = 0;

/// Key of [`ALLOCATIONS_MAP`](crate::ALLOCATIONS_MAP): equal addresses in
/// two traced processes are two allocations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocationKey {
    pub tgid: u32,
    pub _padding: u32,
    pub address: u64,
}

/// Outstanding memory of one stack, the value of
/// [`STACK_TOTALS_MAP`](crate::STACK_TOTALS_MAP), kept up to date in BPF
/// with atomic adds so that a report need not walk every allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackTotals {
    /// Bytes outstanding (wrapping: a free is added as a negative amount).
    pub bytes: u64,
    /// Allocations outstanding, likewise.
    pub allocations: u64,
    /// Bytes ever allocated from the stack since attach, freed or not
    /// (pprof's `alloc_space`).
    pub allocated_bytes: u64,
    /// Allocations ever made from the stack since attach (`alloc_objects`).
    pub allocated_count: u64,
    /// Of `bytes`, those in blocks that took the place of a block memleak
    /// never saw allocated ([`Allocation::replaced`]): a cache refilling
    /// after the attach, not growth.
    pub replacing_bytes: u64,
    /// Of `allocations`, those that did.
    pub replacing_allocations: u64,
    /// Bytes from before the attach that replacing blocks of this stack
    /// stood in for when they were released, not stood in for again yet:
    /// the stack's next blocks take them over (a cache entry replaced a
    /// second time), whatever addresses the allocator gives them. Wrapping:
    /// threads taking at once may take it below zero, which counts as none.
    pub replacement_owed: u64,
}

/// Stack id recorded when a stack of process `tgid` could not be stored
/// (the stack map was full or the unwinder failed). Allocations keep their
/// bytes under it and [`Counter::StacksLost`] counts them, so nothing is
/// dropped silently. Ordinary ids never reach the top 32 bits being all
/// ones (that would take 2^48 stacks).
pub const fn lost_stack_id(tgid: u32) -> u64 {
    (0xffff_ffff << 32) | tgid as u64
}

/// The process of a [`lost_stack_id`], or `None` for an ordinary id.
pub const fn lost_stack_owner(stack_id: u64) -> Option<u32> {
    if stack_id >> 32 == 0xffff_ffff {
        #[allow(clippy::cast_possible_truncation, reason = "the low 32 bits are the tgid")]
        Some(stack_id as u32)
    } else {
        None
    }
}

/// One outstanding allocation, the value of
/// [`ALLOCATIONS_MAP`](crate::ALLOCATIONS_MAP) keyed by its address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Bytes the caller asked for.
    pub size: u64,
    /// When the allocation returned, in `CLOCK_MONOTONIC` nanoseconds.
    pub timestamp_ns: u64,
    /// Value of the stack in [`STACKS_MAP`](crate::STACKS_MAP), or a
    /// [`lost_stack_id`].
    pub stack_id: u64,
    /// Bytes of a block from before the attach that this one took the
    /// place of: the allocator handed out the address of a block whose
    /// release memleak saw and whose allocation it never did, soon after
    /// that release (see [`REPLACEABLE_MAP`](crate::REPLACEABLE_MAP)), or
    /// its stack owed some ([`StackTotals::replacement_owed`]). At most
    /// `size`; 0 for a block that is new memory.
    pub replaced: u64,
}

/// How long after a release a block at the same address still counts as
/// its replacement. Allocators hand a freed block of the same size class
/// back within microseconds (glibc's, jemalloc's and tcmalloc's per-thread
/// caches are last in, first out); an address taken long after is more
/// likely another stack's new memory.
pub const REPLACEMENT_WINDOW_NS: u64 = 10_000_000_000;

/// What an allocation call does with its result; see [`PendingCall`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// Returns a new block (malloc, calloc, memalign, valloc, ...).
    Allocate = 0,
    /// Returns a new block and releases `PendingCall::argument` (realloc,
    /// reallocarray).
    Reallocate = 1,
    /// Returns 0 and stores the block through `PendingCall::argument`
    /// (`posix_memalign`).
    AllocateThroughPointer = 2,
}

impl TryFrom<u32> for CallKind {
    type Error = u32;

    fn try_from(raw: u32) -> Result<Self, u32> {
        match raw {
            0 => Ok(CallKind::Allocate),
            1 => Ok(CallKind::Reallocate),
            2 => Ok(CallKind::AllocateThroughPointer),
            _ => Err(raw),
        }
    }
}

/// An allocation call between its entry and its return, the value of
/// [`PENDING_MAP`](crate::PENDING_MAP) keyed by thread id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingCall {
    /// Bytes requested, already multiplied out for calloc/reallocarray.
    /// [`OVERFLOWED_SIZE`] when that multiplication overflowed.
    pub size: u64,
    /// The old block for realloc, the out-pointer for `posix_memalign`.
    pub argument: u64,
    /// A [`CallKind`] as u32.
    pub kind: u32,
    /// How many allocator entry points this thread is inside. Allocators
    /// call each other (glibc's reallocarray calls realloc); only the
    /// outermost call is recorded.
    pub depth: u32,
    /// 1 if sampling (--sample-rate) picked this call for recording.
    pub sampled: u32,
    /// The function called, a [`FunctionSet`](crate::FunctionSet): aliases
    /// share one probe, so this names them all.
    pub function: u32,
    /// The thread's process, so that user space can delete the entries of
    /// a process that has exited.
    pub tgid: u32,
    pub _padding: u32,
    /// The block this thread's latest `operator delete` released, until the
    /// thread's next call into the allocator; 0 for none. A delete that
    /// calls a probed `free` (or `sdallocx`) with the same block has
    /// counted the release already: that inner release is not counted
    /// again. Releases have no return probe, so this is cleared by the
    /// thread's next allocator call rather than by the delete's return.
    pub releasing: u64,
    /// Where the outermost call returns to, read at its entry when the
    /// allocator may map memory for it (0 otherwise): its return probe
    /// puts the uretprobe trampoline in that slot of the stack, and a walk
    /// from inside the call (an mmap the allocator makes for itself) takes
    /// this address instead of the trampoline's.
    pub return_address: u64,
}

/// The page the kernel maps for uprobes in every traced process (x86-64,
/// 4-level page tables: the page below `TASK_SIZE`), whose first bytes are
/// the uretprobe trampoline: what a return address hijacked by a return
/// probe reads as.
pub const UPROBES_PAGE: u64 = 0x7fff_ffff_e000;

/// Value of [`ALLOCATOR_CODE_MAP`](crate::ALLOCATOR_CODE_MAP): where the
/// probed allocator's code lies in a process. A free called from there
/// releases a block the allocator made for itself with no call memleak
/// sees (glibc's per-thread cache, freed as each thread exits): it is no
/// block the program allocated before memleak attached, and is not
/// counted as [`Counter::UnrecordedFrees`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorCode {
    /// First address of its executable mapping.
    pub start: u64,
    /// One past its last.
    pub end: u64,
}

/// Size recorded for a calloc/reallocarray whose `n * size` overflows; the
/// call fails, so it is never recorded as an allocation.
pub const OVERFLOWED_SIZE: u64 = u64::MAX;

/// An mmap or mremap between entry and return, per thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingMapping {
    pub address: u64,
    pub length: u64,
    pub new_length: u64,
    /// A [`MappingChange`](crate::MappingChange) as u32.
    pub change: u32,
    /// mmap's `prot` and `flags` arguments.
    pub prot: u32,
    pub flags: u32,
    pub _padding: u32,
}

/// Health counters, slots of each process's
/// [`ProcessCounters`] in [`PROCESS_COUNTERS_MAP`](crate::PROCESS_COUNTERS_MAP).
/// Allocations recorded are not among them: the per-stack totals count
/// those already ([`StackTotals::allocated_count`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Releases seen: free-like calls with a non-NULL pointer, and the old
    /// block of each realloc that gave it up. A release made inside
    /// another one of the same block (an `operator delete` that calls
    /// `free`, glibc's realloc(p, 0) calling free) counts once.
    Frees = 0,
    /// Allocations that returned NULL.
    FailedAllocations = 1,
    /// Allocations not recorded because
    /// [`ALLOCATIONS_MAP`](crate::ALLOCATIONS_MAP) was full.
    AllocationsNotTracked = 2,
    /// Allocations recorded under a [`lost_stack_id`].
    StacksLost = 3,
    /// --trace or mapping events dropped because a ring buffer was full.
    EventsLost = 4,
    /// Allocation calls that returned a block, whether or not they were
    /// sampled or in the size range recorded.
    Allocations = 5,
    /// Those of the [`Counter::Frees`] whose block memleak had not
    /// recorded: allocated before it attached, by a function it does not
    /// probe, or left out by sampling, the size range or a full
    /// [`ALLOCATIONS_MAP`](crate::ALLOCATIONS_MAP). Their sizes are not
    /// known.
    UnrecordedFrees = 6,
}

impl Counter {
    /// Every counter, in slot order.
    pub const ALL: [Counter; 7] = [
        Counter::Frees,
        Counter::FailedAllocations,
        Counter::AllocationsNotTracked,
        Counter::StacksLost,
        Counter::EventsLost,
        Counter::Allocations,
        Counter::UnrecordedFrees,
    ];
}

impl TryFrom<u32> for Counter {
    type Error = u32;

    fn try_from(raw: u32) -> Result<Self, u32> {
        Counter::ALL.get(raw as usize).copied().ok_or(raw)
    }
}

/// Number of [`Counter`]s.
#[allow(clippy::cast_possible_truncation, reason = "seven counters")]
pub const COUNTER_SLOTS: u32 = Counter::ALL.len() as u32;

/// One process's health counters, indexed by [`Counter`]: each process
/// has its own, so that a report on one of several processes counts only
/// what that one did.
pub type ProcessCounters = [u64; COUNTER_SLOTS as usize];
