//! What Python frames cost (issue 23), on Debian's python3.11, which has
//! no frame pointers (memleak walks it by its `.eh_frame`): the workload
//! `tests/fixtures/python_alloc_bench.py` allocates bytearrays in loops
//! with 5, 15 or 35 Python frames on the stack and the same native stack
//! under them, untraced, under memleak with `--python off`, and under
//! memleak walking Python frames (its default).
//!
//! A round runs one workload process in each of the three modes, one
//! after the other, and each process runs short loops at the three depths
//! in turn, several times: depths are compared within a process, loops
//! apart by tens of milliseconds, and modes between processes of the same
//! round, so that the load of a shared machine, which comes and goes,
//! moves what is compared alike.
//!
//! Measured in one invocation, as differences and ratios:
//! - BPF time per Python frame: the kernel's run time of memleak's
//!   uprobe programs per allocation (`bpf_stats`), with frames less without,
//!   over the frames walked; the slope from 5 to 35 frames, which leaves
//!   out what every walk pays once (finding the thread's frame); and that.
//! - The workload's slowdown at 15 frames: the loops' own CPU time plus
//!   memleak's CPU meanwhile, with frames over `--python off`, and each
//!   over the untraced loops.
//!
//! memleak attaches with `-p` to the waiting workload, so neither's start
//! is in the measures, and reports once, on SIGINT, while the workload is
//! alive, for the frames it walked to be counted.
//!
//! The workload runs from a copy of the interpreter under a name of its
//! own: a `memleak serve --exe python3.11` elsewhere on the machine would
//! otherwise follow it too, and its probes would be measured with
//! memleak's. Any other tracer whose probes reach every process is
//! caught by the untraced runs: a process that took a uprobe has a
//! `[uprobes]` mapping.

use std::{
    io::Write as _,
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    bpf_stats::{self, RunTime},
    process::{last_line, lines_as_they_come},
    tracer::Tracer,
};
use crate::root;

/// Debian's python3.11: 3.11.2, built without frame pointers.
pub const PYTHON: &str = "/usr/bin/python3.11";
/// The name of the bench's copy of it, which no `--exe python3.11` picks
/// (3.11 says its version in `Py_Version`, not only in its name).
const COPY_NAME: &str = "bench-python3.11";

/// How much to measure.
pub struct Plan {
    /// Allocations of each loop.
    pub allocations: u64,
    /// Loops at each depth in each process.
    pub loops: usize,
    pub rounds: usize,
}

/// Bytes of each bytearray: above pymalloc's 512, so each is a malloc (of
/// one byte more) in the interpreter, and a free when its ring turns.
const BLOCK_BYTES: u64 = 5000;
/// Blocks alive at a time at each depth: a stack of its own in memleak's
/// report, whose frames are counted.
const KEPT: u64 = 16;

/// Allocations of the loop at each depth that comes first in each
/// process, not measured: enough for every stack to be in memleak's maps,
/// and caches warm.
const WARM_UP_ALLOCATIONS: u64 = 2000;

/// The depths of the BPF time per frame: the slope between the two.
const SHALLOW: u32 = 5;
/// The depth of the slowdown, the issue's.
const SLOWDOWN_DEPTH: u32 = 15;
const DEEP: u32 = 35;
const DEPTHS: [u32; 3] = [SHALLOW, SLOWDOWN_DEPTH, DEEP];

const GOAL_FRAME_NS: f64 = 100.0;
const GOAL_SLOWDOWN: f64 = 1.3;

/// Longer than any run takes.
const PATIENCE: Duration = Duration::from_mins(2);

/// How the workload runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Untraced,
    /// memleak `--python off`.
    NativeOnly,
    /// memleak as it comes: Python frames walked.
    PythonFrames,
}

const MODES: [Mode; 3] = [Mode::Untraced, Mode::NativeOnly, Mode::PythonFrames];

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Untraced => "untraced",
            Mode::NativeOnly => "memleak --python off",
            Mode::PythonFrames => "memleak",
        }
    }
}

