//! The kernel's own count of a process's memory, read without touching
//! the process: `/proc/PID/statm`, a line of page counts the kernel keeps
//! up to date as it maps pages, so a read costs the same whatever the
//! process's size (`smaps_rollup` walks every mapping's pages, and costs
//! milliseconds for a big process).

use std::{fs, io::Read as _};

/// A process's resident memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    /// Every page resident.
    pub total: u64,
    /// Of them, anonymous: the heap, stacks and private mappings, what a
    /// leak grows.
    pub anon: u64,
}

/// Process `pid`'s resident memory; `None` for a process gone, a zombie
/// or a kernel thread (no memory of its own).
pub fn resident(pid: u32, page_size: u64) -> Option<Resident> {
    // Seven numbers: read into a buffer on the stack, no allocation.
    let mut buffer = [0u8; 160];
    let mut file = fs::File::open(format!("/proc/{pid}/statm")).ok()?;
    let length = file.read(&mut buffer).ok()?;
    parse_statm(std::str::from_utf8(&buffer[..length]).ok()?, page_size)
}

/// `size resident shared text lib data dt`, in pages; `shared` counts the
/// file-backed and shared-memory pages resident, the rest is anonymous.
fn parse_statm(statm: &str, page_size: u64) -> Option<Resident> {
    let mut pages = statm.split_ascii_whitespace().map(|field| field.parse::<u64>().ok());
    let (size, resident, shared) = (pages.next()??, pages.next()??, pages.next()??);
    if size == 0 {
        return None;
    }
    Some(Resident { total: resident * page_size, anon: resident.saturating_sub(shared) * page_size })
}

/// The pids in /proc now.
pub fn pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries.flatten().filter_map(|entry| entry.file_name().to_str()?.parse().ok()).collect()
}

/// The size of a page, in bytes.
pub fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|size| *size > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_memory_is_resident_less_shared() {
        assert_eq!(
            parse_statm("12000 3000 1000 50 0 5000 0\n", 4096),
            Some(Resident { total: 3000 * 4096, anon: 2000 * 4096 })
        );
    }

    #[test]
    fn a_kernel_thread_has_no_memory_of_its_own() {
        assert_eq!(parse_statm("0 0 0 0 0 0 0\n", 4096), None);
        assert_eq!(parse_statm("", 4096), None);
    }

    #[test]
    fn this_process_has_anonymous_memory() {
        let own = resident(std::process::id(), page_size()).expect("this process's statm");
        assert!(own.anon > 0 && own.anon <= own.total, "{own:?}");
    }
}
