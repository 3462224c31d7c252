//! The screen of `memleak top`, drawn from a `View`: a header of the
//! process's totals, the table of stacks with their growth and a
//! sparkline each, the selected stack's frames under it, and a line of
//! status at the bottom. Readable without colours: the selection is
//! marked with `>` and reverse video, and with `NO_COLOR` set no colour
//! is used at all.

use std::{fmt::Write as _, time::Duration};

use ratatui::{
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::Paragraph,
    Frame,
};

use super::view::{Process, Row, Shown, View};
use crate::{
    report::{options::SortKey, text},
    status::readable_bytes,
};

/// Rounds a sparkline spans.
const SPARK_ROUNDS: usize = 12;
const SPARK_LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// The key help, shown when there is nothing else to say: 80 columns.
const KEYS: &str = "q quit  Enter open  o order  / filter  p pause  s save  d diff  f full  Tab next";

/// What the header says of where the reports come from.
pub struct Heading {
    /// `-c "./leaker"`, `pid 1234`, `http://node:9943`.
    pub source: String,
    pub interval: Duration,
    /// Colours allowed (`NO_COLOR` unset).
    pub colour: bool,
}

/// Rows the table has on a screen `height` lines high: what Page Up and
/// Page Down move by.
pub fn table_height(view: &View, height: u16) -> usize {
    usize::from(height).saturating_sub(header_lines(view) + 2)
}

fn header_lines(view: &View) -> usize {
    4 + usize::from(view.processes().len() > 1) + usize::from(missing_symbols(view).is_some())
}

/// What would name the frames shown better, of the process shown: the
/// first object lacking symbols or lines, as the reports say it.
fn missing_symbols(view: &View) -> Option<String> {
    let missing = &view.process()?.report.missing_symbols;
    let first = text::describe_missing(missing.first()?);
    Some(match missing.len() {
        1 => first,
        more => format!("{first} (and {} more objects: see the reports)", more - 1),
    })
}

pub fn draw(frame: &mut Frame<'_>, view: &View, heading: &Heading) {
    let area = frame.area();
    let rows = view.rows();
    let mut lines = header(view, heading);
    lines.push(
        Line::from(format!(
            "  {:>10} {:>8} {:>10}  {:<width$}  CULPRIT",
            "BYTES",
            "ALLOCS",
            if view.diffing { "SINCE SAVE" } else { "GROWTH" },
            "TREND",
            width = SPARK_ROUNDS
        ))
        .style(Style::new().add_modifier(Modifier::BOLD)),
    );
    let space = usize::from(area.height).saturating_sub(lines.len() + 1);
    lines.extend(table(view, &rows, space, heading.colour, usize::from(area.width)));
    while lines.len() < usize::from(area.height).saturating_sub(1) {
        lines.push(Line::default());
    }
    lines.push(Line::from(bottom_line(view)).style(Style::new().add_modifier(Modifier::REVERSED)));
    frame.render_widget(Paragraph::new(lines), area);
}

fn header(view: &View, heading: &Heading) -> Vec<Line<'static>> {
    let bold = Style::new().add_modifier(Modifier::BOLD);
    let mut lines = Vec::new();
    let clock = crate::clock::local_time(crate::clock::wall_ms());
    let whose = match view.process() {
        Some(process) => describe_process(process),
        None => format!("{} processes together", view.processes().len()),
    };
    lines.push(Line::from(vec![
        Span::styled("memleak top", bold),
        Span::raw(format!(
            " · {} · {whose} · every {}s · {clock}",
            heading.source,
            heading.interval.as_secs_f64()
        )),
    ]));
    lines.push(Line::from(totals(view)));
    lines.push(Line::from(health(view)));
    if view.processes().len() > 1 {
        lines.push(Line::from(tabs(view)));
    }
    lines.push(Line::from(mode(view)));
    if let Some(missing) = missing_symbols(view) {
        lines.push(Line::from(missing));
    }
    lines
}

