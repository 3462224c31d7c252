//! The files under contrib/, checked by the programs that read them:
//! Prometheus' scrape config and alert rules by promtool (the alerts'
//! behaviour too, with its unit tests), the systemd unit by
//! systemd-analyze, the Kubernetes manifests by kubectl's kustomize and
//! kubernetes-validate (Kubernetes' own schemas, offline).

use std::{fs, path::Path, process::Command};

use memleak_tests::{memleak_binary, run_ok, tempdir::TempDir, workspace_root};
use serde_json::Value;

fn contrib(file: &str) -> std::path::PathBuf {
    workspace_root().join("contrib").join(file)
}

#[test]
fn promtool_accepts_the_scrape_config_and_its_alert_rules() {
    // The config names the rule file, which promtool checks with it.
    let output = run_ok("promtool", &[Path::new("check"), Path::new("config"), &contrib("prometheus.yml")]);
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("SUCCESS: 1 rule files found"), "the alert rules are loaded: {said}");
    run_ok("promtool", &[Path::new("check"), Path::new("rules"), &contrib("memleak-alerts.yml")]);
}

#[test]
fn the_growth_alert_fires_for_a_leak_and_not_for_a_cache_or_a_young_process() {
    run_ok("promtool", &[Path::new("test"), Path::new("rules"), &contrib("memleak-alerts.test.yml")]);
}

/// systemd-analyze verify checks that `ExecStart`'s program exists: the unit
/// is checked as shipped, but for its /usr/local/bin/memleak, which is
/// this build's memleak. A warning fails the test as an error would
/// (systemd-analyze exits 0 on an unknown key, say).
#[test]
fn systemd_analyze_verifies_the_unit() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        // Debian's systemd package has it; a build host without systemd
        // has nothing to verify the unit with, and nothing that would run it.
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    }
    let memleak = workspace_root().join("target/debug/memleak");
    assert!(memleak.exists(), "{} is missing: run `cargo build -p memleak` first", memleak.display());
    let unit =
        fs::read_to_string(contrib("memleak-serve.service")).expect("read contrib/memleak-serve.service");
    assert!(unit.contains("ExecStart=/usr/local/bin/memleak serve "), "{unit}");
    let directory = TempDir::new("memleak-unit");
    let copy = directory.path().join("memleak-serve.service");
    fs::write(&copy, unit.replace("/usr/local/bin/memleak", &memleak.display().to_string())).unwrap();
    let output = run_ok("systemd-analyze", &[Path::new("verify"), &copy]);
    let complaints = String::from_utf8_lossy(&output.stderr);
    assert!(complaints.trim().is_empty(), "systemd-analyze verify: {complaints}");
}

/// kubernetes-validate, which `cargo xtask test` installs in a venv of
/// its own; the venv's Python has `PyYAML` (kubernetes-validate's), which
/// reads YAML for the tests.
fn python_tools() -> std::path::PathBuf {
    let venv = workspace_root().join("target/tools/kubernetes-validate/bin");
    assert!(
        venv.join("kubernetes-validate").exists(),
        "{} has no kubernetes-validate: `cargo xtask test` installs it",
        venv.display()
    );
    venv
}

/// `kubectl kustomize DIRECTORY`, which kubectl runs offline: the
/// manifests as applied.
fn kustomize(directory: &Path) -> String {
    let output = run_ok("kubectl", &[Path::new("kustomize"), directory]);
    String::from_utf8(output.stdout).expect("kustomize writes UTF-8")
}

/// The objects of a multi-document YAML text, read by `PyYAML`.
fn objects(yaml: &str, directory: &TempDir) -> Vec<Value> {
    let file = directory.path().join("objects.yaml");
    fs::write(&file, yaml).unwrap();
    let to_json = "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))";
    let output = run_ok(
        &python_tools().join("python").display().to_string(),
        &[Path::new("-c"), Path::new(to_json), &file],
    );
    serde_json::from_slice(&output.stdout).expect("PyYAML's objects as JSON")
}

fn the<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|object| object["kind"] == kind && object["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in {objects:#?}"))
}

