//! The command line, resolved once into what each stage needs (ripgrep's
//! low-level and high-level arguments): a target, the tracer's settings,
//! what to collect, what to show and where to write it. Every check that
//! clap cannot express is made here, so nothing below `main` sees `Args`.

use std::{
    io::IsTerminal as _,
    net::SocketAddr,
    num::NonZeroU64,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use crate::{
    attach::AllocatorChoice,
    bpf::TracerSettings,
    cli::{
        Action, Args, Culprits, DiffArgs, ListenAddress, Probing, PythonFrames, Rendering as RenderingArgs,
        ReportArgs, ServeArgs, Targets, TopArgs, Unwind, DEFAULT_SERVE_PORT,
    },
    collect::CollectOptions,
    model::Unwinding,
    output::{Documents, OutputConfig},
    process::kubernetes::WorkloadFilter,
    report::{
        culprit::SkipRules,
        options::{DiffOrder, Format, Rendering, ReportOptions, SortKey, Weight},
    },
    session::{ReportRequest, Selector, SessionConfig, TargetSpec},
};

/// What memleak was asked to do.
pub enum Run {
    Trace(Box<TraceConfig>),
    /// `memleak report`: render a saved snapshot.
    Report(ReportConfig),
    /// `memleak diff`: compare two saved snapshots.
    Diff(DiffConfig),
    /// `memleak serve`: follow processes and serve their reports.
    Serve(Box<ServeConfig>),
    /// `memleak top` on a terminal: the live view.
    Top(Box<TopConfig>),
}

/// `memleak top`.
pub struct TopConfig {
    pub source: TopSource,
    /// Time between updates.
    pub interval: Duration,
    /// The order the table starts in.
    pub sort: SortKey,
    /// Where `s` saves snapshots, numbered after it.
    pub save: PathBuf,
    /// What each stack's culprit is looked for past, and which frames
    /// are plumbing.
    pub skips: Arc<SkipRules>,
}

/// Where `memleak top` takes its reports from.
pub enum TopSource {
    /// A session of its own.
    Trace { target: TargetSpec, session: SessionConfig },
    /// A `memleak serve` daemon; with pids, those of its processes only.
    Daemon { url: String, token_file: Option<PathBuf>, pids: Vec<u32> },
}

/// `memleak serve --pid PID... --cgroup PATH... --exe NAME... --container ID...`.
pub struct ServeConfig {
    /// What --pid, --cgroup and --exe name; --container's are found when
    /// the daemon starts, as cgroups.
    pub selectors: Vec<Selector>,
    /// --container: ids or names, each resolved to its cgroup.
    pub containers: Vec<String>,
    /// How long an exited process keeps its last report.
    pub retain: Duration,
    pub session: SessionConfig,
    pub listen: SocketAddr,
    /// --advertise: the HOST:PORT /api/v1/sd names, if given.
    pub advertise: Option<String>,
    /// Time between collections when nobody asks for one.
    pub interval: Duration,
    /// The bearer token's file, read at start.
    pub token_file: Option<PathBuf>,
    /// Stacks of each process shown in /metrics.
    pub metrics_top_stacks: usize,
    /// Where the node's root is (`--host-root`): the container runtimes'
    /// and the kubelet's files that name containers and pods are below.
    pub host_root: PathBuf,
    /// --state-dir, if given: where OOM kills are kept.
    pub state_dir: Option<PathBuf>,
    /// --watch: the selectors name what is watched, and only what grows
    /// is traced.
    pub watch: Option<crate::watch::WatchSettings>,
}

/// A tracing run.
pub struct TraceConfig {
    pub target: TargetSpec,
    pub session: SessionConfig,
    /// Time between reports.
    pub interval: Duration,
    /// Reports to print before exiting; until the end otherwise.
    pub count: Option<NonZeroU64>,
    pub collect: CollectOptions,
    /// What a report shows.
    pub shown: ReportOptions,
    pub output: OutputConfig,
    /// --save: where each report is saved whole.
    pub save: Option<PathBuf>,
    /// --stats: where machine-readable records of the run go.
    pub stats: Option<PathBuf>,
}

impl TraceConfig {
    /// What each round's reports are built with: every stack when they
    /// are saved (they are cut to what is shown after saving).
    pub fn request(&self) -> ReportRequest {
        let top = if self.save.is_some() { usize::MAX } else { self.shown.top };
        ReportRequest { collect: self.collect, sort: self.shown.sort, top, in_series: true }
    }

    /// Whether the run may write several documents, which are then
    /// numbered: several reports, or several processes.
    pub fn documents(&self) -> Documents {
        let several_reports = self.count.is_none_or(|count| count.get() > 1);
        let several_processes = match &self.target {
            TargetSpec::Pids(pids) => pids.len() > 1,
            TargetSpec::Cgroup(_) | TargetSpec::Selected(_) => true,
            TargetSpec::Kernel { .. } | TargetSpec::Command(_) => false,
        };
        if several_reports || several_processes {
            Documents::Several
        } else {
            Documents::One
        }
    }
}

/// `memleak report SNAPSHOT`.
pub struct ReportConfig {
    pub snapshot: PathBuf,
    pub shown: ReportOptions,
    pub output: OutputConfig,
    /// What each stack's culprit is looked for past.
    pub skips: SkipRules,
}

/// `memleak diff BASE NEW`.
pub struct DiffConfig {
    pub base: PathBuf,
    pub new: PathBuf,
    /// Stacks kept of those that grew, and of those that shrank.
    pub top: usize,
    pub order: DiffOrder,
    pub output: OutputConfig,
    /// What each stack's culprit is looked for past.
    pub skips: SkipRules,
}

/// Resolves the command line; the error is one line for the user.
pub fn resolve(args: Args) -> Result<Run, String> {
    match args.action {
        Some(Action::Report(report)) => resolve_report(report).map(Run::Report),
        Some(Action::Diff(diff)) => resolve_diff(diff).map(Run::Diff),
        Some(Action::Serve(serve)) => resolve_serve(*serve).map(|config| Run::Serve(Box::new(config))),
        Some(Action::Top(top)) => resolve_top(*top, std::io::stdout().is_terminal()),
        None => resolve_trace(args).map(|config| Run::Trace(Box::new(config))),
    }
}

/// `memleak top`, on a terminal; the plain text reports of the same
/// processes otherwise, as a pipe or a file wants them.
fn resolve_top(args: TopArgs, terminal: bool) -> Result<Run, String> {
    check_filters(&args.probing)?;
    let skips = Arc::new(skip_rules(&args.culprits)?);
    let source = if let Some(url) = args.connect {
        TopSource::Daemon { url, token_file: args.token_file, pids: args.target.pid.clone() }
    } else {
        let target = process_target(&args.target)?.ok_or(
            "memleak top needs processes: give -p PID, -c \"CMD ARGS\", --cgroup PATH or --connect URL",
        )?;
        let session = session_config(&target, &args.target, &args.probing, &args.culprits, false)?;
        if !terminal {
            return Ok(Run::Trace(Box::new(plain_top(target, session, &args))));
        }
        TopSource::Trace { target, session }
    };
    if !terminal {
        return Err("memleak top --connect needs a terminal: the daemon's /api/v1/report?pid=PID gives its plain reports".to_owned());
    }
    Ok(Run::Top(Box::new(TopConfig {
        source,
        interval: args.interval,
        sort: args.sort,
        save: args.save,
        skips,
    })))
}

/// What `memleak top` without a terminal runs: a trace with text reports
/// of the ten largest stacks, as `memleak` itself prints them.
fn plain_top(target: TargetSpec, session: SessionConfig, args: &TopArgs) -> TraceConfig {
    let rendering = Rendering { format: Format::Text, weight: Weight::Bytes, full_stacks: false };
    TraceConfig {
        target,
        session,
        interval: args.interval,
        count: None,
        collect: CollectOptions::NONE,
        shown: ReportOptions { top: 10, sort: args.sort, show_allocs: false },
        output: OutputConfig { path: None, force: false, rendering },
        save: None,
        stats: None,
    }
}

fn resolve_trace(args: Args) -> Result<TraceConfig, String> {
    let target = target_of(&args)?;
    check_filters(&args.probing)?;
    let output = output_of(&args.rendering, args.save.is_some())?;
    let format = output.rendering.format;
    if args.trace && !matches!(format, Format::Text | Format::Json) {
        return Err("--trace prints lines: use it with --format text or json".to_owned());
    }
    let saving = args.save.is_some();
    let collect = CollectOptions {
        min_age_ns: args.older.map(|ms| ms.saturating_mul(1_000_000)),
        // A snapshot keeps each allocation, the stacks that freed
        // everything, and the mappings, for any rendering later.
        each_allocation: args.show_allocs || saving,
        freed_stacks: format.shows_freed_stacks() || saving,
        modules: format.needs_modules() || saving,
        all_mmaps: args.all_mmaps,
        born_since_ns: None,
    };
    let session = session_config(&target, &args.target, &args.probing, &args.culprits, args.trace)?;
    Ok(TraceConfig {
        target,
        session,
        interval: args.interval,
        count: args.count,
        collect,
        shown: shown(&args.rendering, args.sort, args.show_allocs, format),
        output,
        save: args.save,
        stats: args.stats,
    })
}

/// The one target the flags name: without -p, -c or --cgroup, memleak
/// traces the kernel's allocations, as bcc's memleak does.
fn target_of(args: &Args) -> Result<TargetSpec, String> {
    let target = process_target(&args.target)?.unwrap_or(TargetSpec::Kernel { percpu: args.percpu });
    if args.percpu && !matches!(target, TargetSpec::Kernel { .. }) {
        return Err("--percpu is for kernel tracing: leave out -p and -c".to_owned());
    }
    if let TargetSpec::Kernel { .. } = target {
        let user_only = [
            (args.probing.object.is_some(), "-O"),
            (args.probing.symbols_prefix.is_some(), "--symbols-prefix"),
            (args.trace, "--trace"),
            (args.all_mmaps, "--all-mmaps"),
        ];
        if let Some((_, flag)) = user_only.iter().find(|(given, _)| *given) {
            return Err(format!("{flag} needs a process: give -p PID or -c \"CMD ARGS\""));
        }
    }
    Ok(target)
}

/// The processes -p, -c or --cgroup name, if any, with --follow-forks
/// and --no-follow-forks checked against them.
fn process_target(targets: &Targets) -> Result<Option<TargetSpec>, String> {
    let target = match (&targets.command, &targets.cgroup, targets.pid.is_empty()) {
        (Some(command), _, _) => Some(TargetSpec::Command(command.clone())),
        (None, Some(cgroup), _) => Some(TargetSpec::Cgroup(cgroup.clone())),
        (None, None, false) => Some(TargetSpec::Pids(targets.pid.clone())),
        (None, None, true) => None,
    };
    if targets.follow_forks && !matches!(target, Some(TargetSpec::Pids(_))) {
        return Err(
            "--follow-forks is for -p (-c follows forks already, and --cgroup its newcomers)".to_owned()
        );
    }
    if targets.no_follow_forks && !matches!(target, Some(TargetSpec::Command(_))) {
        return Err("--no-follow-forks is for -c: -p follows no forks unless given --follow-forks".to_owned());
    }
    if let Some(TargetSpec::Pids(pids)) = &target {
        check_unique(pids)?;
    }
    Ok(target)
}

/// What a session tracing `target` is started with; `trace_events`:
/// --trace.
fn session_config(
    target: &TargetSpec,
    targets: &Targets,
    probing: &Probing,
    culprits: &Culprits,
    trace_events: bool,
) -> Result<SessionConfig, String> {
    Ok(SessionConfig {
        tracer: tracer_settings(probing, trace_events),
        allocator: allocator_choice(probing),
        skips: Arc::new(skip_rules(culprits)?),
        follow_forks: match target {
            TargetSpec::Command(_) => !targets.no_follow_forks,
            // A cgroup's processes are probed one by one: the processes
            // they fork are found at once, not at the next look.
            TargetSpec::Cgroup(_) => true,
            _ => targets.follow_forks,
        },
        // Known once the output is open: see `report_loop::run`.
        excluded: Vec::new(),
        oom_kills: false,
    })
}

/// The built-in table of frames passed over, unless --no-default-skips,
/// and the --skip-frames patterns.
fn skip_rules(culprits: &Culprits) -> Result<SkipRules, String> {
    for pattern in &culprits.skip_frames {
        if let Err(error) = regex::Regex::new(pattern) {
            // The parser's message spans lines, with a caret under the
            // fault; its last line says what is wrong.
            let reason = error.to_string();
            let reason = reason.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or("").trim();
            let reason = reason.strip_prefix("error: ").unwrap_or(reason);
            return Err(format!("--skip-frames `{pattern}` is not a regular expression: {reason}"));
        }
    }
    SkipRules::new(!culprits.no_default_skips, &culprits.skip_frames).map_err(|error| error.to_string())
}

fn check_filters(probing: &Probing) -> Result<(), String> {
    if let (Some(min), Some(max)) = (probing.min_size, probing.max_size) {
        if min > max {
            return Err(format!("--min-size {min} is larger than --max-size {max}"));
        }
    }
    if probing.symbols_prefix.as_deref() == Some("") {
        return Err("--symbols-prefix needs a prefix, such as je_".to_owned());
    }
    Ok(())
}

/// What the tracer is told of the allocations to record and the maps to
/// size; `trace_events`: each allocation and free is also sent to user
/// space (--trace).
fn tracer_settings(probing: &Probing, trace_events: bool) -> TracerSettings {
    TracerSettings {
        min_size: probing.min_size.unwrap_or(0),
        max_size: probing.max_size.unwrap_or(u64::MAX),
        stack_depth: probing.max_stack_depth,
        max_allocations: probing.max_allocs,
        max_stacks: probing.max_stacks,
        max_processes: probing.max_processes,
        sample_rate: probing.sample_rate,
        trace_events,
        unwinding: match probing.unwind {
            Unwind::Dwarf => Unwinding::Dwarf,
            Unwind::Fp => Unwinding::FramePointers,
        },
        max_unwind_rows: probing.max_unwind_rows,
        stack_reuse: !probing.no_stack_reuse,
        python_max_frames: (probing.python == PythonFrames::Auto).then_some(probing.max_python_depth),
    }
}

fn allocator_choice(probing: &Probing) -> AllocatorChoice {
    AllocatorChoice {
        object: probing.object.clone(),
        prefix: probing.symbols_prefix.clone(),
        python_allocator: probing.python_allocator,
    }
}

/// Where reports go and in which format: --format, else what the --output
/// file's extension names, else text. `saving`: --save was given, which
/// --force applies to as well.
fn output_of(rendering: &RenderingArgs, saving: bool) -> Result<OutputConfig, String> {
    if rendering.force && rendering.output.is_none() && !saving {
        return Err("--force is for overwriting the --output (or --save) files: give one".to_owned());
    }
    let format = match (rendering.format, &rendering.output) {
        (Some(format), _) => format,
        (None, None) => Format::Text,
        (None, Some(output)) => Format::of_file(output).ok_or_else(|| {
            format!(
                "cannot tell the format of {} from its extension (.svg, .pb.gz, .folded, .json, .txt): give --format",
                output.display()
            )
        })?,
    };
    Ok(OutputConfig {
        path: rendering.output.clone(),
        force: rendering.force,
        rendering: Rendering { format, weight: rendering.weight, full_stacks: rendering.full_stacks },
    })
}

/// What a report shows: a flame graph needs every stack, not the top N.
fn shown(
    rendering: &RenderingArgs,
    sort: crate::report::options::SortKey,
    show_allocs: bool,
    format: Format,
) -> ReportOptions {
    let top = if format.wants_every_stack() { usize::MAX } else { rendering.top };
    ReportOptions { sort, top, show_allocs }
}

/// The daemon takes the trace command's tracing flags (`Probing`), with
/// the same defaults. Beyond loopback it wants a token: the reports name
/// a host's programs and their files.
/// A directory holding a root file system: one with `etc`, `var` or
/// `run` (the runtimes' and the kubelet's files are in the last two). A
/// wrong path would otherwise only leave every pod unnamed, without a
/// word. Checked here, not when the flag is parsed: `--help` after it
/// must not depend on the machine (the Kubernetes manifest's arguments are
/// checked so).
fn check_host_root(path: &Path) -> Result<(), String> {
    let text = path.display();
    match std::fs::metadata(path) {
        Err(error) => Err(format!("--host-root `{text}`: {}", crate::status::os_reason(&error))),
        Ok(metadata) if !metadata.is_dir() => Err(format!("--host-root `{text}` is not a directory")),
        Ok(_) if !["etc", "var", "run"].iter().any(|dir| path.join(dir).is_dir()) => Err(format!(
            "--host-root `{text}` does not look like a root file system: it has no etc/, var/ or run/"
        )),
        Ok(_) => Ok(()),
    }
}

fn resolve_serve(args: ServeArgs) -> Result<ServeConfig, String> {
    let listen = listen_address(&args.listen, args.port)?;
    if !listen.ip().is_loopback() && args.token_file.is_none() {
        return Err(format!(
            "--listen {}: beyond loopback, memleak serve needs --token-file FILE, the token clients must send",
            args.listen.given
        ));
    }
    check_unique(&args.pid)?;
    check_filters(&args.probing)?;
    check_host_root(&args.host_root)?;
    let workload = workload_filter(&args)?;
    let selected = !args.pid.is_empty() || selected_beyond_pids(&args) || workload.is_some();
    if !selected && !args.watching.watch {
        return Err("memleak serve needs something to follow: give --pid, --cgroup, --exe, --container, \
                    --namespace, --pod or --container-name, or --watch to watch every process"
            .to_owned());
    }
    let watch = watch_settings(&args.watching)?;
    if let Some(bad) = args.exe.iter().find(|name| name.is_empty() || name.contains('/')) {
        return Err(format!(
            "--exe `{bad}`: give an executable's file name, such as nginx, not a path (it matches any path)"
        ));
    }
    // Newcomers are probed one by one: the processes they fork are found
    // at once, not at the next look. A watch traces the process found
    // growing, not its children.
    let follows_newcomers = watch.is_none() && (selected_beyond_pids(&args) || workload.is_some());
    let selectors = args
        .pid
        .iter()
        .map(|&pid| Selector::Pid(pid))
        .chain(args.cgroup.iter().cloned().map(Selector::Cgroup))
        .chain(args.exe.iter().cloned().map(Selector::Exe))
        .chain(workload.map(Selector::Workload))
        .collect();
    let session = SessionConfig {
        tracer: tracer_settings(&args.probing, false),
        allocator: allocator_choice(&args.probing),
        skips: Arc::new(skip_rules(&args.culprits)?),
        follow_forks: follows_newcomers,
        // memleak itself, known once it runs: see `serve::run`.
        excluded: Vec::new(),
        oom_kills: true,
    };
    Ok(ServeConfig {
        selectors,
        containers: args.container,
        retain: args.retain,
        session,
        listen,
        advertise: args.advertise,
        interval: args.interval,
        token_file: args.token_file,
        metrics_top_stacks: usize::from(args.metrics_top_stacks),
        host_root: args.host_root,
        state_dir: args.state_dir,
        watch,
    })
}

/// Whether --cgroup, --exe or --container select processes: those that
/// start or join later too.
fn selected_beyond_pids(args: &ServeArgs) -> bool {
    !(args.cgroup.is_empty() && args.exe.is_empty() && args.container.is_empty())
}

/// --watch's settings, checked; `None` without --watch.
fn watch_settings(watching: &crate::cli::Watching) -> Result<Option<crate::watch::WatchSettings>, String> {
    if !watching.watch {
        return Ok(None);
    }
    let watch = crate::watch::WatchSettings {
        every: watching.watch_every,
        rule: crate::watch::growth::GrowthRule {
            window: watching.growth_window,
            min_bytes_per_second: watching.min_growth,
        },
        trace_for: watching.trace_for,
        max_traced: usize::from(watching.max_traced),
        max_overhead: watching.max_overhead,
    };
    if watch.every.is_zero() || watch.trace_for.is_zero() {
        return Err("--watch-every and --trace-for must be longer than nothing".to_owned());
    }
    // Four quarters of two samples each at least.
    if watch.rule.window < watch.every * 8 {
        return Err(format!(
            "--growth-window {}s holds fewer than 8 looks every {}s: give a longer window or a shorter --watch-every",
            watch.rule.window.as_secs(),
            watch.every.as_secs()
        ));
    }
    Ok(Some(watch))
}

/// The address --listen and --port name together. Both forms are taken:
/// `--listen HOST --port N` as before, and `--listen HOST:PORT` as
/// Prometheus exporters take `--web.listen-address`; a port given both
/// ways is refused rather than one of them silently winning.
fn listen_address(listen: &ListenAddress, port: Option<u16>) -> Result<SocketAddr, String> {
    match (listen.port, port) {
        (Some(_), Some(port)) => Err(format!(
            "--listen {} names its port already: drop --port {port}, or give --listen {} --port {port}",
            listen.given, listen.ip
        )),
        (Some(port), None) | (None, Some(port)) => Ok(SocketAddr::new(listen.ip, port)),
        (None, None) => Ok(SocketAddr::new(listen.ip, DEFAULT_SERVE_PORT)),
    }
}

/// --namespace, --pod and --container-name as one selector, if any is
/// given: a container must match each. A --pod that is no regular
/// expression is refused here, before anything is loaded.
fn workload_filter(args: &ServeArgs) -> Result<Option<WorkloadFilter>, String> {
    if args.namespace.is_empty() && args.pod.is_none() && args.container_name.is_empty() {
        return Ok(None);
    }
    if let Some(pattern) = &args.pod {
        WorkloadFilter::pod_regex(pattern)?;
    }
    Ok(Some(WorkloadFilter {
        namespaces: args.namespace.clone(),
        pod: args.pod.clone(),
        container_names: args.container_name.clone(),
        host_root: args.host_root.clone(),
    }))
}

fn check_unique(pids: &[u32]) -> Result<(), String> {
    let mut sorted = pids.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        Some(&[pid, _]) => Err(format!("pid {pid} is given twice")),
        _ => Ok(()),
    }
}

