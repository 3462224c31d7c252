//! `memleak serve` on a Kubernetes node, with no Kubernetes here: real
//! leakers in real cgroups named as the kubelet names them (the systemd
//! driver with containerd, the cgroupfs driver with CRI-O), their pod and
//! container names only in the runtime's bundle files under a temporary
//! `--host-root`. memleak must find them there and label each process as
//! cAdvisor and kube-state-metrics label containers, on every output.

use std::{fmt::Write as _, fs, path::Path, process::Command};

use memleak_tests::{
    cgroups::TestCgroup,
    consumers::go_pprof_url,
    fixture,
    http::{get, get_until, serve_with_env, stop, Response},
    tempdir::TempDir,
    Leaker,
};
use serde_json::Value;

/// The processes `/api/v1/targets` lists.
fn targets(response: &Response) -> Vec<Value> {
    let list: Value =
        serde_json::from_str(&response.body).unwrap_or_else(|error| panic!("{error}: {response:#?}"));
    list["targets"].as_array().cloned().unwrap_or_else(|| panic!("no targets array: {list:#}"))
}

/// A 64-hex container id of this test's own: two tests never share one.
fn container_id(tag: &str) -> String {
    let seed = format!("{tag}-{}", std::process::id());
    let mut id = String::new();
    let mut state: u64 = 0xcbf2_9ce4_8422_2325;
    while id.len() < 64 {
        for byte in seed.bytes() {
            state = (state ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
        let _ = write!(id, "{state:016x}");
    }
    id
}

/// A pod uid of this test's own.
fn pod_uid(tag: &str) -> String {
    let hex = container_id(&format!("uid-{tag}"));
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

/// Writes `contents` at `path` below `root`, making its directories.
fn write(root: &Path, path: &str, contents: &str) {
    let path = root.join(path);
    fs::create_dir_all(path.parent().expect("a parent")).expect("make the bundle's directories");
    fs::write(path, contents).expect("write a bundle file");
}

/// What a pod's container must be labelled with.
struct Expected<'a> {
    namespace: &'a str,
    pod: &'a str,
    container: &'a str,
    uid: &'a str,
    container_id: String,
}

/// Runs the leaker in cgroup `container` below `top` (a container's, as
/// the kubelet lays it out), serves `--cgroup top` with `host_root`, and
/// checks the labels on /api/v1/targets, /metrics, the JSON report and
/// the pprof profile.
fn labelled_as(top: &TestCgroup, container: &str, host_root: &Path, expected: &Expected) {
    // Made whole here and removed with `top`, children first.
    let cgroup = top.path().join(container);
    fs::create_dir_all(&cgroup).expect("make the kubelet's cgroups");
    let mut command = Command::new(fixture("leaker"));
    command.args(["all", "--wait"]);
    let mut leaker = Leaker::start_command(command);
    let pid = leaker.pid();
    fs::write(cgroup.join("cgroup.procs"), pid.to_string()).expect("move the leaker into its container");
    let host_root = host_root.to_str().expect("a UTF-8 path");
    let (memleak, port) =
        serve_with_env(&["--cgroup", top.arg(), "--host-root", host_root], &[("NODE_NAME", "node-a")]);
    leaker.go();
    let response = get_until(port, "/api/v1/targets", |response| {
        targets(response).iter().any(|target| target["pid"] == pid && target["outstanding_bytes"] == 17_264)
    });
    let list = targets(&response);
    assert_eq!(list.len(), 1, "the pod's one process: {list:#?}");
    let labels = [
        ("namespace", expected.namespace),
        ("pod", expected.pod),
        ("container", expected.container),
        ("uid", expected.uid),
        ("container_id", expected.container_id.as_str()),
        ("node", "node-a"),
    ];
    for (name, value) in labels {
        assert_eq!(list[0][name], value, "{name}: {list:#?}");
    }

    let metrics = get(port, "/metrics").expect("GET /metrics");
    let series = format!(
        "memleak_outstanding_bytes{{pid=\"{pid}\",exe=\"leaker\",namespace=\"{}\",pod=\"{}\",container=\"{}\",\
         uid=\"{}\",container_id=\"{}\",node=\"node-a\"}} 17264",
        expected.namespace, expected.pod, expected.container, expected.uid, expected.container_id
    );
    assert!(metrics.body.lines().any(|line| line == series), "{series} in:\n{}", metrics.body);

    let json = get(port, &format!("/api/v1/report?pid={pid}&format=json")).expect("GET a JSON report");
    let report: Value = serde_json::from_str(&json.body).unwrap_or_else(|error| panic!("{error}: {json:#?}"));
    assert_eq!(report["total_bytes"], 17_264, "{report:#}");
    for (name, value) in labels {
        assert_eq!(report["workload"][name], value, "{name}: {:#}", report["workload"]);
    }

    // Each sample says whose it is, as Pyroscope splits series by.
    let home = TempDir::new("memleak-pprof-home");
    let url = format!("http://127.0.0.1:{port}/debug/pprof/heap?pid={pid}");
    let tags = go_pprof_url(&url, home.path(), &["-tags", "-sample_index=inuse_space"]);
    let program = list[0]["program"].as_str().expect("the program's path");
    let pid_text = pid.to_string();
    for (name, value) in [("pid", pid_text.as_str()), ("program", program)].into_iter().chain(labels) {
        // go tool pprof -tags: ` name: Total 16.9kB` then a line per
        // value, `16.9kB (  100%): value`: every sample has this one.
        let section = tags
            .split("\n\n")
            .find(|section| section.trim_start().starts_with(&format!("{name}: Total ")))
            .unwrap_or_else(|| panic!("a {name} tag in:\n{tags}"));
        let values: Vec<&str> = section.lines().skip(1).map(str::trim).collect();
        assert!(
            values.len() == 1 && values[0].ends_with(&format!("(  100%): {value}")),
            "{name}={value} on every sample in:\n{tags}"
        );
    }
    leaker.exit();
    stop(memleak);
}

/// The layout of most clusters: cgroup v2, the kubelet's systemd driver,
/// containerd; names in containerd's bundle annotations.
#[test]
fn a_containerd_pod_under_the_systemd_driver_is_named_from_its_bundle() {
    let id = container_id("containerd");
    let uid = pod_uid("containerd");
    // Below a cgroup of the test's own, as a kubelet's --cgroup-root puts
    // kubepods.slice: nothing of the machine's is touched.
    let top = TestCgroup::new();
    let container = format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{id}.scope",
        uid.replace('-', "_")
    );
    let host_root = TempDir::new("memleak-host-root");
    write(
        host_root.path(),
        &format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json"),
        &format!(
            r#"{{"ociVersion":"1.1.0","process":{{"args":["/app/leaker"]}},"annotations":{{
            "io.kubernetes.cri.container-type":"container","io.kubernetes.cri.sandbox-name":"web-7d4b9",
            "io.kubernetes.cri.sandbox-namespace":"shop","io.kubernetes.cri.sandbox-uid":"{uid}",
            "io.kubernetes.cri.container-name":"leaker","io.kubernetes.cri.image-name":"localhost/leaker:test"}}}}"#
        ),
    );
    let expected = Expected {
        namespace: "shop",
        pod: "web-7d4b9",
        container: "leaker",
        uid: &uid,
        container_id: format!("containerd://{id}"),
    };
    labelled_as(&top, &container, host_root.path(), &expected);
}

