//! `memleak serve`: a daemon that follows processes and serves their
//! latest reports over HTTP, for Prometheus, `go tool pprof`, curl and
//! a browser.
//!
//! Two threads. This one drives the `Session` (which is not `Send`): a
//! round of reports every interval, or sooner when a request asks for
//! one, each round published whole to the `state::Board`. The HTTP
//! server (`http`) runs on a thread of its own and reads only what was
//! published, so a slow client never holds up collection, nor a long
//! collection a scrape of the last round.

mod connections;
mod containers;
mod http;
mod metrics;
mod oom;
mod page;
mod query;
mod reports;
mod response;
mod state;
pub mod token;
mod top_stacks;

use std::{
    collections::{BTreeMap, HashMap},
    net::TcpListener,
    time::{Duration, Instant},
};

use tokio::signal::unix::{signal, SignalKind};

use crate::{
    bpf::{
        overhead::{self, Pricing},
        Traced, Tracer, TracerError,
    },
    collect::CollectOptions,
    config::ServeConfig,
    process::{
        container::{self, ContainerError},
        feedback,
        identity::ProcessKey,
        kubernetes::Resolver,
        lifecycle,
    },
    report::options::SortKey,
    session::{
        ReportRequest, Selector, Session, SessionConfig, SessionError, SessionEvent, Target, TargetSpec,
        PYTHON_PENDING_RETRY,
    },
    status,
    watch::{Scope, Watcher},
};
use containers::FollowedContainers;
use oom::{Evidence, HistoryPoint, OomStore};
use state::{Board, Followed, Growth, Published, Query};
use token::Token;

/// How often the targets' mappings are re-read, as the report loop does.
const REFRESH: Duration = Duration::from_millis(250);

/// A request finds a round taken this recently fresh enough, and gets
/// it rather than a new one.
const FRESH_ENOUGH: Duration = Duration::from_millis(500);

/// Stacks kept in each round's reports, or more if /metrics shows more
/// (--metrics-top-stacks); totals are over every stack whatever is kept.
/// A request for a whole report queries one of its own.
const STACKS_KEPT: usize = 10;

