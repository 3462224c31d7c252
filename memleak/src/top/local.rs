//! `memleak top -p/-c/--cgroup`: reports from a session of its own, a
//! round every interval, and a process's final report as it exits.

use std::time::Duration;

use super::{view::Update, Happened, TopError};
use crate::{
    bpf::{Traced, Tracer},
    collect::CollectOptions,
    report::{options::SortKey, Report},
    session::{ReportRequest, Session, SessionConfig, SessionEvent, TargetSpec, PYTHON_PENDING_RETRY},
};

/// Stacks each round keeps of each process: more than a screen shows,
/// for the filter to find among.
const STACKS_PER_ROUND: usize = 200;

/// How often the targets' mappings are read again, and a cgroup's
/// newcomers looked for (as the report loop does).
const REFRESH: Duration = Duration::from_millis(250);

pub struct Local {
    session: Session,
    rounds: tokio::time::Interval,
    refresh: tokio::time::Interval,
    python_retry: tokio::time::Interval,
    python_pending: bool,
}

impl Local {
    /// Attaches to the processes `target` names.
    pub fn start(target: &TargetSpec, config: &SessionConfig, interval: Duration) -> Result<Self, TopError> {
        Tracer::check_kernel()?;
        Tracer::check_privileges(Traced::Processes)?;
        let session = Session::start(target, config)?;
        // A tick missed (a long round) is taken late, not twice.
        let every = |period| {
            let mut clock = tokio::time::interval(period);
            clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            clock
        };
        Ok(Self {
            session,
            // The first round at once: the view is not empty for an interval.
            rounds: every(interval),
            refresh: every(REFRESH),
            python_retry: every(PYTHON_PENDING_RETRY),
            python_pending: true,
        })
    }

    /// What the header names the processes by.
    pub fn describe(target: &TargetSpec) -> String {
        match target {
            TargetSpec::Command(command) => format!("-c {command:?}"),
            TargetSpec::Cgroup(path) => format!("cgroup {}", path.display()),
            TargetSpec::Pids(pids) => {
                let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
                format!("-p {}", pids.join(","))
            }
            TargetSpec::Kernel { .. } | TargetSpec::Selected(_) => "memleak".to_owned(),
        }
    }

    /// Waits for the next round, a process's exit, or something to say.
    /// Cancel-safe: what it waits on is, and the rest is done at once.
    pub async fn next(&mut self) -> Result<Happened, TopError> {
        loop {
            tokio::select! {
                _ = self.python_retry.tick(), if self.python_pending => {
                    self.python_pending = self.session.detect_pending_python()?;
                }
                _ = self.refresh.tick() => {
                    self.python_pending = true;
                    let added = self.session.refresh()?;
                    if added > 0 {
                        return Ok(Happened::Said(format!("{added} more processes traced")));
                    }
                }
                _ = self.rounds.tick() => {
                    let reports = self.session.collect(None, &round_request())?;
                    return Ok(Happened::Round(updates(reports, false)));
                }
                event = self.session.next_event() => match event? {
                    SessionEvent::Trace(_) => {}
                    SessionEvent::Exiting { pid, ack } => {
                        let reports = self.session.collect(Some(pid), &round_request())?;
                        // The command memleak started waits at its exit
                        // until its final report is taken.
                        drop(ack);
                        self.session.remove_exited_target(pid)?;
                        let round = updates(reports, true);
                        if self.session.is_done() {
                            return Ok(Happened::Ended(round, format!("pid {pid} exited, the last traced")));
                        }
                        return Ok(Happened::Round(round));
                    }
                    SessionEvent::Exec { pid } => {
                        self.python_pending = true;
                        self.session.restart_target(pid)?;
                        return Ok(Happened::Said(format!("pid {pid} called execve: its new program is traced")));
                    }
                    SessionEvent::Followed { pid, parent } => {
                        self.python_pending = true;
                        return Ok(Happened::Said(format!("tracing pid {pid}, forked by pid {parent}")));
                    }
                    SessionEvent::Joined { pid } => {
                        self.python_pending = true;
                        return Ok(Happened::Said(format!("tracing pid {pid}, found at its execve")));
                    }
                },
            }
        }
    }

    /// Process `pid`'s report with every stack and each allocation, as
    /// --save keeps it; aside from the rounds, whose growth it leaves be.
    pub fn whole(&mut self, pid: u32) -> Result<Report, TopError> {
        let request = ReportRequest {
            collect: CollectOptions {
                each_allocation: true,
                freed_stacks: true,
                modules: true,
                ..CollectOptions::NONE
            },
            sort: SortKey::Size,
            top: usize::MAX,
            in_series: false,
        };
        let reports = self.session.collect(Some(pid), &request)?;
        reports.into_iter().next().ok_or(TopError::Gone(pid))
    }
}

fn round_request() -> ReportRequest {
    ReportRequest {
        collect: CollectOptions::NONE,
        sort: SortKey::Size,
        top: STACKS_PER_ROUND,
        in_series: true,
    }
}

fn updates(reports: Vec<Report>, exited: bool) -> Vec<Update> {
    reports
        .into_iter()
        .map(|report| Update { report, exited, overhead_seconds: None, history: None })
        .collect()
}
