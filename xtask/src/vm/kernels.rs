//! Which kernel to boot: a Debian kernel package given as a file, one
//! already unpacked, or a series (`6.1`, `newest`) whose newest package
//! is fetched from Debian's registry. Packages are only ever unpacked,
//! with `dpkg-deb -x`, under target/vm/kernels/: the host's own kernel
//! and packages stay as they are.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};
use regex::Regex;

use super::{
    apt::{self, Apt},
    Arch, Verbosity,
};

/// A kernel ready to boot: its image and the modules built with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// The bootable image (vmlinuz).
    pub vmlinuz: PathBuf,
    /// Its modules, the directory named after the release
    /// (lib/modules/RELEASE).
    pub modules: PathBuf,
    /// What `uname -r` says once it runs, e.g. `6.1.0-57-amd64`.
    pub release: String,
    /// The Debian package it came from, e.g. `linux-image-6.1.0-57-amd64`;
    /// None for a directory given as is.
    pub package: Option<String>,
    /// That package's version, e.g. `6.1.192-3`.
    pub package_version: Option<String>,
    pub arch: Arch,
}

/// The kernel `name` stands for, fetched and unpacked if need be: a
/// `linux-image-*.deb` (several joined by commas for a kernel split in
/// parts, as Debian's 7.x are), a directory holding one unpacked, a
/// package name (`linux-image-6.1.0-57-amd64`), or a series: `5.10`,
/// `6.1`, `6.12`... or `newest`, the newest package of the highest
/// series Debian has. Says which package a series resolved to on stderr.
pub fn resolve_kernel(name: &str) -> Result<Kernel> {
    resolve_kernel_for(name, Arch::Amd64, Verbosity::Normal)
}

/// `resolve_kernel` for a kernel of `arch` (the packages' flavour: -amd64,
/// -arm64), saying nothing when `verbosity` is quiet.
pub fn resolve_kernel_for(name: &str, arch: Arch, verbosity: Verbosity) -> Result<Kernel> {
    super::install_host_tools(arch)?;
    let _lock = super::lock_cache()?;
    let path = Path::new(name);
    let is_deb = |part: &str| Path::new(part).extension().is_some_and(|extension| extension == "deb");
    if name.split(',').all(is_deb) {
        let debs: Vec<PathBuf> = name.split(',').map(PathBuf::from).collect();
        return from_local_debs(&debs, arch, verbosity);
    }
    if path.is_dir() {
        return from_unpacked(path, None, None, arch);
    }
    if path.exists() {
        bail!("{name} is neither a linux-image-*.deb nor a directory holding one unpacked");
    }
    from_registry(name, arch, verbosity)
}

/// target/vm/, where everything this harness makes or fetches is kept.
pub fn cache_dir() -> PathBuf {
    crate::root().join("target/vm")
}

fn from_local_debs(debs: &[PathBuf], arch: Arch, verbosity: Verbosity) -> Result<Kernel> {
    for deb in debs {
        if !deb.is_file() {
            bail!("no such package: {}", deb.display());
        }
    }
    let field = |field: &str| -> Result<String> {
        Ok(apt::output_of(Command::new("dpkg-deb").arg("-f").arg(&debs[0]).arg(field))?.trim().to_owned())
    };
    let (package, version) = (field("Package")?, field("Version")?);
    let deb_arch = field("Architecture")?;
    if deb_arch != arch.debian_name() {
        bail!(
            "{} is a kernel for {deb_arch}, not {}: give --arch {deb_arch}",
            debs[0].display(),
            arch.debian_name()
        );
    }
    // A package built again under the same name and version must be
    // unpacked again: the marker names each file with its size and time.
    let mut sources = String::new();
    for deb in debs {
        let metadata = fs::metadata(deb).with_context(|| format!("cannot read {}", deb.display()))?;
        let modified =
            metadata.modified().ok().and_then(|time| time.duration_since(std::time::UNIX_EPOCH).ok());
        let _ = writeln!(
            sources,
            "{} {} {}",
            deb.display(),
            metadata.len(),
            modified.map_or(0, |time| time.as_secs())
        );
    }
    // Apart from the registry's: a package given alone that needs parts
    // given with it must not spoil the whole kernel fetched before.
    let first_stem = debs[0].file_stem().unwrap_or_default().to_string_lossy();
    let parts = if debs.len() > 1 { format!("+{}", debs.len() - 1) } else { String::new() };
    let unpacked = cache_dir().join("kernels/local").join(format!("{first_stem}{parts}"));
    let done = unpacked.join(".done");
    if fs::read_to_string(&done).ok().as_deref() != Some(sources.as_str()) {
        unpack(debs, &unpacked, verbosity)?;
        fs::write(&done, &sources).with_context(|| format!("cannot write {}", done.display()))?;
    }
    from_unpacked(&unpacked, Some(package), Some(version), arch)
}

