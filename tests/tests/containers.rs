//! Targets whose files the host does not see where the target sees them:
//! a container made with namespaces and `pivot_root`, a chroot, a binary
//! deleted after it started. memleak goes through /proc/PID/root and
//! `/proc/PID/map_files`, never the host's view of the paths.

use std::{fs, process::Command};

use memleak_tests::{fixture, leaker_rootfs, tempdir::TempDir, usage_at, workspace_root, Leaker, Memleak};
use serde_json::Value;

/// Traces `leaker` (already started, waiting) with -p until it has run
/// `seed 3`, and returns the final report.
fn trace_seed(leaker: &mut Leaker, pid: u32) -> Value {
    let pid = pid.to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-o", "0", "-T", "100", "3600"]);
    memleak.wait_attached();
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    reports.last().cloned().expect("a final report")
}

/// fibonacci(3) leaks 5 blocks of 8 KiB.
fn assert_seed_leaks(report: &Value, module: &str) {
    assert_eq!(usage_at(report, "fibonacci", "fibonacci"), (5 * 8192, 5), "{report:#}");
    let stack =
        memleak_tests::stacks_at(report, "fibonacci", memleak_tests::marker_line("leaker", "fibonacci"))[0];
    assert_eq!(stack["frames"][0]["module"], module, "{stack}");
}

/// Starts /app/leaker seed 3 --wait in `rootfs`, in new mount and pid
/// namespaces under `pivot_root`, as a container runtime would.
fn start_in_container(rootfs: &TempDir) -> Leaker {
    start_program_in_container(rootfs, std::path::Path::new("/app/leaker"))
}

/// As `start_in_container`, the leaker at `program` in the container.
fn start_program_in_container(rootfs: &TempDir, program: &std::path::Path) -> Leaker {
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--pid", "--fork", "sh"])
        .arg(workspace_root().join("tests/fixtures/enter-container.sh"))
        .arg(rootfs.path())
        .arg(program)
        .args(["seed", "3", "--wait"]);
    Leaker::start_command(command)
}

#[test]
fn a_container_with_its_own_mount_and_pid_namespace() {
    let rootfs = leaker_rootfs();
    let mut leaker = start_in_container(&rootfs);
    let pid = leaker.leaker_pid();
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(maps.contains(" /app/leaker"), "the target sees its binary at /app/leaker: {maps}");
    assert!(!std::path::Path::new("/app/leaker").exists(), "and the host does not");
    let report = trace_seed(&mut leaker, pid);
    assert_seed_leaks(&report, "/app/leaker");
    assert_eq!(report["pid"], pid);
    assert_eq!(report["namespace_pid"], 1, "the pid the container sees");
    leaker.exit();
}

#[test]
fn a_container_whose_libc_is_not_the_hosts() {
    // The container's program runs on musl; the host has glibc.
    let rootfs = memleak_tests::rootfs_with(&memleak_tests::musl_leaker());
    let mut leaker = start_in_container(&rootfs);
    let pid = leaker.leaker_pid();
    let report = trace_seed(&mut leaker, pid);
    assert!(report["allocator"].as_str().unwrap().contains("musl"), "{}", report["allocator"]);
    assert_seed_leaks(&report, "/app/leaker");
    leaker.exit();
}

#[test]
fn a_chroot() {
    let rootfs = leaker_rootfs();
    let mut command = Command::new("chroot");
    command.arg(rootfs.path()).args(["/app/leaker", "seed", "3", "--wait"]);
    let mut leaker = Leaker::start_command(command);
    let pid = leaker.pid();
    let report = trace_seed(&mut leaker, pid);
    let module = format!("{}/app/leaker", rootfs.path().display());
    let stack =
        memleak_tests::stacks_at(&report, "fibonacci", memleak_tests::marker_line("leaker", "fibonacci"));
    assert!(!stack.is_empty(), "{report:#}");
    let seen = stack[0]["frames"][0]["module"].as_str().unwrap();
    // Without a mount namespace, maps names the file as the host sees it.
    assert!(seen == module || seen == "/app/leaker", "{seen}");
    assert_eq!(usage_at(&report, "fibonacci", "fibonacci"), (5 * 8192, 5), "{report:#}");
    assert_eq!(report["namespace_pid"], Value::Null, "same pid namespace as memleak");
    leaker.exit();
}

