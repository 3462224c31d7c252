//! The workload untraced and under each tracer, interleaved so that drift
//! in the machine's speed hits them all alike, and the table of medians.
//! Each run uses one of the workload's two builds, with and without frame
//! pointers, and is compared with the untraced run of the same build.

use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use super::{
    empty_probes::{EmptyProbes, Site},
    median,
    process::{run_attached, run_to_end, Finished, Usage},
    workload::{Build, Summary, Workload},
};

/// What runs the workload.
pub enum Tracer {
    Untraced,
    /// memleak recording about one allocation in `sample_rate`, walking
    /// stacks with `unwinder`.
    Memleak {
        sample_rate: u32,
        unwinder: Unwinder,
    },
    /// A bpftrace script, which bpftrace's -c starts the workload under.
    Bpftrace {
        script: std::path::PathBuf,
    },
    Heaptrack,
    EmptyProbes(Vec<Site>),
}

/// How memleak walks user stacks (its --unwind).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Unwinder {
    /// By each object's `.eh_frame` unwind tables: memleak's default.
    Dwarf,
    /// By frame pointers only.
    FramePointers,
}

impl Unwinder {
    /// Said explicitly even for the default, so that a row labelled with
    /// an unwinder keeps measuring it if the default changes.
    fn argument(self) -> &'static str {
        match self {
            Unwinder::Dwarf => "dwarf",
            Unwinder::FramePointers => "fp",
        }
    }
}

/// One row of the table: a tracer, the build it runs, and its runs so far.
pub struct Contender {
    pub label: &'static str,
    pub build: Build,
    pub tracer: Tracer,
    pub runs: Vec<Run>,
    /// Why it has no (more) runs: the rest of the bench goes on without it.
    pub failure: Option<String>,
}

impl Contender {
    pub fn new(label: &'static str, build: Build, tracer: Tracer) -> Self {
        Self { label, build, tracer, runs: Vec::new(), failure: None }
    }

    pub fn unavailable(label: &'static str, build: Build, tracer: Tracer, why: &str) -> Self {
        Self { failure: Some(why.to_owned()), ..Self::new(label, build, tracer) }
    }

    pub fn median_ns(&self) -> Option<u64> {
        median(&self.runs.iter().map(|run| run.elapsed_ns).collect::<Vec<_>>())
    }

    fn is_full_memleak(&self) -> bool {
        matches!(self.tracer, Tracer::Memleak { sample_rate: 1, .. })
    }
}

/// One timed run of the workload.
pub struct Run {
    pub elapsed_ns: u64,
    pub leaked_bytes: u64,
    /// What memleak reported under `leak_one()`, scaled by its sample rate.
    pub reported_bytes: Option<u64>,
    /// memleak's own CPU time and peak memory.
    pub memleak_usage: Option<Usage>,
    /// The CPU time of every process the run took (user+sys): the
    /// workload's (with the BPF programs run in its context) and the
    /// tracer's own, heaptrack's `heaptrack_interpret` included.
    pub cpu_ns: u64,
}

/// Runs every contender once per round. Untraced runs are what every ratio
/// divides by, so their failure ends the bench; any other contender that
/// fails is left out from then on.
pub fn measure(contenders: &mut [Contender], workload: &Workload, rounds: usize) -> Result<()> {
    for round in 1..=rounds {
        for contender in contenders.iter_mut().filter(|contender| contender.failure.is_none()) {
            eprintln!("bench: run {round}/{rounds}: {}", contender.label);
            match run_once(&contender.tracer, contender.build, workload) {
                Ok(run) => contender.runs.push(run),
                Err(error) if matches!(contender.tracer, Tracer::Untraced) => return Err(error),
                Err(error) => {
                    eprintln!("bench: {} failed, left out from now on: {error:#}", contender.label);
                    contender.failure = Some(format!("failed: {error:#}"));
                }
            }
        }
    }
    Ok(())
}