/// The base renders, and every object of it is valid against the
/// Kubernetes 1.37 schemas, strictly (a misspelt or misplaced field is an
/// error, not ignored as the API server would); nothing in it reaches the
/// API.
#[test]
fn the_kubernetes_manifests_render_and_kubernetes_schemas_accept_them() {
    let directory = TempDir::new("memleak-k8s");
    let rendered = kustomize(&contrib("k8s"));
    let file = directory.path().join("memleak.yaml");
    fs::write(&file, &rendered).unwrap();
    let validate = python_tools().join("kubernetes-validate");
    let output = run_ok(&validate.display().to_string(), &[Path::new("--strict"), &file]);
    let said =
        String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    let objects = objects(&rendered, &directory);
    assert_eq!(objects.len(), 5, "{objects:#?}");
    for object in &objects {
        let passed = format!(
            "passed for resource {}/{} against version",
            object["kind"].as_str().unwrap().to_ascii_lowercase(),
            object["metadata"]["name"].as_str().unwrap()
        );
        assert!(said.contains(&passed), "{passed} in: {said}");
    }

    let namespace = the(&objects, "Namespace", "memleak");
    assert_eq!(namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"], "privileged");
    assert!(
        objects.iter().all(|object| !object["kind"].as_str().unwrap().contains("Role")),
        "no RBAC: {objects:#?}"
    );
    assert_eq!(the(&objects, "ServiceAccount", "memleak")["automountServiceAccountToken"], false);
    assert_eq!(the(&objects, "Service", "memleak")["spec"]["clusterIP"], "None");
}

/// The `DaemonSet` is what it must be: the host's pids, the least
/// capabilities measured, nothing writable, the node's files read-only
/// under /host, the token from its Secret, the node and the pod's address
/// from the downward API.
#[test]
fn the_daemon_set_has_the_host_pids_the_capabilities_measured_and_read_only_host_paths() {
    let directory = TempDir::new("memleak-k8s-pod");
    let objects = objects(&kustomize(&contrib("k8s")), &directory);
    let pod = &the(&objects, "DaemonSet", "memleak")["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    assert_eq!(pod["serviceAccountName"], "memleak");
    let container = &pod["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(
        security["capabilities"]["add"],
        serde_json::json!(["BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH", "CHECKPOINT_RESTORE"]),
        "the capabilities measured"
    );
    assert_eq!(security["privileged"], Value::Null, "privileged is the documented fallback, not the default");
    assert_eq!(security["readOnlyRootFilesystem"], true);
    let args: Vec<&str> =
        container["args"].as_array().unwrap().iter().map(|arg| arg.as_str().unwrap()).collect();
    assert_eq!(args[0], "serve");
    assert!(args.contains(&"--host-root=/host"), "{args:?}");
    assert!(args.contains(&"--watch"), "the node watched, what grows traced: {args:?}");
    assert!(args.contains(&"--state-dir=/var/lib/memleak"), "{args:?}");
    assert!(args.contains(&"--token-file=/etc/memleak/token"), "{args:?}");
    // The binary takes them: with --help last, clap checks every flag
    // before it and starts nothing.
    let parsed = Command::new(memleak_binary()).args(&args).arg("--help").output().unwrap();
    assert!(parsed.status.success(), "memleak {args:?}: {}", String::from_utf8_lossy(&parsed.stderr));
    let env = |name: &str| {
        let variable = container["env"].as_array().unwrap().iter().find(|variable| variable["name"] == name);
        variable.unwrap_or_else(|| panic!("no {name} in {:#}", container["env"]))["valueFrom"]["fieldRef"]
            ["fieldPath"]
            .clone()
    };
    assert_eq!(env("NODE_NAME"), "spec.nodeName");
    assert_eq!(env("POD_IP"), "status.podIP");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/healthz");
    for kind in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(container["resources"][kind][resource].is_string(), "{kind}.{resource}: {container:#}");
        }
    }

    check_volumes(pod);
}

