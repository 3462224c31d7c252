//! Empty programs, for user space to price a uprobe's trap on this
//! machine: attached to a function of memleak's own, in memleak alone,
//! called in a loop and timed (`bpf::overhead`). They do nothing, so what
//! a call costs more with them is the kernel's trap and its return.

use aya_ebpf::{
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};

#[uprobe]
pub fn calibration_entry(_ctx: ProbeContext) -> u32 {
    0
}

#[uretprobe]
pub fn calibration_return(_ctx: RetProbeContext) -> u32 {
    0
}
