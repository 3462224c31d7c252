//! Where an object's separate debug file may be, for objects whose own
//! call frame information covers little of their code: the file named by
//! its build id under `/usr/lib/debug/.build-id/`, or by its
//! `.gnu_debuglink` beside it, in the directories gdb looks in. Looked for
//! inside the process's root first (a container ships its own), then on
//! the host.

use std::path::{Path, PathBuf};

use object::Object as _;

use crate::process::maps;

/// Candidate paths of the debug file of `object_path` (as process `pid`
/// names it), whose ELF contents are `data` and build id `build_id`.
pub fn candidates(pid: u32, object_path: &str, data: &[u8], build_id: Option<&str>) -> Vec<PathBuf> {
    let mut inside: Vec<String> = Vec::new();
    if let Some(id) = build_id.filter(|id| id.len() > 2) {
        inside.push(format!("/usr/lib/debug/.build-id/{}/{}.debug", &id[..2], &id[2..]));
    }
    let debuglink = object::File::parse(data).ok().and_then(|file| {
        let (name, _crc) = file.gnu_debuglink().ok()??;
        Some(String::from_utf8_lossy(name).into_owned())
    });
    // A link names a file, not a path.
    if let Some(name) = debuglink.filter(|name| !name.contains('/')) {
        let directory =
            Path::new(object_path).parent().map_or(String::new(), |dir| dir.display().to_string());
        inside.push(format!("{directory}/{name}"));
        inside.push(format!("{directory}/.debug/{name}"));
        inside.push(format!("/usr/lib/debug{directory}/{name}"));
    }
    let in_root = inside.iter().map(|path| maps::in_root(pid, path));
    let on_host = inside.iter().map(PathBuf::from);
    in_root.chain(on_host).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_id_path_is_looked_for_in_the_root_then_on_the_host() {
        let paths = candidates(42, "/usr/bin/app", b"not elf", Some("abcdef12"));
        assert_eq!(
            paths,
            [
                PathBuf::from("/proc/42/root/usr/lib/debug/.build-id/ab/cdef12.debug"),
                PathBuf::from("/usr/lib/debug/.build-id/ab/cdef12.debug"),
            ]
        );
    }
}
