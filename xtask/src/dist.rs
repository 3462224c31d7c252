//! `cargo xtask dist`: what a release ships, under target/dist/.
//!
//! - `memleak`: the binary, static (musl), the BPF object embedded, for
//!   any `x86_64` Linux: nothing to install besides it;
//! - `man/` and `completions/`: the man pages and the bash, zsh and fish
//!   completions, which the binary writes from its own clap definitions
//!   (`memleak __dist-files DIR`);
//! - `memleak_VERSION_amd64.deb`: all of it, with the systemd unit and
//!   contrib/, for Debian and Ubuntu;
//! - `SHA256SUMS` of the binary and the package;
//! - `arm64/`: the same for arm64 (`aarch64-unknown-linux-musl`, its BPF
//!   object built for arm64's registers, `memleak_VERSION_arm64.deb`), its
//!   man pages and completions those of the x86-64 binary, which runs here.
//!
//! `cargo xtask test` makes the x86-64 files with a debug build (1m45s
//! from scratch on 2 cores, against 4m35s for the release one) under
//! target/dist-test/, where the tests of tests/tests/dist.rs take them.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::{cargo, root, run as run_command, vm::Arch};

/// What `file` calls the code of `machine`.
fn file_says(machine: Arch) -> &'static str {
    match machine {
        Arch::Amd64 => "x86-64",
        Arch::Arm64 => "ARM aarch64",
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Release,
    /// Cargo's dev profile without debug info: what the tests need, and
    /// the package does not carry 100 MB of DWARF to be compressed.
    Test,
}

impl Profile {
    /// Where the files go, under the workspace root.
    pub fn directory(self) -> &'static str {
        match self {
            Self::Release => "target/dist",
            Self::Test => "target/dist-test",
        }
    }
}

/// `cargo xtask dist`: x86-64's files, then, for a release, arm64's.
pub fn run(profile: Profile) -> Result<()> {
    crate::setup::run()?;
    let amd64 = build(profile)?;
    let mut made = vec![&amd64];
    let arm64;
    if profile == Profile::Release {
        arm64 = build_for(profile, Arch::Arm64, Some(&amd64))?;
        made.push(&arm64);
    }
    for made in made {
        println!("{}: {} bytes, static", made.binary.display(), size(&made.binary)?);
        println!("{}: {} bytes", made.deb.display(), size(&made.deb)?);
    }
    println!("{}", amd64.version);
    Ok(())
}

/// What `build` made.
pub struct Made {
    pub binary: PathBuf,
    pub deb: PathBuf,
    /// What the binary's --version said.
    pub version: String,
}

/// Builds the static x86-64 binary, checks that it is static and runs,
/// then writes the man pages, completions and the .deb beside it.
pub fn build(profile: Profile) -> Result<Made> {
    build_for(profile, Arch::Amd64, None)
}

/// Builds `machine`'s static binary and its files, in the profile's
/// folder (x86-64's) or a folder of its own in it. One that cannot run
/// here (arm64) takes its version, man pages and completions from
/// x86-64's, `documented_by`, built from the same sources.
fn build_for(profile: Profile, machine: Arch, documented_by: Option<&Made>) -> Result<Made> {
    let target = machine.musl_target();
    add_rust_target(target)?;
    crate::install_missing_packages(&["file", "binutils"], "checking that memleak is static")?;
    let mut out = root().join(profile.directory());
    if machine != Arch::Amd64 {
        out.push(machine.debian_name());
    }
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("cannot empty {}", out.display()))?;
    }
    fs::create_dir_all(&out)?;
    let mut build = cargo();
    build.args(["build", "--package", "memleak", "--target", target]);
    if machine == Arch::Arm64 {
        // Rust's own linker: no arm64 C toolchain needed for a musl build.
        build.env(crate::linker_variable(target), "rust-lld");
    }
    let profile_folder = match profile {
        Profile::Release => {
            build.arg("--release");
            "release"
        }
        Profile::Test => {
            build.env("CARGO_PROFILE_DEV_DEBUG", "0");
            "debug"
        }
    };
    run_command(&mut build)?;
    let binary = out.join("memleak");
    fs::copy(root().join("target").join(target).join(profile_folder).join("memleak"), &binary)?;
    check_static(&binary, machine)?;
    let version = match documented_by {
        None => {
            let version = output(Command::new(&binary).arg("--version"))?.trim().to_owned();
            run_command(Command::new(&binary).arg("__dist-files").arg(&out))?;
            version
        }
        Some(documented) => {
            let from = documented.binary.parent().context("a binary in a folder")?;
            for folder in ["man", "completions"] {
                copy_tree(&from.join(folder), &out.join(folder))?;
            }
            documented.version.clone()
        }
    };
    let deb = debian_package(&out, profile, machine)?;
    let deb_name = deb.file_name().context("the package has a file name")?;
    let sums = output(Command::new("sha256sum").arg("memleak").arg(deb_name).current_dir(&out))?;
    fs::write(out.join("SHA256SUMS"), sums)?;
    Ok(Made { binary, deb, version })
}