/// A process's final report, taken as it exits: whole, and with what
/// pprof needs, as it is all that will be served of it.
const LAST_REPORT: ReportRequest = ReportRequest {
    collect: CollectOptions { freed_stacks: true, modules: true, ..CollectOptions::NONE },
    sort: SortKey::Size,
    top: usize::MAX,
    in_series: true,
};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Tracer(#[from] TracerError),
    #[error(transparent)]
    Container(#[from] ContainerError),
    #[error("cannot listen on {address}: {}", status::os_reason(source))]
    Listen { address: std::net::SocketAddr, source: std::io::Error },
    #[error("cannot start the HTTP server: {0}")]
    Server(std::io::Error),
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
    #[error("{0}")]
    Token(String),
    #[error("{0}")]
    Advertise(String),
    #[error("{0}")]
    Watch(String),
    #[error("{0}")]
    StateDir(String),
}

/// Where OOM kills are kept without --state-dir.
const DEFAULT_STATE_DIR: &str = "/var/lib/memleak";

/// How long an OOM killer's victim waits for its exit to be seen, or for
/// a look of the watch: a victim memleak does not follow is forgotten
/// then.
const VICTIM_KEPT: Duration = Duration::from_secs(30);

/// Follows the processes and serves their reports until SIGINT or
/// SIGTERM; then every probe is detached. SIGHUP is said, and changes
/// nothing.
pub async fn run(config: &ServeConfig) -> Result<(), ServeError> {
    // Before anything is attached: a signal from now on ends the run
    // cleanly instead of killing memleak with its probes half-placed.
    let mut interrupt = signal(SignalKind::interrupt()).map_err(ServeError::Signals)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(ServeError::Signals)?;
    // A daemon outlives the terminal it was started from: SIGHUP, whose
    // default action would end it without a word, is only said.
    let mut hangup = signal(SignalKind::hangup()).map_err(ServeError::Signals)?;
    raise_descriptor_limit();
    let token = config.token_file.as_deref().map(Token::read).transpose().map_err(ServeError::Token)?;
    let (mut containers, found) = FollowedContainers::start(&config.containers)?;
    let mut selectors: Vec<Selector> = config.selectors.iter().cloned().chain(found).collect();
    // A watch traces nothing until a process grows: the selectors name
    // what it watches, and the session is given the processes to trace.
    let watcher = match config.watch {
        Some(settings) => {
            let scope = Scope::new(&std::mem::take(&mut selectors)).map_err(ServeError::Watch)?;
            Some(Watcher::new(settings, scope))
        }
        None => None,
    };
    Tracer::check_kernel()?;
    Tracer::check_privileges(Traced::Processes)?;
    let listener = TcpListener::bind(config.listen)
        .map_err(|source| ServeError::Listen { address: config.listen, source })?;
    // With --port 0 the kernel chose the port: the address said is the
    // one bound, so that a client can be pointed at it.
    let serving = listener.local_addr().map_err(ServeError::Server)?;
    let advertised = advertised(config.advertise.as_deref(), serving)?;
    let session_config =
        SessionConfig { excluded: feedback::excluded(false, None), ..config.session.clone() };
    let mut session = Session::start(&TargetSpec::Selected(selectors), &session_config)?;
    // Said with -v, as the one-shot runs say it.
    let _ = session.kernel_paths();
    let pricing = price(&mut session);
    let (board, reader, queries) = Board::new(config.metrics_top_stacks);
    let oom_store = match &config.state_dir {
        Some(dir) => OomStore::open(dir, true),
        None => OomStore::open(std::path::Path::new(DEFAULT_STATE_DIR), false),
    }
    .map_err(ServeError::StateDir)?;
    let mut collector =
        Collector::new(config.retain, queries, Resolver::new(config.host_root.clone()), watcher);
    collector.oom = Some(oom_store);
    collector.pricing = pricing;
    collector.sync(&session);
    // The processes are listed, and can be asked for, before their first
    // report.
    collector.publish(&board);
    let server = http::Server::start(listener, reader, token, advertised).map_err(ServeError::Server)?;
    status::say(&format!("serving http://{serving}/; Ctrl-C to stop"));
    let stop = async {
        loop {
            tokio::select! {
                _ = interrupt.recv() => break,
                _ = terminate.recv() => break,
                _ = hangup.recv() => status::say("SIGHUP: nothing to reload, serving on (SIGTERM or Ctrl-C stops)"),
            }
        }
    };
    let ended = tokio::select! {
        ended = collector.follow(&mut session, &mut containers, &board, config.interval) => ended,
        () = stop => Ok(()),
    };
    // Detaches every probe, then closes the connections.
    drop(session);
    server.stop();
    ended
}

/// Prices a probe's trap on this machine, said with -v; a machine where
/// that fails is said once, and no cost is estimated.
fn price(session: &mut Session) -> Option<Pricing> {
    match session.price_traps() {
        Ok(trap) => {
            log::debug!(
                "a probe's trap costs a call {:.0} ns at its entry, {:.0} ns at its return",
                trap.entry_ns,
                trap.return_ns
            );
            Some(Pricing { trap, bpf_ns_per_run: None })
        }
        Err(error) => {
            status::say(&format!("the probes' cost will not be estimated: {error}"));
            None
        }
    }
}

/// Raises the soft limit on open descriptors to the hard one: each
/// followed process takes descriptors (its probes' links, its symbol
/// files), and at the usual soft limit of 1,024 a daemon following about
/// 80 processes ran out, its listener first. The daemon runs no command
/// of the user's that the higher limit could surprise (a `select` loop).
fn raise_descriptor_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct passed,
    // alive for each call.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) != 0 || limit.rlim_cur >= limit.rlim_max {
            return;
        }
        let soft = limit.rlim_cur;
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit) == 0 {
            log::debug!("open descriptors: soft limit raised from {soft} to {}", limit.rlim_max);
        }
    }
}

