//! memleak under the mishaps of real use: commands that cannot start, a
//! memleak killed at the worst moment, programs that exec, huge numbers.

use std::{fs, os::unix::fs::PermissionsExt as _, path::Path, thread, time::Duration};

use memleak_tests::{fixture, run_to_end, tempdir::TempDir, Memleak, PATIENCE};

/// The one-character state of process `pid` in /proc/PID/stat, if it is
/// still there.
fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// The children of process `pid`, over all its threads.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|children| {
            children.split_whitespace().filter_map(|child| child.parse().ok()).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn a_command_that_cannot_be_executed_ends_the_run_with_the_exec_error() {
    let dir = TempDir::new("exec-error");
    // An ELF program memleak can plan probes for, but that the kernel
    // refuses to run: not executable, and open for writing.
    let not_executable = dir.path().join("not-executable");
    fs::copy(fixture("leaker"), &not_executable).unwrap();
    fs::set_permissions(&not_executable, fs::Permissions::from_mode(0o644)).unwrap();
    let (code, stderr) = run_to_end(&["-c", not_executable.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("Permission denied"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");

    let busy = dir.path().join("busy");
    fs::copy(fixture("leaker"), &busy).unwrap();
    let _writer = fs::OpenOptions::new().append(true).open(&busy).unwrap();
    let (code, stderr) = run_to_end(&["-c", busy.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("Text file busy"), "{stderr}");
}

#[test]
fn a_command_dies_with_memleak_even_if_memleak_is_killed_before_it_runs() {
    // Killed as soon as it has forked the command, while it loads the
    // tracer: the command must not go on to run, untraced and orphaned.
    let mut memleak = Memleak::start(&["-c", "sleep 600"]);
    let memleak_pid = memleak.child.id();
    let deadline = std::time::Instant::now() + PATIENCE;
    let command = loop {
        // Not the reaper memleak starts to end the command's processes.
        let command = children_of(memleak_pid).into_iter().find(|&child| {
            fs::read(format!("/proc/{child}/cmdline")).is_ok_and(|cmdline| {
                !cmdline.split(|&byte| byte == 0).any(|arg| arg == b"--internal-command-reaper")
            })
        });
        if let Some(child) = command {
            break child;
        }
        assert!(std::time::Instant::now() < deadline, "memleak never forked the command");
        thread::sleep(Duration::from_millis(1));
    };
    memleak.signal(libc::SIGKILL);
    memleak.child.wait().unwrap();
    while process_state(command).is_some_and(|state| state != 'Z') {
        assert!(
            std::time::Instant::now() < deadline,
            "the command (pid {command}, {:?}) outlived memleak",
            fs::read_link(format!("/proc/{command}/exe"))
        );
        thread::sleep(Duration::from_millis(20));
    }
    assert!(!Path::new(&format!("/proc/{command}/exe")).exists() || process_state(command) == Some('Z'));
}

#[test]
fn numbers_too_large_are_refused_before_anything_is_attached() {
    let pid = std::process::id().to_string();
    let (code, stderr) = run_to_end(&["-p", &pid, "18446744073709551615"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("the interval must be at most 31536000 seconds"), "{stderr}");
    let (code, stderr) = run_to_end(&["-p", &pid, "--max-stacks", "134217727"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("134217727 is not in 1..=10000000"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// A memory cgroup (v1, as on these machines, or v2) of `limit` bytes
/// under this process's own; removed on drop.
struct MemoryCgroup(std::path::PathBuf);

impl MemoryCgroup {
    fn new(name: &str, limit: u64) -> Self {
        let own = fs::read_to_string("/proc/self/cgroup").unwrap();
        let v1 = own.lines().find_map(|line| line.split_once(":memory:").map(|(_, path)| path.to_owned()));
        let (path, limit_file) = match v1 {
            Some(own) => (
                Path::new("/sys/fs/cgroup/memory").join(own.trim_start_matches('/')),
                "memory.limit_in_bytes",
            ),
            None => (Path::new("/sys/fs/cgroup").to_path_buf(), "memory.max"),
        };
        let path = path.join(format!("{name}-{}", std::process::id()));
        fs::create_dir_all(&path)
            .unwrap_or_else(|error| panic!("create memory cgroup {}: {error}", path.display()));
        fs::write(path.join(limit_file), limit.to_string()).unwrap();
        Self(path)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.0);
    }
}

#[test]
fn a_map_the_kernel_refuses_is_explained_with_the_memory_asked_and_the_flag() {
    // 100 million tracked allocations: a bucket array of 2 GiB at start,
    // which a memory cgroup of 300 MiB cannot hold.
    let cgroup = MemoryCgroup::new("memleak-map-refused", 300 << 20);
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"", cgroup.0.display()))
        .arg(memleak_tests::memleak_binary())
        .args(["-p", &std::process::id().to_string(), "--max-allocs", "100000000", "1", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim(),
        "memleak: error: the kernel refused BPF map ALLOCATIONS (Cannot allocate memory): its 100000000 \
         entries ask for 2.0 GiB of kernel memory at start, up to 10.9 GiB when full; lower --max-allocs"
    );
}

#[test]
fn a_target_that_exits_while_memleak_attaches_is_named_as_the_cause() {
    let mut target = std::process::Command::new("sleep").arg("600").spawn().unwrap();
    let pid = target.id().to_string();
    // -v says when each program is loaded: the target is planned for by
    // then, and its probes are placed only after the last.
    let mut memleak = Memleak::start(&["-v", "-p", &pid, "1", "1"]);
    memleak.stderr.wait_for("the first program loaded", |line| line.contains("verified and loaded"));
    target.kill().unwrap();
    target.wait().unwrap();
    let status = memleak.child.wait().unwrap();
    let stderr = memleak.stderr.rest();
    assert_eq!(status.code(), Some(2), "{stderr:#?}");
    let error = stderr.iter().find(|line| line.starts_with("memleak: error: ")).unwrap();
    assert_eq!(error, &format!("memleak: error: pid {pid} exited while memleak was attaching to it"));
}

/// A `sleep 600` with pid `pid`: the kernel gives the pid after
/// `ns_last_pid` to the next fork, unless another fork of the machine's
/// takes it first; then again.
fn impostor_with_pid(pid: u32) -> std::process::Child {
    for _ in 0..1000 {
        fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).expect("write ns_last_pid");
        let mut child = std::process::Command::new("sleep").arg("600").spawn().unwrap();
        if child.id() == pid {
            return child;
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
    panic!("no process could be given pid {pid}");
}

#[test]
fn a_pid_reused_between_the_check_and_the_attach_is_refused_not_traced() {
    let target = std::process::Command::new("sleep").arg("600").spawn().unwrap();
    let pid = target.id();
    let pid_text = pid.to_string();
    let mut memleak = Memleak::start(&["-v", "-p", &pid_text, "--format", "json", "1", "1"]);
    // Checked and planned by then; its probes are placed once the
    // programs are loaded, tens of milliseconds later.
    memleak
        .stderr
        .wait_for("memleak to load its programs", |line| line.starts_with("memleak: debug: uprobes: "));
    let mut target = target;
    target.kill().unwrap();
    target.wait().unwrap();
    let mut impostor = impostor_with_pid(pid);
    let status = memleak.child.wait().unwrap();
    let stderr = memleak.stderr.rest();
    impostor.kill().unwrap();
    impostor.wait().unwrap();
    assert_eq!(status.code(), Some(2), "the impostor was traced: {stderr:#?}");
    let errors: Vec<&String> = stderr.iter().filter(|line| line.starts_with("memleak: error: ")).collect();
    // Which of the two depends on whether the impostor was there before
    // the probes were placed: it is, but for a busy machine.
    let replaced = format!(
        "memleak: error: pid {pid} exited before memleak attached to it, and another process has its pid \
         now: that one is not traced"
    );
    let exited = format!("memleak: error: pid {pid} exited while memleak was attaching to it");
    assert!(errors.len() == 1 && (*errors[0] == replaced || *errors[0] == exited), "{stderr:#?}");
}

#[test]
fn cap_bpf_and_cap_perfmon_alone_trace_a_process_through_multi_uprobe_links() {
    let leaker = memleak_tests::fixture("leaker");
    let output = std::process::Command::new("setpriv")
        .arg("--bounding-set=-all,+bpf,+perfmon")
        .arg(memleak_tests::memleak_binary())
        .args(["-c", &format!("{} all --exit", leaker.display()), "--format", "json", "-T", "1", "3600"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        (report["total_bytes"].as_u64(), report["total_allocations"].as_u64()),
        (Some(17_264), Some(15))
    );
}

#[test]
fn cap_bpf_and_cap_perfmon_alone_are_told_what_perf_event_uprobes_need() {
    let target = std::process::id().to_string();
    let output = std::process::Command::new("setpriv")
        .arg("--bounding-set=-all,+bpf,+perfmon")
        .arg(memleak_tests::memleak_binary())
        .args(["-p", &target, "1", "1"])
        .env(memleak_tests::PERF_EVENT_UPROBES, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr,
        "memleak: error: tracing a process takes root or CAP_SYS_ADMIN here: MEMLEAK_PERF_EVENT_UPROBES is \
         set, and perf-event uprobes need it (the kernel takes CAP_BPF, CAP_PERFMON and CAP_SYSLOG)\n"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[test]
fn memleak_never_traces_itself_nor_with_trace_the_reader_of_its_output() {
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg("exec \"$0\" -p $$ 1 1")
        .arg(memleak_tests::memleak_binary())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.ends_with(": it is memleak itself\n"), "{stderr}");

    // memleak's stdout is a pipe `cat` reads.
    let mut reader = std::process::Command::new("cat")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let reader_pid = reader.id().to_string();
    let run = |args: &[&str], reader: &mut std::process::Child| {
        let pipe = std::os::fd::AsFd::as_fd(reader.stdin.as_ref().unwrap()).try_clone_to_owned().unwrap();
        std::process::Command::new(memleak_tests::memleak_binary()).args(args).stdout(pipe).output().unwrap()
    };
    let traced = run(&["-t", "-p", &reader_pid, "1", "1"], &mut reader);
    let stderr = String::from_utf8_lossy(&traced.stderr);
    assert_eq!(traced.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "memleak: error: memleak does not trace pid {reader_pid}: it reads memleak's output, so tracing \
             it with --trace would feed on itself\n"
        )
    );
    // Without --trace, a report now and then is no loop.
    let reported = run(&["-p", &reader_pid, "1", "1"], &mut reader);
    assert!(reported.status.success(), "{}", String::from_utf8_lossy(&reported.stderr));
    drop(reader.stdin.take());
    reader.wait().unwrap();
}

#[test]
fn an_exec_closes_the_old_programs_books_and_the_new_program_is_traced() {
    let mut leaker = memleak_tests::Leaker::start_waiting(&["all", "--then-exec"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "3600"]);
    memleak.wait_attached();
    leaker.go();
    // The next line makes it exec; the new program says "ready" again.
    leaker.send("exec", "ready");
    memleak.stderr.wait_for("the new program to be traced", |line| {
        line.starts_with(&format!("memleak: pid {pid} now runs "))
    });
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(reports.len(), 2, "the old program's last report, then the new one's: {reports:#?}");
    for report in &reports {
        // Each program leaked 3 blocks of 1000 bytes from leak_malloc:
        // none of the old program's are left over in the new one's books.
        assert_eq!(memleak_tests::usage_at(report, "leak_malloc", "malloc"), (3000, 3), "{report:#}");
    }
    leaker.exit();
}

#[test]
fn o_opens_only_regular_files() {
    // /dev/zero would be read until memory ran out.
    let mut target = std::process::Command::new("sleep").arg("600").spawn().unwrap();
    let pid = target.id().to_string();
    let (code, stderr) = run_to_end(&["-p", &pid, "-O", "/dev/zero", "1", "1"]);
    target.kill().unwrap();
    target.wait().unwrap();
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(stderr, "memleak: error: cannot read /dev/zero: not a regular file\n");
}
