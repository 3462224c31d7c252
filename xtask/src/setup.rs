//! Installs rust-src and bpf-linker, the two things a fresh machine lacks
//! to build memleak's BPF programs, and clippy if the toolchain came
//! without it. Idempotent: a second run only checks.

use std::{os::unix::fs::symlink, path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::run as run_command;

pub fn run() -> Result<()> {
    let toolchain = Toolchain::current()?;
    if !toolchain.sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
        eprintln!("xtask: installing rust-src");
        run_command(Command::new("rustup").args(["component", "add", "rust-src"]))?;
    }
    if !Command::new("cargo").args(["clippy", "--version"]).output().is_ok_and(|out| out.status.success()) {
        eprintln!("xtask: installing clippy");
        run_command(Command::new("rustup").args(["component", "add", "clippy"]))?;
    }
    if bpf_linker_matches(&toolchain) {
        return Ok(());
    }
    install_bpf_linker(&toolchain)
}

/// What `rustc -vV` says about the toolchain in use.
struct Toolchain {
    sysroot: std::path::PathBuf,
    /// e.g. "22.1.2"
    llvm_version: String,
}

impl Toolchain {
    fn current() -> Result<Self> {
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
        let version = output(Command::new(&rustc).arg("-vV"))?;
        let llvm_version = version
            .lines()
            .find_map(|line| line.strip_prefix("LLVM version: "))
            .context("rustc -vV does not say which LLVM it uses")?
            .trim()
            .to_owned();
        let sysroot = output(Command::new(&rustc).args(["--print", "sysroot"]))?.trim().into();
        Ok(Self { sysroot, llvm_version })
    }

    fn llvm_major(&self) -> &str {
        self.llvm_version.split('.').next().unwrap_or("")
    }

    /// The toolchain's own shared libLLVM, e.g.
    /// lib/libLLVM.so.22.1-rust-1.95.0-stable. Found by its LLVM major
    /// version rather than spelled out, so a toolchain update keeps working.
    fn libllvm(&self) -> Result<std::path::PathBuf> {
        let lib = self.sysroot.join("lib");
        let prefix = format!("libLLVM.so.{}.", self.llvm_major());
        let found = std::fs::read_dir(&lib)?
            .filter_map(std::result::Result::ok)
            .map(|entry| entry.path())
            .find(|path| {
                path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with(&prefix))
            });
        found.with_context(|| {
            format!("no {prefix}* in {}: this toolchain ships no shared LLVM", lib.display())
        })
    }
}

fn output(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A bpf-linker is usable only if it runs and links the very libLLVM of
/// this toolchain: rustc's bitcode is read by the linker's LLVM. The
/// library's file name sits in the linker's dynamic string table.
fn bpf_linker_matches(toolchain: &Toolchain) -> bool {
    let Ok(path) = output(Command::new("sh").args(["-c", "command -v bpf-linker"])) else { return false };
    let Ok(binary) = std::fs::read(path.trim()) else { return false };
    let Ok(libllvm) = toolchain.libllvm() else { return false };
    let Some(name) = libllvm.file_name().and_then(|name| name.to_str()) else { return false };
    let links_it = binary.windows(name.len()).any(|window| window == name.as_bytes());
    links_it && output(Command::new("bpf-linker").arg("--version")).is_ok()
}

fn install_bpf_linker(toolchain: &Toolchain) -> Result<()> {
    let libllvm = toolchain.libllvm()?;
    let file_name = libllvm.file_name().context("libLLVM has no file name")?;
    // bpf-linker's build looks for libLLVM.so under $LLVM_PREFIX/lib, and
    // the linker keeps that folder as its run path, so it must outlive the
    // build: it goes beside the installed binary, not under target/.
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let prefix = cargo_home.join(format!("bpf-linker-llvm-{}", toolchain.llvm_major()));
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib)?;
    for name in [Path::new("libLLVM.so"), Path::new(file_name)] {
        let link = lib.join(name);
        let _ = std::fs::remove_file(&link);
        symlink(&libllvm, &link).with_context(|| format!("cannot link {}", link.display()))?;
    }
    let feature = format!("llvm-{}", toolchain.llvm_major());
    eprintln!("xtask: building bpf-linker against {} (about a minute)", libllvm.display());
    run_command(
        Command::new("cargo")
            .args(["install", "--locked", "bpf-linker", "--no-default-features", "--features", &feature])
            .env("LLVM_PREFIX", &prefix),
    )
}
