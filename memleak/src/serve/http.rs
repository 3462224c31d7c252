//! The HTTP side of `memleak serve`, on a thread and a runtime of its
//! own: the session is not `Send` and its collections block, so neither
//! shares a thread with the other. Handlers read the published rounds
//! (see `state`); nothing in a request reaches the session, the
//! filesystem or a command line.
//!
//! hyper's HTTP/1 server, without a framework: a handful of GET
//! endpoints need no router. Which connections are held, and for how
//! long, is `connections`' to say.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    io,
    net::SocketAddr,
    os::fd::AsRawFd as _,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    thread,
    time::Duration,
};

use http_body_util::Full;
use hyper::{
    body::{Body, Bytes, Frame, Incoming, SizeHint},
    header, Method, Request, Response, StatusCode,
};
use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown};
use tokio::sync::watch;

use crate::report::{history::History, pprof::View, Report};

use super::{
    connections::{self, Admitted, Busy, Connections, Deadlines},
    metrics, page,
    query::{Params, ReportAsked},
    reports::{self, Wanted, Windows},
    response::{plain, with_type},
    state::{BoardReader, Followed, Published, TargetSummary},
    token::Token,
};

/// The most a request's head may take, in bytes (hyper's smallest
/// buffer): every endpoint is a short GET.
const MAX_REQUEST_HEAD: usize = 8192;
/// Connections the kernel queues until memleak accepts them (capped by
/// `net.core.somaxconn`, 4096 by default).
const ACCEPT_BACKLOG: libc::c_int = 4096;
/// How long the requests in flight at shutdown get to be answered.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

const ENDPOINTS: &str =
    "/, /metrics, /debug/pprof/heap, /debug/pprof/allocs, /api/v1/targets, /api/v1/sd, /api/v1/report, /api/v1/history, /api/v1/watch, /api/v1/oom and /healthz";

/// The server thread; it ends once `stop` is sent `true`.
pub struct Server {
    thread: thread::JoinHandle<()>,
    stop: watch::Sender<bool>,
}

impl Server {
    /// Serves on `listener`, bound already, so that a port in use is an
    /// error before anything is attached.
    /// With a `token`, every request but `/healthz` must carry it.
    /// `advertised` is the HOST:PORT /api/v1/sd gives scrapers.
    pub fn start(
        listener: std::net::TcpListener,
        board: BoardReader,
        token: Option<Token>,
        advertised: String,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        // listen(2) again sets the backlog of a listening socket: std's 128
        // fills in a burst of connections, and a scraper's connection
        // arriving then is dropped by the kernel (retried after a second)
        // before memleak could make room for it.
        // SAFETY: listen on a socket descriptor the listener owns.
        if unsafe { libc::listen(listener.as_raw_fd(), ACCEPT_BACKLOG) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let (stop, stopped) = watch::channel(false);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handlers = Handlers {
            board,
            token: token.map(Arc::new),
            windows: Arc::new(Windows::default()),
            advertised: advertised.into(),
        };
        let thread = thread::Builder::new()
            .name("memleak-http".to_owned())
            .spawn(move || runtime.block_on(accept(listener, handlers, stopped)))?;
        Ok(Self { thread, stop })
    }

    /// Stops accepting, answers the requests in flight (for a while) and
    /// closes every connection.
    pub fn stop(self) {
        self.stop.send_replace(true);
        if self.thread.join().is_err() {
            log::warn!("the HTTP server's thread panicked");
        }
    }
}

/// What every request is answered from.
#[derive(Clone)]
struct Handlers {
    board: BoardReader,
    token: Option<Arc<Token>>,
    /// The `?seconds=N` windows being taken.
    windows: Arc<Windows>,
    /// Where /api/v1/sd's targets point: this daemon, as scrapers reach it.
    advertised: Arc<str>,
}

async fn accept(listener: std::net::TcpListener, handlers: Handlers, mut stopped: watch::Receiver<bool>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            log::error!("cannot serve: {error}");
            return;
        }
    };
    let limit = connections::limit_from_descriptors();
    log::debug!("serving up to {limit} connections at once");
    let connections = Connections::new(limit, Deadlines::SERVED);
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Some(admitted) = connections.admit(stream.as_raw_fd()) else {
                        log::debug!("closing the connection from {peer}: {limit} connections held, none idle");
                        continue;
                    };
                    let handle = admitted.handle();
                    let service = hyper::service::service_fn({
                        let handlers = handlers.clone();
                        move |request| {
                            let busy = handle.busy();
                            let handlers = handlers.clone();
                            async move {
                                let response = answer(request, handlers).await?;
                                Ok::<_, Infallible>(response.map(|body| Answered { body, _busy: busy }))
                            }
                        }
                    });
                    let connection = http1().serve_connection(TokioIo::new(stream), service);
                    tokio::spawn(serve_connection(graceful.watch(connection), admitted, peer));
                }
                Err(error) => {
                    // Out of descriptors: the connection that has waited
                    // longest for a request makes room for the next one.
                    let out_of_descriptors =
                        matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if out_of_descriptors && connections.evict_longest_waiting() {
                        log::debug!("out of descriptors: closed the connection that waited longest");
                        tokio::task::yield_now().await;
                    } else {
                        log::warn!("cannot accept a connection: {error}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            },
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        log::debug!("closing connections still open {SHUTDOWN_GRACE:?} after the stop");
    }
}

fn http1() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The head's deadline is `connections`', which covers the waits
    // between kept-alive requests too.
    builder.header_read_timeout(None).max_buf_size(MAX_REQUEST_HEAD);
    // A client may shut its side down once its request is sent (`nc -N`,
    // some health checkers): it still waits for the answer.
    builder.half_close(true);
    builder
}

