//! Opening files that traced programs and containers control, as root,
//! without letting them choose what memleak opens.
//!
//! - A path as a process sees it is resolved with the process's root as
//!   the root (openat2 with `RESOLVE_IN_ROOT`): an absolute symlink in a
//!   container leads inside the container, never to the host.
//! - Only regular files are opened for reading: the path is first opened
//!   with `O_PATH`, which has no effect on devices or FIFOs (opening
//!   `/dev/watchdog` arms it; a FIFO blocks its opener), and only a regular
//!   file is then reopened, through that very descriptor, to be read.
//! - What is read is bounded by the file's size, and that by a limit: a
//!   file that claims gigabytes is refused, not read into memory. Files
//!   are read rather than mapped: a container could truncate a mapped file
//!   under memleak, and the SIGBUS would kill it.

use std::{
    ffi::CString,
    fs::File,
    io::{self, Read as _},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::{
            ffi::OsStrExt as _,
            fs::{MetadataExt as _, OpenOptionsExt as _},
        },
    },
    path::Path,
};

use super::maps::MapsEntry;

/// A file told apart from every other, and from its own earlier
/// contents: device, inode, size and modification time (ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    device: u64,
    inode: u64,
    size: u64,
    modified_ns: i128,
}

impl FileIdentity {
    pub fn of(file: &File) -> Option<Self> {
        file.metadata().ok().map(|metadata| Self::of_metadata(&metadata))
    }

    pub fn of_metadata(metadata: &std::fs::Metadata) -> Self {
        Self {
            device: metadata.dev(),
            inode: metadata.ino(),
            size: metadata.size(),
            modified_ns: i128::from(metadata.mtime()) * 1_000_000_000 + i128::from(metadata.mtime_nsec()),
        }
    }
}

/// The most memleak reads of any one file: ELF objects and their debug
/// files. The largest Debian debug file (libLLVM's) is under 2 GiB.
pub const READ_LIMIT: u64 = 4 << 30;

/// Opens `path` as process `pid` sees it, resolved inside its root, if it
/// is a regular file.
pub fn open_in_root(pid: u32, path: &Path) -> io::Result<File> {
    let root = open_path(libc::AT_FDCWD, Path::new(&format!("/proc/{pid}/root")), 0)?;
    let relative = path.strip_prefix("/").unwrap_or(path);
    let resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    reopen_regular(&open_path(root.as_raw_fd(), relative, resolve)?)
}

/// Opens `path` below directory `root` (a host's root mounted in a
/// container, `--host-root`), resolved with `root` as the root, if it is
/// a regular file: a link there never leads out of it.
pub fn open_under(root: &Path, path: &Path) -> io::Result<File> {
    let root = open_path(libc::AT_FDCWD, root, 0)?;
    let relative = path.strip_prefix("/").unwrap_or(path);
    let resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    reopen_regular(&open_path(root.as_raw_fd(), relative, resolve)?)
}

/// The names in directory `path` below `root`, resolved as `open_under`
/// resolves, at most `limit` of them: names only, nothing they link to is
/// followed.
pub fn list_under(root: &Path, path: &Path, limit: usize) -> io::Result<Vec<std::ffi::OsString>> {
    let root = open_path(libc::AT_FDCWD, root, 0)?;
    let relative = path.strip_prefix("/").unwrap_or(path);
    let resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    let directory = open_path(root.as_raw_fd(), relative, resolve)?;
    // Through the descriptor's own magic link: the very directory resolved.
    let held = Path::new("/proc/self/fd").join(directory.as_raw_fd().to_string());
    Ok(std::fs::read_dir(held)?.flatten().take(limit).map(|entry| entry.file_name()).collect())
}

/// Opens `path` on the host (links followed, as memleak's own paths are),
/// if it is a regular file.
pub fn open_regular(path: &Path) -> io::Result<File> {
    reopen_regular(&open_path(libc::AT_FDCWD, path, 0)?)
}

