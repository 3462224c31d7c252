//! The one program that walks user stacks: the return probes tail-call it
//! with what to record in this CPU's slot (see `deferred`), holding this
//! CPU's scratch, which it releases. Never attached.

use aya_ebpf::{macros::uretprobe, programs::RetProbeContext};

use crate::{
    deferred::{ALLOCATION, MAPPING, NOTHING},
    maps::PENDING_RECORD,
    process_events, record, scratch, stack,
};

#[uretprobe]
pub fn record_with_user_stack(ctx: RetProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    record(&ctx);
    scratch::release();
    0
}

fn record(ctx: &RetProbeContext) {
    let Some(pending) = scratch::slot().and_then(|slot| PENDING_RECORD.get_ptr_mut(slot.key())) else {
        return;
    };
    // SAFETY: this CPU's slot, filled by the program that tail-called us.
    let pending = unsafe { &mut *pending };
    // One walk, before anything branches on the kind: the verifier then
    // checks the walker once.
    let stack_id = stack::current_user_stack_id(ctx, pending.tgid);
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
