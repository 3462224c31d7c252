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
