//! Reading the BPF ring buffers (--trace events, mmap calls) as the kernel
//! fills them, without polling.

use std::io;

use aya::{
    maps::{MapData, RingBuf},
    Pod,
};
use tokio::io::{unix::AsyncFd, Interest};

/// A ring buffer of fixed-size records of one type.
pub struct EventRing {
    ring: AsyncFd<RingBuf<MapData>>,
}

impl EventRing {
    pub fn new(ring: RingBuf<MapData>) -> io::Result<Self> {
        // SAFETY: the ring buffer owns its descriptor and is only dropped
        // inside the AsyncFd, so the descriptor outlives the registration.
        let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) };
        Ok(Self { ring: ring.map_err(|error| error.into_parts().1)? })
    }

    /// Takes every record waiting.
    pub fn drain<T: Pod>(&mut self) -> Vec<T> {
        let ring = self.ring.get_mut();
        let mut records = Vec::new();
        while let Some(item) = ring.next() {
            if item.len() >= size_of::<T>() {
                // SAFETY: the BPF side writes whole records of type T, plain
                // data; read_unaligned needs no alignment.
                records.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<T>()) });
            }
        }
        records
    }
}

/// Waits until `ring` has records; forever if there is no ring. The
/// caller drains it right away: the next wait then blocks until the
/// kernel wakes us again.
pub async fn readable(ring: &mut Option<EventRing>) -> io::Result<()> {
    let Some(ring) = ring.as_mut() else { return std::future::pending().await };
    let mut guard = ring.ring.readable_mut().await?;
    guard.clear_ready();
    Ok(())
}
