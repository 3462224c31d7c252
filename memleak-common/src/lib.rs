//! The contract between memleak's BPF programs and user space.
//!
//! Everything both sides must agree on lives here and only here: record
//! layouts, map and program names, counter slots and load-time tunables.
//! Records are `#[repr(C)]` with fixed-width fields and no implicit padding,
//! so the BPF object and the loader see the same bytes.
#![no_std]

/// Deepest user stack recorded, in frames. It is also the kernel's default
/// `perf_event_max_stack`, so `bpf_get_stack` never returns more.
pub const MAX_STACK_DEPTH: usize = 127;

/// Return addresses, innermost first. Only the first `depth` count: the
/// rest is whatever the scratch buffer held.
pub type StackFrames = [u64; MAX_STACK_DEPTH];

/// Value of [`STACKS_MAP`]: the whole stack with its process, since equal
/// addresses in two processes need not mean the same code. A stack's id
/// is found through [`STACK_IDS_MAP`] by hash, and every hit is checked
/// against this, so two different stacks never share an id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackKey {
    pub tgid: u32,
    /// Frames in `frames`, at most [`MAX_STACK_DEPTH`].
    pub depth: u32,
    pub frames: StackFrames,
}

impl StackKey {
    /// The recorded return addresses.
    pub fn addresses(&self) -> &[u64] {
        &self.frames[..(self.depth as usize).min(MAX_STACK_DEPTH)]
    }
}

/// Key of [`STACK_IDS_MAP`]: a stack's hash and process. A stack whose
/// slot holds another stack (a 64-bit collision) tries the next slots.
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

/// Key of [`ALLOCATIONS_MAP`]: equal addresses in two traced processes are
/// two allocations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocationKey {
    pub tgid: u32,
    pub _padding: u32,
    pub address: u64,
}

/// Outstanding memory of one stack, the value of [`STACK_TOTALS_MAP`],
/// kept up to date in BPF with atomic adds so that a report need not walk
/// every allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackTotals {
    /// Bytes outstanding (wrapping: a free is added as a negative amount).
    pub bytes: u64,
    /// Allocations outstanding, likewise.
    pub allocations: u64,
    /// Bytes ever allocated from the stack since attach, freed or not
    /// (pprof's alloc_space).
    pub allocated_bytes: u64,
    /// Allocations ever made from the stack since attach (alloc_objects).
    pub allocated_count: u64,
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
        Some(stack_id as u32)
    } else {
        None
    }
}

/// One outstanding allocation, the value of [`ALLOCATIONS_MAP`] keyed by
/// its address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Bytes the caller asked for.
    pub size: u64,
    /// When the allocation returned, in CLOCK_MONOTONIC nanoseconds.
    pub timestamp_ns: u64,
    /// Value of the stack in [`STACKS_MAP`], or a [`lost_stack_id`].
    pub stack_id: u64,
}

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
    /// (posix_memalign).
    AllocateThroughPointer = 2,
}

/// An allocation call between its entry and its return, the value of
/// [`PENDING_MAP`] keyed by thread id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingCall {
    /// Bytes requested, already multiplied out for calloc/reallocarray.
    /// [`OVERFLOWED_SIZE`] when that multiplication overflowed.
    pub size: u64,
    /// The old block for realloc, the out-pointer for posix_memalign.
    pub argument: u64,
    /// A [`CallKind`] as u32.
    pub kind: u32,
    /// How many allocator entry points this thread is inside. Allocators
    /// call each other (glibc's reallocarray calls realloc); only the
    /// outermost call is recorded.
    pub depth: u32,
    /// 1 if sampling (--sample-rate) picked this call for recording.
    pub sampled: u32,
    /// The function called, as a bit set over [`ALLOCATOR_FUNCTIONS`]:
    /// aliases share one probe, so this names them all.
    pub function: u32,
}

