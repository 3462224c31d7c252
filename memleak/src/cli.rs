//! The command line, as clap parses it, and nothing more: `config` turns
//! it into what each stage needs. Flags keep the meaning they have in
//! bcc's memleak, but for `-o`: bcc ages every allocation (500 ms by
//! default), which means reading each one at every report; memleak reads
//! per-stack totals unless `-o` is given.

#![allow(clippy::doc_markdown, reason = "doc comments here are --help text, where backticks would show")]

use std::{
    net::{IpAddr, SocketAddr},
    num::NonZeroU64,
    path::PathBuf,
    time::Duration,
};

use clap::{builder::PossibleValue, Parser, Subcommand, ValueEnum};
use memleak_common::python::PY_DEFAULT_MAX_FRAMES;

use crate::report::options::{Choice, DiffOrder, Format, SortKey, Weight};

/// Trace outstanding allocations of processes (or, without -p, -c and
/// --cgroup, of the kernel) and print the call stacks that hold the most
/// memory.
#[allow(clippy::struct_excessive_bools, reason = "bcc's yes/no flags, each independent of the others")]
#[derive(Debug, Parser)]
#[command(name = "memleak", version = VERSION, about, after_help = EXAMPLES, args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Render or compare saved snapshots, or serve reports over HTTP,
    /// instead of tracing.
    #[command(subcommand)]
    pub action: Option<Action>,

    #[command(flatten)]
    pub target: Targets,

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
    /// allocations or a million. -o (as -a and --save do) reads each
    /// allocation.
    #[arg(short = 'o', long, value_name = "MS")]
    pub older: Option<u64>,

    /// Also show the mmaps the allocator makes for itself, thread stacks
    /// and PROT_NONE reservations, which are left out (and counted) by
    /// default.
    #[arg(long)]
    pub all_mmaps: bool,

    /// In kernel mode (no -p, -c or --cgroup), also trace per-CPU
    /// allocations.
    #[arg(long)]
    pub percpu: bool,

    /// Print a line for every allocation and free as it happens (with
    /// --format text or json).
    #[arg(short = 't', long)]
    pub trace: bool,

    /// Order of the stacks in a report.
    #[arg(long, value_enum, default_value_t = SortKey::Size)]
    pub sort: SortKey,

    /// bcc's flag for reporting the per-stack totals kept in BPF, without
    /// reading each allocation. memleak does so whenever -a, -o and --save
    /// are not given.
    #[arg(long, conflicts_with_all = ["show_allocs", "older", "save"])]
    pub combined_only: bool,

    /// bcc's workaround for allocators whose free is not seen: an address
    /// handed out again counts as freed first. memleak always does this.
    #[arg(long)]
    pub wa_missing_free: bool,

    #[command(flatten)]
    pub probing: Probing,

    #[command(flatten)]
    pub rendering: Rendering,

    #[command(flatten)]
    pub culprits: Culprits,

    /// Also save each report whole (every stack, each allocation, the
    /// symbolized frames) to FILE, for `memleak report` and `memleak diff`.
    /// Unless there is one report (COUNT 1, one process), files are
    /// numbered: heap.1.snap, heap.2.snap...
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,

    /// Write what memleak did to FILE, as JSON lines for programs to read:
    /// how long starting took, each probe placed, each unwind table built,
    /// and each report's size and how long it took.
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,

    /// Print debug logs (probe placement, skipped symbols) to stderr.
    #[arg(short, long)]
    pub verbose: bool,
}

/// Which allocations are recorded, how their stacks are walked, and how
/// much BPF keeps: for tracing and for `memleak serve` alike.
#[derive(Debug, clap::Args)]
pub struct Probing {
    /// Record about one allocation in N, picked at random; reported figures
    /// are scaled up by N. Frees of recorded allocations stay exact.
    #[arg(short = 's', long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub sample_rate: u32,

    /// Probe `PREFIXmalloc`, `PREFIXfree` and so on, for allocators built with
    /// a symbol prefix (jemalloc's je_).
    #[arg(long, value_name = "PREFIX")]
    pub symbols_prefix: Option<String>,

    /// Ignore allocations smaller than this many bytes.
    #[arg(short = 'z', long, value_name = "BYTES")]
    pub min_size: Option<u64>,

    /// Ignore allocations larger than this many bytes.
    #[arg(short = 'Z', long, value_name = "BYTES")]
    pub max_size: Option<u64>,

    /// Allocator object to probe, as the target names it (inside its root),
    /// instead of the first object of its link map that defines malloc and
    /// free (the program, a preloaded library, libc...).
    #[arg(short = 'O', long = "obj", value_name = "PATH")]
    pub object: Option<PathBuf>,

    /// Outstanding allocations tracked at most; more are counted as not
    /// tracked. Kernel memory: 16 bytes per N reserved at start (16 MiB by
    /// default), then about 96 bytes per allocation outstanding.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ALLOCS, value_parser = clap::value_parser!(u32).range(1..=MAX_ALLOCS))]
    pub max_allocs: u32,