fn resolve_report(args: ReportArgs) -> Result<ReportConfig, String> {
    let output = output_of(&args.rendering, false)?;
    let shown = shown(&args.rendering, args.sort, args.show_allocs, output.rendering.format);
    Ok(ReportConfig { snapshot: args.snapshot, shown, output, skips: skip_rules(&args.culprits)? })
}

fn resolve_diff(args: DiffArgs) -> Result<DiffConfig, String> {
    let output = output_of(&args.rendering, false)?;
    let top = if output.rendering.format.wants_every_stack() { usize::MAX } else { args.rendering.top };
    Ok(DiffConfig {
        base: args.base,
        new: args.new,
        top,
        order: args.sort,
        output,
        skips: skip_rules(&args.culprits)?,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn resolved(line: &str) -> Result<Run, String> {
        let args = Args::try_parse_from(std::iter::once("memleak").chain(line.split_whitespace()))
            .map_err(|error| error.to_string())?;
        resolve(args)
    }

    fn trace(line: &str) -> TraceConfig {
        match resolved(line) {
            Ok(Run::Trace(config)) => *config,
            Ok(_) => panic!("{line}: not a trace"),
            Err(error) => panic!("{line}: {error}"),
        }
    }

    #[test]
    fn the_flags_name_one_target() {
        assert_eq!(trace("").target, TargetSpec::Kernel { percpu: false });
        assert_eq!(trace("--percpu").target, TargetSpec::Kernel { percpu: true });
        assert_eq!(trace("-p 1,2").target, TargetSpec::Pids(vec![1, 2]));
        assert_eq!(trace("--cgroup /sys/fs/cgroup/x").target, TargetSpec::Cgroup("/sys/fs/cgroup/x".into()));
        assert_eq!(trace("-c ls").target, TargetSpec::Command("ls".to_owned()));
    }

    #[test]
    fn what_a_round_collects_follows_the_flags() {
        let plain = trace("-p 1");
        assert_eq!(plain.collect, CollectOptions::default(), "per-stack totals only");
        assert_eq!((plain.request().top, plain.shown.top), (10, 10));
        let pprof = trace("-p 1 --format pprof");
        assert!(pprof.collect.freed_stacks && pprof.collect.modules && !pprof.collect.each_allocation);
        assert_eq!(pprof.shown.top, usize::MAX);
        let saved = trace("-p 1 --save heap.snap -T 3");
        assert!(saved.collect.each_allocation && saved.collect.freed_stacks && saved.collect.modules);
        assert_eq!((saved.request().top, saved.shown.top), (usize::MAX, 3), "saved whole, shown cut");
        assert_eq!(trace("-p 1 -o 0").collect.min_age_ns, Some(0), "-o 0 still ages each allocation");
        assert!(trace("-p 1 -o 0").collect.reads_each_allocation());
    }

    #[test]
    fn several_documents_are_numbered() {
        assert_eq!(trace("-p 1 1 1").documents(), Documents::One);
        assert_eq!(trace("-p 1 1 2").documents(), Documents::Several);
        assert_eq!(trace("-p 1,2 1 1").documents(), Documents::Several);
        assert_eq!(trace("--cgroup /x 1 1").documents(), Documents::Several);
        assert_eq!(trace("-c ls").documents(), Documents::Several, "no count: a report per interval");
    }

    fn serve(line: &str) -> Result<ServeConfig, String> {
        match resolved(line)? {
            Run::Serve(config) => Ok(*config),
            _ => panic!("{line}: not serve"),
        }
    }

    #[test]
    fn serve_watch_takes_every_process_by_default_and_checks_its_settings() {
        let config = serve("serve --watch").unwrap_or_else(|error| panic!("{error}"));
        let watch = config.watch.unwrap();
        assert_eq!(config.selectors, Vec::new());
        assert_eq!(
            (watch.every, watch.rule.window, watch.trace_for),
            (Duration::from_secs(5), Duration::from_mins(5), Duration::from_mins(2))
        );
        assert!((watch.rule.min_bytes_per_second - 1024.0 * 1024.0 / 60.0).abs() < 1e-9);
        assert_eq!(watch.max_traced, 2);
        assert!(!config.session.follow_forks, "a watch traces what grows, not its forks");
        let config = serve(
            "serve --watch --exe redis-server --min-growth 64KiB/s --growth-window 1m --watch-every 2s",
        )
        .unwrap_or_else(|error| panic!("{error}"));
        let watch = config.watch.unwrap();
        assert_eq!(config.selectors, vec![Selector::Exe("redis-server".to_owned())]);
        assert_eq!((watch.rule.min_bytes_per_second, watch.every), (65536.0, Duration::from_secs(2)));
        assert_eq!(
            serve("serve --watch --growth-window 30s --watch-every 5s").err().as_deref(),
            Some("--growth-window 30s holds fewer than 8 looks every 5s: give a longer window or a shorter --watch-every")
        );
    }

    #[test]
    fn serve_listens_on_loopback_only() {
        let config = serve("serve --pid 1,2").unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(config.selectors, vec![Selector::Pid(1), Selector::Pid(2)]);
        assert_eq!(config.listen.to_string(), "127.0.0.1:9943");
        assert_eq!(config.interval, Duration::from_secs(2));
        let config = serve("serve --pid 1 --listen ::1 --port 80").unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(config.listen.to_string(), "[::1]:80");
        assert_eq!(
            serve("serve --pid 1 --listen 0.0.0.0").err().as_deref(),
            Some("--listen 0.0.0.0: beyond loopback, memleak serve needs --token-file FILE, the token clients must send")
        );
        let config = serve("serve --pid 1 --listen 0.0.0.0 --token-file /etc/memleak/token")
            .unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(config.token_file, Some(PathBuf::from("/etc/memleak/token")));
        assert_eq!(serve("serve --pid 3,3").err().as_deref(), Some("pid 3 is given twice"));
        assert_eq!(
            serve("serve").err().as_deref(),
            Some(
                "memleak serve needs something to follow: give --pid, --cgroup, --exe, --container, \
                 --namespace, --pod or --container-name, or --watch to watch every process"
            )
        );
    }

    /// Where each --listen form binds: Prometheus exporters' HOST:PORT
    /// forms, and today's --listen HOST --port N.
    #[test]
    fn serve_listens_where_each_listen_form_says() {
        let listen = |line: &str| serve(line).map(|config| config.listen.to_string());
        let token = "--token-file /t";
        for (flags, bound) in [
            ("--listen 127.0.0.1:9000", "127.0.0.1:9000"),
            ("--listen [::1]:9001", "[::1]:9001"),
            ("--listen [::1]", "[::1]:9943"),
            ("--listen 127.0.0.2 --port 9002", "127.0.0.2:9002"),
            (&format!("--listen :9003 {token}"), "0.0.0.0:9003"),
            (&format!("--listen 0.0.0.0:0 {token}"), "0.0.0.0:0"),
            ("--port 9004", "127.0.0.1:9004"),
        ] {
            assert_eq!(listen(&format!("serve --pid 1 {flags}")).as_deref(), Ok(bound), "{flags}");
        }
        assert_eq!(
            listen("serve --pid 1 --listen 127.0.0.1:9000 --port 9001"),
            Err("--listen 127.0.0.1:9000 names its port already: drop --port 9001, or give --listen 127.0.0.1 \
                 --port 9001"
                .to_owned())
        );
        assert_eq!(
            listen("serve --pid 1 --listen :9943"),
            Err("--listen :9943: beyond loopback, memleak serve needs --token-file FILE, the token clients must send"
                .to_owned())
        );
        let refused = |value: &str| {
            let line = ["memleak", "serve", "--pid", "1", "--listen", value];
            crate::cli::describe_error(&Args::try_parse_from(line).expect_err(value))
        };
        assert_eq!(
            refused("localhost:9943"),
            "invalid value `localhost:9943` for `--listen <ADDR>`: `localhost:9943` is not an address to listen \
             on: give an IP address (127.0.0.1, ::1), IP:PORT, [IPv6]:PORT or :PORT"
        );
        assert_eq!(
            refused(":99999"),
            "invalid value `:99999` for `--listen <ADDR>`: `:99999`: `99999` is not a port (0 to 65535)"
        );
        assert_eq!(
            refused("127.0.0.1:x"),
            "invalid value `127.0.0.1:x` for `--listen <ADDR>`: `127.0.0.1:x`: `x` is not a port (0 to 65535)"
        );
    }

    #[test]
    fn a_host_root_must_be_a_root_file_system() {
        let refused =
            |root: &str| serve(&format!("serve --pid 1 --host-root {root}")).err().unwrap_or_default();
        assert_eq!(refused("/dev/zero"), "--host-root `/dev/zero` is not a directory");
        assert_eq!(
            refused("/proc/self/fdinfo"),
            "--host-root `/proc/self/fdinfo` does not look like a root file system: it has no etc/, var/ or run/"
        );
        assert_eq!(refused("/nonexistent"), "--host-root `/nonexistent`: No such file or directory");
        assert!(serve("serve --pid 1 --host-root /").is_ok());
    }

    #[test]
    fn serve_advertises_host_and_port_as_given() {
        let advertise = |value: &str| {
            resolved(&format!("serve --pid 1 --advertise {value}")).map(|run| match run {
                Run::Serve(config) => config.advertise,
                _ => panic!("not serve"),
            })
        };
        for good in ["10.0.0.7:9943", "[fd00::7]:9943", "memleak.node-a.svc:80"] {
            assert_eq!(advertise(good), Ok(Some(good.to_owned())));
        }
        for bad in ["10.0.0.7", "fd00::7:9943", ":9943", "a b:1", "host:port"] {
            assert!(advertise(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn serve_takes_a_pods_filters_as_one_selector() {
        let config =
            serve("serve --namespace shop --namespace data --pod web-.* --container-name nginx --exe x")
                .unwrap_or_else(|error| panic!("{error}"));
        let filter = WorkloadFilter {
            namespaces: vec!["shop".to_owned(), "data".to_owned()],
            pod: Some("web-.*".to_owned()),
            container_names: vec!["nginx".to_owned()],
            host_root: PathBuf::from("/"),
        };
        assert_eq!(config.selectors, vec![Selector::Exe("x".to_owned()), Selector::Workload(filter)]);
        assert!(config.session.follow_forks);
        // A directory that looks like a root: --host-root checks.
        let host = std::env::temp_dir().join(format!("memleak-host-root-{}", std::process::id()));
        std::fs::create_dir_all(host.join("etc")).unwrap();
        let config = serve(&format!("serve --namespace shop --host-root {}", host.display()))
            .unwrap_or_else(|error| panic!("{error}"));
        let _ = std::fs::remove_dir_all(&host);
        let Some(Selector::Workload(filter)) = config.selectors.first() else {
            panic!("{:?}", config.selectors)
        };
        assert_eq!(filter.host_root, host);
        let refused = serve("serve --pod web-(").err().unwrap_or_default();
        assert_eq!(refused, "--pod `web-(` is not a regular expression: unclosed group");
    }

    #[test]
    fn serve_combines_selectors_and_retains_exited_processes_10_minutes_by_default() {
        let config =
            serve("serve --pid 7 --exe leaker --cgroup /sys/fs/cgroup/pod --exe nginx --container web")
                .unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(
            config.selectors,
            vec![
                Selector::Pid(7),
                Selector::Cgroup("/sys/fs/cgroup/pod".into()),
                Selector::Exe("leaker".to_owned()),
                Selector::Exe("nginx".to_owned()),
            ]
        );
        assert_eq!(config.containers, vec!["web".to_owned()]);
        assert_eq!(config.retain, Duration::from_mins(10));
        assert!(config.session.follow_forks, "a newcomer's children are found at their fork");
        assert_eq!(config.session.tracer.max_processes, crate::cli::DEFAULT_MAX_PROCESSES);
        let config =
            serve("serve --exe x --retain 30s --max-processes 3").unwrap_or_else(|error| panic!("{error}"));
        assert_eq!((config.retain, config.session.tracer.max_processes), (Duration::from_secs(30), 3));
        for (retain, seconds) in [("2s", 2), ("10m", 600), ("1h", 3600), ("2d", 172_800), ("0s", 0)] {
            let line = format!("serve --exe x --retain {retain}");
            let config = serve(&line).unwrap_or_else(|error| panic!("{error}"));
            assert_eq!(config.retain, Duration::from_secs(seconds), "{retain}");
        }
        assert!(!serve("serve --pid 1").unwrap_or_else(|error| panic!("{error}")).session.follow_forks);
    }

    #[test]
    fn serve_takes_the_tracing_flags_of_the_trace_command() {
        let config = serve("serve --pid 1 -s 10 --max-allocs 5000 --max-stacks 300 --unwind fp -z 64 -Z 4096 --symbols-prefix je_")
            .unwrap_or_else(|error| panic!("{error}"));
        let tracer = &config.session.tracer;
        assert_eq!(
            (tracer.sample_rate, tracer.max_allocations, tracer.max_stacks, tracer.min_size, tracer.max_size),
            (10, 5000, 300, 64, 4096)
        );
        assert_eq!(tracer.unwinding, Unwinding::FramePointers);
        assert_eq!(config.session.allocator.prefix.as_deref(), Some("je_"));
        assert_eq!(
            serve("serve --pid 1 -z 100 -Z 10").err().as_deref(),
            Some("--min-size 100 is larger than --max-size 10")
        );
    }

    #[test]
    fn serve_refuses_a_bad_retain_or_exe_in_one_line() {
        for (retain, why) in [
            ("10", "`10` has no unit"),
            ("ten", "`ten` is not a duration"),
            ("5y", "`5y` is not a duration"),
            ("400d", "`400d` is longer than a year"),
        ] {
            let line = format!("serve --exe x --retain {retain}");
            let error = resolved(&line).err().unwrap_or_else(|| panic!("{line} was accepted"));
            assert!(error.contains(why), "{line}: {error}");
        }
        assert_eq!(
            serve("serve --exe /usr/bin/leaker").err().as_deref(),
            Some("--exe `/usr/bin/leaker`: give an executable's file name, such as nginx, not a path (it matches any path)")
        );
    }

    #[test]
    fn serve_shows_5_stacks_per_process_unless_told_between_0_and_100() {
        let top = |line: &str| serve(line).map(|config| config.metrics_top_stacks);
        assert_eq!(top("serve --pid 1"), Ok(5));
        assert_eq!(top("serve --pid 1 --metrics-top-stacks 0"), Ok(0));
        assert_eq!(top("serve --pid 1 --metrics-top-stacks 100"), Ok(100));
        assert!(top("serve --pid 1 --metrics-top-stacks 101").is_err(), "more than 100 is refused");
    }

    #[test]
    fn contradictions_are_refused_in_one_line() {
        let error = |line: &str| resolved(line).err().unwrap_or_else(|| panic!("{line} was accepted"));
        assert_eq!(error("-p 1 --percpu"), "--percpu is for kernel tracing: leave out -p and -c");
        assert_eq!(error("--trace"), "--trace needs a process: give -p PID or -c \"CMD ARGS\"");
        assert_eq!(error("-p 1,1"), "pid 1 is given twice");
        assert_eq!(error("-p 1 -z 10 -Z 5"), "--min-size 10 is larger than --max-size 5");
        assert_eq!(
            error("-p 1 --force"),
            "--force is for overwriting the --output (or --save) files: give one"
        );
        assert!(error("-p 1 --output x.bin").starts_with("cannot tell the format of x.bin"));
        assert_eq!(
            error("-p 1 --trace --format svg"),
            "--trace prints lines: use it with --format text or json"
        );
        assert_eq!(error("-p 1 --symbols-prefix="), "--symbols-prefix needs a prefix, such as je_");
    }
}
