//! Allocator calls in flight, per thread: what the entry probe read, for
//! the return probe that sees the result. Allocators call each other
//! (glibc's reallocarray calls realloc), so each thread also counts how
//! deep inside the allocator it is, and only the outermost call is the
//! program's allocation.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, programs::ProbeContext};
use memleak_common::{CallKind, FunctionSet, PendingCall, UPROBES_PAGE};

use crate::{maps::PENDING, tunables};

/// The current thread's id.
pub fn thread_id() -> u32 {
    bpf_get_current_pid_tgid() as u32
}

/// The current thread's process id.
pub fn process_id() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}

/// Starts an allocator call on this thread: `size` bytes asked for, and
/// the call's `argument` (realloc's old block, `posix_memalign`'s
/// out-pointer).
/// `function` is the function called, a `FunctionSet`.
pub fn enter(ctx: &ProbeContext, size: u64, argument: u64, kind: CallKind, function: u32) {
    if !tunables::in_scope() {
        return; // no pending call, so the return probe does nothing either
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let (thread, process) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    // A thread keeps its entry between calls (at depth 0), so that a call
    // costs one lookup, not an insert and a delete.
    let pending = PENDING.get_ptr_mut(thread);
    // SAFETY: only this thread touches its own entry.
    if let Some(pending) = pending.filter(|pending| unsafe { (**pending).depth } > 0) {
        // An allocator entry point called from inside another one: only the
        // outer call is the program's allocation.
        // SAFETY: as above.
        unsafe { (*pending).depth += 1 };
        return;
    }
    let sampled = u32::from(tunables::sample());
    // Read only where the allocator may map memory for the call: a large
    // block, or a thread's first call (its arena). The read costs about
    // a tenth of a malloc/free pair's tracing; other calls go without.
    let return_address = if size >= MAPPED_SIZE || pending.is_none() { return_address(ctx) } else { 0 };
    let call = PendingCall {
        size,
        argument,
        kind: kind as u32,
        depth: 1,
        sampled,
        function,
        tgid: process,
        _padding: 0,
        // A new call: the thread's last operator delete has returned.
        releasing: 0,
        return_address,
    };
    match pending {
        // SAFETY: as above.
        Some(pending) => unsafe { *pending = call },
        None => {
            let _ = PENDING.insert(thread, call, 0);
        }
    }
}

/// This attachment's cookie (Linux 5.15): which function was called, as
/// a `FunctionSet`, and how its probe is placed.
#[cfg(not(feature = "legacy-kernels"))]
pub fn attach_cookie(ctx: &ProbeContext) -> u64 {
    // SAFETY: the helper reads the cookie of the program's attachment.
    unsafe { aya_ebpf::helpers::generated::bpf_get_attach_cookie(aya_ebpf::EbpfContext::as_ptr(ctx)) }
}

/// Blocks from this size on are mapped on their own by glibc (its
/// smallest mmap threshold) and by most allocators' large-block paths.
const MAPPED_SIZE: u64 = 128 << 10;

/// Where the call starting at this entry probe returns; 0 if it cannot
/// be read.
fn return_address(ctx: &ProbeContext) -> u64 {
    crate::registers::Registers::of(ctx).return_address_at_entry()
}

/// Ends this thread's call; `None` while still inside a nested one, or
/// when no call was seen starting (memleak attached during it).
pub fn leave() -> Option<PendingCall> {
    let pending = PENDING.get_ptr_mut(thread_id())?;
    // SAFETY: only this thread touches its own entry.
    unsafe {
        match (*pending).depth {
            0 => None,
            1 => {
                (*pending).depth = 0;
                Some(*pending)
            }
            _ => {
                (*pending).depth -= 1;
                None
            }
        }
    }
}

/// Where the allocator call this thread is inside returns to, when the
/// walk of its stack meets `pc` in the uprobes page: the return probe of
/// that call put its trampoline in the return address's place. Only for
/// a call made from outside the allocator (depth 1) whose return address
/// was read (see `enter`): a nested call's own is not kept.
pub fn real_return_address(pc: u64) -> u64 {
    if pc & !0xfff != UPROBES_PAGE {
        return pc;
    }
    let Some(call) = PENDING.get_ptr(thread_id()) else { return pc };
    // SAFETY: this thread's own entry, read once.
    let call = unsafe { *call };
    if call.depth == 1 && call.return_address != 0 {
        call.return_address
    } else {
        pc
    }
}

/// Whether this thread is inside malloc & co. now.
pub fn inside_allocator() -> bool {
    // SAFETY: this thread's own entry.
    PENDING.get_ptr(thread_id()).is_some_and(|call| unsafe { (*call).depth } > 0)
}

/// Where a release that starts now on this thread is made.
pub enum Release {
    /// In the program's own call: it counts.
    Outer,
    /// Inside an `operator delete` or a `PyObject_Free` of the same block,
    /// which counted it.
    InsideDelete,
    /// Inside a realloc of the same block, whose return releases it
    /// (glibc's realloc(p, 0) calls free(p)).
    InsideRealloc,
}

/// Starts the release of `address` by the function probed with cookie
/// `function` on this thread, and says where it is made. An `operator
/// delete` that is only that (not an alias of `free`), or a
/// `PyObject_Free`, is remembered as releasing `address`, for the `free`
/// it may call: releases have no return probe, so its calls cannot be
/// counted as allocations' are.
pub fn begin_release(address: u64, function: u32) -> Release {
    let delete = FunctionSet(function).releases_through_another();
    let Some(call) = PENDING.get_ptr_mut(thread_id()) else {
        if delete {
            let call = PendingCall { tgid: process_id(), releasing: address, ..PendingCall::default() };
            let _ = PENDING.insert(thread_id(), call, 0);
        }
        return Release::Outer;
    };
    // SAFETY: only this thread touches its own entry.
    let call = unsafe { &mut *call };
    let release = if call.releasing == address {
        Release::InsideDelete
    } else if call.depth > 0 && call.kind == CallKind::Reallocate as u32 && call.argument == address {
        Release::InsideRealloc
    } else {
        Release::Outer
    };
    let releasing = if delete && matches!(release, Release::Outer) { address } else { 0 };
    // Written only when it changes: most frees find it 0 and leave it so.
    if call.releasing != releasing {
        call.releasing = releasing;
    }
    release
}
