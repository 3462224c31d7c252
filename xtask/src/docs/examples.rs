//! The README's examples, each a function that runs the real commands
//! and returns what the README shows of them. To add one: write a
//! function here, add it to `EXAMPLES`, and put `<!-- example: NAME -->`
//! before a fenced block in the README; `cargo xtask readme NAME` fills
//! it.
//!
//! Each example shows the commands it ran as a user would type them
//! (`sudo memleak ...`, run in the scratch directory), and what they
//! printed, stdout and stderr together as a terminal shows them. Where
//! the README leaves lines out, a `...` line says so.

use std::path::Path;

use anyhow::{bail, Context as _, Result};

use super::{
    image,
    normalise::Check,
    workshop::{
        curl, curl_until, free_port, lines_of, output, port_or_free, read, reports, require, unmount_below,
        Cgroup, Run, Transcript, Workshop,
    },
    Artifact, Example, Made, Unavailable,
};
use crate::root;

/// Every example, in the README's order.
pub const EXAMPLES: &[Example] = &[
    Example { name: "demo", check: Check::Numbers, make: demo },
    Example { name: "execve", check: Check::Exact, make: execve },
    Example { name: "forks", check: Check::Unordered, make: forks },
    Example { name: "growth", check: Check::Exact, make: growth },
    Example { name: "mappings", check: Check::Exact, make: mappings },
    Example { name: "reservations", check: Check::Exact, make: reservations },
    Example { name: "kernel", check: Check::Outline, make: kernel },
    Example { name: "container", check: Check::Exact, make: container },
    Example { name: "cgroup", check: Check::Unordered, make: cgroup },
    Example { name: "cgroup-joined", check: Check::Exact, make: cgroup_joined },
    Example { name: "sessions", check: Check::Exact, make: sessions },
    Example { name: "sessions-fp", check: Check::Exact, make: sessions_fp },
    Example { name: "culprit", check: Check::Exact, make: culprit },
    Example { name: "python", check: Check::Exact, make: python },
    Example { name: "operators", check: Check::Exact, make: operators },
    Example { name: "stripped", check: Check::Exact, make: stripped },
    Example { name: "jit", check: Check::Exact, make: jit },
    Example { name: "redis", check: Check::Outline, make: redis },
    Example { name: "go-static", check: Check::Exact, make: go_static },
    Example { name: "go-cgo", check: Check::Numbers, make: go_cgo },
    Example { name: "flame-graph", check: Check::Exact, make: flame_graph },
    Example { name: "pprof", check: Check::Exact, make: pprof },
    Example { name: "diff", check: Check::Exact, make: diff },
    Example { name: "trace", check: Check::Exact, make: trace },
    Example { name: "json", check: Check::Exact, make: json },
    Example { name: "unrecorded-frees", check: Check::Exact, make: unrecorded_frees },
    Example { name: "stats", check: Check::Exact, make: stats },
    Example { name: "serve", check: Check::Exact, make: serve },
    Example { name: "serve-token", check: Check::Exact, make: serve_token },
    Example { name: "promtool", check: Check::Exact, make: promtool },
    Example { name: "serve-exe", check: Check::Exact, make: serve_exe },
    Example { name: "serve-podman", check: Check::Exact, make: serve_podman },
    Example { name: "serve-watch", check: Check::Numbers, make: serve_watch },
    Example { name: "resident", check: Check::Numbers, make: resident },
    Example { name: "top", check: Check::Outline, make: top },
    Example { name: "privileges", check: Check::Exact, make: privileges },
];

/// The key of the `tEXt` chunk a screenshot keeps its page's HTML in.
pub const PNG_SOURCE_KEY: &str = "memleak-readme-source";

impl Made {
    fn text(transcript: &Transcript) -> Self {
        Self { text: transcript.text(), ..Self::default() }
    }
}

/// `memleak ARGS` run to its end, stdin closed; its lines.
fn memleak_to_end(workshop: &Workshop, args: &[&str]) -> Result<Vec<String>> {
    let (status, lines) = output(&mut workshop.memleak(args))?;
    if !status.success() {
        bail!("memleak {args:?} failed with {status}: {lines:#?}");
    }
    Ok(lines)
}

/// `sudo memleak ARGS` as the user types it: each argument quoted as a
/// shell needs it.
fn typed(args: &[&str]) -> String {
    let quoted: Vec<String> = args
        .iter()
        .map(|arg| {
            if arg.is_empty() || arg.contains([' ', '$', '\'', '"', '&', '?', '*', '|']) {
                format!("'{arg}'")
            } else {
                (*arg).to_owned()
            }
        })
        .collect();
    format!("sudo memleak {}", quoted.join(" "))
}

/// A run of memleak ARGS to its end, as a transcript.
fn traced_to_end(workshop: &Workshop, args: &[&str]) -> Result<(Transcript, Vec<String>)> {
    let lines = memleak_to_end(workshop, args)?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(args)).lines(&lines);
    Ok((transcript, lines))
}

/// A process memleak attaches to with -p: started with its stdin ours,
/// waited for until it prints `ready`.
fn target(workshop: &Workshop, program: &Path, args: &[&str], ready: &str) -> Result<Run> {
    let mut command = workshop.command(program);
    command.args(args);
    let mut run = Run::interactive(&mut command)?;
    run.wait_for(&format!("{ready:?} from {}", program.display()), |line| line == ready)?;
    Ok(run)
}

/// memleak with ARGS, running while the example talks to it.
fn memleak_running(workshop: &Workshop, args: &[&str]) -> Result<Run> {
    Run::interactive(&mut workshop.memleak(args))
}

fn demo(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    let args = ["-c", "./leaker demo --exit", "1"];
    let lines = memleak_to_end(workshop, &args)?;
    let reports = reports(&lines);
    let second = reports.get(1).context("the demo's second report")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).line("...").lines(second);
    Ok(Made::text(&transcript))
}

/// The growth fixture's threads keeping freed memory in their arenas:
/// its second report, which says it is not a leak.
fn resident(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("growth")?;
    let args = ["-c", "./growth fragment", "-o", "500", "3", "2"];
    let lines = memleak_to_end(workshop, &args)?;
    let reports = reports(&lines);
    let second = reports.get(1).context("the second report")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).line("...").lines(second);
    Ok(Made::text(&transcript))
}

fn execve(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    // An interval no run reaches: on a loaded machine a periodic report
    // came before the execve, and the transcript changed.
    let args = ["-c", "./leaker all --then-exec --wait", "3600"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for("the leaker", |line| line == "ready")?;
    memleak.send("go")?;
    memleak.wait_for("its leaks", |line| line == "done")?;
    memleak.send("go")?;
    memleak.wait_for_start("memleak: pid ")?;
    let now_runs = memleak.wait_for("the new program traced", |line| line.contains(" now runs "))?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let end = lines.iter().position(|line| *line == now_runs).context("the line seen")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).kept(&lines[..=end], |line| {
        line.starts_with("memleak: ") || line.contains("] Top ") || line.starts_with("Outstanding: ")
    });
    Ok(Made::text(&transcript))
}