/// The HOST:PORT /api/v1/sd points scrapers to: --advertise, else the
/// pod's address (`POD_IP`, set from the downward API in a Kubernetes
/// manifest) with the port listened on, else the address listened on.
fn advertised(advertise: Option<&str>, serving: std::net::SocketAddr) -> Result<String, ServeError> {
    if let Some(advertise) = advertise {
        return Ok(advertise.to_owned());
    }
    let pod_ip = std::env::var("POD_IP").ok().filter(|ip| !ip.is_empty());
    let address = match pod_ip {
        Some(ip) => {
            let ip: std::net::IpAddr = ip.parse().map_err(|_| {
                ServeError::Advertise(format!(
                    "POD_IP `{ip}` is not an IP address: set it to the pod's, or give --advertise HOST:PORT"
                ))
            })?;
            std::net::SocketAddr::new(ip, serving.port())
        }
        None => serving,
    };
    if address.ip().is_unspecified() {
        status::say(&format!(
            "/api/v1/sd names {address}, which only this host reaches: give --advertise HOST:PORT for others"
        ));
    }
    Ok(address.to_string())
}

/// A process followed, and when it stopped being traced if it did: it
/// exited, or a watch let it go.
struct Entry {
    followed: Followed,
    let_go_at: Option<Instant>,
}

impl Entry {
    /// Its process called execve and runs `program` now, traced afresh.
    fn now_runs(&mut self, program: &str) {
        program.clone_into(&mut self.followed.program);
        self.followed.report = None;
        self.followed.growth = Growth::default();
    }
}

/// The latest report of each process followed, published after each
/// round; and the last collection error, said once. Processes are keyed
/// by pid and start time: a pid reused by a new process is a new entry,
/// never the old one's.
struct Collector {
    followed: BTreeMap<ProcessKey, Entry>,
    /// The session's processes by pid, as they are now.
    live: HashMap<u32, ProcessKey>,
    /// How long an exited process keeps its last report.
    retain: Duration,
    processes_not_followed: u64,
    /// Reports the HTTP handlers ask for.
    queries: tokio::sync::mpsc::Receiver<Query>,
    last_error: Option<String>,
    /// When the last round of every target was taken.
    last_round: Option<Instant>,
    /// Names each newcomer's container and pod.
    resolver: Resolver,
    /// With --watch: what is watched, and which processes to trace.
    watcher: Option<Watcher>,
    /// Where OOM kills are kept.
    oom: Option<OomStore>,
    /// The OOM killer's victims whose ends are yet to be seen, with when
    /// they were picked.
    victims: HashMap<u32, Instant>,
    /// What a probe hit costs, if it could be priced.
    pricing: Option<Pricing>,
    /// The kernel's count of BPF run time, on while a process is traced:
    /// it adds two clock reads to every run of every BPF program on the
    /// machine, which a watch tracing nothing must not cost. `Err`: it
    /// could not be turned on, as said once.
    run_time_count: Result<Option<std::os::fd::OwnedFd>, ()>,
    /// With --watch: each traced process's estimated cost as of its
    /// latest report (ms since 1970, seconds), and the rate it paid
    /// between its two latest reports (CPUs).
    costs_seen: HashMap<u32, (u64, f64, f64)>,
}

impl Collector {
    fn new(
        retain: Duration,
        queries: tokio::sync::mpsc::Receiver<Query>,
        resolver: Resolver,
        watcher: Option<Watcher>,
    ) -> Self {
        Self {
            followed: BTreeMap::new(),
            live: HashMap::new(),
            retain,
            processes_not_followed: 0,
            queries,
            last_error: None,
            last_round: None,
            resolver,
            watcher,
            oom: None,
            victims: HashMap::new(),
            pricing: None,
            run_time_count: Ok(None),
            costs_seen: HashMap::new(),
        }
    }

