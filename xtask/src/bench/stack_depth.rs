//! What a stack's depth costs: the workload built without frame pointers
//! recurses 10, 40 and 100 frames deep before 200,000 malloc/free pairs
//! on its main thread, untraced, under memleak and under heaptrack.
//!
//! The CPU compared is all the tracing costs: the program's own (BPF
//! programs run in its context, so their time is in it) plus memleak's
//! from the program's start to its end, against heaptrack's whole run
//! (the program and `heaptrack_interpret` together). memleak's start-up
//! (loading BPF, reading unwind tables) is before the program starts and
//! is measured elsewhere. The kernel's own count of BPF run time
//! (`bpf_stats`) gives memleak's BPF time per malloc/free pair, from a
//! run of its own: the count reads the clock twice per program run, CPU
//! that memleak does not cost when nobody counts.

use std::{
    io::BufReader,
    path::Path,
    process::{ChildStderr, Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use super::{
    bpf_stats::{self, RunTime},
    median,
    process::{release, run_to_end, wait_for_line},
    tracer::Tracer,
    workload::Summary,
};

/// Frames the workload recurses before it allocates.
pub const DEPTHS: [u32; 3] = [10, 40, 100];
/// malloc/free pairs per run, one in `LEAK_EVERY` leaked.
const PAIRS: u32 = 200_000;
const LEAK_EVERY: u32 = 100;
/// Goals: memleak's CPU over heaptrack's, and BPF time per pair.
const GOAL_RATIO: f64 = 1.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Untraced,
    Memleak,
    /// memleak walking every frame of every stack (--no-stack-reuse).
    MemleakFullWalks,
    Heaptrack,
}

const MODES: [Mode; 4] = [Mode::Untraced, Mode::Memleak, Mode::MemleakFullWalks, Mode::Heaptrack];

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Untraced => "untraced",
            Mode::Memleak => "memleak",
            Mode::MemleakFullWalks => "memleak --no-stack-reuse",
            Mode::Heaptrack => "heaptrack",
        }
    }
}

/// One run's costs.
#[derive(Clone, Copy)]
struct Run {
    /// Everything the run cost in CPU, as the module's doc says.
    cpu_ns: u64,
    /// memleak's BPF programs' time, summed.
    bpf: Option<RunTime>,
}

/// The runs at one depth, per mode, with each mode's failure if any.
pub struct AtDepth {
    depth: u32,
    runs: Vec<(Mode, Vec<Run>, Option<String>)>,
    /// Frames of memleak's stack of `leak_one`, and whether it reached
    /// `main`: the walk crossed every frame.
    leak_stack: Option<(usize, bool)>,
}

/// Runs every mode `rounds` times at each depth, interleaved.
pub fn measure(
    memleak: &Path,
    workload: &Path,
    rounds: usize,
    heaptrack_installed: bool,
) -> Result<Vec<AtDepth>> {
    let mut all = Vec::new();
    for depth in DEPTHS {
        let mut at = AtDepth {
            depth,
            runs: MODES.iter().map(|&mode| (mode, Vec::new(), None)).collect(),
            leak_stack: None,
        };
        if !heaptrack_installed {
            at.runs[3].2 = Some("not installed".to_owned());
        }
        for round in 1..=rounds {
            for (mode, runs, failure) in at.runs.iter_mut().filter(|(_, _, failure)| failure.is_none()) {
                eprintln!("bench: depth {depth}, run {round}/{rounds}: {}", mode.label());
                match run_once(*mode, memleak, workload, depth, &mut at.leak_stack) {
                    Ok(run) => runs.push(run),
                    Err(error) if *mode == Mode::Untraced => return Err(error),
                    Err(error) => *failure = Some(format!("failed: {error:#}")),
                }
            }
        }
        all.push(at);
    }
    Ok(all)
}

fn workload_args(depth: u32) -> Vec<String> {
    // 0 threads: one worker on the main thread, its stacks reaching main.
    [0, PAIRS, LEAK_EVERY, depth].map(|n| n.to_string()).to_vec()
}

