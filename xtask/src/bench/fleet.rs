//! `memleak serve` as a Kubernetes node agent: 200 leaking processes in
//! 50 pods laid out as the kubelet lays them out (cgroup v2, the systemd
//! driver, containerd), named only by containerd's annotation files under
//! a `--host-root`, followed with `--namespace`. What one scrape of
//! `/metrics` and of the node-wide `/debug/pprof/allocs` costs, time and
//! size, against Alloy's default scrape timeout of 18 s. And pods that
//! come and go, one after another, under one daemon: what it holds
//! before and after, and whether their series leave `/metrics`.

use std::{
    io::BufReader,
    path::{Path, PathBuf},
    process::{Child, ChildStderr, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::serve::{get, get_bytes, Daemon, Holdings, RETAINED_AND_FORGOTTEN, SOAK_RETAIN};

/// Pods, and processes in each.
const PODS: usize = 50;
const PER_POD: usize = 4;
/// The namespace every bench pod is in, which the daemon follows.
const NAMESPACE: &str = "memleak-bench";
/// Scrapes of each endpoint; the median is shown.
const SCRAPES: usize = 5;
/// The daemon's `FRESH_ENOUGH` is 500 ms: each scrape pays its round.
const SCRAPE_SPACING: Duration = Duration::from_millis(700);
/// Where the kubelet's besteffort pods go, systemd driver, below the
/// cgroup v2 mount.
const BESTEFFORT: &str = "kubepods.slice/kubepods-besteffort.slice";

/// One endpoint's cost, the median of its scrapes.
pub struct Scrape {
    path: &'static str,
    median: Duration,
    bytes: usize,
}

/// One fake pod: its cgroup and its container's id.
struct Pod {
    cgroup: PathBuf,
    container_id: String,
}

impl Pod {
    /// Pod `index`'s cgroup below `pods`, and its annotations under
    /// `host_root`.
    fn make(index: usize, pods: &Path, host_root: &Path) -> Result<Self> {
        let uid = format!("00000000-0000-4000-8000-{index:012}");
        let container_id = format!("{:064x}", 0xbe0c_0000_u64 + index as u64);
        let cgroup = pods
            .join(format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")))
            .join(format!("cri-containerd-{container_id}.scope"));
        std::fs::create_dir_all(&cgroup).with_context(|| format!("cannot make {}", cgroup.display()))?;
        let bundle =
            host_root.join("run/containerd/io.containerd.runtime.v2.task/k8s.io").join(&container_id);
        std::fs::create_dir_all(&bundle)?;
        let config = serde_json::json!({
            "ociVersion": "1.1.0",
            "annotations": {
                "io.kubernetes.cri.container-type": "container",
                "io.kubernetes.cri.sandbox-name": format!("bench-{index}"),
                "io.kubernetes.cri.sandbox-namespace": NAMESPACE,
                "io.kubernetes.cri.sandbox-uid": uid,
                "io.kubernetes.cri.container-name": "app",
                "io.kubernetes.cri.image-name": "memleak-bench:1",
            }
        });
        std::fs::write(bundle.join("config.json"), config.to_string())?;
        Ok(Self { cgroup, container_id })
    }

    /// Removes the pod as the kubelet does once its processes are gone:
    /// its cgroups and its bundle.
    fn remove(&self, host_root: &Path) -> Result<()> {
        std::fs::remove_dir(&self.cgroup)?;
        std::fs::remove_dir(self.cgroup.parent().context("a pod's cgroup")?)?;
        std::fs::remove_dir_all(
            host_root.join("run/containerd/io.containerd.runtime.v2.task/k8s.io").join(&self.container_id),
        )?;
        Ok(())
    }

    /// A leaker in the pod's cgroup from its first instruction, held
    /// until released; with its stderr, kept open: a leaker whose stderr
    /// is closed dies of SIGPIPE when it says "done".
    fn start(&self, leaker: &Path) -> Result<(Child, BufReader<ChildStderr>)> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$1/cgroup.procs" && exec "$2" all --wait"#)
            .arg("sh")
            .arg(&self.cgroup)
            .arg(leaker)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start a leaker")?;
        let mut stderr = BufReader::new(child.stderr.take().context("no stderr")?);
        super::process::wait_for_line(&mut stderr, "ready")?;
        Ok((child, stderr))
    }
}

/// What the fleet bench found: the scrapes, and what the daemon held
/// with one process followed and with all of them.
pub struct Fleet {
    scrapes: Vec<Scrape>,
    one: Holdings,
    all: Holdings,
}

/// Goals for what each process followed beyond the first costs the
/// daemon: memory, and descriptors (an unraised soft limit of 1,024 held
/// about 80 processes when each took 20).
const GOAL_KIB_PER_PROCESS: f64 = 1024.0;
const GOAL_DESCRIPTORS_PER_PROCESS: f64 = 3.0;

/// Releases the held `leakers` once the daemon has taken in every leaker
/// of `pods` (probed before they allocate: a block allocated before its
/// process was taken in is never seen), waits until it holds their every
/// byte, has it symbolize their stacks (a node-wide profile), and says
/// what it holds then.
fn follow_and_symbolize(
    daemon: &Daemon,
    pods: &[Pod],
    leakers: &mut [(Child, BufReader<ChildStderr>)],
) -> Result<Holdings> {
    let processes = if pods.len() == 1 { 1 } else { pods.len() * PER_POD };
    wait_for_targets(daemon, processes)?;
    for (leaker, _) in leakers {
        super::process::release(leaker.stdin.as_mut().context("no stdin")?)?;
    }
    wait_for_pods(daemon, pods, processes)?;
    get_bytes(daemon.port, "/debug/pprof/allocs")?;
    daemon.holdings()
}

/// Runs the 200 leakers in their pods under `memleak serve --namespace`
/// and scrapes the daemon.
pub fn measure(memleak: &Path, leaker: &Path) -> Result<Fleet> {
    let host_root = crate::root().join("target/bench/fleet-host");
    let _ = std::fs::remove_dir_all(&host_root);
    let cgroup2 = cgroup2_mount()?;
    let besteffort = cgroup2.join(BESTEFFORT);
    let pods = (0..PODS).map(|index| Pod::make(index, &besteffort, &host_root)).collect::<Result<Vec<_>>>();
    let measured = pods.and_then(|pods| {
        let host_root = host_root.to_str().context("a host root in UTF-8")?;
        let daemon = Daemon::start(memleak, &["--namespace", NAMESPACE, "--host-root", host_root])?;
        let mut leakers = Vec::with_capacity(PODS * PER_POD);
        let scraped = (|| {
            // What the first process costs (the daemon reads its objects,
            // their debug files and symbols for the first time) is
            // measured apart from what each one more costs.
            leakers.push(pods[0].start(leaker)?);
            let one = follow_and_symbolize(&daemon, &pods[..1], &mut leakers)?;
            for (index, pod) in pods.iter().enumerate() {
                for _ in usize::from(index == 0)..PER_POD {
                    leakers.push(pod.start(leaker)?);
                }
            }
            let all = follow_and_symbolize(&daemon, &pods, &mut leakers[1..])?;
            let scrapes = [scrape(&daemon, "/metrics")?, scrape(&daemon, "/debug/pprof/allocs")?];
            // 200 processes' profile is tens of kilobytes gzipped: an
            // empty one (under 100 bytes) is no measure of it.
            if scrapes[1].bytes < 1024 {
                bail!("the node-wide profile came back with {} bytes, no samples", scrapes[1].bytes);
            }
            Ok(Fleet { scrapes: Vec::from(scrapes), one, all })
        })();
        for (mut leaker, _) in leakers {
            let _ = leaker.kill();
            let _ = leaker.wait();
        }
        scraped
    });
    remove_pods(&cgroup2);
    let _ = std::fs::remove_dir_all(&host_root);
    measured
}

/// What the daemon holds before and after pods came and went.
pub struct Churn {
    pods: usize,
    start: Holdings,
    end: Holdings,
    scrapes: u32,
    failed_scrapes: u32,
    /// `/metrics` series of the bench's namespace once every pod is gone
    /// and past `--retain`: none is the goal.
    series_left: usize,
}

/// The first churned pod's index, past the 50 pods' of `measure`.
const CHURNED_FROM: usize = 1000;

/// Starts `pods` pods one after another under one `memleak serve
/// --namespace --retain`, each one's leakers followed to their last
/// byte, then killed and the pod removed; `/metrics` and the node-wide
/// profile are scraped after each.
pub fn measure_churn(memleak: &Path, leaker: &Path, pods: usize) -> Result<Churn> {
    let host_root = crate::root().join("target/bench/fleet-churn-host");
    let _ = std::fs::remove_dir_all(&host_root);
    let cgroup2 = cgroup2_mount()?;
    let besteffort = cgroup2.join(BESTEFFORT);
    let measured = (|| {
        // A root as memleak takes one (with a run/), before the first pod.
        std::fs::create_dir_all(host_root.join("run"))?;
        let root_text = host_root.to_str().context("a host root in UTF-8")?;
        let daemon = Daemon::start(
            memleak,
            &["--namespace", NAMESPACE, "--host-root", root_text, "--retain", SOAK_RETAIN, "--interval", "1"],
        )?;
        // What is made once, for the first pod followed, is in place at
        // the start.
        come_and_go(&daemon, &Pod::make(CHURNED_FROM, &besteffort, &host_root)?, leaker, &host_root)?;
        thread::sleep(RETAINED_AND_FORGOTTEN);
        let start = daemon.holdings()?;
        let (mut scrapes, mut failed_scrapes) = (0, 0);
        for index in 1..=pods {
            let pod = Pod::make(CHURNED_FROM + index, &besteffort, &host_root)?;
            come_and_go(&daemon, &pod, leaker, &host_root)?;
            for path in ["/metrics", "/debug/pprof/allocs"] {
                scrapes += 1;
                failed_scrapes += u32::from(get_bytes(daemon.port, path).is_err());
            }
        }
        thread::sleep(RETAINED_AND_FORGOTTEN);
        let end = daemon.holdings()?;
        let in_namespace = format!("namespace=\"{NAMESPACE}\"");
        let series_left = get(daemon.port, "/metrics")?.matches(&in_namespace).count();
        Ok(Churn { pods, start, end, scrapes, failed_scrapes, series_left })
    })();
    remove_pods(&cgroup2);
    let _ = std::fs::remove_dir_all(&host_root);
    measured
}

/// One pod's life: its leakers start, are taken in, leak, are seen to
/// hold every byte, and are killed; then the pod is removed.
fn come_and_go(daemon: &Daemon, pod: &Pod, leaker: &Path, host_root: &Path) -> Result<()> {
    let mut leakers = Vec::with_capacity(PER_POD);
    let lived = (|| {
        for _ in 0..PER_POD {
            leakers.push(pod.start(leaker)?);
        }
        let container_id = format!("containerd://{}", pod.container_id);
        poll_until("the pod's leakers traced", || {
            Ok(attached(daemon, "container_id", &container_id)? == PER_POD)
        })?;
        for (leaker, _) in &mut leakers {
            super::process::release(leaker.stdin.as_mut().context("no stdin")?)?;
        }
        let held = format!("container_id=\"{container_id}\"");
        poll_until("every byte of the pod's leakers in /metrics", || {
            let metrics = get(daemon.port, "/metrics")?;
            Ok(metrics
                .lines()
                .filter(|line| line.starts_with("memleak_outstanding_bytes{") && line.contains(&held))
                .filter(|line| line.ends_with(" 17264"))
                .count()
                == PER_POD)
        })
    })();
    for (mut leaker, _) in leakers {
        let _ = leaker.kill();
        let _ = leaker.wait();
    }
    lived?;
    pod.remove(host_root)
}

/// Polls `done` every 100 ms, for a minute at most.
fn poll_until(what: &str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_mins(1);
    while !done()? {
        if Instant::now() > deadline {
            bail!("{what}: not within a minute");
        }
        thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

pub fn print_churn(churn: &Result<Churn>) {
    let churn = match churn {
        Ok(churn) => churn,
        Err(error) => {
            println!("\nmemleak serve on a node, pods coming and going\n  not measured: {error:#}");
            return;
        }
    };
    println!(
        "\nmemleak serve on a node, {} pods of {PER_POD} leakers coming and going one after another, \
         --namespace {NAMESPACE} --retain {SOAK_RETAIN} --interval 1",
        churn.pods
    );
    Holdings::print_change(churn.start, churn.end);
    println!(
        "  {} scrapes of /metrics and /debug/pprof/allocs, {} failed; {} series of the namespace left once every \
         pod is gone (goal 0)",
        churn.scrapes, churn.failed_scrapes, churn.series_left
    );
}

/// Where cgroup v2 is mounted: `/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
/// on a host that mounts v1 too.
fn cgroup2_mount() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, point, kind) = (fields.next()?, fields.next()?, fields.next()?);
            (kind == "cgroup2").then(|| PathBuf::from(point))
        })
        .context("no cgroup v2 mount")
}

