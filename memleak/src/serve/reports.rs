//! `/api/v1/report`, `/debug/pprof/heap` and `/debug/pprof/allocs`: one
//! process's report, in any format the CLI writes, or (the profiles
//! without `?pid=`) every process's in one profile; taken when asked for
//! (or, with `?seconds=N`, after N seconds, counting only what those
//! seconds left outstanding, as jeprof's `--base` would with two
//! profiles).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use http_body_util::Full;
use hyper::{body::Bytes, header, Response, StatusCode};

use super::{
    query::{Params, ReportAsked},
    response::{plain, with_type},
    state::{BoardReader, Followed, Unanswered},
};
use crate::{
    clock,
    collect::CollectOptions,
    report::{
        self,
        options::{Format, Rendering, ReportOptions, SortKey, Weight},
        pprof::{self, Labelled, View},
        Report,
    },
    session::ReportRequest,
};

/// Where a client finds the pids it may ask for.
const TARGETS_URL: &str = "/api/v1/targets";

/// The parameters `/debug/pprof/heap` and `/debug/pprof/allocs` take;
/// without `pid`, the profile is of every process.
pub const PPROF_PARAMETERS: &[&str] = &["pid", "seconds"];

/// The whole profile as `go tool pprof` reads it.
const PPROF: ReportAsked = ReportAsked {
    format: Format::Pprof,
    weight: Weight::Bytes,
    sort: SortKey::Size,
    top: usize::MAX,
    older_ms: None,
};

/// `?seconds=N` windows taken at once at most. Each holds a connection
/// for its N seconds, and its report is one query of the collector's: a
/// window more is refused at once, not after its N seconds.
pub const WINDOWS_AT_ONCE: usize = 4;

/// The windows being taken: when each ends.
#[derive(Default)]
pub struct Windows {
    /// Each window's id and end.
    ends: Mutex<Vec<(u64, Instant)>>,
    next_id: AtomicU64,
}

