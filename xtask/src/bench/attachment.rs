//! What attaching costs, beyond the traps in the target: memleak's start
//! until its first uprobe is attached and from SIGINT to its exit, with
//! multi-uprobe links (its way on Linux 6.6 and later) and with one
//! perf-event uprobe per site (its way before, the baseline); and the
//! speed of a process memleak does not trace while it traces another one
//! mapping the same libc, by -p and by --cgroup.

use std::{
    io::{BufRead as _, Read as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    median,
    process::{last_line, run_to_end, spawn_with_pipe, tracing, Killed},
    stats::Record,
    workload::{Build, Summary, Workload},
};

/// The environment variable that makes memleak use perf-event uprobes.
const PERF_EVENT_UPROBES: &str = "MEMLEAK_PERF_EVENT_UPROBES";

/// How memleak attaches.
#[derive(Clone, Copy)]
enum Links {
    Multi,
    PerfEvents,
}

impl Links {
    fn label(self) -> &'static str {
        match self {
            Self::Multi => "multi-uprobe links",
            Self::PerfEvents => "perf-event uprobes",
        }
    }
}

/// Start and exit times of one way of attaching, each run's.
pub struct Lifecycle {
    links: Links,
    attached_ms: Vec<f64>,
    exit_ms: Vec<f64>,
}

/// memleak -p on a sleeping glibc program, `runs` times each way,
/// interleaved.
pub fn measure_lifecycle(memleak: &Path, runs: usize) -> Result<Vec<Lifecycle>> {
    let mut rows: Vec<Lifecycle> = [Links::Multi, Links::PerfEvents]
        .into_iter()
        .map(|links| Lifecycle { links, attached_ms: Vec::new(), exit_ms: Vec::new() })
        .collect();
    for run in 1..=runs {
        for row in &mut rows {
            eprintln!("bench: start and exit {run}/{runs}: {}", row.links.label());
            let (attached, exit) = start_and_stop(memleak, row.links)?;
            row.attached_ms.push(attached);
            row.exit_ms.push(exit);
        }
    }
    Ok(rows)
}

