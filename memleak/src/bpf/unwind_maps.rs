//! The unwind maps seen from user space: the array of rows, written
//! through a memory mapping of it, each process's table of executable
//! mappings, and the walkers' requests to rescan a process.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use aya::maps::{HashMap, MapData};
use memleak_common::{ProcessMappings, UnwindRow, PROCESS_MAPPINGS_MAP, UNWIND_RESCANS_MAP, UNWIND_ROWS_MAP};

use super::{Tracer, TracerError};

/// The rows array, mapped into memleak's memory: writing a row is a store,
/// where a map update would be a system call per row (about 0.8 µs each,
/// 0.2 s for a large process).
pub struct RowArray {
    rows: NonNull<UnwindRow>,
    capacity: u32,
    mapped_bytes: usize,
}

impl RowArray {
    /// Rows the array holds.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Writes `rows` from index `first` on; false if they do not fit.
    pub fn write(&mut self, first: u32, rows: &[UnwindRow]) -> bool {
        let end = u64::from(first) + rows.len() as u64;
        if end > u64::from(self.capacity) {
            return false;
        }
        // SAFETY: `first..end` is within the mapping, which is writable and
        // lives as long as `self`; rows are plain data. BPF programs read
        // only ranges that no process table points at yet, or no longer.
        unsafe {
            std::ptr::copy_nonoverlapping(rows.as_ptr(), self.rows.as_ptr().add(first as usize), rows.len());
        }
        true
    }
}

#[cfg(test)]
impl RowArray {
    /// A row array in plain memory, as BPF would map it, for tests.
    pub fn for_tests() -> Self {
        let capacity = 4096;
        let mapped_bytes = capacity as usize * size_of::<UnwindRow>();
        // SAFETY: an anonymous private mapping, unmapped by `drop`.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(address, libc::MAP_FAILED);
        let rows = NonNull::new(address.cast::<UnwindRow>()).expect("a mapping");
        Self { rows, capacity, mapped_bytes }
    }
}

impl Drop for RowArray {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `Tracer::unwind_rows`, unmapped once.
        unsafe { libc::munmap(self.rows.as_ptr().cast(), self.mapped_bytes) };
    }
}

impl Tracer {
    /// Maps the rows array into memory; `rows` is its size, as loaded.
    pub fn unwind_rows(&self, rows: u32) -> Result<RowArray, TracerError> {
        let map = self.ebpf.map(UNWIND_ROWS_MAP).ok_or(TracerError::Missing(UNWIND_ROWS_MAP))?;
        let aya::maps::Map::Array(data) = map else { return Err(TracerError::Missing(UNWIND_ROWS_MAP)) };
        let page = 4096;
        let bytes = (rows as usize * size_of::<UnwindRow>()).div_ceil(page) * page;
        let fd = data.fd().as_fd().as_raw_fd();
        // SAFETY: a shared mapping of an mmapable BPF array's descriptor, of
        // no more than its size rounded up to a page, as the kernel allows.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(TracerError::MapRows(std::io::Error::last_os_error()));
        }
        let rows_pointer =
            NonNull::new(address.cast::<UnwindRow>()).ok_or(TracerError::Missing(UNWIND_ROWS_MAP))?;
        Ok(RowArray { rows: rows_pointer, capacity: rows, mapped_bytes: bytes })
    }

    /// Gives process `pid` its table of executable mappings, replacing the
    /// one it had.
    pub fn set_process_mappings(&mut self, pid: u32, mappings: &ProcessMappings) -> Result<(), TracerError> {
        let mut map: HashMap<&mut MapData, u32, ProcessMappings> = self.map_mut(PROCESS_MAPPINGS_MAP)?;
        map.insert(pid, mappings, 0)
            .map_err(|source| TracerError::WriteMap { map: PROCESS_MAPPINGS_MAP, source })
    }

    /// The processes whose walks met code in no mapping they know, each
    /// once: the requests are taken.
    pub fn take_rescan_requests(&mut self) -> Result<Vec<u32>, TracerError> {
        let mut map: HashMap<&mut MapData, u32, u64> = self.map_mut(UNWIND_RESCANS_MAP)?;
        let pids: Vec<u32> = map.keys().filter_map(Result::ok).collect();
        for pid in &pids {
            let _ = map.remove(pid);
        }
        Ok(pids)
    }
}
