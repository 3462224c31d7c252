//! Programs that allocate through jemalloc, tcmalloc or mimalloc (Debian's
//! packages, preloaded): memleak probes the allocator that serves them.

use memleak_tests::{trace_fixture_output_with_env, usage_at, Leaker, Memleak};
use serde_json::Value;

const LIBRARIES: &str = "/usr/lib/x86_64-linux-gnu";

fn library(name: &str) -> String {
    let path = format!("{LIBRARIES}/{name}");
    assert!(std::path::Path::new(&path).exists(), "{path} is missing: .ci/run installs it");
    path
}

fn preloaded(name: &str, kind: &str, memleak_args: &[&str]) -> Value {
    let preload = library(name);
    trace_fixture_output_with_env("leaker", kind, memleak_args, &[("LD_PRELOAD", &preload)])
        .pop()
        .expect("a final report")
}

#[test]
fn preloaded_allocators_are_the_ones_probed() {
    for name in ["libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libmimalloc.so.2"] {
        let report = preloaded(name, "churn", &[]);
        // Named as the process maps it: the file the soname's link leads to
        // (libtcmalloc_minimal.so.4.5.10).
        let mapped = std::fs::canonicalize(library(name)).unwrap();
        assert_eq!(report["allocator"], mapped.to_str().unwrap(), "the report names the allocator traced");
        assert_eq!(usage_at(&report, "churn", "churn-leak"), (77, 1), "{name}: {report:#}");
        assert_eq!(usage_at(&report, "churn", "churn"), (0, 0), "{name}: every churn block freed");
        assert!(report["health"]["frees"].as_u64().unwrap() >= 10_000, "{name}: frees seen");
    }
}

#[test]
fn a_program_on_another_allocator_has_its_own_mmaps_followed() {
    // jemalloc's library does not define mmap: the program's mmaps go to
    // the C library, probed beside it.
    for name in ["libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libmimalloc.so.2"] {
        let report = preloaded(name, "mappings", &[]);
        let mapped: Vec<(u64, u64)> = report["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|stack| stack["mapping"] == "mmap" && stack["frames"][0]["function"] == "map_pages")
            .map(|stack| (stack["bytes"].as_u64().unwrap(), stack["allocations"].as_u64().unwrap()))
            .collect();
        // 3 pages kept, 8 cut to 2 + 2, 2 grown to 5: see leaker.c.
        let total = mapped.iter().fold((0, 0), |(bytes, regions), (b, r)| (bytes + b, regions + r));
        assert_eq!(total, (12 * 4096, 4), "{name}: {report:#}");
        assert_eq!(usage_at(&report, "mappings", "big-malloc"), (1 << 20, 1), "{name}: {report:#}");
    }
}

#[test]
fn jemalloc_api_is_traced() {
    let report = preloaded("libjemalloc.so.2", "jemalloc-api", &[]);
    assert_eq!(usage_at(&report, "jemalloc_api", "mallocx"), (300, 1), "{report:#}");
    assert_eq!(usage_at(&report, "jemalloc_api", "rallocx"), (500, 1), "{report:#}");
    let from_api: u64 = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| stack["frames"][0]["function"] == "jemalloc_api")
        .map(|stack| stack["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(from_api, 800, "sdallocx and dallocx freed the rest: {report:#}");
}

#[test]
fn a_running_process_with_a_preloaded_allocator() {
    let preload = library("libtcmalloc_minimal.so.4");
    let mut leaker = Leaker::start_waiting_with_env(&["seed", "4"], &[("LD_PRELOAD", &preload)]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "-T", "100", "3600"]);
    memleak.wait_attached();
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    let report = reports.last().unwrap();
    // The file mapped is the soname's target, libtcmalloc_minimal.so.4.5.10.
    assert!(report["allocator"].as_str().unwrap().starts_with(&preload), "{}", report["allocator"]);
    assert_eq!(usage_at(report, "fibonacci", "fibonacci"), (9 * 8192, 9), "{report:#}");
    leaker.exit();
}

#[test]
fn redis_server_allocates_through_jemalloc() {
    const KEYS: u64 = 5000;
    let mut redis = memleak_tests::redis::Redis::start();
    let pid = redis.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "-T", "1000", "3600"]);
    memleak.wait_attached();
    redis.set_keys(KEYS);
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    drop(redis);
    assert!(status.success());
    let report = reports.last().unwrap();
    assert!(report["allocator"].as_str().unwrap().ends_with("/libjemalloc.so.2"), "{}", report["allocator"]);
    // Each key holds a few blocks: its name, its value, its dict entry.
    let allocations = report["total_allocations"].as_u64().unwrap();
    assert!((3 * KEYS..=6 * KEYS).contains(&allocations), "{allocations} blocks for {KEYS} keys");
    let bytes = report["total_bytes"].as_u64().unwrap();
    assert!((KEYS * 100..=KEYS * 1000).contains(&bytes), "{bytes} bytes for {KEYS} keys of 100 bytes");
    assert_whole_stacks(report, bytes);
}

/// Debian's redis has no frame pointers: its stacks are walked through
/// its unwind tables, from jemalloc's callers to main (or to a thread's
/// start, for the background threads), for at least 99% of the `bytes`.
fn assert_whole_stacks(report: &Value, bytes: u64) {
    let functions = |stack: &Value| -> Vec<String> {
        let frames = stack["frames"].as_array().unwrap();
        frames.iter().filter_map(|frame| frame["function"].as_str().map(str::to_owned)).collect()
    };
    let rooted: u64 = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| functions(stack).iter().any(|name| name == "main" || name == "start_thread"))
        .map(|stack| stack["bytes"].as_u64().unwrap())
        .sum();
    assert!(rooted * 100 >= bytes * 99, "{rooted} of {bytes} bytes in stacks that reach main: {report:#}");
    let commands = report["stacks"].as_array().unwrap().iter().find(|stack| {
        let names = functions(stack);
        ["setCommand", "call", "processCommand", "main"].iter().all(|name| names.iter().any(|f| f == name))
    });
    assert!(commands.is_some(), "a stack through SET's command processing: {report:#}");
}

