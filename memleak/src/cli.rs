//! Command-line interface. Flags keep the meaning they have in bcc's
//! memleak, but for `-o`: bcc ages every allocation (500 ms by default),
//! which means reading each one at every report; memleak reads per-stack
//! totals unless `-o` is given.

use std::{num::NonZeroU64, path::PathBuf, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};

/// Trace outstanding allocations of processes (or, without -p and -c, of
/// the kernel) and print the call stacks that hold the most memory.
#[derive(Debug, Parser)]
#[command(name = "memleak", version, about, after_help = EXAMPLES, args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Render or compare saved snapshots instead of tracing.
    #[command(subcommand)]
    pub offline: Option<Offline>,

    /// Trace these running processes (-p 12,34 or -p 12 -p 34); each gets
    /// reports of its own.
    #[arg(short, long, value_name = "PID", value_delimiter = ',', conflicts_with = "command")]
    pub pid: Vec<u32>,

    /// Trace every process of this cgroup v2 directory, including those
    /// that join it later: a report per process, then a total.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["pid", "command"])]
    pub cgroup: Option<PathBuf>,

    /// Run this command (with its arguments, split like a shell would) and
    /// trace it from its first instruction.
    #[arg(short, long, value_name = "\"CMD ARGS\"")]
    pub command: Option<String>,

    /// Seconds between reports.
    #[arg(value_name = "INTERVAL", default_value = "5", value_parser = parse_interval)]
    pub interval: Duration,

    /// Number of reports to print before exiting (default: until the target
    /// exits or memleak is interrupted).
    #[arg(value_name = "COUNT")]
    pub count: Option<NonZeroU64>,

    /// Show the address, size and age of each outstanding allocation.
    #[arg(short = 'a', long)]
    pub show_allocs: bool,

    /// Report only allocations older than this many milliseconds. Without
    /// -o, reports count every outstanding allocation, from per-stack
    /// totals kept in BPF: a report then costs the same for a thousand
    /// allocations or a million. -o (and -a) read each allocation.
    #[arg(short = 'o', long, value_name = "MS")]
    pub older: Option<u64>,

    /// Also show the mmaps the allocator makes for itself and thread
    /// stacks, which are left out (and counted) by default.
    #[arg(long)]
    pub all_mmaps: bool,

    /// In kernel mode (no -p or -c), also trace per-CPU allocations.
    #[arg(long)]
    pub percpu: bool,

    /// Print a line for every allocation and free as it happens.
    #[arg(short = 't', long)]
    pub trace: bool,

    /// Order of the stacks in a report.
    #[arg(long, value_enum, default_value_t = SortKey::Size)]
    pub sort: SortKey,

    /// Record about one allocation in N, picked at random; reported figures
    /// are scaled up by N. Frees of recorded allocations stay exact.
    #[arg(short = 's', long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub sample_rate: u32,

    /// bcc's flag for reporting the per-stack totals kept in BPF, without
    /// reading each allocation. memleak does so whenever -a, -o and --save
    /// are not given.
    #[arg(long, conflicts_with_all = ["show_allocs", "older", "save"])]
    pub combined_only: bool,

    /// bcc's workaround for allocators whose free is not seen: an address
    /// handed out again counts as freed first. memleak always does this.
    #[arg(long)]
    pub wa_missing_free: bool,

    /// Probe PREFIXmalloc, PREFIXfree and so on, for allocators built with
    /// a symbol prefix (jemalloc's je_).
    #[arg(long, value_name = "PREFIX")]
    pub symbols_prefix: Option<String>,

    /// Ignore allocations smaller than this many bytes.
    #[arg(short = 'z', long, value_name = "BYTES")]
    pub min_size: Option<u64>,

    /// Ignore allocations larger than this many bytes.
    #[arg(short = 'Z', long, value_name = "BYTES")]
    pub max_size: Option<u64>,

    /// Allocator object to probe, instead of the libc the target maps.
    #[arg(short = 'O', long = "obj", value_name = "PATH")]
    pub object: Option<PathBuf>,

    /// Outstanding allocations tracked at most; more are counted as not
    /// tracked. Kernel memory: 16 bytes per N reserved at start (16 MiB by
    /// default), then about 96 bytes per allocation outstanding.
    #[arg(long, value_name = "N", default_value_t = 1_000_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_allocs: u32,

    /// Distinct call stacks stored at most; allocations from further stacks
    /// are counted as "stacks lost".
    #[arg(long, value_name = "N", default_value_t = 65_536, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_stacks: u32,

    /// Frames kept per stack (1 to 127).
    #[arg(long, value_name = "N", default_value_t = 127, value_parser = clap::value_parser!(u32).range(1..=127))]
    pub max_stack_depth: u32,

    #[command(flatten)]
    pub rendering: Rendering,

    /// Also save each report whole (every stack, each allocation, the
    /// symbolized frames) to FILE, for `memleak report` and `memleak diff`.
    /// Unless there is one report (COUNT 1, one process), files are
    /// numbered: heap.1.snap, heap.2.snap...
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,

    /// Print debug logs (probe placement, skipped symbols) to stderr.
    #[arg(short, long)]
    pub verbose: bool,
}