#[test]
fn a_binary_deleted_after_it_started() {
    let dir = TempDir::new("memleak-deleted");
    let binary = dir.path().join("leaker-deleted");
    memleak_tests::fixtures::copy_executable(&fixture("leaker"), &binary);
    let mut command = Command::new(&binary);
    command.args(["seed", "3", "--wait"]);
    let mut leaker = Leaker::start_command(command);
    fs::remove_file(&binary).unwrap();
    let pid = leaker.pid();
    let report = trace_seed(&mut leaker, pid);
    assert_seed_leaks(&report, binary.to_str().unwrap());
    leaker.exit();
}

#[test]
fn debug_info_shipped_inside_the_container_is_found_first() {
    // A stripped binary whose DWARF sits in a separate file that only the
    // container has, under its /usr/lib/debug, named by .gnu_debuglink.
    let work = TempDir::new("memleak-debuglink");
    let stripped = work.path().join("leaker");
    memleak_tests::fixtures::copy_executable(&fixture("leaker"), &stripped);
    let debug = memleak_tests::fixtures::split_debug_file(&stripped, "--strip-debug");
    let rootfs = memleak_tests::rootfs_with(&stripped);
    let debug_dir = rootfs.path().join("usr/lib/debug");
    fs::create_dir_all(&debug_dir).unwrap();
    fs::copy(&debug, debug_dir.join("leaker.debug")).unwrap();
    drop(work); // the host keeps no copy of the debug file
    let mut leaker = start_in_container(&rootfs);
    let pid = leaker.leaker_pid();
    let report = trace_seed(&mut leaker, pid);
    // File and line come from the container's debug file.
    assert_seed_leaks(&report, "/app/leaker");
    let stack =
        memleak_tests::stacks_at(&report, "fibonacci", memleak_tests::marker_line("leaker", "fibonacci"))[0];
    assert!(stack["frames"][0]["file"].as_str().unwrap().ends_with("tests/fixtures/leaker.c"), "{stack}");
    leaker.exit();
}

/// A FIFO on the host, which nothing reads: opening it to read would
/// block forever.
fn host_fifo(dir: &TempDir) -> std::path::PathBuf {
    let fifo = dir.path().join("fifo");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    fifo
}

