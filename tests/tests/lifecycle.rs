//! Attaching to running processes, periodic reports, and how a run ends.

use memleak_tests::{usage_at, Leaker, Memleak};

#[test]
fn running_process_is_reported_every_interval_and_on_sigint() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "1"]);
    memleak.wait_attached();
    leaker.go();
    // Interval reports keep coming; wait for one that has seen it all.
    memleak.stdout.wait_for("a report with every leak", |line| line.contains("\"total_bytes\":17264"));
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "SIGINT ends the run normally, got {status}");
    let last = reports.last().expect("a final report after SIGINT");
    assert_eq!(last["pid"], leaker.pid());
    assert_eq!(last["total_bytes"], 17_264);
    assert_eq!(usage_at(last, "leak_malloc", "malloc"), (3000, 3));
    assert!(reports.len() >= 2, "interval reports, then the final one");
    leaker.exit();
}

#[test]
fn target_exit_ends_the_run_with_a_symbolized_report() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "3600"]);
    memleak.wait_attached();
    leaker.go();
    leaker.exit();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "a target that exits ends the run normally, got {status}");
    let last = reports.last().expect("a final report once the target exited");
    // Symbolized from the files memleak kept open, after the process is gone.
    assert_eq!(usage_at(last, "leak_calloc", "calloc"), (3000, 3), "{last:#}");
}

#[test]
fn count_limits_the_number_of_reports() {
    let leaker = Leaker::start_waiting(&["none"]);
    let pid = leaker.pid().to_string();
    let memleak = Memleak::start(&["-p", &pid, "--format", "json", "1", "2"]);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(reports.len(), 2);
    assert!(reports.iter().all(|report| report["total_bytes"] == 0));
}

#[test]
fn sigterm_detaches_and_leaves_the_target_running() {
    let mut leaker = Leaker::start_waiting(&["seed", "3"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "3600"]);
    memleak.wait_attached();
    memleak.signal(libc::SIGTERM);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(reports.len(), 1, "one final report");
    // Detached: the target still runs, and allocates untraced.
    leaker.go();
    assert!(leaker.child.try_wait().unwrap().is_none(), "the target outlives memleak");
    leaker.exit();
}

#[test]
fn text_report_shows_frames_with_file_and_line() {
    let mut leaker = Leaker::start_waiting(&["seed", "2"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "-o", "0", "3600"]);
    memleak.wait_attached();
    leaker.go();
    memleak.signal(libc::SIGINT);
    let text = memleak.stdout.rest().join("\n");
    let status = memleak.child.wait().unwrap();
    assert!(status.success());
    let line = memleak_tests::marker_line("leaker", "fibonacci");
    // fibonacci(2) runs three times, twice called from one line of
    // fibonacci (one call path, one stack); glibc's pthread_create adds
    // the dtv.
    assert!(text.contains("Top 3 stacks with outstanding allocations in pid"), "{text}");
    assert!(text.contains("\t8192 bytes in 1 allocations from stack"), "{text}");
    assert!(text.contains("\t16384 bytes in 2 allocations from stack"), "{text}");
    assert!(text.contains(&format!("tests/fixtures/leaker.c:{line}) [")), "{text}");
    assert!(text.contains("\t\tchild+0x"), "{text}");
    assert!(text.contains("Outstanding: 24848 bytes in 4 allocations"), "{text}");
    leaker.exit();
}
