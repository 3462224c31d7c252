//! Root filesystems for container tests, and temporary directories.

use std::{fs, path::Path, process::Command};

use crate::fixtures::fixture;

/// A root filesystem holding the leaker at /app/leaker and the libraries
/// it loads, at their own paths, for container tests.
pub fn leaker_rootfs() -> tempdir::TempDir {
    rootfs_with(&fixture("leaker"))
}

/// A root filesystem holding `leaker` at /app/leaker and the libraries it
/// loads (as ldd lists them), at their own paths.
pub fn rootfs_with(leaker: &Path) -> tempdir::TempDir {
    let root = tempdir::TempDir::new("memleak-rootfs");
    let copy = |from: &Path, to: &Path| {
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(from, to)
            .unwrap_or_else(|error| panic!("copy {} to {}: {error}", from.display(), to.display()));
    };
    let program = root.path().join("app/leaker");
    fs::create_dir_all(program.parent().unwrap()).unwrap();
    crate::fixtures::copy_executable(leaker, &program);
    // Ask the program's own dynamic loader (glibc's or musl's) what it loads.
    let headers = Command::new("readelf").arg("-l").arg(leaker).output().expect("run readelf");
    let headers = String::from_utf8_lossy(&headers.stdout);
    let interpreter = headers
        .lines()
        .find_map(|line| line.split_once("program interpreter: ").map(|(_, rest)| rest.trim_end_matches(']')))
        .expect("a dynamically linked leaker");
    let listing = Command::new(interpreter).arg("--list").arg(leaker).output().expect("run the loader");
    for line in String::from_utf8_lossy(&listing.stdout).lines() {
        let path = line.split_whitespace().rfind(|word| word.starts_with('/'));
        if let Some(path) = path.filter(|path| Path::new(path) != leaker) {
            copy(Path::new(path), &root.path().join(path.trim_start_matches('/')));
        }
    }
    fs::create_dir_all(root.path().join("proc")).unwrap();
    root
}

/// A directory removed when dropped.
pub mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new(prefix: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "{prefix}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).expect("create a temporary directory");
            Self(path.clone())
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
