//! Builds memleak-ebpf for the BPF target and leaves the object in `OUT_DIR`,
//! where `include_bytes_aligned!` embeds it into the memleak binary.
//!
//! The nested cargo's output is shown only when it fails: replayed as
//! warnings on every build (as aya-build does), it buried real warnings.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

fn main() -> anyhow::Result<()> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().context("memleak/ has a parent")?;
    for crate_dir in ["memleak-ebpf", "memleak-common"] {
        println!("cargo:rerun-if-changed={}", workspace.join(crate_dir).display());
    }
    check_bpf_toolchain()?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let target_dir = out_dir.join("bpf-target");
    let target = match env::var("CARGO_CFG_TARGET_ENDIAN")?.as_str() {
        "big" => "bpfeb-unknown-none",
        _ => "bpfel-unknown-none",
    };
    let arch = env::var("CARGO_CFG_TARGET_ARCH")?;
    let rustflags =
        [&format!("--cfg=bpf_target_arch=\"{arch}\""), "-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f");
    let output = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .current_dir(workspace)
        .args(["build", "--package", "memleak-ebpf", "--bins", "--release", "--target", target])
        .args(["-Z", "build-std=core", "--target-dir"])
        .arg(&target_dir)
        // -Z build-std on a stable toolchain.
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        // Set for this build script; they would point the nested build at
        // the host compiler's wrappers.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .output()
        .context("running cargo to build memleak-ebpf")?;
    if !output.status.success() {
        bail!("building the BPF programs failed:\n{}", String::from_utf8_lossy(&output.stderr));
    }
    let object = target_dir.join(target).join("release/memleak");
    fs::copy(&object, out_dir.join("memleak")).with_context(|| format!("copying {}", object.display()))?;
    Ok(())
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
