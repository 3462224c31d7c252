//! What the entry probe of free and the other functions that give memory
//! back does (the programs are `alloc`'s).

use aya_ebpf::programs::ProbeContext;

use crate::{
    calls::{self, Release},
    events,
    maps::ALLOCATOR_CODE,
    record, tunables,
};

/// free(ptr), sdallocx(ptr, size, flags), operator delete(ptr, ...) and
/// the like, `function` (a `FunctionSet`): forgets the allocation at
/// `ptr`, counting the release once when one of them calls another.
/// --trace shows every call, the inner one too.
pub fn released(ctx: &ProbeContext, function: u32) {
    let address: u64 = ctx.arg(0).unwrap_or(0);
    if address == 0 || !tunables::in_scope() {
        return;
    }
    let tgid = calls::process_id();
    let size = match calls::begin_release(address, function) {
        Release::Outer => record::release(tgid, address, || called_from_allocator(ctx, tgid)),
        Release::InsideDelete => record::release_if_recorded(tgid, address),
        // Released at realloc's return: traced now, with its size.
        Release::InsideRealloc if tunables::trace() => record::recorded_size(tgid, address),
        Release::InsideRealloc => return,
    };
    events::send(function, address, size.unwrap_or(0));
}

/// Whether the allocator itself made this call: its return address (the
/// probe comes before anything the function pushes: see memleak's
/// `attach::placement`) lies in the allocator's code. Asked only of a
/// release of a block memleak had not recorded.
fn called_from_allocator(ctx: &ProbeContext, tgid: u32) -> bool {
    // SAFETY: a lookup in a map of plain values.
    let Some(code) = (unsafe { ALLOCATOR_CODE.get(tgid) }) else { return false };
    let caller = crate::registers::Registers::of(ctx).return_address_at_entry();
    (code.start..code.end).contains(&caller)
}
