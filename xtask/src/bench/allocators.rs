//! The workload on each allocator memleak probes: glibc's, jemalloc,
//! tcmalloc and mimalloc preloaded (as programs and operators preload
//! them), and musl's, the workload built with musl-gcc. Each untraced,
//! under memleak, under empty probes at memleak's sites in that allocator
//! (its floor, placement included) and under heaptrack; interleaved, as
//! ratios of slowdowns against its own untraced run.

use std::path::Path;

use anyhow::Result;

use super::{
    overhead::{self, Contender, Tracer, Unwinder},
    workload::{Build, ProbePlan, Workload},
};

/// An allocator, and how the workload gets it.
struct Allocator {
    name: &'static str,
    /// The library preloaded, if any.
    preload: Option<&'static str>,
    /// Built with musl-gcc instead of gcc.
    musl: bool,
}

const ALLOCATORS: [Allocator; 5] = [
    Allocator { name: "glibc", preload: None, musl: false },
    Allocator { name: "jemalloc", preload: Some("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"), musl: false },
    Allocator {
        name: "tcmalloc",
        preload: Some("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        musl: false,
    },
    Allocator { name: "mimalloc", preload: Some("/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"), musl: false },
    Allocator { name: "musl", preload: None, musl: true },
];

/// One allocator's row: its contenders' runs, or why it has none.
pub struct Row {
    name: &'static str,
    measured: Result<Vec<Contender>>,
}

/// Measures every allocator in turn; one that fails is shown failed.
pub fn measure_all(workload: &Workload, musl_build: &Path, runs: usize, heaptrack: bool) -> Vec<Row> {
    ALLOCATORS
        .iter()
        .map(|allocator| {
            eprintln!("bench: the workload on {}", allocator.name);
            let on_it = Workload {
                frame_pointers_path: if allocator.musl {
                    musl_build.to_path_buf()
                } else {
                    workload.frame_pointers_path.clone()
                },
                no_frame_pointers_path: workload.no_frame_pointers_path.clone(),
                args: workload.args.clone(),
                memleak: workload.memleak.clone(),
                scratch: workload.scratch.clone(),
                env: allocator
                    .preload
                    .map(|library| ("LD_PRELOAD".to_owned(), library.to_owned()))
                    .into_iter()
                    .collect(),
            };
            // heaptrack's preloaded library is built against glibc: in a
            // musl program it hangs.
            Row { name: allocator.name, measured: measure(&on_it, runs, heaptrack && !allocator.musl) }
        })
        .collect()
}

fn measure(workload: &Workload, runs: usize, heaptrack: bool) -> Result<Vec<Contender>> {
    let plan = ProbePlan::read(workload)?;
    let memleak = Tracer::Memleak { sample_rate: 1, unwinder: Unwinder::Dwarf };
    let mut contenders = vec![
        Contender::new("untraced", Build::FramePointers, Tracer::Untraced),
        Contender::new("memleak", Build::FramePointers, memleak),
        Contender::new("floor", Build::FramePointers, Tracer::EmptyProbes(plan.sites)),
    ];
    if heaptrack {
        contenders.push(Contender::new("heaptrack", Build::FramePointers, Tracer::Heaptrack));
    }
    overhead::measure(&mut contenders, workload, runs)?;
    Ok(contenders)
}

pub fn print(rows: &[Row]) {
    println!();
    println!(
        "the workload on each allocator (frame pointers), slowdowns against its own untraced run, medians:"
    );
    println!();
    println!(
        "| allocator | untraced | memleak | floor | heaptrack | memleak / floor | memleak / heaptrack |"
    );
    println!("|---|---|---|---|---|---|---|");
    for row in rows {
        let contenders = match &row.measured {
            Ok(contenders) => contenders,
            Err(error) => {
                println!("| {} | failed: {error:#} | | | | | |", row.name);
                continue;
            }
        };
        let slowdown = |label| overhead::slowdown_of_label(contenders, label);
        let untraced = overhead::median_ms_of_label(contenders, "untraced");
        let cell = |value: Option<f64>| value.map_or_else(|| "-".to_owned(), |value| format!("{value:.1}x"));
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => format!("{:.2}", a / b),
            _ => "-".to_owned(),
        };
        let (memleak, floor, heaptrack) = (slowdown("memleak"), slowdown("floor"), slowdown("heaptrack"));
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.name,
            untraced.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.1} ms")),
            cell(memleak),
            cell(floor),
            cell(heaptrack),
            ratio(memleak, floor),
            ratio(memleak, heaptrack)
        );
    }
    println!();
    println!("goal: memleak at or below heaptrack's time on glibc and jemalloc (memleak / heaptrack <= 1)");
}
