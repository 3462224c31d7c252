//! What `memleak serve` follows: processes named by executable, cgroup or
//! container, found as they start or join; an exited process's report
//! kept for --retain, then forgotten; what --max-processes leaves out,
//! said; and bad selectors refused in one line.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use memleak_tests::{
    assert_refused_in_one_line,
    cgroups::TestCgroup,
    fixture,
    http::{free_port, get, get_until, serve, serve_with_env, stop, Response},
    leaker_rootfs,
    tempdir::TempDir,
    workspace_root, Leaker, Memleak, PATIENCE,
};
use serde_json::Value;

/// A copy of the leaker under a name of its own, so that `--exe` follows
/// this test's processes only, never those of tests running beside it.
fn named_leaker(tag: &str) -> (TempDir, PathBuf, String) {
    let dir = TempDir::new(&format!("memleak-exe-{tag}"));
    let name = format!("leaker-{tag}-{}", std::process::id());
    let binary = dir.path().join(&name);
    memleak_tests::fixtures::copy_executable(&fixture("leaker"), &binary);
    (dir, binary, name)
}

/// Starts `binary all --wait`.
fn start_waiting(binary: &Path) -> Leaker {
    let mut command = Command::new(binary);
    command.args(["all", "--wait"]);
    Leaker::start_command(command)
}

/// The processes `/api/v1/targets` lists.
fn targets(response: &Response) -> Vec<Value> {
    let list: Value =
        serde_json::from_str(&response.body).unwrap_or_else(|error| panic!("{error}: {response:#?}"));
    list["targets"].as_array().cloned().unwrap_or_else(|| panic!("no targets array: {list:#}"))
}

/// Polls `/api/v1/targets` until the process `pid` is as `wanted`
/// (`None`: absent), and returns the whole list.
fn targets_until(port: u16, pid: u32, wanted: impl Fn(Option<&Value>) -> bool) -> Vec<Value> {
    let of_pid = |list: &[Value]| list.iter().find(|target| target["pid"] == pid).cloned();
    let response = get_until(port, "/api/v1/targets", |response| wanted(of_pid(&targets(response)).as_ref()));
    targets(&response)
}

#[test]
fn exe_follows_a_leaker_started_after_the_daemon() {
    let (_dir, binary, name) = named_leaker("exe");
    let (mut memleak, port) = serve(&["--exe", &name]);
    let mut leaker = start_waiting(&binary);
    let pid = leaker.pid();
    let tracing = format!("memleak: tracing pid {pid} ({name}) through ");
    memleak.stderr.wait_for("memleak to follow the new process", |line| line.starts_with(&tracing));
    leaker.go();
    let list =
        targets_until(port, pid, |target| target.is_some_and(|target| target["outstanding_bytes"] == 17_264));
    assert_eq!(list.len(), 1, "this test's process alone: {list:#?}");
    assert_eq!(list[0]["executable"], name.as_str());
    assert_eq!(list[0]["outstanding_allocations"], 15, "{list:#?}");
    assert_eq!(list[0]["container"], Value::Null, "{list:#?}");
    let metrics = get(port, "/metrics").expect("GET /metrics");
    let series = format!("memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"{name}\"}} 17264");
    assert!(metrics.body.lines().any(|line| line == series), "{series} in:\n{}", metrics.body);
    leaker.exit();
    stop(memleak);
}

/// A program started through a symlink, as Debian starts redis-server
/// (a link to redis-check-rdb), is followed by the link's name, the name
/// `ps` shows, though /proc/PID/exe names the file linked to.
#[test]
fn exe_follows_a_program_by_the_name_it_was_started_under() {
    let (dir, binary, _) = named_leaker("target");
    let link_name = format!("leaker-link-{}", std::process::id());
    let link = dir.path().join(&link_name);
    std::os::unix::fs::symlink(&binary, &link).expect("link to the leaker");
    let (mut memleak, port) = serve(&["--exe", &link_name]);
    let mut leaker = start_waiting(&link);
    let pid = leaker.pid();
    let tracing = format!("memleak: tracing pid {pid} (");
    memleak.stderr.wait_for("memleak to follow the linked program", |line| line.starts_with(&tracing));
    leaker.go();
    targets_until(port, pid, |target| target.is_some_and(|target| target["outstanding_bytes"] == 17_264));
    leaker.exit();
    stop(memleak);
}