fn run_once(
    mode: Mode,
    memleak: &Path,
    workload: &Path,
    depth: u32,
    leak_stack: &mut Option<(usize, bool)>,
) -> Result<Run> {
    match mode {
        Mode::Untraced => {
            let finished = run_to_end(Command::new(workload).args(workload_args(depth)))?;
            Ok(Run { cpu_ns: Summary::parse(&finished.stderr)?.cpu_ns, bpf: None })
        }
        Mode::Heaptrack => {
            let scratch = crate::root().join("target/bench/heaptrack-depth");
            std::fs::create_dir_all(&scratch)?;
            let mut command = Command::new("heaptrack");
            command.arg(workload).args(workload_args(depth)).current_dir(&scratch);
            let finished = run_to_end(&mut command);
            let _ = std::fs::remove_dir_all(&scratch);
            Ok(Run { cpu_ns: finished?.usage.cpu_ns, bpf: None })
        }
        Mode::Memleak => {
            let (run, stack) = timed_and_counted(memleak, workload, depth, &[])?;
            *leak_stack = Some(stack);
            Ok(run)
        }
        Mode::MemleakFullWalks => {
            let (run, stack) = timed_and_counted(memleak, workload, depth, &["--no-stack-reuse"])?;
            if leak_stack.is_some_and(|reused| reused != stack) {
                bail!("the stack of leak_one has {stack:?} frames and main walking every frame, {leak_stack:?} reusing");
            }
            Ok(run)
        }
    }
}

/// memleak's CPU from a run as users run it, and its BPF time from a run
/// with the kernel counting it (see the module's doc).
fn timed_and_counted(
    memleak: &Path,
    workload: &Path,
    depth: u32,
    memleak_args: &[&str],
) -> Result<(Run, (usize, bool))> {
    let (timed, stack) = run_under_memleak(memleak, workload, depth, memleak_args)?;
    let counted = {
        let _stats = bpf_stats::StatsEnabled::new()?;
        run_under_memleak(memleak, workload, depth, memleak_args)?.0
    };
    Ok((Run { cpu_ns: timed.cpu_ns, bpf: counted.bpf }, stack))
}

/// The workload held at its start while memleak attaches, then run; the
/// costs are read when it says "done", before memleak reports.
fn run_under_memleak(
    memleak: &Path,
    workload: &Path,
    depth: u32,
    memleak_args: &[&str],
) -> Result<(Run, (usize, bool))> {
    let mut program = Command::new(workload)
        .args(workload_args(depth))
        .env("WORKLOAD_HOLD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run the workload")?;
    let measured = (|| {
        let mut said = BufReader::new(program.stderr.take().context("no stderr")?);
        wait_for_line(&mut said, "ready")?;
        let args = [&["-T", "1000"][..], memleak_args].concat();
        let tracer = Tracer::attach(memleak, program.id(), &args)?;
        let (bpf_before, memleak_before) = tracer.usage()?;
        release(program.stdin.as_mut().context("no stdin")?)?;
        let summary = summary_line(&mut said)?;
        wait_for_line(&mut said, "done")?;
        let (bpf_after, memleak_after) = tracer.usage()?;
        release(program.stdin.as_mut().context("no stdin")?)?;
        let _ = program.wait();
        let report = tracer.report()?;
        let stack = leak_one_stack(&report, summary.leaked_bytes)?;
        let run = Run {
            cpu_ns: summary.cpu_ns + memleak_after.saturating_sub(memleak_before),
            bpf: Some(bpf_after.since(bpf_before)),
        };
        Ok((run, stack))
    })();
    let _ = program.kill();
    let _ = program.wait();
    measured
}

/// Reads the workload's summary line.
fn summary_line(said: &mut BufReader<ChildStderr>) -> Result<Summary> {
    use std::io::BufRead as _;
    let mut line = String::new();
    loop {
        line.clear();
        if said.read_line(&mut line)? == 0 {
            bail!("the workload ended before its summary");
        }
        if line.starts_with("elapsed_ns") {
            return Summary::parse(&line);
        }
    }
}

/// The frames of memleak's stack of `leak_one` and whether it reaches
/// `main`; fails unless it holds exactly the bytes the workload leaked.
fn leak_one_stack(report: &serde_json::Value, leaked: u64) -> Result<(usize, bool)> {
    let stacks = report["stacks"].as_array().context("no stacks in memleak's report")?;
    let leaks: Vec<&serde_json::Value> =
        stacks.iter().filter(|stack| stack["frames"][0]["function"] == "leak_one").collect();
    let bytes: u64 = leaks.iter().filter_map(|stack| stack["bytes"].as_u64()).sum();
    if bytes != leaked || leaks.len() != 1 {
        bail!(
            "memleak found {bytes} bytes from leak_one in {} stacks, of {leaked} leaked in one",
            leaks.len()
        );
    }
    let frames = leaks[0]["frames"].as_array().context("no frames")?;
    Ok((frames.len(), frames.iter().any(|frame| frame["function"] == "main")))
}

