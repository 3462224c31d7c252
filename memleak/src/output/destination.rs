//! Where on disk a report file may go, and how it gets there without
//! trusting anything another user put in the directory: see the module
//! above for the rules, and `Destination::of` and `Temporary` for how.

use std::{
    ffi::CString,
    fs::{self, File, OpenOptions},
    io,
    mem::MaybeUninit,
    os::unix::{
        ffi::OsStrExt as _,
        fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _},
    },
    path::{Path, PathBuf},
};

use super::{write_error, OutputError};

/// The directory a path names an entry of: `.` for a bare name.
pub(super) fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// How many links memleak follows before it treats a path as a loop, as
/// the kernel's MAXSYMLINKS does.
const MAX_LINKS: usize = 40;

/// What is at a final path, and so what writing there means. Decided by
/// looking, not by opening: opening a device can have effects of its own
/// (opening `/dev/watchdog` arms it).
#[derive(Debug)]
pub(super) enum Destination {
    /// Nothing: a new file.
    Absent,
    /// A regular file, or a link memleak does not write through (to a
    /// file, to nothing, or one it does not trust): replaced with --force,
    /// the link itself and never what it leads to.
    Replaceable,
    /// A character device, a FIFO or an open file: written in place.
    Direct(Through),
    /// A directory, block device or socket: neither written nor replaced.
    Unusable(&'static str),
}

/// Where a direct target is opened.
#[derive(Debug)]
pub(super) struct Through {
    /// The device or FIFO itself, or the /proc link to an open file.
    pub(super) path: PathBuf,
    /// A link in `/proc/PID/fd` to an open file, which only opening it
    /// resolves: a "magic link" in the kernel's words.
    pub(super) magic: bool,
    /// For messages: "a character device".
    pub(super) what: &'static str,
}

impl Destination {
    /// Follows the links at `path` one by one (only links root or
    /// memleak's user owns, as `fs.protected_symlinks` would) to what they
    /// lead to. A link in a procfs `fd` directory (`/proc/PID/fd`, where
    /// `/dev/stdout` and `/dev/fd` lead) is an open file, whatever it
    /// names; procfs's other links (`exe`, `cwd`, `map_files`) are
    /// followed by their text, as any link is.
    pub(super) fn of(path: &Path) -> io::Result<Self> {
        let mut current = path.to_path_buf();
        for hop in 0..MAX_LINKS {
            // Past the first, `path` is a link.
            let through_link = hop > 0;
            let metadata = match fs::symlink_metadata(&current) {
                Ok(metadata) => metadata,
                // A link that leads nowhere is still a link.
                Err(error) if error.kind() == io::ErrorKind::NotFound => {
                    return Ok(if through_link { Self::Replaceable } else { Self::Absent });
                }
                Err(error) => return Err(error),
            };
            if !metadata.file_type().is_symlink() {
                return Ok(Self::of_node(metadata.file_type(), current, through_link));
            }
            if !is_trusted(&metadata) {
                return Ok(Self::Replaceable);
            }
            let directory = directory_of(&current);
            if directory.file_name().is_some_and(|name| name == "fd") && is_on_procfs(directory)? {
                return Ok(Self::Direct(Through { path: current, magic: true, what: "an open file" }));
            }
            current = directory.join(fs::read_link(&current)?);
        }
        Ok(Self::Replaceable) // a loop of links
    }

    /// `node`, the path itself or what its links lead to.
    fn of_node(file_type: fs::FileType, node: PathBuf, through_link: bool) -> Self {
        let direct = |what| Self::Direct(Through { path: node, magic: false, what });
        if file_type.is_char_device() {
            direct("a character device")
        } else if file_type.is_fifo() {
            direct("a FIFO")
        } else if file_type.is_file() || through_link {
            // A link to a directory is a link: --force replaces it.
            Self::Replaceable
        } else if file_type.is_dir() {
            Self::Unusable("a directory")
        } else if file_type.is_block_device() {
            Self::Unusable("a block device")
        } else if file_type.is_socket() {
            Self::Unusable("a socket")
        } else {
            Self::Unusable("neither a file nor a device")
        }
    }

    /// Whether a new file may be put at `path`, where this is.
    pub(super) fn check_replaceable(&self, path: &Path, force: bool) -> Result<(), OutputError> {
        match self {
            Self::Absent => Ok(()),
            Self::Replaceable if force => Ok(()),
            Self::Replaceable => Err(OutputError::Exists(path.to_path_buf())),
            Self::Direct(Through { what, .. }) | Self::Unusable(what) => {
                Err(OutputError::NotAFile { path: path.to_path_buf(), what })
            }
        }
    }
}

/// A link root or memleak's own user made, which memleak may follow.
pub(super) fn is_trusted(link: &fs::Metadata) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let user = unsafe { libc::geteuid() };
    link.uid() == 0 || link.uid() == user
}

