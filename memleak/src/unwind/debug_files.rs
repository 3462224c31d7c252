//! An object's separate debug file: where it may be, and whether a file
//! found there is it.
//!
//! Distributions and container images ship an object's DWARF and
//! `.debug_frame` in a file of their own, named by the object's build id
//! (`/usr/lib/debug/.build-id/ab/cdef….debug`) or by its `.gnu_debuglink`,
//! looked for beside the object, in `.debug/` there and under
//! `/usr/lib/debug`, as gdb does. Every one of those places is a path as
//! the traced process sees it, chosen by whoever made the process's
//! files, and memleak runs as root, so:
//!
//! - they are resolved inside the process's root, as every path of a
//!   container is (`process::files::open_in_root`): a container's link
//!   name never leads to a host file, and an absolute symlink leads back
//!   inside the container;
//! - the same places on the host (the host's `/usr/lib/debug`, the host
//!   directory of the object's path) are searched only for an object that
//!   is the host's own: the host's file at the object's path is that very
//!   file (device and inode);
//! - a file found is used only if it is a regular file of at most
//!   `MAX_BYTES`, an ELF file that names no further file, whose build id is
//!   the object's (found by build id) or whose CRC is the one the debug
//!   link records (found by link). Checking the CRC reads the file through
//!   a small buffer; nothing is read whole before it matches.

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
};

use object::{read::ReadCache, Object as _};

use crate::process::{address_space::MappedObject, files};

/// The largest debug file memleak looks at: Debian's largest, libLLVM's,
/// is under 2 GiB. A larger file claiming to be one is left alone rather
/// than checksummed or read.
pub const MAX_BYTES: u64 = 2 << 30;

/// Where a debug directory keeps the debug file of the object with build
/// id `id` (hex): `.build-id/ab/cdef….debug`, as distributions install
/// them; `None` for an id too short to split.
pub fn build_id_path(id: &str) -> Option<String> {
    (id.len() > 2 && id.is_char_boundary(2)).then(|| format!(".build-id/{}/{}.debug", &id[..2], &id[2..]))
}

/// What an object says of its debug file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Links {
    /// Its `.gnu_debuglink`, if a plain file name: the name and the CRC
    /// of the file it names.
    pub debuglink: Option<(String, u32)>,
    /// Whether it names other files in a way memleak does not follow: a
    /// `.gnu_debuglink` that is a path, a `.gnu_debugaltlink` or a
    /// `.debug_sup` (dwz's shared files, named by path).
    pub names_paths: bool,
}

impl Links {
    /// Whether it names no other file at all.
    pub fn none(&self) -> bool {
        self.debuglink.is_none() && !self.names_paths
    }
}

/// What the ELF object `file` names for its debug information, read
/// section by section (the headers and those sections alone); `None` if
/// it is no ELF object.
pub fn links_of(file: &File) -> Option<Links> {
    let cache = ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    let mut links = Links {
        names_paths: elf.section_by_name(".gnu_debugaltlink").is_some()
            || elf.section_by_name(".debug_sup").is_some(),
        ..Links::default()
    };
    if elf.section_by_name(".gnu_debuglink").is_some() {
        match elf.gnu_debuglink() {
            Ok(Some((name, crc))) => match std::str::from_utf8(name) {
                Ok(name) if !name.is_empty() && !name.contains('/') && name != "." && name != ".." => {
                    links.debuglink = Some((name.to_owned(), crc));
                }
                _ => links.names_paths = true,
            },
            _ => links.names_paths = true,
        }
    }
    Some(links)
}

/// What `object` names for its debug information, read through a file
/// description of its own: the object's is shared, and parsing moves its
/// offset.
pub fn object_links(object: &MappedObject) -> Option<Links> {
    links_of(&File::open(object.fd_path()).ok()?)
}

/// A verified debug file, open.
pub struct Found {
    pub file: File,
    /// Where it was found, for messages.
    pub place: DebugFile,
}

/// The separate debug file of `object`, mapped by process `pid`, if one
/// is where it may be (see the module's documentation) and passes the
/// checks.
pub fn find(pid: u32, object: &MappedObject) -> Option<Found> {
    let links = object_links(object)?;
    if links.names_paths {
        return None;
    }
    let hosts_own = object.is_hosts_own();
    let candidates = candidates_of(pid, &object.path, links.debuglink.as_ref(), object.build_id(), hosts_own);
    candidates.into_iter().find_map(|candidate| {
        let file = candidate.open().ok()?;
        match candidate.is_debug_file_of(&file, object.build_id(), links.debuglink.as_ref()) {
            Ok(()) => Some(Found { file, place: candidate }),
            Err(why) => {
                log::debug!("{candidate} is not the debug file of {}: {why}", object.path);
                None
            }
        }
    })
}

