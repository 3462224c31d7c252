//! Reports that tell the truth on real programs: what the allocator maps
//! for itself (even from a free), thread stacks, reservations that are not
//! memory, the processes a command forks, and what sampling counts.

use memleak_tests::{
    frame_functions, marker_line, static_leaker, trace_command, trace_program, usage_at, Memleak,
};
use serde_json::Value;

/// The stacks of a report that hold mmap regions of `kind`.
fn mapped<'a>(report: &'a Value, kind: &str) -> Vec<&'a Value> {
    report["stacks"].as_array().unwrap().iter().filter(|stack| stack["mapping"] == kind).collect()
}

fn bytes(stacks: &[&Value]) -> u64 {
    stacks.iter().map(|stack| stack["bytes"].as_u64().unwrap()).sum()
}

/// How many regions `stacks` hold: a region cut in pieces counts each.
fn regions(stacks: &[&Value]) -> u64 {
    stacks.iter().map(|stack| stack["allocations"].as_u64().unwrap()).sum()
}

#[test]
fn an_arena_that_free_maps_is_the_allocators() {
    // glibc 2.36: a thread whose first allocator call is free sets up its
    // tcache and so an arena, which alloc_new_heap maps: 64 MiB.
    let report = trace_command("free-in-thread", &[]);
    assert_eq!(mapped(&report, "mmap"), Vec::<&Value>::new(), "{report:#}");
    assert_eq!(report["hidden_mappings"]["allocator_bytes"], 64 << 20, "{report:#}");
    let all = trace_command("free-in-thread", &["--all-mmaps"]);
    let arena = mapped(&all, "allocator_mmap");
    assert_eq!(bytes(&arena), 64 << 20, "{all:#}");
    let frames = arena[0]["frames"].as_array().unwrap();
    assert!(
        frames.iter().any(|frame| frame["function"] == "free_it"),
        "mapped from the thread's free: {all:#}"
    );
}

#[test]
fn thread_stacks_of_a_static_glibc_program_are_not_leaks() {
    // In a static binary pthread_create is __pthread_create_2_1, in the
    // program itself.
    let reports = trace_program(&static_leaker(), "threads", &[]);
    let report = reports.last().expect("a final report");
    assert!(report["allocator"].as_str().unwrap().ends_with("leaker-static"), "{report:#}");
    assert_eq!(mapped(report, "mmap"), Vec::<&Value>::new(), "{report:#}");
    let hidden = report["hidden_mappings"]["thread_stack_bytes"].as_u64().unwrap();
    assert!(hidden >= 3 * (8 << 20) && hidden.is_multiple_of(3), "three default thread stacks: {hidden}");
}

#[test]
fn reserved_address_space_is_not_memory_until_made_usable() {
    // Seen from the kernel as it can (fentry programs at the system calls,
    // or the mmap_lock tracepoint where it has no ftrace), from the
    // tracepoint, and through uprobes, as on kernels with neither.
    let ways = [&[][..], &[("MEMLEAK_MAPPING_TRACEPOINT", "1")][..], &[("MEMLEAK_MAPPING_UPROBES", "1")][..]];
    for env in ways {
        let report = memleak_tests::trace_fixture_output_with_env("leaker", "reservations", &[], env)
            .pop()
            .expect("a final report");
        let usable = mapped(&report, "mmap");
        let at = |marker| -> Vec<&Value> {
            let line = marker_line("leaker", marker);
            usable.iter().copied().filter(|stack| stack["frames"][0]["line"] == line).collect()
        };
        // 256 pages reserved PROT_NONE, 2 of them opened with mprotect; an
        // mprotect that fails (EINVAL) opens none of 4 more.
        let opened = at("reserve");
        assert_eq!((bytes(&opened), regions(&opened)), (2 * 4096, 1), "{env:?}: {report:#}");
        // 4 pages, one taken back and given again, one taken back for good:
        // 3 in two pieces, around the one taken.
        let taken_back = at("take-back");
        assert_eq!((bytes(&taken_back), regions(&taken_back)), (3 * 4096, 2), "{env:?}: {report:#}");
        assert_eq!(usable.len(), 2, "{env:?}: {report:#}");
        assert_eq!(report["hidden_mappings"]["reserved_bytes"], 255 * 4096, "{env:?}: {report:#}");
    }
    let all = trace_command("reservations", &["--all-mmaps"]);
    assert_eq!(bytes(&mapped(&all, "reservation")), 255 * 4096, "{all:#}");
    assert_eq!(all["hidden_mappings"]["reserved_bytes"], 0);
}