    /// Takes in the processes the session traces that are not followed
    /// yet, each said once.
    fn sync(&mut self, session: &Session) {
        self.processes_not_followed = session.processes_not_followed();
        for target in session.targets() {
            let key = target.key();
            self.live.insert(target.pid, key);
            if let Some(entry) = self.followed.get_mut(&key) {
                if entry.followed.detached {
                    // Found growing again: a new window, counted afresh.
                    entry.followed.detached = false;
                    entry.let_go_at = None;
                    entry.followed.report = None;
                    entry.followed.growth = Growth::default();
                    continue;
                }
                // Taken in after its execve, once its loader mapped its
                // libraries (see `restart`).
                if entry.followed.program != target.program {
                    status::say(&format!("pid {} now runs {}: tracing it", target.pid, target.program));
                    entry.now_runs(&target.program);
                }
                continue;
            }
            status::say(&describe_newcomer(target));
            let workload = self.resolver.workload_of(target.pid);
            let followed = Followed::new(target.pid, target.program.clone(), workload);
            self.followed.insert(key, Entry { followed, let_go_at: None });
        }
    }

    /// A round every `interval` or when asked, until an error the session
    /// cannot go on from.
    async fn follow(
        &mut self,
        session: &mut Session,
        containers: &mut FollowedContainers,
        board: &Board,
        interval: Duration,
    ) -> Result<(), ServeError> {
        let mut rounds = tokio::time::interval(interval);
        rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut refresh = tokio::time::interval(REFRESH);
        let mut container_look = tokio::time::interval(containers::LOOK);
        container_look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut watch_look =
            tokio::time::interval(self.watcher.as_ref().map_or(REFRESH, |w| w.settings().every));
        watch_look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut python_retry = tokio::time::interval(PYTHON_PENDING_RETRY);
        python_retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Whether a target may have an interpreter not initialised yet:
        // set whenever targets may have come or changed.
        let mut python_pending = true;
        loop {
            tokio::select! {
                _ = python_retry.tick(), if python_pending => {
                    python_pending = session.detect_pending_python()?;
                    continue;
                }
                _ = rounds.tick() => self.round(session, board, None),
                _ = container_look.tick(), if containers.any() => match self.watcher.as_mut() {
                    Some(watcher) => containers.look(watcher.scope_mut()),
                    None => containers.look(session),
                },
                _ = watch_look.tick(), if self.watcher.is_some() => {
                    python_pending = true;
                    self.watch(session, board)?;
                }
                () = board.asked() => {
                    // A client asking again and again must not keep the
                    // collector busy: a round this recent is fresh enough.
                    if self.last_round.is_some_and(|at| at.elapsed() < FRESH_ENOUGH) {
                        self.publish(board);
                    } else {
                        self.round(session, board, None);
                        rounds.reset();
                    }
                }
                _ = refresh.tick() => {
                    python_pending = true;
                    let added = session.refresh()?;
                    let forgotten = self.forget_expired();
                    if added > 0 || forgotten {
                        self.sync(session);
                        self.publish(board);
                    }
                }
                event = session.next_event() => {
                    python_pending = true;
                    self.take_event(session, board, event?)?;
                }
                Some(query) = self.queries.recv() => answer(session, query),
            }
            // A process left out (by --max-processes) is found by a
            // refresh or an event that adds nobody: the count is published
            // as it changes, not with the next newcomer.
            self.count_run_time_while_traced(session);
            if session.processes_not_followed() != self.processes_not_followed {
                self.processes_not_followed = session.processes_not_followed();
                self.publish(board);
            }
        }
    }

    /// A target's exit or exec: its final report, then it is let go, or
    /// its new program is traced. A newcomer is taken in.
    fn take_event(
        &mut self,
        session: &mut Session,
        board: &Board,
        event: SessionEvent,
    ) -> Result<(), ServeError> {
        match event {
            SessionEvent::Exiting { pid, ack } => {
                self.round_with(session, board, Some(pid), &LAST_REPORT);
                self.take_oom_victims(session);
                match self.victims.remove(&pid) {
                    // Said with its culprit.
                    Some(_) => self.keep_oom_evidence(pid),
                    None => {
                        status::say(&format!(
                            "pid {pid} exited; its last report stays for {:?}",
                            self.retain
                        ));
                    }
                }
                drop(ack);
                session.remove_exited_target(pid)?;
                self.mark_exited(pid);
                self.publish(board);
            }
            SessionEvent::Exec { pid } => {
                self.round(session, board, Some(pid));
                self.restart(session, pid)?;
                self.publish(board);
            }
            SessionEvent::Followed { .. } | SessionEvent::Joined { .. } => {
                self.sync(session);
                self.publish(board);
            }
            SessionEvent::Trace(_) => {}
        }
        Ok(())
    }