/// One loop, and what ran meanwhile.
#[derive(Clone, Copy, Debug, Default)]
struct Loop {
    depth: u32,
    /// The workload's process CPU time in its loop, as it measured it:
    /// the probes' traps and BPF programs run in its thread.
    workload_cpu_ns: u64,
    wall_ns: u64,
    /// memleak's CPU time meanwhile (0 untraced).
    memleak_cpu_ns: u64,
    /// memleak's uprobe programs meanwhile.
    bpf: RunTime,
}

impl Loop {
    fn cpu_ns(&self) -> u64 {
        self.workload_cpu_ns + self.memleak_cpu_ns
    }
}

/// One workload process: its loops, in the order they ran (the depths in
/// turn).
struct Process {
    loops: Vec<Loop>,
    /// An untraced process that took uprobes all the same: another tracer
    /// probes every process.
    probed_by_another: bool,
}

impl Process {
    /// The sums of the loops at `depth`.
    fn total(&self, depth: u32) -> Loop {
        self.loops.iter().filter(|run| run.depth == depth).fold(
            Loop { depth, ..Loop::default() },
            |sum, run| Loop {
                depth,
                workload_cpu_ns: sum.workload_cpu_ns + run.workload_cpu_ns,
                wall_ns: sum.wall_ns + run.wall_ns,
                memleak_cpu_ns: sum.memleak_cpu_ns + run.memleak_cpu_ns,
                bpf: RunTime { ns: sum.bpf.ns + run.bpf.ns, runs: sum.bpf.runs + run.bpf.runs },
            },
        )
    }
}

/// The processes of one mode, one a round.
struct Runs {
    mode: Mode,
    processes: Vec<Process>,
    /// Why it has no (more) processes: the rest goes on without it.
    failure: Option<String>,
}

/// The measures, to be printed.
pub struct PythonFrames {
    /// Allocations of each depth in each process.
    allocations: u64,
    rounds: usize,
    runs: Vec<Runs>,
}

/// Runs a workload process in each mode once a round.
pub fn measure(memleak: &Path, plan: &Plan) -> Result<PythonFrames> {
    let script = root().join("tests/fixtures/python_alloc_bench.py");
    let scratch = root().join("target/bench");
    std::fs::create_dir_all(&scratch)?;
    let python = scratch.join(COPY_NAME);
    std::fs::copy(PYTHON, &python)
        .with_context(|| format!("cannot copy {PYTHON} to {}", python.display()))?;
    let _stats = bpf_stats::StatsEnabled::new()?;
    let mut runs: Vec<Runs> =
        MODES.iter().map(|&mode| Runs { mode, processes: Vec::new(), failure: None }).collect();
    for round in 1..=plan.rounds {
        for runs in runs.iter_mut().filter(|runs| runs.failure.is_none()) {
            eprintln!("bench: python frames, run {round}/{}: {}", plan.rounds, runs.mode.label());
            match run_process(memleak, &python, &script, plan, runs.mode) {
                Ok(process) => runs.processes.push(process),
                Err(error) if runs.mode == Mode::Untraced => return Err(error),
                Err(error) => {
                    eprintln!("bench: {} failed, left out from now on: {error:#}", runs.mode.label());
                    runs.failure = Some(format!("failed: {error:#}"));
                }
            }
        }
    }
    Ok(PythonFrames { allocations: plan.allocations * plan.loops as u64, rounds: plan.rounds, runs })
}

