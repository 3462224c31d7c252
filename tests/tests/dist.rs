//! What `cargo xtask dist` ships, as `cargo xtask test` builds it (debug,
//! under target/dist-test/): a static memleak that traces from a root
//! filesystem holding nothing else, its man pages and completions, a .deb
//! that installs, upgrades and goes away cleanly, and a --version that
//! names the commit and the BPF object.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use memleak_tests::{
    marker_line, memleak_binary, podman::Podman, run_ok, stacks_at, static_leaker, tempdir::TempDir,
    usage_at, workspace_root, Memleak,
};
use serde_json::Value;

/// target/dist-test/, which `cargo xtask test` fills before the tests.
fn dist() -> PathBuf {
    let directory = workspace_root().join("target/dist-test");
    assert!(
        directory.join("memleak").exists(),
        "{} has no memleak: `cargo xtask test` builds it",
        directory.display()
    );
    directory
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program).args(args).output().unwrap_or_else(|error| panic!("cannot run {program}: {error}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// --version

/// What build.rs watches to decide `-dirty`: the sources of the binary.
const BINARY_SOURCES: [&str; 5] = ["memleak", "memleak-ebpf", "memleak-common", "Cargo.toml", "Cargo.lock"];

/// The commit as --version should name it, asked of git here.
fn expected_commit() -> String {
    let root = workspace_root();
    let git = |args: &[&str]| {
        let output = Command::new("git").arg("-C").arg(&root).args(args).output().ok()?;
        output.status.success().then(|| text(&output.stdout).trim().to_owned())
    };
    let Some(hash) = git(&["rev-parse", "--short", "HEAD"]) else { return "unknown".to_owned() };
    let mut status = vec!["--no-optional-locks", "status", "--porcelain", "--untracked-files=no", "--"];
    status.extend(BINARY_SOURCES);
    let changes = git(&status).expect("git status");
    if changes.is_empty() {
        hash
    } else {
        format!("{hash}-dirty")
    }
}

/// The BPF objects embedded in an executable: ELF files for the BPF
/// machine (247) found in its bytes, each as long as its section header
/// table's end, where LLVM's writer puts it.
fn embedded_bpf_objects(executable: &[u8]) -> Vec<&[u8]> {
    let u16_at = |at: usize| u16::from_le_bytes([executable[at], executable[at + 1]]);
    let u64_at = |at: usize| u64::from_le_bytes(executable[at..at + 8].try_into().unwrap());
    let mut objects = Vec::new();
    for start in 1..executable.len().saturating_sub(64) {
        // The first byte alone first: this runs over 100 MB unoptimised.
        if executable[start] != 0x7f || executable[start + 1..start + 6] != *b"ELF\x02\x01" {
            continue;
        }
        if u16_at(start + 18) != 247 {
            continue;
        }
        let end = u64_at(start + 0x28) + u64::from(u16_at(start + 0x3c)) * u64::from(u16_at(start + 0x3a));
        objects.push(&executable[start..start + usize::try_from(end).unwrap()]);
    }
    objects
}

fn sha256(bytes: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let output = child.wait_with_output().unwrap();
    text(&output.stdout).split_whitespace().next().expect("sha256sum prints a hash").to_owned()
}

#[test]
fn version_names_the_commit_and_the_embedded_bpf_object() {
    let binary = memleak_binary();
    let version = text(&run_ok(&binary.display().to_string(), &["--version"]).stdout);
    let executable = std::fs::read(&binary).unwrap();
    let objects = embedded_bpf_objects(&executable);
    // The main object, then the one for kernels before 5.17: the version
    // names them by the SHA-256 of the two, one after the other.
    assert_eq!(objects.len(), 2, "two BPF objects in {}", binary.display());
    let expected = format!(
        "memleak {} (commit {}, bpf object sha256:{})\n",
        env!("CARGO_PKG_VERSION"),
        expected_commit(),
        sha256(&objects.concat())
    );
    assert_eq!(version, expected);
    // The static build is of the same sources: the same line.
    let static_version = text(&run_ok(&dist().join("memleak").display().to_string(), &["--version"]).stdout);
    assert_eq!(static_version, expected);
}

// The static binary

/// The static binary traces a static glibc leaker from a root holding
/// only the two of them, as it would from a scratch container image. It
/// sees the kernel through what is mounted there: a proc of its own, /sys
/// bound recursively (BTF in `/sys/kernel/btf`, the uprobe PMU in
/// `/sys/bus/event_source`, the cgroup v2 mount that -c makes its cgroup
/// in) and /dev/null, which -c's helper process has for its stdio.
/// Nothing else: no bpffs (memleak pins nothing). The mounts live in a
/// mount namespace that ends with the test.
#[test]
fn the_static_binary_traces_from_a_root_holding_only_itself_and_the_program() {
    let memleak = dist().join("memleak");
    assert!(text(&run_ok("file", &["--brief", &memleak.display().to_string()]).stdout).contains("static"));
    let headers = text(&run_ok("readelf", &["--program-headers", &memleak.display().to_string()]).stdout);
    assert!(!headers.contains("INTERP"), "no program interpreter: {headers}");
    let root = TempDir::new("memleak-static-root");
    std::fs::copy(&memleak, root.path().join("memleak")).unwrap();
    std::fs::copy(static_leaker(), root.path().join("leaker")).unwrap();
    for directory in ["proc", "sys", "dev"] {
        std::fs::create_dir(root.path().join(directory)).unwrap();
    }
    std::fs::write(root.path().join("dev/null"), b"").unwrap();
    let entries: Vec<String> = walk(root.path());
    assert_eq!(
        entries,
        ["dev/", "dev/null", "leaker", "memleak", "proc/", "sys/"],
        "the root holds only these, and places to mount"
    );
    let script = "set -e; root=$0; mount -t proc proc \"$root/proc\"; mount --rbind /sys \"$root/sys\"; \
                  mount --bind /dev/null \"$root/dev/null\"; exec chroot \"$root\" /memleak \"$@\"";
    let mut memleak = Memleak::spawn(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", script])
            .arg(root.path())
            .args(["-c", "/leaker all", "--format", "json", "-T", "1000", "3600"]),
    );
    memleak.stderr.wait_for("the leaker to finish", |line| line == "done");
    memleak.close_stdin();
    let said = memleak.stderr.rest();
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    // No warning: -c's cgroup and its helper (whose stdio is /dev/null)
    // work from there too.
    let unexpected: Vec<&String> = said
        .iter()
        .filter(|line| {
            !(*line == "done" || line.starts_with("memleak: tracing pid ") || line.ends_with(" exited"))
        })
        .collect();
    assert!(unexpected.is_empty(), "memleak said: {said:#?}");
    let report: &Value = reports.last().expect("a final report");
    // Each leak exactly; the totals also hold what static glibc allocates
    // for itself at start, which depends on the environment.
    for (function, marker, bytes, count) in memleak_tests::ALLOCATION_FUNCTION_LEAKS {
        assert_eq!(usage_at(report, function, marker), (bytes, count), "{function} in {report:#}");
    }
    let stack = &stacks_at(report, "leak_malloc", marker_line("leaker", "malloc"))[0];
    let functions: Vec<&str> = stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|frame| frame["function"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(functions[..3], ["leak_malloc", "all", "main"], "{stack:#}");
    assert_eq!(stack["frames"][0]["module"], "/leaker", "the program as the root names it: {stack:#}");
}

/// Paths under `root`, relative, folders with a trailing slash, sorted.
fn walk(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(directory) = pending.pop() {
        for entry in std::fs::read_dir(&directory).unwrap() {
            let path = entry.unwrap().path();
            let relative = path.strip_prefix(root).unwrap().display().to_string();
            if path.is_dir() {
                found.push(format!("{relative}/"));
                pending.push(path);
            } else {
                found.push(relative);
            }
        }
    }
    found.sort();
    found
}

// Man pages and completions

#[test]
fn man_pages_render_without_warnings() {
    let man = dist().join("man");
    let mut pages: Vec<String> = walk(&man);
    pages.sort();
    assert_eq!(
        pages,
        ["memleak-diff.1", "memleak-report.1", "memleak-serve.1", "memleak-top.1", "memleak.1"]
    );
    for page in &pages {
        let output = Command::new("man")
            .args(["--warnings", "-l"])
            .arg(man.join(page))
            .env("MANWIDTH", "80")
            .output()
            .expect("run man");
        let (rendered, warnings) = (text(&output.stdout), text(&output.stderr));
        assert!(output.status.success() && warnings.is_empty(), "man -l {page}: {warnings}");
        let name = page.trim_end_matches(".1");
        assert!(rendered.contains(&format!("{name}(1)")), "{page} is titled {name}(1):\n{rendered}");
    }
    let memleak = text(
        &Command::new("man")
            .arg("-l")
            .arg(man.join("memleak.1"))
            .env("MANWIDTH", "80")
            .output()
            .unwrap()
            .stdout,
    );
    assert!(memleak.contains("--max-stack-depth"), "the options are documented:\n{memleak}");
    // NAME is what --help starts with, the doc comment of cli::Args
    // (words only: man justifies the lines).
    let words = memleak.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(words.contains("NAME memleak - Trace outstanding allocations of processes"), "{memleak}");
    assert!(
        memleak.contains("\nEXAMPLES\n")
            && memleak.contains("\n         memleak -p 1234 -a 10 3      3 reports"),
        "the examples keep their lines:\n{memleak}"
    );
}

/// bash's completion of `memleak serve --na<Tab>`, as bash-completion would
/// ask it: the script sourced, then its function called with `COMP_WORDS`.
fn bash_completions(words: &[&str]) -> Vec<String> {
    let script = dist().join("completions/memleak.bash");
    let quoted: Vec<String> = words.iter().map(|word| format!("'{word}'")).collect();
    let program = format!(
        "source '{}'; COMP_WORDS=({}); COMP_CWORD={}; COMP_LINE=\"${{COMP_WORDS[*]}}\"; COMP_POINT=${{#COMP_LINE}}; \
         _memleak memleak \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        quoted.join(" "),
        words.len() - 1
    );
    let output = run_ok("bash", &["--norc", "--noprofile", "-c", &program]);
    text(&output.stdout).lines().filter(|line| !line.is_empty()).map(str::to_owned).collect()
}

#[test]
fn bash_completes_a_subcommand_s_flag() {
    assert_eq!(bash_completions(&["memleak", "serve", "--na"]), ["--namespace"]);
    assert_eq!(bash_completions(&["memleak", "di"]), ["diff"]);
    // The generator's own entry point is not offered.
    assert_eq!(bash_completions(&["memleak", "__"]), Vec::<String>::new());
}

#[test]
fn zsh_and_fish_completions_name_the_flags() {
    let completions = dist().join("completions");
    for file in ["_memleak", "memleak.fish"] {
        let script = std::fs::read_to_string(completions.join(file)).unwrap();
        assert!(script.contains("namespace"), "{file} offers serve's --namespace");
    }
}

// The Debian package

/// Purges the package when dropped, whatever the test did: the machine
/// is left as it was found, a failed test included.
struct Purge;

impl Drop for Purge {
    fn drop(&mut self) {
        if !absent(&package_status()) {
            let _ = Command::new("dpkg").args(["--purge", "memleak"]).stdout(Stdio::null()).status();
        }
    }
}

fn package_status() -> String {
    text(&run("dpkg-query", &["--show", "--showformat=${Status}", "memleak"]).stdout)
}

/// Unknown to dpkg, or known only as once purged.
fn absent(status: &str) -> bool {
    status.is_empty() || status.ends_with(" not-installed")
}

fn apt_get(args: &[&str]) {
    let mut all = vec!["-y", "-q", "-o", "Dpkg::Use-Pty=0"];
    all.extend_from_slice(args);
    let output = Command::new("apt-get")
        .args(&all)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .expect("run apt-get");
    assert!(output.status.success(), "apt-get {args:?}: {}{}", text(&output.stdout), text(&output.stderr));
}

/// The files (not folders) dpkg lists for the installed package.
fn installed_files() -> Vec<PathBuf> {
    text(&run_ok("dpkg", &["--listfiles", "memleak"]).stdout)
        .lines()
        .map(PathBuf::from)
        .filter(|path| path.is_file())
        .collect()
}

/// The package built anew with a higher version, as the next release
/// would be: what upgrades over the installed one.
fn next_version(deb: &Path, scratch: &Path) -> PathBuf {
    let tree = scratch.join("tree");
    run_ok("dpkg-deb", &["--raw-extract", &deb.display().to_string(), &tree.display().to_string()]);
    let control = tree.join("DEBIAN/control");
    let fields = std::fs::read_to_string(&control).unwrap();
    let version = fields.lines().find_map(|line| line.strip_prefix("Version: ")).unwrap().to_owned();
    std::fs::write(
        &control,
        fields.replace(&format!("Version: {version}\n"), &format!("Version: {version}+1\n")),
    )
    .unwrap();
    let next = scratch.join("memleak_next_amd64.deb");
    run_ok(
        "dpkg-deb",
        &[
            "-Zgzip",
            "-z1",
            "--root-owner-group",
            "--build",
            &tree.display().to_string(),
            &next.display().to_string(),
        ],
    );
    next
}

#[test]
fn the_deb_installs_upgrades_and_removes_cleanly() {
    let _root = memleak_binary();
    let status = package_status();
    assert!(
        absent(&status),
        "a memleak package is on this machine already ({status}): the test would replace it"
    );
    let deb = std::fs::read_dir(dist())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|extension| extension == "deb"))
        .expect("a .deb in target/dist-test");
    let _purge = Purge;
    apt_get(&["install", &deb.display().to_string()]);
    assert_eq!(package_status(), "install ok installed");

    let version = text(&run_ok("/usr/bin/memleak", &["--version"]).stdout);
    assert_eq!(version, text(&run_ok(&dist().join("memleak").display().to_string(), &["--version"]).stdout));
    for page in ["memleak", "memleak-serve", "memleak-report", "memleak-diff", "memleak-top"] {
        let output = Command::new("man").args(["--warnings", page]).env("MANWIDTH", "80").output().unwrap();
        assert!(output.status.success() && output.stderr.is_empty(), "man {page}: {}", text(&output.stderr));
        assert!(text(&output.stdout).contains(&format!("{page}(1)")), "man {page}");
    }
    let unit = "/lib/systemd/system/memleak-serve.service";
    assert!(std::fs::read_to_string(unit).unwrap().contains("\nExecStart=/usr/bin/memleak serve "));
    let verified = run("systemd-analyze", &["verify", unit]);
    assert!(verified.status.success() && verified.stderr.is_empty(), "{}", text(&verified.stderr));
    let files = installed_files();
    for expected in [
        "/usr/bin/memleak",
        "/usr/share/man/man1/memleak.1.gz",
        "/usr/share/man/man1/memleak-serve.1.gz",
        "/usr/share/bash-completion/completions/memleak",
        "/usr/share/zsh/vendor-completions/_memleak",
        "/usr/share/fish/vendor_completions.d/memleak.fish",
        "/usr/share/doc/memleak/contrib/prometheus.yml",
        "/usr/share/doc/memleak/contrib/k8s/daemonset.yaml",
        "/usr/share/doc/memleak/copyright",
        "/etc/memleak/serve.env",
        unit,
    ] {
        assert!(files.contains(&PathBuf::from(expected)), "{expected} in {files:#?}");
    }

    // The same package again, then the next version, over it: the
    // configuration as the user left it stays.
    apt_get(&["install", "--reinstall", &deb.display().to_string()]);
    let configured = "MEMLEAK_SERVE_ARGS=--exe nginx\n";
    std::fs::write("/etc/memleak/serve.env", configured).unwrap();
    let scratch = TempDir::new("memleak-deb");
    apt_get(&["install", &next_version(&deb, scratch.path()).display().to_string()]);
    assert_eq!(package_status(), "install ok installed");
    let upgraded = text(&run_ok("dpkg-query", &["--show", "--showformat=${Version}", "memleak"]).stdout);
    assert!(upgraded.ends_with("+1"), "upgraded to {upgraded}");
    assert_eq!(std::fs::read_to_string("/etc/memleak/serve.env").unwrap(), configured);
    assert_eq!(installed_files(), files, "the upgrade installs the same files");

    apt_get(&["remove", "memleak"]);
    assert_eq!(package_status(), "deinstall ok config-files");
    let left: Vec<&PathBuf> = files.iter().filter(|file| file.exists()).collect();
    assert_eq!(left, [Path::new("/etc/memleak/serve.env")], "only the configuration is left");
    run_ok("dpkg", &["--purge", "memleak"]);
    assert!(!Path::new("/etc/memleak").exists(), "purged, /etc/memleak goes too");
    assert!(absent(&package_status()), "purged: {}", package_status());
}

// The DaemonSet's image

/// contrib/k8s/Containerfile, built from what dist ships: memleak alone,
/// run with the args it is given, as the daemon set gives it `serve ...`.
#[test]
fn the_daemon_sets_image_runs_memleak_with_the_args_it_is_given() {
    let podman =
        Podman::with_built_image("daemonset", &workspace_root().join("contrib/k8s/Containerfile"), &dist());
    let in_image = podman.run_image(&["--version"]);
    assert!(in_image.status.success(), "{}", text(&in_image.stderr));
    let shipped = run(dist().join("memleak").to_str().unwrap(), &["--version"]);
    assert_eq!(text(&in_image.stdout), text(&shipped.stdout));
    assert!(text(&shipped.stdout).starts_with("memleak "), "{}", text(&shipped.stdout));
}
