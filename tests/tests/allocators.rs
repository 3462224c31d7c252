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
        assert_eq!(report["allocator"], library(name), "the report names the allocator traced");
        assert_eq!(usage_at(&report, "churn", "churn-leak"), (77, 1), "{name}: {report:#}");
        assert_eq!(usage_at(&report, "churn", "churn"), (0, 0), "{name}: every churn block freed");
        assert!(report["health"]["frees"].as_u64().unwrap() >= 10_000, "{name}: frees seen");
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
