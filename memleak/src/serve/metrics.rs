//! `/metrics`: Prometheus' text exposition format (version 0.0.4), one
//! series per followed process and metric, labelled with its pid and its
//! executable's file name. Cardinality: metrics x processes followed.

use std::fmt::Write as _;

use super::state::{Followed, Published};

/// The exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

enum Kind {
    Gauge,
    Counter,
}

/// A metric of each followed process: its name, kind, help and value.
struct Metric {
    name: &'static str,
    kind: Kind,
    help: &'static str,
    value: fn(&Followed) -> u64,
}

const METRICS: &[Metric] = &[
    Metric {
        name: "memleak_outstanding_bytes",
        kind: Kind::Gauge,
        help: "Bytes allocated and not freed, as of the latest report.",
        value: |followed| followed.report.as_ref().map_or(0, |report| report.total_bytes),
    },
    Metric {
        name: "memleak_outstanding_allocations",
        kind: Kind::Gauge,
        help: "Allocations not freed, as of the latest report.",
        value: |followed| followed.report.as_ref().map_or(0, |report| report.total_allocations),
    },
    Metric {
        name: "memleak_allocations_total",
        kind: Kind::Counter,
        help: "Allocation calls that returned a block since memleak attached.",
        value: |followed| followed.report.as_ref().map_or(0, |report| report.health.allocations),
    },
    Metric {
        name: "memleak_frees_total",
        kind: Kind::Counter,
        help: "Releases seen since memleak attached: frees, and blocks realloc gave up.",
        value: |followed| followed.report.as_ref().map_or(0, |report| report.health.frees),
    },
    Metric {
        name: "memleak_allocations_not_tracked_total",
        kind: Kind::Counter,
        help: "Allocations not tracked because the allocation map was full.",
        value: |followed| followed.report.as_ref().map_or(0, |report| report.health.allocations_not_tracked),
    },
    Metric {
        name: "memleak_stacks_lost_total",
        kind: Kind::Counter,
        help: "Allocations whose stack could not be stored because the stack map was full.",
        value: |followed| followed.report.as_ref().map_or(0, |report| report.health.stacks_lost),
    },
];

/// The whole `/metrics` body. A process without a report yet has no
/// series: zeros would read as a measurement.
pub fn render(published: &Published) -> String {
    let mut out = String::new();
    for metric in METRICS {
        let kind = match metric.kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        };
        // Writing to a String cannot fail.
        let _ = writeln!(out, "# HELP {} {}", metric.name, metric.help);
        let _ = writeln!(out, "# TYPE {} {kind}", metric.name);
        for followed in published.targets.iter().filter(|followed| followed.report.is_some()) {
            let _ = writeln!(
                out,
                "{}{{pid=\"{}\",exe=\"{}\"}} {}",
                metric.name,
                followed.pid,
                escape_label(followed.executable()),
                (metric.value)(followed)
            );
        }
    }
    out
}

/// A label value as the format wants it: backslash, double quote and
/// line feed escaped. An executable may be named anything.
fn escape_label(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
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
    use std::sync::Arc;

    use super::*;
    use crate::{model::HealthCounters, report::Report};

    fn followed(pid: u32, program: &str, bytes: u64) -> Followed {
        let report = Report {
            pid,
            program: program.to_owned(),
            namespace_pid: None,
            time_unix_ms: 0,
            allocator: "/usr/lib/libc.so.6".to_owned(),
            min_age_ms: 0,
            sample_rate: 1,
            unwinding: None,
            total_bytes: bytes,
            total_allocations: 3,
            total_stacks: 1,
            stacks: Vec::new(),
            health: HealthCounters { allocations: 5, frees: 2, ..HealthCounters::default() },
            truncated_stacks: std::collections::BTreeMap::new(),
            hidden_mappings: crate::model::HiddenMappings::default(),
            modules: Vec::new(),
        };
        Followed {
            pid,
            program: program.to_owned(),
            exited: false,
            report: Some(Arc::new(report)),
            container: None,
        }
    }

    #[test]
    fn each_process_has_a_series_of_each_metric_under_its_help_and_type() {
        let published = Published {
            targets: vec![
                followed(42, "/usr/bin/leaker", 17_264),
                Followed { pid: 43, program: "new".to_owned(), exited: false, report: None, container: None },
            ],
            processes_not_followed: 0,
        };
        let body = render(&published);
        let lines: Vec<&str> = body.lines().collect();
        assert_eq!(lines.len(), METRICS.len() * 3, "HELP, TYPE and one series each:\n{body}");
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
        assert!(!body.contains("pid=\"43\""), "no series before a first report:\n{body}");
    }

    #[test]
    fn label_values_are_escaped() {
        let published =
            Published { targets: vec![followed(7, "/tmp/a\"b\\c\nd", 1)], processes_not_followed: 0 };
        let body = render(&published);
        assert!(body.contains("exe=\"a\\\"b\\\\c\\nd\""), "{body}");
    }
}
