//! The workload untraced and under each tracer, interleaved so that drift
//! in the machine's speed hits them all alike, and the table of medians.

use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use super::{
    empty_probes::{EmptyProbes, Site},
    process::{run_attached, run_to_end, Finished, Usage},
    workload::{Summary, Workload},
};

/// What runs the workload.
pub enum Tracer {
    Untraced,
    /// memleak recording about one allocation in `sample_rate`.
    Memleak {
        sample_rate: u32,
    },
    /// A bpftrace script, which bpftrace's -c starts the workload under.
    Bpftrace {
        script: std::path::PathBuf,
    },
    Heaptrack,
    EmptyProbes(Vec<Site>),
}

/// One row of the table: a tracer and its runs so far.
pub struct Contender {
    pub label: &'static str,
    pub tracer: Tracer,
    pub runs: Vec<Run>,
    /// Why it has no (more) runs: the rest of the bench goes on without it.
    pub failure: Option<String>,
}

impl Contender {
    pub fn new(label: &'static str, tracer: Tracer) -> Self {
        Self { label, tracer, runs: Vec::new(), failure: None }
    }

    pub fn unavailable(label: &'static str, tracer: Tracer, why: &str) -> Self {
        Self { failure: Some(why.to_owned()), ..Self::new(label, tracer) }
    }

    fn median_ns(&self) -> Option<u64> {
        median(self.runs.iter().map(|run| run.elapsed_ns).collect())
    }

