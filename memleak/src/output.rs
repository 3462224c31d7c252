//! Where reports go: stdout, or a file given with --output. Rendering is
//! `report::render`'s; this module only decides where the bytes land.
//!
//! A closed stdout (`memleak ... | head`) ends the run quietly: writers
//! return `OutputError::ReaderGone`, which callers treat as the end, not as
//! a failure. Nothing is left half-written: a stream of reports (text,
//! JSON, folded) is written under a temporary name and renamed into place
//! when the run ends well; a document (SVG, pprof, a snapshot) is written
//! whole and renamed into place at once, one file per report, numbered
//! when there may be several.

use std::{
    fs::{self, File},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use memleak_common::TraceEvent;

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
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot write to stdout: {0}")]
    Stdout(io::Error),
    /// stdout is a pipe whose reader has gone: nobody is listening.
    #[error("stdout was closed")]
    ReaderGone,
}

/// Where and how reports are written, as the user asked.
#[derive(Clone, Debug)]
pub struct OutputConfig {
    /// A file, or stdout.
    pub path: Option<PathBuf>,
    /// Overwrite files that exist.
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
    /// A stream, written as `temporary` and renamed to `path` by `finish`.
    File {
        path: PathBuf,
        temporary: PathBuf,
        file: BufWriter<File>,
    },
    /// A document per report.
    Documents(NumberedFiles),
}

impl Output {
    /// Reports to the configured file, else to stdout. Fails now, before
    /// any probe is placed, if a file exists (without `force`) or cannot
    /// be written.
    pub fn open(config: &OutputConfig, documents: Documents) -> Result<Self, OutputError> {
        let rendering = config.rendering;
        let Some(path) = config.path.as_deref() else { return Ok(Self { rendering, sink: Sink::Stdout }) };
        if rendering.format.is_document() {
            let files = NumberedFiles::new(path, documents, config.force)?;
            return Ok(Self { rendering, sink: Sink::Documents(files) });
        }
        if path.exists() && !config.force {
            return Err(OutputError::Exists(path.to_path_buf()));
        }
        let temporary = temporary_name(path);
        let write_error = |source| OutputError::Write { path: path.to_path_buf(), source };
        let file = File::create(&temporary).map_err(write_error)?;
        Ok(Self {
            rendering,
            sink: Sink::File { path: path.to_path_buf(), temporary, file: BufWriter::new(file) },
        })
    }

    /// Documents (SVG, pprof) on stdout would run together: there, only
    /// the final report is written.
    pub fn takes_every_report(&self) -> bool {
        !(self.rendering.format.is_document() && matches!(self.sink, Sink::Stdout))
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

    /// Puts the file in place; a run that fails drops the output instead,
    /// which removes the temporary file.
    pub fn finish(mut self) -> Result<(), OutputError> {
        let Sink::File { path, temporary, file } = std::mem::replace(&mut self.sink, Sink::Stdout) else {
            return Ok(());
        };
        let write_error = |source| OutputError::Write { path: path.clone(), source };
        let file = file.into_inner().map_err(|error| write_error(error.into_error()))?;
        file.sync_all().map_err(write_error)?;
        fs::rename(&temporary, &path).map_err(write_error)
    }

    fn write(&mut self, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<(), OutputError> {
        match &mut self.sink {
            Sink::Documents(files) => files.write(write).map(drop),
            Sink::File { file, path, .. } => {
                write(file).map_err(|source| OutputError::Write { path: path.clone(), source })
            }
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                match write(&mut out).and_then(|()| out.flush()) {
                    Ok(()) => Ok(()),
                    Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Err(OutputError::ReaderGone),
                    Err(error) => Err(OutputError::Stdout(error)),
                }
            }
        }
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if let Sink::File { temporary, .. } = &self.sink {
            let _ = fs::remove_file(temporary);
        }
    }
}

/// Whole files, one per report: `heap.snap`, or `heap.1.snap`,
/// `heap.2.snap`... when there may be several. Each is rendered in memory,
/// written under a temporary name and renamed into place.
pub struct NumberedFiles {
    path: PathBuf,
    numbered: bool,
    written: u32,
}

impl NumberedFiles {
    /// Fails if the file, or without `force` any numbered file of the same
    /// name, exists: nothing the user had is overwritten unasked.
    pub fn new(path: &Path, documents: Documents, force: bool) -> Result<Self, OutputError> {
        let numbered = documents == Documents::Several;
        let files = Self { path: path.to_path_buf(), numbered, written: 0 };
        if !force {
            let first = files.name(1);
            if first.exists() {
                return Err(OutputError::Exists(first));
            }
            if let Some(existing) = numbered.then(|| files.existing_numbered()).flatten() {
                return Err(OutputError::Exists(existing));
            }
        }
        // Whether the directory takes files, before anything is attached.
        let probe = temporary_name(&files.name(1));
        File::create(&probe).map_err(|source| OutputError::Write { path: files.name(1), source })?;
        let _ = fs::remove_file(probe);
        Ok(files)
    }

    /// Renders the next file and puts it in place; returns its name.
    pub fn write(
        &mut self,
        render: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> Result<PathBuf, OutputError> {
        self.written += 1;
        let path = self.name(self.written);
        let write_error = |source| OutputError::Write { path: path.clone(), source };
        let mut bytes = Vec::new();
        render(&mut bytes).map_err(write_error)?;
        let temporary = temporary_name(&path);
        let written = File::create(&temporary)
            .and_then(|mut file| file.write_all(&bytes).and_then(|()| file.sync_all()))
            .and_then(|()| fs::rename(&temporary, &path));
        if let Err(source) = written {
            let _ = fs::remove_file(&temporary);
            return Err(write_error(source));
        }
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
        let directory = match self.path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        fs::read_dir(directory).ok()?.filter_map(Result::ok).map(|entry| entry.path()).find(|path| {
            let name = path.file_name().and_then(|name| name.to_str()).unwrap_or("");
            let number =
                name.strip_prefix(&format!("{stem}.")).and_then(|rest| rest.strip_suffix(&extension));
            number.is_some_and(|number| !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
        })
    }
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

fn temporary_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".memleak-{}.tmp", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_documents_are_numbered_before_the_extension() {
        let files = |path: &str| NumberedFiles { path: PathBuf::from(path), numbered: true, written: 0 };
        assert_eq!(files("/tmp/heap.snap").name(2), Path::new("/tmp/heap.2.snap"));
        assert_eq!(files("leak.pb.gz").name(1), Path::new("leak.1.pb.gz"));
        assert_eq!(files("graph").name(3), Path::new("graph.3"));
        let single = NumberedFiles { path: PathBuf::from("leak.svg"), numbered: false, written: 0 };
        assert_eq!(single.name(1), Path::new("leak.svg"));
    }
}
