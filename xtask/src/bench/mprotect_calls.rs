//! What memleak adds to an mprotect call: a program flips one page
//! between read-write and read-only, as a JIT flips its code pages, and
//! times its calls itself, chunk after chunk. memleak attaches to it and
//! detaches in turns: seeing mprotect from the kernel, as it does where
//! it can, and through a uprobe, as it does elsewhere. Nothing a leak
//! report shows changes, so nothing should be sent.
//!
//! One process throughout: a call's cost depends on the mappings around
//! the page (whether the kernel splits and merges them on every flip),
//! which differ between runs by more than memleak adds.
//!
//! And what seeing munmap and mprotect from the kernel costs the processes
//! memleak does not trace: a program that only maps, protects and unmaps
//! memory runs alone and beside a memleak tracing another process, each
//! way, in turns; the ratio of each run to the run alone next to it.

use std::{
    path::Path,
    process::{Command, Stdio},
    sync::mpsc::{Receiver, RecvTimeoutError},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    median,
    process::{lines_as_they_come, run_to_end, tracing, Killed},
};

/// Calls per line the program prints: tens of milliseconds.
const CHUNK: u32 = 20_000;
/// How long each way of running is timed, per round.
const WINDOW: Duration = Duration::from_secs(2);
/// Goal: what memleak adds to a call.
const GOAL_NS: f64 = 1000.0;
/// memleak's switch to keep munmap's and mprotect's uprobes.
const MAPPING_UPROBES: &str = "MEMLEAK_MAPPING_UPROBES";

/// Median ns a call took, each way.
pub struct CallCosts {
    pub untraced: f64,
    /// As memleak sees it by default on this kernel.
    pub default: f64,
    pub tracepoint: f64,
    pub uprobe: f64,
}

/// The switch that keeps the `mmap_lock` tracepoint where fentry programs
/// could serve.
const MAPPING_TRACEPOINT: &str = "MEMLEAK_MAPPING_TRACEPOINT";
/// Iterations of the bystander's loop in a run: a few hundred ms.
const BYSTANDER_ITERATIONS: &str = "100000";
/// How long memleak runs before the bystander starts.
const SETTLE: Duration = Duration::from_secs(1);
/// Goal: a bystander's speed beside memleak, against its speed alone.
const BYSTANDER_GOAL: f64 = 0.98;

/// A bystander's runs one way: ns an iteration, and the ratio of its
/// speed to the run alone in the same round.
pub struct BystanderWay {
    label: &'static str,
    iteration_ns: Vec<f64>,
    speed: Vec<f64>,
}

/// `mapping_loop`, untraced, alone and beside a memleak tracing a sleeping
/// process each way, `rounds` times in turns.
pub fn measure_bystander(memleak: &Path, mapping_loop: &Path, rounds: usize) -> Result<Vec<BystanderWay>> {
    let ways: [(&str, Option<&str>); 4] = [
        ("alone", None),
        ("beside memleak -p (default: fentry at the system calls where the kernel takes them, else uprobes)", Some("")),
        ("beside memleak -p, the mmap_lock tracepoint", Some(MAPPING_TRACEPOINT)),
        ("beside memleak -p, uprobes in the traced process only", Some(MAPPING_UPROBES)),
    ];
    let mut rows: Vec<BystanderWay> = ways
        .iter()
        .map(|&(label, _)| BystanderWay { label, iteration_ns: Vec::new(), speed: Vec::new() })
        .collect();
    let mut sleeper = Killed(Command::new("sleep").arg("3600").spawn().context("cannot run sleep")?);
    let pid = sleeper.0.id().to_string();
    for round in 1..=rounds {
        eprintln!("bench: a bystander's mapping calls, run {round}/{rounds}");
        // Each round starts with another way, so that no way always runs
        // first, or right after memleak's start; each is paired with the
        // run alone of its round.
        let mut times = [0.0; 4];
        for index in (0..ways.len()).map(|index| (index + round) % ways.len()) {
            let switch = ways[index].1;
            let _traced = match switch {
                None => None,
                Some(switch) => {
                    let mut command = Command::new(memleak);
                    command.args(["-p", &pid]);
                    if !switch.is_empty() {
                        command.env(switch, "1");
                    }
                    let traced = tracing(&mut command)?;
                    // Past its start's work: what it costs from then on.
                    std::thread::sleep(SETTLE);
                    Some(traced)
                }
            };
            let finished = run_to_end(Command::new(mapping_loop).arg(BYSTANDER_ITERATIONS))?;
            times[index] = finished
                .stdout
                .strip_prefix("iteration_ns ")
                .and_then(|ns| ns.trim().parse().ok())
                .with_context(|| format!("not an iteration_ns line: {}", finished.stdout))?;
        }
        for (row, ns) in rows.iter_mut().zip(times) {
            row.iteration_ns.push(ns);
            row.speed.push(times[0] / ns);
        }
    }
    let _ = sleeper.0.kill();
    Ok(rows)
}