impl AtDepth {
    /// The runs of `mode`, unless it failed.
    fn runs_of(&self, mode: Mode) -> Option<&Vec<Run>> {
        self.runs
            .iter()
            .find(|(runs_mode, _, failure)| *runs_mode == mode && failure.is_none())
            .map(|(_, runs, _)| runs)
    }

    /// The median CPU of `mode`'s runs.
    fn cpu(&self, mode: Mode) -> Option<u64> {
        median(&self.runs_of(mode)?.iter().map(|run| run.cpu_ns).collect::<Vec<_>>())
    }

    /// The median over rounds of memleak's CPU over heaptrack's in the
    /// same round: runs next to each other in time share the machine's
    /// slow and fast spells, which moved heaptrack's own CPU by half
    /// between rounds here.
    fn ratio_to_heaptrack(&self) -> Option<f64> {
        let ours = self.runs_of(Mode::Memleak)?;
        let theirs = self.runs_of(Mode::Heaptrack)?;
        let mut ratios: Vec<f64> =
            ours.iter().zip(theirs).map(|(ours, theirs)| ours.cpu_ns as f64 / theirs.cpu_ns as f64).collect();
        ratios.sort_by(f64::total_cmp);
        ratios.get(ratios.len() / 2).copied()
    }

    /// The median BPF time of `mode`'s runs.
    fn bpf(&self, mode: Mode) -> Option<u64> {
        median(&self.runs_of(mode)?.iter().filter_map(|run| run.bpf).map(|bpf| bpf.ns).collect::<Vec<_>>())
    }

    fn print_row(&self) {
        let ms = |ns: Option<u64>| ns.map_or("-".to_owned(), |ns| format!("{:.1} ms", ns as f64 / 1e6));
        let per_pair = |ns: Option<u64>| {
            ns.map_or("-".to_owned(), |ns| format!("{:.2} µs", ns as f64 / f64::from(PAIRS) / 1e3))
        };
        let ratio = self.ratio_to_heaptrack().map_or("-".to_owned(), |ratio| format!("{ratio:.2}"));
        let stack = self.leak_stack.map_or("-".to_owned(), |(frames, main)| {
            format!("{frames} frames{}", if main { ", main" } else { ", NO main" })
        });
        println!(
            "  {:>5} {:>10} {:>10} {:>10} {:>10} {ratio:>10} {:>10} {:>10} {stack:>16}",
            self.depth,
            ms(self.cpu(Mode::Untraced)),
            ms(self.cpu(Mode::Memleak)),
            ms(self.cpu(Mode::MemleakFullWalks)),
            ms(self.cpu(Mode::Heaptrack)),
            per_pair(self.bpf(Mode::Memleak)),
            per_pair(self.bpf(Mode::MemleakFullWalks)),
        );
        for (mode, _, failure) in &self.runs {
            if let Some(failure) = failure {
                println!("    {}: {failure}", mode.label());
            }
        }
    }
}

pub fn print(measured: &Result<Vec<AtDepth>>) {
    println!(
        "\nstack depth: the workload without frame pointers, {PAIRS} malloc/free pairs on its main thread \
         after recursing N frames; CPU of the program plus the tracer's, and memleak's BPF time per pair, medians \
         (/heaptrack: of each round's ratio)"
    );
    let all = match measured {
        Ok(all) => all,
        Err(error) => {
            println!("  not measured: {error:#}");
            return;
        }
    };
    println!(
        "  {:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>16}",
        "depth",
        "untraced",
        "memleak",
        "full walks",
        "heaptrack",
        "/heaptrack",
        "BPF/pair",
        "full walks",
        "leak stack"
    );
    for at in all {
        at.print_row();
    }
    println!(
        "  full walks: memleak --no-stack-reuse. Goals: memleak/heaptrack at most {GOAL_RATIO:.1} at every depth; \
         BPF under 1 µs a pair at depth 10, under 1.5 µs at 100"
    );
}