/// Set by `cargo xtask kernels` in Debian's kernels from 6.0, which take
/// fentry programs: there memleak must use them. Elsewhere the kernel may
/// refuse them (this project's CI host, a microVM's kernel under lockdown,
/// says EPERM), and uprobes serve.
const KERNEL_TAKES_FENTRY: &str = "MEMLEAK_TESTS_KERNEL_TAKES_FENTRY";

/// How one run of memleak on the fixture's reservations saw munmap and
/// mprotect.
struct MappingCallsSeen {
    /// What -v said of the way.
    said: String,
    /// (function, kernel hook) of each function the kernel saw.
    hooks: Vec<(String, String)>,
    reserved_bytes: Value,
}

/// memleak -v -c on `leaker reservations`, with `env`.
fn mapping_calls_seen(env: &[(&str, &str)]) -> MappingCallsSeen {
    let command = format!("{} reservations", memleak_tests::fixture("leaker").display());
    let dir = memleak_tests::workspace_root().join("target/fixtures/seen-in-kernel");
    std::fs::create_dir_all(&dir).unwrap();
    // Named by this process too: the kernels' VMs share target/fixtures.
    let stats_file = dir.join(format!("stats-{}-{}.jsonl", std::process::id(), env.len()));
    let stats_path = stats_file.to_str().unwrap();
    let args = ["-v", "-c", &command, "--format", "json", "--stats", stats_path, "-T", "1000", "3600"];
    let mut memleak = Memleak::start_with_env(&args, env);
    let said = memleak.stderr.wait_for("the way chosen", |line| {
        line.starts_with("memleak: debug: munmap and mprotect seen from the kernel")
            || line.starts_with("memleak: debug: munmap and mprotect probed in the C library")
    });
    let by_uprobes = said.contains("probed in the C library");
    memleak.stderr.wait_for("the fixture to finish", |line| {
        let probed = line.contains("uprobe on munmap") || line.contains("uprobe on mprotect");
        assert!(by_uprobes || !probed, "{line}");
        line == "done"
    });
    memleak.close_stdin();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let report = reports.last().expect("a final report");
    let records = std::fs::read_to_string(&stats_file).unwrap();
    let probes: Value = records
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .find(|record| record["event"] == "probes")
        .expect("a probes record");
    let hooks = probes["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|probe| {
            Some((probe["function"].as_str()?.to_owned(), probe["kernel_hook"].as_str()?.to_owned()))
        })
        .collect();
    MappingCallsSeen { said, hooks, reserved_bytes: report["hidden_mappings"]["reserved_bytes"].clone() }
}

#[test]
fn munmap_and_mprotect_are_seen_from_the_kernel_where_it_can() {
    // fentry programs at their system calls where the kernel takes them:
    // the C library's functions keep no uprobe, --stats names the hooks,
    // and what the kernel saw counts as what uprobes saw.
    let hooks = |names: [&str; 2]| {
        vec![("munmap".to_owned(), names[0].to_owned()), ("mprotect".to_owned(), names[1].to_owned())]
    };
    let default = mapping_calls_seen(&[]);
    if std::env::var_os(KERNEL_TAKES_FENTRY).is_some() || !default.said.contains("probed in the C library") {
        assert_eq!(
            default.said,
            "memleak: debug: munmap and mprotect seen from the kernel: fentry at their system calls"
        );
        let wrappers = if cfg!(target_arch = "aarch64") {
            ["__arm64_sys_munmap", "__arm64_sys_mprotect"]
        } else {
            ["__x64_sys_munmap", "__x64_sys_mprotect"]
        };
        assert_eq!(default.hooks, hooks(wrappers));
    } else {
        // Refused (this project's CI host says EPERM): uprobes, which cost
        // only the traced process, not the tracepoint.
        assert!(default.said.contains(": not seen at their system calls: "), "{}", default.said);
        assert_eq!(default.hooks, []);
    }
    assert_eq!(default.reserved_bytes, 255 * 4096);
    // The tracepoint, asked for: where it passes (mm, write, success), as
    // from 6.2; 6.1's builds a memory cgroup's path for every take of the
    // lock, and memleak keeps the uprobes there.
    let tracepoint = mapping_calls_seen(&[("MEMLEAK_MAPPING_TRACEPOINT", "1")]);
    if cfg!(target_arch = "aarch64") {
        // Its program knows x86-64's system call numbers only.
        assert!(tracepoint
            .said
            .ends_with("the mmap_lock tracepoint's program knows x86-64's system calls only"));
        assert_eq!(tracepoint.hooks, []);
    } else if tracepoint.said.contains("probed in the C library") {
        assert!(
            tracepoint.said.ends_with(
                "tracepoint builds a memory cgroup's path on every take of any process's mmap lock"
            ),
            "{}",
            tracepoint.said
        );
        assert_eq!(tracepoint.hooks, []);
    } else {
        assert_eq!(
            tracepoint.said,
            "memleak: debug: munmap and mprotect seen from the kernel: mmap_lock tracepoint"
        );
        assert_eq!(tracepoint.hooks, hooks(["mmap_lock_acquire_returned"; 2]));
    }
    assert_eq!(tracepoint.reserved_bytes, 255 * 4096);
}