#[test]
fn cgroup_follows_a_process_that_joins_later() {
    let cgroup = TestCgroup::named(&format!("memleak-serve-follow-{}", std::process::id()));
    let (mut memleak, port) = serve(&["--cgroup", cgroup.arg()]);
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid();
    cgroup.join(pid);
    let tracing = format!("memleak: tracing pid {pid} (leaker) through ");
    memleak.stderr.wait_for("memleak to follow the process", |line| line.starts_with(&tracing));
    leaker.go();
    let list =
        targets_until(port, pid, |target| target.is_some_and(|target| target["outstanding_bytes"] == 17_264));
    assert_eq!(list.len(), 1, "only the process in the cgroup: {list:#?}");
    leaker.exit();
    stop(memleak);
}

/// 64 hex digits for a container id no runtime gave.
fn made_up_container_id() -> String {
    let seed = format!("{}{:?}", std::process::id(), std::time::Instant::now());
    let output = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write as _;
            child.stdin.take().unwrap().write_all(seed.as_bytes())?;
            child.wait_with_output()
        })
        .expect("run sha256sum");
    String::from_utf8_lossy(&output.stdout)[..64].to_owned()
}

/// No container engine runs here: a container made as a runtime makes
/// one (new mount and pid namespaces, `pivot_root`), in a cgroup named
/// as podman names a container's.
#[test]
fn container_follows_the_process_in_a_container_by_id_prefix() {
    let id = made_up_container_id();
    let cgroup = TestCgroup::named(&format!("libpod-{id}.scope"));
    let rootfs = leaker_rootfs();
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--pid", "--fork", "sh"])
        .arg(workspace_root().join("tests/fixtures/enter-container.sh"))
        .arg(rootfs.path())
        .args(["/app/leaker", "all", "--wait"]);
    let mut leaker = Leaker::start_command(command);
    let pid = leaker.leaker_pid();
    cgroup.join(pid);
    let (memleak, port) = serve_with_env(&["--container", &id[..12]], &[("NODE_NAME", "node-a")]);
    let tracing = format!("memleak: tracing pid {pid} (leaker) in container {} through ", &id[..12]);
    // Said before it serves: the process was in the container at the start.
    assert!(
        memleak.stderr.seen.iter().any(|line| line.starts_with(&tracing)),
        "{tracing} in {:#?}",
        memleak.stderr.seen
    );
    leaker.go();
    let list =
        targets_until(port, pid, |target| target.is_some_and(|target| target["outstanding_bytes"] == 17_264));
    assert_eq!(list.len(), 1, "{list:#?}");
    // No runtime knows it: no name, and the id as podman's cgroup says.
    assert_eq!(list[0]["container"], Value::Null, "{list:#?}");
    assert_eq!(list[0]["container_id"], format!("podman://{id}").as_str(), "the full id: {list:#?}");
    assert_eq!(list[0]["node"], "node-a", "{list:#?}");
    assert_eq!(list[0]["program"], "/app/leaker", "{list:#?}");
    let metrics = get(port, "/metrics").expect("GET /metrics");
    let series = format!(
        "memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\",container_id=\"podman://{id}\",node=\"node-a\"}} 17264"
    );
    assert!(metrics.body.lines().any(|line| line == series), "{series} in {}", metrics.body);
    leaker.exit();
    stop(memleak);
}

#[test]
fn an_exited_process_is_listed_then_forgotten_after_retain() {
    let (_dir, binary, name) = named_leaker("retain");
    let (mut memleak, port) = serve(&["--exe", &name, "--retain", "2s"]);
    let mut leaker = start_waiting(&binary);
    let pid = leaker.pid();
    let tracing = format!("memleak: tracing pid {pid} ({name}) through ");
    memleak.stderr.wait_for("memleak to follow the new process", |line| line.starts_with(&tracing));
    leaker.go();
    targets_until(port, pid, |target| target.is_some_and(|target| target["outstanding_bytes"] == 17_264));
    leaker.exit();
    let list = targets_until(port, pid, |target| target.is_some_and(|target| target["exited"] == true));
    let exited = list.iter().find(|target| target["pid"] == pid).unwrap();
    assert_eq!(exited["outstanding_bytes"], 17_264, "its last report stays: {exited:#}");
    let list = targets_until(port, pid, |target| target.is_none());
    assert!(list.is_empty(), "forgotten after --retain: {list:#?}");
    stop(memleak);
}

