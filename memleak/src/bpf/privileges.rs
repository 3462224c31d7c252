//! What memleak needs of privileges, said as this kernel makes it.
//!
//! Loading BPF programs and reading kernel stacks takes `CAP_BPF` and
//! `CAP_PERFMON` (or `CAP_SYS_ADMIN`, which root has). A process's uprobes
//! take nothing more where memleak attaches them through multi-uprobe
//! links (Linux 6.6), as it does by default; the perf-event uprobes it
//! falls back to, on older kernels or with `MEMLEAK_PERF_EVENT_UPROBES`
//! set, are refused without `CAP_SYS_ADMIN` (measured on 6.18: `-p` of a
//! process of memleak's own user, as that user with `CAP_BPF` and
//! `CAP_PERFMON`, gets EACCES from `perf_event_open`; with `CAP_SYS_ADMIN`
//! alone it traces). Tracing the kernel takes the kernel's addresses in
//! /proc/kallsyms besides, which it hides from a process without
//! `CAP_SYSLOG` (unless `kernel.perf_event_paranoid` is 1 or less):
//! without them memleak names none of the kernel's frames and cannot leave
//! out its own map refills: measured here as nobody, 3 s of the kernel
//! counted about 500,000 allocations, nearly all its own refills (a few
//! thousand with `CAP_SYSLOG`), and no frame had a name. So the advice
//! depends on what is traced, on how uprobes will be attached and on what
//! /proc/kallsyms shows, and says which applies.

use super::multi_uprobes::{self, PERF_EVENT_UPROBES};

/// What a run traces, as far as privileges go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traced {
    /// The kernel's allocations: no uprobes.
    Kernel,
    /// Processes (`-p`, `-c`, `--cgroup`, `memleak serve`): uprobes.
    Processes,
}

/// How uprobes would be attached, and so what they need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Uprobes {
    /// Multi-uprobe links: `CAP_BPF` and `CAP_PERFMON` are enough.
    Links,
    /// Perf-event uprobes, which need `CAP_SYS_ADMIN`; why they are used.
    PerfEvents(&'static str),
}

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Fails, before any work, with the one line of advice a user needs
/// when memleak lacks what tracing `traced` takes on this kernel.
pub fn check(traced: Traced) -> Result<(), String> {
    let effective = effective_capabilities();
    let has = |capability: u32| effective & (1 << capability) != 0;
    let can_load = has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON));
    if !can_load {
        return Err(format!("permission denied loading BPF programs: {}", advice(traced, false)));
    }
    match traced {
        Traced::Kernel if !kernel_addresses_visible() => {
            Err("tracing the kernel takes CAP_SYSLOG too here: /proc/kallsyms hides the kernel's addresses \
             from memleak, which could then name none of its frames nor leave out its own map refills \
             (run as root, or add CAP_SYSLOG)"
                .to_owned())
        }
        Traced::Kernel => Ok(()),
        Traced::Processes if has(CAP_SYS_ADMIN) => Ok(()),
        Traced::Processes => match uprobes(true) {
            Uprobes::Links => Ok(()),
            Uprobes::PerfEvents(why) => Err(format!(
                "tracing a process takes root or CAP_SYS_ADMIN here: {why}, and perf-event uprobes need it \
                 (the kernel takes {})",
                kernel_capabilities()
            )),
        },
    }
}

/// What to do when the kernel refuses memleak its BPF programs or maps,
/// or a process's uprobes: run as root, or with the capabilities that
/// this kernel wants for `traced`, and why.
pub fn advice(traced: Traced, can_load: bool) -> String {
    match (traced, uprobes(can_load)) {
        (Traced::Kernel, _) => format!("run as root, or with {}", kernel_capabilities()),
        (Traced::Processes, Uprobes::Links) => {
            "run as root, or with CAP_BPF and CAP_PERFMON (enough on this kernel, which has multi-uprobe links)"
                .to_owned()
        }
        (Traced::Processes, Uprobes::PerfEvents(why)) => format!(
            "run as root, or with CAP_SYS_ADMIN: {why}, and perf-event uprobes need it (the kernel takes {})",
            kernel_capabilities()
        ),
    }
}

/// What tracing the kernel takes of this process: `CAP_SYSLOG` too when
/// /proc/kallsyms hides the kernel's addresses from it.
fn kernel_capabilities() -> &'static str {
    if kernel_addresses_visible() {
        "CAP_BPF and CAP_PERFMON"
    } else {
        "CAP_BPF, CAP_PERFMON and CAP_SYSLOG"
    }
}

