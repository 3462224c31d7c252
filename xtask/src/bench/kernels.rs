//! `cargo xtask bench --kernels`: the malloc-heavy workload untraced and
//! under memleak in each kernel of the test matrix, booted by `vm`. Each
//! VM runs this same xtask (`bench --in-vm`), which prints the overhead
//! table of that kernel: there memleak runs on that kernel's paths
//! (perf-event uprobes before 6.6, munmap and mprotect through uprobes
//! where the `mmap_lock` tracepoint is not cheap), walking stacks by
//! tables and by frame pointers. Emulation slows everything alike, so
//! only the slowdowns, ratios inside one VM, compare across kernels.

use anyhow::{bail, Result};

use super::{
    build_workload,
    overhead::{self, Contender, Tracer, Unwinder},
    workload::Build,
    Settings,
};
use crate::{kernel_tests, root, vm};

/// Few runs, long enough that the untraced ones take about 50 ms: a VM
/// emulates the machine at about a thirtieth of its speed.
const IN_VM: Settings = Settings { threads: 2, iterations: 20_000, runs: 3, ..super::QUICK };

/// Boots each of `kernels` (the test matrix's when empty) and prints
/// the overhead table the bench measured there, with memleak's release
/// build.
pub fn run(kernels: &[String]) -> Result<()> {
    crate::setup::run()?;
    crate::require_root("the benchmark")?;
    crate::run(crate::cargo().args(["build", "--release", "--package", "memleak"]))?;
    let kernels: Vec<String> = if kernels.is_empty() {
        kernel_tests::KERNELS.iter().map(|&kernel| kernel.to_owned()).collect()
    } else {
        kernels.to_vec()
    };
    let xtask = std::env::current_exe()?;
    let mut failed = Vec::new();
    for kernel in &kernels {
        let resolved = vm::resolve_kernel(kernel)?;
        println!();
        println!("## {kernel} ({})", resolved.release);
        let command = format!("cd {} && {} bench --in-vm", root().display(), xtask.display());
        let status = vm::run_in_vm(&resolved, &vm::VmOptions::default().sharing_target(), &command)?;
        if status != 0 {
            failed.push(format!("{kernel} (exit {status})"));
        }
    }
    if !failed.is_empty() {
        bail!("the bench failed in {}", failed.join(", "));
    }
    Ok(())
}

/// Inside a VM: the workload untraced and under memleak, each build
/// against its own untraced runs.
pub fn in_vm() -> Result<()> {
    let memleak = root().join("target/release/memleak");
    let workload = build_workload(&IN_VM, memleak)?;
    let memleak = |unwinder| Tracer::Memleak { sample_rate: 1, unwinder };
    let mut contenders = vec![
        Contender::new("untraced", Build::FramePointers, Tracer::Untraced),
        Contender::new("memleak --unwind fp", Build::FramePointers, memleak(Unwinder::FramePointers)),
        Contender::new("untraced (no frame pointers)", Build::NoFramePointers, Tracer::Untraced),
        Contender::new("memleak (no frame pointers)", Build::NoFramePointers, memleak(Unwinder::Dwarf)),
    ];
    println!(
        "workload: {} threads x {} malloc/free pairs, median of {} runs",
        IN_VM.threads, IN_VM.iterations, IN_VM.runs
    );
    overhead::measure(&mut contenders, &workload, IN_VM.runs)?;
    print(&contenders);
    Ok(())
}

/// Each traced row against the untraced one before it (its build): the
/// slowdown, and the wall time added per malloc/free pair of a thread
/// (the threads run side by side, one per virtual CPU).
fn print(contenders: &[Contender]) {
    println!();
    println!("| run | median wall time | slowdown | added per pair | leaked bytes |");
    println!("|---|---|---|---|---|");
    let mut untraced = None;
    for contender in contenders {
        let Some(median) = contender.median_ns() else {
            println!("| {} | {} | | | |", contender.label, contender.failure.as_deref().unwrap_or("no run"));
            continue;
        };
        let (slowdown, added) = match (&contender.tracer, untraced) {
            (Tracer::Untraced, _) => {
                untraced = Some(median);
                ("1.0x".to_owned(), String::new())
            }
            (_, Some(base)) => (
                format!("{:.1}x", median as f64 / base as f64),
                format!("{:.2} µs", median.saturating_sub(base) as f64 / 1e3 / f64::from(IN_VM.iterations)),
            ),
            (_, None) => (String::new(), String::new()),
        };
        let leaked = overhead::leak_accuracy(contender);
        println!("| {} | {:.1} ms | {slowdown} | {added} | {leaked} |", contender.label, median as f64 / 1e6);
    }
}