/// Runs `build` of the workload once under `tracer`.
pub fn run_once(tracer: &Tracer, build: Build, workload: &Workload) -> Result<Run> {
    let path = workload.path(build);
    let env = || workload.env.iter().map(|(name, value)| (name, value));
    let finished = match tracer {
        Tracer::Untraced => run_to_end(Command::new(path).args(&workload.args).envs(env()))?,
        &Tracer::Memleak { sample_rate, unwinder } => {
            run_to_end(&mut memleak_command(workload, build, sample_rate, unwinder))?
        }
        Tracer::Bpftrace { script } => run_to_end(
            Command::new("bpftrace").arg(script).args(["-c", &workload.command_line(build)]).envs(env()),
        )?,
        Tracer::Heaptrack => {
            let mut command = Command::new("heaptrack");
            command.arg(path).args(&workload.args).envs(env()).current_dir(&workload.scratch);
            let finished = run_to_end(&mut command);
            remove_heaptrack_data(&workload.scratch);
            finished?
        }
        Tracer::EmptyProbes(sites) => {
            run_attached(path, &workload.args, &workload.env, |pid| EmptyProbes::attach(sites, pid))?
        }
    };
    let summary = Summary::parse(&finished.stderr)?;
    let mut run = Run {
        elapsed_ns: summary.elapsed_ns,
        leaked_bytes: summary.leaked_bytes,
        reported_bytes: None,
        memleak_usage: None,
        cpu_ns: finished.usage.cpu_ns,
    };
    if let Tracer::Memleak { .. } = tracer {
        run.reported_bytes = Some(leak_one_bytes(&finished)?);
        // memleak reaps its -c command, so the kernel charges memleak with
        // the workload's time too. Peak memory is the larger of the two's,
        // which is memleak's.
        run.memleak_usage = Some(Usage {
            cpu_ns: finished.usage.cpu_ns.saturating_sub(summary.cpu_ns),
            max_rss_kib: finished.usage.max_rss_kib,
        });
    }
    Ok(run)
}

/// memleak running `build` of the workload, with one JSON report of every
/// stack when the workload ends.
fn memleak_command(workload: &Workload, build: Build, sample_rate: u32, unwinder: Unwinder) -> Command {
    let mut command = Command::new(&workload.memleak);
    command.args(["-c", &workload.command_line(build), "-s", &sample_rate.to_string()]);
    command.args(["--unwind", unwinder.argument()]);
    command.args(["--format", "json", "-o", "0", "-T", "1000", "3600"]);
    command.envs(workload.env.iter().map(|(name, value)| (name, value)));
    command
}

/// Bytes of the stacks whose first frame is `leak_one()`, from memleak's
/// last JSON report.
fn leak_one_bytes(finished: &Finished) -> Result<u64> {
    let report = finished.stdout.lines().last().context("memleak printed no report")?;
    let report: serde_json::Value = serde_json::from_str(report).context("memleak's report is not JSON")?;
    let stacks = report["stacks"].as_array().context("no stacks in memleak's report")?;
    Ok(stacks
        .iter()
        .filter(|stack| stack["frames"][0]["function"] == "leak_one")
        .filter_map(|stack| stack["bytes"].as_u64())
        .sum())
}

