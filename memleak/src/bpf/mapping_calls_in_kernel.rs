//! munmap and mprotect seen from the kernel rather than through uprobes,
//! where it allows it: their uprobes are then left out of every attach.
//! memleak-ebpf's `probes::mmap` says why and how: fentry programs at the
//! entry of their system calls, which cost other processes only those
//! calls. Where the kernel refuses them, uprobes in the traced processes:
//! the `mmap_lock` tracepoint would spare those a trap, but every other
//! process of the machine would pay for it on every take of its mmap lock
//! (a loop of mapping calls ran 10% slower beside it, `cargo xtask bench
//! --mprotect-only`), so it is used only when asked for.

use std::path::Path;

use aya::{
    programs::{BtfTracePoint, FEntry, ProgramError},
    Btf, Ebpf,
};
use memleak_common::{programs, MAPPING_FUNCTIONS};

use crate::{attach::kernel_btf, status};

/// Set to anything: munmap and mprotect keep their uprobes even where
/// the kernel could see them, as the tests of that way do.
pub const MAPPING_UPROBES: &str = "MEMLEAK_MAPPING_UPROBES";

/// Set to anything: the `mmap_lock` tracepoint where the kernel refuses
/// fentry programs, or even where it takes them (as the tests of that
/// way do): traced processes then pay less for their munmap and mprotect
/// calls, and every other process more for all of its mapping calls.
pub const MAPPING_TRACEPOINT: &str = "MEMLEAK_MAPPING_TRACEPOINT";

/// The tracepoint's arguments where it is cheap: (mm, write, success).
/// Kernels that passed the memory cgroup's path as well built that path
/// for every take of any process's mmap lock while the tracepoint was
/// on, page faults included: a cost memleak would lay on the whole
/// machine.
const CHEAP_ARGUMENTS: usize = 3;

/// How the kernel sees munmap and mprotect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeenBy {
    /// fentry programs at the entry of their system calls.
    SystemCalls,
    /// The `mmap_lock_acquire_returned` tracepoint.
    LockTracepoint,
}

impl SeenBy {
    /// As `-v` and `--stats` say it.
    pub fn label(self) -> &'static str {
        match self {
            Self::SystemCalls => "fentry at their system calls",
            Self::LockTracepoint => "mmap_lock tracepoint",
        }
    }

    /// Where the kernel sees the calls of the mapping function whose
    /// entry program is `entry_program`, if it does.
    pub fn hook(self, entry_program: &str) -> Option<&'static str> {
        let function = MAPPING_FUNCTIONS.iter().find(|function| function.entry_program == entry_program)?;
        match self {
            Self::SystemCalls => function.seen_in_kernel,
            Self::LockTracepoint => function.seen_in_kernel.map(|_| programs::MAPPING_LOCK_TAKEN),
        }
    }
}

/// Attaches what sees munmap and mprotect in the kernel where it can, and
/// says how it does; why not is said with -v.
pub fn attach(ebpf: &mut Ebpf, btf: &Btf) -> Option<SeenBy> {
    if std::env::var_os(MAPPING_UPROBES).is_some() {
        log::debug!("munmap and mprotect probed in the C library: {MAPPING_UPROBES} is set");
        return None;
    }
    let at_system_calls = if std::env::var_os(MAPPING_TRACEPOINT).is_some() {
        Err(format!("{MAPPING_TRACEPOINT} is set"))
    } else {
        attach_system_calls(ebpf, btf)
    };
    let why_not_system_calls = match at_system_calls {
        Ok(()) => return Some(said(SeenBy::SystemCalls)),
        Err(why) => why,
    };
    if std::env::var_os(MAPPING_TRACEPOINT).is_none() {
        // The tracepoint's program tells the calls apart by x86-64's
        // system call numbers: arm64's object has none to offer.
        let instead = if cfg!(target_arch = "x86_64") {
            format!(" ({MAPPING_TRACEPOINT}=1 would have the mmap_lock tracepoint see them, at a cost to every process)")
        } else {
            String::new()
        };
        log::debug!(
            "munmap and mprotect probed in the C library: not seen at their system calls: {why_not_system_calls}{instead}"
        );
        return None;
    }
    if !cfg!(target_arch = "x86_64") {
        log::debug!(
            "munmap and mprotect probed in the C library: the mmap_lock tracepoint's program knows x86-64's system calls only"
        );
        return None;
    }
    match tracepoint_refused(Path::new(kernel_btf::VMLINUX_BTF)).map_or_else(
        || attach_tracepoint(ebpf, btf).map_err(|error| why_refused("the tracepoint", &error)),
        Err,
    ) {
        Ok(()) => Some(said(SeenBy::LockTracepoint)),
        Err(why) => {
            log::debug!("munmap and mprotect probed in the C library: {why}");
            None
        }
    }
}

