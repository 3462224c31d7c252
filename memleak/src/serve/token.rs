//! The bearer token that `--token-file` sets: with one, every request
//! but `/healthz` must carry `Authorization: Bearer <token>`.

use std::path::Path;

use crate::process::files;

/// Tokens shorter than this are refused: guessable.
const SHORTEST: usize = 16;

/// The most of a token file read: a token is one short line, and a file
/// any larger is not one (a log, a disk image, a file of NULs). Read as
/// memleak reads every file it does not control, the file is never read
/// past this.
const LONGEST_FILE: u64 = 4096;

pub struct Token {
    secret: Vec<u8>,
}

impl Token {
    /// The token in `path`: its first line, without surrounding blanks.
    /// Only a regular file of at most `LONGEST_FILE` bytes is read, and it
    /// is opened with `O_PATH` first: a FIFO (which would block memleak's
    /// start, signals and all) or a device (`/dev/zero`, read until memory
    /// runs out) is refused without being opened for reading.
    pub fn read(path: &Path) -> Result<Self, String> {
        let cannot = |error: &std::io::Error| {
            format!("cannot read --token-file {}: {}", path.display(), crate::status::os_reason(error))
        };
        let file = files::open_regular(path).map_err(|error| cannot(&error))?;
        let contents = files::read_limited(&file, LONGEST_FILE).map_err(|error| cannot(&error))?;
        let first_line = contents.split(|&byte| byte == b'\n').next().unwrap_or_default();
        let secret = first_line.trim_ascii();
        // What a client sends after `Bearer `: visible ASCII, no blanks,
        // no control characters (NULs of a zeroed file are no token).
        if !secret.iter().all(u8::is_ascii_graphic) {
            return Err(format!(
                "--token-file {}: the token on its first line must be printable ASCII without blanks",
                path.display()
            ));
        }
        if secret.len() < SHORTEST {
            return Err(format!(
                "--token-file {}: the token must be at least {SHORTEST} characters on its first line",
                path.display()
            ));
        }
        Ok(Self { secret: secret.to_vec() })
    }

    /// The `Authorization` header's value that carries it, for a client
    /// (`memleak top --connect`).
    pub fn header(&self) -> String {
        format!("Bearer {}", String::from_utf8_lossy(&self.secret))
    }

    /// Whether an `Authorization` header's value carries the token. The
    /// comparison takes as long whatever bytes differ, so that timing the
    /// answers cannot find the token byte by byte.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(offered) = authorization.and_then(|value| value.strip_prefix(b"Bearer ")) else {
            return false;
        };
        let mut difference = u8::from(offered.len() != self.secret.len());
        for (index, expected) in self.secret.iter().enumerate() {
            difference |= expected ^ offered.get(index).copied().unwrap_or(!expected);
        }
        std::hint::black_box(difference) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(secret: &str) -> Token {
        Token { secret: secret.as_bytes().to_vec() }
    }

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let token = token("0123456789abcdef");
        assert!(token.admits(Some(b"Bearer 0123456789abcdef")));
        for offered in [
            &b"Bearer 0123456789abcdeg"[..],
            b"Bearer 0123456789abcde",
            b"Bearer 0123456789abcdef0",
            b"Bearer ",
            b"Basic 0123456789abcdef",
            b"0123456789abcdef",
        ] {
            assert!(!token.admits(Some(offered)), "{}", String::from_utf8_lossy(offered));
        }
        assert!(!token.admits(None));
    }

    /// A scratch directory of this test process.
    fn scratch(name: &str) -> std::path::PathBuf {
        let directory = std::env::temp_dir().join(format!("memleak-token-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).expect("a temporary directory");
        directory
    }

    #[test]
    fn a_token_file_gives_its_first_line_and_short_tokens_are_refused() {
        let directory = scratch("lines");
        let path = directory.join("token");
        std::fs::write(&path, "  0123456789abcdef \nignored\n").expect("written");
        assert!(Token::read(&path).expect("a good token").admits(Some(b"Bearer 0123456789abcdef")));
        std::fs::write(&path, "short\n").expect("written");
        let refused = Token::read(&path).err().expect("too short");
        assert!(refused.ends_with("the token must be at least 16 characters on its first line"), "{refused}");
        let missing = Token::read(&directory.join("absent")).err().expect("no file");
        assert!(missing.starts_with("cannot read --token-file "), "{missing}");
        std::fs::remove_dir_all(&directory).expect("removed");
    }

    #[test]
    fn a_file_of_nuls_or_of_spaced_words_is_no_token() {
        let directory = scratch("printable");
        let path = directory.join("token");
        for contents in [&[0u8; 64][..], b"0123456789abcdef\x000123\n", b"correct horse battery staple\n"] {
            std::fs::write(&path, contents).expect("written");
            let refused = Token::read(&path).err().expect("not printable");
            assert!(
                refused.ends_with("the token on its first line must be printable ASCII without blanks"),
                "{refused}"
            );
        }
        std::fs::remove_dir_all(&directory).expect("removed");
    }

    #[test]
    fn a_token_file_larger_than_a_token_is_refused_unread() {
        let directory = scratch("large");
        let path = directory.join("token");
        // Sparse: its size is what is refused, no page of it is read.
        let file = std::fs::File::create(&path).expect("created");
        file.set_len(300 << 20).expect("sized");
        let refused = Token::read(&path).err().expect("too large");
        assert_eq!(
            refused,
            format!(
                "cannot read --token-file {}: it is 314572800 bytes, more than memleak reads (4096)",
                path.display()
            )
        );
        std::fs::remove_dir_all(&directory).expect("removed");
    }

    #[test]
    fn a_fifo_or_a_device_is_refused_without_being_opened_for_reading() {
        let directory = scratch("fifo");
        let fifo = directory.join("token");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("a path");
        // SAFETY: a NUL-terminated path alive for the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
        // Opening a FIFO for reading would block here, with no writer.
        for path in [fifo.as_path(), Path::new("/dev/zero")] {
            let refused = Token::read(path).err().expect("not a regular file");
            assert_eq!(refused, format!("cannot read --token-file {}: not a regular file", path.display()));
        }
        std::fs::remove_dir_all(&directory).expect("removed");
    }
}