    /// Process `pid` called execve, its old program's report taken: its
    /// new program is traced if it is still followed (named by pid, or
    /// still selected), else it is let go as if it had exited.
    fn restart(&mut self, session: &mut Session, pid: u32) -> Result<(), ServeError> {
        let restarted = session.restart_target(pid)?.is_some() || session.adopt(pid);
        let Some(key) = self.live.get(&pid).copied() else { return Ok(()) };
        let target = session.targets().iter().find(|target| target.pid == pid);
        if let (true, Some(target)) = (restarted, target) {
            status::say(&format!("pid {pid} now runs {}: tracing it", target.program));
            if let Some(entry) = self.followed.get_mut(&key) {
                entry.now_runs(&target.program);
            }
        } else if session.is_loading(pid) {
            // Its allocator is not mapped yet: it is taken in once its
            // loader has mapped it, and said then (`sync`).
            log::debug!(
                "pid {pid} now runs {}: traced once its libraries are loaded",
                lifecycle::program(pid)
            );
        } else {
            status::say(&format!(
                "pid {pid} now runs {}, which is not followed; its last report stays",
                lifecycle::program(pid)
            ));
            self.mark_exited(pid);
        }
        Ok(())
    }

    /// A look at every watched process: the windows ended are closed,
    /// each with its last report, then the processes found growing are
    /// traced, as many as --max-traced lets.
    fn watch(&mut self, session: &mut Session, board: &Board) -> Result<(), ServeError> {
        let now = Instant::now();
        // Before the look, which forgets the processes gone: a victim
        // only watched is known by its history.
        self.take_oom_victims(session);
        let watched_victims: Vec<u32> = self
            .victims
            .keys()
            .copied()
            .filter(|&pid| {
                self.watcher
                    .as_ref()
                    .is_some_and(|watcher| watcher.history(pid).is_some() && !watcher.is_traced(pid))
            })
            .collect();
        for pid in watched_victims {
            self.victims.remove(&pid);
            self.keep_oom_evidence(pid);
        }
        let Some(watcher) = self.watcher.as_mut() else { return Ok(()) };
        for pid in watcher.windows_ended(now) {
            self.end_window(session, board, pid, "its window ended")?;
        }
        let within_budget = self.keep_to_budget(session, board)?;
        let Some(watcher) = self.watcher.as_mut() else { return Ok(()) };
        let suspects = watcher.look(now);
        for pid in suspects.into_iter().filter(|_| within_budget) {
            match session.trace_process(pid) {
                Ok(()) => watcher.traced(pid, now),
                Err(error) => watcher.untraceable(pid, &error.to_string()),
            }
        }
        for pid in watcher.unnamed() {
            watcher.name(pid, self.resolver.workload_of(pid));
        }
        self.sync(session);
        self.publish(board);
        Ok(())
    }

    /// Turns the kernel's count of BPF run time on while the session traces
    /// a process, and off when it traces none.
    fn count_run_time_while_traced(&mut self, session: &Session) {
        let traced = !session.targets().is_empty();
        match &mut self.run_time_count {
            Ok(count @ None) if traced && self.pricing.is_some() => match overhead::count_run_time() {
                Ok(fd) => *count = Some(fd),
                Err(error) => {
                    status::say(&format!("the probes' BPF time will not be counted: {error}"));
                    self.run_time_count = Err(());
                }
            },
            Ok(count @ Some(_)) if !traced => *count = None,
            _ => {}
        }
    }

