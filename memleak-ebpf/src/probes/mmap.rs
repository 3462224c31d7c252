//! mmap, munmap, mremap and mprotect: sent to user space as events, which
//! keeps the regions (a partial munmap splits them, which a hash map
//! cannot do). munmap and mprotect are seen at their system calls' entry
//! where the kernel allows it, to spare the calls a trap, through uprobes
//! elsewhere.

use aya_ebpf::{
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
#[cfg(not(feature = "legacy-kernels"))]
use memleak_common::PROBED_AFTER_SYSTEM_CALL;
use memleak_common::{MappingChange, MappingEvent, PendingMapping, PROT_NONE, RESERVES_ADDRESS_SPACE};

use crate::{
    calls, deferred,
    maps::{PENDING_MAPPINGS, TRACED_PROCESSES},
    process_events::send,
    scratch, tunables,
};

/// mmap's and mremap's failure value.
const MAP_FAILED: u64 = u64::MAX;

/// `mmap(addr, length, prot, flags, fd, offset)`.
#[uprobe]
pub fn mmap_enter(ctx: ProbeContext) -> u32 {
    scratch::own_stack(&ctx);
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
    scratch::own_stack(&ctx);
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
    scratch::own_stack(&ctx);
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
        if event.reserves_address_space() {
            if let Some(flags) = traced_process() {
                mark_reserving(flags);
            }
        }
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
    scratch::own_stack(&ctx);
    if tunables::in_scope() {
        send_range_change(ctx.arg(0).unwrap_or(0), ctx.arg(1).unwrap_or(0), MappingChange::Unmap, 0);
    }
    0
}

/// The bits of an address within its page.
const PAGE_OFFSET_BITS: u64 = 4095;

/// The protection bits the kernel takes (x86-64's: no architecture
/// bits of its own; arm64's: `PROT_BTI` and `PROT_MTE` too, the first
/// of which glibc's loader sets on every BTI object it maps), and the
/// two that say which way a stack grows; both of those, or any other
/// bit, and the call fails (`EINVAL`).
#[cfg(not(bpf_target_arch = "aarch64"))]
const PROT_KNOWN: u32 = 0x1 | 0x2 | 0x4 | 0x8;
#[cfg(bpf_target_arch = "aarch64")]
const PROT_KNOWN: u32 = 0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x20;
const PROT_GROWSDOWN: u32 = 0x0100_0000;
const PROT_GROWSUP: u32 = 0x0200_0000;

/// Whether mprotect takes `prot`, as `do_mprotect_pkey` checks it
/// before it changes anything.
fn valid_protection(prot: u32) -> bool {
    let grows = prot & (PROT_GROWSDOWN | PROT_GROWSUP);
    grows != PROT_GROWSDOWN | PROT_GROWSUP && prot & !(PROT_KNOWN | PROT_GROWSDOWN | PROT_GROWSUP) == 0
}

/// Whether the kernel refuses `mprotect(address, length, prot)` before it
/// changes anything (`EINVAL`; a length of 0 changes nothing): an address
/// within a page, unknown protection bits. Seen at the call's entry, such
/// a call is not sent.
fn refused_at_once(address: u64, length: u64, prot: u32) -> bool {
    address & PAGE_OFFSET_BITS != 0 || length == 0 || !valid_protection(prot)
}

/// `mprotect(address, length, prot)`: a reservation made usable, or back.
/// Probed past its system call where memleak could (see its
/// `attach::placement`): a call that failed then changes nothing. The
/// attach cookie says where.
#[cfg(not(feature = "legacy-kernels"))]
#[uprobe]
pub fn mprotect_enter(ctx: ProbeContext) -> u32 {
    let past_system_call = crate::calls::attach_cookie(&ctx) & PROBED_AFTER_SYSTEM_CALL != 0;
    protected(&ctx, past_system_call)
}

/// `mprotect` at its entry, on kernels without attach cookies.
#[cfg(feature = "legacy-kernels")]
#[uprobe]
pub fn mprotect_enter(ctx: ProbeContext) -> u32 {
    protected(&ctx, false)
}

/// `mprotect` past its system call, on kernels without attach cookies.
#[cfg(feature = "legacy-kernels")]
#[uprobe]
pub fn mprotect_past_call(ctx: ProbeContext) -> u32 {
    protected(&ctx, true)
}

fn protected(ctx: &ProbeContext, past_system_call: bool) -> u32 {
    scratch::own_stack(ctx);
    if past_system_call && crate::registers::Registers::of(ctx).return_value() != 0 {
        return 0;
    }
    let (address, length, prot) = (ctx.arg(0).unwrap_or(0), ctx.arg(1).unwrap_or(0), ctx.arg(2).unwrap_or(0));
    // At the entry (arm64's probes, or code memleak could not place a
    // probe past the call in), a call the kernel refuses is still sent
    // unless it is seen to be one.
    if !past_system_call && refused_at_once(address, length, prot) {
        return 0;
    }
    if traced_process().is_some_and(|flags| protect_matters(flags, prot)) {
        send_range_change(address, length, MappingChange::Protect, prot);
    }
    0
}

/// munmap and mprotect seen from the kernel, at the entry of their system
/// calls: user space attaches these where the kernel allows it, each to
/// its architecture's wrapper (`programs::MAPPING_SYSTEM_CALLS`:
/// `__x64_sys_munmap`, `__arm64_sys_munmap`).
#[cfg(not(feature = "legacy-kernels"))]
mod system_calls {
    use aya_ebpf::{macros::fentry, programs::FEntryContext};
    use memleak_common::MappingChange;

    use super::{protect_matters, send_range_change, traced_process};
    use crate::registers::Registers;

    /// `munmap(address, length)`, as the kernel enters it, for the
    /// processes memleak traces, in place of its uprobe: a uprobe traps on
    /// every call of the traced process, 8 µs a munmap, whose first
    /// instruction the kernel single-steps. An fentry program costs only
    /// the calls of munmap itself, of any process on the machine (where
    /// `lock_taken` fires for every take of any process's mmap lock). The
    /// event is in the ring before the range is unmapped, so before any
    /// other thread can map it again. A call the kernel refuses before it
    /// changes anything (an address within a page, a length of 0:
    /// `EINVAL`) is not sent.
    #[fentry]
    pub fn munmap_called(ctx: FEntryContext) -> i32 {
        // The wrapper's one argument: the task's user registers, saved at
        // kernel entry.
        // A BTF pointer the verifier checks each load through; the call's
        // arguments, which its registers keep.
        let [address, length, _] = Registers::at(ctx.arg(0)).system_call_arguments();
        if address & super::PAGE_OFFSET_BITS != 0 || length == 0 || traced_process().is_none() {
            return 0;
        }
        send_range_change(address, length, MappingChange::Unmap, 0);
        0
    }

    /// `mprotect(address, length, prot)` as the kernel enters it (see
    /// `munmap_called`). A call the kernel refuses before it changes
    /// anything (an address within a page, unknown protection bits:
    /// `EINVAL`; a length of 0) is not sent. An mprotect whose range has a
    /// hole fails after changing what is before the hole: it is sent, and
    /// user space changes the regions it knows in the whole range.
    #[fentry]
    pub fn mprotect_called(ctx: FEntryContext) -> i32 {
        protect_called(&ctx)
    }

    /// `pkey_mprotect(address, length, prot, key)`: mprotect with a
    /// protection key, where the kernel has them.
    #[fentry]
    pub fn pkey_mprotect_called(ctx: FEntryContext) -> i32 {
        protect_called(&ctx)
    }

    #[expect(
        clippy::inline_always,
        reason = "the arguments read in each program itself, typed by its target"
    )]
    #[inline(always)]
    fn protect_called(ctx: &FEntryContext) -> i32 {
        // As in `munmap_called`.
        let [address, length, prot] = Registers::at(ctx.arg(0)).system_call_arguments();
        let prot = prot as u32;
        if super::refused_at_once(address, length, prot) {
            return 0;
        }
        let Some(flags) = traced_process() else { return 0 };
        if protect_matters(flags, prot) {
            send_range_change(address, length, MappingChange::Protect, prot);
        }
        0
    }
}

