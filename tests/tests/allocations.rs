//! Every allocation function of glibc, traced for real with exact numbers.

use memleak_tests::{marker_line, stacks_at, trace_command, usage_at};
use serde_json::Value;

/// What `leaker all` leaves outstanding, per allocating line: function,
/// marker, bytes, allocations.
fn all_leaks() -> Vec<(&'static str, &'static str, u64, u64)> {
    let mut leaks = memleak_tests::ALLOCATION_FUNCTION_LEAKS.to_vec();
    leaks.push(("fail_allocations", "after-failures", 10, 1));
    leaks
}

fn total(report: &Value) -> (u64, u64) {
    (report["total_bytes"].as_u64().unwrap(), report["total_allocations"].as_u64().unwrap())
}

#[test]
fn every_allocation_function_is_recorded_exactly() {
    let report = trace_command("all", &[]);
    for (function, marker, bytes, count) in all_leaks() {
        assert_eq!(
            usage_at(&report, function, marker),
            (bytes, count),
            "{function} at ALLOC({marker}) in {report:#}"
        );
    }
    // Nothing else: realloc's old blocks, realloc(p, 0) and the failed
    // calls leave no bytes behind.
    assert_eq!(total(&report), (17_264, 15), "{report:#}");
    assert_eq!(report["total_stacks"], all_leaks().len());
    let health = &report["health"];
    assert_eq!(health["allocations"], 17, "{health}");
    assert_eq!(
        health["failed_allocations"], 3,
        "malloc(huge), overflowing calloc, bad posix_memalign: {health}"
    );
    assert_eq!(
        (health["allocations_not_tracked"].as_u64(), health["stacks_lost"].as_u64()),
        (Some(0), Some(0))
    );
}

#[test]
fn frames_name_function_file_line_and_module() {
    let report = trace_command("all", &[]);
    let line = marker_line("leaker", "malloc");
    let stack = stacks_at(&report, "leak_malloc", line)[0];
    let frames = stack["frames"].as_array().unwrap();
    let first = &frames[0];
    assert!(first["file"].as_str().unwrap().ends_with("tests/fixtures/leaker.c"), "{first}");
    assert!(first["module"].as_str().unwrap().ends_with("target/fixtures/leaker"), "{first}");
    assert_eq!(first["inlined"], false);
    assert!(first["offset"].as_u64().unwrap() > 0, "{first}");
    assert!(first["address"].as_str().unwrap().starts_with("0x"), "{first}");
    let names: Vec<&str> = frames.iter().map(|frame| frame["function"].as_str().unwrap_or("?")).collect();
    assert_eq!(&names[..3], ["leak_malloc", "all", "main"], "{names:?}");
}

#[test]
fn churn_that_frees_everything_reports_nothing() {
    let report = trace_command("churn", &[]);
    assert_eq!(usage_at(&report, "churn", "churn"), (0, 0), "{report:#}");
    assert_eq!(usage_at(&report, "churn", "churn-leak"), (77, 1), "{report:#}");
    assert_eq!(total(&report), (77, 1));
    assert_eq!(report["health"]["allocations"], 10_001);
    assert_eq!(report["health"]["frees"], 10_000);
}

/// fibonacci(n) runs 1 + calls(n-1) + calls(n-2) times.
fn calls(n: u64) -> u64 {
    if n < 2 {
        1
    } else {
        1 + calls(n - 1) + calls(n - 2)
    }
}