/// Candidate places of the debug file of `object_path` (as process `pid`
/// names it), best first: inside the process's root, then, for an object
/// that is the host's own, the same paths on the host.
pub fn candidates_of(
    pid: u32,
    object_path: &str,
    debuglink: Option<&(String, u32)>,
    build_id: Option<&str>,
    hosts_own: bool,
) -> Vec<DebugFile> {
    let mut paths: Vec<(PathBuf, Match)> = Vec::new();
    if let Some(name) = build_id.and_then(build_id_path) {
        paths.push((PathBuf::from(format!("/usr/lib/debug/{name}")), Match::BuildId));
    }
    // A link names a file, not a path (see `links_of`).
    if let Some((name, _)) = debuglink.filter(|(name, _)| !name.contains('/') && name != "..") {
        let directory = Path::new(object_path).parent().unwrap_or(Path::new("/"));
        let relative = directory.strip_prefix("/").unwrap_or(directory);
        for path in [
            directory.join(name),
            directory.join(".debug").join(name),
            Path::new("/usr/lib/debug").join(relative).join(name),
            Path::new("/usr/lib/debug").join(name),
        ] {
            paths.push((path, Match::Crc));
        }
    }
    let roots = if hosts_own { vec![Some(pid), None] } else { vec![Some(pid)] };
    roots
        .into_iter()
        .flat_map(|root_of| {
            paths.iter().map(move |(path, by)| DebugFile { root_of, path: path.clone(), by: *by })
        })
        .collect()
}

/// What makes a file found at a place the object's debug file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Match {
    /// Found by build id: it has the object's.
    BuildId,
    /// Found by debug link: its CRC is the link's.
    Crc,
}

/// Where a debug file may be: a path inside a process's root, or on the
/// host.
#[derive(Debug, PartialEq, Eq)]
pub struct DebugFile {
    pub root_of: Option<u32>,
    pub path: PathBuf,
    pub by: Match,
}

impl DebugFile {
    /// It, opened, if it is a regular file; a process's links resolve
    /// inside its root.
    pub fn open(&self) -> io::Result<File> {
        match self.root_of {
            Some(pid) => files::open_in_root(pid, &self.path),
            None => files::open_regular(&self.path),
        }
    }

    /// Whether `file`, opened from here, is the debug file of an object
    /// with build id `build_id` and debug link `debuglink`; if not, why.
    fn is_debug_file_of(
        &self,
        file: &File,
        build_id: Option<&str>,
        debuglink: Option<&(String, u32)>,
    ) -> Result<(), String> {
        let size = file.metadata().map_err(|error| error.to_string())?.len();
        if size > MAX_BYTES {
            return Err(format!("it is {size} bytes, more than memleak reads of a debug file ({MAX_BYTES})"));
        }
        let cache = ReadCache::new(file);
        let elf = object::File::parse(&cache).map_err(|error| format!("not an ELF file: {error}"))?;
        // It is symbolized itself, and blazesym would follow its links on
        // paths memleak does not choose.
        for section in [".gnu_debuglink", ".gnu_debugaltlink", ".debug_sup"] {
            if elf.section_by_name(section).is_some() {
                return Err(format!("it has a {section} section"));
            }
        }
        let its_id = elf.build_id().ok().flatten().map(crate::elf::hex);
        if let (Some(ours), Some(its)) = (build_id, &its_id) {
            if ours != its {
                return Err(format!("its build id is {its}, not {ours}"));
            }
        }
        match (self.by, debuglink) {
            (Match::BuildId, _) if its_id.is_some() => Ok(()),
            (Match::BuildId, _) => Err("it has no build id".to_owned()),
            (Match::Crc, Some(&(_, crc))) => {
                let its = crc_of(file, size).map_err(|error| error.to_string())?;
                (its == crc).then_some(()).ok_or_else(|| format!("its CRC is {its:08x}, not {crc:08x}"))
            }
            (Match::Crc, None) => Err("no debug link to check it against".to_owned()),
        }
    }
}

impl std::fmt::Display for DebugFile {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.root_of {
            Some(pid) => write!(out, "{} in the root of pid {pid}", self.path.display()),
            None => write!(out, "{}", self.path.display()),
        }
    }
}

