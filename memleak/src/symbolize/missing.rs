//! Where a report's frames lack what a reader needs, and where it would
//! come from: objects whose frames have no names (shown as their file
//! offsets, `memcached+0x1a2b3`), and the culprits' objects that have no
//! file and line.

use std::{collections::HashMap, process::Command};

use object::{Object as _, ObjectSection as _};
use serde::{Deserialize, Serialize};

use super::ANONYMOUS_CODE;
use crate::{
    model::Frame,
    process::address_space::{FileId, MappedObject},
    unwind::debug_files,
};

/// What frames of an object lack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lacking {
    /// Function names: the object has no symbols for that code.
    Names,
    /// Files and lines, for the culprits (the program's own code).
    Lines,
}

/// An object whose frames in a report lack names or lines.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingSymbols {
    /// The object, as the process names it.
    pub module: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
    pub lacking: Lacking,
    /// What would give them, for people.
    pub advice: String,
}

/// The objects of `shown` frames that lack names, and those of `culprits`
/// that lack lines, each once; `object_of` finds a frame's object. Frames
/// in anonymous executable memory, JIT code that no perf map names, get
/// one entry that says how `program`'s runtime writes one.
pub fn missing_symbols<'a>(
    shown: impl Iterator<Item = &'a Frame>,
    culprits: impl Iterator<Item = &'a Frame>,
    mut object_of: impl FnMut(&Frame) -> Option<&'a MappedObject>,
    advice: &mut Advice,
    program: &str,
) -> Vec<MissingSymbols> {
    let mut found: Vec<MissingSymbols> = Vec::new();
    let (jit, unnamed): (Vec<&Frame>, Vec<&Frame>) = shown
        .filter(|frame| frame.function.is_none())
        .partition(|frame| frame.module.as_deref() == Some(ANONYMOUS_CODE));
    if !jit.is_empty() {
        found.push(MissingSymbols {
            module: ANONYMOUS_CODE.to_owned(),
            build_id: None,
            lacking: Lacking::Names,
            advice: perf_map_advice(program),
        });
    }
    let lacking = unnamed.into_iter().map(|frame| (frame, Lacking::Names)).chain(
        culprits
            .filter(|frame| frame.function.is_some() && frame.line.is_none())
            .map(|frame| (frame, Lacking::Lines)),
    );
    for (frame, lacking) in lacking {
        // Frames of no file (JIT code, anonymous memory) have nothing to install.
        let (Some(module), Some(_)) = (&frame.module, frame.file_offset) else { continue };
        if found.iter().any(|missing| &missing.module == module && missing.lacking == lacking) {
            continue;
        }
        let Some(object) = object_of(frame) else { continue };
        found.push(MissingSymbols {
            module: module.clone(),
            build_id: object.build_id().map(str::to_owned),
            lacking,
            advice: advice.for_object(object, lacking),
        });
    }
    // What gives an object's names gives its lines: said once.
    let unnamed: Vec<String> = found
        .iter()
        .filter(|missing| missing.lacking == Lacking::Names)
        .map(|missing| missing.module.clone())
        .collect();
    found.retain(|missing| missing.lacking == Lacking::Names || !unnamed.contains(&missing.module));
    found.sort_by(|a, b| (a.lacking, &a.module).cmp(&(b.lacking, &b.module)));
    found
}

/// How the runtime of `program` writes the perf map that names its JIT
/// code (`/tmp/perf-PID.map`, which memleak reads as it grows).
fn perf_map_advice(program: &str) -> String {
    let file = program.rsplit('/').next().unwrap_or(program);
    let how = if file.starts_with("node") {
        "start node with --perf-basic-prof"
    } else if file == "java" {
        "run `jcmd PID Compiler.perfmap` (JDK 17 and later), again as it compiles more"
    } else if file.starts_with("dotnet") {
        "start it with DOTNET_PerfMapEnabled=1"
    } else {
        "ask its runtime for a perf map (node --perf-basic-prof, jcmd PID Compiler.perfmap, DOTNET_PerfMapEnabled=1)"
    };
    format!("JIT code without a perf map: {how}, and memleak names its functions")
}

/// What to install or rebuild for an object's symbols, worked out once per
/// object (it asks dpkg).
#[derive(Default)]
pub struct Advice {
    said: HashMap<(FileId, Lacking), String>,
}