fn add_rust_target(target: &str) -> Result<()> {
    let sysroot = output(Command::new("rustc").args(["--print", "sysroot"]))?;
    if Path::new(sysroot.trim()).join("lib/rustlib").join(target).is_dir() {
        return Ok(());
    }
    eprintln!("xtask: adding the {target} target");
    run_command(Command::new("rustup").args(["target", "add", target]))
}

/// A static executable has no program interpreter (`PT_INTERP`) and no
/// shared library to load; `file` says "static-pie linked" for Rust's
/// musl binaries, and names the machine.
fn check_static(binary: &Path, machine: Arch) -> Result<()> {
    let headers =
        output(Command::new("readelf").args(["--program-headers", "--dynamic", "--wide"]).arg(binary))?;
    if headers.contains("INTERP") || headers.contains("(NEEDED)") {
        bail!("{} is not static:\n{headers}", binary.display());
    }
    let kind = output(Command::new("file").arg("--brief").arg(binary))?;
    if !kind.contains("static") {
        bail!("file does not call {} static: {kind}", binary.display());
    }
    if !kind.contains(file_says(machine)) {
        bail!("file does not call {} {} code: {kind}", binary.display(), file_says(machine));
    }
    Ok(())
}

fn size(path: &Path) -> Result<u64> {
    Ok(fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?.len())
}

