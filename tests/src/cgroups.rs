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
        let mounts = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
        let root = mounts
            .lines()
            .find_map(|line| {
                let (fields, filesystem) = line.split_once(" - ")?;
                filesystem
                    .starts_with("cgroup2 ")
                    .then(|| fields.split_whitespace().nth(4).map(PathBuf::from))?
            })
            .expect("a cgroup v2 hierarchy mounted");
        let path = root.join(name);
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
