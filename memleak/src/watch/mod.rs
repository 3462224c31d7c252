//! `memleak serve --watch`: every process the selectors name is watched
//! from the kernel's counters, with no probe in it, and only those whose
//! memory grows are traced, for a window, then let go.
//!
//! `counters` reads a process's resident memory; `growth` judges whether
//! it grows. The `Watcher` keeps each process's samples and state, and
//! says which to trace; the daemon's collector (`serve`) attaches and
//! detaches, and tells it.

mod counters;
pub mod growth;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::{
    model::Workload,
    process::{container, identity::ProcessKey, kubernetes, lifecycle},
    session::{runs_one_of, Selector},
    status,
};
use growth::{GrowthRule, Judgement, Samples};

/// How the watch goes, from the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WatchSettings {
    /// Time between looks at every process's counters (--watch-every).
    pub every: Duration,
    pub rule: GrowthRule,
    /// How long a process found growing is traced (--trace-for).
    pub trace_for: Duration,
    /// Processes traced at once at most (--max-traced).
    pub max_traced: usize,
    /// What the processes traced may pay for the probes together, in
    /// CPUs (--max-overhead).
    pub max_overhead: f64,
}

/// Where a watched process stands.
#[derive(Clone, Debug, PartialEq)]
pub enum State {
    /// Its counters are read; nothing is attached.
    Watched,
    /// Found growing, waiting for a tracing slot (--max-traced).
    Suspected,
    /// Traced until then.
    Traced { until: Instant, until_unix_ms: u64 },
    /// Traced, then let go; its last report stays. Watched again, and
    /// traced again if it goes on growing over a whole new window.
    Detached,
    /// Found growing, but memleak cannot trace it (why): watched only.
    Untraceable(String),
}

impl State {
    pub fn name(&self) -> &'static str {
        match self {
            State::Watched => "watched",
            State::Suspected => "suspected",
            State::Traced { .. } => "traced",
            State::Detached => "detached",
            State::Untraceable(_) => "untraceable",
        }
    }

    /// Every state's name, as /metrics counts them.
    pub const NAMES: [&'static str; 5] = ["watched", "suspected", "traced", "detached", "untraceable"];
}

/// A process watched.
struct Watched {
    key: ProcessKey,
    program: String,
    samples: Samples,
    /// Its resident memory at the latest look.
    resident: counters::Resident,
    /// Its growth, as last judged, in bytes per second.
    growth: Option<f64>,
    state: State,
    /// Its container and pod, looked for once it is singled out.
    workload: Option<Workload>,
    named: bool,
}

/// Which processes are watched: those the selectors name, or every one.
pub struct Scope {
    /// No selector: every process but memleak and kernel threads.
    everything: bool,
    pids: Vec<u32>,
    cgroups: Vec<PathBuf>,
    exes: Vec<String>,
    workloads: Option<kubernetes::Selection>,
    cgroup2_root: Option<PathBuf>,
}

impl Scope {
    /// The processes `selectors` name; every one with none.
    pub fn new(selectors: &[Selector]) -> Result<Self, String> {
        let mut scope = Self {
            everything: selectors.is_empty(),
            pids: Vec::new(),
            cgroups: Vec::new(),
            exes: Vec::new(),
            workloads: None,
            cgroup2_root: None,
        };
        for selector in selectors {
            match selector {
                Selector::Pid(pid) => scope.pids.push(*pid),
                Selector::Cgroup(path) => {
                    scope.cgroups.push(std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()));
                }
                Selector::Exe(name) => scope.exes.push(name.clone()),
                // Containers not running yet: `follow_cgroup` gives them.
                Selector::CgroupToCome => {}
                Selector::Workload(filter) => {
                    scope.workloads = Some(kubernetes::Selection::new(filter.clone())?);
                }
            }
        }
        scope.cgroup2_root = container::cgroup2_mount();
        Ok(scope)
    }

    /// Watches the processes of cgroup `path` too, instead of those of
    /// `instead_of` if given: a container found, or found again.
    pub fn follow_cgroup(&mut self, path: &Path, instead_of: Option<&Path>) {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        match instead_of.and_then(|old| self.cgroups.iter().position(|known| known == old)) {
            Some(index) => self.cgroups[index] = path,
            None => self.cgroups.push(path),
        }
    }

    fn selects(&mut self, pid: u32) -> bool {
        if self.everything || self.pids.contains(&pid) {
            return true;
        }
        let in_cgroup = || {
            let (Some(root), Some(path)) = (&self.cgroup2_root, container::cgroup2_path(pid)) else {
                return false;
            };
            let directory = root.join(path.trim_start_matches('/'));
            self.cgroups.iter().any(|cgroup| directory.starts_with(cgroup))
        };
        (!self.cgroups.is_empty() && in_cgroup())
            || (!self.exes.is_empty() && runs_one_of(pid, &self.exes))
            || self.workloads.as_mut().is_some_and(|workloads| workloads.selects(pid))
    }
}