/// The private apt configuration for `arch`'s packages:
/// target/vm/apt/, apt-arm64/ for arm64's.
fn apt_dir(arch: Arch) -> PathBuf {
    cache_dir().join(match arch {
        Arch::Amd64 => "apt",
        Arch::Arm64 => "apt-arm64",
    })
}

fn unpacked_dir(package: &str, version: &str) -> PathBuf {
    cache_dir().join("kernels").join(format!("{package}_{}", version.replace(':', "%3a")))
}

/// Unpacks `debs` into `into`, emptied first, without installing them.
fn unpack(debs: &[PathBuf], into: &Path, verbosity: Verbosity) -> Result<()> {
    if into.exists() {
        fs::remove_dir_all(into).with_context(|| format!("cannot remove {}", into.display()))?;
    }
    fs::create_dir_all(into).with_context(|| format!("cannot create {}", into.display()))?;
    for deb in debs {
        verbosity.say(format!("unpacking {}", deb.file_name().unwrap_or_default().to_string_lossy()));
        apt::run_quietly(Command::new("dpkg-deb").arg("-x").arg(deb).arg(into))?;
    }
    Ok(())
}

/// The kernel in a directory holding a kernel package unpacked:
/// boot/vmlinuz-RELEASE with lib/modules/RELEASE or usr/lib/modules/RELEASE
/// up to 6.x, usr/lib/modules/RELEASE/vmlinuz in Debian's 7.x packages.
pub fn from_unpacked(
    dir: &Path,
    package: Option<String>,
    package_version: Option<String>,
    arch: Arch,
) -> Result<Kernel> {
    let dir = dir.canonicalize().with_context(|| format!("no such directory: {}", dir.display()))?;
    let mut images = Vec::new();
    for (parent, in_modules_dir) in [("boot", false), ("usr/lib/modules", true), ("lib/modules", true)] {
        let Ok(entries) = fs::read_dir(dir.join(parent)) else { continue };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if in_modules_dir && path.join("vmlinuz").is_file() {
                images.push((path.join("vmlinuz"), path));
            } else if let Some(release) = name.strip_prefix("vmlinuz-").filter(|_| !in_modules_dir) {
                let modules =
                    [dir.join("lib/modules").join(release), dir.join("usr/lib/modules").join(release)]
                        .into_iter()
                        .find(|modules| modules.is_dir())
                        .unwrap_or_else(|| dir.join("lib/modules").join(release));
                images.push((path, modules));
            }
        }
    }
    images.sort();
    let Some((vmlinuz, modules)) = images.into_iter().next() else {
        bail!(
            "no vmlinuz in {}: a kernel split in parts (linux-image-*, linux-binary-*, linux-modules-*) \
             is given as A.deb,B.deb,C.deb",
            dir.display()
        );
    };
    if !modules.join("kernel").is_dir() {
        bail!("no modules beside {}: {} has no kernel/ directory", vmlinuz.display(), modules.display());
    }
    let release = modules
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .with_context(|| format!("{} names no release", modules.display()))?;
    Ok(Kernel { vmlinuz, modules, release, package, package_version, arch })
}

