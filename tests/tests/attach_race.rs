//! Attaching to a process that allocates all the time while memleak's
//! probes go in, on a machine as slow as an emulated one: strace delays
//! every system call that loads or links a probe. A call that entered
//! the allocator before its return probe existed once left its thread
//! counting none of its allocations for the rest of the run (the `-p`
//! runs that saw "0 allocations" in kernel VMs).

use std::process::Command;

use memleak_tests::{fixture, marker_line, memleak_binary, stacks_at, Leaker, Memleak, PERF_EVENT_UPROBES};

/// 20 ms per probe-making system call: a kernel VM under emulation takes
/// about that, and the busy thread allocates every 100 µs.
const DELAYED: &str = "inject=bpf,perf_event_open:delay_exit=20000";

fn attach_slowly(env: &[(&str, &str)]) {
    let mut target = Leaker::start_command(Command::new(fixture("busy_malloc")));
    let mut memleak = Memleak::spawn(
        Command::new("strace")
            .args(["-f", "-qq", "-o", "/dev/null", "-e", "trace=bpf,perf_event_open", "-e", DELAYED])
            .arg(memleak_binary())
            .args(["-p", &target.pid().to_string(), "--format", "json", "1", "3"])
            .envs(env.iter().copied()),
    );
    memleak.wait_attached();
    target.go();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak under strace: {status}");
    let report = reports.last().expect("a final report");
    let health = &report["health"];
    let (allocations, frees) = (health["allocations"].as_u64().unwrap(), health["frees"].as_u64().unwrap());
    // Each of the busy thread's frees follows its malloc. Frees are
    // counted from the first probe on, allocations only once their probes
    // are all in, some 100 ms later under strace: hundreds more frees,
    // but never, as when the busy thread went uncounted, all of them.
    assert!(
        frees > 1000 && allocations >= frees / 2,
        "{allocations} allocations counted for {frees} frees ({env:?}): a thread's calls went uncounted"
    );
    let leaks = stacks_at(report, "leak", marker_line("busy_malloc", "leak"));
    let leaked: Vec<(u64, u64)> = leaks
        .iter()
        .map(|stack| (stack["bytes"].as_u64().unwrap(), stack["allocations"].as_u64().unwrap()))
        .collect();
    assert_eq!(leaked, [(10_000, 10)], "the main thread's 10 leaks after the attach ({env:?})");
}

#[test]
fn calls_under_way_while_multi_uprobe_links_go_in_are_all_counted() {
    attach_slowly(&[]);
}

#[test]
fn calls_under_way_while_perf_event_uprobes_go_in_are_all_counted() {
    attach_slowly(&[(PERF_EVENT_UPROBES, "1")]);
}
