//! --trace: one line per allocation and free, as they happen.

use std::io::{self, Write};

use memleak_common::{FunctionSet, TraceEvent};
use serde::Serialize;

use super::options::Format;
use crate::clock;

/// A trace event as printed.
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct TraceLine {
    /// Wall-clock time of the event, ms since the Unix epoch.
    pub time_unix_ms: u64,
    pub pid: u32,
    pub tid: u32,
    /// The function called; aliases that share code are joined with `|`
    /// (`aligned_alloc|memalign`): their calls cannot be told apart.
    pub event: String,
    /// Bytes requested; for a free, the size recorded at allocation, or
    /// null if the block was not recorded.
    pub size: Option<u64>,
    /// The block returned (null for a failed allocation) or freed.
    pub address: Option<String>,
    /// The call releases a block (free, sdallocx...).
    #[serde(skip)]
    pub is_free: bool,
}

impl TraceLine {
    /// `wall_minus_monotonic_ns` converts the BPF clock to wall time.
    pub fn new(event: &TraceEvent, wall_minus_monotonic_ns: i128) -> TraceLine {
        let functions = FunctionSet(event.function);
        let names: Vec<&str> = functions.functions().map(|function| function.name).collect();
        let is_free = functions.intersects(FunctionSet::RELEASING);
        let wall_ns = i128::from(event.timestamp_ns) + wall_minus_monotonic_ns;
        TraceLine {
            time_unix_ms: u64::try_from(wall_ns / 1_000_000).unwrap_or(0),
            pid: event.tgid,
            tid: event.tid,
            event: if names.is_empty() { "?".to_owned() } else { names.join("|") },
            size: (!is_free || event.size != 0).then_some(event.size),
            address: (event.address != 0).then(|| format!("{:#x}", event.address)),
            is_free,
        }
    }
}

pub fn render(line: &TraceLine, format: Format, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    if format == Format::Json {
        serde_json::to_writer(&mut *out, line)?;
        return writeln!(out);
    }
    let time = clock::local_time_ms(line.time_unix_ms);
    let address = line.address.as_deref().unwrap_or("NULL");
    match (line.is_free, line.size) {
        (true, Some(size)) => {
            writeln!(
                out,
                "[{time}] {}/{} {}({address}) releases {size} bytes",
                line.pid, line.tid, line.event
            )
        }
        (true, None) => writeln!(out, "[{time}] {}/{} {}({address})", line.pid, line.tid, line.event),
        (false, size) => {
            let function = &line.event;
            writeln!(out, "[{time}] {}/{} {function}({}) = {address}", line.pid, line.tid, size.unwrap_or(0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(function: u32, address: u64, size: u64) -> TraceEvent {
        TraceEvent { timestamp_ns: 2_000_000, address, size, tgid: 7, tid: 8, function, _padding: 0 }
    }

    #[test]
    fn events_name_their_function_and_wall_time() {
        let line = TraceLine::new(&event(1 << 1, 0x1000, 400), 1_000_000_000_000);
        assert_eq!(line.event, "calloc");
        assert_eq!(line.time_unix_ms, 1_000_002);
        assert_eq!((line.size, line.address.as_deref()), (Some(400), Some("0x1000")));
        let failed = TraceLine::new(&event(1, 0, 1 << 40), 0);
        assert_eq!((failed.event.as_str(), failed.address), ("malloc", None));
        let untracked_free = TraceLine::new(&event(1 << 9, 0x2000, 0), 0);
        assert_eq!((untracked_free.event.as_str(), untracked_free.size), ("free", None));
        let alias = TraceLine::new(&event(1 << 5 | 1 << 6, 0x3000, 64), 0);
        assert_eq!(alias.event, "aligned_alloc|memalign");
    }

    #[test]
    fn text_lines_read_like_calls() {
        let mut out = Vec::new();
        render(&TraceLine::new(&event(1, 0x1000, 64), 0), Format::Text, &mut out).unwrap();
        render(&TraceLine::new(&event(1 << 9, 0x1000, 64), 0), Format::Text, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().map(|line| line.split_once("] ").unwrap().1).collect();
        assert_eq!(lines, ["7/8 malloc(64) = 0x1000", "7/8 free(0x1000) releases 64 bytes"]);
    }
}
