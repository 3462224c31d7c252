//! --stats: what memleak did, as JSON lines for programs to read (the
//! benchmark, say) instead of log lines meant for people. One object per
//! line, each with an `event` naming what it records:
//!
//! - `started`: how long loading the BPF programs and starting took, and
//!   the path each part of the tracer takes on this kernel (`kernel`);
//! - `probes`: where the probes for a process went;
//! - `report`: a report's size, and how long it took from reading the maps
//!   to the report;
//! - `unwind_tables`: what a process's unwind table took to build, and
//!   what the tables of every process hold;
//! - `stack_walks`: with each round of reports, the user stacks walked
//!   with unwind tables so far, and how much of them was taken unchanged
//!   from the thread's last walk.
//!
//! Fields are only ever added.

use std::{
    fs::File,
    io::{self, BufWriter, Write as _},
    path::{Path, PathBuf},
    time::Duration,
};

use memleak_common::{WalkCount, WalkCounts};
use serde::Serialize;

use crate::{
    attach::AttachPlan,
    bpf::{kernel_features, mapping_calls_in_kernel::SeenBy},
    report::Report,
    unwind::tables::{TableBuilt, UnwindStats},
};

#[derive(Debug, thiserror::Error)]
#[error("cannot write the --stats file {path}: {source}")]
pub struct StatsError {
    path: PathBuf,
    source: io::Error,
}

/// The --stats file, or nothing.
pub struct Stats {
    sink: Option<(PathBuf, BufWriter<File>)>,
}

#[derive(Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Record<'a> {
    Probes {
        pid: u32,
        object: &'a str,
        path: &'a Path,
        probes: Vec<Probe<'a>>,
        /// Forms of C++'s `operator new` and `delete` the program's calls
        /// land in, left unprobed because their probes would add nothing.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        not_probed: Vec<NotProbedForm<'a>>,
    },
    Report {
        pid: u32,
        stacks: usize,
        allocations: u64,
        bytes: u64,
        latency_ms: f64,
        written_ms: f64,
    },
    Started {
        load_ms: f64,
        /// Until the first uprobe was attached; absent in kernel mode.
        #[serde(skip_serializing_if = "Option::is_none")]
        attached_ms: Option<f64>,
        start_ms: f64,
        /// The path each part of the tracer takes on this kernel.
        kernel: &'a kernel_features::Paths,
    },
    StackWalks {
        walks: u64,
        reusing_walks: u64,
        frames: u64,
        frames_reused: u64,
        /// Stacks not walked: a walk preempted on the same CPU held its
        /// memory (see the kernels page).
        skipped_busy: u64,
    },
    UnwindTables {
        pid: u32,
        objects: usize,
        new_objects: usize,
        new_rows: u64,
        build_ms: f64,
        rows_in_use: u64,
        row_bytes: u64,
        objects_without_rows: usize,
        objects_not_fitting: usize,
    },
}

#[derive(Serialize)]
struct Probe<'a> {
    function: &'a str,
    /// Where the function starts in the object's file.
    file_offset: u64,
    /// Where its entry probe is, past the start.
    entry_offset: u64,
    /// Whether its return is probed too.
    #[serde(rename = "return_probe")]
    on_return: bool,
    /// The object it is in, when that is not the record's `object` (a
    /// program's own `operator new`, say); its `path` likewise.
    #[serde(skip_serializing_if = "Option::is_none")]
    in_object: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    in_path: Option<PathBuf>,
    /// Where the kernel sees the function's calls instead of its uprobes,
    /// which were left out (munmap and mprotect): the kernel function
    /// whose fentry program sees them, or the tracepoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_hook: Option<&'static str>,
}

#[derive(Serialize)]
struct NotProbedForm<'a> {
    function: &'a str,
    object: &'a str,
    why: &'a str,
}

/// A plan's `path` is memleak's own descriptor of the file: the kernel's
/// name for it says which file that is.
fn kernel_path(plan: &AttachPlan) -> PathBuf {
    std::fs::read_link(&plan.path).unwrap_or_else(|_| plan.path.clone())
}

/// The probes of `plan`, each naming its object when it is `elsewhere`
/// than the record's.
/// `plan`'s probes; `seen_by`: how the kernel sees the mapping functions
/// whose uprobes it stands in for (see `Tracer::mapping_calls_seen_by`).
fn probes_of(plan: &AttachPlan, elsewhere: bool, seen_by: Option<SeenBy>) -> Vec<Probe<'_>> {
    let in_path = elsewhere.then(|| kernel_path(plan));
    plan.sites
        .iter()
        .map(|site| Probe {
            function: site.function,
            file_offset: site.file_offset,
            entry_offset: site.entry_skip,
            on_return: site.return_program.is_some(),
            in_object: elsewhere.then_some(plan.display_path.as_str()),
            in_path: in_path.clone(),
            kernel_hook: seen_by.and_then(|seen_by| seen_by.hook(site.entry_program)),
        })
        .collect()
}

