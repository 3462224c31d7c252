//! Where reports go: stdout, or a file given with --output. A closed
//! stdout (`memleak ... | head`) is not an error: the writers return
//! `false` and the run ends quietly. Nothing is left half-written: a
//! stream of reports (text, JSON, folded) is written under a temporary name
//! and renamed into place when the run ends well; a document (SVG, pprof,
//! a snapshot) is written whole and renamed into place at once, one file
//! per report, numbered when there may be several.

use std::{
    fs::{self, File},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use memleak_common::TraceEvent;

use super::{diff::Diff, folded, json, pprof, svg, text, trace, trace::TraceLine, Report};
use crate::{
    cli::{Format, Weight},
    status,
};

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{0} exists: give --force to overwrite it")]
    Exists(PathBuf),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

pub struct Output {
    format: Format,
    weight: Weight,
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
    /// Reports to `path` if given, else to stdout. `several` says whether
    /// there may be more than one report, so that documents are numbered.
    /// Fails now, before any probe is placed, if a file exists (without
    /// `force`) or cannot be written.
    pub fn open(
        path: Option<&Path>,
        force: bool,
        several: bool,
        format: Format,
        weight: Weight,
    ) -> Result<Self, OutputError> {
        let Some(path) = path else { return Ok(Self { format, weight, sink: Sink::Stdout }) };
        if format.is_document() {
            let files = NumberedFiles::new(path, several, force)?;
            return Ok(Self { format, weight, sink: Sink::Documents(files) });
        }
        if path.exists() && !force {
            return Err(OutputError::Exists(path.to_path_buf()));
        }
        let temporary = temporary_name(path);
        let write_error = |source| OutputError::Write { path: path.to_path_buf(), source };
        let file = File::create(&temporary).map_err(write_error)?;
        Ok(Self {
            format,
            weight,
            sink: Sink::File { path: path.to_path_buf(), temporary, file: BufWriter::new(file) },
        })
    }

    /// Documents (SVG, pprof) on stdout would run together: there, only
    /// the final report is written.
    pub fn takes_every_report(&self) -> bool {
        !(self.format.is_document() && matches!(self.sink, Sink::Stdout))
    }

    /// Writes a report; `false` when stdout is a closed pipe.
    pub fn report(&mut self, report: &Report) -> anyhow::Result<bool> {
        let (format, weight) = (self.format, self.weight);
        self.write(|out| match format {
            Format::Text => text::render(report, out),
            Format::Json => json::render(report, out),
            Format::Folded => folded::render(report, weight, out),
            Format::Svg => svg::render(report, weight, out),
            Format::Pprof => pprof::render(report, out),
        })
    }

    /// Writes what changed between two snapshots.
    pub fn diff(&mut self, diff: &Diff) -> anyhow::Result<bool> {
        let (format, weight) = (self.format, self.weight);
        self.write(|out| match format {
            Format::Text => text::render_diff(diff, out),
            Format::Json => json::render_diff(diff, out),
            Format::Folded => folded::render_diff(diff, weight, out),
            Format::Svg => svg::render_diff(diff, weight, out),
            Format::Pprof => pprof::render_diff(diff, out),
        })
    }

    /// Writes trace events. `wall_minus_monotonic_ns` turns their BPF
    /// timestamps into wall-clock time.
    pub fn trace(&mut self, events: &[TraceEvent], wall_minus_monotonic_ns: i128) -> anyhow::Result<bool> {
        let format = self.format;
        self.write(|out| {
            events.iter().try_for_each(|event| {
                trace::render(&TraceLine::new(event, wall_minus_monotonic_ns), format, out)
            })
        })
    }

    /// After the per-process reports of one round, a cgroup's total;
    /// `reported` holds (bytes, allocations) of each report. Only in text
    /// and JSON: it would break folded stacks and SVG.
    pub fn cgroup_total(&mut self, cgroup: &Path, reported: &[(u64, u64)]) -> anyhow::Result<bool> {
        let bytes: u64 = reported.iter().map(|(bytes, _)| bytes).sum();
        let allocations: u64 = reported.iter().map(|(_, allocations)| allocations).sum();
        let line = match self.format {
            Format::Folded | Format::Svg | Format::Pprof => return Ok(true),
            Format::Json => serde_json::json!({
                "cgroup": cgroup.display().to_string(),
                "processes": reported.len(),
                "total_bytes": bytes,
                "total_allocations": allocations,
            })
            .to_string(),
            Format::Text => format!(
                "Cgroup {}: {bytes} bytes in {allocations} allocations outstanding in {} processes",
                cgroup.display(),
                reported.len()
            ),
        };
        self.write(|out| writeln!(out, "{line}"))
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

    fn write(&mut self, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> anyhow::Result<bool> {
        let result = match &mut self.sink {
            Sink::Documents(files) => {
                files.write(write)?;
                return Ok(true);
            }
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                write(&mut out).and_then(|()| out.flush())
            }
            Sink::File { file, path, .. } => {
                return write(file)
                    .map(|()| true)
                    .map_err(|source| OutputError::Write { path: path.clone(), source }.into());
            }
        };
        match result {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(false),
            Err(error) => Err(error.into()),
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
    pub fn new(path: &Path, numbered: bool, force: bool) -> Result<Self, OutputError> {
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

/// The format a file name asks for, by its extension.
pub fn format_of(path: &Path) -> Option<Format> {
    let name = path.file_name()?.to_str()?;
    if name.ends_with(".pb.gz") {
        return Some(Format::Pprof);
    }
    let (_, extension) = name.rsplit_once('.')?;
    match extension {
        "pprof" => Some(Format::Pprof),
        "svg" => Some(Format::Svg),
        "folded" => Some(Format::Folded),
        "json" | "jsonl" => Some(Format::Json),
        "txt" | "text" => Some(Format::Text),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_name_formats() {
        assert_eq!(format_of(Path::new("/tmp/leak.svg")), Some(Format::Svg));
        assert_eq!(format_of(Path::new("stacks.folded")), Some(Format::Folded));
        assert_eq!(format_of(Path::new("reports.json")), Some(Format::Json));
        assert_eq!(format_of(Path::new("profile.pb.gz")), Some(Format::Pprof));
        assert_eq!(format_of(Path::new("archive.tar.gz")), None);
        assert_eq!(format_of(Path::new("noextension")), None);
    }

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
