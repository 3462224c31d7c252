//! What the collector publishes and the HTTP handlers read: the latest
//! report of every followed process, swapped in whole after each round.
//! Handlers hold an `Arc` of one round, never a lock the collector waits
//! on, so a slow client cannot hold up collection.

use std::{path::Path, sync::Arc, time::Duration};

use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::{report::Report, session::ReportRequest};

/// One round's view of every process followed, by pid.
#[derive(Clone, Debug, Default)]
pub struct Published {
    pub targets: Vec<Followed>,
}

/// A process followed, and its latest report if one was taken.
#[derive(Clone, Debug)]
pub struct Followed {
    pub pid: u32,
    /// Its executable, as the process names it.
    pub program: String,
    /// It exited; its last report stays.
    pub exited: bool,
    pub report: Option<Arc<Report>>,
}

impl Followed {
    /// The executable's file name: the `exe` label and the list's name.
    pub fn executable(&self) -> &str {
        Path::new(&self.program).file_name().and_then(|name| name.to_str()).unwrap_or(&self.program)
    }

    pub fn summary(&self) -> TargetSummary<'_> {
        let report = self.report.as_deref();
        TargetSummary {
            pid: self.pid,
            executable: self.executable(),
            program: &self.program,
            exited: self.exited,
            allocator: report.map(|report| report.allocator.as_str()),
            report_time_unix_ms: report.map(|report| report.time_unix_ms),
            outstanding_bytes: report.map_or(0, |report| report.total_bytes),
            outstanding_allocations: report.map_or(0, |report| report.total_allocations),
            allocations: report.map_or(0, |report| report.health.allocations),
            frees: report.map_or(0, |report| report.health.frees),
            allocations_not_tracked: report.map_or(0, |report| report.health.allocations_not_tracked),
            stacks_lost: report.map_or(0, |report| report.health.stacks_lost),
        }
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
    pub allocator: Option<&'a str>,
    pub report_time_unix_ms: Option<u64>,
    pub outstanding_bytes: u64,
    pub outstanding_allocations: u64,
    /// Seen since memleak attached, freed or not.
    pub allocations: u64,
    pub frees: u64,
    pub allocations_not_tracked: u64,
    pub stacks_lost: u64,
}

/// A report a request asks the collector for: one process's, built as
/// the request wants it rather than as rounds are.
pub struct Query {
    pub pid: u32,
    pub request: ReportRequest,
    /// The report, `None` if `pid` is not traced (any more), or why it
    /// could not be taken.
    pub reply: oneshot::Sender<Result<Option<Report>, String>>,
}

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
/// answered with the latest one.
const FRESH_WAIT: Duration = Duration::from_secs(1);

impl Board {
    /// The board, its readers' side, and the queries they will send.
    pub fn new() -> (Self, BoardReader, mpsc::Receiver<Query>) {
        let (sender, receiver) = watch::channel(Arc::new(Published::default()));
        let asks = Arc::new(Notify::new());
        let (queries, queries_received) = mpsc::channel(QUERIES_WAITING);
        (Self { sender, asks: asks.clone() }, BoardReader { receiver, asks, queries }, queries_received)
    }

    pub fn publish(&self, published: Published) {
        self.sender.send_replace(Arc::new(published));
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

    /// Asks the collector for process `pid`'s report, built as `request`
    /// says.
    pub async fn query(
        &self,
        pid: u32,
        request: ReportRequest,
    ) -> Result<Result<Option<Report>, String>, Unanswered> {
        let (reply, answer) = oneshot::channel();
        self.queries.try_send(Query { pid, request, reply }).map_err(|error| match error {
            mpsc::error::TrySendError::Full(_) => Unanswered::Busy,
            mpsc::error::TrySendError::Closed(_) => Unanswered::Stopping,
        })?;
        answer.await.map_err(|_| Unanswered::Stopping)
    }
}
