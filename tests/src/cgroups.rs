//! Cgroup v2 directories of a test's own, for `--cgroup` and the daemon's
//! cgroup selectors.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// A fresh cgroup v2 directory, removed when dropped (with its children,
/// its processes moved back to the test's own cgroup first).
pub struct TestCgroup(PathBuf);

impl TestCgroup {
    /// A cgroup named for the test process and thread: tests run in
    /// parallel threads of one process, each with its own.
    pub fn new() -> Self {
        let thread = format!("{:?}", std::thread::current().id()).replace(|c: char| !c.is_alphanumeric(), "");
        Self::named(&format!("memleak-test-{}-{thread}", std::process::id()))
    }

    /// A cgroup named `name` at the top of the cgroup v2 hierarchy, found
    /// from /proc/self/mountinfo: a pure cgroup v2 machine mounts it at
    /// /sys/fs/cgroup, a hybrid one at /sys/fs/cgroup/unified.
    pub fn named(name: &str) -> Self {
        let path = cgroup2_root().join(name);
        fs::create_dir_all(&path).expect("create a cgroup");
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Its path as memleak's `--cgroup` takes it.
    pub fn arg(&self) -> &str {
        self.0.to_str().expect("a cgroup path in UTF-8")
    }

    pub fn join(&self, pid: u32) {
        fs::write(self.0.join("cgroup.procs"), pid.to_string()).expect("move a process into the cgroup");
    }

    /// A child cgroup, as a pod or a slice has one per container or
    /// service; removed with its parent.
    #[must_use]
    pub fn child(&self, name: &str) -> Self {
        let path = self.0.join(name);
        fs::create_dir(&path).expect("create a child cgroup");
        Self(path)
    }
}

/// Where the cgroup v2 hierarchy is mounted.
fn cgroup2_root() -> PathBuf {
    let mounts = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    mounts
        .lines()
        .find_map(|line| {
            let (fields, filesystem) = line.split_once(" - ")?;
            filesystem.starts_with("cgroup2 ").then(|| fields.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .expect("a cgroup v2 hierarchy mounted")
}

impl Default for TestCgroup {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Children first: rmdir refuses a cgroup that has children.
        if let Ok(entries) = fs::read_dir(&self.0) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                    drop(Self(entry.path()));
                }
            }
        }
        // Processes still inside (a test that failed) back where the test
        // runs, and rmdir refuses a cgroup that holds processes.
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let own = own.lines().find_map(|line| line.strip_prefix("0::")).unwrap_or("/").to_owned();
        if let Some(root) = self
            .0
            .ancestors()
            .find(|dir| dir.join("cgroup.controllers").exists() && !dir.join("cgroup.events").exists())
        {
            let home = root.join(own.trim_start_matches('/'));
            for pid in fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default().lines() {
                let _ = fs::write(home.join("cgroup.procs"), pid);
            }
        }
        let _ = fs::remove_dir(&self.0);
    }
}

/// A memory cgroup of a test's own with a limit, whose processes the OOM
/// killer kills past it: in the cgroup v2 hierarchy where it has the
/// memory controller, else in cgroup v1's memory hierarchy (a hybrid
/// machine's). Removed when dropped, once its processes are gone.
pub struct MemoryLimit(PathBuf);

impl MemoryLimit {
    pub fn new(name: &str, bytes: u64) -> Self {
        let root = cgroup2_root();
        let controllers = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        if controllers.split_whitespace().any(|controller| controller == "memory") {
            let path = root.join(name);
            fs::create_dir_all(&path).expect("create a cgroup");
            let _ = fs::write(root.join("cgroup.subtree_control"), "+memory");
            fs::write(path.join("memory.max"), bytes.to_string()).expect("set memory.max");
            let _ = fs::write(path.join("memory.swap.max"), "0");
            return Self(path);
        }
        let path = Path::new("/sys/fs/cgroup/memory").join(name);
        fs::create_dir_all(&path).expect("create a cgroup v1 memory cgroup");
        fs::write(path.join("memory.limit_in_bytes"), bytes.to_string()).expect("set memory.limit_in_bytes");
        // With swap, the limit would page out rather than kill.
        let _ = fs::write(path.join("memory.memsw.limit_in_bytes"), bytes.to_string());
        Self(path)
    }

    pub fn join(&self, pid: u32) {
        fs::write(self.0.join("cgroup.procs"), pid.to_string())
            .expect("move a process into the memory cgroup");
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        // Its processes are killed by now, or are being.
        for _ in 0..100 {
            if fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