/// The file that `entry` of process `pid`'s maps maps, if it is a regular
/// one: through `/proc/PID/map_files` (the very file, even deleted), else
/// by its path inside the process's root, then on the host, either taken
/// only if it is that same file (device and inode).
pub fn open_mapped(pid: u32, entry: &MapsEntry) -> Option<File> {
    let path = Path::new(entry.file()?);
    let map_files = format!("/proc/{pid}/map_files/{:x}-{:x}", entry.start, entry.end);
    if let Ok(file) = open_regular(Path::new(&map_files)) {
        return Some(file);
    }
    let same_file = |file: &File| {
        file.metadata().is_ok_and(|metadata| {
            let device = (libc::major(metadata.dev()), libc::minor(metadata.dev()));
            device == entry.device && metadata.ino() == entry.inode
        })
    };
    open_in_root(pid, path).ok().filter(same_file).or_else(|| open_regular(path).ok().filter(same_file))
}

/// Whether process `pid` has memleak's root as its own: no container, no
/// chroot.
pub fn shares_root(pid: u32) -> bool {
    let identity = |path: &str| std::fs::metadata(path).map(|metadata| (metadata.dev(), metadata.ino())).ok();
    identity(&format!("/proc/{pid}/root")).is_some_and(|root| Some(root) == identity("/"))
}

/// The whole of a file opened here, if it is at most `limit` bytes.
pub fn read_limited(file: &File, limit: u64) -> io::Result<Vec<u8>> {
    let size = file.metadata()?.len();
    if size > limit {
        return Err(io::Error::other(format!("it is {size} bytes, more than memleak reads ({limit})")));
    }
    let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    // A file that grows meanwhile is read as it was when measured.
    file.take(size).read_to_end(&mut data)?;
    Ok(data)
}

/// Reads the regular file at `path` on the host, within `READ_LIMIT`.
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    read_limited(&open_regular(path)?, READ_LIMIT)
}

/// The kernel's `struct open_how` (libc's cannot be built: it may grow).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// openat2(`directory`, `path`, `O_PATH`, `resolve`): a handle on whatever
/// is there, which opening that way does not disturb.
fn open_path(directory: libc::c_int, path: &Path, resolve: u64) -> io::Result<OwnedFd> {
    let name = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
    let how = OpenHow { flags: (libc::O_PATH | libc::O_CLOEXEC) as u64, mode: 0, resolve };
    // SAFETY: `name` is NUL-terminated and `how` a valid open_how, both
    // alive for the call, whose size is passed.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat2, directory, name.as_ptr(), &raw const how, size_of::<OpenHow>())
    };
    let fd = i32::try_from(fd).map_err(|_| io::Error::last_os_error())?;
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The file `handle` holds, opened for reading, if it is a regular one.
fn reopen_regular(handle: &OwnedFd) -> io::Result<File> {
    let held = Path::new("/proc/self/fd").join(handle.as_raw_fd().to_string());
    let metadata = std::fs::metadata(&held)?;
    if !metadata.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    // Through the descriptor's own magic link: the very file inspected.
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(held)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A directory standing in for a container's root, seen through a
    /// process whose root it is not: `open_in_root` is tested with our own
    /// pid and paths below our real root, then the resolution rules with a
    /// chroot-like directory through openat2 directly.
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("memleak-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn devices_and_fifos_are_refused_without_being_opened_for_reading() {
        assert!(open_regular(Path::new("/dev/zero")).is_err());
        let dir = scratch("fifo");
        let fifo = dir.join("fifo");
        let name = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        // Would block forever if it were opened for reading.
        assert!(open_regular(&fifo).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn absolute_links_resolve_inside_the_root() {
        let root = scratch("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/inside"), "inside").unwrap();
        // In the "container", /etc/escape leads to /etc/inside: its own.
        symlink("/etc/inside", root.join("etc/escape")).unwrap();
        let handle = open_path(libc::AT_FDCWD, &root, 0).unwrap();
        let resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
        let file = reopen_regular(&open_path(handle.as_raw_fd(), Path::new("etc/escape"), resolve).unwrap());
        assert_eq!(read_limited(&file.unwrap(), 100).unwrap(), b"inside");
        // `..` cannot climb out either.
        symlink("../../../../../../etc/hostname", root.join("etc/climb")).unwrap();
        assert!(open_path(handle.as_raw_fd(), Path::new("etc/climb"), resolve).is_err());
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn reads_are_bounded() {
        let file = open_regular(Path::new("/proc/self/exe")).unwrap();
        assert!(read_limited(&file, 1000).unwrap_err().to_string().contains("more than memleak reads"));
        assert!(open_in_root(std::process::id(), Path::new("/proc/self/exe")).is_err(), "a magic link");
    }
}