/// The processes watched, their samples and states.
pub struct Watcher {
    settings: WatchSettings,
    scope: Scope,
    watched: HashMap<u32, Watched>,
    /// The monotonic clock samples are timed on, and when it started on
    /// the wall clock (ms since 1970).
    started: Instant,
    started_unix_ms: u64,
    page_size: u64,
    /// Windows of tracing begun since the start.
    windows: u64,
}

impl Watcher {
    pub fn new(settings: WatchSettings, scope: Scope) -> Self {
        Self {
            settings,
            scope,
            watched: HashMap::new(),
            started: Instant::now(),
            started_unix_ms: crate::clock::wall_ms(),
            page_size: counters::page_size(),
            windows: 0,
        }
    }

    pub fn settings(&self) -> &WatchSettings {
        &self.settings
    }

    pub fn scope_mut(&mut self) -> &mut Scope {
        &mut self.scope
    }

    /// Reads every process's counters, takes in those that came and lets
    /// go of those gone, and judges each one's growth. Returns the
    /// processes to trace now, fastest growing first, as many as the
    /// tracing slots left allow.
    pub fn look(&mut self, now: Instant) -> Vec<u32> {
        let seconds = now.duration_since(self.started).as_secs_f64();
        let own = std::process::id();
        let mut seen = std::collections::HashSet::new();
        for pid in counters::pids() {
            if pid == own {
                continue;
            }
            let Some(resident) = counters::resident(pid, self.page_size) else { continue };
            if !self.watched.contains_key(&pid) {
                let Some(watched) = self.take_in(pid, resident) else { continue };
                self.watched.insert(pid, watched);
            }
            seen.insert(pid);
            let Some(watched) = self.watched.get_mut(&pid) else { continue };
            watched.resident = resident;
            watched.samples.push(seconds, resident.anon, self.settings.rule.window);
            watched.judge(&self.settings.rule);
        }
        self.watched.retain(|pid, _| seen.contains(pid));
        let traced = self.tracing().count();
        let mut suspects: Vec<(&u32, f64)> = self
            .watched
            .iter()
            .filter(|(_, watched)| watched.state == State::Suspected)
            .map(|(pid, watched)| (pid, watched.growth.unwrap_or_default()))
            .collect();
        suspects.sort_by(|one, other| other.1.total_cmp(&one.1));
        suspects
            .into_iter()
            .map(|(pid, _)| *pid)
            .take(self.settings.max_traced.saturating_sub(traced))
            .collect()
    }

    /// Process `pid`, new to the watch: watched if the scope names it.
    fn take_in(&mut self, pid: u32, resident: counters::Resident) -> Option<Watched> {
        if !self.scope.selects(pid) {
            return None;
        }
        let key = ProcessKey::of(pid)?;
        Some(Watched {
            key,
            program: lifecycle::program(pid),
            samples: Samples::default(),
            resident,
            growth: None,
            state: State::Watched,
            workload: None,
            named: false,
        })
    }