    /// Distinct call stacks stored at most; allocations from further stacks
    /// are counted as "stacks lost", their bytes kept under [stack lost].
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_STACKS, value_parser = clap::value_parser!(u32).range(1..=MAX_STACKS))]
    pub max_stacks: u32,

    /// How user stacks are walked: with the unwind tables of each object's
    /// .eh_frame, which needs no frame pointers, or with frame pointers
    /// only, as bcc's memleak does.
    #[arg(long, value_enum, default_value_t = Unwind::Dwarf)]
    pub unwind: Unwind,

    /// Unwind table rows kept in kernel memory for every object of every
    /// traced process, about 8 bytes each; objects past it are walked with
    /// frame pointers, and the report says so. A Debian python3 needs about
    /// 200,000.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_UNWIND_ROWS, value_parser = clap::value_parser!(u32).range(1..=MAX_UNWIND_ROWS))]
    pub max_unwind_rows: u32,

    /// Walk every frame of every stack, as memleak did before it took the
    /// frames a thread's stack still shares with its last walk (each one
    /// checked on the stack). For checking and measuring: the stacks are
    /// the same, found more slowly.
    #[arg(long)]
    pub no_stack_reuse: bool,

    /// Frames kept per stack (1 to 127).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_STACK_DEPTH, value_parser = clap::value_parser!(u32).range(1..=127))]
    pub max_stack_depth: u32,

    /// Processes traced at once at most (a cgroup's come and go); more
    /// are counted and left untraced. Each may hold one entry of kernel
    /// memory for allocations whose stack could not be stored.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_PROCESSES, value_parser = clap::value_parser!(u32).range(1..=MAX_PROCESSES))]
    pub max_processes: u32,

    /// Python frames in the stacks of CPython 3.8 to 3.13 processes: with
    /// `auto`, each call of the interpreter's eval loop is shown as the
    /// Python functions it ran, with file and line, in every process whose
    /// interpreter passes memleak's checks (said at attach); `off` leaves
    /// stacks native.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = PythonFrames::Auto)]
    pub python: PythonFrames,

    /// Python frames kept per stack at most (1 to 63). Each takes two of
    /// the --max-stack-depth frames (its code and instruction, and a check
    /// of its code object); the native frames get what they leave.
    #[arg(long, value_name = "N", default_value_t = PY_DEFAULT_MAX_FRAMES, value_parser = clap::value_parser!(u16).range(1..=63))]
    pub max_python_depth: u16,

    /// Also probe CPython's small-object allocator (PyObject_Malloc and
    /// PyMem_Malloc & co., blocks of 512 bytes and less), so that each
    /// small object is tracked with its Python line, and the arenas they
    /// live in are not shown. Costs a probe per object made and freed.
    /// Refused, said once, where the interpreter has that allocator
    /// inlined into its callers (Debian's python3).
    #[arg(long)]
    pub python_allocator: bool,
}

/// How reports are shown and where they go; for tracing and for the
/// offline subcommands alike.
#[derive(Debug, clap::Args)]
pub struct Rendering {
    /// Number of stacks to show in each report, in text and JSON (folded,
    /// SVG and pprof reports hold every stack).
    #[arg(short = 'T', long, value_name = "N", default_value_t = 10)]
    pub top: usize,

    /// Report format (default: from the --output file's extension, else
    /// text).
    #[arg(long, value_enum)]
    pub format: Option<Format>,

    /// Write reports to this file instead of stdout, in the format its
    /// extension names unless --format is given. Text, JSON and folded
    /// reports follow one another in it, each written as soon as it is
    /// made; an SVG or pprof report is a file of its own, put in place once
    /// whole, numbered (leaks.1.svg, leaks.2.svg... for leaks.svg) unless
    /// there is one report. A device or FIFO is written in place.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// Overwrite the files --output (and --save) write if they exist; only
    /// a regular file or a link is replaced, never a directory or device.
    #[arg(long)]
    pub force: bool,

    /// For --format folded and svg: weigh stacks by bytes or by count.
    #[arg(long, value_enum, default_value_t = Weight::Bytes)]
    pub weight: Weight,

    /// In text, show every frame of each stack: runs of allocation
    /// plumbing (alloc::, core::, std::rt, __libc_start_main...) are
    /// otherwise folded into one line. JSON, folded, SVG and pprof always
    /// hold every frame.
    #[arg(long)]
    pub full_stacks: bool,
}

/// What a stack is named by: its culprit, the first frame of the
/// program's own code past the allocation plumbing.
#[derive(Debug, clap::Args)]
pub struct Culprits {
    /// Also pass over frames whose function matches REGEX when naming a
    /// stack's culprit, its first frame of the program's own code. REGEX
    /// is searched in the function's name without its parameters (anchor
    /// it with ^ and $). May be repeated.
    #[arg(long, value_name = "REGEX")]
    pub skip_frames: Vec<String>,

    /// Pass over none of the built-in allocation wrappers and runtime
    /// plumbing (operator new, std::, alloc::, PyMem_*, zmalloc...): a
    /// stack's culprit is its first frame that --skip-frames does not name.
    #[arg(long)]
    pub no_default_skips: bool,
}

