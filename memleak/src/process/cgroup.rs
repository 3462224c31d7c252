//! --cgroup: every process of a cgroup v2 and of its descendant cgroups,
//! including those that join after memleak started. A pod's or a slice's
//! directory holds few processes of its own: its containers and services
//! are in child cgroups. Each process found is probed on its own, as with
//! -p: a process outside the cgroup that maps the same libc never takes
//! a probe's trap. The processes they fork are followed at once.

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

/// The id of the cgroup2 hierarchy's root, whose directory is inode 1.
const ROOT_CGROUP_ID: u64 = 1;

/// A cgroup v2 directory.
pub struct Cgroup {
    pub path: PathBuf,
    /// The id BPF's `bpf_get_current_cgroup_id()` returns: the directory's
    /// inode number on cgroup2.
    pub id: u64,
    /// How deep the cgroup is below the hierarchy's root (the root is 0),
    /// which `bpf_get_current_ancestor_cgroup_id` takes. `None` when the
    /// root is out of sight (a cgroup namespace, a mount of a subtree):
    /// then only the processes directly in the cgroup are traced.
    pub level: Option<u32>,
}

impl Cgroup {
    pub fn open(path: &Path) -> Result<Self, CgroupError> {
        let not_cgroup = || CgroupError::NotCgroup2(path.to_path_buf());
        // A file of cgroupfs (cgroup.procs, say) is on cgroup2 too, and has
        // an inode, but no task is ever in it: only a directory is a cgroup.
        let metadata = std::fs::metadata(path).map_err(|_| not_cgroup())?;
        if !metadata.is_dir() || !is_cgroup2(path) {
            return Err(not_cgroup());
        }
        let id = metadata.ino();
        let level = level_of(path);
        if level.is_none() {
            log::warn!(
                "cannot see the root of the cgroup hierarchy above {} (a cgroup namespace?): \
                 only processes directly in it are traced, not those of its descendant cgroups",
                path.display()
            );
        }
        Ok(Self { path: path.to_path_buf(), id, level })
    }

    /// The id of the cgroup at `path` now: another than `id` once the
    /// cgroup was removed and made again there (a container restarted);
    /// `None` while there is none.
    pub fn id_now(&self) -> Option<u64> {
        let metadata = std::fs::metadata(&self.path).ok()?;
        metadata.is_dir().then(|| metadata.ino())
    }

    /// The processes in the cgroup and, when its level is known, in its
    /// descendant cgroups now, each once, those directly in it first.
    pub fn processes(&self) -> Vec<CgroupProcess> {
        let mut found = Vec::new();
        let mut seen = HashSet::new();
        let mut directories = vec![(self.path.clone(), false)];
        while let Some((directory, in_descendant)) = directories.pop() {
            // A cgroup removed meanwhile has no processes left to trace.
            let procs = std::fs::read_to_string(directory.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|line| line.trim().parse().ok()) {
                // A threaded cgroup lists the process of each of its
                // threads: the same pid can be in several.
                if seen.insert(pid) {
                    found.push(CgroupProcess { pid, in_descendant });
                }
            }
            if self.level.is_none() {
                break;
            }
            let Ok(entries) = std::fs::read_dir(&directory) else { continue };
            // cgroupfs has no symlinks: every directory is a child cgroup.
            let children = entries
                .flatten()
                .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
                .map(|entry| (entry.path(), true));
            directories.extend(children);
        }
        found
    }
}

/// A process found in a cgroup's subtree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupProcess {
    pub pid: u32,
    /// In a descendant cgroup, not directly in the one traced.
    pub in_descendant: bool,
}

/// How many directories `path` is below the root of its cgroup2
/// hierarchy: its ancestors on the same cgroup2 mount, up to one whose id
/// is the root's. `None` if the mount's top is not the hierarchy's root
/// (a cgroup namespace or a bind mount of a subtree): the kernel counts
/// levels from the real root, which is then out of sight.
fn level_of(path: &Path) -> Option<u32> {
    let mut directory = std::fs::canonicalize(path).ok()?;
    let device = std::fs::metadata(&directory).ok()?.dev();
    let mut level = 0;
    loop {
        let parent = directory.parent().map(Path::to_path_buf);
        match parent {
            Some(parent) if is_cgroup2(&parent) && std::fs::metadata(&parent).ok()?.dev() == device => {
                directory = parent;
                level += 1;
            }
            _ => break,
        }
    }
    (std::fs::metadata(&directory).ok()?.ino() == ROOT_CGROUP_ID).then_some(level)
}

/// `f_type` is signed on glibc and unsigned on musl: compared widened.
fn is_cgroup2(path: &Path) -> bool {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs fills in the struct it is given.
    let mut stats: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    unsafe {
        libc::statfs(c_path.as_ptr(), &raw mut stats) == 0
            && i128::from(stats.f_type) == i128::from(CGROUP2_SUPER_MAGIC)
    }
}
