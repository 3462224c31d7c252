//! The initramfs each kernel boots with: a static busybox, the modules
//! it takes to mount the host's `/` over virtio-9p under an overlay, and
//! the two scripts that do it and then run the command (init.sh,
//! stage2.sh). Distribution kernels build virtio-pci, 9p and overlayfs as
//! modules, and their own initramfs would look for a disk, so one is made
//! here, once per kernel, kept under target/vm/initrd/.

use std::{
    collections::{BTreeMap, HashSet},
    ffi::CString,
    fs,
    io::Write as _,
    os::unix::{ffi::OsStrExt as _, fs::PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use super::{kernels::cache_dir, Kernel, Verbosity};

/// The first script the kernel runs: loads the modules, mounts the
/// host's root and switches to it.
const INIT: &str = include_str!("init.sh");

/// The script run on the host's root: mounts what a system has, the
/// shared directories, and runs the command.
const STAGE2: &str = include_str!("stage2.sh");

/// What mounting the host's root takes; their dependencies come along.
const MODULES: [&str; 4] = ["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// The initramfs for `kernel`, with `busybox` of the kernel's
/// architecture, made unless one made from the same scripts, busybox and
/// modules is there. `host_busybox` runs here to write the archive.
pub fn build(kernel: &Kernel, busybox: &Path, host_busybox: &Path, verbosity: Verbosity) -> Result<PathBuf> {
    let dir = cache_dir().join("initrd");
    let initrd = dir.join(format!("{}.cpio", kernel.release));
    let stamp_path = dir.join(format!("{}.cpio.stamp", kernel.release));
    let stamp = format!(
        "{:016x} {} {}\n",
        fnv1a(format!("{INIT}\0{STAGE2}\0{MODULES:?}").as_bytes()),
        busybox.display(),
        kernel.modules.display()
    );
    if initrd.is_file() && fs::read_to_string(&stamp_path).is_ok_and(|made| made == stamp) {
        return Ok(initrd);
    }
    verbosity.say(format!("making the initramfs for {}", kernel.release));
    let work = dir.join(format!("{}.tmp", kernel.release));
    if work.exists() {
        fs::remove_dir_all(&work).with_context(|| format!("cannot remove {}", work.display()))?;
    }
    let made = fill(&work, kernel, busybox, verbosity).and_then(|()| {
        let partial = dir.join(format!("{}.cpio.tmp", kernel.release));
        archive(&work, host_busybox, &partial)?;
        fs::rename(&partial, &initrd).with_context(|| format!("cannot write {}", initrd.display()))
    });
    let _ = fs::remove_dir_all(&work);
    made?;
    fs::write(&stamp_path, stamp).with_context(|| format!("cannot write {}", stamp_path.display()))?;
    Ok(initrd)
}

/// The initramfs's tree, in `root`.
fn fill(root: &Path, kernel: &Kernel, busybox: &Path, verbosity: Verbosity) -> Result<()> {
    for dir in ["bin", "dev", "proc", "sys", "newroot", "lower", "upper", "modules"] {
        fs::create_dir_all(root.join(dir)).with_context(|| format!("cannot create {}", root.display()))?;
    }
    fs::copy(busybox, root.join("bin/busybox"))
        .with_context(|| format!("cannot copy {}", busybox.display()))?;
    set_mode(&root.join("bin/busybox"), 0o755)?;
    // The kernel opens /dev/console for init before anything can mount
    // devtmpfs.
    make_device(&root.join("dev/console"), 0o600, 5, 1)?;
    make_device(&root.join("dev/null"), 0o666, 1, 3)?;
    let order = Modules::new(&kernel.modules, verbosity)?.copy_in_order(&root.join("modules"))?;
    fs::write(root.join("modules/order"), order.iter().map(|name| name.clone() + "\n").collect::<String>())?;
    for (name, script) in [("init", INIT), ("stage2", STAGE2)] {
        let path = root.join(name);
        fs::write(&path, script).with_context(|| format!("cannot write {}", path.display()))?;
        set_mode(&path, 0o755)?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot change the mode of {}", path.display()))
}

fn make_device(path: &Path, mode: u32, major: u32, minor: u32) -> Result<()> {
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: `c_path` is a NUL-terminated path that outlives the call.
    let status = unsafe { libc::mknod(c_path.as_ptr(), libc::S_IFCHR | mode, libc::makedev(major, minor)) };
    if status != 0 {
        bail!(
            "cannot make the device {} for the initramfs ({}): run as root",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    set_mode(path, mode)
}

/// The cpio (newc) archive of `root`, written by busybox's cpio: the
/// format the kernel unpacks, with no other cpio needed on the host.
fn archive(root: &Path, busybox: &Path, output: &Path) -> Result<()> {
    let mut names = Vec::new();
    list(root, Path::new("."), &mut names)?;
    let file = fs::File::create(output).with_context(|| format!("cannot create {}", output.display()))?;
    let mut cpio = Command::new(busybox)
        .args(["cpio", "-o", "-H", "newc"])
        .current_dir(root)
        .stdin(Stdio::piped())
        .stdout(file)
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot run {} cpio", busybox.display()))?;
    let mut stdin = cpio.stdin.take().context("cpio has no stdin")?;
    for name in &names {
        stdin.write_all(name.as_os_str().as_bytes())?;
        stdin.write_all(b"\n")?;
    }
    drop(stdin);
    let status = cpio.wait()?;
    if !status.success() {
        bail!("busybox cpio failed ({status}) making {}", output.display());
    }
    Ok(())
}

/// Every path under `root`, relative (`./bin/busybox`), parents first,
/// as `find .` lists them.
fn list(root: &Path, relative: &Path, names: &mut Vec<PathBuf>) -> Result<()> {
    names.push(relative.to_owned());
    let dir = root.join(relative);
    if !fs::symlink_metadata(&dir)?.is_dir() {
        return Ok(());
    }
    let mut entries: Vec<_> =
        fs::read_dir(&dir)?.filter_map(Result::ok).map(|entry| entry.file_name()).collect();
    entries.sort();
    for entry in entries {
        list(root, &relative.join(entry), names)?;
    }
    Ok(())
}

/// A kernel's modules: where each is, and which are built in.
struct Modules {
    /// By name, `-` written `_`, as the kernel names them.
    files: BTreeMap<String, PathBuf>,
    /// None when the kernel has no modules.builtin to tell.
    built_in: Option<HashSet<String>>,
    verbosity: Verbosity,
}

/// A module's name as the kernel has it: `9pnet-virtio` is `9pnet_virtio`.
fn module_name(file_name: &str) -> Option<String> {
    let stem = file_name.split_once(".ko").filter(|(_, rest)| rest.is_empty() || rest.starts_with('.'))?.0;
    Some(stem.replace('-', "_"))
}

impl Modules {
    fn new(dir: &Path, verbosity: Verbosity) -> Result<Self> {
        let mut files = BTreeMap::new();
        let mut pending = vec![dir.join("kernel")];
        while let Some(current) = pending.pop() {
            for entry in
                fs::read_dir(&current).with_context(|| format!("cannot read {}", current.display()))?
            {
                let path = entry?.path();
                if path.is_dir() {
                    pending.push(path);
                } else if let Some(name) =
                    path.file_name().and_then(|name| module_name(&name.to_string_lossy()))
                {
                    files.insert(name, path);
                }
            }
        }
        let built_in = fs::read_to_string(dir.join("modules.builtin")).ok().map(|listed| {
            listed.lines().filter_map(|line| module_name(line.rsplit('/').next().unwrap_or(line))).collect()
        });
        Ok(Self { files, built_in, verbosity })
    }

    /// Copies MODULES and what they depend on into `into`, decompressed,
    /// and returns their names in the order they load: each after those
    /// it depends on (read from its own `depends=`, as the packages have
    /// no modules.dep and the host may have no depmod).
    fn copy_in_order(&self, into: &Path) -> Result<Vec<String>> {
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for name in MODULES {
            self.add(name, into, &mut seen, &mut order)?;
        }
        Ok(order)
    }

    fn add(
        &self,
        name: &str,
        into: &Path,
        seen: &mut HashSet<String>,
        order: &mut Vec<String>,
    ) -> Result<()> {
        let name = name.replace('-', "_");
        if !seen.insert(name.clone()) {
            return Ok(());
        }
        let Some(file) = self.files.get(&name) else {
            match &self.built_in {
                Some(built_in) if built_in.contains(&name) => return Ok(()),
                Some(_) => bail!("the kernel has no module {name}, and does not list it as built in"),
                None => {
                    self.verbosity
                        .say(format!("no module {name}, and no modules.builtin: taken as built in"));
                    return Ok(());
                }
            }
        };
        let contents = decompressed(file)?;
        let copy = into.join(format!("{name}.ko"));
        fs::write(&copy, &contents).with_context(|| format!("cannot write {}", copy.display()))?;
        for dependency in dependencies(&contents) {
            self.add(&dependency, into, seen, order)?;
        }
        order.push(name);
        Ok(())
    }
}

/// A module file's contents, decompressed as Debian ships them
/// (.ko.xz up to 6.x, .ko.zst later; busybox's insmod reads neither).
fn decompressed(file: &Path) -> Result<Vec<u8>> {
    let extension = file.extension().and_then(|extension| extension.to_str()).unwrap_or("");
    let program = match extension {
        "xz" => ["xz", "-dc"],
        "zst" => ["zstd", "-qdc"],
        "gz" => ["gzip", "-dc"],
        _ => return fs::read(file).with_context(|| format!("cannot read {}", file.display())),
    };
    let output = Command::new(program[0])
        .arg(program[1])
        .arg(file)
        .output()
        .with_context(|| format!("cannot run {} (to decompress {})", program[0], file.display()))?;
    if !output.status.success() {
        bail!(
            "{} -dc {} failed: {}",
            program[0],
            file.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output.stdout)
}

/// The modules a module's .modinfo says it depends on.
fn dependencies(module: &[u8]) -> Vec<String> {
    module
        .split(|byte| *byte == 0)
        .filter_map(|field| field.strip_prefix(b"depends="))
        .flat_map(|depends| {
            String::from_utf8_lossy(depends).split(',').map(str::to_owned).collect::<Vec<_>>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// FNV-1a, 64 bits: a hash that stays the same from one Rust release to
/// the next, so the stamp does not go stale by itself.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_and_dependencies_are_read() {
        assert_eq!(module_name("9pnet_virtio.ko.xz").as_deref(), Some("9pnet_virtio"));
        assert_eq!(module_name("virtio-pci.ko").as_deref(), Some("virtio_pci"));
        assert_eq!(module_name("9p.ko.zst").as_deref(), Some("9p"));
        assert_eq!(module_name("modules.order"), None);
        let modinfo = b"\0license=GPL\0depends=9pnet,netfs\0retpoline=Y\0";
        assert_eq!(dependencies(modinfo), ["9pnet", "netfs"]);
        assert!(dependencies(b"depends=\0").is_empty());
    }
}
