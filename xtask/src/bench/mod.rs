//! `cargo xtask bench`: the malloc-heavy workload untraced and under
//! memleak, in one invocation, reported as ratios. Ratios, not absolute
//! times, are what carry across machines.

use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::{build_fixture_with, cargo, require_root, root, run as run_command, setup};

/// One timed run of the workload.
struct Measurement {
    elapsed_ns: u64,
    leaked_bytes: u64,
    /// What memleak reported under leak_one(), for traced runs.
    reported_bytes: Option<u64>,
}

pub fn run(quick: bool) -> Result<()> {
    setup::run()?;
    require_root("the benchmark")?;
    run_command(cargo().args(["build", "--release", "--package", "memleak"]))?;
    let workload = build_fixture_with("workload", &["-O2"])?;
    let memleak = root().join("target/release/memleak");
    let (threads, iterations, runs) = if quick { (2, 20_000, 3) } else { (2, 100_000, 5) };
    let workload_args = [threads.to_string(), iterations.to_string(), "100".to_owned()];
    println!(
        "workload: {threads} threads x {iterations} malloc/free pairs of 16..4096 bytes, 1% leaked via leak_one(); \
         median of {runs} runs"
    );

    let mut untraced = Vec::new();
    let mut traced = Vec::new();
    // Interleaved, so that drift in the machine's speed hits both alike.
    for run in 1..=runs {
        eprintln!("bench: run {run}/{runs}");
        untraced.push(run_untraced(&workload, &workload_args)?);
        traced.push(run_traced(&memleak, &workload, &workload_args)?);
    }
    let base = median(&untraced);
    let full = median(&traced);
    let exact = traced.iter().all(|m| m.reported_bytes == Some(m.leaked_bytes));
    println!();
    println!("| run | median wall time | slowdown | leaked bytes exact |");
    println!("|---|---|---|---|");
    println!("| untraced | {:.1} ms | 1.0x | |", base as f64 / 1e6);
    println!(
        "| memleak | {:.1} ms | {:.1}x | {} |",
        full as f64 / 1e6,
        full as f64 / base as f64,
        if exact { "yes".to_owned() } else { describe_misses(&traced) }
    );
    if !exact {
        bail!("memleak's leaked bytes were not exact");
    }
    Ok(())
}

fn median(measurements: &[Measurement]) -> u64 {
    let mut times: Vec<u64> = measurements.iter().map(|m| m.elapsed_ns).collect();
    times.sort_unstable();
    times[times.len() / 2]
}

fn describe_misses(traced: &[Measurement]) -> String {
    let misses: Vec<String> =
        traced.iter().map(|m| format!("{:?} of {}", m.reported_bytes, m.leaked_bytes)).collect();
    format!("no: {}", misses.join(", "))
}

fn run_untraced(workload: &Path, args: &[String]) -> Result<Measurement> {
    let output = Command::new(workload).args(args).output().context("running the workload")?;
    parse_workload(&String::from_utf8_lossy(&output.stderr))
}

fn run_traced(memleak: &Path, workload: &Path, args: &[String]) -> Result<Measurement> {
    let command = format!("{} {}", workload.display(), args.join(" "));
    let output = Command::new(memleak)
        .args(["-c", &command, "--format", "json", "-o", "0", "-T", "1000", "3600"])
        .output()
        .context("running memleak")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("memleak failed: {stderr}");
    }
    let mut measurement = parse_workload(&stderr)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = stdout.lines().last().context("memleak printed no report")?;
    measurement.reported_bytes = Some(bytes_from(report, "leak_one")?);
    Ok(measurement)
}

/// Reads "elapsed_ns N leaked_bytes N leaked_allocations N".
fn parse_workload(stderr: &str) -> Result<Measurement> {
    let line = stderr.lines().find(|line| line.starts_with("elapsed_ns ")).context("no workload summary")?;
    let numbers: Vec<u64> =
        line.split_whitespace().skip(1).step_by(2).filter_map(|n| n.parse().ok()).collect();
    let [elapsed_ns, leaked_bytes, _] = numbers[..] else { bail!("cannot read {line:?}") };
    Ok(Measurement { elapsed_ns, leaked_bytes, reported_bytes: None })
}

/// Bytes of the stacks whose first frame is `function`, from a JSON report.
fn bytes_from(report: &str, function: &str) -> Result<u64> {
    let report: serde_json::Value = serde_json::from_str(report).context("memleak's report is not JSON")?;
    let stacks = report["stacks"].as_array().context("no stacks in the report")?;
    Ok(stacks
        .iter()
        .filter(|stack| stack["frames"][0]["function"] == function)
        .filter_map(|stack| stack["bytes"].as_u64())
        .sum())
}
