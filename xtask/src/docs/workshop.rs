//! What the examples run with: a scratch directory, the fixtures built
//! into it, memleak, programs started and talked to, and transcripts of
//! what a terminal would show.
//!
//! Everything runs in `/tmp/memleak-readme`, made afresh for each run,
//! so that paths in the output are the same from any checkout: the
//! fixtures are built there, with their sources' directory mapped to `.`
//! in their debug information (`./tests/fixtures/leaker.c`), which makes
//! their binaries, build ids included, the same from any checkout too.

use std::{
    fs,
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    net::TcpListener,
    os::{fd::AsRawFd as _, unix::fs::PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use super::{Example, Made, Unavailable};
use crate::root;

/// Where the examples run. Fixed, for the paths in the output not to
/// change from run to run.
pub const DIRECTORY: &str = "/tmp/memleak-readme";

/// How long any one wait may take: a guard against hangs.
const PATIENCE: Duration = Duration::from_mins(1);

pub struct Workshop {
    memleak: PathBuf,
    dir: PathBuf,
    /// Held for the run: two runs at once would share the directory.
    _lock: fs::File,
}

impl Workshop {
    pub fn new(memleak: &Path) -> Result<Self> {
        let lock = fs::File::create(format!("{DIRECTORY}.lock")).context("cannot make the lock file")?;
        // SAFETY: flock on a descriptor the File keeps open.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            bail!("another `cargo xtask readme` runs: {DIRECTORY}.lock is held");
        }
        let dir = PathBuf::from(DIRECTORY);
        unmount_below(&dir);
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("cannot empty {DIRECTORY}"))?;
        }
        fs::create_dir_all(&dir)?;
        // nobody runs memleak from here too (the privileges example).
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
        Ok(Self { memleak: memleak.to_path_buf(), dir, _lock: lock })
    }

    /// Makes `example`'s text.
    pub fn make(&mut self, example: &Example) -> Result<Made> {
        (example.make)(self)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn memleak_path(&self) -> &Path {
        &self.memleak
    }

    /// memleak with `args`, run in the scratch directory.
    pub fn memleak(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.memleak);
        command.args(args).current_dir(&self.dir);
        command
    }

    /// A command run in the scratch directory.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new(program);
        command.current_dir(&self.dir);
        command
    }

    /// Builds tests/fixtures/NAME.c (or .cpp) into the scratch directory
    /// as the tests build it: unoptimised, with frame pointers.
    pub fn fixture(&self, name: &str) -> Result<PathBuf> {
        self.compile(name, name, &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"])
    }

    /// As a release build: -O2, no frame pointers, with line information.
    pub fn optimized(&self, name: &str) -> Result<PathBuf> {
        self.compile(name, name, &["-g", "-O2", "-fomit-frame-pointer", "-pthread"])
    }

    /// As `optimized`, linked with `library` (a path: Debian ships no
    /// development link for the allocators), as `g++ ... -ltcmalloc`
    /// would; built as NAME-LIBRARY.
    pub fn optimized_linked(&self, name: &str, library: &Path) -> Result<PathBuf> {
        let stem = library.file_name().and_then(|file| file.to_str()).unwrap_or("library");
        let stem = stem.split('.').next().unwrap_or(stem);
        let library = library.to_str().context("a library path in UTF-8")?;
        let flags = ["-g", "-O2", "-fomit-frame-pointer", "-pthread"];
        self.compile_linked(name, &format!("{name}-{stem}"), &flags, &[library])
    }

    fn compile(&self, name: &str, output: &str, flags: &[&str]) -> Result<PathBuf> {
        self.compile_linked(name, output, flags, &[])
    }

    /// Compiles NAME with `flags`, linked with `libraries`, which come
    /// after the source: the linker keeps only what the objects before
    /// a library need of it.
    fn compile_linked(
        &self,
        name: &str,
        output: &str,
        flags: &[&str],
        libraries: &[&str],
    ) -> Result<PathBuf> {
        let binary = self.dir.join(output);
        if binary.exists() {
            return Ok(binary);
        }
        let c = format!("tests/fixtures/{name}.c");
        let (source, compiler) =
            if root().join(&c).exists() { (c, "gcc") } else { (format!("tests/fixtures/{name}.cpp"), "g++") };
        let mut command = Command::new(compiler);
        command
            .args(flags)
            .arg(format!("-fdebug-prefix-map={}=.", root().display()))
            .arg("-o")
            .arg(&binary)
            .arg(&source)
            .args(libraries)
            .current_dir(root());
        finish_quietly(&mut command)?;
        Ok(binary)
    }

    /// Builds the Go program in tests/fixtures/NAME into the scratch
    /// directory.
    pub fn go_program(&self, name: &str) -> Result<PathBuf> {
        require("go")?;
        let binary = self.dir.join(name);
        let mut command = Command::new("go");
        command
            .args(["build", "-trimpath", "-o"])
            .arg(&binary)
            .arg("main.go")
            .current_dir(root().join("tests/fixtures").join(name))
            // A lone file, no module: nothing to download.
            .env("GO111MODULE", "off");
        finish_quietly(&mut command)?;
        Ok(binary)
    }
}

