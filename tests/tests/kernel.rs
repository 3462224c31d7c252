//! Kernel mode: with no -p or -c, memleak traces the kernel's allocations.

use memleak_tests::{run_to_end, Leaker, Memleak};
use serde_json::Value;

const FILES: u64 = 2000;

/// Kernel mode sees every process, and so each other's start and stop:
/// the tests that trace the kernel take turns.
static KERNEL_TRACING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn names(stack: &Value) -> Vec<&str> {
    stack["frames"].as_array().unwrap().iter().filter_map(|frame| frame["function"].as_str()).collect()
}

/// The stacks of the struct files themselves, not of the security blobs
/// hung on them: `alloc_empty_file` right above the cache's allocation,
/// or through `__alloc_file`, its helper until 6.4 (the kernel tests'
/// 6.1).
fn file_stacks(report: &Value) -> Vec<&Value> {
    report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| {
            let names = names(stack);
            let callers: Vec<&str> =
                names.iter().skip(1).copied().skip_while(|&name| name == "__alloc_file").collect();
            names.len() > 2
                && names[0].starts_with("kmem_cache_alloc")
                && callers.first() == Some(&"alloc_empty_file")
        })
        .collect()
}

fn sum(stacks: &[&Value], key: &str) -> u64 {
    stacks.iter().map(|stack| stack[key].as_u64().unwrap()).sum()
}

#[test]
fn open_files_show_up_as_kmem_cache_objects() {
    let _turn = KERNEL_TRACING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut memleak = Memleak::start(&["--format", "json", "-o", "0", "-T", "100000", "1"]);
    memleak.wait_attached();
    let mut leaker = Leaker::start_waiting(&["files", &FILES.to_string()]);
    // Kernel mode sees every process: what other processes hold is
    // measured before the leaker opens its files, and taken off.
    let before: Value =
        serde_json::from_str(&memleak.stdout.wait_for("a report before the files are opened", |_| true))
            .unwrap();
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    let report = reports.last().expect("a final report");
    assert_eq!(report["pid"], 0);
    assert_eq!(report["allocator"], "kernel");
    // Each open file holds a struct file from the filp cache. Other
    // processes open and close files meanwhile, but seldom hundreds.
    let held = file_stacks(report);
    let held_before = sum(&file_stacks(&before), "allocations");
    let files = sum(&held, "allocations").saturating_sub(held_before);
    assert!(
        (FILES - 50..FILES + 500).contains(&files),
        "{files} more struct files outstanding for {FILES} opened; health {}; stacks {:#?}",
        report["health"],
        held.iter().map(|stack| (stack["allocations"].clone(), names(stack))).collect::<Vec<_>>(),
    );
    let bytes = sum(&held, "bytes");
    let all_files = sum(&held, "allocations");
    assert!(
        bytes >= all_files * 128 && bytes <= all_files * 512,
        "a struct file takes 128..512 bytes: {bytes}/{all_files}"
    );
    // Stacks start at the allocator, with no tracing machinery on top.
    for stack in report["stacks"].as_array().unwrap() {
        let first = names(stack).first().copied().unwrap_or("");
        let tracing =
            ["bpf_prog_", "bpf_trace_run", "__traceiter_"].iter().any(|prefix| first.starts_with(prefix));
        assert!(!tracing, "{first} tops a stack");
    }
    // The BPF memory allocator refilling memleak's own maps is left out:
    // recorded, each refill stored an entry, which drained the cache
    // again. Left out are the refills' own allocations, and whatever was
    // allocated in an interrupt during memleak's programs (a frame of one
    // of them, `bpf_prog_TAG_NAME`: another tool's may allocate); the
    // pages a slab takes to serve a refill run later are not.
    let memleaks_program = |name: &str| {
        name.starts_with("bpf_prog_")
            && ["_kmalloc", "_kmem_cache_alloc", "_mm_page_alloc", "_percpu_alloc_percpu"]
                .iter()
                .any(|program| name.ends_with(program))
    };
    let own: Vec<_> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(names)
        .filter(|names| {
            matches!(names.get(1), Some(&("alloc_bulk" | "__alloc")))
                || names.iter().any(|&name| memleaks_program(name))
        })
        .collect();
    assert!(own.is_empty(), "memleak's own allocations recorded: {own:#?}");
    assert_eq!(held[0]["frames"][0]["module"], "kernel");
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
    let _turn = KERNEL_TRACING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let memleak = Memleak::start(&["--percpu", "--format", "json", "-o", "0", "1", "1"]);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "the per-CPU tracepoints attach");
    assert_eq!(reports.len(), 1);
}
