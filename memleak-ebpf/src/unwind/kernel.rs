//! The kernel stack, through the helper: kernel frames are few and the
//! helper knows the kernel's own unwinder.

use aya_ebpf::{helpers::generated::bpf_get_stack, EbpfContext};
use memleak_common::StackFrames;

use crate::tunables;

/// Fills `frames` with the kernel stack; returns the number of frames.
pub fn kernel_stack<C: EbpfContext>(ctx: &C, frames: &mut StackFrames) -> Option<u32> {
    let size = tunables::stack_depth() * 8;
    // SAFETY: `frames` holds MAX_STACK_DEPTH u64s, and `size` is at most
    // that many bytes.
    let copied = unsafe { bpf_get_stack(ctx.as_ptr(), frames.as_mut_ptr().cast(), size, 0) };
    (copied >= 0).then_some((copied / 8) as u32)
}