impl Windows {
    /// Takes a window of `length` from now if fewer than
    /// `WINDOWS_AT_ONCE` are being taken; else a 503 that says when the
    /// first of those ends (its report follows), in whole seconds.
    fn open(self: &Arc<Self>, length: Duration) -> Result<Window, Refusal> {
        let mut ends = self.ends.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if ends.len() >= WINDOWS_AT_ONCE {
            let first_end = ends.iter().map(|&(_, end)| end).min().unwrap_or(now);
            // Rounded up, and a second for its report.
            let wait = first_end.saturating_duration_since(now);
            let retry_after = wait.as_secs() + u64::from(wait.subsec_nanos() > 0) + 1;
            return Err(Refusal {
                status: StatusCode::SERVICE_UNAVAILABLE,
                reason: format!(
                    "{WINDOWS_AT_ONCE} windows are being taken: retry in {retry_after} s, as one ends"
                ),
                retry_after,
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        ends.push((id, now + length));
        Ok(Window { id, windows: self.clone() })
    }
}

/// A window being taken, until its report is answered or the request
/// given up.
struct Window {
    id: u64,
    windows: Arc<Windows>,
}

impl Drop for Window {
    fn drop(&mut self) {
        let mut ends = self.windows.ends.lock().unwrap_or_else(PoisonError::into_inner);
        ends.retain(|&(id, _)| id != self.id);
    }
}

/// What a request wants.
#[derive(Clone, Copy, Debug)]
pub enum Wanted {
    /// `/debug/pprof/heap` or `/debug/pprof/allocs`.
    Profile(View),
    /// `/api/v1/report`.
    Report(ReportAsked),
}

/// Answers `/debug/pprof/heap`, `/debug/pprof/allocs` or `/api/v1/report`.
pub async fn answer(
    board: &BoardReader,
    windows: &Arc<Windows>,
    params: &Params,
    wanted: Wanted,
) -> Response<Full<Bytes>> {
    let (asked, view) = match wanted {
        Wanted::Profile(view) if matches!(params.pid_if_given(), Ok(None)) => {
            return match node_wide(board, windows, params, view).await {
                Ok(body) => pprof_response(body),
                Err(refusal) => refusal.response(),
            };
        }
        Wanted::Profile(view) => (PPROF, view),
        Wanted::Report(asked) => (asked, View::Heap),
    };
    match report(board, windows, params, asked).await {
        Ok(report) => rendered(&report, asked, view),
        Err(refusal) => refusal.response(),
    }
}

/// The profile of every process followed, as pprof: each sample labelled
/// with its process's labels (`Followed::labels`), so that a scraper of
/// the node (Pyroscope's, Parca's) gets a series per process from one
/// scrape. Processes that exited or were let go are left out: nothing of
/// them is traced now, and their last reports stay served by pid.
async fn node_wide(
    board: &BoardReader,
    windows: &Arc<Windows>,
    params: &Params,
    view: View,
) -> Result<Vec<u8>, Refusal> {
    let window = params.window().map_err(|reason| Refusal::new(StatusCode::BAD_REQUEST, reason))?;
    let collect = CollectOptions {
        freed_stacks: PPROF.format.shows_freed_stacks(),
        modules: PPROF.format.needs_modules(),
        ..CollectOptions::NONE
    };
    let request = ReportRequest { collect, sort: PPROF.sort, top: usize::MAX, in_series: false };
    let reports = taken(board, windows, None, window, request).await?;
    let published = board.latest();
    let labelled: Vec<Labelled> = reports
        .iter()
        .map(|report| {
            let followed = published.named_by(report.pid).filter(|followed| followed.is_traced());
            // Taken in since the last round was published: what the
            // report itself says of it.
            let labels = followed.map_or_else(
                || Followed::new(report.pid, report.program.clone(), None).labels(),
                Followed::labels,
            );
            Labelled { report, labels }
        })
        .collect();
    let mut body = Vec::new();
    pprof::render_labelled(&labelled, view, &mut body).map_err(|error| {
        Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write the profile: {error}"))
    })?;
    Ok(body)
}

/// The reports of process `pid` (of every process with `None`) taken by
/// the collector as `request` says; with a window, once it has passed,
/// of what was allocated in it only.
async fn taken(
    board: &BoardReader,
    windows: &Arc<Windows>,
    pid: Option<u32>,
    window: Option<Duration>,
    mut request: ReportRequest,
) -> Result<Vec<Report>, Refusal> {
    // Held until the window's report is answered.
    let mut taken = None;
    if let Some(window) = window {
        taken = Some(windows.open(window)?);
        request.collect.born_since_ns = Some(clock::monotonic_ns());
        // What was allocated before the window is not the window's.
        request.collect.freed_stacks = false;
        log::debug!("{}: a window of {} s begins", whose(pid), window.as_secs());
        tokio::time::sleep(window).await;
    }
    // A window's report waits for its turn with the collector: the window
    // was admitted, and only `WINDOWS_AT_ONCE` can wait so.
    let answered = if taken.is_some() {
        board.query_in_turn(pid, request).await
    } else {
        board.query(pid, request).await
    };
    drop(taken);
    match answered {
        Ok(Ok(mut reports)) => {
            if window.is_some() {
                // alloc_space since memleak attached is no part of a window.
                let stacks = reports.iter_mut().flat_map(|report| report.stacks.iter_mut());
                stacks.for_each(|stack| stack.allocated = None);
            }
            Ok(reports)
        }
        Ok(Err(error)) => Err(Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot take {}'s report: {error}", whose(pid)),
        )),
        Err(Unanswered::Busy) => {
            Err(Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "busy taking other reports: retry".to_owned()))
        }
        Err(Unanswered::Stopping) => {
            Err(Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "memleak is stopping".to_owned()))
        }
    }
}

fn whose(pid: Option<u32>) -> String {
    pid.map_or_else(|| "every process".to_owned(), |pid| format!("pid {pid}"))
}

/// Why no report is served: the status and its one line of reason.
struct Refusal {
    status: StatusCode,
    reason: String,
    /// For a 503: in how many seconds to ask again.
    retry_after: u64,
}

impl Refusal {
    fn new(status: StatusCode, reason: String) -> Self {
        Self { status, reason, retry_after: 1 }
    }

    fn response(self) -> Response<Full<Bytes>> {
        let mut response = plain(self.status, format!("{}\n", self.reason));
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from(self.retry_after));
        }
        response
    }
}

