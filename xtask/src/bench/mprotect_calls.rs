//! What memleak adds to an mprotect call: a program flips one page
//! between read-write and read-only, as a JIT flips its code pages, and
//! times its calls itself, untraced and under memleak. Nothing a leak
//! report shows changes, yet every call takes memleak's probe.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result};

use super::{median, process::run_to_end};

/// Calls per run.
const CALLS: u32 = 200_000;
/// Goal: what memleak adds to a call.
const GOAL_NS: f64 = 1000.0;

/// Median ns a call took, untraced and under memleak, over `rounds`
/// interleaved rounds.
pub fn measure(memleak: &Path, program: &Path, rounds: usize) -> Result<(f64, f64)> {
    let (mut untraced, mut traced) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        eprintln!("bench: mprotect, run {round}/{rounds}");
        let alone = run_to_end(Command::new(program).arg(CALLS.to_string()))?;
        untraced.push(call_ns(&alone.stderr)?);
        // memleak passes its command's stderr on as its own.
        let command = format!("{} {CALLS}", program.display());
        let under = run_to_end(Command::new(memleak).args(["-c", &command, "3600"]))?;
        traced.push(call_ns(&under.stderr)?);
    }
    let medians = median(&untraced).zip(median(&traced));
    medians.context("no rounds run")
}

/// The number on the program's `mprotect_ns N` line.
fn call_ns(stderr: &str) -> Result<f64> {
    stderr
        .lines()
        .find_map(|line| line.strip_prefix("mprotect_ns "))
        .and_then(|ns| ns.trim().parse().ok())
        .with_context(|| format!("no mprotect_ns line in: {stderr}"))
}

pub fn print(measured: &Result<(f64, f64)>) {
    println!("\nmprotect: {CALLS} calls flipping one page, ns a call as the program times it, medians");
    match measured {
        Ok((untraced, traced)) => println!(
            "  untraced {untraced:.0} ns, under memleak {traced:.0} ns: memleak adds {:.0} ns (goal: under {GOAL_NS:.0})",
            traced - untraced
        ),
        Err(error) => println!("  not measured: {error:#}"),
    }
}