/// How many processes `/api/v1/targets` lists whose `field` is `value`
/// and that have a report: memleak attached to them (a process is listed
/// as soon as it is taken in, before its probes are in place).
fn attached(daemon: &Daemon, field: &str, value: &str) -> Result<usize> {
    let listed: serde_json::Value = serde_json::from_str(&get(daemon.port, "/api/v1/targets")?)?;
    Ok(listed["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|target| target[field] == value && !target["allocator"].is_null())
        .count())
}

/// Waits until the daemon traces `count` processes of the bench's pods.
fn wait_for_targets(daemon: &Daemon, count: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_mins(2);
    loop {
        let listed = attached(daemon, "namespace", NAMESPACE)?;
        if listed == count {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the daemon took in {listed} of {count} leakers in 2 minutes");
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until `/metrics` names every one of `pods`' containers and
/// holds every block of `leakers` leakers.
fn wait_for_pods(daemon: &Daemon, pods: &[Pod], leakers: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_mins(2);
    loop {
        let metrics = get(daemon.port, "/metrics")?;
        let named = pods
            .iter()
            .all(|pod| metrics.contains(&format!("container_id=\"containerd://{}\"", pod.container_id)));
        // The leaker keeps 17,264 bytes ("all"): every process has.
        let full = metrics
            .lines()
            .filter(|line| line.starts_with("memleak_outstanding_bytes{") && line.ends_with(" 17264"))
            .count();
        if named && full == leakers {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the daemon followed {full} of {leakers} leakers in 2 minutes");
        }
        thread::sleep(Duration::from_millis(500));
    }
}

fn scrape(daemon: &Daemon, path: &'static str) -> Result<Scrape> {
    let mut times = Vec::with_capacity(SCRAPES);
    let mut bytes = 0;
    for _ in 0..SCRAPES {
        thread::sleep(SCRAPE_SPACING);
        let started = Instant::now();
        bytes = get_bytes(daemon.port, path)?.len();
        times.push(started.elapsed());
    }
    times.sort_unstable();
    Ok(Scrape { path, median: times[SCRAPES / 2], bytes })
}

/// Removes the bench's pod cgroups below `cgroup2`, leaves first; the
/// kubelet's own slices are left if they hold anything else.
fn remove_pods(cgroup2: &Path) {
    let besteffort = cgroup2.join(BESTEFFORT);
    let Ok(pods) = std::fs::read_dir(&besteffort) else { return };
    for pod in
        pods.flatten().filter(|pod| pod.file_name().to_string_lossy().contains("pod00000000_0000_4000_8000"))
    {
        if let Ok(containers) = std::fs::read_dir(pod.path()) {
            for container in containers.flatten().filter(|entry| entry.path().is_dir()) {
                let _ = std::fs::remove_dir(container.path());
            }
        }
        let _ = std::fs::remove_dir(pod.path());
    }
    let _ = std::fs::remove_dir(&besteffort);
    let _ = std::fs::remove_dir(cgroup2.join("kubepods.slice"));
}

pub fn print(fleet: &Result<Fleet>) {
    let processes = PODS * PER_POD;
    println!(
        "\nmemleak serve on a node: {processes} leakers in {PODS} pods (kubelet's cgroups, containerd's annotations \
         under --host-root), --namespace {NAMESPACE}; one scrape, median of {SCRAPES}"
    );
    match fleet {
        Ok(Fleet { scrapes, one, all }) => {
            let more = (processes - 1) as f64;
            println!(
                "  the daemon holds {} KiB and {} descriptors following 1 of them, {} KiB and {} following all",
                one.rss_kib, one.descriptors, all.rss_kib, all.descriptors
            );
            println!(
                "  each one more: {:.0} KiB (goal: under {GOAL_KIB_PER_PROCESS:.0}), {:.1} descriptors (goal: under {GOAL_DESCRIPTORS_PER_PROCESS:.0})",
                all.rss_kib.saturating_sub(one.rss_kib) as f64 / more,
                all.descriptors.saturating_sub(one.descriptors) as f64 / more
            );
            println!("  {:<40} {:>10} {:>12}", "endpoint", "time", "body");
            for scrape in scrapes {
                println!(
                    "  {:<40} {:>8.1} ms {:>10} B",
                    scrape.path,
                    scrape.median.as_secs_f64() * 1000.0,
                    scrape.bytes
                );
            }
            println!("  goal: each under 1 s (Alloy's default scrape timeout is 18 s)");
        }
        Err(error) => println!("  not measured: {error:#}"),
    }
}
