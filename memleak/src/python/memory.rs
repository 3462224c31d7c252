//! Reading a live process's memory through `/proc/PID/mem`: no ptrace
//! stop, the process runs on. Needs what ptrace would (root, or
//! `CAP_SYS_PTRACE`, or being its parent).

use std::{fs::File, os::unix::fs::FileExt as _};

/// A place to read another process's memory from: a live process, or a
/// test's made-up memory.
pub trait Memory {
    /// Fills `buffer` from `address`, all of it or an error.
    fn read_exact_at(&self, address: u64, buffer: &mut [u8]) -> std::io::Result<()>;
}

impl Memory for ProcessMemory {
    fn read_exact_at(&self, address: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        self.read_exact(address, buffer)
    }
}

pub struct ProcessMemory {
    mem: File,
}

impl ProcessMemory {
    pub fn open(pid: u32) -> std::io::Result<Self> {
        Ok(Self { mem: File::open(format!("/proc/{pid}/mem"))? })
    }

    /// `buffer.len()` bytes at `address`, all of them or an error.
    pub fn read_exact(&self, address: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        self.mem.read_exact_at(buffer, address)
    }

    pub fn bytes(&self, address: u64, length: usize) -> std::io::Result<Vec<u8>> {
        let mut buffer = vec![0; length];
        self.read_exact(address, &mut buffer)?;
        Ok(buffer)
    }

    pub fn u64(&self, address: u64) -> std::io::Result<u64> {
        let mut buffer = [0; 8];
        self.read_exact(address, &mut buffer)?;
        Ok(u64::from_le_bytes(buffer))
    }

    pub fn u32(&self, address: u64) -> std::io::Result<u32> {
        let mut buffer = [0; 4];
        self.read_exact(address, &mut buffer)?;
        Ok(u32::from_le_bytes(buffer))
    }

    /// The NUL-terminated string at `address`, if it ends within `limit`
    /// bytes (read byte by byte up to the end of its page at most, then on).
    pub fn c_string(&self, address: u64, limit: usize) -> std::io::Result<Vec<u8>> {
        let mut text = Vec::new();
        let mut at = address;
        while text.len() < limit {
            let to_page_end = usize::try_from(4096 - at % 4096).unwrap_or(1).min(limit - text.len());
            let chunk = self.bytes(at, to_page_end)?;
            if let Some(end) = chunk.iter().position(|&byte| byte == 0) {
                text.extend_from_slice(&chunk[..end]);
                return Ok(text);
            }
            text.extend_from_slice(&chunk);
            at += to_page_end as u64;
        }
        Err(std::io::Error::other(format!("no string end within {limit} bytes at {address:#x}")))
    }
}
