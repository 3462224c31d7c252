//! `cargo xtask vm KERNEL -- COMMAND`: boots another Linux kernel under
//! qemu and runs one command in it as root. memleak's BPF programs meet
//! each kernel's verifier and helpers, and what loads on the host's kernel
//! may be refused by the older ones fleets run (Debian's 5.10, 6.1, 6.12):
//! this is how to see it without such a machine.
//!
//! Inside, `/` is this machine's, shared read-only over virtio-9p under a
//! tmpfs overlay, so the host's programs and files (memleak's build
//! included) are at their usual paths; writes stay in the VM but for the
//! directories shared read-write (`--rw`). The kernels are Debian's
//! packages, unpacked under target/vm/ (kernels.rs), booted with an
//! initramfs made here (initramfs.rs). Where the host's KVM cannot run a
//! distribution kernel (no `kvm_intel` or `kvm_amd`: a PVM sandbox), qemu
//! emulates (TCG): slower, but the command starts in seconds.
//!
//! An arm64 kernel (`--arch arm64`) boots under qemu-system-aarch64, always
//! emulated, on a root of Debian's own arm64 packages unpacked under
//! target/vm/arm64/ (`arm64_root.rs`) rather than this machine's `/`, with
//! the workspace shared read-only at its own path.

mod apt;
mod arm64_root;
mod initramfs;
mod kernels;

use std::{
    fmt::Display,
    fs,
    io::{Read as _, Write as _},
    os::unix::io::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

pub use kernels::{resolve_kernel, resolve_kernel_for, Kernel};

/// The exit status when the VM ran past its time, as timeout(1) has it.
pub const TIMED_OUT: i32 = 124;

/// The exit status when the command never ran to its end (no boot, a
/// panic) or the harness failed: `git bisect run` takes it as "cannot
/// test this one".
pub const NEVER_RAN: i32 = 125;

/// How many of the console's last lines are shown when the command did
/// not run to its end.
const CONSOLE_LINES: usize = 40;

/// How often the run directory's files are looked at.
const POLL: Duration = Duration::from_millis(100);

/// Whether the harness says what it does on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verbosity {
    #[default]
    Normal,
    Quiet,
}

impl Verbosity {
    fn say(self, message: impl Display) {
        if self == Self::Normal {
            eprintln!("xtask: vm: {message}");
        }
    }
}

/// The architecture of the kernel booted, and so of the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    /// x86-64, as this machine: the VM's `/` is this machine's.
    Amd64,
    /// Emulated, on a root of Debian's arm64 packages.
    Arm64,
}

impl Arch {
    /// The name Debian gives it, in package names and `Architecture:`.
    pub fn debian_name(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// Rust's static target for it: musl's libc linked in, which Rust's
    /// toolchain carries itself (no musl-gcc needed to link memleak).
    pub const fn musl_target(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64-unknown-linux-musl",
            Self::Arm64 => "aarch64-unknown-linux-musl",
        }
    }

    fn qemu(self) -> &'static str {
        match self {
            Self::Amd64 => "qemu-system-x86_64",
            Self::Arm64 => "qemu-system-aarch64",
        }
    }

    /// The serial port the kernel's console is on.
    fn console(self) -> &'static str {
        match self {
            Self::Amd64 => "ttyS0",
            Self::Arm64 => "ttyAMA0",
        }
    }
}

/// How qemu runs the guest's CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Accel {
    /// KVM where the host's can run any kernel (`kvm_intel` or `kvm_amd`
    /// loaded, /dev/kvm writable), else TCG.
    #[default]
    Auto,
    /// Hardware virtualisation.
    Kvm,
    /// qemu's emulation, multi-threaded.
    Tcg,
}

/// A directory of this machine's that the VM sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    pub host: PathBuf,
    /// Where the VM sees it.
    pub guest: PathBuf,
    pub writable: bool,
}