/// Every host path is mounted read-only under /host, each one listed, but
/// the state directory, writable where --state-dir names it; and the
/// token's Secret where --token-file reads it.
fn check_volumes(pod: &Value) {
    let container = &pod["containers"][0];
    let volumes = pod["volumes"].as_array().unwrap();
    let mounts = container["volumeMounts"].as_array().unwrap();
    let mut host_paths = Vec::new();
    for volume in volumes.iter().filter(|volume| volume["hostPath"].is_object() && volume["name"] != "state")
    {
        let path = volume["hostPath"]["path"].as_str().unwrap();
        let mount =
            mounts.iter().find(|mount| mount["name"] == volume["name"]).expect("each host path mounted");
        assert_eq!(mount["mountPath"], format!("/host{path}"), "{mount:#}");
        assert_eq!(mount["readOnly"], true, "{mount:#}");
        host_paths.push(path);
    }
    assert_eq!(
        host_paths,
        ["/sys/fs/cgroup", "/run/containerd", "/run/containers", "/var/log/pods", "/var/log/containers"]
    );
    let state = volumes.iter().find(|volume| volume["name"] == "state").expect("the state directory");
    assert_eq!(state["hostPath"]["path"], "/var/lib/memleak");
    let state_mount = mounts.iter().find(|mount| mount["name"] == "state").unwrap();
    assert_eq!(
        (&state_mount["mountPath"], &state_mount["readOnly"]),
        (&Value::from("/var/lib/memleak"), &Value::Null)
    );
    let token = volumes.iter().find(|volume| volume["secret"].is_object()).expect("the token's Secret");
    let token_mount = mounts.iter().find(|mount| mount["name"] == token["name"]).unwrap();
    assert_eq!(token_mount["mountPath"], "/etc/memleak");
    assert_eq!(token["secret"]["secretName"], "memleak-token");
}

/// With the Prometheus operator's component, a `PodMonitor` scrapes the
/// `DaemonSet`'s pods by their port, with the token of their Secret, and
/// keeps memleak's namespace and pod labels (`honorLabels`).
#[test]
fn the_pod_monitor_scrapes_the_daemon_set_and_keeps_its_labels() {
    let directory = TempDir::new("memleak-k8s-overlay");
    let overlay = directory.path().join("overlay");
    fs::create_dir(&overlay).unwrap();
    // Kustomize takes a base by a relative path only: from the overlay up
    // to the root, then down to contrib/k8s.
    let up = "../".repeat(overlay.components().count() - 1);
    let base = format!("{up}{}", contrib("k8s").display().to_string().trim_start_matches('/'));
    fs::write(
        overlay.join("kustomization.yaml"),
        format!("resources: [{base}]\ncomponents: [{base}/prometheus-operator]\n"),
    )
    .unwrap();
    let objects = objects(&kustomize(&overlay), &directory);
    let monitor = the(&objects, "PodMonitor", "memleak");
    assert_eq!(monitor["metadata"]["namespace"], "memleak");
    let pod = &the(&objects, "DaemonSet", "memleak")["spec"]["template"];
    let labels = pod["metadata"]["labels"].as_object().unwrap();
    for (name, value) in monitor["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(labels.get(name), Some(value), "the PodMonitor selects the DaemonSet's pods: {labels:?}");
    }
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["honorLabels"], true);
    assert_eq!(endpoint["path"], "/metrics");
    let ports = pod["spec"]["containers"][0]["ports"].as_array().unwrap();
    assert!(ports.iter().any(|port| port["name"] == endpoint["port"]), "{endpoint:#} on {ports:#?}");
    let credentials = &endpoint["authorization"]["credentials"];
    let secret =
        pod["spec"]["volumes"].as_array().unwrap().iter().find(|volume| volume["secret"].is_object());
    assert_eq!(credentials["name"], secret.unwrap()["secret"]["secretName"]);
    assert_eq!(credentials["key"], "token");
}

/// The alerts keyed by namespace, pod and container: promtool loads them,
/// and its unit tests fire them for a leaking container alone.
#[test]
fn the_kubernetes_alerts_fire_for_a_leaking_container_alone() {
    run_ok("promtool", &[Path::new("check"), Path::new("rules"), &contrib("k8s/memleak-alerts.yml")]);
    run_ok("promtool", &[Path::new("test"), Path::new("rules"), &contrib("k8s/memleak-alerts.test.yml")]);
}
