//! The malloc-heavy workload (tests/fixtures/workload.c), and what the
//! tracers compared on it need to know about it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use super::{empty_probes::Site, process::run_to_end};

/// How the workload runs, and what the tracers run it with.
pub struct Workload {
    pub path: PathBuf,
    pub args: Vec<String>,
    pub memleak: PathBuf,
    /// Where bpftrace's script and heaptrack's data files go.
    pub scratch: PathBuf,
}

impl Workload {
    /// The workload as one command line, for memleak's and bpftrace's -c.
    pub fn command_line(&self) -> String {
        format!("{} {}", self.path.display(), self.args.join(" "))
    }
}

/// What the workload prints on stderr at its end:
/// "elapsed_ns N leaked_bytes N leaked_allocations N cpu_ns N".
pub struct Summary {
    /// The allocation loops' wall time: tracer start-up is not in it.
    pub elapsed_ns: u64,
    pub leaked_bytes: u64,
    /// The workload's own user+sys time.
    pub cpu_ns: u64,
}

impl Summary {
    pub fn parse(stderr: &str) -> Result<Self> {
        let line = stderr
            .lines()
            .find(|line| line.starts_with("elapsed_ns "))
            .context("the workload printed no summary")?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |name: &str| -> Result<u64> {
            let at = words.iter().position(|word| *word == name);
            let value = at.and_then(|at| words.get(at + 1)).and_then(|value| value.parse().ok());
            value.with_context(|| format!("no {name} in the workload's {line:?}"))
        };
        Ok(Self {
            elapsed_ns: field("elapsed_ns")?,
            leaked_bytes: field("leaked_bytes")?,
            cpu_ns: field("cpu_ns")?,
        })
    }
}

/// Where memleak probes malloc and free for the workload, from its -v log.
/// The floor is empty probes at exactly these sites: the workload calls no
/// other allocator function, so memleak's other probes never fire.
pub struct ProbePlan {
    /// The C library the workload maps.
    pub libc: PathBuf,
    pub sites: Vec<Site>,
    /// e.g. "malloc, malloc's return, free+3"
    pub description: String,
}

impl ProbePlan {
    /// Runs memleak -v on a tiny workload and reads its debug lines:
    /// "uprobe on malloc at 0x98930 in /lib/x86_64-linux-gnu/libc.so.6"
    /// and "free: entry probe at +3, past ...".
    pub fn read(workload: &Workload) -> Result<Self> {
        let command_line = format!("{} 1 1 1", workload.path.display());
        let finished = run_to_end(Command::new(&workload.memleak).args(["-v", "-c", &command_line, "1"]))?;
        let log = &finished.stderr;
        let (libc, malloc) = probe_site(log, "malloc")?;
        let (_, free) = probe_site(log, "free")?;
        let free_skip: Option<u64> = log
            .lines()
            .find_map(|line| line.split("free: entry probe at +").nth(1))
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok());
        // A return probe goes on the function's first instruction, which
        // is where memleak's malloc probe is.
        let site = |file_offset, on_return| Site { object: libc.clone(), file_offset, on_return };
        let sites = vec![site(malloc, false), site(malloc, true), site(free, false)];
        let free = free_skip.map_or("free".to_owned(), |skip| format!("free+{skip}"));
        Ok(Self { libc, sites, description: format!("malloc, malloc's return, {free}") })
    }
}

/// The object and file offset of memleak's entry probe on `function`.
fn probe_site(log: &str, function: &str) -> Result<(PathBuf, u64)> {
    let marker = format!("uprobe on {function} at 0x");
    let Some(rest) = log.lines().find_map(|line| line.split(&marker).nth(1)) else {
        bail!("memleak -v did not say where it probes {function}")
    };
    let (offset, object) = rest.split_once(" in ").context("unexpected probe line")?;
    let offset = u64::from_str_radix(offset, 16).context("unexpected probe offset")?;
    Ok((PathBuf::from(object.trim()), offset))
}

/// The libbpf-tools memleak probe set, as a bpftrace script: malloc's size
/// at its entry; at its return, the address with size and user stack id;
/// the address forgotten at `free`'s first instruction. bpftrace 0.17
/// attaches uprobes for every process even under -c, so the predicates
/// keep the maps to the workload (libbpf-tools' -p has the kernel filter).
pub fn libbpf_tools_script(libc: &Path) -> String {
    let libc = libc.display();
    format!(
        "uprobe:{libc}:malloc /pid == cpid/ {{ @size[tid] = arg0; }}\n\
         uretprobe:{libc}:malloc /pid == cpid/ {{ @allocs[retval] = (@size[tid], ustack); delete(@size[tid]); }}\n\
         uprobe:{libc}:free /pid == cpid/ {{ delete(@allocs[arg0]); }}\n\
         // bpftrace prints every map at exit: thousands of lines.\n\
         END {{ clear(@allocs); clear(@size); }}\n"
    )
}
