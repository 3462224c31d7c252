//! `cargo xtask bench`: in one invocation, the malloc-heavy workload
//! untraced, under memleak (full and sampled), under the libbpf-tools probe
//! set, under heaptrack and under empty probes at memleak's own sites (the
//! floor), reported as ratios; then the time one report takes with up to a
//! million allocations outstanding, memleak's CPU and memory, and its BPF
//! maps' memory. Ratios, not absolute times, are what carry across
//! machines. CI does not run this.

mod empty_probes;
mod latency;
mod map_memory;
mod overhead;
mod process;
mod stats;
mod workload;

use anyhow::Result;

use self::{
    overhead::{Contender, Tracer},
    workload::{ProbePlan, Workload},
};
use crate::{
    build_fixture_with, cargo, install_missing_packages, require_root, root, run as run_command, setup,
};

/// How much to measure.
struct Settings {
    threads: u32,
    iterations: u32,
    runs: usize,
    /// Outstanding allocations to measure a report's latency at.
    latency_allocations: &'static [u64],
}

/// Under 2 minutes here, even with the machine busy. Most of the time
/// goes in memleak's exits: closing each of its uprobes takes about
/// 100 ms (an RCU grace period), about 2 s a run; 1M allocations take 40 s.
const QUICK: Settings =
    Settings { threads: 2, iterations: 20_000, runs: 3, latency_allocations: &[10_000, 100_000] };
const FULL: Settings =
    Settings { threads: 2, iterations: 100_000, runs: 5, latency_allocations: &[10_000, 100_000, 1_000_000] };

/// One allocation in this many is leaked through `leak_one()`.
const LEAK_EVERY: u32 = 100;

pub fn run(quick: bool) -> Result<()> {
    let settings = if quick { QUICK } else { FULL };
    setup::run()?;
    require_root("the benchmark")?;
    install_missing_packages(&["bpftrace", "bpftool"], "the benchmark")?;
    // heaptrack is only a comparison: the bench goes on without it.
    let heaptrack_installed = match install_missing_packages(&["heaptrack"], "the benchmark") {
        Ok(()) => true,
        Err(error) => {
            eprintln!(
                "bench: heaptrack is missing and could not be installed, going on without it: {error:#}"
            );
            false
        }
    };
    run_command(cargo().args(["build", "--release", "--package", "memleak"]))?;
    let scratch = root().join("target/bench");
    std::fs::create_dir_all(&scratch)?;
    let workload = Workload {
        path: build_fixture_with("workload", &["-O2"])?,
        args: [settings.threads, settings.iterations, LEAK_EVERY].map(|n| n.to_string()).to_vec(),
        memleak: root().join("target/release/memleak"),
        scratch,
    };
    let spread = build_fixture_with("spread", &["-O2"])?;
    let plan = ProbePlan::read(&workload)?;
    let mut contenders = contenders(&workload, &plan, heaptrack_installed)?;

    println!(
        "workload: {} threads x {} malloc/free pairs of 16..4096 bytes, 1 in {LEAK_EVERY} leaked via \
         leak_one(); median of {} runs",
        settings.threads, settings.iterations, settings.runs
    );
    println!("floor: empty BPF programs at {} in {}", plan.description, plan.libc.display());
    overhead::measure(&mut contenders, &workload, settings.runs)?;
    overhead::print(&contenders);
    let latencies = latency::measure_all(&workload.memleak, &spread, settings.latency_allocations);
    latency::print(&latencies);
    overhead::print_memleak_usage(&contenders);
    latency::print_map_memory(&latencies);

    overhead::memleak_exact(&contenders)
}

/// The rows of the overhead table, untraced first.
fn contenders(workload: &Workload, plan: &ProbePlan, heaptrack_installed: bool) -> Result<Vec<Contender>> {
    let script = workload.scratch.join("libbpf-tools.bt");
    std::fs::write(&script, workload::libbpf_tools_script(&plan.libc))?;
    let heaptrack = if heaptrack_installed {
        Contender::new("heaptrack", Tracer::Heaptrack)
    } else {
        Contender::unavailable("heaptrack", Tracer::Heaptrack, "not installed")
    };
    Ok(vec![
        Contender::new("untraced", Tracer::Untraced),
        Contender::new("memleak", Tracer::Memleak { sample_rate: 1 }),
        Contender::new("memleak -s 10", Tracer::Memleak { sample_rate: 10 }),
        Contender::new("memleak -s 100", Tracer::Memleak { sample_rate: 100 }),
        Contender::new("libbpf-tools probe set (bpftrace)", Tracer::Bpftrace { script }),
        heaptrack,
        Contender::new("empty probes at memleak's sites (floor)", Tracer::EmptyProbes(plan.sites.clone())),
    ])
}