/// The processes traced: for a trace and for `memleak top` alike.
#[derive(Debug, clap::Args)]
pub struct Targets {
    /// Trace these running processes (-p 12,34 or -p 12 -p 34); each gets
    /// reports of its own.
    #[arg(short, long, value_name = "PID", value_delimiter = ',', conflicts_with = "command")]
    pub pid: Vec<u32>,

    /// Trace every process of this cgroup v2 directory, including those
    /// that join it later: a report per process, then a total.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["pid", "command"])]
    pub cgroup: Option<PathBuf>,

    /// Run this command (with its arguments, split like a shell would) and
    /// trace it from its first instruction, with the processes it forks.
    #[arg(short, long, value_name = "\"CMD ARGS\"")]
    pub command: Option<String>,

    /// With -p: also trace the processes each one forks from now on (and
    /// theirs), each with reports of its own.
    #[arg(long, conflicts_with = "no_follow_forks")]
    pub follow_forks: bool,

    /// With -c: trace only the command's own process, not the processes it
    /// forks (which are followed by default).
    #[arg(long)]
    pub no_follow_forks: bool,
}

/// What memleak does instead of tracing to stdout: work on snapshots
/// saved with --save (no root, no process needed), or serve reports.
#[derive(Debug, Subcommand)]
pub enum Action {
    /// Render a snapshot saved with --save, in any format.
    Report(ReportArgs),
    /// Show what grew and what shrank between two snapshots, stack by
    /// stack (jeprof's --base); as SVG, a differential flame graph.
    Diff(DiffArgs),
    /// Run as a daemon: follow processes and serve their latest reports
    /// over HTTP, for Prometheus and curl.
    Serve(Box<ServeArgs>),
    /// A live view in the terminal: the stacks that hold the most memory
    /// and how each grows, updated every interval; of processes traced
    /// here, or of a `memleak serve` daemon's (--connect).
    Top(Box<TopArgs>),
}

/// `memleak top`.
#[derive(Debug, clap::Args)]
#[command(after_help = TOP_KEYS)]
pub struct TopArgs {
    #[command(flatten)]
    pub target: Targets,

    /// Show the processes a running `memleak serve` follows, at its URL
    /// (http://HOST:PORT), instead of tracing here; with -p, those
    /// processes only.
    #[arg(long, value_name = "URL", conflicts_with_all = ["command", "cgroup", "follow_forks", "no_follow_forks"])]
    pub connect: Option<String>,

    /// With --connect: the daemon's bearer token, this file's first line.
    #[arg(long, value_name = "FILE", requires = "connect")]
    pub token_file: Option<PathBuf>,

    /// Seconds between updates.
    #[arg(value_name = "INTERVAL", default_value = "2", value_parser = parse_interval)]
    pub interval: Duration,

    /// The order the table starts in: growth is over the last round (`o`
    /// switches it).
    #[arg(long, value_enum, default_value_t = SortKey::Growth)]
    pub sort: SortKey,

    /// Where `s` saves the process shown whole, for `memleak report` and
    /// `memleak diff`: numbered after FILE (memleak.1.snap, memleak.2.snap...),
    /// never over a file that exists.
    #[arg(long, value_name = "FILE", default_value = "memleak.snap")]
    pub save: PathBuf,

    #[command(flatten)]
    pub probing: Probing,

    #[command(flatten)]
    pub culprits: Culprits,
}

/// The keys, for `memleak top --help`.
const TOP_KEYS: &str = "\
Keys:
  Up/Down, PgUp/PgDn  select a stack         Enter  its frames, or fold them
  o  order by bytes, growth or count         f      plumbing frames shown or folded
  /  filter by function, file or object      Esc    clear the filter
  p  pause or go on                          Tab    the next process, or all together
  s  save the process shown (--save)         d      diff against the last save, or leave it
  q, Ctrl-C  quit

