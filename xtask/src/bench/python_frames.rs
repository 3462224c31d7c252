//! What Python frames cost (issue 23), on Debian's python3.11, which has
//! no frame pointers (memleak walks it by its `.eh_frame`): the workload
//! `tests/fixtures/python_alloc_bench.py` allocates bytearrays in a loop
//! with 5, 15 or 35 Python frames on the stack and the same native stack
//! under them, untraced, under memleak with `--python off`, and under
//! memleak walking Python frames (its default), interleaved in rounds.
//!
//! Two measures, each a difference or a ratio within one invocation:
//! - BPF time per Python frame: the kernel's run time of memleak's
//!   programs per allocation (`bpf_stats`), with frames less without,
//!   over the frames walked; and the slope from 5 to 35 frames, which
//!   leaves out the thread-state lookup every walk pays once.
//! - The workload's slowdown at 15 frames: the loop's own CPU time plus
//!   memleak's CPU meanwhile, with frames over `--python off`, and each
//!   over the untraced loop.
//!
//! memleak attaches with `-p` to the waiting workload, so neither's start
//! is in the measures, and reports once, on SIGINT, while the workload is
//! alive, for the frames it walked to be counted.

use std::{
    io::Write as _,
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    bpf_stats::{self, RunTime},
    process::{last_line, lines_as_they_come},
};
use crate::root;

/// Debian's python3.11: 3.11.2, built without frame pointers.
pub const PYTHON: &str = "/usr/bin/python3.11";

/// How much to measure.
pub struct Plan {
    /// Allocations of each run's loop.
    pub allocations: u64,
    pub rounds: usize,
}

/// Bytes of each bytearray: above pymalloc's 512, so each is a malloc (of
/// one byte more) in the interpreter, and a free when the ring turns.
const BLOCK_BYTES: u64 = 5000;
/// Blocks alive at a time: the report's top stack, to count its frames.
const KEPT: u64 = 16;

/// The depth of the slowdown's runs, the issue's.
const SLOWDOWN_DEPTH: u32 = 15;
/// The depths of the BPF time per frame: the slope between the two.
const SHALLOW: u32 = 5;
const DEEP: u32 = 35;

const GOAL_FRAME_NS: f64 = 100.0;
const GOAL_SLOWDOWN: f64 = 1.3;

/// Longer than any run takes.
const PATIENCE: Duration = Duration::from_mins(2);

/// How the workload runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Untraced,
    /// memleak `--python off`.
    NativeOnly,
    /// memleak as it comes: Python frames walked.
    PythonFrames,
}

/// One row of the table.
struct Setup {
    depth: u32,
    mode: Mode,
    runs: Vec<Run>,
    failure: Option<String>,
}

impl Setup {
    fn label(&self) -> String {
        let mode = match self.mode {
            Mode::Untraced => "untraced",
            Mode::NativeOnly => "memleak --python off",
            Mode::PythonFrames => "memleak",
        };
        format!("{mode}, {} Python frames deep", self.depth)
    }
}

/// One run's loop.
#[derive(Clone, Copy)]
struct Run {
    /// The workload's process CPU time in its loop, as it measured it:
    /// the probes' traps and BPF programs run in its threads.
    workload_cpu_ns: u64,
    wall_ns: u64,
    /// memleak's CPU time meanwhile (0 untraced).
    memleak_cpu_ns: u64,
    /// memleak's BPF programs meanwhile.
    bpf: RunTime,
    /// Python frames in the report's stack of the loop's blocks.
    python_frames: usize,
}

impl Run {
    fn cpu_ns(&self) -> u64 {
        self.workload_cpu_ns + self.memleak_cpu_ns
    }
}

/// The measures, to be printed.
pub struct PythonFrames {
    allocations: u64,
    rounds: usize,
    setups: Vec<Setup>,
}

