//! The command line's driver of a session: attach, then a report every
//! interval until the count is reached, the targets exit, or memleak is
//! told to stop; each report to the output, to --save and to --stats.

use std::time::{Duration, Instant};

use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::{
    bpf::{Traced, Tracer, TracerError},
    clock,
    config::TraceConfig,
    output::{BackgroundFiles, NumberedFiles, Output, OutputError},
    process::feedback,
    report::{saved, CgroupTotal, ExitedTotal, Report},
    session::{
        CgroupCensus, Session, SessionConfig, SessionError, SessionEvent, Target, TargetSpec,
        PYTHON_PENDING_RETRY,
    },
    stats::{Stats, StatsError},
    status,
};

/// How often the targets' mappings are re-read, so that libraries loaded
/// later can be symbolized even if a target exits before the next report,
/// and how soon a process that joins a cgroup is traced.
const REFRESH: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Tracer(#[from] TracerError),
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error(transparent)]
    Stats(#[from] StatsError),
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
}

/// Runs the trace `config` describes, to its end.
pub async fn run(config: &TraceConfig) -> Result<(), RunError> {
    // Before anything is attached: a signal from now on ends the run
    // cleanly instead of killing memleak with its probes half-placed.
    let mut stop = StopSignals::new().map_err(RunError::Signals)?;
    let traced = match config.target {
        TargetSpec::Kernel { .. } => Traced::Kernel,
        TargetSpec::Pids(_) | TargetSpec::Command(_) | TargetSpec::Cgroup(_) | TargetSpec::Selected(_) => {
            Traced::Processes
        }
    };
    Tracer::check_kernel()?;
    Tracer::check_privileges(traced)?;
    // Before anything is attached too: a file that may not be overwritten
    // or cannot be written is an error now, not after the run.
    let documents = config.documents();
    let mut output = Output::open(&config.output, documents)?;
    let mut saves = config
        .save
        .as_deref()
        .map(|path| NumberedFiles::new(path, documents, config.output.force).and_then(BackgroundFiles::new))
        .transpose()?;
    let mut stats = Stats::open(config.stats.as_deref())?;
    let starting = Instant::now();
    // Once the output is open: a FIFO's reader is known only then.
    let session_config = SessionConfig {
        excluded: feedback::excluded(config.session.tracer.trace_events, config.output.path.as_deref()),
        ..config.session.clone()
    };
    for excluded in &session_config.excluded {
        log::debug!("never tracing pid {}: {}", excluded.pid, excluded.why);
    }
    let mut session = Session::start(&config.target, &session_config)?;
    let attached = session.first_attached().map(|at| at.saturating_duration_since(starting));
    stats.started(session.load_time(), attached, starting.elapsed(), &session.kernel_paths())?;
    announce(&session, &config.target, &mut stats)?;
    let mut sinks = Sinks { output: &mut output, saves: saves.as_mut(), stats: &mut stats };
    let ended = drive(config, &mut session, &mut sinks, &mut stop).await;
    // Ends a command memleak started and detaches every probe.
    drop(session);
    // Every snapshot handed over is written, whatever ended the run.
    let snapshots_written = saves.as_mut().map_or(Ok(()), BackgroundFiles::finish);
    match ended {
        // Nobody is listening any more: not an error.
        Ok(()) | Err(RunError::Output(OutputError::ReaderGone)) => {
            snapshots_written?;
            Ok(output.finish()?)
        }
        Err(error) => Err(error),
    }
}

/// Says what is traced, on stderr and in --stats.
fn announce(session: &Session, target: &TargetSpec, stats: &mut Stats) -> Result<(), RunError> {
    for traced in session.targets() {
        if !traced.is_kernel() {
            stats.probes(traced.pid, &traced.plan, session.mapping_calls_seen_by())?;
            write_unwind_stats(session, traced, stats)?;
        }
        match target {
            TargetSpec::Kernel { .. } => status::say("tracing kernel allocations; Ctrl-C to stop"),
            TargetSpec::Cgroup(_) | TargetSpec::Selected(_) => say_joined(traced),
            TargetSpec::Pids(_) | TargetSpec::Command(_) => status::say(&format!(
                "tracing pid {} through {}; Ctrl-C to stop",
                traced.pid,
                traced.plan.describe()
            )),
        }
    }
    if let Some(cgroup) = session.cgroup() {
        say_census(&cgroup.path, session.cgroup_census());
        status::say(&format!("tracing cgroup {} (id {}); Ctrl-C to stop", cgroup.path.display(), cgroup.id));
    }
    Ok(())
}

