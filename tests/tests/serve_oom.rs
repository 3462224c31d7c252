//! The evidence of an OOM kill: a process memleak traced or watched,
//! killed by the OOM killer of its memory cgroup (seen at the kernel's
//! `mark_victim` tracepoint), leaves its last report or its memory's
//! history in the state directory, served at /api/v1/oom after it is
//! gone and after memleak restarts.

use std::process::{Child, Command, Stdio};

use memleak_tests::{
    cgroups::MemoryLimit,
    fixture,
    fixtures::marker_line,
    http::{get, get_until, serve, stop},
    memleak::stacks_at,
    tempdir::TempDir,
};
use serde_json::Value;

/// The growth fixture leaking 4 MiB a second in a memory cgroup of 48 MiB:
/// killed a dozen seconds after it starts.
struct Victim {
    child: Child,
    _limit: MemoryLimit,
}

impl Victim {
    fn start(tag: &str) -> Self {
        let limit = MemoryLimit::new(&format!("memleak-oom-{tag}-{}", std::process::id()), 48 << 20);
        let child = Command::new(fixture("growth"))
            .args(["leak", "4096"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start the growth fixture");
        limit.join(child.id());
        Self { child, _limit: limit }
    }

    fn pid(&self) -> u64 {
        u64::from(self.child.id())
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The kills /api/v1/oom lists, once it lists one of `pid`.
fn kills_once_killed(port: u16, pid: u64) -> Vec<Value> {
    let response = get_until(port, "/api/v1/oom", |response| {
        serde_json::from_str::<Value>(&response.body).is_ok_and(|list| {
            list["kills"].as_array().is_some_and(|kills| kills.iter().any(|kill| kill["pid"] == pid))
        })
    });
    let list: Value = serde_json::from_str(&response.body).unwrap();
    list["kills"].as_array().unwrap().clone()
}

#[test]
fn a_traced_leaker_killed_by_the_oom_killer_leaves_its_last_report_after_memleak_restarts() {
    let state = TempDir::new("memleak-oom-state");
    let state_dir = state.path().to_str().unwrap();
    let mut victim = Victim::start("traced");
    let pid = victim.pid();
    let (mut memleak, port) = serve(&["--pid", &pid.to_string(), "--state-dir", state_dir]);
    let kills = kills_once_killed(port, pid);
    let status = victim.child.wait().expect("wait for the victim");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL), "{status}");
    let [kill] = kills.as_slice() else { panic!("not one kill: {kills:#?}") };
    assert_eq!(kill["traced"], true, "{kill:#}");
    let line = marker_line("growth", "slow-leak");
    let culprit = format!("leak_slowly (growth.c:{line})");
    assert_eq!(kill["culprit"], culprit.as_str(), "{kill:#}");
    let leaks = stacks_at(&kill["report"], "leak_slowly", line);
    let [leak] = leaks.as_slice() else { panic!("not one stack at {culprit} in the report: {kill:#}") };
    let (bytes, allocations) = (leak["bytes"].as_u64().unwrap(), leak["allocations"].as_u64().unwrap());
    assert!(
        allocations > 0 && bytes == allocations * 4096,
        "{allocations} allocations of 4 KiB, {bytes} bytes"
    );
    assert_eq!(
        (kill["culprit_bytes"].as_u64(), kill["culprit_allocations"].as_u64()),
        (Some(bytes), Some(allocations))
    );
    let said = memleak.stderr.wait_for("the kill said", |line| line.contains("was killed by the OOM killer"));
    assert!(said.contains(&format!("pid {pid} (growth)")) && said.contains(&culprit), "{said}");
    let metrics = get(port, "/metrics").unwrap().body;
    let counted =
        format!("memleak_oom_kills_total{{exe=\"growth\",traced=\"true\",culprit=\"{culprit}\"}} 1");
    assert!(metrics.lines().any(|line| line == counted), "no `{counted}` in:\n{metrics}");
    stop(memleak);

    let files: Vec<_> = std::fs::read_dir(state.path().join("oom")).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one file per kill in {state_dir}/oom");
    // A new daemon, following something else, serves it still.
    let (memleak, port) = serve(&["--exe", "memleak-follows-nothing", "--state-dir", state_dir]);
    let again = kills_once_killed(port, pid);
    assert_eq!(again, kills, "the kill as served after the restart");
    stop(memleak);
}

#[test]
fn a_process_only_watched_when_killed_leaves_its_memory_history() {
    let state = TempDir::new("memleak-oom-watched");
    let victim = Victim::start("watched");
    let pid = victim.pid();
    // A window longer than the victim lives: it is never traced.
    let (mut memleak, port) = serve(&[
        "--watch",
        "--pid",
        &pid.to_string(),
        "--watch-every",
        "1s",
        "--growth-window",
        "10m",
        "--state-dir",
        state.path().to_str().unwrap(),
    ]);
    let kills = kills_once_killed(port, pid);
    let [kill] = kills.as_slice() else { panic!("not one kill: {kills:#?}") };
    assert_eq!(
        (kill["traced"].as_bool(), &kill["report"], &kill["culprit"]),
        (Some(false), &Value::Null, &Value::Null)
    );
    let history: Vec<u64> = kill["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|point| point["anon_bytes"].as_u64().unwrap())
        .collect();
    assert!(history.len() >= 2 && history.last() > history.first(), "a growing history: {history:?}");
    assert_eq!(kill["anon_bytes_last_seen"].as_u64(), history.last().copied(), "{kill:#}");
    let said = memleak.stderr.wait_for("the kill said", |line| line.contains("was killed by the OOM killer"));
    assert!(said.contains("it was watched, not traced: no stack is known"), "{said}");
    stop(memleak);
}
