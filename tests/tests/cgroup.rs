//! --cgroup: every process of a cgroup v2, including those that join it
//! after memleak attached, and none outside it.

use std::fs;

use memleak_tests::{
    bpf_maps::map_entries,
    cgroups::TestCgroup,
    uprobes::{byte_in_file, byte_in_process, multi_links},
    usage_at, Leaker, Memleak, PATIENCE,
};
use serde_json::Value;

#[test]
fn processes_that_join_later_are_traced_and_others_are_not() {
    let cgroup = TestCgroup::new();
    let path = cgroup.arg();
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
    // Each process's calls are its own: its probes are placed in it alone.
    assert_eq!(first_report["health"]["allocations"], 17);
    assert_eq!(second_report["health"]["allocations"], 10_001);
    for leaker in [first, second, outsider] {
        leaker.exit();
    }
}

/// A cgroup whose process exited: the total after it counts what the
/// process held at its exit, beside the processes left (none).
#[test]
fn the_total_after_a_process_exited_counts_what_it_held() {
    let cgroup = TestCgroup::new();
    let path = cgroup.arg();
    let mut memleak = Memleak::start(&["--cgroup", path, "--format", "json", "-T", "1", "3600"]);
    memleak.wait_attached();
    let mut command = std::process::Command::new(memleak_tests::fixture("leaker"));
    command.args(["all", "--wait"]);
    let mut leaker = Leaker::start_command(command);
    let pid = leaker.pid();
    cgroup.join(pid);
    let joined = format!("memleak: pid {pid} is in the cgroup");
    memleak.stderr.wait_for("memleak to pick the process up", |line| line.starts_with(&joined));
    leaker.go();
    leaker.exit();
    let report = format!("\"pid\":{pid},");
    memleak.stdout.wait_for("the final report of the process", |line| line.contains(&report));
    memleak.signal(libc::SIGINT);
    let (status, lines) = memleak.finish();
    assert!(status.success());
    let total: &Value = lines.iter().find(|line| line.get("cgroup").is_some()).expect("a cgroup total");
    assert_eq!((&total["processes"], &total["total_bytes"]), (&Value::from(0), &Value::from(0)), "{total}");
    let exited = &total["exited"];
    assert_eq!(exited["processes"], 1, "{total}");
    assert_eq!(
        (&exited["total_bytes"], &exited["total_allocations"]),
        (&Value::from(17_264), &Value::from(15))
    );
}

/// memleak may trace for days while processes come and go: each one's
/// entries in the BPF maps are deleted once it has exited and had its
/// final report, so that the maps hold only what live processes hold.
#[test]
fn processes_that_come_and_go_leave_nothing_behind_in_the_maps() {
    let cgroup = TestCgroup::new();
    let path = cgroup.arg();
    let mut memleak = Memleak::start(&["--cgroup", path, "--format", "json", "-T", "1", "3600"]);
    memleak.wait_attached();
    let memleak_pid = memleak.child.id();
    let join = |leaker: &mut Leaker, memleak: &mut Memleak| {
        cgroup.join(leaker.pid());
        let joined = format!("memleak: pid {} is in the cgroup", leaker.pid());
        memleak.stderr.wait_for("memleak to pick the process up", |line| line.starts_with(&joined));
        leaker.go();
    };
    // A process that stays throughout, so that the baseline is not empty.
    let mut stayer = Leaker::start_waiting(&["all"]);
    join(&mut stayer, &mut memleak);
    let baseline = map_entries(memleak_pid);
    for map in ["ALLOCATIONS", "STACKS", "STACK_IDS", "STACK_TOTALS"] {
        assert!(baseline[map] > 0, "the process that stays holds entries in {map}: {baseline:?}");
    }
    let binary = memleak_tests::fixture("leaker");
    for round in 0..50 {
        let mut command = std::process::Command::new(&binary);
        command.args(["all", "--wait"]);
        let mut leaker = Leaker::start_command(command);
        let pid = leaker.pid();
        join(&mut leaker, &mut memleak);
        if round == 0 {
            let during = map_entries(memleak_pid);
            for map in ["ALLOCATIONS", "STACKS", "STACK_IDS", "STACK_TOTALS"] {
                assert!(
                    during[map] > baseline[map],
                    "a live process adds to {map}: {during:?} vs {baseline:?}"
                );
            }
        }
        leaker.exit();
        let report = format!("\"pid\":{pid},");
        memleak.stdout.wait_for("the final report of a process that exited", |line| line.contains(&report));
        // Processes that join, allocate and exit between two looks at the
        // cgroup: BPF counts their calls, and memleak never traces them.
        let procs = cgroup.path().join("cgroup.procs");
        let quick = format!("echo $$ > {} && exec /usr/bin/python3 -c pass", procs.display());
        let status = std::process::Command::new("sh").args(["-c", &quick]).status().expect("run sh");
        assert!(status.success());
    }
    // The last process is forgotten right after its report is written.
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut after = map_entries(memleak_pid);
    while after != baseline && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        after = map_entries(memleak_pid);
    }
    assert_eq!(after, baseline, "50 processes came and went: the maps hold what they held before");
    memleak.signal(libc::SIGINT);
    let (status, lines) = memleak.finish();
    assert!(status.success());
    let last =
        lines.iter().rev().find(|line| line["pid"] == stayer.pid()).expect("the stayer's final report");
    assert_eq!(last["total_bytes"], 17_264, "the process that stayed is reported whole: {last:#}");
    stayer.exit();
}

