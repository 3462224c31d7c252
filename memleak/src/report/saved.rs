//! Saved snapshots (`--save`): capture once, render many times, the memray
//! way. A snapshot is a report with every stack, each allocation's address,
//! size and age, the symbolized frames and the mappings their addresses
//! fall in. `memleak report` renders it in any format later, and `memleak
//! diff` compares two, without root and without the process.
//!
//! The file is gzipped JSON in two lines: a header naming the format and
//! its version, then the report. The header comes first so that a file of
//! another version is recognised as such before its body is parsed.
//!
//! Anyone can hand memleak a file, and gzip inflates a megabyte to a
//! gigabyte: reading is bounded (`Limits`), and holds what it reads in a
//! form of its own (`Saved`), each distinct frame once, so that memory
//! follows what a snapshot holds, not how often its frames repeat.

mod visit;

use std::{
    cell::Cell,
    fmt,
    fs::File,
    io::{self, BufRead, BufReader, Read, Write},
    mem,
    path::{Path, PathBuf},
    rc::Rc,
    sync::Arc,
};

use flate2::{read::GzDecoder, write::GzEncoder, Compression};
use serde::{de::DeserializeSeed as _, Deserialize, Serialize};

use super::{
    options::{Format, ReportOptions},
    Report,
};
use crate::model::Frame;
use visit::{Body, Exceeded, Reading, ReportSeed};

/// What the header's `format` says.
const FORMAT: &str = "memleak-snapshot";
/// Raised whenever a change to `Report` would misread older files.
const VERSION: u32 = 1;

/// How far reading one snapshot may go. Each limit stops the reading with
/// an error that names the file, long before the memory or the time it
/// guards runs out, and far above what memleak itself writes.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// The header line, in bytes; memleak writes about 65.
    header: u64,
    /// Bytes in a row without a `"`: any one string, number or white
    /// space, which the JSON parser holds whole. memleak writes names and
    /// paths, and no white space.
    value: u64,
    /// The inflated file, in bytes: this bounds the time reading takes.
    /// memleak at its default limits writes 65,536 stacks of at most 127
    /// frames, about 200 bytes of JSON each, and 1,000,000 allocations of
    /// about 55: 1.7 GB at most. Long C++ names make frames longer.
    inflated: u64,
    /// The memory what is read takes, estimated as it is read (`visit`
    /// says how), and as frames are expanded to be shown. A snapshot at
    /// memleak's default limits takes under 200 MB read, as each distinct
    /// frame is held once and a stack holds 4 bytes per frame; shown whole
    /// (flame graphs, pprof), about 260 bytes per frame of every stack.
    memory: u64,
}

const LIMITS: Limits = Limits { header: 4 << 10, value: 1 << 20, inflated: 4 << 30, memory: 1 << 30 };

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
    #[error(
        "{path} inflates past {}: not a memleak snapshot, or one too large to read \
         (65,536 stacks of 127 frames inflate to about 1.7 GB)",
        size(*.limit)
    )]
    Inflated { path: PathBuf, limit: u64 },
    #[error("{path} is not a memleak snapshot (written with --save): it holds a value over {} long", size(*.limit))]
    LongValue { path: PathBuf, limit: u64 },
    #[error(
        "{path} would take over {} of memory to read: not a memleak snapshot, or one too large to read",
        size(*.limit)
    )]
    Memory { path: PathBuf, limit: u64 },
    #[error(
        "{path} has too many frames to show every stack in {} of memory: --format text or json show its top stacks",
        size(*.limit)
    )]
    TooManyToShow { path: PathBuf, limit: u64 },
}

