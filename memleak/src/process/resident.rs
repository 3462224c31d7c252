//! What a process's resident memory is made of, from `/proc/PID/smaps`:
//! its anonymous memory, and of it the heap and the allocator's arenas
//! and the thread stacks; and the pages of the files it maps. Read for
//! the processes memleak traces, once a report: beside the blocks memleak
//! tracks, it tells a leak from memory the allocator keeps.
//!
//! glibc's arenas and thread stacks are anonymous mappings; their layout
//! tells them apart. An arena other than the main one (`[heap]`) reserves
//! 64 MiB with no access and opens it as it grows: its open part lies
//! right below a no-access mapping of its own. A thread stack lies right
//! above its guard, a no-access mapping of a page or a few.

use crate::model::ResidentMemory;

/// Guards larger than this are not a thread stack's (glibc's default is
/// one page; a program may ask for more).
const MAX_GUARD: u64 = 1 << 20;

/// Process `pid`'s resident memory; `None` if its smaps cannot be read
/// (it is gone, or a kernel thread).
pub fn read(pid: u32) -> Option<ResidentMemory> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    Some(parse(&smaps))
}

/// One mapping of smaps: its range, whether no access is allowed, whether
/// it maps no file, its name, and its resident and anonymous bytes.
#[derive(Debug, Default)]
struct Mapping<'a> {
    start: u64,
    end: u64,
    no_access: bool,
    anonymous: bool,
    name: &'a str,
    resident: u64,
    anon: u64,
}

fn parse(smaps: &str) -> ResidentMemory {
    let mappings = mappings(smaps);
    let mut memory = ResidentMemory::default();
    for (index, mapping) in mappings.iter().enumerate() {
        memory.resident_bytes += mapping.resident;
        memory.anon_bytes += mapping.anon;
        memory.file_bytes += mapping.resident.saturating_sub(mapping.anon);
        let below = index.checked_sub(1).and_then(|below| mappings.get(below));
        let above = mappings.get(index + 1);
        match mapping.name {
            "[heap]" => memory.heap_bytes += mapping.anon,
            "[stack]" => memory.thread_stack_bytes += mapping.anon,
            _ if mapping.anonymous && !mapping.no_access => {
                let guarded = below.is_some_and(|guard| {
                    guard.anonymous
                        && guard.no_access
                        && guard.end == mapping.start
                        && guard.end - guard.start <= MAX_GUARD
                });
                let reserved_above =
                    above.is_some_and(|rest| rest.anonymous && rest.no_access && rest.start == mapping.end);
                if guarded {
                    memory.thread_stack_bytes += mapping.anon;
                } else if reserved_above {
                    memory.heap_bytes += mapping.anon;
                }
            }
            _ => {}
        }
    }
    memory
}

fn mappings(smaps: &str) -> Vec<Mapping<'_>> {
    let mut mappings: Vec<Mapping<'_>> = Vec::new();
    for line in smaps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((start, end)) = first.split_once('-').filter(|(start, _)| !start.ends_with(':')) {
            let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16)) else {
                continue;
            };
            let permissions = fields.next().unwrap_or_default();
            // offset, device, inode, then the name, which may hold spaces.
            let inode = fields.nth(2).unwrap_or("0");
            let name = line.splitn(6, char::is_whitespace).nth(5).map_or("", str::trim);
            mappings.push(Mapping {
                start,
                end,
                no_access: permissions.starts_with("---"),
                anonymous: inode == "0" && !name.starts_with('/'),
                name,
                ..Mapping::default()
            });
            continue;
        }
        let Some(mapping) = mappings.last_mut() else { continue };
        let mut kilobytes = || fields.next().and_then(|value| value.parse::<u64>().ok()).unwrap_or(0) * 1024;
        match first {
            "Rss:" => mapping.resident = kilobytes(),
            "Anonymous:" => mapping.anon = kilobytes(),
            _ => {}
        }
    }
    mappings
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping's smaps entry with its resident and anonymous kB.
    fn entry(range: &str, permissions: &str, inode: &str, name: &str, rss: u64, anon: u64) -> String {
        format!(
            "{range} {permissions} 00000000 00:00 {inode}    {name}\nSize: 8 kB\nRss: {rss} kB\nPss: {rss} kB\n\
             Anonymous: {anon} kB\nVmFlags: rd wr mr mw me ac\n"
        )
    }

    #[test]
    fn the_heap_arenas_thread_stacks_and_files_are_told_apart() {
        let smaps = [
            entry("555555554000-555555556000", "r-xp", "1234", "/usr/bin/app", 8, 0),
            entry("555555556000-555555557000", "rw-p", "1234", "/usr/bin/app", 4, 4),
            entry("555555600000-555555700000", "rw-p", "0", "[heap]", 1000, 1000),
            // An arena's open part, below the rest of its reservation.
            entry("7ffff0000000-7ffff2000000", "rw-p", "0", "", 3000, 3000),
            entry("7ffff2000000-7ffff4000000", "---p", "0", "", 0, 0),
            // A thread's guard page, then its stack.
            entry("7ffff6000000-7ffff6001000", "---p", "0", "", 0, 0),
            entry("7ffff6001000-7ffff6801000", "rw-p", "0", "", 40, 40),
            // A block of its own (a big malloc): other anonymous memory.
            entry("7ffff7000000-7ffff7100000", "rw-p", "0", "", 500, 500),
            entry("7ffff7e00000-7ffff7f00000", "r--p", "99", "/usr/lib/locale/locale archive", 200, 0),
            entry("7ffffffde000-7ffffffff000", "rw-p", "0", "[stack]", 12, 12),
        ]
        .concat();
        let memory = parse(&smaps);
        assert_eq!(
            memory,
            ResidentMemory {
                resident_bytes: (8 + 4 + 1000 + 3000 + 40 + 500 + 200 + 12) * 1024,
                anon_bytes: (4 + 1000 + 3000 + 40 + 500 + 12) * 1024,
                heap_bytes: (1000 + 3000) * 1024,
                thread_stack_bytes: (40 + 12) * 1024,
                file_bytes: (8 + 200) * 1024,
            }
        );
    }

    #[test]
    fn this_process_has_resident_memory_and_a_stack() {
        let own = read(std::process::id()).expect("this process's smaps");
        assert!(
            own.anon_bytes > 0 && own.thread_stack_bytes > 0 && own.anon_bytes <= own.resident_bytes,
            "{own:?}"
        );
    }
}
