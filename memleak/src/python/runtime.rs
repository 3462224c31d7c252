//! Finding CPython in a process: the object that holds the interpreter
//! (`python3.X` itself, or the `libpython3.X.so` it links), where it is
//! loaded, its version, and the addresses of what the walk and the merge
//! need, read from the file as the process maps it.

use std::{collections::HashMap, fs::File, ops::Range, path::Path};

use iced_x86::{Decoder, DecoderOptions, FlowControl, OpKind};
use object::{
    read::ReadCache, Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _, ReadRef as _,
};

use crate::{
    elf,
    process::{
        files::{self, FileIdentity},
        maps::{self, MapsEntry},
    },
    unwind::eh_frame,
};

/// A CPython version: `Py_Version`'s fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonVersion {
    pub major: u32,
    pub minor: u32,
    /// Unknown when only a file name said the version.
    pub micro: Option<u32>,
}

impl PythonVersion {
    /// `PY_VERSION_HEX`'s major and minor bytes, the rest 0.
    pub fn hex_minor(self) -> u32 {
        self.major << 24 | self.minor << 16
    }
}

impl std::fmt::Display for PythonVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(micro) = self.micro {
            write!(f, ".{micro}")?;
        }
        Ok(())
    }
}

/// The object that holds the interpreter, as the process maps it.
pub struct InterpreterObject {
    /// The file as `/proc/PID/maps` names it (inside the process's root).
    pub path: String,
    pub file: File,
    /// Which file it is, whatever its path and whoever maps it.
    pub identity: FileIdentity,
    /// Runtime address minus the object's own addresses.
    pub bias: u64,
    /// Whether it defines `_PyRuntime` (3.7+); without it, older Pythons
    /// are recognised by `Py_Initialize`, to be refused by their version.
    pub has_runtime: bool,
}

/// What the process maps, seen once: its file mappings by object, and
/// which libc it runs on.
pub struct Mappings {
    /// One entry per mapped object (device, inode), in address order: the
    /// first mapping of each, and the executable one the file is opened by.
    objects: Vec<(MapsEntry, MapsEntry)>,
    pub executable_path: Option<String>,
}

impl Mappings {
    pub fn read(pid: u32) -> std::io::Result<Self> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let executable_path = std::fs::read_link(format!("/proc/{pid}/exe"))
            .ok()
            .map(|path| path.to_string_lossy().into_owned());
        Ok(Self::parse(&text, executable_path))
    }

    fn parse(text: &str, executable_path: Option<String>) -> Self {
        let mut objects: Vec<(MapsEntry, Option<MapsEntry>)> = Vec::new();
        for entry in maps::parse(text) {
            if entry.file().is_none() {
                continue;
            }
            let same = |(first, _): &&mut (MapsEntry, Option<MapsEntry>)| {
                first.device == entry.device && first.inode == entry.inode
            };
            if let Some((_, code)) = objects.iter_mut().find(|object| same(object)) {
                if code.is_none() && entry.executable {
                    *code = Some(entry);
                }
            } else {
                let code = entry.executable.then(|| entry.clone());
                objects.push((entry, code));
            }
        }
        let objects = objects.into_iter().filter_map(|(first, code)| Some((first, code?))).collect();
        Self { objects, executable_path }
    }

    /// The paths of every mapped object, as the process names them.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.objects.iter().filter_map(|(first, _)| first.file())
    }

    /// The object mapped from `path`, opened as `files::open_mapped` does.
    pub fn open(&self, pid: u32, path: &str) -> Option<File> {
        let (_, code) = self.objects.iter().find(|(first, _)| first.file() == Some(path))?;
        files::open_mapped(pid, code)
    }
}

/// An object file read through a cache, a few pages at a time.
pub type Parsed<'a> = object::File<'a, &'a ReadCache<&'a File>>;

/// The file offset of `address` of `file`, if the file holds its bytes.
pub fn file_offset(file: &Parsed<'_>, address: u64) -> Option<u64> {
    file.segments().find_map(|segment| {
        let (offset, size) = segment.file_range();
        let start = segment.address();
        (address >= start && address < start + size).then(|| address - start + offset)
    })
}