/// The allocator functions memleak probes. Bit i of a probe's attach
/// cookie stands for function i, so one BPF program can serve several
/// functions and still say which was called.
pub const ALLOCATOR_FUNCTIONS: [&str; 16] = [
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "free",
    // jemalloc's own API, and the sized frees C++ and Rust allocators call.
    "mallocx",
    "rallocx",
    "dallocx",
    "sdallocx",
    "free_sized",
    "free_aligned_sized",
];

/// One allocation or free, sent through [`EVENTS_MAP`] with --trace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceEvent {
    /// CLOCK_MONOTONIC nanoseconds.
    pub timestamp_ns: u64,
    /// The block returned, or the one freed.
    pub address: u64,
    /// Bytes requested; for a free, the size recorded at allocation or 0
    /// if it was not recorded.
    pub size: u64,
    pub tgid: u32,
    pub tid: u32,
    /// Bit set over [`ALLOCATOR_FUNCTIONS`], as in [`PendingCall`].
    pub function: u32,
    pub _padding: u32,
}

/// What a [`MappingEvent`] reports.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappingChange {
    /// mmap returned `address`, `length` bytes.
    Map = 0,
    /// munmap(`address`, `length`) was called.
    Unmap = 1,
    /// mremap moved or resized `address`, `length` to `new_address`,
    /// `new_length`.
    Remap = 2,
}

/// An mmap, munmap or mremap of a traced process, sent through
/// [`MAPPING_EVENTS_MAP`]. These are rare next to malloc and free, and a
/// partial munmap needs interval bookkeeping that a BPF hash map cannot
/// do, so user space keeps the regions.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingEvent {
    /// CLOCK_MONOTONIC nanoseconds.
    pub timestamp_ns: u64,
    pub address: u64,
    /// Bytes.
    pub length: u64,
    pub new_address: u64,
    /// Bytes.
    pub new_length: u64,
    /// For `Map`: the stack of the mmap call, as in [`Allocation`].
    pub stack_id: u64,
    pub tgid: u32,
    /// A [`MappingChange`] as u32.
    pub change: u32,
    /// 1 if the call came from inside malloc & co.: the allocator's own
    /// arenas and large blocks, already counted as what malloc returned.
    pub inside_allocator: u32,
    pub _padding: u32,
}

/// An mmap or mremap between entry and return, per thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingMapping {
    pub address: u64,
    pub length: u64,
    pub new_length: u64,
    /// A [`MappingChange`] as u32.
    pub change: u32,
    pub _padding: u32,
}

/// The cookie bits of the functions in [`ALLOCATOR_FUNCTIONS`] that free:
/// free, dallocx, sdallocx, free_sized, free_aligned_sized.
pub const FREE_FUNCTIONS: u32 = 1 << 9 | 1 << 12 | 1 << 13 | 1 << 14 | 1 << 15;

/// Size recorded for a calloc/reallocarray whose `n * size` overflows; the
/// call fails, so it is never recorded as an allocation.
pub const OVERFLOWED_SIZE: u64 = u64::MAX;

/// Health counters, slots of the per-CPU [`COUNTERS_MAP`]. Allocations
/// recorded are not among them: the per-stack totals count those already
/// ([`StackTotals::allocated_count`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Releases seen: free-like calls with a non-NULL pointer, and the old
    /// block of each realloc that gave it up (glibc's realloc(p, 0) also
    /// calls free, so it counts twice).
    Frees = 0,
    /// Allocations that returned NULL.
    FailedAllocations = 1,
    /// Allocations not recorded because [`ALLOCATIONS_MAP`] was full.
    AllocationsNotTracked = 2,
    /// Allocations recorded under a [`lost_stack_id`].
    StacksLost = 3,
    /// --trace or mapping events dropped because a ring buffer was full.
    EventsLost = 4,
}

/// Number of slots in [`COUNTERS_MAP`].
pub const COUNTER_SLOTS: u32 = 5;

