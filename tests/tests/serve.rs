//! `memleak serve`: the daemon follows a process and serves its totals
//! over HTTP, as Prometheus and curl read them; SIGTERM and SIGINT
//! detach every probe and end it with 0.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    process::{Command, Stdio},
};

use memleak_tests::{
    http::{self, get, get_until, serve_pid, Response},
    uprobes::{byte_in_file, byte_in_process, multi_links, placed_uprobes},
    Leaker, PATIENCE,
};
use serde_json::Value;

const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

/// `promtool check metrics` on `body`: its complaints, if any.
fn promtool_check(body: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool (Debian's prometheus package; `cargo xtask test` installs it)");
    promtool.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let output = promtool.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "promtool check metrics: {}{}\non:\n{body}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The offsets in libc of the uprobes process `holder` placed, checking
/// that it placed some. Multi-uprobe links list their sites from 6.13 on;
/// before 6.6 (the kernel tests' 6.1 and 5.10) memleak places perf-event
/// uprobes, which list none either. Those are counted then, and the
/// check that no breakpoint is left has no offsets.
fn placed_offsets(holder: u32) -> Vec<u64> {
    let offsets: Vec<u64> = multi_links(holder).iter().flat_map(|link| link.offsets.clone()).collect();
    assert!(
        !offsets.is_empty() || placed_uprobes(holder),
        "memleak placed no uprobe, through multi-uprobe links or perf events"
    );
    offsets
}

/// The probes memleak placed in libc, and the check that each is gone
/// from the traced process once memleak has ended.
fn assert_detached(leaker: &Leaker, offsets: &[u64]) {
    for &offset in offsets {
        assert_eq!(
            byte_in_process(leaker.pid(), LIBC, offset),
            byte_in_file(LIBC, offset),
            "a breakpoint left at {offset:#x}"
        );
    }
}

#[test]
fn metrics_show_the_exact_outstanding_bytes_of_the_followed_process() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let (memleak, port) = serve_pid(leaker.pid());
    let offsets = placed_offsets(memleak.child.id());
    let health = get(port, "/healthz").expect("GET /healthz");
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"), "{health:#?}");

    // A client that never finishes its request holds up nothing.
    let mut stalled = TcpStream::connect(("127.0.0.1", port)).expect("connect a stalled client");
    stalled.write_all(b"GET /metrics HTTP/1.1\r\nHost: memleak\r\n").unwrap();

    leaker.go();
    let pid = leaker.pid();
    let bytes = format!("memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\"}} 17264");
    let metrics = get_until(port, "/metrics", |response| response.body.lines().any(|line| line == bytes));
    assert_eq!(metrics.status, 200);
    assert_eq!(metrics.content_type.as_deref(), Some("text/plain; version=0.0.4; charset=utf-8"));
    let series = |name: &str| format!("{name}{{pid=\"{pid}\",exe=\"leaker\"}} ");
    let value = |name: &str| {
        let prefix = series(name);
        metrics.body.lines().find_map(|line| line.strip_prefix(prefix.as_str())).map(str::to_owned)
    };
    assert_eq!(value("memleak_outstanding_allocations").as_deref(), Some("15"), "{}", metrics.body);
    let allocations: u64 = value("memleak_allocations_total").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(allocations >= 15, "allocations seen: {}", metrics.body);
    assert!(metrics.body.contains("# TYPE memleak_frees_total counter\n"), "{}", metrics.body);
    promtool_check(&metrics.body);

    let targets = get(port, "/api/v1/targets").expect("GET /api/v1/targets");
    assert_eq!(targets.status, 200, "{targets:#?}");
    let list: Value =
        serde_json::from_str(&targets.body).unwrap_or_else(|error| panic!("{error}: {targets:#?}"));
    let listed = &list["targets"][0];
    assert_eq!(list["targets"].as_array().map(Vec::len), Some(1), "{list:#}");
    assert_eq!((listed["pid"].as_u64(), listed["executable"].as_str()), (Some(pid.into()), Some("leaker")));
    assert_eq!(listed["outstanding_bytes"], 17_264, "{list:#}");

    let missing = get(port, "/nowhere").expect("GET /nowhere");
    assert_eq!(missing.status, 404, "{missing:#?}");
    assert_eq!(missing.body.lines().count(), 1, "one line of reason: {missing:#?}");
    // A client that shuts its side down once its request is sent (as
    // `nc -N` does) still gets the answer.
    let mut half_closed = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    half_closed.write_all(b"GET /healthz HTTP/1.1\r\nHost: memleak\r\n\r\n").unwrap();
    half_closed.shutdown(std::net::Shutdown::Write).unwrap();
    half_closed.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut answer = String::new();
    half_closed.read_to_string(&mut answer).expect("the answer, then the end");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n") && answer.ends_with("\r\n\r\nok\n"), "{answer:?}");
    let bad_query = get(port, "/metrics?colour=red").expect("GET /metrics?colour=red");
    assert_eq!(bad_query.status, 400, "{bad_query:#?}");
    let not_followed = get(port, "/metrics?pid=1").expect("GET /metrics?pid=1");
    assert_eq!(
        (not_followed.status, not_followed.body.as_str()),
        (404, "pid 1 is not followed: /api/v1/targets lists those that are\n")
    );

    memleak.signal(libc::SIGTERM);
    let (status, _) = memleak.finish();
    assert!(status.success(), "SIGTERM: {status}");
    assert_detached(&leaker, &offsets);
    drop(stalled);
}

/// The first followed process in a response of `/api/v1/targets`.
fn first_target(targets: &Response) -> Value {
    let list: Value =
        serde_json::from_str(&targets.body).unwrap_or_else(|error| panic!("{error}: {targets:#?}"));
    list["targets"][0].clone()
}

/// Polls `/api/v1/targets` until its first process is as `wanted`.
fn target_until(port: u16, wanted: impl Fn(&Value) -> bool) -> Value {
    first_target(&get_until(port, "/api/v1/targets", |response| wanted(&first_target(response))))
}

#[test]
fn an_exited_process_keeps_its_last_report() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let (memleak, port) = serve_pid(leaker.pid());
    leaker.go();
    target_until(port, |target| target["outstanding_bytes"] == 17_264);
    leaker.exit();
    let exited = target_until(port, |target| target["exited"] == true);
    assert_eq!(exited["outstanding_bytes"], 17_264, "the last report stays: {exited:#}");
    memleak.signal(libc::SIGTERM);
    let (status, _) = memleak.finish();
    assert!(status.success(), "SIGTERM: {status}");
}

#[test]
fn sigint_detaches_every_probe_and_exits_0() {
    let leaker = Leaker::start_waiting(&["all"]);
    let (memleak, port) = serve_pid(leaker.pid());
    let offsets = placed_offsets(memleak.child.id());
    let health = get(port, "/healthz").expect("GET /healthz");
    assert_eq!(health.status, 200);
    memleak.signal(libc::SIGINT);
    let (status, _) = memleak.finish();
    assert!(status.success(), "SIGINT: {status}");
    assert_detached(&leaker, &offsets);
    assert!(get(port, "/healthz").is_err(), "still listening after it exited");
}

/// The daemon takes the trace command's tracing flags: with room for 5
/// allocations, the leaker's first five (malloc x3, calloc x2) fit and
/// the other twelve are counted as not tracked, and /metrics' map fill
/// shows the room.
///
/// The report is one asked for once the leaker is done, taken by the
/// collector between its rounds: its maps are read after every
/// allocation, by construction. A round's list would not do: a round
/// that ticks while the leaker allocates reads the stack totals, then
/// the counters a moment later, and once (in a full suite run, the
/// leaker slowed) it read them after its first three blocks, the counters
/// after all seventeen: (3000, 3) beside the 12 not tracked waited for.
#[test]
fn the_tracing_flags_size_the_daemons_maps() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid();
    let (memleak, port) = http::serve(&["--pid", &pid.to_string(), "--max-allocs", "5"]);
    leaker.go();
    let asked = get(port, &format!("/api/v1/report?pid={pid}&format=json")).expect("GET /api/v1/report");
    assert_eq!(asked.status, 200, "{asked:#?}");
    let report: Value =
        serde_json::from_str(&asked.body).unwrap_or_else(|error| panic!("{error}: {asked:#?}"));
    assert_eq!(
        (
            report["total_bytes"].as_u64(),
            report["total_allocations"].as_u64(),
            report["health"]["allocations_not_tracked"].as_u64()
        ),
        (Some(5000), Some(5), Some(12)),
        "{report:#}"
    );
    let metrics = get(port, "/metrics").expect("GET /metrics");
    assert!(metrics.body.contains("\nmemleak_map_max_entries{map=\"allocations\"} 5\n"), "{}", metrics.body);
    http::stop(memleak);
}

/// `--port 0` lets the kernel choose the port, and the line that says
/// where memleak serves names that port, not 0: a client can be pointed
/// at it.
#[test]
fn port_0_says_the_port_the_kernel_chose() {
    let leaker = Leaker::start_waiting(&["all"]);
    let mut memleak =
        memleak_tests::Memleak::start(&["serve", "--pid", &leaker.pid().to_string(), "--port", "0"]);
    let serving =
        memleak.stderr.wait_for("memleak to serve", |line| line.starts_with("memleak: serving http://"));
    let address = serving
        .strip_prefix("memleak: serving http://")
        .and_then(|rest| rest.split_once("/;"))
        .map_or_else(|| panic!("no address in {serving:?}"), |(address, _)| address);
    let port: u16 = address
        .strip_prefix("127.0.0.1:")
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("not 127.0.0.1:PORT: {serving:?}"));
    assert_ne!(port, 0, "{serving}");
    let health = get(port, "/healthz").expect("GET /healthz on the port said");
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"), "{health:#?}");
    http::stop(memleak);
    drop(leaker);
}
