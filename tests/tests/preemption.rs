//! Threads preempted mid-walk. A kernel that preempts uprobe programs
//! (Linux 6.0 and later, `preempt=full` or `lazy`, the only x86 modes of
//! Linux 7) switches between threads of the target in the middle of
//! their stack walks, on one CPU. On 7.3 that oopsed the kernel within
//! seconds (the walks shared the CPU's private BPF stack), and the walks'
//! per-CPU memory mixed their stacks. Here the host rarely preempts;
//! `cargo xtask kernels` runs this test in each kernel of its matrix
//! booted with `preempt=full`, where it does all the time.

use memleak_tests::{fixture, frame_functions, stacks_through, tempdir::TempDir, Memleak};
use serde_json::Value;

/// The workload's threads: at most as many as a CPU has scratch slots
/// (memleak-ebpf's `maps::SCRATCH_SLOTS`), so that no walk may find
/// them all held, however the threads are preempted.
const THREADS: u32 = 4;

#[test]
fn threads_preempted_mid_walk_keep_their_own_whole_stacks() {
    // 4 threads of 3,000 malloc/free pairs, one in 30 leaked, each
    // 8 frames deep in descend().
    let command = format!("{} {THREADS} 3000 30 8", fixture("workload").display());
    let dir = TempDir::new("preemption");
    let stats_file = dir.path().join("stats.jsonl");
    let stats_path = stats_file.to_str().unwrap();
    let mut memleak =
        Memleak::start(&["-c", &command, "--format", "json", "-T", "1000", "--stats", stats_path, "3600"]);
    // The workload's own count of what it leaked.
    let line = memleak.stderr.wait_for("the workload's totals", |line| line.starts_with("elapsed_ns "));
    let words: Vec<&str> = line.split_whitespace().collect();
    let count_of = |name: &str| -> u64 {
        let at = words.iter().position(|word| *word == name).unwrap_or_else(|| panic!("{name} in {line}"));
        words[at + 1].parse().unwrap()
    };
    let (leaked_bytes, leaked_allocations) = (count_of("leaked_bytes"), count_of("leaked_allocations"));
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let report = reports.last().expect("a final report");

    assert_eq!(report["health"]["stacks_lost"], 0, "{:#}", report["health"]);
    let leaks = stacks_through(report, "leak_one");
    // Every thread leaks through the same path: one stack, every frame
    // in place, holding exactly what the workload counted.
    assert_eq!(leaks.len(), 1, "{report:#}");
    let names = frame_functions(leaks[0]);
    let descents = names.iter().filter(|&&name| name == "descend").count();
    assert!(
        names.starts_with(&["leak_one", "work", "descend"])
            && descents == 9
            && names.contains(&"start_thread"),
        "{names:?}"
    );
    assert_eq!(
        (leaks[0]["bytes"].as_u64(), leaks[0]["allocations"].as_u64()),
        (Some(leaked_bytes), Some(leaked_allocations)),
        "{:#}",
        leaks[0]
    );

    let walks = std::fs::read_to_string(&stats_file).unwrap();
    let last_walks = walks.lines().rfind(|line| line.contains("\"stack_walks\"")).expect("stack_walks");
    let last_walks: Value = serde_json::from_str(last_walks).unwrap();
    assert_eq!(last_walks["skipped_busy"], 0, "{last_walks}");
}
