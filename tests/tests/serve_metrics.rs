//! What `memleak serve`'s /metrics says beyond totals: the largest stacks
//! under ids that do not change for the same stack of the same binary,
//! and how full the BPF maps are, checked against bpftool's count.

use std::{collections::BTreeMap, time::Instant};

use memleak_tests::{
    bpf_maps::map_entries,
    http::{get, serve_pid},
    Leaker, PATIENCE,
};

/// `/metrics` once it shows the leaker's 17264 bytes outstanding.
fn metrics_once_leaked(port: u16, pid: u32) -> String {
    let leaked = format!("memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\"}} 17264");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let response = get(port, "/metrics").expect("GET /metrics");
        if response.body.lines().any(|line| line == leaked) {
            return response.body;
        }
        assert!(Instant::now() < deadline, "no {leaked} after {PATIENCE:?}:\n{}", response.body);
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The stack series of process `pid`: (first named frame, bytes) by
/// stack id.
fn stacks_of(body: &str, pid: u32) -> BTreeMap<String, (String, u64)> {
    let prefix = format!("memleak_stack_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\",stack=\"");
    body.lines()
        .filter_map(|line| line.strip_prefix(prefix.as_str()))
        .map(|rest| {
            let (id, rest) = rest.split_once("\",frame=\"").unwrap_or_else(|| panic!("no frame: {rest}"));
            let (frame, bytes) = rest.split_once("\"} ").unwrap_or_else(|| panic!("no value: {rest}"));
            (id.to_owned(), (frame.to_owned(), bytes.parse().unwrap_or_else(|_| panic!("{bytes}"))))
        })
        .collect()
}

/// The value of an unlabelled-but-for-`map` series.
fn map_series(body: &str, name: &str, map: &str) -> usize {
    let prefix = format!("{name}{{map=\"{map}\"}} ");
    let value = body.lines().find_map(|line| line.strip_prefix(prefix.as_str()));
    value.and_then(|value| value.parse().ok()).unwrap_or_else(|| panic!("no {prefix} in:\n{body}"))
}

#[test]
fn stack_ids_stay_the_same_for_another_process_of_the_binary_under_a_restarted_daemon() {
    let mut first = Leaker::start_waiting(&["all"]);
    let (memleak, port) = serve_pid(first.pid());
    first.go();
    let body = metrics_once_leaked(port, first.pid());
    let first_stacks = stacks_of(&body, first.pid());

    // The map fill, against what bpftool counts in memleak's maps. The
    // leaker is idle: nothing changes between the scrape and the count.
    let counted = map_entries(memleak.child.id());
    assert_eq!(map_series(&body, "memleak_map_entries", "allocations"), 15, "{body}");
    assert_eq!(Some(&15), counted.get("ALLOCATIONS"), "bpftool: {counted:?}");
    let stacks = map_series(&body, "memleak_map_entries", "stacks");
    assert_eq!(Some(&stacks), counted.get("STACKS"), "memleak says {stacks}; bpftool: {counted:?}");
    assert_eq!(map_series(&body, "memleak_map_max_entries", "stacks"), 65_536, "{body}");
    memleak.signal(libc::SIGTERM);
    assert!(memleak.finish().0.success());

    // Another process of the same binary, at other addresses, under a
    // daemon started afresh.
    let mut second = Leaker::start_waiting(&["all"]);
    let (memleak, port) = serve_pid(second.pid());
    second.go();
    let second_stacks = stacks_of(&metrics_once_leaked(port, second.pid()), second.pid());
    memleak.signal(libc::SIGTERM);
    assert!(memleak.finish().0.success());

    let mut shown: Vec<(String, u64)> = first_stacks.values().cloned().collect();
    shown.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let expected = [
        ("leak_realloc", 5000),
        ("leak_calloc", 3000),
        ("leak_malloc", 3000),
        ("leak_valloc", 2000),
        ("leak_memalign", 1280),
    ];
    let expected: Vec<(String, u64)> =
        expected.iter().map(|(frame, bytes)| ((*frame).to_owned(), *bytes)).collect();
    assert_eq!(shown, expected, "the 5 largest stacks by default:\n{body}");
    assert_eq!(first_stacks, second_stacks, "the same ids for the same stacks");
}
