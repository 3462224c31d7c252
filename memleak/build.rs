//! Builds memleak-ebpf for the BPF target, twice (for kernels from 5.17 and
//! for older ones), and leaves the objects in `OUT_DIR`, where
//! `include_bytes_aligned!` embeds them into the memleak binary.
//!
//! It also leaves what `memleak --version` prints, as environment
//! variables of the compiler: the git commit and the BPF object's hash.
//!
//! The nested cargo's output is shown only when it fails: replayed as
//! warnings on every build (as aya-build does), it buried real warnings.

use std::{
    env,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};
use sha2::Digest as _;

fn main() -> anyhow::Result<()> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().context("memleak/ has a parent")?;
    for crate_dir in ["memleak-ebpf", "memleak-common"] {
        println!("cargo:rerun-if-changed={}", workspace.join(crate_dir).display());
    }
    check_bpf_toolchain()?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let target_dir = bpf_target_dir(&out_dir);
    let target = match env::var("CARGO_CFG_TARGET_ENDIAN")?.as_str() {
        "big" => "bpfeb-unknown-none",
        _ => "bpfel-unknown-none",
    };
    let arch = env::var("CARGO_CFG_TARGET_ARCH")?;
    let rustflags =
        [&format!("--cfg=bpf_target_arch=\"{arch}\""), "-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f");
    let mut objects = Vec::new();
    // The object for kernels from 5.17, then the one for 5.10 to 5.16
    // (see memleak-ebpf's `legacy-kernels`), each in a target directory
    // of its own, so that neither build undoes the other's.
    for (features, suffix) in [("", ""), ("legacy-kernels", "-legacy")] {
        let target_dir = PathBuf::from(format!("{}{suffix}", target_dir.display()));
        let output = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
            .current_dir(workspace)
            .args(["build", "--package", "memleak-ebpf", "--bins", "--release", "--target", target])
            .args(["--features", features])
            .args(["-Z", "build-std=core", "--target-dir"])
            .arg(&target_dir)
            // -Z build-std on a stable toolchain.
            .env("RUSTC_BOOTSTRAP", "1")
            .env("CARGO_ENCODED_RUSTFLAGS", &rustflags)
            // Set for this build script; they would point the nested build
            // at the host compiler's wrappers.
            .env_remove("RUSTC")
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .output()
            .context("running cargo to build memleak-ebpf")?;
        if !output.status.success() {
            bail!("building the BPF programs failed:\n{}", String::from_utf8_lossy(&output.stderr));
        }
        let object = target_dir.join(target).join("release/memleak");
        let embedded = out_dir.join(format!("memleak{suffix}"));
        fs::copy(&object, &embedded).with_context(|| format!("copying {}", object.display()))?;
        objects.extend(fs::read(&embedded)?);
    }
    describe_build(workspace, &objects);
    Ok(())
}

/// Where the nested cargo builds the BPF programs: one folder under the
/// target directory for every host target and profile, as the object
/// depends on neither. The static (musl) build that `cargo xtask dist`
/// and the tests make then takes the object the glibc build made, rather
/// than a minute to build it again. `OUT_DIR` is
/// `TARGET_DIR/[TRIPLE/]PROFILE/build/memleak-HASH/out`; anywhere else (a
/// layout cargo may change), the object is built under `OUT_DIR`.
fn bpf_target_dir(out_dir: &Path) -> PathBuf {
    let own = || out_dir.join("bpf-target");
    let mut ancestors = out_dir.ancestors().skip(2);
    if ancestors.next().and_then(Path::file_name) != Some("build".as_ref()) {
        return own();
    }
    let Some(mut target_dir) = ancestors.nth(1) else { return own() };
    if env::var_os("TARGET").is_some_and(|triple| target_dir.file_name() == Some(&triple)) {
        let Some(parent) = target_dir.parent() else { return own() };
        target_dir = parent;
    }
    target_dir.join("bpf")
}

/// What `memleak --version` says besides the crate's version: the commit
/// and the BPF objects. bpf-linker writes no GNU build-id note, so the
/// objects are named by the SHA-256 of their bytes, one after the other (the BPF build is
/// reproducible: the same sources give the same bytes).
fn describe_build(workspace: &Path, bpf_objects: &[u8]) {
    let digest = sha2::Sha256::digest(bpf_objects);
    let hex = digest.iter().fold(String::new(), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    });
    println!("cargo:rustc-env=MEMLEAK_BPF_SHA256={hex}");
    let commit = git_commit(workspace).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=MEMLEAK_COMMIT={commit}");
}

/// Sources that go into the binary: a change to any of them makes it
/// another build, and `-dirty` is decided by them alone (an edited README
/// does not make the binary differ from its commit's).
const BINARY_SOURCES: [&str; 5] = ["memleak", "memleak-ebpf", "memleak-common", "Cargo.toml", "Cargo.lock"];

/// The short hash of HEAD, with `-dirty` when the binary's sources differ
/// from it; `None` outside a git checkout of this workspace (a build from
/// a source archive, or from a .crate unpacked inside another repository).
fn git_commit(workspace: &Path) -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let output = Command::new("git").arg("-C").arg(workspace).args(args).output().ok()?;
        output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let top = git(&["rev-parse", "--show-toplevel"])?;
    if fs::canonicalize(&top).ok()? != fs::canonicalize(workspace).ok()? {
        return None;
    }
    // Rerun when the sources change, HEAD moves or the index changes (a
    // commit, a checkout, an add).
    for source in BINARY_SOURCES {
        println!("cargo:rerun-if-changed={}", workspace.join(source).display());
    }
    for path in ["HEAD", "index", "packed-refs"] {
        rerun_if_exists(&git(&["rev-parse", "--git-path", path])?, workspace);
    }
    if let Some(branch) = git(&["symbolic-ref", "--quiet", "HEAD"]) {
        rerun_if_exists(&git(&["rev-parse", "--git-path", &branch])?, workspace);
    }
    let hash = git(&["rev-parse", "--short", "HEAD"])?;
    // --no-optional-locks: a status that refreshed the index would touch
    // it, and so rerun this script at the next build.
    let mut status = vec!["--no-optional-locks", "status", "--porcelain", "--untracked-files=no", "--"];
    status.extend(BINARY_SOURCES);
    let dirty = !git(&status)?.is_empty();
    Some(if dirty { format!("{hash}-dirty") } else { hash })
}

/// Watches a file of git's, named relative to `workspace` or absolute; a
/// missing file is not watched (cargo would rerun the script every time).
fn rerun_if_exists(path: &str, workspace: &Path) {
    let path = workspace.join(path);
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// Fails early, with the fix, instead of deep inside the nested cargo.
fn check_bpf_toolchain() -> anyhow::Result<()> {
    let linker_found = Command::new("bpf-linker").arg("--version").output().is_ok();
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let sysroot = Command::new(rustc).args(["--print", "sysroot"]).output().context("running rustc")?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_owned();
    let rust_src_found = Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").is_dir();
    if !linker_found || !rust_src_found {
        bail!("bpf-linker or rust-src is missing: run `cargo xtask setup` once, then build again");
    }
    Ok(())
}
