//! `memleak serve` left running: what one scrape of each endpoint costs
//! with 10,000 stacks outstanding, and a soak in which short-lived
//! leaking processes come and go under `--exe` while `/metrics` and
//! `/debug/pprof/heap` are scraped every second. The daemon's memory,
//! descriptors and BPF map entries are taken at the soak's start and end:
//! a daemon that keeps anything of the processes it forgot grows.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{latency::start_waiting, map_memory, process::release};

/// One endpoint's cost, the median of its scrapes.
pub struct ScrapeCost {
    path: String,
    median: Duration,
    bytes: usize,
}

/// Endpoints scraped at 10,000 stacks; `{pid}` is the fixture's.
const SCRAPED: [&str; 6] = [
    "/metrics",
    "/api/v1/targets",
    "/",
    "/api/v1/report?pid={pid}",
    "/api/v1/report?pid={pid}&format=svg",
    "/debug/pprof/heap?pid={pid}",
];

/// Scrapes of each endpoint; the median is shown.
const SCRAPES: usize = 5;

/// A round younger than this is served as it is (the daemon's
/// `FRESH_ENOUGH`); scrapes are spaced further apart so that each one
/// pays for the collection it asks for, as Prometheus' would.
const SCRAPE_SPACING: Duration = Duration::from_millis(700);

/// `spread` holds `allocations` blocks over 10,000 stacks under `memleak
/// serve`, and each endpoint is scraped `SCRAPES` times.
pub fn measure_scrapes(memleak: &Path, spread: &Path, allocations: u64) -> Result<Vec<ScrapeCost>> {
    let (mut target, mut target_stderr) = start_waiting(spread, &[allocations])?;
    let pid = target.id();
    let daemon = Daemon::start(memleak, &["--pid", &pid.to_string(), "--interval", "3600"]);
    let measured = daemon.and_then(|daemon| {
        release(target.stdin.as_mut().context("no stdin")?)?;
        super::process::wait_for_line(&mut target_stderr, "ready")?;
        daemon.wait_for(&format!("\"outstanding_allocations\":{allocations}"))?;
        SCRAPED
            .iter()
            .map(|path| {
                let path = path.replace("{pid}", &pid.to_string());
                let mut times = Vec::with_capacity(SCRAPES);
                let mut bytes = 0;
                for _ in 0..SCRAPES {
                    thread::sleep(SCRAPE_SPACING);
                    let started = Instant::now();
                    bytes = get(daemon.port, &path)?.len();
                    times.push(started.elapsed());
                }
                times.sort_unstable();
                Ok(ScrapeCost { path, median: times[SCRAPES / 2], bytes })
            })
            .collect()
    });
    let _ = target.kill();
    let _ = target.wait();
    measured
}

pub fn print_scrapes(allocations: u64, costs: &Result<Vec<ScrapeCost>>) {
    println!("\nmemleak serve: one scrape with {allocations} allocations outstanding over 10,000 stacks (median of {SCRAPES})");
    match costs {
        Ok(costs) => {
            println!("  {:<40} {:>10} {:>12}", "endpoint", "time", "body");
            for cost in costs {
                let path = cost
                    .path
                    .split_once("pid=")
                    .map_or(cost.path.clone(), |(head, _)| format!("{head}pid=PID"));
                let format = cost
                    .path
                    .split_once("&format=")
                    .map_or(String::new(), |(_, format)| format!("&format={format}"));
                println!(
                    "  {:<40} {:>8.1} ms {:>10} B",
                    format!("{path}{format}"),
                    cost.median.as_secs_f64() * 1000.0,
                    cost.bytes
                );
            }
        }
        Err(error) => println!("  not measured: {error:#}"),
    }
}

/// How long the soak lasts, and how many processes come and go in it;
/// and how many pods come and go on a node.
pub struct SoakPlan {
    pub duration: Duration,
    pub processes: u32,
    pub pods: usize,
}

/// What the daemon holds at one moment.
#[derive(Clone, Copy)]
pub(super) struct Holdings {
    pub(super) rss_kib: u64,
    pub(super) descriptors: u64,
    map_entries: u64,
}