    /// What the watch knows of process `pid`.
    pub fn history(&self, pid: u32) -> Option<History<'_>> {
        let watched = self.watched.get(&pid)?;
        let points = watched
            .samples
            .iter()
            .map(|(seconds, bytes)| {
                let since_start =
                    u64::try_from(Duration::from_secs_f64(seconds).as_millis()).unwrap_or(u64::MAX);
                (self.started_unix_ms.saturating_add(since_start), bytes)
            })
            .collect();
        Some(History {
            program: &watched.program,
            points,
            growth: watched.growth,
            workload: watched.workload.as_ref(),
        })
    }

    /// The processes singled out (not merely watched) whose container and
    /// pod have not been looked for: a node's thousand processes are not
    /// named, only those its series and OOM kills will show.
    pub fn unnamed(&self) -> Vec<u32> {
        self.watched
            .iter()
            .filter(|(_, watched)| watched.state != State::Watched && !watched.named)
            .map(|(pid, _)| *pid)
            .collect()
    }

    /// Names process `pid`'s container and pod (`None`: in none).
    pub fn name(&mut self, pid: u32, workload: Option<Workload>) {
        if let Some(watched) = self.watched.get_mut(&pid) {
            watched.workload = workload;
            watched.named = true;
        }
    }

    /// Whether process `pid` is traced now, by a window of the watch.
    pub fn is_traced(&self, pid: u32) -> bool {
        self.watched.get(&pid).is_some_and(|watched| matches!(watched.state, State::Traced { .. }))
    }

    /// Process `pid` is traced from now on, for a window.
    pub fn traced(&mut self, pid: u32, now: Instant) {
        let Some(watched) = self.watched.get_mut(&pid) else { return };
        let trace_for_ms = u64::try_from(self.settings.trace_for.as_millis()).unwrap_or(u64::MAX);
        let until_unix_ms = crate::clock::wall_ms().saturating_add(trace_for_ms);
        watched.state = State::Traced { until: now + self.settings.trace_for, until_unix_ms };
        self.windows += 1;
        status::say(&format!(
            "pid {pid} ({}) grows {}: tracing it for {:?}",
            watched.program,
            describe_rate(watched.growth.unwrap_or_default()),
            self.settings.trace_for
        ));
    }

    /// Process `pid` was found growing but cannot be traced: said once,
    /// and it is watched only from now on.
    pub fn untraceable(&mut self, pid: u32, why: &str) {
        let Some(watched) = self.watched.get_mut(&pid) else { return };
        status::say(&format!(
            "pid {pid} ({}) grows {}, but cannot be traced: {why}; watching it only",
            watched.program,
            describe_rate(watched.growth.unwrap_or_default())
        ));
        watched.state = State::Untraceable(why.to_owned());
    }

    /// The processes traced now, by a window of the watch.
    pub fn traced_pids(&self) -> Vec<u32> {
        self.watched
            .iter()
            .filter(|(_, watched)| matches!(watched.state, State::Traced { .. }))
            .map(|(pid, _)| *pid)
            .collect()
    }

    /// The processes whose window has ended by `now`.
    pub fn windows_ended(&self, now: Instant) -> Vec<u32> {
        self.watched
            .iter()
            .filter(|(_, watched)| matches!(watched.state, State::Traced { until, .. } if until <= now))
            .map(|(pid, _)| *pid)
            .collect()
    }

    /// Process `pid` was let go at the end of its window: its growth is
    /// judged afresh over a whole new window.
    pub fn detached(&mut self, pid: u32) {
        let Some(watched) = self.watched.get_mut(&pid) else { return };
        watched.state = State::Detached;
        watched.samples.clear();
        watched.growth = None;
    }

    fn tracing(&self) -> impl Iterator<Item = &Watched> {
        self.watched.values().filter(|watched| matches!(watched.state, State::Traced { .. }))
    }

    /// What is published of the watch.
    pub fn view(&self) -> WatchView {
        let mut processes: Vec<WatchedProcess> = self
            .watched
            .values()
            .map(|watched| WatchedProcess {
                pid: watched.key.pid,
                program: watched.program.clone(),
                state: watched.state.name(),
                resident_bytes: watched.resident.total,
                anon_bytes: watched.resident.anon,
                #[allow(
                    clippy::cast_possible_truncation,
                    reason = "a rate of bytes per second, far below 2^63"
                )]
                growth_bytes_per_second: watched.growth.map(|rate| rate.round() as i64),
                traced_until_unix_ms: match watched.state {
                    State::Traced { until_unix_ms, .. } => Some(until_unix_ms),
                    _ => None,
                },
                untraceable: match &watched.state {
                    State::Untraceable(why) => Some(why.clone()),
                    _ => None,
                },
                workload: watched.workload.clone(),
            })
            .collect();
        processes.sort_by_key(|process| process.pid);
        WatchView {
            every_seconds: self.settings.every.as_secs_f64(),
            growth_window_seconds: self.settings.rule.window.as_secs_f64(),
            min_growth_bytes_per_second: self.settings.rule.min_bytes_per_second,
            trace_for_seconds: self.settings.trace_for.as_secs_f64(),
            max_traced: self.settings.max_traced,
            windows_total: self.windows,
            processes,
        }
    }
}

