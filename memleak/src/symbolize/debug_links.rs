//! Which separate debug files blazesym may read, and where from.
//!
//! blazesym opens debug files by path, and the paths come from the object
//! it symbolizes: a `.gnu_debuglink` name joined to each debug directory,
//! a `.gnu_debugaltlink` or `.debug_sup` path taken as it is. A traced
//! program chooses those, and memleak runs as root: a link name of
//! `../../dev/watchdog` would have it open a host device, a FIFO would
//! hang it. So:
//!
//! - blazesym reads an object's debug information only if its debug link
//!   is a plain file name and it names no other file (no altlink, no
//!   supplementary file); otherwise it gets the object's symbol table
//!   alone, and the frames lose their file and line;
//! - the debug directories it searches are the host's (`/usr/lib/debug`),
//!   and a private directory memleak makes and fills itself: a debug file
//!   found inside the target's root (a container ships its own) is opened
//!   with that root as the root (`process::files`), checked the same way,
//!   and offered there as a link to memleak's own descriptor of it.

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::fs::DirBuilderExt as _},
    path::PathBuf,
};

use object::{read::ReadCache, Object as _};

use crate::{
    process::address_space::{FileId, MappedObject},
    unwind::debug_files,
};

/// The host's debug directories, searched after the private one.
const HOST_DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];

/// The debug files blazesym may read for one process.
pub struct DebugLinks {
    pid: u32,
    /// memleak's own directory of links to debug files it opened; removed
    /// on drop. `None` if it could not be made: then none is offered.
    private: Option<PathBuf>,
    /// Whether each object's debug information may be read, decided once.
    decided: HashMap<FileId, bool>,
    /// The debug files offered, held open for the links to them.
    held: Vec<File>,
}

impl DebugLinks {
    pub fn new(pid: u32) -> Self {
        let private =
            make_private_dir().inspect_err(|error| log::debug!("no private debug directory: {error}")).ok();
        Self { pid, private, decided: HashMap::new(), held: Vec::new() }
    }

    /// The directories blazesym searches, best first.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.private.iter().cloned().chain(host_dirs()).collect()
    }

    /// Whether blazesym may read `object`'s debug information. The first
    /// time, its debug file inside the target's root, if it has one, is
    /// offered in the private directory.
    pub fn allow(&mut self, object: &MappedObject) -> bool {
        if let Some(&allowed) = self.decided.get(&object.id) {
            return allowed;
        }
        let references = File::open(object.fd_path()).ok().and_then(|file| references_of(&file));
        let allowed = references.as_ref().is_some_and(References::are_safe);
        if allowed {
            if let Some(references) = &references {
                self.offer_debug_file(object, references);
            }
        } else {
            log::debug!("{}: its debug links name paths; symbolized from its symbol table only", object.path);
        }
        self.decided.insert(object.id, allowed);
        allowed
    }

    /// Links the first safe debug file of `object` inside the target's
    /// root into the private directory, under the names blazesym looks for.
    fn offer_debug_file(&mut self, object: &MappedObject, references: &References) {
        let Some(private) = &self.private else { return };
        let link = references.debuglink.as_deref().map(str::as_bytes);
        let candidates = debug_files::candidates_of(self.pid, &object.path, link, object.build_id());
        for candidate in candidates.into_iter().filter(|candidate| candidate.root_of.is_some()) {
            let Ok(file) = candidate.open() else { continue };
            if !references_of(&file).is_some_and(|debug| debug.names_no_other_file()) {
                continue;
            }
            let target = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
            let mut names: Vec<PathBuf> = references.debuglink.iter().map(PathBuf::from).collect();
            names.extend(object.build_id().and_then(debug_files::build_id_path).map(PathBuf::from));
            for name in names {
                let path = private.join(name);
                let linked = path
                    .parent()
                    .map_or(Ok(()), std::fs::create_dir_all)
                    .and_then(|()| std::os::unix::fs::symlink(&target, &path));
                if let Err(error) = linked {
                    log::debug!("cannot offer {candidate} as {}: {error}", path.display());
                }
            }
            log::debug!("debug file of {}: {candidate}", object.path);
            self.held.push(file);
            return;
        }
    }
}

/// The host's debug directories, where the kernel's are too.
pub fn host_dirs() -> Vec<PathBuf> {
    HOST_DEBUG_DIRS.map(PathBuf::from).to_vec()
}

impl Drop for DebugLinks {
    fn drop(&mut self) {
        if let Some(private) = &self.private {
            let _ = std::fs::remove_dir_all(private);
        }
    }
}

/// `memleak-debug-<16 hex digits>` in the temporary directory, made new
/// (`mkdir` fails on anything already there) and readable by root alone.
fn make_private_dir() -> io::Result<PathBuf> {
    let mut random = [0u8; 8];
    // SAFETY: fills `random`, whose length is passed.
    if unsafe { libc::getrandom(random.as_mut_ptr().cast(), random.len(), 0) } != 8 {
        return Err(io::Error::last_os_error());
    }
    let path = std::env::temp_dir().join(format!("memleak-debug-{:016x}", u64::from_ne_bytes(random)));
    std::fs::DirBuilder::new().mode(0o700).create(&path)?;
    Ok(path)
}

/// The other files an ELF object names for its debug information.
#[derive(Debug, Default, PartialEq, Eq)]
struct References {
    /// Its `.gnu_debuglink` file name.
    debuglink: Option<String>,
    /// Whether it has a `.gnu_debugaltlink` or `.debug_sup`, which name
    /// paths.
    other_files: bool,
    /// Whether its debug link is something other than a plain file name.
    odd_link: bool,
}

impl References {
    fn names_no_other_file(&self) -> bool {
        !self.other_files
    }

    fn are_safe(&self) -> bool {
        !self.other_files && !self.odd_link
    }
}

/// What `file` names for its debug information, read section by section
/// (only the headers and these sections are read); `None` if it is no
/// ELF object.
fn references_of(file: &File) -> Option<References> {
    let cache = ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    let mut references = References {
        other_files: elf.section_by_name(".gnu_debugaltlink").is_some()
            || elf.section_by_name(".debug_sup").is_some(),
        ..References::default()
    };
    if let Ok(Some((name, _crc))) = elf.gnu_debuglink() {
        match std::str::from_utf8(name) {
            Ok(name) if !name.is_empty() && !name.contains('/') && name != "." && name != ".." => {
                references.debuglink = Some(name.to_owned());
            }
            _ => references.odd_link = true,
        }
    }
    Some(references)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memleak_itself_names_no_other_file() {
        let file = File::open("/proc/self/exe").unwrap();
        assert_eq!(references_of(&file), Some(References::default()));
        assert_eq!(references_of(&File::open("/etc/hostname").unwrap()), None);
    }

    #[test]
    fn the_private_directory_is_new_and_root_s_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let links = DebugLinks::new(std::process::id());
        let private = links.private.clone().unwrap();
        assert_eq!(std::fs::metadata(&private).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(links.dirs()[0], private);
        drop(links);
        assert!(!private.exists(), "removed with the symbolizer");
    }
}
