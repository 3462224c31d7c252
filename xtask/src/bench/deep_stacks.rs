//! memleak's own memory and time per report with 65,536 distinct stacks
//! of 37 frames (tests/fixtures/spread.c, 16 levels deep), written as
//! folded stacks: every stack, every frame, every report. The goal is
//! under 200 MB of memleak's RSS and under a second per report.

use std::{
    io::BufRead,
    path::Path,
    process::{ChildStdin, Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    latency,
    process::{lines_as_they_come, release, spawn_with_pipe, wait_for_line},
    stats::{self, Record},
};

/// One block per stack, from 2^16 paths.
const STACKS: u64 = 65_536;
const DEPTH: u32 = 16;
/// Reports taken once every stack is in: the peak RSS is after the last.
const REPORTS: usize = 3;
const GOAL_RSS_MB: f64 = 200.0;
const GOAL_REPORT_MS: f64 = 1000.0;
const PATIENCE: Duration = Duration::from_mins(2);

pub struct DeepStacks {
    /// memleak's peak RSS (`VmHWM`), in MB.
    peak_rss_mb: f64,
    /// The slowest of the reports with every stack in, built and written.
    report: stats::Report,
}

/// Runs `spread` under memleak reporting folded stacks every second.
pub fn measure(memleak: &Path, spread: &Path) -> Result<DeepStacks> {
    let (mut target, mut target_stderr) = latency::start_waiting(spread, &[STACKS, STACKS, DEPTH.into()])?;
    let mut command = Command::new(memleak);
    command
        .args(["-p", &target.id().to_string(), "--format", "folded", "--max-stacks", "70000", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let (mut tracer, stats) = spawn_with_pipe(&mut command, "--stats")?;
    let stats = lines_as_they_come(stats);
    let mut target_stdin = target.stdin.take().context("no stdin")?;
    let measured = observe(&stats, &mut target_stdin, &mut target_stderr, tracer.id());
    drop(target_stdin);
    let _ = target.wait();
    let exit = tracer.wait()?;
    let measured = measured?;
    if !exit.success() {
        bail!("memleak failed with {exit}");
    }
    Ok(measured)
}

/// Once memleak is attached, lets the fixture allocate, then takes
/// `REPORTS` reports that hold every stack, and memleak's peak RSS.
fn observe(
    stats: &Receiver<(Instant, String)>,
    target_stdin: &mut ChildStdin,
    target_stderr: &mut impl BufRead,
    memleak_pid: u32,
) -> Result<DeepStacks> {
    // The probes record comes once memleak is attached.
    loop {
        let (_, line) = stats.recv_timeout(PATIENCE).context("memleak never attached")?;
        if let Record::Probes(_) = Record::parse(&line)? {
            break;
        }
    }
    release(target_stdin)?;
    wait_for_line(target_stderr, "ready")?;
    let since = Instant::now();
    let mut full = Vec::new();
    while full.len() < REPORTS {
        let (read_at, line) = stats.recv_timeout(PATIENCE).context("memleak wrote no more reports")?;
        if let Record::Report(report) = Record::parse(&line)? {
            if read_at > since && report.stacks >= STACKS {
                full.push(report);
            }
        }
    }
    let peak_rss_mb = peak_rss_kb(memleak_pid)? as f64 / 1024.0;
    let cost = |report: &stats::Report| report.latency_ms + report.written_ms;
    let slowest = full.into_iter().max_by(|a, b| cost(a).total_cmp(&cost(b))).context("no report")?;
    Ok(DeepStacks { peak_rss_mb, report: slowest })
}

/// `VmHWM` of process `pid`, in KiB.
fn peak_rss_kb(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in memleak's status")
}

pub fn print(result: &Result<DeepStacks>) {
    println!();
    println!("memleak's own cost at {STACKS} stacks of 37 frames, as folded stacks every second:");
    println!();
    match result {
        Ok(deep) => {
            let report_ms = deep.report.latency_ms + deep.report.written_ms;
            println!(
                "- peak RSS {:.0} MB: {:.2} of the {GOAL_RSS_MB:.0} MB goal",
                deep.peak_rss_mb,
                deep.peak_rss_mb / GOAL_RSS_MB
            );
            println!(
                "- slowest report {report_ms:.0} ms ({:.0} ms built, {:.0} ms written, {} stacks): {:.2} of \
                 the {GOAL_REPORT_MS:.0} ms goal",
                deep.report.latency_ms,
                deep.report.written_ms,
                deep.report.stacks,
                report_ms / GOAL_REPORT_MS
            );
        }
        Err(error) => println!("- failed: {error:#}"),
    }
}
