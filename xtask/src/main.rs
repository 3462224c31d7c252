//! Everything besides cargo itself: toolchain setup, the demo, the book
//! and its examples, the privileged test run and the benchmark.

mod bench;
mod dist;
mod docs;
mod kernel_tests;
mod setup;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building the BPF programs needs: rust-src and a
    /// bpf-linker built against the toolchain's own LLVM. Fast when done.
    Setup,
    /// Build memleak and run it on the bundled leaking example.
    Demo,
    /// Run clippy and every test: unit tests and, as root, the end-to-end
    /// tests, here and then in other kernels (see `kernels`).
    Test {
        /// Passed to the test binaries (a test name filter, --nocapture...).
        #[arg(trailing_var_arg = true)]
        test_args: Vec<String>,
    },
    /// Build the book (docs/, an mdBook) into target/book and check its
    /// links and README.md's. With --examples, as root, first make the
    /// docs' example outputs again from real runs: each block marked
    /// `<!-- example: NAME -->` in README.md and docs/src, and the pictures
    /// it shows. A block changes only where more than run-specific values
    /// (times, pids, addresses, ports) differ.
    Docs {
        /// Make the examples again and rewrite the blocks that changed.
        #[arg(long)]
        examples: bool,
        /// Make the examples again but write nothing; fail, naming each
        /// example whose output changed.
        #[arg(long, conflicts_with_all = ["fresh", "examples"])]
        check: bool,
        /// Make the examples again and rewrite the blocks made even where
        /// only run-specific values differ: a fresh transcript.
        #[arg(long)]
        fresh: bool,
        /// Only these examples (all by default); naming one makes it
        /// again, as --examples does.
        names: Vec<String>,
    },
    /// Build what a release ships, under target/dist/: a static memleak
    /// (`x86_64` musl), its man pages and shell completions, and a .deb;
    /// the same for arm64 under target/dist/arm64/.
    Dist {
        /// A debug build without debug info under target/dist-test/, as
        /// `cargo xtask test` makes for tests/tests/dist.rs: `x86_64` only.
        #[arg(long)]
        debug: bool,
    },
    /// Measure memleak's overhead on a malloc-heavy workload, with and
    /// without frame pointers, what Python frames cost, and its unwind
    /// tables for real programs.
    Bench {
        /// Fewer and shorter runs (under 2 minutes).
        #[arg(long)]
        quick: bool,
        /// Only `memleak serve`'s section: its scrapes and its soak.
        #[arg(long)]
        serve_only: bool,
        /// Only the time one --save snapshot of 65,536 deep stacks takes
        /// (no root needed).
        #[arg(long, conflicts_with = "serve_only")]
        save_only: bool,
        /// Only what Python frames cost, on Debian's python3.11.
        #[arg(long, conflicts_with_all = ["serve_only", "save_only"])]
        python_only: bool,
        /// Only what a stack's depth costs, against heaptrack, and an
        /// mprotect call.
        #[arg(long, conflicts_with_all = ["serve_only", "save_only", "python_only"])]
        depth_only: bool,
        /// Only what memleak adds to an mprotect call, and what seeing
        /// mapping calls costs processes it does not trace.
        #[arg(long, conflicts_with_all = ["serve_only", "save_only", "python_only", "depth_only"])]
        mprotect_only: bool,
        /// Only the workload untraced and under memleak, in each of these
        /// kernels (comma-separated; the test matrix's if none), booted
        /// with `vm`: the slowdown on each kernel's paths.
        #[arg(long, num_args = 0.., value_delimiter = ',', conflicts_with_all = ["serve_only", "save_only", "python_only", "depth_only", "mprotect_only"])]
        kernels: Option<Vec<String>>,
        /// Only the workload's overhead table, and its costs per
        /// malloc/free pair and per run from two workload sizes.
        #[arg(long, conflicts_with_all = ["serve_only", "save_only", "python_only", "depth_only", "mprotect_only", "kernels"])]
        overhead_only: bool,
        /// Only `memleak serve --watch`'s own CPU at 0, 100 and 1,000
        /// processes watched, and memleak's estimate of its probes' cost
        /// against the cost measured.
        #[arg(long, conflicts_with_all = ["serve_only", "save_only", "python_only", "depth_only", "mprotect_only", "kernels", "overhead_only"])]
        watch_only: bool,
        /// Inside a kernel's VM: the part `--kernels` runs there.
        #[arg(long, hide = true)]
        in_vm: bool,
    },
    /// Run the end-to-end set in other kernels, each booted with `vm`, as
    /// root: Debian's 5.10, 6.1 and 6.12 on x86-64, and the arm64 set,
    /// cross-built, in Debian's arm64 6.1 under emulation. `cargo xtask
    /// test` ends with it.
    Kernels {
        /// Only these kernels (a series such as 6.1, `newest`, or a .deb),
        /// of --arch, x86-64 if not given.
        kernels: Vec<String>,
        /// Only this architecture's kernels.
        #[arg(long, value_enum)]
        arch: Option<vm::Arch>,
    },
    /// Boot another Linux kernel (a Debian package, or a series such as
    /// 5.10, 6.1, 6.12, newest) under qemu with this machine's / and run
    /// a command in it as root: `cargo xtask vm 6.1 -- uname -r`.
    Vm(vm::Args),
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::Demo => demo(),
        Task::Test { test_args } => test(&test_args),
        Task::Dist { debug } => dist::run(if debug { dist::Profile::Test } else { dist::Profile::Release }),
        Task::Bench { in_vm: true, .. } => bench::in_vm(),
        Task::Bench { kernels: Some(kernels), .. } => bench::on_kernels(&kernels),
        Task::Bench {
            quick,
            serve_only,
            save_only,
            python_only,
            depth_only,
            mprotect_only,
            overhead_only,
            watch_only,
            ..
        } => {
            let part = match (serve_only, save_only, python_only, depth_only, mprotect_only, overhead_only) {
                _ if watch_only => bench::Part::Watch,
                (true, ..) => bench::Part::Serve,
                (_, true, ..) => bench::Part::Save,
                (_, _, true, ..) => bench::Part::Python,
                (_, _, _, true, ..) => bench::Part::Depth,
                (_, _, _, _, true, _) => bench::Part::Mprotect,
                (.., true) => bench::Part::Overhead,
                _ => bench::Part::All,
            };
            bench::run(quick, part)
        }
        Task::Docs { examples, check, fresh, names } => {
            docs::run(&docs::Options { examples, check, fresh, only: names })
        }
        Task::Kernels { kernels, arch } => {
            setup::run()?;
            require_root("the kernel tests")?;
            let jobs = kernel_tests::jobs(&kernels, arch);
            if jobs.iter().any(|job| job.arch == vm::Arch::Amd64) {
                install_missing_packages(&TEST_PACKAGES, "the tests")?;
                run(cargo().args(["build", "--package", "memleak"]))?;
            }
            kernel_tests::run(&jobs, &kernel_tests::build(&jobs)?)
        }
        Task::Vm(args) => vm::run(&args),
    }
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Runs a command, failing with its command line if it fails.
pub fn run(command: &mut Command) -> Result<()> {
    let status = command.status().with_context(|| format!("cannot run {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}

/// Cargo's variable naming `target`'s linker.
pub fn linker_variable(target: &str) -> String {
    format!("CARGO_TARGET_{}_LINKER", target.to_uppercase().replace('-', "_"))
}

pub fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    command.current_dir(root());
    if IN_BACKGROUND.get() {
        command.env("CARGO_TERM_QUIET", "true");
    }
    command
}

/// Has `command` start a session of its own, with no controlling
/// terminal, as a service starts whatever terminal xtask runs in:
/// `memleak serve` holds a newcomer at its execve only then.
pub fn as_a_service(command: &mut Command) -> &mut Command {
    // SAFETY: setsid is async-signal-safe, as pre_exec requires.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(command, || {
            if libc::setsid() < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        })
    }
}

