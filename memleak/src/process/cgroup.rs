//! --cgroup: every process of a cgroup v2, including those that join it
//! after memleak started. Probes go once on each distinct allocator file,
//! for every process that maps it; the BPF side keeps only the cgroup's
//! tasks. A container's libc is usually a file of its own image, so the
//! probes seldom fire outside it.

use std::{
    collections::HashSet,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{0} is not a cgroup v2 directory (look under /sys/fs/cgroup, or /sys/fs/cgroup/unified)")]
    NotCgroup2(PathBuf),
}

/// cgroup2's filesystem magic, from include/uapi/linux/magic.h.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// A cgroup v2 directory and the allocator files already probed for it.
pub struct Cgroup {
    pub path: PathBuf,
    /// The id BPF's `bpf_get_current_cgroup_id()` returns: the directory's
    /// inode number on cgroup2.
    pub id: u64,
    /// (device, inode) of every allocator object probed.
    probed: HashSet<(u64, u64)>,
}

impl Cgroup {
    pub fn open(path: &Path) -> Result<Self, CgroupError> {
        let not_cgroup = || CgroupError::NotCgroup2(path.to_path_buf());
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| not_cgroup())?;
        // SAFETY: statfs fills in the struct it is given.
        let mut stats: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a valid out-pointer.
        if unsafe { libc::statfs(c_path.as_ptr(), &raw mut stats) } != 0
            || stats.f_type != CGROUP2_SUPER_MAGIC
        {
            return Err(not_cgroup());
        }
        let id = std::fs::metadata(path).map_err(|_| not_cgroup())?.ino();
        Ok(Self { path: path.to_path_buf(), id, probed: HashSet::new() })
    }

    /// The processes in the cgroup now.
    pub fn processes(&self) -> Vec<u32> {
        let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        procs.lines().filter_map(|line| line.trim().parse().ok()).collect()
    }

    /// Records that `object` is probed; `false` if it already was.
    pub fn first_probe_of(&mut self, object: &Path) -> bool {
        match std::fs::metadata(object) {
            Ok(meta) => self.probed.insert((meta.dev(), meta.ino())),
            Err(_) => true,
        }
    }
}