/// One memleak -p: until its first uprobe (from its --stats), and from
/// SIGINT until it has exited, probes detached.
fn start_and_stop(memleak: &Path, links: Links) -> Result<(f64, f64)> {
    let target = sleeper()?;
    let mut command = Command::new(memleak);
    command
        .args(["-p", &target.0.id().to_string(), "-T", "1000", "3600"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Links::PerfEvents = links {
        command.env(PERF_EVENT_UPROBES, "1");
    }
    let (child, stats) = spawn_with_pipe(&mut command, "--stats")?;
    let mut memleak = Killed(child);
    let mut attached = None;
    let mut records = std::io::BufReader::new(stats).lines();
    for line in records.by_ref() {
        if let Record::Started(started) = Record::parse(&line?)? {
            attached = started.attached_ms;
            break;
        }
    }
    // Read on, for memleak never to write into a closed pipe.
    std::thread::spawn(move || records.for_each(drop));
    let attached = attached.context("memleak's --stats said nothing of its first uprobe")?;
    let stopping = Instant::now();
    // SAFETY: SIGINT to our own child, not reaped yet.
    unsafe { libc::kill(memleak.0.id() as libc::pid_t, libc::SIGINT) };
    let ended = memleak.0.wait()?;
    let exit = stopping.elapsed();
    if !ended.success() {
        let mut stderr = String::new();
        memleak.0.stderr.take().map(|mut pipe| pipe.read_to_string(&mut stderr));
        bail!("memleak -p exited with {ended}: {}", last_line(&stderr));
    }
    Ok((attached, millis(exit)))
}

pub fn print_lifecycle(rows: &[Lifecycle]) {
    println!();
    println!("memleak -p on a sleeping glibc program (sleep 3600), medians:");
    println!();
    println!("| uprobes | start until the first is attached | SIGINT until exit |");
    println!("|---|---|---|");
    for row in rows {
        let (attached, exit) = (median_ms(&row.attached_ms), median_ms(&row.exit_ms));
        println!("| {} | {attached:.0} ms | {exit:.0} ms |", row.links.label());
    }
    println!();
    if let Some(multi) = rows.iter().find(|row| matches!(row.links, Links::Multi)) {
        println!(
            "start until the first uprobe: {:.0} ms (goal < 150 ms); SIGINT until exit: {:.0} ms (goal < 300 ms)",
            median_ms(&multi.attached_ms),
            median_ms(&multi.exit_ms)
        );
    }
}

/// Where memleak traces another process while the workload runs.
#[derive(Clone, Copy)]
enum Neighbour {
    Alone,
    ByPid,
    ByCgroup,
}

impl Neighbour {
    fn label(self) -> &'static str {
        match self {
            Self::Alone => "alone",
            Self::ByPid => "while memleak -p traces another process",
            Self::ByCgroup => "while memleak --cgroup traces another cgroup",
        }
    }
}

/// The bystander workload: 2 threads of a million malloc/free pairs,
/// long enough (tens of ms) for a slowdown of a few percent to show.
const BYSTANDER_ARGS: [&str; 3] = ["2", "1000000", "100"];

/// The untraced workload's times in one setting.
pub struct Bystander {
    neighbour: Neighbour,
    elapsed_ns: Vec<u64>,
}

/// The workload (frame-pointer build, untraced) alone and beside a
/// memleak tracing a sleeping process, `runs` times each, interleaved.
pub fn measure_bystander(workload: &Workload, runs: usize) -> Result<Vec<Bystander>> {
    let cgroup = TestCgroup::new()?;
    let mut rows: Vec<Bystander> = [Neighbour::Alone, Neighbour::ByPid, Neighbour::ByCgroup]
        .into_iter()
        .map(|neighbour| Bystander { neighbour, elapsed_ns: Vec::new() })
        .collect();
    for run in 1..=runs {
        for row in &mut rows {
            eprintln!("bench: bystander {run}/{runs}: {}", row.neighbour.label());
            let sleeper = sleeper()?;
            let pid = sleeper.0.id().to_string();
            let _tracer = match row.neighbour {
                Neighbour::Alone => None,
                Neighbour::ByPid => Some(tracing(Command::new(&workload.memleak).args(["-p", &pid]))?),
                Neighbour::ByCgroup => {
                    cgroup.join(sleeper.0.id())?;
                    Some(tracing(Command::new(&workload.memleak).args(["--cgroup", &cgroup.path()?]))?)
                }
            };
            let path = workload.path(Build::FramePointers);
            let finished = run_to_end(Command::new(path).args(BYSTANDER_ARGS))?;
            row.elapsed_ns.push(Summary::parse(&finished.stderr)?.elapsed_ns);
        }
    }
    Ok(rows)
}

pub fn print_bystander(rows: &[Bystander]) {
    println!();
    println!("the workload untraced, alone and beside a memleak tracing another process that maps the same libc, medians:");
    println!();
    println!("| untraced workload | median wall time | speed against alone |");
    println!("|---|---|---|");
    let alone = rows
        .iter()
        .find(|row| matches!(row.neighbour, Neighbour::Alone))
        .map(|row| median_ns(&row.elapsed_ns));
    for row in rows {
        let time = median_ns(&row.elapsed_ns);
        let speed = alone.map(|alone| format!("{:.2}", alone / time)).unwrap_or_default();
        println!("| {} | {:.1} ms | {speed} |", row.neighbour.label(), time / 1e6);
    }
    println!();
    println!("goal: at least 0.95 of its speed alone, by -p and by --cgroup");
}

/// `sleep 3600`, once it runs sleep: memleak -p on the child before its
/// exec would plan for the bench's own binary.
fn sleeper() -> Result<Killed> {
    let sleeper = Killed(Command::new("sleep").arg("3600").spawn().context("cannot run sleep")?);
    let exe = format!("/proc/{}/exe", sleeper.0.id());
    while !std::fs::read_link(&exe).is_ok_and(|path| path.ends_with("sleep")) {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(sleeper)
}

/// A cgroup v2 directory of the bench's own, removed when dropped.
struct TestCgroup(PathBuf);

impl TestCgroup {
    fn new() -> Result<Self> {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(PathBuf::from)
            .find(|root| root.join("cgroup.controllers").exists())
            .context("no cgroup v2 hierarchy")?;
        let path = root.join(format!("memleak-bench-{}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self(path))
    }

    fn join(&self, pid: u32) -> Result<()> {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string())
            .context("cannot move a process into the cgroup")
    }

    fn path(&self) -> Result<String> {
        self.0.to_str().map(str::to_owned).context("a cgroup path that is not UTF-8")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// The median of `values` in ms, NaN (printed as such) of none.
fn median_ms(values: &[f64]) -> f64 {
    median(values).unwrap_or(f64::NAN)
}

fn median_ns(values: &[u64]) -> f64 {
    median(values).map_or(f64::NAN, |ns| ns as f64)
}
