//! What --output and --save write, and how, when memleak runs as root in
//! a directory that someone else may have prepared: planted links, device
//! nodes, FIFOs, /dev/stdout, and a run killed with SIGKILL.

use std::{
    fs,
    os::unix::fs::{symlink, FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use memleak_tests::{fixture, memleak_binary, run_to_end, tempdir::TempDir, Leaker, Memleak, PATIENCE};
use serde_json::Value;

fn path(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `-c 'leaker all'`: a run that ends by itself, with one report at the
/// end. The leaker waits for stdin, which is /dev/null: it exits at once.
fn leaker_args<'a>(leaker: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["-c", leaker];
    args.extend_from_slice(more);
    args.extend_from_slice(&["3600", "1"]);
    args
}

fn leaker() -> String {
    format!("{} all", fixture("leaker").display())
}

/// Runs memleak to its end with stdin from /dev/null; panics unless it
/// exits 0. Returns its stdout.
fn run_ok(args: &[&str]) -> String {
    let output =
        Command::new(memleak_binary()).args(args).stdin(Stdio::null()).output().expect("run memleak");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "memleak {args:?} exited with {}: {stderr}", output.status);
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// Every line of `text` parsed as a JSON report; panics on any that is not.
fn reports(text: &str, what: &str) -> Vec<Value> {
    let reports: Vec<Value> = text
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|error| panic!("{what}: not JSON ({error}): {line}"))
        })
        .collect();
    assert!(!reports.is_empty(), "{what}: expected JSON reports, got {text:?}");
    for report in &reports {
        assert!(report["total_bytes"].is_u64(), "{what}: a report, got {report}");
    }
    reports
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Runs memleak through `sh`, which first plants, at every name in
/// `planted` (in `dir`), a link to `victim` named as the old scheme named
/// temporaries for its own pid, then execs memleak, which keeps that pid.
/// So each name memleak could have predicted is a trap, deterministically.
fn run_with_links_planted(dir: &Path, victim: &Path, planted: &[&str], args: &[&str]) {
    const PLANT: &str =
        r#"for name in $PLANTED; do ln -s "$VICTIM" "$name.memleak-$$.tmp" || exit 99; done; exec "$@""#;
    let output = Command::new("sh")
        .args(["-c", PLANT, "sh"])
        .arg(memleak_binary())
        .args(args)
        .current_dir(dir)
        .env("VICTIM", victim)
        .env("PLANTED", planted.join(" "))
        .stdin(Stdio::null())
        .output()
        .expect("run sh");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "memleak {args:?} exited with {}: {stderr}", output.status);
}

/// A user who can write to the directory plants links where memleak's
/// temporaries would go: nothing is written through them.
#[test]
fn temporaries_never_follow_links_planted_at_their_names() {
    let dir = TempDir::new("memleak-planted");
    let elsewhere = TempDir::new("memleak-planted-victim");
    let victim = elsewhere.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    let planted = ["out.json", "heap.snap", "heap.1.snap", "flame.svg", "flame.1.svg"];
    let (out, snapshot, flame) =
        (dir.path().join("out.json"), dir.path().join("heap.snap"), dir.path().join("flame.svg"));
    let leaker = leaker();
    let streams = ["--format", "json", "--output", path(&out), "--save", path(&snapshot)];
    run_with_links_planted(dir.path(), &victim, &planted, &leaker_args(&leaker, &streams));
    // No COUNT: several documents, numbered flame.1.svg...
    run_with_links_planted(dir.path(), &victim, &planted, &["-c", &leaker, "--output", path(&flame), "3600"]);

    assert_eq!(fs::read_to_string(&victim).unwrap(), "precious", "the victim was written through a link");
    let mut links = 0;
    for name in names(dir.path()) {
        let entry = dir.path().join(&name);
        let pid = name.split_once(".memleak-").and_then(|(_, rest)| rest.strip_suffix(".tmp"));
        if pid.is_some_and(|pid| pid.bytes().all(|b| b.is_ascii_digit())) {
            assert_eq!(fs::read_link(&entry).ok(), Some(victim.clone()), "{name}: a planted link, untouched");
            links += 1;
            continue;
        }
        assert!(["out.json", "heap.snap", "flame.1.svg"].contains(&name.as_str()), "{name} was left behind");
        assert!(fs::symlink_metadata(&entry).unwrap().is_file(), "{name} is a regular file");
    }
    assert_eq!(links, 2 * planted.len(), "every planted link is still there: {:?}", names(dir.path()));
    reports(&fs::read_to_string(&out).unwrap(), "out.json");
    assert!(fs::metadata(&snapshot).unwrap().len() > 0, "heap.snap holds the snapshot");
    let svg = fs::read_to_string(dir.path().join("flame.1.svg")).unwrap();
    assert!(svg.contains("<svg"), "flame.1.svg is a flame graph: {svg:.200}");
}