/// Unmounts whatever a killed run left mounted below `dir` (podman's
/// storage), deepest first, for removing `dir` never to go through a
/// mount.
pub fn unmount_below(dir: &Path) {
    let prefix = format!("{}/", dir.display());
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut left: Vec<&str> = mounts
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4))
        .filter(|mount_point| mount_point.starts_with(&prefix))
        .collect();
    left.sort_by_key(|mount_point| std::cmp::Reverse(mount_point.len()));
    for mount_point in left {
        let _ = Command::new("umount").args(["--lazy", mount_point]).status();
    }
}

/// Fails with `Unavailable` when `program` is not on the PATH.
pub fn require(program: &str) -> Result<()> {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()));
    if found {
        Ok(())
    } else {
        Err(Unavailable(format!("{program} is not installed")).into())
    }
}

/// Runs `command` to its end; fails with its output if it fails.
fn finish_quietly(command: &mut Command) -> Result<()> {
    let output = command.stdin(Stdio::null()).output().with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed with {}: {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// Runs `command` to its end, its stdout and stderr in one pipe, as a
/// terminal shows them; returns its status and lines.
pub fn output(command: &mut Command) -> Result<(ExitStatus, Vec<String>)> {
    let mut run = Run::spawn(command.stdin(Stdio::null()))?;
    run.finish()
}

/// The lines `command` prints, which must succeed.
pub fn lines_of(command: &mut Command) -> Result<Vec<String>> {
    let (status, lines) = output(command)?;
    if !status.success() {
        bail!("{command:?} failed with {status}: {}", lines.join("\n"));
    }
    Ok(lines)
}

/// A program that runs while the example talks to it: its stdout and
/// stderr go into one pipe, read line by line as they come, as a terminal
/// would show them; its stdin is ours. Killed when dropped.
pub struct Run {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// Every line read so far.
    pub seen: Vec<String>,
}

impl Run {
    pub fn spawn(command: &mut Command) -> Result<Self> {
        let (reader, writer) = io::pipe().context("cannot make a pipe")?;
        let mut child = command
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .spawn()
            .with_context(|| format!("cannot run {command:?}"))?;
        // The command's own copies of the pipe's write end are closed
        // here, for the pipe to end with the program.
        command.stdout(Stdio::null()).stderr(Stdio::null());
        let stdin = child.stdin.take();
        Ok(Self { child, stdin, lines: lines_as_they_come(reader), seen: Vec::new() })
    }

    /// As `spawn`, with stdin a pipe that `send` writes to.
    pub fn interactive(command: &mut Command) -> Result<Self> {
        Self::spawn(command.stdin(Stdio::piped()))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a line that `wanted` accepts; returns it.
    pub fn wait_for(&mut self, what: &str, wanted: impl Fn(&str) -> bool) -> Result<String> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if wanted(&line) {
                        return Ok(line);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    bail!("no {what} after {PATIENCE:?}; saw: {:#?}", self.seen)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    bail!("the program ended before {what}; saw: {:#?}", self.seen)
                }
            }
        }
    }

    /// Waits for a line that starts with `start`.
    pub fn wait_for_start(&mut self, start: &str) -> Result<String> {
        self.wait_for(&format!("a line starting {start:?}"), |line| line.starts_with(start))
    }

    /// Writes `line` to its stdin.
    pub fn send(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("no stdin to write to")?;
        stdin.write_all(format!("{line}\n").as_bytes()).context("cannot write to the program")
    }

    pub fn close_stdin(&mut self) {
        drop(self.stdin.take());
    }

    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
    }

    /// Waits for it to end; returns its status and every line it printed.
    pub fn finish(&mut self) -> Result<(ExitStatus, Vec<String>)> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => self.seen.push(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => bail!("still running after {PATIENCE:?}: {:#?}", self.seen),
            }
        }
        let status = self.child.wait()?;
        Ok((status, self.seen.clone()))
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn lines_as_they_come(pipe: impl io::Read + Send + 'static) -> Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

/// What a terminal showed: commands after a `$ `, their output, and `...`
/// where lines were left out.
#[derive(Default)]
pub struct Transcript(String);

impl Transcript {
    pub fn command(&mut self, command: &str) -> &mut Self {
        self.0.push_str("$ ");
        self.line(command)
    }

    pub fn line(&mut self, line: &str) -> &mut Self {
        self.0.push_str(line);
        self.0.push('\n');
        self
    }

    pub fn lines<S: AsRef<str>>(&mut self, lines: impl IntoIterator<Item = S>) -> &mut Self {
        for line in lines {
            self.line(line.as_ref());
        }
        self
    }

    /// The lines `keep` accepts, with `...` for each run of lines left out.
    pub fn kept<S: AsRef<str>>(&mut self, lines: &[S], keep: impl Fn(&str) -> bool) -> &mut Self {
        let mut elided = false;
        for line in lines.iter().map(AsRef::as_ref) {
            if keep(line) {
                self.line(line);
                elided = false;
            } else if !elided {
                self.line("...");
                elided = true;
            }
        }
        self
    }

    pub fn text(&self) -> String {
        self.0.clone()
    }
}

/// The reports among lines a run printed: each from its `[HH:MM:SS] Top`
/// header to the line before the next line that is not part of it.
pub fn reports(lines: &[String]) -> Vec<Vec<String>> {
    let mut reports: Vec<Vec<String>> = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in lines {
        if line.starts_with('[') && line.contains("] Top ") {
            reports.extend(current.take());
            current = Some(vec![line.clone()]);
        } else if let Some(report) = current.as_mut() {
            if is_report_line(line) {
                report.push(line.clone());
            } else {
                reports.extend(current.take());
            }
        }
    }
    reports.extend(current);
    reports
}

/// A line of a text report after its header.
fn is_report_line(line: &str) -> bool {
    const STARTS: [&str; 11] = [
        "Outstanding: ",
        "Of those, ",
        "Resident: ",
        "Mostly not a leak: ",
        "Seen: ",
        "Not shown: ",
        "Truncated stacks: ",
        "Cgroup ",
        "Since the last report: ",
        "No symbols for ",
        "No file:line for ",
    ];
    line.starts_with('\t')
        || STARTS.iter().any(|start| line.starts_with(start))
        || line.contains(" of those frees were of blocks memleak never saw allocated")
        || line.ends_with(": raise --max-allocs")
        || line.ends_with(": raise --max-stacks")
}

/// A TCP port on 127.0.0.1 that nothing listened on a moment ago.
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

/// `preferred` if nothing listens on it, else a free port.
pub fn port_or_free(preferred: u16) -> Result<u16> {
    match TcpListener::bind(("127.0.0.1", preferred)) {
        Ok(_) => Ok(preferred),
        Err(_) => free_port(),
    }
}

/// `curl -s URL` and its output.
pub fn curl(args: &[&str]) -> Result<String> {
    require("curl")?;
    let output = Command::new("curl").arg("-s").args(args).stdin(Stdio::null()).output()?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// GETs `url` with curl until `wanted` accepts the body.
pub fn curl_until(url: &str, wanted: impl Fn(&str) -> bool) -> Result<String> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let body = curl(&[url])?;
        if wanted(&body) {
            return Ok(body);
        }
        if Instant::now() > deadline {
            bail!("{url}: not the answer wanted after {PATIENCE:?}: {body}");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// A cgroup v2 directory, removed (children first) when dropped.
pub struct Cgroup(pub PathBuf);

impl Cgroup {
    /// `NAME` at the root of the cgroup v2 hierarchy, made afresh.
    pub fn new(name: &str) -> Result<Self> {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(PathBuf::from)
            .find(|root| root.join("cgroup.procs").exists() && root.join("cgroup.controllers").exists())
            .ok_or_else(|| Unavailable("no cgroup v2 hierarchy".to_owned()))?;
        let cgroup = Self(root.join(name));
        drop(Self(cgroup.0.clone()));
        fs::create_dir(&cgroup.0).with_context(|| format!("cannot make {}", cgroup.0.display()))?;
        Ok(cgroup)
    }

    pub fn child(&self, name: &str) -> Result<Self> {
        let path = self.0.join(name);
        fs::create_dir(&path)?;
        Ok(Self(path))
    }

    pub fn join(&self, pid: u32) -> Result<()> {
        fs::write(self.0.join("cgroup.procs"), pid.to_string()).context("cannot move a process into a cgroup")
    }

    pub fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Ok(entries) = fs::read_dir(&self.0) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                    drop(Self(entry.path()));
                }
            }
        }
        let _ = fs::remove_dir(&self.0);
    }
}