fn describe_process(process: &Process) -> String {
    let report = &process.report;
    let program = std::path::Path::new(&report.program)
        .file_name()
        .map_or(report.program.clone(), |name| name.to_string_lossy().into_owned());
    let allocator = std::path::Path::new(&report.allocator)
        .file_name()
        .map_or(report.allocator.clone(), |name| name.to_string_lossy().into_owned());
    let unwinding = report.unwinding.map_or("", |unwinding| match unwinding {
        crate::model::Unwinding::Dwarf => ", unwind tables",
        crate::model::Unwinding::FramePointers => ", frame pointers",
    });
    let exited = if process.exited { " (exited)" } else { "" };
    format!("pid {} {program}{exited} · {allocator}{unwinding}", process.pid)
}

/// Outstanding bytes and allocations, their change over the last round,
/// and the resident memory beside them.
fn totals(view: &View) -> String {
    let shown: Vec<&Process> = match view.process() {
        Some(process) => vec![process],
        None => view.processes().iter().collect(),
    };
    let bytes: u64 = shown.iter().map(|process| process.report.total_bytes).sum();
    let allocations: u64 = shown.iter().map(|process| process.report.total_allocations).sum();
    let change: Option<i64> =
        shown.iter().filter_map(|process| process.history.last_total_change()).reduce(|a, b| a + b);
    let mut line = format!("outstanding {} in {allocations} allocations", readable_bytes(bytes));
    if let Some(change) = change {
        let _ = write!(line, ", {} over the last round", signed_bytes(change));
    }
    let resident: Option<u64> = shown
        .iter()
        .map(|process| process.report.memory.resident.as_ref().map(|resident| resident.resident_bytes))
        .sum();
    if let Some(resident) = resident {
        let _ = write!(line, " · resident {}", readable_bytes(resident));
    }
    line
}

/// The health counters, and what memleak's probes cost where known.
fn health(view: &View) -> String {
    let shown: Vec<&Process> = match view.process() {
        Some(process) => vec![process],
        None => view.processes().iter().collect(),
    };
    let sum = |field: fn(&Process) -> u64| shown.iter().map(|process| field(process)).sum::<u64>();
    let mut line = format!(
        "allocs {} · frees {} · unrecorded frees {} · failed {} · untracked {} · stacks lost {}",
        sum(|p| p.report.health.allocations),
        sum(|p| p.report.health.frees),
        sum(|p| p.report.health.unrecorded_frees.unwrap_or(0)),
        sum(|p| p.report.health.failed_allocations),
        sum(|p| p.report.health.allocations_not_tracked),
        sum(|p| p.report.health.stacks_lost),
    );
    let overhead: Option<f64> = shown.iter().map(|process| process.overhead_seconds).sum();
    if let Some(seconds) = overhead {
        let _ = write!(line, " · probes cost {:.1} ms", seconds * 1e3);
    }
    line
}

/// The processes, the one shown in brackets.
fn tabs(view: &View) -> String {
    let mut line = String::from("Tab:");
    let mark = |shown: bool, text: String| if shown { format!(" [{text}]") } else { format!(" {text}") };
    line.push_str(&mark(view.shown == Shown::All, "all".to_owned()));
    for (index, process) in view.processes().iter().enumerate() {
        let program = std::path::Path::new(&process.report.program)
            .file_name()
            .map_or(String::new(), |name| name.to_string_lossy().into_owned());
        let exited = if process.exited { " exited" } else { "" };
        line.push_str(&mark(view.shown == Shown::One(index), format!("{} {program}{exited}", process.pid)));
    }
    line
}

/// The order, the filter, a pause and a diff.
fn mode(view: &View) -> String {
    let order = match view.sort {
        SortKey::Growth => "growth",
        SortKey::Size => "bytes",
        SortKey::Count => "count",
    };
    let mut line = match (view.diffing, &view.last_save) {
        (true, Some(save)) => format!("order: growth since {}", save.path.display()),
        _ => format!("order: {order}"),
    };
    if !view.filter.is_empty() {
        let _ = write!(line, " · filter: {}", view.filter);
    }
    if view.full_stacks {
        line.push_str(" · every frame");
    }
    if view.paused() {
        line.push_str(" · PAUSED (p goes on)");
    }
    if let Some(save) = &view.last_save {
        let _ = write!(line, " · saved {}", save.path.display());
    }
    line
}