/// Runs every setup once a round, in the order of the table, so that the
/// runs compared are close in time.
pub fn measure(memleak: &Path, plan: &Plan) -> Result<PythonFrames> {
    let script = root().join("tests/fixtures/python_alloc_bench.py");
    let _stats = bpf_stats::StatsEnabled::new()?;
    let setup = |depth, mode| Setup { depth, mode, runs: Vec::new(), failure: None };
    let mut setups = vec![setup(SLOWDOWN_DEPTH, Mode::Untraced)];
    for depth in [SHALLOW, SLOWDOWN_DEPTH, DEEP] {
        setups.extend([setup(depth, Mode::NativeOnly), setup(depth, Mode::PythonFrames)]);
    }
    for round in 1..=plan.rounds {
        for setup in setups.iter_mut().filter(|setup| setup.failure.is_none()) {
            eprintln!("bench: python frames, run {round}/{}: {}", plan.rounds, setup.label());
            let workload = Workload { script: &script, depth: setup.depth, allocations: plan.allocations };
            match run_once(memleak, &workload, setup.mode) {
                Ok(run) => setup.runs.push(run),
                Err(error) if setup.mode == Mode::Untraced => return Err(error),
                Err(error) => {
                    eprintln!("bench: {} failed, left out from now on: {error:#}", setup.label());
                    setup.failure = Some(format!("failed: {error:#}"));
                }
            }
        }
    }
    Ok(PythonFrames { allocations: plan.allocations, rounds: plan.rounds, setups })
}

struct Workload<'a> {
    script: &'a Path,
    depth: u32,
    allocations: u64,
}

/// The workload, started and waiting for its go.
struct Started {
    child: Child,
    stderr: Receiver<(Instant, String)>,
}

impl Started {
    fn new(workload: &Workload) -> Result<Self> {
        let args = [u64::from(workload.depth), workload.allocations, BLOCK_BYTES, KEPT];
        let mut child = Command::new(PYTHON)
            .arg(workload.script)
            .args(args.map(|arg| arg.to_string()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {PYTHON}"))?;
        let stderr = lines_as_they_come(child.stderr.take().context("no stderr")?);
        let mut started = Self { child, stderr };
        started.line_starting("ready")?;
        Ok(started)
    }

    fn go(&mut self) -> Result<()> {
        let stdin = self.child.stdin.as_mut().context("no stdin")?;
        stdin.write_all(b"go\n").context("cannot release the workload")
    }

    /// Its loop's times, once it is done.
    fn done(&mut self) -> Result<Loop> {
        Loop::parse(&self.line_starting("done ")?)
    }

    fn line_starting(&mut self, start: &str) -> Result<String> {
        let mut last = String::new();
        loop {
            match self.stderr.recv_timeout(PATIENCE) {
                Ok((_, line)) if line.starts_with(start) => return Ok(line),
                Ok((_, line)) => last = line,
                Err(_) => bail!("the workload never said {start:?}; its last words: {}", last_line(&last)),
            }
        }
    }

    /// Closing its stdin ends it.
    fn end(mut self) -> Result<()> {
        drop(self.child.stdin.take());
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the workload failed with {status}");
        }
        Ok(())
    }
}

impl Drop for Started {
    /// A workload left waiting by a failure: our own child.
    fn drop(&mut self) {
        if self.child.try_wait().is_ok_and(|status| status.is_none()) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What the workload says of its loop:
/// `done cpu_ns N wall_ns N allocations N`.
#[derive(Debug, PartialEq, Eq)]
struct Loop {
    cpu_ns: u64,
    wall_ns: u64,
    allocations: u64,
}

impl Loop {
    fn parse(line: &str) -> Result<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |name: &str| -> Result<u64> {
            let at = words.iter().position(|word| *word == name);
            let value = at.and_then(|at| words.get(at + 1)).and_then(|value| value.parse().ok());
            value.with_context(|| format!("no {name} in the workload's {line:?}"))
        };
        Ok(Self { cpu_ns: field("cpu_ns")?, wall_ns: field("wall_ns")?, allocations: field("allocations")? })
    }
}

fn run_once(memleak: &Path, workload: &Workload, mode: Mode) -> Result<Run> {
    let mut started = Started::new(workload)?;
    if mode == Mode::Untraced {
        started.go()?;
        let done = started.done()?;
        started.end()?;
        return Ok(Run {
            workload_cpu_ns: done.cpu_ns,
            wall_ns: done.wall_ns,
            memleak_cpu_ns: 0,
            bpf: RunTime::default(),
            python_frames: 0,
        });
    }
    let tracer = Tracer::attach(memleak, started.child.id(), mode)?;
    let measured = tracer.around(|| {
        started.go()?;
        started.done()
    });
    let report = tracer.report();
    started.end()?;
    let (done, (bpf, memleak_cpu_ns)) = measured?;
    if done.allocations != workload.allocations {
        bail!("the workload made {} allocations, not {}", done.allocations, workload.allocations);
    }
    let python_frames = loop_stack_python_frames(&report?)?;
    let expected = if mode == Mode::PythonFrames { workload.depth as usize } else { 0 };
    if python_frames != expected {
        bail!("memleak's stack of the loop has {python_frames} Python frames, not {expected}");
    }
    Ok(Run { workload_cpu_ns: done.cpu_ns, wall_ns: done.wall_ns, memleak_cpu_ns, bpf, python_frames })
}

/// memleak tracing the workload.
struct Tracer {
    child: Child,
    stdout: Receiver<(Instant, String)>,
    stderr: Receiver<(Instant, String)>,
}

impl Tracer {
    /// memleak on `pid`, once it says it traces it; one JSON report of
    /// every outstanding allocation, whatever its age, on SIGINT.
    fn attach(memleak: &Path, pid: u32, mode: Mode) -> Result<Self> {
        let mut command = Command::new(memleak);
        command.args(["-p", &pid.to_string(), "--format", "json", "-o", "0", "-T", "1"]);
        if mode == Mode::NativeOnly {
            command.args(["--python", "off"]);
        }
        // No report but the one at the end.
        command.arg("3600");
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run memleak")?;
        let stdout = lines_as_they_come(child.stdout.take().context("no stdout")?);
        let stderr = lines_as_they_come(child.stderr.take().context("no stderr")?);
        let tracer = Self { child, stdout, stderr };
        let mut said = Vec::new();
        loop {
            let Ok((_, line)) = tracer.stderr.recv_timeout(PATIENCE) else {
                bail!("memleak never said it traced pid {pid}: {}", last_line(&said.join("\n")))
            };
            let tracing = line.contains("tracing pid");
            said.push(line);
            if tracing {
                break;
            }
        }
        let python_found = said.iter().any(|line| line.contains("runs python"));
        if python_found != (mode == Mode::PythonFrames) {
            bail!("memleak's Python frames are not as asked: it said {said:?}");
        }
        Ok(tracer)
    }

