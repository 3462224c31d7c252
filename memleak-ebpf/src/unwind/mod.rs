//! Stack walkers: each fills a stack's frames, innermost first, and says
//! how many it found and how the walk ended. Storing the stack is
//! `stack`'s job, so a walker can be added beside these without touching
//! it.

mod frame_pointer;
mod kernel;
mod reuse;
mod tables;

#[cfg(not(feature = "legacy-kernels"))]
use aya_ebpf::EbpfContext;
#[cfg(not(feature = "legacy-kernels"))]
use memleak_common::{StackKey, WalkEnd};

#[cfg(not(feature = "legacy-kernels"))]
use crate::{maps::PROCESS_MAPPINGS, scratch::Slot, tunables};

pub use kernel::kernel_stack;

/// A return address read off the stack, as a code address. arm64 code
/// built with `-mbranch-protection` signs the return addresses it saves
/// (pointer authentication), in the bits above the 48 that user addresses
/// take.
#[expect(clippy::inline_always, reason = "one mask, or none")]
#[inline(always)]
fn code_address(saved: u64) -> u64 {
    if cfg!(bpf_target_arch = "aarch64") {
        saved & ((1 << 48) - 1)
    } else {
        saved
    }
}

/// What a walk found.
pub struct Walked {
    /// Frames filled in.
    pub depth: u32,
    /// A `WalkEnd`.
    pub end: u32,
    /// Whether the walk is its CPU's last cached one (see `reuse`), whose
    /// stack id `remember_stack_id` notes. Never, in the object for
    /// kernels before 5.17, which reuses no walk.
    #[cfg_attr(feature = "legacy-kernels", expect(dead_code, reason = "no stack reuse before 5.17"))]
    pub cached: bool,
    /// Whether it found exactly the frames of the cached walk before it,
    /// whose stack id `last_stack_id` gives. The key's frames are then
    /// not filled in: `copy_last_walk` does it. Never before 5.17.
    #[cfg_attr(feature = "legacy-kernels", expect(dead_code, reason = "no stack reuse before 5.17"))]
    pub unchanged: bool,
}

#[cfg(not(feature = "legacy-kernels"))]
pub use reuse::{copy_last_walk, last_stack_id, remember_stack_id};

/// The user stack of process `tgid`, from a return probe: through its
/// table of executable mappings when user space gave it one (with unwind
/// rows, or with none under `--unwind fp`: then every step follows the
/// frame pointer, and is kept only if it lands in code), else through
/// frame pointers alone.
/// Leaves the last `reserved` frames of the depth limit to the Python
/// frames walked before. The walk's state is in scratch `slot`.
#[cfg(not(feature = "legacy-kernels"))]
pub fn user_stack<C: EbpfContext>(
    ctx: &C,
    tgid: u32,
    key: &mut StackKey,
    reserved: u32,
    slot: Slot,
) -> Walked {
    let limit = tunables::stack_depth().saturating_sub(reserved).max(1);
    if let Some(mappings) = PROCESS_MAPPINGS.get_ptr(tgid) {
        return tables::walk(ctx, tgid, mappings, key, limit, reserved != 0, slot);
    }
    // No table yet: the process has just been found, or just started.
    let depth = frame_pointer::walk_user_stack(ctx, &mut key.frames, limit);
    Walked { depth, end: WalkEnd::FramePointers as u32, cached: false, unchanged: false }
}

/// Kernels without `bpf_loop` walk in stages, one program run each (see
/// `probes::recorder`): `begin_user_stack`, then `walk_on` until it says
/// the walk has ended, then `end_user_stack`. The walk's state is in
/// scratch `slot` between them.
#[cfg(feature = "legacy-kernels")]
mod staged {
    use aya_ebpf::EbpfContext;
    use memleak_common::{StackKey, WalkEnd};

    use super::{frame_pointer, tables, Walked};
    use crate::{
        maps::{WalkState, PROCESS_MAPPINGS, STACK_SCRATCH, WALK_STATE},
        scratch::Slot,
        tunables,
    };

    /// Frames a stage takes: a program run's share, as many as the
    /// verifier follows in a reasonable time, and enough that a walk of
    /// `MAX_STACK_DEPTH` frames fits the kernel's 33 tail calls.
    const FRAMES_PER_STAGE: u32 = 8;

    /// Starts the walk of the user stack (see `user_stack`): whether a
    /// table walk goes on in `walk_on`. A process without a table yet is
    /// walked by frame pointers at once, whole.
    pub fn begin_user_stack<C: EbpfContext>(
        ctx: &C,
        tgid: u32,
        key: &mut StackKey,
        reserved: u32,
        slot: Slot,
    ) -> bool {
        let limit = tunables::stack_depth().saturating_sub(reserved).max(1);
        if let Some(mappings) = PROCESS_MAPPINGS.get_ptr(tgid) {
            return tables::begin(ctx, tgid, mappings, key, limit, reserved != 0, slot).is_some();
        }
        let depth = frame_pointer::walk_user_stack(ctx, &mut key.frames, limit);
        // SAFETY: a field of the slot's key (see `tables::depth`).
        unsafe { core::ptr::write_volatile(&raw mut key.depth, depth) };
        if let Some(state) = WALK_STATE.get_ptr_mut(slot.key()) {
            // SAFETY: the slot's state, which only this program run touches.
            unsafe {
                (*state).by_tables = 0;
                (*state).end = WalkEnd::FramePointers as u32;
            }
        }
        false
    }

    /// Takes the next frames of a table walk: whether it has ended.
    pub fn walk_on(slot: Slot) -> bool {
        tables::walk_on::<FRAMES_PER_STAGE>(slot)
    }

    /// What the walk in scratch `slot` found.
    pub fn end_user_stack(slot: Slot) -> Option<Walked> {
        let key = STACK_SCRATCH.get_ptr_mut(slot.key())?;
        let state: *mut WalkState = WALK_STATE.get_ptr_mut(slot.key())?;
        // SAFETY: the slot's state, which only this program run touches.
        if unsafe { (*state).by_tables } != 0 {
            return Some(tables::finish(key, state));
        }
        // SAFETY: as above, and the slot's key.
        let (depth, end) = unsafe { (core::ptr::read_volatile(&raw const (*key).depth), (*state).end) };
        Some(Walked { depth, end, cached: false, unchanged: false })
    }
}

#[cfg(feature = "legacy-kernels")]
pub use staged::{begin_user_stack, end_user_stack, walk_on};