fn forks(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    let args = ["-c", "./leaker forks"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for("the child", |line| line == "child ready")?;
    memleak.wait_for("the child traced", |line| line.contains("forked by"))?;
    memleak.send("go")?;
    // The child's report, then the parent's: the parent's "done" may come
    // anywhere among the child's lines.
    memleak.wait_for("the child's exit", |line| line.contains(" exited"))?;
    memleak.wait_for_start("Seen: ")?;
    if !memleak.seen.iter().any(|line| line == "done") {
        memleak.wait_for("the parent", |line| line == "done")?;
    }
    memleak.close_stdin();
    let (status, lines) = memleak.finish()?;
    if !status.success() {
        bail!("memleak failed with {status}: {lines:#?}");
    }
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines);
    Ok(Made::text(&transcript))
}

/// `leaker steps` leaks 8 KiB at each line it reads: one line before each
/// of memleak's first three reports, a second apart.
fn growth(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let mut steps = target(workshop, &leaker, &["steps"], "done")?;
    let pid = steps.pid().to_string();
    let args = ["-p", pid.as_str(), "1"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    for _ in 0..3 {
        steps.send("step")?;
        steps.wait_for("a step", |line| line == "stepped")?;
        memleak.wait_for("a report", |line| line.contains("] Top "))?;
    }
    memleak.wait_for_start("Seen: ")?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let third = reports(&lines).into_iter().nth(2).context("a third report")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).line("...").lines(&third);
    Ok(Made::text(&transcript))
}

fn mappings(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    Ok(Made::text(&traced_to_end(workshop, &["-c", "./leaker mappings"])?.0))
}

fn reservations(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    Ok(Made::text(&traced_to_end(workshop, &["-c", "./leaker reservations"])?.0))
}

/// The kernel's allocations while `leaker files 1000` opens 1000 files.
fn kernel(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let args = ["-T", "2", "5", "1"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing kernel allocations")?;
    let files = target(workshop, &leaker, &["files", "1000"], "done")?;
    let (status, lines) = memleak.finish()?;
    drop(files);
    if !status.success() {
        bail!("memleak failed with {status}: {lines:#?}");
    }
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines);
    Ok(Made::text(&transcript))
}

