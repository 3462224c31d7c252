//! Frees of blocks memleak never saw allocated: a cache filled before
//! memleak attached replaces its entries, and its stack would look like
//! growth while the process's memory holds still. memleak counts those
//! frees, tells the blocks that take their places from new memory, and
//! its reports, diffs and /metrics say so: the leak beside the cache comes
//! first.

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

/// A run of memleak -p on a cache, saving a report a second (report N as
/// heap.N.snap): every report, and the numbers of those taken before any
/// refresh of the cache and after each.
struct Run {
    dir: TempDir,
    reports: Vec<Value>,
    snapshots: Vec<usize>,
}

impl Run {
    /// `leaker cache` refreshed twice.
    fn trace_two_replacements() -> Self {
        Self::trace_rounds(cache(), "replace", "replaced", 2, |report, rounds| state(report) == after(rounds))
    }

    /// `rounds` refreshes of `cache`, each asked for with `request` and
    /// answered with `answer`; `whole(report, n)` says when a report shows
    /// all of refresh `n`.
    fn trace_rounds(
        mut cache: Leaker,
        request: &str,
        answer: &str,
        rounds: u64,
        whole: impl Fn(&Value, u64) -> bool,
    ) -> Self {
        let dir = TempDir::new("memleak-unrecorded");
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
        let mut snapshots = vec![memleak.stdout.seen.len()];
        for round in 1..=rounds {
            cache.send(request, answer);
            memleak.stdout.wait_for("a report after the refresh", |line| {
                whole(&serde_json::from_str(line).unwrap(), round)
            });
            // A round reads the counters and the stacks one after the
            // other: the report that first shows the whole refresh may have
            // read the counters before it ended. The next one began after
            // that report, and so after the refresh.
            memleak.stdout.wait_for("the report after that", |_| true);
            snapshots.push(memleak.stdout.seen.len());
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

    /// `memleak diff --format json` of the snapshots before refresh
    /// `from` (0: before any) and after refresh `to`.
    fn diff(&self, from: usize, to: usize) -> Value {
        let (base, new) = (self.snapshot(self.snapshots[from]), self.snapshot(self.snapshots[to]));
        serde_json::from_str(&run_memleak(&["diff", path(&base), path(&new), "--format", "json"])).unwrap()
    }
}

#[test]
fn frees_of_blocks_allocated_before_memleak_attached_are_counted() {
    let run = Run::trace_two_replacements();
    let [base, first, second] = run.snapshots[..] else { unreachable!() };
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
    let [base, first, second] = [0, 1, 2].map(|n| run.snapshot(run.snapshots[n]));
    let across = run.diff(0, 1);
    assert_eq!(across["unrecorded_frees_between"], 100, "{across:#}");
    assert_eq!(
        (changed(&across, "cache_entry"), changed(&across, "cache_leak")),
        ((40_000, 100, 0), (1000, 1, 1000)),
        "every new entry took the place of an old one: {across:#}"
    );
    assert_eq!(across["stacks"][0]["frames"][0]["function"], "cache_leak", "the leak first: {across:#}");
    let text = run_memleak(&["diff", path(&base), path(&first)]);
    assert!(
        text.contains(
            "\n\t\treplacing: +40000 bytes of blocks that took the place of blocks from before memleak \
             attached; +0 bytes of new memory\n"
        ),
        "{text}"
    );
    assert!(
        text.ends_with(
            "\nBetween these snapshots the program freed 100 blocks memleak never saw allocated, of sizes \
             unknown; the blocks allocated in their places count as replacing them, not as growth (unless -s, \
             -z or -Z left blocks out)\n"
        ),
        "{text}"
    );
    // The raw order puts the cache first.
    let raw = run_memleak(&["diff", path(&base), path(&first), "--sort", "bytes", "--format", "json"]);
    let raw: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(raw["stacks"][0]["frames"][0]["function"], "cache_entry", "{raw:#}");
    let after = run.diff(1, 2);
    assert_eq!(after["unrecorded_frees_between"], 0, "{after:#}");
    assert_eq!(after["total_stacks"], 1, "only the leak changed: {after:#}");
    assert!(!run_memleak(&["diff", path(&first), path(&second)]).contains("Between these snapshots"));
}

/// (bytes, allocations, bytes of new memory) by which the stack of a diff
/// whose first frame is `function` changed.
fn changed(diff: &Value, function: &str) -> (i64, i64, i64) {
    let stacks = diff["stacks"].as_array().unwrap();
    let stack = stacks.iter().find(|stack| stack["frames"][0]["function"] == function);
    let stack = stack.unwrap_or_else(|| panic!("no {function} in {diff:#}"));
    let field = |name: &str| stack[name].as_i64().unwrap_or_else(|| panic!("no {name} in {stack:#}"));
    (field("delta_bytes"), field("delta_allocations"), field("delta_new_bytes"))
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
    // The cache's blocks replace those from before the attach.
    let gauge = |name: &str, value: u64| format!("\n{name}{{pid=\"{pid}\",exe=\"leaker\"}} {value}\n");
    assert!(metrics.body.contains(&gauge("memleak_outstanding_replacing_bytes", 40_000)), "{}", metrics.body);
    let cache_stack = metrics.body.lines().find(|line| {
        line.starts_with("memleak_stack_replacing_bytes{") && line.contains("frame=\"cache_entry\"")
    });
    assert_eq!(cache_stack.and_then(|line| line.rsplit(' ').next()), Some("40000"), "{}", metrics.body);
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

/// `leaker cache` on each allocator, preloaded (glibc's without).
fn cache_on(allocator: Option<&str>) -> Leaker {
    let mut command = Command::new(memleak_tests::fixture("leaker"));
    command.arg("cache");
    if let Some(library) = allocator {
        let path = format!("/usr/lib/x86_64-linux-gnu/{library}");
        assert!(Path::new(&path).exists(), "{path} is missing: .ci/run installs it");
        command.env("LD_PRELOAD", path);
    }
    Leaker::start_command(command)
}

#[test]
fn the_leak_comes_first_beside_a_cache_refilled_after_a_late_attach() {
    // glibc's, jemalloc's and tcmalloc's per-thread caches hand a freed
    // block back to the next allocation of its size; mimalloc only once
    // the page's free list runs out, so that some of the first refill's
    // blocks are new memory to memleak (8 of 100 here), and the next
    // refills make up for them.
    for allocator in
        [None, Some("libjemalloc.so.2"), Some("libtcmalloc_minimal.so.4"), Some("libmimalloc.so.2")]
    {
        let run = Run::trace_rounds(cache_on(allocator), "replace", "replaced", 3, |report, rounds| {
            state(report) == after(rounds)
        });
        let first = run.diff(0, 1);
        if allocator != Some("libmimalloc.so.2") {
            assert_eq!(
                (changed(&first, "cache_entry"), changed(&first, "cache_leak")),
                ((40_000, 100, 0), (1000, 1, 1000)),
                "{allocator:?}: {first:#}"
            );
            assert_eq!(first["stacks"][0]["frames"][0]["function"], "cache_leak", "{allocator:?}: {first:#}");
        }
        let later = run.diff(1, 3);
        assert_eq!(later["stacks"][0]["frames"][0]["function"], "cache_leak", "{allocator:?}: {later:#}");
        assert_eq!(changed(&later, "cache_leak"), (2000, 2, 2000), "{allocator:?}: {later:#}");
        let cache_grew = later["stacks"].as_array().unwrap().iter().any(|stack| {
            stack["frames"][0]["function"] == "cache_entry" && stack["delta_new_bytes"].as_i64() > Some(0)
        });
        assert!(!cache_grew, "{allocator:?}: {later:#}");
    }
}

#[test]
fn a_rust_service_with_tikv_jemallocator_finds_its_leak_first() {
    // GreptimeDB's case: a full cache refreshed by HashMap::insert (the new
    // block allocated before the old one is freed, through sdallocx), and
    // audit events leaked beside it.
    let mut command = Command::new(memleak_tests::rust_jemalloc());
    command.arg("cache");
    let allocations_through = |report: &Value, function: &str| -> u64 {
        let stacks = memleak_tests::stacks_through(report, function);
        stacks.iter().map(|stack| stack["allocations"].as_u64().unwrap()).sum()
    };
    let run =
        Run::trace_rounds(Leaker::start_command(command), "refresh", "refreshed", 3, |report, round| {
            allocations_through(report, "rust_jemalloc::record_audit_event") == 10 * round
                && allocations_through(report, "rust_jemalloc::refresh_entry") == 500 * round.min(2)
        });
    let leak = "rust_jemalloc::record_audit_event";
    // Rounds 1 and 2 replace the 1000 entries made before the attach.
    let second = run.diff(1, 2);
    assert_eq!(second["unrecorded_frees_between"], 500, "the sdallocx frees are counted: {second:#}");
    assert_eq!(second["stacks"][0]["frames"][0]["function"], leak, "{second:#}");
    assert_eq!(changed(&second, leak), (10_000, 10, 10_000), "{second:#}");
    // Each new entry takes the place of the old one freed just before it;
    // the round's first takes that of the last round's last, if that was
    // within memleak's window of 10 s.
    let (bytes, allocations, new_bytes) = changed(&second, "rust_jemalloc::refresh_entry");
    assert_eq!((bytes, allocations), (500 * 4096, 500), "{second:#}");
    assert!((0..=4096).contains(&new_bytes), "at most the first entry is new memory: {second:#}");
    // Round 3 refreshes entries made since the attach.
    let third = run.diff(2, 3);
    assert_eq!(third["unrecorded_frees_between"], 0, "{third:#}");
    assert_eq!(third["stacks"][0]["frames"][0]["function"], leak, "{third:#}");
    assert_eq!(changed(&third, leak), (10_000, 10, 10_000), "{third:#}");
    let last = run.reports.last().unwrap();
    assert_eq!(health(last, "unrecorded_frees"), 1000, "{last:#}");
    let replacing = last["total_replacing"]["bytes"].as_u64().unwrap();
    // Not the first entry ever made, nor a round's first whose previous round
    // ended out of the window.
    assert!((997 * 4096..=1000 * 4096).contains(&replacing), "{last:#}");
}
