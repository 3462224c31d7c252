//! Builds memleak-ebpf for the BPF target and leaves the object in OUT_DIR,
//! where `include_bytes_aligned!` embeds it into the memleak binary.

use std::{env, path::Path, process::Command};

use anyhow::{bail, Context as _};

fn main() -> anyhow::Result<()> {
    // The BPF crate needs `-Z build-std=core`. On a stable toolchain that
    // takes RUSTC_BOOTSTRAP=1, set here so a plain `cargo build` works.
    // SAFETY: build scripts are single-threaded at this point.
    unsafe { env::set_var("RUSTC_BOOTSTRAP", "1") };
    println!("cargo:rerun-if-env-changed=RUSTUP_TOOLCHAIN");
    check_bpf_toolchain()?;
    let toolchain = env::var("RUSTUP_TOOLCHAIN").unwrap_or_else(|_| "stable".to_owned());
    let root_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../memleak-ebpf");
    let root_dir = root_dir.to_str().context("non-UTF-8 source path")?;
    aya_build::build_ebpf(
        [aya_build::Package { name: "memleak-ebpf", root_dir, ..Default::default() }],
        aya_build::Toolchain::Custom(&toolchain),
    )
}

/// Fails early, with the fix, instead of deep inside the nested cargo.
fn check_bpf_toolchain() -> anyhow::Result<()> {
    let linker_found = Command::new("bpf-linker").arg("--version").output().is_ok();
    let sysroot = Command::new(env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned()))
        .args(["--print", "sysroot"])
        .output()
        .context("running rustc --print sysroot")?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_owned();
    let rust_src_found = Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").is_dir();
    if !linker_found || !rust_src_found {
        bail!("bpf-linker or rust-src is missing: run `cargo xtask setup` once, then build again");
    }
    Ok(())
}