    fn is_full_memleak(&self) -> bool {
        matches!(self.tracer, Tracer::Memleak { sample_rate: 1 })
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
}

/// Runs every contender once per round. Untraced runs are what every ratio
/// divides by, so their failure ends the bench; any other contender that
/// fails is left out from then on.
pub fn measure(contenders: &mut [Contender], workload: &Workload, rounds: usize) -> Result<()> {
    for round in 1..=rounds {
        for contender in contenders.iter_mut().filter(|contender| contender.failure.is_none()) {
            eprintln!("bench: run {round}/{rounds}: {}", contender.label);
            match run_once(&contender.tracer, workload) {
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

/// Runs the workload once under `tracer`.
fn run_once(tracer: &Tracer, workload: &Workload) -> Result<Run> {
    let finished = match tracer {
        Tracer::Untraced => run_to_end(Command::new(&workload.path).args(&workload.args))?,
        Tracer::Memleak { sample_rate } => {
            let sample_rate = sample_rate.to_string();
            let command_line = workload.command_line();
            let json_of_every_stack = ["--format", "json", "-o", "0", "-T", "1000"];
            // One report, when the workload ends.
            let args = ["-c", &command_line, "-s", &sample_rate].into_iter().chain(json_of_every_stack);
            run_to_end(Command::new(&workload.memleak).args(args).arg("3600"))?
        }
        Tracer::Bpftrace { script } => {
            run_to_end(Command::new("bpftrace").arg(script).args(["-c", &workload.command_line()]))?
        }
        Tracer::Heaptrack => {
            let mut command = Command::new("heaptrack");
            command.arg(&workload.path).args(&workload.args).current_dir(&workload.scratch);
            let finished = run_to_end(&mut command);
            remove_heaptrack_data(&workload.scratch);
            finished?
        }
        Tracer::EmptyProbes(sites) => {
            run_attached(&workload.path, &workload.args, |pid| EmptyProbes::attach(sites, pid))?
        }
    };
    let summary = Summary::parse(&finished.stderr)?;
    let mut run = Run {
        elapsed_ns: summary.elapsed_ns,
        leaked_bytes: summary.leaked_bytes,
        reported_bytes: None,
        memleak_usage: None,
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

/// Whether memleak in full mode ran and reported the leaked bytes exactly
/// in every run: the one result the bench fails on.
pub fn memleak_exact(contenders: &[Contender]) -> Result<()> {
    let Some(memleak) = contenders.iter().find(|contender| contender.is_full_memleak()) else {
        bail!("memleak did not run")
    };
    if let Some(failure) = &memleak.failure {
        bail!("memleak {failure}");
    }
    if !memleak.runs.iter().all(|run| run.reported_bytes == Some(run.leaked_bytes)) {
        bail!("memleak's leaked bytes were not exact: {}", misses(memleak));
    }
    Ok(())
}

/// The table of medians, then how memleak compares with the issue's
/// targets. Untraced is the first contender.
pub fn print(contenders: &[Contender]) {
    let [untraced, ..] = contenders else { return };
    let (Some(base), Some(first)) = (untraced.median_ns(), untraced.runs.first()) else { return };
    println!();
    println!("| run | median wall time | slowdown | leaked bytes ({} leaked) |", first.leaked_bytes);
    println!("|---|---|---|---|");
    for contender in contenders {
        let (time, slowdown) = match contender.median_ns() {
            Some(median) => {
                (format!("{:.1} ms", median as f64 / 1e6), format!("{:.1}x", ratio(median, base)))
            }
            None => (contender.failure.clone().unwrap_or_default(), String::new()),
        };
        println!("| {} | {time} | {slowdown} | {} |", contender.label, leak_accuracy(contender));
    }
    println!();
    let median_where = |wanted: fn(&Tracer) -> bool| {
        contenders.iter().find(|contender| wanted(&contender.tracer)).and_then(Contender::median_ns)
    };
    let memleak = median_where(|tracer| matches!(tracer, Tracer::Memleak { sample_rate: 1 }));
    let libbpf_tools = median_where(|tracer| matches!(tracer, Tracer::Bpftrace { .. }));
    let floor = median_where(|tracer| matches!(tracer, Tracer::EmptyProbes(_)));
    print_target("memleak's slowdown / the libbpf-tools probe set's", memleak, libbpf_tools, "target <= 0.2");
    print_target("memleak's slowdown / empty probes' (floor)", memleak, floor, "stretch <= 1.5");
}

/// Exactness for memleak; for a sampling memleak, the worst error over the
/// runs.
fn leak_accuracy(contender: &Contender) -> String {
    let sample_rate = match contender.tracer {
        Tracer::Untraced => return String::new(),
        Tracer::Memleak { sample_rate } => sample_rate,
        Tracer::EmptyProbes(_) => return "nothing recorded".to_owned(),
        Tracer::Bpftrace { .. } | Tracer::Heaptrack => return "not checked".to_owned(),
    };
    if contender.runs.is_empty() {
        return String::new();
    }
    if sample_rate == 1 {
        let exact = contender.runs.iter().all(|run| run.reported_bytes == Some(run.leaked_bytes));
        return if exact { "exact".to_owned() } else { format!("not exact: {}", misses(contender)) };
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

/// Slowdowns share the untraced time, so their ratio is that of the
/// medians: "memleak's slowdown / X's: 0.31 (target <= 0.2)".
fn print_target(what: &str, ours: Option<u64>, theirs: Option<u64>, target: &str) {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) => println!("{what}: {:.2} ({target})", ratio(ours, theirs)),
        _ => println!("{what}: not measured"),
    }
}

/// memleak's own CPU time and peak RSS in each mode.
pub fn print_memleak_usage(contenders: &[Contender]) {
    println!();
    println!("memleak's own CPU (user+sys, without the workload's) and peak RSS per workload run, medians:");
    for contender in contenders {
        let usages: Vec<Usage> = contender.runs.iter().filter_map(|run| run.memleak_usage).collect();
        let cpu_ns = median(usages.iter().map(|usage| usage.cpu_ns).collect());
        let rss_kib = median(usages.iter().map(|usage| usage.max_rss_kib).collect());
        if let (Some(cpu_ns), Some(rss_kib)) = (cpu_ns, rss_kib) {
            let (cpu_millis, memory_mib) = (cpu_ns as f64 / 1e6, rss_kib as f64 / 1024.0);
            println!("- {}: {cpu_millis:.0} ms CPU, {memory_mib:.1} MiB RSS", contender.label);
        }
    }
}

fn median(mut values: Vec<u64>) -> Option<u64> {
    values.sort_unstable();
    values.get(values.len() / 2).copied()
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}
