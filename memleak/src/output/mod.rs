//! Where reports go: stdout, or a file given with --output. Rendering is
//! `report::render`'s; this module only decides where the bytes land.
//!
//! A closed stdout (`memleak ... | head`) ends the run quietly: writers
//! return `OutputError::ReaderGone`, which callers treat as the end, not as
//! a failure. The same holds for a FIFO or pipe given as --output.
//!
//! memleak runs as root, often asked to write into a directory that other
//! users can write to as well. Nothing here trusts what is in it:
//!
//! - **New files** are made under a temporary name in the final path's
//!   own directory, so that putting them in place is one atomic rename(2):
//!   `NAME.memleak-<16 hex digits>.tmp`, the digits from getrandom(2),
//!   opened with `O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC`. `O_EXCL` makes the
//!   open fail, rather than open (or follow a link to) anything that was
//!   there, so a planted file or link is never written; the random name
//!   only keeps such plants from making memleak fail. Mode 0644, less the
//!   umask. See `Temporary` for why this rather than `O_TMPFILE`.
//! - **A final path** is taken with rename(2), which replaces a link there
//!   rather than following it (rename(2): "If newpath refers to a symbolic
//!   link, the link will be overwritten"). Without --force anything already
//!   at the path is refused, a file, a link (even one that leads nowhere)
//!   or anything else, and a new file is put in place with
//!   `RENAME_NOREPLACE`, so that one that appears during the run is not
//!   overwritten either. With --force a regular file or a link is replaced;
//!   a directory, block device or socket never is.
//! - **A character device, a FIFO or an open file** (`/dev/null`, a FIFO
//!   someone reads, `/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`) is
//!   written in place, as a shell redirection would write it: no temporary,
//!   no rename, no --force needed. A link on the way there is followed
//!   only if root or memleak's own user owns it, the rule of the kernel's
//!   `fs.protected_symlinks`; a link another user planted (say to
//!   `/dev/watchdog`) is treated as any other link.
//! - **Text, JSON and folded reports** follow one another in a file that a
//!   killed run leaves holding every complete report: see `Stream`.
//! - **SVG, pprof and --save snapshots** are whole documents, one file per
//!   report, each written in full and renamed into place: see
//!   `NumberedFiles`; snapshots by a thread of their own, in order
//!   (`BackgroundFiles`).
//!
//! A run that fails, or is killed, leaves no temporary behind, except when
//! killed in the instant between creating a file and renaming it (a write
//! and an fsync of one report).

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Seek as _, SeekFrom, Write},
    os::unix::{
        fs::OpenOptionsExt as _,
        io::{FromRawFd as _, RawFd},
    },
    path::{Path, PathBuf},
};

mod background;
mod destination;

pub use background::BackgroundFiles;

use memleak_common::TraceEvent;

use destination::{directory_of, place, Destination, Temporary, Through};

use crate::{
    report::{
        self,
        diff::Diff,
        options::{Format, Rendering},
        trace::{self, TraceLine},
        CgroupTotal, Report,
    },
    status,
};

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{0} exists: give --force to overwrite it")]
    Exists(PathBuf),
    /// A directory, block device or socket, which is neither written nor
    /// replaced; or, as a numbered document's name, a device or FIFO.
    #[error("{path} is {what}: --output and --save write to files, character devices and FIFOs")]
    NotAFile { path: PathBuf, what: &'static str },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot write to stdout: {0}")]
    Stdout(io::Error),
    /// stdout, or a FIFO or pipe given as --output, has lost its reader:
    /// nobody is listening.
    #[error("stdout was closed")]
    ReaderGone,
}

fn write_error(path: &Path) -> impl FnOnce(io::Error) -> OutputError + '_ {
    move |source| OutputError::Write { path: path.to_path_buf(), source }
}

/// Where and how reports are written, as the user asked.
#[derive(Clone, Debug)]
pub struct OutputConfig {
    /// A file, or stdout.
    pub path: Option<PathBuf>,
    /// Replace a file or link that exists.
    pub force: bool,
    pub rendering: Rendering,
}

/// Whether a run writes one document or may write several, which are
/// then numbered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Documents {
    One,
    Several,
}

