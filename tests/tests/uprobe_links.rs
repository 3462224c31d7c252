//! How memleak attaches: one multi-uprobe link per program and object,
//! placed in the traced process alone, where the kernel has such links
//! (Linux 6.6); one perf-event uprobe per site where it does not. Both
//! record the same allocations.

use memleak_tests::{
    uprobes::{byte_in_file, byte_in_process, links_of_type, multi_links},
    Leaker, Memleak, PERF_EVENT_UPROBES,
};
use serde_json::Value;

const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";
/// memleak's switch to probe munmap and mprotect in the C library
/// whatever the kernel could see.
const MAPPING_UPROBES: &str = "MEMLEAK_MAPPING_UPROBES";
/// int3, the breakpoint a uprobe writes over the instruction it probes.
const BREAKPOINT: u8 = 0xcc;

fn totals(report: &Value) -> (Option<u64>, Option<u64>) {
    (report["total_bytes"].as_u64(), report["total_allocations"].as_u64())
}

#[test]
fn a_traced_process_gets_one_link_per_program_with_breakpoints_in_it_alone() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let outsider = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid().to_string();
    // munmap and mprotect probed too, as where the kernel refuses fentry
    // programs (this project's CI host): the same links on every kernel.
    let mut memleak = Memleak::start_with_env(
        &["-p", &pid, "--format", "json", "-T", "1000", "3600"],
        &[(MAPPING_UPROBES, "1")],
    );
    memleak.wait_attached();
    let links = multi_links(memleak.child.id());
    // 11 entry programs (the aligned allocations share one) and 2 return
    // programs: allocations' and mappings'.
    assert_eq!(links.len(), 13, "{links:#?}");
    assert!(links.iter().all(|link| link.pid == leaker.pid() && link.path == LIBC), "{links:#?}");
    // The return program of malloc, calloc, realloc, reallocarray,
    // posix_memalign, aligned_alloc, valloc and pvalloc: one link.
    assert_eq!(links.iter().map(|link| link.offsets.len()).max(), Some(8), "{links:#?}");
    assert_eq!(links_of_type(memleak.child.id(), "perf"), 0);
    for offset in links.iter().flat_map(|link| &link.offsets) {
        assert_eq!(byte_in_process(leaker.pid(), LIBC, *offset), BREAKPOINT, "at {offset:#x}");
        assert_eq!(
            byte_in_process(outsider.pid(), LIBC, *offset),
            byte_in_file(LIBC, *offset),
            "the untraced process at {offset:#x}"
        );
    }
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(totals(&reports[0]), (Some(17_264), Some(15)), "{:#}", reports[0]);
    // Detached: the traced process's code is its file's again.
    for offset in links.iter().flat_map(|link| &link.offsets) {
        assert_eq!(
            byte_in_process(leaker.pid(), LIBC, *offset),
            byte_in_file(LIBC, *offset),
            "at {offset:#x}"
        );
    }
}

#[test]
fn perf_event_uprobes_record_the_same_allocations() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start_with_env(
        &["-p", &pid, "--format", "json", "-T", "1000", "3600"],
        &[(PERF_EVENT_UPROBES, "1"), (MAPPING_UPROBES, "1")],
    );
    memleak.wait_attached();
    assert_eq!(multi_links(memleak.child.id()).len(), 0);
    // A perf event per site and program: 13 function entries, 8
    // allocation returns and 2 mapping returns (mmap's and mremap's).
    assert_eq!(links_of_type(memleak.child.id(), "perf"), 23);
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(totals(&reports[0]), (Some(17_264), Some(15)), "{:#}", reports[0]);
}