/// The table's lines, scrolled so that the selected row and as much of
/// its frames as fit are on screen.
fn table(view: &View, rows: &[Row], space: usize, colour: bool, width: usize) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    let mut selected_lines = 0..0;
    for (index, row) in rows.iter().enumerate() {
        let selected = index == view.selected.min(rows.len().saturating_sub(1));
        let start = lines.len();
        lines.push(row_line(row, selected, colour, width));
        if selected && view.opened {
            let plumbing = text::folded(view.full_stacks, !row.plumbing.is_empty(), &row.plumbing);
            lines.extend(
                text::frame_lines(row.stack_lost, &row.frames, plumbing)
                    .into_iter()
                    .map(|frame| Line::from(format!("      {frame}"))),
            );
        }
        if selected {
            selected_lines = start..lines.len();
        }
    }
    if rows.is_empty() {
        let none = match (view.diffing && view.diff.is_none(), view.filter.is_empty()) {
            (true, _) => "the diff comes with the next round",
            (false, true) => "no outstanding allocations yet",
            (false, false) => "no stack matches the filter",
        };
        lines.push(Line::from(format!("  {none}")));
    }
    let end = selected_lines.end.min(selected_lines.start + space);
    let scroll = end.saturating_sub(space);
    lines.into_iter().skip(scroll).take(space).collect()
}

fn row_line(row: &Row, selected: bool, colour: bool, width: usize) -> Line<'static> {
    let growth = row.growth.map_or_else(|| "-".to_owned(), signed_bytes);
    let growth_style = match row.growth {
        Some(growth) if growth > 0 && colour => Style::new().fg(Color::Red),
        _ => Style::new(),
    };
    let spans = vec![
        Span::raw(format!(
            "{} {:>10} {:>8} ",
            if selected { '>' } else { ' ' },
            readable_bytes(row.bytes),
            row.allocations
        )),
        Span::styled(format!("{growth:>10}"), growth_style),
        Span::raw(format!("  {:<spark$}  ", sparkline(&row.series), spark = SPARK_ROUNDS)),
        Span::raw(fit_culprit(&row.culprit, row.place.as_deref(), width.saturating_sub(CULPRIT_COLUMN))),
    ];
    let line = Line::from(spans);
    if selected {
        line.style(Style::new().add_modifier(Modifier::REVERSED))
    } else {
        line
    }
}

/// The bottom line: the filter being typed, else the last thing said,
/// else the keys.
fn bottom_line(view: &View) -> String {
    if let Some(typed) = &view.typing {
        return format!("filter (function, file or object; Enter applies, Esc cancels): {typed}_");
    }
    if view.status.is_empty() {
        KEYS.to_owned()
    } else {
        view.status.clone()
    }
}

/// Where the culprit column starts: after the marker, bytes, count,
/// growth and sparkline.
const CULPRIT_COLUMN: usize = 2 + 10 + 1 + 8 + 1 + 10 + 2 + SPARK_ROUNDS + 2;

/// `name (file:line)` in `width` columns: the file is cut from its start
/// first (`.../src/cache.c:41`), as the line and the file's own name are
/// what the reader opens; then the name from its end.
fn fit_culprit(name: &str, place: Option<&str>, width: usize) -> String {
    let Some(place) = place else { return cut(name, width) };
    let whole = format!("{name} ({place})");
    if whole.chars().count() <= width {
        return whole;
    }
    // The name, " (", "...", at least the file's own name, ")".
    let room = width.saturating_sub(name.chars().count() + 6);
    let file_name_and_line = place.rsplit('/').next().unwrap_or(place);
    if room >= file_name_and_line.chars().count() {
        let tail: String = place.chars().rev().take(room).collect::<Vec<_>>().into_iter().rev().collect();
        return format!("{name} (...{tail})");
    }
    cut(&format!("{name} ({file_name_and_line})"), width)
}

/// `text` in `width` columns at most, cut at its end.
fn cut(text: &str, width: usize) -> String {
    text.chars().take(width).collect()
}