/// Serves one connection until it ends, or memleak closes it.
async fn serve_connection(
    connection: impl std::future::Future<Output = hyper::Result<()>>,
    admitted: Admitted,
    peer: SocketAddr,
) {
    tokio::select! {
        served = connection => if let Err(error) = served {
            log::debug!("connection from {peer}: {error}");
        },
        closing = admitted.closing() => log::debug!("closing the connection from {peer}: {closing:?}"),
    }
}

/// A response's body, and its connection's busy mark, which goes once the
/// body is sent: from then on the connection waits for its next request.
struct Answered {
    body: Full<Bytes>,
    _busy: Busy,
}

impl Body for Answered {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The endpoints served.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Page,
    Healthz,
    Metrics,
    Targets,
    Watch,
    Oom,
    ServiceDiscovery,
    Report,
    History,
    /// Go's two paths of one profile, each showing its own sample type
    /// first; allocs is where Pyroscope's and Parca's scrapers look.
    Pprof(View),
}

impl Endpoint {
    fn at(path: &str) -> Option<Self> {
        Some(match path {
            "/" => Endpoint::Page,
            "/healthz" => Endpoint::Healthz,
            "/metrics" => Endpoint::Metrics,
            "/api/v1/targets" => Endpoint::Targets,
            "/api/v1/watch" => Endpoint::Watch,
            "/api/v1/oom" => Endpoint::Oom,
            "/api/v1/sd" => Endpoint::ServiceDiscovery,
            "/api/v1/report" => Endpoint::Report,
            "/api/v1/history" => Endpoint::History,
            // Go serves the same profile at both, alloc_space first at
            // allocs; allocs is where Pyroscope's and Parca's scrapers
            // look for memory.
            "/debug/pprof/heap" => Endpoint::Pprof(View::Heap),
            "/debug/pprof/allocs" => Endpoint::Pprof(View::Allocs),
            _ => return None,
        })
    }

    /// The query parameters it takes.
    fn parameters(self) -> &'static [&'static str] {
        match self {
            Endpoint::Report => ReportAsked::PARAMETERS,
            Endpoint::Pprof(_) => reports::PPROF_PARAMETERS,
            Endpoint::Metrics | Endpoint::History => &["pid"],
            Endpoint::Page
            | Endpoint::Healthz
            | Endpoint::Targets
            | Endpoint::Watch
            | Endpoint::Oom
            | Endpoint::ServiceDiscovery => &[],
        }
    }
}