/// The symbol `name`'s address and size, defined in `.dynsym` or
/// `.symtab`.
pub fn symbol(file: &Parsed<'_>, name: &str) -> Option<(u64, u64)> {
    file.dynamic_symbols()
        .chain(file.symbols())
        .find(|symbol| !symbol.is_undefined() && symbol.address() != 0 && symbol.name() == Ok(name))
        .map(|symbol| (symbol.address(), symbol.size()))
}

/// Whether `.dynsym` defines `name`.
fn dynamic_symbol(file: &Parsed<'_>, name: &str) -> Option<u64> {
    file.dynamic_symbols()
        .find(|symbol| !symbol.is_undefined() && symbol.address() != 0 && symbol.name() == Ok(name))
        .map(|symbol| symbol.address())
}

/// The address of `_PyRuntime`: its symbol, or the `.PyRuntime` section
/// CPython 3.11+ puts it in (found in a binary stripped of both tables).
pub fn runtime_address(file: &Parsed<'_>) -> Option<u64> {
    symbol(file, "_PyRuntime")
        .map(|(address, _)| address)
        .or_else(|| file.section_by_name(".PyRuntime").map(|section| section.address()))
}

/// What an object's dynamic symbols say of it.
#[derive(Clone, Copy)]
struct ObjectKind {
    /// It defines `_PyRuntime` (3.7+).
    has_runtime: bool,
    /// It defines `Py_Initialize`.
    initializes: bool,
    /// It calls an interpreter it does not define (`Py_BytesMain`, say):
    /// an executable linked with a `libpython` its loader maps later.
    links_interpreter: bool,
}

/// The kinds of the objects looked at, by file: a process caught at its
/// exec is looked at every few milliseconds until its interpreter has
/// initialised, and forked workers and containers map the same files, so
/// each is parsed once. Emptied when it reaches `KNOWN_OBJECTS`.
static OBJECT_KINDS: std::sync::Mutex<Option<HashMap<FileIdentity, ObjectKind>>> =
    std::sync::Mutex::new(None);
const KNOWN_OBJECTS: usize = 4096;

/// What `file`'s dynamic symbols say of it, parsed once per file.
fn object_kind(file: &File) -> Option<ObjectKind> {
    let identity = FileIdentity::of(file);
    let mut known = OBJECT_KINDS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(kind) = identity.and_then(|identity| known.as_ref()?.get(&identity).copied()) {
        return Some(kind);
    }
    let cache = ReadCache::new(file);
    let parsed = object::File::parse(&cache).ok()?;
    // Both are exported, for extension modules to link to: the dynamic
    // symbols say, without reading a large `.symtab`.
    let exports = |name| dynamic_symbol(&parsed, name).is_some();
    let has_runtime = exports("_PyRuntime") || parsed.section_by_name(".PyRuntime").is_some();
    let initializes = exports("Py_Initialize");
    let imports =
        |name| parsed.dynamic_symbols().any(|symbol| symbol.is_undefined() && symbol.name() == Ok(name));
    let links_interpreter =
        !has_runtime && (imports("Py_BytesMain") || imports("Py_Main") || imports("Py_Initialize"));
    let kind = ObjectKind { has_runtime, initializes, links_interpreter };
    if let Some(identity) = identity {
        let known = known.get_or_insert_with(HashMap::new);
        if known.len() >= KNOWN_OBJECTS {
            known.clear();
        }
        known.insert(identity, kind);
    }
    Some(kind)
}

