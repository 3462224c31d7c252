//! `memleak serve` scraped by Debian's real Prometheus server: the test
//! asks Prometheus' own query API, as a dashboard or an alert would, for
//! the leaker's outstanding bytes, and sees them grow from nothing to the
//! exact 17,264 bytes it leaks.

use memleak_tests::{http::serve_pid, prometheus::Prometheus, Leaker};

/// The value of a query that must give exactly one series.
fn one_value<'a>(query: &str, series: &'a [(serde_json::Value, String)]) -> &'a str {
    assert_eq!(series.len(), 1, "{query}: one series wanted: {series:?}");
    &series[0].1
}

/// Whether a query gave one series, of `value`.
fn is_one(series: &[(serde_json::Value, String)], value: &str) -> bool {
    series.len() == 1 && series[0].1 == value
}

#[test]
fn prometheus_stores_the_exact_outstanding_bytes_and_sees_them_grow() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid();
    let (memleak, port) = serve_pid(pid);
    let prometheus = Prometheus::scraping(port);
    let process = format!("pid=\"{pid}\",exe=\"leaker\"");

    // Before the leaker allocates: a sample of nothing outstanding.
    let outstanding = format!("memleak_outstanding_bytes{{{process}}}");
    let before = prometheus.query_until(&outstanding, |series| !series.is_empty());
    assert_eq!(one_value(&outstanding, &before), "0", "nothing allocated yet");

    leaker.go();
    prometheus.query_until(&outstanding, |series| is_one(series, "17264"));
    // Both samples are in Prometheus' storage: it saw the growth itself.
    let seen_growth = format!("max_over_time({outstanding}[10m]) - min_over_time({outstanding}[10m])");
    let growth = prometheus.query(&seen_growth);
    assert_eq!(one_value(&seen_growth, &growth), "17264", "Prometheus stored 0, then 17264");
    let growth_series = format!("memleak_outstanding_growth_bytes{{{process}}}");
    prometheus.query_until(&growth_series, |series| is_one(series, "17264"));

    // The largest stack, by its first named frame, and the map fill.
    let realloc = format!("memleak_stack_outstanding_bytes{{{process},frame=\"leak_realloc\"}}");
    let stacks = prometheus.query_until(&realloc, |series| !series.is_empty());
    assert_eq!(one_value(&realloc, &stacks), "5000", "leak_realloc's realloc(block, 5000)");
    let allocation_entries = "memleak_map_entries{map=\"allocations\"}";
    let entries = prometheus.query(allocation_entries);
    assert_eq!(one_value(allocation_entries, &entries), "15", "the leaker's 15 blocks, each one entry");

    drop(prometheus);
    memleak.signal(libc::SIGTERM);
    let (status, _) = memleak.finish();
    assert!(status.success(), "SIGTERM: {status}");
}
