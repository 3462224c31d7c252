//! `memleak serve --watch` on a busy node: the daemon's own CPU while it
//! watches 0, 100 and 1,000 processes from their counters, a look a
//! second, with nothing growing. The fixed cost is the run with none; the
//! slope between 100 and 1,000 is what each process watched costs a look,
//! which is what must stay flat.
//!
//! And what memleak estimates its probes cost a traced process
//! (`memleak_overhead_seconds_total`) against what they cost it: the CPU
//! time of the growth fixture's busy leaker (20,000 malloc/free pairs a
//! second) traced, less its CPU time untraced, over the same span.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    process::{process_cpu_ns, Killed},
    serve::{get, Daemon},
};

/// Processes watched in each run.
const SIZES: [usize; 3] = [0, 100, 1_000];
/// Looks a run is measured over, after the first ones (the daemon's start,
/// and its first sight of every process).
const LOOKS: u32 = 10;
const SETTLE: Duration = Duration::from_secs(4);

/// One run: processes watched, and the daemon's CPU per look.
pub struct WatchCost {
    processes: usize,
    cpu_per_look: Duration,
}

pub fn measure(memleak: &Path) -> Result<Vec<WatchCost>> {
    SIZES.iter().map(|&processes| measure_one(memleak, processes)).collect()
}

fn measure_one(memleak: &Path, processes: usize) -> Result<WatchCost> {
    let cgroup = BenchCgroup::new(&format!("memleak-bench-watch-{}", std::process::id()))?;
    let mut sleepers = Vec::with_capacity(processes);
    for _ in 0..processes {
        let child =
            Command::new("sleep").arg("3600").stdin(Stdio::null()).spawn().context("cannot start sleep")?;
        std::fs::write(cgroup.0.join("cgroup.procs"), child.id().to_string())?;
        sleepers.push(Killed(child));
    }
    let cgroup_arg = cgroup.0.to_str().context("a cgroup path in UTF-8")?.to_owned();
    let daemon = Daemon::start(
        memleak,
        &["--watch", "--cgroup", &cgroup_arg, "--watch-every", "1s", "--growth-window", "8s"],
    )?;
    let pid = daemon.pid();
    thread::sleep(SETTLE);
    let (cpu_before, started) = (process_cpu_ns(pid)?, Instant::now());
    thread::sleep(Duration::from_secs(u64::from(LOOKS)));
    let cpu = process_cpu_ns(pid)?.saturating_sub(cpu_before);
    let looks = started.elapsed().as_secs_f64();
    drop(daemon);
    drop(sleepers);
    Ok(WatchCost { processes, cpu_per_look: Duration::from_secs_f64(cpu as f64 / 1e9 / looks) })
}

pub fn print(costs: &Result<Vec<WatchCost>>) {
    println!("\nmemleak serve --watch: its own CPU per look (one a second), nothing growing");
    let costs = match costs {
        Ok(costs) => costs,
        Err(error) => {
            println!("  not measured: {error:#}");
            return;
        }
    };
    println!("  {:>9}  {:>12}", "processes", "CPU per look");
    for cost in costs {
        println!("  {:>9}  {:>9.2} ms", cost.processes, cost.cpu_per_look.as_secs_f64() * 1e3);
    }
    let of = |processes| costs.iter().find(|cost| cost.processes == processes).map(|cost| cost.cpu_per_look);
    if let (Some(hundred), Some(thousand)) = (of(100), of(1_000)) {
        let per_process = thousand.saturating_sub(hundred).as_secs_f64() / 900.0;
        println!(
            "  each process watched: {:.1} us a look (the slope from 100 to 1,000); 1,000 processes, a look every \
             5 s (the default): {:.2}% of a CPU",
            per_process * 1e6,
            thousand.as_secs_f64() / 5.0 * 100.0
        );
    }
}

/// How long each run of the busy leaker is measured, after it settles.
const ESTIMATE_SPAN: Duration = Duration::from_secs(10);

/// The busy leaker's CPU over `ESTIMATE_SPAN`, untraced and traced, and
/// memleak's estimate of its probes' cost over the traced span.
pub struct EstimateCheck {
    untraced: Duration,
    traced: Duration,
    estimate: Duration,
}

pub fn measure_estimate(memleak: &Path) -> Result<EstimateCheck> {
    let growth = crate::build_fixture_with("growth", &["-O2"])?;
    let start = || -> Result<Killed> {
        let child = Command::new(&growth).args(["busy-leak", "64"]).stdin(Stdio::null()).spawn()?;
        Ok(Killed(child))
    };
    let untraced = {
        let leaker = start()?;
        thread::sleep(SETTLE);
        let before = process_cpu_ns(leaker.0.id())?;
        thread::sleep(ESTIMATE_SPAN);
        Duration::from_nanos(process_cpu_ns(leaker.0.id())?.saturating_sub(before))
    };
    let leaker = start()?;
    let pid = leaker.0.id();
    let daemon = Daemon::start(memleak, &["--pid", &pid.to_string()])?;
    let series = format!("memleak_overhead_seconds_total{{pid=\"{pid}\",exe=\"growth\"}} ");
    let estimated = |daemon: &Daemon| -> Result<f64> {
        let metrics = get(daemon.port, "/metrics")?;
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(&series)?.parse().ok())
            .with_context(|| format!("no estimate for pid {pid} in /metrics"))
    };
    thread::sleep(SETTLE);
    let (cpu_before, estimate_before) = (process_cpu_ns(pid)?, estimated(&daemon)?);
    thread::sleep(ESTIMATE_SPAN);
    let (cpu_after, estimate_after) = (process_cpu_ns(pid)?, estimated(&daemon)?);
    drop(daemon);
    Ok(EstimateCheck {
        untraced,
        traced: Duration::from_nanos(cpu_after.saturating_sub(cpu_before)),
        estimate: Duration::from_secs_f64((estimate_after - estimate_before).max(0.0)),
    })
}

pub fn print_estimate(check: &Result<EstimateCheck>) {
    println!("\nmemleak's estimate of its probes' cost, against the cost measured (growth busy-leak, 20,000 pairs a second)");
    let check = match check {
        Ok(check) => check,
        Err(error) => {
            println!("  not measured: {error:#}");
            return;
        }
    };
    let measured = check.traced.saturating_sub(check.untraced);
    println!(
        "  over {} s: CPU untraced {:.1} ms, traced {:.1} ms: the probes cost {:.1} ms; memleak estimated {:.1} ms",
        ESTIMATE_SPAN.as_secs(),
        check.untraced.as_secs_f64() * 1e3,
        check.traced.as_secs_f64() * 1e3,
        measured.as_secs_f64() * 1e3,
        check.estimate.as_secs_f64() * 1e3,
    );
    println!(
        "  estimate / measured: {:.2} (the issue asks within 30%: 0.70 to 1.30)",
        check.estimate.as_secs_f64() / measured.as_secs_f64().max(1e-9)
    );
}

/// A cgroup v2 directory the bench puts its processes in, removed after.
struct BenchCgroup(PathBuf);

impl BenchCgroup {
    fn new(name: &str) -> Result<Self> {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
        let root = mounts
            .lines()
            .find_map(|line| {
                let (fields, filesystem) = line.split_once(" - ")?;
                filesystem
                    .starts_with("cgroup2 ")
                    .then(|| fields.split_whitespace().nth(4).map(PathBuf::from))?
            })
            .context("no cgroup v2 hierarchy mounted")?;
        let path = root.join(name);
        std::fs::create_dir_all(&path).with_context(|| format!("cannot make {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        // Its processes are killed by now; the kernel takes a moment to
        // let go of them.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}