/// The object of process `pid` that holds a CPython interpreter, if one
/// does. Each object mapped executable is opened through
/// `/proc/PID/map_files` (a container's files need not exist on the
/// host), and the first, in address order, that defines `_PyRuntime` is
/// taken: the executable, mapped lowest, when libpython is linked into it
/// (Debian's); else the `libpython3.X.so` it links (pyenv's, the official
/// images'), the executable then only importing the symbol. Without any,
/// an object defining `Py_Initialize` is a Python older than 3.7.
pub fn find_interpreter(pid: u32, mappings: &Mappings) -> Option<InterpreterObject> {
    let mut legacy = None;
    for (first, code) in &mappings.objects {
        let Some(file) = files::open_mapped(pid, code) else { continue };
        let Some(ObjectKind { has_runtime, initializes, .. }) = object_kind(&file) else { continue };
        if !has_runtime && (legacy.is_some() || !initializes) {
            continue;
        }
        let Some(bias) = load_bias(&file, first) else { continue };
        let Some(identity) = FileIdentity::of(&file) else { continue };
        let path = first.file().unwrap_or_default().to_owned();
        let found = InterpreterObject { path, file, identity, bias, has_runtime };
        if has_runtime {
            return Some(found);
        }
        legacy = Some(found);
    }
    legacy
}

/// Whether process `pid` runs an executable that calls an interpreter
/// it does not define: looked at before its loader has mapped the
/// `libpython` that does (at its execve), it is CPython not ready yet.
pub fn links_interpreter(pid: u32, mappings: &Mappings) -> bool {
    mappings.objects.iter().any(|(_, code)| {
        files::open_mapped(pid, code)
            .and_then(|file| object_kind(&file))
            .is_some_and(|kind| kind.links_interpreter)
    })
}

/// Where the object that `first` (its first mapping) maps is loaded:
/// the mapping's address minus the virtual address of what it maps.
fn load_bias(file: &File, first: &MapsEntry) -> Option<u64> {
    const PAGE: u64 = 4096;
    let segments = elf::load_segments(file);
    let (offset, _, vaddr) = segments
        .into_iter()
        .find(|&(offset, size, _)| offset / PAGE * PAGE <= first.offset && first.offset < offset + size)?;
    // The mapping starts `offset - first.offset` before the segment's data.
    Some(first.start.wrapping_add(offset).wrapping_sub(first.offset).wrapping_sub(vaddr))
}

/// The version of the interpreter in `object`: `Py_Version` (3.11+),
/// else its file name's `pythonX.Y` with the `X.Y.Z` string CPython keeps
/// in `.rodata` (`PY_VERSION`), else that string alone. Also whether the
/// build is free-threaded by its name (`python3.13t`).
pub fn version<'a>(
    object: &InterpreterObject,
    parsed: &Parsed<'a>,
    cache: &'a ReadCache<&'a File>,
) -> Option<(PythonVersion, bool)> {
    let name = object.path.rsplit('/').next().unwrap_or(&object.path);
    let from_name = name_version(name);
    let free_threaded = from_name.is_some_and(|(_, threaded)| threaded);
    if let Some((address, _)) = symbol(parsed, "Py_Version") {
        let offset = file_offset(parsed, address)?;
        let bytes = cache.read_bytes_at(offset, 4).ok()?;
        let hex = u32::from_le_bytes(bytes.try_into().ok()?);
        let version =
            PythonVersion { major: hex >> 24, minor: (hex >> 16) & 0xff, micro: Some((hex >> 8) & 0xff) };
        return Some((version, free_threaded));
    }
    let rodata = parsed.section_by_name(".rodata").and_then(|section| section.data().ok()).unwrap_or(&[]);
    let from_rodata = |major: Option<u32>, minor: Option<u32>| rodata_version(rodata, major, minor);
    match from_name {
        Some(((major, minor), _)) => {
            let micro = from_rodata(Some(major), Some(minor)).and_then(|version| version.micro);
            Some((PythonVersion { major, minor, micro }, free_threaded))
        }
        None => from_rodata(None, None).map(|version| (version, false)),
    }
}

/// `(major, minor)` and a `t` suffix from a name holding `pythonX.Y`.
fn name_version(name: &str) -> Option<((u32, u32), bool)> {
    let at = name.find("python")? + "python".len();
    let rest = &name[at..];
    let (major, rest) = rest.split_once('.')?;
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let minor = rest[..digits].parse().ok()?;
    Some(((major.parse().ok()?, minor), rest[digits..].starts_with('t')))
}

