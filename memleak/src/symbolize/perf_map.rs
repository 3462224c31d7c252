//! Names for JIT-compiled code, from the `/tmp/perf-PID.map` that a
//! runtime writes when asked (node `--perf-basic-prof`, the JVM with
//! `perf-map-agent`, `LuaJIT`, .NET): one `START SIZE NAME` line per piece of
//! code, in hex, appended as code is compiled.

use std::{
    collections::BTreeMap,
    io::{Read as _, Seek as _, SeekFrom},
    path::PathBuf,
};

use crate::process::files;

/// Bytes of a perf map read at most: a runtime that writes more is not
/// allowed to make memleak read without end.
const MAX_BYTES: u64 = 256 << 20;

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
    /// An unfinished last line, kept for the next read.
    partial: String,
}

impl PerfMap {
    /// The perf map of process `pid`, whose pid in its own namespace is
    /// `namespace_pid`: the runtime names the file by the pid it sees, in
    /// its own /tmp.
    pub fn of_process(pid: u32, namespace_pid: Option<u32>) -> Self {
        let path = PathBuf::from(format!("/tmp/perf-{}.map", namespace_pid.unwrap_or(pid)));
        Self { pid, path, code: BTreeMap::new(), read: 0, partial: String::new() }
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

    /// Reads what was appended since the last read.
    fn read_more(&mut self) {
        let Ok(mut file) = files::open_in_root(self.pid, &self.path) else { return };
        if file.seek(SeekFrom::Start(self.read)).is_err() {
            return;
        }
        let mut text = String::new();
        let room = MAX_BYTES.saturating_sub(self.read);
        let Ok(read) = file.take(room).read_to_string(&mut text) else { return };
        self.read += read as u64;
        let text = std::mem::take(&mut self.partial) + &text;
        let (complete, partial) = text.rsplit_once('\n').unwrap_or(("", &text));
        partial.clone_into(&mut self.partial);
        for line in complete.lines() {
            if let Some((start, size, name)) = parse_line(line) {
                self.code.insert(start, (start.saturating_add(size), name.to_owned()));
            }
        }
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
    use super::*;

    #[test]
    fn code_is_named_as_the_map_grows() {
        let dir = std::env::temp_dir().join(format!("memleak-perf-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("perf-1.map");
        std::fs::write(&path, "7f2c96fc7080 1cc JS:^leakBuffers /app/leak.js:2:21\nnot a line\n1000 10 Bui")
            .unwrap();
        let mut map = PerfMap {
            pid: std::process::id(),
            path: path.clone(),
            code: BTreeMap::new(),
            read: 0,
            partial: String::new(),
        };
        assert_eq!(map.name(0x7f2c_96fc_718d), Some(("JS:^leakBuffers /app/leak.js:2:21", 0x10d)));
        assert_eq!(map.name(0x7f2c_96fc_724c), None, "past its end");
        assert_eq!(map.name(0x1004), None, "the last line is not finished yet");
        let mut file = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        std::io::Write::write_all(
            &mut file,
            b"ltin:Abort\n7f2c96fc7080 20 JS:*leakBuffers /app/leak.js:2:21\n",
        )
        .unwrap();
        assert_eq!(map.name(0x1004), Some(("Builtin:Abort", 4)), "appended lines are read");
        // Code compiled again at the same place: the newer line names it.
        assert_eq!(map.name(0x7f2c_96fc_7081), Some(("JS:*leakBuffers /app/leak.js:2:21", 1)));
        assert_eq!(map.name(0x7f2c_96fc_7100), None, "the newer code is shorter");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