Without a terminal on stdout, memleak top prints the plain reports.";

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Follow these running processes (--pid 12,34 or --pid 12 --pid 34).
    #[arg(short, long, value_name = "PID", value_delimiter = ',')]
    pub pid: Vec<u32>,

    /// Follow every process of this cgroup v2 directory and of the cgroups
    /// below it, including those that join later. May be repeated.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Vec<PathBuf>,

    /// Follow every process whose executable's file name is NAME, or that
    /// was started under that name (through a symlink, say), those
    /// started later included. May be repeated.
    #[arg(long, value_name = "NAME")]
    pub exe: Vec<String>,

    /// Follow the processes of a container, by id (a prefix is enough) or
    /// by name (through `podman inspect` or `docker inspect`): whichever
    /// container it names now and later, waited for until it runs, and
    /// found again when redeployed under the same name. May be repeated.
    #[arg(long, value_name = "ID|NAME")]
    pub container: Vec<String>,

    /// Follow the processes of every container of a pod in this
    /// namespace, those started later too (names from --host-root, no
    /// Kubernetes API). May be repeated; with --pod or --container-name,
    /// a container must match each.
    #[arg(long, value_name = "NS")]
    pub namespace: Vec<String>,

    /// Follow the processes of the containers of the pods whose whole
    /// name this regular expression matches (`web-.*`).
    #[arg(long, value_name = "REGEX")]
    pub pod: Option<String>,

    /// Follow the processes of the containers of this name, in whichever
    /// pod. May be repeated.
    #[arg(long, value_name = "NAME")]
    pub container_name: Vec<String>,

    /// How long a process that exited keeps its last report before it is
    /// forgotten: 30s, 10m, 1h, 2d.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
    pub retain: Duration,

    /// Address to listen on: an IP address (127.0.0.1, ::1), or one with
    /// its port as Prometheus exporters take them (127.0.0.1:9943,
    /// [::1]:9943, or :9943 for every IPv4 address). Any but a loopback
    /// address needs --token-file.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1", value_parser = parse_listen)]
    pub listen: ListenAddress,

    /// Require `Authorization: Bearer <token>` on every request but
    /// /healthz, the token being this file's first line (16 characters
    /// at least).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// Port to listen on, for a --listen without one [default: 9943].
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,

    /// The address /api/v1/sd gives scrapers to reach this daemon, as
    /// HOST:PORT [default: $POD_IP with the port listened on, else the
    /// address listened on].
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_advertise)]
    pub advertise: Option<String>,

    /// Where the node's root filesystem is: the container runtimes' and
    /// the kubelet's files below it name each process's pod and
    /// container (/host when memleak runs in a pod with the host's root
    /// mounted there).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,

    /// Where the evidence of OOM kills is kept, a file per kill under
    /// DIR/oom, read again at start [default: /var/lib/memleak, or memory
    /// only if it cannot be made].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    #[command(flatten)]
    pub probing: Probing,

    #[command(flatten)]
    pub culprits: Culprits,

    /// Print debug logs (probe placement, each request's window) to
    /// stderr.
    #[arg(short, long)]
    pub verbose: bool,

    /// Seconds between collections. A request for /metrics (but
    /// /metrics?pid=), / or /api/v1/targets asks for a fresh one too, and
    /// waits up to a second for it; a report or profile asked for is
    /// taken when asked.
    #[arg(long, value_name = "SECONDS", default_value = "2", value_parser = parse_interval)]
    pub interval: Duration,

    /// Stacks of each process shown in /metrics, largest first, as
    /// memleak_stack_outstanding_bytes series; 0 shows none. At most 100:
    /// each is two series per process in every scrape.
    #[arg(long, value_name = "K", default_value_t = 5, value_parser = clap::value_parser!(u16).range(..=100))]
    pub metrics_top_stacks: u16,

    #[command(flatten)]
    pub watching: Watching,
}

/// `memleak serve --watch`: trace only what grows.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Watching")]
pub struct Watching {
    /// Watch the processes the selectors name (every process with none)
    /// from the kernel's memory counters, with no probe, and trace only
    /// those whose anonymous memory grows, for --trace-for each.
    #[arg(long)]
    pub watch: bool,

    /// Time between looks at the processes' counters: 1s, 5s, 1m.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration, requires = "watch")]
    pub watch_every: Duration,

    /// The span a process's growth is judged over: its memory's floor
    /// must rise through it, quarter after quarter.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration, requires = "watch")]
    pub growth_window: Duration,

    /// The least growth judged a leak, as SIZE/UNIT: 64KiB/s, 1MiB/min,
    /// 100MiB/h.
    #[arg(long, value_name = "RATE", default_value = "1MiB/min", value_parser = parse_rate, requires = "watch")]
    pub min_growth: f64,

    /// How long a process found growing is traced before it is let go,
    /// its last report kept.
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = parse_duration, requires = "watch")]
    pub trace_for: Duration,

    /// What the traced processes may pay for memleak's probes together, as
    /// a share of one CPU (0.1: a tenth), as memleak estimates it: past
    /// it, the costliest window ends early, and no other begins.
    #[arg(long, value_name = "SHARE", default_value = "0.1", value_parser = parse_share, requires = "watch")]
    pub max_overhead: f64,

    /// Processes traced at once at most; others found growing wait.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..), requires = "watch")]
    pub max_traced: u16,
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// A file written by --save.
    #[arg(value_name = "SNAPSHOT")]
    pub snapshot: PathBuf,

    #[command(flatten)]
    pub rendering: Rendering,

    #[command(flatten)]
    pub culprits: Culprits,

    /// Show the address, size and age of each outstanding allocation.
    #[arg(short = 'a', long)]
    pub show_allocs: bool,

    /// Order of the stacks.
    #[arg(long, value_enum, default_value_t = SortKey::Size)]
    pub sort: SortKey,
}

#[derive(Debug, clap::Args)]
#[command(mut_arg("top", |arg| {
    arg.help("Number of stacks shown of those that grew most, and of those that shrank most, in text and JSON \
              (folded, SVG and pprof hold every stack that changed)")
}))]
pub struct DiffArgs {
    /// The earlier snapshot (from --save).
    #[arg(value_name = "BASE")]
    pub base: PathBuf,

    /// The later snapshot.
    #[arg(value_name = "NEW")]
    pub new: PathBuf,

    /// Order of the stacks.
    #[arg(long, value_enum, default_value_t = DiffOrder::Growth)]
    pub sort: DiffOrder,

    #[command(flatten)]
    pub rendering: Rendering,

    #[command(flatten)]
    pub culprits: Culprits,
}

