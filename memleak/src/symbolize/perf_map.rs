//! Names for JIT-compiled code, from the `/tmp/perf-PID.map` that a
//! runtime writes when asked (node `--perf-basic-prof`, the JVM with
//! `perf-map-agent`, `LuaJIT`, .NET): one `START SIZE NAME` line per piece of
//! code, in hex, appended as code is compiled.
//!
//! The traced program writes the file, as much as it likes, and memleak
//! (one run, or a daemon following many processes) keeps what it read: so
//! what all perf maps hold together is one budget of the whole memleak
//! process, of which each map may hold a share. A map that would pass its
//! share or the budget, or that has a line longer than any a runtime
//! writes, is dropped whole (its memory given back, its JIT code left
//! unnamed), and memleak says so once. The file is read in small chunks,
//! and an unfinished last line is kept only up to that line bound.

use std::{
    collections::BTreeMap,
    io::{Read as _, Seek as _, SeekFrom},
    path::PathBuf,
    sync::atomic::{AtomicU64, Ordering},
};

use crate::process::files;

/// What the perf maps of this process hold together, at most.
static BUDGET: Budget = Budget::new(256 << 20, 64 << 20);

/// Bytes of one perf map read at most: reading costs time even when what
/// is read replaces what was held.
const MAX_READ: u64 = 256 << 20;

/// The longest line a map may have: a runtime's names (a Java method's
/// signature, a C++ template) are far shorter.
const MAX_LINE: usize = 16 << 10;

/// Bytes read from the file at a time.
const CHUNK: usize = 64 << 10;

/// What an entry costs beyond its name's bytes: its share of a tree node
/// (start, end and the name's `String`, in nodes about half full when
/// filled in order) and the allocator's rounding and header of the name.
/// Measured: 400,000 entries added in order, names of 35 bytes, took 128
/// bytes each besides their names.
const ENTRY_COST: u64 = 128;

/// Memory that maps draw from, and what one of them may hold.
pub struct Budget {
    limit: u64,
    share: u64,
    held: AtomicU64,
}

/// Why a map could not hold more.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    Share,
    Budget,
}

impl Budget {
    const fn new(limit: u64, share: u64) -> Self {
        Self { limit, share, held: AtomicU64::new(0) }
    }

    /// Takes `bytes` more for a map that holds `held` now, if that passes
    /// neither its share nor the budget.
    fn take(&self, held: u64, bytes: u64) -> Result<(), Refusal> {
        if held + bytes > self.share {
            return Err(Refusal::Share);
        }
        let mut total = self.held.load(Ordering::Relaxed);
        loop {
            if total + bytes > self.limit {
                return Err(Refusal::Budget);
            }
            match self.held.compare_exchange_weak(total, total + bytes, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => total = now,
            }
        }
    }