#[test]
fn processes_past_max_processes_are_counted_and_said() {
    let (_dir, binary, name) = named_leaker("bound");
    let (mut memleak, port) = serve(&["--exe", &name, "--max-processes", "1"]);
    let first = start_waiting(&binary);
    let tracing = format!("memleak: tracing pid {} ({name}) through ", first.pid());
    memleak.stderr.wait_for("memleak to follow the first process", |line| line.starts_with(&tracing));
    let second = start_waiting(&binary);
    let refused = format!("memleak: warn: not tracing pid {}: --max-processes 1 reached", second.pid());
    memleak.stderr.wait_for("memleak to say it left one out", |line| line.starts_with(&refused));
    // The count is published once the process is left out, though no
    // process was added with it.
    let left_out = |response: &Response| {
        serde_json::from_str::<Value>(&response.body).is_ok_and(|list| list["processes_not_followed"] == 1)
    };
    let response = get_until(port, "/api/v1/targets", left_out);
    let list = targets(&response);
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0]["pid"], first.pid());
    let metrics = get(port, "/metrics").expect("GET /metrics");
    assert!(
        metrics.body.lines().any(|line| line == "memleak_processes_not_followed_total 1"),
        "{}",
        metrics.body
    );
    first.exit();
    second.exit();
    stop(memleak);
}

#[test]
fn bad_selectors_are_refused_in_one_line() {
    let port = free_port().to_string();
    assert_refused_in_one_line(
        &["serve", "--port", &port],
        "give --pid, --cgroup, --exe, --container, --namespace, --pod or --container-name",
    );
    assert_refused_in_one_line(
        &["serve", "--pod", "web-(", "--port", &port],
        "--pod `web-(` is not a regular expression: unclosed group",
    );
    assert_refused_in_one_line(&["serve", "--exe", "x", "--retain", "10"], "`10` has no unit");
    assert_refused_in_one_line(&["serve", "--exe", "x", "--retain", "soon"], "`soon` is not a duration");
    // A container not running is waited for, not refused
    // (serve_podman.rs); a reference that cannot name one is refused.
    assert_refused_in_one_line(&["serve", "--container=-h"], "is not a container id or name");
    assert_refused_in_one_line(&["serve", "--exe", "/usr/bin/x"], "give an executable's file name");
}

/// What the daemon holds of the processes it follows: its open
/// descriptors, by what they are (a socket, a BPF link, a file), and the
/// entries of its BPF hash maps, by map.
fn holdings(daemon: u32) -> Holdings {
    let mut descriptors: Vec<String> = fs::read_dir(format!("/proc/{daemon}/fd"))
        .expect("list memleak's descriptors")
        .flatten()
        .filter_map(|fd| fs::read_link(fd.path()).ok())
        .map(|target| {
            let target = target.to_string_lossy().into_owned();
            // socket:[1234] and anon_inode:bpf-link are told apart by kind.
            target.split_once(":[").map_or(target.clone(), |(kind, _)| kind.to_owned())
        })
        .collect();
    descriptors.sort();
    (descriptors, memleak_tests::bpf_maps::map_entries(daemon))
}

/// Starts the leaker `binary` under `--exe`, waits until the daemon
/// shows its 17,264 bytes, scrapes every endpoint, and lets it exit.
fn come_and_go(memleak: &mut Memleak, port: u16, binary: &Path, name: &str) {
    let mut leaker = start_waiting(binary);
    let pid = leaker.pid();
    let tracing = format!("memleak: tracing pid {pid} ({name}) through ");
    memleak.stderr.wait_for("memleak to follow the new process", |line| line.starts_with(&tracing));
    leaker.go();
    targets_until(port, pid, |target| target.is_some_and(|target| target["outstanding_bytes"] == 17_264));
    let endpoints = [
        "/metrics",
        "/",
        &format!("/debug/pprof/heap?pid={pid}"),
        &format!("/api/v1/report?pid={pid}&format=svg"),
    ];
    for path in endpoints {
        let response = get(port, path).expect("GET an endpoint");
        assert_eq!(response.status, 200, "{path}: {response:#?}");
    }
    leaker.exit();
}

/// The soak of `cargo xtask bench`, short: leakers come and go under
/// `--exe` while every endpoint is scraped, and once `--retain` has passed
/// the daemon holds what it held after the first one, descriptor for
/// descriptor and map entry for map entry. (The first one starts what
/// is started once: the fork tracepoint's link.)
#[test]
fn processes_that_came_and_went_leave_nothing_in_the_daemon() {
    let (_dir, binary, name) = named_leaker("soak");
    let (mut memleak, port) = serve(&["--exe", &name, "--retain", "1s", "--interval", "1"]);
    let daemon = memleak.child.id();
    come_and_go(&mut memleak, port, &binary, &name);
    get_until(port, "/api/v1/targets", |response| targets(response).is_empty());
    let after_one = holdings_settled(daemon, None);
    for _ in 0..4 {
        come_and_go(&mut memleak, port, &binary, &name);
    }
    get_until(port, "/api/v1/targets", |response| targets(response).is_empty());
    let after_five = holdings_settled(daemon, Some(&after_one));
    assert_eq!(after_five, after_one, "what the daemon held after one process, and after five");
    stop(memleak);
}

