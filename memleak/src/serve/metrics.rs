//! `/metrics`: Prometheus' text exposition format (version 0.0.4).
//!
//! Per followed process, labelled with its pid, its executable's file
//! name and, when it runs in one, its container's id: the series of
//! `PROCESS_METRICS`, and its largest stacks (at most
//! --metrics-top-stacks K of them, two series each, labelled too with
//! the stack's stable id and first named frame). Once for memleak: how
//! full its allocation and stack maps are, and how many processes
//! --max-processes left out. So a scrape has at most processes x (9 + 2K)
//! + 5 series.

use std::fmt::Write as _;

use super::{
    state::{Followed, Published},
    top_stacks::{top_stacks, ShownStack},
};
use crate::{
    bpf::MapFill,
    model::Workload,
    watch::{State, WatchView, WatchedProcess},
};
use std::path::Path;

/// The exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone, Copy)]
enum Kind {
    Gauge,
    Counter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// A metric of each followed process: its name, kind, help and value.
struct Metric {
    name: &'static str,
    kind: Kind,
    help: &'static str,
    value: fn(&Followed) -> i128,
}

/// A figure of a process's latest report (0 without one: never shown).
fn of_report(followed: &Followed, figure: fn(&crate::report::Report) -> u64) -> i128 {
    followed.report.as_deref().map_or(0, |report| i128::from(figure(report)))
}

/// A figure of a process's resident memory as of its latest report (0
/// without one).
fn of_resident(followed: &Followed, figure: fn(&crate::model::ResidentMemory) -> u64) -> i128 {
    followed
        .report
        .as_deref()
        .and_then(|report| report.memory.resident.as_ref())
        .map_or(0, |resident| i128::from(figure(resident)))
}

const PROCESS_METRICS: &[Metric] = &[
    Metric {
        name: "memleak_outstanding_bytes",
        kind: Kind::Gauge,
        help: "Bytes allocated and not freed, as of the latest report.",
        value: |followed| of_report(followed, |report| report.total_bytes),
    },
    Metric {
        name: "memleak_outstanding_allocations",
        kind: Kind::Gauge,
        help: "Allocations not freed, as of the latest report.",
        value: |followed| of_report(followed, |report| report.total_allocations),
    },
    Metric {
        name: "memleak_outstanding_replacing_bytes",
        kind: Kind::Gauge,
        help: "Of memleak_outstanding_bytes, those in blocks that took the place of blocks allocated before \
               memleak attached (a cache refilling): outstanding, but not growth.",
        value: |followed| of_report(followed, |report| report.total_replacing.bytes),
    },
    Metric {
        name: "memleak_outstanding_growth_bytes",
        kind: Kind::Gauge,
        help: "New memory (memleak_outstanding_bytes less memleak_outstanding_replacing_bytes) now less what it \
               was in the first report after memleak attached (or the process ran a new program); negative when \
               blocks allocated before that report were freed.",
        value: |followed| followed.growth.bytes_since_first_report(),
    },
    Metric {
        name: "memleak_growing_reports",
        kind: Kind::Gauge,
        help: "Reports in a row, the latest included, in which new memory (see memleak_outstanding_growth_bytes) \
               grew; 0 after one in which it did not.",
        value: |followed| i128::from(followed.growth.growing_reports),
    },
    Metric {
        name: "memleak_resident_bytes",
        kind: Kind::Gauge,
        help: "Resident memory of the process, from /proc/PID/smaps, as of the latest report.",
        value: |followed| of_resident(followed, |resident| resident.resident_bytes),
    },
    Metric {
        name: "memleak_resident_anon_bytes",
        kind: Kind::Gauge,
        help: "Of memleak_resident_bytes, anonymous memory: the heap, stacks and private mappings.",
        value: |followed| of_resident(followed, |resident| resident.anon_bytes),
    },
    Metric {
        name: "memleak_resident_heap_bytes",
        kind: Kind::Gauge,
        help: "Of memleak_resident_anon_bytes, the heap and glibc's arenas, where freed blocks stay until the \
               allocator gives them back: growing while memleak_outstanding_bytes does not is not a leak.",
        value: |followed| of_resident(followed, |resident| resident.heap_bytes),
    },
    Metric {
        name: "memleak_resident_thread_stack_bytes",
        kind: Kind::Gauge,
        help: "Of memleak_resident_anon_bytes, the threads' stacks.",
        value: |followed| of_resident(followed, |resident| resident.thread_stack_bytes),
    },
    Metric {
        name: "memleak_resident_file_bytes",
        kind: Kind::Gauge,
        help: "Of memleak_resident_bytes, the pages of files mapped (shared memory included).",
        value: |followed| of_resident(followed, |resident| resident.file_bytes),
    },
    Metric {
        name: "memleak_allocations_total",
        kind: Kind::Counter,
        help: "Allocation calls that returned a block since memleak attached.",
        value: |followed| of_report(followed, |report| report.health.allocations),
    },
    Metric {
        name: "memleak_frees_total",
        kind: Kind::Counter,
        help: "Releases seen since memleak attached: frees, and blocks realloc gave up.",
        value: |followed| of_report(followed, |report| report.health.frees),
    },
    Metric {
        name: "memleak_unrecorded_frees_total",
        kind: Kind::Counter,
        help: "Of memleak_frees_total, releases of blocks memleak never saw allocated: allocated before it \
               attached, or left out by -s, -z, -Z or --max-allocs. Their sizes are unknown; the blocks \
               allocated in their places count in memleak_outstanding_replacing_bytes, not as growth.",
        value: |followed| {
            of_report(followed, |report| report.health.unrecorded_frees.unwrap_or_default())
        },
    },
    Metric {
        name: "memleak_allocations_not_tracked_total",
        kind: Kind::Counter,
        help: "Allocations not tracked because the allocation map was full.",
        value: |followed| of_report(followed, |report| report.health.allocations_not_tracked),
    },
    Metric {
        name: "memleak_stacks_lost_total",
        kind: Kind::Counter,
        help: "Allocations whose stack could not be stored because the stack map was full.",
        value: |followed| of_report(followed, |report| report.health.stacks_lost),
    },
];

/// A metric of each stack shown.
struct StackMetric {
    name: &'static str,
    help: &'static str,
    value: fn(&ShownStack) -> u64,
}

/// The series of each process's largest stacks.
const STACK_METRICS: [StackMetric; 3] = [
    StackMetric {
        name: "memleak_stack_outstanding_bytes",
        help: "Bytes allocated and not freed from one stack, for the --metrics-top-stacks stacks of each process \
         holding the most new memory (bytes less memleak_stack_replacing_bytes), then the most bytes; stack is \
         an id stable across restarts for the same stack of the same binary, frame its culprit.",
        value: |stack| stack.bytes,
    },
    StackMetric {
        name: "memleak_stack_outstanding_allocations",
        help: "Allocations not freed from one stack, for the stacks memleak_stack_outstanding_bytes shows.",
        value: |stack| stack.allocations,
    },
    StackMetric {
        name: "memleak_stack_replacing_bytes",
        help: "Of memleak_stack_outstanding_bytes, those in blocks that took the place of blocks allocated before \
               memleak attached (a cache refilling): outstanding, but not growth.",
        value: |stack| stack.replacing_bytes,
    },
];

/// The whole `/metrics` body. A process without a report yet has no
/// series: zeros would read as a measurement.
#[cfg(test)]
pub fn render(published: &Published) -> String {
    render_for(published, None)
}

/// `/metrics`, or with `only` (`/metrics?pid=`, the targets of
/// /api/v1/sd) the series of the process that pid names alone: memleak's
/// own series are left to the scrape of the whole, or each target would
/// repeat them.
pub fn render_for(published: &Published, only: Option<u32>) -> String {
    let mut out = String::new();
    let reported: Vec<&Followed> = published
        .targets
        .iter()
        // One set of series per pid: that of the process it names now, as
        // two with the same labels must not be in one scrape.
        .filter(|followed| {
            followed.report.is_some()
                && only.is_none_or(|pid| pid == followed.pid)
                && published.named_by(followed.pid).is_some_and(|named| std::ptr::eq(named, *followed))
        })
        .collect();
    for metric in PROCESS_METRICS {
        header(&mut out, metric.name, metric.kind, metric.help);
        for followed in &reported {
            // Writing to a String cannot fail.
            let _ =
                writeln!(out, "{}{{{}}} {}", metric.name, process_labels(followed), (metric.value)(followed));
        }
    }
    render_overhead(&mut out, &reported);
    render_stacks(&mut out, &reported, published.metrics_top_stacks);
    if only.is_some() {
        return out;
    }
    if let Some(fill) = published.map_fill {
        render_map_fill(&mut out, &fill);
    }
    header(
        &mut out,
        "memleak_processes_not_followed_total",
        Kind::Counter,
        "Processes a selector named that were left untraced because --max-processes was reached.",
    );
    let _ = writeln!(out, "memleak_processes_not_followed_total {}", published.processes_not_followed);
    header(
        &mut out,
        "memleak_python_code_objects_let_go_total",
        Kind::Counter,
        "Python code objects whose names and line tables memleak let go to stay within its memory budget; \
         each is read again when a stack needs it.",
    );
    let _ = writeln!(out, "memleak_python_code_objects_let_go_total {}", published.python_code_let_go);
    if let Some(watch) = &published.watch {
        render_watch(&mut out, watch);
    }
    header(
        &mut out,
        "memleak_oom_kills_total",
        Kind::Counter,
        "Processes followed or watched that the OOM killer killed since memleak started, by program, workload, \
         whether memleak traced them, and the culprit of the stack holding the most in their last report \
         (/api/v1/oom has the reports).",
    );
    for (labels, count) in &published.oom.counted {
        let labels: Vec<String> =
            labels.iter().map(|(name, value)| format!("{name}=\"{}\"", escape_label(value))).collect();
        let _ = writeln!(out, "memleak_oom_kills_total{{{}}} {count}", labels.join(","));
    }
    out
}

/// A series of each process --watch singled out: its name, help and value.
type WatchSeries = (&'static str, &'static str, fn(&WatchedProcess) -> Option<i128>);

/// With --watch: how many processes stand in each state, the windows of
/// tracing begun, and each process not merely watched with its state,
/// memory and growth. The merely watched are counted, not listed: a node
/// runs a thousand of them, and cAdvisor has their memory already.
fn render_watch(out: &mut String, watch: &WatchView) {
    header(
        out,
        "memleak_watched_processes",
        Kind::Gauge,
        "Processes --watch looks at, by state: watched (counters only), suspected (growing, waiting for a \
         tracing slot), traced, detached (traced, then let go), untraceable (growing, but no allocator memleak \
         can probe).",
    );
    for state in State::NAMES {
        let count = watch.processes.iter().filter(|process| process.state == state).count();
        let _ = writeln!(out, "memleak_watched_processes{{state=\"{state}\"}} {count}");
    }
    header(out, "memleak_watch_windows_total", Kind::Counter, "Windows of tracing --watch began.");
    let _ = writeln!(out, "memleak_watch_windows_total {}", watch.windows_total);
    let singled_out: Vec<_> = watch.processes.iter().filter(|process| process.state != "watched").collect();
    let series: [WatchSeries; 3] = [
        ("memleak_watch_state", "1 for each process --watch singled out, labelled with its state.", |_| {
            Some(1)
        }),
        (
            "memleak_watch_anon_bytes",
            "Anonymous resident memory of each process --watch singled out, from /proc/PID/statm.",
            |process| Some(i128::from(process.anon_bytes)),
        ),
        (
            "memleak_watch_growth_bytes_per_second",
            "Growth of each process --watch singled out, its anonymous memory's robust slope over \
             --growth-window, as last judged.",
            |process| process.growth_bytes_per_second.map(i128::from),
        ),
    ];
    for (name, help, value) in series {
        header(out, name, Kind::Gauge, help);
        for process in &singled_out {
            let Some(value) = value(process) else { continue };
            let executable = Path::new(&process.program)
                .file_name()
                .map_or_else(|| process.program.clone(), |name| name.to_string_lossy().into_owned());
            let mut labels = String::new();
            for (label, value) in process.workload.iter().flat_map(Workload::labels) {
                let _ = write!(labels, ",{label}=\"{}\"", escape_label(value));
            }
            if name == "memleak_watch_state" {
                let _ = write!(labels, ",state=\"{}\"", process.state);
            }
            let _ = writeln!(
                out,
                "{name}{{pid=\"{}\",exe=\"{}\"{labels}}} {value}",
                process.pid,
                escape_label(&executable)
            );
        }
    }
}

/// What memleak's probes cost each process, where it could price them.
fn render_overhead(out: &mut String, reported: &[&Followed]) {
    header(
        out,
        "memleak_overhead_seconds_total",
        Kind::Counter,
        "CPU time memleak's probes cost the process since they were placed, estimated: each allocation call \
         traps at its entry and return, each free at its entry, priced on this machine at start, and each runs a \
         program, priced by the kernel's count of their run time.",
    );
    for followed in reported {
        if let Some(seconds) = followed.overhead_seconds {
            let _ =
                writeln!(out, "memleak_overhead_seconds_total{{{}}} {seconds:.6}", process_labels(followed));
        }
    }
}

/// The largest stacks of each process; nothing, headers included, when
/// none are shown.
fn render_stacks(out: &mut String, reported: &[&Followed], top: usize) {
    if top == 0 {
        return;
    }
    let shown: Vec<(&Followed, Vec<ShownStack>)> = reported
        .iter()
        .filter_map(|followed| Some((*followed, top_stacks(followed.report.as_deref()?, top))))
        .collect();
    for StackMetric { name, help, value } in STACK_METRICS {
        header(out, name, Kind::Gauge, help);
        for (followed, stacks) in &shown {
            for stack in stacks {
                let _ = writeln!(
                    out,
                    "{name}{{{},stack=\"{}\",frame=\"{}\"}} {}",
                    process_labels(followed),
                    stack.id,
                    escape_label(&stack.frame),
                    value(stack)
                );
            }
        }
    }
}

/// How full the allocation and stack maps are, shared by every process.
fn render_map_fill(out: &mut String, fill: &MapFill) {
    let maps =
        [("allocations", fill.allocations, fill.max_allocations), ("stacks", fill.stacks, fill.max_stacks)];
    header(
        out,
        "memleak_map_entries",
        Kind::Gauge,
        "Entries in memleak's BPF map of outstanding allocations, or of stacks, for all processes followed.",
    );
    for (map, entries, _) in maps {
        let _ = writeln!(out, "memleak_map_entries{{map=\"{map}\"}} {entries}");
    }
    header(
        out,
        "memleak_map_max_entries",
        Kind::Gauge,
        "Capacity of the map (--max-allocs, --max-stacks): past it allocations go untracked or stacks are lost.",
    );
    for (map, _, capacity) in maps {
        let _ = writeln!(out, "memleak_map_max_entries{{map=\"{map}\"}} {capacity}");
    }
}

fn header(out: &mut String, name: &str, kind: Kind, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {}", kind.name());
}

/// `pid="42",exe="leaker"`, then for a process in a container the
/// workload's labels known (`namespace`, `pod`, `container`, `uid`,
/// `container_id`, `node`), as cAdvisor and kube-state-metrics name them.
fn process_labels(followed: &Followed) -> String {
    let mut labels = format!("pid=\"{}\",exe=\"{}\"", followed.pid, escape_label(followed.executable()));
    for (name, value) in followed.workload.iter().flat_map(Workload::labels) {
        let _ = write!(labels, ",{name}=\"{}\"", escape_label(value));
    }
    labels
}

/// The most characters of a label value: a pod or an executable may be
/// named anything, as long as anything (a 1 MB pod name made every
/// scrape 11 MB).
const MAX_LABEL_CHARACTERS: usize = 256;

/// A label value as the format wants it: control characters and
/// bidirectional overrides shown as the text reports show them
/// (`report::printable`), cut at `MAX_LABEL_CHARACTERS` with a marker,
/// then backslash, double quote and line feed escaped.
fn escape_label(value: &str) -> String {
    let shown = crate::report::printable(value);
    let mut escaped = String::with_capacity(shown.len().min(MAX_LABEL_CHARACTERS * 2));
    let mut characters = shown.chars();
    let kept: String = characters.by_ref().take(MAX_LABEL_CHARACTERS).collect();
    let cut = characters.count();
    let value = if cut == 0 { kept } else { format!("{kept}...[{cut} more characters]") };
    for character in value.chars() {
        match character {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            other => escaped.push(other),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        model::HealthCounters,
        report::{tests::sample_report, Report},
    };

    /// A process whose reports held `bytes`, then `bytes + 100`: its
    /// report is the sample report's, with 3 stacks.
    fn followed(pid: u32, program: &str, bytes: u64) -> Followed {
        let report = Report {
            pid,
            program: program.to_owned(),
            total_bytes: bytes,
            total_allocations: 3,
            health: HealthCounters { allocations: 5, frees: 2, ..HealthCounters::default() },
            ..sample_report(3)
        };
        let mut followed = Followed::new(pid, program.to_owned(), None);
        followed.take_report(Report { total_bytes: bytes.saturating_sub(100), ..report.clone() });
        followed.take_report(report);
        followed
    }

    fn published(targets: Vec<Followed>, metrics_top_stacks: usize) -> Published {
        Published { targets, metrics_top_stacks, ..Published::default() }
    }

    #[test]
    fn a_watch_counts_every_state_and_lists_only_the_processes_it_singled_out() {
        let process = |pid, state| WatchedProcess {
            pid,
            program: "/srv/app".to_owned(),
            state,
            resident_bytes: 8192,
            anon_bytes: 4096,
            growth_bytes_per_second: Some(65_536),
            traced_until_unix_ms: None,
            untraceable: None,
            workload: None,
        };
        let watch = WatchView {
            windows_total: 3,
            processes: vec![process(1, "watched"), process(2, "watched"), process(3, "traced")],
            ..WatchView::default()
        };
        let counted =
            vec![(vec![("exe".to_owned(), "app".to_owned()), ("traced".to_owned(), "true".to_owned())], 2)];
        let body = render(&Published {
            watch: Some(std::sync::Arc::new(watch)),
            oom: std::sync::Arc::new(crate::serve::state::OomView { kills: Vec::new(), counted }),
            ..Published::default()
        });
        let series: Vec<&str> = body.lines().filter(|line| !line.starts_with('#')).collect();
        for expected in [
            "memleak_watched_processes{state=\"watched\"} 2",
            "memleak_watched_processes{state=\"suspected\"} 0",
            "memleak_watched_processes{state=\"traced\"} 1",
            "memleak_watch_windows_total 3",
            "memleak_watch_state{pid=\"3\",exe=\"app\",state=\"traced\"} 1",
            "memleak_watch_anon_bytes{pid=\"3\",exe=\"app\"} 4096",
            "memleak_watch_growth_bytes_per_second{pid=\"3\",exe=\"app\"} 65536",
            "memleak_oom_kills_total{exe=\"app\",traced=\"true\"} 2",
        ] {
            assert!(series.contains(&expected), "no `{expected}` in:\n{body}");
        }
        assert!(!body.contains("pid=\"1\""), "a process merely watched has series:\n{body}");
    }

    #[test]
    fn each_process_has_a_series_of_each_metric_under_its_help_and_type() {
        let new = Followed::new(43, "new".to_owned(), None);
        let body = render(&published(vec![followed(42, "/usr/bin/leaker", 17_264), new], 0));
        let lines: Vec<&str> = body.lines().collect();
        assert_eq!(
            lines.len(),
            PROCESS_METRICS.len() * 3 + 10,
            "HELP, TYPE and one series each, the overhead's header, the processes not followed, the code objects let go, and no OOM \
             kill:\n{body}"
        );
        assert!(lines.contains(&"memleak_python_code_objects_let_go_total 0"));
        assert_eq!(lines.last(), Some(&"# TYPE memleak_oom_kills_total counter"));
        assert!(lines.contains(&"memleak_processes_not_followed_total 0"));
        assert_eq!(
            lines[0],
            "# HELP memleak_outstanding_bytes Bytes allocated and not freed, as of the latest report."
        );
        assert_eq!(lines[1], "# TYPE memleak_outstanding_bytes gauge");
        assert_eq!(lines[2], "memleak_outstanding_bytes{pid=\"42\",exe=\"leaker\"} 17264");
        assert!(
            body.contains(
                "# TYPE memleak_frees_total counter\nmemleak_frees_total{pid=\"42\",exe=\"leaker\"} 2\n"
            ),
            "{body}"
        );
        assert!(
            body.contains("\nmemleak_outstanding_growth_bytes{pid=\"42\",exe=\"leaker\"} 100\n"),
            "{body}"
        );
        assert!(body.contains("\nmemleak_growing_reports{pid=\"42\",exe=\"leaker\"} 1\n"), "{body}");
        assert!(!body.contains("pid=\"43\""), "no series before a first report:\n{body}");
        assert!(!body.contains("memleak_stack_"), "no stack series with K = 0:\n{body}");
        assert!(!body.contains("memleak_map_"), "no map fill before a round:\n{body}");
    }

    #[test]
    fn the_largest_stacks_are_series_of_their_own() {
        let body = render(&published(vec![followed(42, "/usr/bin/leaker", 17_264)], 2));
        let stack_lines: Vec<&str> =
            body.lines().filter(|line| line.starts_with("memleak_stack_outstanding_bytes{")).collect();
        assert_eq!(stack_lines.len(), 2, "K = 2:\n{body}");
        let fibonacci = stack_lines[0];
        assert!(
            fibonacci.starts_with("memleak_stack_outstanding_bytes{pid=\"42\",exe=\"leaker\",stack=\"")
                && fibonacci.ends_with("\",frame=\"fibonacci\"} 24576"),
            "{body}"
        );
        assert!(
            body.contains("# TYPE memleak_stack_outstanding_allocations gauge\n"),
            "allocations too:\n{body}"
        );
    }

    #[test]
    fn map_fill_is_shown_once_for_every_process() {
        let fill = MapFill { allocations: 15, max_allocations: 1000, stacks: 9, max_stacks: 64 };
        let body = render(&Published { map_fill: Some(fill), ..published(Vec::new(), 5) });
        for line in [
            "memleak_map_entries{map=\"allocations\"} 15",
            "memleak_map_entries{map=\"stacks\"} 9",
            "memleak_map_max_entries{map=\"allocations\"} 1000",
            "memleak_map_max_entries{map=\"stacks\"} 64",
        ] {
            assert!(body.lines().any(|seen| seen == line), "{line} in:\n{body}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let body = render(&published(vec![followed(7, "/tmp/a\"b\\c\nd", 1)], 0));
        // The backslash and the line feed as the text reports show them
        // (`\\` and `\n`), then escaped for the format.
        assert!(body.contains("exe=\"a\\\"b\\\\\\\\c\\\\nd\""), "{body}");
        let body = render(&published(vec![followed(7, "/tmp/x\u{1b}]0;t\u{7}\u{202e}gpj.exe", 1)], 0));
        assert!(body.contains("exe=\"x\\\\x1b]0;t\\\\x07\\\\u{202e}gpj.exe\""), "{body}");
    }

