//! Two memleaks with --trace must not trace each other: each event one
//! prints allocates, which is an event for the other, and the two used to
//! burn both cores writing 59 MB in 8 s. Each leaves the other out, in
//! one line, as it leaves out itself and its output's readers.

use memleak_tests::{cgroups::TestCgroup, memleak_binary, run_to_end, Leaker, Memleak};

const ANOTHER_MEMLEAK: &str =
    "it is another memleak: with --trace, each tracing the other would print an event for each event printed";

#[test]
fn another_memleak_named_by_p_with_trace_is_refused_in_one_line() {
    let leaker = Leaker::start_waiting(&["none"]);
    let pid = leaker.pid().to_string();
    let mut first = Memleak::start(&["-t", "-p", &pid, "--format", "json", "3600"]);
    first.wait_attached();
    let first_pid = first.child.id().to_string();
    // Its output a pipe, not /dev/null: the first memleak holds /dev/null
    // open for reading, which would make it a reader of that output.
    let mut second = Memleak::start(&["-t", "-p", &first_pid, "--format", "json", "1", "1"]);
    let status = second.child.wait().unwrap();
    let stderr = second.stderr.rest();
    assert_eq!(status.code(), Some(2), "{stderr:#?}");
    assert_eq!(
        stderr,
        [format!("memleak: error: memleak does not trace pid {first_pid}: {ANOTHER_MEMLEAK}")]
    );
    // Without --trace nothing feeds on itself: memleak may be traced.
    let (code, stderr) = run_to_end(&["-p", &first_pid, "--format", "json", "1", "1"]);
    assert_eq!(code, Some(0), "{stderr}");
    first.signal(libc::SIGINT);
    assert!(first.finish().0.success());
    leaker.exit();
}

#[test]
fn a_command_that_is_memleak_is_not_run_with_trace() {
    let binary = memleak_binary();
    let command = format!("{} -p 1", binary.display());
    let (code, stderr) = run_to_end(&["-t", "-c", &command]);
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!("memleak: error: memleak does not trace `{}`: {ANOTHER_MEMLEAK}", binary.display())
    );
}

#[test]
fn two_memleaks_with_trace_in_the_cgroup_they_trace_leave_each_other_out() {
    let cgroup = TestCgroup::new();
    let path = cgroup.arg();
    let mut leaker = Leaker::start_waiting(&["seed", "3"]);
    cgroup.join(leaker.pid());
    let args = ["-t", "--cgroup", path, "--format", "json", "3600"];
    let mut first = Memleak::start(&args);
    cgroup.join(first.child.id());
    first.wait_attached();
    // The second finds the first in the cgroup from the start, and the
    // first finds the second when it joins.
    let mut second = Memleak::start(&args);
    cgroup.join(second.child.id());
    let left_out = |other: &Memleak| {
        format!("memleak: warn: not tracing pid {} of the cgroup: {ANOTHER_MEMLEAK}", other.child.id())
    };
    let said_by_second = left_out(&first);
    second.stderr.wait_for("the second to leave the first out", |line| line == said_by_second);
    let said_by_first = left_out(&second);
    first.stderr.wait_for("the first to leave the second out", |line| line == said_by_first);
    // Both trace the leaker: its allocations are events for both.
    leaker.go();
    let events_of = |memleak: &mut Memleak| {
        memleak.stdout.wait_for("the leaker's events", |line| line.contains("\"event\""));
    };
    events_of(&mut first);
    events_of(&mut second);
    let mut outputs = Vec::new();
    for memleak in [first, second] {
        memleak.signal(libc::SIGINT);
        let pid = memleak.child.id();
        let mut memleak = memleak;
        let stdout = memleak.stdout.rest();
        let status = memleak.child.wait().unwrap();
        let stderr = memleak.stderr.rest();
        assert!(status.success(), "{stderr:#?}");
        let said = stderr.iter().filter(|line| line.contains(ANOTHER_MEMLEAK)).count();
        assert_eq!(said, 1, "the other left out in one line: {stderr:#?}");
        let bytes: usize = stdout.iter().map(String::len).sum();
        outputs.push((pid, stdout.len(), bytes));
    }
    // The leaker's few events and a final report each, not one memleak's
    // events of the other's printing.
    for (pid, lines, bytes) in outputs {
        assert!(bytes < 64 * 1024, "memleak {pid} wrote {lines} lines, {bytes} bytes");
    }
    leaker.exit();
}