fn is_dev_null(path: &Path) -> bool {
    fs::symlink_metadata(path)
        .is_ok_and(|node| node.file_type().is_char_device() && node.rdev() == libc::makedev(1, 3))
}

/// Puts back the system's /dev/null if a broken memleak replaced it, so
/// that one failure does not break every later test on the machine.
struct RestoreDevNull;

impl Drop for RestoreDevNull {
    fn drop(&mut self) {
        let null = Path::new("/dev/null");
        if !is_dev_null(null) {
            let _ = fs::remove_file(null);
            let _ = Command::new("mknod").args(["-m", "666", "/dev/null", "c", "1", "3"]).status();
        }
    }
}

/// `--output /dev/null` writes to the device, with or without --force; it
/// never swaps the node for a file.
#[test]
fn device_nodes_are_written_never_replaced() {
    let dir = TempDir::new("memleak-devices");
    let leaker = leaker();
    let null = Path::new("/dev/null");
    run_ok(&leaker_args(&leaker, &["--format", "json", "--output", path(null)]));
    assert!(is_dev_null(null), "/dev/null is still the device");
    // With --force, a node of the test's own first: a memleak that replaces
    // device nodes fails here, before it could replace the system's.
    let private = dir.path().join("null");
    let made = Command::new("mknod").args(["-m", "666"]).arg(&private).args(["c", "1", "3"]).status();
    assert!(made.is_ok_and(|status| status.success()), "mknod {}", private.display());
    run_ok(&leaker_args(&leaker, &["--format", "json", "--force", "--output", path(&private)]));
    assert!(is_dev_null(&private), "{} is still a device node", private.display());
    for format in ["json", "svg"] {
        let _restore = RestoreDevNull;
        run_ok(&leaker_args(&leaker, &["--format", format, "--force", "--output", path(null)]));
        assert!(is_dev_null(null), "--force --format {format} left /dev/null the device");
    }
    assert_eq!(names(dir.path()), ["null"], "nothing made beside the node");

    // A link another user planted at the path is not followed, even to a
    // device: it is refused as any link is, and --force replaces it.
    let planted = dir.path().join("planted.json");
    symlink(&private, &planted).unwrap();
    std::os::unix::fs::lchown(&planted, Some(65534), Some(65534)).unwrap();
    let (code, stderr) = run_to_end(&leaker_args(&leaker, &["--output", path(&planted)]));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("planted.json exists: give --force to overwrite it"), "{stderr}");
    run_ok(&leaker_args(&leaker, &["--force", "--output", path(&planted)]));
    assert!(fs::symlink_metadata(&planted).unwrap().is_file(), "the planted link was replaced");
    reports(&fs::read_to_string(&planted).unwrap(), "planted.json");
    assert!(is_dev_null(&private), "and the device it led to was not written as a file");
}

/// Reads a FIFO to its end on a thread.
fn read_fifo(fifo: &Path) -> mpsc::Receiver<Vec<u8>> {
    let (sender, receiver) = mpsc::channel();
    let fifo = fifo.to_path_buf();
    thread::spawn(move || sender.send(fs::read(fifo).unwrap_or_default()));
    receiver
}

/// Lets a reader still waiting to open the FIFO go, should memleak never
/// have opened it: opened for writing and closed, it reads an empty end.
fn release_reader(fifo: &Path) {
    let _ = fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(fifo);
}

#[test]
fn a_fifo_is_written_in_place() {
    let dir = TempDir::new("memleak-fifo");
    let fifo = dir.path().join("reports.json");
    let made = Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|status| status.success()), "mkfifo {}", fifo.display());
    let leaker = leaker();
    for force in [&[][..], &["--force"][..]] {
        let read = read_fifo(&fifo);
        let mut args = vec!["--output", path(&fifo)];
        args.extend_from_slice(force);
        let (code, stderr) = run_to_end(&leaker_args(&leaker, &args));
        release_reader(&fifo);
        let got = read.recv_timeout(PATIENCE).expect("the reader is done");
        assert_eq!(code, Some(0), "memleak {args:?}: {stderr}");
        reports(&String::from_utf8(got).unwrap(), "the FIFO's reader");
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "still a FIFO");
    }
    assert_eq!(names(dir.path()), ["reports.json"]);
}