impl Holdings {
    /// Prints `start` and `end` side by side, with their ratio.
    pub(super) fn print_change(start: Self, end: Self) {
        println!("  {:<26} {:>10} {:>10} {:>9}", "", "start", "end", "end/start");
        let row = |name: &str, start: u64, end: u64| {
            println!("  {name:<26} {start:>10} {end:>10} {:>9.2}", end as f64 / start.max(1) as f64);
        };
        row("RSS (KiB)", start.rss_kib, end.rss_kib);
        row("open descriptors", start.descriptors, end.descriptors);
        row("BPF map entries", start.map_entries, end.map_entries);
    }
}

pub struct Soak {
    start: Holdings,
    end: Holdings,
    started: u32,
    /// Processes the daemon listed at some point.
    followed: usize,
    scrapes: u32,
    /// Scrapes answered other than 200, by endpoint and answer (a pprof
    /// of a process forgotten since it was listed gets 404).
    failed_scrapes: std::collections::BTreeMap<String, u32>,
}

/// Followed processes are forgotten this long after they exit.
pub(super) const SOAK_RETAIN: &str = "5s";

/// Past `SOAK_RETAIN`, with a second to spare: every process that exited
/// is forgotten.
pub(super) const RETAINED_AND_FORGOTTEN: Duration = Duration::from_secs(7);

/// Runs `memleak serve --exe` on `soak_leaker` (the leaker, built under
/// a name of its own), and starts `plan.processes` short-lived leakers
/// over `plan.duration` while scraping every second.
pub fn soak(memleak: &Path, soak_leaker: &Path, plan: &SoakPlan) -> Result<Soak> {
    let name = soak_leaker.file_name().and_then(|name| name.to_str()).context("a leaker's name")?;
    let daemon = Daemon::start(memleak, &["--exe", name, "--retain", SOAK_RETAIN, "--interval", "1"])?;
    // What is made once, for the first process followed (the fork
    // tracepoint's link, say), is in place at the start.
    let mut first = short_lived(soak_leaker)?;
    let since = Instant::now();
    while !lived_its_life(since, &mut first) {
        thread::sleep(Duration::from_millis(100));
    }
    thread::sleep(RETAINED_AND_FORGOTTEN);
    let start = daemon.holdings()?;
    let mut scraping = Scraping::default();
    let spacing = plan.duration / plan.processes.max(1);
    let began = Instant::now();
    let mut next_start = began;
    let mut running: Vec<(Instant, Child)> = Vec::new();
    let mut started = 0;
    while started < plan.processes || !running.is_empty() {
        if started < plan.processes && Instant::now() >= next_start {
            running.push((Instant::now(), short_lived(soak_leaker)?));
            started += 1;
            next_start += spacing;
        }
        running.retain_mut(|(since, child)| !lived_its_life(*since, child));
        scraping.scrape(&daemon);
        thread::sleep(Duration::from_secs(1));
    }
    thread::sleep(RETAINED_AND_FORGOTTEN);
    let end = daemon.holdings()?;
    Ok(Soak {
        start,
        end,
        started,
        followed: scraping.seen.len(),
        scrapes: scraping.scrapes,
        failed_scrapes: scraping.failed,
    })
}

pub fn print_soak(plan: &SoakPlan, soak: &Result<Soak>) {
    println!(
        "\nmemleak serve soak: {} leakers started and exited over {} s under --exe --retain {SOAK_RETAIN}, /metrics and /debug/pprof/heap scraped every second",
        plan.processes,
        plan.duration.as_secs()
    );
    let soak = match soak {
        Ok(soak) => soak,
        Err(error) => {
            println!("  not measured: {error:#}");
            return;
        }
    };
    Holdings::print_change(soak.start, soak.end);
    let failed: u32 = soak.failed_scrapes.values().sum();
    println!(
        "  {} of {} processes followed (a first one came and went before the start); {} scrapes, {failed} not answered 200",
        soak.followed, soak.started, soak.scrapes
    );
    for (failure, count) in &soak.failed_scrapes {
        println!("    {count} x {failure}");
    }
}

/// Allocations the pickup's python makes, a millisecond apart, from its
/// start.
const PICKUP_ALLOCATIONS: u64 = 200;

