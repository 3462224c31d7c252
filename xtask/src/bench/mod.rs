//! `cargo xtask bench`: in one invocation, the malloc-heavy workload
//! built with frame pointers, untraced, under memleak (unwinding by
//! `.eh_frame` tables, its default, and by frame pointers; full and
//! sampled), under the libbpf-tools probe set, under heaptrack and under
//! empty probes at memleak's own sites (the floor); and the same workload
//! built without frame pointers, untraced, under memleak and under empty
//! probes. Each slowdown is against the untraced run of its own build, and
//! the results are ratios of slowdowns: memleak to the floor and to
//! libbpf-tools', and what unwinding by tables costs over frame pointers.
//! Then what Python frames cost on Debian's python3.11: BPF time per
//! frame, and a Python loop's slowdown with them over `--python off`
//! (`--python-only` runs that alone).
//! Then Debian's redis-server, which allocates through jemalloc, under
//! redis-benchmark: its throughput under memleak and under the
//! libbpf-tools probe set, over untraced. Then the workload on each
//! allocator (glibc, jemalloc, tcmalloc, mimalloc, musl) under memleak,
//! its floor and heaptrack. Then memleak's start until its
//! first uprobe and its exit, with multi-uprobe links and with perf-event
//! uprobes, and an untraced workload's speed beside a memleak tracing
//! another process. Then what memleak's unwind tables take for real programs (python3,
//! redis-server): their rows, kernel memory and build time, and memleak's
//! start; the time one report takes with up to a million allocations
//! outstanding; memleak's CPU and memory, and its BPF maps' memory. Last,
//! `memleak serve`: one scrape of each endpoint at 10,000 stacks, and a
//! soak of short-lived processes under `--exe`, the daemon's memory,
//! descriptors and map entries taken at its start and end; and `--watch`'s
//! own CPU at 0, 100 and 1,000 processes watched. And the time
//! one `--save` snapshot of 65,536 deep stacks takes (`--save-only` runs
//! that alone).
//! `--kernels` runs the workload's part in other kernels instead (see
//! `kernels`).
//! Ratios, not absolute times, are what carry across machines. CI does not
//! run this.

mod allocators;
mod attachment;
mod bpf_stats;
mod deep_stacks;
mod empty_probes;
mod fleet;
mod kernels;

pub use kernels::{in_vm, run as on_kernels};
mod latency;
mod map_memory;
mod mprotect_calls;
mod overhead;
mod process;
mod python_allocator;
mod python_frames;
mod redis;
mod saving;
mod serve;
mod slopes;
mod stack_depth;
mod stats;
mod tracer;
mod unwind_tables;
mod watch;
mod workload;

use std::time::Duration;

use anyhow::Result;

use self::{
    overhead::{Contender, Tracer, Unwinder},
    workload::{Build, ProbePlan, Workload},
};
use crate::{
    build_fixture_with, build_fixture_without_frame_pointers, cargo, install_missing_packages, require_root,
    root, run as run_command, setup,
};

/// The median of `values` (the upper one of an even count), `None` of
/// none: every table of the bench gives medians of its rounds.
pub fn median<T: Copy + PartialOrd>(values: &[T]) -> Option<T> {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    sorted.get(sorted.len() / 2).copied()
}

/// How much to measure.
struct Settings {
    threads: u32,
    iterations: u32,
    runs: usize,
    /// Outstanding allocations to measure a report's latency at.
    latency_allocations: &'static [u64],
    /// SETs and GETs per redis-benchmark run.
    redis_requests: u32,
    /// `memleak serve`'s soak.
    soak: serve::SoakPlan,
    /// What Python frames cost.
    python: python_frames::Plan,
}

