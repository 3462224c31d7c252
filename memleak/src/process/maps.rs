//! The one reader of `/proc/PID/maps`: every other module gets a
//! process's mappings from here, typed.

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsEntry {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub writable: bool,
    pub executable: bool,
    /// File offset of `start`.
    pub offset: u64,
    /// The mapped file's device and inode, which tell two files apart
    /// whatever their paths; `(0, 0)` for anonymous memory.
    pub device: (u32, u32),
    pub inode: u64,
    pub pathname: Pathname,
}

/// What a mapping maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pathname {
    /// A file, as the process names it (inside its own mount namespace),
    /// without the " (deleted)" the kernel adds once it is unlinked.
    File { path: String, deleted: bool },
    /// `[heap]`, `[stack]`, `[vdso]` and the like.
    Special(String),
    /// Anonymous memory (JIT code, arenas, thread stacks).
    Anonymous,
}

impl MapsEntry {
    /// The file this maps, if it maps one.
    pub fn file(&self) -> Option<&str> {
        match &self.pathname {
            Pathname::File { path, .. } => Some(path),
            _ => None,
        }
    }
}

/// Parses the text of a maps file; lines that do not parse are skipped.
pub fn parse(maps: &str) -> Vec<MapsEntry> {
    maps.lines().filter_map(parse_line).collect()
}

/// `start-end perms offset major:minor inode   pathname`, where the
/// pathname may hold spaces.
fn parse_line(line: &str) -> Option<MapsEntry> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    let offset = fields.next()?;
    let (major, minor) = fields.next()?.split_once(':')?;
    let inode = fields.next()?;
    let pathname = fields.next().unwrap_or("").trim_start();
    let hex = |text: &str| u64::from_str_radix(text, 16).ok();
    let pathname = if pathname.is_empty() {
        Pathname::Anonymous
    } else if pathname.starts_with('/') {
        match pathname.strip_suffix(" (deleted)") {
            Some(path) => Pathname::File { path: path.to_owned(), deleted: true },
            None => Pathname::File { path: pathname.to_owned(), deleted: false },
        }
    } else {
        Pathname::Special(pathname.to_owned())
    };
    Some(MapsEntry {
        start: hex(start)?,
        end: hex(end)?,
        readable: perms.first() == Some(&b'r'),
        writable: perms.get(1) == Some(&b'w'),
        executable: perms.get(2) == Some(&b'x'),
        offset: hex(offset)?,
        device: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
        inode: inode.parse().ok()?,
        pathname,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0a0000000-55d0a0001000 r--p 00000000 08:01 42                         /usr/bin/my app
55d0a0001000-55d0a0002000 r-xp 00001000 08:01 42                         /usr/bin/my app
55d0a1000000-55d0a1021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000010000 rwxp 00000000 00:00 0 
7f1000000000-7f1000001000 r-xp 00002000 fd:10 1234                       /app/lib.so (deleted)";

    #[test]
    fn every_field_is_read() {
        let entries = parse(MAPS);
        assert_eq!(entries.len(), 5);
        let code = &entries[1];
        assert_eq!((code.start, code.end, code.offset), (0x55d0_a000_1000, 0x55d0_a000_2000, 0x1000));
        assert!(code.readable && code.executable && !code.writable);
        assert_eq!((code.device, code.inode), ((8, 1), 42));
        assert_eq!(code.file(), Some("/usr/bin/my app"), "paths may hold spaces");
        assert_eq!(entries[2].pathname, Pathname::Special("[heap]".to_owned()));
        assert_eq!(entries[3].pathname, Pathname::Anonymous);
        assert!(entries[3].writable && entries[3].executable);
        assert_eq!(
            entries[4].pathname,
            Pathname::File { path: "/app/lib.so".to_owned(), deleted: true },
            "the kernel's suffix is not part of the path"
        );
        assert_eq!(entries[4].device, (0xfd, 0x10));
    }

    #[test]
    fn a_malformed_line_is_skipped() {
        assert_eq!(parse("not a maps line\n").len(), 0);
    }
}