/// The report asked for, or why not.
async fn report(
    board: &BoardReader,
    windows: &Arc<Windows>,
    params: &Params,
    asked: ReportAsked,
) -> Result<Report, Refusal> {
    let bad = |reason: String| Refusal::new(StatusCode::BAD_REQUEST, reason);
    let pid = params.pid().map_err(bad)?;
    let window = params.window().map_err(bad)?;
    let published = board.latest();
    let Some(followed) = published.named_by(pid) else {
        let reason = format!("pid {pid} is not followed: {TARGETS_URL} lists those that are");
        return Err(Refusal::new(StatusCode::NOT_FOUND, reason));
    };
    if !followed.is_traced() {
        return last_report(followed, asked, window.is_some());
    }
    let workload = followed.workload.clone();
    drop(published);
    let collect = CollectOptions {
        min_age_ns: asked.older_ms.map(|ms| ms.saturating_mul(1_000_000)),
        freed_stacks: asked.format.shows_freed_stacks(),
        modules: asked.format.needs_modules(),
        ..CollectOptions::NONE
    };
    let top = if asked.format.wants_every_stack() { usize::MAX } else { asked.top };
    let request = ReportRequest { collect, sort: asked.sort, top, in_series: false };
    let reports = taken(board, windows, Some(pid), window, request).await?;
    match reports.into_iter().next() {
        Some(mut report) => {
            report.workload = workload;
            Ok(report)
        }
        // It exited while the request waited: its last report, if kept.
        None => match board.latest().named_by(pid).filter(|followed| !followed.is_traced()) {
            Some(exited) => last_report(exited, asked, window.is_some()),
            None => Err(Refusal::new(StatusCode::NOT_FOUND, format!("pid {pid} is no longer traced"))),
        },
    }
}

/// The last report of a process no longer traced (exited, or let go at
/// the end of its window), cut as asked: all there is of it.
fn last_report(followed: &Followed, asked: ReportAsked, windowed: bool) -> Result<Report, Refusal> {
    let pid = followed.pid;
    let (gone, before) = if followed.exited {
        ("has exited", "exited")
    } else {
        ("was let go at the end of its window", "was let go")
    };
    if windowed || asked.older_ms.is_some() {
        let reason = format!("pid {pid} {gone}: only its last report is kept, without ?seconds or older");
        return Err(Refusal::new(StatusCode::BAD_REQUEST, reason));
    }
    let Some(last) = followed.report.as_deref() else {
        return Err(Refusal::new(
            StatusCode::NOT_FOUND,
            format!("pid {pid} {before} before its first report"),
        ));
    };
    let mut last = last.clone();
    last.workload.clone_from(&followed.workload);
    let options = ReportOptions { sort: asked.sort, top: asked.top, show_allocs: false };
    last.cut_for_display(&options, asked.format);
    Ok(last)
}

/// The report written as asked, with the content type its readers want;
/// a pprof profile shows `view`'s sample type first.
fn rendered(report: &Report, asked: ReportAsked, view: View) -> Response<Full<Bytes>> {
    let mut body = Vec::new();
    let rendering = Rendering { format: asked.format, weight: asked.weight, full_stacks: false };
    let written = match asked.format {
        Format::Pprof => pprof::render_as(report, view, &mut body),
        _ => report::render(rendering, report, &mut body),
    };
    if let Err(error) = written {
        return plain(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write the report: {error}\n"));
    }
    let content_type = match asked.format {
        Format::Text | Format::Folded => "text/plain; charset=utf-8",
        Format::Json => "application/json",
        Format::Svg => "image/svg+xml",
        Format::Pprof => "application/octet-stream",
    };
    if asked.format == Format::Pprof {
        return pprof_response(body);
    }
    with_type(StatusCode::OK, content_type, body)
}

/// A gzipped profile, as Go's net/http/pprof serves one: gzip is the
/// format's own (pprof, Pyroscope and Parca read it so), not a
/// Content-Encoding a client would undo.
fn pprof_response(body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = with_type(StatusCode::OK, "application/octet-stream", body);
    // As Go's net/http/pprof names it: a browser saves it.
    let disposition = header::HeaderValue::from_static("attachment; filename=\"heap\"");
    response.headers_mut().insert(header::CONTENT_DISPOSITION, disposition);
    response
}