fn output(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// The package's fields, from memleak/Cargo.toml: its version and
/// license, and `[package.metadata.deb]`.
struct Metadata {
    version: String,
    description: String,
    license: String,
    maintainer: String,
}

fn metadata() -> Result<Metadata> {
    let text = output(cargo().args(["metadata", "--no-deps", "--format-version", "1"]))?;
    let metadata: serde_json::Value = serde_json::from_str(&text)?;
    let package = metadata["packages"]
        .as_array()
        .and_then(|packages| packages.iter().find(|package| package["name"] == "memleak"))
        .context("cargo metadata lists no memleak package")?;
    let field = |value: &serde_json::Value, name: &str| {
        value.as_str().map(str::to_owned).with_context(|| format!("memleak/Cargo.toml has no {name}"))
    };
    Ok(Metadata {
        version: field(&package["version"], "version")?,
        description: field(&package["metadata"]["deb"]["description"], "[package.metadata.deb] description")?,
        license: field(&package["license"], "license")?,
        maintainer: field(&package["metadata"]["deb"]["maintainer"], "[package.metadata.deb] maintainer")?,
    })
}

/// Where each file goes in the package. The unit and the completions go
/// where Debian 12's own packages put theirs (/lib/systemd/system, not yet
/// /usr/lib: bookworm ships units under /lib).
const SYSTEMD_UNIT: &str = "lib/systemd/system/memleak-serve.service";
const COMPLETIONS: [(&str, &str); 3] = [
    ("memleak.bash", "usr/share/bash-completion/completions/memleak"),
    ("_memleak", "usr/share/zsh/vendor-completions/_memleak"),
    ("memleak.fish", "usr/share/fish/vendor_completions.d/memleak.fish"),
];
const DOC: &str = "usr/share/doc/memleak";
/// The unit's `EnvironmentFile`, which says what to follow: the package's
/// one configuration file, kept on `apt-get remove`.
const SERVE_ENV: &str = "etc/memleak/serve.env";

/// Stages the package's files and has dpkg-deb build it: Debian's own
/// tool, from fields read from memleak/Cargo.toml, rather than cargo-deb,
/// which would be one more program to build on every CI machine.
fn debian_package(out: &Path, profile: Profile, machine: Arch) -> Result<PathBuf> {
    let metadata = metadata()?;
    let stage = out.join("deb");
    let write = |to: &str, bytes: &[u8], mode: u32| -> Result<()> {
        let target = stage.join(to);
        fs::create_dir_all(target.parent().context("a file in a folder")?)?;
        fs::write(&target, bytes).with_context(|| format!("cannot write {}", target.display()))?;
        fs::set_permissions(&target, fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    let place = |from: &Path, to: &str, mode: u32| -> Result<()> {
        write(to, &fs::read(from).with_context(|| format!("cannot read {}", from.display()))?, mode)
    };
    place(&out.join("memleak"), "usr/bin/memleak", 0o755)?;
    for page in fs::read_dir(out.join("man"))? {
        let page = page?.path();
        let name = page.file_name().and_then(|name| name.to_str()).context("a man page's name")?;
        let target = format!("usr/share/man/man1/{name}");
        place(&page, &target, 0o644)?;
        // -n: no name or time in the header, so that the same page makes
        // the same bytes.
        run_command(Command::new("gzip").args(["-9", "-n"]).arg(stage.join(&target)))?;
    }
    for (name, target) in COMPLETIONS {
        place(&out.join("completions").join(name), target, 0o644)?;
    }
    // The unit as contrib/ has it, for the binary where the package puts it.
    let unit = fs::read_to_string(root().join("contrib/memleak-serve.service"))?;
    let exec_start = "ExecStart=/usr/local/bin/memleak ";
    if !unit.contains(exec_start) {
        bail!("contrib/memleak-serve.service has no `{exec_start}` line to point at /usr/bin/memleak");
    }
    write(SYSTEMD_UNIT, unit.replace(exec_start, "ExecStart=/usr/bin/memleak ").as_bytes(), 0o644)?;
    write(SERVE_ENV, SERVE_ENV_TEXT.as_bytes(), 0o644)?;
    copy_tree(&root().join("contrib"), &stage.join(DOC).join("contrib"))?;
    write(&format!("{DOC}/copyright"), copyright_text(&metadata).as_bytes(), 0o644)?;
    write_control(&stage, &metadata, machine)?;
    let deb = out.join(format!("memleak_{}_{}.deb", metadata.version, machine.debian_name()));
    let mut build = Command::new("dpkg-deb");
    build.args(["--root-owner-group", "--build"]);
    if profile == Profile::Test {
        // dpkg-deb's xz takes most of a minute over an unoptimised binary.
        build.args(["-Zgzip", "-z1"]);
    }
    run_command(build.arg(&stage).arg(&deb))?;
    fs::remove_dir_all(&stage)?;
    Ok(deb)
}

const SERVE_ENV_TEXT: &str = "\
# What memleak-serve.service follows: memleak serve's flags, e.g.
#   MEMLEAK_SERVE_ARGS=--exe nginx --container web
# then: systemctl enable --now memleak-serve
MEMLEAK_SERVE_ARGS=
";

fn copyright_text(metadata: &Metadata) -> String {
    format!(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\
         Upstream-Name: memleak\n\n\
         Files: *\n\
         Copyright: {}\n\
         License: {}\n",
        metadata.maintainer, metadata.license
    )
}

/// DEBIAN/: control, conffiles and md5sums.
fn write_control(stage: &Path, metadata: &Metadata, machine: Arch) -> Result<()> {
    let installed_kib = output(Command::new("du").args(["-sk", "--apparent-size"]).arg(stage))?
        .split_whitespace()
        .next()
        .context("du prints a size")?
        .to_owned();
    let files = output(Command::new("find").arg(".").args(["-type", "f"]).current_dir(stage))?;
    let mut files: Vec<&str> = files.lines().map(|line| line.trim_start_matches("./")).collect();
    files.sort_unstable();
    let sums = output(Command::new("md5sum").args(&files).current_dir(stage))?;
    let control = stage.join("DEBIAN");
    fs::create_dir_all(&control)?;
    fs::write(control.join("md5sums"), sums)?;
    fs::write(control.join("conffiles"), format!("/{SERVE_ENV}\n"))?;
    // A static binary depends on nothing; the long description's lines
    // start with a space, as deb-control(5) wants.
    fs::write(
        control.join("control"),
        format!(
            "Package: memleak\n\
             Version: {version}\n\
             Architecture: {architecture}\n\
             Maintainer: {maintainer}\n\
             Installed-Size: {installed_kib}\n\
             Section: utils\n\
             Priority: optional\n\
             Description: {description}\n \
             Traces a process's outstanding allocations with eBPF uprobes and\n \
             reports the call stacks that hold the most memory, as text, JSON,\n \
             flame graphs or pprof profiles; memleak serve exports them to\n \
             Prometheus. Needs root (or CAP_BPF and CAP_PERFMON).\n",
            version = metadata.version,
            architecture = machine.debian_name(),
            maintainer = metadata.maintainer,
            description = metadata.description,
        ),
    )?;
    Ok(())
}

/// Copies a folder's files, with 0644 files and 0755 folders.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    fs::set_permissions(to, fs::Permissions::from_mode(0o755))?;
    for entry in fs::read_dir(from)? {
        let path = entry?.path();
        let target = to.join(path.file_name().context("an entry's name")?);
        if path.is_dir() {
            copy_tree(&path, &target)?;
        } else {
            fs::copy(&path, &target)?;
            fs::set_permissions(&target, fs::Permissions::from_mode(0o644))?;
        }
    }
    Ok(())
}