/// `--output /dev/stdout` writes where memleak's stdout goes, be it a
/// pipe or a file, and replaces nothing.
#[test]
fn dev_stdout_is_memleak_s_own_stdout() {
    let leaker = leaker();
    let piped = run_ok(&leaker_args(&leaker, &["--format", "json", "--output", "/dev/stdout"]));
    reports(&piped, "stdout, a pipe");

    let dir = TempDir::new("memleak-stdout");
    let captured = dir.path().join("captured.json");
    let args = leaker_args(&leaker, &["--format", "json", "--force", "--output", "/proc/self/fd/1"]);
    let status = Command::new(memleak_binary())
        .args(&args)
        .stdin(Stdio::null())
        .stdout(fs::File::create(&captured).unwrap())
        .status()
        .expect("run memleak");
    assert!(status.success(), "memleak {args:?} exited with {status}");
    reports(&fs::read_to_string(&captured).unwrap(), "stdout, a file");
    assert!(Path::new("/dev/stdout").is_symlink(), "/dev/stdout is still the system's link");
}

/// A link at the final path is a path that exists: refused without
/// --force, even if it leads nowhere, and replaced itself with it.
#[test]
fn a_link_at_the_final_path_is_refused_or_replaced_never_followed() {
    let dir = TempDir::new("memleak-final-link");
    let elsewhere = TempDir::new("memleak-final-link-victim");
    let victim = elsewhere.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    let leaker = leaker();
    let out = dir.path().join("out.json");
    symlink(dir.path().join("nowhere.json"), &out).unwrap();
    let (code, stderr) = run_to_end(&leaker_args(&leaker, &["--output", path(&out)]));
    assert_eq!(code, Some(2), "a dangling link is refused too: {stderr}");
    assert!(stderr.contains("out.json exists: give --force to overwrite it"), "{stderr}");
    assert_eq!(names(dir.path()), ["out.json"], "nothing made through it");

    fs::remove_file(&out).unwrap();
    symlink(&victim, &out).unwrap();
    let snapshot = dir.path().join("heap.snap");
    symlink(&victim, &snapshot).unwrap();
    run_ok(&leaker_args(&leaker, &["--force", "--output", path(&out), "--save", path(&snapshot)]));
    assert_eq!(fs::read_to_string(&victim).unwrap(), "precious", "what the links led to is untouched");
    for replaced in [&out, &snapshot] {
        assert!(fs::symlink_metadata(replaced).unwrap().is_file(), "{} was replaced", replaced.display());
    }
    reports(&fs::read_to_string(&out).unwrap(), "out.json");
    assert_eq!(names(dir.path()), ["heap.snap", "out.json"]);

    let subdirectory = dir.path().join("sub.json");
    fs::create_dir(&subdirectory).unwrap();
    for force in [&[][..], &["--force"][..]] {
        let mut args = vec!["--output", path(&subdirectory)];
        args.extend_from_slice(force);
        let (code, stderr) = run_to_end(&leaker_args(&leaker, &args));
        assert_eq!((code, stderr.lines().count()), (Some(2), 1), "{args:?}: {stderr}");
        let expected =
            "sub.json is a directory: --output and --save write to files, character devices and FIFOs";
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// Lines of `text` that end in a newline: reports written whole.
fn complete_lines(text: &str) -> Vec<&str> {
    text.split_inclusive('\n').filter_map(|line| line.strip_suffix('\n')).collect()
}

/// SIGKILL after a few reports: the file is where the user asked, with
/// every report that was complete.
#[test]
fn a_killed_run_keeps_every_complete_report() {
    let dir = TempDir::new("memleak-killed");
    let out = dir.path().join("out.json");
    let mut leaker = Leaker::start_waiting(&["steps"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "--output", path(&out), "1"]);
    memleak.wait_attached();
    leaker.go();
    let deadline = Instant::now() + PATIENCE;
    let seen = loop {
        let text = fs::read_to_string(&out).unwrap_or_default();
        let seen = complete_lines(&text).len();
        if seen >= 3 {
            break seen;
        }
        if let Some(status) = memleak.child.try_wait().unwrap() {
            panic!("memleak exited with {status} after {seen} reports in {}", out.display());
        }
        assert!(
            Instant::now() < deadline,
            "{seen} reports in {} after {PATIENCE:?}, expected 3 (one a second); the directory holds {:?}",
            out.display(),
            names(dir.path())
        );
        thread::sleep(Duration::from_millis(100));
    };
    memleak.signal(libc::SIGKILL);
    let status = memleak.child.wait().unwrap();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));

    let text = fs::read_to_string(&out).unwrap();
    let complete = complete_lines(&text);
    assert!(complete.len() >= seen, "{} reports after the kill, {seen} before", complete.len());
    reports(&complete.join("\n"), "out.json after SIGKILL");
    assert_eq!(names(dir.path()), ["out.json"], "no temporary left behind");
    leaker.exit();
}

