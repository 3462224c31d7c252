//! The entry probe of free and the other functions that give memory back.

use aya_ebpf::{
    helpers::generated::bpf_get_attach_cookie, macros::uprobe, programs::ProbeContext, EbpfContext as _,
};

use crate::{calls, events, record, tunables};

/// free(ptr), and sdallocx(ptr, size, flags) and the like: forgets the
/// allocation at `ptr`.
#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let address: u64 = ctx.arg(0).unwrap_or(0);
    if address != 0 && tunables::in_scope() {
        let size = record::release(calls::process_id(), address);
        // SAFETY: reads this attachment's cookie: which function was called.
        let function = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
        events::send(function, address, size.unwrap_or(0));
    }
    0
}
