//! Frees of blocks memleak never saw allocated: a cache filled before
//! memleak attached replaces its entries, and its stack looks like growth
//! while the process's memory holds still. memleak counts those frees,
//! and its reports, diffs and /metrics say so.

use std::{path::Path, process::Command};

use memleak_tests::{http, tempdir::TempDir, usage_at, Leaker, Memleak};
use serde_json::Value;

/// `leaker cache`: 100 entries of 400 bytes allocated before "ready";
/// each "replace" frees and allocates every entry anew, then leaks 1000
/// bytes beside them.
fn cache() -> Leaker {
    let mut command = Command::new(memleak_tests::fixture("leaker"));
    command.arg("cache");
    Leaker::start_command(command)
}

/// (cache bytes, cache entries) and (leaked bytes, leaks) of a report.
fn state(report: &Value) -> ((u64, u64), (u64, u64)) {
    (usage_at(report, "cache_entry", "cache-entry"), usage_at(report, "cache_leak", "cache-leak"))
}

/// The state after `rounds` replacements, once each is whole.
fn after(rounds: u64) -> ((u64, u64), (u64, u64)) {
    ((40_000, 100), (1000 * rounds, rounds))
}

fn health(report: &Value, counter: &str) -> u64 {
    report["health"][counter].as_u64().unwrap_or_else(|| panic!("no health.{counter}: {report:#}"))
}

