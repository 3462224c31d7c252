//! What the collector publishes and the HTTP handlers read: the latest
//! report of every followed process, swapped in whole after each round.
//! Handlers hold an `Arc` of one round, never a lock the collector waits
//! on, so a slow client cannot hold up collection.

use std::{path::Path, sync::Arc, time::Duration};

use serde::Serialize;
use tokio::sync::{watch, Notify};

use crate::report::Report;

/// One round's view of every process followed, by pid.
#[derive(Clone, Debug, Default)]
pub struct Published {
    pub targets: Vec<Followed>,
    /// Processes a selector named that were left untraced because
    /// --max-processes was reached, each counted once.
    #[allow(dead_code, reason = "for /api/v1/targets and /metrics, whose renderers are being reworked")]
    pub processes_not_followed: u64,
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
    /// The full id of the container it runs in, when its cgroup is named
    /// as a container runtime names them.
    pub container: Option<String>,
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
            container: self.container.as_deref(),
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
    pub container: Option<&'a str>,
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

/// The collector's side: publishes rounds, and hears requests for one.
pub struct Board {
    sender: watch::Sender<Arc<Published>>,
    asks: Arc<Notify>,
}

/// The handlers' side: reads the latest round, or asks for a fresh one.
#[derive(Clone)]
pub struct BoardReader {
    receiver: watch::Receiver<Arc<Published>>,
    asks: Arc<Notify>,
}

/// How long a request waits for the round it asked for before it is
/// answered with the latest one.
const FRESH_WAIT: Duration = Duration::from_secs(1);

impl Board {
    pub fn new() -> (Self, BoardReader) {
        let (sender, receiver) = watch::channel(Arc::new(Published::default()));
        let asks = Arc::new(Notify::new());
        (Self { sender, asks: asks.clone() }, BoardReader { receiver, asks })
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
}