/// The cgroupfs driver with CRI-O: the cgroup names neither the runtime
/// nor the container's name; CRI-O's bundle does.
#[test]
fn a_crio_pod_under_the_cgroupfs_driver_is_named_from_its_bundle() {
    let id = container_id("crio");
    let uid = pod_uid("crio");
    let top = TestCgroup::new();
    let container = format!("kubepods/besteffort/pod{uid}/{id}");
    let host_root = TempDir::new("memleak-host-root");
    write(
        host_root.path(),
        &format!("run/containers/storage/overlay-containers/{id}/userdata/config.json"),
        &format!(
            r#"{{"annotations":{{"io.kubernetes.pod.name":"db-0","io.kubernetes.pod.namespace":"data",
            "io.kubernetes.pod.uid":"{uid}","io.kubernetes.container.name":"postgres",
            "io.kubernetes.cri-o.ContainerType":"container"}}}}"#
        ),
    );
    let expected = Expected {
        namespace: "data",
        pod: "db-0",
        container: "postgres",
        uid: &uid,
        container_id: format!("cri-o://{id}"),
    };
    labelled_as(&top, &container, host_root.path(), &expected);
}

/// Writes containerd's bundle of container `id`: a pod's container, or
/// with `container` "" the pod's sandbox (its pause container).
fn containerd_bundle(host_root: &Path, id: &str, namespace: &str, pod: &str, uid: &str, container: &str) {
    let kind = if container.is_empty() { "sandbox" } else { "container" };
    write(
        host_root,
        &format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json"),
        &format!(
            r#"{{"annotations":{{"io.kubernetes.cri.container-type":"{kind}",
            "io.kubernetes.cri.sandbox-name":"{pod}","io.kubernetes.cri.sandbox-namespace":"{namespace}",
            "io.kubernetes.cri.sandbox-uid":"{uid}","io.kubernetes.cri.container-name":"{container}"}}}}"#
        ),
    );
}

/// The cgroup of container `id` of pod `uid`, as the systemd driver lays
/// a burstable pod out, below `top`; made here.
fn pod_container_cgroup(top: &TestCgroup, uid: &str, id: &str) -> std::path::PathBuf {
    let path = top.path().join(format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{id}.scope",
        uid.replace('-', "_")
    ));
    fs::create_dir_all(&path).expect("make a pod's cgroups");
    path
}