/// How reports are shown and where they go; for tracing and for the
/// offline subcommands alike.
#[derive(Debug, clap::Args)]
pub struct Rendering {
    /// Number of stacks to show in each report.
    #[arg(short = 'T', long, value_name = "N", default_value_t = 10)]
    pub top: usize,

    /// Report format (default: from the --output file's extension, else
    /// text).
    #[arg(long, value_enum)]
    pub format: Option<Format>,

    /// Write reports to this file instead of stdout. Text, JSON and folded
    /// reports go to one file, put in place when memleak ends; SVG and pprof
    /// are a file per report, numbered unless there is one report.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// Overwrite the --output (and --save) files if they exist.
    #[arg(long)]
    pub force: bool,

    /// For --format folded and svg: weigh stacks by bytes or by count.
    #[arg(long, value_enum, default_value_t = Weight::Bytes)]
    pub weight: Weight,
}

impl Rendering {
    /// --format, else what the --output file's extension names, else text.
    pub fn format(&self) -> Format {
        self.format
            .or_else(|| self.output.as_deref().and_then(crate::report::output::format_of))
            .unwrap_or(Format::Text)
    }

    /// How many stacks a report keeps: a flame graph needs every one.
    pub fn stacks_kept(&self) -> usize {
        if self.format().wants_every_stack() {
            usize::MAX
        } else {
            self.top
        }
    }

    /// `saving`: --save was given, which --force applies to as well.
    pub fn validate(&self, saving: bool) -> Result<(), String> {
        if self.force && self.output.is_none() && !saving {
            return Err("--force is for overwriting the --output (or --save) files: give one".to_owned());
        }
        if let (None, Some(output)) = (self.format, &self.output) {
            if crate::report::output::format_of(output).is_none() {
                return Err(format!(
                    "cannot tell the format of {} from its extension (.svg, .pb.gz, .folded, .json, .txt): give --format",
                    output.display()
                ));
            }
        }
        Ok(())
    }
}

/// Work on snapshots saved with --save: no root, no process needed.
#[derive(Debug, Subcommand)]
pub enum Offline {
    /// Render a snapshot saved with --save, in any format.
    Report(ReportArgs),
    /// Show what grew and what shrank between two snapshots, stack by
    /// stack (jeprof's --base); as SVG, a differential flame graph.
    Diff(DiffArgs),
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// A file written by --save.
    #[arg(value_name = "SNAPSHOT")]
    pub snapshot: PathBuf,

    #[command(flatten)]
    pub rendering: Rendering,

    /// Show the address, size and age of each outstanding allocation.
    #[arg(short = 'a', long)]
    pub show_allocs: bool,

    /// Order of the stacks.
    #[arg(long, value_enum, default_value_t = SortKey::Size)]
    pub sort: SortKey,
}

