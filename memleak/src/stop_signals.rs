//! SIGINT and SIGTERM are held, blocked, from memleak's first instruction
//! until its BPF programs are loaded, then honoured: a signal at any
//! moment of the start is a clean end, never a failure. Before memleak's
//! handlers are in, their default action would kill memleak with nothing
//! said; during loading, the verifier gives up on a pending signal with
//! EAGAIN, and the start failed with "the kernel rejected BPF program".
//! Held, the signal waits in the kernel and reaches the handlers once the
//! programs are in, and the run ends as on any other signal.

use std::sync::OnceLock;

/// The signal mask memleak was started with.
struct Mask(libc::sigset_t);

// SAFETY: a sigset_t is plain data, only read once set.
unsafe impl Sync for Mask {}
// SAFETY: as above.
unsafe impl Send for Mask {}

static STARTED_WITH: OnceLock<Mask> = OnceLock::new();

/// Blocks SIGINT and SIGTERM in the calling thread (memleak's main thread,
/// before any other exists, so in every thread memleak starts meanwhile).
pub fn hold() {
    // SAFETY: the sets are initialized by sigemptyset before use, and
    // pthread_sigmask only reads and writes them.
    unsafe {
        let mut stop: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut stop);
        libc::sigaddset(&raw mut stop, libc::SIGINT);
        libc::sigaddset(&raw mut stop, libc::SIGTERM);
        let mut before: libc::sigset_t = std::mem::zeroed();
        if libc::pthread_sigmask(libc::SIG_BLOCK, &raw const stop, &raw mut before) == 0 {
            let _ = STARTED_WITH.set(Mask(before));
        }
    }
}

/// Lets held signals through: those that came meanwhile are delivered now.
pub fn release() {
    if let Some(mask) = STARTED_WITH.get() {
        // SAFETY: restores a mask pthread_sigmask gave.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &raw const mask.0, std::ptr::null_mut()) };
    }
}

/// The mask memleak was started with, for a command it runs: a blocked
/// signal stays blocked across exec, and the command must get its
/// signals as it would without memleak.
pub fn started_with() -> Option<libc::sigset_t> {
    STARTED_WITH.get().map(|mask| mask.0)
}
