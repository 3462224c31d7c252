//! `memleak serve --watch`: processes watched from their counters with no
//! probe, and only the one whose memory grows traced, for a window, then
//! let go with its report kept.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use memleak_tests::{
    cgroups::TestCgroup,
    fixture,
    fixtures::{marker_line, static_stripped},
    http::{get, serve, stop},
    memleak::{frame_functions, stacks_at},
    uprobes::multi_links,
    PATIENCE,
};
use serde_json::Value;

/// Processes a test started, killed when it ends, failed or not.
#[derive(Default)]
struct Fleet(Vec<Child>);

impl Fleet {
    /// Starts `program` with `args` in `cgroup`; returns its pid.
    fn start_in(&mut self, cgroup: &TestCgroup, program: &Path, args: &[&str]) -> u32 {
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("start {}: {error}", program.display()));
        let pid = child.id();
        self.0.push(child);
        cgroup.join(pid);
        pid
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Python program that takes 50 MB, holds it a second, frees it and
/// waits a second, again and again: an interpreter's sawtooth.
const PYTHON_SAWTOOTH: &str = "import time\n\
while True:\n    held = [b'x' * 5_000_000 for _ in range(10)]\n    time.sleep(1)\n    del held\n    time.sleep(1)\n";

/// `memleak serve --watch` on the processes of `cgroup`, judging quickly:
/// a look a second, over 12 s, at 16 KiB/s or more; then `more`.
fn serve_watching(cgroup: &TestCgroup, more: &[&str]) -> (memleak_tests::Memleak, u16) {
    let mut args = vec![
        "--watch",
        "--cgroup",
        cgroup.arg(),
        "--watch-every",
        "1s",
        "--growth-window",
        "12s",
        "--min-growth",
        "16KiB/s",
    ];
    args.extend_from_slice(more);
    serve(&args)
}

/// The states `/api/v1/watch` gives each pid.
fn watch_states(port: u16) -> BTreeMap<u64, String> {
    let response = get(port, "/api/v1/watch").unwrap_or_else(|error| panic!("GET /api/v1/watch: {error}"));
    let watch: Value =
        serde_json::from_str(&response.body).unwrap_or_else(|error| panic!("{error}: {response:#?}"));
    watch["processes"]
        .as_array()
        .unwrap_or_else(|| panic!("no processes in {watch:#}"))
        .iter()
        .map(|process| (process["pid"].as_u64().unwrap(), process["state"].as_str().unwrap().to_owned()))
        .collect()
}

/// Starts, in each of `cgroups`, a process that holds its memory, one
/// that allocates and frees all the time, and a sawtooth (a C program's
/// in half of them, an interpreter's in the others); returns their pids.
fn start_bystanders(fleet: &mut Fleet, cgroups: &[TestCgroup]) -> BTreeSet<u64> {
    let growth = fixture("growth");
    let mut bystanders = BTreeSet::new();
    for (index, cgroup) in cgroups.iter().enumerate() {
        bystanders.insert(fleet.start_in(cgroup, &growth, &["steady"]));
        bystanders.insert(fleet.start_in(cgroup, &growth, &["churn"]));
        let sawtooth = if index < cgroups.len() / 2 {
            fleet.start_in(cgroup, &growth, &["sawtooth"])
        } else {
            fleet.start_in(cgroup, Path::new("python3"), &["-c", PYTHON_SAWTOOTH])
        };
        bystanders.insert(sawtooth);
    }
    bystanders.into_iter().map(u64::from).collect()
}

/// Every state each process went through, and every process `memleak`
/// held a probe in, until `leaker` has been traced and let go.
fn states_until_let_go(
    port: u16,
    memleak_pid: u32,
    leaker: u64,
) -> (BTreeMap<u64, BTreeSet<String>>, BTreeSet<u64>) {
    let mut states_seen: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    let mut probed = BTreeSet::new();
    let deadline = Instant::now() + PATIENCE;
    loop {
        for (pid, state) in watch_states(port) {
            states_seen.entry(pid).or_default().insert(state);
        }
        probed.extend(multi_links(memleak_pid).iter().map(|link| u64::from(link.pid)));
        let was_traced = states_seen.get(&leaker).is_some_and(|states| states.contains("traced"));
        if was_traced && watch_states(port).get(&leaker).map(String::as_str) == Some("detached") {
            return (states_seen, probed);
        }
        assert!(Instant::now() < deadline, "the leaker was not traced, then let go: {states_seen:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The report `leaker` left when it was let go names the leak's line,
/// with whole blocks of it.
fn assert_report_names_the_leak(port: u16, leaker: u64) {
    let response = get(port, &format!("/api/v1/report?pid={leaker}&format=json"))
        .unwrap_or_else(|error| panic!("GET the report: {error}"));
    let report: Value =
        serde_json::from_str(&response.body).unwrap_or_else(|error| panic!("{error}: {response:#?}"));
    let line = marker_line("growth", "slow-leak");
    let leaks = stacks_at(&report, "leak_slowly", line);
    let [leak] = leaks.as_slice() else {
        panic!("not one stack at leak_slowly (growth.c:{line}): {report:#}")
    };
    let (bytes, allocations) = (leak["bytes"].as_u64().unwrap(), leak["allocations"].as_u64().unwrap());
    assert!(
        allocations > 0 && bytes == allocations * 4096,
        "{allocations} allocations of 4 KiB, {bytes} bytes"
    );
    assert!(frame_functions(leak).contains(&"leak"), "leak_slowly's caller: {leak:#}");
}

#[test]
fn of_thirty_processes_in_ten_cgroups_only_the_slow_leaker_is_traced() {
    let parent = TestCgroup::new();
    let cgroups: Vec<TestCgroup> = (0..10).map(|index| parent.child(&format!("service-{index}"))).collect();
    let mut fleet = Fleet::default();
    let bystanders = start_bystanders(&mut fleet, &cgroups);
    let leaker = u64::from(fleet.start_in(&cgroups[3], &fixture("growth"), &["leak", "64"]));
    let (memleak, port) = serve_watching(&parent, &["--trace-for", "6s"]);
    let (states_seen, probed) = states_until_let_go(port, memleak.child.id(), leaker);
    let missing: Vec<_> = bystanders.iter().filter(|pid| !states_seen.contains_key(pid)).collect();
    assert!(missing.is_empty(), "processes of the cgroups not watched: {missing:?} of {states_seen:?}");
    let singled_out: Vec<_> = states_seen
        .iter()
        .filter(|(pid, states)| **pid != leaker && states.iter().any(|state| state != "watched"))
        .collect();
    assert!(singled_out.is_empty(), "steady, churning or sawtooth processes singled out: {singled_out:?}");
    assert_eq!(probed, BTreeSet::from([leaker]), "the processes memleak placed uprobes in");
    assert!(multi_links(memleak.child.id()).is_empty(), "uprobes left in place after the window");
    // Let go, its last report stays.
    assert_report_names_the_leak(port, leaker);
    let list: Value = serde_json::from_str(&get(port, "/api/v1/targets").unwrap().body).unwrap();
    let traced: Vec<(u64, bool)> = list["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|target| (target["pid"].as_u64().unwrap(), target["detached"].as_bool().unwrap()))
        .collect();
    assert_eq!(traced, [(leaker, true)], "{list:#}");
    let metrics = get(port, "/metrics").unwrap().body;
    let detached = format!("memleak_watch_state{{pid=\"{leaker}\",exe=\"growth\",state=\"detached\"}} 1");
    assert!(metrics.lines().any(|line| line == detached), "no `{detached}` in:\n{metrics}");
    stop(memleak);
}

#[test]
fn growers_past_max_traced_wait_and_one_that_cannot_be_traced_is_said_once_and_watched() {
    let cgroup = TestCgroup::new();
    let mut fleet = Fleet::default();
    let growth = fixture("growth");
    let first = u64::from(fleet.start_in(&cgroup, &growth, &["leak", "128"]));
    let second = u64::from(fleet.start_in(&cgroup, &growth, &["leak", "64"]));
    let untraceable = u64::from(fleet.start_in(&cgroup, &static_stripped("growth"), &["leak", "64"]));
    let (mut memleak, port) = serve_watching(&cgroup, &["--trace-for", "4s", "--max-traced", "1"]);
    // Each round of states seen, until both leakers have been traced.
    let mut rounds: Vec<BTreeMap<u64, String>> = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    let traced_once = |rounds: &[BTreeMap<u64, String>], pid: u64| {
        rounds.iter().any(|states| states.get(&pid).is_some_and(|state| state == "traced"))
    };
    let said_untraceable = |rounds: &[BTreeMap<u64, String>]| {
        rounds
            .last()
            .is_some_and(|states| states.get(&untraceable).is_some_and(|state| state == "untraceable"))
    };
    // The one that cannot be traced is found so when a slot is free.
    while !(traced_once(&rounds, first) && traced_once(&rounds, second) && said_untraceable(&rounds)) {
        assert!(
            Instant::now() < deadline,
            "not each grower traced in turn, or found untraceable: {rounds:?}"
        );
        rounds.push(watch_states(port));
        std::thread::sleep(Duration::from_millis(250));
    }
    for states in &rounds {
        let traced = states.values().filter(|state| *state == "traced").count();
        assert!(traced <= 1, "more traced at once than --max-traced 1: {states:?}");
    }
    let one_waited = rounds.iter().any(|states| {
        let pair = (states.get(&first).map(String::as_str), states.get(&second).map(String::as_str));
        matches!(pair, (Some("traced"), Some("suspected")) | (Some("suspected"), Some("traced")))
    });
    assert!(one_waited, "no leaker waited, suspected, while the other was traced: {rounds:?}");
    stop_and_read(&mut memleak);
    let said: Vec<String> = memleak
        .stderr
        .rest()
        .into_iter()
        .filter(|line| line.starts_with(&format!("memleak: pid {untraceable} ")))
        .collect();
    assert_eq!(said.len(), 1, "the untraceable process said once: {said:?}");
    assert!(said[0].contains("cannot be traced: no known allocator"), "{said:?}");
}

/// Ends the daemon with SIGTERM, which must end it with status 0; its
/// stderr stays to be read.
fn stop_and_read(memleak: &mut memleak_tests::Memleak) {
    memleak.signal(libc::SIGTERM);
    let status = memleak.child.wait().expect("wait for memleak");
    assert!(status.success(), "SIGTERM: {status}");
}

#[test]
fn a_window_that_costs_more_than_max_overhead_ends_early_and_its_cost_is_exported() {
    let cgroup = TestCgroup::new();
    let mut fleet = Fleet::default();
    // 20,000 malloc/free pairs a second beside its leak: a few percent of
    // a CPU in traps alone, past a budget of 1%.
    let busy = u64::from(fleet.start_in(&cgroup, &fixture("growth"), &["busy-leak", "64"]));
    let (mut memleak, port) = serve_watching(&cgroup, &["--trace-for", "10m", "--max-overhead", "0.01"]);
    let said = memleak.stderr.wait_for("the window cut short", |line| {
        line.starts_with(&format!("memleak: pid {busy}: its probes cost"))
    });
    assert!(said.contains("over --max-overhead 1.0%: its window ends early; detached"), "{said}");
    let metrics = get(port, "/metrics").unwrap().body;
    let prefix = format!("memleak_overhead_seconds_total{{pid=\"{busy}\",exe=\"growth\"}} ");
    let cost: f64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix(&prefix)?.parse().ok())
        .unwrap_or_else(|| panic!("no `{prefix}` in:\n{metrics}"));
    assert!(cost > 0.0, "{cost}");
    assert_eq!(watch_states(port).get(&busy).map(String::as_str), Some("detached"));
    stop(memleak);
}
