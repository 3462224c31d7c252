//! What the collector publishes and the HTTP handlers read: the latest
//! report of every followed process, swapped in whole after each round.
//! Handlers hold an `Arc` of one round, never a lock the collector waits
//! on, so a slow client cannot hold up collection.

use std::{cell::Cell, path::Path, sync::Arc, time::Duration};

use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::{
    bpf::MapFill,
    model::Workload,
    report::{history::History, Report},
    session::ReportRequest,
    watch::WatchView,
};

/// One round's view of every process followed, by pid.
#[derive(Clone, Debug, Default)]
pub struct Published {
    pub targets: Vec<Followed>,
    /// How full the tracer's maps were in the round; `None` before the
    /// first.
    pub map_fill: Option<MapFill>,
    /// Stacks of each process /metrics shows (--metrics-top-stacks).
    pub metrics_top_stacks: usize,
    /// Processes a selector named that were left untraced because
    /// --max-processes was reached, each counted once.
    pub processes_not_followed: u64,
    /// Python code objects let go to keep memleak within its budgets
    /// (see `python::code::let_go_past_budget`).
    pub python_code_let_go: u64,
    /// With --watch: every process watched, and where it stands.
    pub watch: Option<Arc<WatchView>>,
    /// The OOM kills of processes followed or watched.
    pub oom: Arc<OomView>,
}

impl Published {
    /// The process `pid` names: the one running, else the last to exit
    /// with it. A pid the kernel gave again names the new process, never
    /// the retained report of the old.
    pub fn named_by(&self, pid: u32) -> Option<&Followed> {
        let with_pid = || self.targets.iter().filter(move |followed| followed.pid == pid);
        with_pid().find(|followed| !followed.exited).or_else(|| with_pid().next_back())
    }
}

/// What /metrics and /api/v1/oom show of the OOM kills (`oom`).
#[derive(Clone, Debug, Default)]
pub struct OomView {
    /// Newest first, as written to the state directory.
    pub kills: Vec<Arc<serde_json::Value>>,
    /// Kills seen since memleak started, by their labels.
    pub counted: Vec<(Vec<(String, String)>, u64)>,
}

/// A process followed, and its latest report if one was taken.
#[derive(Clone, Debug)]
pub struct Followed {
    pub pid: u32,
    /// Its executable, as the process names it.
    pub program: String,
    /// It exited; its last report stays.
    pub exited: bool,
    /// With --watch: its window of tracing ended and it was let go,
    /// running on; its last report stays.
    pub detached: bool,
    pub report: Option<Arc<Report>>,
    /// Its recent rounds as series (`/api/v1/history`), shared with the
    /// rounds published before: copied only when a round adds to it.
    pub history: Arc<History>,
    /// How its outstanding bytes moved over its reports.
    pub growth: Growth,
    /// The container and pod it runs in, when its cgroup is named as a
    /// container runtime or the kubelet names them.
    pub workload: Option<Workload>,
    /// What memleak's probes cost it so far, in seconds, as estimated
    /// (`bpf::overhead`); `None` where memleak could not price them.
    pub overhead_seconds: Option<f64>,
}

impl Followed {
    /// A process just taken in: no report yet.
    pub fn new(pid: u32, program: String, workload: Option<Workload>) -> Self {
        Self {
            pid,
            program,
            exited: false,
            detached: false,
            report: None,
            history: Arc::default(),
            growth: Growth::default(),
            workload,
            overhead_seconds: None,
        }
    }

    /// Keeps `report` as the latest, and tracks the growth it shows. The
    /// first report after none (memleak attached, or the process ran a
    /// new program) is the baseline growth is counted from.
    pub fn take_report(&mut self, report: Report) {
        let new_memory = report.total_new_bytes();
        self.growth = match self.report {
            None => Growth::from_first(new_memory),
            Some(_) => self.growth.after(new_memory),
        };
        Arc::make_mut(&mut self.history).record(&report);
        self.report = Some(Arc::new(report));
    }

    /// Whether it is traced now: neither exited nor let go by a watch.
    pub fn is_traced(&self) -> bool {
        !self.exited && !self.detached
    }

    /// The executable's file name: the `exe` label and the list's name.
    pub fn executable(&self) -> &str {
        Path::new(&self.program).file_name().and_then(|name| name.to_str()).unwrap_or(&self.program)
    }

