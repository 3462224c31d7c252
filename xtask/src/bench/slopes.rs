//! What each tracer costs per malloc/free pair, apart from what it costs
//! once per run: the workload at two sizes, N and 2N pairs a thread, under
//! each tracer, in rounds whose order rotates. The difference between the
//! two sizes' medians over N is the cost of one pair (the slope); what is
//! left at N once N pairs are taken out is the run's fixed cost (the
//! intercept: the tracer's start, its exit, and its first sight of each
//! stack). One workload size alone mixes the two, and a ratio of
//! slowdowns then depends on the size chosen. Wall time per pair is what
//! the program waits (a thread's loop); CPU per pair counts every process
//! (heaptrack hands each event to `heaptrack_interpret`, which runs
//! beside the program, where memleak's BPF programs run in it).

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
    /// Each run at N pairs a thread, then at 2N.
    runs: [Vec<Timed>; 2],
    failure: Option<String>,
}

/// What one run took, in ns.
#[derive(Clone, Copy)]
struct Timed {
    /// The allocation loops' wall time.
    loop_wall: u64,
    /// From the tracer's start to its exit.
    whole_wall: u64,
    /// Every process's CPU (see `overhead::Run::cpu_ns`).
    cpu: u64,
}

/// What was measured, and at which N.
pub struct Slopes {
    pairs: u32,
    threads: u32,
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
                        let whole_wall = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        line.runs[size].push(Timed {
                            loop_wall: run.elapsed_ns,
                            whole_wall,
                            cpu: run.cpu_ns,
                        });
                    }
                    Err(error) if matches!(line.tracer, Tracer::Untraced) => return Err(error),
                    Err(error) => line.failure = Some(format!("failed: {error:#}")),
                }
            }
        }
    }
    Ok(Slopes { pairs, threads, lines })
}

impl Line {
    fn new(label: &'static str, tracer: Tracer) -> Self {
        Self { label, tracer, runs: [Vec::new(), Vec::new()], failure: None }
    }

    /// The median of `field` over the runs at size `size` (0: N, 1: 2N).
    fn median_of(&self, size: usize, field: fn(&Timed) -> u64) -> Option<f64> {
        let values: Vec<u64> = self.runs[size].iter().map(field).collect();
        Some(median(&values)? as f64)
    }

    /// The slope and intercept of `field` against pairs a thread.
    fn line_of(&self, pairs: u32, field: fn(&Timed) -> u64) -> Option<(f64, f64)> {
        let (small, large) = (self.median_of(0, field)?, self.median_of(1, field)?);
        let pairs = f64::from(pairs);
        let slope = (large - small) / pairs;
        Some((slope, small - pairs * slope))
    }

    /// What a pair and what a run cost.
    fn costs(&self, pairs: u32, threads: u32) -> Option<Cost> {
        let (wall_per_pair, _) = self.line_of(pairs, |run| run.loop_wall)?;
        let (_, fixed_wall) = self.line_of(pairs, |run| run.whole_wall)?;
        let (cpu_per_thread_pair, fixed_cpu) = self.line_of(pairs, |run| run.cpu)?;
        Some(Cost {
            wall_per_pair,
            fixed_wall,
            cpu_per_pair: cpu_per_thread_pair / f64::from(threads),
            fixed_cpu,
        })
    }
}

/// What a tracer costs, as the slope and intercept of its runs, in ns.
#[derive(Clone, Copy)]
struct Cost {
    /// Wall time of one pair in a thread's loop: what the program waits.
    wall_per_pair: f64,
    /// Wall time from the start to the exit, pairs aside.
    fixed_wall: f64,
    /// CPU time of one pair, every process's.
    cpu_per_pair: f64,
    /// CPU time of a run, pairs aside.
    fixed_cpu: f64,
}

impl Cost {
    fn minus(self, base: Self) -> Self {
        Self {
            wall_per_pair: self.wall_per_pair - base.wall_per_pair,
            fixed_wall: self.fixed_wall - base.fixed_wall,
            cpu_per_pair: self.cpu_per_pair - base.cpu_per_pair,
            fixed_cpu: self.fixed_cpu - base.fixed_cpu,
        }
    }
}

/// The table of what each tracer adds to the untraced run, and memleak's
/// added cost per pair over heaptrack's and over the floor's.
pub fn print(slopes: &Slopes) {
    let (pairs, threads) = (slopes.pairs, slopes.threads);
    println!();
    println!(
        "What each tracer adds, per malloc/free pair and per run, from {pairs} and {} pairs a thread ({threads} \
         threads; slope and intercept of the medians):",
        2 * pairs
    );
    println!();
    println!("| run | wall per pair (a thread's) | CPU per pair (every process's) | fixed wall (start to exit) | fixed CPU |");
    println!("|---|---|---|---|---|");
    let untraced = slopes.lines.first().and_then(|line| line.costs(pairs, threads));
    let added = |line: &Line| Some(line.costs(pairs, threads)?.minus(untraced?));
    for line in &slopes.lines {
        match added(line) {
            Some(cost) if !matches!(line.tracer, Tracer::Untraced) => println!(
                "| {} | {:.0} ns | {:.0} ns | {:.0} ms | {:.0} ms |",
                line.label,
                cost.wall_per_pair,
                cost.cpu_per_pair,
                cost.fixed_wall / 1e6,
                cost.fixed_cpu / 1e6
            ),
            Some(_) => {
                let cost = untraced.unwrap_or(Cost {
                    wall_per_pair: 0.0,
                    fixed_wall: 0.0,
                    cpu_per_pair: 0.0,
                    fixed_cpu: 0.0,
                });
                println!(
                    "| untraced (itself, not added) | {:.0} ns | {:.0} ns | {:.0} ms | {:.0} ms |",
                    cost.wall_per_pair,
                    cost.cpu_per_pair,
                    cost.fixed_wall / 1e6,
                    cost.fixed_cpu / 1e6
                );
            }
            None => {
                println!("| {} | {} | | | |", line.label, line.failure.as_deref().unwrap_or("not measured"));
            }
        }
    }
    let added_of = |label: &str| added(slopes.lines.iter().find(|line| line.label.starts_with(label))?);
    println!();
    for (what, theirs) in [("heaptrack's", "heaptrack"), ("the floor's", "empty probes")] {
        match (added_of("memleak"), added_of(theirs)) {
            (Some(ours), Some(theirs)) => println!(
                "memleak's added cost per pair / {what}: wall {:.2}, CPU {:.2}",
                ours.wall_per_pair / theirs.wall_per_pair,
                ours.cpu_per_pair / theirs.cpu_per_pair
            ),
            _ => println!("memleak's added cost per pair / {what}: not measured"),
        }
    }
}