#[test]
fn o_is_the_containers_file_and_its_links_stay_inside_it() {
    let rootfs = leaker_rootfs();
    let host = TempDir::new("memleak-host-side");
    let fifo = host_fifo(&host);
    // In the container, /evil.so leads to a path that is a FIFO only on
    // the host: resolved inside the container, it leads nowhere.
    std::os::unix::fs::symlink(&fifo, rootfs.path().join("evil.so")).unwrap();
    let mut leaker = start_in_container(&rootfs);
    let pid = leaker.leaker_pid();
    let pid_text = pid.to_string();
    let (code, stderr) = memleak_tests::run_to_end(&["-p", &pid_text, "-O", "/evil.so", "1", "1"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains(&format!("cannot read /evil.so in the root of pid {pid}")), "{stderr}");

    // The container's own libc, a copy the host's path does not lead to.
    let libc_path = fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .find_map(|line| {
            line.split_whitespace().nth(5).filter(|path| path.contains("libc.so")).map(str::to_owned)
        })
        .expect("the leaker maps libc");
    let mut memleak =
        Memleak::start(&["-p", &pid_text, "-O", &libc_path, "--format", "json", "-T", "100", "3600"]);
    let said = memleak.stderr.wait_for("memleak to attach", |line| line.starts_with("memleak: tracing "));
    assert!(said.contains(&format!("{libc_path} in the root of pid {pid}")), "{said}");
    leaker.go();
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    assert_eq!(usage_at(reports.last().unwrap(), "fibonacci", "fibonacci"), (5 * 8192, 5));
    leaker.exit();
}

#[test]
fn a_debug_file_that_leads_to_a_host_fifo_is_not_opened() {
    // A stripped leaker whose debug link the container answers with a link
    // to a path that, on the host, is a FIFO.
    let work = TempDir::new("memleak-debuglink-fifo");
    let stripped = work.path().join("leaker");
    let status = Command::new("objcopy")
        .args(["--strip-debug", "--add-gnu-debuglink=/dev/null"])
        .arg(fixture("leaker"))
        .arg(&stripped)
        .status()
        .unwrap();
    assert!(status.success());
    let rootfs = memleak_tests::rootfs_with(&stripped);
    let fifo = host_fifo(&work);
    for dir in ["app", "usr/lib/debug"] {
        fs::create_dir_all(rootfs.path().join(dir)).unwrap();
        std::os::unix::fs::symlink(&fifo, rootfs.path().join(dir).join("null")).unwrap();
    }
    let mut leaker = start_in_container(&rootfs);
    let pid = leaker.leaker_pid();
    // Would hang in the final report, reading the FIFO.
    let report = trace_seed(&mut leaker, pid);
    // Named from the symbol table: the debug file, file and line, is gone.
    let fibonacci: u64 = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| stack["frames"][0]["function"] == "fibonacci")
        .map(|stack| stack["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(fibonacci, 5 * 8192, "{report:#}");
    leaker.exit();
}

/// Counts the times a file is opened or read, by anyone, from now on
/// (inotify's `IN_OPEN` and `IN_ACCESS`).
struct AccessWatch {
    inotify: std::os::fd::OwnedFd,
}

impl AccessWatch {
    fn new(path: &std::path::Path) -> Self {
        use std::os::fd::{AsRawFd as _, FromRawFd as _};
        // SAFETY: no pointers; a fresh descriptor is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(fd >= 0, "inotify_init1: {}", std::io::Error::last_os_error());
        // SAFETY: a descriptor nobody else owns.
        let inotify = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path and an inotify descriptor.
        let watch = unsafe {
            libc::inotify_add_watch(inotify.as_raw_fd(), name.as_ptr(), libc::IN_OPEN | libc::IN_ACCESS)
        };
        assert!(watch >= 0, "inotify_add_watch {}: {}", path.display(), std::io::Error::last_os_error());
        Self { inotify }
    }

    /// The opens and reads seen so far.
    fn events(&self) -> usize {
        use std::os::fd::AsRawFd as _;
        let mut events = 0;
        let mut buffer = [0u8; 4096];
        loop {
            // SAFETY: reads into `buffer`, whose length is passed.
            let read =
                unsafe { libc::read(self.inotify.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len()) };
            let Ok(read) = usize::try_from(read) else { return events };
            // Each event is a header and a name, here empty (the watch is
            // on the file itself).
            events += read / size_of::<libc::inotify_event>();
        }
    }
}

#[test]
fn a_debug_link_never_leads_to_the_hosts_files() {
    // The container's program sits at a path the host has too, and its
    // .gnu_debuglink names a file that, beside that path, only the host
    // has: the program's own debug file, a match by CRC and build id, but
    // the host's, which a container must not make memleak open. Built
    // without .eh_frame, so that the unwinder looks for the debug file's
    // .debug_frame as well as the symbolizer for its lines.
    let work = TempDir::new("memleak-debuglink-build");
    let full = work.path().join("leaker");
    let built = Command::new("gcc")
        .args(["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"])
        .args(["-fno-asynchronous-unwind-tables", "-fno-unwind-tables", "-o"])
        .arg(&full)
        .arg(workspace_root().join("tests/fixtures/leaker.c"))
        .status()
        .unwrap();
    assert!(built.success());
    let stripped = full;
    let debug = memleak_tests::fixtures::split_debug_file(&stripped, "--strip-debug");
    let shared = TempDir::new("memleak-debuglink-shared");
    let sentinel = shared.path().join("leaker.debug");
    fs::copy(&debug, &sentinel).unwrap();
    let rootfs = memleak_tests::rootfs_with(&stripped);
    let program = shared.path().join("leaker");
    let in_rootfs = |path: &std::path::Path| rootfs.path().join(path.strip_prefix("/").unwrap());
    fs::create_dir_all(in_rootfs(shared.path())).unwrap();
    memleak_tests::fixtures::copy_executable(&stripped, &in_rootfs(&program));
    let watch = AccessWatch::new(&sentinel);

    let mut leaker = start_program_in_container(&rootfs, &program);
    let pid = leaker.leaker_pid();
    let report = trace_seed(&mut leaker, pid);
    leaker.exit();
    let fibonacci: Vec<&Value> = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|stack| stack["frames"][0]["function"] == "fibonacci")
        .collect();
    let bytes: u64 = fibonacci.iter().map(|stack| stack["bytes"].as_u64().unwrap()).sum();
    assert_eq!(bytes, 5 * 8192, "{report:#}");
    assert!(fibonacci.iter().all(|stack| stack["frames"][0]["line"].is_null()), "no lines: {report:#}");
    assert_eq!(watch.events(), 0, "memleak opened or read the host's {}", sentinel.display());

    // The same debug file shipped by the container, beside its program,
    // is used: lines and file.
    fs::copy(&debug, in_rootfs(&sentinel)).unwrap();
    let mut leaker = start_program_in_container(&rootfs, &program);
    let pid = leaker.leaker_pid();
    let report = trace_seed(&mut leaker, pid);
    leaker.exit();
    assert_seed_leaks(&report, program.to_str().unwrap());
    assert_eq!(watch.events(), 0, "memleak opened or read the host's {}", sentinel.display());
}
