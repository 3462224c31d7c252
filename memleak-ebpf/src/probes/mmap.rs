//! mmap, munmap, mremap and mprotect: sent to user space as events, which
//! keeps the regions (a partial munmap splits them, which a hash map
//! cannot do).

use aya_ebpf::{
    bindings::pt_regs,
    helpers::generated::bpf_get_attach_cookie,
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext as _,
};
use memleak_common::{MappingChange, MappingEvent, PendingMapping, PROBED_AFTER_SYSTEM_CALL};

use crate::{calls, deferred, maps::PENDING_MAPPINGS, process_events::send, tunables};

/// mmap's and mremap's failure value.
const MAP_FAILED: u64 = u64::MAX;

/// `mmap(addr, length, prot, flags, fd, offset)`.
#[uprobe]
pub fn mmap_enter(ctx: ProbeContext) -> u32 {
    if !tunables::in_scope() {
        return 0;
    }
    let call = PendingMapping {
        length: ctx.arg(1).unwrap_or(0),
        prot: ctx.arg(2).unwrap_or(0),
        flags: ctx.arg(3).unwrap_or(0),
        change: MappingChange::Map as u32,
        ..PendingMapping::default()
    };
    let _ = PENDING_MAPPINGS.insert(calls::thread_id(), call, 0);
    0
}

/// `mremap(old_address, old_length, new_length, flags, ...)`.
#[uprobe]
pub fn mremap_enter(ctx: ProbeContext) -> u32 {
    if !tunables::in_scope() {
        return 0;
    }
    let call = PendingMapping {
        address: ctx.arg(0).unwrap_or(0),
        length: ctx.arg(1).unwrap_or(0),
        new_length: ctx.arg(2).unwrap_or(0),
        change: MappingChange::Remap as u32,
        ..PendingMapping::default()
    };
    let _ = PENDING_MAPPINGS.insert(calls::thread_id(), call, 0);
    0
}

/// The return of mmap and mremap.
#[uretprobe]
pub fn mapping_return(ctx: RetProbeContext) -> u32 {
    let returned: u64 = ctx.ret();
    let (thread, tgid) = (calls::thread_id(), calls::process_id());
    let Some(call) = PENDING_MAPPINGS.get_ptr(thread) else { return 0 };
    // SAFETY: this thread's own entry, copied before it is removed.
    let call = unsafe { *call };
    let _ = PENDING_MAPPINGS.remove(thread);
    if returned == MAP_FAILED {
        return 0;
    }
    let mut event = MappingEvent { tgid, change: call.change, ..MappingEvent::default() };
    if MappingChange::try_from(call.change) == Ok(MappingChange::Map) {
        if call.length < tunables::min_size() || call.length > tunables::max_size() {
            return 0;
        }
        event.address = returned;
        event.length = call.length;
        event.prot = call.prot;
        event.flags = call.flags;
        // malloc & co. in progress on this thread: the allocator's own mapping.
        event.inside_allocator = u32::from(calls::inside_allocator());
        deferred::send_mapping(&ctx, event);
    } else {
        event.address = call.address;
        event.length = call.length;
        event.new_address = returned;
        event.new_length = call.new_length;
        send(event);
    }
    0
}

/// `munmap(address, length)`.
#[uprobe]
pub fn munmap_enter(ctx: ProbeContext) -> u32 {
    send_range_change(&ctx, MappingChange::Unmap, 0);
    0
}

/// `mprotect(address, length, prot)`: a reservation made usable, or back.
/// Probed past its system call where memleak could (see its
/// `attach::placement`): a call that failed then changes nothing.
#[uprobe]
pub fn mprotect_enter(ctx: ProbeContext) -> u32 {
    // SAFETY: reads this attachment's cookie.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let regs = ctx.as_ptr() as *const pt_regs;
    // SAFETY: the probe's registers, which the kernel hands over.
    if cookie & PROBED_AFTER_SYSTEM_CALL != 0 && unsafe { (*regs).rax } != 0 {
        return 0;
    }
    send_range_change(&ctx, MappingChange::Protect, ctx.arg(2).unwrap_or(0));
    0
}

/// Sends `change` of the range the call's first two arguments name, as
/// the call begins: munmap and mprotect return nothing memleak needs.
fn send_range_change(ctx: &ProbeContext, change: MappingChange, prot: u32) {
    if !tunables::in_scope() {
        return;
    }
    send(MappingEvent {
        address: ctx.arg(0).unwrap_or(0),
        length: ctx.arg(1).unwrap_or(0),
        prot,
        tgid: calls::process_id(),
        change: change as u32,
        ..MappingEvent::default()
    });
}