/// (child, parent) from "memleak: tracing pid CHILD, forked by pid PARENT".
fn forked(line: &str) -> (u64, u64) {
    let words: Vec<&str> = line.split([' ', ',']).collect();
    (words[3].parse().unwrap(), words[8].parse().unwrap())
}

/// The last report of process `pid`.
fn final_report(reports: &[Value], pid: u64) -> &Value {
    reports.iter().rev().find(|report| report["pid"] == pid).unwrap_or_else(|| panic!("no report of {pid}"))
}

/// Runs `leaker forks` under memleak -c with `extra` flags: the child
/// leaks 3 x 3000 bytes once a line arrives, after `before_go` has seen
/// memleak's stderr. Returns every report and the stderr lines.
fn trace_forks(extra: &[&str], before_go: &str) -> (Vec<Value>, String) {
    let command = format!("{} forks", memleak_tests::fixture("leaker").display());
    let mut args = vec!["-c", &command, "--format", "json", "-T", "1000", "3600"];
    args.extend_from_slice(extra);
    let mut memleak = Memleak::start(&args);
    let seen = memleak.stderr.wait_for(before_go, |line| line.contains(before_go));
    std::io::Write::write_all(memleak.stdin.as_mut().unwrap(), b"go\n").unwrap();
    memleak.stderr.wait_for("the parent to finish", |line| line == "done");
    memleak.close_stdin();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    (reports, seen)
}

#[test]
fn a_command_is_followed_into_the_processes_it_forks() {
    let (reports, followed) = trace_forks(&[], "forked by pid");
    // "memleak: tracing pid CHILD, forked by pid PARENT"
    let (child, parent) = forked(&followed);
    let final_of = |pid: u64| final_report(&reports, pid);
    let child_report = final_of(child);
    assert_eq!(usage_at(child_report, "forks", "child-leak"), (9000, 3), "{child_report:#}");
    assert_eq!(child_report["total_bytes"], 9000, "{child_report:#}");
    assert_eq!(child_report["health"]["allocations"], 3);
    let parent_report = final_of(parent);
    assert_eq!(usage_at(parent_report, "forks", "parent-leak"), (1000, 1), "{parent_report:#}");
    assert_eq!(usage_at(parent_report, "forks", "child-leak"), (0, 0), "{parent_report:#}");
}

#[test]
fn no_follow_forks_traces_the_command_alone() {
    let (reports, _) = trace_forks(&["--no-follow-forks"], "child ready");
    let pids: std::collections::BTreeSet<String> =
        reports.iter().map(|report| report["pid"].to_string()).collect();
    assert_eq!(pids.len(), 1, "{reports:#?}");
    let report = reports.last().unwrap();
    assert_eq!(report["total_bytes"], 1000, "{report:#}");
}

