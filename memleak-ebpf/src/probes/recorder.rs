//! The programs that walk user stacks: the return probes tail-call the
//! first with what to record in this CPU's slot (see `deferred`), holding
//! this CPU's scratch, which the last releases. Never attached.
//!
//! With `bpf_loop` one program walks the whole stack. Without it (kernels
//! before 5.17), the verifier follows every iteration of a loop, and a
//! whole walk in one program is past its million instructions: the walk
//! goes in stages, each a program that tail-calls the next through
//! `USER_STACK_RECORDER` (`USER_STACK_STAGES`), its state in the scratch
//! slot. `record_with_user_stack` walks the Python frames and starts the
//! native walk, `walk_user_stack` takes `FRAMES_PER_STAGE` frames a run
//! and calls itself again until the walk ends, `store_user_stack`
//! completes the stack and records it if it is the CPU's last, and
//! `insert_user_stack` stores a new one, trying a slot of its hash a run
//! (see `stack::probe_slot`), and records. A stage whose tail call fails
//! records without the stack, counted as lost.

use aya_ebpf::{macros::uretprobe, programs::RetProbeContext};

#[cfg(not(feature = "legacy-kernels"))]
use crate::stack;
use crate::{
    deferred::{ALLOCATION, MAPPING, NOTHING},
    maps::{PendingRecord, PENDING_RECORD},
    process_events, record, scratch,
};

#[uretprobe]
pub fn record_with_user_stack(ctx: RetProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    if let Some(pending) = pending() {
        recorded(&ctx, pending);
    }
    scratch::release();
    0
}

/// The record this CPU's slot holds, filled by the program that
/// tail-called the recorder (or kernel mode's stages: see
/// `probes::kernel`).
pub(crate) fn pending<'a>() -> Option<&'a mut PendingRecord> {
    let pending = PENDING_RECORD.get_ptr_mut(scratch::slot()?.key())?;
    // SAFETY: this CPU's slot, held by this program run (see `scratch`).
    Some(unsafe { &mut *pending })
}

/// Records what `pending` asks for with the current user stack.
#[cfg(not(feature = "legacy-kernels"))]
fn recorded(ctx: &RetProbeContext, pending: &mut PendingRecord) {
    // One walk, before anything branches on the kind: the verifier then
    // checks the walker once.
    let stack_id = stack::current_user_stack_id(ctx, pending.tgid);
    deliver(pending, stack_id);
}

/// Records what `pending` asks for with stack `stack_id`.
fn deliver(pending: &mut PendingRecord, stack_id: u64) {
    match pending.kind {
        ALLOCATION => record::store(pending.key, pending.size, stack_id),
        MAPPING => {
            pending.mapping.stack_id = stack_id;
            process_events::send(pending.mapping);
        }
        _ => {}
    }
    pending.kind = NOTHING;
}

/// The first stage's work, and the later stages.
#[cfg(feature = "legacy-kernels")]
mod staged {
    use aya_ebpf::{macros::uretprobe, programs::RetProbeContext};
    use memleak_common::{STAGE_INSERT, STAGE_STORE, STAGE_WALK};

    use super::{deliver, pending};
    use crate::{
        maps::{PendingRecord, USER_STACK_RECORDER},
        scratch,
        stack::{self, Completed, Probed},
        unwind,
    };

    /// Starts the walk, and hands it to the next stage.
    pub(super) fn recorded(ctx: &RetProbeContext, pending: &mut PendingRecord) {
        let next = match stack::begin_user_stack(ctx, pending.tgid) {
            Some(true) => STAGE_WALK,
            Some(false) => STAGE_STORE,
            None => return deliver(pending, stack::lost_stack(pending.tgid)),
        };
        hand_on(ctx, pending, next);
    }

    /// Tail-calls stage `next`, which does not come back and releases
    /// the scratch; if it could not, records without the stack.
    fn hand_on(ctx: &RetProbeContext, pending: &mut PendingRecord, next: u32) {
        // SAFETY: every stage takes the same context: a return probe's.
        unsafe { USER_STACK_RECORDER.tail_call(ctx, next) };
        deliver(pending, stack::lost_stack(pending.tgid));
    }

    #[uretprobe]
    pub fn walk_user_stack(ctx: RetProbeContext) -> u32 {
        if let Some(pending) = pending() {
            let ended = scratch::slot().is_none_or(unwind::walk_on);
            hand_on(&ctx, pending, if ended { STAGE_STORE } else { STAGE_WALK });
        }
        scratch::release();
        0
    }

    #[uretprobe]
    pub fn store_user_stack(ctx: RetProbeContext) -> u32 {
        if let Some(pending) = pending() {
            match stack::walked_user_stack() {
                Completed::Last(id) => deliver(pending, id),
                Completed::New => hand_on(&ctx, pending, STAGE_INSERT),
                Completed::Lost => deliver(pending, stack::lost_stack(pending.tgid)),
            }
        }
        scratch::release();
        0
    }

    #[uretprobe]
    pub fn insert_user_stack(ctx: RetProbeContext) -> u32 {
        if let Some(pending) = pending() {
            match stack::probe_slot() {
                Probed::Stored(id) => deliver(pending, id),
                Probed::Again => hand_on(&ctx, pending, STAGE_INSERT),
                Probed::Lost => deliver(pending, stack::lost_stack(pending.tgid)),
            }
        }
        scratch::release();
        0
    }
}

#[cfg(feature = "legacy-kernels")]
use staged::recorded;
