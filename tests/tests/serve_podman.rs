//! `memleak serve --container` on a real container: podman with runc
//! runs the leaker, and memleak finds the container by the name podman
//! knows it by (through `podman inspect`) or by a prefix of its id
//! (through the cgroup podman made for it). Podman keeps these
//! containers in storage of the test's own, which memleak's `podman
//! inspect` is pointed at through the environment it inherits.

use std::{fs, io::Write as _};

use memleak_tests::{
    http::{get, get_until, serve_with_env, stop, Response},
    leaker_rootfs,
    podman::Podman,
    tempdir::TempDir,
};
use serde_json::Value;

/// The processes `/api/v1/targets` lists.
fn targets(response: &Response) -> Vec<Value> {
    let list: Value =
        serde_json::from_str(&response.body).unwrap_or_else(|error| panic!("{error}: {response:#?}"));
    list["targets"].as_array().cloned().unwrap_or_else(|| panic!("no targets array: {list:#}"))
}

/// The cgroup v2 directory of process `pid`, as a path on the host.
fn cgroup_directory_of(pid: u32) -> String {
    let mounts = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    let root = mounts
        .lines()
        .find_map(|line| {
            let (fields, filesystem) = line.split_once(" - ")?;
            filesystem.starts_with("cgroup2 ").then(|| fields.split_whitespace().nth(4))?
        })
        .expect("a cgroup v2 hierarchy mounted");
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("read the leaker's cgroups");
    let path = cgroups.lines().find_map(|line| line.strip_prefix("0::")).expect("a cgroup v2 path");
    format!("{root}{path}")
}

/// Runs the leaker in a container, serves `--container` with what
/// `reference` makes of the container (its name, say), and checks what
/// memleak says and serves: its leaks, at the leaker's host pid, under
/// the container's name and full id, and the node's name.
fn follows_a_real_container(tag: &str, reference: impl Fn(&str, &str) -> String, named: bool) {
    let rootfs = leaker_rootfs();
    let podman = Podman::with_image(tag, rootfs.path());
    let name = format!("memleak-test-{tag}-{}", std::process::id());
    let mut container = podman.run_leaker(&name, &["all"]);
    let id = container.id();
    assert!(
        id.len() == 64 && id.bytes().all(|byte| byte.is_ascii_hexdigit()),
        "podman's id of {name}: {id:?}"
    );
    let short = &id[..12];
    let pid = container.host_pid();
    assert_ne!(pid, container.leaker().pid(), "the leaker's pid, not the podman client's");
    let cgroup = cgroup_directory_of(pid);
    assert!(cgroup.ends_with(&format!("/libpod-{id}")), "podman's cgroup for {name}: {cgroup}");

    let env = podman.env();
    let mut env: Vec<(&str, &str)> = env.iter().map(|(key, value)| (*key, value.as_str())).collect();
    env.push(("NODE_NAME", "node-a"));
    let reference = reference(&name, &id);
    let (memleak, port) = serve_with_env(&["--container", &reference], &env);
    let container_said = if named { format!("{name} ({short})") } else { short.to_owned() };
    let following = format!("memleak: following container {container_said}: cgroup {cgroup}");
    let tracing = format!("memleak: tracing pid {pid} (leaker) in container {short} through ");
    // Both said before it serves: the leaker was in the container already.
    for said in [&following, &tracing] {
        assert!(
            memleak.stderr.seen.iter().any(|line| line.starts_with(said.as_str())),
            "{said} in {:#?}",
            memleak.stderr.seen
        );
    }

    container.leaker().go();
    let response = get_until(port, "/api/v1/targets", |response| {
        targets(response).iter().any(|target| target["pid"] == pid && target["outstanding_bytes"] == 17_264)
    });
    let list = targets(&response);
    assert_eq!(list.len(), 1, "the container's one process: {list:#?}");
    assert_eq!(list[0]["container"], name.as_str(), "podman's name for it: {list:#?}");
    let container_id = format!("podman://{id}");
    assert_eq!(list[0]["container_id"], container_id.as_str(), "the full id: {list:#?}");
    assert_eq!(list[0]["node"], "node-a", "{list:#?}");
    assert_eq!(list[0]["executable"], "leaker", "{list:#?}");
    assert_eq!(list[0]["program"], "/app/leaker", "as the container sees it: {list:#?}");
    assert_eq!(list[0]["outstanding_allocations"], 15, "{list:#?}");
    let metrics = get(port, "/metrics").expect("GET /metrics");
    let series = format!(
        "memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\",container=\"{name}\",\
         container_id=\"{container_id}\",node=\"node-a\"}} 17264"
    );
    assert!(metrics.body.lines().any(|line| line == series), "{series} in:\n{}", metrics.body);
    stop(memleak);
    container.exit();
}