/// One workload process in `mode`: `plan.loops` loops at each depth, the
/// depths in turn.
fn run_process(memleak: &Path, python: &Path, script: &Path, plan: &Plan, mode: Mode) -> Result<Process> {
    let mut workload = Workload::start(python, script)?;
    let tracer = match mode {
        Mode::Untraced => None,
        Mode::NativeOnly | Mode::PythonFrames => {
            let native_only: &[&str] = if mode == Mode::NativeOnly { &["--python", "off"] } else { &[] };
            let tracer =
                Tracer::attach(memleak, workload.pid(), &[&["-T", "100"][..], native_only].concat())?;
            let python_found = tracer.said.iter().any(|line| line.contains("runs python"));
            if python_found != (mode == Mode::PythonFrames) {
                bail!("memleak's Python frames are not as asked: it said {:?}", tracer.said);
            }
            Some(tracer)
        }
    };
    // Unmeasured: the goal is the cost warm, with the stacks already in
    // memleak's maps and the Python frames resolved.
    for depth in DEPTHS {
        workload.run_loop(depth, WARM_UP_ALLOCATIONS)?;
    }
    let mut loops = Vec::new();
    for _ in 0..plan.loops {
        for depth in DEPTHS {
            let before = tracer.as_ref().map(Tracer::usage).transpose()?;
            let done = workload.run_loop(depth, plan.allocations)?;
            let after = tracer.as_ref().map(Tracer::usage).transpose()?;
            let (bpf, memleak_cpu_ns) = match (before, after) {
                (Some((bpf_before, cpu_before)), Some((bpf_after, cpu_after))) => {
                    (bpf_after.since(bpf_before), cpu_after.saturating_sub(cpu_before))
                }
                _ => (RunTime::default(), 0),
            };
            loops.push(Loop {
                depth,
                workload_cpu_ns: done.cpu_ns,
                wall_ns: done.wall_ns,
                memleak_cpu_ns,
                bpf,
            });
        }
    }
    if let Some(tracer) = tracer {
        let report = tracer.report()?;
        let frames = loop_stacks_python_frames(&report)?;
        // With --python off the depths' blocks share one native stack.
        let expected =
            if mode == Mode::PythonFrames { DEPTHS.map(|depth| depth as usize).to_vec() } else { vec![0] };
        if frames != expected {
            bail!("memleak's stacks of the loops have {frames:?} Python frames, not {expected:?}");
        }
    }
    let probed_by_another = mode == Mode::Untraced && workload.took_uprobes()?;
    workload.end()?;
    Ok(Process { loops, probed_by_another })
}

/// The workload, started and waiting for its loops.
struct Workload {
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: Receiver<(Instant, String)>,
}