/// How many processes a cgroup had at the start. None is said as a
/// warning: a pod's or a slice's directory given by mistake, or a
/// container already gone, must not look like a program that allocates
/// nothing.
fn say_census(path: &std::path::Path, census: CgroupCensus) {
    if census.processes == 0 {
        log::warn!(
            "no processes to trace in {} or its descendant cgroups: tracing those that join it",
            path.display()
        );
    } else {
        status::say(&format!(
            "tracing {} processes in {} ({} in descendant cgroups)",
            census.processes,
            path.display(),
            census.in_descendants
        ));
    }
}

fn write_unwind_stats(session: &Session, target: &Target, stats: &mut Stats) -> Result<(), RunError> {
    if let (Some(built), Some(all)) = (&target.unwind_built, session.unwind_stats()) {
        stats.unwind_tables(target.pid, built, &all)?;
    }
    Ok(())
}

fn say_joined(target: &Target) {
    status::say(&format!(
        "pid {} is in the cgroup: tracing it through {}",
        target.pid, target.plan.display_path
    ));
}

/// Where reports go.
struct Sinks<'a> {
    output: &'a mut Output,
    /// --save's snapshots.
    saves: Option<&'a mut BackgroundFiles>,
    stats: &'a mut Stats,
}

/// Why reports are due now.
enum Round {
    /// The interval passed.
    Interval,
    /// memleak was told to stop: a final report for every target.
    Last,
    /// A target is exiting: its final report. The command memleak started
    /// stays at its exit stop until `ack` is dropped.
    Exit { pid: u32, ack: Option<std::sync::mpsc::Sender<()>> },
    /// A target called execve: the old program's final report, then the
    /// new one is traced.
    Exec { pid: u32 },
}

async fn drive(
    config: &TraceConfig,
    session: &mut Session,
    sinks: &mut Sinks<'_>,
    stop: &mut StopSignals,
) -> Result<(), RunError> {
    let mut python_retry = tokio::time::interval(PYTHON_PENDING_RETRY);
    python_retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut clocks = Clocks {
        interval: tokio::time::interval_at(tokio::time::Instant::now() + config.interval, config.interval),
        refresh: tokio::time::interval(REFRESH),
        python_retry,
        python_pending: true,
    };
    let mut printed = 0u64;
    // Processes of the cgroup that exited since its last total.
    let mut exited = ExitedTotal::default();
    loop {
        let round = next_round(session, sinks, &mut clocks, stop).await?;
        // Events that came before the report go out before it.
        let events = session.drain_trace_events();
        if !events.is_empty() {
            sinks.output.trace(&events, clock::wall_minus_monotonic_ns())?;
        }
        let count_reached = |printed: u64| config.count.is_some_and(|count| printed >= count.get());
        let final_round = !matches!(round, Round::Interval) || count_reached(printed + 1);
        let only = match &round {
            Round::Exit { pid, .. } | Round::Exec { pid } => Some(*pid),
            Round::Interval | Round::Last => None,
        };
        let reports = report_round(config, session, sinks, only, final_round)?;
        let last = matches!(round, Round::Last);
        match round {
            Round::Exec { pid } => restart(session, sinks, pid)?,
            Round::Exit { pid, ack } => {
                drop(ack);
                reports.iter().filter(|report| report.pid == pid).for_each(|report| exited.add(report));
                // Its final report is out; the others go on. A cgroup's run
                // goes on even with none: processes may join it later.
                session.remove_exited_target(pid)?;
            }
            Round::Interval | Round::Last => {}
        }
        if only.is_some() {
            if session.is_done() {
                return Ok(());
            }
            continue;
        }
        if let Some(cgroup) = session.cgroup() {
            sinks.output.cgroup_total(&CgroupTotal::of(
                &cgroup.path,
                &reports,
                std::mem::take(&mut exited),
            ))?;
        }
        printed += 1;
        if last || count_reached(printed) {
            return Ok(());
        }
    }
}

/// The report loop's timers: reports, re-reading the targets, and looking
/// again for interpreters not ready yet.
struct Clocks {
    interval: tokio::time::Interval,
    refresh: tokio::time::Interval,
    python_retry: tokio::time::Interval,
    /// Whether a target may have an interpreter not ready yet: set
    /// whenever targets may have come or changed, cleared once none has.
    python_pending: bool,
}