#[test]
fn container_by_name_follows_a_real_podman_container() {
    follows_a_real_container("name", |name, _| name.to_owned(), true);
}

#[test]
fn container_by_id_prefix_follows_a_real_podman_container() {
    follows_a_real_container("prefix", |_, id| id[..12].to_owned(), false);
}

/// Names may be hex: a container called as another's id starts is the
/// one followed, as podman itself resolves the reference.
#[test]
fn container_by_a_hex_name_follows_that_container_not_an_id_prefix() {
    let rootfs = leaker_rootfs();
    let podman = Podman::with_image("hex", rootfs.path());
    let mut first = podman.run_leaker(&format!("memleak-test-hex-{}", std::process::id()), &["all"]);
    let first_id = first.id();
    let hex_name = first_id[..4].to_owned();
    let mut named = podman.run_leaker(&hex_name, &["all"]);
    let named_id = named.id();
    let pid = named.host_pid();
    let env = podman.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(key, value)| (*key, value.as_str())).collect();
    let (memleak, port) = serve_with_env(&["--container", &hex_name], &env);
    let following = format!("memleak: following container {hex_name} ({}): cgroup ", &named_id[..12]);
    assert!(
        memleak.stderr.seen.iter().any(|line| line.starts_with(&following)),
        "{following} in {:#?}",
        memleak.stderr.seen
    );
    named.leaker().go();
    let response = get_until(port, "/api/v1/targets", |response| {
        targets(response).iter().any(|target| target["pid"] == pid && target["outstanding_bytes"] == 17_264)
    });
    let list = targets(&response);
    assert_eq!(list.len(), 1, "the named container's process alone, not {first_id}'s: {list:#?}");
    assert_eq!(list[0]["container"], hex_name.as_str(), "{list:#?}");
    assert_eq!(list[0]["container_id"], format!("podman://{named_id}").as_str(), "{list:#?}");
    stop(memleak);
    named.exit();
    first.leaker().go();
    first.exit();
}

/// A container restarted (`podman restart`, or stopped and started) runs
/// its new process in a cgroup made again at the same path, with another
/// id: memleak follows the new process, and the BPF filter that keeps the
/// container's tasks follows the new cgroup, so each byte it leaks counts.
#[test]
fn a_restarted_container_is_followed_and_counted() {
    let rootfs = leaker_rootfs();
    let podman = Podman::with_image("restart", rootfs.path());
    let shared = TempDir::new("memleak-podman-shared");
    let fifo = shared.path().join("input");
    let fifo_name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo_name.as_ptr(), 0o600) }, 0, "mkfifo {}", fifo.display());
    // Held open for reading and writing: the leaker's open never waits for
    // a writer, and its reads never meet end of file, across restarts.
    let mut input = fs::OpenOptions::new().read(true).write(true).open(&fifo).expect("open the FIFO");
    let name = format!("memleak-test-restart-{}", std::process::id());
    let container = podman.run_detached(&name, shared.path(), &["all", "--wait", "--input", "/shared/input"]);
    let short = container.id()[..12].to_owned();
    let env = podman.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(key, value)| (*key, value.as_str())).collect();
    let (mut memleak, port) = serve_with_env(&["--container", &name], &env);
    let mut pids = Vec::new();
    for round in ["at the start", "after podman restart", "after podman stop and start"] {
        match round {
            "after podman restart" => podman.run(&["restart", "--time", "0", &name]),
            "after podman stop and start" => {
                podman.run(&["stop", "--time", "0", &name]);
                podman.run(&["start", &name]);
            }
            _ => {}
        }
        let pid = container.host_pid();
        assert!(!pids.contains(&pid), "{round}: a new process, not one of {pids:?}");
        pids.push(pid);
        // Found in the container as the leaker, or before as `runc init`
        // (runc maps libc), which then runs the leaker.
        let tracing = format!("memleak: tracing pid {pid} (leaker) in container {short} through ");
        let now_runs = format!("memleak: pid {pid} now runs /app/leaker: tracing it");
        let traced = |line: &str| line.starts_with(&tracing) || line == now_runs;
        if !memleak.stderr.seen.iter().any(|line| traced(line)) {
            memleak.stderr.wait_for(&format!("memleak to trace the leaker {round}"), traced);
        }
        input.write_all(b"go\n").expect("tell the leaker to allocate");
        let response = get_until(port, "/api/v1/targets", |response| {
            targets(response)
                .iter()
                .any(|target| target["pid"] == pid && target["outstanding_bytes"] == 17_264)
        });
        let list = targets(&response);
        let target = list.iter().find(|target| target["pid"] == pid).unwrap();
        assert_eq!(target["outstanding_allocations"], 15, "{round}: {list:#?}");
    }
    stop(memleak);
    drop(container);
}