    /// Closes process `pid`'s window (`why`): its last report is taken, its
    /// probes detached, and it is watched again.
    fn end_window(
        &mut self,
        session: &mut Session,
        board: &Board,
        pid: u32,
        why: &str,
    ) -> Result<(), ServeError> {
        self.round_with(session, board, Some(pid), &LAST_REPORT);
        session.stop_tracing(pid)?;
        let held = self.window_summary(pid);
        self.mark_detached(pid);
        self.costs_seen.remove(&pid);
        if let Some(watcher) = self.watcher.as_mut() {
            watcher.detached(pid);
        }
        status::say(&format!("pid {pid}: {why}; detached, its last report stays{held}"));
        Ok(())
    }

    /// Keeps what the processes traced pay for the probes under
    /// --max-overhead: past it, the costliest window ends now. Returns
    /// whether new windows may begin (the budget is not spent).
    fn keep_to_budget(&mut self, session: &mut Session, board: &Board) -> Result<bool, ServeError> {
        let Some(watcher) = self.watcher.as_ref() else { return Ok(true) };
        let max = watcher.settings().max_overhead;
        let mut rates = Vec::new();
        for pid in watcher.traced_pids() {
            let followed =
                self.live.get(&pid).and_then(|key| self.followed.get(key)).map(|entry| &entry.followed);
            let Some((cost, at)) = followed.and_then(|followed| {
                Some((followed.overhead_seconds?, followed.report.as_ref()?.time_unix_ms))
            }) else {
                continue;
            };
            let rate = match self.costs_seen.get(&pid) {
                Some(&(then, before, _)) if at > then => {
                    (cost - before).max(0.0) / ((at - then) as f64 / 1e3)
                }
                Some(&(_, _, rate)) => rate,
                None => 0.0,
            };
            if self.costs_seen.get(&pid).is_none_or(|&(then, _, _)| at > then) {
                self.costs_seen.insert(pid, (at, cost, rate));
            }
            rates.push((pid, rate));
        }
        let total: f64 = rates.iter().map(|(_, rate)| rate).sum();
        if total <= max {
            return Ok(true);
        }
        let Some(&(costliest, rate)) = rates.iter().max_by(|one, other| one.1.total_cmp(&other.1)) else {
            return Ok(true);
        };
        let why = format!(
            "its probes cost about {:.1}% of a CPU, and all traced {:.1}%, over --max-overhead {:.1}%: its window \
             ends early",
            rate * 100.0,
            total * 100.0,
            max * 100.0
        );
        self.end_window(session, board, costliest, &why)?;
        Ok(false)
    }

    /// Takes the OOM killer's victims picked since the last call; those
    /// whose ends were not seen in time (not followed) are forgotten.
    fn take_oom_victims(&mut self, session: &mut Session) {
        let now = Instant::now();
        for pid in session.take_oom_victims() {
            log::debug!("the OOM killer picked pid {pid}");
            self.victims.insert(pid, now);
        }
        self.victims.retain(|_, picked| now.duration_since(*picked) < VICTIM_KEPT);
    }

    /// Keeps the evidence of the kill of process `pid`: its last report if
    /// it was traced (taken as it exited), its memory's history if it was
    /// watched.
    fn keep_oom_evidence(&mut self, pid: u32) {
        let followed =
            self.live.get(&pid).and_then(|key| self.followed.get(key)).map(|entry| &entry.followed);
        let watched = self.watcher.as_ref().and_then(|watcher| watcher.history(pid));
        let program = followed
            .map(|followed| followed.program.clone())
            .or(watched.as_ref().map(|history| history.program.to_owned()))
            .unwrap_or_else(|| format!("pid {pid}"));
        let history = watched.as_ref().map_or_else(Vec::new, |history| {
            history.points.iter().map(|&(unix_ms, anon_bytes)| HistoryPoint { unix_ms, anon_bytes }).collect()
        });
        let evidence = Evidence {
            pid,
            followed,
            program: &program,
            workload: followed
                .and_then(|followed| followed.workload.as_ref())
                .or(watched.as_ref().and_then(|history| history.workload)),
            history,
            growth: watched.and_then(|history| history.growth),
        };
        if let Some(store) = self.oom.as_mut() {
            store.keep(&evidence);
        }
    }