#[test]
fn seed_case_fibonacci_in_a_thread() {
    let report = trace_command("seed 10", &[]);
    let (bytes, count) = usage_at(&report, "fibonacci", "fibonacci");
    assert_eq!((bytes, count), (calls(10) * 8192, calls(10)), "{report:#}");
    // The shallowest call's stack: fibonacci <- child <- start_thread.
    let stacks = stacks_at(&report, "fibonacci", marker_line("leaker", "fibonacci"));
    let shallowest = stacks.iter().min_by_key(|stack| stack["frames"].as_array().unwrap().len()).unwrap();
    let names: Vec<&str> = shallowest["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["function"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(&names[..3], ["fibonacci", "child", "start_thread"], "{names:?}");
}

#[test]
fn command_arguments_reach_the_command() {
    let report = trace_command("seed 4", &[]);
    assert_eq!(usage_at(&report, "fibonacci", "fibonacci"), (calls(4) * 8192, calls(4)));
}

#[test]
fn allocations_before_main_are_seen_with_c() {
    let report = trace_command("early", &[]);
    assert_eq!(usage_at(&report, "early", "early"), (4242, 1), "{report:#}");
}

#[test]
fn size_filters_keep_only_the_range() {
    let report = trace_command("all", &["-z", "1000", "-Z", "2000"]);
    // malloc and calloc 3 x 1000, posix_memalign 1234, memalign 1280, valloc 2000.
    assert_eq!(total(&report), (10_514, 9), "{report:#}");
}

#[test]
fn show_allocs_lists_each_allocation() {
    let report = trace_command("all", &["-a"]);
    let stack = stacks_at(&report, "leak_malloc", marker_line("leaker", "malloc"))[0];
    let outstanding = stack["outstanding"].as_array().expect("-a lists allocations");
    assert_eq!(outstanding.len(), 3);
    let mut addresses: Vec<u64> = outstanding.iter().map(|a| a["address"].as_u64().unwrap()).collect();
    addresses.dedup();
    assert_eq!(addresses.len(), 3, "distinct addresses: {outstanding:?}");
    assert!(outstanding.iter().all(|a| a["size"] == 1000 && a["age_ms"].is_u64()), "{outstanding:?}");
}

#[test]
fn older_than_hides_young_allocations() {
    let report = trace_command("all", &["-o", "3600000"]);
    assert_eq!(total(&report), (0, 0), "{report:#}");
    assert_eq!(report["stacks"].as_array().unwrap().len(), 0);
    // The counters still saw them.
    assert_eq!(report["health"]["allocations"], 17);
}

#[test]
fn a_full_allocation_map_is_counted() {
    let report = trace_command("all", &["--max-allocs", "5"]);
    // The first five (malloc x3, calloc x2) fit and are never freed; the
    // other twelve recorded allocations find the map full.
    assert_eq!(total(&report), (5000, 5), "{report:#}");
    assert_eq!(report["health"]["allocations_not_tracked"], 12);
}

#[test]
fn a_full_stack_map_is_counted_and_keeps_the_bytes() {
    let report = trace_command("all", &["--max-stacks", "2"]);
    assert_eq!(total(&report), (17_264, 15), "bytes are never lost with their stack: {report:#}");
    let lost: Vec<&Value> =
        report["stacks"].as_array().unwrap().iter().filter(|s| s["stack_lost"] == true).collect();
    assert_eq!(lost.len(), 1, "{report:#}");
    assert!(report["health"]["stacks_lost"].as_u64().unwrap() > 0);
}

#[test]
fn stack_depth_is_limited() {
    let report = trace_command("seed 6", &["--max-stack-depth", "2"]);
    for stack in report["stacks"].as_array().unwrap() {
        // Inlined functions share their caller's return address.
        let mut addresses: Vec<&str> = stack["frames"]
            .as_array()
            .unwrap()
            .iter()
            .map(|frame| frame["address"].as_str().unwrap())
            .collect();
        addresses.dedup();
        assert!(addresses.len() <= 2, "{stack}");
        assert!(addresses.len() < 2 || stack["truncated"] == "depth_limit", "said where it was cut: {stack}");
    }
    assert_eq!(usage_at(&report, "fibonacci", "fibonacci"), (calls(6) * 8192, calls(6)));
}

#[test]
fn a_realloc_chain_leaves_only_its_last_size() {
    let report = trace_command("realloc-chain", &[]);
    assert_eq!(usage_at(&report, "realloc_chain", "realloc-chain"), (1000, 1), "{report:#}");
    assert_eq!(total(&report), (1000, 1));
    // malloc(10) and 99 reallocs, each releasing the block before it.
    assert_eq!(report["health"]["allocations"], 100);
}

#[test]
fn inlined_functions_get_frames_of_their_own() {
    let report = trace_command("inlined", &[]);
    let stack = &stacks_at(&report, "leak_inlined", marker_line("leaker", "inlined"))[0];
    let frames = stack["frames"].as_array().unwrap();
    assert_eq!(frames[0]["inlined"], true, "{stack}");
    assert_eq!(frames[0]["offset"], Value::Null, "an inlined frame has no offset of its own");
    assert_eq!(frames[1]["function"], "calls_inlined", "{stack}");
    assert_eq!(frames[1]["inlined"], false);
    assert_eq!(frames[1]["line"], marker_line("leaker", "inlined-call"), "{stack}");
    assert_eq!(stack["bytes"], 512);
}

#[test]
fn cxx_names_are_demangled() {
    let report = memleak_tests::trace_fixture("cxx_leaker", "", &[]);
    let stacks = report["stacks"].as_array().unwrap();
    let names_of = |stack: &Value| -> Vec<String> {
        stack["frames"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["function"].as_str().unwrap_or("?").to_owned())
            .collect()
    };
    let all_names: Vec<String> = stacks.iter().flat_map(names_of).collect();
    assert!(!all_names.iter().any(|name| name.starts_with("_Z")), "mangled names left: {all_names:?}");
    // The five `new char[100]`: operator new[] tail-calls operator new.
    let news: Vec<&Value> = stacks.iter().filter(|s| s["bytes"] == 500).collect();
    assert_eq!(news.len(), 1, "{report:#}");
    assert_eq!(news[0]["allocations"], 5);
    assert_eq!(names_of(news[0])[0], "operator new(unsigned long)");
    // The vector's storage, allocated deep inside inlined-at-O0 templates.
    let vector = stacks.iter().find(|s| s["bytes"] == 64).expect("the vector's final storage");
    let names = names_of(vector);
    assert!(names.contains(&"app::Cache::grow(int)".to_owned()), "{names:?}");
    assert!(
        names.contains(&"std::vector<char*, std::allocator<char*> >::push_back(char*&&)".to_owned()),
        "{names:?}"
    );
}

/// memleak's stdout for `leaker KIND` run with -c, as text lines.
fn raw_output(kind: &str, memleak_args: &[&str]) -> String {
    let leaker = memleak_tests::fixture("leaker");
    let command = format!("{} {kind}", leaker.display());
    let mut args = vec!["-c", &command, "-o", "0", "3600"];
    args.extend_from_slice(memleak_args);
    let mut memleak = memleak_tests::Memleak::start(&args);
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    memleak.close_stdin();
    let lines = memleak.stdout.rest();
    assert!(memleak.child.wait().unwrap().success());
    lines.join("\n")
}

#[test]
fn folded_stacks_are_root_first_and_weighted() {
    let folded = raw_output("all", &["--format", "folded"]);
    let weight_of = |leaf: &str| -> Vec<u64> {
        folded
            .lines()
            .filter(|line| line.rsplit_once(' ').unwrap().0.ends_with(&format!(";{leaf}")))
            .map(|line| line.rsplit_once(' ').unwrap().1.parse().unwrap())
            .collect()
    };
    assert_eq!(weight_of("leak_malloc"), [3000], "{folded}");
    assert_eq!(weight_of("leak_realloc"), [5300], "two stacks of leak_realloc fold into one line: {folded}");
    assert!(
        folded
            .lines()
            .all(|line| line.starts_with("_start;__libc_start_main_impl;__libc_start_call_main;main;")),
        "root first, the root being the process's: {folded}"
    );
    let counts = raw_output("all", &["--format", "folded", "--weight", "count"]);
    assert!(counts.lines().any(|line| line.ends_with(";leak_calloc 3")), "{counts}");
    // Every stack, not only the top 10 (there are 11).
    assert_eq!(folded.lines().count(), 10, "leak_realloc's two stacks fold together: {folded}");
}

#[test]
fn an_svg_flame_graph_of_the_final_report() {
    let svg = raw_output("seed 5", &["--format", "svg", "1"]);
    assert_eq!(svg.matches("<?xml").count(), 1, "only the final report is drawn");
    let titles = memleak_tests::svg_titles(&svg);
    // seed 5: fibonacci(5) leaks 8 KiB 15 times, in its thread `child`;
    // the thread's dtv is the rest.
    assert!(titles.contains(&"child (122,880 bytes, 99.78%)".to_owned()), "{titles:#?}");
    assert!(titles.iter().any(|title| title.starts_with("fibonacci (")), "{titles:#?}");
}

#[test]
fn output_goes_to_a_file_named_by_its_format() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-output-file");
    // Without a COUNT there may be several reports: an SVG per report,
    // numbered. The first is there from an earlier run: --force replaces it.
    let svg = dir.path().join("leaks.svg");
    let first = dir.path().join("leaks.1.svg");
    std::fs::write(&first, "old").unwrap();
    let stdout = raw_output("seed 4", &["--output", svg.to_str().unwrap(), "--force"]);
    assert!(stdout.is_empty(), "reports go to the file, not stdout: {stdout}");
    let drawn = std::fs::read_to_string(&first).unwrap();
    assert!(drawn.starts_with("<?xml") && drawn.contains("fibonacci"), "the extension chose SVG");
    let mut left: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, ["leaks.1.svg"], "one report, and no temporary file left behind");
    let json = dir.path().join("leaks.json");
    raw_output("all", &["--output", json.to_str().unwrap()]);
    let report: Value =
        serde_json::from_str(std::fs::read_to_string(&json).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(report["total_bytes"], 17_264);
}