/// heaptrack leaves a heaptrack.workload.PID.zst of some MB per run.
fn remove_heaptrack_data(scratch: &Path) {
    let Ok(entries) = std::fs::read_dir(scratch) else { return };
    for entry in entries.filter_map(Result::ok) {
        if entry.file_name().to_string_lossy().starts_with("heaptrack.") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Whether every full memleak row, whichever unwinder and build, ran and
/// reported the leaked bytes exactly in every run: the one result the
/// bench fails on.
pub fn memleak_exact(contenders: &[Contender]) -> Result<()> {
    let full: Vec<&Contender> = contenders.iter().filter(|contender| contender.is_full_memleak()).collect();
    if full.is_empty() {
        bail!("memleak did not run");
    }
    let mut problems = Vec::new();
    for memleak in full {
        if let Some(failure) = &memleak.failure {
            problems.push(format!("{} {failure}", memleak.label));
        } else if !exact(memleak) {
            problems.push(format!("{}: leaked bytes not exact: {}", memleak.label, misses(memleak)));
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

fn exact(contender: &Contender) -> bool {
    contender.runs.iter().all(|run| run.reported_bytes == Some(run.leaked_bytes))
}

/// The table of medians, each slowdown against the untraced run of the
/// same build, then how memleak compares with its targets.
pub fn print(contenders: &[Contender]) {
    let untraced = contenders.iter().find(|contender| matches!(contender.tracer, Tracer::Untraced));
    let Some(first) = untraced.and_then(|untraced| untraced.runs.first()) else { return };
    println!();
    println!("| run | median wall time | slowdown | leaked bytes ({} leaked) |", first.leaked_bytes);
    println!("|---|---|---|---|");
    for contender in contenders {
        let time = match contender.median_ns() {
            Some(median) => format!("{:.1} ms", median as f64 / 1e6),
            None => contender.failure.clone().unwrap_or_default(),
        };
        let slowdown = slowdown(contenders, contender).map(|slowdown| format!("{slowdown:.1}x"));
        let (slowdown, accuracy) = (slowdown.unwrap_or_default(), leak_accuracy(contender));
        println!("| {} | {time} | {slowdown} | {accuracy} |", contender.label);
    }
    println!();
    println!(
        "Each slowdown is against the untraced run of the same build: the one with frame pointers unless \
         the row says \"no frame pointers\"."
    );
    println!();
    print_ratios(contenders);
}

/// How memleak compares with its targets. Each ratio is one of slowdowns,
/// each against the untraced run of its own build, so that one across the
/// builds compares what tracing costs, not how fast the builds run.
fn print_ratios(contenders: &[Contender]) {
    use Build::{FramePointers, NoFramePointers};
    let dwarf =
        |tracer: &Tracer| matches!(tracer, Tracer::Memleak { sample_rate: 1, unwinder: Unwinder::Dwarf });
    let frame_pointers = |tracer: &Tracer| {
        matches!(tracer, Tracer::Memleak { sample_rate: 1, unwinder: Unwinder::FramePointers })
    };
    let slowdown_of = |build, wanted: fn(&Tracer) -> bool| slowdown_where(contenders, build, wanted);
    let floor_of = |build| slowdown_of(build, |tracer| matches!(tracer, Tracer::EmptyProbes(_)));

    let memleak = slowdown_of(FramePointers, dwarf);
    let libbpf_tools = slowdown_of(FramePointers, |tracer| matches!(tracer, Tracer::Bpftrace { .. }));
    print_target("memleak's slowdown / the libbpf-tools probe set's", memleak, libbpf_tools, "target <= 0.2");
    let floor = floor_of(FramePointers);
    print_target("memleak's slowdown / empty probes' (floor)", memleak, floor, "stretch <= 1.5");
    let no_fp = slowdown_of(NoFramePointers, dwarf);
    print_target(
        "memleak (dwarf, no frame pointers) / floor (no frame pointers)",
        no_fp,
        floor_of(NoFramePointers),
        "goal <= 1.6, stretch <= 1.3",
    );
    let sampled = slowdown_of(FramePointers, |tracer| {
        matches!(tracer, Tracer::Memleak { sample_rate: 10, unwinder: Unwinder::Dwarf })
    });
    // Time added over the untraced run, not slowdowns: what sampling saves
    // of what tracing costs.
    print_target(
        "memleak -s 10's added time / memleak's",
        sampled.map(|slowdown| slowdown - 1.0),
        memleak.map(|slowdown| slowdown - 1.0),
        "goal <= 0.7",
    );
    let fp = slowdown_of(FramePointers, frame_pointers);
    print_target(
        "memleak (dwarf, no frame pointers) / memleak --unwind fp (frame pointers)",
        no_fp,
        fp,
        "what unwinding by tables costs over walking frame pointers",
    );
    print_target(
        "memleak (dwarf) / memleak --unwind fp, both with frame pointers",
        memleak,
        fp,
        "the unwinders alone",
    );
}

/// The slowdown of the contender labelled `label`, if it ran.
pub fn slowdown_of_label(contenders: &[Contender], label: &str) -> Option<f64> {
    slowdown(contenders, contenders.iter().find(|contender| contender.label == label)?)
}

/// The median wall time of the contender labelled `label`, in ms.
pub fn median_ms_of_label(contenders: &[Contender], label: &str) -> Option<f64> {
    let median = contenders.iter().find(|contender| contender.label == label)?.median_ns()?;
    Some(median as f64 / 1e6)
}

/// The slowdown of the first `build` contender whose tracer is `wanted`.
fn slowdown_where(contenders: &[Contender], build: Build, wanted: fn(&Tracer) -> bool) -> Option<f64> {
    let contender =
        contenders.iter().find(|contender| contender.build == build && wanted(&contender.tracer))?;
    slowdown(contenders, contender)
}

/// `contender`'s median over that of the untraced run of its build.
fn slowdown(contenders: &[Contender], contender: &Contender) -> Option<f64> {
    let untraced = contenders
        .iter()
        .find(|untraced| untraced.build == contender.build && matches!(untraced.tracer, Tracer::Untraced))?;
    Some(ratio(contender.median_ns()?, untraced.median_ns()?))
}

/// Exactness for memleak; for a sampling memleak, the worst error over the
/// runs.
pub fn leak_accuracy(contender: &Contender) -> String {
    let sample_rate = match contender.tracer {
        Tracer::Untraced => return String::new(),
        Tracer::Memleak { sample_rate, .. } => sample_rate,
        Tracer::EmptyProbes(_) => return "nothing recorded".to_owned(),
        Tracer::Bpftrace { .. } | Tracer::Heaptrack => return "not checked".to_owned(),
    };
    if contender.runs.is_empty() {
        return String::new();
    }
    if sample_rate == 1 {
        return if exact(contender) {
            "exact".to_owned()
        } else {
            format!("not exact: {}", misses(contender))
        };
    }
    let worst = contender
        .runs
        .iter()
        .filter_map(|run| {
            Some(run.reported_bytes?.abs_diff(run.leaked_bytes) as f64 / run.leaked_bytes as f64)
        })
        .fold(0.0, f64::max);
    format!("within {:.0}%", worst * 100.0)
}

fn misses(contender: &Contender) -> String {
    let misses: Vec<String> = contender
        .runs
        .iter()
        .map(|run| format!("{} of {}", run.reported_bytes.unwrap_or(0), run.leaked_bytes))
        .collect();
    misses.join(", ")
}

/// The ratio of two slowdowns: "memleak's slowdown / X's: 0.31 (target
/// <= 0.2)".
fn print_target(what: &str, ours: Option<f64>, theirs: Option<f64>, target: &str) {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) => println!("{what}: {:.2} ({target})", ours / theirs),
        _ => println!("{what}: not measured"),
    }
}

/// memleak's own CPU time and peak RSS in each mode.
pub fn print_memleak_usage(contenders: &[Contender]) {
    println!();
    println!("memleak's own CPU (user+sys, without the workload's) and peak RSS per workload run, medians:");
    for contender in contenders {
        let usages: Vec<Usage> = contender.runs.iter().filter_map(|run| run.memleak_usage).collect();
        let cpu_ns = median(&usages.iter().map(|usage| usage.cpu_ns).collect::<Vec<_>>());
        let rss_kib = median(&usages.iter().map(|usage| usage.max_rss_kib).collect::<Vec<_>>());
        if let (Some(cpu_ns), Some(rss_kib)) = (cpu_ns, rss_kib) {
            let (cpu_millis, memory_mib) = (cpu_ns as f64 / 1e6, rss_kib as f64 / 1024.0);
            println!("- {}: {cpu_millis:.0} ms CPU, {memory_mib:.1} MiB RSS", contender.label);
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}