/// [`AllocationKey`] -> [`Allocation`].
pub const ALLOCATIONS_MAP: &str = "ALLOCATIONS";
/// Stack id (u64) -> [`StackKey`].
pub const STACKS_MAP: &str = "STACKS";
/// [`StackSlot`] -> stack id (u64).
pub const STACK_IDS_MAP: &str = "STACK_IDS";
/// Stack id (u64) -> [`StackTotals`].
pub const STACK_TOTALS_MAP: &str = "STACK_TOTALS";
/// Thread id (u32) -> [`PendingCall`].
pub const PENDING_MAP: &str = "PENDING";
/// Per-CPU u64 array indexed by [`Counter`].
pub const COUNTERS_MAP: &str = "COUNTERS";
/// Ring buffer of [`TraceEvent`]s, written only with --trace.
pub const EVENTS_MAP: &str = "EVENTS";
/// Ring buffer of [`MappingEvent`]s.
pub const MAPPING_EVENTS_MAP: &str = "MAPPING_EVENTS";

/// Load-time tunables: read-only globals in the BPF object, set by the
/// loader (libbpf-tools' `const volatile` pattern).
pub mod tunables {
    /// u64: smallest allocation recorded, in bytes.
    pub const MIN_SIZE: &str = "MIN_SIZE";
    /// u64: largest allocation recorded, in bytes.
    pub const MAX_SIZE: &str = "MAX_SIZE";
    /// u32: frames kept per stack, at most [`super::MAX_STACK_DEPTH`].
    pub const STACK_DEPTH: &str = "STACK_DEPTH";
    /// u32: record about one allocation in this many (1: all).
    pub const SAMPLE_RATE: &str = "SAMPLE_RATE";
    /// u32: 1 to send a [`super::TraceEvent`] per allocation and free.
    pub const TRACE: &str = "TRACE";
    /// u64: with --cgroup, the cgroup v2 id whose tasks are recorded; 0
    /// records every task the probes fire for.
    pub const CGROUP_ID: &str = "CGROUP_ID";
    /// u32: offset of `size` in the kernel's struct kmem_cache.
    pub const CACHE_SIZE_OFFSET: &str = "CACHE_SIZE_OFFSET";
    /// u64, u64: kernel code range whose allocations are left out (the BPF
    /// memory allocator's refill, which serves memleak's own maps).
    pub const IGNORED_CALLER_START: &str = "IGNORED_CALLER_START";
    pub const IGNORED_CALLER_END: &str = "IGNORED_CALLER_END";
}

/// The BPF programs and the allocator functions each one is attached to.
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
    /// Kernel allocations: program name and tracepoint name are the same.
    pub const KERNEL: [&str; 6] =
        ["kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc", "mm_page_free"];
    /// Per-CPU kernel allocations (--percpu).
    pub const KERNEL_PERCPU: [&str; 2] = ["percpu_alloc_percpu", "percpu_free_percpu"];
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: both are repr(C), made only of u64/u32 fields with no padding
    // (checked by the size assertions below), so every bit pattern is valid.
    unsafe impl aya::Pod for super::Allocation {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PendingCall {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::StackKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AllocationKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::StackTotals {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::TraceEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::MappingEvent {}
}

const _: () = assert!(core::mem::size_of::<Allocation>() == 24);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 32);
const _: () = assert!(core::mem::size_of::<StackKey>() == 8 + 8 * MAX_STACK_DEPTH);
const _: () = assert!(core::mem::size_of::<AllocationKey>() == 16);
const _: () = assert!(core::mem::size_of::<StackSlot>() == 16);
const _: () = assert!(core::mem::size_of::<StackTotals>() == 32);
const _: () = assert!(core::mem::size_of::<TraceEvent>() == 40);
const _: () = assert!(core::mem::size_of::<MappingEvent>() == 64);
const _: () = assert!(core::mem::size_of::<PendingMapping>() == 32);
const _: () = assert!(core::mem::size_of::<StackFrames>() == 8 * MAX_STACK_DEPTH);