/// The `mmap_lock` tracepoint's program, for kernels with
/// `bpf_task_pt_regs` (5.15): user space attaches it only where the
/// tracepoint takes 3 arguments (6.x). It tells the calls apart by
/// x86-64's system call numbers.
#[cfg(all(not(feature = "legacy-kernels"), not(bpf_target_arch = "aarch64")))]
mod lock_taken {
    use aya_ebpf::{
        bindings::pt_regs,
        helpers::generated::{bpf_get_current_task_btf, bpf_task_pt_regs},
        macros::btf_tracepoint,
        programs::BtfTracePointContext,
    };
    use memleak_common::MappingChange;

    use super::{protect_matters, send_range_change, traced_process};
    use crate::registers::Registers;

    /// x86-64's system call numbers of munmap, mprotect and `pkey_mprotect`.
    const SYS_MUNMAP: u64 = 11;
    const SYS_MPROTECT: u64 = 10;
    const SYS_PKEY_MPROTECT: u64 = 329;

    /// The kernel's `mmap_lock_acquire_returned(mm, write, success)`: munmap
    /// and mprotect seen from the kernel, for the processes memleak traces,
    /// in place of their uprobes, when asked for
    /// (`MEMLEAK_MAPPING_TRACEPOINT`): user space prefers `system_calls`,
    /// then uprobes, which cost other processes nothing. Both calls take
    /// their process's mmap lock for writing once, after checking their
    /// arguments, before changing anything, and hold it until done: the
    /// event is in the ring before any other thread can map the range
    /// again. Also fires for every other taker of any process's mmap lock
    /// (mmap, brk, page faults that miss the per-VMA lock, /proc
    /// readers...), which the system call number sends away first: about
    /// 0.35 µs on each mapping system call of every process.
    #[btf_tracepoint(function = "mmap_lock_acquire_returned")]
    pub fn mmap_lock_acquire_returned(_ctx: BtfTracePointContext) -> i32 {
        // SAFETY: the current task is always valid, and the helper gives its
        // user registers (saved at kernel entry) as a pointer the verifier
        // checks each load through.
        let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const pt_regs;
        let change = match Registers::at(regs).system_call_number() {
            SYS_MUNMAP => MappingChange::Unmap,
            SYS_MPROTECT | SYS_PKEY_MPROTECT => MappingChange::Protect,
            _ => return 0,
        };
        let Some(flags) = traced_process() else { return 0 };
        // The call's arguments, which its registers keep.
        let [address, length, prot] = Registers::at(regs).system_call_arguments();
        let prot = prot as u32;
        if change == MappingChange::Unmap {
            send_range_change(address, length, change, 0);
        } else if protect_matters(flags, prot) {
            send_range_change(address, length, change, prot);
        }
        0
    }
}