impl Stats {
    pub fn open(path: Option<&Path>) -> Result<Self, StatsError> {
        let Some(path) = path else { return Ok(Self { sink: None }) };
        let file = File::create(path).map_err(|source| StatsError { path: path.to_path_buf(), source })?;
        Ok(Self { sink: Some((path.to_path_buf(), BufWriter::new(file))) })
    }

    /// Where the probes for process `pid` went; `seen_by` as
    /// `Tracer::mapping_calls_seen_by` says.
    pub fn probes(&mut self, pid: u32, plan: &AttachPlan, seen_by: Option<SeenBy>) -> Result<(), StatsError> {
        let mut probes = probes_of(plan, false, seen_by);
        // C++'s operators and CPython's allocator, probed in objects of
        // their own.
        for other in plan.operator_objects.iter().chain(plan.interpreter_object.as_deref()) {
            probes.extend(probes_of(other, true, seen_by));
        }
        let not_probed = plan
            .not_probed
            .iter()
            .map(|form| NotProbedForm { function: form.function, object: &form.object, why: &form.why })
            .collect();
        let path = kernel_path(plan);
        self.write(&Record::Probes { pid, object: &plan.display_path, path: &path, probes, not_probed })
    }

    /// A report, `latency` after the maps were read for it.
    /// One report: `latency` from reading the maps to the report built,
    /// `written` saving and writing it.
    pub fn report(
        &mut self,
        report: &Report,
        latency: Duration,
        written: Duration,
    ) -> Result<(), StatsError> {
        self.write(&Record::Report {
            pid: report.pid,
            stacks: report.total_stacks,
            allocations: report.total_allocations,
            bytes: report.total_bytes,
            latency_ms: latency.as_secs_f64() * 1000.0,
            written_ms: written.as_secs_f64() * 1000.0,
        })
    }

    /// The table walks so far (`memleak_common::WalkCount`).
    pub fn stack_walks(&mut self, counts: &WalkCounts) -> Result<(), StatsError> {
        self.write(&Record::StackWalks {
            walks: counts[WalkCount::Walks as usize],
            reusing_walks: counts[WalkCount::ReusingWalks as usize],
            frames: counts[WalkCount::Frames as usize],
            frames_reused: counts[WalkCount::FramesReused as usize],
            skipped_busy: counts[WalkCount::CpuBusy as usize],
        })
    }

    /// How long memleak took to start tracing: `load` of it loading its
    /// BPF programs (the kernel's verifier, mostly), `start` in all, the
    /// first tables and probes included.
    pub fn started(
        &mut self,
        load: Duration,
        attached: Option<Duration>,
        start: Duration,
        kernel: &kernel_features::Paths,
    ) -> Result<(), StatsError> {
        self.write(&Record::Started {
            load_ms: load.as_secs_f64() * 1000.0,
            attached_ms: attached.map(|attached| attached.as_secs_f64() * 1000.0),
            start_ms: start.as_secs_f64() * 1000.0,
            kernel,
        })
    }

    /// What process `pid`'s unwind table took, and what the tables of
    /// every process hold now.
    pub fn unwind_tables(
        &mut self,
        pid: u32,
        built: &TableBuilt,
        all: &UnwindStats,
    ) -> Result<(), StatsError> {
        self.write(&Record::UnwindTables {
            pid,
            objects: built.objects,
            new_objects: built.new_objects,
            new_rows: built.new_rows,
            build_ms: built.elapsed.as_secs_f64() * 1000.0,
            rows_in_use: all.rows,
            row_bytes: all.rows * size_of::<memleak_common::UnwindRow>() as u64,
            objects_without_rows: all.objects_without_rows,
            objects_not_fitting: all.objects_not_fitting,
        })
    }

    fn write(&mut self, record: &Record) -> Result<(), StatsError> {
        let Some((path, out)) = self.sink.as_mut() else { return Ok(()) };
        let error = |source| StatsError { path: path.clone(), source };
        serde_json::to_writer(&mut *out, record).map_err(|e| error(e.into()))?;
        // Flushed at once: a reader follows the file as the run goes on.
        out.write_all(b"\n").and_then(|()| out.flush()).map_err(error)
    }
}
