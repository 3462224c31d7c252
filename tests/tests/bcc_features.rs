//! bcc memleak's other flags: sampling, combined totals, ordering, symbol
//! prefixes, several processes, and growth between reports.

use memleak_tests::{run_to_end, trace_command, usage_at, Leaker, Memleak};
use serde_json::Value;

#[test]
fn sampled_totals_are_scaled_and_within_the_statistical_bound() {
    let report = trace_command("many", &["-s", "10"]);
    assert_eq!(report["sample_rate"], 10);
    let (bytes, count) = usage_at(&report, "many", "many");
    // 20000 allocations, each recorded with probability 1/10: the recorded
    // count is Binomial(20000, 0.1), mean 2000, sd 42.4. Six sd either side
    // (a false failure about once in 10^9 runs), times 10 for the scaling.
    assert!((17_450..=22_550).contains(&count), "scaled count {count} is off: {report:#}");
    assert_eq!(bytes, count * 100, "every recorded block is 100 bytes");
    // Frees stay exact: nothing of the freed blocks is outstanding.
    assert_eq!(usage_at(&report, "many", "many-freed"), (0, 0), "{report:#}");
}

#[test]
fn a_sample_rate_of_zero_is_a_usage_error() {
    let (code, stderr) = run_to_end(&["-p", "1", "-s", "0"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("memleak: error: invalid value `0` for `--sample-rate"), "{stderr}");
}

#[test]
fn combined_totals_are_exact_under_four_threads() {
    let report = trace_command("threaded", &["--combined-only"]);
    assert_eq!(usage_at(&report, "threaded_worker", "threaded"), (4 * 1000 * 64, 4000), "{report:#}");
    assert_eq!(report["min_age_ms"], 0);
}

#[test]
fn combined_only_refuses_per_allocation_flags() {
    for flag in [&["-a"][..], &["-o", "100"][..]] {
        let mut args = vec!["-p", "1", "--combined-only"];
        args.extend_from_slice(flag);
        let (code, stderr) = run_to_end(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("cannot be used with"), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
}

#[test]
fn sort_by_count_orders_by_allocations() {
    let report = trace_command("all", &["--sort", "count"]);
    let counts: Vec<u64> =
        report["stacks"].as_array().unwrap().iter().map(|s| s["allocations"].as_u64().unwrap()).collect();
    assert_eq!(&counts[..2], [3, 3], "{counts:?}");
    assert!(counts.windows(2).all(|pair| pair[0] >= pair[1]), "{counts:?}");
    let (code, stderr) = run_to_end(&["-p", "1", "--sort", "age"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("invalid value `age` for `--sort"), "{stderr}");
}

#[test]
fn a_symbol_prefix_selects_prefixed_functions() {
    // glibc exports most of its allocator a second time as __libc_malloc
    // and so on, but has no __libc_posix_memalign: that call goes unseen.
    let report = trace_command("all", &["--symbols-prefix", "__libc_"]);
    assert_eq!(usage_at(&report, "leak_posix_memalign", "posix_memalign"), (0, 0), "{report:#}");
    assert_eq!(usage_at(&report, "leak_malloc", "malloc"), (3000, 3), "{report:#}");
    let totals = (report["total_bytes"].as_u64(), report["total_allocations"].as_u64());
    assert_eq!(totals, (Some(17_264 - 1234), Some(14)));
}

#[test]
fn a_symbol_prefix_that_matches_nothing_names_what_was_searched() {
    let leaker = Leaker::start_waiting(&["none"]);
    let pid = leaker.pid().to_string();
    let (code, stderr) = run_to_end(&["-p", &pid, "--symbols-prefix", "nosuch_"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("memleak: error: no nosuch_malloc and nosuch_free in "), "{stderr}");
    assert!(stderr.contains("target/fixtures/leaker") && stderr.contains("libc.so.6"), "{stderr}");
}

#[test]
fn several_processes_get_reports_of_their_own() {
    let mut first = Leaker::start_waiting(&["all"]);
    let mut second = Leaker::start_waiting(&["churn"]);
    let pids = format!("{},{}", first.pid(), second.pid());
    let mut memleak = Memleak::start(&["-p", &pids, "--format", "json", "-o", "0", "-T", "100", "3600"]);
    memleak.wait_attached();
    memleak.wait_attached();
    first.go();
    second.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(reports.len(), 2, "one final report per process");
    let of =
        |pid: u32| reports.iter().find(|r| r["pid"] == pid).unwrap_or_else(|| panic!("no report for {pid}"));
    let first_report = of(first.pid());
    assert_eq!(first_report["total_bytes"], 17_264, "{first_report:#}");
    assert_eq!(usage_at(first_report, "leak_malloc", "malloc"), (3000, 3));
    let second_report = of(second.pid());
    assert_eq!(
        (second_report["total_bytes"].as_u64(), second_report["total_allocations"].as_u64()),
        (Some(77), Some(1))
    );
    assert_eq!(usage_at(second_report, "churn", "churn-leak"), (77, 1));
    // What each saw is its own, not the sum over both.
    let seen = |report: &Value| {
        let health = &report["health"];
        (health["allocations"].as_u64(), health["frees"].as_u64(), health["failed_allocations"].as_u64())
    };
    // Two frees: the block realloc moved, and realloc(p, 0)'s, once
    // although glibc's realloc calls free for it.
    assert_eq!(seen(first_report), (Some(17), Some(2), Some(3)), "{first_report:#}");
    assert_eq!(seen(second_report), (Some(10_001), Some(10_000), Some(0)), "{second_report:#}");
    first.exit();
    second.exit();
}

#[test]
fn each_report_shows_how_a_stack_moved_since_the_last() {
    let mut leaker = Leaker::start_waiting(&["steps"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "1"]);
    memleak.wait_attached();
    leaker.go();
    let step_bytes = |line: &str| -> u64 {
        let report: Value = serde_json::from_str(line).unwrap();
        usage_at(&report, "step_leak", "step").0
    };
    // Three steps, each after a report; then two reports in which it holds.
    for step in 1..=3u64 {
        leaker.send("step", "stepped");
        memleak
            .stdout
            .wait_for(&format!("a report with step {step}"), |line| step_bytes(line) == step * 8192);
    }
    let seen_so_far = memleak.stdout.seen.len();
    memleak.stdout.wait_for("another report", |_| true);
    memleak.stdout.wait_for("another report", |_| true);
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert!(reports.len() > seen_so_far, "{reports:#?}");
    // Every report's delta is exactly the change since the report before.
    let stack_of = |report: &Value| -> Option<Value> {
        let line = memleak_tests::marker_line("leaker", "step");
        memleak_tests::stacks_at(report, "step_leak", line).first().map(|s| (*s).clone())
    };
    let mut previous_bytes: Option<u64> = None;
    let mut streak = 0;
    for (index, report) in reports.iter().enumerate() {
        let Some(stack) = stack_of(report) else {
            previous_bytes = Some(0);
            continue;
        };
        let bytes = stack["bytes"].as_u64().unwrap();
        if index == 0 {
            assert_eq!(stack["delta_bytes"], Value::Null, "the first report has nothing to compare with");
        } else {
            let delta = bytes as i64 - previous_bytes.unwrap_or(0) as i64;
            assert_eq!(stack["delta_bytes"].as_i64(), Some(delta), "report {index}: {stack}");
            streak = if delta > 0 { streak + 1 } else { 0 };
            assert_eq!(stack["growing_reports"].as_u64(), Some(streak), "report {index}: {stack}");
        }
        previous_bytes = Some(bytes);
    }
    let last = stack_of(reports.last().unwrap()).unwrap();
    assert_eq!((last["bytes"].as_u64(), last["delta_bytes"].as_i64()), (Some(3 * 8192), Some(0)));
    leaker.exit();
}

#[test]
fn trace_prints_every_call_as_it_happens() {
    let lines = memleak_tests::trace_fixture_output("leaker", "all", &["-t"]);
    let events: Vec<(String, Option<u64>, bool)> = lines
        .iter()
        .filter(|line| line.get("event").is_some())
        .map(|line| {
            (line["event"].as_str().unwrap().to_owned(), line["size"].as_u64(), line["address"].is_string())
        })
        .collect();
    let expected: Vec<(&str, u64, bool)> = vec![
        ("malloc", 1000, true),
        ("malloc", 1000, true),
        ("malloc", 1000, true),
        ("calloc", 1000, true),
        ("calloc", 1000, true),
        ("calloc", 1000, true),
        ("malloc", 100, true),
        ("realloc", 5000, true),
        ("realloc", 300, true),
        ("malloc", 64, true),
        ("free", 64, true),    // glibc's realloc(p, 0) calls free(p)...
        ("realloc", 0, false), // ...and returns NULL
        ("reallocarray", 700, true),
        ("posix_memalign", 1234, true),
        ("posix_memalign", 4321, false), // EINVAL
        // Aliases in glibc 2.36: one probe, both names.
        ("aligned_alloc|memalign", 640, true),
        ("aligned_alloc|memalign", 1280, true),
        ("valloc", 2000, true),
        ("pvalloc", 100, true),
        ("malloc", u64::MAX / 2, false),
        ("calloc", u64::MAX, false), // n * size overflowed
        ("malloc", 10, true),
    ];
    let expected: Vec<(String, Option<u64>, bool)> =
        expected.into_iter().map(|(event, size, ok)| (event.to_owned(), Some(size), ok)).collect();
    assert_eq!(events, expected);
    let pids: Vec<&Value> =
        lines.iter().filter(|line| line.get("event").is_some()).map(|line| &line["pid"]).collect();
    assert!(pids.windows(2).all(|pair| pair[0] == pair[1]), "one process");
    assert_eq!(lines.last().unwrap()["total_bytes"], 17_264, "the final report follows the events");
}

#[test]
fn trace_shows_what_each_free_releases() {
    let lines = memleak_tests::trace_fixture_output("leaker", "churn", &["-t"]);
    let frees: Vec<&Value> = lines.iter().filter(|line| line["event"] == "free").collect();
    assert_eq!(frees.len(), 10_000);
    // Each free releases the block of the malloc just before it.
    let expected: u64 = (0..10_000u64).map(|i| 16 + i % 512).sum();
    assert_eq!(frees.iter().map(|line| line["size"].as_u64().unwrap()).sum::<u64>(), expected);
    let report = lines.last().unwrap();
    assert_eq!(report["health"]["events_lost"], 0);
}

/// (bytes, regions) of the mmap stacks whose second frame is `mappings()` at
/// the line of `marker`: `map_pages()` is the first.
fn mapped_at(report: &Value, marker: &str) -> (u64, u64) {
    let line = memleak_tests::marker_line("leaker", marker);
    report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| stack["mapping"] == "mmap" && stack["frames"][0]["function"] == "map_pages")
        .filter(|stack| stack["frames"][1]["function"] == "mappings" && stack["frames"][1]["line"] == line)
        .fold((0, 0), |(bytes, count), stack| {
            (bytes + stack["bytes"].as_u64().unwrap(), count + stack["allocations"].as_u64().unwrap())
        })
}

#[test]
fn mmap_munmap_and_mremap_are_followed_exactly() {
    // munmap seen from the kernel as it can (at its system call, or by
    // the mmap_lock tracepoint where it has no ftrace), by the tracepoint,
    // and through its uprobe, as on kernels with neither.
    let ways = [&[][..], &[("MEMLEAK_MAPPING_TRACEPOINT", "1")][..], &[("MEMLEAK_MAPPING_UPROBES", "1")][..]];
    for env in ways {
        let report = memleak_tests::trace_fixture_output_with_env("leaker", "mappings", &[], env)
            .pop()
            .expect("a report");
        assert_eq!(mapped_at(&report, "map-kept"), (3 * 4096, 1), "{env:?}: {report:#}");
        // 8 pages, less the front, the back and a hole of 2: two regions of 2.
        assert_eq!(mapped_at(&report, "map-cut"), (4 * 4096, 2), "{env:?}: {report:#}");
        // 2 pages grown to 5 by mremap, wherever it moved them.
        assert_eq!(mapped_at(&report, "map-grown"), (5 * 4096, 1), "{env:?}: {report:#}");
        // The 4 pages mapped and unmapped leave nothing.
        let mmap_bytes: u64 = report["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["mapping"] == "mmap")
            .map(|s| s["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(mmap_bytes, 12 * 4096, "{env:?}");
    }
}

#[test]
fn mmaps_made_inside_malloc_are_not_counted_twice() {
    let report = trace_command("mappings", &[]);
    assert_eq!(usage_at(&report, "mappings", "big-malloc"), (1 << 20, 1), "{report:#}");
    let hidden = report["hidden_mappings"]["allocator_bytes"].as_u64().unwrap();
    assert!(
        (1 << 20..(1 << 20) + 8192).contains(&hidden),
        "glibc maps the block plus a header page: {hidden}"
    );
    assert!(report["stacks"].as_array().unwrap().iter().all(|s| s["mapping"] != "allocator_mmap"));
    let all = trace_command("mappings", &["--all-mmaps"]);
    let internal: Vec<&Value> =
        all["stacks"].as_array().unwrap().iter().filter(|s| s["mapping"] == "allocator_mmap").collect();
    assert_eq!(internal.len(), 1, "{all:#}");
    assert_eq!(internal[0]["bytes"].as_u64(), Some(hidden));
    assert_eq!(all["hidden_mappings"]["allocator_bytes"], 0);
    // Shown, but not added to the total: the block is counted already. A
    // page of a file mapped read-only is the page cache's; --all-mmaps
    // shows it, and counts it.
    let file_page = 4096;
    assert_eq!(report["hidden_mappings"]["file_bytes"], file_page, "{report:#}");
    assert_eq!(
        all["total_bytes"].as_u64(),
        Some(report["total_bytes"].as_u64().unwrap() + file_page),
        "{all:#}"
    );
    let file: Vec<&Value> =
        all["stacks"].as_array().unwrap().iter().filter(|s| s["mapping"] == "file_mapping").collect();
    assert_eq!(file.len(), 1, "{all:#}");
    assert_eq!(file[0]["frames"][0]["function"], "mappings", "{all:#}");
    // The allocator's mmap was made inside malloc, whose return address
    // its return probe had replaced with the uretprobe trampoline: the
    // walk takes the real one back, and reaches main.
    let functions = memleak_tests::frame_functions(internal[0]);
    assert!(functions.contains(&"mappings") && functions.contains(&"main"), "{functions:?}");
}

#[test]
fn thread_stacks_are_not_reported_as_leaks() {
    let report = trace_command("threads", &[]);
    assert!(report["stacks"].as_array().unwrap().iter().all(|s| s["mapping"].is_null()), "{report:#}");
    let hidden = report["hidden_mappings"]["thread_stack_bytes"].as_u64().unwrap();
    assert!(hidden >= 3 * 65_536 && hidden.is_multiple_of(3), "three equal thread stacks: {hidden}");
    let all = trace_command("threads", &["--all-mmaps"]);
    let stacks: Vec<&Value> =
        all["stacks"].as_array().unwrap().iter().filter(|s| s["mapping"] == "thread_stack").collect();
    assert_eq!(stacks.iter().map(|s| s["allocations"].as_u64().unwrap()).sum::<u64>(), 3, "{all:#}");
    assert_eq!(stacks.iter().map(|s| s["bytes"].as_u64().unwrap()).sum::<u64>(), hidden);
}

#[test]
fn an_address_handed_out_again_counts_as_freed_first() {
    // bcc's --wa-missing-free: memleak always applies it, with or without
    // the flag. The toy allocator frees through a function memleak does not
    // probe, then returns the same block again.
    for extra in [&[][..], &["--wa-missing-free"][..]] {
        let mut args = vec!["--symbols-prefix", "my_"];
        args.extend_from_slice(extra);
        let report = memleak_tests::trace_fixture("slot_alloc", "", &args);
        assert_eq!(
            (report["total_bytes"].as_u64(), report["total_allocations"].as_u64()),
            (Some(200), Some(1)),
            "{report:#}"
        );
        assert!(report["allocator"].as_str().unwrap().ends_with("target/fixtures/slot_alloc"), "{report:#}");
        assert_eq!(report["health"]["allocations"], 2);
    }
}