pub struct Output {
    rendering: Rendering,
    sink: Sink,
}

enum Sink {
    Stdout,
    /// Reports one after another in a file of their own.
    Stream(Stream),
    /// Reports one after another into a device, FIFO or open file.
    Direct(Direct),
    /// A document per report.
    Documents(NumberedFiles),
}

impl Output {
    /// Reports to the configured file, else to stdout. Fails now, before
    /// any probe is placed, if the path is taken (without `force`), is
    /// something memleak does not write, or its directory takes no files.
    /// A FIFO is opened here, and like a shell redirection waits for its
    /// reader.
    pub fn open(config: &OutputConfig, documents: Documents) -> Result<Self, OutputError> {
        let rendering = config.rendering;
        let Some(path) = config.path.as_deref() else { return Ok(Self { rendering, sink: Sink::Stdout }) };
        let sink = if rendering.format.is_document() {
            Sink::Documents(NumberedFiles::new(path, documents, config.force)?)
        } else {
            match Destination::of(path).map_err(write_error(path))? {
                Destination::Direct(through) => Sink::Direct(Direct::open(path, &through)?),
                target => Sink::Stream(Stream::new(path, &target, config.force)?),
            }
        };
        Ok(Self { rendering, sink })
    }

    /// Documents (SVG, pprof) on stdout, or on a device, FIFO or open
    /// file, would run together: there, only the final report is written.
    pub fn takes_every_report(&self) -> bool {
        let shared = match &self.sink {
            Sink::Stdout => true,
            Sink::Documents(files) => files.direct.is_some(),
            Sink::Stream(_) | Sink::Direct(_) => false,
        };
        !(self.rendering.format.is_document() && shared)
    }

    pub fn report(&mut self, report: &Report) -> Result<(), OutputError> {
        let rendering = self.rendering;
        self.write(|out| report::render(rendering, report, out))
    }

    /// Writes what changed between two snapshots.
    pub fn diff(&mut self, diff: &Diff) -> Result<(), OutputError> {
        let rendering = self.rendering;
        self.write(|out| report::render_diff(rendering, diff, out))
    }

    /// Writes trace events. `wall_minus_monotonic_ns` turns their BPF
    /// timestamps into wall-clock time.
    pub fn trace(&mut self, events: &[TraceEvent], wall_minus_monotonic_ns: i128) -> Result<(), OutputError> {
        let format = self.rendering.format;
        self.write(|out| {
            events.iter().try_for_each(|event| {
                trace::render(&TraceLine::new(event, wall_minus_monotonic_ns), format, out)
            })
        })
    }

    /// After the per-process reports of one round, a cgroup's total.
    pub fn cgroup_total(&mut self, total: &CgroupTotal) -> Result<(), OutputError> {
        if !matches!(self.rendering.format, Format::Text | Format::Json) {
            return Ok(()); // it would break folded stacks and documents
        }
        let format = self.rendering.format;
        self.write(|out| report::render_cgroup_total(format, total, out))
    }

    /// Ends a run that went well: a stream that got no report is put in
    /// place empty, and what was written is synced to disk. A run that
    /// fails just drops the output; what it wrote stays (see `Stream`).
    pub fn finish(self) -> Result<(), OutputError> {
        match self.sink {
            Sink::Stream(stream) => stream.finish(),
            Sink::Stdout | Sink::Direct(_) | Sink::Documents(_) => Ok(()),
        }
    }