/// CPython's `PY_VERSION` in `rodata`, `X.Y.Z` ending a string, of the
/// given major and minor if known. The linker merges strings that end
/// alike: pyenv's "3.8.18" is the tail of "/root/.pyenv/versions/3.8.18",
/// so a string of its own is preferred, then a string's tail.
fn rodata_version(rodata: &[u8], major: Option<u32>, minor: Option<u32>) -> Option<PythonVersion> {
    // A literal prefix when the version is known keeps the search fast.
    let number_or =
        |known: Option<u32>, digits: &str| known.map_or_else(|| digits.to_owned(), |known| known.to_string());
    let pattern = format!(
        r"(?-u)({})\.({})\.([0-9]{{1,3}})\x00",
        number_or(major, "[23]"),
        number_or(minor, "[0-9]{1,2}")
    );
    let pattern = regex::bytes::Regex::new(&pattern).ok()?;
    let number = |bytes: &[u8]| std::str::from_utf8(bytes).ok()?.parse().ok();
    let mut found = pattern.captures_iter(rodata).filter_map(|captures| {
        let start = captures.get(0)?.start();
        let before = start.checked_sub(1).map(|at| rodata[at]);
        if before.is_some_and(|byte| byte.is_ascii_digit() || byte == b'.') {
            return None;
        }
        let version = PythonVersion {
            major: number(&captures[1])?,
            minor: number(&captures[2])?,
            micro: Some(number(&captures[3])?),
        };
        let wanted = major.is_none_or(|major| major == version.major)
            && minor.is_none_or(|minor| minor == version.minor);
        wanted.then_some((before.is_none_or(|byte| byte == 0), version))
    });
    let first = found.next()?;
    Some(if first.0 { first.1 } else { found.find(|(own, _)| *own).unwrap_or(first).1 })
}

