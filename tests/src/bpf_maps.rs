//! What memleak's BPF maps hold, counted from outside memleak: the maps are
//! found through the process's open descriptors and dumped with bpftool,
//! so a test does not take memleak's own word for them.

use std::{collections::BTreeMap, fs, process::Command};

use serde_json::Value;

/// The number of entries in each map process `pid` holds open, by map
/// name (as the kernel keeps it: at most 15 characters).
pub fn map_entries(pid: u32) -> BTreeMap<String, usize> {
    let mut entries = BTreeMap::new();
    for fd in fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("read memleak's fdinfo").flatten() {
        let info = fs::read_to_string(fd.path()).unwrap_or_default();
        let Some(id) = info.lines().find_map(|line| line.strip_prefix("map_id:")) else { continue };
        let id = id.trim();
        let show = bpftool(&["map", "show", "id", id]);
        let name = show["name"].as_str().unwrap_or("").to_owned();
        // Ring buffers and arrays have no entries to count.
        if !matches!(show["type"].as_str(), Some("hash" | "lru_hash")) {
            continue;
        }
        let dump = bpftool(&["map", "dump", "id", id]);
        entries.insert(name, dump.as_array().map_or(0, Vec::len));
    }
    entries
}

fn bpftool(args: &[&str]) -> Value {
    let output = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .expect("run bpftool (cargo xtask test installs it)");
    assert!(output.status.success(), "bpftool {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("bpftool {args:?} printed no JSON: {error}"))
}