/// What `holdings` gives.
type Holdings = (Vec<String>, std::collections::BTreeMap<String, usize>);

/// The daemon's holdings once they hold still (a connection just
/// answered is closed on the daemon's side a moment after the client's):
/// until they equal `wanted`, or two readings in a row agree; or what
/// they are after `PATIENCE`.
fn holdings_settled(daemon: u32, wanted: Option<&Holdings>) -> Holdings {
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut last = holdings(daemon);
    loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let now = holdings(daemon);
        let settled = wanted.map_or(now == last, |wanted| &now == wanted);
        if settled || std::time::Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// `command` with no controlling terminal, as services run: the daemon
/// holds no process that has one.
fn as_a_service(mut command: Command) -> Command {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: setsid is async-signal-safe, as pre_exec requires.
    unsafe {
        command.pre_exec(|| if libc::setsid() < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) })
    };
    command.stderr(Stdio::null());
    command
}

/// Waits until `runs` processes have exited under the daemon, and checks
/// that it counted every byte of each: the leaker's `all` makes its 15
/// allocations (17,264 bytes) as soon as it starts.
fn assert_every_run_counted(port: u16, runs: usize) {
    let response = get_until(port, "/api/v1/targets", |response| {
        targets(response).iter().filter(|target| target["exited"] == true).count() == runs
    });
    let list = targets(&response);
    let counted: Vec<&Value> = list.iter().map(|target| &target["outstanding_bytes"]).collect();
    assert!(
        counted.iter().all(|&bytes| *bytes == 17_264),
        "run {runs}: each run's 17,264 bytes, from its first instruction: {counted:?}"
    );
}

/// 20 runs of a program that allocates at once and exits: each is held
/// at its execve until its probes are in. The first run of the program
/// is stopped again at its loader, its allocator not mapped at its
/// execve; the others are probed with the first run's plan.
#[test]
fn exe_counts_what_a_process_allocates_at_its_start() {
    let (_dir, binary, name) = named_leaker("start");
    let (memleak, port) = serve(&["--exe", &name, "--retain", "10m"]);
    for run in 1..=20 {
        let mut command = as_a_service(Command::new(&binary));
        let status = command.args(["all", "--exit"]).stdin(Stdio::null()).status().expect("run the leaker");
        assert!(status.success(), "run {run}: {status}");
        assert_every_run_counted(port, run);
    }
    stop(memleak);
}

/// A process that joins the cgroup and then calls execve, as a container's
/// first process does: held by its cgroup, whatever its name. In the
/// first run it is taken in at its execve; in the second before it (a
/// shell, followed already, that runs the leaker with `exec`). Two runs
/// only: in a 5.10 VM each takes half a minute.
#[test]
fn cgroup_counts_what_a_process_allocates_at_its_start() {
    use std::io::Write as _;
    let cgroup = TestCgroup::named(&format!("memleak-serve-start-{}", std::process::id()));
    let (memleak, port) = serve(&["--cgroup", cgroup.arg(), "--retain", "10m"]);
    let procs = cgroup.path().join("cgroup.procs");
    let leaker = fixture("leaker");
    for run in 1..=2 {
        let script =
            format!("echo $$ > {} && read -r _ && exec {} all --exit", procs.display(), leaker.display());
        let mut command = as_a_service(Command::new("sh"));
        let mut shell = command.arg("-c").arg(script).stdin(Stdio::piped()).spawn().expect("run sh");
        let pid = shell.id();
        if run % 2 == 0 {
            targets_until(port, pid, |target| target.is_some_and(|target| target["executable"] == "sh"));
        } else {
            while !fs::read_to_string(&procs).unwrap_or_default().lines().any(|line| line == pid.to_string())
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        shell.stdin.take().expect("sh's stdin").write_all(b"go\n").expect("tell sh to go on");
        let status = shell.wait().expect("wait for the leaker");
        assert!(status.success(), "run {run}: {status}");
        assert_every_run_counted(port, run);
    }
    stop(memleak);
}
