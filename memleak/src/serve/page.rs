//! `/`: a page for a person, listing the processes followed with their
//! outstanding memory, each linking to its flame graph, its text report
//! and its pprof profile. One self-contained document: no script, no
//! asset fetched from anywhere, so it works on a host without internet
//! and behind any proxy.

use std::fmt::Write as _;

use super::state::{Followed, Published};
use crate::{
    model::Workload,
    report::{printable, subject, Report},
    status,
    watch::{describe_rate, WatchView, WatchedProcess},
};

/// The page, from one round of reports.
pub fn render(published: &Published) -> String {
    let title = escape(&title(published));
    let mut page = String::from(HEAD);
    // Writing to a String cannot fail.
    let _ = write!(page, "<title>{title}</title>\n{STYLE}<h1>{title}</h1>\n{WHAT}");
    oom_section(&mut page, &published.oom.kills);
    if let Some(watch) = &published.watch {
        watch_section(&mut page, watch);
    }
    if published.targets.is_empty() {
        let none = if published.watch.is_some() {
            "No process has been traced yet."
        } else {
            "No process is followed yet."
        };
        let _ = writeln!(page, "<p>{none}</p>");
    } else {
        page.push_str(TABLE_HEAD);
        for followed in &published.targets {
            row(&mut page, followed);
        }
        page.push_str("</tbody></table>\n");
    }
    page.push_str(FOOT);
    page
}

fn row(page: &mut String, followed: &Followed) {
    let pid = followed.pid;
    let report = followed.report.as_deref();
    let state = match (followed.exited, followed.detached) {
        (true, _) => "exited",
        (false, true) => "detached",
        (false, false) => "traced",
    };
    let (bytes, allocations, growth) = match report {
        Some(report) => (
            grouped(report.total_bytes),
            grouped(report.total_allocations),
            growth(followed.growth.bytes_since_first_report(), followed.growth.growing_reports),
        ),
        None => (String::from("-"), String::from("-"), String::from("-")),
    };
    // Its pod and container names (`namespace/pod/container`), else the
    // short id `podman ps` and `docker ps` show; the full id on hover.
    let workload = followed.workload.as_ref();
    let container_id = workload.and_then(|workload| workload.container_id.as_deref()).unwrap_or_default();
    let container = workload.map_or_else(|| "-".to_owned(), container_named);
    let culprit =
        report.and_then(Report::largest_culprit).map_or_else(|| String::from("-"), |(_, named)| named);
    let resident = report.and_then(|report| report.memory.resident).map_or_else(
        || "-".to_owned(),
        |resident| {
            format!(
                "{} ({})",
                status::readable_bytes(resident.resident_bytes),
                status::readable_bytes(resident.anon_bytes)
            )
        },
    );
    let not_a_leak = report.and_then(|report| report.memory.not_a_leak.as_deref()).unwrap_or_default();
    let allocator = report.map_or("", |report| report.allocator.as_str());
    let allocator_file =
        std::path::Path::new(allocator).file_name().and_then(|name| name.to_str()).unwrap_or(allocator);
    // Writing to a String cannot fail.
    let _ = writeln!(
        page,
        "<tr><td class=\"num\">{pid}</td><td title=\"{program}\">{exe}</td>\
         <td title=\"{container_id}\">{container}</td><td>{state}</td>\
         <td class=\"num\">{bytes}</td><td class=\"num\">{growth}</td><td class=\"num\">{allocations}</td>\
         <td class=\"num\" title=\"{not_a_leak}\">{resident}</td>\
         <td class=\"culprit\">{culprit}</td><td title=\"{allocator}\">{allocator_file}</td>\
         <td class=\"links\"><a href=\"/api/v1/report?pid={pid}&amp;format=svg\">flame graph</a> \
         <a href=\"/api/v1/report?pid={pid}\">text</a> \
         <a href=\"/api/v1/report?pid={pid}&amp;format=json\">json</a> \
         <a href=\"/debug/pprof/heap?pid={pid}\">pprof</a></td></tr>",
        program = escape(&followed.program),
        exe = escape(followed.executable()),
        allocator = escape(allocator),
        allocator_file = escape(allocator_file),
        container_id = escape(container_id),
        container = escape(&container),
        culprit = escape(&culprit),
        not_a_leak = escape(not_a_leak),
        resident = escape(&resident),
    );
}

