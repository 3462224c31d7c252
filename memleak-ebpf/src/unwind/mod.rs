//! Stack walkers: each fills a stack's frames, innermost first, and says
//! how many it found and how the walk ended. Storing the stack is
//! `stack`'s job, so a walker can be added beside these without touching
//! it.

mod frame_pointer;
mod kernel;
mod reuse;
mod tables;

use aya_ebpf::EbpfContext;
use memleak_common::{StackKey, WalkEnd};

use crate::{maps::PROCESS_MAPPINGS, scratch::Slot, tunables};

pub use kernel::kernel_stack;

/// What a walk found.
pub struct Walked {
    /// Frames filled in.
    pub depth: u32,
    /// A `WalkEnd`.
    pub end: u32,
    /// Whether the walk is its CPU's last cached one (see `reuse`), whose
    /// stack id `remember_stack_id` notes.
    pub cached: bool,
    /// Whether it found exactly the frames of the cached walk before it,
    /// whose stack id `last_stack_id` gives. The key's frames are then
    /// not filled in: `copy_last_walk` does it.
    pub unchanged: bool,
}

pub use reuse::{copy_last_walk, last_stack_id, remember_stack_id};

/// The user stack of process `tgid`, from a return probe: through its
/// table of executable mappings when user space gave it one (with unwind
/// rows, or with none under `--unwind fp`: then every step follows the
/// frame pointer, and is kept only if it lands in code), else through
/// frame pointers alone.
/// Leaves the last `reserved` frames of the depth limit to the Python
/// frames walked before. The walk's state is in scratch `slot`.
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
