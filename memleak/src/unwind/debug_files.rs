//! Where an object's separate debug file may be, for objects whose own
//! call frame information covers little of their code: the file named by
//! its build id under `/usr/lib/debug/.build-id/`, or by its
//! `.gnu_debuglink` beside it, in the directories gdb looks in. Looked for
//! inside the process's root first (a container ships its own), then on
//! the host.

use std::path::{Path, PathBuf};

use object::Object as _;

use crate::process::files;

/// Candidate paths of the debug file of `object_path` (as process `pid`
/// names it), whose ELF contents are `data` and build id `build_id`.
pub fn candidates(pid: u32, object_path: &str, data: &[u8], build_id: Option<&str>) -> Vec<DebugFile> {
    let debuglink = object::File::parse(data).ok().and_then(|file| Some(file.gnu_debuglink().ok()??.0));
    candidates_of(pid, object_path, debuglink, build_id)
}

/// Where a debug directory keeps the debug file of the object with build
/// id `id` (hex): `.build-id/ab/cdef….debug`, as distributions install
/// them; `None` for an id too short to split.
pub fn build_id_path(id: &str) -> Option<String> {
    (id.len() > 2 && id.is_char_boundary(2)).then(|| format!(".build-id/{}/{}.debug", &id[..2], &id[2..]))
}

/// As `candidates`, given the object's `.gnu_debuglink` name.
pub fn candidates_of(
    pid: u32,
    object_path: &str,
    debuglink: Option<&[u8]>,
    build_id: Option<&str>,
) -> Vec<DebugFile> {
    let mut inside: Vec<String> = Vec::new();
    if let Some(name) = build_id.and_then(build_id_path) {
        inside.push(format!("/usr/lib/debug/{name}"));
    }
    let debuglink = debuglink.map(|name| String::from_utf8_lossy(name).into_owned());
    // A link names a file, not a path.
    if let Some(name) = debuglink.filter(|name| !name.contains('/') && name != "..") {
        let directory =
            Path::new(object_path).parent().map_or(String::new(), |dir| dir.display().to_string());
        inside.push(format!("{directory}/{name}"));
        inside.push(format!("{directory}/.debug/{name}"));
        inside.push(format!("/usr/lib/debug{directory}/{name}"));
        inside.push(format!("/usr/lib/debug/{name}"));
    }
    let in_root = inside.iter().map(|path| DebugFile { root_of: Some(pid), path: PathBuf::from(path) });
    let on_host = inside.iter().map(|path| DebugFile { root_of: None, path: PathBuf::from(path) });
    in_root.chain(on_host).collect()
}

/// Where a debug file may be: a path inside a process's root, or on the
/// host.
#[derive(Debug, PartialEq, Eq)]
pub struct DebugFile {
    pub root_of: Option<u32>,
    pub path: PathBuf,
}

impl DebugFile {
    /// Its contents, if it is a regular file, read within
    /// `files::READ_LIMIT`; a process's links resolve inside its root.
    pub fn read(&self) -> std::io::Result<Vec<u8>> {
        files::read_limited(&self.open()?, files::READ_LIMIT)
    }

    /// It, opened, if it is a regular file.
    pub fn open(&self) -> std::io::Result<std::fs::File> {
        match self.root_of {
            Some(pid) => files::open_in_root(pid, &self.path),
            None => files::open_regular(&self.path),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_id_path_is_looked_for_in_the_root_then_on_the_host() {
        let paths = candidates(42, "/usr/bin/app", b"not elf", Some("abcdef12"));
        let path = PathBuf::from("/usr/lib/debug/.build-id/ab/cdef12.debug");
        assert_eq!(
            paths,
            [DebugFile { root_of: Some(42), path: path.clone() }, DebugFile { root_of: None, path }]
        );
        assert_eq!(paths[0].to_string(), "/usr/lib/debug/.build-id/ab/cdef12.debug in the root of pid 42");
    }
}