/// The OOM kills kept, newest first, each said in its line; the whole
/// record at /api/v1/oom.
fn oom_section(page: &mut String, kills: &[std::sync::Arc<serde_json::Value>]) {
    if kills.is_empty() {
        return;
    }
    page.push_str(
        "<h2>OOM kills</h2>\n<table><thead><tr><th>killed</th><th>pid</th><th>program</th><th>culprit</th>\
         <th>what memleak knew</th></tr></thead><tbody>\n",
    );
    for kill in kills {
        let text = |field: &str| kill[field].as_str().unwrap_or("-").to_owned();
        let killed = kill["killed_unix_ms"].as_u64().map_or_else(|| "-".to_owned(), crate::clock::local_time);
        let _ = writeln!(
            page,
            "<tr><td>{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"culprit\">{}</td><td>{}</td></tr>",
            escape(&killed),
            kill["pid"].as_u64().unwrap_or_default(),
            escape(&text("program")),
            escape(&text("culprit")),
            escape(&text("summary")),
        );
    }
    page.push_str(
        "</tbody></table>\n<p><a href=\"/api/v1/oom\">Every kill's last report and history</a></p>\n",
    );
}

/// With --watch: how many processes are watched, and those singled out
/// (found growing, traced, let go, untraceable) with their memory and
/// growth; their reports are in the table below.
fn watch_section(page: &mut String, watch: &WatchView) {
    let watched = watch.processes.iter().filter(|process| process.state == "watched").count();
    let _ = writeln!(
        page,
        "<h2>Watched</h2>\n<p>{} processes watched from their counters, every {}s; a process whose anonymous \
         memory grows {} or more over {}s is traced for {}s, {} at a time. {watched} show no growth.</p>",
        watch.processes.len(),
        watch.every_seconds,
        escape(&describe_rate(watch.min_growth_bytes_per_second)),
        watch.growth_window_seconds,
        watch.trace_for_seconds,
        watch.max_traced,
    );
    let singled_out: Vec<&WatchedProcess> =
        watch.processes.iter().filter(|process| process.state != "watched").collect();
    if singled_out.is_empty() {
        return;
    }
    page.push_str(
        "<table><thead><tr><th>pid</th><th>program</th><th>state</th><th>resident</th><th>anonymous</th>\
         <th>growth</th><th>why untraced</th></tr></thead><tbody>\n",
    );
    for process in singled_out {
        let growth =
            process.growth_bytes_per_second.map_or_else(|| "-".to_owned(), |rate| describe_rate(rate as f64));
        let _ = writeln!(
            page,
            "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            process.pid,
            escape(&process.program),
            process.state,
            grouped(process.resident_bytes),
            grouped(process.anon_bytes),
            escape(&growth),
            escape(process.untraceable.as_deref().unwrap_or("")),
        );
    }
    page.push_str("</tbody></table>\n");
}

/// How the page names a workload: `namespace/pod/container` as far as
/// known, else the short id.
fn container_named(workload: &Workload) -> String {
    let names: Vec<&str> = [&workload.namespace, &workload.pod, &workload.container]
        .into_iter()
        .filter_map(Option::as_deref)
        .collect();
    if !names.is_empty() {
        return names.join("/");
    }
    let id = workload.container_id.as_deref().unwrap_or("-");
    let id = id.rsplit("://").next().unwrap_or(id);
    id[..id.len().min(12)].to_owned()
}

/// What the page is about, for its title and heading: the processes
/// followed, by pid and program as every report's title names them (a
/// browser's tab, a bookmark, a screenshot say which they were). One
/// process is named as its reports are, its allocator included; of
/// several, the first three by pid and executable.
fn title(published: &Published) -> String {
    const NAMED: usize = 3;
    match published.targets.as_slice() {
        [] => "memleak: no process followed yet".to_owned(),
        [only] => {
            let whom = match only.report.as_deref() {
                Some(report) => subject::of(report),
                None => subject::process(only.pid, None, &only.program),
            };
            format!("memleak: {whom}")
        }
        several => {
            let named: Vec<String> = several
                .iter()
                .take(NAMED)
                .map(|followed| format!("pid {} ({})", followed.pid, printable(followed.executable())))
                .collect();
            let more = match several.len().saturating_sub(NAMED) {
                0 => String::new(),
                more => format!(" and {more} more"),
            };
            format!("memleak: {} processes, {}{more}", several.len(), named.join(", "))
        }
    }
}

/// `+17,264 (3 reports)`: the bytes gained since the first report, and
/// for how many reports in a row the process has grown.
fn growth(bytes: i128, growing_reports: u32) -> String {
    let sign = match bytes.cmp(&0) {
        std::cmp::Ordering::Greater => "+",
        std::cmp::Ordering::Less => "-",
        std::cmp::Ordering::Equal => "",
    };
    let amount = grouped(u64::try_from(bytes.unsigned_abs()).unwrap_or(u64::MAX));
    match growing_reports {
        0 => format!("{sign}{amount}"),
        1 => format!("{sign}{amount} (1 report)"),
        reports => format!("{sign}{amount} ({reports} reports)"),
    }
}

