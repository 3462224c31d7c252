//! Kernel mode: with no -p or -c, memleak traces the kernel's allocations.

use memleak_tests::{run_to_end, Leaker, Memleak};
use serde_json::Value;

const FILES: u64 = 2000;

fn names(stack: &Value) -> Vec<&str> {
    stack["frames"].as_array().unwrap().iter().filter_map(|frame| frame["function"].as_str()).collect()
}

#[test]
fn open_files_show_up_as_kmem_cache_objects() {
    let mut memleak = Memleak::start(&["--format", "json", "-o", "0", "-T", "100000", "3600"]);
    memleak.wait_attached();
    let mut leaker = Leaker::start_waiting(&["files", &FILES.to_string()]);
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    let report = reports.last().expect("a final report");
    assert_eq!(report["pid"], 0);
    assert_eq!(report["allocator"], "kernel");
    // Each open file holds a struct file from the filp cache. Other
    // processes open files meanwhile, but seldom keep hundreds.
    let file_stacks: Vec<&Value> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| {
            let names = names(stack);
            // The struct file itself, not the security blob hung on it.
            names.len() > 2 && names[0].starts_with("kmem_cache_alloc") && names[1] == "alloc_empty_file"
        })
        .collect();
    let files: u64 = file_stacks.iter().map(|stack| stack["allocations"].as_u64().unwrap()).sum();
    assert!(
        (FILES..FILES + 500).contains(&files),
        "{files} struct files outstanding for {FILES} opened; health {}",
        report["health"],
    );
    let bytes: u64 = file_stacks.iter().map(|stack| stack["bytes"].as_u64().unwrap()).sum();
    assert!(
        bytes >= files * 128 && bytes <= files * 512,
        "a struct file takes 128..512 bytes: {bytes}/{files}"
    );
    // Stacks start at the allocator, with no tracing machinery on top.
    for stack in report["stacks"].as_array().unwrap() {
        let first = names(stack).first().copied().unwrap_or("");
        let tracing =
            ["bpf_prog_", "bpf_trace_run", "__traceiter_"].iter().any(|prefix| first.starts_with(prefix));
        assert!(!tracing, "{first} tops a stack");
    }
    assert_eq!(file_stacks[0]["frames"][0]["module"], "kernel");
    leaker.exit();
}

#[test]
fn user_only_flags_need_a_process() {
    for flag in ["--trace", "--all-mmaps"] {
        let (code, stderr) = run_to_end(&[flag]);
        assert_eq!(code, Some(2), "{stderr}");
        assert_eq!(
            stderr.trim(),
            format!("memleak: error: {flag} needs a process: give -p PID or -c \"CMD ARGS\"")
        );
    }
    let (code, stderr) = run_to_end(&["-p", "1", "--percpu"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--percpu is for kernel tracing"), "{stderr}");
}

#[test]
fn percpu_allocations_are_traced_on_request() {
    let memleak = Memleak::start(&["--percpu", "--format", "json", "-o", "0", "1", "1"]);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "the per-CPU tracepoints attach");
    assert_eq!(reports.len(), 1);
}