/// A Debian kernel package's name, with its series (X.Y).
struct Candidate {
    name: String,
    series: (u32, u32),
}

/// The generic flavours of `arch`: linux-image-X.Y.N-M-amd64 (up to 6.1)
/// and linux-image-X.Y.N+debNN[.P]-amd64 (from 6.12), not -cloud-, -rt-,
/// -dbg, -unsigned, arm64's -16k or the meta packages (linux-image-amd64,
/// linux-image-6.1-amd64), which would only bring one of these along.
fn candidates(names: &[String], arch: Arch) -> Result<Vec<Candidate>> {
    let pattern = Regex::new(&format!(
        r"^linux-image-(\d+)\.(\d+)\.\d+(-\d+|\+deb\d+(\.\d+)?)-{}$",
        arch.debian_name()
    ))?;
    Ok(names
        .iter()
        .filter_map(|name| {
            let captures = pattern.captures(name)?;
            let series = (captures[1].parse().ok()?, captures[2].parse().ok()?);
            Some(Candidate { name: name.clone(), series })
        })
        .collect())
}

fn parse_series(name: &str) -> Option<(u32, u32)> {
    let (major, minor) = name.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// `name` resolved through Debian's registry, downloaded and unpacked
/// unless it was before.
fn from_registry(name: &str, arch: Arch, verbosity: Verbosity) -> Result<Kernel> {
    let wanted_package = name.starts_with("linux-image-").then_some(name);
    let wanted_series = if name == "newest" { None } else { parse_series(name) };
    if wanted_package.is_none() && wanted_series.is_none() && name != "newest" {
        bail!(
            "no kernel {name}: KERNEL is a linux-image-*.deb, a directory holding one unpacked, \
             a package name, a series such as 6.1, or newest"
        );
    }
    let apt = Apt::new(&apt_dir(arch), arch, verbosity)?;
    let names = if let Some(package) = wanted_package {
        vec![package.to_owned()]
    } else {
        let all = candidates(&apt.package_names("linux-image-")?, arch)?;
        let series = match wanted_series {
            Some(series) => series,
            None => all.iter().map(|candidate| candidate.series).max().context("Debian lists no kernel")?,
        };
        all.into_iter()
            .filter(|candidate| candidate.series == series)
            .map(|candidate| candidate.name)
            .collect()
    };
    let newest = apt
        .records(&names)?
        .into_iter()
        .max_by(|left, right| {
            apt::compare_versions(&left.version, &right.version)
                .then_with(|| left.package.cmp(&right.package))
        })
        .with_context(|| {
            format!(
                "Debian has no {} kernel package for {name} (its lists are in {})",
                arch.debian_name(),
                apt.dir().display()
            )
        })?;
    // The parts a split 7.x kernel keeps its vmlinuz and modules in: not
    // linux-base-*, whose scripts a VM needs none of, and which the
    // archive does not always have at the kernel's version (6.18.15).
    let parts: Vec<String> = apt::same_version_dependencies(&newest.depends, &newest.version)
        .into_iter()
        .filter(|part| part.starts_with("linux-binary-") || part.starts_with("linux-modules-"))
        .collect();
    let parts_said = if parts.is_empty() { String::new() } else { format!(" (with {})", parts.join(", ")) };
    verbosity.say(format!("{name} is {} {}{parts_said}", newest.package, newest.version));
    let unpacked = unpacked_dir(&newest.package, &newest.version);
    if !unpacked.join(".done").exists() {
        download_and_unpack(&apt, &newest, &parts, &unpacked, verbosity)?;
    }
    from_unpacked(&unpacked, Some(newest.package), Some(newest.version), arch)
}

/// Fetches the package and the parts it is split in, of the same version,
/// unpacks them and drops the .debs: the unpacked tree is what is kept.
fn download_and_unpack(
    apt: &Apt,
    record: &apt::Record,
    parts: &[String],
    unpacked: &Path,
    verbosity: Verbosity,
) -> Result<()> {
    let debs_dir = cache_dir().join("debs");
    let mut debs = Vec::new();
    for package in std::iter::once(&record.package).chain(parts) {
        verbosity.say(format!("downloading {package} {}", record.version));
        debs.push(apt.download(package, &record.version, &debs_dir)?);
    }
    unpack(&debs, unpacked, verbosity)?;
    let done = unpacked.join(".done");
    fs::write(&done, format!("{} {}\n", record.package, record.version))
        .with_context(|| format!("cannot write {}", done.display()))?;
    for deb in &debs {
        // Only space is lost if it stays.
        let _ = fs::remove_file(deb);
    }
    Ok(())
}

/// A static busybox of `arch`, for the initramfs: Debian's
/// busybox-static, fetched through the private apt configuration and kept
/// as target/vm/busybox/busybox (busybox-arm64/ for arm64). The host's
/// busybox, if any, may be dynamic.
pub fn busybox(arch: Arch, verbosity: Verbosity) -> Result<PathBuf> {
    let dir = cache_dir().join(match arch {
        Arch::Amd64 => "busybox",
        Arch::Arm64 => "busybox-arm64",
    });
    let busybox = dir.join("busybox");
    if busybox.is_file() {
        return Ok(busybox);
    }
    let apt = Apt::new(&apt_dir(arch), arch, verbosity)?;
    let record = apt
        .records(&["busybox-static".to_owned()])?
        .into_iter()
        .max_by(|left, right| apt::compare_versions(&left.version, &right.version))
        .context("Debian lists no busybox-static")?;
    verbosity.say(format!("downloading busybox-static {}", record.version));
    let deb = apt.download(&record.package, &record.version, &cache_dir().join("debs"))?;
    let unpacked = dir.with_extension("tmp");
    unpack(std::slice::from_ref(&deb), &unpacked, Verbosity::Quiet)?;
    // In /bin up to bookworm, /usr/bin from trixie on.
    let found = [unpacked.join("bin/busybox"), unpacked.join("usr/bin/busybox")]
        .into_iter()
        .find(|path| path.is_file())
        .with_context(|| format!("no busybox in {}", deb.display()))?;
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    fs::copy(&found, &busybox).with_context(|| format!("cannot copy {}", found.display()))?;
    let _ = fs::remove_dir_all(&unpacked);
    let _ = fs::remove_file(&deb);
    Ok(busybox)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_generic_flavours_are_candidates() {
        let names: Vec<String> = [
            "linux-image-6.1.0-57-amd64",
            "linux-image-6.1.0-57-amd64-unsigned",
            "linux-image-6.1.0-57-cloud-amd64",
            "linux-image-6.1.0-57-rt-amd64",
            "linux-image-6.1.0-57-amd64-dbg",
            "linux-image-6.1-amd64",
            "linux-image-amd64",
            "linux-image-6.12.118+deb13-amd64",
            "linux-image-6.12.115+deb13.1-amd64",
            "linux-image-7.3.4+deb13-amd64",
        ]
        .map(str::to_owned)
        .into();
        let found: Vec<(String, (u32, u32))> = candidates(&names, Arch::Amd64)
            .expect("the pattern compiles")
            .into_iter()
            .map(|candidate| (candidate.name, candidate.series))
            .collect();
        assert_eq!(
            found,
            [
                ("linux-image-6.1.0-57-amd64".to_owned(), (6, 1)),
                ("linux-image-6.12.118+deb13-amd64".to_owned(), (6, 12)),
                ("linux-image-6.12.115+deb13.1-amd64".to_owned(), (6, 12)),
                ("linux-image-7.3.4+deb13-amd64".to_owned(), (7, 3)),
            ]
        );
        assert_eq!(parse_series("5.10"), Some((5, 10)));
        assert_eq!(parse_series("newest"), None);
        assert!((6, 12) > (6, 9), "series compare by number");
    }
}
