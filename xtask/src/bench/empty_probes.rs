//! Empty BPF programs on uprobes: what the kernel's trap alone costs at a
//! set of probe sites, the floor under any uprobe tracer probing there.
//!
//! bpftrace would say this in three lines, but Debian 12's bpftrace 0.17
//! is built without "unsafe uprobe" support and refuses a probe inside a
//! function ("Can't check if uprobe is in proper place"), by symbol offset
//! or by address alike, even with --unsafe; and memleak probes `free` past
//! its first instruction. So the probes are attached here, the way aya
//! attaches memleak's: through the kernel's uprobe PMU, by file offset,
//! for one process.

use std::{
    ffi::CString,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::PathBuf,
};

use anyhow::{bail, Context as _, Result};

/// One place to probe.
#[derive(Clone, Debug)]
pub struct Site {
    pub object: PathBuf,
    pub file_offset: u64,
    /// A return probe (at the function's start) rather than an entry probe.
    pub on_return: bool,
}

/// Attached probes; dropping this detaches them.
pub struct EmptyProbes {
    _events: Vec<OwnedFd>,
    _program: OwnedFd,
}

impl EmptyProbes {
    /// Probes `sites` for process `pid` (and its threads) only.
    pub fn attach(sites: &[Site], pid: u32) -> Result<Self> {
        let program = load_empty_program()?;
        let pmu = UprobePmu::read()?;
        let events =
            sites.iter().map(|site| attach(&pmu, site, pid, &program)).collect::<Result<Vec<_>>>()?;
        Ok(Self { _events: events, _program: program })
    }
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// _IOW('$', 8, __u32) and _IO('$', 0) from `linux/perf_event.h`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;

/// The head of `union bpf_attr` that `BPF_PROG_LOAD` reads; the kernel
/// takes the fields a shorter struct leaves out as zero.
#[repr(C)]
struct ProgramLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// `struct perf_event_attr` up to config2 (`PERF_ATTR_SIZE_VER1`).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    /// Bit 0: start disabled.
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// For a uprobe: a pointer to the object's path.
    config1: u64,
    /// For a uprobe: the file offset to probe.
    config2: u64,
}

/// `r0 = 0; exit`.
fn load_empty_program() -> Result<OwnedFd> {
    let instructions: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    let mut name = [0u8; 16];
    name[..11].copy_from_slice(b"bench_empty");
    let attr = ProgramLoad {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: u32::try_from(instructions.len()).context("too many instructions")?,
        insns: instructions.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
    };
    // SAFETY: attr and the memory it points to outlive the call; the size
    // passed is attr's.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, &attr, size_of::<ProgramLoad>()) };
    owned_fd(fd, "loading an empty BPF program")
}

/// The kernel's uprobe PMU: its perf event type, and which config bit
/// asks for a return probe.
struct UprobePmu {
    kind: u32,
    return_bit: u32,
}

impl UprobePmu {
    fn read() -> Result<Self> {
        let read = |file: &str| {
            let path = format!("/sys/bus/event_source/devices/uprobe/{file}");
            std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))
        };
        let kind = read("type")?.trim().parse().context("uprobe PMU type")?;
        // "config:0"
        let format = read("format/retprobe")?;
        let return_bit = format
            .trim()
            .strip_prefix("config:")
            .and_then(|bit| bit.parse().ok())
            .with_context(|| format!("unexpected uprobe retprobe format {format:?}"))?;
        Ok(Self { kind, return_bit })
    }
}

fn attach(pmu: &UprobePmu, site: &Site, pid: u32, program: &OwnedFd) -> Result<OwnedFd> {
    let path = CString::new(site.object.as_os_str().as_encoded_bytes())?;
    let attr = PerfEventAttr {
        kind: pmu.kind,
        #[allow(clippy::cast_possible_truncation, reason = "a struct of a few dozen bytes")]
        size: size_of::<PerfEventAttr>() as u32,
        config: u64::from(site.on_return) << pmu.return_bit,
        flags: 1,
        config1: path.as_ptr() as u64,
        config2: site.file_offset,
        ..Default::default()
    };
    let what = format!("probing {} at {:#x}", site.object.display(), site.file_offset);
    // SAFETY: attr and the path it points to outlive the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_perf_event_open, &attr, pid as libc::pid_t, -1, -1, PERF_FLAG_FD_CLOEXEC)
    };
    let event = owned_fd(fd, &what)?;
    for (request, argument) in [(PERF_EVENT_IOC_SET_BPF, program.as_raw_fd()), (PERF_EVENT_IOC_ENABLE, 0)] {
        // SAFETY: both requests take an int argument, not a pointer.
        if unsafe { libc::ioctl(event.as_raw_fd(), request as _, argument) } < 0 {
            return Err(std::io::Error::last_os_error()).context(what);
        }
    }
    Ok(event)
}

fn owned_fd(result: libc::c_long, what: &str) -> Result<OwnedFd> {
    if result < 0 {
        return Err(std::io::Error::last_os_error()).context(what.to_owned());
    }
    let Ok(fd) = i32::try_from(result) else { bail!("{what}: fd {result} out of range") };
    // SAFETY: the kernel just gave us this fd, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