/// The leaker at /app/leaker in a root of its own, in new mount and pid
/// namespaces, as a container runtime would run it.
fn container(workshop: &mut Workshop) -> Result<Made> {
    require("unshare")?;
    let leaker = workshop.fixture("leaker")?;
    let rootfs = workshop.dir().join("rootfs");
    make_rootfs(&leaker, &rootfs)?;
    let mut command = workshop.command("unshare");
    command
        .args(["--mount", "--pid", "--fork", "sh"])
        .arg(root().join("tests/fixtures/enter-container.sh"))
        .arg(&rootfs)
        .args(["/app/leaker", "seed", "2", "--wait"]);
    let mut contained = Run::interactive(&mut command)?;
    contained.wait_for("the contained leaker", |line| line == "ready")?;
    // unshare --fork: the leaker is unshare's only child.
    let unshare = contained.pid();
    let children = std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"))?;
    let pid = children.split_whitespace().next().context("unshare's child")?.to_owned();
    let args = ["-p", pid.as_str(), "-T", "1"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    contained.send("go")?;
    contained.wait_for("the leaks", |line| line.starts_with("fibonacci("))?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let mut transcript = Transcript::default();
    transcript
        .command(&format!("{}   # /app/leaker, inside unshare + pivot_root", typed(&args)))
        .lines(&lines);
    Ok(Made::text(&transcript))
}

/// A root filesystem with `leaker` at /app/leaker and the libraries its
/// loader lists, at their paths.
fn make_rootfs(leaker: &Path, rootfs: &Path) -> Result<()> {
    let copy = |from: &Path, to: &Path| -> Result<()> {
        std::fs::create_dir_all(to.parent().context("a parent")?)?;
        std::fs::copy(from, to).with_context(|| format!("cannot copy {}", from.display()))?;
        Ok(())
    };
    copy(leaker, &rootfs.join("app/leaker"))?;
    let listing = lines_of(std::process::Command::new("ldd").arg(leaker))?;
    for line in listing {
        if let Some(path) = line.split_whitespace().rfind(|word| word.starts_with('/')) {
            copy(Path::new(path), &rootfs.join(path.trim_start_matches('/')))?;
        }
    }
    std::fs::create_dir_all(rootfs.join("proc"))?;
    Ok(())
}

/// A pod: two leakers, each in a cgroup of its own below the pod's.
fn cgroup(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let pod = Cgroup::new("memleak-pod")?;
    let mut leakers = Vec::new();
    for name in ["web", "db"] {
        let container = pod.child(name)?;
        let process = target(workshop, &leaker, &["seed", "2", "--wait"], "ready")?;
        container.join(process.pid())?;
        leakers.push((container, process));
    }
    let path = pod.path();
    let args = ["--cgroup", path.as_str(), "-T", "1"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing cgroup ")?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let end = lines.iter().position(|line| line.starts_with("memleak: tracing cgroup ")).context("seen")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines[..=end]);
    drop(leakers);
    Ok(Made::text(&transcript))
}

/// An empty cgroup, and a leaker that joins it once memleak runs.
fn cgroup_joined(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let cgroup = Cgroup::new("memleak-manual")?;
    let path = cgroup.path();
    let args = ["--cgroup", path.as_str(), "-T", "2", "3"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing cgroup ")?;
    let mut joining = target(workshop, &leaker, &["seed", "2", "--wait"], "ready")?;
    cgroup.join(joining.pid())?;
    memleak.wait_for("the newcomer traced", |line| line.contains("is in the cgroup"))?;
    joining.send("go")?;
    joining.wait_for("its leaks", |line| line.starts_with("fibonacci("))?;
    let total = memleak.wait_for_start("Cgroup ")?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let end = lines.iter().position(|line| *line == total).context("seen")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines[..=end]);
    Ok(Made::text(&transcript))
}

/// `program` held at "ready" until memleak -p (with `extra` flags) has
/// attached, then let go until it prints "done": memleak's output, under
/// the command a user would type.
fn attached_until_done(
    workshop: &Workshop,
    program: &Path,
    program_args: &[&str],
    extra: &[&str],
) -> Result<Transcript> {
    let mut server = target(workshop, program, program_args, "ready")?;
    let pid = server.pid().to_string();
    let mut args = vec!["-p", pid.as_str()];
    args.extend_from_slice(extra);
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    server.send("go")?;
    server.wait_for("the program's allocations", |line| line == "done")?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines);
    Ok(transcript)
}

/// tests/fixtures/sessions.cpp built as a release build is: -O2, no
/// frame pointers; 1000 sessions leaked.
fn sessions_with(workshop: &Workshop, extra: &[&str]) -> Result<Transcript> {
    let sessions = workshop.optimized("sessions")?;
    attached_until_done(workshop, &sessions, &["1000", "--wait"], extra)
}

fn sessions(workshop: &mut Workshop) -> Result<Made> {
    Ok(Made::text(&sessions_with(workshop, &[])?))
}

fn sessions_fp(workshop: &mut Workshop) -> Result<Made> {
    Ok(Made::text(&sessions_with(workshop, &["--unwind", "fp"])?))
}

/// tests/fixtures/service.cpp, built -O2 as a release build is, leaking
/// 100 sessions: each a `Session` by `new` in `make_session`, its name
/// and buffer by `std::string` and `std::vector` in its constructor.
fn culprit(workshop: &mut Workshop) -> Result<Made> {
    let service = workshop.optimized("service")?;
    let transcript = attached_until_done(workshop, &service, &["100", "--wait"], &["-T", "3"])?;
    Ok(Made::text(&transcript))
}

/// `tests/fixtures/cache_service.py` under Debian's python3.11, a stripped
/// build: its response cache keeps 200 bytearrays of 4000 bytes.
fn python(workshop: &mut Workshop) -> Result<Made> {
    let python = Path::new("/usr/bin/python3.11");
    if !python.exists() {
        return Err(Unavailable("Debian's python3.11 is not installed".to_owned()).into());
    }
    let script = "cache_service.py";
    std::fs::copy(root().join("tests/fixtures").join(script), workshop.dir().join(script))
        .with_context(|| format!("copying {script}"))?;
    let transcript = attached_until_done(workshop, python, &[script], &["-T", "1"])?;
    Ok(Made::text(&transcript))
}

/// tests/fixtures/sessions.cpp at -O2, linked with Debian's tcmalloc,
/// attached with -p before it serves 1000 requests that each leak a
/// session: memleak probes tcmalloc's own operator new.
fn operators(workshop: &mut Workshop) -> Result<Made> {
    let tcmalloc = Path::new("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4");
    if !tcmalloc.exists() {
        return Err(Unavailable("Debian's libtcmalloc-minimal4 is not installed".to_owned()).into());
    }
    let sessions = workshop.optimized_linked("sessions", tcmalloc)?;
    let transcript = attached_until_done(workshop, &sessions, &["1000", "--wait"], &["-T", "1"])?;
    Ok(Made::text(&transcript))
}

/// `leaker cache`, whose 100 entries of 400 bytes were allocated before
/// memleak attached, replaces them all and leaks 1000 bytes: the end of
/// the final report, the first begun after the replacement.
fn unrecorded_frees(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let mut cache = target(workshop, &leaker, &["cache"], "ready")?;
    let pid = cache.pid().to_string();
    // Not heap.snap: the diff example's snapshots are in the same place.
    let args = ["-p", pid.as_str(), "--save", "cache.snap", "2"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    memleak.wait_for("a first report", |line| line.starts_with("Seen: "))?;
    cache.send("replace")?;
    cache.wait_for("the replacement", |line| line == "replaced")?;
    // The report that shows the whole replacement may have read the
    // counters before it ended; the one after it has all of it.
    memleak.wait_for("the replacement reported", |line| line.starts_with("Outstanding: 41000 bytes"))?;
    memleak.wait_for("the end of that report", |line| line.starts_with("Seen: "))?;
    memleak.wait_for("the report after it", |line| line.starts_with("Seen: "))?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let saved = reports(&lines).len();
    let last = reports(&lines).pop().context("a final report")?;
    let newest = format!("cache.{saved}.snap");
    let diff_args = ["diff", "cache.1.snap", newest.as_str()];
    let (_, diff) = output(&mut workshop.memleak(&diff_args))?;
    let mut transcript = Transcript::default();
    transcript
        .command(&typed(&args))
        .kept(&last, |line| {
            line.starts_with("Outstanding:")
                || line.starts_with("Of those")
                || line.starts_with("Seen:")
                || line.contains("never saw allocated")
        })
        .line("^C")
        .command(&format!("memleak {}", diff_args.join(" ")))
        .lines(&diff);
    Ok(Made::text(&transcript))
}

/// Debian's memcached, a stripped build, attached with -p while it takes
/// a connection and stores a key.
fn stripped(workshop: &mut Workshop) -> Result<Made> {
    use std::io::{Read as _, Write as _};
    let memcached = Path::new("/usr/bin/memcached");
    if !memcached.exists() {
        return Err(Unavailable("Debian's memcached is not installed".to_owned()).into());
    }
    let port = free_port()?.to_string();
    let mut server = workshop.command(memcached);
    server.args(["-u", "nobody", "-l", "127.0.0.1", "-p", &port, "-m", "64", "-t", "1"]);
    let server = Run::spawn(server.stdin(std::process::Stdio::null()))?;
    let connect = || -> Result<std::net::TcpStream> {
        for _ in 0..100 {
            if let Ok(stream) = std::net::TcpStream::connect(format!("127.0.0.1:{port}")) {
                return Ok(stream);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        bail!("memcached does not listen on port {port}")
    };
    drop(connect()?);
    let pid = server.pid().to_string();
    let args = ["-p", pid.as_str()];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    // A connection memleak sees accepted: memcached allocates its state.
    let mut client = connect()?;
    client.write_all(b"set key 0 0 5\r\nvalue\r\n")?;
    let mut answer = [0_u8; 8];
    client.read_exact(&mut answer)?;
    if &answer != b"STORED\r\n" {
        bail!("memcached answered {:?}", String::from_utf8_lossy(&answer));
    }
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    drop(server);
    let mut transcript = Transcript::default();
    transcript.command("sudo memleak -p $(pidof memcached)").lines(&lines);
    Ok(Made::text(&transcript))
}

/// tests/fixtures/jit.c calls malloc from code it copied into an mmap'd
/// page, once memleak (-p) attached knowing the page: the stack through
/// it, its first three frames.
fn jit(workshop: &mut Workshop) -> Result<Made> {
    let jit = workshop.fixture("jit")?;
    let mut program = target(workshop, &jit, &[], "ready")?;
    let pid = program.pid().to_string();
    let mut memleak = memleak_running(workshop, &["-p", &pid])?;
    memleak.wait_for_start("memleak: tracing ")?;
    program.send("go")?;
    program.wait_for("the call", |line| line == "done")?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let start = lines
        .iter()
        .position(|line| line.starts_with("\t4242 bytes in 1 allocations from stack"))
        .context("the stack through the copied code")?;
    let mut transcript = Transcript::default();
    transcript.lines(lines.iter().skip(start).take(4));
    Ok(Made::text(&transcript))
}

/// Debian's redis-server, which links jemalloc, after redis-benchmark's
/// 10,000 SETs of 100 bytes, on keys at random.
fn redis(workshop: &mut Workshop) -> Result<Made> {
    require("redis-server")?;
    require("redis-benchmark")?;
    let port = free_port()?.to_string();
    let mut server = workshop.command("redis-server");
    server.args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    let mut server = Run::spawn(server.stdin(std::process::Stdio::null()))?;
    server.wait_for("redis to start", |line| line.contains("Ready to accept connections"))?;
    let pid = server.pid().to_string();
    let args = ["-p", pid.as_str(), "-T", "3"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    let mut benchmark = workshop.command("redis-benchmark");
    benchmark.args(["-p", &port, "-t", "set", "-n", "10000", "-d", "100", "-r", "100000000", "-q"]);
    lines_of(&mut benchmark)?;
    memleak.signal(libc::SIGINT);
    let (_, lines) = memleak.finish()?;
    let mut transcript = Transcript::default();
    transcript.command("sudo memleak -p $(pidof redis-server) -T 3").lines(&lines);
    Ok(Made::text(&transcript))
}

fn go_static(workshop: &mut Workshop) -> Result<Made> {
    workshop.go_program("go-static")?;
    std::fs::rename(workshop.dir().join("go-static"), workshop.dir().join("gostatic"))?;
    let args = ["-c", "./gostatic"];
    let (_, lines) = output(&mut workshop.memleak(&args))?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines);
    Ok(Made::text(&transcript))
}

/// tests/fixtures/go-cgo, whose Go function `remember` keeps 20 C strings
/// from `C.CString`: its report, cut to that stack (`-Z 1000` leaves out
/// the Go heap's mappings).
fn go_cgo(workshop: &mut Workshop) -> Result<Made> {
    workshop.go_program("go-cgo")?;
    std::fs::rename(workshop.dir().join("go-cgo"), workshop.dir().join("gocgo"))?;
    // Its 40 depths of `deep` hold more than `remember`: all stacks shown.
    let args = ["-c", "./gocgo", "-Z", "1000", "-T", "100"];
    let lines = memleak_to_end(workshop, &args)?;
    let header = lines
        .iter()
        .position(|line| line.contains(" stacks with outstanding allocations "))
        .context("no report")?;
    // The stack is its "\tN bytes in" line, its culprit, and its frames.
    let culprit = lines
        .iter()
        .position(|line| line.starts_with("\t\tculprit: main.remember"))
        .context("no stack named by main.remember")?;
    let end =
        lines[culprit..].iter().position(|line| !line.starts_with("\t\t")).context("no totals")? + culprit;
    let totals = lines.iter().position(|line| line.starts_with("Outstanding: ")).context("no totals")?;
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).lines(&lines[..=header]).line("...").lines(&lines[culprit - 1..end]);
    transcript.line("...");
    transcript.lines(&lines[totals..]);
    Ok(Made::text(&transcript))
}

/// Folded stacks, then a flame graph: the README shows docs/flamegraph.svg.
fn flame_graph(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    let folded_args = ["-c", "./leaker all", "--format", "folded"];
    let folded = memleak_to_end(workshop, &folded_args)?;
    let svg_args = ["-c", "./leaker all", "--output", "flamegraph.svg"];
    let svg_lines = memleak_to_end(workshop, &svg_args)?;
    // memleak's own lines, then the first four stacks.
    let stack = |line: &str| !line.starts_with("memleak: ") && line != "done";
    let stacks = folded.iter().filter(|line| stack(line)).count();
    let mut transcript = Transcript::default();
    transcript.command(&typed(&folded_args)).lines(folded.iter().filter(|line| !stack(line)));
    transcript.lines(folded.iter().filter(|line| stack(line)).take(4));
    if stacks > 4 {
        transcript.line("...");
    }
    transcript.command(&typed(&svg_args)).lines(&svg_lines);
    let svg = read(&workshop.dir().join("flamegraph.1.svg"))?;
    Ok(Made {
        text: transcript.text(),
        files: vec![(image("flamegraph.svg"), Artifact::Text(svg))],
        ..Made::default()
    })
}

fn pprof(workshop: &mut Workshop) -> Result<Made> {
    require("go")?;
    workshop.fixture("leaker")?;
    let args = ["-c", "./leaker all", "--output", "leaks.pb.gz"];
    let lines = memleak_to_end(workshop, &args)?;
    let mut go = workshop.command("go");
    go.args(["tool", "pprof", "-top", "-unit=byte", "leaks.1.pb.gz"]);
    let top = lines_of(&mut go)?;
    let mut transcript = Transcript::default();
    transcript
        .command(&typed(&args))
        .lines(&lines)
        .command("go tool pprof -top -unit=byte leaks.1.pb.gz")
        .lines(&top);
    Ok(Made::text(&transcript))
}

/// What a python3.11 built by pyenv appends to a list at each line it
/// reads: 100 bytearray(1000). One line before the first snapshot, two
/// between the first and the second; then the diff, and its flame graph
/// (docs/diff-flamegraph.svg).
fn diff(workshop: &mut Workshop) -> Result<Made> {
    let python = Path::new("/root/.pyenv/versions/3.11.7/bin/python3.11");
    if !python.exists() {
        return Err(Unavailable(format!("{} (pyenv's) is not installed", python.display())).into());
    }
    let script = "import sys\nkept = []\nprint('ready', file=sys.stderr, flush=True)\nfor line in sys.stdin:\n    \
                  kept.extend(bytearray(1000) for _ in range(100))\n    print('appended', file=sys.stderr, flush=True)\n";
    let mut program = target(workshop, python, &["-c", script], "ready")?;
    let pid = program.pid().to_string();
    let args = ["-p", pid.as_str(), "--save", "heap.snap", "3", "2"];
    let mut memleak = memleak_running(workshop, &args)?;
    memleak.wait_for_start("memleak: tracing ")?;
    program.send("line")?;
    program.wait_for("a line read", |line| line == "appended")?;
    memleak.wait_for("the first snapshot", |line| line.contains("] Top "))?;
    for _ in 0..2 {
        program.send("line")?;
        program.wait_for("a line read", |line| line == "appended")?;
    }
    let (status, lines) = memleak.finish()?;
    if !status.success() {
        bail!("memleak failed with {status}: {lines:#?}");
    }
    let diff_args = ["diff", "heap.1.snap", "heap.2.snap", "-T", "2"];
    let (_, diff) = output(&mut workshop.memleak(&diff_args))?;
    output(&mut workshop.memleak(&["diff", "heap.1.snap", "heap.2.snap", "--output", "growth.svg"]))?;
    let svg = read(&workshop.dir().join("growth.svg"))?;
    let mut transcript = Transcript::default();
    transcript.command(&format!("memleak {}", diff_args.join(" "))).lines(&diff);
    Ok(Made {
        text: transcript.text(),
        files: vec![(image("diff-flamegraph.svg"), Artifact::Text(svg))],
        ..Made::default()
    })
}

fn trace(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    let args = ["-c", "./leaker realloc-chain", "-t"];
    let lines = memleak_to_end(workshop, &args)?;
    // The first three calls, among memleak's and the leaker's lines.
    let calls: Vec<&String> = lines.iter().filter(|line| line.starts_with('[')).take(3).collect();
    let mut transcript = Transcript::default();
    transcript.command(&typed(&args)).line("...").lines(calls).line("...");
    Ok(Made::text(&transcript))
}

/// One JSON report, wrapped for reading, with one stack and two of its
/// frames kept.
fn json(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    let lines = memleak_to_end(workshop, &["-c", "./leaker seed 1", "--format", "json"])?;
    let report = lines.iter().rev().find(|line| line.starts_with('{')).context("a JSON report")?;
    Ok(Made { text: json_wrapped(report)?, ..Made::default() })
}

fn stats(workshop: &mut Workshop) -> Result<Made> {
    workshop.fixture("leaker")?;
    let args = ["-c", "./leaker all --exit", "--stats", "stats.jsonl", "3600"];
    let mut command = workshop.memleak(&args);
    let status = command.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status()?;
    if !status.success() {
        bail!("memleak --stats failed with {status}");
    }
    let jsonl = read(&workshop.dir().join("stats.jsonl"))?;
    let mut transcript = Transcript::default();
    transcript.command(&format!("{} >/dev/null", typed(&args))).command("cat stats.jsonl");
    for line in jsonl.lines() {
        transcript.line(&first_items(line, "\"probes\":[", 3));
    }
    Ok(Made::text(&transcript))
}

/// The daemon, following `leaker all` and `leaker steps`: what it says,
/// then its endpoints through curl and go tool pprof, and a screenshot
/// of its page (docs/serve-page.png).
fn serve(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let mut all = target(workshop, &leaker, &["all", "--wait"], "ready")?;
    let mut steps = target(workshop, &leaker, &["steps"], "done")?;
    let pids = format!("{},{}", all.pid(), steps.pid());
    let port = port_or_free(9943)?;
    let port_text = port.to_string();
    let mut args = vec!["serve", "--pid", pids.as_str()];
    if port != 9943 {
        args.extend_from_slice(&["--port", &port_text]);
    }
    let mut daemon = memleak_running(workshop, &args)?;
    daemon.wait_for_start("memleak: serving ")?;
    let address = format!("127.0.0.1:{port}");
    let url = |path: &str| format!("{address}{path}");
    // Both processes' first reports, which growth is counted from, before
    // they leak.
    curl_until(&url("/api/v1/targets"), |body| reported(body, all.pid()) && reported(body, steps.pid()))?;
    all.send("go")?;
    all.wait_for("its leaks", |line| line == "done")?;
    for _ in 0..4 {
        steps.send("step")?;
        steps.wait_for("a step", |line| line == "stepped")?;
    }
    let all_bytes = format!("memleak_outstanding_bytes{{pid=\"{}\",exe=\"leaker\"}} 17264", all.pid());
    let steps_bytes = format!("memleak_outstanding_bytes{{pid=\"{}\",exe=\"leaker\"}} 32768", steps.pid());
    // Once both leaked all they do, and a round after that saw no growth.
    let growing = regex::Regex::new(r"(?m)^memleak_growing_reports\{.*\} [1-9]").expect("a valid pattern");
    let metrics = curl_until(&url("/metrics"), |body| {
        body.contains(&all_bytes) && body.contains(&steps_bytes) && !growing.is_match(body)
    })?;
    let mut started = Transcript::default();
    started.command(&format!("sudo memleak {}", args.join(" "))).lines(&daemon.seen);
    let mut endpoints = Transcript::default();
    endpoints.command(&format!("curl -s {}", url("/metrics"))).lines(metrics.lines());
    for path in ["/api/v1/targets", "/healthz", "/flamegraph"] {
        endpoints.command(&format!("curl -s {}", url(path))).lines(curl(&[&url(path)])?.lines());
    }
    let reports = serve_reports(workshop, &address, all.pid())?;
    let page = screenshot(workshop, &url("/"))?;
    daemon.signal(libc::SIGTERM);
    daemon.finish()?;
    Ok(Made {
        text: started.text(),
        parts: vec![("endpoints", endpoints.text()), ("reports", reports.text())],
        files: vec![(image("serve-page.png"), page)],
    })
}

/// A process's reports from the daemon at `address`: its profile through
/// go tool pprof, and its report through curl, as text, SVG and a format
/// memleak does not have.
fn serve_reports(workshop: &Workshop, address: &str, pid: u32) -> Result<Transcript> {
    // go tool pprof, with its profiles saved in the scratch directory.
    require("go")?;
    let heap = format!("http://{address}/debug/pprof/heap?pid={pid}");
    let mut pprof = workshop.command("go");
    pprof.args(["tool", "pprof", "-top", &heap]).env("PPROF_TMPDIR", workshop.dir().join("pprof"));
    let top = lines_of(&mut pprof)?;
    let mut reports = Transcript::default();
    reports.command(&format!("go tool pprof -top '{heap}'")).lines(top.iter().take(13));
    if top.len() > 13 {
        reports.line("...");
    }
    let report = format!("{address}/api/v1/report?pid={pid}");
    reports.command(&format!("curl -s '{report}&top=1'")).lines(curl(&[&format!("{report}&top=1")])?.lines());
    let svg = curl(&[&format!("{report}&format=svg")])?;
    if !svg.contains("<svg") {
        bail!("no flame graph from {report}&format=svg: {svg}");
    }
    reports.command(&format!("curl -s '{report}&format=svg' > leaker.svg"));
    let png = curl(&[&format!("{report}&format=png")])?;
    reports.command(&format!("curl -s '{report}&format=png'")).lines(png.lines());
    Ok(reports)
}

/// Whether `/api/v1/targets` says process `pid` had a report.
fn reported(targets: &str, pid: u32) -> bool {
    let Some(at) = targets.find(&format!("{{\"pid\":{pid},")) else { return false };
    let target = &targets[at..];
    let target = &target[..target.find('}').unwrap_or(target.len())];
    target.contains("\"report_time_unix_ms\":") && !target.contains("\"report_time_unix_ms\":null")
}

/// The page at `url` as headless Chromium draws it, with its HTML.
fn screenshot(workshop: &Workshop, url: &str) -> Result<Artifact> {
    require("chromium")?;
    let html = curl(&[url])?;
    let png = workshop.dir().join("page.png");
    let mut chromium = workshop.command("chromium");
    chromium
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,300"])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("http://{url}"));
    lines_of(&mut chromium)?;
    Ok(Artifact::Png { png: std::fs::read(&png)?, source: html })
}

/// Beyond loopback: refused without a token, then a request without one
/// and with one.
fn serve_token(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let process = target(workshop, &leaker, &["all", "--wait"], "ready")?;
    let pid = process.pid().to_string();
    let mut transcript = Transcript::default();
    let refused = ["serve", "--pid", pid.as_str(), "--listen", "0.0.0.0"];
    let (_, lines) = output(&mut workshop.memleak(&refused))?;
    transcript.command(&typed(&refused)).lines(&lines);
    let make_token = "head -c 24 /dev/urandom | base64 > token";
    lines_of(workshop.command("sh").args(["-c", make_token]))?;
    transcript.command(make_token);
    let port = free_port()?.to_string();
    let args = [
        "serve",
        "--pid",
        pid.as_str(),
        "--listen",
        "0.0.0.0",
        "--port",
        port.as_str(),
        "--token-file",
        "token",
    ];
    let mut daemon = memleak_running(workshop, &args)?;
    daemon.wait_for_start("memleak: serving ")?;
    transcript.command(&format!("{} &", typed(&args)));
    let url = format!("http://127.0.0.1:{port}/metrics");
    transcript.command(&format!("curl -s {url}")).lines(curl(&[&url])?.lines());
    let token = read(&workshop.dir().join("token"))?;
    let header = format!("Authorization: Bearer {}", token.lines().next().unwrap_or_default());
    let authorised = curl(&["-H", &header, &url])?;
    transcript
        .command(&format!("curl -s -H \"Authorization: Bearer $(cat token)\" {url} | head -3"))
        .lines(authorised.lines().take(3));
    daemon.signal(libc::SIGTERM);
    daemon.finish()?;
    Ok(Made::text(&transcript))
}

fn promtool(_workshop: &mut Workshop) -> Result<Made> {
    require("promtool")?;
    let mut transcript = Transcript::default();
    for args in [
        &["check", "config", "contrib/prometheus.yml"][..],
        &["test", "rules", "contrib/memleak-alerts.test.yml"],
    ] {
        let mut command = std::process::Command::new("promtool");
        command.args(args).current_dir(root());
        let (status, lines) = output(&mut command)?;
        if !status.success() {
            bail!("promtool {args:?} failed: {lines:#?}");
        }
        transcript.command(&format!("promtool {}", args.join(" "))).lines(&lines);
    }
    Ok(Made::text(&transcript))
}

/// `--exe`: a program started after the daemon, followed from its
/// execve, and its last report kept once it exited. The leaker runs
/// under a name of its own, for no other leaker on the machine (a test's)
/// to be followed with it.
fn serve_exe(workshop: &mut Workshop) -> Result<Made> {
    let leaker = workshop.fixture("leaker")?;
    let renamed = workshop.dir().join("readme-leaker");
    std::fs::copy(&leaker, &renamed)?;
    let port = port_or_free(9943)?;
    let port_text = port.to_string();
    let mut args = vec!["serve", "--exe", "readme-leaker", "--retain", "30s"];
    if port != 9943 {
        args.extend_from_slice(&["--port", &port_text]);
    }
    let mut daemon = memleak_running(workshop, &args)?;
    daemon.wait_for_start("memleak: serving ")?;
    let mut command = workshop.command(&renamed);
    let mut process = Run::interactive(crate::as_a_service(command.args(["all", "--wait"])))?;
    process.wait_for("\"ready\" from readme-leaker", |line| line == "ready")?;
    daemon.wait_for("the newcomer", |line| line.contains("tracing pid"))?;
    // Its first report, which growth is counted from, before it leaks.
    let url = format!("127.0.0.1:{port}/api/v1/targets");
    curl_until(&url, |body| reported(body, process.pid()))?;
    process.send("go")?;
    process.wait_for("its leaks", |line| line == "done")?;
    // A round that saw them, then its exit: its last report grew no more.
    curl_until(&url, |body| body.contains("\"outstanding_bytes\":17264,"))?;
    process.close_stdin();
    process.finish()?;
    daemon.wait_for("its exit", |line| line.contains("exited"))?;
    let targets = curl_until(&url, |body| body.contains("\"exited\":true"))?;
    let mut transcript = Transcript::default();
    transcript.command(&format!("sudo memleak {}", args.join(" "))).lines(&daemon.seen);
    transcript.command(&format!("curl -s {url}     # after it exited")).lines(targets.lines());
    daemon.signal(libc::SIGTERM);
    daemon.finish()?;
    Ok(Made::text(&transcript))
}

/// `serve --watch` on four processes of the growth fixture: one leaking
/// 64 KiB/s, one holding its memory, a garbage collector's sawtooth, and
/// one leaking 4 MiB/s in a memory cgroup of 96 MiB, which the OOM killer
/// kills while it is traced. Only the two leakers are traced.
fn serve_watch(workshop: &mut Workshop) -> Result<Made> {
    let growth = workshop.fixture("growth")?;
    let mut transcript = Transcript::default();
    let mut processes = Vec::new();
    for args in [["leak", "64"].as_slice(), &["steady"], &["sawtooth"]] {
        processes.push(Run::spawn(workshop.command(&growth).args(args).stdin(std::process::Stdio::null()))?);
        transcript.command(&format!("./growth {} &", args.join(" ")));
    }
    let leaker = processes[0].pid();
    let limited = MemoryLimit::new("memleak-readme-oom", 96 << 20)?;
    let mut victim = Run::spawn(
        workshop
            .command("sh")
            .args([
                "-c",
                &format!("echo $$ > {}/cgroup.procs && exec ./growth leak 4096", limited.path.display()),
            ])
            .stdin(std::process::Stdio::null()),
    )?;
    transcript.command(&limited.typed);
    transcript.command(&format!(
        "sudo sh -c 'echo $$ > {}/cgroup.procs && exec ./growth leak 4096' &",
        limited.path.display()
    ));
    let port = port_or_free(9943)?;
    let port_text = port.to_string();
    let state = workshop.dir().join("state");
    let _ = std::fs::remove_dir_all(&state);
    let mut args = WATCH_ARGS.to_vec();
    if port != 9943 {
        args.extend_from_slice(&["--port", &port_text]);
    }
    let mut daemon = memleak_running(workshop, &args)?;
    daemon.wait_for("the OOM kill", |line| line.contains("was killed by the OOM killer"))?;
    daemon.wait_for("the leaker let go", |line| {
        line.starts_with(&format!("memleak: pid {leaker}: its window ended"))
    })?;
    victim.finish()?;
    transcript.command(&typed(&args)).lines(&daemon.seen);
    watch_endpoints(workshop, &format!("127.0.0.1:{port}"), leaker, &mut transcript)?;
    daemon.signal(libc::SIGTERM);
    daemon.finish()?;
    for mut process in processes {
        process.signal(libc::SIGKILL);
        process.finish()?;
    }
    Ok(Made::text(&transcript))
}

/// The watch's example: a watch of every process of the growth fixture,
/// a look a second, and windows of 20 s.
const WATCH_ARGS: [&str; 14] = [
    "serve",
    "--watch",
    "--exe",
    "growth",
    "--watch-every",
    "1s",
    "--growth-window",
    "12s",
    "--min-growth",
    "16KiB/s",
    "--trace-for",
    "20s",
    "--state-dir",
    "state",
];

/// What the watch's daemon at `address` serves once `leaker` was let go
/// and the OOM killer's victim is gone.
fn watch_endpoints(
    workshop: &Workshop,
    address: &str,
    leaker: u32,
    transcript: &mut Transcript,
) -> Result<()> {
    let metrics = curl(&[&format!("{address}/metrics")])?;
    let watch_lines =
        metrics.lines().filter(|line| line.starts_with("memleak_watch") || line.starts_with("memleak_oom"));
    transcript
        .command(&format!("curl -s {address}/metrics | grep -E '^memleak_(watch|oom)'"))
        .lines(watch_lines);
    let report_url = format!("{address}/api/v1/report?pid={leaker}");
    transcript
        .command(&format!("curl -s '{report_url}'     # its last report, as it was let go"))
        .lines(curl(&[&report_url])?.lines());
    let kills = workshop.dir().join("oom.json");
    std::fs::write(&kills, curl(&[&format!("{address}/api/v1/oom")])?)?;
    let filter = ".kills[] | {pid, program, culprit, culprit_bytes, summary}";
    require("jq")?;
    let picked = lines_of(std::process::Command::new("jq").arg(filter).arg(&kills))?;
    transcript.command(&format!("curl -s {address}/api/v1/oom | jq '{filter}'")).lines(&picked);
    Ok(())
}

/// A memory cgroup of the example's own with a limit: in the cgroup v2
/// hierarchy where it has the memory controller, else in cgroup v1's
/// memory hierarchy; removed when dropped. `typed` makes it in a shell.
struct MemoryLimit {
    path: std::path::PathBuf,
    typed: String,
}

impl MemoryLimit {
    fn new(name: &str, bytes: u64) -> Result<Self> {
        let v2 = Path::new("/sys/fs/cgroup");
        let v2_memory = std::fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|controllers| controllers.split_whitespace().any(|controller| controller == "memory"));
        let (path, file) = if v2_memory {
            (v2.join(name), "memory.max")
        } else {
            (Path::new("/sys/fs/cgroup/memory").join(name), "memory.limit_in_bytes")
        };
        let _ = std::fs::remove_dir(&path);
        std::fs::create_dir(&path).with_context(|| format!("cannot make {}", path.display()))?;
        std::fs::write(path.join(file), bytes.to_string())?;
        // Without swap, the limit kills rather than pages out.
        let swap = if v2_memory { "memory.swap.max" } else { "memory.memsw.limit_in_bytes" };
        let _ = std::fs::write(path.join(swap), if v2_memory { "0".to_owned() } else { bytes.to_string() });
        let (path_shown, mib) = (path.display(), bytes >> 20);
        let typed = if v2_memory {
            format!("sudo mkdir {path_shown} && echo {mib}M | sudo tee {path_shown}/{file} && echo 0 | sudo tee {path_shown}/{swap}")
        } else {
            format!(
                "sudo mkdir {path_shown} && echo {mib}M | sudo tee {path_shown}/{file} {path_shown}/{swap}"
            )
        };
        Ok(Self { path, typed })
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// `--container NAME` on a real podman container (runc, cgroups made by
/// podman itself), in podman storage of the example's own: the host's
/// podman state is never read or changed.
fn serve_podman(workshop: &mut Workshop) -> Result<Made> {
    require("podman")?;
    require("runc")?;
    let leaker = workshop.fixture("leaker")?;
    let podman = Podman::new(workshop.dir())?;
    let rootfs = workshop.dir().join("rootfs");
    if !rootfs.exists() {
        make_rootfs(&leaker, &rootfs)?;
    }
    let mut transcript = Transcript::default();
    transcript.command(
        "export CONTAINERS_STORAGE_CONF=$PWD/podman/storage.conf CONTAINERS_CONF=$PWD/podman/containers.conf",
    );
    let import = "tar -C rootfs -cf image.tar . && sudo -E podman import image.tar localhost/leaker";
    lines_of(podman.command("sh").args(["-c", &import.replace("sudo -E ", "")]))?;
    transcript.command(import);
    let run = [
        "--runtime",
        "runc",
        "--cgroup-manager",
        "cgroupfs",
        "run",
        "-i",
        "--rm",
        "--name",
        "leaker-demo",
        "--network",
        "none",
        "--cidfile",
        "podman/leaker-demo.id",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
        "localhost/leaker",
        "/app/leaker",
        "all",
        "--wait",
    ];
    let mut container = Run::interactive(podman.command("podman").args(run))?;
    podman.started();
    container.wait_for("the contained leaker", |line| line == "ready")?;
    transcript.command(&format!("sudo -E podman {} &", run.join(" ")));
    let port = free_port()?.to_string();
    let args = ["serve", "--container", "leaker-demo", "--port", port.as_str()];
    let mut daemon = Run::interactive(podman.with_env(&mut workshop.memleak(&args)))?;
    daemon.wait_for_start("memleak: serving ")?;
    container.send("go")?;
    container.wait_for("its leaks", |line| line == "done")?;
    let url = format!("127.0.0.1:{port}/metrics");
    let metrics = curl_until(&url, |body| body.contains("} 17264"))?;
    transcript.command(&format!("sudo -E memleak {}", args.join(" "))).lines(&daemon.seen);
    transcript
        .command(&format!("curl -s {url} | grep 'memleak_outstanding_bytes{{'"))
        .lines(metrics.lines().filter(|line| line.starts_with("memleak_outstanding_bytes{")));
    daemon.signal(libc::SIGTERM);
    daemon.finish()?;
    container.close_stdin();
    container.finish()?;
    Ok(Made::text(&transcript))
}

/// Podman with storage under the scratch directory's `podman/`, runc
/// and cgroups it makes itself (crun refuses a hybrid cgroup host, and
/// no systemd runs here). Removes its container, image and any mount
/// it left when dropped, before the directory can be removed.
struct Podman {
    dir: std::path::PathBuf,
    running: std::cell::Cell<bool>,
}

impl Podman {
    fn new(scratch: &Path) -> Result<Self> {
        let dir = scratch.join("podman");
        std::fs::create_dir_all(&dir)?;
        let at = |name: &str| dir.join(name).display().to_string();
        std::fs::write(
            dir.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"overlay\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
                at("storage"),
                at("runroot")
            ),
        )?;
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nruntime = \"runc\"\ntmp_dir = \"{}\"\n\n\
                 [network]\nnetwork_config_dir = \"{}\"\n",
                at("tmp"),
                at("networks")
            ),
        )?;
        Ok(Self { dir, running: std::cell::Cell::new(false) })
    }

    /// `command` with podman pointed at this storage.
    fn with_env<'a>(&self, command: &'a mut std::process::Command) -> &'a mut std::process::Command {
        command
            .env("CONTAINERS_STORAGE_CONF", self.dir.join("storage.conf"))
            .env("CONTAINERS_CONF", self.dir.join("containers.conf"))
    }

    /// `program`, run in the scratch directory, pointed at this storage.
    fn command(&self, program: &str) -> std::process::Command {
        let mut command = std::process::Command::new(program);
        command.current_dir(self.dir.parent().unwrap_or(&self.dir));
        self.with_env(&mut command);
        command
    }

    /// A container was started: remove it when dropped.
    fn started(&self) {
        self.running.set(true);
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        if self.running.get() {
            let id = std::fs::read_to_string(self.dir.join("leaker-demo.id")).unwrap_or_default();
            let _ =
                self.command("podman").args(["rm", "--force", "--time", "0", "--ignore", id.trim()]).output();
        }
        let _ = self.command("podman").args(["rmi", "--force", "localhost/leaker"]).output();
        unmount_below(&self.dir);
    }
}

