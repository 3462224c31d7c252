//! Writing reports to stdout. A closed stdout (`memleak ... | head`) is
//! not an error: the writers return `false` and the run ends quietly.

use std::{
    io::{self, Write},
    path::Path,
};

use memleak_common::TraceEvent;

use super::{folded, json, svg, text, trace, trace::TraceLine, Report};
use crate::cli::{Format, Weight};

/// Prints a report; `false` when stdout is a closed pipe.
pub fn print_report(report: &Report, format: Format, weight: Weight) -> anyhow::Result<bool> {
    to_stdout(|out| match format {
        Format::Text => text::render(report, out),
        Format::Json => json::render(report, out),
        Format::Folded => folded::render(report, weight, out),
        Format::Svg => svg::render(report, weight, out),
    })
}

/// Prints trace events. `wall_minus_monotonic_ns` turns their BPF
/// timestamps into wall-clock time.
pub fn print_trace(
    events: &[TraceEvent],
    wall_minus_monotonic_ns: i128,
    format: Format,
) -> anyhow::Result<bool> {
    to_stdout(|out| {
        events
            .iter()
            .try_for_each(|event| trace::render(&TraceLine::new(event, wall_minus_monotonic_ns), format, out))
    })
}

/// After the per-process reports of one round, a cgroup's total;
/// `reported` holds (bytes, allocations) of each report. Only in text and
/// JSON: it would break folded stacks and SVG.
pub fn print_cgroup_total(cgroup: &Path, reported: &[(u64, u64)], format: Format) -> anyhow::Result<bool> {
    if matches!(format, Format::Folded | Format::Svg) {
        return Ok(true);
    }
    let bytes: u64 = reported.iter().map(|(bytes, _)| bytes).sum();
    let allocations: u64 = reported.iter().map(|(_, allocations)| allocations).sum();
    let line = match format {
        Format::Json => serde_json::json!({
            "cgroup": cgroup.display().to_string(),
            "processes": reported.len(),
            "total_bytes": bytes,
            "total_allocations": allocations,
        })
        .to_string(),
        _ => format!(
            "Cgroup {}: {bytes} bytes in {allocations} allocations outstanding in {} processes",
            cgroup.display(),
            reported.len()
        ),
    };
    to_stdout(|out| writeln!(out, "{line}"))
}

fn to_stdout(write: impl FnOnce(&mut io::StdoutLock) -> io::Result<()>) -> anyhow::Result<bool> {
    let mut out = io::stdout().lock();
    match write(&mut out).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(error) => Err(error.into()),
    }
}
