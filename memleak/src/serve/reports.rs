//! `/api/v1/report` and `/debug/pprof/heap`: one process's report, in
//! any format the CLI writes, taken when asked for (or, with
//! `?seconds=N`, after N seconds, counting only what those seconds left
//! outstanding, as jeprof's `--base` would with two profiles).

use http_body_util::Full;
use hyper::{body::Bytes, header, Response, StatusCode};

use super::{
    http::{plain, with_type},
    query::{Params, ReportAsked},
    state::{BoardReader, Followed, Unanswered},
};
use crate::{
    clock,
    collect::CollectOptions,
    report::{
        self,
        options::{Format, Rendering, ReportOptions, SortKey, Weight},
        Report,
    },
    session::ReportRequest,
};

/// Where a client finds the pids it may ask for.
const TARGETS_URL: &str = "/api/v1/targets";

/// The parameters `/debug/pprof/heap` takes.
pub const PPROF_PARAMETERS: &[&str] = &["pid", "seconds"];

/// The whole profile as `go tool pprof` reads it.
const PPROF: ReportAsked = ReportAsked {
    format: Format::Pprof,
    weight: Weight::Bytes,
    sort: SortKey::Size,
    top: usize::MAX,
    older_ms: None,
};

/// Answers `/debug/pprof/heap` (`asked` is `None`) or `/api/v1/report`.
pub async fn answer(
    board: &BoardReader,
    params: &Params,
    asked: Option<ReportAsked>,
) -> Response<Full<Bytes>> {
    let asked = asked.unwrap_or(PPROF);
    match report(board, params, asked).await {
        Ok(report) => rendered(&report, asked),
        Err(refusal) => refusal.response(),
    }
}

/// Why no report is served: the status and its one line of reason.
struct Refusal {
    status: StatusCode,
    reason: String,
}

impl Refusal {
    fn new(status: StatusCode, reason: String) -> Self {
        Self { status, reason }
    }

    fn response(self) -> Response<Full<Bytes>> {
        let mut response = plain(self.status, format!("{}\n", self.reason));
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

/// The report asked for, or why not.
async fn report(board: &BoardReader, params: &Params, asked: ReportAsked) -> Result<Report, Refusal> {
    let bad = |reason: String| Refusal::new(StatusCode::BAD_REQUEST, reason);
    let pid = params.pid().map_err(bad)?;
    let window = params.window().map_err(bad)?;
    let published = board.latest();
    let Some(followed) = published.named_by(pid) else {
        let reason = format!("pid {pid} is not followed: {TARGETS_URL} lists those that are");
        return Err(Refusal::new(StatusCode::NOT_FOUND, reason));
    };
    if followed.exited {
        return last_report(followed, asked, window.is_some());
    }
    drop(published);
    let mut collect = CollectOptions {
        min_age_ns: asked.older_ms.map(|ms| ms.saturating_mul(1_000_000)),
        freed_stacks: asked.format.shows_freed_stacks(),
        modules: asked.format.needs_modules(),
        ..CollectOptions::NONE
    };
    if let Some(window) = window {
        collect.born_since_ns = Some(clock::monotonic_ns());
        // What was allocated before the window is not the window's.
        collect.freed_stacks = false;
        log::debug!("pid {pid}: a window of {} s begins", window.as_secs());
        tokio::time::sleep(window).await;
    }
    let top = if asked.format.wants_every_stack() { usize::MAX } else { asked.top };
    let request = ReportRequest { collect, sort: asked.sort, top, in_series: false };
    match board.query(pid, request).await {
        Ok(Ok(Some(mut report))) => {
            if window.is_some() {
                // alloc_space since memleak attached is no part of a window.
                report.stacks.iter_mut().for_each(|stack| stack.allocated = None);
            }
            Ok(report)
        }
        // It exited while the request waited: its last report, if kept.
        Ok(Ok(None)) => match board.latest().named_by(pid).filter(|followed| followed.exited) {
            Some(exited) => last_report(exited, asked, window.is_some()),
            None => Err(Refusal::new(StatusCode::NOT_FOUND, format!("pid {pid} is no longer traced"))),
        },
        Ok(Err(error)) => Err(Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot take pid {pid}'s report: {error}"),
        )),
        Err(Unanswered::Busy) => {
            Err(Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "busy taking other reports: retry".to_owned()))
        }
        Err(Unanswered::Stopping) => {
            Err(Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "memleak is stopping".to_owned()))
        }
    }
}

/// An exited process's last report, cut as asked: all there is of it.
fn last_report(followed: &Followed, asked: ReportAsked, windowed: bool) -> Result<Report, Refusal> {
    let pid = followed.pid;
    if windowed || asked.older_ms.is_some() {
        let reason = format!("pid {pid} has exited: only its last report is kept, without ?seconds or older");
        return Err(Refusal::new(StatusCode::BAD_REQUEST, reason));
    }
    let Some(last) = followed.report.as_deref() else {
        return Err(Refusal::new(StatusCode::NOT_FOUND, format!("pid {pid} exited before its first report")));
    };
    let mut last = last.clone();
    let options = ReportOptions { sort: asked.sort, top: asked.top, show_allocs: false };
    last.cut_for_display(&options, asked.format);
    Ok(last)
}

/// The report written as asked, with the content type its readers want.
fn rendered(report: &Report, asked: ReportAsked) -> Response<Full<Bytes>> {
    let mut body = Vec::new();
    let rendering = Rendering { format: asked.format, weight: asked.weight };
    if let Err(error) = report::render(rendering, report, &mut body) {
        return plain(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write the report: {error}\n"));
    }
    let content_type = match asked.format {
        Format::Text | Format::Folded => "text/plain; charset=utf-8",
        Format::Json => "application/json",
        Format::Svg => "image/svg+xml",
        Format::Pprof => "application/octet-stream",
    };
    let mut response = with_type(StatusCode::OK, content_type, body);
    if asked.format == Format::Pprof {
        // As Go's net/http/pprof names it: a browser saves it.
        let disposition = header::HeaderValue::from_static("attachment; filename=\"heap\"");
        response.headers_mut().insert(header::CONTENT_DISPOSITION, disposition);
    }
    response
}