impl Workload {
    fn start(python: &Path, script: &Path) -> Result<Self> {
        let mut child = Command::new(python)
            .arg(script)
            .args([BLOCK_BYTES, KEPT].map(|arg| arg.to_string()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {}", python.display()))?;
        let stdin = child.stdin.take();
        let stderr = lines_as_they_come(child.stderr.take().context("no stderr")?);
        let mut workload = Self { child, stdin, stderr };
        workload.line_starting("ready")?;
        Ok(workload)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Runs one loop of `allocations` at `depth`; what it says of it.
    fn run_loop(&mut self, depth: u32, allocations: u64) -> Result<Done> {
        let stdin = self.stdin.as_mut().context("no stdin")?;
        writeln!(stdin, "{depth} {allocations}").context("cannot start the workload's loop")?;
        let done = Done::parse(&self.line_starting("done ")?)?;
        if (done.depth, done.allocations) != (depth, allocations) {
            bail!("the workload ran {done:?}, not {allocations} allocations at depth {depth}");
        }
        Ok(done)
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

    /// Whether a uprobe fired in it: the kernel maps its `[uprobes]` page
    /// into a process for the first return probe or single step.
    fn took_uprobes(&self) -> Result<bool> {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.pid()))?;
        Ok(maps.lines().any(|line| line.ends_with("[uprobes]")))
    }

    /// Closing its stdin ends it.
    fn end(mut self) -> Result<()> {
        drop(self.stdin.take());
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the workload failed with {status}");
        }
        Ok(())
    }
}

impl Drop for Workload {
    /// A workload left waiting by a failure: our own child.
    fn drop(&mut self) {
        if self.child.try_wait().is_ok_and(|status| status.is_none()) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What the workload says of a loop:
/// `done depth N cpu_ns N wall_ns N allocations N`.
#[derive(Debug, PartialEq, Eq)]
struct Done {
    depth: u32,
    cpu_ns: u64,
    wall_ns: u64,
    allocations: u64,
}

impl Done {
    fn parse(line: &str) -> Result<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |name: &str| -> Result<u64> {
            let at = words.iter().position(|word| *word == name);
            let value = at.and_then(|at| words.get(at + 1)).and_then(|value| value.parse().ok());
            value.with_context(|| format!("no {name} in the workload's {line:?}"))
        };
        Ok(Self {
            depth: u32::try_from(field("depth")?)?,
            cpu_ns: field("cpu_ns")?,
            wall_ns: field("wall_ns")?,
            allocations: field("allocations")?,
        })
    }
}

/// The Python frames of each stack in the report holding the loops'
/// blocks (blocks of at least `BLOCK_BYTES`, `KEPT` of them for each
/// depth), fewest first.
fn loop_stacks_python_frames(report: &serde_json::Value) -> Result<Vec<usize>> {
    let stacks = report["stacks"].as_array().context("no stacks in memleak's report")?;
    let holds_loop_blocks = |stack: &&serde_json::Value| {
        let (bytes, allocations) = (stack["bytes"].as_u64(), stack["allocations"].as_u64());
        bytes.zip(allocations).is_some_and(|(bytes, allocations)| {
            allocations > 0 && allocations % KEPT == 0 && bytes >= allocations * BLOCK_BYTES
        })
    };
    let mut frames: Vec<usize> = stacks
        .iter()
        .filter(holds_loop_blocks)
        .map(|stack| {
            let frames = stack["frames"].as_array().map_or(&[][..], Vec::as_slice);
            frames.iter().filter(|frame| frame["kind"] == "python").count()
        })
        .collect();
    frames.sort_unstable();
    Ok(frames)
}

/// A measure taken several times: its median, and its lowest and highest,
/// which show how much this machine's noise moved it.
#[derive(Debug, PartialEq)]
struct Spread {
    median: f64,
    low: f64,
    high: f64,
}

impl Spread {
    /// None for no values.
    fn of(values: impl Iterator<Item = f64>) -> Option<Self> {
        let mut values: Vec<f64> = values.collect();
        values.sort_by(f64::total_cmp);
        Some(Self { median: *values.get(values.len() / 2)?, low: *values.first()?, high: *values.last()? })
    }
}

impl PythonFrames {
    fn runs(&self, mode: Mode) -> &[Process] {
        self.runs.iter().find(|runs| runs.mode == mode).map_or(&[], |runs| &runs.processes)
    }

    fn per_allocation(&self, ns: u64) -> f64 {
        ns as f64 / self.allocations as f64
    }

    /// A value of the loops at `depth` in `mode`, per allocation, by round.
    fn by_round(&self, mode: Mode, depth: u32, value: impl Fn(&Loop) -> u64) -> Vec<f64> {
        self.runs(mode).iter().map(|process| self.per_allocation(value(&process.total(depth)))).collect()
    }

    /// The BPF time per allocation that walking adds, over the frames
    /// walked, by round.
    fn bpf_ns_per_frame(&self, depth: u32) -> Option<Spread> {
        let with = self.by_round(Mode::PythonFrames, depth, |run| run.bpf.ns);
        let without = self.by_round(Mode::NativeOnly, depth, |run| run.bpf.ns);
        Spread::of(with.iter().zip(&without).map(|(with, without)| (with - without) / f64::from(depth)))
    }

    /// The BPF time each frame from `SHALLOW` to `DEEP` adds: the walk's
    /// cost per frame alone, by round.
    fn bpf_ns_per_frame_slope(&self) -> Option<Spread> {
        Spread::of(self.runs(Mode::PythonFrames).iter().map(|process| self.slope(process)))
    }

    fn slope(&self, process: &Process) -> f64 {
        let [shallow, deep] = [SHALLOW, DEEP].map(|depth| self.per_allocation(process.total(depth).bpf.ns));
        (deep - shallow) / f64::from(DEEP - SHALLOW)
    }

