//! memleak's --stats records (memleak/src/stats.rs): one JSON object a
//! line, saying how long memleak took to start, what its unwind tables
//! hold, where it put its probes and how long each report took. The bench reads these rather than memleak's log, whose wording is
//! for people and may change; memleak only ever adds fields, which are
//! ignored here, as are events the bench has no use for.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use serde::Deserialize;

/// One line of the --stats file.
#[derive(Debug, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Record {
    Started(Started),
    UnwindTables(UnwindTables),
    Probes(Probes),
    Report(Report),
    /// An event added after this was written.
    #[serde(other)]
    Other,
}

impl Record {
    pub fn parse(line: &str) -> Result<Self> {
        serde_json::from_str(line)
            .with_context(|| format!("memleak's --stats line is not a record: {line:?}"))
    }
}

/// How long memleak took to start tracing.
#[derive(Debug, Deserialize)]
#[expect(clippy::struct_field_names, reason = "each is a time in ms, as memleak writes it")]
pub struct Started {
    /// Loading the BPF programs: the kernel's verifier, mostly.
    pub load_ms: f64,
    /// Until the first uprobe was attached (memleak of December 2026 on).
    #[serde(default)]
    pub attached_ms: Option<f64>,
    /// Everything until tracing began, the first unwind tables and probes
    /// included.
    pub start_ms: f64,
}

/// What one traced process's unwind table took to build, and what the
/// tables of every traced process hold.
#[derive(Debug, Deserialize)]
pub struct UnwindTables {
    pub pid: u32,
    /// The process's objects with code.
    pub objects: u64,
    /// Building this process's table.
    pub build_ms: f64,
    /// Rows held in kernel memory for every process, and their bytes.
    pub rows_in_use: u64,
    pub row_bytes: u64,
    /// Objects with no `.eh_frame` rows to walk them by.
    pub objects_without_rows: u64,
    /// Objects left out because the table was full.
    pub objects_not_fitting: u64,
}

/// Where the probes for one traced process went.
#[derive(Debug, Deserialize)]
pub struct Probes {
    /// The allocator object as the target names it; unlike memleak's own
    /// path to it (under /proc/PID), it outlives the process.
    pub object: PathBuf,
    pub probes: Vec<Probe>,
}

impl Probes {
    /// The probe on `function`, which memleak always probes.
    pub fn on(&self, function: &str) -> Result<&Probe> {
        self.probes.iter().find(|probe| probe.function == function).with_context(|| {
            format!("memleak's --stats has no probe on {function} in {}", self.object.display())
        })
    }
}

#[derive(Debug, Deserialize)]
pub struct Probe {
    pub function: String,
    /// Where the function starts in the object's file: a return probe's
    /// place.
    pub file_offset: u64,
    /// How far past the start the entry probe is.
    pub entry_offset: u64,
    /// Whether the function's return is probed too.
    #[serde(rename = "return_probe")]
    pub on_return: bool,
}

impl Probe {
    /// The entry probe's file offset.
    pub fn entry(&self) -> u64 {
        self.file_offset + self.entry_offset
    }
}

/// One report, written as soon as it was built.
#[derive(Debug, Deserialize)]
pub struct Report {
    /// Stacks and allocations the report covered.
    pub stacks: u64,
    pub allocations: u64,
    /// From reading memleak's maps to the report being built.
    pub latency_ms: f64,
    /// Saving and writing the report (0 from a memleak too old to say).
    #[serde(default)]
    pub written_ms: f64,
}

impl Report {
    pub fn latency(&self) -> Result<Duration> {
        Duration::try_from_secs_f64(self.latency_ms / 1000.0)
            .with_context(|| format!("memleak's report latency is not a duration: {} ms", self.latency_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_memleak_writes() {
        let probes = r#"{"event":"probes","pid":7,"object":"/lib/libc.so.6","path":"/proc/7/map_files/1-2","probes":[{"function":"free","file_offset":100,"entry_offset":3,"return_probe":false}]}"#;
        let Record::Probes(probes) = Record::parse(probes).expect("a probes record") else {
            panic!("expected a probes record")
        };
        assert_eq!(probes.object, PathBuf::from("/lib/libc.so.6"));
        let free = probes.on("free").expect("a probe on free");
        assert_eq!((free.entry(), free.on_return), (103, false));
        assert!(probes.on("malloc").is_err(), "found a probe on malloc in {probes:?}");

        let report =
            r#"{"event":"report","pid":7,"stacks":10,"allocations":100,"bytes":1600,"latency_ms":12.5}"#;
        let Record::Report(report) = Record::parse(report).expect("a report record") else {
            panic!("expected a report record")
        };
        assert_eq!((report.stacks, report.allocations), (10, 100));
        assert_eq!(report.latency().expect("a latency"), Duration::from_micros(12_500));
    }

    #[test]
    fn reads_start_and_unwind_tables() {
        let Record::Started(started) =
            Record::parse(r#"{"event":"started","load_ms":812.5,"start_ms":1020.0}"#).expect("a record")
        else {
            panic!("expected a started record")
        };
        let near = |value: f64, wanted: f64| (value - wanted).abs() < 1e-9;
        assert!(near(started.load_ms, 812.5) && near(started.start_ms, 1020.0), "read {started:?}");
        let tables = r#"{"event":"unwind_tables","pid":7,"objects":14,"new_objects":14,"new_rows":190000,"build_ms":120.5,"rows_in_use":190000,"row_bytes":1520000,"objects_without_rows":1,"objects_not_fitting":0}"#;
        let Record::UnwindTables(tables) = Record::parse(tables).expect("a record") else {
            panic!("expected an unwind_tables record")
        };
        assert_eq!(
            (tables.pid, tables.objects, tables.rows_in_use, tables.row_bytes),
            (7, 14, 190_000, 1_520_000)
        );
        assert_eq!((tables.objects_without_rows, tables.objects_not_fitting), (1, 0));
        assert!(near(tables.build_ms, 120.5), "build_ms {}", tables.build_ms);
    }

    #[test]
    fn skips_events_it_does_not_know() {
        let record = Record::parse(r#"{"event":"detached","pid":7}"#).expect("a record");
        assert!(matches!(record, Record::Other), "read {record:?}");
    }
}