    #[test]
    fn a_long_label_value_is_cut_with_a_marker() {
        let body = render(&published(vec![followed(7, &format!("/tmp/{}", "n".repeat(1000)), 1)], 0));
        let cut = format!("exe=\"{}...[744 more characters]\"", "n".repeat(256));
        assert!(body.contains(&cut), "{body}");
    }

    #[test]
    fn a_container_labels_its_processes_and_a_reused_pid_has_one_set_of_series() {
        let mut in_container = followed(42, "/app/leaker", 1_000);
        in_container.workload = Some(Workload {
            namespace: Some("shop".to_owned()),
            pod: Some("web-7d4b9".to_owned()),
            container: Some("nginx".to_owned()),
            uid: Some("1f2e3d4c-5b6a-4789-8abc-def012345678".to_owned()),
            container_id: Some("containerd://272b5f306501".to_owned()),
            node: Some("node-a".to_owned()),
        });
        let mut gone = followed(42, "/app/leaker", 9_999);
        gone.exited = true;
        let body = render(&published(vec![gone, in_container], 0));
        let series: Vec<&str> =
            body.lines().filter(|line| line.starts_with("memleak_outstanding_bytes{")).collect();
        assert_eq!(
            series,
            ["memleak_outstanding_bytes{pid=\"42\",exe=\"leaker\",namespace=\"shop\",pod=\"web-7d4b9\",\
                 container=\"nginx\",uid=\"1f2e3d4c-5b6a-4789-8abc-def012345678\",\
                 container_id=\"containerd://272b5f306501\",node=\"node-a\"} 1000"]
        );
    }

    #[test]
    fn a_pid_asked_for_gets_its_own_series_and_none_of_memleak_s() {
        let mut published = published(vec![followed(7, "/bin/a", 1000), followed(8, "/bin/b", 2000)], 1);
        published.map_fill = Some(MapFill { allocations: 1, max_allocations: 2, stacks: 3, max_stacks: 4 });
        let body = render_for(&published, Some(8));
        let series: Vec<&str> = body.lines().filter(|line| !line.starts_with('#')).collect();
        assert!(series.iter().all(|line| line.contains("{pid=\"8\",exe=\"b\"")), "{body}");
        assert!(series.contains(&"memleak_outstanding_bytes{pid=\"8\",exe=\"b\"} 2000"), "{body}");
        assert!(!body.contains("memleak_map_entries") && !body.contains("memleak_processes_not_followed"));
        let whole = render_for(&published, None);
        assert!(whole.contains("pid=\"7\"") && whole.contains("memleak_map_entries{map=\"stacks\"} 3"));
    }
}
