//! One name per object, as the target sees it: the report header, the
//! frames' modules and the program agree, with -c as with -p.

use std::{path::Path, process::Command};

use memleak_tests::{fixture, tempdir::TempDir, Leaker, Memleak};
use serde_json::Value;

/// The modules of every frame of `report` whose function is `function`.
fn modules_of<'a>(report: &'a Value, function: &str) -> Vec<&'a str> {
    let frames =
        report["stacks"].as_array().unwrap().iter().flat_map(|stack| stack["frames"].as_array().unwrap());
    frames
        .filter(|frame| frame["function"] == function)
        .filter_map(|frame| frame["module"].as_str())
        .collect()
}

/// Asserts that `modules` are all `name`, and that there are some.
fn assert_all_named(modules: &[&str], name: &str, report: &Value) {
    assert!(
        !modules.is_empty() && modules.iter().all(|module| *module == name),
        "{modules:?} vs {name}: {report:#}"
    );
}

/// Runs memleak with `args` in `directory` until the traced fixture says
/// "done", then lets it exit; returns memleak's last report.
fn trace_in(directory: &Path, args: &[&str]) -> Value {
    let mut memleak = Memleak::start_in(directory, args);
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    memleak.close_stdin();
    let (status, mut reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    reports.pop().expect("a final report")
}

/// The path under which this test's own process maps libc: what the
/// kernel shows in /proc/PID/maps, the name -p reports use.
fn mapped_libc() -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let path = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libc.so.6"));
    path.expect("this test maps libc").to_owned()
}

#[test]
fn with_c_libc_is_named_as_the_process_maps_it() {
    // The dynamic loader's --list says /lib/x86_64-linux-gnu/libc.so.6 on
    // Debian, where /lib is a link to /usr/lib; the process maps
    // /usr/lib/x86_64-linux-gnu/libc.so.6.
    let leaker = fixture("leaker");
    let command = format!("{} all", leaker.display());
    let report = trace_in(Path::new("/"), &["-c", &command, "--format", "json", "-T", "1000", "3600"]);
    let libc = mapped_libc();
    assert_eq!(report["allocator"], libc.as_str(), "{report:#}");
    assert_all_named(&modules_of(&report, "__libc_start_call_main"), &libc, &report);
}

#[test]
fn a_program_started_by_a_relative_path_is_named_by_its_absolute_path() {
    // slot_alloc is its own allocator: the header named it ./slot_alloc.
    let program = fixture("slot_alloc");
    let directory = program.parent().unwrap();
    let args = ["-c", "./slot_alloc", "--symbols-prefix", "my_", "--format", "json", "-T", "1000", "3600"];
    let report = trace_in(directory, &args);
    let absolute = program.to_str().unwrap();
    assert_eq!(report["program"], absolute, "{report:#}");
    assert_eq!(report["allocator"], absolute, "{report:#}");
    assert_all_named(&modules_of(&report, "main"), absolute, &report);
}

#[test]
fn a_program_started_through_a_symlink_is_named_by_the_symlink() {
    // As Debian's redis-server, a link to redis-check-rdb: the process maps
    // the file the link leads to, but was started as the link.
    let directory = TempDir::new("memleak-alias");
    let alias = directory.path().join("leaker-alias");
    std::os::unix::fs::symlink(fixture("leaker"), &alias).unwrap();
    let alias = alias.to_str().unwrap();
    // With -c, from the PATH, as a shell would find it.
    let path = format!("{}:{}", directory.path().display(), std::env::var("PATH").unwrap_or_default());
    let mut memleak = Memleak::start_with_env(
        &["-c", "leaker-alias seed 2", "--format", "json", "-T", "1000", "3600"],
        &[("PATH", &path)],
    );
    memleak.stderr.wait_for("the fixture to finish", |line| line == "done");
    memleak.close_stdin();
    let (status, reports) = memleak.finish();
    assert!(status.success());
    let report = reports.last().unwrap();
    assert_eq!(report["program"], alias, "{report:#}");
    assert_all_named(&modules_of(report, "fibonacci"), alias, report);
    // With -p.
    let mut leaker = Leaker::start_command({
        let mut command = Command::new(alias);
        command.args(["seed", "2", "--wait"]);
        command
    });
    let (reports, _) = memleak_tests::trace_running(&mut leaker, &[]);
    let report = reports.last().unwrap();
    assert_eq!(report["program"], alias, "{report:#}");
    assert_all_named(&modules_of(report, "fibonacci"), alias, report);
    leaker.exit();
}

#[test]
fn debians_redis_server_is_named_redis_server() {
    use std::io::{Read as _, Write as _};
    // Found through the PATH, as a user or a service file starts it.
    let installed = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|directory| directory.join("redis-server"))
        .find(|candidate| candidate.exists())
        .expect("redis-server is installed by cargo xtask test");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut redis = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start redis-server");
    let mut connection = (0..100)
        .find_map(|_| {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .map_err(|_| std::thread::sleep(std::time::Duration::from_millis(50)))
                .ok()
        })
        .expect("redis-server listens");
    let pid = redis.id().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "-T", "1000", "3600"]);
    memleak.wait_attached();
    connection.write_all(b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n").unwrap();
    let mut reply = [0u8; 5];
    connection.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"+OK\r\n");
    memleak.signal(libc::SIGINT);
    let (status, reports) = memleak.finish();
    let _ = redis.kill();
    let _ = redis.wait();
    assert!(status.success());
    let report = reports.last().unwrap();
    let installed = installed.to_str().unwrap();
    assert_eq!(report["program"], installed, "{report:#}");
    assert_all_named(&modules_of(report, "setCommand"), installed, report);
}
