//! What each tracer costs per malloc/free pair, apart from what it costs
//! once per run: the workload at two sizes, N and 2N pairs a thread, under
//! each tracer, in rounds whose order rotates. The difference between the
//! two sizes' median loop times over N is the cost of one pair (the
//! slope); what is left at N once N pairs are taken out is the run's fixed
//! cost (the intercept: the tracer's start, its exit, and its first sight
//! of each stack). One workload size alone mixes the two, and a ratio of
//! slowdowns then depends on the size chosen: heaptrack's fixed cost is
//! larger than memleak's, its cost per pair smaller than it looks.

use std::time::Instant;

use anyhow::Result;

use super::{
    median,
    overhead::{run_once, Tracer, Unwinder},
    workload::{Build, ProbePlan, Workload},
    LEAK_EVERY,
};

/// One tracer's runs at both sizes.
pub struct Line {
    label: &'static str,
    tracer: Tracer,
    /// (loop ns, whole run ns) at N pairs a thread, then at 2N.
    runs: [Vec<(u64, u64)>; 2],
    failure: Option<String>,
}

/// What was measured, and at which N.
pub struct Slopes {
    pairs: u32,
    lines: Vec<Line>,
}

/// Runs the workload (frame-pointer build) at `pairs` and twice that many
/// pairs a thread, `rounds` times each, untraced, under memleak, under
/// heaptrack (if installed) and under empty probes at memleak's sites.
pub fn measure(
    workload: &Workload,
    plan: &ProbePlan,
    threads: u32,
    pairs: u32,
    rounds: usize,
    heaptrack_installed: bool,
) -> Result<Slopes> {
    let of_size = |pairs: u32| Workload {
        frame_pointers_path: workload.frame_pointers_path.clone(),
        no_frame_pointers_path: workload.no_frame_pointers_path.clone(),
        args: [threads, pairs, LEAK_EVERY].map(|n| n.to_string()).to_vec(),
        memleak: workload.memleak.clone(),
        scratch: workload.scratch.clone(),
        env: workload.env.clone(),
    };
    let workloads = [of_size(pairs), of_size(2 * pairs)];
    let mut lines = vec![
        Line::new("untraced", Tracer::Untraced),
        Line::new("memleak", Tracer::Memleak { sample_rate: 1, unwinder: Unwinder::Dwarf }),
        Line::new("empty probes at memleak's sites (floor)", Tracer::EmptyProbes(plan.sites.clone())),
    ];
    if heaptrack_installed {
        lines.push(Line::new("heaptrack", Tracer::Heaptrack));
    }
    for round in 0..rounds {
        let order: Vec<usize> = (0..lines.len()).map(|index| (index + round) % lines.len()).collect();
        for index in order {
            let line = &mut lines[index];
            if line.failure.is_some() {
                continue;
            }
            // The smaller size first in even rounds, last in odd ones.
            for step in 0..2 {
                let size = if round % 2 == 0 { step } else { 1 - step };
                eprintln!("bench: slopes, round {}/{rounds}: {} at size {}", round + 1, line.label, size + 1);
                let started = Instant::now();
                match run_once(&line.tracer, Build::FramePointers, &workloads[size]) {
                    Ok(run) => {
                        let whole = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        line.runs[size].push((run.elapsed_ns, whole));
                    }
                    Err(error) if matches!(line.tracer, Tracer::Untraced) => return Err(error),
                    Err(error) => line.failure = Some(format!("failed: {error:#}")),
                }
            }
        }
    }
    Ok(Slopes { pairs, lines })
}

impl Line {
    fn new(label: &'static str, tracer: Tracer) -> Self {
        Self { label, tracer, runs: [Vec::new(), Vec::new()], failure: None }
    }

    /// Median (loop, whole run) ns at size `size` (0: N, 1: 2N).
    fn medians(&self, size: usize) -> Option<(f64, f64)> {
        let loops: Vec<u64> = self.runs[size].iter().map(|&(loop_ns, _)| loop_ns).collect();
        let wholes: Vec<u64> = self.runs[size].iter().map(|&(_, whole_ns)| whole_ns).collect();
        Some((median(&loops)? as f64, median(&wholes)? as f64))
    }

    /// ns per pair a thread (from the loops), and the run's fixed ns
    /// (from whole runs: start to exit).
    fn costs(&self, pairs: u32) -> Option<Cost> {
        let ((small_loop, small_whole), (large_loop, large_whole)) = (self.medians(0)?, self.medians(1)?);
        let pairs = f64::from(pairs);
        let whole_per_pair = (large_whole - small_whole) / pairs;
        Some(Cost {
            per_pair_ns: (large_loop - small_loop) / pairs,
            fixed_ns: small_whole - pairs * whole_per_pair,
        })
    }
}

#[derive(Clone, Copy)]
struct Cost {
    per_pair_ns: f64,
    fixed_ns: f64,
}

/// The table, each cost also over the untraced one, and memleak's added
/// cost per pair over heaptrack's and over the floor's.
pub fn print(slopes: &Slopes) {
    let pairs = slopes.pairs;
    println!();
    println!(
        "Per malloc/free pair and per run, from {pairs} and {} pairs a thread (slope and intercept of the \
         medians):",
        2 * pairs
    );
    println!();
    println!("| run | per pair | added per pair | fixed (start to exit) | added fixed |");
    println!("|---|---|---|---|---|");
    let untraced = slopes.lines.first().and_then(|line| line.costs(pairs));
    let added = |line: &Line| Some((line.costs(pairs)?, untraced?));
    for line in &slopes.lines {
        match (line.costs(pairs), added(line)) {
            (Some(cost), Some((_, base))) => println!(
                "| {} | {:.0} ns | {:.0} ns | {:.1} ms | {:.1} ms |",
                line.label,
                cost.per_pair_ns,
                cost.per_pair_ns - base.per_pair_ns,
                cost.fixed_ns / 1e6,
                (cost.fixed_ns - base.fixed_ns) / 1e6
            ),
            _ => println!("| {} | {} | | | |", line.label, line.failure.as_deref().unwrap_or("not measured")),
        }
    }
    let added_per_pair = |label: &str| {
        let line = slopes.lines.iter().find(|line| line.label.starts_with(label))?;
        Some(line.costs(pairs)?.per_pair_ns - untraced?.per_pair_ns)
    };
    println!();
    for (what, theirs) in [("heaptrack's", "heaptrack"), ("the floor's", "empty probes")] {
        match (added_per_pair("memleak"), added_per_pair(theirs)) {
            (Some(ours), Some(theirs)) => {
                println!("memleak's added cost per pair / {what}: {:.2}", ours / theirs);
            }
            _ => println!("memleak's added cost per pair / {what}: not measured"),
        }
    }
}