/// Waits until reports are due, meanwhile picking up new processes and
/// writing --trace events.
async fn next_round(
    session: &mut Session,
    sinks: &mut Sinks<'_>,
    clocks: &mut Clocks,
    stop: &mut StopSignals,
) -> Result<Round, RunError> {
    // A round may have restarted a target at its execve.
    clocks.python_pending = true;
    loop {
        let round = tokio::select! {
            _ = clocks.python_retry.tick(), if clocks.python_pending => {
                clocks.python_pending = session.detect_pending_python()?;
                continue;
            }
            _ = clocks.refresh.tick() => {
                clocks.python_pending = true;
                let added = session.refresh()?;
                let targets = session.targets();
                for target in &targets[targets.len() - added..] {
                    say_joined(target);
                    sinks.stats.probes(target.pid, &target.plan, session.mapping_calls_seen_by())?;
                    write_unwind_stats(session, target, sinks.stats)?;
                }
                continue;
            }
            event = session.next_event() => match event? {
                SessionEvent::Trace(events) => {
                    sinks.output.trace(&events, clock::wall_minus_monotonic_ns())?;
                    continue;
                }
                SessionEvent::Exiting { pid, ack } => {
                    status::say(&format!("pid {pid} exited"));
                    Round::Exit { pid, ack }
                }
                SessionEvent::Followed { pid, parent } => {
                    clocks.python_pending = true;
                    status::say(&format!("tracing pid {pid}, forked by pid {parent}"));
                    continue;
                }
                // Only `memleak serve` follows processes from their execve.
                SessionEvent::Joined { pid } => {
                    clocks.python_pending = true;
                    status::say(&format!("tracing pid {pid}, found at its execve"));
                    continue;
                }
                SessionEvent::Exec { pid } => {
                    status::say(&format!("pid {pid} called execve: the final report of its old program"));
                    Round::Exec { pid }
                }
            },
            _ = clocks.interval.tick() => Round::Interval,
            _ = stop.interrupt.recv() => Round::Last,
            _ = stop.terminate.recv() => Round::Last,
        };
        return Ok(round);
    }
}

/// Traces the new program of process `pid` after its execve, and says so.
fn restart(session: &mut Session, sinks: &mut Sinks<'_>, pid: u32) -> Result<(), RunError> {
    let seen_by = session.mapping_calls_seen_by();
    if let Some(target) = session.restart_target(pid)? {
        status::say(&format!(
            "pid {pid} now runs {}: tracing it through {}",
            target.program,
            target.plan.describe()
        ));
        sinks.stats.probes(target.pid, &target.plan, seen_by)?;
    }
    Ok(())
}

/// Takes the reports of one round (of process `only`, or of all) and
/// writes them; returns those written.
fn report_round(
    config: &TraceConfig,
    session: &mut Session,
    sinks: &mut Sinks<'_>,
    only: Option<u32>,
    final_round: bool,
) -> Result<Vec<Report>, RunError> {
    let started = Instant::now();
    let reports = session.collect(only, &config.request())?;
    let latency = started.elapsed();
    if let Some(counts) = session.walk_counts() {
        sinks.stats.stack_walks(&counts)?;
    }
    // A document on stdout is written once, at the end.
    let skip_output = !sinks.output.takes_every_report() && !final_round;
    let mut written = Vec::new();
    for mut report in reports {
        log::debug!(
            "report for pid {}: {} stacks, {} allocations in {} ms",
            report.pid,
            report.total_stacks,
            report.total_allocations,
            latency.as_millis()
        );
        let writing = Instant::now();
        if let Some(saves) = sinks.saves.as_mut() {
            // Written by a thread of its own: a snapshot of every stack
            // takes seconds at 65,536 deep stacks, and the report loop
            // goes on meanwhile. The frames are shared, not copied.
            let whole = report.clone();
            saves.write(move |out| saved::write(&whole, out))?;
            // Saved whole; shown as asked.
            report.cut_for_display(&config.shown, config.output.rendering.format);
        }
        if !skip_output {
            sinks.output.report(&report)?;
        }
        sinks.stats.report(&report, latency, writing.elapsed())?;
        if !skip_output {
            written.push(report);
        }
    }
    Ok(written)
}

/// SIGINT and SIGTERM, which end the run with a final report.
struct StopSignals {
    interrupt: Signal,
    terminate: Signal,
}

impl StopSignals {
    fn new() -> std::io::Result<Self> {
        Ok(Self { interrupt: signal(SignalKind::interrupt())?, terminate: signal(SignalKind::terminate())? })
    }
}