/// The code of `_PyEval_EvalFrameDefault` in the object's own addresses:
/// the function's symbol, then each FDE of `.eh_frame` that its jumps lead
/// into, outside the function, that is no other function (entered by a
/// call, or named): the part GCC moved away as `.cold`, which Debian's
/// stripped binary does not name.
pub fn eval_ranges<'a>(
    path: &Path,
    parsed: &Parsed<'a>,
    cache: &'a ReadCache<&'a File>,
) -> Result<Vec<Range<u64>>, String> {
    let (start, size) =
        symbol(parsed, "_PyEval_EvalFrameDefault").ok_or("no symbol _PyEval_EvalFrameDefault")?;
    if size == 0 {
        return Err("the symbol _PyEval_EvalFrameDefault has no size".to_owned());
    }
    let function = start..start + size;
    let offset = file_offset(parsed, start).ok_or("_PyEval_EvalFrameDefault is not in the file")?;
    let code = cache.read_bytes_at(offset, size).map_err(|()| "cannot read _PyEval_EvalFrameDefault")?;
    let stubs: Vec<Range<u64>> = parsed
        .sections()
        .filter(|section| section.name().is_ok_and(|name| name.starts_with(".plt")))
        .map(|section| section.address()..section.address() + section.size())
        .collect();
    let mut targets: Vec<u64> = Vec::new();
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    for instruction in &mut decoder {
        let jumps = matches!(
            instruction.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch
        );
        if jumps && instruction.op0_kind() == OpKind::NearBranch64 {
            let target = instruction.near_branch_target();
            if !function.contains(&target) && !stubs.iter().any(|stub| stub.contains(&target)) {
                targets.push(target);
            }
        }
    }
    if targets.is_empty() {
        return Ok(vec![function]);
    }
    let fdes = eh_frame::fde_spans(path, cache).map_err(|error| error.to_string())?;
    let named: HashMap<u64, String> = parsed
        .dynamic_symbols()
        .chain(parsed.symbols())
        .filter(|symbol| symbol.kind() == object::SymbolKind::Text && !symbol.is_undefined())
        .filter_map(|symbol| Some((symbol.address(), symbol.name().ok()?.to_owned())))
        .collect();
    let mut ranges = vec![function];
    for target in targets {
        let index = fdes.partition_point(|fde| fde.code.start <= target);
        let Some(fde) = index.checked_sub(1).map(|index| &fdes[index]) else { continue };
        // Not another function: one entered by a call, or named otherwise
        // (a tail call, or a trap shared by several functions).
        let named_otherwise =
            named.get(&fde.code.start).is_some_and(|name| !name.starts_with("_PyEval_EvalFrameDefault.cold"));
        let cold_part = fde.code.contains(&target) && !fde.entered_by_call && !named_otherwise;
        if cold_part && !ranges.contains(&fde.code) {
            ranges.push(fde.code.clone());
        }
    }
    ranges[1..].sort_by_key(|range| range.start);
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_names_and_version_strings() {
        assert_eq!(name_version("libpython3.12.so.1.0"), Some(((3, 12), false)));
        assert_eq!(name_version("python3.13t"), Some(((3, 13), true)));
        assert_eq!(name_version("libpython3.7m.so.1.0"), Some(((3, 7), false)));
        assert_eq!(name_version("python2.7"), Some(((2, 7), false)));
        assert_eq!(name_version("python3"), None);
        let rodata = b"\x00%.80s (%.80s) %.80s\x001.2.3.4\x00/opt/3.9.0\x003.10.13\x003.9.1\x00";
        let version = |major, minor| rodata_version(rodata, major, minor).map(|version| version.to_string());
        assert_eq!(version(Some(3), Some(9)).as_deref(), Some("3.9.1"), "a string of its own first");
        assert_eq!(version(None, None).as_deref(), Some("3.10.13"), "1.2.3.4 is no Python version");
        assert_eq!(version(Some(3), Some(8)), None);
        let merged = b"\0/root/.pyenv/versions/3.8.18\0";
        assert_eq!(
            rodata_version(merged, Some(3), Some(8)).map(|version| version.to_string()).as_deref(),
            Some("3.8.18")
        );
    }

    /// Debian's python3.11: the eval loop is entered by calls, its cold
    /// part, jumped to from its body, is not.
    #[test]
    fn a_cold_part_is_told_from_a_function_by_its_first_unwind_row() {
        let file = File::open("/usr/bin/python3.11").unwrap();
        let spans = eh_frame::fde_spans(Path::new("python3.11"), &ReadCache::new(&file)).unwrap();
        let span = |start| spans.iter().find(|span| span.code.start == start).unwrap();
        assert_eq!(span(0x52_b0f0), &eh_frame::FdeSpan { code: 0x52_b0f0..0x53_8a4c, entered_by_call: true });
        assert_eq!(
            span(0x43_0f05),
            &eh_frame::FdeSpan { code: 0x43_0f05..0x43_455e, entered_by_call: false }
        );
    }

    #[test]
    fn a_mapping_s_bias_is_its_address_less_what_it_maps() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 42 /usr/lib/libpython3.12.so.1.0
7f0000001000-7f0000005000 r-xp 00001000 08:01 42 /usr/lib/libpython3.12.so.1.0
00400000-00401000 r--p 00000000 08:01 43 /usr/bin/python3.11
00401000-00402000 r-xp 00001000 08:01 43 /usr/bin/python3.11
7f0000100000-7f0000101000 rw-p 00000000 00:00 0";
        let mappings = Mappings::parse(maps, None);
        assert_eq!(mappings.objects.len(), 2, "one per file, anonymous memory left out");
        assert_eq!(mappings.objects[0].1.offset, 0x1000, "the file is opened through its code");
        let paths: Vec<&str> = mappings.paths().collect();
        assert_eq!(paths, ["/usr/lib/libpython3.12.so.1.0", "/usr/bin/python3.11"]);
    }
}
