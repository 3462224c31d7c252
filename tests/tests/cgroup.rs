//! --cgroup: every process of a cgroup v2, including those that join it
//! after memleak attached, and none outside it.

use std::{fs, path::PathBuf};

use memleak_tests::{usage_at, Leaker, Memleak};
use serde_json::Value;

/// A fresh cgroup v2 directory, removed when dropped.
struct TestCgroup(PathBuf);

impl TestCgroup {
    fn new() -> Self {
        // A pure cgroup v2 machine mounts it at /sys/fs/cgroup; a hybrid one,
        // like ours, at /sys/fs/cgroup/unified.
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(PathBuf::from)
            .find(|root| root.join("cgroup.procs").exists() && root.join("cgroup.controllers").exists())
            .expect("a cgroup v2 hierarchy");
        let path = root.join(format!("memleak-test-{}", std::process::id()));
        fs::create_dir_all(&path).expect("create a cgroup");
        Self(path)
    }

    fn join(&self, pid: u32) {
        fs::write(self.0.join("cgroup.procs"), pid.to_string()).expect("move a process into the cgroup");
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.0);
    }
}

#[test]
fn processes_that_join_later_are_traced_and_others_are_not() {
    let cgroup = TestCgroup::new();
    let path = cgroup.0.to_str().unwrap();
    let mut memleak = Memleak::start(&["--cgroup", path, "--format", "json", "-o", "0", "-T", "100", "3600"]);
    memleak.wait_attached();
    let mut first = Leaker::start_waiting(&["all"]);
    let mut second = Leaker::start_waiting(&["churn"]);
    let mut outsider = Leaker::start_waiting(&["all"]);
    for leaker in [&first, &second] {
        cgroup.join(leaker.pid());
        let joined = format!("memleak: pid {} is in the cgroup", leaker.pid());
        memleak.stderr.wait_for("memleak to pick the process up", |line| line.starts_with(&joined));
    }
    first.go();
    second.go();
    outsider.go();
    memleak.signal(libc::SIGINT);
    let (status, lines) = memleak.finish();
    assert!(status.success());
    let report_of = |pid: u32| lines.iter().find(|line| line["pid"] == pid);
    let first_report = report_of(first.pid()).expect("a report for the first process");
    assert_eq!(first_report["total_bytes"], 17_264, "{first_report:#}");
    assert_eq!(usage_at(first_report, "leak_malloc", "malloc"), (3000, 3));
    let second_report = report_of(second.pid()).expect("a report for the second process");
    assert_eq!(usage_at(second_report, "churn", "churn-leak"), (77, 1), "{second_report:#}");
    assert!(report_of(outsider.pid()).is_none(), "a process outside the cgroup is not reported");
    let total: &Value = lines.iter().find(|line| line.get("cgroup").is_some()).expect("a cgroup total");
    assert_eq!(total["processes"], 2);
    assert_eq!(total["total_bytes"], 17_264 + 77, "{total}");
    // Only the cgroup's processes were recorded, though the probes sit on
    // the libc every process on the machine maps.
    assert_eq!(first_report["health"]["allocations"], 17 + 10_001);
    for leaker in [first, second, outsider] {
        leaker.exit();
    }
}

#[test]
fn a_path_that_is_not_a_cgroup() {
    let (code, stderr) = memleak_tests::run_to_end(&["--cgroup", "/tmp"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("memleak: error: /tmp is not a cgroup v2 directory"), "{stderr}");
}