/// The size of each: a `bytearray(123456)`, which `CPython` allocates with
/// one more byte for its NUL. No other allocation of python's start has
/// it, so these are counted apart from the rest.
const PICKUP_BLOCK: u64 = 123_457;

/// How soon `--exe` takes in a program that starts after the daemon:
/// Debian's python3 makes `PICKUP_ALLOCATIONS` blocks of `PICKUP_BLOCK` bytes a
/// millisecond apart from its start, and the allocations the daemon saw
/// are counted, in each of `runs` runs one after another under one
/// daemon (each held at its execve until probed: the first run of a
/// program is stopped again at its loader, the next ones are probed with
/// its plan).
pub fn measure_pickup(memleak: &Path, runs: usize) -> Result<Vec<u64>> {
    let python = std::fs::canonicalize("/usr/bin/python3").context("no /usr/bin/python3")?;
    let name = python.file_name().and_then(|name| name.to_str()).context("python's name")?.to_owned();
    let script = format!(
        "import time\nx = []\nfor i in range({PICKUP_ALLOCATIONS}):\n    x.append(bytearray(123456))\n    time.sleep(0.001)\ntime.sleep(30)\n"
    );
    let daemon = Daemon::start(memleak, &["--exe", &name])?;
    (0..runs)
        .map(|_| {
            let mut command = Command::new(&python);
            command.args(["-c", &script]).stdout(Stdio::null()).stderr(Stdio::null());
            let mut program = crate::as_a_service(&mut command).spawn().context("cannot run python3")?;
            let pid = program.id();
            // Its allocations are all made well within this.
            thread::sleep(Duration::from_secs(2));
            let seen = daemon.blocks_of(pid, PICKUP_BLOCK);
            let _ = program.kill();
            let _ = program.wait();
            seen
        })
        .collect()
}

pub fn print_pickup(seen: &Result<Vec<u64>>) {
    println!(
        "\nmemleak serve --exe: of {PICKUP_ALLOCATIONS} allocations python3 makes a millisecond apart from its start, those seen"
    );
    match seen {
        Ok(seen) => {
            let mut sorted = seen.clone();
            sorted.sort_unstable();
            let runs: Vec<String> = seen.iter().map(u64::to_string).collect();
            println!(
                "  median {} (lowest {}), runs: {}",
                sorted[sorted.len() / 2],
                sorted.first().copied().unwrap_or(0),
                runs.join(", ")
            );
        }
        Err(error) => println!("  not measured: {error:#}"),
    }
}

/// A leaker that waits half a second, leaks, and a second later exits.
fn short_lived(program: &Path) -> Result<Child> {
    Command::new(program)
        .args(["all", "--wait"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start a leaker")
}

/// Lets a leaker go half a second after its start, ends it a second
/// after that; whether it has ended (and been reaped).
fn lived_its_life(since: Instant, child: &mut Child) -> bool {
    let age = since.elapsed();
    if age >= Duration::from_millis(500) {
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"go\n");
            if age < Duration::from_millis(1500) {
                child.stdin = Some(stdin);
            }
        }
    }
    matches!(child.try_wait(), Ok(Some(_)))
}

/// The soak's scrapes, and the processes they saw.
#[derive(Default)]
struct Scraping {
    seen: std::collections::BTreeSet<u64>,
    scrapes: u32,
    failed: std::collections::BTreeMap<String, u32>,
}