/// A pod's or a slice's cgroup holds few processes of its own: its
/// containers and services are in child cgroups. Tracing the parent traces
/// them all, those that join a child later included.
#[test]
fn a_parent_cgroup_includes_the_processes_of_its_descendants() {
    let pod = TestCgroup::new();
    let container = pod.child("container");
    let nested = container.child("nested");
    let mut direct = Leaker::start_waiting(&["all"]);
    let mut in_child = Leaker::start_waiting(&["all"]);
    let mut in_grandchild = Leaker::start_waiting(&["all"]);
    let mut outsider = Leaker::start_waiting(&["all"]);
    pod.join(direct.pid());
    container.join(in_child.pid());
    nested.join(in_grandchild.pid());
    let path = pod.arg();
    let mut memleak = Memleak::start(&["--cgroup", path, "--format", "json", "-T", "100", "3600"]);
    let census = memleak.stderr.wait_for("how many processes memleak found", |line| {
        line.starts_with("memleak: tracing ") && !line.starts_with("memleak: tracing cgroup")
    });
    assert_eq!(census, format!("memleak: tracing 3 processes in {path} (2 in descendant cgroups)"));
    memleak.wait_attached();
    let mut latecomer = Leaker::start_waiting(&["all"]);
    nested.join(latecomer.pid());
    let joined = format!("memleak: pid {} is in the cgroup", latecomer.pid());
    memleak.stderr.wait_for("memleak to pick up a process joining a child", |line| line.starts_with(&joined));
    for leaker in [&mut direct, &mut in_child, &mut in_grandchild, &mut latecomer, &mut outsider] {
        leaker.go();
    }
    memleak.signal(libc::SIGINT);
    let (status, lines) = memleak.finish();
    assert!(status.success());
    for leaker in [&direct, &in_child, &in_grandchild, &latecomer] {
        let report = lines
            .iter()
            .find(|line| line["pid"] == leaker.pid())
            .unwrap_or_else(|| panic!("a report for pid {}: {lines:#?}", leaker.pid()));
        assert_eq!(report["total_bytes"], 17_264, "{report:#}");
        assert_eq!(usage_at(report, "leak_malloc", "malloc"), (3000, 3), "{report:#}");
    }
    assert!(
        lines.iter().all(|line| line["pid"] != outsider.pid()),
        "a process outside the cgroup is not reported"
    );
    let total: &Value = lines.iter().find(|line| line.get("cgroup").is_some()).expect("a cgroup total");
    assert_eq!(total["processes"], 4, "{total}");
    assert_eq!(total["total_bytes"], 4 * 17_264, "{total}");
    for leaker in [direct, in_child, in_grandchild, latecomer, outsider] {
        leaker.exit();
    }
}

/// The wrong directory (a slice with no processes, a pod already gone)
/// must not look like a program that allocates nothing.
#[test]
fn a_cgroup_without_processes_says_so() {
    let slice = TestCgroup::new();
    let _empty_child = slice.child("empty");
    let path = slice.arg();
    let (code, stderr) = memleak_tests::run_to_end(&["--cgroup", path, "1", "1"]);
    assert_eq!(code, Some(0), "{stderr}");
    let expected = format!(
        "memleak: warn: no processes to trace in {path} or its descendant cgroups: tracing those that join it\n"
    );
    assert!(stderr.contains(&expected), "expected {expected:?} in: {stderr}");
}

