//! Read-only globals that user space sets at load time.

use memleak_common::MAX_STACK_DEPTH;

#[unsafe(no_mangle)]
static MIN_SIZE: u64 = 0;
#[unsafe(no_mangle)]
static MAX_SIZE: u64 = u64::MAX;
#[unsafe(no_mangle)]
static STACK_DEPTH: u32 = MAX_STACK_DEPTH as u32;

// Volatile reads: without them the compiler folds in the defaults above
// and the values the loader writes would never be seen.

pub fn min_size() -> u64 {
    // SAFETY: a plain read of an initialised static.
    unsafe { core::ptr::read_volatile(&MIN_SIZE) }
}

pub fn max_size() -> u64 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&MAX_SIZE) }
}

/// Frames to keep, clamped so the verifier sees a bounded copy size.
pub fn stack_depth() -> u32 {
    // SAFETY: as above.
    let depth = unsafe { core::ptr::read_volatile(&STACK_DEPTH) };
    if depth == 0 || depth > MAX_STACK_DEPTH as u32 {
        MAX_STACK_DEPTH as u32
    } else {
        depth
    }
}