fn said(seen_by: SeenBy) -> SeenBy {
    log::debug!("munmap and mprotect seen from the kernel: {}", seen_by.label());
    seen_by
}

/// Loads and attaches each system call's program; munmap's and mprotect's
/// must take (else every one is unloaded again), `pkey_mprotect`'s only
/// where the kernel has protection keys.
fn attach_system_calls(ebpf: &mut Ebpf, btf: &Btf) -> Result<(), String> {
    let mut attached = Vec::new();
    for (name, function) in programs::MAPPING_SYSTEM_CALLS {
        let outcome = match fentry(ebpf, name) {
            Some(program) => program.load(function, btf).and_then(|()| program.attach()).map(drop),
            None => Err(ProgramError::UnexpectedProgramType),
        };
        match outcome {
            Ok(()) => attached.push(name),
            Err(error) if function.ends_with("pkey_mprotect") => {
                log::debug!("pkey_mprotect is not seen: {}", why_refused(function, &error));
            }
            Err(error) => {
                for name in attached {
                    if let Some(program) = fentry(ebpf, name) {
                        let _ = program.unload();
                    }
                }
                return Err(why_refused(function, &error));
            }
        }
    }
    Ok(())
}

fn fentry<'a>(ebpf: &'a mut Ebpf, name: &str) -> Option<&'a mut FEntry> {
    ebpf.program_mut(name).and_then(|program| program.try_into().ok())
}

/// Why the tracepoint is not to be used on this machine, if it is not,
/// from the kernel's BTF at `btf`.
fn tracepoint_refused(btf: &Path) -> Option<String> {
    let tracepoint = programs::MAPPING_LOCK_TAKEN;
    match kernel_btf::tracepoint_arguments(btf, tracepoint) {
        Ok(Some(CHEAP_ARGUMENTS)) => None,
        Ok(Some(_)) => Some(format!(
            "this kernel's {tracepoint} tracepoint builds a memory cgroup's path on every take of any \
             process's mmap lock"
        )),
        Ok(None) => Some(format!("the kernel has no {tracepoint} tracepoint")),
        Err(error) => Some(error.to_string()),
    }
}

fn attach_tracepoint(ebpf: &mut Ebpf, btf: &Btf) -> Result<(), ProgramError> {
    let name = programs::MAPPING_LOCK_TAKEN;
    let program: &mut BtfTracePoint = ebpf
        .program_mut(name)
        .and_then(|program| program.try_into().ok())
        .ok_or(ProgramError::UnexpectedProgramType)?;
    program.load(name, btf)?;
    program.attach().map(drop)
}

/// The kernel's internal "operation not supported", which reaches user
/// space from BPF's attach paths.
const KERNEL_ENOTSUPP: i32 = 524;

/// What the kernel said when it refused the program for `what`: the
/// error, and the verifier's last line if it got that far.
fn why_refused(what: &str, error: &ProgramError) -> String {
    if let ProgramError::SyscallError(aya::sys::SyscallError { call, io_error }) = error {
        // The kernel's own ENOTSUPP, which libc has no text for: arm64
        // kernels before 6.4 cannot attach a trampoline to a kernel
        // function (no ftrace direct calls).
        let reason = if io_error.raw_os_error() == Some(KERNEL_ENOTSUPP) {
            "not supported by this kernel (ENOTSUPP)".to_owned()
        } else {
            status::os_reason(io_error)
        };
        return format!("the kernel refused the program for {what}: {call}: {reason}");
    }
    let ProgramError::LoadError { io_error, verifier_log } = error else {
        return format!("the kernel refused the program for {what}: {error}");
    };
    let log = verifier_log.to_string();
    let reason = status::os_reason(io_error);
    match log.lines().rev().find(|line| !line.trim().is_empty()) {
        Some(last) => format!("the kernel refused the program for {what}: {reason}: {last}"),
        None => format!("the kernel refused the program for {what}: {reason}"),
    }
}