/// memleak as user nobody, without capabilities: what it says is needed
/// for a process, for the kernel, and for perf-event uprobes.
fn privileges(workshop: &mut Workshop) -> Result<Made> {
    require("setpriv")?;
    // A copy nobody can run, wherever the checkout is.
    let memleak = workshop.dir().join("memleak");
    std::fs::copy(workshop.memleak_path(), &memleak)?;
    let mut transcript = Transcript::default();
    // As typed, the arguments, whether perf-event uprobes are asked for,
    // and the capabilities held.
    let runs: [(&str, &[&str], bool, &str); 4] = [
        ("memleak -p 1          # as nobody, without capabilities", &["-p", "1"], false, ""),
        ("memleak -T 1 1 1      # the kernel", &["-T", "1", "1", "1"], false, ""),
        ("MEMLEAK_PERF_EVENT_UPROBES=1 memleak -p 1", &["-p", "1"], true, ""),
        (
            "memleak -T 1 1 1      # the kernel, with CAP_BPF and CAP_PERFMON",
            &["-T", "1", "1", "1"],
            false,
            ",+bpf,+perfmon",
        ),
    ];
    for (shown, args, perf_events, capabilities) in runs {
        let mut command = workshop.command("setpriv");
        command
            .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"])
            .arg(format!("--inh-caps=-all{capabilities}"))
            .arg(format!("--ambient-caps=-all{capabilities}"))
            .arg(&memleak)
            .args(args);
        if perf_events {
            command.env("MEMLEAK_PERF_EVENT_UPROBES", "1");
        }
        let (_, lines) = output(&mut command)?;
        transcript.command(shown).lines(&lines);
    }
    Ok(Made::text(&transcript))
}