#[test]
fn go_tool_pprof_reads_the_profile() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-pprof");
    raw_output("all", &["--output", dir.path().join("leaks.pb.gz").to_str().unwrap()]);
    let profile = dir.path().join("leaks.1.pb.gz");
    let pprof = |args: &[&str]| memleak_tests::go_pprof(&profile, args);
    let top = pprof(&["-top", "-unit=byte"]);
    assert!(top.contains("of 17264B total"), "{top}");
    let row = |function: &str| {
        top.lines().find(|line| line.trim_end().ends_with(function)).unwrap_or("").to_owned()
    };
    assert!(row("leak_malloc").trim_start().starts_with("3000B"), "{top}");
    assert!(row("leak_realloc").trim_start().starts_with("5300B"), "{top}");
    let objects = pprof(&["-top", "-sample_index=inuse_objects"]);
    assert!(
        objects.lines().any(|line| line.trim_start().starts_with("3 ") && line.ends_with("leak_calloc")),
        "{objects}"
    );
    let svg = pprof(&["-svg"]);
    assert!(svg.contains("<svg") && svg.contains("leak_malloc"), "a call graph drawn by graphviz: {svg}");
    let traces = pprof(&["-traces"]);
    assert!(traces.contains("leak_malloc") && traces.contains("main"), "whole stacks: {traces}");
    // Mappings name the binaries, the program's first, with build ids.
    assert!(top.starts_with("File: leaker\n"), "{top}");
    let build_id = memleak_tests::build_id(&memleak_tests::fixture("leaker"));
    assert!(top.contains(&format!("\nBuild ID: {build_id}\n")), "{top}");
    let raw = pprof(&["-raw"]);
    let mappings = raw.split("Mappings\n").nth(1).unwrap_or("");
    assert!(mappings.lines().any(|line| line.contains("/libc.so.6 ")), "{mappings}");
}