    /// Every label of the process's identity, as (name, value): its pid,
    /// its program and, in a container, its container's and pod's. What the
    /// node-wide profile puts on each of its samples and /api/v1/sd on
    /// its target, so a label added here reaches both.
    pub fn labels(&self) -> Vec<(String, String)> {
        let mut labels =
            vec![("pid".to_owned(), self.pid.to_string()), ("program".to_owned(), self.program.clone())];
        let workload = self.workload.iter().flat_map(Workload::labels);
        labels.extend(workload.map(|(name, value)| (name.to_owned(), value.to_owned())));
        labels
    }

    pub fn summary(&self) -> TargetSummary<'_> {
        let report = self.report.as_deref();
        TargetSummary {
            pid: self.pid,
            executable: self.executable(),
            program: &self.program,
            exited: self.exited,
            detached: self.detached,
            workload: WorkloadLabels::of(self.workload.as_ref()),
            allocator: report.map(|report| report.allocator.as_str()),
            report_time_unix_ms: report.map(|report| report.time_unix_ms),
            outstanding_bytes: report.map_or(0, |report| report.total_bytes),
            outstanding_allocations: report.map_or(0, |report| report.total_allocations),
            growth_bytes: self.growth.bytes_since_first_report(),
            growing_reports: self.growth.growing_reports,
            allocations: report.map_or(0, |report| report.health.allocations),
            frees: report.map_or(0, |report| report.health.frees),
            allocations_not_tracked: report.map_or(0, |report| report.health.allocations_not_tracked),
            stacks_lost: report.map_or(0, |report| report.health.stacks_lost),
            resident_bytes: report
                .and_then(|report| report.memory.resident)
                .map(|resident| resident.resident_bytes),
            anon_bytes: report.and_then(|report| report.memory.resident).map(|resident| resident.anon_bytes),
            not_a_leak: report.and_then(|report| report.memory.not_a_leak.as_deref()),
            overhead_seconds: self.overhead_seconds,
        }
    }
}

/// How a process's outstanding bytes moved over its reports, as far as
/// memleak can see it. memleak counts only the blocks allocated since it
/// attached: a free of an older block is not seen, so the process's
/// memory may shrink where memleak sees none of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Growth {
    /// Outstanding bytes in the first report: the baseline.
    first_bytes: u64,
    /// Outstanding bytes in the latest report.
    latest_bytes: u64,
    /// Reports in a row, the latest included, whose outstanding bytes were
    /// above those of the report before; 0 once one was not.
    pub growing_reports: u32,
}

impl Growth {
    /// The growth of a process whose first report holds `bytes`.
    pub fn from_first(bytes: u64) -> Self {
        Self { first_bytes: bytes, latest_bytes: bytes, growing_reports: 0 }
    }

    /// The growth after a report that holds `bytes`.
    #[must_use]
    pub fn after(self, bytes: u64) -> Self {
        let growing_reports =
            if bytes > self.latest_bytes { self.growing_reports.saturating_add(1) } else { 0 };
        Self { latest_bytes: bytes, growing_reports, ..self }
    }

    /// Outstanding bytes now less those of the first report: negative when
    /// blocks memleak saw allocated before it have been freed since.
    pub fn bytes_since_first_report(&self) -> i128 {
        i128::from(self.latest_bytes) - i128::from(self.first_bytes)
    }
}

/// A followed process and its totals, as `/api/v1/targets` lists it.
/// Zeros until its first report (`report_time_unix_ms` is null then).
#[derive(Debug, Serialize)]
pub struct TargetSummary<'a> {
    pub pid: u32,
    pub executable: &'a str,
    pub program: &'a str,
    pub exited: bool,
    /// With --watch: traced for a window, then let go.
    pub detached: bool,
    #[serde(flatten)]
    pub workload: WorkloadLabels<'a>,
    pub allocator: Option<&'a str>,
    pub report_time_unix_ms: Option<u64>,
    pub outstanding_bytes: u64,
    pub outstanding_allocations: u64,
    /// `outstanding_bytes` less those of its first report (see `Growth`).
    pub growth_bytes: i128,
    /// Reports in a row in which it grew.
    pub growing_reports: u32,
    /// Seen since memleak attached, freed or not.
    pub allocations: u64,
    pub frees: u64,
    pub allocations_not_tracked: u64,
    pub stacks_lost: u64,
    /// The process's resident memory, and of it anonymous, as of its
    /// latest report.
    pub resident_bytes: Option<u64>,
    pub anon_bytes: Option<u64>,
    /// When its memory grew and the blocks memleak tracks do not explain
    /// it: why it is not a leak memleak sees.
    pub not_a_leak: Option<&'a str>,
    /// What memleak's probes cost it so far, in seconds, as estimated.
    pub overhead_seconds: Option<f64>,
}