#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// The earlier snapshot (from --save).
    #[arg(value_name = "BASE")]
    pub base: PathBuf,

    /// The later snapshot.
    #[arg(value_name = "NEW")]
    pub new: PathBuf,

    #[command(flatten)]
    pub rendering: Rendering,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SortKey {
    /// Outstanding bytes, largest first.
    Size,
    /// Outstanding allocations, most first.
    Count,
    /// Steady growth: the longest run of growing reports first, then the
    /// fastest growth per report. Finds a slow leak behind big stable
    /// caches.
    Growth,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// bcc-style text.
    Text,
    /// One JSON object per report, one per line.
    Json,
    /// Collapsed stacks, root first, for flame graph tools; every stack,
    /// not only the top N.
    Folded,
    /// A flame graph, as SVG; every stack.
    Svg,
    /// A gzipped pprof profile (profile.proto), for
    /// go tool pprof, Pyroscope, Parca and speedscope; every stack.
    Pprof,
}

impl Format {
    /// A whole document per report (not a stream): only the final report
    /// is written, with every stack.
    pub fn is_document(self) -> bool {
        matches!(self, Format::Svg | Format::Pprof)
    }

    /// For flame graph tools: every stack, not the top N.
    pub fn wants_every_stack(self) -> bool {
        matches!(self, Format::Folded | Format::Svg | Format::Pprof)
    }
}

/// What folded stacks and flame graphs weigh stacks by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Weight {
    /// Outstanding bytes.
    Bytes,
    /// Outstanding allocations.
    Count,
}

const EXAMPLES: &str = "\
Examples:
  memleak -p 1234              report every 5 s until interrupted
  memleak -p 1234 -a 10 3      3 reports, 10 s apart, with each allocation
  memleak -c './app --flag'    run ./app and trace it from its start
  memleak --percpu 10          the kernel's allocations, per-CPU ones too
  memleak -p 1234 --format json | jq .total_bytes
  memleak -p 1234 --save heap.snap 60 2
  memleak diff heap.1.snap heap.2.snap --output growth.svg";

fn parse_interval(text: &str) -> Result<Duration, String> {
    match text.parse::<u64>() {
        Ok(0) => Err("the interval must be at least 1 second".to_owned()),
        Ok(seconds) => Ok(Duration::from_secs(seconds)),
        Err(_) => Err(format!("`{text}` is not a whole number of seconds")),
    }
}

impl Args {
    pub fn format(&self) -> Format {
        self.rendering.format()
    }

    /// Without -p, -c or --cgroup, memleak traces the kernel's allocations, as bcc's
    /// memleak does.
    pub fn kernel_mode(&self) -> bool {
        self.pid.is_empty() && self.command.is_none() && self.cgroup.is_none()
    }

    /// Checks that clap's declarations cannot express.
    pub fn validate(&self) -> Result<(), String> {
        let kernel = self.kernel_mode();
        if !kernel && self.percpu {
            return Err("--percpu is for kernel tracing: leave out -p and -c".to_owned());
        }
        let user_only = [
            (self.object.is_some(), "-O"),
            (self.symbols_prefix.is_some(), "--symbols-prefix"),
            (self.trace, "--trace"),
            (self.all_mmaps, "--all-mmaps"),
        ];
        if let Some((_, flag)) = user_only.iter().find(|(given, _)| kernel && *given) {
            return Err(format!("{flag} needs a process: give -p PID or -c \"CMD ARGS\""));
        }
        if let (Some(min), Some(max)) = (self.min_size, self.max_size) {
            if min > max {
                return Err(format!("--min-size {min} is larger than --max-size {max}"));
            }
        }
        let mut pids = self.pid.clone();
        pids.sort_unstable();
        if let Some(pair) = pids.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(format!("pid {} is given twice", pair[0]));
        }
        self.rendering.validate(self.save.is_some())?;
        if self.trace && !matches!(self.format(), Format::Text | Format::Json) {
            return Err("--trace prints lines: use it with --format text or json".to_owned());
        }
        if self.symbols_prefix.as_deref() == Some("") {
            return Err("--symbols-prefix needs a prefix, such as je_".to_owned());
        }
        Ok(())
    }
}