    fn write(&mut self, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<(), OutputError> {
        match &mut self.sink {
            Sink::Documents(files) => files.write(write).map(drop),
            Sink::Stream(stream) => {
                let bytes = render(&stream.path, write)?;
                stream.append(&bytes)
            }
            Sink::Direct(direct) => {
                let bytes = render(&direct.path, write)?;
                direct.write(&bytes)
            }
            Sink::Stdout => {
                // Rendered whole first, and written in one go: stdout
                // writes each line as it ends, and a command run with -c
                // shares stdout, so its output landed inside reports
                // (in the middle of a JSON line longer than the buffer).
                let mut bytes = Vec::new();
                write(&mut bytes).map_err(OutputError::Stdout)?;
                let mut out = io::stdout().lock();
                match out.write_all(&bytes).and_then(|()| out.flush()) {
                    Ok(()) => Ok(()),
                    Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Err(OutputError::ReaderGone),
                    Err(error) => Err(OutputError::Stdout(error)),
                }
            }
        }
    }
}

/// A report rendered in memory, so that it reaches a file in one
/// `write_all` rather than in pieces as it is rendered.
fn render(path: &Path, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<Vec<u8>, OutputError> {
    let mut bytes = Vec::new();
    write(&mut bytes).map_err(write_error(path))?;
    Ok(bytes)
}

/// Text, JSON or folded reports, one after another in a file of their
/// own, so that a run killed at any point (SIGKILL, the OOM killer)
/// leaves the file holding every report it completed.
///
/// The first report is written to a fresh temporary, synced, and renamed
/// to the final path; every later one is appended to that same open file,
/// now at the final path, with one `write_all` straight to the kernel (no
/// user-space buffer to lose). So after SIGKILL a user finds:
/// - before the first report: nothing at the path, and no temporary;
/// - after N reports: the path holding all N, each whole (a report being
///   appended at the instant of the kill may be cut short; it is the last
///   line or lines, after every complete one).
///
/// Nothing the user had is lost unasked: without --force a path that
/// exists is refused when the run starts, and the first report is put in
/// place with `RENAME_NOREPLACE`; with --force the old file is replaced
/// only once the first report exists, synced first so that a crash cannot
/// leave an empty file where the old one was. A run that fails after some
/// reports keeps them, as a killed one does. Only `finish` syncs the rest:
/// a kill loses nothing that was written, only a crash of the whole system
/// could, and an fsync per report would cost more than it buys.
///
/// A report that cannot be written whole (a full disk, a quota) is taken
/// back: the file is cut to where it ended before, so that it still ends
/// on a complete report, and the run ends with the reason.
struct Stream {
    path: PathBuf,
    force: bool,
    /// The file at `path` once the first report is in place.
    file: Option<File>,
    /// Where the last complete report ends.
    length: u64,
}

impl Stream {
    fn new(path: &Path, target: &Destination, force: bool) -> Result<Self, OutputError> {
        target.check_replaceable(path, force)?;
        // Whether the directory takes files, before anything is attached.
        Temporary::create(path).map_err(write_error(path))?;
        Ok(Self { path: path.to_path_buf(), force, file: None, length: 0 })
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), OutputError> {
        let Some(file) = &mut self.file else {
            if !bytes.is_empty() {
                self.file = Some(self.start(bytes)?);
                self.length = bytes.len() as u64;
            }
            return Ok(());
        };
        match file.write_all(bytes) {
            Ok(()) => {
                self.length += bytes.len() as u64;
                Ok(())
            }
            Err(source) => {
                // Part of the report may be in: cut it off, and leave the
                // offset at the end, for anything written after.
                let cut = file.set_len(self.length).and_then(|()| file.seek(SeekFrom::Start(self.length)));
                if let Err(error) = cut {
                    log::warn!("cannot take a report cut short out of {}: {error}", self.path.display());
                }
                Err(OutputError::Write { path: self.path.clone(), source })
            }
        }
    }

    /// Puts a file holding `bytes` at the path; returns it, open.
    fn start(&self, bytes: &[u8]) -> Result<File, OutputError> {
        let mut temporary = Temporary::create(&self.path).map_err(write_error(&self.path))?;
        let file = &mut temporary.file;
        file.write_all(bytes).and_then(|()| file.sync_data()).map_err(write_error(&self.path))?;
        place(temporary, &self.path, self.force)
    }

    fn finish(self) -> Result<(), OutputError> {
        match &self.file {
            Some(file) => file.sync_data().map_err(write_error(&self.path)),
            None => self.start(&[]).map(drop),
        }
    }
}

/// A character device, FIFO or open file, written in place as a shell's
/// `>> PATH` would write it: appended to, never truncated, never renamed.
struct Direct {
    /// As the user gave it, for messages.
    path: PathBuf,
    file: File,
}

impl Direct {
    /// One of memleak's own descriptors (`/dev/stdout`, `/proc/self/fd/1`)
    /// is duplicated, as `>&1` would: that writes where stdout writes, and
    /// works for a socket (journald's stdout), which cannot be opened by
    /// name. Anything else is opened for appending, without following a
    /// link unless it is one of /proc's links to open files.
    fn open(path: &Path, through: &Through) -> Result<Self, OutputError> {
        let file = match own_descriptor(through) {
            Some(descriptor) => duplicate(descriptor),
            None => OpenOptions::new()
                .append(true)
                .custom_flags(libc::O_NOCTTY | if through.magic { 0 } else { libc::O_NOFOLLOW })
                .open(&through.path),
        };
        Ok(Self { path: path.to_path_buf(), file: file.map_err(write_error(path))? })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), OutputError> {
        match self.file.write_all(bytes) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Err(OutputError::ReaderGone),
            Err(source) => Err(OutputError::Write { path: self.path.clone(), source }),
        }
    }
}

/// The descriptor number when `through` is a link in memleak's own
/// `/proc/PID/fd` (which `/proc/self/fd` and `/dev/fd` lead to).
fn own_descriptor(through: &Through) -> Option<RawFd> {
    if !through.magic {
        return None;
    }
    let directory = fs::canonicalize(directory_of(&through.path)).ok()?;
    let own = Path::new("/proc").join(std::process::id().to_string()).join("fd");
    if directory != own {
        return None;
    }
    through.path.file_name()?.to_str()?.parse().ok()
}

fn duplicate(descriptor: RawFd) -> io::Result<File> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) takes any number and fails with EBADF
    // if it is not an open descriptor; it touches no memory.
    let copy = unsafe { libc::fcntl(descriptor, libc::F_DUPFD_CLOEXEC, 3) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `copy` is a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(copy) })
}