/// Whether Python frames are walked (--python).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PythonFrames {
    /// In every CPython process that passes memleak's checks.
    Auto,
    /// Never.
    Off,
}

/// How user stacks are walked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Unwind {
    /// Unwind tables from .eh_frame: full stacks without frame pointers.
    Dwarf,
    /// Frame pointers only: short or truncated stacks in code built
    /// without them (most release builds).
    Fp,
}

/// The report vocabulary's choices, offered as clap values with their
/// descriptions as help.
macro_rules! choice_values {
    ($($choice:ty),*) => {$(
        impl ValueEnum for $choice {
            fn value_variants<'a>() -> &'a [Self] {
                <$choice as Choice>::ALL
            }

            fn to_possible_value(&self) -> Option<PossibleValue> {
                Some(PossibleValue::new(self.name()).help(self.description()))
            }
        }
    )*};
}

choice_values!(Format, SortKey, DiffOrder, Weight);

/// What `--version` says after "memleak": the crate's version, the commit
/// built (`-dirty` when the binary's sources differed from it, `unknown`
/// outside a git checkout) and the SHA-256 of the embedded BPF object,
/// which has no build-id note of its own (see build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("MEMLEAK_COMMIT"),
    ", bpf object sha256:",
    env!("MEMLEAK_BPF_SHA256"),
    ")"
);

const EXAMPLES: &str = "\
Examples:
  memleak -p 1234              report every 5 s until interrupted
  memleak -p 1234 -a 10 3      3 reports, 10 s apart, with each allocation
  memleak -c './app --flag'    run ./app and trace it from its start
  memleak --percpu 10          the kernel's allocations, per-CPU ones too
  memleak -p 1234 --format json | jq .total_bytes
  memleak -p 1234 --save heap.snap 60 2
  memleak diff heap.1.snap heap.2.snap --output growth.svg
  memleak serve --pid 1234     serve /metrics on 127.0.0.1:9943
  memleak serve --exe nginx --container web --retain 1h";

// The tracer's defaults, for `memleak serve` too.
pub const DEFAULT_MAX_ALLOCS: u32 = 1_000_000;
pub const DEFAULT_MAX_STACKS: u32 = 65_536;
pub const DEFAULT_MAX_UNWIND_ROWS: u32 = 1 << 20;
pub const DEFAULT_MAX_STACK_DEPTH: u32 = 127;
pub const DEFAULT_MAX_PROCESSES: u32 = 1024;
/// Where `memleak serve` listens unless --port says otherwise.
pub const DEFAULT_SERVE_PORT: u16 = 9943;

// The largest sizes accepted: each map past these would ask the kernel for
// gigabytes at start (see `bpf::map_costs`), far more than any real target
// needs, and the kernel refuses a hash map of 2^27 entries or more outright.
const MAX_ALLOCS: i64 = 100_000_000;
const MAX_STACKS: i64 = 10_000_000;
const MAX_UNWIND_ROWS: i64 = 1 << 28;
const MAX_PROCESSES: i64 = 65_536;
/// A year: longer intervals are surely a typo, and far ones overflow the
/// clock.
const MAX_INTERVAL_SECONDS: u64 = 365 * 24 * 3600;

/// A duration with its unit: `30s`, `10m`, `1h`, `2d`; at most a year.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 24 * 3600,
        "" => return Err(format!("`{text}` has no unit: give one, as in 30s, 10m, 1h or 2d")),
        _ => return Err(format!("`{text}` is not a duration: give one as in 30s, 10m, 1h or 2d")),
    };
    let count: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: give one as in 30s, 10m, 1h or 2d"))?;
    match count.checked_mul(unit_seconds) {
        Some(seconds) if seconds <= MAX_INTERVAL_SECONDS => Ok(Duration::from_secs(seconds)),
        _ => Err(format!("`{text}` is longer than a year")),
    }
}

/// A share of a CPU: more than 0, and at most the CPUs a machine may have.
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(share) if share > 0.0 && share <= 4096.0 => Ok(share),
        _ => Err(format!("`{text}` is not a share of a CPU: give a number above 0, as 0.1 for a tenth")),
    }
}

/// A rate of growth in bytes per second, from SIZE/UNIT: `64KiB/s`,
/// `1MiB/min`, `100MB/h`; SIZE a number with B, KiB, MiB or GiB (K, M
/// and G, and KB, MB and GB, read as powers of 1,024 too).
fn parse_rate(text: &str) -> Result<f64, String> {
    let forms = || format!("`{text}` is not a rate: give SIZE/UNIT, as in 64KiB/s, 1MiB/min or 100MiB/h");
    let (size, per) = text.split_once('/').ok_or_else(forms)?;
    let seconds = match per {
        "s" => 1.0,
        "min" | "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(forms()),
    };
    let split = size.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(size.len());
    let (number, unit) = size.split_at(split);
    let number: f64 = number.parse().map_err(|_| forms())?;
    let unit_bytes = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => return Err(forms()),
    };
    let rate = number * unit_bytes / seconds;
    if rate.is_finite() && rate > 0.0 {
        Ok(rate)
    } else {
        Err(format!("`{text}`: the least growth must be more than nothing"))
    }
}

