//! The bearer token that `--token-file` sets: with one, every request
//! but `/healthz` must carry `Authorization: Bearer <token>`.

use std::{fs, path::Path};

/// Tokens shorter than this are refused: guessable.
const SHORTEST: usize = 16;

pub struct Token {
    secret: Vec<u8>,
}

impl Token {
    /// The token in `path`: its first line, without surrounding blanks.
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = fs::read_to_string(path).map_err(|error| {
            format!("cannot read --token-file {}: {}", path.display(), crate::status::os_reason(&error))
        })?;
        let secret = text.lines().next().unwrap_or_default().trim();
        if secret.len() < SHORTEST {
            return Err(format!(
                "--token-file {}: the token must be at least {SHORTEST} characters on its first line",
                path.display()
            ));
        }
        Ok(Self { secret: secret.as_bytes().to_vec() })
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

    #[test]
    fn a_token_file_gives_its_first_line_and_short_tokens_are_refused() {
        let directory = std::env::temp_dir().join(format!("memleak-token-{}", std::process::id()));
        fs::create_dir_all(&directory).expect("a temporary directory");
        let path = directory.join("token");
        fs::write(&path, "  0123456789abcdef \nignored\n").expect("written");
        assert!(Token::read(&path).expect("a good token").admits(Some(b"Bearer 0123456789abcdef")));
        fs::write(&path, "short\n").expect("written");
        let refused = Token::read(&path).err().expect("too short");
        assert!(refused.ends_with("the token must be at least 16 characters on its first line"), "{refused}");
        let missing = Token::read(&directory.join("absent")).err().expect("no file");
        assert!(missing.starts_with("cannot read --token-file "), "{missing}");
        fs::remove_dir_all(&directory).expect("removed");
    }
}
