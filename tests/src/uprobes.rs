//! Where memleak's uprobes are: its multi-uprobe links as the kernel
//! describes them in `/proc/PID/fdinfo`, and the breakpoints they leave
//! in a process's memory.

use std::{fs, os::unix::fs::FileExt as _};

/// One multi-uprobe link memleak holds.
#[derive(Debug)]
pub struct MultiLink {
    /// The process it fires for; 0 for every process.
    pub pid: u32,
    pub path: String,
    /// File offsets of its sites.
    pub offsets: Vec<u64>,
}

/// The multi-uprobe links process `holder` (memleak) has open.
pub fn multi_links(holder: u32) -> Vec<MultiLink> {
    link_infos(holder)
        .iter()
        .filter(|info| matches!(field(info, "link_type"), Some("uprobe_multi" | "uretprobe_multi")))
        .map(|info| MultiLink {
            pid: field(info, "pid").and_then(|pid| pid.parse().ok()).unwrap_or(0),
            path: field(info, "path").unwrap_or_default().to_owned(),
            // After the "cookie offset ref_ctr_offset" header, a row per site.
            offsets: info
                .lines()
                .skip_while(|line| !line.starts_with("cookie"))
                .skip(1)
                .filter_map(|row| row.split_whitespace().nth(1))
                .filter_map(|offset| u64::from_str_radix(offset.trim_start_matches("0x"), 16).ok())
                .collect(),
        })
        .collect()
}

/// How many BPF links of type `kind` (`perf`, `uprobe_multi`...)
/// process `holder` has open.
pub fn links_of_type(holder: u32, kind: &str) -> usize {
    link_infos(holder).iter().filter(|info| field(info, "link_type") == Some(kind)).count()
}

/// Whether process `holder` has placed uprobes, through BPF links of
/// either kind or, on kernels without perf-event links (before 5.15),
/// through perf events its programs are set on, which are no links.
pub fn placed_uprobes(holder: u32) -> bool {
    if links_of_type(holder, "uprobe_multi") + links_of_type(holder, "perf") > 0 {
        return true;
    }
    let Ok(fds) = fs::read_dir(format!("/proc/{holder}/fd")) else { return false };
    fds.flatten().any(|fd| {
        fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == "anon_inode:[perf_event]")
    })
}

fn link_infos(holder: u32) -> Vec<String> {
    let Ok(entries) = fs::read_dir(format!("/proc/{holder}/fdinfo")) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| fs::read_to_string(entry.path()).ok())
        .filter(|info| info.contains("link_type:"))
        .collect()
}

fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')).map(str::trim)
}

/// The byte process `pid` sees at `offset` of the file it maps at `path`
/// (as its maps name it): 0xcc where a uprobe placed its breakpoint.
pub fn byte_in_process(pid: u32, path: &str, offset: u64) -> u8 {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let address = maps
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(5) != Some(&path) {
                return None;
            }
            let (start, end) = fields[0].split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            let mapped_from = u64::from_str_radix(fields[2], 16).ok()?;
            (offset >= mapped_from && offset < mapped_from + (end - start))
                .then(|| start + offset - mapped_from)
        })
        .unwrap_or_else(|| panic!("pid {pid} does not map offset {offset:#x} of {path}"));
    let mut byte = [0_u8];
    fs::File::open(format!("/proc/{pid}/mem")).unwrap().read_exact_at(&mut byte, address).unwrap();
    byte[0]
}

/// The byte at `offset` of the file at `path`.
pub fn byte_in_file(path: &str, offset: u64) -> u8 {
    let mut byte = [0_u8];
    fs::File::open(path).unwrap().read_exact_at(&mut byte, offset).unwrap();
    byte[0]
}
