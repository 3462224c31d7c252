//! Loops whose body the verifier checks once, where the kernel can.
//!
//! `bpf_loop` (Linux 5.17) calls a step function with the loop's index and
//! a context: the verifier checks the step once, whatever the count. The
//! build for older kernels (feature `legacy-kernels`) has no such helper,
//! nor callbacks (5.13): there the same steps run in a bounded loop,
//! which the verifier follows iteration by iteration, so each loop's
//! bound is a constant as small as the loop allows.

use core::ffi::c_void;

/// A loop's step: given the index and the loop's context, 0 to go on, 1
/// to end the loop.
pub type Step = extern "C" fn(u64, *mut c_void) -> i64;

/// Calls `step` with `0..count` and `context` until it returns 1; `count`
/// is at most `MAX`.
#[expect(clippy::inline_always, reason = "the context must stay in the caller's frame for the verifier")]
#[inline(always)]
pub fn repeat<T, const MAX: u32>(count: u32, step: Step, context: &mut T) {
    let context = core::ptr::from_mut(context).cast::<c_void>();
    #[cfg(not(feature = "legacy-kernels"))]
    // SAFETY: the helper calls `step` at most `count` times with
    // `context`, a live pointer for the whole call.
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(count.min(MAX), step as *mut c_void, context, 0);
    }
    #[cfg(feature = "legacy-kernels")]
    for index in 0..MAX {
        if index >= count || step(u64::from(index), context) != 0 {
            break;
        }
    }
}