/// `4 KiB`, `1 GiB`: a limit as a message gives it.
fn size(bytes: u64) -> String {
    match bytes {
        bytes if bytes >= 1 << 30 && bytes % (1 << 30) == 0 => format!("{} GiB", bytes >> 30),
        bytes if bytes >= 1 << 20 && bytes % (1 << 20) == 0 => format!("{} MiB", bytes >> 20),
        bytes if bytes >= 1 << 10 && bytes % (1 << 10) == 0 => format!("{} KiB", bytes >> 10),
        bytes => format!("{bytes} bytes"),
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    /// The memleak that wrote it, for the error message on a mismatch.
    written_by: String,
}

/// What serde's many small writes (a field name, a quote, a comma) are
/// gathered into before each goes to the compressor: each write into
/// flate2 costs a call into the deflater, and unbuffered they made a
/// snapshot of 65,536 stacks of 37 frames take over 30 s.
const SERIALIZED_CHUNK: usize = 256 << 10;

/// Writes `report` as a snapshot. The JSON is made on this thread and
/// compressed on another, a chunk at a time: at 65,536 stacks of 37
/// frames (570 MB of JSON) making it takes about 1.6 s here and
/// compressing it 0.7 s, which then overlap.
pub fn write(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let header = Header {
        format: FORMAT.to_owned(),
        version: VERSION,
        written_by: env!("CARGO_PKG_VERSION").to_owned(),
    };
    let (chunks, to_compress) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
    let compressed = std::thread::scope(|scope| {
        let compressor = scope.spawn(move || {
            let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
            for chunk in to_compress {
                gzip.write_all(&chunk)?;
            }
            gzip.finish()
        });
        let mut json = Chunks { chunk: Vec::with_capacity(SERIALIZED_CHUNK), chunks };
        let made = serde_json::to_writer(&mut json, &header)
            .map_err(io::Error::from)
            .and_then(|()| json.write_all(b"\n"))
            .and_then(|()| serde_json::to_writer(&mut json, report).map_err(io::Error::from))
            .and_then(|()| json.write_all(b"\n"))
            .and_then(|()| json.flush());
        // The compressor ends once every chunk is taken.
        drop(json);
        let compressed =
            compressor.join().unwrap_or_else(|_| Err(io::Error::other("the compressor panicked")));
        made.and(compressed)
    })?;
    out.write_all(&compressed)
}

/// Bytes in chunks of `SERIALIZED_CHUNK`, each sent to the compressor
/// whole.
struct Chunks {
    chunk: Vec<u8>,
    chunks: std::sync::mpsc::SyncSender<Vec<u8>>,
}

impl Write for Chunks {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.chunk.extend_from_slice(bytes);
        if self.chunk.len() >= SERIALIZED_CHUNK {
            self.flush()?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let full = mem::replace(&mut self.chunk, Vec::with_capacity(SERIALIZED_CHUNK));
        self.chunks.send(full).map_err(|_| io::Error::other("the compressor stopped"))
    }
}

/// A snapshot as read: its report, with each distinct frame held once and
/// each stack's frames as places in that table. A stack's frames are
/// copied out only when it is shown (`into_report`), or shared
/// (`memleak diff`).
#[derive(Debug)]
pub struct Saved {
    /// The report with every stack, in the file's order; each stack's
    /// `frames` are empty (`frames_of` has them).
    report: Report,
    /// Each distinct frame of the snapshot, once.
    frames: Vec<Arc<Frame>>,
    /// For each stack of `report`, its frames as places in `frames`.
    stack_frames: Vec<Box<[u32]>>,
    /// Memory that expanding frames may still take, of `memory_limit`.
    memory_left: u64,
    memory_limit: u64,
    path: PathBuf,
}

impl Saved {
    /// The report; its stacks' `frames` are empty: see `frames_of`.
    pub fn report(&self) -> &Report {
        &self.report
    }

    /// Each distinct frame of the snapshot, once.
    pub fn frame_table(&self) -> &[Arc<Frame>] {
        &self.frames
    }

    /// The frames of stack `stack` (a place in `report().stacks`),
    /// innermost first, as places in `frame_table()`.
    pub fn frames_of(&self, stack: usize) -> &[u32] {
        self.stack_frames.get(stack).map_or(&[], |frames| &frames[..])
    }

    /// A report held whole, in this form; no limit applies. What `memleak
    /// top` diffs a snapshot against.
    pub fn from_report(mut report: Report) -> Self {
        let mut interner = visit::Interner::default();
        let stack_frames = report
            .stacks
            .iter_mut()
            .map(|stack| {
                mem::take(&mut stack.frames)
                    .into_iter()
                    .map(|frame| interner.intern(Arc::unwrap_or_clone(frame)).0)
                    .collect()
            })
            .collect();
        Saved {
            report,
            frames: interner.into_table(),
            stack_frames,
            memory_left: u64::MAX,
            memory_limit: u64::MAX,
            path: PathBuf::new(),
        }
    }

    /// The report as `memleak report` shows it in `format`: the stacks
    /// `Report::cut_for_display` keeps, and only their frames expanded.
    pub fn into_report(self, options: &ReportOptions, format: Format) -> Result<Report, SavedError> {
        let shown = super::shown_stacks(&self.report.stacks, options, format);
        self.expand(&shown, options.show_allocs)
    }

    /// The report whole: every stack in the file's order, frames and
    /// allocations and all.
    #[cfg(test)]
    pub fn into_whole_report(self) -> Result<Report, SavedError> {
        let every: Vec<usize> = (0..self.report.stacks.len()).collect();
        self.expand(&every, true)
    }

    /// Keeps stacks `shown`, in that order, with their frames: shared with
    /// the frame table, a pointer each.
    fn expand(mut self, shown: &[usize], with_allocations: bool) -> Result<Report, SavedError> {
        let pointer = mem::size_of::<Arc<Frame>>() as u64;
        let needed: u64 = shown.iter().map(|&stack| self.frames_of(stack).len() as u64 * pointer).sum();
        if needed > self.memory_left {
            return Err(SavedError::TooManyToShow { path: self.path, limit: self.memory_limit });
        }
        let mut stacks: Vec<_> = mem::take(&mut self.report.stacks).into_iter().map(Some).collect();
        self.report.stacks.reserve_exact(shown.len());
        for &place in shown {
            let Some(mut stack) = stacks.get_mut(place).and_then(Option::take) else { continue };
            stack.frames =
                self.frames_of(place).iter().map(|&frame| Arc::clone(&self.frames[frame as usize])).collect();
            if !with_allocations {
                stack.outstanding = Vec::new();
            }
            self.report.stacks.push(stack);
        }
        Ok(self.report)
    }
}

/// Reads the snapshot at `path`, every stack of it.
#[cfg(test)]
pub fn load(path: &Path) -> Result<Report, SavedError> {
    read(path)?.into_whole_report()
}

/// Reads the snapshot at `path`, its frames held once.
pub fn read(path: &Path) -> Result<Saved, SavedError> {
    let file = File::open(path).map_err(|source| SavedError::Read { path: path.to_path_buf(), source })?;
    read_from(file, path, LIMITS)
}

fn read_from(mut input: impl Read, path: &Path, limits: Limits) -> Result<Saved, SavedError> {
    let not_a_snapshot =
        |reason: &str| SavedError::NotASnapshot { path: path.to_path_buf(), reason: reason.to_owned() };
    let mut magic = [0u8; 2];
    match input.read_exact(&mut magic) {
        Ok(()) if magic == [0x1f, 0x8b] => {}
        Ok(()) => return Err(not_a_snapshot("it is not gzip-compressed")),
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(not_a_snapshot("it is empty or too short"))
        }
        Err(source) => return Err(SavedError::Read { path: path.to_path_buf(), source }),
    }
    read_inflated(GzDecoder::new(io::Cursor::new(magic).chain(input)), path, limits)
}

