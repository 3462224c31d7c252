//! memleak attached to a process the bench started, as the benches that
//! read its costs while it runs use it: its BPF programs' run time and
//! its own CPU, then its one report, taken on SIGINT.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{
    bpf_stats::{self, RunTime},
    process::{last_line, lines_as_they_come, process_cpu_ns},
};

/// How long memleak may take to attach.
const PATIENCE: Duration = Duration::from_mins(2);

/// memleak tracing a process.
pub struct Tracer {
    child: Child,
    stdout: Receiver<(Instant, String)>,
    stderr: Receiver<(Instant, String)>,
    /// What memleak said until it traced the process.
    pub said: Vec<String>,
}

impl Tracer {
    /// memleak on `pid` with `args` too, once it says it traces it; one
    /// JSON report of every outstanding allocation, whatever its age, on
    /// SIGINT, and none before.
    pub fn attach(memleak: &Path, pid: u32, args: &[&str]) -> Result<Self> {
        let mut child = Command::new(memleak)
            .args(["-p", &pid.to_string(), "--format", "json", "-o", "0"])
            .args(args)
            .arg("3600")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run memleak")?;
        let stdout = lines_as_they_come(child.stdout.take().context("no stdout")?);
        let stderr = lines_as_they_come(child.stderr.take().context("no stderr")?);
        let mut tracer = Self { child, stdout, stderr, said: Vec::new() };
        loop {
            let Ok((_, line)) = tracer.stderr.recv_timeout(PATIENCE) else {
                bail!("memleak never said it traced pid {pid}: {}", last_line(&tracer.said.join("\n")))
            };
            let tracing = line.contains("tracing pid");
            tracer.said.push(line);
            if tracing {
                return Ok(tracer);
            }
        }
    }

    /// What memleak's uprobe programs and memleak itself have run so far.
    pub fn usage(&self) -> Result<(RunTime, u64)> {
        let pid = self.child.id();
        Ok((bpf_stats::uprobes_of_process(pid)?, process_cpu_ns(pid)?))
    }

    /// Stops memleak with SIGINT and takes its last report.
    pub fn report(mut self) -> Result<serde_json::Value> {
        let pid = libc::pid_t::try_from(self.child.id()).context("pid out of range")?;
        // SAFETY: our own child, not yet waited for.
        if unsafe { libc::kill(pid, libc::SIGINT) } != 0 {
            return Err(std::io::Error::last_os_error()).context("cannot stop memleak");
        }
        let status = self.child.wait()?;
        let log: Vec<String> = self.stderr.try_iter().map(|(_, line)| line).collect();
        if !status.success() {
            bail!("memleak failed with {status}: {}", last_line(&log.join("\n")));
        }
        let (_, report) = self.stdout.iter().last().context("memleak printed no report")?;
        serde_json::from_str(&report).context("memleak's report is not JSON")
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        if self.child.try_wait().is_ok_and(|status| status.is_none()) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
