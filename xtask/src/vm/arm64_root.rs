//! The root an arm64 VM boots into: Debian bookworm's own arm64 packages,
//! unpacked by `mmdebstrap --variant=extract` under target/vm/arm64/root.
//! Unpacked only: no maintainer script runs, so no arm64 emulation is
//! needed on this machine (binfmt), and it took 14 s here (505 MB), where
//! a root installed under qemu-user took half an hour. Made once, and
//! again only when `PACKAGES` change.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result};

use super::{apt, kernels::cache_dir, Verbosity};

/// Debian 12's, whose kernel (6.1) and python3.11 the arm64 nodes
/// (Graviton, Ampere) run.
const SUITE: &str = "bookworm";

/// Where the packages come from: the release and its security updates,
/// which the cross compilers on this machine are built against too.
const SOURCES: [&str; 2] = [
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
];

/// What the VM runs: bash for the command, coreutils for what commands
/// take for granted, the C and C++ runtimes of the tests and their
/// fixtures, glibc's symbols (libc6-dbg: `start_thread` and the other
/// functions libc.so.6 keeps local are named by them, as on the test
/// machines), Debian's python3.11, and prometheus for the promtool the
/// `serve` tests check /metrics with. Their dependencies come along.
const PACKAGES: [&str; 8] =
    ["bash", "coreutils", "libc6", "libc6-dbg", "libgcc-s1", "libstdc++6", "python3.11", "prometheus"];

/// The root, made unless one made from the same packages is there.
pub fn build(verbosity: Verbosity) -> Result<PathBuf> {
    let dir = cache_dir().join("arm64");
    let root = dir.join("root");
    let stamp_path = dir.join("root.stamp");
    let stamp = format!("{SUITE} {}\n{}\n", PACKAGES.join(","), SOURCES.join("\n"));
    if root.is_dir() && fs::read_to_string(&stamp_path).is_ok_and(|made| made == stamp) {
        return Ok(root);
    }
    verbosity.say(format!("making the arm64 root in {}", root.display()));
    let partial = dir.join("root.tmp");
    for old in [&partial, &root] {
        if old.exists() {
            fs::remove_dir_all(old).with_context(|| format!("cannot remove {}", old.display()))?;
        }
    }
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    unpack(&partial)?;
    fs::rename(&partial, &root).with_context(|| format!("cannot rename {}", partial.display()))?;
    fs::write(&stamp_path, stamp).with_context(|| format!("cannot write {}", stamp_path.display()))?;
    Ok(root)
}

fn unpack(into: &Path) -> Result<()> {
    apt::run_quietly(
        Command::new("mmdebstrap")
            .args(["--quiet", "--variant=extract", "--arch=arm64", "--format=directory"])
            .arg(format!("--include={}", PACKAGES.join(",")))
            .arg(SUITE)
            .arg(into)
            .args(SOURCES),
    )
}
