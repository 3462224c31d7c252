//! What the running kernel offers of what memleak's BPF programs use,
//! asked of the kernel itself at start (its BTF, a probe load), never
//! guessed from its version: distributions backport features, and a
//! version says nothing of a kernel built without BTF.
//!
//! Two things are required: the kernel's BTF, and BPF ring buffers (Linux
//! 5.8), which every event reaches user space through. A kernel without
//! either is refused with one line saying what it lacks. The rest have a
//! path on every kernel, and `-v` and `--stats` say which one runs: see
//! [`Paths`]. The largest choice is the BPF object: kernels without the
//! `bpf_loop` helper (before 5.17) get the one built for them (see
//! memleak-ebpf's `legacy-kernels`).

use std::path::Path;

use serde::Serialize;

use crate::attach::kernel_btf;

/// The oldest kernel release memleak is tested on.
pub const OLDEST_KERNEL: &str = "5.10";

/// The kernels memleak's suite runs on (`cargo xtask test`): Debian's.
pub const TESTED_KERNELS: &str = "Debian's 5.10, 6.1, 6.12 and newer";

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "this kernel ({release}) has no BTF at {path}: memleak needs a kernel built with \
         CONFIG_DEBUG_INFO_BTF (as Debian's, Ubuntu's, RHEL's and Amazon Linux's are), {OLDEST_KERNEL} or later"
    )]
    NoBtf { release: String, path: &'static str },
    #[error(
        "this kernel ({release}) lacks {feature}, which memleak needs: memleak runs on Linux \
         {OLDEST_KERNEL} or later (tested on {TESTED_KERNELS})"
    )]
    TooOld { release: String, feature: &'static str },
}

/// Set, memleak loads the object built for kernels before 5.17 on any
/// kernel: for its development and tests.
pub const BOUNDED_LOOPS: &str = "MEMLEAK_BOUNDED_LOOPS";

/// How the BPF programs loop over frames, which decides the object loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loops {
    /// The `bpf_loop` helper (5.17): the verifier checks a loop's step
    /// once.
    BpfLoop,
    /// Bounded loops, which the verifier follows iteration by iteration,
    /// in the object built for kernels 5.10 to 5.16, which also does
    /// without callbacks, atomic exchanges and attach cookies.
    Bounded,
}

impl Loops {
    /// What `-v` and `--stats` call it.
    pub fn name(self) -> &'static str {
        match self {
            Self::BpfLoop => "bpf_loop",
            Self::Bounded => "bounded loops, in stages, without stack reuse",
        }
    }
}

/// Fails with one line when this kernel cannot run memleak's programs;
/// else says how they loop on it.
pub fn check() -> Result<Loops, KernelError> {
    check_btf(Path::new(kernel_btf::VMLINUX_BTF), &release())
}

fn check_btf(btf: &Path, release: &str) -> Result<Loops, KernelError> {
    let no_btf = || KernelError::NoBtf { release: release.to_owned(), path: kernel_btf::VMLINUX_BTF };
    let has = |name, value| kernel_btf::enum_has_value(btf, name, value);
    // An empty or unreadable file is no BTF either: a container may mask it.
    match has("bpf_map_type", "BPF_MAP_TYPE_RINGBUF") {
        Ok(true) => {}
        Ok(false) => {
            return Err(KernelError::TooOld { release: release.to_owned(), feature: "BPF ring buffers" })
        }
        Err(_) => return Err(no_btf()),
    }
    match has("bpf_func_id", "BPF_FUNC_loop") {
        // For trying the older kernels' object on a newer kernel.
        Ok(true) if std::env::var_os(BOUNDED_LOOPS).is_some() => Ok(Loops::Bounded),
        Ok(true) => Ok(Loops::BpfLoop),
        Ok(false) => Ok(Loops::Bounded),
        Err(_) => Err(no_btf()),
    }
}

/// The running kernel's release (`uname -r`).
pub fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |r| r.trim().to_owned())
}

/// The path each part of the tracer takes on this kernel, for `-v` and
/// `--stats`.
#[derive(Clone, Debug, Serialize)]
pub struct Paths {
    /// `uname -r`.
    pub release: String,
    /// "multi-uprobe links" (6.6) or "perf-event uprobes".
    pub uprobes: &'static str,
    /// "`mmap_lock` tracepoint" or "uprobes": how munmap and mprotect are
    /// seen.
    pub munmap_mprotect: &'static str,
    /// How the BPF programs loop over frames: "`bpf_loop`" or "bounded
    /// loops, in stages, without stack reuse" (see [`Loops`]).
    pub loops: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernels_btf_has_bpf_loop() {
        let checked = check_btf(Path::new(kernel_btf::VMLINUX_BTF), "6.18");
        assert!(
            matches!(checked, Ok(Loops::BpfLoop)),
            "the development kernel has bpf_loop, but: {checked:?}"
        );
    }

    #[test]
    fn an_empty_btf_is_no_btf_in_one_line() {
        let error = check_btf(Path::new("/dev/null"), "6.1.0-57-amd64").expect_err("/dev/null holds no BTF");
        let line = error.to_string();
        assert!(matches!(error, KernelError::NoBtf { .. }), "{line}");
        assert!(
            line.contains("6.1.0-57-amd64") && line.contains("CONFIG_DEBUG_INFO_BTF") && !line.contains('\n'),
            "{line}"
        );
    }
}