/// Whether /proc/kallsyms shows this process the kernel's addresses:
/// the first text symbol's is not 0.
fn kernel_addresses_visible() -> bool {
    use std::io::BufRead as _;
    let Ok(kallsyms) = std::fs::File::open("/proc/kallsyms") else { return false };
    std::io::BufReader::new(kallsyms)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            let (address, kind) = (fields.next()?, fields.next()?);
            kind.eq_ignore_ascii_case("t")
                .then(|| u64::from_str_radix(address, 16).is_ok_and(|address| address != 0))
        })
        .unwrap_or(false)
}

/// How the tracer will attach uprobes (`Tracer::load` decides so too).
/// `can_load`: memleak may load BPF programs, and so asks the kernel
/// itself; otherwise the kernel's BTF says whether it knows the links.
fn uprobes(can_load: bool) -> Uprobes {
    if std::env::var_os(PERF_EVENT_UPROBES).is_some() {
        return Uprobes::PerfEvents("MEMLEAK_PERF_EVENT_UPROBES is set");
    }
    let kernel_knows = kernel_knows_uprobe_multi();
    let links_work = if can_load { multi_uprobes::supported() } else { kernel_knows };
    uprobes_as(links_work, kernel_knows)
}

/// `uprobes`, from whether a multi-uprobe link could be made (or, unable
/// to load, whether the kernel knows them) and whether the kernel knows
/// them: one it knows but refused was denied by a seccomp profile or a
/// security module, as a container runtime's default profile does.
fn uprobes_as(links_work: bool, kernel_knows: bool) -> Uprobes {
    match (links_work, kernel_knows) {
        (true, _) => Uprobes::Links,
        (false, true) => Uprobes::PerfEvents(
            "the kernel has multi-uprobe links but refused memleak one (a seccomp profile or a security module \
             denies them)",
        ),
        (false, false) => Uprobes::PerfEvents("this kernel has no multi-uprobe links (Linux 6.6)"),
    }
}

/// The kernel's BTF, which anyone may read, names the attach type of
/// multi-uprobe links in the kernel's `enum bpf_attach_type`; a kernel
/// without BTF is taken at its version.
fn kernel_knows_uprobe_multi() -> bool {
    const NAME: &[u8] = b"BPF_TRACE_UPROBE_MULTI\0";
    match std::fs::read("/sys/kernel/btf/vmlinux") {
        Ok(btf) => btf.windows(NAME.len()).any(|window| window == NAME),
        Err(_) => release_at_least(&kernel_release(), (6, 6)),
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default()
}

/// `6.18.44-fc` is at least 6.6.
fn release_at_least(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut numbers = release.trim().split(['.', '-']).map(|part| part.parse::<u32>().ok());
    match (numbers.next().flatten(), numbers.next().flatten()) {
        (Some(got_major), Some(got_minor)) => (got_major, got_minor) >= (major, minor),
        _ => false,
    }
}

/// memleak's effective capabilities, from /proc/self/status.
fn effective_capabilities() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container runtime's default seccomp profile denies the links on
    /// a kernel that has them: memleak said the kernel lacked them.
    #[test]
    fn links_refused_by_a_kernel_that_has_them_are_said_to_be_denied() {
        assert_eq!(uprobes_as(true, true), Uprobes::Links);
        let Uprobes::PerfEvents(why) = uprobes_as(false, true) else { panic!("perf events") };
        assert!(why.contains("seccomp"), "{why}");
        assert_eq!(
            uprobes_as(false, false),
            Uprobes::PerfEvents("this kernel has no multi-uprobe links (Linux 6.6)")
        );
    }

    #[test]
    fn releases_are_compared_by_major_then_minor() {
        assert!(release_at_least("6.18.44-fc-v1045", (6, 6)));
        assert!(release_at_least("6.6.0", (6, 6)));
        assert!(!release_at_least("6.1.0-28-amd64", (6, 6)));
        assert!(!release_at_least("5.15.0", (6, 6)));
        assert!(!release_at_least("", (6, 6)));
    }

    /// The tests run as root, which sees the kernel's addresses.
    #[test]
    fn the_kernel_needs_no_more_than_cap_bpf_and_cap_perfmon_where_its_addresses_show() {
        assert!(kernel_addresses_visible());
        assert_eq!(advice(Traced::Kernel, false), "run as root, or with CAP_BPF and CAP_PERFMON");
    }
}