/// Where `memleak serve` listens, as --listen gives it: an address, and
/// the port when it names one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenAddress {
    pub ip: IpAddr,
    pub port: Option<u16>,
    /// As the user wrote it, for messages.
    pub given: String,
}

/// `127.0.0.1`, `::1`, `[::1]`, `127.0.0.1:9943`, `[::1]:9943`, or
/// `:9943` (every IPv4 address, as Go's servers read it, but for IPv6).
fn parse_listen(text: &str) -> Result<ListenAddress, String> {
    let given = text.to_owned();
    // An address first: `::1` starts as `:PORT` does.
    let bare = text.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')).unwrap_or(text);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(ListenAddress { ip, port: None, given });
    }
    if let Some(port) = text.strip_prefix(':') {
        let port = parse_port(text, port)?;
        return Ok(ListenAddress {
            ip: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            port: Some(port),
            given,
        });
    }
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(ListenAddress { ip: address.ip(), port: Some(address.port()), given });
    }
    if let Some((_, port)) = text.rsplit_once(':').filter(|(host, _)| host.parse::<IpAddr>().is_ok()) {
        return Err(parse_port(text, port).err().unwrap_or_else(|| listen_forms(text)));
    }
    Err(listen_forms(text))
}

fn listen_forms(text: &str) -> String {
    format!("`{text}` is not an address to listen on: give an IP address (127.0.0.1, ::1), IP:PORT, [IPv6]:PORT or :PORT")
}

fn parse_port(text: &str, port: &str) -> Result<u16, String> {
    port.parse().map_err(|_| format!("`{text}`: `{port}` is not a port (0 to 65535)"))
}

/// HOST:PORT, HOST a name or an IP address (an IPv6 one in brackets).
fn parse_advertise(text: &str) -> Result<String, String> {
    let wanted = || {
        format!("`{text}` is not HOST:PORT: give a name or IP address and a port, as 10.0.0.7:9943 or [fd00::7]:9943")
    };
    let (host, port) = text.rsplit_once(':').ok_or_else(wanted)?;
    parse_port(text, port)?;
    let host_is_good = if let Some(inside) = host.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
        inside.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        // DNS's limits: 253 characters a name, 63 a label.
        !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| label.len() <= 63)
            && host.bytes().all(|byte| byte.is_ascii_alphanumeric() || byte == b'.' || byte == b'-')
    };
    if host_is_good {
        Ok(text.to_owned())
    } else {
        Err(wanted())
    }
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    match text.parse::<u64>() {
        Ok(0) => Err("the interval must be at least 1 second".to_owned()),
        Ok(seconds) if seconds > MAX_INTERVAL_SECONDS => {
            Err(format!("the interval must be at most {MAX_INTERVAL_SECONDS} seconds (a year)"))
        }
        Ok(seconds) => Ok(Duration::from_secs(seconds)),
        Err(_) => Err(format!("`{text}` is not a whole number of seconds")),
    }
}

/// A command line clap refused, as the one line memleak prints after
/// `memleak: error: `: what clap says is wrong (its usage and its
/// `-- --flag` hint left out: memleak's INTERVAL would not take a flag),
/// then what it meant, when that is known: clap's own suggestion
/// (`; did you mean `--sample-rate`?`), a subcommand that a word in
/// INTERVAL's place is close to, or the subcommand a flag belongs to.
/// Quotes are backticks, as in memleak's own messages.
pub fn describe_error(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    let said: Vec<&str> =
        rendered.lines().take_while(|line| !line.trim().is_empty()).map(str::trim).collect();
    let mut message = said.join(" ").trim_start_matches("error: ").to_owned();
    if let Some(meant) = suggestion(error) {
        message.push_str(&meant);
    }
    message.replace('\'', "`")
}

/// `; did you mean 'X'?`, `; `--x` is a flag of `memleak serve`` or `;
/// did you mean `--x` of `memleak serve`?`.
fn suggestion(error: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    let text = |kind| match error.get(kind) {
        Some(ContextValue::String(text)) => Some(vec![text.clone()]),
        Some(ContextValue::Strings(texts)) if !texts.is_empty() => Some(texts.clone()),
        _ => None,
    };
    let quoted = |names: Vec<String>| names.iter().map(|name| format!("'{name}'")).collect::<Vec<_>>();
    let invalid = text(ContextKind::InvalidArg).and_then(|mut names| names.pop());
    // A mistyped flag: memleak's own measure, not clap's, which offers
    // `--output` for `--tpo` and nothing for `--pdi`.
    if let (clap::error::ErrorKind::UnknownArgument, Some(invalid)) = (error.kind(), &invalid) {
        return flag_suggestion(invalid, subcommand_in_usage(error).as_deref());
    }
    let clap_suggests =
        [ContextKind::SuggestedValue, ContextKind::SuggestedSubcommand].into_iter().find_map(text);
    if let Some(names) = clap_suggests {
        return Some(format!("; did you mean {}?", quoted(names).join(" or ")));
    }
    // A word where INTERVAL goes: a subcommand mistyped, most likely.
    if error.kind() == clap::error::ErrorKind::ValueValidation && invalid.as_deref() == Some("[INTERVAL]") {
        let word = text(ContextKind::InvalidValue)?.pop()?;
        let command = <Args as clap::CommandFactory>::command();
        let close: Vec<String> = command
            .get_subcommands()
            .map(|subcommand| subcommand.get_name().to_owned())
            .filter(|name| is_close(&word, name))
            .collect();
        return (!close.is_empty()).then(|| format!("; did you mean {}?", quoted(close).join(" or ")));
    }
    None
}