pub fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} loads BPF programs: run it as root (sudo -E cargo xtask ...)");
    }
    Ok(())
}

/// Installs with apt-get whichever of `packages` dpkg does not have;
/// `purpose` says what for.
pub fn install_missing_packages(packages: &[&str], purpose: &str) -> Result<()> {
    let installed = |package: &&str| {
        Command::new("dpkg-query")
            .args(["-W", "-f=${Status}", package])
            .output()
            .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).contains("install ok installed"))
    };
    let missing: Vec<&str> = packages.iter().filter(|package| !installed(package)).copied().collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {} for {purpose}", missing.join(" "));
    apt_get(&["update"])?;
    apt_get(&[&["install", "-y", "--no-install-recommends"], missing.as_slice()].concat())
}

/// How long `apt_get` waits for another package manager's lock.
const APT_LOCK_WAIT: std::time::Duration = std::time::Duration::from_mins(15);

/// Runs apt-get with `args`, waiting while another apt or dpkg holds the
/// package manager's locks: cloud machines run apt at boot, and a fresh
/// machine's first test run failed on its lock.
fn apt_get(args: &[&str]) -> Result<()> {
    let started = std::time::Instant::now();
    loop {
        // dpkg's own lock is waited for by apt itself; the lists' lock
        // that `update` takes is not.
        let output = Command::new("apt-get")
            .args(["-o", &format!("DPkg::Lock::Timeout={}", APT_LOCK_WAIT.as_secs())])
            .args(args)
            .stdout(std::process::Stdio::inherit())
            .stderr(std::process::Stdio::piped())
            .output()
            .context("cannot run apt-get")?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        eprint!("{stderr}");
        if output.status.success() {
            return Ok(());
        }
        let locked = stderr.contains("Could not get lock") || stderr.contains("Unable to lock");
        if !locked || started.elapsed() > APT_LOCK_WAIT {
            bail!("apt-get {} failed with {}", args.join(" "), output.status);
        }
        eprintln!("xtask: another package manager holds apt's lock; waiting for it");
        std::thread::sleep(std::time::Duration::from_secs(10));
    }
}

