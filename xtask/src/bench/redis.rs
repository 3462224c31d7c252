//! What tracing costs a real server on another allocator: Debian's
//! redis-server, which links jemalloc, under `redis-benchmark -t set,get
//! -P 1`. Throughput under memleak, and under the libbpf-tools probe set
//! (malloc, its return and free in jemalloc, by bpftrace), over untraced.
//! Rounds alternate the three, for the machine's drift to hit all alike.

use std::{
    io::BufReader,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
};

use anyhow::{Context as _, Result};

use super::{
    median,
    process::{run_to_end, wait_for_line},
    unwind_tables::RedisServer,
};

/// jemalloc as Debian's redis-server links it.
const JEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

/// How redis runs while the benchmark runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tracing {
    Untraced,
    Memleak,
    LibbpfTools,
}

const TRACINGS: [Tracing; 3] = [Tracing::Untraced, Tracing::Memleak, Tracing::LibbpfTools];

impl Tracing {
    fn name(self) -> &'static str {
        match self {
            Tracing::Untraced => "untraced",
            Tracing::Memleak => "memleak",
            Tracing::LibbpfTools => "libbpf-tools probe set (bpftrace)",
        }
    }
}

/// Requests per second of each command, one entry per round.
pub struct Throughput {
    tracing: Tracing,
    set: Vec<f64>,
    get: Vec<f64>,
}

/// Runs `rounds` rounds of `requests` SETs and GETs against one
/// redis-server, untraced, under memleak and under bpftrace.
pub fn measure(memleak: &Path, scratch: &Path, rounds: usize, requests: u32) -> Result<Vec<Throughput>> {
    let server = RedisServer::start(scratch)?;
    let script = scratch.join("libbpf-tools-redis.bt");
    std::fs::write(&script, libbpf_tools_script(server.pid()))?;
    let mut results: Vec<Throughput> =
        TRACINGS.iter().map(|&tracing| Throughput { tracing, set: Vec::new(), get: Vec::new() }).collect();
    for round in 1..=rounds {
        for result in &mut results {
            eprintln!("bench: redis round {round}/{rounds}: {}", result.tracing.name());
            let tracer = match result.tracing {
                Tracing::Untraced => None,
                Tracing::Memleak => Some(Tracer::memleak(memleak, server.pid())?),
                Tracing::LibbpfTools => Some(Tracer::bpftrace(&script)?),
            };
            let (set, get) = benchmark(server.port(), requests)?;
            drop(tracer);
            result.set.push(set);
            result.get.push(get);
        }
    }
    Ok(results)
}

/// SETs and GETs per second, one request at a time.
fn benchmark(port: u16, requests: u32) -> Result<(f64, f64)> {
    let mut command = Command::new("redis-benchmark");
    command.args(["-p", &port.to_string(), "-t", "set,get", "-P", "1", "-q", "-n", &requests.to_string()]);
    let output = run_to_end(&mut command)?.stdout;
    // "SET: 84745.77 requests per second, p50=0.255 msec", after progress
    // lines that end in carriage returns.
    let rate = |name: &str| -> Result<f64> {
        let line = output
            .split(['\r', '\n'])
            .rfind(|line| line.starts_with(&format!("{name}: ")) && line.contains("requests per second"))
            .with_context(|| format!("no {name} rate in redis-benchmark's output: {output}"))?;
        let number = line[name.len() + 2..].split_whitespace().next().unwrap_or_default();
        number.parse().with_context(|| format!("not a rate: {line}"))
    };
    Ok((rate("SET")?, rate("GET")?))
}

/// The libbpf-tools memleak's probes on jemalloc, for process `pid`: as
/// `workload::libbpf_tools_script`, by pid instead of by command.
fn libbpf_tools_script(pid: u32) -> String {
    format!(
        "uprobe:{JEMALLOC}:malloc /pid == {pid}/ {{ @size[tid] = arg0; }}\n\
         uretprobe:{JEMALLOC}:malloc /pid == {pid}/ {{ @allocs[retval] = (@size[tid], ustack); delete(@size[tid]); }}\n\
         uprobe:{JEMALLOC}:free /pid == {pid}/ {{ delete(@allocs[arg0]); }}\n\
         END {{ clear(@allocs); clear(@size); }}\n"
    )
}