/// A process's workload labels in `/api/v1/targets`: each key always
/// there, null when not known (outside a container, say), so that a
/// client reads every entry alike.
#[derive(Debug, Default, Serialize)]
pub struct WorkloadLabels<'a> {
    pub namespace: Option<&'a str>,
    pub pod: Option<&'a str>,
    pub container: Option<&'a str>,
    pub uid: Option<&'a str>,
    pub container_id: Option<&'a str>,
    pub node: Option<&'a str>,
}

impl<'a> WorkloadLabels<'a> {
    pub fn of(workload: Option<&'a Workload>) -> Self {
        let Some(workload) = workload else { return Self::default() };
        Self {
            namespace: workload.namespace.as_deref(),
            pod: workload.pod.as_deref(),
            container: workload.container.as_deref(),
            uid: workload.uid.as_deref(),
            container_id: workload.container_id.as_deref(),
            node: workload.node.as_deref(),
        }
    }
}

/// A report a request asks the collector for: one process's, or every
/// process's, built as the request wants it rather than as rounds are.
pub struct Query {
    /// The process, or `None` for every process traced.
    pub pid: Option<u32>,
    pub request: ReportRequest,
    /// The reports (none if `pid` is not traced any more), or why they
    /// could not be taken.
    pub reply: oneshot::Sender<Answer>,
}

/// What the collector answers a query with.
pub type Answer = Result<Vec<Report>, String>;

/// Why a query got no answer from the collector.
#[derive(Debug, PartialEq, Eq)]
pub enum Unanswered {
    /// As many queries wait already as the collector takes at once.
    Busy,
    /// The collector is gone: memleak is stopping.
    Stopping,
}

/// Queries waiting for the collector at most; more are answered busy,
/// so that requests cannot pile up work faster than it is done.
const QUERIES_WAITING: usize = 4;

/// The collector's side: publishes rounds, and hears requests for one.
pub struct Board {
    sender: watch::Sender<Arc<Published>>,
    asks: Arc<Notify>,
    /// What each round publishes besides the processes.
    metrics_top_stacks: usize,
    map_fill: Cell<Option<MapFill>>,
}

/// The handlers' side: reads the latest round, asks for a fresh one, or
/// queries a report of its own.
#[derive(Clone)]
pub struct BoardReader {
    receiver: watch::Receiver<Arc<Published>>,
    asks: Arc<Notify>,
    queries: mpsc::Sender<Query>,
}

/// How long a request waits for the round it asked for before it is
/// answered with the latest one: a scrape is answered within a second
/// (with a wide margin) however long a round takes.
const FRESH_WAIT: Duration = Duration::from_millis(250);

impl Board {
    /// A board whose rounds say that /metrics shows `metrics_top_stacks`
    /// stacks of each process; its readers' side, and the queries they
    /// will send.
    pub fn new(metrics_top_stacks: usize) -> (Self, BoardReader, mpsc::Receiver<Query>) {
        let (sender, receiver) =
            watch::channel(Arc::new(Published { metrics_top_stacks, ..Published::default() }));
        let asks = Arc::new(Notify::new());
        let (queries, queries_received) = mpsc::channel(QUERIES_WAITING);
        let board = Self { sender, asks: asks.clone(), metrics_top_stacks, map_fill: Cell::new(None) };
        (board, BoardReader { receiver, asks, queries }, queries_received)
    }

    /// Publishes a round, with the map fill last noted.
    pub fn publish(&self, published: Published) {
        let published = Published {
            map_fill: self.map_fill.get(),
            metrics_top_stacks: self.metrics_top_stacks,
            ..published
        };
        self.sender.send_replace(Arc::new(published));
    }

    /// Notes how full the maps are, for the rounds published from now on.
    pub fn note_map_fill(&self, map_fill: MapFill) {
        self.map_fill.set(Some(map_fill));
    }