/// What `--flag` (maybe `--flag=value`), unknown to memleak's `subcommand`
/// (`None`: tracing), was meant to be: the command's flags close to it,
/// else the other commands' flags it is or is close to (`memleak
/// --containr x` meant `memleak serve --container`).
fn flag_suggestion(invalid: &str, subcommand: Option<&str>) -> Option<String> {
    let flag = invalid.split_once('=').map_or(invalid, |(flag, _)| flag);
    let long = flag.strip_prefix("--")?;
    let root = <Args as clap::CommandFactory>::command();
    let command = subcommand.and_then(|name| root.find_subcommand(name)).unwrap_or(&root);
    let close_flags = |command: &clap::Command| -> Vec<String> {
        let longs: Vec<&str> = command.get_arguments().filter_map(clap::Arg::get_long).collect();
        // The flag itself first, where another command has it.
        let mut close: Vec<&str> = longs.iter().copied().filter(|name| *name == long).collect();
        if close.is_empty() {
            close = longs.into_iter().filter(|name| is_close(long, name)).collect();
        }
        close.iter().map(|name| format!("--{name}")).collect()
    };
    let quoted =
        |names: &[String]| names.iter().map(|name| format!("`{name}`")).collect::<Vec<_>>().join(" or ");
    let own = close_flags(command);
    if !own.is_empty() {
        return Some(format!("; did you mean {}?", quoted(&own)));
    }
    let others: Vec<(String, Vec<String>)> = std::iter::once(("memleak".to_owned(), &root))
        .chain(root.get_subcommands().map(|other| (format!("memleak {}", other.get_name()), other)))
        .filter(|(_, other)| other.get_name() != command.get_name())
        .map(|(name, other)| (name, close_flags(other)))
        .filter(|(_, flags)| !flags.is_empty())
        .collect();
    if others.is_empty() {
        return None;
    }
    if others.iter().all(|(_, flags)| flags.iter().all(|other| other == flag)) {
        let owners: Vec<String> = others.iter().map(|(name, _)| format!("`{name}`")).collect();
        return Some(format!("; `{flag}` is a flag of {}", owners.join(" and ")));
    }
    let meant: Vec<String> =
        others.iter().map(|(name, flags)| format!("{} of `{name}`", quoted(flags))).collect();
    Some(format!("; did you mean {}?", meant.join(" or ")))
}

/// The subcommand whose usage a clap error shows (`Usage: memleak serve
/// [OPTIONS]`): the one whose flags were being parsed.
fn subcommand_in_usage(error: &clap::Error) -> Option<String> {
    let usage = match error.get(clap::error::ContextKind::Usage)? {
        clap::error::ContextValue::StyledStr(usage) => usage.to_string(),
        _ => return None,
    };
    let after = usage.split_once("memleak ")?.1;
    let word = after.split_whitespace().next()?;
    let root = <Args as clap::CommandFactory>::command();
    root.find_subcommand(word).map(|subcommand| subcommand.get_name().to_owned())
}