/// Under 2 minutes here, even with the machine busy. Most of the time
/// goes in memleak's exits: closing each of its uprobes takes about
/// 100 ms (an RCU grace period), about 2 s a run; 1M allocations take 40 s.
const QUICK: Settings = Settings {
    threads: 2,
    iterations: 20_000,
    runs: 3,
    latency_allocations: &[10_000, 100_000],
    redis_requests: 20_000,
    soak: serve::SoakPlan { duration: Duration::from_secs(40), processes: 20, pods: 20 },
    python: python_frames::Plan { allocations: 10_000, loops: 3, rounds: 3 },
};
const FULL: Settings = Settings {
    threads: 2,
    iterations: 100_000,
    runs: 5,
    latency_allocations: &[10_000, 100_000, 1_000_000],
    redis_requests: 100_000,
    soak: serve::SoakPlan { duration: Duration::from_mins(4), processes: 100, pods: 100 },
    python: python_frames::Plan { allocations: 20_000, loops: 5, rounds: 9 },
};

/// One allocation in this many is leaked through `leak_one()`.
const LEAK_EVERY: u32 = 100;

/// What part of the bench to run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Part {
    All,
    /// `memleak serve`'s section.
    Serve,
    /// The time of one `--save` snapshot.
    Save,
    /// What Python frames cost.
    Python,
    /// What a stack's depth costs, and an mprotect call.
    Depth,
    /// What an mprotect call costs.
    Mprotect,
    /// The workload's overhead table and its costs per pair and per run.
    Overhead,
    /// `memleak serve --watch`'s own CPU.
    Watch,
}

pub fn run(quick: bool, part: Part) -> Result<()> {
    let settings = if quick { QUICK } else { FULL };
    if part == Part::Save {
        saving::print(&saving::measure());
        return Ok(());
    }
    setup::run()?;
    require_root("the benchmark")?;
    let heaptrack_installed = install_packages()?;
    run_command(cargo().args(["build", "--release", "--package", "memleak"]))?;
    let memleak = root().join("target/release/memleak");
    if part == Part::Python {
        python_section(&memleak, &settings.python);
        return Ok(());
    }
    if part == Part::Depth {
        depth_section(&memleak, settings.runs, heaptrack_installed)?;
        return Ok(());
    }
    if part == Part::Mprotect {
        return mprotect_section(&memleak, settings.runs);
    }
    if part == Part::Watch {
        watch::print(&watch::measure(&memleak));
        watch::print_estimate(&watch::measure_estimate(&memleak));
        return Ok(());
    }
    let spread = build_fixture_with("spread", &["-O2"])?;
    if part == Part::Serve {
        return daemon(&memleak, &spread, &settings.soak);
    }
    let workload = build_workload(&settings, memleak)?;
    let contenders = overhead_section(&workload, &settings, heaptrack_installed)?;
    if part == Part::Overhead {
        return overhead::memleak_exact(&contenders);
    }
    python_section(&workload.memleak, &settings.python);
    depth_section(&workload.memleak, settings.runs, heaptrack_installed)?;
    eprintln!("bench: redis-server under redis-benchmark");
    match redis::measure(&workload.memleak, &workload.scratch, settings.runs, settings.redis_requests) {
        Ok(results) => redis::print(&results),
        Err(error) => println!("\nredis-server under redis-benchmark: not measured: {error:#}"),
    }
    probe_costs(&workload, settings.runs, heaptrack_installed)?;
    let tables = unwind_tables::measure_all(&workload.memleak, &workload.scratch);
    unwind_tables::print(&tables);
    let latencies = latency::measure_all(&workload.memleak, &spread, settings.latency_allocations);
    latency::print(&latencies);
    eprintln!("bench: memleak's own cost at 65,536 deep stacks");
    deep_stacks::print(&deep_stacks::measure(&workload.memleak, &spread));
    eprintln!("bench: one --save snapshot of 65,536 deep stacks");
    saving::print(&saving::measure());
    overhead::print_memleak_usage(&contenders);
    latency::print_map_memory(&latencies);
    daemon(&workload.memleak, &spread, &settings.soak)?;

    overhead::memleak_exact(&contenders)
}