/// A JSON line with the array after `key` cut to its first `count`
/// elements, then `...`: the line as memleak wrote it, shortened.
fn first_items(line: &str, key: &str, count: usize) -> String {
    let Some(start) = line.find(key).map(|at| at + key.len()) else { return line.to_owned() };
    let items = json_items(&line[start..]);
    if items.len() <= count {
        return line.to_owned();
    }
    let kept_end = start + items[count - 1].end;
    let array_end = start + items.last().map_or(0, |item| item.end);
    format!("{},...{}", &line[..kept_end], &line[array_end..])
}

/// The byte ranges of the elements of the JSON array or object whose
/// contents start `text` (just after its `[` or `{`): each a member
/// (`"key":value`) or an element, found by their depth and strings.
fn json_items(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut items = Vec::new();
    let (mut depth, mut in_string, mut escaped, mut start) = (0_i32, false, false, 0);
    for (at, character) in text.char_indices() {
        if in_string {
            match character {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match character {
            '"' => in_string = true,
            '[' | '{' => depth += 1,
            ']' | '}' if depth == 0 => {
                if at > start {
                    items.push(start..at);
                }
                return items;
            }
            ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(start..at);
                start = at + 1;
            }
            _ => {}
        }
    }
    items
}

/// A JSON report wrapped for reading, as memleak wrote it but for the
/// line breaks: four members to a line, each object member on a line of
/// its own, one stack kept of `stacks` and two frames of its `frames`.
/// Lines break by count, not width, for the same report to wrap the same
/// whatever its pid and times.
fn json_wrapped(report: &str) -> Result<String> {
    let body = report.strip_prefix('{').context("a JSON object")?;
    let members = json_items(body);
    let mut lines: Vec<String> = Vec::new();
    let mut line: Vec<String> = Vec::new();
    for range in &members {
        let member = &body[range.clone()];
        if member.starts_with("\"stacks\":[") || member.contains(":{") {
            lines.extend((!line.is_empty()).then(|| line.join(",")));
            line.clear();
            let text =
                if member.starts_with("\"stacks\":[") { wrapped_stacks(member)? } else { member.to_owned() };
            lines.push(text);
            continue;
        }
        line.push(member.to_owned());
        if line.len() == 4 {
            lines.push(line.join(","));
            line.clear();
        }
    }
    lines.extend((!line.is_empty()).then(|| line.join(",")));
    Ok(format!("{{{}}}\n", lines.join(",\n ")))
}

/// `"stacks":[...]` with its first stack kept, wrapped: its members
/// three to a line, its frames one to a line.
fn wrapped_stacks(member: &str) -> Result<String> {
    let inside = &member["\"stacks\":[".len()..];
    let stacks = json_items(inside);
    let first = &inside[stacks.first().context("a stack")?.clone()];
    let stack = first.strip_prefix('{').context("a stack object")?;
    let indent = "   ";
    let mut lines: Vec<String> = Vec::new();
    let mut line: Vec<&str> = Vec::new();
    for range in json_items(stack) {
        let member = &stack[range];
        if let Some(frames) = member.strip_prefix("\"frames\":[") {
            lines.extend((!line.is_empty()).then(|| line.join(",")));
            line.clear();
            let frames: Vec<&str> =
                json_items(frames).into_iter().take(2).map(|range| &frames[range]).collect();
            let align = " ".repeat(indent.len() + "\"frames\":[".len());
            lines.push(format!("\"frames\":[{}]", frames.join(&format!(",\n{align}"))));
            continue;
        }
        line.push(member);
        if line.len() == 3 || member.contains(":{") {
            lines.push(line.join(","));
            line.clear();
        }
    }
    lines.extend((!line.is_empty()).then(|| line.join(",")));
    Ok(format!("\"stacks\":[{{{}}}]", lines.join(&format!(",\n{indent}"))))
}

/// `memleak top` in a terminal of 80x24 (tmux's): the stack that grows
/// first, beside the larger cache that holds still; then opened.
fn top(workshop: &mut Workshop) -> Result<Made> {
    require("tmux")?;
    workshop.fixture("growth")?;
    let socket = format!("memleak-readme-top-{}", std::process::id());
    let tmux = |args: &[&str]| lines_of(std::process::Command::new("tmux").args(["-L", &socket]).args(args));
    let typed_command = "sudo memleak top -c './growth cache-leak 64' 1";
    let command = format!(
        "cd '{}' && exec '{}' top -c './growth cache-leak 64' 1",
        workshop.dir().display(),
        workshop.memleak_path().display()
    );
    tmux(&["new-session", "-d", "-x", "80", "-y", "24", &command])?;
    let shown = (|| {
        // Six rounds: the sparkline has a past.
        let screen = screen_once(&tmux, "six rounds of the leak", |screen| {
            let sparkline = |line: &str| line.matches(['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█']).count();
            screen
                .lines()
                .any(|line| line.starts_with('>') && line.contains("leak_slowly") && sparkline(line) >= 6)
                && screen.contains("fill_cache")
        })?;
        tmux(&["send-keys", "Enter"])?;
        let opened = screen_once(&tmux, "the leak's frames", |screen| {
            screen.lines().any(|line| line.starts_with("      main+0x"))
        })?;
        tmux(&["send-keys", "q"])?;
        Ok::<_, anyhow::Error>((screen, opened))
    })();
    let _ = tmux(&["kill-server"]);
    let (screen, opened) = shown?;
    let mut transcript = Transcript::default();
    // The rows below the table are blank on a screen this high.
    let drawn = |screen: &str| -> Vec<String> {
        screen.lines().map(str::trim_end).filter(|line| !line.is_empty()).map(str::to_owned).collect()
    };
    transcript.command(typed_command).lines(drawn(&screen));
    transcript.line("").line("(Enter: the selected stack, opened)").line("");
    transcript.lines(drawn(&opened));
    Ok(Made::text(&transcript))
}

/// tmux's screen once `wanted` holds for it, and it holds still: the
/// same in two captures a fifth of a second apart, not caught mid-draw.
fn screen_once(
    tmux: &dyn Fn(&[&str]) -> Result<Vec<String>>,
    what: &str,
    wanted: impl Fn(&str) -> bool,
) -> Result<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_mins(1);
    let mut last = String::new();
    loop {
        let screen = tmux(&["capture-pane", "-p"])?.join("\n");
        if wanted(&screen) && screen == last {
            return Ok(screen);
        }
        if std::time::Instant::now() > deadline {
            bail!("no screen with {what} after a minute; the last:\n{screen}");
        }
        last = screen;
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_array_is_cut_to_its_first_items() {
        let line = r#"{"event":"probes","probes":[{"a":1},{"b":"x,]}"},{"c":[3,4]},{"d":4}],"end":true}"#;
        assert_eq!(
            first_items(line, "\"probes\":[", 2),
            r#"{"event":"probes","probes":[{"a":1},{"b":"x,]}"},...],"end":true}"#
        );
        assert_eq!(first_items(line, "\"probes\":[", 4), line);
    }

    #[test]
    fn a_json_report_is_wrapped_not_changed() {
        let report = r#"{"pid":1,"program":"/a","stacks":[{"stack_id":2,"bytes":8,"frames":[{"f":1},{"f":2},{"f":3}],"lost":false},{"stack_id":3}],"health":{"frees":1},"end":null}"#;
        let wrapped = json_wrapped(report).unwrap();
        assert_eq!(
            wrapped,
            "{\"pid\":1,\"program\":\"/a\",\n \"stacks\":[{\"stack_id\":2,\"bytes\":8,\n   \"frames\":[{\"f\":1},\n             {\"f\":2}],\n   \"lost\":false}],\n \"health\":{\"frees\":1},\n \"end\":null}\n"
        );
        let unwrapped: String = wrapped.lines().map(str::trim_start).collect();
        assert!(unwrapped.starts_with(r#"{"pid":1,"program":"/a","stacks":[{"stack_id":2"#));
    }

    #[test]
    fn arguments_are_quoted_as_a_shell_needs() {
        assert_eq!(typed(&["-c", "./leaker all", "-T", "1"]), "sudo memleak -c './leaker all' -T 1");
    }
}
