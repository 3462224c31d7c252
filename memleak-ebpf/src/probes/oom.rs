//! The OOM killer's pick: its victim's tgid goes in `OOM_VICTIMS`, for
//! user space to keep the victim's last report as its exit is seen. The
//! tracepoint fires at the pick, before the victim gets its SIGKILL, and
//! only then: it costs nothing the rest of the time.
//!
//! Kernels before 6.8 pass the victim's pid; later ones its task, whose
//! tgid is read at the offset user space found in the kernel's BTF. User
//! space loads the one program that matches the kernel's prototype.

use aya_ebpf::{
    helpers::{bpf_probe_read_kernel, generated::bpf_ktime_get_ns},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};

use crate::{maps::OOM_VICTIMS, tunables};

/// `mark_victim(int pid)`: the pid of the task picked, its process's
/// leader (or the thread that still had the memory).
#[btf_tracepoint(function = "mark_victim")]
pub fn oom_victim_by_pid(ctx: BtfTracePointContext) -> i32 {
    let pid: u64 = ctx.arg(0);
    note_victim(pid as u32);
    0
}

/// `mark_victim(struct task_struct *task, uid_t uid)`.
#[btf_tracepoint(function = "mark_victim")]
pub fn oom_victim_by_task(ctx: BtfTracePointContext) -> i32 {
    let task: u64 = ctx.arg(0);
    let tgid_field = (task + u64::from(tunables::task_tgid_offset())) as *const u32;
    // SAFETY: reads the task's tgid at the offset user space found in the
    // kernel's BTF; a kernel read that fails cleanly on a bad address.
    if let Ok(tgid) = unsafe { bpf_probe_read_kernel(tgid_field) } {
        note_victim(tgid);
    }
    0
}

fn note_victim(tgid: u32) {
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let _ = OOM_VICTIMS.insert(tgid, now, 0);
}