impl Advice {
    fn for_object(&mut self, object: &MappedObject, lacking: Lacking) -> String {
        self.said.entry((object.id, lacking)).or_insert_with(|| advise(object, lacking)).clone()
    }
}

fn advise(object: &MappedObject, lacking: Lacking) -> String {
    let sections = Sections::of(object);
    if sections.rust && !sections.line_tables {
        return "a Rust build without line tables: build it with debug = \"line-tables-only\" \
                (or more) under [profile.release] in Cargo.toml"
            .to_owned();
    }
    let mut ways = Vec::new();
    let package = host_package(object);
    if let Some(package) = &package {
        // Debian's automatic debug packages are named so; the C library's
        // is built apart.
        let debug_package =
            if package == "libc6" { "libc6-dbg".to_owned() } else { format!("{package}-dbgsym") };
        ways.push(format!("install {debug_package} ({})", debug_archive()));
    }
    if let Some(name) = object.build_id().and_then(debug_files::build_id_path) {
        // A container's object is looked up in the container's files alone.
        let whose = if object.is_hosts_own() { "" } else { " inside the container's root (its image)" };
        ways.push(format!("put its debug file at /usr/lib/debug/{name}{whose}"));
    }
    if package.is_none() && !sections.debug_info {
        ways.push(
            match lacking {
                Lacking::Names => "build it unstripped",
                Lacking::Lines => "build it with -g",
            }
            .to_owned(),
        );
    }
    ways.join(", or ")
}

/// Where Debian's `-dbgsym` packages come from, as Debian's wiki says it
/// (HowToGetABacktrace): the release's `-debug` suite, which APT's
/// sources must list. The release is the host's, from /etc/os-release.
fn debug_archive() -> String {
    let release = std::fs::read_to_string("/etc/os-release").ok().and_then(|text| {
        text.lines()
            .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
            .map(|name| name.trim_matches('"').to_owned())
    });
    match release.filter(|name| !name.is_empty()) {
        Some(name) => format!("from Debian's debug archive: add the {name}-debug suite to APT's sources"),
        None => "from Debian's debug archive: add your release's -debug suite to APT's sources".to_owned(),
    }
}

/// What an object's sections say of its symbols.
#[derive(Default)]
struct Sections {
    /// Built by rustc (its `.comment` says so).
    rust: bool,
    /// It has `.debug_line`.
    line_tables: bool,
    /// It has `.debug_info`.
    debug_info: bool,
}

impl Sections {
    fn of(object: &MappedObject) -> Self {
        let cache = object::read::ReadCache::new(object.file());
        let Ok(elf) = object::File::parse(&cache) else { return Self::default() };
        let rust = elf
            .section_by_name(".comment")
            .and_then(|section| section.data().ok())
            .is_some_and(|data| data.windows(5).any(|window| window == b"rustc"));
        Self {
            rust,
            line_tables: elf.section_by_name(".debug_line").is_some(),
            debug_info: elf.section_by_name(".debug_info").is_some(),
        }
    }
}

/// The Debian package that installed `object`, if it is the host's own
/// file (a container's files are its image's, which the host's dpkg does
/// not know, even at the same path).
fn host_package(object: &MappedObject) -> Option<String> {
    if !object.is_hosts_own() {
        return None;
    }
    // dpkg knows files by the paths packages list, from before /usr was
    // merged: /lib/x86_64-linux-gnu/libc.so.6 for /usr/lib/x86_64-linux-gnu/libc.so.6.
    let unmerged =
        object.path.strip_prefix("/usr").filter(|rest| rest.starts_with("/lib") || rest.starts_with("/bin"));
    [Some(object.path.as_str()), unmerged].into_iter().flatten().find_map(|path| {
        let output = Command::new("dpkg-query").arg("-S").arg(path).output().ok()?;
        if !output.status.success() {
            return None;
        }
        // "libstdc++6:amd64: /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30"
        let text = String::from_utf8_lossy(&output.stdout);
        let package = text.lines().next()?.split(": ").next()?;
        let package = package.split(':').next()?.trim();
        (!package.is_empty() && !package.contains(',')).then(|| package.to_owned())
    })
}
