//! Where reports go: stdout, or a file given with --output. A closed
//! stdout (`memleak ... | head`) is not an error: the writers return
//! `false` and the run ends quietly. A file is written under a temporary
//! name and renamed into place when the run ends well, so a failed run
//! leaves no half-written file behind.

use std::{
    fs::{self, File},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
};

use memleak_common::TraceEvent;

use super::{folded, json, pprof, svg, text, trace, trace::TraceLine, Report};
use crate::cli::{Format, Weight};

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
    /// Written as `temporary`, renamed to `path` by `finish`.
    File {
        path: PathBuf,
        temporary: PathBuf,
        file: BufWriter<File>,
    },
}

impl Output {
    /// Reports to `path` if given, else to stdout. Fails now, before any
    /// probe is placed, if the file exists (without `force`) or cannot be
    /// written.
    pub fn open(
        path: Option<&Path>,
        force: bool,
        format: Format,
        weight: Weight,
    ) -> Result<Self, OutputError> {
        let Some(path) = path else { return Ok(Self { format, weight, sink: Sink::Stdout }) };
        if path.exists() && !force {
            return Err(OutputError::Exists(path.to_path_buf()));
        }
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".memleak-{}.tmp", std::process::id()));
        let temporary = path.with_file_name(name);
        let write_error = |source| OutputError::Write { path: path.to_path_buf(), source };
        let file = File::create(&temporary).map_err(write_error)?;
        Ok(Self {
            format,
            weight,
            sink: Sink::File { path: path.to_path_buf(), temporary, file: BufWriter::new(file) },
        })
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
}