/// Whole files, one per report: `heap.snap`, or `heap.1.snap`,
/// `heap.2.snap`... when there may be several. Each is rendered in memory,
/// written to a fresh temporary, synced and renamed into place, so a file
/// at a final name is always whole, and one killed mid-write is never at
/// its final name.
///
/// A character device, FIFO or open file (`--save /dev/null`) is written
/// in place instead, unnumbered: each document goes to it in turn.
pub struct NumberedFiles {
    path: PathBuf,
    numbered: bool,
    force: bool,
    written: u32,
    direct: Option<Direct>,
}

impl NumberedFiles {
    /// Fails if the file, or without `force` any numbered file of the same
    /// name, exists: nothing the user had is overwritten unasked. Fails if
    /// the directory takes no files, too.
    pub fn new(path: &Path, documents: Documents, force: bool) -> Result<Self, OutputError> {
        let direct = match Destination::of(path).map_err(write_error(path))? {
            Destination::Direct(through) => Some(Direct::open(path, &through)?),
            // Not even as the stem of numbered names: `dir.1`.
            Destination::Unusable(what) => {
                return Err(OutputError::NotAFile { path: path.to_path_buf(), what })
            }
            Destination::Absent | Destination::Replaceable => None,
        };
        let numbered = direct.is_none() && documents == Documents::Several;
        let files = Self { path: path.to_path_buf(), numbered, force, written: 0, direct };
        if files.direct.is_some() {
            return Ok(files);
        }
        let first = files.name(1);
        Destination::of(&first).map_err(write_error(&first))?.check_replaceable(&first, force)?;
        if let Some(existing) = (numbered && !force).then(|| files.existing_numbered()).flatten() {
            return Err(OutputError::Exists(existing));
        }
        // Whether the directory takes files, before anything is attached.
        Temporary::create(&first).map_err(write_error(&first))?;
        Ok(files)
    }

