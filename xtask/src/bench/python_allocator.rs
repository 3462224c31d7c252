//! `--python-allocator`'s cost: a Python allocation-heavy workload
//! (recursion depth 15, then bytearrays made and dropped in a loop, small
//! ones from CPython's arenas and large ones from malloc) on pyenv's
//! 3.11, whose small-object allocator memleak can probe (Debian's is
//! inlined into its callers, and refused). Untraced, under memleak (Python
//! frames, malloc & co.), under memleak --python-allocator, and under
//! heaptrack; interleaved, the median of each, as slowdowns against
//! untraced. The workload times its own loop, so that neither memleak's
//! start nor heaptrack's report at exit counts.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use super::{median, process::run_to_end, workload::Workload};

/// The interpreter: built from source without link-time optimisation.
const PYTHON: &str = "/root/.pyenv/versions/3.11.7/bin/python3.11";

/// Rounds of the workload's loop.
const ITERATIONS: u32 = 50_000;

/// The workload: rounds at recursion depth 15, each making a bytearray of
/// 64 bytes (`PyObject_Malloc`) and one of 4,096 (`PyObject_Malloc`, then
/// malloc), both dropped; one of `KEEP_EVERY` small ones kept, for
/// something to report. Prints its loop's time.
const SCRIPT: &str = r#"import sys, time
ITERATIONS, KEEP_EVERY = int(sys.argv[1]), 100
kept = []
def loop(depth):
    if depth:
        return loop(depth - 1)
    start = time.perf_counter_ns()
    for index in range(ITERATIONS):
        small = bytearray(64)
        large = bytearray(4096)
        if index % KEEP_EVERY == 0:
            kept.append(small)
    return time.perf_counter_ns() - start
sys.stderr.write(f"elapsed_ns {loop(15)}\n")
"#;

/// What runs the workload.
#[derive(Clone, Copy)]
enum Runner {
    Untraced,
    Memleak,
    MemleakPythonAllocator,
    Heaptrack,
}

impl Runner {
    fn label(self) -> &'static str {
        match self {
            Runner::Untraced => "untraced",
            Runner::Memleak => "memleak",
            Runner::MemleakPythonAllocator => "memleak --python-allocator",
            Runner::Heaptrack => "heaptrack",
        }
    }
}

/// Each runner's loop times, in ns; or why it has none.
pub struct Measured {
    iterations: u32,
    rows: Vec<(Runner, Result<Vec<u64>>)>,
}

/// Runs the workload `runs` times under each runner, interleaved, with
/// the bench's memleak and scratch directory.
pub fn measure(workload: &Workload, runs: usize, heaptrack: bool) -> Measured {
    let (memleak, scratch, iterations) = (&workload.memleak, &workload.scratch, ITERATIONS);
    let script = scratch.join("python_allocator_workload.py");
    let mut runners = vec![Runner::Untraced, Runner::Memleak, Runner::MemleakPythonAllocator];
    if heaptrack {
        runners.push(Runner::Heaptrack);
    }
    let mut rows: Vec<(Runner, Result<Vec<u64>>)> =
        runners.into_iter().map(|runner| (runner, Ok(Vec::new()))).collect();
    if let Err(error) = std::fs::write(&script, SCRIPT) {
        let why = format!("cannot write {}: {error}", script.display());
        return Measured {
            iterations,
            rows: rows.into_iter().map(|(runner, _)| (runner, Err(anyhow::anyhow!(why.clone())))).collect(),
        };
    }
    for round in 1..=runs {
        for (runner, times) in &mut rows {
            let Ok(so_far) = times else { continue };
            eprintln!("bench: python allocator run {round}/{runs}: {}", runner.label());
            match run_once(*runner, memleak, &script, scratch, iterations) {
                Ok(elapsed_ns) => so_far.push(elapsed_ns),
                Err(error) => *times = Err(error),
            }
        }
    }
    Measured { iterations, rows }
}

/// One run: the loop's time, as the workload measured it.
fn run_once(runner: Runner, memleak: &Path, script: &Path, scratch: &Path, iterations: u32) -> Result<u64> {
    let python = PathBuf::from(PYTHON);
    if !python.exists() {
        bail!("{PYTHON} is not installed");
    }
    let iterations = iterations.to_string();
    let command_line = format!("{PYTHON} {} {iterations}", script.display());
    let mut command = match runner {
        Runner::Untraced => {
            let mut command = Command::new(&python);
            command.arg(script).arg(&iterations);
            command
        }
        Runner::Memleak | Runner::MemleakPythonAllocator => {
            let mut command = Command::new(memleak);
            command.args(["-c", &command_line, "--format", "json", "-T", "10", "3600"]);
            if matches!(runner, Runner::MemleakPythonAllocator) {
                command.arg("--python-allocator");
            }
            command
        }
        Runner::Heaptrack => {
            let mut command = Command::new("heaptrack");
            command.arg(&python).arg(script).arg(&iterations).current_dir(scratch);
            command
        }
    };
    let finished = run_to_end(&mut command);
    if matches!(runner, Runner::Heaptrack) {
        remove_heaptrack_data(scratch);
    }
    let finished = finished?;
    let line = finished
        .stderr
        .lines()
        .find_map(|line| line.strip_prefix("elapsed_ns "))
        .with_context(|| format!("no elapsed_ns from the workload; stderr: {}", finished.stderr))?;
    line.trim().parse().with_context(|| format!("elapsed_ns {line}"))
}

/// heaptrack leaves a heaptrack.python3.11.PID.zst per run.
fn remove_heaptrack_data(scratch: &Path) {
    let Ok(entries) = std::fs::read_dir(scratch) else { return };
    for entry in entries.filter_map(Result::ok) {
        if entry.file_name().to_string_lossy().starts_with("heaptrack.") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

pub fn print(measured: &Measured) {
    println!();
    println!(
        "--python-allocator: pyenv's python3.11, recursion depth 15, {} rounds of bytearray(64) and bytearray(4096), 1 in 100 small ones kept; the loop's time, medians:",
        measured.iterations
    );
    println!();
    println!("| runner | loop | slowdown against untraced |");
    println!("|---|---|---|");
    let median_of = |runner: &Runner| {
        measured
            .rows
            .iter()
            .find(|(row, _)| row.label() == runner.label())
            .and_then(|(_, times)| times.as_ref().ok().and_then(|times| median(times)))
    };
    let untraced = median_of(&Runner::Untraced);
    for (runner, times) in &measured.rows {
        if let Err(error) = times {
            println!("| {} | failed: {error:#} | |", runner.label());
            continue;
        }
        let ns = median_of(runner);
        let slowdown = match (ns, untraced) {
            (Some(ns), Some(untraced)) if untraced > 0 => format!("{:.1}x", ratio(ns, untraced)),
            _ => "-".to_owned(),
        };
        let ms = ns.map_or_else(|| "-".to_owned(), |ns| format!("{:.1} ms", ratio(ns, 1_000_000)));
        println!("| {} | {ms} | {slowdown} |", runner.label());
    }
    if let (Some(flag), Some(heaptrack)) =
        (median_of(&Runner::MemleakPythonAllocator), median_of(&Runner::Heaptrack))
    {
        println!();
        println!("memleak --python-allocator / heaptrack: {:.2}", ratio(flag, heaptrack));
    }
}

#[allow(clippy::cast_precision_loss, reason = "times well under 2^52 ns")]
fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}