impl Watched {
    /// Judges its growth, and moves it to the state that follows.
    fn judge(&mut self, rule: &GrowthRule) {
        let judgement = self.samples.judge(rule);
        self.growth = match judgement {
            Judgement::Growing { bytes_per_second } => Some(bytes_per_second),
            Judgement::Steady => Some(0.0),
            Judgement::TooEarly => self.growth,
        };
        self.state = match (&self.state, judgement) {
            (State::Watched | State::Detached | State::Suspected, Judgement::Growing { .. }) => {
                State::Suspected
            }
            (State::Suspected, Judgement::Steady) => State::Watched,
            (state, _) => state.clone(),
        };
    }
}

/// What the watch knows of a process.
pub struct History<'a> {
    pub program: &'a str,
    /// Its anonymous memory over the latest window: (ms since 1970, bytes).
    pub points: Vec<(u64, u64)>,
    /// Its growth as last judged, in bytes per second.
    pub growth: Option<f64>,
    /// Its container and pod, if it was singled out in one.
    pub workload: Option<&'a Workload>,
}

/// The watch as /api/v1/watch serves it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WatchView {
    pub every_seconds: f64,
    pub growth_window_seconds: f64,
    pub min_growth_bytes_per_second: f64,
    pub trace_for_seconds: f64,
    pub max_traced: usize,
    /// Windows of tracing begun since memleak started.
    pub windows_total: u64,
    /// By pid.
    pub processes: Vec<WatchedProcess>,
}

#[derive(Clone, Debug, Serialize)]
pub struct WatchedProcess {
    pub pid: u32,
    pub program: String,
    /// watched, suspected, traced, detached or untraceable.
    pub state: &'static str,
    pub resident_bytes: u64,
    /// Of `resident_bytes`, anonymous memory: what growth is judged on.
    pub anon_bytes: u64,
    /// As last judged over a whole window; null before the first.
    pub growth_bytes_per_second: Option<i64>,
    pub traced_until_unix_ms: Option<u64>,
    /// Why a process found growing cannot be traced.
    pub untraceable: Option<String>,
    /// Its container and pod, for those singled out in one.
    #[serde(skip)]
    pub workload: Option<Workload>,
}

/// `64.0 KiB/s`, `30.0 KiB/min`: a rate as a person reads it, a minute's
/// worth below a KiB a second.
pub fn describe_rate(bytes_per_second: f64) -> String {
    let (per, seconds) = if bytes_per_second >= 1024.0 { ("s", 1.0) } else { ("min", 60.0) };
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a rate of bytes, not negative, far below 2^64"
    )]
    let bytes = (bytes_per_second.max(0.0) * seconds).round() as u64;
    format!("{}/{per}", status::readable_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_a_person_says_them() {
        assert_eq!(describe_rate(65536.0), "64.0 KiB/s");
        assert_eq!(describe_rate(1.5 * 1_048_576.0), "1.5 MiB/s");
        assert_eq!(describe_rate(512.0), "30.0 KiB/min");
        assert_eq!(describe_rate(0.0), "0 bytes/min");
    }
}