impl Scraping {
    fn scrape(&mut self, daemon: &Daemon) {
        let mut count = |answer: Result<String>| {
            self.scrapes += 1;
            answer
                .map_err(|error| {
                    // `GET /path?query: status`: the endpoint and the status.
                    let error = error.to_string();
                    let failure = match error.split_once('?') {
                        Some((endpoint, rest)) => {
                            format!("{endpoint}: {}", rest.split_once(": ").map_or("", |(_, status)| status))
                        }
                        None => error,
                    };
                    *self.failed.entry(failure).or_default() += 1;
                })
                .ok()
        };
        let _ = count(get(daemon.port, "/metrics"));
        let Some(targets) = count(get(daemon.port, "/api/v1/targets")) else { return };
        let listed: serde_json::Value = serde_json::from_str(&targets).unwrap_or_default();
        let pids: Vec<u64> = listed["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|target| target["pid"].as_u64())
            .collect();
        self.seen.extend(&pids);
        if let Some(pid) = pids.last() {
            let _ = count(get(daemon.port, &format!("/debug/pprof/heap?pid={pid}")));
        }
    }
}

/// A `memleak serve` the bench started, killed when dropped.
pub(super) struct Daemon {
    child: Child,
    pub(super) port: u16,
}

impl Daemon {
    pub(super) fn start(memleak: &Path, args: &[&str]) -> Result<Self> {
        let port = free_port()?;
        // To a file, not a pipe nobody reads: a daemon must not block on
        // its own log.
        let log_path = crate::root().join(format!("target/bench/serve-{port}.log"));
        std::fs::create_dir_all(log_path.parent().context("a log directory")?)?;
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(memleak)
            .arg("serve")
            .args(args)
            .args(["--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start memleak serve")?;
        let mut daemon = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(port, "/healthz").is_err() {
            if let Some(status) = daemon.child.try_wait()? {
                let said = std::fs::read_to_string(&log_path).unwrap_or_default();
                bail!("memleak serve {args:?} failed with {status}: {}", super::process::last_line(&said));
            }
            if Instant::now() > deadline {
                bail!("memleak serve did not answer /healthz within 30 s");
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(daemon)
    }

    /// The daemon's pid, to read its CPU.
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `/api/v1/targets` until it holds `text`.
    fn wait_for(&self, text: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_mins(1);
        while !get(self.port, "/api/v1/targets")?.contains(text) {
            if Instant::now() > deadline {
                bail!("/api/v1/targets never showed {text}");
            }
            thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// How many blocks of `size` bytes process `pid` holds, as its JSON
    /// report counts them: the stacks whose every block has that size.
    fn blocks_of(&self, pid: u32, size: u64) -> Result<u64> {
        let report: serde_json::Value = serde_json::from_str(&get(
            self.port,
            &format!("/api/v1/report?pid={pid}&format=json&top=1000000"),
        )?)?;
        let stacks = report["stacks"].as_array().cloned().unwrap_or_default();
        Ok(stacks
            .iter()
            .filter_map(|stack| Some((stack["bytes"].as_u64()?, stack["allocations"].as_u64()?)))
            .filter(|&(bytes, allocations)| allocations > 0 && bytes == allocations * size)
            .map(|(_, allocations)| allocations)
            .sum())
    }

    pub(super) fn holdings(&self) -> Result<Holdings> {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kib = status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|value| value.split_whitespace().next()?.parse().ok())
            .context("no VmRSS")?;
        let descriptors = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
        Ok(Holdings { rss_kib, descriptors, map_entries: map_memory::entries_of_process(pid)? })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SIGTERM: the daemon detaches its probes as it ends.
        // SAFETY: kill(2) on our own, unreaped child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).context("cannot bind a loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// `GET path` from the daemon: its body, or an error unless it answered
/// 200.
pub(super) fn get(port: u16, path: &str) -> Result<String> {
    Ok(String::from_utf8_lossy(&get_bytes(port, path)?).into_owned())
}

/// `GET path`'s body, as sent (a profile is gzipped).
pub(super) fn get_bytes(port: u16, path: &str) -> Result<Vec<u8>> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_mins(1)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let head_end =
        raw.windows(4).position(|window| window == b"\r\n\r\n").context("no end of the response's head")?;
    let (head, body) = (String::from_utf8_lossy(&raw[..head_end]), &raw[head_end + 4..]);
    if !head.starts_with("HTTP/1.1 200") {
        // The reason, its numbers (pids) left out so that alike failures
        // are counted together.
        let reason: String = String::from_utf8_lossy(body)
            .lines()
            .next()
            .unwrap_or_default()
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .collect();
        bail!("GET {path}: {} ({reason})", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_vec())
}

/// The leaker, built as a release build would be (no frame pointers)
/// under the name `--exe` follows.
pub fn soak_leaker() -> Result<PathBuf> {
    crate::build_fixture_without_frame_pointers("leaker", "soak-leaker", &["-O2", "-fomit-frame-pointer"])
}
