//! One tracing session: resolve the target, plan and attach the probes,
//! then print a report every interval until the count is reached, the
//! target exits, or memleak is told to stop.

use std::{
    collections::HashMap,
    io::{self, Write},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use memleak_common::{StackFrames, LOST_STACK_ID};
use tokio::{
    signal::unix::{signal, Signal, SignalKind},
    sync::mpsc::UnboundedReceiver,
};

use crate::{
    allocator::{self, AttachPlan},
    cli::{Args, Format},
    collector::{self, CollectOptions},
    report::{json, text, Report, ReportContext},
    status,
    symbolize::StackSymbolizer,
    target::{self, GatedCommand, TargetEvent},
    tracer::{Tracer, TracerConfig},
};

/// How often the target's mappings are re-read, so that libraries it loads
/// later can be symbolized even if it exits before the next report.
const MAPS_REFRESH: Duration = Duration::from_millis(250);

pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = TracerConfig {
        min_size: args.min_size.unwrap_or(0),
        max_size: args.max_size.unwrap_or(u64::MAX),
        stack_depth: args.max_stack_depth,
        max_allocations: args.max_allocs,
        max_stacks: args.max_stacks,
    };
    // Before anything is attached: a signal from now on ends the run
    // cleanly instead of killing memleak with its probes half-placed.
    let mut stop = StopSignals::new()?;
    let (events, mut target_events) = tokio::sync::mpsc::unbounded_channel();
    // The target is checked before the BPF object is loaded, so a wrong pid
    // is reported as such even without privileges.
    let (pid, plan, tracer, child) = match (args.pid, &args.command) {
        (Some(pid), _) => {
            target::check_process(pid)?;
            let plan = allocator::plan_for_process(pid, args.object.as_deref())?;
            let mut tracer = Tracer::load(&config)?;
            tracer.attach(&plan, pid)?;
            target::watch_process(pid, events);
            (pid, plan, tracer, None)
        }
        (None, Some(command_line)) => {
            let gated = GatedCommand::spawn(command_line)?;
            let prepared = allocator::plan_for_program(&gated.program, args.object.as_deref())
                .map_err(anyhow::Error::from)
                .and_then(|plan| {
                    let mut tracer = Tracer::load(&config)?;
                    tracer.attach(&plan, gated.pid)?;
                    Ok((plan, tracer))
                });
            match prepared {
                Ok((plan, tracer)) => (gated.pid, plan, tracer, Some(gated.release(events)?)),
                Err(error) => {
                    gated.abandon();
                    return Err(error);
                }
            }
        }
        (None, None) => unreachable!("Args::validate requires -p or -c"),
    };
    status::say(&format!(
        "tracing pid {pid} through {} ({} functions probed); Ctrl-C to stop",
        plan.display_path,
        plan.sites.len()
    ));
    let result = trace(&args, &tracer, pid, &plan, &mut target_events, &mut stop).await;
    drop(target_events);
    if let Some(command) = child {
        // A command memleak started does not outlive it.
        command.finish();
    }
    // Detaches every probe.
    drop(tracer);
    result
}

async fn trace(
    args: &Args,
    tracer: &Tracer,
    pid: u32,
    plan: &AttachPlan,
    target_events: &mut UnboundedReceiver<TargetEvent>,
    stop: &mut StopSignals,
) -> anyhow::Result<()> {
    let mut symbolizer = StackSymbolizer::new(pid);
    symbolizer.modules.refresh();
    let mut reports = tokio::time::interval_at(tokio::time::Instant::now() + args.interval, args.interval);
    let mut refresh = tokio::time::interval(MAPS_REFRESH);
    let mut printed = 0u64;
    loop {
        // Held by a command at its exit stop until the final report is out.
        let mut exit_ack = None;
        let last = tokio::select! {
            _ = refresh.tick() => { symbolizer.modules.refresh(); continue; }
            _ = reports.tick() => false,
            Some(TargetEvent::Exiting { ack }) = target_events.recv() => {
                status::say(&format!("pid {pid} exited"));
                exit_ack = ack;
                true
            }
            _ = stop.interrupt.recv() => true,
            _ = stop.terminate.recv() => true,
        };
        symbolizer.modules.refresh();
        let report = take_report(args, tracer, pid, plan, &mut symbolizer)?;
        if !print(&report, args.format)? {
            return Ok(()); // stdout closed: nobody is listening any more
        }
        drop(exit_ack);
        printed += 1;
        if last || args.count.is_some_and(|count| printed >= count.get()) {
            return Ok(());
        }
    }
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

fn take_report(
    args: &Args,
    tracer: &Tracer,
    pid: u32,
    plan: &AttachPlan,
    symbolizer: &mut StackSymbolizer,
) -> anyhow::Result<Report> {
    let now_ns = monotonic_ns();
    let time_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let allocations = tracer.allocations()?;
    let counters = tracer.counters()?;
    let options = CollectOptions {
        min_age_ns: args.older.saturating_mul(1_000_000),
        keep_allocations: args.show_allocs,
    };
    let snapshot = collector::aggregate(pid, time_unix_ms, now_ns, &allocations, counters, options);
    // Stacks are read from the map only when a report needs one not seen yet.
    let unseen = snapshot
        .stacks
        .iter()
        .any(|stack| stack.stack_id != LOST_STACK_ID && symbolizer.cached(stack.stack_id).is_none());
    let stored: HashMap<u64, StackFrames> =
        if unseen { tracer.stacks()?.into_iter().collect() } else { HashMap::new() };
    let context = ReportContext { allocator: &plan.display_path, min_age_ms: args.older, top: args.top };
    Ok(Report::build(snapshot, &context, |stack_id| {
        if let Some(frames) = symbolizer.cached(stack_id) {
            return frames;
        }
        let addresses = stored.get(&stack_id).map_or(&[][..], |frames| &frames[..]);
        symbolizer.symbolize(stack_id, addresses)
    }))
}

/// Prints a report; `false` when stdout is a closed pipe.
fn print(report: &Report, format: Format) -> anyhow::Result<bool> {
    let mut out = io::stdout().lock();
    let result = match format {
        Format::Text => text::render(report, &mut out),
        Format::Json => json::render(report, &mut out),
    }
    .and_then(|()| out.flush());
    match result {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(error) => Err(error.into()),
    }
}

fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills in the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