    /// `: 1.2 MiB in 318 allocations, the most at leak_slowly (growth.c:31)`:
    /// what process `pid`'s latest report holds, said as its window ends.
    fn window_summary(&self, pid: u32) -> String {
        let report = self.live.get(&pid).and_then(|key| self.followed.get(key)?.followed.report.clone());
        let Some(report) = report else { return String::new() };
        let culprit =
            report.largest_culprit().map(|(_, named)| format!(", the most at {named}")).unwrap_or_default();
        format!(
            ": {} in {} allocations{culprit}",
            status::readable_bytes(report.total_bytes),
            report.total_allocations
        )
    }

    /// Process `pid`, let go at the end of its window, runs on: its last
    /// report stays for --retain, or until it is traced again.
    fn mark_detached(&mut self, pid: u32) {
        let Some(key) = self.live.remove(&pid) else { return };
        if let Some(entry) = self.followed.get_mut(&key) {
            entry.followed.detached = true;
            entry.let_go_at = Some(Instant::now());
        }
    }

    /// Process `pid` is no longer traced: its last report stays for
    /// --retain.
    fn mark_exited(&mut self, pid: u32) {
        let Some(key) = self.live.remove(&pid) else { return };
        if let Some(entry) = self.followed.get_mut(&key) {
            entry.followed.exited = true;
            entry.let_go_at = Some(Instant::now());
        }
    }

    /// Forgets the processes that exited more than --retain ago. Their BPF
    /// state went when they exited; this is the last of them. Returns
    /// whether any was forgotten.
    fn forget_expired(&mut self) -> bool {
        let retain = self.retain;
        let before = self.followed.len();
        self.followed.retain(|key, entry| {
            let expired = entry.let_go_at.is_some_and(|exited| exited.elapsed() >= retain);
            if expired {
                log::debug!("forgetting pid {} ({}), exited {retain:?} ago", key.pid, entry.followed.program);
            }
            !expired
        });
        // The names of containers no process followed is in any more.
        let followed = &self.followed;
        self.resolver.keep_only(|id| {
            followed.values().any(|entry| {
                let workload = entry.followed.workload.as_ref();
                workload
                    .and_then(|workload| workload.container_id.as_deref())
                    .is_some_and(|held| held.ends_with(id))
            })
        });
        self.followed.len() != before
    }

    /// Takes the reports of every target (or of `only`) and publishes
    /// them. A failed collection is said once and leaves the last
    /// reports served: the daemon goes on.
    fn round(&mut self, session: &mut Session, board: &Board, only: Option<u32>) {
        let request = ReportRequest {
            collect: CollectOptions::NONE,
            sort: SortKey::Size,
            top: board.stacks_kept(STACKS_KEPT),
            in_series: true,
        };
        self.round_with(session, board, only, &request);
    }

    fn round_with(
        &mut self,
        session: &mut Session,
        board: &Board,
        only: Option<u32>,
        request: &ReportRequest,
    ) {
        if only.is_none() {
            self.last_round = Some(Instant::now());
        }
        if let Some(pricing) = self.pricing.as_mut() {
            let (ns, runs) = session.uprobe_run_time();
            if runs > 0 {
                pricing.bpf_ns_per_run = Some(ns as f64 / runs as f64);
            }
        }
        match session.collect(only, request) {
            Ok(reports) => {
                self.last_error = None;
                board.note_map_fill(session.map_fill());
                for report in reports {
                    let Some(key) = self.live.get(&report.pid) else { continue };
                    if let Some(entry) = self.followed.get_mut(key) {
                        entry.followed.program.clone_from(&report.program);
                        entry.followed.overhead_seconds =
                            self.pricing.map(|pricing| pricing.seconds(&report.health));
                        entry.followed.take_report(report);
                    }
                }
            }
            Err(error) => {
                let message = error.to_string();
                if self.last_error.as_deref() != Some(&message) {
                    log::warn!("cannot collect reports, serving the last ones: {message}");
                }
                self.last_error = Some(message);
            }
        }
        self.publish(board);
    }