/// Reads a snapshot from its inflated bytes.
fn read_inflated(inflated: impl Read, path: &Path, limits: Limits) -> Result<Saved, SavedError> {
    let exceeded = Rc::new(Cell::new(None));
    let mut lines = BufReader::new(Bounded::new(inflated, limits, Rc::clone(&exceeded)));
    let header = read_header(&mut lines, limits).map_err(|error| match error {
        HeaderError::Unread(error) => failure(exceeded.get(), &error, path, limits),
        HeaderError::NotAHeader => SavedError::NotASnapshot {
            path: path.to_path_buf(),
            reason: "its first line is not a snapshot header".to_owned(),
        },
    })?;
    check_header(&header, path)?;
    let mut reading = Reading::new(limits.memory);
    // The reader moves in: serde_json reads a `BufReader` it owns a byte
    // at a time without a call to `read` for each.
    let mut json = serde_json::Deserializer::from_reader(lines);
    let body = ReportSeed(&mut reading).deserialize(&mut json).and_then(|body| json.end().map(|()| body));
    match body {
        Ok(Body { report, stack_frames }) => Ok(Saved {
            report,
            frames: reading.interner.into_table(),
            stack_frames,
            memory_left: reading.budget.left(),
            memory_limit: limits.memory,
            path: path.to_path_buf(),
        }),
        // serde_json reports a gzip stream cut short as an I/O error, and a
        // body cut short as an EOF while parsing: both are "truncated".
        Err(error) => Err(failure(exceeded.get().or(reading.budget.exceeded()), &error, path, limits)),
    }
}