impl Share {
    /// `dir`, read-write, at its own path.
    pub fn read_write(dir: PathBuf) -> Self {
        Self { guest: dir.clone(), host: dir, writable: true }
    }
}

/// How the VM is made and how long it may run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmOptions {
    pub cpus: u32,
    /// As qemu's -m takes it: 2G, 512M.
    pub memory: String,
    /// For the whole VM, boot included.
    pub timeout: Duration,
    /// Directories shared, mounted in this order (a share may go over a
    /// directory of one before it).
    pub shares: Vec<Share>,
    pub accel: Accel,
    /// More kernel command-line arguments.
    pub append: String,
    /// Keep the run directory (console log, dmesg, the command's output)
    /// and say where it is.
    pub keep: bool,
    /// Where the command's output goes as it comes: this file, else
    /// xtask's own stdout and stderr.
    pub output: Option<PathBuf>,
    pub verbosity: Verbosity,
}

impl Default for VmOptions {
    fn default() -> Self {
        Self {
            cpus: 2,
            memory: "2G".to_owned(),
            timeout: Duration::from_mins(15),
            shares: Vec::new(),
            accel: Accel::Auto,
            append: String::new(),
            keep: false,
            output: None,
            verbosity: Verbosity::Normal,
        }
    }
}

impl VmOptions {
    /// These options with the workspace's target/ shared read-write, where
    /// a test in the VM can leave what the host should see.
    #[must_use]
    pub fn sharing_target(mut self) -> Self {
        self.shares.push(Share::read_write(crate::root().join("target")));
        self
    }
}

/// What `cargo xtask vm --help` ends with.
const HELP_AFTER: &str = "\
COMMAND runs with bash as root in the VM, in the current directory, with stdin from /dev/null; \
its output comes back as it is written. / is this machine's, read-only under a tmpfs overlay: \
writes stay in the VM but under --rw directories. proc, sysfs, devtmpfs, cgroup2, debugfs, \
tracefs, bpffs and securityfs are mounted, and the kernel's modules are at /lib/modules/$(uname -r).

Exit status: the command's; 124 when the VM ran past --timeout; 125 when it never ran the command \
(no boot, a panic: the console's last lines are printed) or the harness failed.

With --arch arm64, / is a root of Debian bookworm's arm64 packages (bash, coreutils, python3.11, \
the C and C++ runtimes, promtool) made under target/vm/arm64/, and the workspace is shared \
read-only at its own path; the CPU (a Cortex-A72) is always emulated.

Kernels, busybox, initramfs images and run directories are kept under target/vm/.";

