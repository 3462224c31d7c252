//! Saved snapshots (`--save`): capture once, render many times, the memray
//! way. A snapshot is a report with every stack, each allocation's address,
//! size and age, the symbolized frames and the mappings their addresses
//! fall in. `memleak report` renders it in any format later, and `memleak
//! diff` compares two, without root and without the process.
//!
//! The file is gzipped JSON in two lines: a header naming the format and
//! its version, then the report. The header comes first so that a file of
//! another version is recognised as such before its body is parsed.

use std::{
    fs::File,
    io::{self, BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
};

use flate2::{read::GzDecoder, write::GzEncoder, Compression};
use serde::{Deserialize, Serialize};

use super::Report;

/// What the header's `format` says.
const FORMAT: &str = "memleak-snapshot";
/// Raised whenever a change to `Report` would misread older files.
const VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    /// The memleak that wrote it, for the error message on a mismatch.
    written_by: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} is not a memleak snapshot (written with --save): {reason}")]
    NotASnapshot { path: PathBuf, reason: String },
    #[error("{path} is snapshot version {found} (from memleak {written_by}); this memleak reads version {VERSION}")]
    Version { path: PathBuf, found: u32, written_by: String },
    #[error("{path} is truncated or corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// Writes `report` as a snapshot.
pub fn write(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let header = Header {
        format: FORMAT.to_owned(),
        version: VERSION,
        written_by: env!("CARGO_PKG_VERSION").to_owned(),
    };
    let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
    serde_json::to_writer(&mut gzip, &header)?;
    gzip.write_all(b"\n")?;
    serde_json::to_writer(&mut gzip, report)?;
    gzip.write_all(b"\n")?;
    out.write_all(&gzip.finish()?)
}

/// Reads the snapshot at `path`.
pub fn load(path: &Path) -> Result<Report, SavedError> {
    let file = File::open(path).map_err(|source| SavedError::Read { path: path.to_path_buf(), source })?;
    read(file, path)
}

fn read(mut input: impl Read, path: &Path) -> Result<Report, SavedError> {
    let not_a_snapshot =
        |reason: &str| SavedError::NotASnapshot { path: path.to_path_buf(), reason: reason.to_owned() };
    let corrupt = |reason: String| SavedError::Corrupt { path: path.to_path_buf(), reason };
    let mut magic = [0u8; 2];
    match input.read_exact(&mut magic) {
        Ok(()) if magic == [0x1f, 0x8b] => {}
        Ok(()) => return Err(not_a_snapshot("it is not gzip-compressed")),
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(not_a_snapshot("it is empty or too short"))
        }
        Err(source) => return Err(SavedError::Read { path: path.to_path_buf(), source }),
    }
    let mut lines = BufReader::new(GzDecoder::new(io::Cursor::new(magic).chain(input)));
    let mut header_line = String::new();
    lines.read_line(&mut header_line).map_err(|error| corrupt(error.to_string()))?;
    let header: Header = serde_json::from_str(&header_line)
        .map_err(|_| not_a_snapshot("its first line is not a snapshot header"))?;
    if header.format != FORMAT {
        return Err(not_a_snapshot(&format!("its header says {:?}", header.format)));
    }
    if header.version != VERSION {
        return Err(SavedError::Version {
            path: path.to_path_buf(),
            found: header.version,
            written_by: header.written_by,
        });
    }
    // serde_json reports a gzip stream cut short as an I/O error, and a
    // body cut short as an EOF while parsing: both are "truncated".
    serde_json::from_reader(lines).map_err(|error| corrupt(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    fn saved() -> Vec<u8> {
        let mut bytes = Vec::new();
        write(&sample_report(usize::MAX), &mut bytes).unwrap();
        bytes
    }

    fn read_bytes(bytes: &[u8]) -> Result<Report, SavedError> {
        read(bytes, Path::new("heap.snap"))
    }

    #[test]
    fn a_snapshot_reads_back_as_the_same_report() {
        assert_eq!(read_bytes(&saved()).unwrap(), sample_report(usize::MAX));
    }

    #[test]
    fn bad_files_are_named_for_what_is_wrong() {
        let bytes = saved();
        let message = |bytes: &[u8]| read_bytes(bytes).unwrap_err().to_string();
        assert_eq!(
            message(b""),
            "heap.snap is not a memleak snapshot (written with --save): it is empty or too short"
        );
        assert_eq!(
            message(b"{\"pid\": 1}"),
            "heap.snap is not a memleak snapshot (written with --save): it is not gzip-compressed"
        );
        let cut = message(&bytes[..bytes.len() / 2]);
        assert!(cut.starts_with("heap.snap is truncated or corrupt: "), "{cut}");
        let mut flipped = bytes.clone();
        let middle = flipped.len() / 2;
        flipped[middle] ^= 0xff;
        let flipped = message(&flipped);
        assert!(flipped.starts_with("heap.snap is truncated or corrupt: "), "{flipped}");
    }

    #[test]
    fn another_version_is_refused_by_its_header() {
        let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
        gzip.write_all(b"{\"format\":\"memleak-snapshot\",\"version\":99,\"written_by\":\"9.0.0\"}\n{}\n")
            .unwrap();
        let error = read_bytes(&gzip.finish().unwrap()).unwrap_err().to_string();
        assert_eq!(
            error,
            "heap.snap is snapshot version 99 (from memleak 9.0.0); this memleak reads version 1"
        );
    }
}