/// Compiles a C fixture from tests/fixtures with debug info and frame
/// pointers, as a developer's debug build would have them.
pub fn build_fixture(name: &str) -> Result<PathBuf> {
    build_fixture_with(name, &["-O0"])
}

/// Compiles a C fixture with extra compiler flags.
pub fn build_fixture_with(name: &str, flags: &[&str]) -> Result<PathBuf> {
    compile_fixture(name, name, &["-g", "-fno-omit-frame-pointer", "-pthread"], flags)
}

/// Compiles a C fixture to target/fixtures/`output_name` with debug info
/// but without asking for frame pointers, as distributions' release builds
/// come: what unwinding by `.eh_frame` tables is for. `flags` should say
/// `-fomit-frame-pointer` rather than leave it to the optimisation level.
/// A separate helper rather than `build_fixture_with(.., ["-fomit-frame-pointer"])`,
/// which would only work because gcc's last flag wins.
pub fn build_fixture_without_frame_pointers(
    name: &str,
    output_name: &str,
    flags: &[&str],
) -> Result<PathBuf> {
    compile_fixture(name, output_name, &["-g", "-pthread"], flags)
}

/// `build_fixture_with` by another C compiler (musl-gcc, say), to
/// target/fixtures/`output_name`.
pub fn build_fixture_with_compiler(
    compiler: &str,
    name: &str,
    output_name: &str,
    flags: &[&str],
) -> Result<PathBuf> {
    compile(compiler, name, output_name, &["-g", "-fno-omit-frame-pointer", "-pthread"], flags)
}

fn compile_fixture(name: &str, output_name: &str, base_flags: &[&str], flags: &[&str]) -> Result<PathBuf> {
    compile("gcc", name, output_name, base_flags, flags)
}

fn compile(
    compiler: &str,
    name: &str,
    output_name: &str,
    base_flags: &[&str],
    flags: &[&str],
) -> Result<PathBuf> {
    let source = root().join("tests/fixtures").join(format!("{name}.c"));
    let output_dir = root().join("target/fixtures");
    std::fs::create_dir_all(&output_dir)?;
    let output = output_dir.join(output_name);
    run(Command::new(compiler).args(base_flags).args(flags).arg("-o").arg(&output).arg(&source))?;
    Ok(output)
}