    /// Renders the next file and puts it in place; returns its name.
    pub fn write(
        &mut self,
        render: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> Result<PathBuf, OutputError> {
        if let Some(direct) = &mut self.direct {
            let bytes = self::render(&self.path, render)?;
            direct.write(&bytes)?;
            return Ok(self.path.clone());
        }
        self.written += 1;
        let path = self.name(self.written);
        let bytes = self::render(&path, render)?;
        let mut temporary = Temporary::create(&path).map_err(write_error(&path))?;
        let file = &mut temporary.file;
        file.write_all(&bytes).and_then(|()| file.sync_all()).map_err(write_error(&path))?;
        place(temporary, &path, self.force)?;
        status::say(&format!("wrote {}", path.display()));
        Ok(path)
    }

    /// The name of the `number`th file.
    fn name(&self, number: u32) -> PathBuf {
        if !self.numbered {
            return self.path.clone();
        }
        let (stem, extension) = split_extension(&self.path);
        self.path.with_file_name(format!("{stem}.{number}{extension}"))
    }

    /// A file named as this run would name one, left by an earlier run.
    fn existing_numbered(&self) -> Option<PathBuf> {
        let (stem, extension) = split_extension(&self.path);
        fs::read_dir(directory_of(&self.path)).ok()?.filter_map(Result::ok).map(|entry| entry.path()).find(
            |path| {
                let name = path.file_name().and_then(|name| name.to_str()).unwrap_or("");
                let number =
                    name.strip_prefix(&format!("{stem}.")).and_then(|rest| rest.strip_suffix(&extension));
                number.is_some_and(|number| !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
            },
        )
    }
}

/// The first of `heap.1.snap`, `heap.2.snap`... (for `heap.snap`) past
/// every one that exists: where `memleak top` saves, never over a file
/// an earlier run left.
pub fn next_numbered(path: &Path) -> PathBuf {
    let (stem, extension) = split_extension(path);
    let taken = fs::read_dir(directory_of(path))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            name.strip_prefix(&format!("{stem}."))?.strip_suffix(&extension)?.parse::<u32>().ok()
        })
        .max()
        .unwrap_or(0);
    path.with_file_name(format!("{stem}.{}{extension}", taken + 1))
}

/// `leak.pb.gz` -> (`leak`, `.pb.gz`); `heap.snap` -> (`heap`, `.snap`).
fn split_extension(path: &Path) -> (String, String) {
    let name = path.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
    if let Some(stem) = name.strip_suffix(".pb.gz") {
        return (stem.to_owned(), ".pb.gz".to_owned());
    }
    match name.rsplit_once('.') {
        Some((stem, extension)) if !stem.is_empty() => (stem.to_owned(), format!(".{extension}")),
        _ => (name, String::new()),
    }
}

#[cfg(test)]
mod tests {
    use std::{
        os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
        sync::mpsc,
        thread,
        time::Duration,
    };

    use super::{
        destination::{c_path, create_exclusive},
        *,
    };
    use crate::report::options::Weight;