    fn give_back(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The perf map of one process, read as it grows.
pub struct PerfMap {
    /// The process whose root `path` is in: the file is the process's, and
    /// its links lead where they would for the process.
    pid: u32,
    path: PathBuf,
    /// Code by start address: (end, name). A later line for the same start
    /// (code freed and compiled again there) replaces the earlier one.
    code: BTreeMap<u64, (u64, String)>,
    /// Bytes of the file read so far; it is only ever appended to.
    read: u64,
    /// An unfinished last line, kept for the next read; at most
    /// `MAX_LINE` bytes.
    partial: Vec<u8>,
    /// What `code` holds, as drawn from `budget`.
    held: u64,
    budget: &'static Budget,
    /// Dropped for passing a bound: never read again.
    dropped: bool,
}

impl PerfMap {
    /// The perf map of process `pid`, whose pid in its own namespace is
    /// `namespace_pid`: the runtime names the file by the pid it sees, in
    /// its own /tmp.
    pub fn of_process(pid: u32, namespace_pid: Option<u32>) -> Self {
        let path = PathBuf::from(format!("/tmp/perf-{}.map", namespace_pid.unwrap_or(pid)));
        Self::with_budget(pid, path, &BUDGET)
    }

    fn with_budget(pid: u32, path: PathBuf, budget: &'static Budget) -> Self {
        Self {
            pid,
            path,
            code: BTreeMap::new(),
            read: 0,
            partial: Vec::new(),
            held: 0,
            budget,
            dropped: false,
        }
    }

    /// The name of the code at `address`, and how far into it the address
    /// is. The file is read again first if it grew and the address is not
    /// known yet.
    pub fn name(&mut self, address: u64) -> Option<(&str, u64)> {
        if self.find(address).is_none() {
            self.read_more();
        }
        let (start, (_, name)) = self.find(address)?;
        Some((name.as_str(), address - start))
    }

    fn find(&self, address: u64) -> Option<(u64, &(u64, String))> {
        let (&start, code) = self.code.range(..=address).next_back()?;
        (address < code.0).then_some((start, code))
    }

    /// Reads what was appended since the last read, a chunk at a time.
    fn read_more(&mut self) {
        if self.dropped {
            return;
        }
        let Ok(mut file) = files::open_in_root(self.pid, &self.path) else { return };
        if file.seek(SeekFrom::Start(self.read)).is_err() {
            return;
        }
        let mut file = file.take(MAX_READ.saturating_sub(self.read));
        let mut chunk = vec![0u8; CHUNK];
        loop {
            let read = match file.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            self.read += read as u64;
            let mut rest = &chunk[..read];
            while let Some(end) = rest.iter().position(|&byte| byte == b'\n') {
                let line = &rest[..end];
                rest = &rest[end + 1..];
                if self.partial.len() + line.len() > MAX_LINE {
                    return self.drop_map("has a line longer than 16 KiB");
                }
                let added = if self.partial.is_empty() {
                    self.add_line(line)
                } else {
                    let mut whole = std::mem::take(&mut self.partial);
                    whole.extend_from_slice(line);
                    self.add_line(&whole)
                };
                if let Err(refusal) = added {
                    return self.drop_map(match refusal {
                        Refusal::Share => "passed its share of memory (64 MiB)",
                        Refusal::Budget => "would pass the memory all perf maps may hold together (256 MiB)",
                    });
                }
            }
            if self.partial.len() + rest.len() > MAX_LINE {
                return self.drop_map("has a line longer than 16 KiB");
            }
            self.partial.extend_from_slice(rest);
        }
    }

    /// Adds the code a line names, if it is a perf map line.
    fn add_line(&mut self, line: &[u8]) -> Result<(), Refusal> {
        let Some((start, size, name)) = std::str::from_utf8(line).ok().and_then(parse_line) else {
            return Ok(());
        };
        let cost = ENTRY_COST + name.len() as u64;
        self.budget.take(self.held, cost)?;
        self.held += cost;
        if let Some((_, replaced)) = self.code.insert(start, (start.saturating_add(size), name.to_owned())) {
            let freed = ENTRY_COST + replaced.len() as u64;
            self.budget.give_back(freed);
            self.held -= freed;
        }
        Ok(())
    }

    /// Gives back all the map holds, and says why, once: it is never read
    /// again.
    fn drop_map(&mut self, why: &str) {
        log::warn!(
            "the perf map {} of pid {} {why}: it is left out, and the JIT code it names goes unnamed",
            self.path.display(),
            self.pid
        );
        self.dropped = true;
        self.code = BTreeMap::new();
        self.partial = Vec::new();
        self.budget.give_back(self.held);
        self.held = 0;
    }
}

impl Drop for PerfMap {
    fn drop(&mut self) {
        self.budget.give_back(self.held);
    }
}

/// `7f2c96fc7080 1cc JS:^leakBuffers /app/leak.js:2:21`
fn parse_line(line: &str) -> Option<(u64, u64, &str)> {
    let mut fields = line.splitn(3, ' ');
    let start = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    let size = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    let name = fields.next()?.trim();
    (!name.is_empty()).then_some((start, size, name))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memleak-perf-map-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn code_is_named_as_the_map_grows() {
        static BUDGET: Budget = Budget::new(1 << 20, 1 << 20);
        let dir = scratch("grows");
        let path = dir.join("perf-1.map");
        std::fs::write(&path, "7f2c96fc7080 1cc JS:^leakBuffers /app/leak.js:2:21\nnot a line\n1000 10 Bui")
            .unwrap();
        let mut map = PerfMap::with_budget(std::process::id(), path.clone(), &BUDGET);
        assert_eq!(map.name(0x7f2c_96fc_718d), Some(("JS:^leakBuffers /app/leak.js:2:21", 0x10d)));
        assert_eq!(map.name(0x7f2c_96fc_724c), None, "past its end");
        assert_eq!(map.name(0x1004), None, "the last line is not finished yet");
        let mut file = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"ltin:Abort\n7f2c96fc7080 20 JS:*leakBuffers /app/leak.js:2:21\n").unwrap();
        assert_eq!(map.name(0x1004), Some(("Builtin:Abort", 4)), "appended lines are read");
        // Code compiled again at the same place: the newer line names it.
        assert_eq!(map.name(0x7f2c_96fc_7081), Some(("JS:*leakBuffers /app/leak.js:2:21", 1)));
        assert_eq!(map.name(0x7f2c_96fc_7100), None, "the newer code is shorter");
        let names = ["JS:*leakBuffers /app/leak.js:2:21", "Builtin:Abort"];
        let held: u64 = names.iter().map(|name| ENTRY_COST + name.len() as u64).sum();
        assert_eq!(
            (map.held, BUDGET.held.load(Ordering::Relaxed)),
            (held, held),
            "the replaced line given back"
        );
        drop(map);
        assert_eq!(BUDGET.held.load(Ordering::Relaxed), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_map_past_its_share_is_dropped_and_gives_its_memory_back() {
        // Room for two entries of 8-byte names in a map, three in all.
        static BUDGET: Budget = Budget::new(3 * (ENTRY_COST + 8), 2 * (ENTRY_COST + 8));
        let dir = scratch("share");
        let lines = |names: &[&str]| {
            names
                .iter()
                .enumerate()
                .map(|(at, name)| format!("{at}0 10 {name}"))
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        };
        std::fs::write(dir.join("first"), lines(&["first-00", "first-01"])).unwrap();
        std::fs::write(dir.join("second"), lines(&["second-0", "second-1", "second-2"])).unwrap();
        let pid = std::process::id();
        let mut first = PerfMap::with_budget(pid, dir.join("first"), &BUDGET);
        assert_eq!(first.name(0x10), Some(("first-01", 0)));
        let mut second = PerfMap::with_budget(pid, dir.join("second"), &BUDGET);
        assert_eq!(second.name(0x10), None, "its second entry passes the budget");
        assert!(second.dropped && second.code.is_empty());
        assert_eq!(BUDGET.held.load(Ordering::Relaxed), 2 * (ENTRY_COST + 8), "the first map's alone");
        std::fs::write(dir.join("second"), lines(&["second-0", "second-1"])).unwrap();
        assert_eq!(second.name(0x10), None, "a dropped map is not read again");
        drop(first);
        let mut third = PerfMap::with_budget(pid, dir.join("second"), &BUDGET);
        assert_eq!(third.name(0x10), Some(("second-1", 0)), "the memory given back serves another map");
        drop(third);
        // With the budget all free, a map still holds no more than its share.
        std::fs::write(dir.join("third"), lines(&["third-00", "third-01", "third-02"])).unwrap();
        let mut fourth = PerfMap::with_budget(pid, dir.join("third"), &BUDGET);
        assert_eq!(fourth.name(0x00), None, "its third entry passes its share");
        assert!(fourth.dropped);
        assert_eq!(BUDGET.held.load(Ordering::Relaxed), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_endless_line_is_not_kept() {
        static BUDGET: Budget = Budget::new(1 << 20, 1 << 20);
        let dir = scratch("line");
        let path = dir.join("perf-1.map");
        let mut text = b"10 10 before\n".to_vec();
        text.resize(text.len() + MAX_LINE + 1, b'x');
        std::fs::write(&path, &text).unwrap();
        let mut map = PerfMap::with_budget(std::process::id(), path, &BUDGET);
        assert_eq!(map.name(0x10), None, "the whole map is dropped, the line before too");
        assert!(map.dropped && map.partial.capacity() == 0 && map.code.is_empty());
        assert_eq!(BUDGET.held.load(Ordering::Relaxed), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