/// The leaker, waiting for `go`, moved into cgroup `cgroup`.
fn leaker_in(cgroup: &Path) -> Leaker {
    let mut command = Command::new(fixture("leaker"));
    command.args(["all", "--wait"]);
    let leaker = Leaker::start_command(command);
    fs::write(cgroup.join("cgroup.procs"), leaker.pid().to_string()).expect("move the leaker into its pod");
    leaker
}

/// The pids `/api/v1/targets` lists, in order.
fn sorted_pids(list: &[Value]) -> Vec<u64> {
    let mut pids: Vec<u64> = list.iter().filter_map(|target| target["pid"].as_u64()).collect();
    pids.sort_unstable();
    pids
}

/// `--namespace shop` follows the containers of shop's pods, those of a
/// pod started after the daemon too, and nothing else: not data's pod,
/// not shop's pod's sandbox.
#[test]
fn namespace_follows_exactly_the_pods_of_that_namespace_and_those_started_later() {
    let top = TestCgroup::new();
    let host_root = TempDir::new("memleak-host-root");
    let (web, db, later, pause) =
        (container_id("web"), container_id("db"), container_id("later"), container_id("pause"));
    let (web_uid, db_uid, late_pod_uid) = (pod_uid("web"), pod_uid("db"), pod_uid("later"));
    containerd_bundle(host_root.path(), &web, "shop", "web-7d4b9", &web_uid, "leaker");
    containerd_bundle(host_root.path(), &pause, "shop", "web-7d4b9", &web_uid, "");
    containerd_bundle(host_root.path(), &db, "data", "db-0", &db_uid, "leaker");
    containerd_bundle(host_root.path(), &later, "shop", "web-8f00d", &late_pod_uid, "leaker");
    let mut in_web = leaker_in(&pod_container_cgroup(&top, &web_uid, &web));
    let mut in_db = leaker_in(&pod_container_cgroup(&top, &db_uid, &db));
    // The pause container: a process of shop's pod that is no workload.
    let mut sandbox = Command::new("sleep").arg("1000").spawn().expect("start a pause process");
    let sandbox_cgroup = pod_container_cgroup(&top, &web_uid, &pause).join("cgroup.procs");
    fs::write(sandbox_cgroup, sandbox.id().to_string()).expect("move it into its pod");

    let host_root_arg = host_root.path().to_str().expect("a UTF-8 path");
    let (memleak, port) =
        serve_with_env(&["--namespace", "shop", "--host-root", host_root_arg], &[("NODE_NAME", "node-a")]);
    // Taken in before it serves: shop's one workload process.
    let list = targets(&get(port, "/api/v1/targets").expect("GET /api/v1/targets"));
    assert_eq!(sorted_pids(&list), [u64::from(in_web.pid())], "web's leaker alone: {list:#?}");

    let mut in_later = leaker_in(&pod_container_cgroup(&top, &late_pod_uid, &later));
    let later_pid = in_later.pid();
    get_until(port, "/api/v1/targets", |response| {
        targets(response).iter().any(|target| target["pid"] == later_pid)
    });
    for leaker in [&mut in_web, &mut in_db, &mut in_later] {
        leaker.go();
    }
    let response = get_until(port, "/api/v1/targets", |response| {
        let list = targets(response);
        list.len() == 2 && list.iter().all(|target| target["outstanding_bytes"] == 17_264)
    });
    let list = targets(&response);
    let expected =
        sorted_pids(&[serde_json::json!({"pid": in_web.pid()}), serde_json::json!({"pid": later_pid})]);
    assert_eq!(
        sorted_pids(&list),
        expected,
        "shop's two pods' leakers, not data's nor the sandbox: {list:#?}"
    );
    for target in &list {
        let pod = if target["pid"] == later_pid { "web-8f00d" } else { "web-7d4b9" };
        assert_eq!(
            (target["namespace"].as_str(), target["pod"].as_str()),
            (Some("shop"), Some(pod)),
            "{target:#}"
        );
    }
    let metrics = get(port, "/metrics").expect("GET /metrics");
    let series = format!(
        "memleak_outstanding_bytes{{pid=\"{later_pid}\",exe=\"leaker\",namespace=\"shop\",pod=\"web-8f00d\",\
         container=\"leaker\",uid=\"{late_pod_uid}\",container_id=\"containerd://{later}\",node=\"node-a\"}} 17264"
    );
    assert!(metrics.body.lines().any(|line| line == series), "{series} in:\n{}", metrics.body);
    assert!(!metrics.body.contains("namespace=\"data\""), "data's pod is not followed:\n{}", metrics.body);
    stop(memleak);
    for leaker in [in_web, in_db, in_later] {
        leaker.exit();
    }
    let _ = sandbox.kill();
    let _ = sandbox.wait();
}