/// `word` is a mistyping of `name`: a prefix of it, or at most one edit
/// away per three letters (`serv`, `dif`, `reprot`; a swap of two
/// neighbours is one edit).
fn is_close(word: &str, name: &str) -> bool {
    // The measure clap's own suggestions use (insertions, deletions,
    // substitutions and swaps of neighbours), with clap's crate for it.
    (word.len() >= 3 && name.starts_with(word)) || strsim::osa_distance(word, name) <= (name.len() / 3).max(1)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn refused(line: &str) -> String {
        let arguments = std::iter::once("memleak").chain(line.split_whitespace());
        describe_error(&Args::try_parse_from(arguments).expect_err(line))
    }

    #[test]
    fn rates_of_growth_are_a_size_per_unit_of_time() {
        assert_eq!(parse_rate("64KiB/s"), Ok(65536.0));
        assert_eq!(parse_rate("1MiB/min"), Ok(1_048_576.0 / 60.0));
        assert_eq!(parse_rate("3.6MB/h"), Ok(3.6 * 1_048_576.0 / 3600.0));
        assert_eq!(parse_rate("512/s"), Ok(512.0));
        for bad in ["64KiB", "64KiB/d", "KiB/s", "64XB/s", "0KiB/s"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
        assert_eq!(
            refused("serve --watch --min-growth 1MiB"),
            "invalid value `1MiB` for `--min-growth <RATE>`: `1MiB` is not a rate: give SIZE/UNIT, as in 64KiB/s, \
             1MiB/min or 100MiB/h"
        );
        assert!(
            refused("serve --pid 1 --trace-for 1m").contains("--watch"),
            "{}",
            refused("serve --pid 1 --trace-for 1m")
        );
    }

    #[test]
    fn a_mistyped_flag_keeps_clap_s_suggestion() {
        assert_eq!(
            refused("--sample-rat 10"),
            "unexpected argument `--sample-rat` found; did you mean `--sample-rate`?"
        );
        assert_eq!(refused("serve --prot 9"), "unexpected argument `--prot` found; did you mean `--port`?");
        assert_eq!(
            refused("report --formt json heap.snap"),
            "unexpected argument `--formt` found; did you mean `--format`?"
        );
        assert_eq!(
            refused("--format jsn"),
            "invalid value `jsn` for `--format <FORMAT>` [possible values: text, json, folded, svg, pprof]; \
             did you mean `json`?"
        );
    }

    #[test]
    fn an_advertised_name_keeps_to_dns_limits() {
        let long_label = format!("serve --pid 1 --advertise {}.example:9943", "a".repeat(64));
        assert!(refused(&long_label).contains("is not HOST:PORT"), "{}", refused(&long_label));
        let long_name = format!("serve --pid 1 --advertise {}:9943", ["node"; 60].join("."));
        assert!(refused(&long_name).contains("is not HOST:PORT"));
        let fine = format!("{}.example:9943", "a".repeat(63));
        assert!(Args::try_parse_from(["memleak", "serve", "--pid", "1", "--advertise", &fine]).is_ok());
    }

    #[test]
    fn a_mistyped_subcommand_is_named() {
        assert_eq!(
            refused("serv --pid 1"),
            "invalid value `serv` for `[INTERVAL]`: `serv` is not a whole number of seconds; did you mean `serve`?"
        );
        assert!(refused("dif a b").ends_with("; did you mean `diff`?"));
        assert!(refused("reprot a").ends_with("; did you mean `report`?"));
        assert_eq!(
            refused("soon"),
            "invalid value `soon` for `[INTERVAL]`: `soon` is not a whole number of seconds"
        );
    }

    #[test]
    fn a_subcommand_s_flag_says_whose_it_is() {
        assert_eq!(
            refused("--listen 0.0.0.0"),
            "unexpected argument `--listen` found; `--listen` is a flag of `memleak serve`"
        );
        assert_eq!(refused("--xyz"), "unexpected argument `--xyz` found", "no `-- --xyz` hint");
        assert_eq!(
            refused("--containr x"),
            "unexpected argument `--containr` found; did you mean `--container` of `memleak serve`?"
        );
    }

    #[test]
    fn the_flags_users_mistype_are_suggested() {
        assert_eq!(refused("--tpo 3"), "unexpected argument `--tpo` found; did you mean `--top`?");
        assert_eq!(refused("--pdi 3"), "unexpected argument `--pdi` found; did you mean `--pid`?");
        assert_eq!(refused("serve --exee x"), "unexpected argument `--exee` found; did you mean `--exe`?");
    }

    /// Every long flag of every command, mistyped by one edit (its second
    /// and third letters swapped, or its last letter dropped), is
    /// suggested back, where the typo is not a flag itself.
    #[test]
    fn every_flag_mistyped_once_is_suggested() {
        let root = <Args as clap::CommandFactory>::command();
        let commands = std::iter::once((None, &root))
            .chain(root.get_subcommands().map(|sub| (Some(sub.get_name()), sub)));
        for (name, command) in commands {
            let longs: Vec<&str> = command.get_arguments().filter_map(clap::Arg::get_long).collect();
            for long in longs.iter().filter(|long| long.len() >= 3 && **long != "help" && **long != "version")
            {
                let mut swapped: Vec<char> = long.chars().collect();
                swapped.swap(1, 2);
                let swapped: String = swapped.into_iter().collect();
                let dropped = &long[..long.len() - 1];
                for typo in [swapped.as_str(), dropped] {
                    if longs.contains(&typo) || typo == *long {
                        continue;
                    }
                    let line = format!("{} --{typo}", name.unwrap_or("")).trim().to_owned();
                    let said = refused(&line);
                    assert!(said.contains(&format!("`--{long}`")), "{line}: {said}");
                }
            }
        }
    }

    /// The long help of memleak and each subcommand, as `--help` prints it.
    fn help_of(subcommand: Option<&str>) -> String {
        let mut command = <Args as clap::CommandFactory>::command();
        let command = match subcommand {
            Some(name) => command.find_subcommand_mut(name).unwrap(),
            None => &mut command,
        };
        command.render_long_help().to_string()
    }

    /// Help that once said what memleak no longer does.
    #[test]
    fn the_help_says_what_memleak_does_now() {
        for subcommand in [None, Some("report"), Some("diff"), Some("serve")] {
            let help = help_of(subcommand);
            for stale in ["when memleak ends", "instead of the libc the target maps", "without -p and -c,"] {
                assert!(!help.contains(stale), "{subcommand:?}: {stale:?} in\n{help}");
            }
        }
        assert!(help_of(None).contains("each written as soon as it is made"));
        assert!(help_of(Some("diff")).contains("of those that grew most, and of those that shrank most"));
    }

    #[test]
    fn words_close_to_a_name() {
        assert!(is_close("serv", "serve") && is_close("dif", "diff") && is_close("reprot", "report"));
        assert!(is_close("sreve", "serve") && !is_close("x", "diff") && !is_close("sort", "report"));
    }
}