    /// Stacks each report must keep, at least `kept` and at least as many
    /// as /metrics shows.
    pub fn stacks_kept(&self, kept: usize) -> usize {
        kept.max(self.metrics_top_stacks)
    }

    /// Resolves when a handler asked for a fresh round; asks made while
    /// a round was being taken count once.
    pub async fn asked(&self) {
        self.asks.notified().await;
    }
}

impl BoardReader {
    /// Asks for a round and returns it, or the latest one if it takes
    /// longer than `FRESH_WAIT`.
    pub async fn fresh(&self) -> Arc<Published> {
        let mut receiver = self.receiver.clone();
        receiver.mark_unchanged();
        self.asks.notify_one();
        // A collector gone or slow: what is known is served.
        let _ = tokio::time::timeout(FRESH_WAIT, receiver.changed()).await;
        let fresh = receiver.borrow().clone();
        fresh
    }

    /// The latest round, as it is.
    pub fn latest(&self) -> Arc<Published> {
        self.receiver.borrow().clone()
    }

    /// Asks the collector for process `pid`'s report (every process's
    /// with `None`), built as `request` says.
    pub async fn query(&self, pid: Option<u32>, request: ReportRequest) -> Result<Answer, Unanswered> {
        let (reply, answer) = oneshot::channel();
        self.queries.try_send(Query { pid, request, reply }).map_err(|error| match error {
            mpsc::error::TrySendError::Full(_) => Unanswered::Busy,
            mpsc::error::TrySendError::Closed(_) => Unanswered::Stopping,
        })?;
        answer.await.map_err(|_| Unanswered::Stopping)
    }

    /// As `query`, waiting for room among the queries waiting rather than
    /// answered busy: for the few requests admitted beforehand (windows).
    pub async fn query_in_turn(
        &self,
        pid: Option<u32>,
        request: ReportRequest,
    ) -> Result<Answer, Unanswered> {
        let (reply, answer) = oneshot::channel();
        self.queries.send(Query { pid, request, reply }).await.map_err(|_| Unanswered::Stopping)?;
        answer.await.map_err(|_| Unanswered::Stopping)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    fn report_of(bytes: u64) -> Report {
        Report { total_bytes: bytes, ..sample_report(1) }
    }

    #[test]
    fn every_target_has_every_workload_label_null_when_unknown() {
        let outside = serde_json::to_value(Followed::new(7, "/bin/x".to_owned(), None).summary()).unwrap();
        let workload = Workload {
            container: Some("web".to_owned()),
            container_id: Some("podman://ab".to_owned()),
            ..Workload::default()
        };
        let inside =
            serde_json::to_value(Followed::new(8, "/bin/x".to_owned(), Some(workload)).summary()).unwrap();
        for label in ["namespace", "pod", "container", "uid", "container_id", "node"] {
            assert_eq!(outside[label], serde_json::Value::Null, "{label}: {outside:#}");
            assert!(outside.as_object().unwrap().contains_key(label), "{label}: {outside:#}");
        }
        assert_eq!(
            (inside["container"].as_str(), inside["container_id"].as_str()),
            (Some("web"), Some("podman://ab"))
        );
        assert_eq!(inside["pod"], serde_json::Value::Null, "{inside:#}");
    }

    #[test]
    fn growth_counts_from_the_first_report_and_streaks_end_on_a_report_without_growth() {
        let mut followed = Followed::new(1, "p".to_owned(), None);
        let mut seen = Vec::new();
        for bytes in [1000, 1500, 1600, 1600, 1700, 900, 1200] {
            followed.take_report(report_of(bytes));
            seen.push((followed.growth.bytes_since_first_report(), followed.growth.growing_reports));
        }
        assert_eq!(seen, [(0, 0), (500, 1), (600, 2), (600, 0), (700, 1), (-100, 0), (200, 1)]);
    }

    #[test]
    fn a_process_that_ran_a_new_program_counts_from_its_first_report_again() {
        let mut followed = Followed::new(1, "p".to_owned(), None);
        followed.take_report(report_of(100));
        followed.take_report(report_of(5000));
        // What the collector does on exec.
        followed.report = None;
        followed.take_report(report_of(300));
        assert_eq!((followed.growth.bytes_since_first_report(), followed.growth.growing_reports), (0, 0));
    }
}