/// The text of `png`'s `tEXt` chunk with `key`, if it has one.
pub fn png_text(png: &[u8], key: &str) -> Option<String> {
    let mut at = PNG_SIGNATURE.len();
    if !png.starts_with(PNG_SIGNATURE) {
        return None;
    }
    while at + 8 <= png.len() {
        let length = u32::from_be_bytes(png[at..at + 4].try_into().ok()?) as usize;
        let kind = &png[at + 4..at + 8];
        let data = png.get(at + 8..at + 8 + length)?;
        if kind == b"tEXt" {
            if let Some(text) = data.strip_prefix(key.as_bytes()).and_then(|rest| rest.strip_prefix(&[0])) {
                return Some(String::from_utf8_lossy(text).into_owned());
            }
        }
        at += 12 + length;
    }
    None
}

/// `png` with a `tEXt` chunk `key` holding `text`, after its header.
pub fn with_png_text(png: &[u8], key: &str, text: &str) -> Result<Vec<u8>> {
    if !png.starts_with(PNG_SIGNATURE) || png.len() < PNG_SIGNATURE.len() + 25 {
        bail!("not a PNG");
    }
    // The signature, then IHDR: 4 bytes of length, 4 of type, 13 of data
    // and 4 of CRC.
    let after_header = PNG_SIGNATURE.len() + 25;
    let mut data = key.as_bytes().to_vec();
    data.push(0);
    data.extend_from_slice(text.as_bytes());
    let mut chunk = Vec::with_capacity(data.len() + 12);
    chunk.extend_from_slice(&u32::try_from(data.len())?.to_be_bytes());
    chunk.extend_from_slice(b"tEXt");
    chunk.extend_from_slice(&data);
    chunk.extend_from_slice(&crc32(&chunk[4..]).to_be_bytes());
    let mut out = png[..after_header].to_vec();
    out.extend_from_slice(&chunk);
    out.extend_from_slice(&png[after_header..]);
    Ok(out)
}

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