pub(super) fn is_on_procfs(directory: &Path) -> io::Result<bool> {
    let name = c_path(directory)?;
    let mut filesystem = MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `name` is NUL-terminated; `filesystem` has room for the
    // struct statfs that the call fills in.
    if unsafe { libc::statfs(name.as_ptr(), filesystem.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statfs succeeded, so it filled `filesystem` in.
    let filesystem = unsafe { filesystem.assume_init() };
    // Signed on glibc and unsigned on musl: compared widened.
    Ok(i128::from(filesystem.f_type) == i128::from(libc::PROC_SUPER_MAGIC))
}

pub(super) fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Puts a written temporary at `path`: over a file or link there only
/// with `force`, and never over anything else, as `Destination` decides.
/// Returns the file, open and now at `path`.
pub(super) fn place(temporary: Temporary, path: &Path, force: bool) -> Result<File, OutputError> {
    Destination::of(path).map_err(write_error(path))?.check_replaceable(path, force)?;
    temporary.rename(path, force)
}

/// A file nobody else made, removed on drop unless renamed into place. It
/// is made in the final path's directory: rename(2) within a directory is
/// atomic, and never copies across filesystems.
///
/// Why a named temporary with `O_EXCL`, not `O_TMPFILE` and linkat(2):
/// `O_TMPFILE` would leave nothing behind even when killed, but linkat(2)
/// never replaces a path, so --force would still need a named file and a
/// rename; and filesystems without `O_TMPFILE` (NFS, CIFS, many FUSE ones)
/// would need this path anyway, then as a rarely-run fallback. One way
/// that works everywhere is better, and the cost is small: a temporary
/// lives only while one report is written and synced.
pub(super) struct Temporary {
    pub(super) file: File,
    pub(super) name: RemoveOnDrop,
}

/// How many random names to try before giving up. One is taken only if
/// someone planted a file at it, which takes guessing 64 random bits.
const ATTEMPTS: usize = 8;

impl Temporary {
    /// `NAME.memleak-<16 hex digits>.tmp` beside `target`.
    pub(super) fn create(target: &Path) -> io::Result<Self> {
        let Some(name) = target.file_name() else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not the name of a file"));
        };
        let mut taken = None;
        for _ in 0..ATTEMPTS {
            let mut temporary = name.to_os_string();
            temporary.push(format!(".memleak-{}.tmp", random_hex()?));
            let path = target.with_file_name(temporary);
            match create_exclusive(&path) {
                Ok(file) => return Ok(Self { file, name: RemoveOnDrop(Some(path)) }),
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => taken = Some(error),
                Err(error) => return Err(error),
            }
        }
        Err(taken.unwrap_or_else(|| io::ErrorKind::AlreadyExists.into()))
    }

    /// rename(2), which replaces a link at `path` rather than follow it;
    /// with `replace` false, only if nothing is at `path`.
    fn rename(self, path: &Path, replace: bool) -> Result<File, OutputError> {
        let Self { file, mut name } = self;
        let Some(temporary) = name.0.take() else { return Ok(file) };
        let renamed =
            if replace { fs::rename(&temporary, path) } else { rename_no_replace(&temporary, path) };
        match renamed {
            Ok(()) => Ok(file),
            Err(error) => {
                name.0 = Some(temporary); // removed as `name` drops
                if error.kind() == io::ErrorKind::AlreadyExists {
                    return Err(OutputError::Exists(path.to_path_buf()));
                }
                Err(OutputError::Write { path: path.to_path_buf(), source: error })
            }
        }
    }
}

/// A temporary's name, removed on drop while it is set.
pub(super) struct RemoveOnDrop(pub(super) Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = fs::remove_file(path);
        }
    }
}

/// A new file at `path`, or an error if anything, a link included, is
/// there (`O_EXCL`; `O_NOFOLLOW` says so twice). std adds `O_CLOEXEC`.
pub(super) fn create_exclusive(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).mode(0o644).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// rename(2) with `RENAME_NOREPLACE`. A filesystem without it (EINVAL:
/// NFS, some FUSE) gets a check and a plain rename, which leaves a
/// moment for a file that appears to be replaced. The system call itself,
/// not libc's wrapper: the musl that Rust's static target links (1.2.3)
/// has none.
pub(super) fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    let (from_name, to_name) = (c_path(from)?, c_path(to)?);
    // SAFETY: renameat2 takes two directory fds, two names, NUL-terminated
    // and outliving the call, and flags.
    let renamed = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from_name.as_ptr(),
            libc::AT_FDCWD,
            to_name.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if renamed == 0 {
        return Ok(());
    }
    let error = io::Error::last_os_error();
    if !matches!(error.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) {
        return Err(error);
    }
    match fs::symlink_metadata(to) {
        Ok(_) => Err(io::ErrorKind::AlreadyExists.into()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => fs::rename(from, to),
        Err(error) => Err(error),
    }
}

/// 64 bits from getrandom(2), as 16 hex digits.
pub(super) fn random_hex() -> io::Result<String> {
    let mut bytes = [0u8; 8];
    let mut filled = 0;
    while filled < bytes.len() {
        let rest = &mut bytes[filled..];
        // SAFETY: the pointer and length describe `rest`, which the call
        // fills in and nothing else uses meanwhile.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if let Ok(got) = usize::try_from(got) {
            filled += got;
            continue;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
    Ok(format!("{:016x}", u64::from_ne_bytes(bytes)))
}