    fn publish(&self, board: &Board) {
        board.publish(Published {
            targets: self.followed.values().map(|entry| entry.followed.clone()).collect(),
            watch: self.watcher.as_ref().map(|watcher| std::sync::Arc::new(watcher.view())),
            oom: self.oom.as_ref().map(|store| std::sync::Arc::new(store.view())).unwrap_or_default(),
            processes_not_followed: self.processes_not_followed,
            python_code_let_go: crate::python::code::let_go_past_budget(),
            ..Published::default()
        });
    }
}

/// Takes the report a handler asked for, aside from the rounds.
fn answer(session: &mut Session, query: Query) {
    let answer = session.collect(query.pid, &query.request).map_err(|error| error.to_string());
    // The handler may have given up waiting; nothing is owed then.
    let _ = query.reply.send(answer);
}

/// What is said of a process taken in: how it was found, what it runs
/// and where its probes went.
fn describe_newcomer(target: &Target) -> String {
    let program = std::path::Path::new(&target.program)
        .file_name()
        .map_or_else(|| target.program.clone(), |name| name.to_string_lossy().into_owned());
    let container = target
        .container
        .as_deref()
        .map(|id| format!(" in container {}", container::short_id(id)))
        .unwrap_or_default();
    let found = if target.found_at_exec { ", found at its execve" } else { "" };
    format!("tracing pid {} ({program}){container} through {}{found}", target.pid, target.plan.describe())
}

#[cfg(test)]
mod tests {
    use std::{
        collections::{BTreeMap, BTreeSet},
        path::Path,
    };

    /// The sibling modules a file of serve/ names through `super::`,
    /// outside its tests: `super::a::f`, and `a` and `b` of
    /// `use super::{a::{..}, b};`.
    fn siblings_used(source: &str) -> BTreeSet<String> {
        let code = source.split("#[cfg(test)]\nmod tests").next().unwrap_or(source);
        let mut used = BTreeSet::new();
        let mut rest = code;
        while let Some(at) = rest.find("super::") {
            rest = &rest[at + "super::".len()..];
            let Some(group) = rest.strip_prefix('{') else {
                used.insert(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect());
                continue;
            };
            // Each item's first name, at the group's own depth.
            let (mut depth, mut name, mut item_named) = (1, String::new(), false);
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 1 && !item_named && (c.is_alphanumeric() || c == '_') {
                    name.push(c);
                } else if !name.is_empty() {
                    used.insert(std::mem::take(&mut name));
                    item_named = true;
                }
                if depth == 1 && c == ',' {
                    item_named = false;
                }
                if depth == 0 {
                    break;
                }
            }
        }
        used
    }

    /// The house rule for the server's files: the router and the
    /// handlers may share a module below them, never import each other.
    #[test]
    fn no_file_of_serve_imports_one_that_imports_it_back() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/serve");
        let mut uses = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let Some(module) = path.file_stem().and_then(|stem| stem.to_str()).map(str::to_owned) else {
                continue;
            };
            if module != "mod" && path.extension().is_some_and(|extension| extension == "rs") {
                uses.insert(module, siblings_used(&std::fs::read_to_string(&path).unwrap()));
            }
        }
        assert!(uses["reports"].contains("query"), "the scan misses imports: {uses:?}");
        let cycles: Vec<String> = uses
            .iter()
            .flat_map(|(module, used)| used.iter().map(move |other| (module, other)))
            .filter(|(module, other)| {
                module < other && uses.get(*other).is_some_and(|back| back.contains(*module))
            })
            .map(|(module, other)| format!("{module}.rs <-> {other}.rs"))
            .collect();
        assert!(cycles.is_empty(), "files of serve/ that import each other: {cycles:?}");
    }
}