fn demo() -> Result<()> {
    setup::run()?;
    require_root("the demo")?;
    run(cargo().args(["build", "--release", "--package", "memleak"]))?;
    let leaker = build_fixture("leaker")?;
    let memleak = root().join("target/release/memleak");
    let command = format!("{} demo --exit", leaker.display());
    println!("$ sudo memleak -c '{command}' 1");
    run(Command::new(memleak).args(["-c", &command, "1"]))
}

/// Debian packages the end-to-end tests use: compilers for the fixtures
/// (musl's too; objcopy comes with gcc's binutils), the allocators they
/// are run with, redis-server, nginx and memcached (stripped) as real programs, go tool pprof (with
/// graphviz for its -svg) to read memleak's profiles, bpftool to count
/// what memleak's maps hold without taking memleak's word for it,
/// Debian's python3 and a node to unwind real interpreters and JIT code,
/// prometheus for promtool, which checks `memleak serve`'s /metrics,
/// podman with runc to run real containers for `serve --container`
/// (crun cannot run them on a hybrid cgroup host), python3-venv for
/// the Python tools `install_python_tools` puts in a venv, and what the
/// tests of `cargo xtask dist`'s files use: file and readelf (binutils)
/// to see the binary is static, man-db to render the man pages, and
/// systemd for systemd-analyze, and strace, which slows memleak's
/// system calls down as a slow machine would. libc6-dbg names glibc's
/// local functions (`start_thread`) in the stacks the tests check; Debian's
/// arm64 cross compilers, with the arm64 glibc they bring, are what the unit
/// tests build arm64 unwind tables and thread layouts from, and what the
/// arm64 set's test binaries and fixtures are built with. tmux is the
/// terminal `memleak top` is driven and read in.
const TEST_PACKAGES: [&str; 29] = [
    "bpftool",
    "strace",
    "python3",
    "nodejs",
    "gcc",
    "g++",
    "libc6-dev",
    "libc6-dbg",
    "gcc-aarch64-linux-gnu",
    "g++-aarch64-linux-gnu",
    "musl-tools",
    "libjemalloc2",
    "libtcmalloc-minimal4",
    "libmimalloc2.0",
    "redis-server",
    "nginx",
    "memcached",
    "golang-go",
    "graphviz",
    "prometheus",
    "chromium",
    "podman",
    "runc",
    "python3-venv",
    "file",
    "binutils",
    "man-db",
    "systemd",
    "tmux",
];

/// Where the tests find kubernetes-validate, which checks contrib/k8s
/// against Kubernetes' schemas offline (they are bundled): a venv kept
/// under target/ across runs.
const KUBERNETES_VALIDATE_VENV: &str = "target/tools/kubernetes-validate";

/// The version pinned, whose schemas go up to Kubernetes 1.37.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

/// Installs the tools from `PyPI` the tests use, each in a venv of its own under
/// target/, unless it is there already.
fn install_python_tools() -> Result<()> {
    let venv = root().join(KUBERNETES_VALIDATE_VENV);
    if venv.join("bin/kubernetes-validate").exists() {
        return Ok(());
    }
    eprintln!("xtask: installing {KUBERNETES_VALIDATE} in {}", venv.display());
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", KUBERNETES_VALIDATE]))
}