#[test]
fn sampling_says_what_each_figure_counts() {
    // 10,001 mallocs and 10,000 frees: every call is seen, one allocation
    // in 10 is recorded, every free is looked up.
    let report = trace_command("churn", &["-s", "10"]);
    let health = &report["health"];
    assert_eq!((health["allocations"].as_u64(), health["frees"].as_u64()), (Some(10_001), Some(10_000)));
    let sampled = health["recorded_allocations"].as_u64().unwrap();
    assert!((500..2000).contains(&sampled), "about 1,000 sampled: {sampled}");
    let command = format!("{} churn --exit", memleak_tests::fixture("leaker").display());
    let output = std::process::Command::new(memleak_tests::memleak_binary())
        .args(["-c", &command, "-s", "10", "3600"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run memleak");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout);
    let seen = text.lines().find(|line| line.starts_with("Seen: ")).unwrap_or_else(|| panic!("{text}"));
    assert!(seen.starts_with("Seen: 10001 allocations ("), "{seen}");
    assert!(seen.contains(" sampled, 1 in 10), 10000 frees,"), "{seen}");
}

#[test]
fn a_go_program_without_cgo_is_told_why_there_is_nothing_to_trace() {
    let program = memleak_tests::go_program("go-static");
    let (code, stderr) = memleak_tests::run_to_end(&["-c", &program.display().to_string()]);
    assert_eq!(code, Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("is a Go program without cgo: Go allocates through its own runtime"),
        "{stderr}"
    );
}

#[test]
fn a_cgo_programs_c_leaks_are_found_with_the_go_code_that_called_c() {
    let reports = trace_program(&memleak_tests::go_program("go-cgo"), "", &[]);
    let report = reports.last().expect("a final report");
    let stacks_through = |function: &str| -> Vec<&Value> {
        let stacks = memleak_tests::stacks_through(report, function);
        stacks.into_iter().filter(|stack| stack["mapping"].is_null()).collect()
    };
    // 30 goroutines, each leaking 500 bytes in C: one call path, one
    // stack, walked from the system stack back onto the goroutine's.
    let leaks = stacks_through("c_leak");
    assert_eq!(
        (leaks.len(), bytes(&leaks), leaks[0]["allocations"].as_u64()),
        (1, 15_000, Some(30)),
        "{report:#}"
    );
    let frames = frame_functions(leaks[0]);
    let after_switch = frames.iter().position(|name| *name == "runtime.asmcgocall").expect("the switch") + 1;
    assert_eq!(
        frames[after_switch..],
        // main's second closure, the goroutine's body.
        ["main._Cfunc_c_leak", "main.main.func2", "runtime.goexit"],
        "{frames:?}"
    );
    assert!(leaks[0]["truncated"].is_null(), "{:#}", leaks[0]);
    assert_eq!(leaks[0]["culprit"]["function"], "c_leak");
    // 20 C strings from one Go line: past cgo's wrappers and the runtime,
    // the culprit is that line.
    let strings = stacks_through("main.remember");
    assert_eq!(
        (strings.len(), bytes(&strings), strings[0]["allocations"].as_u64()),
        (1, 260, Some(20)),
        "{report:#}"
    );
    let source =
        std::fs::read_to_string(memleak_tests::workspace_root().join("tests/fixtures/go-cgo/main.go"))
            .unwrap();
    let line = source.lines().position(|line| line.contains("ALLOC(cstring)")).unwrap() as u64 + 1;
    let culprit = &strings[0]["culprit"];
    assert_eq!((culprit["function"].as_str(), culprit["line"].as_u64()), (Some("main.remember"), Some(line)));
    assert_eq!(frame_functions(strings[0]).last(), Some(&"runtime.goexit"), "{:#}", strings[0]);
    // 8 goroutines at once, 500 C strings each, from 0 to 39 calls of
    // `deep` down: every one at its depth, each stack whole.
    let mut expected = [0u64; 40];
    for goroutine in 0..8 {
        for round in 0..500 {
            expected[(7 * goroutine + round) % 40] += 1;
        }
    }
    let mut found = [0u64; 40];
    for stack in stacks_through("main.deep") {
        let frames = frame_functions(stack);
        assert_eq!(frames.last(), Some(&"runtime.goexit"), "{frames:?}");
        assert!(stack["truncated"].is_null() && stack["culprit"]["function"] == "main.deep", "{stack:#}");
        let depth = frames.iter().filter(|name| **name == "main.deep").count() - 1;
        found[depth] += stack["allocations"].as_u64().unwrap();
        assert_eq!(stack["bytes"], 11 * stack["allocations"].as_u64().unwrap());
    }
    assert_eq!(found, expected);
    // Go reserves its heap's address space up front: hundreds of MB that
    // no page backs.
    let reserved = report["hidden_mappings"]["reserved_bytes"].as_u64().unwrap();
    assert!(reserved > 256 << 20, "{report:#}");
    assert_eq!(mapped(report, "reservation"), Vec::<&Value>::new());
    let shown = bytes(&mapped(report, "mmap"));
    assert!(shown < 128 << 20, "only mappings that can be touched: {shown} bytes");
}

/// Requests sent to nginx.
const NGINX_REQUESTS: u64 = 50;

/// Debian's nginx, as its package starts it: the first process forks the
/// master and exits (daemon mode), and the master forks the worker that
/// serves every request.
#[test]
fn nginx_started_with_c_is_followed_into_its_worker() {
    let dir = memleak_tests::tempdir::TempDir::new("memleak-nginx");
    // A unix socket in the test's own directory: a TCP port picked free here could be
    // taken by another test before nginx binds it.
    let socket = dir.path().join("nginx.sock");
    let temp = |name: &str| format!("{name}_temp_path {}/{name};", dir.path().display());
    let config = format!(
        "worker_processes 1; pid {root}/nginx.pid; error_log {root}/error.log;\n\
         events {{ worker_connections 64; }}\n\
         http {{ access_log off; {} {} {} {} {}\n\
         server {{ listen unix:{socket}; location / {{ return 200 \"hello\\n\"; }} }} }}\n",
        temp("client_body"),
        temp("proxy"),
        temp("fastcgi"),
        temp("uwsgi"),
        temp("scgi"),
        root = dir.path().display(),
        socket = socket.display()
    );
    std::fs::write(dir.path().join("nginx.conf"), config).unwrap();
    let command = format!("/usr/sbin/nginx -p {0} -c {0}/nginx.conf", dir.path().display());
    let mut memleak = Memleak::start(&["-c", &command, "--format", "json", "-T", "100", "3600"]);
    let (master, first) =
        forked(&memleak.stderr.wait_for("the master", |line| line.contains("forked by pid")));
    let (worker, parent) =
        forked(&memleak.stderr.wait_for("the worker", |line| line.contains("forked by pid")));
    assert_eq!(parent, master, "the worker is the master's child");
    assert_ne!(first, master);
    for _ in 0..NGINX_REQUESTS {
        let mut connection = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        std::io::Write::write_all(&mut connection, b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut answer = String::new();
        std::io::Read::read_to_string(&mut connection, &mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    // memleak did not start the master: it goes on, and is stopped here.
    let master_pid = libc::pid_t::try_from(master).unwrap();
    // SAFETY: kill(2) on the nginx master this test started.
    unsafe { libc::kill(master_pid, libc::SIGTERM) };
    assert!(status.success());
    let final_of = |pid: u64| final_report(&reports, pid);
    let served = &final_of(worker)["health"];
    assert!(
        served["allocations"].as_u64().unwrap() >= NGINX_REQUESTS,
        "a pool per request at least: {served}"
    );
    assert!(served["frees"].as_u64().unwrap() >= NGINX_REQUESTS, "{served}");
    assert!(final_of(worker)["program"].as_str().unwrap().ends_with("/nginx"));
    assert_eq!(
        final_of(master)["health"]["allocations"].as_u64().map(|calls| calls < NGINX_REQUESTS),
        Some(true)
    );
}

#[test]
fn follow_forks_traces_the_children_of_a_running_process() {
    let mut leaker = memleak_tests::Leaker::start_waiting(&["forks"]);
    let pid = leaker.pid().to_string();
    let mut memleak =
        Memleak::start(&["-p", &pid, "--follow-forks", "--format", "json", "-T", "1000", "3600"]);
    memleak.wait_attached();
    leaker.send("go", "child ready");
    let (child, parent) =
        forked(&memleak.stderr.wait_for("the child", |line| line.contains("forked by pid")));
    assert_eq!(parent, u64::from(leaker.pid()));
    // The child reads this line, leaks and exits; then the parent is done.
    leaker.send("go", "done");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    assert!(status.success());
    let child_report = final_report(&reports, child);
    assert_eq!(usage_at(child_report, "forks", "child-leak"), (9000, 3), "{child_report:#}");
    let parent_report = final_report(&reports, parent);
    assert_eq!(usage_at(parent_report, "forks", "parent-leak"), (1000, 1), "{parent_report:#}");
    leaker.exit();
}