    /// What a walk costs whatever its depth (finding the thread's frame),
    /// by round: the BPF time `SHALLOW` frames add, less `SHALLOW` steps
    /// at that round's slope.
    fn bpf_ns_per_walk(&self) -> Option<Spread> {
        let with = self.runs(Mode::PythonFrames);
        let without = self.by_round(Mode::NativeOnly, SHALLOW, |run| run.bpf.ns);
        Spread::of(with.iter().zip(&without).map(|(process, without)| {
            let added = self.per_allocation(process.total(SHALLOW).bpf.ns) - without;
            added - f64::from(SHALLOW) * self.slope(process)
        }))
    }

    /// The CPU of `mode` over that of `base` at `depth`, by round.
    fn cpu_ratio(&self, mode: Mode, base: Mode, depth: u32) -> Option<Spread> {
        let cpu = self.by_round(mode, depth, Loop::cpu_ns);
        let base = self.by_round(base, depth, Loop::cpu_ns);
        Spread::of(cpu.iter().zip(&base).map(|(cpu, base)| cpu / base))
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
        "Python frames: Debian's {PYTHON} (no frame pointers, run as {COPY_NAME}) allocating bytearrays of {BLOCK_BYTES} bytes in \
         loops, {} at each depth in each of {} rounds, memleak -p; medians of the rounds:",
        measured.allocations, measured.rounds
    );
    println!();
    print_table(measured);
    print_goals(measured);
    let probed = measured.runs(Mode::Untraced).iter().filter(|process| process.probed_by_another).count();
    if probed > 0 {
        println!(
            "Not clean: {probed} of the {} untraced processes took uprobes, so another tracer on this machine \
             probes every process, and the traced ones too.",
            measured.runs(Mode::Untraced).len()
        );
    }
}

/// The medians of each mode and depth.
fn print_table(measured: &PythonFrames) {
    println!(
        "| run | Python frames deep | loops' wall time | BPF per allocation | workload CPU per allocation | \
         memleak CPU | CPU / untraced |"
    );
    println!("|---|---|---|---|---|---|---|");
    for runs in &measured.runs {
        let label = runs.mode.label();
        if let Some(failure) = &runs.failure {
            println!("| {label} | {failure} | | | | | |");
            continue;
        }
        for depth in DEPTHS {
            let median =
                |value: fn(&Loop) -> u64| Spread::of(measured.by_round(runs.mode, depth, value).into_iter());
            let traced = runs.mode != Mode::Untraced;
            let ns = |value: fn(&Loop) -> u64| {
                median(value).map_or_else(String::new, |spread| format!("{:.0} ns", spread.median))
            };
            let ms = |value: fn(&Loop) -> u64| {
                let per_allocation = median(value).map_or(0.0, |spread| spread.median);
                format!("{:.0} ms", per_allocation * measured.allocations as f64 / 1e6)
            };
            let bpf = if traced { ns(|run| run.bpf.ns) } else { String::new() };
            let memleak = if traced { ms(|run| run.memleak_cpu_ns) } else { String::new() };
            let slowdown = measured
                .cpu_ratio(runs.mode, Mode::Untraced, depth)
                .map_or_else(String::new, |spread| format!("{:.2}x", spread.median));
            println!(
                "| {label} | {depth} | {} | {bpf} | {} | {memleak} | {slowdown} |",
                ms(|run| run.wall_ns),
                ns(|run| run.workload_cpu_ns)
            );
        }
    }
    println!();
    println!(
        "BPF time is the kernel's run time of memleak's uprobe programs (BPF_ENABLE_STATS) during the loops; CPU is \
         the loops' process CPU time plus memleak's meanwhile."
    );
}

/// The measures against their goals.
fn print_goals(measured: &PythonFrames) {
    println!();
    println!("Medians of the rounds, each comparing runs of the same round (lowest to highest round):");
    let ns = |value: f64| format!("{value:.0} ns");
    let frame_goal = format!("goal under {GOAL_FRAME_NS:.0} ns warm");
    for depth in DEPTHS {
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
        measured.cpu_ratio(Mode::PythonFrames, Mode::NativeOnly, SLOWDOWN_DEPTH),
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
        let done = Done::parse("done depth 15 cpu_ns 524843247 wall_ns 525048198 allocations 100000")
            .expect("a loop");
        assert_eq!(done, Done { depth: 15, cpu_ns: 524_843_247, wall_ns: 525_048_198, allocations: 100_000 });
        assert!(Done::parse("done depth 15 cpu_ns 5").is_err(), "a line without wall_ns read as a loop");
    }

    #[test]
    fn counts_the_python_frames_of_the_loops_stacks() {
        let python = |function: &str| serde_json::json!({"function": function, "kind": "python"});
        let native = |function: &str| serde_json::json!({"function": function});
        let report = serde_json::json!({"stacks": [
            // Not the loops': 16 small blocks, and one large block.
            {"bytes": 1600, "allocations": KEPT, "frames": [native("malloc"), python("<module>")]},
            {"bytes": 5001, "allocations": 1, "frames": [native("malloc"), python("<module>")]},
            {"bytes": 16 * 5001, "allocations": KEPT, "frames": [
                native("malloc"), python("allocate"), python("descend"), python("<module>"), native("Py_BytesMain"),
            ]},
            {"bytes": 16 * 5001, "allocations": KEPT, "frames": [native("malloc"), python("allocate"), python("<module>")]},
        ]});
        assert_eq!(loop_stacks_python_frames(&report).expect("stacks"), [2, 3]);
        // --python off: the depths' blocks on one native stack.
        let native_only = serde_json::json!({"stacks": [
            {"bytes": 48 * 5001, "allocations": 3 * KEPT, "frames": [native("malloc"), native("Py_BytesMain")]},
        ]});
        assert_eq!(loop_stacks_python_frames(&native_only).expect("stacks"), [0]);
    }

    /// A process whose loops at each depth took `bpf_ns` of BPF time.
    fn process(bpf_ns: [u64; 3]) -> Process {
        let loops = DEPTHS
            .iter()
            .zip(bpf_ns)
            .map(|(&depth, ns)| Loop { depth, bpf: RunTime { ns, runs: 0 }, ..Loop::default() })
            .collect();
        Process { loops, probed_by_another: false }
    }

    #[test]
    fn per_frame_costs_compare_the_runs_of_a_round() {
        let runs = |mode, processes: Vec<Process>| Runs { mode, processes, failure: None };
        // 1,000 allocations at each depth: ns per allocation are the ns /
        // 1000. 300 ns a walk and 60 a frame, but 50 ns more at 5 frames
        // in the third round; the second round ran on a slower machine,
        // which comparing within rounds keeps from moving the difference.
        let measured = PythonFrames {
            allocations: 1000,
            rounds: 3,
            runs: vec![
                runs(
                    Mode::NativeOnly,
                    vec![
                        process([1_000_000, 1_000_000, 1_000_000]),
                        process([2_000_000, 2_000_000, 2_000_000]),
                        process([1_000_000, 1_000_000, 1_000_000]),
                    ],
                ),
                runs(
                    Mode::PythonFrames,
                    vec![
                        process([1_600_000, 2_200_000, 3_400_000]),
                        process([2_600_000, 3_200_000, 4_400_000]),
                        process([1_650_000, 2_200_000, 3_400_000]),
                    ],
                ),
            ],
        };
        let median = |spread: Option<Spread>| spread.map(|spread| spread.median);
        // 600 ns over 5 frames in two rounds of three, 650 in the third.
        let per_frame = measured.bpf_ns_per_frame(SHALLOW).expect("a spread");
        assert_eq!(per_frame, Spread { median: 120.0, low: 120.0, high: 130.0 });
        // 1200 ns over 15 frames.
        assert_eq!(median(measured.bpf_ns_per_frame(SLOWDOWN_DEPTH)), Some(80.0));
        // (3400 - 1600) / 30 in two rounds.
        assert_eq!(median(measured.bpf_ns_per_frame_slope()), Some(60.0));
        // 600 - 5 x 60 in two rounds.
        assert_eq!(median(measured.bpf_ns_per_walk()), Some(300.0));
        // No untraced runs.
        assert_eq!(measured.cpu_ratio(Mode::PythonFrames, Mode::Untraced, SHALLOW), None);
    }
}