async fn answer(request: Request<Incoming>, handlers: Handlers) -> Result<Response<Full<Bytes>>, Infallible> {
    if request.method() != Method::GET {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n".to_owned());
        response.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET"));
        return Ok(response);
    }
    let path = request.uri().path();
    let Some(endpoint) = Endpoint::at(path) else {
        return Ok(plain(StatusCode::NOT_FOUND, format!("no endpoint {path}: memleak serves {ENDPOINTS}\n")));
    };
    // A health check says nothing about the processes, and load balancers
    // ask it without credentials.
    if let Some(token) = handlers.token.as_deref().filter(|_| endpoint != Endpoint::Healthz) {
        let authorization = request.headers().get(header::AUTHORIZATION).map(header::HeaderValue::as_bytes);
        if !token.admits(authorization) {
            let mut response = plain(
                StatusCode::UNAUTHORIZED,
                "this memleak wants Authorization: Bearer <token>\n".to_owned(),
            );
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            return Ok(response);
        }
    }
    let params = match Params::parse(request.uri().query(), endpoint.parameters()) {
        Ok(params) => params,
        Err(reason) => return Ok(plain(StatusCode::BAD_REQUEST, format!("{path}: {reason}\n"))),
    };
    let board = &handlers.board;
    Ok(match endpoint {
        Endpoint::Healthz => plain(StatusCode::OK, "ok\n".to_owned()),
        Endpoint::Page => {
            with_type(StatusCode::OK, "text/html; charset=utf-8", page::render(&*board.fresh().await))
        }
        Endpoint::Metrics => metrics_answer(board, &params).await,
        Endpoint::Targets => targets(&*board.fresh().await),
        Endpoint::Oom => json(&OomList { kills: &board.latest().oom.kills }),
        Endpoint::Watch => watch(&board.latest()),
        Endpoint::ServiceDiscovery => service_discovery(&board.latest(), &handlers.advertised),
        Endpoint::History => history(&board.latest(), &params),
        Endpoint::Pprof(_) | Endpoint::Report => match wanted(endpoint, &params) {
            Ok(wanted) => reports::answer(board, &handlers.windows, &params, wanted).await,
            Err(reason) => plain(StatusCode::BAD_REQUEST, format!("{path}: {reason}\n")),
        },
    })
}

/// `/metrics`, of every process or (`?pid=`) of one.
async fn metrics_answer(board: &BoardReader, params: &Params) -> Response<Full<Bytes>> {
    match params.pid_if_given() {
        Err(reason) => plain(StatusCode::BAD_REQUEST, format!("/metrics: {reason}\n")),
        Ok(only) => {
            // A process's targets (one per process, from /api/v1/sd)
            // read the latest round, at most --interval old: each
            // asking for a round of every process would have the
            // collector take one as often as it may.
            let published = if only.is_some() { board.latest() } else { board.fresh().await };
            match only.filter(|&pid| published.named_by(pid).is_none()) {
                Some(pid) => plain(
                    StatusCode::NOT_FOUND,
                    format!("pid {pid} is not followed: /api/v1/targets lists those that are\n"),
                ),
                None => {
                    with_type(StatusCode::OK, metrics::CONTENT_TYPE, metrics::render_for(&published, only))
                }
            }
        }
    }
}

/// What a request to a report's or a profile's endpoint wants.
fn wanted(endpoint: Endpoint, params: &Params) -> Result<Wanted, String> {
    match endpoint {
        Endpoint::Pprof(view) => Ok(Wanted::Profile(view)),
        _ => ReportAsked::of(params).map(Wanted::Report),
    }
}

/// `/api/v1/targets`'s body.
#[derive(serde::Serialize)]
struct TargetList<'a> {
    targets: Vec<TargetSummary<'a>>,
    /// Processes a selector named that --max-processes left untraced.
    processes_not_followed: u64,
}

fn targets(published: &Published) -> Response<Full<Bytes>> {
    let list = TargetList {
        targets: published.targets.iter().map(Followed::summary).collect(),
        processes_not_followed: published.processes_not_followed,
    };
    json(&list)
}

/// `/api/v1/history`'s body.
#[derive(serde::Serialize)]
struct PastOf<'a> {
    pid: u32,
    /// Its latest round's report; none before its first round.
    report: Option<&'a Report>,
    history: &'a History,
}