    /// A directory of this test's own, removed when dropped.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(name: &str) -> Self {
            let path = std::env::temp_dir().join(format!("memleak-output-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        fn join(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }

        /// The names in it, sorted.
        fn names(&self) -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(&self.0)
                .unwrap()
                .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn config(path: &Path, format: Format, force: bool) -> OutputConfig {
        OutputConfig {
            path: Some(path.to_path_buf()),
            force,
            rendering: Rendering { format, weight: Weight::Bytes, full_stacks: false },
        }
    }

    fn line(output: &mut Output, text: &str) -> Result<(), OutputError> {
        output.write(|out| writeln!(out, "{text}"))
    }

    fn mkfifo(path: &Path) {
        let name = c_path(path).unwrap();
        // SAFETY: `name` is NUL-terminated and outlives the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
    }

    /// Reads a FIFO to its end on a thread: opening it for reading waits
    /// for a writer, as memleak's opening it for writing waits for this.
    fn read_fifo(path: &Path) -> mpsc::Receiver<Vec<u8>> {
        let (sender, receiver) = mpsc::channel();
        let path = path.to_path_buf();
        thread::spawn(move || sender.send(fs::read(path).unwrap()));
        receiver
    }

    #[test]
    fn several_documents_are_numbered_before_the_extension() {
        let files = |path: &str, numbered| NumberedFiles {
            path: PathBuf::from(path),
            numbered,
            force: false,
            written: 0,
            direct: None,
        };
        assert_eq!(files("/tmp/heap.snap", true).name(2), Path::new("/tmp/heap.2.snap"));
        assert_eq!(files("leak.pb.gz", true).name(1), Path::new("leak.1.pb.gz"));
        assert_eq!(files("graph", true).name(3), Path::new("graph.3"));
        assert_eq!(files("leak.svg", false).name(1), Path::new("leak.svg"));
    }

    #[test]
    fn a_temporary_is_never_made_over_anything_planted_at_its_name() {
        let dir = TestDir::new("planted");
        let victim = dir.join("victim");
        fs::write(&victim, "precious").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let dangling = dir.join("dangling");
        std::os::unix::fs::symlink(dir.join("created-through-the-link"), &dangling).unwrap();
        for planted in [&victim, &link, &dangling] {
            let error = create_exclusive(planted).expect_err("something is planted there");
            assert_eq!(error.kind(), io::ErrorKind::AlreadyExists, "{}: {error}", planted.display());
        }
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(dir.names(), ["dangling", "link", "victim"], "nothing made through the dangling link");
    }

    #[test]
    fn temporaries_have_unpredictable_names_beside_the_target_and_vanish_unless_placed() {
        let dir = TestDir::new("names");
        let target = dir.join("out.json");
        let (first, second) = (Temporary::create(&target).unwrap(), Temporary::create(&target).unwrap());
        let names: Vec<PathBuf> = [&first, &second].iter().map(|t| t.name.0.clone().unwrap()).collect();
        assert_ne!(names[0], names[1]);
        for name in &names {
            assert_eq!(name.parent(), Some(dir.0.as_path()), "in the target's directory");
            let file_name = name.file_name().unwrap().to_str().unwrap();
            let digits =
                file_name.strip_prefix("out.json.memleak-").and_then(|rest| rest.strip_suffix(".tmp"));
            assert!(
                digits.is_some_and(|d| d.len() == 16 && d.bytes().all(|b| b.is_ascii_hexdigit())),
                "{file_name}"
            );
            let mode = fs::symlink_metadata(name).unwrap().permissions().mode();
            assert_eq!(mode & 0o7133, 0, "0644 at most, less the umask: {mode:o}");
            assert_eq!(mode & 0o600, 0o600, "{mode:o}");
        }
        drop((first, second));
        assert!(dir.names().is_empty(), "{:?}", dir.names());
    }

    #[test]
    fn placing_replaces_a_link_itself_and_only_with_force() {
        let dir = TestDir::new("links");
        let victim = dir.join("victim");
        fs::write(&victim, "precious").unwrap();
        let out = dir.join("out.json");
        std::os::unix::fs::symlink(&victim, &out).unwrap();
        let written = |text: &str| {
            let mut temporary = Temporary::create(&out).unwrap();
            temporary.file.write_all(text.as_bytes()).unwrap();
            temporary
        };
        let refused = place(written("new"), &out, false).map(drop);
        assert!(matches!(&refused, Err(OutputError::Exists(path)) if *path == out), "{refused:?}");
        assert_eq!(fs::read_link(&out).unwrap(), victim, "the link is kept");
        assert_eq!(dir.names(), ["out.json", "victim"], "and no temporary is left");
        place(written("new"), &out, true).unwrap();
        assert!(fs::symlink_metadata(&out).unwrap().is_file(), "the link itself was replaced");
        assert_eq!(fs::read_to_string(&out).unwrap(), "new");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious", "what it led to is untouched");
        assert_eq!(dir.names(), ["out.json", "victim"]);
    }

    #[test]
    fn what_is_at_a_path_decides_how_it_is_written() {
        let dir = TestDir::new("targets");
        let link = |name: &str, to: &Path| {
            let path = dir.join(name);
            std::os::unix::fs::symlink(to, &path).unwrap();
            path
        };
        fs::write(dir.join("file"), "").unwrap();
        mkfifo(&dir.join("fifo"));
        let direct = |path: &Path| match Destination::of(path).unwrap() {
            Destination::Direct(through) => (through.path, through.magic, through.what),
            other => panic!("{} should be written in place, not {other:?}", path.display()),
        };
        assert!(matches!(Destination::of(&dir.join("nothing")).unwrap(), Destination::Absent));
        assert!(matches!(Destination::of(&dir.join("file")).unwrap(), Destination::Replaceable));
        assert!(matches!(
            Destination::of(&link("to-file", &dir.join("file"))).unwrap(),
            Destination::Replaceable
        ));
        assert!(matches!(
            Destination::of(&link("to-nothing", &dir.join("nothing"))).unwrap(),
            Destination::Replaceable
        ));
        assert!(matches!(Destination::of(&link("to-dir", &dir.0)).unwrap(), Destination::Replaceable));
        assert!(matches!(Destination::of(&dir.0).unwrap(), Destination::Unusable("a directory")));
        assert!(matches!(
            Destination::of(&link("loop", &dir.join("loop"))).unwrap(),
            Destination::Replaceable
        ));
        let null = Path::new("/dev/null");
        assert_eq!(direct(null), (null.to_path_buf(), false, "a character device"));
        assert_eq!(direct(&link("to-null", null)), (null.to_path_buf(), false, "a character device"));
        assert_eq!(direct(&dir.join("fifo")), (dir.join("fifo"), false, "a FIFO"));
        assert_eq!(direct(&link("to-fifo", Path::new("fifo"))), (dir.join("fifo"), false, "a FIFO"));
        // procfs's links to files that are not open files of a process
        // are links like any other.
        assert!(matches!(Destination::of(Path::new("/proc/self/exe")).unwrap(), Destination::Replaceable));
        let (stdout, magic, _) = direct(Path::new("/dev/stdout"));
        assert!(magic, "{}", stdout.display());
        assert_eq!(own_descriptor(&Through { path: stdout, magic, what: "" }), Some(1));
    }

    #[test]
    fn a_stream_is_in_place_from_its_first_report_on() {
        let dir = TestDir::new("stream");
        let path = dir.join("out.json");
        let mut output = Output::open(&config(&path, Format::Json, false), Documents::Several).unwrap();
        assert!(dir.names().is_empty(), "only probed, nothing made yet: {:?}", dir.names());
        output.write(|_| Ok(())).unwrap();
        assert!(dir.names().is_empty(), "nothing to put in place yet: {:?}", dir.names());
        line(&mut output, "{\"report\":1}").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "{\"report\":1}\n");
        line(&mut output, "{\"report\":2}").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "{\"report\":1}\n{\"report\":2}\n", "as it is made");
        assert_eq!(dir.names(), ["out.json"], "no temporary once in place");
        // As if the run failed, or was killed: what was written stays.
        drop(output);
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 2);
        let empty = dir.join("empty.json");
        Output::open(&config(&empty, Format::Json, false), Documents::One).unwrap().finish().unwrap();
        assert_eq!(fs::read_to_string(&empty).unwrap(), "", "a run with no report leaves an empty file");
    }

    #[test]
    fn force_replaces_an_old_file_once_the_first_report_exists() {
        let dir = TestDir::new("force");
        let path = dir.join("out.txt");
        fs::write(&path, "old").unwrap();
        let refused = Output::open(&config(&path, Format::Text, false), Documents::One).map(drop);
        let message = refused.expect_err("the file exists").to_string();
        assert_eq!(message, format!("{} exists: give --force to overwrite it", path.display()));
        let mut output = Output::open(&config(&path, Format::Text, true), Documents::One).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "old", "kept until there is a report");
        line(&mut output, "new").unwrap();
        output.finish().unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new\n");
        assert_eq!(dir.names(), ["out.txt"]);
    }

    #[test]
    fn directories_are_refused_with_or_without_force() {
        let dir = TestDir::new("directory");
        for force in [false, true] {
            for format in [Format::Json, Format::Svg] {
                let refused = Output::open(&config(&dir.0, format, force), Documents::Several).map(drop);
                let message = refused.expect_err("a directory").to_string();
                assert_eq!(
                    message,
                    format!(
                        "{} is a directory: --output and --save write to files, character devices and FIFOs",
                        dir.0.display()
                    )
                );
            }
        }
        assert!(dir.names().is_empty(), "not even numbered files beside it: {:?}", dir.names());
    }

    #[test]
    fn devices_are_written_in_place_and_never_numbered() {
        let null = Path::new("/dev/null");
        for format in [Format::Json, Format::Svg] {
            let mut output = Output::open(&config(null, format, false), Documents::Several).unwrap();
            assert_eq!(output.takes_every_report(), !format.is_document(), "documents would run together");
            line(&mut output, "report").unwrap();
            line(&mut output, "report").unwrap();
            output.finish().unwrap();
        }
        let mut saves = NumberedFiles::new(null, Documents::Several, true).unwrap();
        for _ in 0..2 {
            assert_eq!(saves.write(|out| out.write_all(b"snapshot")).unwrap(), null);
        }
        assert!(fs::metadata(null).unwrap().file_type().is_char_device());
    }

    #[test]
    fn a_fifo_is_written_in_place_until_its_reader_leaves() {
        let dir = TestDir::new("fifo");
        let fifo = dir.join("reports");
        mkfifo(&fifo);
        let read = read_fifo(&fifo);
        let mut output = Output::open(&config(&fifo, Format::Json, true), Documents::Several).unwrap();
        line(&mut output, "{\"report\":1}").unwrap();
        line(&mut output, "{\"report\":2}").unwrap();
        output.finish().unwrap();
        let got = read.recv_timeout(Duration::from_mins(1)).unwrap();
        assert_eq!(String::from_utf8(got).unwrap(), "{\"report\":1}\n{\"report\":2}\n");
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        assert_eq!(dir.names(), ["reports"]);

        // A reader that opens and leaves: writes end with ReaderGone.
        let gone = fifo.clone();
        let reader = thread::spawn(move || drop(File::open(gone)));
        let mut output = Output::open(&config(&fifo, Format::Json, false), Documents::Several).unwrap();
        reader.join().unwrap();
        let ended = (0..100_000).map(|_| line(&mut output, "{\"report\":3}")).find(Result::is_err);
        assert!(matches!(ended, Some(Err(OutputError::ReaderGone))), "{ended:?}");
    }

    #[test]
    fn an_open_file_of_our_own_is_written_through_its_descriptor() {
        let dir = TestDir::new("descriptor");
        let file = File::create(dir.join("captured")).unwrap();
        let path = PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file)));
        let mut output = Output::open(&config(&path, Format::Json, true), Documents::Several).unwrap();
        line(&mut output, "{\"report\":1}").unwrap();
        output.finish().unwrap();
        assert_eq!(fs::read_to_string(dir.join("captured")).unwrap(), "{\"report\":1}\n");
        assert_eq!(dir.names(), ["captured"], "nothing made beside it, nothing replaced");
    }

    /// --save's snapshots are written by a thread of their own: in the
    /// order they were handed over, each whole, and the first error comes
    /// back to the report loop.
    #[test]
    fn documents_written_in_the_background_keep_their_order_and_errors() {
        let dir = TestDir::new("background");
        let files = NumberedFiles::new(&dir.join("heap.snap"), Documents::Several, false).unwrap();
        let mut background = BackgroundFiles::new(files).unwrap();
        for number in 1..=5 {
            background.write(move |out| write!(out, "snapshot {number}")).unwrap();
        }
        background.finish().unwrap();
        assert_eq!(dir.names(), ["heap.1.snap", "heap.2.snap", "heap.3.snap", "heap.4.snap", "heap.5.snap"]);
        for number in 1..=5 {
            let written = fs::read_to_string(dir.join(&format!("heap.{number}.snap"))).unwrap();
            assert_eq!(written, format!("snapshot {number}"));
        }

        let files = NumberedFiles::new(&dir.join("failing.snap"), Documents::Several, false).unwrap();
        let mut background = BackgroundFiles::new(files).unwrap();
        background.write(|_| Err(io::Error::other("no room"))).unwrap();
        // Taken back by the next write, or at the latest by `finish`.
        let error = match background.write(|out| write!(out, "after")) {
            Err(error) => error,
            Ok(()) => background.finish().unwrap_err(),
        };
        assert_eq!(
            error.to_string(),
            format!("cannot write {}: no room", dir.join("failing.1.snap").display())
        );
        assert!(!dir.names().iter().any(|name| name.starts_with("failing")), "{:?}", dir.names());
    }
}
