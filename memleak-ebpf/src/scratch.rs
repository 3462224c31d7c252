//! Each CPU's scratch memory, in slots that one program run holds at a
//! time.
//!
//! The walk keeps its state in per-CPU maps: the stack being built, the
//! walk's registers, its caches, the record handed to the walker. That
//! assumed nothing else runs on the CPU until the walk is done, and
//! uprobe programs break it: since Linux 6.0 they run with only migration
//! disabled, and a kernel that preempts (`full`, or `lazy`, the only modes
//! Linux 7 offers on x86) switches to other threads mid-walk, on the same
//! CPU, whose allocations run the same programs. Two walks over one CPU's
//! memory mix their stacks.
//!
//! So a run holds a slot of its CPU's scratch from the hand-over to the
//! walker's end, marked with its thread, and every per-CPU scratch map
//! has one entry per slot (`Slot`). A run that finds every slot held
//! (`SCRATCH_SLOTS` threads preempted mid-walk on one CPU) records under
//! its process's lost stack, counted. Kernel mode's programs cannot be
//! preempted, only interrupted, by an allocation on the same thread: a
//! run whose thread already holds a slot is such an interruption, and
//! is left out (see `probes::kernel`).
//!
//! The walks' own stack frames are safe only on the task's kernel stack:
//! see `own_stack`.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, EbpfContext};
use memleak_common::WalkCount;

use crate::{
    checked::opaque,
    maps::{SCRATCH_HOLDERS, SCRATCH_SLOTS, WALK_COUNTS},
    totals::atomic_add,
};

/// Takes a slot of this CPU's scratch for the current thread: `None`,
/// counted, if all are held or the thread holds one already. Whoever gets
/// a slot must `release` on every path.
pub fn hold() -> Option<Slot> {
    let holders = SCRATCH_HOLDERS.get_ptr_mut(0)?;
    let marker = marker();
    // SAFETY: this CPU's holders, 8-byte aligned map memory; each word is
    // changed only by compare and exchange, or by its holder.
    let holders = unsafe { &mut *holders };
    if holders.contains(&marker) {
        count_busy();
        return None;
    }
    for (index, holder) in holders.iter_mut().enumerate() {
        // SAFETY: as above. Compare and exchange, so that a run preempted
        // between the test and the store cannot share a slot with the run
        // that preempted it.
        if unsafe { compare_exchange(holder, 0, marker) } == 0 {
            return Some(Slot(index as u32));
        }
    }
    count_busy();
    None
}

/// A slot of this CPU's scratch: the key of its entry in every per-CPU
/// scratch map.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Slot(u32);

impl Slot {
    /// The key of the slot's entries.
    pub fn key(self) -> u32 {
        self.0
    }

    /// The slot whose key a walk kept in map memory.
    pub fn from_key(key: u32) -> Self {
        Self(key & (SCRATCH_SLOTS as u32 - 1))
    }
}

/// The slot the current thread holds (see `hold`). Found without a
/// branch: the verifier then follows the walk once for a slot it does not
/// know, where a search gave it one walk to follow for each slot it could
/// end at (past a million instructions). Found afresh where needed rather
/// than handed down: a slot kept live across the walk more than doubled
/// the instructions the verifier checks, and the walk's steps read it
/// from their state in map memory (`WalkState::scratch`). `None` only if
/// the map is missing.
pub fn slot() -> Option<Slot> {
    let marker = marker();
    let holders = SCRATCH_HOLDERS.get(0)?;
    let mut slot = 0;
    for (index, &holder) in holders.iter().enumerate() {
        // 1 where the holder is the marker, else 0: the top bit of
        // `x | -x` is set for every x but 0. Hidden from the compiler,
        // which would turn it back into a comparison, and so a branch.
        let differs = opaque(holder ^ marker);
        let held = 1 - opaque((differs | differs.wrapping_neg()) >> 63);
        slot += held * index as u64;
    }
    Some(Slot(slot as u32 & (SCRATCH_SLOTS as u32 - 1)))
}

