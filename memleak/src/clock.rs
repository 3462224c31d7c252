//! The two clocks a report needs: wall time for people, and
//! `CLOCK_MONOTONIC`, which stamps what BPF records.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn wall_ms() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// `CLOCK_MONOTONIC` in nanoseconds: `bpf_ktime_get_ns`'s clock.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills in the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// What to add to a BPF timestamp to get wall-clock nanoseconds.
pub fn wall_minus_monotonic_ns() -> i128 {
    let wall_ns = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_nanos() as i128);
    wall_ns - i128::from(monotonic_ns())
}

/// HH:MM:SS.mmm in the local time zone, for trace lines.
pub fn local_time_ms(unix_ms: u64) -> String {
    format!("{}.{:03}", local_time(unix_ms), unix_ms % 1000)
}

/// HH:MM:SS in the local time zone, as bcc prints it.
#[allow(
    deprecated,
    reason = "the libc crate marks time_t deprecated on musl, where it is 64 bits as on glibc x86_64 already"
)]
pub fn local_time(unix_ms: u64) -> String {
    let seconds = (unix_ms / 1000) as libc::time_t;
    // SAFETY: `tm` is plain data that localtime_r fills in.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call.
    if unsafe { libc::localtime_r(&raw const seconds, &raw mut tm) }.is_null() {
        return "??:??:??".to_owned();
    }
    format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
}
