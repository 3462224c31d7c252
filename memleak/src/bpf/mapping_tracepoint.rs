//! munmap and mprotect seen from the kernel's `mmap_lock_acquire_returned`
//! tracepoint (memleak-ebpf's `probes::mmap` says why and how) rather than
//! through uprobes, where this kernel allows it cheaply: their uprobes are
//! then left out of every attach.

use std::path::Path;

use aya::{
    programs::{BtfTracePoint, ProgramError},
    Btf, Ebpf,
};
use memleak_common::{programs, MAPPING_FUNCTIONS};

use crate::{attach::kernel_btf, status};

/// Set to anything: munmap and mprotect keep their uprobes even where
/// the tracepoint could serve them, as the tests of that way do.
pub const MAPPING_UPROBES: &str = "MEMLEAK_MAPPING_UPROBES";

/// The tracepoint's arguments where it is cheap: (mm, write, success).
/// Kernels that passed the memory cgroup's path as well built that path
/// for every take of any process's mmap lock while the tracepoint was
/// on, page faults included: a cost memleak would lay on the whole
/// machine.
const CHEAP_ARGUMENTS: usize = 3;

/// Attaches the tracepoint where it serves, and returns the entry
/// programs of the uprobes it stands in for; why not is said with -v.
pub fn attach(ebpf: &mut Ebpf, btf: &Btf) -> Vec<&'static str> {
    let attached = match uprobes_kept(Path::new(kernel_btf::VMLINUX_BTF)) {
        Some(why) => Err(why),
        None => load_and_attach(ebpf, btf).map_err(|error| why_refused(&error)),
    };
    let seen_in_kernel = MAPPING_FUNCTIONS.iter().filter(|function| function.seen_in_kernel);
    match attached {
        Ok(()) => {
            log::debug!(
                "munmap and mprotect seen from the kernel's {} tracepoint",
                programs::MAPPING_LOCK_TAKEN
            );
            seen_in_kernel.map(|function| function.entry_program).collect()
        }
        Err(why) => {
            log::debug!("munmap and mprotect probed in the C library: {why}");
            Vec::new()
        }
    }
}

/// Why munmap and mprotect keep their uprobes on this machine, if they
/// do, from the kernel's BTF at `btf`.
fn uprobes_kept(btf: &Path) -> Option<String> {
    if std::env::var_os(MAPPING_UPROBES).is_some() {
        return Some(format!("{MAPPING_UPROBES} is set"));
    }
    if !cfg!(target_arch = "x86_64") {
        return Some("the tracepoint's program knows x86-64's system call numbers only".to_owned());
    }
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

fn load_and_attach(ebpf: &mut Ebpf, btf: &Btf) -> Result<(), ProgramError> {
    let name = programs::MAPPING_LOCK_TAKEN;
    let program: &mut BtfTracePoint = ebpf
        .program_mut(name)
        .and_then(|program| program.try_into().ok())
        .ok_or(ProgramError::UnexpectedProgramType)?;
    program.load(name, btf)?;
    program.attach().map(drop)
}

/// What the kernel said when it refused the program: the error, and the
/// verifier's last line if it got that far.
fn why_refused(error: &ProgramError) -> String {
    let ProgramError::LoadError { io_error, verifier_log } = error else {
        return format!("the kernel refused the tracepoint: {error}");
    };
    let log = verifier_log.to_string();
    match log.lines().rev().find(|line| !line.trim().is_empty()) {
        Some(last) => format!("the kernel refused the tracepoint: {}: {last}", status::os_reason(io_error)),
        None => format!("the kernel refused the tracepoint: {}", status::os_reason(io_error)),
    }
}
