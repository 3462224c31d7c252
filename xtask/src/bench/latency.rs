//! How long one memleak report takes with many allocations outstanding,
//! spread over 10,000 stacks (tests/fixtures/spread.c), and what memleak's
//! BPF maps weigh meanwhile.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, ChildStderr, ChildStdin, Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    map_memory::{self, MapMemory},
    process::{last_line, lines_as_they_come, release, spawn_with_pipe, wait_for_line},
    stats::{self, Record},
};

/// How memleak is asked to report.
#[derive(Clone, Copy)]
enum Mode {
    /// No -o: whatever memleak does by default.
    Default,
    /// -o 1: every allocation is read, to be filtered by age.
    EveryAllocation,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::EveryAllocation => "-o 1",
        }
    }
}

/// One report taken once every allocation was in.
struct Latency {
    /// Its size and latency, as memleak's --stats record of it says.
    report: stats::Report,
    /// memleak's health counter: allocations its map had no room for.
    not_tracked: u64,
    /// Map memory freshly attached, and with the allocations in.
    idle_memory: MapMemory,
    loaded_memory: MapMemory,
}

/// Both modes' measurements at one number of outstanding allocations.
/// A failed measurement is shown, not fatal: latency is informative.
pub struct Row {
    allocations: u64,
    default: Result<Latency>,
    every_allocation: Result<Latency>,
}

/// Measures each number of outstanding allocations in both modes.
pub fn measure_all(memleak: &Path, spread: &Path, sizes: &[u64]) -> Vec<Row> {
    let measure_one = |allocations, mode: Mode| {
        eprintln!("bench: report latency, {allocations} allocations, {} mode", mode.label());
        measure(memleak, spread, allocations, mode)
    };
    sizes
        .iter()
        .map(|&allocations| Row {
            allocations,
            default: measure_one(allocations, Mode::Default),
            every_allocation: measure_one(allocations, Mode::EveryAllocation),
        })
        .collect()
}

/// Room in memleak's allocation map for what the fixture allocates besides
/// its blocks.
const MAX_ALLOCS_HEADROOM: u64 = 10_000;

/// Reports begun after the last allocation that are waited for, at most,
/// for one that covers them all.
const REPORTS_TO_WAIT: u32 = 5;

/// A report that takes longer than this is not coming.
const PATIENCE: Duration = Duration::from_mins(2);

/// Runs `spread` holding `allocations` blocks under memleak, reporting
/// every second, and times a report that began after the last allocation.
fn measure(memleak: &Path, spread: &Path, allocations: u64, mode: Mode) -> Result<Latency> {
    let (mut target, mut target_stderr) = start_waiting(spread, &[allocations])?;

    // memleak only sees allocations made while it is attached: it attaches
    // first, then the fixture allocates.
    let mut command = memleak_command(memleak, target.id(), allocations, mode);
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let (mut tracer, stats) = spawn_with_pipe(&mut command, "--stats")?;
    let memleak_lines = MemleakLines {
        log: lines_as_they_come(tracer.stderr.take().context("no stderr")?),
        stats: lines_as_they_come(stats),
    };
    let reports = lines_as_they_come(tracer.stdout.take().context("no stdout")?);
    let mut target_stdin = target.stdin.take().context("no stdin")?;
    let observed = observe(&memleak_lines, tracer.id(), allocations, &mut target_stdin, &mut target_stderr);
    // Closing its stdin ends the fixture; memleak then prints a final
    // report and ends too. Both are our own children.
    drop(target_stdin);
    if observed.is_err() {
        let _ = target.kill();
        let _ = tracer.kill();
    }
    let _ = target.wait();
    let exit = tracer.wait()?;
    let Observed { report, idle_memory, loaded_memory } = observed?;
    if !exit.success() {
        bail!("memleak failed with {exit}");
    }
    let (_, last_report) = reports.iter().last().context("memleak printed no report")?;
    Ok(Latency { report, not_tracked: not_tracked(&last_report)?, idle_memory, loaded_memory })
}

/// Starts `spread ARGS`, and waits until it waits for its go: it has
/// allocated nothing yet.
pub fn start_waiting(spread: &Path, args: &[u64]) -> Result<(Child, BufReader<ChildStderr>)> {
    let mut target = Command::new(spread)
        .args(args.iter().map(u64::to_string))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run the spread fixture")?;
    let mut target_stderr = BufReader::new(target.stderr.take().context("no stderr")?);
    wait_for_line(&mut target_stderr, "waiting")?;
    Ok((target, target_stderr))
}

/// memleak reporting on `pid` every second, in JSON.
fn memleak_command(memleak: &Path, pid: u32, allocations: u64, mode: Mode) -> Command {
    let mut command = Command::new(memleak);
    command.args(["-p", &pid.to_string(), "--format", "json"]);
    command.args(["--max-allocs", &(allocations + MAX_ALLOCS_HEADROOM).to_string()]);
    if let Mode::EveryAllocation = mode {
        command.args(["-o", "1"]);
    }
    command.arg("1");
    command
}

/// The allocations memleak had no room for, from a JSON report's health
/// counters.
fn not_tracked(report: &str) -> Result<u64> {
    let report: serde_json::Value = serde_json::from_str(report).context("memleak's report is not JSON")?;
    report["health"]["allocations_not_tracked"]
        .as_u64()
        .context("no health.allocations_not_tracked in memleak's report")
}

/// What memleak writes as it runs, each line stamped with the moment it
/// was read.
struct MemleakLines {
    /// stderr: status lines, and why memleak stopped if it did.
    log: Receiver<(Instant, String)>,
    /// The --stats records.
    stats: Receiver<(Instant, String)>,
}