/// `memleak ARGS`, which must succeed; its stdout.
fn run_memleak(args: &[&str]) -> String {
    let output = Command::new(memleak_tests::memleak_binary()).args(args).output().expect("run memleak");
    assert!(output.status.success(), "memleak {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("UTF-8")
}

fn path(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The N of "Since the last report: N frees of blocks memleak never saw
/// allocated" in a text report, 0 without the line.
fn unrecorded_since_last_report(text: &str) -> u64 {
    let line = text.lines().find_map(|line| line.strip_prefix("Since the last report: "));
    line.map_or(0, |rest| {
        let count = rest.split_once(" frees of blocks memleak never saw allocated;").expect(rest).0;
        count.parse().unwrap_or_else(|_| panic!("{text}"))
    })
}

/// A run of memleak -p on the cache, saving a report a second (report N
/// as heap.N.snap): every report, and the numbers of three, one before
/// any replacement and one after each of two.
struct Run {
    dir: TempDir,
    reports: Vec<Value>,
    snapshots: [usize; 3],
}

impl Run {
    fn trace_two_replacements() -> Self {
        let dir = TempDir::new("memleak-unrecorded");
        let mut cache = cache();
        let pid = cache.pid().to_string();
        let save = dir.path().join("heap.snap");
        let mut memleak = Memleak::start(&[
            "-p",
            &pid,
            "--save",
            path(&save),
            "--format",
            "json",
            "-o",
            "0",
            "-T",
            "100",
            "1",
        ]);
        memleak.wait_attached();
        memleak.stdout.wait_for("a first report", |_| true);
        let mut snapshots = [memleak.stdout.seen.len(); 3];
        for (rounds, snapshot) in (1..=2).zip(&mut snapshots[1..]) {
            cache.send("replace", "replaced");
            memleak.stdout.wait_for("a report after the replacement", |line| {
                state(&serde_json::from_str(line).unwrap()) == after(rounds)
            });
            // A round reads the counters and the stacks one after the
            // other: the report that first shows the whole replacement may
            // have read the counters before it ended. The next one began
            // after that report, and so after the replacement.
            memleak.stdout.wait_for("the report after that", |_| true);
            *snapshot = memleak.stdout.seen.len();
        }
        memleak.signal(libc::SIGINT);
        let (status, reports) = memleak.finish();
        assert!(status.success());
        cache.exit();
        Self { dir, reports, snapshots }
    }

    /// Report `n`, counting from 1.
    fn report(&self, n: usize) -> &Value {
        &self.reports[n - 1]
    }

    fn snapshot(&self, n: usize) -> std::path::PathBuf {
        self.dir.path().join(format!("heap.{n}.snap"))
    }
}

#[test]
fn frees_of_blocks_allocated_before_memleak_attached_are_counted() {
    let run = Run::trace_two_replacements();
    let [base, first, second] = run.snapshots;
    // The first replacement freed the 100 entries allocated before memleak
    // attached; the second, 100 it saw allocated.
    let counted = |n: usize| {
        let report = run.report(n);
        (health(report, "frees"), health(report, "unrecorded_frees"), health(report, "allocations"))
    };
    assert_eq!(counted(first), (100, 100, 101), "{:#}", run.report(first));
    assert_eq!(counted(second), (200, 100, 202), "{:#}", run.report(second));
    // Each report says how many it saw since the one before, however the
    // reports fell across the replacement.
    let since = |from: usize, to: usize| -> u64 {
        let reports = &run.reports[from..to];
        reports.iter().map(|report| report["delta_unrecorded_frees"].as_u64().unwrap()).sum()
    };
    assert_eq!(run.report(base).get("delta_unrecorded_frees"), None, "none in the first");
    assert_eq!((since(base, first), since(first, second)), (100, 0));
    // The text of each report, --sort growth, says so too.
    let texts: Vec<String> = (base + 1..=first)
        .map(|n| run_memleak(&["report", path(&run.snapshot(n)), "--sort", "growth"]))
        .collect();
    assert_eq!(texts.iter().map(|text| unrecorded_since_last_report(text)).sum::<u64>(), 100, "{texts:#?}");
    let last = texts.last().unwrap();
    assert!(
        last.contains(
            "\n100 of those frees were of blocks memleak never saw allocated (allocated before it attached, \
             or left out by -s, -z, -Z or --max-allocs), of sizes unknown\n"
        ),
        "{last}"
    );
    assert!(last.contains("\nSeen: 101 allocations, 100 frees, 0 failed allocations;"), "{last}");
    assert_diffs_say_so(&run);
}

/// The cache's stack grew by 40000 bytes between the snapshot before the
/// first replacement and the one after, as a leak's would: the diff says
/// why it need not be. Between the two replacements, every block freed
/// was one memleak saw allocated.
fn assert_diffs_say_so(run: &Run) {
    let [base, first, second] = run.snapshots.map(|n| run.snapshot(n));
    let diff = |base: &Path, new: &Path| -> Value {
        serde_json::from_str(&run_memleak(&["diff", path(base), path(new), "--format", "json"])).unwrap()
    };
    let grown = |diff: &Value, function: &str| -> (i64, i64) {
        let stacks = diff["stacks"].as_array().unwrap();
        let stack = stacks.iter().find(|stack| stack["frames"][0]["function"] == function);
        let stack = stack.unwrap_or_else(|| panic!("no {function} in {diff:#}"));
        (stack["delta_bytes"].as_i64().unwrap(), stack["delta_allocations"].as_i64().unwrap())
    };
    let across = diff(&base, &first);
    assert_eq!(across["unrecorded_frees_between"], 100, "{across:#}");
    assert_eq!((grown(&across, "cache_entry"), grown(&across, "cache_leak")), ((40_000, 100), (1000, 1)));
    let text = run_memleak(&["diff", path(&base), path(&first)]);
    assert!(
        text.ends_with(
            "\nBetween these snapshots the program freed 100 blocks memleak never saw allocated, of sizes \
             unknown: a stack that replaces such blocks (a cache refilling) looks like growth until the old \
             blocks are gone\n"
        ),
        "{text}"
    );
    let after = diff(&first, &second);
    assert_eq!(after["unrecorded_frees_between"], 0, "{after:#}");
    assert_eq!(after["total_stacks"], 1, "only the leak changed: {after:#}");
    assert!(!run_memleak(&["diff", path(&first), path(&second)]).contains("Between these snapshots"));
}

#[test]
fn serve_counts_them_in_its_metrics() {
    let mut cache = cache();
    let pid = cache.pid();
    let (memleak, port) = http::serve_pid(pid);
    cache.send("replace", "replaced");
    // 100 entries of 400 bytes and the 1000 leaked after them: the whole
    // replacement is in the report.
    let whole = format!("memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\"}} 41000");
    let metrics =
        http::get_until(port, "/metrics", |response| response.body.lines().any(|line| line == whole));
    let series = |name: &str| format!("\n{name}{{pid=\"{pid}\",exe=\"leaker\"}} 100\n");
    for name in ["memleak_unrecorded_frees_total", "memleak_frees_total"] {
        assert!(metrics.body.contains(&series(name)), "{name}: {}", metrics.body);
    }
    assert!(metrics.body.contains("\n# TYPE memleak_unrecorded_frees_total counter\n"), "{}", metrics.body);
    http::stop(memleak);
    cache.exit();
}

#[test]
fn the_allocators_own_blocks_freed_at_thread_exit_are_not_counted() {
    // `leaker seed 3` runs one thread, which leaks and exits: glibc frees
    // that thread's cache, a block it made for itself inside the thread's
    // first malloc, with no call memleak sees. A free, of no block the
    // program allocated before memleak attached (with -c, there is none).
    let report = memleak_tests::trace_command("seed 3", &[]);
    assert_eq!((health(&report, "frees"), health(&report, "unrecorded_frees")), (1, 0), "{report:#}");
}