/// The CRC-32 PNG chunks carry (ISO 3309), bit by bit: chunks are small.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffff_u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// Reads a file the example's program wrote.
pub fn read(path: &Path) -> Result<String> {
    let mut text = String::new();
    fs::File::open(path)
        .and_then(|mut file| file.read_to_string(&mut text))
        .with_context(|| format!("cannot read {}", path.display()))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_png_s() {
        // The CRC of an IEND chunk's type, as every PNG ends.
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
    }

    #[test]
    fn a_png_keeps_the_text_it_was_given() {
        let mut png = PNG_SIGNATURE.to_vec();
        png.extend_from_slice(&[0, 0, 0, 13]);
        png.extend_from_slice(b"IHDR");
        png.extend_from_slice(&[0; 17]);
        png.extend_from_slice(&[0, 0, 0, 0]);
        png.extend_from_slice(b"IEND");
        png.extend_from_slice(&crc32(b"IEND").to_be_bytes());
        assert_eq!(png_text(&png, "source"), None);
        let tagged = with_png_text(&png, "source", "<html>").unwrap();
        assert_eq!(png_text(&tagged, "source").as_deref(), Some("<html>"));
        assert!(tagged.ends_with(&png[PNG_SIGNATURE.len() + 25..]));
    }

    #[test]
    fn reports_are_cut_from_what_a_run_printed() {
        let lines: Vec<String> = [
            "memleak: tracing pid 1",
            "[10:00:00] Top 1 stacks with outstanding allocations in pid 1 (/a) through /b:",
            "\t8 bytes in 1 allocations from stack",
            "\t\tf+0x1 [/a]",
            "Outstanding: 8 bytes in 1 allocations",
            "Seen: 1 allocations, 0 frees, 0 failed allocations; 0 allocations not tracked, 0 stacks lost",
            "done",
            "[10:00:01] Top stacks with outstanding allocations in pid 1 (/a) through /b: none",
            "Outstanding: 0 bytes in 0 allocations",
        ]
        .map(str::to_owned)
        .to_vec();
        let found = reports(&lines);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].len(), 5);
        assert_eq!(found[1].len(), 2);
    }
}