/// A stack of the Rust fixture: every function, in order, to the runtime's
/// start.
fn assert_reaches_the_runtime(stack: &Value) {
    let names: Vec<&str> =
        stack["frames"].as_array().unwrap().iter().filter_map(|frame| frame["function"].as_str()).collect();
    let at = |name: &str| names.iter().position(|function| *function == name);
    let order = [
        at("rust_jemalloc::leak_blocks"),
        at("rust_jemalloc::handle_request"),
        at("rust_jemalloc::serve"),
        at("rust_jemalloc::main"),
        at("std::rt::lang_start_internal"),
    ];
    assert!(
        order.iter().all(Option::is_some) && order.is_sorted(),
        "in order, to the runtime's start: {names:?}"
    );
    assert_eq!(stack.get("truncated"), None, "{stack:#}");
}

#[test]
fn a_program_built_against_musl() {
    let leaker = memleak_tests::musl_leaker();
    let report = memleak_tests::trace_program(&leaker, "churn", &[]).pop().unwrap();
    assert!(report["allocator"].as_str().unwrap().contains("musl"), "musl's libc: {}", report["allocator"]);
    assert_eq!(usage_at(&report, "churn", "churn-leak"), (77, 1), "{report:#}");
    assert_eq!(usage_at(&report, "churn", "churn"), (0, 0), "{report:#}");
    assert_eq!(
        (report["health"]["allocations"].as_u64(), report["health"]["frees"].as_u64()),
        (Some(10_001), Some(10_000))
    );
    let report = memleak_tests::trace_program(&leaker, "seed 3", &[]).pop().unwrap();
    assert_eq!(usage_at(&report, "fibonacci", "fibonacci"), (5 * 8192, 5), "{report:#}");
}

#[test]
fn frees_of_blocks_from_before_the_attach_count_with_an_allocator_linked_in() {
    // The program's own jemalloc is the allocator: a free called from the
    // program's code is not the allocator's own, though both are in one
    // object. All 1001 (1000 blocks and their vector) were allocated
    // before memleak attached.
    let program = memleak_tests::rust_jemalloc();
    let mut target = Leaker::start_command({
        let mut command = std::process::Command::new(&program);
        command.arg("free-old");
        command
    });
    let (reports, _) = memleak_tests::trace_running(&mut target, &[]);
    target.exit();
    let health = &reports.last().expect("a final report")["health"];
    assert_eq!(
        (health["frees"].as_u64(), health["unrecorded_frees"].as_u64()),
        (Some(1001), Some(1001)),
        "{health:#}"
    );
}

#[test]
fn a_rust_release_build_with_tikv_jemallocator() {
    // The default release profile: no frame pointers. jemalloc is linked
    // in with the _rjem_ prefix and keeps only what Rust calls (mallocx,
    // sdallocx...).
    let program = memleak_tests::rust_jemalloc();
    let mut target = Leaker::start_command(std::process::Command::new(&program));
    let (reports, _) = memleak_tests::trace_running(&mut target, &[]);
    target.exit();
    let report = reports.last().expect("a final report");
    assert_eq!(report["allocator"], program.to_str().unwrap(), "the binary's own jemalloc is probed");
    let stacks = report["stacks"].as_array().unwrap();
    // The loop is unrolled: each of the three leaks has a call site, and a
    // stack, of its own.
    let leaked: Vec<&Value> = stacks
        .iter()
        .filter(|stack| stack["frames"][0]["function"] == "rust_jemalloc::leak_blocks")
        .collect();
    let total = |field: &str| leaked.iter().map(|stack| stack[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!((total("bytes"), total("allocations")), (3000, 3), "{report:#}");
    for stack in leaked {
        assert_reaches_the_runtime(stack);
    }
    assert!(
        stacks.iter().all(|stack| stack["frames"][0]["function"] != "rust_jemalloc::churn"),
        "churn freed all"
    );
    assert!(report["health"]["frees"].as_u64().unwrap() >= 10_000, "sdallocx frees are seen");
}

#[test]
fn a_rust_build_with_line_tables_is_named_by_its_own_lines() {
    // With line tables, the standard library's frames inlined into the
    // program are named as their source writes them (`alloc`,
    // `from_elem<u8>`): their files say whose they are.
    let program = memleak_tests::rust_jemalloc_with_line_tables();
    let mut target = Leaker::start_command(std::process::Command::new(&program));
    let (reports, _) = memleak_tests::trace_running(&mut target, &[]);
    target.exit();
    let report = reports.last().expect("a final report");
    // DWARF names functions without their module: `leak_blocks`.
    let leaked = memleak_tests::stacks_through(report, "leak_blocks");
    assert_eq!(leaked.iter().map(|stack| stack["bytes"].as_u64().unwrap()).sum::<u64>(), 3000, "{report:#}");
    for stack in leaked {
        let culprit = &stack["culprit"];
        assert_eq!(culprit["function"], "leak_blocks", "{stack:#}");
        assert!(culprit["file"].as_str().unwrap().ends_with("rust-jemalloc/src/main.rs"), "{culprit:#}");
        assert!(culprit["line"].as_u64().is_some(), "{culprit:#}");
    }
    let missing = report["missing_symbols"].as_array().map(Vec::as_slice).unwrap_or_default();
    assert!(
        missing.iter().all(|entry| entry["module"] != program.to_str().unwrap()),
        "no advice for a program whose culprits have lines: {missing:#?}"
    );
}