/// The flags in `TRACED_PROCESSES` of the current process, if memleak
/// traces it and it is in scope: a system call's fentry program fires for
/// every process on the machine, and a uprobe with --cgroup for every process
/// mapping the file.
fn traced_process() -> Option<*mut u32> {
    let flags = TRACED_PROCESSES.get_ptr_mut(calls::process_id())?;
    tunables::in_scope().then_some(flags)
}

/// Whether an mprotect to `prot` by the process whose flags are at
/// `flags` may change what memleak tracks (see
/// `memleak_common::TRACED_PROCESSES_MAP`); one that takes all access
/// marks the process as reserving.
fn protect_matters(flags: *mut u32, prot: u32) -> bool {
    if prot == PROT_NONE {
        mark_reserving(flags);
        return true;
    }
    // SAFETY: a live entry's value, read once.
    unsafe { *flags & RESERVES_ADDRESS_SPACE != 0 }
}

/// Marks the process whose flags are at `flags` as reserving address
/// space of its own. Threads that race here set the same bit.
fn mark_reserving(flags: *mut u32) {
    // SAFETY: a live entry's value; the flag is only ever set.
    unsafe { *flags |= RESERVES_ADDRESS_SPACE };
}

/// Sends `change` of `[address, address + length)` by the current
/// process: munmap and mprotect return nothing memleak needs.
fn send_range_change(address: u64, length: u64, change: MappingChange, prot: u32) {
    send(MappingEvent {
        address,
        length,
        prot,
        tgid: calls::process_id(),
        change: change as u32,
        ..MappingEvent::default()
    });
}
