//! The malloc-heavy workload (tests/fixtures/workload.c), and what the
//! tracers compared on it need to know about it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use super::{
    empty_probes::Site,
    process::run_to_end,
    stats::{Probes, Record},
};

/// Which build of the workload a run uses: the same source, so that the
/// two differ only in how their stacks can be walked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    /// With frame pointers, which `--unwind fp` needs for whole stacks.
    FramePointers,
    /// Without, as distributions' release builds come: only unwind tables
    /// walk these stacks.
    NoFramePointers,
}

/// How the workload runs, and what the tracers run it with.
pub struct Workload {
    /// Built with frame pointers.
    pub frame_pointers_path: PathBuf,
    /// Built without.
    pub no_frame_pointers_path: PathBuf,
    pub args: Vec<String>,
    pub memleak: PathBuf,
    /// Where bpftrace's script and heaptrack's data files go.
    pub scratch: PathBuf,
    /// Environment of every run (`LD_PRELOAD` of another allocator);
    /// memleak and bpftrace pass it on to the workload they start.
    pub env: Vec<(String, String)>,
}

impl Workload {
    pub fn path(&self, build: Build) -> &Path {
        match build {
            Build::FramePointers => &self.frame_pointers_path,
            Build::NoFramePointers => &self.no_frame_pointers_path,
        }
    }

    /// The workload as one command line, for memleak's and bpftrace's -c.
    pub fn command_line(&self, build: Build) -> String {
        format!("{} {}", self.path(build).display(), self.args.join(" "))
    }
}

/// What the workload prints on stderr at its end:
/// `elapsed_ns N leaked_bytes N leaked_allocations N cpu_ns N`.
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

/// Where memleak probes malloc and free for the workload, from its --stats
/// record of the probes it placed. The floor is empty probes at exactly
/// these sites: the workload calls no other allocator function, so
/// memleak's other probes never fire.
pub struct ProbePlan {
    /// The C library the workload maps.
    pub libc: PathBuf,
    pub sites: Vec<Site>,
    /// e.g. "malloc, malloc's return, free+3"
    pub description: String,
}

impl ProbePlan {
    /// Runs memleak on a tiny workload and reads the probes it placed
    /// from its --stats file. The sites are in the C library, so they are
    /// the same for either build of the workload.
    pub fn read(workload: &Workload) -> Result<Self> {
        let stats = workload.scratch.join("probe-plan-stats.jsonl");
        let command_line = format!("{} 1 1 1", workload.path(Build::FramePointers).display());
        let mut memleak = Command::new(&workload.memleak);
        memleak.envs(workload.env.iter().map(|(name, value)| (name, value)));
        run_to_end(memleak.args(["-c", &command_line, "--stats"]).arg(&stats).arg("1"))?;
        let records = std::fs::read_to_string(&stats)
            .with_context(|| format!("cannot read memleak's --stats file {}", stats.display()))?;
        Self::of(&first_probes(&records)?)
    }

    /// The sites of memleak's probes on malloc and free, in that order,
    /// each entry probe followed by its return probe, if any.
    fn of(probes: &Probes) -> Result<Self> {
        let site = |file_offset, on_return| Site { object: probes.object.clone(), file_offset, on_return };
        let mut sites = Vec::new();
        let mut names = Vec::new();
        for function in ["malloc", "free"] {
            let probe = probes.on(function)?;
            sites.push(site(probe.entry(), false));
            names.push(match probe.entry_offset {
                0 => function.to_owned(),
                past_start => format!("{function}+{past_start}"),
            });
            if probe.on_return {
                sites.push(site(probe.file_offset, true));
                names.push(format!("{function}'s return"));
            }
        }
        Ok(Self { libc: probes.object.clone(), sites, description: names.join(", ") })
    }
}

/// The first --stats record of probes: the workload's, the one process
/// traced.
fn first_probes(records: &str) -> Result<Probes> {
    for line in records.lines() {
        if let Record::Probes(probes) = Record::parse(line)? {
            return Ok(probes);
        }
    }
    bail!("memleak's --stats file says nothing of its probes")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_plan_follows_memleaks_probes() {
        // As memleak wrote it for the workload, cut to three functions.
        let records = r#"{"event":"probes","pid":7,"object":"/lib/x86_64-linux-gnu/libc.so.6","path":"/proc/7/map_files/1-2","probes":[{"function":"malloc","file_offset":624944,"entry_offset":0,"return_probe":true},{"function":"calloc","file_offset":628448,"entry_offset":0,"return_probe":true},{"function":"free","file_offset":626416,"entry_offset":3,"return_probe":false}]}
{"event":"report","pid":7,"stacks":2,"allocations":2,"bytes":1863,"latency_ms":2.5}"#;
        let plan = ProbePlan::of(&first_probes(records).expect("a probes record")).expect("a plan");
        assert_eq!(plan.libc, PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"));
        assert_eq!(plan.description, "malloc, malloc's return, free+3");
        let sites: Vec<(u64, bool)> =
            plan.sites.iter().map(|site| (site.file_offset, site.on_return)).collect();
        assert_eq!(sites, [(624_944, false), (624_944, true), (626_419, false)]);
        assert!(plan.sites.iter().all(|site| site.object == plan.libc), "sites {:?}", plan.sites);
    }
}
