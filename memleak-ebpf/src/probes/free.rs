//! The entry probe of free and the other functions that give memory back.

use aya_ebpf::{
    helpers::generated::bpf_get_attach_cookie, macros::uprobe, programs::ProbeContext, EbpfContext as _,
};

use crate::{
    calls::{self, Release},
    events, record, tunables,
};

/// free(ptr), sdallocx(ptr, size, flags), operator delete(ptr, ...) and
/// the like: forgets the allocation at `ptr`, counting the release once
/// when one of them calls another. --trace shows every call, the inner
/// one too.
#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let address: u64 = ctx.arg(0).unwrap_or(0);
    if address == 0 || !tunables::in_scope() {
        return 0;
    }
    // SAFETY: reads this attachment's cookie: which function was called.
    let function = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let tgid = calls::process_id();
    let size = match calls::begin_release(address, function) {
        Release::Outer => record::release(tgid, address),
        Release::InsideDelete => record::release_if_recorded(tgid, address),
        // Released at realloc's return: traced now, with its size.
        Release::InsideRealloc if tunables::trace() => record::recorded_size(tgid, address),
        Release::InsideRealloc => return 0,
    };
    events::send(function, address, size.unwrap_or(0));
    0
}
