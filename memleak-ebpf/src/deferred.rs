//! Work that needs the current user stack, handed to the one program that
//! walks it. Both return probes (malloc & co.'s and mmap's) record with a
//! stack; were the walker in each, the kernel would verify it twice, which
//! was most of memleak's start-up. Instead each leaves what to record in a
//! per-CPU slot and tail-calls `record_with_user_stack`, verified once.
//! BPF programs run without migrating, and the slot is held (see
//! `scratch`) from its filling to the recorder's end.

use aya_ebpf::programs::RetProbeContext;
use memleak_common::{AllocationKey, MappingEvent};

use crate::{
    maps::{PendingRecord, PENDING_RECORD, USER_STACK_RECORDER},
    process_events, record, scratch, stack,
};

/// What the slot asks for.
pub const NOTHING: u32 = 0;
pub const ALLOCATION: u32 = 1;
pub const MAPPING: u32 = 2;

/// Records allocation `key` of `size` bytes with the current user stack.
pub fn store_allocation(ctx: &RetProbeContext, key: AllocationKey, size: u64) {
    hand_over(ctx, |pending| {
        pending.kind = ALLOCATION;
        pending.tgid = key.tgid;
        pending.key = key;
        pending.size = size;
    });
    // Not handed over (every scratch slot held, or the recorder missing):
    // kept, without its stack.
    record::store(key, size, stack::lost_stack(key.tgid));
}

/// Sends mapping `event` with the current user stack.
pub fn send_mapping(ctx: &RetProbeContext, event: MappingEvent) {
    hand_over(ctx, |pending| {
        pending.kind = MAPPING;
        pending.tgid = event.tgid;
        pending.mapping = event;
    });
    process_events::send(MappingEvent { stack_id: stack::lost_stack(event.tgid), ..event });
}

/// Fills this CPU's slot and tail-calls the recorder, which does not come
/// back and releases the scratch; returns only if that could not happen.
fn hand_over(ctx: &RetProbeContext, fill: impl FnOnce(&mut PendingRecord)) {
    let Some(slot) = scratch::hold() else { return };
    if let Some(pending) = PENDING_RECORD.get_ptr_mut(slot.key()) {
        // SAFETY: this CPU's slot, held until the recorder's end.
        fill(unsafe { &mut *pending });
        // SAFETY: the recorder takes the same context: a return probe's.
        unsafe { USER_STACK_RECORDER.tail_call(ctx, 0) };
        // SAFETY: as above.
        unsafe { (*pending).kind = NOTHING };
    }
    scratch::release();
}