/// `alloc_space` and `alloc_objects` count what was allocated since attach,
/// freed or not: churn's 10000 blocks, all freed, and its one leak.
#[test]
fn pprof_profiles_count_what_was_allocated_too() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-pprof-alloc");
    raw_output("churn", &["--output", dir.path().join("churn.pb.gz").to_str().unwrap()]);
    let profile = dir.path().join("churn.1.pb.gz");
    let line = memleak_tests::marker_line("leaker", "churn");
    // 16 + i % 512 bytes for i in 0..10000.
    let churned: u64 = (0..10_000).map(|i| 16 + i % 512).sum();
    let allocated =
        memleak_tests::go_pprof(&profile, &["-top", "-lines", "-unit=byte", "-sample_index=alloc_space"]);
    let row =
        format!("churn {}:{line}", memleak_tests::workspace_root().join("tests/fixtures/leaker.c").display());
    assert!(
        allocated
            .lines()
            .any(|text| text.trim_start().starts_with(&format!("{churned}B ")) && text.ends_with(&row)),
        "{row} allocated {churned} bytes: {allocated}"
    );
    let objects = memleak_tests::go_pprof(&profile, &["-top", "-sample_index=alloc_objects"]);
    assert!(objects.contains("\n     10001   100%   100%      10001   100%  churn\n"), "{objects}");
    let in_use = memleak_tests::go_pprof(&profile, &["-top", "-unit=byte"]);
    assert!(in_use.contains("Type: inuse_space") && in_use.contains("of 77B total"), "{in_use}");
}
