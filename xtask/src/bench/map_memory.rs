//! The memory of a process's BPF maps, as the kernel charges it
//! (bpftool's `bytes_memlock`: on recent kernels what a map really uses,
//! so a hash map without preallocation grows with its entries).

use std::{collections::BTreeSet, process::Command};

use anyhow::{bail, Context as _, Result};

/// Memory of each map, largest first.
pub struct MapMemory {
    pub maps: Vec<(String, u64)>,
}

impl MapMemory {
    pub fn total(&self) -> u64 {
        self.maps.iter().map(|(_, bytes)| bytes).sum()
    }
}

/// The maps process `pid` holds open, each counted once.
pub fn of_process(pid: u32) -> Result<MapMemory> {
    let ids = map_ids(pid)?;
    let output =
        Command::new("bpftool").args(["map", "show", "-j"]).output().context("cannot run bpftool")?;
    if !output.status.success() {
        bail!("bpftool map show failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    let all: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("bpftool's map list is not JSON")?;
    let mut maps: Vec<(String, u64)> = all
        .as_array()
        .context("bpftool's map list is not an array")?
        .iter()
        .filter(|map| map["id"].as_u64().is_some_and(|id| ids.contains(&id)))
        .map(|map| {
            let name = map["name"].as_str().unwrap_or("(unnamed)").to_owned();
            (name, map["bytes_memlock"].as_u64().unwrap_or(0))
        })
        .collect();
    maps.sort_by_key(|(_, bytes)| std::cmp::Reverse(*bytes));
    Ok(MapMemory { maps })
}

/// The entries of every hash map process `pid` holds open, dumped with
/// bpftool: the allocations, stacks and processes memleak keeps in BPF.
/// Arrays and rings, fixed in size, are not counted.
pub fn entries_of_process(pid: u32) -> Result<u64> {
    let mut entries = 0;
    for id in map_ids(pid)? {
        let id = id.to_string();
        let show = bpftool_json(&["map", "show", "id", &id])?;
        if !matches!(show["type"].as_str(), Some("hash" | "lru_hash" | "percpu_hash")) {
            continue;
        }
        let dump = bpftool_json(&["map", "dump", "id", &id])?;
        entries += dump.as_array().map_or(0, Vec::len) as u64;
    }
    Ok(entries)
}

fn bpftool_json(args: &[&str]) -> Result<serde_json::Value> {
    let output = Command::new("bpftool").arg("-j").args(args).output().context("cannot run bpftool")?;
    if !output.status.success() {
        bail!("bpftool {args:?} failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    serde_json::from_slice(&output.stdout).with_context(|| format!("bpftool {args:?} printed no JSON"))
}

/// Map ids from /proc/PID/fdinfo: a map's fd says `map_id:\tN` there.
fn map_ids(pid: u32) -> Result<BTreeSet<u64>> {
    let directory = format!("/proc/{pid}/fdinfo");
    let entries = std::fs::read_dir(&directory).with_context(|| format!("cannot list {directory}"))?;
    // Fds closed while we look are simply skipped.
    let ids = entries
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .filter_map(|info| info.lines().find_map(|line| line.strip_prefix("map_id:")?.trim().parse().ok()))
        .collect();
    Ok(ids)
}