    /// `measured`, with what memleak's BPF programs and memleak itself
    /// ran meanwhile.
    fn around<T>(&self, measured: impl FnOnce() -> Result<T>) -> Result<(T, (RunTime, u64))> {
        let pid = self.child.id();
        let (bpf_before, cpu_before) = (bpf_stats::of_process(pid)?, process_cpu_ns(pid)?);
        let value = measured()?;
        let (bpf_after, cpu_after) = (bpf_stats::of_process(pid)?, process_cpu_ns(pid)?);
        Ok((value, (bpf_after.since(bpf_before), cpu_after.saturating_sub(cpu_before))))
    }

    /// Stops memleak with SIGINT and takes its last report.
    fn report(mut self) -> Result<serde_json::Value> {
        let pid = libc::pid_t::try_from(self.child.id()).context("pid out of range")?;
        // SAFETY: our own child, not yet waited for.
        if unsafe { libc::kill(pid, libc::SIGINT) } != 0 {
            return Err(std::io::Error::last_os_error()).context("cannot stop memleak");
        }
        let status = self.child.wait()?;
        let log: Vec<String> = self.stderr.try_iter().map(|(_, line)| line).collect();
        if !status.success() {
            bail!("memleak failed with {status}: {}", last_line(&log.join("\n")));
        }
        let (_, report) = self.stdout.iter().last().context("memleak printed no report")?;
        serde_json::from_str(&report).context("memleak's report is not JSON")
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        if self.child.try_wait().is_ok_and(|status| status.is_none()) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The CPU time process `pid` (every thread, living or gone) has used.
fn process_cpu_ns(pid: u32) -> Result<u64> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: a pointer to a live local.
    let error = unsafe { libc::clock_getcpuclockid(libc::pid_t::try_from(pid)?, &raw mut clock) };
    if error != 0 {
        return Err(std::io::Error::from_raw_os_error(error)).context("clock_getcpuclockid");
    }
    // SAFETY: timespec is plain old data; all zeroes is a valid value.
    let mut time: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a pointer to a live local.
    if unsafe { libc::clock_gettime(clock, &raw mut time) } != 0 {
        return Err(std::io::Error::last_os_error()).context("clock_gettime of memleak's CPU");
    }
    Ok(time.tv_sec as u64 * 1_000_000_000 + time.tv_nsec as u64)
}

/// The Python frames of the report's stack holding the loop's `KEPT`
/// blocks, the one with the most bytes.
fn loop_stack_python_frames(report: &serde_json::Value) -> Result<usize> {
    let stacks = report["stacks"].as_array().context("no stacks in memleak's report")?;
    let top = stacks
        .iter()
        .max_by_key(|stack| stack["bytes"].as_u64().unwrap_or(0))
        .context("memleak's report has no stack")?;
    if top["allocations"].as_u64() != Some(KEPT) {
        bail!("memleak's top stack holds {} allocations, not the loop's {KEPT}", top["allocations"]);
    }
    let frames = top["frames"].as_array().context("a stack without frames")?;
    Ok(frames.iter().filter(|frame| frame["kind"] == "python").count())
}

/// A value of the runs of `setup`, and its median.
fn median_of(setup: &Setup, value: impl Fn(&Run) -> f64) -> Option<f64> {
    median(setup.runs.iter().map(value).collect())
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// A measure taken once a round: its median, and its lowest and highest,
/// which show how much this machine's noise moved it.
#[derive(Debug, PartialEq)]
struct Spread {
    median: f64,
    low: f64,
    high: f64,
}

impl Spread {
    /// None for no rounds.
    fn of(values: impl Iterator<Item = f64>) -> Option<Self> {
        let mut values: Vec<f64> = values.collect();
        values.sort_by(f64::total_cmp);
        Some(Self { median: *values.get(values.len() / 2)?, low: *values.first()?, high: *values.last()? })
    }
}

impl PythonFrames {
    fn setup(&self, depth: u32, mode: Mode) -> Option<&Setup> {
        self.setups.iter().find(|setup| setup.depth == depth && setup.mode == mode)
    }

    fn per_allocation(&self, ns: u64) -> f64 {
        ns as f64 / self.allocations as f64
    }

    /// BPF ns per allocation of each run of a setup, by round.
    fn bpf_per_allocation(&self, depth: u32, mode: Mode) -> Vec<f64> {
        let Some(setup) = self.setup(depth, mode) else { return Vec::new() };
        setup.runs.iter().map(|run| self.per_allocation(run.bpf.ns)).collect()
    }

    /// CPU (the workload's and memleak's) of each run of a setup, by round.
    fn cpu_by_round(&self, depth: u32, mode: Mode) -> Vec<f64> {
        let Some(setup) = self.setup(depth, mode) else { return Vec::new() };
        setup.runs.iter().map(|run| run.cpu_ns() as f64).collect()
    }

    /// The BPF time per allocation that walking adds, over the frames
    /// walked, by round: each round's runs with and without frames ran
    /// one after the other, so a round pairs them.
    fn bpf_ns_per_frame(&self, depth: u32) -> Option<Spread> {
        let with = self.bpf_per_allocation(depth, Mode::PythonFrames);
        let without = self.bpf_per_allocation(depth, Mode::NativeOnly);
        Spread::of(with.iter().zip(&without).map(|(with, without)| (with - without) / f64::from(depth)))
    }

    /// The BPF time each frame from `SHALLOW` to `DEEP` adds, by round:
    /// the walk's cost per frame alone.
    fn bpf_ns_per_frame_slope(&self) -> Option<Spread> {
        let deep = self.bpf_per_allocation(DEEP, Mode::PythonFrames);
        let shallow = self.bpf_per_allocation(SHALLOW, Mode::PythonFrames);
        Spread::of(
            deep.iter().zip(&shallow).map(|(deep, shallow)| (deep - shallow) / f64::from(DEEP - SHALLOW)),
        )
    }

    /// What a walk costs whatever its depth (finding the thread's frame),
    /// by round: the BPF time `SHALLOW` frames add, less `SHALLOW` steps
    /// at that round's slope.
    fn bpf_ns_per_walk(&self) -> Option<Spread> {
        let [deep, shallow, without] =
            [(DEEP, Mode::PythonFrames), (SHALLOW, Mode::PythonFrames), (SHALLOW, Mode::NativeOnly)]
                .map(|(depth, mode)| self.bpf_per_allocation(depth, mode));
        let steps = f64::from(SHALLOW);
        Spread::of(deep.iter().zip(&shallow).zip(&without).map(|((deep, shallow), without)| {
            let slope = (deep - shallow) / f64::from(DEEP - SHALLOW);
            shallow - without - steps * slope
        }))
    }

    /// The CPU with Python frames over that with `--python off` at the
    /// slowdown's depth, by round.
    fn slowdown_of_frames(&self) -> Option<Spread> {
        let with = self.cpu_by_round(SLOWDOWN_DEPTH, Mode::PythonFrames);
        let without = self.cpu_by_round(SLOWDOWN_DEPTH, Mode::NativeOnly);
        Spread::of(with.iter().zip(&without).map(|(with, without)| with / without))
    }

    /// The median CPU (the workload's and memleak's) of `depth`'s runs in
    /// `mode`, over the untraced runs' at the slowdown's depth.
    fn cpu_over_untraced(&self, depth: u32, mode: Mode) -> Option<f64> {
        let cpu = |setup: &Setup| median_of(setup, |run| run.cpu_ns() as f64);
        Some(cpu(self.setup(depth, mode)?)? / cpu(self.setup(SLOWDOWN_DEPTH, Mode::Untraced)?)?)
    }
}

pub fn print(result: &Result<PythonFrames>) {
    println!();
    let measured = match result {
        Ok(measured) => measured,
        Err(error) => {
            println!("Python frames: not measured: {error:#}");
            return;
        }
    };
    println!(
        "Python frames: Debian's {PYTHON} (no frame pointers) allocating {} bytearrays of {BLOCK_BYTES} \
         bytes in a loop, {KEPT} kept, memleak -p; median of {} runs:",
        measured.allocations, measured.rounds
    );
    println!();
    print_table(measured);
    print_goals(measured);
}

/// The medians of each setup.
fn print_table(measured: &PythonFrames) {
    println!(
        "| run | Python frames in the stack | loop wall time | BPF per allocation | workload CPU per allocation \
         | memleak CPU | CPU / untraced |"
    );
    println!("|---|---|---|---|---|---|---|");
    for setup in &measured.setups {
        if let Some(failure) = &setup.failure {
            println!("| {} | {failure} | | | | | |", setup.label());
            continue;
        }
        let ns = |value: Option<f64>| value.map_or_else(String::new, |value| format!("{value:.0} ns"));
        let frames = match setup.mode {
            Mode::Untraced => "-".to_owned(),
            _ => median_of(setup, |run| run.python_frames as f64)
                .map_or_else(String::new, |frames| format!("{frames:.0}")),
        };
        let wall = median_of(setup, |run| run.wall_ns as f64 / 1e6)
            .map_or_else(String::new, |ms| format!("{ms:.0} ms"));
        let bpf = match setup.mode {
            Mode::Untraced => String::new(),
            _ => ns(median_of(setup, |run| measured.per_allocation(run.bpf.ns))),
        };
        let workload = ns(median_of(setup, |run| measured.per_allocation(run.workload_cpu_ns)));
        let memleak = match setup.mode {
            Mode::Untraced => String::new(),
            _ => median_of(setup, |run| run.memleak_cpu_ns as f64 / 1e6)
                .map_or_else(String::new, |ms| format!("{ms:.0} ms")),
        };
        let slowdown = measured
            .cpu_over_untraced(setup.depth, setup.mode)
            .map_or_else(String::new, |slowdown| format!("{slowdown:.2}x"));
        println!("| {} | {frames} | {wall} | {bpf} | {workload} | {memleak} | {slowdown} |", setup.label());
    }
    println!();
    println!(
        "BPF time is the kernel's run time of memleak's programs (BPF_ENABLE_STATS) during the loop; CPU is \
         the loop's process CPU time plus memleak's meanwhile."
    );
}

/// The measures against their goals.
fn print_goals(measured: &PythonFrames) {
    println!();
    println!("Medians of the rounds, each pairing runs made one after the other (lowest to highest round):");
    let ns = |value: f64| format!("{value:.0} ns");
    let frame_goal = format!("goal under {GOAL_FRAME_NS:.0} ns warm");
    for depth in [SHALLOW, SLOWDOWN_DEPTH, DEEP] {
        print_goal(
            &format!(
                "BPF time per Python frame at {depth} frames (with frames less --python off, over {depth})"
            ),
            measured.bpf_ns_per_frame(depth),
            ns,
            Some((GOAL_FRAME_NS, &frame_goal)),
        );
    }
    print_goal(
        &format!("BPF time per Python frame from {SHALLOW} to {DEEP} frames (the walk's step alone)"),
        measured.bpf_ns_per_frame_slope(),
        ns,
        Some((GOAL_FRAME_NS, &frame_goal)),
    );
    print_goal(
        "BPF time per walk besides its frames (finding the thread's frame)",
        measured.bpf_ns_per_walk(),
        ns,
        None,
    );
    print_goal(
        &format!("slowdown with Python frames / --python off at {SLOWDOWN_DEPTH} frames"),
        measured.slowdown_of_frames(),
        |value| format!("{value:.2}"),
        Some((GOAL_SLOWDOWN, &format!("goal <= {GOAL_SLOWDOWN}"))),
    );
}

/// "what: median (low to high), 0.60 of the goal (goal ...)".
fn print_goal(what: &str, spread: Option<Spread>, show: impl Fn(f64) -> String, goal: Option<(f64, &str)>) {
    let Some(spread) = spread else {
        println!("{what}: not measured");
        return;
    };
    let (median, low, high) = (show(spread.median), show(spread.low), show(spread.high));
    match goal {
        Some((goal, said)) => {
            println!("{what}: {median} ({low} to {high}), {:.2} of the goal ({said})", spread.median / goal);
        }
        None => println!("{what}: {median} ({low} to {high})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_workloads_loop() {
        let done = Loop::parse("done cpu_ns 524843247 wall_ns 525048198 allocations 100000").expect("a loop");
        assert_eq!(done, Loop { cpu_ns: 524_843_247, wall_ns: 525_048_198, allocations: 100_000 });
        assert!(Loop::parse("done cpu_ns 5").is_err(), "a line without wall_ns read as a loop");
    }

    #[test]
    fn counts_the_python_frames_of_the_loops_stack() {
        let report = serde_json::json!({"stacks": [
            {"bytes": 300, "allocations": 2, "frames": [{"function": "malloc"}, {"function": "<module>", "kind": "python"}]},
            {"bytes": 80_016, "allocations": KEPT, "frames": [
                {"function": "malloc"},
                {"function": "allocate", "kind": "python"},
                {"function": "descend", "kind": "python"},
                {"function": "<module>", "kind": "python"},
                {"function": "Py_BytesMain"},
            ]},
        ]});
        assert_eq!(loop_stack_python_frames(&report).expect("a stack"), 3);
        let wrong = serde_json::json!({"stacks": [{"bytes": 5001, "allocations": 1, "frames": []}]});
        assert!(loop_stack_python_frames(&wrong).is_err(), "a stack of 1 allocation taken for the loop's");
    }

    #[test]
    fn per_frame_costs_pair_the_runs_of_a_round() {
        let run = |bpf_ns: u64| Run {
            workload_cpu_ns: 0,
            wall_ns: 0,
            memleak_cpu_ns: 0,
            bpf: RunTime { ns: bpf_ns, runs: 0 },
            python_frames: 0,
        };
        // 1,000 allocations a run: ns per allocation are the ns / 1000.
        let setup = |depth, mode, bpf_ns: &[u64]| Setup {
            depth,
            mode,
            runs: bpf_ns.iter().map(|&ns| run(ns)).collect(),
            failure: None,
        };
        let measured = PythonFrames {
            allocations: 1000,
            rounds: 3,
            setups: vec![
                // 300 ns a walk and 60 a frame, but 50 ns more at 5 frames
                // in the third round; the second round ran on a slower
                // machine, which pairing keeps from moving the difference.
                setup(SHALLOW, Mode::NativeOnly, &[1_000_000, 2_000_000, 1_000_000]),
                setup(SHALLOW, Mode::PythonFrames, &[1_600_000, 2_600_000, 1_650_000]),
                setup(DEEP, Mode::NativeOnly, &[1_000_000, 2_000_000, 1_000_000]),
                setup(DEEP, Mode::PythonFrames, &[3_400_000, 4_400_000, 3_400_000]),
            ],
        };
        let median = |spread: Option<Spread>| spread.map(|spread| spread.median);
        // 600 ns over 5 frames in two rounds of three, 650 in the third.
        let per_frame = measured.bpf_ns_per_frame(SHALLOW).expect("a spread");
        assert_eq!(per_frame, Spread { median: 120.0, low: 120.0, high: 130.0 });
        // (3400 - 1600) / 30 in two rounds.
        assert_eq!(median(measured.bpf_ns_per_frame_slope()), Some(60.0));
        // 600 - 5 x 60 in two rounds.
        assert_eq!(median(measured.bpf_ns_per_walk()), Some(300.0));
        assert_eq!(measured.bpf_ns_per_frame(SLOWDOWN_DEPTH), None);
    }
}