/// Gives back the slot `hold` took.
pub fn release() {
    let marker = marker();
    let Some(holders) = SCRATCH_HOLDERS.get_ptr_mut(0) else { return };
    // SAFETY: as in `hold`; only the holder clears its own slot.
    for holder in unsafe { &mut *holders }.iter_mut() {
        if *holder == marker {
            // SAFETY: this CPU's word, which only its holder writes now.
            unsafe { core::ptr::write_volatile(holder, 0) };
        }
    }
}

/// Keeps the program on its task's kernel stack. From 6.13 the kernel
/// gives a uprobe or tracepoint program with a large frame a per-CPU
/// private stack instead, assuming that one run per CPU at a time: a run
/// preempted there shares it with the next run of the same program on
/// the CPU, and finds that run's values in its frames when it resumes.
/// (Debian's 7.3 oopsed within seconds, tracing two threads on one CPU.)
/// The kernel gives none to a program that can make a tail call: this is
/// one, to a slot that is always empty, which falls through at once.
/// Not on kernels before 5.17 (the object built for them): they have no
/// private stacks, and count a tail call to an empty slot against their
/// 33, which the staged walk needs (see `probes::recorder`).
pub fn own_stack<C: EbpfContext>(ctx: &C) {
    #[cfg(not(feature = "legacy-kernels"))]
    // SAFETY: `NO_PROGRAMS` holds no program: the call returns.
    unsafe {
        crate::maps::NO_PROGRAMS.tail_call(ctx, 0);
    };
    #[cfg(feature = "legacy-kernels")]
    let _ = ctx;
}

/// The current thread, never 0 (a free slot): its pid and tgid, with the
/// top bit set.
fn marker() -> u64 {
    bpf_get_current_pid_tgid() | 1 << 63
}

fn count_busy() {
    if let Some(counts) = WALK_COUNTS.get_ptr_mut(0) {
        // SAFETY: this CPU's counts, which holders add to as well:
        // atomically.
        unsafe { atomic_add(&raw mut (*counts)[WalkCount::CpuBusy as usize], 1) };
    }
}

/// `*target`, replaced by `new` if it was `expected` (`BPF_ATOMIC` |
/// `BPF_CMPXCHG`, Linux 5.12).
///
/// # Safety
/// `target` must be valid for writes and 8-byte aligned.
#[cfg(all(target_arch = "bpf", not(feature = "legacy-kernels")))]
unsafe fn compare_exchange(target: *mut u64, expected: u64, new: u64) -> u64 {
    let was: u64;
    // SAFETY: guaranteed by the caller; the instruction compares with r0
    // and leaves the old value there.
    unsafe {
        core::arch::asm!(
            "r0 = cmpxchg_64({target} + 0, r0, {new})",
            target = in(reg) target,
            new = in(reg) new,
            inout("r0") expected => was,
        );
    }
    was
}

/// The same for kernels before 5.12, which lack the instruction: a load
/// and a store. They run tracing programs with preemption disabled (the
/// kernel switched to disabling only migration in 6.0), so no other run
/// on this CPU can come between the two.
#[cfg(all(target_arch = "bpf", feature = "legacy-kernels"))]
unsafe fn compare_exchange(target: *mut u64, expected: u64, new: u64) -> u64 {
    // SAFETY: guaranteed by the caller.
    let was = unsafe { core::ptr::read_volatile(target) };
    if was == expected {
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(target, new) };
    }
    was
}

/// The same for a host build (clippy's), which has no r0.
#[cfg(not(target_arch = "bpf"))]
unsafe fn compare_exchange(target: *mut u64, expected: u64, new: u64) -> u64 {
    use core::sync::atomic::{AtomicU64, Ordering};
    // SAFETY: guaranteed by the caller.
    let target = unsafe { AtomicU64::from_ptr(target) };
    target.compare_exchange(expected, new, Ordering::SeqCst, Ordering::SeqCst).unwrap_or_else(|was| was)
}