/// The error for a file that failed to read: a limit's, if one was passed.
fn failure(exceeded: Option<Exceeded>, error: &impl fmt::Display, path: &Path, limits: Limits) -> SavedError {
    let path = path.to_path_buf();
    match exceeded {
        Some(Exceeded::Inflated) => SavedError::Inflated { path, limit: limits.inflated },
        Some(Exceeded::Value) => SavedError::LongValue { path, limit: limits.value },
        Some(Exceeded::Memory) => SavedError::Memory { path, limit: limits.memory },
        None => SavedError::Corrupt { path, reason: reason(error) },
    }
}

enum HeaderError {
    Unread(io::Error),
    NotAHeader,
}

/// The first line, read no further than `limits.header` bytes.
fn read_header(lines: &mut impl BufRead, limits: Limits) -> Result<Header, HeaderError> {
    let mut line = Vec::new();
    lines.take(limits.header).read_until(b'\n', &mut line).map_err(HeaderError::Unread)?;
    if line.last() != Some(&b'\n') {
        return Err(HeaderError::NotAHeader);
    }
    serde_json::from_slice(&line).map_err(|_| HeaderError::NotAHeader)
}

fn check_header(header: &Header, path: &Path) -> Result<(), SavedError> {
    if header.format != FORMAT {
        return Err(SavedError::NotASnapshot {
            path: path.to_path_buf(),
            reason: format!("its header says {:?}", header.format),
        });
    }
    if header.version != VERSION {
        return Err(SavedError::Version {
            path: path.to_path_buf(),
            found: header.version,
            written_by: reason(&header.written_by),
        });
    }
    Ok(())
}

/// A message from the file or about it, as part of ours: control
/// characters escaped (a value quoted from the file may hold any), and
/// cut short (it may be a megabyte long).
fn reason(message: &impl fmt::Display) -> String {
    const LONGEST: usize = 200;
    let message = message.to_string();
    let escaped = super::printable(&message);
    match escaped.char_indices().nth(LONGEST) {
        Some((cut, _)) => format!("{}...", &escaped[..cut]),
        None => escaped.into_owned(),
    }
}

/// The inflated file, read no further than `limits` allow: past them,
/// every read fails and `exceeded` says which limit it was.
struct Bounded<R> {
    inner: R,
    limits: Limits,
    /// Bytes read so far.
    read: u64,
    /// Bytes read since the last `"`.
    run: u64,
    /// Shared with the reader of the file, which hands this one over.
    exceeded: Rc<Cell<Option<Exceeded>>>,
}

impl<R> Bounded<R> {
    fn new(inner: R, limits: Limits, exceeded: Rc<Cell<Option<Exceeded>>>) -> Self {
        Self { inner, limits, read: 0, run: 0, exceeded }
    }
}

impl<R> Bounded<R> {
    /// The longest run without a `"` that `chunk`, read next, ends or
    /// holds; keeps count of the run it leaves open.
    fn longest_run(&mut self, chunk: &[u8]) -> u64 {
        let is_quote = |&byte: &u8| byte == b'"';
        let (Some(first), Some(last)) = (chunk.iter().position(is_quote), chunk.iter().rposition(is_quote))
        else {
            self.run += chunk.len() as u64;
            return self.run;
        };
        let ended = self.run + first as u64;
        // Runs between two quotes of the chunk are shorter than it.
        let inside = if chunk.len() as u64 > self.limits.value {
            chunk[first..=last].split(is_quote).map(<[u8]>::len).max().unwrap_or(0) as u64
        } else {
            0
        };
        self.run = (chunk.len() - 1 - last) as u64;
        ended.max(inside).max(self.run)
    }
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.exceeded.get().is_none() {
            let read = self.inner.read(buf)?;
            let longest = self.longest_run(&buf[..read]);
            self.read += read as u64;
            if self.read > self.limits.inflated {
                self.exceeded.set(Some(Exceeded::Inflated));
            } else if longest > self.limits.value {
                self.exceeded.set(Some(Exceeded::Value));
            } else {
                return Ok(read);
            }
        }
        Err(io::Error::other("past a limit on reading a snapshot"))
    }
}

#[cfg(test)]
mod tests;