pub fn print_bystander(rows: &Result<Vec<BystanderWay>>) {
    println!(
        "\nmapping calls of a process memleak does not trace: mmap, touch, mprotect and munmap in a loop, alone and beside a memleak tracing another process, in turns; medians"
    );
    let rows = match rows {
        Ok(rows) => rows,
        Err(error) => return println!("  not measured: {error:#}"),
    };
    println!("| the untraced loop | ns an iteration | speed against alone, paired |");
    println!("|---|---:|---:|");
    for row in rows {
        let ns = median(&row.iteration_ns).unwrap_or(f64::NAN);
        let speed = median(&row.speed).unwrap_or(f64::NAN);
        println!("| {} | {ns:.0} | {speed:.3} |", row.label);
    }
    println!("goal: the default at least {BYSTANDER_GOAL} of the speed alone");
}

/// Medians over `rounds` rounds, each timing the program untraced, then
/// under memleak each way.
pub fn measure(memleak: &Path, program: &Path, rounds: usize) -> Result<CallCosts> {
    let mut flipper = Killed(
        Command::new(program)
            .arg(CHUNK.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {}", program.display()))?,
    );
    let pid = flipper.0.id().to_string();
    let chunks = lines_as_they_come(flipper.0.stdout.take().context("no stdout")?);
    let (mut untraced, mut default, mut tracepoint, mut uprobe) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        eprintln!("bench: mprotect, run {round}/{rounds}");
        untraced.push(time_window(&chunks)?);
        let memleak_by_pid = || {
            let mut command = Command::new(memleak);
            command.args(["-p", &pid]);
            command
        };
        let traced = tracing(&mut memleak_by_pid())?;
        default.push(time_window(&chunks)?);
        drop(traced);
        let traced = tracing(memleak_by_pid().env(MAPPING_TRACEPOINT, "1"))?;
        tracepoint.push(time_window(&chunks)?);
        drop(traced);
        let traced = tracing(memleak_by_pid().env(MAPPING_UPROBES, "1"))?;
        uprobe.push(time_window(&chunks)?);
        drop(traced);
    }
    let medians = (median(&untraced), median(&default), median(&tracepoint), median(&uprobe));
    let (Some(untraced), Some(default), Some(tracepoint), Some(uprobe)) = medians else {
        bail!("no rounds run")
    };
    Ok(CallCosts { untraced, default, tracepoint, uprobe })
}

/// The median ns a call took in the chunks the program ends within the
/// next `WINDOW`, those it ended before left out.
fn time_window(chunks: &Receiver<(Instant, String)>) -> Result<f64> {
    while chunks.try_recv().is_ok() {}
    let end = Instant::now() + WINDOW;
    let mut ns = Vec::new();
    loop {
        match chunks.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((_, line)) => ns.push(call_ns(&line)?),
            Err(RecvTimeoutError::Timeout) => break,
            Err(RecvTimeoutError::Disconnected) => bail!("mprotect_loop ended"),
        }
    }
    median(&ns).context("mprotect_loop printed nothing in two seconds")
}

/// The number on a `mprotect_ns N` line.
fn call_ns(line: &str) -> Result<f64> {
    line.strip_prefix("mprotect_ns ")
        .and_then(|ns| ns.trim().parse().ok())
        .with_context(|| format!("not an mprotect_ns line: {line}"))
}

pub fn print(measured: &Result<CallCosts>) {
    println!(
        "\nmprotect: one page flipped in one process, memleak attached and detached in turns; ns a call as the program times it, medians"
    );
    match measured {
        Ok(CallCosts { untraced, default, tracepoint, uprobe }) => {
            println!("| memleak sees mprotect | ns a call | memleak adds |");
            println!("|---|---:|---:|");
            println!("| not attached | {untraced:.0} | |");
            println!(
                "| as it does by default here (fentry at the system call where the kernel takes it, else a uprobe) | {default:.0} | {:.0} (goal: under {GOAL_NS:.0}) |",
                default - untraced
            );
            println!(
                "| from the mmap_lock tracepoint ({MAPPING_TRACEPOINT}=1) | {tracepoint:.0} | {:.0} |",
                tracepoint - untraced
            );
            println!("| through a uprobe ({MAPPING_UPROBES}=1) | {uprobe:.0} | {:.0} |", uprobe - untraced);
        }
        Err(error) => println!("  not measured: {error:#}"),
    }
}