/// `cargo xtask vm`'s command line.
#[derive(clap::Args, Debug)]
#[command(after_long_help = HELP_AFTER)]
pub struct Args {
    /// A linux-image-*.deb (A.deb,B.deb,C.deb for a kernel split in
    /// parts, as Debian's 7.x), a directory holding one unpacked, a
    /// package name, or a series fetched from Debian: 5.10, 6.1, 6.12,
    /// ... or newest.
    kernel: String,
    /// The kernel's architecture.
    #[arg(long, value_enum, default_value_t = Arch::Amd64)]
    arch: Arch,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    cpus: u32,
    /// Memory, as qemu's -m takes it.
    #[arg(long, default_value = "2G", value_name = "SIZE")]
    mem: String,
    /// Wall-clock limit for the whole VM, boot included.
    #[arg(long, default_value_t = 900, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    timeout: u64,
    /// Also share DIR read-write, at the same path (repeatable).
    #[arg(long = "rw", value_name = "DIR")]
    read_write: Vec<PathBuf>,
    /// Share the workspace's target/ read-write.
    #[arg(long)]
    rw_target: bool,
    /// How qemu runs the guest.
    #[arg(long, value_enum, default_value_t = Accel::Auto)]
    accel: Accel,
    /// More kernel command-line arguments.
    #[arg(long, default_value = "", value_name = "ARGS", allow_hyphen_values = true)]
    append: String,
    /// Keep the run directory (console log, dmesg, output) and say where.
    #[arg(long)]
    keep: bool,
    /// No messages of the harness's own on stderr.
    #[arg(short)]
    quiet: bool,
    /// Run by bash, its words joined by spaces.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// `cargo xtask vm`: exits with the command's status.
pub fn run(args: &Args) -> ! {
    let status = match run_cli(args) {
        Ok(status) => status,
        Err(error) => {
            eprintln!("xtask: vm: error: {error:#}");
            NEVER_RAN
        }
    };
    std::process::exit(status)
}

fn run_cli(args: &Args) -> Result<i32> {
    let verbosity = if args.quiet { Verbosity::Quiet } else { Verbosity::Normal };
    let kernel = resolve_kernel_for(&args.kernel, args.arch, verbosity)?;
    let mut options = VmOptions {
        cpus: args.cpus,
        memory: args.mem.clone(),
        timeout: Duration::from_secs(args.timeout),
        shares: args.read_write.iter().cloned().map(Share::read_write).collect(),
        accel: args.accel,
        append: args.append.clone(),
        keep: args.keep,
        output: None,
        verbosity,
    };
    if args.rw_target {
        options = options.sharing_target();
    }
    run_in_vm(&kernel, &options, &args.command.join(" "))
}

/// Runs `command` with bash as root in a VM booted from `kernel`, in the
/// current directory, its output passed on as it comes, and returns its
/// exit status: `TIMED_OUT` when the VM ran past `options.timeout`,
/// `NEVER_RAN` when the command did not run to its end (the console's last
/// lines are printed). An error is the harness's own failure.
pub fn run_in_vm(kernel: &Kernel, options: &VmOptions, command: &str) -> Result<i32> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the VM shares this machine's / and its initramfs has device files: \
             run as root (sudo -E cargo xtask vm ...)"
        );
    }
    install_host_tools(kernel.arch)?;
    let (accel, accel_arguments) = accel_arguments(options.accel, kernel.arch)?;
    let (initrd, root) = {
        let _lock = lock_cache()?;
        let host_busybox = kernels::busybox(Arch::Amd64, options.verbosity)?;
        let guest_busybox = kernels::busybox(kernel.arch, options.verbosity)?;
        let root = match kernel.arch {
            Arch::Amd64 => PathBuf::from("/"),
            Arch::Arm64 => arm64_root::build(options.verbosity)?,
        };
        (initramfs::build(kernel, &guest_busybox, &host_busybox, options.verbosity)?, root)
    };
    let mut shares = options.shares.clone();
    if kernel.arch == Arch::Arm64 {
        // Its root is not this machine's: the workspace (memleak's
        // builds, the tests and their fixtures) is shared, before the
        // shares asked for, which may go over parts of it.
        let workspace = crate::root();
        shares.insert(0, Share { host: workspace.clone(), guest: workspace, writable: false });
    }
    for share in &mut shares {
        share.host =
            share.host.canonicalize().with_context(|| format!("cannot share {}", share.host.display()))?;
    }
    let run = RunDir::create(&kernel.release, options)?;
    run.prepare(kernel, command, &shares)?;
    let mut qemu = Command::new(kernel.arch.qemu());
    qemu.args(["-nodefaults", "-no-user-config"])
        .args(accel_arguments)
        .args(["-smp", &options.cpus.to_string(), "-m", &options.memory])
        .args(["-display", "none", "-no-reboot", "-monitor", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(format!(
            "console={} panic=-1 loglevel=4 random.trust_cpu=on xtask.vm_run={} {}",
            kernel.arch.console(),
            run.path.display(),
            options.append
        ))
        .arg("-serial")
        .arg(format!("file:{}", run.path.join("console.log").display()))
        .args(qemu_shares(&root, &run.path, &shares));
    let package = match (&kernel.package, &kernel.package_version) {
        (Some(package), Some(version)) => format!("{package} {version}; "),
        _ => String::new(),
    };
    options.verbosity.say(format!(
        "booting {} ({package}{accel}, {} vCPU, {})",
        kernel.release, options.cpus, options.memory
    ));
    let outcome = boot(qemu, &run.path, options.timeout, options.output.as_deref())?;
    Ok(outcome.report(&kernel.release, &run.path, options))
}

/// qemu's -virtfs arguments sharing the VM's root (read-only), the run
/// directory and the other shares, whose mount tags stage2.sh knows:
/// hostroot, vmrun, share0, share1...
fn qemu_shares(root: &Path, run: &Path, shares: &[Share]) -> Vec<String> {
    let mut tagged = vec![("hostroot".to_owned(), root, false), ("vmrun".to_owned(), run, true)];
    tagged.extend(
        shares
            .iter()
            .enumerate()
            .map(|(index, share)| (format!("share{index}"), share.host.as_path(), share.writable)),
    );
    tagged
        .into_iter()
        .flat_map(|(tag, dir, writable)| {
            // qemu's options take a comma written twice as a comma.
            let dir = dir.display().to_string().replace(',', ",,");
            let read_only = if writable { "" } else { ",readonly=on" };
            [
                "-virtfs".to_owned(),
                format!("local,path={dir},mount_tag={tag},security_model=none,multidevs=remap{read_only}"),
            ]
        })
        .collect()
}

/// The Debian packages the VMs of `arch` take: qemu, dpkg-deb to unpack
/// kernels, xz and zstd for their modules, Debian's keys for the private
/// apt configuration's lists; for arm64, mmdebstrap to make its root.
pub fn install_host_tools(arch: Arch) -> Result<()> {
    let mut packages = vec!["dpkg", "xz-utils", "zstd", "debian-archive-keyring"];
    match arch {
        Arch::Amd64 => packages.push("qemu-system-x86"),
        Arch::Arm64 => packages.extend(["qemu-system-arm", "mmdebstrap"]),
    }
    crate::install_missing_packages(&packages, "the kernel VMs")
}

/// Fetches what a VM of `arch` boots besides its kernel, booting none:
/// the host tools, busybox for the initramfs and, for arm64, its root.
pub fn fetch_for(arch: Arch, verbosity: Verbosity) -> Result<()> {
    install_host_tools(arch)?;
    let _lock = lock_cache()?;
    kernels::busybox(Arch::Amd64, verbosity)?;
    kernels::busybox(arch, verbosity)?;
    if arch == Arch::Arm64 {
        arm64_root::build(verbosity)?;
    }
    Ok(())
}

/// Holds target/vm/ for this process until dropped, so runs at once do
/// not fetch, unpack or make the same files together.
fn lock_cache() -> Result<fs::File> {
    let dir = kernels::cache_dir();
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join("lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the descriptor is the open file's; flock has no other
    // preconditions.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!("cannot lock {}: {}", path.display(), std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Which accelerator to use, and qemu's arguments for it.
fn accel_arguments(accel: Accel, arch: Arch) -> Result<(&'static str, Vec<&'static str>)> {
    if arch == Arch::Arm64 {
        if accel == Accel::Kvm {
            bail!("--accel kvm: an arm64 kernel is emulated on this machine");
        }
        // -cpu max emulates pointer authentication and SVE too, and ran
        // the same commands about twice as slowly.
        return Ok(("tcg", vec!["-accel", "tcg,thread=multi", "-cpu", "cortex-a72", "-machine", "virt"]));
    }
    let kvm_writable = || fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok();
    // kvm_pvm, the KVM of some sandboxes, only runs kernels made for it:
    // a distribution kernel never gets past its decompressor there.
    let kvm_runs_any_kernel =
        || Path::new("/sys/module/kvm_intel").exists() || Path::new("/sys/module/kvm_amd").exists();
    let kvm = match accel {
        Accel::Auto => kvm_writable() && kvm_runs_any_kernel(),
        Accel::Kvm if kvm_writable() => true,
        Accel::Kvm => bail!("--accel kvm: /dev/kvm is missing or not writable"),
        Accel::Tcg => false,
    };
    Ok(if kvm {
        ("kvm", vec!["-enable-kvm", "-cpu", "host", "-machine", "q35,accel=kvm"])
    } else {
        ("tcg", vec!["-accel", "tcg,thread=multi", "-cpu", "max", "-machine", "q35"])
    })
}

/// The run's directory under target/vm/runs/, shared read-write with the
/// VM at the same path: the command, where to run it, its output and
/// status, the console log. Removed when dropped unless kept.
struct RunDir {
    path: PathBuf,
    keep: bool,
}

impl RunDir {
    fn create(release: &str, options: &VmOptions) -> Result<Self> {
        let runs = kernels::cache_dir().join("runs");
        fs::create_dir_all(&runs).with_context(|| format!("cannot create {}", runs.display()))?;
        // Its path goes on the kernel command line, split at spaces.
        if runs.to_string_lossy().contains(char::is_whitespace) {
            bail!("{} has a space in its path: the VM could not be told where it is", runs.display());
        }
        for attempt in 0..1000 {
            let path = runs.join(format!("{release}.{}.{attempt}", std::process::id()));
            match fs::create_dir(&path) {
                Ok(()) => return Ok(Self { path, keep: options.keep }),
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(error) => return Err(error).with_context(|| format!("cannot create {}", path.display())),
            }
        }
        bail!("cannot make a run directory in {}", runs.display())
    }

    /// The files stage2.sh reads: the command, the directory to run it
    /// in, the modules directory, the shares (share.N: `rw` or `ro`, and
    /// where it goes); and the empty output files the host follows.
    fn prepare(&self, kernel: &Kernel, command: &str, shares: &[Share]) -> Result<()> {
        let cwd = std::env::current_dir().context("no current directory")?;
        let mut files = vec![
            ("command".to_owned(), format!("{command}\n")),
            ("cwd".to_owned(), format!("{}\n", cwd.display())),
            ("moddir".to_owned(), format!("{}\n", kernel.modules.display())),
            ("stdout".to_owned(), String::new()),
            ("stderr".to_owned(), String::new()),
        ];
        for (index, share) in shares.iter().enumerate() {
            let guest = share.guest.display().to_string();
            if guest.contains(char::is_whitespace) {
                bail!("{guest} has a space in its path: stage2.sh could not read where it goes");
            }
            let mode = if share.writable { "rw" } else { "ro" };
            files.push((format!("share.{index}"), format!("{mode} {guest}\n")));
        }
        for (name, contents) in files {
            let path = self.path.join(name);
            fs::write(&path, contents).with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if self.keep {
            // Asked for, so said even with -q.
            eprintln!("xtask: vm: run directory kept: {}", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// qemu, killed if still running when dropped (an error, a panic).
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// How a VM's run went.
struct Outcome {
    timed_out: bool,
    /// When the command started, after qemu did: None if it never did.
    command_started: Option<Duration>,
    wall: Duration,
}

/// Runs qemu until it stops or `timeout` passes, passing the command's
/// output on as the VM writes it, to `output` if given.
fn boot(mut qemu: Command, run: &Path, timeout: Duration, output: Option<&Path>) -> Result<Outcome> {
    let log_path = run.join("qemu.log");
    let log = fs::File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let started = Instant::now();
    let program = qemu.get_program().to_string_lossy().into_owned();
    let mut qemu = Qemu(
        qemu.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {program}"))?,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (to_stdout, to_stderr): (Box<dyn std::io::Write + Send>, Box<dyn std::io::Write + Send>) =
        match output {
            Some(path) => {
                let file =
                    fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
                (Box::new(file.try_clone()?), Box::new(file))
            }
            None => (Box::new(std::io::stdout()), Box::new(std::io::stderr())),
        };
    let followers = [
        follow(run.join("stdout"), to_stdout, Arc::clone(&stop)),
        follow(run.join("stderr"), to_stderr, Arc::clone(&stop)),
    ];
    let mut command_started = None;
    let mut timed_out = false;
    let waited = loop {
        match qemu.0.try_wait() {
            Ok(None) => {}
            Ok(Some(_)) => break Ok(()),
            Err(error) => break Err(error).context("cannot wait for qemu"),
        }
        if command_started.is_none() && run.join("booted").exists() {
            command_started = Some(started.elapsed());
        }
        if started.elapsed() >= timeout {
            timed_out = true;
            break Ok(());
        }
        thread::sleep(POLL);
    };
    drop(qemu);
    stop.store(true, Ordering::Release);
    for follower in followers {
        let _ = follower.join();
    }
    waited?;
    Ok(Outcome { timed_out, command_started, wall: started.elapsed() })
}

/// A thread copying what is appended to `path` to `output` until `stop`
/// is set and all of it is copied: `tail -f`.
fn follow(
    path: PathBuf,
    mut output: Box<dyn std::io::Write + Send>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let Ok(mut file) = fs::File::open(&path) else { return };
        let mut buffer = vec![0; 64 * 1024];
        loop {
            // Read before the last copy, so nothing written before qemu
            // stopped is left.
            let stopping = stop.load(Ordering::Acquire);
            while let Ok(count) = file.read(&mut buffer) {
                if count == 0 {
                    break;
                }
                // A reader gone (`| head`) must not stop the VM.
                let _ = output.write_all(&buffer[..count]);
                let _ = output.flush();
            }
            if stopping {
                return;
            }
            thread::sleep(POLL);
        }
    })
}

impl Outcome {
    /// Says how long it took and, if the command did not run to its end,
    /// why; returns the exit status to pass on.
    fn report(&self, release: &str, run: &Path, options: &VmOptions) -> i32 {
        let read = |name: &str| fs::read_to_string(run.join(name)).ok().map(|text| text.trim().to_owned());
        // Kernel uptimes, written by stage2.sh.
        let timing = match (self.command_started, read("booted"), read("ended")) {
            (None, ..) => "the command never started".to_owned(),
            (Some(started), booted, ended) => format!(
                "the command started {:.1} s after qemu did ({} s of kernel uptime) and {}",
                started.as_secs_f64(),
                booted.as_deref().unwrap_or("?"),
                ended.map_or_else(
                    || "did not end".to_owned(),
                    |ended| format!("ended at {ended} s of uptime")
                )
            ),
        };
        options.verbosity.say(format!("{release}: {timing}; {:.1} s in all", self.wall.as_secs_f64()));
        if self.timed_out {
            eprintln!(
                "xtask: vm: timed out after {} s; the console's last lines:",
                options.timeout.as_secs()
            );
            print_console_tail(run);
            return TIMED_OUT;
        }
        let status = read("rc").and_then(|rc| rc.parse().ok());
        if let Some(status) = status {
            return status;
        }
        let qemu_said = fs::read_to_string(run.join("qemu.log")).unwrap_or_default();
        let qemu_said = qemu_said.split_whitespace().collect::<Vec<_>>().join(" ");
        if qemu_said.is_empty() {
            eprintln!("xtask: vm: the command did not run to its end; the console's last lines:");
        } else {
            eprintln!("xtask: vm: the command did not run to its end (qemu said: {qemu_said}); the console's last lines:");
        }
        print_console_tail(run);
        NEVER_RAN
    }
}

fn print_console_tail(run: &Path) {
    let console = fs::read(run.join("console.log")).unwrap_or_default();
    let console = String::from_utf8_lossy(&console).replace('\r', "");
    let lines: Vec<&str> = console.lines().collect();
    if lines.is_empty() {
        eprintln!("(none: the kernel printed nothing at loglevel 4)");
    }
    for line in &lines[lines.len().saturating_sub(CONSOLE_LINES)..] {
        eprintln!("{line}");
    }
}