fn test(test_args: &[String]) -> Result<()> {
    let mut clock = Clock::start();
    setup::run()?;
    require_root("the end-to-end tests")?;
    install_missing_packages(&TEST_PACKAGES, "the tests")?;
    // The other kernels after the host's tests, whose failures say more
    // and sooner; a filter given asks for those tests alone. What their
    // VMs boot is fetched meanwhile, and what they run is built beside
    // the host's tests.
    let kernel_jobs = if test_args.is_empty() { kernel_tests::jobs(&[], None) } else { Vec::new() };
    let fetching = (!kernel_jobs.is_empty()).then(|| {
        let jobs = kernel_jobs.clone();
        std::thread::spawn(move || kernel_tests::fetch(&jobs))
    });
    install_python_tools()?;
    clock.lap("tools");
    // The end-to-end tests run the memleak binary this builds, and
    // tests/tests/dist.rs what a release ships, built here in debug.
    run(cargo().args(["build", "--package", "memleak"]))?;
    dist::build(dist::Profile::Test)?;
    clock.lap("builds");
    lint()?;
    clock.lap("clippy");
    // The book, whose links must hold, and the examples cheap and
    // deterministic enough to make again on every run: a checked-in one
    // that memleak no longer prints fails here.
    docs::run(&docs::Options { examples: false, check: false, fresh: false, only: Vec::new() })?;
    let checked: Vec<String> = docs::CHECKED_BY_TEST.iter().map(|name| (*name).to_owned()).collect();
    docs::examples_in_docs(&checked, true, false)?;
    clock.lap("the book");
    let host_tests = || {
        let mut cargo = cargo();
        cargo.args(["test", "--workspace", "--exclude", "memleak-ebpf"]);
        cargo
    };
    run(host_tests().arg("--no-run"))?;
    let amd64 = kernel_tests::amd64_binaries(&kernel_jobs)?;
    let cross_building = fetching.map(|fetching| {
        let jobs = kernel_jobs.clone();
        std::thread::spawn(move || {
            fetching.join().map_err(|_| anyhow::anyhow!("fetching the kernels panicked"))??;
            in_background(|| kernel_tests::cross_build(&jobs))
        })
    });
    let tested = run(host_tests().arg("--").args(test_args));
    // Waited for even when the tests failed: no build is left running.
    let arm64 = cross_building.map(std::thread::JoinHandle::join);
    tested?;
    clock.lap("the host's tests");
    if let Some(arm64) = arm64 {
        let arm64 = arm64.map_err(|_| anyhow::anyhow!("the cross build panicked"))??;
        clock.lap("the rest of the cross build");
        kernel_tests::run(&kernel_jobs, &kernel_tests::Built { amd64, arm64 })?;
        clock.lap("the kernels");
    }
    Ok(())
}

/// Runs `work` on this thread at idle priority, its cargo runs quiet: a
/// build beside the host's tests, which leave half the CPUs idle (about
/// 130 s of CPU in 280 s of two CPUs' time), takes only what they leave
/// and writes no lines among theirs. A process or thread this thread
/// starts inherits its policy.
fn in_background<T>(work: impl FnOnce() -> T) -> T {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `param` only; pid 0 is this thread.
    // Failing, the build merely runs at the usual priority.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) } != 0 {
        eprintln!("xtask: cannot lower a build's priority: {}", std::io::Error::last_os_error());
    }
    IN_BACKGROUND.set(true);
    let done = work();
    IN_BACKGROUND.set(false);
    done
}

thread_local! {
    /// Whether this thread builds in the background: see `in_background`.
    static IN_BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Says on stderr how long each phase of `test` took, and the run so far:
/// CI's whole run must stay within 30 minutes.
struct Clock {
    started: std::time::Instant,
    lap: std::time::Instant,
}

impl Clock {
    fn start() -> Self {
        let now = std::time::Instant::now();
        Self { started: now, lap: now }
    }

    fn lap(&mut self, phase: &str) {
        eprintln!(
            "xtask: test: {phase} took {:.0} s ({:.0} s in all)",
            self.lap.elapsed().as_secs_f64(),
            self.started.elapsed().as_secs_f64()
        );
        self.lap = std::time::Instant::now();
    }
}

/// Clippy over every crate and target, the BPF crate's host build
/// included, with the workspace's lint table, then the BPF crate as built
/// for kernels before 5.17; any warning fails.
fn lint() -> Result<()> {
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    // The whole workspace again, all targets: memleak-ebpf alone, as a
    // host binary, has no panic handler (its test target links std's).
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        "memleak-ebpf/legacy-kernels",
        "--",
        "-D",
        "warnings",
    ]))
}