/// `+1.5 MiB`, `-512 bytes`, `0`.
fn signed_bytes(change: i64) -> String {
    match change {
        0 => "0".to_owned(),
        change if change > 0 => format!("+{}", readable_bytes(change.unsigned_abs())),
        change => format!("-{}", readable_bytes(change.unsigned_abs())),
    }
}

/// The last rounds of a series, each as a block from ▁ to █ between
/// their least and their most; a flat series is a flat line.
pub fn sparkline(series: &[u64]) -> String {
    let recent = &series[series.len().saturating_sub(SPARK_ROUNDS)..];
    let (Some(&least), Some(&most)) = (recent.iter().min(), recent.iter().max()) else {
        return String::new();
    };
    recent
        .iter()
        .map(|&value| {
            let level = if most == least {
                usize::from(most > 0) * 3
            } else {
                usize::try_from(u128::from(value - least) * 7 / u128::from(most - least)).unwrap_or(7)
            };
            SPARK_LEVELS[level]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparkline_spans_its_last_rounds_from_least_to_most() {
        assert_eq!(sparkline(&[]), "");
        assert_eq!(sparkline(&[0, 0, 0]), "▁▁▁");
        assert_eq!(sparkline(&[5, 5]), "▄▄");
        assert_eq!(sparkline(&[0, 10, 20, 30, 40, 50, 60, 70]), "▁▂▃▄▅▆▇█");
        let long: Vec<u64> = (0..20).collect();
        assert_eq!(sparkline(&long).chars().count(), SPARK_ROUNDS);
    }

    #[test]
    fn a_culprit_keeps_its_name_file_name_and_line_in_any_width() {
        let place = Some("/srv/app/src/cache/fill.c:41");
        assert_eq!(fit_culprit("fill", place, 80), "fill (/srv/app/src/cache/fill.c:41)");
        assert_eq!(fit_culprit("fill", place, 25), "fill (...cache/fill.c:41)");
        assert_eq!(fit_culprit("a_long_function_name", place, 25), "a_long_function_name (fil");
        assert_eq!(fit_culprit("fill", None, 3), "fil");
    }

    /// The screen of a view of the sample report in a terminal this
    /// large, a line each.
    fn screen(width: u16, height: u16) -> Vec<String> {
        let mut view =
            View::new(SortKey::Size, std::sync::Arc::new(crate::report::culprit::SkipRules::default()));
        let report = crate::report::tests::sample_report(usize::MAX);
        view.take(vec![super::super::view::Update {
            report,
            exited: false,
            overhead_seconds: None,
            history: None,
        }]);
        let heading =
            Heading { source: "-p 4242".to_owned(), interval: Duration::from_secs(2), colour: false };
        let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(width, height)).unwrap();
        terminal.draw(|frame| draw(frame, &view, &heading)).unwrap();
        let buffer = terminal.backend().buffer().clone();
        (0..height)
            .map(|y| {
                (0..width)
                    .map(|x| buffer[(x, y)].symbol().to_owned())
                    .collect::<String>()
                    .trim_end()
                    .to_owned()
            })
            .collect()
    }

    #[test]
    fn the_screen_fits_80_by_24_and_smaller_terminals_without_panicking() {
        let lines = screen(80, 24);
        assert!(
            lines[0].starts_with("memleak top · -p 4242 · pid 4242 leaker · libc.so.6 · every 2s"),
            "{lines:#?}"
        );
        assert_eq!(lines[1], "outstanding 24.3 KiB in 7 allocations");
        assert!(lines[5].starts_with(">   24.0 KiB        3          -"), "{lines:#?}");
        assert!(lines[5].ends_with("fibonacci (/src/leaker.c:9)"), "{lines:#?}");
        assert_eq!(lines[23], KEYS);
        for (width, height) in [(20, 5), (1, 1), (200, 3)] {
            assert_eq!(screen(width, height).len(), usize::from(height));
        }
    }

    #[test]
    fn changes_are_signed() {
        assert_eq!(signed_bytes(0), "0");
        assert_eq!(signed_bytes(2048), "+2.0 KiB");
        assert_eq!(signed_bytes(-100), "-100 bytes");
    }
}