/// The CRC-32 that `.gnu_debuglink` records of the first `size` bytes of
/// `file` (zlib's), read through a small buffer. Read at offsets: the
/// ELF parse before it left the file's own offset anywhere.
fn crc_of(file: &File, size: u64) -> io::Result<u32> {
    let mut crc = flate2::Crc::new();
    let mut buffer = vec![0u8; 64 << 10];
    let mut at = 0u64;
    while at < size {
        let want = usize::try_from((size - at).min(buffer.len() as u64)).unwrap_or(buffer.len());
        let read = std::os::unix::fs::FileExt::read_at(file, &mut buffer[..want], at)?;
        if read == 0 {
            break;
        }
        crc.update(&buffer[..read]);
        at += read as u64;
    }
    Ok(crc.sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_containers_object_is_looked_for_in_its_root_alone() {
        let link = ("app.debug".to_owned(), 0);
        let paths = candidates_of(42, "/etc/app", Some(&link), Some("abcdef12"), false);
        assert!(paths.iter().all(|candidate| candidate.root_of == Some(42)), "{paths:?}");
        let paths: Vec<_> =
            paths.iter().map(|candidate| (candidate.path.to_str().unwrap(), candidate.by)).collect();
        assert_eq!(
            paths,
            [
                ("/usr/lib/debug/.build-id/ab/cdef12.debug", Match::BuildId),
                ("/etc/app.debug", Match::Crc),
                ("/etc/.debug/app.debug", Match::Crc),
                ("/usr/lib/debug/etc/app.debug", Match::Crc),
                ("/usr/lib/debug/app.debug", Match::Crc),
            ]
        );
    }

    #[test]
    fn the_hosts_own_object_is_looked_for_on_the_host_too() {
        let paths = candidates_of(42, "/usr/bin/app", None, Some("abcdef12"), true);
        let path = PathBuf::from("/usr/lib/debug/.build-id/ab/cdef12.debug");
        assert_eq!(
            paths,
            [
                DebugFile { root_of: Some(42), path: path.clone(), by: Match::BuildId },
                DebugFile { root_of: None, path, by: Match::BuildId }
            ]
        );
        assert_eq!(paths[0].to_string(), "/usr/lib/debug/.build-id/ab/cdef12.debug in the root of pid 42");
    }

    #[test]
    fn memleak_itself_names_no_other_file() {
        assert_eq!(links_of(&File::open("/proc/self/exe").unwrap()), Some(Links::default()));
        assert_eq!(links_of(&File::open("/etc/hostname").unwrap()), None);
    }

    /// The smallest ELF file: a 64-bit x86-64 header, no section, no
    /// segment.
    fn bare_elf() -> Vec<u8> {
        let mut header = vec![0x7f, b'E', b'L', b'F', 2, 1, 1];
        header.resize(16, 0);
        header.extend(2u16.to_le_bytes()); // e_type: executable
        header.extend(62u16.to_le_bytes()); // e_machine: x86-64
        header.extend(1u32.to_le_bytes()); // e_version
        header.extend([0u8; 8 * 3 + 4]); // e_entry, e_phoff, e_shoff, e_flags
        for half in [64u16, 56, 0, 64, 0, 0] {
            // e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
            header.extend(half.to_le_bytes());
        }
        header
    }

    #[test]
    fn a_file_is_the_debug_file_only_if_it_is_a_matching_elf_file_of_sane_size() {
        let dir = std::env::temp_dir().join(format!("memleak-debug-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let check = |name: &str, by: Match, crc: u32| {
            let place = DebugFile { root_of: None, path: dir.join(name), by };
            let file = place.open().unwrap();
            place.is_debug_file_of(&file, Some("abcdef12"), Some(&("x".to_owned(), crc)))
        };
        std::fs::write(dir.join("elf"), bare_elf()).unwrap();
        let crc = crc_of(&File::open(dir.join("elf")).unwrap(), 64).unwrap();
        assert_eq!(check("elf", Match::Crc, crc), Ok(()));
        assert_eq!(
            check("elf", Match::Crc, crc ^ 1),
            Err(format!("its CRC is {crc:08x}, not {:08x}", crc ^ 1))
        );
        assert_eq!(check("elf", Match::BuildId, crc), Err("it has no build id".to_owned()));
        std::fs::write(dir.join("text"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        assert!(check("text", Match::Crc, 0).unwrap_err().starts_with("not an ELF file"));
        // Sparse: refused by its size, nothing read.
        File::create(dir.join("huge")).unwrap().set_len(MAX_BYTES + 1).unwrap();
        assert!(check("huge", Match::Crc, 0)
            .unwrap_err()
            .contains("more than memleak reads of a debug file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_crc_is_zlibs_over_the_whole_file() {
        let path = std::env::temp_dir().join(format!("memleak-crc-{}", std::process::id()));
        std::fs::write(&path, b"123456789").unwrap();
        let file = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        // The check value of CRC-32 (the one gdb's debug links use).
        assert_eq!(crc_of(&file, 9).unwrap(), 0xcbf4_3926);
    }
}
