//! The user stack, walked through the frame pointers.
//!
//! Walked here rather than with `bpf_get_stack`: the helper costs about
//! 0.7 µs per call on this path, mostly setting up the perf callchain
//! buffer, where a walk of a few frames costs a fraction of that. Both
//! follow the same chain.

use aya_ebpf::{helpers::bpf_probe_read_user, EbpfContext};
use memleak_common::{StackFrames, MAX_STACK_DEPTH};

/// The caller's return address, then each saved return address along the
/// frame-pointer chain, as `bpf_get_stack` would give them. Stops at a
/// frame pointer that is null, misaligned or does not move up the stack,
/// or that cannot be read. Returns the number of frames. Only for return
/// probes: there the registers are the caller's, so its frame is the first.
/// Keeps at most `limit` frames.
pub fn walk_user_stack<C: EbpfContext>(ctx: &C, frames: &mut StackFrames, limit: u32) -> u32 {
    let regs = crate::registers::Registers::of(ctx);
    let (ip, mut frame_pointer) = (regs.instruction_pointer(), regs.frame_pointer());
    frames[0] = ip;
    let depth_limit = limit as usize;
    let mut depth = 1;
    #[allow(
        clippy::needless_range_loop,
        reason = "a constant bound and an index are what the verifier follows"
    )]
    for index in 1..MAX_STACK_DEPTH {
        if index >= depth_limit || frame_pointer == 0 || frame_pointer % 8 != 0 {
            break;
        }
        // SAFETY: a read of user memory, which the helper makes fault-safe.
        let Ok([caller_frame, return_address]) =
            (unsafe { bpf_probe_read_user(frame_pointer as *const [u64; 2]) })
        else {
            break;
        };
        let return_address = super::code_address(return_address);
        if return_address == 0 {
            break;
        }
        frames[index] = return_address;
        depth = index + 1;
        if caller_frame <= frame_pointer {
            break;
        }
        frame_pointer = caller_frame;
    }
    depth as u32
}
