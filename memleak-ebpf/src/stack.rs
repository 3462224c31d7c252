//! Stack storage that cannot lose or merge stacks silently.
//!
//! A kernel stack-trace map hashes a stack into a bucket: on a collision
//! it either drops the new stack for the rest of the run or overwrites the
//! old one, which misattributes every allocation that pointed at it. Here
//! the whole stack is the key of an ordinary hash map, and its value is an
//! id that no other stack can get. The only way to lose a stack is a full
//! map, and that is counted.

use aya_ebpf::{
    bindings::{BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::generated::{bpf_get_smp_processor_id, bpf_get_stack},
    EbpfContext,
};
use memleak_common::{lost_stack_id, Counter, StackKey};

use crate::{
    counters,
    maps::{STACKS, STACK_ID_COUNTERS, STACK_SCRATCH},
    tunables,
};

/// Returns the id of the current user stack of process `tgid`, storing
/// the stack if it is new, or its process's `lost_stack_id` (counted) if
/// it cannot be stored.
pub fn current_stack_id<C: EbpfContext>(ctx: &C, tgid: u32) -> u64 {
    stack_id(ctx, tgid, BPF_F_USER_STACK as u64)
}

/// Like `current_stack_id`, for the kernel stack (kernel allocations are
/// recorded under tgid 0).
pub fn current_kernel_stack_id<C: EbpfContext>(ctx: &C) -> u64 {
    stack_id(ctx, 0, 0)
}

fn stack_id<C: EbpfContext>(ctx: &C, tgid: u32, flags: u64) -> u64 {
    match store_current_stack(ctx, tgid, flags) {
        Some(id) => id,
        None => {
            counters::increment(Counter::StacksLost);
            lost_stack_id(tgid)
        }
    }
}

fn store_current_stack<C: EbpfContext>(ctx: &C, tgid: u32, flags: u64) -> Option<u64> {
    let key: *mut StackKey = STACK_SCRATCH.get_ptr_mut(0)?;
    let size = tunables::stack_depth() * 8;
    // SAFETY: `key` points at this CPU's scratch slot, whose frames hold
    // at least `size` bytes. The kernel zeroes what it does not fill up to
    // `size`, and nothing ever writes past `size`, so the tail stays zero
    // and equal stacks give equal keys.
    let copied = unsafe {
        (*key).tgid = tgid;
        bpf_get_stack(ctx.as_ptr(), (&raw mut (*key).frames).cast(), size, flags)
    };
    if copied < 0 {
        return None;
    }
    // SAFETY: as above; the map copies the key before returning.
    let key: &StackKey = unsafe { &*key };
    if let Some(id) = STACKS.get_ptr(key) {
        // SAFETY: the value of a live entry; stack ids are never rewritten.
        return Some(unsafe { *id });
    }
    let id = new_stack_id()?;
    match STACKS.insert(key, id, BPF_NOEXIST as u64) {
        Ok(()) => Some(id),
        // Another CPU stored the same stack first: use its id.
        // SAFETY: as above.
        Err(_) => STACKS.get_ptr(key).map(|id| unsafe { *id }),
    }
}

/// A fresh id, unique across CPUs without atomics: the CPU number in the
/// low 16 bits, that CPU's own running count above them.
fn new_stack_id() -> Option<u64> {
    let count = STACK_ID_COUNTERS.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot; BPF programs do not migrate mid-run.
    let local = unsafe {
        let local = *count;
        *count = local + 1;
        local
    };
    // SAFETY: a helper without arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() } as u64;
    Some((local << 16) | (cpu & 0xffff))
}
