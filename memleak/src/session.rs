//! One tracing session: resolve the targets, plan and attach the probes,
//! then print reports every interval until the count is reached, the
//! targets exit, or memleak is told to stop.

use std::{
    collections::HashMap,
    path::Path,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use memleak_common::{
    lost_stack_owner, Allocation, AllocationKey, MappingEvent, StackKey, StackTotals, KERNEL_TGID,
};
use tokio::{
    signal::unix::{signal, Signal, SignalKind},
    sync::mpsc::{UnboundedReceiver, UnboundedSender},
};

use crate::{
    allocator::{self, AttachPlan},
    cgroup::Cgroup,
    cli::{Args, Format},
    collector::{self, CollectOptions},
    events::{self, EventRing},
    kernel_btf,
    mappings::{self, Regions},
    model::{Frame, HealthCounters, ModuleMapping},
    report::{
        output::{NumberedFiles, Output},
        snapshot, Report, ReportContext,
    },
    status,
    symbolize::{ProcessModules, StackSymbolizer},
    target::{self, GatedCommand, SpawnedCommand, TargetEvent},
    tracer::{Tracer, TracerConfig},
    trend::TrendTracker,
};

/// How often the targets' mappings are re-read, so that libraries loaded
/// later can be symbolized even if a target exits before the next report.
const MAPS_REFRESH: Duration = Duration::from_millis(250);

/// A traced process and what its reports need.
struct Target {
    pid: u32,
    /// Its executable, as it names it.
    program: String,
    plan: AttachPlan,
    /// Its pid inside its own pid namespace, when that differs.
    namespace_pid: Option<u32>,
    symbolizer: StackSymbolizer,
    trends: TrendTracker,
    regions: Regions,
}

impl Target {
    fn new(pid: u32, plan: AttachPlan) -> Self {
        let mut symbolizer = StackSymbolizer::new(pid);
        symbolizer.modules.refresh();
        let namespace_pid = target::namespace_pid(pid);
        let program = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map_or_else(|_| format!("pid {pid}"), |path| path.display().to_string());
        Self {
            pid,
            program,
            plan,
            namespace_pid,
            symbolizer,
            trends: TrendTracker::default(),
            regions: Regions::default(),
        }
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // Before anything is attached: a signal from now on ends the run
    // cleanly instead of killing memleak with its probes half-placed.
    let mut stop = StopSignals::new()?;
    Tracer::check_privileges()?;
    // Before anything is attached too: a file that may not be overwritten
    // or cannot be written is an error now, not after the run.
    let rendering = &args.rendering;
    // Each report of each process is a file of its own.
    let several =
        args.count.is_none_or(|count| count.get() > 1) || args.pid.len() > 1 || args.cgroup.is_some();
    let mut output = Output::open(
        rendering.output.as_deref(),
        rendering.force,
        several,
        rendering.format(),
        rendering.weight,
    )?;
    let mut saves =
        args.save.as_deref().map(|path| NumberedFiles::new(path, several, rendering.force)).transpose()?;
    let (events, mut target_events) = tokio::sync::mpsc::unbounded_channel();
    let mut cgroup = None;
    let (tracer, targets, command) = match &args.command {
        None if args.kernel_mode() => attach_kernel(&args)?,
        None if args.cgroup.is_some() => {
            let (tracer, targets, watched) = attach_cgroup(&args, &events)?;
            cgroup = Some((watched, events.clone()));
            (tracer, targets, None)
        }
        None => attach_processes(&args, events)?,
        Some(command_line) => {
            let (tracer, target, command) = start_command(&args, command_line, events)?;
            (tracer, vec![target], Some(command))
        }
    };
    // (attach_cgroup speaks for itself, as processes join.)
    for target in targets.iter().filter(|_| args.cgroup.is_none()) {
        let what = if args.kernel_mode() {
            "tracing kernel allocations; Ctrl-C to stop".to_owned()
        } else {
            format!(
                "tracing pid {} through {} ({} functions probed); Ctrl-C to stop",
                target.pid,
                target.plan.display_path,
                target.plan.sites.len()
            )
        };
        status::say(&what);
    }
    let mut tracer = tracer;
    let rings = Rings {
        trace: if args.trace { Some(EventRing::new(tracer.take_events()?)?) } else { None },
        mappings: Some(EventRing::new(tracer.take_mapping_events()?)?),
    };
    let mut sinks = Sinks { output: &mut output, saves: saves.as_mut() };
    let result =
        trace(&args, &mut tracer, targets, cgroup, rings, &mut sinks, &mut target_events, &mut stop).await;
    drop(target_events);
    if let Some(command) = command {
        // A command memleak started does not outlive it.
        command.finish();
    }
    // Detaches every probe.
    drop(tracer);
    result?;
    output.finish()?;
    Ok(())
}

/// No -p or -c: the kernel's own allocations, as one target with tgid 0.
fn attach_kernel(args: &Args) -> anyhow::Result<(Tracer, Vec<Target>, Option<SpawnedCommand>)> {
    let btf = Path::new(kernel_btf::VMLINUX_BTF);
    let cache_size_offset = kernel_btf::member_offset(btf, "kmem_cache", "size")?;
    // Inserting into memleak's own maps makes the BPF memory allocator
    // refill them with kmalloc, from alloc_bulk: counting those would feed
    // on itself.
    let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
    let ignored_callers = kernel_btf::function_range(&kallsyms, "alloc_bulk").unwrap_or_else(|| {
        log::warn!("alloc_bulk is not in /proc/kallsyms: memleak's own map refills may be counted");
        0..0
    });
    let config = TracerConfig { cache_size_offset, ignored_callers, ..tracer_config(args, 1) };
    let mut tracer = Tracer::load(&config)?;
    tracer.attach_kernel(args.percpu)?;
    let plan = AttachPlan { path: btf.to_path_buf(), display_path: "kernel".to_owned(), sites: Vec::new() };
    let target = Target {
        pid: KERNEL_TGID,
        program: "kernel".to_owned(),
        plan,
        namespace_pid: None,
        symbolizer: StackSymbolizer::kernel(),
        trends: TrendTracker::default(),
        regions: Regions::default(),
    };
    Ok((tracer, vec![target], None))
}

fn tracer_config(args: &Args, processes: usize) -> TracerConfig {
    TracerConfig {
        min_size: args.min_size.unwrap_or(0),
        max_size: args.max_size.unwrap_or(u64::MAX),
        stack_depth: args.max_stack_depth,
        max_allocations: args.max_allocs,
        max_stacks: args.max_stacks,
        sample_rate: args.sample_rate,
        processes: processes as u32,
        trace: args.trace,
        cache_size_offset: 0,
        ignored_callers: 0..0,
        cgroup_id: 0,
    }
}

/// `-p`: checks every pid and plans its probes before the BPF object is
/// loaded, so a wrong pid is reported as such even without privileges.
fn attach_processes(
    args: &Args,
    events: UnboundedSender<TargetEvent>,
) -> anyhow::Result<(Tracer, Vec<Target>, Option<SpawnedCommand>)> {
    let prefix = args.symbols_prefix.as_deref().unwrap_or("");
    let mut plans = Vec::new();
    for &pid in &args.pid {
        target::check_process(pid)?;
        plans.push((pid, allocator::plan_for_process(pid, args.object.as_deref(), prefix)?));
    }
    let mut tracer = Tracer::load(&tracer_config(args, plans.len()))?;
    let mut targets = Vec::new();
    for (pid, plan) in plans {
        tracer.attach(&plan, pid)?;
        target::watch_process(pid, events.clone());
        targets.push(Target::new(pid, plan));
    }
    Ok((tracer, targets, None))
}

/// `--cgroup`: the processes in the cgroup now; `add_cgroup_processes`
/// picks up those that join later.
fn attach_cgroup(
    args: &Args,
    events: &UnboundedSender<TargetEvent>,
) -> anyhow::Result<(Tracer, Vec<Target>, Cgroup)> {
    let path = args.cgroup.as_deref().expect("--cgroup given");
    let mut cgroup = Cgroup::open(path)?;
    // Room in the totals map for a lost-stack entry per process, however
    // many come and go.
    let config = TracerConfig { cgroup_id: cgroup.id, ..tracer_config(args, 4096) };
    let mut tracer = Tracer::load(&config)?;
    let mut targets = Vec::new();
    add_cgroup_processes(args, &mut tracer, &mut cgroup, &mut targets, events)?;
    status::say(&format!("tracing cgroup {} (id {}); Ctrl-C to stop", path.display(), cgroup.id));
    Ok((tracer, targets, cgroup))
}

/// Starts following the cgroup's processes not followed yet, probing each
/// allocator file once, for every process that maps it.
fn add_cgroup_processes(
    args: &Args,
    tracer: &mut Tracer,
    cgroup: &mut Cgroup,
    targets: &mut Vec<Target>,
    events: &UnboundedSender<TargetEvent>,
) -> anyhow::Result<()> {
    let prefix = args.symbols_prefix.as_deref().unwrap_or("");
    for pid in cgroup.processes() {
        if targets.iter().any(|target| target.pid == pid) || target::check_process(pid).is_err() {
            continue;
        }
        let plan = match allocator::plan_for_process(pid, args.object.as_deref(), prefix) {
            Ok(plan) => plan,
            Err(error) => {
                log::warn!("not tracing pid {pid} of the cgroup: {error}");
                continue;
            }
        };
        if cgroup.first_probe_of(&plan.path) {
            tracer.attach(&plan, 0)?;
            log::debug!("probed {} for the cgroup", plan.display_path);
        }
        target::watch_process(pid, events.clone());
        status::say(&format!("pid {pid} is in the cgroup: tracing it through {}", plan.display_path));
        targets.push(Target::new(pid, plan));
    }
    Ok(())
}

/// `-c`: forks the command held before exec, attaches, then lets it run.
fn start_command(
    args: &Args,
    command_line: &str,
    events: UnboundedSender<TargetEvent>,
) -> anyhow::Result<(Tracer, Target, SpawnedCommand)> {
    let prefix = args.symbols_prefix.as_deref().unwrap_or("");
    let gated = GatedCommand::spawn(command_line)?;
    let prepared = allocator::plan_for_program(&gated.program, args.object.as_deref(), prefix)
        .map_err(anyhow::Error::from)
        .and_then(|plan| {
            let mut tracer = Tracer::load(&tracer_config(args, 1))?;
            tracer.attach(&plan, gated.pid)?;
            Ok((plan, tracer))
        });
    match prepared {
        Ok((plan, tracer)) => {
            let pid = gated.pid;
            let program = std::fs::canonicalize(&gated.program).unwrap_or_else(|_| gated.program.clone());
            let program = program.display().to_string();
            let command = gated.release(events)?;
            // Not /proc/PID/exe: the command may not have reached its exec yet.
            Ok((tracer, Target { program, ..Target::new(pid, plan) }, command))
        }
        Err(error) => {
            gated.abandon();
            Err(error)
        }
    }
}

async fn trace(
    args: &Args,
    tracer: &mut Tracer,
    mut targets: Vec<Target>,
    mut cgroup: Option<(Cgroup, UnboundedSender<TargetEvent>)>,
    mut rings: Rings,
    sinks: &mut Sinks<'_>,
    target_events: &mut UnboundedReceiver<TargetEvent>,
    stop: &mut StopSignals,
) -> anyhow::Result<()> {
    let mut reports = tokio::time::interval_at(tokio::time::Instant::now() + args.interval, args.interval);
    let mut refresh = tokio::time::interval(MAPS_REFRESH);
    let mut stacks = StackCatalog::default();
    let mut printed = 0u64;
    loop {
        // Which targets to report on now, and whether this is the end.
        let (due, last, exit_ack) = tokio::select! {
            _ = refresh.tick() => {
                targets.iter_mut().for_each(|target| target.symbolizer.modules.refresh());
                if let Some((cgroup, events)) = cgroup.as_mut() {
                    add_cgroup_processes(args, tracer, cgroup, &mut targets, events)?;
                }
                continue;
            }
            ring = events::readable(&mut rings.trace) => {
                if !sinks.output.trace(&ring?.drain(), wall_ns() - i128::from(monotonic_ns()))? {
                    return Ok(()); // stdout closed
                }
                continue;
            }
            ring = events::readable(&mut rings.mappings) => {
                apply_mappings(&mut targets, &ring?.drain());
                continue;
            }
            _ = reports.tick() => (None, false, None),
            Some(TargetEvent::Exiting { pid, ack }) = target_events.recv() => {
                status::say(&format!("pid {pid} exited"));
                (Some(pid), false, ack)
            }
            _ = stop.interrupt.recv() => (None, true, None),
            _ = stop.terminate.recv() => (None, true, None),
        };
        // Events that came before the report go out, or count, before it.
        if let Some(ring) = rings.trace.as_mut() {
            if !sinks.output.trace(&ring.drain(), wall_ns() - i128::from(monotonic_ns()))? {
                return Ok(());
            }
        }
        if let Some(ring) = rings.mappings.as_mut() {
            apply_mappings(&mut targets, &ring.drain());
        }
        // The command stays at its exit stop until `exit_ack` is dropped.
        let final_round = last || due.is_some() || args.count.is_some_and(|count| printed + 1 >= count.get());
        let skip_output = !sinks.output.takes_every_report() && !final_round;
        let mut reported = Vec::new();
        // Read once for every process reported on.
        let maps = MapContents::read(args, tracer)?;
        for target in targets.iter_mut().filter(|target| due.is_none_or(|pid| pid == target.pid)) {
            target.symbolizer.modules.refresh();
            let mut report = take_report(args, tracer, &maps, target, &mut stacks)?;
            if let Some(saves) = sinks.saves.as_mut() {
                saves.write(|out| snapshot::write(&report, out))?;
                // Saved whole; shown as asked.
                let top = args.rendering.stacks_kept();
                report.cut_for_display(args.sort, top, args.format(), args.show_allocs);
            }
            if skip_output {
                continue;
            }
            if !sinks.output.report(&report)? {
                return Ok(()); // stdout closed: nobody is listening any more
            }
            reported.push((report.total_bytes, report.total_allocations));
        }
        drop(exit_ack);
        if let Some(pid) = due {
            // Its final report is out; the others go on. A cgroup's run goes
            // on even with none: processes may join it later.
            targets.retain(|target| target.pid != pid);
            if targets.is_empty() && cgroup.is_none() {
                return Ok(());
            }
            continue;
        }
        if let Some((cgroup, _)) = &cgroup {
            if !sinks.output.cgroup_total(&cgroup.path, &reported)? {
                return Ok(());
            }
        }
        printed += 1;
        if last || args.count.is_some_and(|count| printed >= count.get()) {
            return Ok(());
        }
    }
}

/// Where reports go.
struct Sinks<'a> {
    output: &'a mut Output,
    /// --save's snapshots.
    saves: Option<&'a mut NumberedFiles>,
}

/// The BPF ring buffers memleak reads.
struct Rings {
    /// --trace events, if asked for.
    trace: Option<EventRing>,
    /// mmap, munmap and mremap calls.
    mappings: Option<EventRing>,
}

fn apply_mappings(targets: &mut [Target], events: &[MappingEvent]) {
    for event in events {
        if let Some(target) = targets.iter_mut().find(|target| target.pid == event.tgid) {
            target.regions.apply(event);
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

/// The stacks read from the BPF stack map so far, by id. The map is read
/// again only when a report meets an id not seen yet.
#[derive(Default)]
struct StackCatalog {
    stacks: HashMap<u64, StackKey>,
}

impl StackCatalog {
    fn ensure(&mut self, tracer: &Tracer, stack_ids: impl IntoIterator<Item = u64>) -> anyhow::Result<()> {
        let mut ids = stack_ids.into_iter().filter(|id| lost_stack_owner(*id).is_none());
        if ids.any(|id| !self.stacks.contains_key(&id)) {
            self.stacks.extend(tracer.stacks()?);
        }
        Ok(())
    }

    /// The process a stack id belongs to.
    fn owner(&self, stack_id: u64) -> Option<u32> {
        lost_stack_owner(stack_id).or_else(|| self.stacks.get(&stack_id).map(|key| key.tgid))
    }
}

/// What the BPF maps hold at one report round, read once for all the
/// processes reported on.
struct MapContents {
    started: std::time::Instant,
    time_unix_ms: u64,
    /// CLOCK_MONOTONIC, the clock of the BPF timestamps.
    now_ns: u64,
    counters: HealthCounters,
    totals: Vec<(u64, StackTotals)>,
    /// Each allocation, read only when its age or address is wanted: the
    /// totals are one map entry per stack.
    allocations: Option<Vec<(AllocationKey, Allocation)>>,
}

impl MapContents {
    fn read(args: &Args, tracer: &Tracer) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        let per_allocation = collect_options(args).keep_allocations || args.older.is_some();
        let totals = tracer.stack_totals()?;
        Ok(Self {
            started,
            time_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            now_ns: monotonic_ns(),
            counters: tracer.counters(&totals)?,
            totals,
            allocations: if per_allocation { Some(tracer.allocations()?) } else { None },
        })
    }
}

fn collect_options(args: &Args) -> CollectOptions {
    CollectOptions {
        min_age_ns: args.older.unwrap_or(0).saturating_mul(1_000_000),
        // A snapshot keeps each allocation.
        keep_allocations: args.show_allocs || args.save.is_some(),
    }
}

fn take_report(
    args: &Args,
    tracer: &Tracer,
    maps: &MapContents,
    target: &mut Target,
    stacks: &mut StackCatalog,
) -> anyhow::Result<Report> {
    let MapContents { time_unix_ms, now_ns, counters, ref totals, .. } = *maps;
    let options = collect_options(args);
    stacks.ensure(tracer, totals.iter().map(|(id, _)| *id))?;
    let mut snapshot = match &maps.allocations {
        Some(allocations) => {
            collector::aggregate(target.pid, time_unix_ms, now_ns, allocations, counters, options)
        }
        None => collector::from_totals(target.pid, time_unix_ms, totals, |id| stacks.owner(id), counters),
    };
    // pprof's alloc_space includes stacks whose every allocation was freed;
    // a snapshot keeps them for a pprof rendering later.
    let keep_freed = args.format() == Format::Pprof || args.save.is_some();
    collector::add_allocated(&mut snapshot, totals, |id| stacks.owner(id), keep_freed);
    let Target { program, plan, namespace_pid, symbolizer, trends, regions, .. } = target;
    stacks.ensure(tracer, regions.iter().map(|(_, region)| region.stack_id))?;
    collector::add_regions(&mut snapshot, regions, now_ns, options, args.all_mmaps, |region| {
        mappings::classify(region, &frames_of(symbolizer, stacks, region.stack_id))
    });
    stacks.ensure(tracer, snapshot.stacks.iter().map(|stack| stack.stack_id))?;
    let trends = trends.observe(&snapshot);
    let context = ReportContext {
        program,
        allocator: &plan.display_path,
        namespace_pid: *namespace_pid,
        min_age_ms: options.min_age_ns / 1_000_000,
        // A snapshot keeps every stack; it is cut after it is saved.
        top: if args.save.is_some() { usize::MAX } else { args.rendering.stacks_kept() },
        sort: args.sort,
        sample_rate: args.sample_rate,
    };
    let mut report =
        Report::build(snapshot, &context, &trends, |stack_id| frames_of(symbolizer, stacks, stack_id));
    if args.save.is_some() || args.format() == Format::Pprof {
        report.modules = modules_of(&report, &mut symbolizer.modules);
    }
    // `cargo xtask bench` reads this line for its report latencies: from
    // the maps' reading, for one process, to the report.
    log::debug!(
        "report for pid {}: {} stacks, {} allocations in {} ms",
        report.pid,
        report.total_stacks,
        report.total_allocations,
        maps.started.elapsed().as_millis()
    );
    Ok(report)
}

/// The program's code and the file mappings the report's frames fall in,
/// each once.
fn modules_of(report: &Report, modules: &mut ProcessModules) -> Vec<ModuleMapping> {
    let mut found: Vec<ModuleMapping> = modules.executable_mapping(&report.program).into_iter().collect();
    for frame in report.stacks.iter().flat_map(|stack| &stack.frames) {
        if found.iter().any(|module| module.start <= frame.address && frame.address < module.end) {
            continue;
        }
        found.extend(modules.module_mapping(frame.address));
    }
    found
}

/// The symbolized frames of a stack, symbolized once.
fn frames_of(symbolizer: &mut StackSymbolizer, stacks: &StackCatalog, stack_id: u64) -> Arc<[Frame]> {
    if let Some(frames) = symbolizer.cached(stack_id) {
        return frames;
    }
    let addresses = stacks.stacks.get(&stack_id).map_or(&[][..], StackKey::addresses);
    symbolizer.symbolize(stack_id, addresses)
}

fn wall_ns() -> i128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128)
}

fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills in the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