#[test]
fn a_path_that_is_not_a_cgroup() {
    let (code, stderr) = memleak_tests::run_to_end(&["--cgroup", "/tmp"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("memleak: error: /tmp is not a cgroup v2 directory"), "{stderr}");
}

/// A cgroup removed and made again at the same path, as a container's is
/// when it restarts, is another cgroup with another id: its processes are
/// traced, and the BPF filter that keeps the cgroup's tasks must take the
/// new id, or each of them counts nothing.
#[test]
fn a_cgroup_made_again_at_its_path_is_followed() {
    let cgroup = TestCgroup::new();
    let path = cgroup.arg();
    let mut memleak = Memleak::start(&["--cgroup", path, "--format", "json", "-T", "100", "3600"]);
    memleak.wait_attached();
    let join = |leaker: &mut Leaker, memleak: &mut Memleak| {
        cgroup.join(leaker.pid());
        let joined = format!("memleak: pid {} is in the cgroup", leaker.pid());
        memleak.stderr.wait_for("memleak to pick the process up", |line| line.starts_with(&joined));
        leaker.go();
    };
    let mut before = Leaker::start_waiting(&["all"]);
    join(&mut before, &mut memleak);
    let pid_before = before.pid();
    before.exit();
    let report = format!("\"pid\":{pid_before},");
    memleak.stdout.wait_for("the final report of the first process", |line| line.contains(&report));
    for round in 0..2 {
        let old_id =
            fs::metadata(cgroup.path()).map(|metadata| std::os::unix::fs::MetadataExt::ino(&metadata));
        fs::remove_dir(cgroup.path()).expect("remove the empty cgroup");
        fs::create_dir(cgroup.path()).expect("make the cgroup again");
        let new_id =
            fs::metadata(cgroup.path()).map(|metadata| std::os::unix::fs::MetadataExt::ino(&metadata));
        assert_ne!(old_id.ok(), new_id.ok(), "round {round}: a cgroup made again has another id");
        let mut after = Leaker::start_waiting(&["all"]);
        join(&mut after, &mut memleak);
        let pid = after.pid();
        after.exit();
        let report = format!("\"pid\":{pid},");
        let line =
            memleak.stdout.wait_for("the final report of a process of the cgroup made again", |line| {
                line.contains(&report)
            });
        let report: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(report["total_bytes"], 17_264, "round {round}: {report:#}");
        assert_eq!(usage_at(&report, "leak_malloc", "malloc"), (3000, 3), "round {round}: {report:#}");
    }
    memleak.signal(libc::SIGINT);
    assert!(memleak.finish().0.success());
}

/// A file of the cgroup file system is on cgroup2 and has an inode, but
/// no task is ever in it: taken for a cgroup, it traced nothing.
#[test]
fn a_file_of_a_cgroup_is_not_a_cgroup() {
    let cgroup = TestCgroup::new();
    let file = cgroup.path().join("cgroup.procs");
    let file = file.to_str().unwrap();
    let (code, stderr) = memleak_tests::run_to_end(&["--cgroup", file, "1", "1"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with(&format!("memleak: error: {file} is not a cgroup v2 directory")), "{stderr}");
}

#[test]
fn memleak_in_the_cgroup_it_traces_never_traces_itself() {
    // With --trace, each event memleak printed would make more: it must
    // leave itself out, and say so.
    let cgroup = TestCgroup::new();
    let path = cgroup.arg();
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {path}/cgroup.procs && exec \"$0\" \"$@\""))
        .arg(memleak_tests::memleak_binary())
        .args(["-t", "--cgroup", path, "--format", "json", "2", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let own = stderr
        .lines()
        .find_map(|line| line.strip_prefix("memleak: warn: not tracing pid "))
        .and_then(|rest| rest.strip_suffix(" of the cgroup: it is memleak itself"))
        .unwrap_or_else(|| panic!("memleak says it leaves itself out: {stderr}"));
    let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let own: u32 = own.parse().unwrap();
    assert!(lines.iter().all(|line| line["pid"] != own), "memleak's own events or report: {lines:#?}");
    assert!(lines.iter().any(|line| line["cgroup"].is_string()), "the cgroup's total: {lines:#?}");
}

#[test]
fn only_the_cgroups_processes_get_breakpoints_in_a_libc_the_host_shares() {
    const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    let cgroup = TestCgroup::new();
    let member = Leaker::start_waiting(&["all"]);
    let outsider = Leaker::start_waiting(&["all"]);
    cgroup.join(member.pid());
    let path = cgroup.arg();
    let mut memleak = Memleak::start(&["--cgroup", path, "--format", "json", "-T", "100", "3600"]);
    memleak.wait_attached();
    let links = multi_links(memleak.child.id());
    assert!(!links.is_empty() && links.iter().all(|link| link.pid == member.pid()), "{links:#?}");
    for offset in links.iter().flat_map(|link| &link.offsets) {
        assert_eq!(byte_in_process(member.pid(), LIBC, *offset), 0xcc, "int3 at {offset:#x}");
        // The same libc file, mapped by a process outside the cgroup: untouched.
        assert_eq!(
            byte_in_process(outsider.pid(), LIBC, *offset),
            byte_in_file(LIBC, *offset),
            "{offset:#x}"
        );
    }
    memleak.signal(libc::SIGINT);
    assert!(memleak.finish().0.success());
}