/// A tracer attached to redis for one round; stopped, and waited for,
/// when dropped.
struct Tracer(Child);

impl Tracer {
    fn memleak(memleak: &Path, pid: u32) -> Result<Self> {
        let mut command = Command::new(memleak);
        command.args(["-p", &pid.to_string(), "3600"]).stdout(Stdio::null()).stderr(Stdio::piped());
        Self::start(command, "memleak: tracing pid", |child| child.stderr.take().map(BufReader::new))
    }

    fn bpftrace(script: &PathBuf) -> Result<Self> {
        let mut command = Command::new("bpftrace");
        command.arg(script).stdout(Stdio::piped()).stderr(Stdio::null());
        Self::start(command, "Attaching", |child| child.stdout.take().map(BufReader::new))
    }

    /// Spawns `command` and waits for `ready` in what `output` takes from
    /// it, which is then drained.
    fn start<R: std::io::Read + Send + 'static>(
        mut command: Command,
        ready: &str,
        output: impl FnOnce(&mut Child) -> Option<BufReader<R>>,
    ) -> Result<Self> {
        let mut child = Self(command.stdin(Stdio::null()).spawn().context("cannot start the tracer")?);
        let mut lines = output(&mut child.0).context("no output to read")?;
        wait_for_line(&mut lines, ready)?;
        thread::spawn(move || std::io::copy(&mut lines, &mut std::io::sink()));
        // bpftrace says "Attaching" before its probes are all in.
        thread::sleep(std::time::Duration::from_secs(1));
        Ok(child)
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let Ok(pid) = libc::pid_t::try_from(self.0.id()) else { return };
        // SAFETY: SIGINT to our own child, not reaped yet.
        unsafe { libc::kill(pid, libc::SIGINT) };
        let _ = self.0.wait();
    }
}

/// The table, and the two ratios the probe-cost issue set goals for.
pub fn print(results: &[Throughput]) {
    println!();
    println!(
        "Debian's redis-server (jemalloc) under redis-benchmark -P 1, requests per second, median of {} alternating rounds:",
        results.first().map_or(0, |result| result.set.len())
    );
    println!();
    println!("| run | SET | GET | SET kept | GET kept |");
    println!("|---|---|---|---|---|");
    let untraced = results.iter().find(|result| result.tracing == Tracing::Untraced);
    let kept = |rates: &[f64], base: Option<&[f64]>| match (median(rates), base.and_then(median)) {
        (Some(rate), Some(base)) if base > 0.0 => format!("{:.2}", rate / base),
        _ => "-".to_owned(),
    };
    for result in results {
        println!(
            "| {} | {:.0} | {:.0} | {} | {} |",
            result.tracing.name(),
            median(&result.set).unwrap_or(0.0),
            median(&result.get).unwrap_or(0.0),
            kept(&result.set, untraced.map(|base| base.set.as_slice())),
            kept(&result.get, untraced.map(|base| base.get.as_slice())),
        );
    }
    let set_of = |tracing: Tracing| {
        results.iter().find(|result| result.tracing == tracing).and_then(|r| median(&r.set))
    };
    if let (Some(memleak), Some(base), Some(libbpf)) =
        (set_of(Tracing::Memleak), set_of(Tracing::Untraced), set_of(Tracing::LibbpfTools))
    {
        println!();
        println!("memleak's SET throughput / untraced: {:.2} (goal >= 0.4)", memleak / base);
        println!(
            "memleak's SET throughput / the libbpf-tools probe set's: {:.1} (goal >= 3)",
            memleak / libbpf
        );
    }
}