/// `17264` as `17,264`: bytes are read at a glance.
fn grouped(number: u64) -> String {
    let digits = number.to_string();
    let mut grouped = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    grouped
}

/// Text as HTML shows it: a program may be named anything, `<script>`
/// included, and control characters and bidirectional overrides are
/// shown as the text reports show them (`report::printable`).
fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in crate::report::printable(text).chars() {
        match character {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            other => escaped.push(other),
        }
    }
    escaped
}

const HEAD: &str = r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
"#;

const STYLE: &str = r"<style>
body { font: 15px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 80em; padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; overflow-wrap: anywhere; }
p.what { color: #555; margin-top: 0; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 0.35em 0.7em; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #f3f3f3; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
a { color: #0b57d0; }
td.links { white-space: nowrap; }
td.links a { margin-right: 0.6em; }
td.culprit { font-family: ui-monospace, monospace; font-size: 0.9em; }
footer { margin-top: 1.5em; color: #666; font-size: 0.9em; }
</style>
</head>
<body>
";

const WHAT: &str =
    "<p class=\"what\">Memory allocated and not freed since memleak attached, per process followed.</p>\n";

const TABLE_HEAD: &str = "<table>\n<thead><tr><th class=\"num\">pid</th><th>program</th><th>container</th><th>state</th>\
<th class=\"num\">outstanding bytes</th><th class=\"num\" title=\"since its first report; in a row, the reports that grew\">growth</th>\
<th class=\"num\">allocations</th><th class=\"num\" title=\"resident memory, and of it anonymous, from /proc/PID/smaps; \
a verdict on hover when it grew and the blocks tracked do not explain it\">resident (anonymous)</th><th title=\"the first frame of the program's own code in the stack holding the most\">culprit</th>\
<th>allocator</th><th>reports</th></tr></thead>\n<tbody>\n";

const FOOT: &str = r#"<footer>Also: <a href="/metrics">/metrics</a> for Prometheus, <a href="/api/v1/targets">/api/v1/targets</a> as JSON.</footer>
</body>
</html>
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_shows_its_sign_and_streak() {
        assert_eq!(growth(17_264, 3), "+17,264 (3 reports)");
        assert_eq!(growth(-1_000, 0), "-1,000");
        assert_eq!(growth(0, 0), "0");
        assert_eq!(growth(8_192, 1), "+8,192 (1 report)");
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        let cases = [(0, "0"), (999, "999"), (1_000, "1,000"), (17_264, "17,264"), (1_234_567, "1,234,567")];
        for (number, shown) in cases {
            assert_eq!(grouped(number), shown);
        }
    }

    #[test]
    fn a_program_named_like_markup_is_shown_as_text() {
        let published = Published {
            targets: vec![Followed::new(
                9,
                "/tmp/<script>alert(1)</script>".to_owned(),
                Some(Workload {
                    pod: Some("<b>".to_owned()),
                    container_id: Some("containerd://<i>".to_owned()),
                    ..Workload::default()
                }),
            )],
            ..Published::default()
        };
        let page = render(&published);
        assert!(!page.contains("<script>"), "{page}");
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{page}");
        assert!(page.contains("href=\"/debug/pprof/heap?pid=9\""), "{page}");
        assert!(!page.contains("<b>") && !page.contains("<i>"), "{page}");
        assert!(page.contains("<td title=\"containerd://&lt;i&gt;\">&lt;b&gt;</td>"), "{page}");
        assert!(
            page.contains("<title>memleak: pid 9 (/tmp/&lt;script&gt;alert(1)&lt;/script&gt;)</title>"),
            "{page}"
        );
    }

    fn followed(pid: u32, program: &str) -> Followed {
        Followed::new(pid, program.to_owned(), None)
    }

    #[test]
    fn the_title_names_the_processes_followed() {
        let mut published = Published::default();
        assert_eq!(title(&published), "memleak: no process followed yet");
        let mut one = followed(4242, "/app/server");
        assert_eq!(
            title(&Published { targets: vec![one.clone()], ..Published::default() }),
            "memleak: pid 4242 (/app/server)"
        );
        one.take_report(crate::report::tests::sample_report(1));
        published.targets = vec![one];
        assert_eq!(
            title(&published),
            "memleak: pid 4242 (/app/leaker) through /usr/lib/libc.so.6",
            "as its reports"
        );
        published.targets = (1..=5).map(|pid| followed(pid, "/usr/bin/python3")).collect();
        assert_eq!(
            title(&published),
            "memleak: 5 processes, pid 1 (python3), pid 2 (python3), pid 3 (python3) and 2 more"
        );
        let page = render(&published);
        assert!(page.contains("<h1>memleak: 5 processes, pid 1 (python3)"), "{page}");
    }
}