/// The overhead table, then the costs per pair and per run.
fn overhead_section(
    workload: &Workload,
    settings: &Settings,
    heaptrack_installed: bool,
) -> Result<Vec<Contender>> {
    let plan = ProbePlan::read(workload)?;
    let mut contenders = contenders(workload, &plan, heaptrack_installed)?;

    println!(
        "workload: {} threads x {} malloc/free pairs of 16..4096 bytes, 1 in {LEAK_EVERY} leaked via \
         leak_one(); median of {} runs",
        settings.threads, settings.iterations, settings.runs
    );
    println!("floor: empty BPF programs at {} in {}", plan.description, plan.libc.display());
    overhead::measure(&mut contenders, workload, settings.runs)?;
    overhead::print(&contenders);
    let slopes = slopes::measure(
        workload,
        &plan,
        settings.threads,
        settings.iterations,
        settings.runs,
        heaptrack_installed,
    )?;
    slopes::print(&slopes);
    Ok(contenders)
}

/// The malloc-heavy workload, both builds, run by `memleak`.
fn build_workload(settings: &Settings, memleak: std::path::PathBuf) -> Result<Workload> {
    let scratch = root().join("target/bench");
    std::fs::create_dir_all(&scratch)?;
    Ok(Workload {
        frame_pointers_path: build_fixture_with("workload", &["-O2"])?,
        no_frame_pointers_path: build_fixture_without_frame_pointers(
            "workload",
            "workload-nofp",
            &["-O2", "-fomit-frame-pointer"],
        )?,
        args: [settings.threads, settings.iterations, LEAK_EVERY].map(|n| n.to_string()).to_vec(),
        memleak,
        scratch,
        env: Vec::new(),
    })
}

/// What the bench runs, installed if missing; whether heaptrack is, which
/// is only a comparison: the bench goes on without it.
fn install_packages() -> Result<bool> {
    // redis-server is one of the real programs whose unwind tables are
    // measured; the allocators and musl are the workload's others.
    install_missing_packages(
        &[
            "bpftrace",
            "bpftool",
            "redis-server",
            "libjemalloc2",
            "libtcmalloc-minimal4",
            "libmimalloc2.0",
            "musl-tools",
            // Debian's python3.11, the Python frames' interpreter.
            "python3.11",
        ],
        "the benchmark",
    )?;
    Ok(match install_missing_packages(&["heaptrack"], "the benchmark") {
        Ok(()) => true,
        Err(error) => {
            eprintln!(
                "bench: heaptrack is missing and could not be installed, going on without it: {error:#}"
            );
            false
        }
    })
}

/// What Python frames cost, in their own table; a failure is shown, not
/// fatal.
fn python_section(memleak: &std::path::Path, plan: &python_frames::Plan) {
    eprintln!("bench: Python frames, {}", python_frames::PYTHON);
    python_frames::print(&python_frames::measure(memleak, plan));
}

/// What a stack's depth costs, against heaptrack, and what memleak adds
/// to an mprotect call.
fn depth_section(memleak: &std::path::Path, runs: usize, heaptrack_installed: bool) -> Result<()> {
    let workload =
        build_fixture_without_frame_pointers("workload", "workload-nofp", &["-O2", "-fomit-frame-pointer"])?;
    eprintln!("bench: stack depths {:?}", stack_depth::DEPTHS);
    stack_depth::print(&stack_depth::measure(memleak, &workload, runs, heaptrack_installed));
    mprotect_section(memleak, runs)
}

/// What memleak adds to an mprotect call, each way it can see the call,
/// and what each way costs processes it does not trace.
fn mprotect_section(memleak: &std::path::Path, runs: usize) -> Result<()> {
    let mprotect_loop = build_fixture_with("mprotect_loop", &["-O2"])?;
    mprotect_calls::print(&mprotect_calls::measure(memleak, &mprotect_loop, runs));
    let mapping_loop = build_fixture_with("mapping_loop", &["-O2"])?;
    mprotect_calls::print_bystander(&mprotect_calls::measure_bystander(memleak, &mapping_loop, runs.max(10)));
    Ok(())
}