struct Observed {
    report: stats::Report,
    idle_memory: MapMemory,
    loaded_memory: MapMemory,
}

/// Once memleak is attached, lets the fixture allocate, then waits for a
/// report that began after the fixture said it was done.
fn observe(
    memleak: &MemleakLines,
    memleak_pid: u32,
    allocations: u64,
    target_stdin: &mut ChildStdin,
    target_stderr: &mut impl BufRead,
) -> Result<Observed> {
    next_line_with(&memleak.log, "tracing pid")?;
    let idle_memory = map_memory::of_process(memleak_pid)?;
    release(target_stdin)?;
    wait_for_line(target_stderr, "ready")?;
    let report = first_report_after(memleak, Instant::now(), allocations)?;
    let loaded_memory = map_memory::of_process(memleak_pid)?;
    Ok(Observed { report, idle_memory, loaded_memory })
}

/// The first report that began after `since` and covers all `allocations`;
/// a --stats record is stamped when it is read, and memleak writes it as
/// soon as the report is built, so the report began its latency before
/// that. memleak leaves out allocations younger than its -o age (500 ms by
/// default), so the first reports after the last allocation may not cover
/// them all: up to `REPORTS_TO_WAIT` are waited for, then the last is taken.
fn first_report_after(memleak: &MemleakLines, since: Instant, allocations: u64) -> Result<stats::Report> {
    let mut waited = 0;
    loop {
        let (read_at, report) = next_report(memleak)?;
        let began = read_at.checked_sub(report.latency()?);
        if began.is_none_or(|began| began < since) {
            continue;
        }
        waited += 1;
        if report.allocations >= allocations || waited == REPORTS_TO_WAIT {
            return Ok(report);
        }
    }
}

/// memleak's next report record, with the moment it was read.
fn next_report(memleak: &MemleakLines) -> Result<(Instant, stats::Report)> {
    loop {
        let Ok((read_at, line)) = memleak.stats.recv_timeout(PATIENCE) else {
            bail!("memleak wrote no more reports; its last words: {}", last_words(&memleak.log))
        };
        if let Record::Report(report) = Record::parse(&line)? {
            return Ok((read_at, report));
        }
    }
}

/// memleak's last line on stderr: why it stopped, if it did.
fn last_words(log: &Receiver<(Instant, String)>) -> String {
    // A moment for the log to catch up with memleak's end.
    let lines = std::iter::from_fn(|| log.recv_timeout(Duration::from_millis(100)).ok());
    let last = lines.map(|(_, line)| line).last().unwrap_or_default();
    last_line(&last).to_owned()
}

fn next_line_with(lines: &Receiver<(Instant, String)>, marker: &str) -> Result<(Instant, String)> {
    let mut last = String::new();
    loop {
        match lines.recv_timeout(PATIENCE) {
            Ok((read_at, line)) if line.contains(marker) => return Ok((read_at, line)),
            Ok((_, line)) => last = line,
            Err(_) => bail!("memleak never said {marker:?}; its last words: {}", last_line(&last)),
        }
    }
}

pub fn print(rows: &[Row]) {
    println!();
    println!(
        "report latency over 10,000 stacks: one report begun after the last allocation, from memleak's \
         --stats report records (in brackets: what the report covered):"
    );
    println!();
    println!("| outstanding allocations | default mode | -o 1 | allocations not tracked |");
    println!("|---|---|---|---|");
    for row in rows {
        let both = [&row.default, &row.every_allocation];
        let not_tracked: Vec<String> =
            both.iter().filter_map(|latency| Some(latency.as_ref().ok()?.not_tracked.to_string())).collect();
        let [default, every_allocation] = both.map(cell);
        println!("| {} | {default} | {every_allocation} | {} |", row.allocations, not_tracked.join(" / "));
    }
}

fn cell(latency: &Result<Latency>) -> String {
    match latency {
        Ok(latency) => {
            let report = &latency.report;
            format!(
                "{:.1} ms ({} stacks, {} allocations)",
                report.latency_ms, report.stacks, report.allocations
            )
        }
        Err(error) => format!("failed: {error:#}"),
    }
}

/// The map memory of the largest default-mode run: freshly attached, and
/// with every allocation in.
pub fn print_map_memory(rows: &[Row]) {
    let Some((allocations, latency)) =
        rows.iter().rev().find_map(|row| Some((row.allocations, row.default.as_ref().ok()?)))
    else {
        return;
    };
    let (idle, loaded) = (&latency.idle_memory, &latency.loaded_memory);
    println!();
    // The allocation map's bucket array is sized by --max-allocs.
    let max_allocs = allocations + MAX_ALLOCS_HEADROOM;
    println!(
        "memleak's BPF map memory (bytes_memlock, --max-allocs {max_allocs}): {} idle; {} with \
         {allocations} allocations outstanding",
        mib(idle.total()),
        mib(loaded.total())
    );
    println!("- idle: {}", by_map(idle));
    println!("- with {allocations} allocations: {}", by_map(loaded));
}

/// The maps of 0.1 MiB or more by name, the rest summed up.
fn by_map(memory: &MapMemory) -> String {
    let (large, small): (Vec<_>, Vec<_>) =
        memory.maps.iter().partition(|(_, bytes)| *bytes >= 1024 * 1024 / 10);
    let mut parts: Vec<String> =
        large.iter().map(|(name, bytes)| format!("{name} {}", mib(*bytes))).collect();
    if !small.is_empty() {
        let bytes: u64 = small.iter().map(|(_, bytes)| bytes).sum();
        parts.push(format!("{} more maps {:.0} KiB", small.len(), bytes as f64 / 1024.0));
    }
    parts.join(", ")
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