/// `--container NAME` names whatever container holds that name, now and
/// later: one not running yet is waited for (said once), and one removed
/// and run again under the same name (a redeploy: another id, another
/// cgroup) is followed again, each byte its new process leaks counted.
#[test]
fn a_container_is_waited_for_and_followed_again_when_redeployed() {
    let rootfs = leaker_rootfs();
    let podman = Podman::with_image("redeploy", rootfs.path());
    let name = format!("memleak-test-redeploy-{}", std::process::id());
    let env = podman.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(key, value)| (*key, value.as_str())).collect();
    let (mut memleak, port) = serve_with_env(&["--container", &name], &env);
    let waiting = format!("memleak: waiting for container {name}: none of that name or id runs yet");
    assert!(memleak.stderr.seen.contains(&waiting), "{waiting} in {:#?}", memleak.stderr.seen);
    let mut ids = Vec::new();
    for deployment in ["the first run", "the run after podman rm --force"] {
        let mut container = podman.run_leaker(&name, &["all"]);
        let id = container.id();
        assert!(!ids.contains(&id), "{deployment}: a new container, not one of {ids:?}");
        let short = id[..12].to_owned();
        let pid = container.host_pid();
        let following = format!("memleak: following container {name} ({short}): cgroup ");
        let line = memleak
            .stderr
            .wait_for(&format!("memleak to follow {deployment}"), |line| line.starts_with(&following));
        assert!(line.ends_with(&format!("/libpod-{id}")), "{deployment}: {line}");
        // Found in the container as the leaker, or before as `runc init`,
        // which then runs the leaker.
        let tracing = format!("memleak: tracing pid {pid} (leaker) in container {short} through ");
        let now_runs = format!("memleak: pid {pid} now runs /app/leaker: tracing it");
        let traced = |line: &str| line.starts_with(&tracing) || line == now_runs;
        if !memleak.stderr.seen.iter().any(|line| traced(line)) {
            memleak.stderr.wait_for(&format!("memleak to trace the leaker of {deployment}"), traced);
        }
        container.leaker().go();
        let response = get_until(port, "/api/v1/targets", |response| {
            targets(response)
                .iter()
                .any(|target| target["pid"] == pid && target["outstanding_bytes"] == 17_264)
        });
        let list = targets(&response);
        let target = list.iter().find(|target| target["pid"] == pid).unwrap();
        assert_eq!(target["outstanding_allocations"], 15, "{deployment}: {list:#?}");
        assert_eq!(target["container"], name.as_str(), "{deployment}: {list:#?}");
        assert_eq!(target["container_id"], format!("podman://{id}"), "{deployment}: {list:#?}");
        // `podman rm --force`: the container, its process and its cgroup go.
        drop(container);
        let gone =
            format!("memleak: container {name} ({short}) is gone: waiting for a container {name} to run");
        memleak.stderr.wait_for(&format!("memleak to see {deployment} gone"), |line| line == gone);
        ids.push(id);
    }
    let said =
        memleak.stderr.seen.iter().filter(|line| line.starts_with("memleak: waiting for container")).count();
    assert_eq!(said, 1, "waiting said once, at the start: {:#?}", memleak.stderr.seen);
    stop(memleak);
}