/// The probe-cost issue's measures beyond glibc: every allocator, start
/// and exit, a bystander's speed; and --python-allocator's cost.
fn probe_costs(workload: &Workload, runs: usize, heaptrack_installed: bool) -> Result<()> {
    let musl_build = crate::build_fixture_with_compiler("musl-gcc", "workload", "workload-musl", &["-O2"])?;
    allocators::print(&allocators::measure_all(workload, &musl_build, runs, heaptrack_installed));
    attachment::print_lifecycle(&attachment::measure_lifecycle(&workload.memleak, runs)?);
    attachment::print_bystander(&attachment::measure_bystander(workload, runs)?);
    python_allocator::print(&python_allocator::measure(workload, runs, heaptrack_installed));
    Ok(())
}

/// `memleak serve`: a scrape's cost at 10,000 stacks, and the soak.
fn daemon(memleak: &std::path::Path, spread: &std::path::Path, soak: &serve::SoakPlan) -> Result<()> {
    eprintln!("bench: memleak serve, one scrape of each endpoint at 10,000 stacks");
    serve::print_scrapes(SCRAPED_ALLOCATIONS, &serve::measure_scrapes(memleak, spread, SCRAPED_ALLOCATIONS));
    eprintln!("bench: memleak serve --exe, picking up a python3 that starts after it");
    serve::print_pickup(&serve::measure_pickup(memleak, PICKUP_RUNS));
    eprintln!("bench: memleak serve's soak, {} s", soak.duration.as_secs());
    let leaker = serve::soak_leaker()?;
    serve::print_soak(soak, &serve::soak(memleak, &leaker, soak));
    eprintln!("bench: memleak serve on a node of 50 pods");
    fleet::print(&fleet::measure(memleak, &leaker));
    eprintln!("bench: memleak serve on a node, {} pods coming and going", soak.pods);
    fleet::print_churn(&fleet::measure_churn(memleak, &leaker, soak.pods));
    eprintln!("bench: memleak serve --watch, its own CPU at 0, 100 and 1,000 processes");
    watch::print(&watch::measure(memleak));
    eprintln!("bench: memleak's estimate of its probes' cost, against the cost measured");
    watch::print_estimate(&watch::measure_estimate(memleak));
    Ok(())
}

/// Runs of the `--exe` pickup: its misses come in some runs only.
const PICKUP_RUNS: usize = 7;

/// Allocations outstanding, over 10,000 stacks, when scrapes are timed.
const SCRAPED_ALLOCATIONS: u64 = 20_000;

/// The rows of the overhead table: the build with frame pointers, untraced
/// first, then the build without. The probe sites are the same libc
/// functions for both builds.
fn contenders(workload: &Workload, plan: &ProbePlan, heaptrack_installed: bool) -> Result<Vec<Contender>> {
    use Build::{FramePointers, NoFramePointers};
    let script = workload.scratch.join("libbpf-tools.bt");
    std::fs::write(&script, workload::libbpf_tools_script(&plan.libc))?;
    let heaptrack = if heaptrack_installed {
        Contender::new("heaptrack", FramePointers, Tracer::Heaptrack)
    } else {
        Contender::unavailable("heaptrack", FramePointers, Tracer::Heaptrack, "not installed")
    };
    let memleak = |sample_rate, unwinder| Tracer::Memleak { sample_rate, unwinder };
    let floor = || Tracer::EmptyProbes(plan.sites.clone());
    Ok(vec![
        Contender::new("untraced", FramePointers, Tracer::Untraced),
        Contender::new("memleak", FramePointers, memleak(1, Unwinder::Dwarf)),
        Contender::new("memleak --unwind fp", FramePointers, memleak(1, Unwinder::FramePointers)),
        Contender::new("memleak -s 10", FramePointers, memleak(10, Unwinder::Dwarf)),
        Contender::new("memleak -s 100", FramePointers, memleak(100, Unwinder::Dwarf)),
        Contender::new("libbpf-tools probe set (bpftrace)", FramePointers, Tracer::Bpftrace { script }),
        heaptrack,
        Contender::new("empty probes at memleak's sites (floor)", FramePointers, floor()),
        Contender::new("untraced (no frame pointers)", NoFramePointers, Tracer::Untraced),
        Contender::new("memleak (no frame pointers)", NoFramePointers, memleak(1, Unwinder::Dwarf)),
        Contender::new("empty probes at memleak's sites (no frame pointers)", NoFramePointers, floor()),
    ])
}
