//! Processes memleak must never trace, because each event it printed
//! would cause more: memleak itself, and with --trace the processes that
//! read its output (the other end of its stdout pipe, a FIFO's reader,
//! the terminal behind its pseudo-terminal) and other memleaks, found as
//! they are met (`runs_memleak`).

use std::{
    fs,
    os::unix::fs::{FileTypeExt as _, MetadataExt as _},
    path::Path,
};

/// A process left out, and why, as the user is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Excluded {
    pub pid: u32,
    pub why: &'static str,
}

pub const ITSELF: &str = "it is memleak itself";
pub const READS_OUTPUT: &str = "it reads memleak's output, so tracing it with --trace would feed on itself";
pub const ANOTHER_MEMLEAK: &str =
    "it is another memleak: with --trace, each tracing the other would print an event for each event printed";

/// Whether process `pid` runs memleak: the very file this memleak runs
/// (same device and inode), or a copy of the same build (same GNU build
/// id). Two memleaks with --trace that trace each other feed on each
/// other: each event printed allocates, which is an event for the other.
/// Not a name check: a program may be called anything, memleak too.
pub fn runs_memleak(pid: u32) -> bool {
    is_memleak(Path::new(&format!("/proc/{pid}/exe")))
}

/// Whether the executable at `path` is memleak, as `runs_memleak` tells.
pub fn is_memleak(path: &Path) -> bool {
    static OWN: std::sync::OnceLock<Option<(u64, u64, Option<String>)>> = std::sync::OnceLock::new();
    let own = OWN.get_or_init(|| {
        let metadata = fs::metadata("/proc/self/exe").ok()?;
        Some((metadata.dev(), metadata.ino(), crate::elf::build_id(Path::new("/proc/self/exe"))))
    });
    let (Some((device, inode, own_build_id)), Ok(metadata)) = (own, fs::metadata(path)) else { return false };
    if (metadata.dev(), metadata.ino()) == (*device, *inode) {
        return true;
    }
    // Only a file as large as memleak can be a copy of it: no other file
    // is read.
    let own_size = fs::metadata("/proc/self/exe").map_or(0, |own| own.len());
    own_build_id.is_some() && metadata.len() == own_size && crate::elf::build_id(path) == *own_build_id
}

/// memleak, and with `trace` the readers of its stdout and of
/// `output_path`, found now: readers that come later are not known.
pub fn excluded(trace: bool, output_path: Option<&Path>) -> Vec<Excluded> {
    let own = std::process::id();
    let mut excluded = vec![Excluded { pid: own, why: ITSELF }];
    if trace {
        let mut outputs = vec![Output::of(Path::new("/proc/self/fd/1"))];
        outputs.extend(output_path.map(Output::of));
        let outputs: Vec<Output> = outputs.into_iter().flatten().collect();
        for pid in readers(&outputs, own) {
            excluded.push(Excluded { pid, why: READS_OUTPUT });
        }
    }
    excluded
}

/// What memleak writes to, as its readers' descriptors show it.
#[derive(Debug, PartialEq, Eq)]
enum Output {
    /// A pipe, FIFO or file: its device and inode.
    Node { device: u64, inode: u64 },
    /// A pseudo-terminal's subordinate side, `/dev/pts/N`: read through
    /// `/dev/ptmx` descriptors whose `tty-index` is N.
    Terminal { index: u32 },
}

impl Output {
    fn of(path: &Path) -> Option<Self> {
        let metadata = fs::metadata(path).ok()?;
        let devpts_major = 136..=143;
        if metadata.file_type().is_char_device() && devpts_major.contains(&libc::major(metadata.rdev())) {
            let link = fs::read_link(path).unwrap_or_else(|_| path.to_path_buf());
            let index = link.strip_prefix("/dev/pts").ok()?.to_str()?.parse().ok()?;
            return Some(Self::Terminal { index });
        }
        Some(Self::Node { device: metadata.dev(), inode: metadata.ino() })
    }
}

/// The processes other than `own` with a descriptor open for reading on
/// one of `outputs`.
fn readers(outputs: &[Output], own: u32) -> Vec<u32> {
    let Ok(processes) = fs::read_dir("/proc") else { return Vec::new() };
    let pids = processes.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok());
    pids.filter(|&pid| pid != own && reads_any(pid, outputs)).collect()
}

fn reads_any(pid: u32, outputs: &[Output]) -> bool {
    let Ok(descriptors) = fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    descriptors.filter_map(Result::ok).any(|descriptor| {
        let info =
            fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", descriptor.file_name().to_string_lossy()))
                .unwrap_or_default();
        let field = |name: &str| {
            info.lines().find_map(|line| line.strip_prefix(name)).map(str::trim).map(str::to_owned)
        };
        // Octal open flags; write-only descriptors do not read.
        let writes_only = field("flags:")
            .and_then(|flags| u32::from_str_radix(&flags, 8).ok())
            .is_some_and(|flags| flags & 0o3 == 0o1);
        if writes_only {
            return false;
        }
        let terminal = field("tty-index:").and_then(|index| index.parse().ok());
        outputs.iter().any(|output| match output {
            Output::Terminal { index } => terminal == Some(*index),
            Output::Node { device, inode } => fs::metadata(descriptor.path())
                .is_ok_and(|metadata| metadata.dev() == *device && metadata.ino() == *inode),
        })
    })
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    #[test]
    fn the_reader_of_a_pipe_is_found_and_its_writer_is_not() {
        let mut reader = Command::new("cat").stdin(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
        let writer_end = reader.stdin.as_ref().unwrap();
        let own_end = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(writer_end));
        let output = Output::of(Path::new(&own_end)).unwrap();
        assert_eq!(readers(&[output], std::process::id()), vec![reader.id()]);
        drop(reader.stdin.take());
        reader.wait().unwrap();
    }

    #[test]
    fn this_program_runs_memleak_and_a_copy_of_it_too_but_not_another_program() {
        // The test binary stands for memleak: it is /proc/self/exe.
        let own = std::process::id();
        assert!(runs_memleak(own));
        let dir = std::env::temp_dir().join(format!("memleak-copy-{own}"));
        fs::create_dir_all(&dir).unwrap();
        let copy = dir.join("renamed");
        fs::copy("/proc/self/exe", &copy).unwrap();
        let copied = is_memleak(&copy);
        let _ = fs::remove_dir_all(&dir);
        assert!(copied, "a copy of the same build, under another name");
        let mut other = Command::new("sleep").arg("60").spawn().unwrap();
        let other_runs_memleak = runs_memleak(other.id());
        other.kill().unwrap();
        other.wait().unwrap();
        assert!(!other_runs_memleak);
        assert!(!runs_memleak(u32::MAX), "no such process");
    }

    #[test]
    fn memleak_is_always_left_out_and_readers_only_with_trace() {
        let own = Excluded { pid: std::process::id(), why: ITSELF };
        assert_eq!(excluded(false, None), vec![own.clone()]);
        assert_eq!(excluded(true, None)[0], own);
    }
}