/// A small tmpfs mounted at a directory of its own; unmounted when dropped.
struct SmallFileSystem {
    dir: TempDir,
}

impl SmallFileSystem {
    fn new(tag: &str, size: &str) -> Self {
        let dir = TempDir::new(tag);
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(status.success(), "mount a {size} tmpfs at {}", dir.path().display());
        Self { dir }
    }

    /// Writes a file until the file system is full.
    fn fill(&self) {
        let mut filler = fs::File::create(self.dir.path().join("filler")).expect("create a filler");
        let page = [b'x'; 4096];
        let error = loop {
            if let Err(error) = std::io::Write::write_all(&mut filler, &page) {
                break error;
            }
        };
        assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "filling the tmpfs: {error}");
    }
}

impl Drop for SmallFileSystem {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("--lazy").arg(self.dir.path()).status();
    }
}

/// The reports of text `output`, each from its header line on.
fn text_reports(output: &str) -> Vec<Vec<&str>> {
    let mut reports: Vec<Vec<&str>> = Vec::new();
    for line in output.lines() {
        if line.starts_with('[') && line.contains("] Top ") {
            reports.push(Vec::new());
        }
        reports.last_mut().unwrap_or_else(|| panic!("text before the first report: {line}")).push(line);
    }
    reports
}

/// A file system that fills up under a stream of reports: the report
/// that does not fit is taken back, so the file ends on a complete one,
/// and memleak exits 2 saying why in one line.
#[test]
fn a_full_disk_leaves_the_file_ending_on_a_complete_report() {
    for format in ["json", "text"] {
        let small = SmallFileSystem::new(&format!("memleak-full-{format}"), "64k");
        let out = small.dir.path().join(format!("out.{format}"));
        let mut leaker = Leaker::start_waiting(&["all"]);
        let pid = leaker.pid().to_string();
        let mut memleak = Memleak::start(&["-p", &pid, "--format", format, "--output", path(&out), "1"]);
        memleak.wait_attached();
        leaker.go();
        let deadline = Instant::now() + PATIENCE;
        while !out.exists() {
            assert!(Instant::now() < deadline, "no {} after {PATIENCE:?}", out.display());
            thread::sleep(Duration::from_millis(100));
        }
        // The next reports go in the room left in the file's last page,
        // until one does not fit.
        small.fill();
        let status = loop {
            if let Some(status) = memleak.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "memleak still runs on a full file system");
            thread::sleep(Duration::from_millis(100));
        };
        let stderr = memleak.stderr.rest();
        assert_eq!(status.code(), Some(2), "{format}: {stderr:#?}");
        let errors: Vec<&String> =
            stderr.iter().filter(|line| line.starts_with("memleak: error: ")).collect();
        assert_eq!(
            errors,
            [&format!(
                "memleak: error: cannot write {}: No space left on device (os error 28)",
                out.display()
            )],
            "{format}: one line with the reason: {stderr:#?}"
        );
        let written = fs::read_to_string(&out).unwrap();
        assert!(written.ends_with('\n'), "{format}: the last report cut short: {written:?}");
        if format == "json" {
            reports(&written, "out.json on a full file system");
        } else {
            let every = text_reports(&written);
            assert!(
                every.iter().all(|report| report.len() == every[0].len()),
                "every text report whole, as long as the first: {written}"
            );
        }
        leaker.exit();
    }
}

/// `memleak -c CMD --format json > out.json`: the command shares memleak's
/// stdout, and writes to it all along. Each report is one write, so every
/// line of the file is either the command's or a whole report.
#[test]
fn a_commands_output_never_lands_inside_a_json_report() {
    let dir = TempDir::new("memleak-shared-stdout");
    let out = dir.path().join("out.json");
    let leaker = fixture("leaker");
    let command = format!(
        "sh -c '{} demo --exit & while kill -0 $! 2>/dev/null; do echo \"> 121393\"; done'",
        leaker.display()
    );
    let status = Command::new(memleak_binary())
        .args(["-c", &command, "--format", "json", "1"])
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out).unwrap())
        .status()
        .expect("run memleak");
    assert!(status.success(), "memleak exited with {status}");
    let written = fs::read_to_string(&out).unwrap();
    let (commands, ours): (Vec<&str>, Vec<&str>) = written.lines().partition(|line| *line == "> 121393");
    assert!(commands.len() > 100, "the command wrote all along: {} lines", commands.len());
    let reports = reports(&ours.join("\n"), "the reports between the command's lines");
    assert!(reports.len() >= 3, "a report every second, and the last: {reports:#?}");
    assert!(
        reports.iter().any(|report| report["stacks"].as_array().is_some_and(|stacks| !stacks.is_empty())),
        "reports long enough to have been split: {reports:#?}"
    );
}