/// `/api/v1/history?pid=PID`: the process's latest round and the series
/// of its recent ones, what `memleak top --connect` draws.
fn history(published: &Published, params: &Params) -> Response<Full<Bytes>> {
    let pid = match params.pid_if_given() {
        Ok(Some(pid)) => pid,
        Ok(None) => {
            return plain(
                StatusCode::BAD_REQUEST,
                "/api/v1/history: which process? add ?pid=PID; /api/v1/targets lists those followed\n"
                    .to_owned(),
            )
        }
        Err(reason) => return plain(StatusCode::BAD_REQUEST, format!("/api/v1/history: {reason}\n")),
    };
    match published.named_by(pid) {
        Some(followed) => {
            json(&PastOf { pid, report: followed.report.as_deref(), history: &followed.history })
        }
        None => plain(
            StatusCode::NOT_FOUND,
            format!("pid {pid} is not followed: /api/v1/targets lists those that are\n"),
        ),
    }
}

/// `/api/v1/watch`: every process watched, and where it stands.
fn watch(published: &Published) -> Response<Full<Bytes>> {
    match &published.watch {
        Some(watch) => json(watch.as_ref()),
        None => plain(
            StatusCode::NOT_FOUND,
            "/api/v1/watch: this memleak does not watch: start it with --watch\n".to_owned(),
        ),
    }
}

/// `/api/v1/oom`'s body: each kill as the state directory keeps it.
#[derive(serde::Serialize)]
struct OomList<'a> {
    /// Newest first.
    kills: &'a [std::sync::Arc<serde_json::Value>],
}

/// `value` as a JSON body, on a line of its own.
fn json(value: &impl serde::Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_string(value) {
        Ok(mut body) => {
            body.push('\n');
            with_type(StatusCode::OK, "application/json", body)
        }
        Err(error) => plain(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write the answer: {error}\n")),
    }
}

/// One target of a Prometheus HTTP service discovery list.
#[derive(serde::Serialize)]
struct DiscoveredTarget<'a> {
    targets: [&'a str; 1],
    labels: BTreeMap<String, String>,
}

/// `/api/v1/sd`: Prometheus' HTTP service discovery list, a target per
/// process running: this daemon's address, with `__param_pid` (which a
/// scraper sends as `?pid=`, so /metrics and the profiles answer for that
/// process alone) and the process's labels. Processes that exited are
/// not listed, nor those a watch let go: nothing of them is left to
/// scrape but their last report.
fn service_discovery(published: &Published, advertised: &str) -> Response<Full<Bytes>> {
    let list: Vec<DiscoveredTarget> = published
        .targets
        .iter()
        .filter(|followed| followed.is_traced())
        .map(|followed| {
            let mut labels: BTreeMap<String, String> = followed.labels().into_iter().collect();
            labels.insert("__param_pid".to_owned(), followed.pid.to_string());
            DiscoveredTarget { targets: [advertised], labels }
        })
        .collect();
    json(&list)
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;
    use crate::model::Workload;

    fn body_of(response: Response<Full<Bytes>>) -> serde_json::Value {
        let body = block_on(response.into_body().collect()).expect("a body").to_bytes();
        serde_json::from_slice(&body).expect("JSON")
    }

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("a runtime").block_on(future)
    }

    /// Prometheus' HTTP SD format: a list of {targets, labels}, every
    /// process running once, with the pid a scraper sends back.
    #[test]
    fn the_sd_list_has_a_target_per_running_process_with_its_labels() {
        let mut exited = Followed::new(9, "/bin/gone".to_owned(), None);
        exited.exited = true;
        let published = Published {
            targets: vec![
                Followed::new(7, "/bin/a".to_owned(), None),
                Followed::new(
                    8,
                    "/bin/b".to_owned(),
                    Some(Workload {
                        namespace: Some("shop".to_owned()),
                        pod: Some("web-1".to_owned()),
                        container: Some("app".to_owned()),
                        container_id: Some("containerd://c0ffee".to_owned()),
                        ..Workload::default()
                    }),
                ),
                exited,
            ],
            ..Published::default()
        };
        let response = service_discovery(&published, "10.0.0.7:9943");
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body_of(response),
            serde_json::json!([
                {"targets": ["10.0.0.7:9943"], "labels": {"__param_pid": "7", "pid": "7", "program": "/bin/a"}},
                {"targets": ["10.0.0.7:9943"],
                 "labels": {"__param_pid": "8", "pid": "8", "program": "/bin/b", "namespace": "shop", "pod": "web-1",
                            "container": "app", "container_id": "containerd://c0ffee"}},
            ])
        );
    }
}
