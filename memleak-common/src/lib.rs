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

/// A user stack as `bpf_get_stack` wrote it: return addresses, innermost
/// first, the unused tail zeroed. The whole array is the key of
/// [`STACKS_MAP`], so two different stacks can never share an id.
pub type StackFrames = [u64; MAX_STACK_DEPTH];

/// Stack id recorded when a stack could not be stored (the stack map was
/// full or the unwinder failed). Allocations keep their bytes under it and
/// [`Counter::StacksLost`] counts them, so nothing is dropped silently.
pub const LOST_STACK_ID: u64 = u64::MAX;

/// One outstanding allocation, the value of [`ALLOCATIONS_MAP`] keyed by
/// its address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Bytes the caller asked for.
    pub size: u64,
    /// When the allocation returned, in CLOCK_MONOTONIC nanoseconds.
    pub timestamp_ns: u64,
    /// Value of the stack in [`STACKS_MAP`], or [`LOST_STACK_ID`].
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
}

/// Size recorded for a calloc/reallocarray whose `n * size` overflows; the
/// call fails, so it is never recorded as an allocation.
pub const OVERFLOWED_SIZE: u64 = u64::MAX;

/// Health counters, slots of the per-CPU [`COUNTERS_MAP`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Allocation calls that returned a block and passed the size filters.
    Allocations = 0,
    /// free() calls with a non-NULL pointer.
    Frees = 1,
    /// Allocations that returned NULL.
    FailedAllocations = 2,
    /// Allocations not recorded because [`ALLOCATIONS_MAP`] was full.
    AllocationsNotTracked = 3,
    /// Allocations recorded under [`LOST_STACK_ID`].
    StacksLost = 4,
}

/// Number of slots in [`COUNTERS_MAP`].
pub const COUNTER_SLOTS: u32 = 5;

impl Counter {
    pub const ALL: [Counter; COUNTER_SLOTS as usize] = [
        Counter::Allocations,
        Counter::Frees,
        Counter::FailedAllocations,
        Counter::AllocationsNotTracked,
        Counter::StacksLost,
    ];
}

/// Address -> [`Allocation`].
pub const ALLOCATIONS_MAP: &str = "ALLOCATIONS";
/// [`StackFrames`] -> stack id (u64).
pub const STACKS_MAP: &str = "STACKS";
/// Thread id (u32) -> [`PendingCall`].
pub const PENDING_MAP: &str = "PENDING";
/// Per-CPU u64 array indexed by [`Counter`].
pub const COUNTERS_MAP: &str = "COUNTERS";

/// Load-time tunables: read-only globals in the BPF object, set by the
/// loader (libbpf-tools' `const volatile` pattern).
pub mod tunables {
    /// u64: smallest allocation recorded, in bytes.
    pub const MIN_SIZE: &str = "MIN_SIZE";
    /// u64: largest allocation recorded, in bytes.
    pub const MAX_SIZE: &str = "MAX_SIZE";
    /// u32: frames kept per stack, at most [`super::MAX_STACK_DEPTH`].
    pub const STACK_DEPTH: &str = "STACK_DEPTH";
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
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: both are repr(C), made only of u64/u32 fields with no padding
    // (checked by the size assertions below), so every bit pattern is valid.
    unsafe impl aya::Pod for super::Allocation {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PendingCall {}
}

const _: () = assert!(core::mem::size_of::<Allocation>() == 24);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 24);
const _: () = assert!(core::mem::size_of::<StackFrames>() == 8 * MAX_STACK_DEPTH);
