//! The attach plan: which object serves the target's allocations, and at
//! which file offsets each allocator function starts.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use memleak_common::{programs, ALLOCATOR_FUNCTIONS};
use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};

use crate::probe_placement;

/// The entry program of each function in `memleak_common::ALLOCATOR_FUNCTIONS`,
/// in the same order. Every one but `free` also gets the shared return
/// probe.
const ENTRY_PROGRAMS: [&str; ALLOCATOR_FUNCTIONS.len()] = [
    programs::MALLOC_ENTER,         // malloc
    programs::CALLOC_ENTER,         // calloc
    programs::REALLOC_ENTER,        // realloc
    programs::REALLOCARRAY_ENTER,   // reallocarray
    programs::POSIX_MEMALIGN_ENTER, // posix_memalign
    programs::MEMALIGN_ENTER,       // aligned_alloc
    programs::MEMALIGN_ENTER,       // memalign
    programs::MALLOC_ENTER,         // valloc
    programs::MALLOC_ENTER,         // pvalloc
    programs::FREE_ENTER,           // free
    programs::MALLOC_ENTER,         // mallocx(size, flags)
    programs::REALLOC_ENTER,        // rallocx(ptr, size, flags)
    programs::FREE_ENTER,           // dallocx(ptr, flags)
    programs::FREE_ENTER,           // sdallocx(ptr, size, flags)
    programs::FREE_ENTER,           // free_sized(ptr, size)
    programs::FREE_ENTER,           // free_aligned_sized(ptr, alignment, size)
];

/// The memory-mapping functions, probed in the same object when it has
/// them: entry program and return program.
const MAPPING_FUNCTIONS: [(&str, &str, Option<&str>); 4] = [
    ("mmap", programs::MMAP_ENTER, Some(programs::MAPPING_RETURN)),
    ("mmap64", programs::MMAP_ENTER, Some(programs::MAPPING_RETURN)),
    ("munmap", programs::MUNMAP_ENTER, None),
    ("mremap", programs::MREMAP_ENTER, Some(programs::MAPPING_RETURN)),
];

#[derive(Debug, thiserror::Error)]
pub enum AllocatorError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{0} is not an ELF file: give -O the allocator library or binary")]
    NotElf(PathBuf),
    #[error("{0} has no malloc and free symbols: give -O the object that provides the allocator")]
    NoAllocator(PathBuf),
    #[error("no known allocator (malloc and free, plain or with a je_ or _rjem_ prefix) in {searched}: give -O the object, or --symbols-prefix")]
    NoKnownAllocator { searched: String },
    #[error(
        "no {prefix}malloc and {prefix}free in {searched}: check --symbols-prefix, or give -O the object"
    )]
    NoPrefixedAllocator { prefix: String, searched: String },
    #[error("cannot run `{0}`: it is neither an ELF executable nor a #! script")]
    NotExecutable(PathBuf),
    #[error("cannot find the libc that {program} will load: `{loader} --list` failed: {reason}")]
    Loader { program: PathBuf, loader: String, reason: String },
}

/// A function of the allocator and where it starts in its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSite {
    pub function: &'static str,
    pub entry_program: &'static str,
    /// The program for the function's return, if it has one.
    pub return_program: Option<&'static str>,
    /// Where the function starts in its file.
    pub file_offset: u64,
    /// Bytes past the start the entry probe goes; see `probe_placement`.
    pub entry_skip: u64,
    /// Bit i set for `memleak_common::ALLOCATOR_FUNCTIONS[i]` and each alias
    /// sharing this code; given to the probes as their attach cookie.
    pub cookie: u64,
}

/// The object to probe and the probe sites in it.
#[derive(Clone, Debug)]
pub struct AttachPlan {
    /// Path that opens the object from memleak's own mount namespace.
    pub path: PathBuf,
    /// The object as the target names it, for reports.
    pub display_path: String,
    pub sites: Vec<ProbeSite>,
}

/// Symbol prefixes tried when the user names none: plain names, then
/// jemalloc's `je_` and tikv-jemallocator's `_rjem_` builds.
const AUTO_PREFIXES: [&str; 3] = ["", "je_", "_rjem_"];

/// Plans probes for a running process: `object` if given, else the first
/// object in link-map order that defines the allocator. That order is the
/// binary, then LD_PRELOAD, then the binary's DT_NEEDED libraries, so a
/// preloaded or linked-in jemalloc wins over libc, as it does in the
/// dynamic linker.
pub fn plan_for_process(pid: u32, object: Option<&Path>, prefix: &str) -> Result<AttachPlan, AllocatorError> {
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let in_root = |file: &Path| root.join(file.strip_prefix("/").unwrap_or(file));
    if let Some(object) = object {
        // A path on the host, or else inside the target's mount namespace.
        let path = if object.exists() { object.to_path_buf() } else { in_root(object) };
        return plan_for_object(&path, &object.display().to_string(), prefix);
    }
    let maps_path = PathBuf::from(format!("/proc/{pid}/maps"));
    let maps =
        fs::read_to_string(&maps_path).map_err(|source| AllocatorError::Read { path: maps_path, source })?;
    // Each mapped file once, with the address range of its first mapping.
    let mut mapped: Vec<&str> = Vec::new();
    let mut ranges: BTreeMap<&str, &str> = BTreeMap::new();
    for line in maps.lines() {
        let Some(file) = mapped_file(line) else { continue };
        if !mapped.contains(&file) {
            mapped.push(file);
            ranges.insert(file, line.split(' ').next().unwrap_or(""));
        }
    }
    let open_path = |file: &str| {
        let candidates = mapped_file_paths(pid, ranges.get(file).unwrap_or(&""), file);
        candidates.iter().find(|path| path.exists()).cloned().unwrap_or_else(|| PathBuf::from(file))
    };
    let binary = mapped.first().copied().unwrap_or("");
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let needed = fs::read(open_path(binary)).map(|data| needed_libraries(&data)).unwrap_or_default();
    let ordered = link_order(&mapped, &preloads(&environ), &needed);
    let candidates: Vec<(PathBuf, String)> =
        ordered.iter().map(|file| (open_path(file), (*file).to_owned())).collect();
    first_allocator(&candidates, prefix)
}

/// Orders mapped files as the dynamic linker's link map has them: the
/// binary (mapped first), the LD_PRELOAD objects, the binary's DT_NEEDED
/// libraries in order, then everything else as mapped.
fn link_order<'a>(mapped: &[&'a str], preloads: &[String], needed: &[String]) -> Vec<&'a str> {
    let rank = |index: usize, file: &str| -> usize {
        let preload = preloads.iter().position(|preload| same_library(file, preload));
        let dependency = needed.iter().position(|name| same_library(file, name));
        match (index, preload, dependency) {
            (0, _, _) => 0,
            (_, Some(position), _) => 1 + position,
            (_, None, Some(position)) => 1_000 + position,
            _ => 1_000_000 + index,
        }
    };
    let mut ranked: Vec<(usize, &str)> =
        mapped.iter().enumerate().map(|(i, file)| (rank(i, file), *file)).collect();
    ranked.sort_by_key(|(rank, _)| *rank);
    ranked.into_iter().map(|(_, file)| file).collect()
}

/// Whether mapped `file` is the library `name` (a path or a soname): the
/// file is often the soname's symlink target, libfoo.so.4 -> libfoo.so.4.5.10.
fn same_library(file: &str, name: &str) -> bool {
    let base = |path: &'_ str| path.rsplit('/').next().unwrap_or(path).to_owned();
    let (file, name) = (base(file), base(name));
    file == name || file.strip_prefix(&name).is_some_and(|rest| rest.starts_with('.'))
}

/// The LD_PRELOAD entries of a NUL-separated environment block.
fn preloads(environ: &[u8]) -> Vec<String> {
    environ
        .split(|&byte| byte == 0)
        .filter_map(|entry| entry.strip_prefix(b"LD_PRELOAD="))
        .flat_map(|value| {
            String::from_utf8_lossy(value).split([':', ' ']).map(str::to_owned).collect::<Vec<_>>()
        })
        .filter(|entry| !entry.is_empty())
        .collect()
}

/// The DT_NEEDED entries of an ELF file, in order.
fn needed_libraries(data: &[u8]) -> Vec<String> {
    use object::read::elf::{Dyn as _, FileHeader as _};
    let Ok(header) = object::elf::FileHeader64::<object::Endianness>::parse(data) else { return Vec::new() };
    let Ok(endian) = header.endian() else { return Vec::new() };
    let Ok(sections) = header.sections(endian, data) else { return Vec::new() };
    let Ok(Some((entries, strings_index))) = sections.dynamic(endian, data) else { return Vec::new() };
    let Ok(strings) = sections.strings(endian, data, strings_index) else { return Vec::new() };
    entries
        .iter()
        .filter(|entry| entry.tag32(endian) == Some(object::elf::DT_NEEDED))
        .filter_map(|entry| entry.string(endian, strings).ok())
        .map(|name| String::from_utf8_lossy(name).into_owned())
        .collect()
}

/// Plans probes for a program about to be run: `object` if given, else the
/// first object in the link map its dynamic loader will build (asked of
/// the loader itself, so LD_PRELOAD, LD_LIBRARY_PATH and the ld.so cache
/// count) that defines the allocator.
pub fn plan_for_program(
    program: &Path,
    object: Option<&Path>,
    prefix: &str,
) -> Result<AttachPlan, AllocatorError> {
    if let Some(object) = object {
        return plan_for_object(object, &object.display().to_string(), prefix);
    }
    let data =
        fs::read(program).map_err(|source| AllocatorError::Read { path: program.to_path_buf(), source })?;
    if let Some(interpreter) = script_interpreter(&data) {
        // A script: the allocator is its interpreter's.
        return plan_for_program(&interpreter, None, prefix);
    }
    let file =
        object::File::parse(&*data).map_err(|_| AllocatorError::NotExecutable(program.to_path_buf()))?;
    let mut candidates = vec![(program.to_path_buf(), program.display().to_string())];
    if let Some(loader) = interpreter(&file) {
        for library in loaded_libraries(program, &loader)? {
            candidates.push((PathBuf::from(&library), library));
        }
    }
    first_allocator(&candidates, prefix)
}

/// The libraries `program` will load, in load order, as its dynamic loader
/// resolves them (`ld.so --list` loads them but runs none of their code).
fn loaded_libraries(program: &Path, loader: &str) -> Result<Vec<String>, AllocatorError> {
    let fail = |reason: String| AllocatorError::Loader {
        program: program.to_path_buf(),
        loader: loader.to_owned(),
        reason,
    };
    let output = Command::new(loader).arg("--list").arg(program).output();
    let output = output.map_err(|error| fail(error.to_string()))?;
    if !output.status.success() {
        return Err(fail(String::from_utf8_lossy(&output.stderr).trim().to_owned()));
    }
    // Lines look like "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x7f...)",
    // or "\t/usr/lib/libjemalloc.so.2 (0x7f...)" for a preloaded object.
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| line.split_once("=> ").map_or(line, |(_, rest)| rest))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|path| path.starts_with('/'))
        .map(str::to_owned)
        .collect())
}

/// The first candidate that defines PREFIXmalloc and PREFIXfree; with no
/// prefix given, the first that does so under any of `AUTO_PREFIXES`.
fn first_allocator(candidates: &[(PathBuf, String)], prefix: &str) -> Result<AttachPlan, AllocatorError> {
    let prefixes: &[&str] = if prefix.is_empty() { &AUTO_PREFIXES } else { &[prefix] };
    let found = candidates.iter().find_map(|(path, display)| {
        prefixes.iter().find_map(|prefix| plan_for_object(path, display, prefix).ok())
    });
    found.ok_or_else(|| {
        let searched = candidates.iter().map(|(_, display)| display.as_str()).collect::<Vec<_>>().join(", ");
        if prefix.is_empty() {
            AllocatorError::NoKnownAllocator { searched }
        } else {
            AllocatorError::NoPrefixedAllocator { prefix: prefix.to_owned(), searched }
        }
    })
}

/// The interpreter named on a script's `#!` line.
fn script_interpreter(data: &[u8]) -> Option<PathBuf> {
    let line = data.strip_prefix(b"#!")?.split(|&byte| byte == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    line.split_whitespace().next().map(PathBuf::from)
}

/// The PT_INTERP of an ELF file, if it is dynamically linked.
fn interpreter(file: &object::File) -> Option<String> {
    use object::read::elf::ProgramHeader as _;
    let object::File::Elf64(elf) = file else { return None };
    let endian = elf.endian();
    let data = elf.data();
    elf.elf_program_headers().iter().find_map(|header| {
        let bytes = header.interpreter(endian, data).ok()??;
        Some(String::from_utf8_lossy(bytes).into_owned())
    })
}

/// Where a file mapped by process `pid` at `range` ("start-end" from its
/// maps) can be opened, best first: /proc/PID/map_files opens the very file
/// mapped, wherever the target's root is (a container, a chroot) and even
/// once it is deleted; then the path inside the target's root; then the
/// path as the host sees it.
pub fn mapped_file_paths(pid: u32, range: &str, path: &str) -> [PathBuf; 3] {
    let inside = Path::new(path).strip_prefix("/").unwrap_or(Path::new(path));
    [
        PathBuf::from(format!("/proc/{pid}/map_files/{range}")),
        PathBuf::from(format!("/proc/{pid}/root")).join(inside),
        PathBuf::from(path),
    ]
}

/// The file of a /proc/PID/maps line, if it maps one.
pub fn mapped_file(line: &str) -> Option<&str> {
    let path = line.splitn(6, ' ').nth(5)?.trim_start();
    path.starts_with('/').then(|| path.strip_suffix(" (deleted)").unwrap_or(path))
}

/// Finds the allocator functions, named PREFIXmalloc and so on, in one ELF
/// object.
pub fn plan_for_object(path: &Path, display_path: &str, prefix: &str) -> Result<AttachPlan, AllocatorError> {
    let data = fs::read(path).map_err(|source| AllocatorError::Read { path: path.to_path_buf(), source })?;
    let file = object::File::parse(&*data).map_err(|_| AllocatorError::NotElf(path.to_path_buf()))?;
    let addresses = function_addresses(&file, prefix, &ALLOCATOR_FUNCTIONS);
    let mut sites = Vec::new();
    let mut missing = Vec::new();
    for (index, (function, entry_program)) in ALLOCATOR_FUNCTIONS.into_iter().zip(ENTRY_PROGRAMS).enumerate()
    {
        let offset = addresses.get(function).and_then(|&address| file_offset(&file, address));
        let Some(file_offset) = offset else {
            missing.push(function);
            continue;
        };
        // Aliases (glibc's aligned_alloc and memalign share code) are probed
        // once, or every call would count twice; the cookie names them all.
        if let Some(first) = sites.iter_mut().find(|site: &&mut ProbeSite| site.file_offset == file_offset) {
            log::debug!("{function} is an alias of {} in {display_path}: probed once", first.function);
            first.cookie |= 1 << index;
            continue;
        }
        let return_program = (entry_program != programs::FREE_ENTER).then_some(programs::ALLOCATION_RETURN);
        // A return probe needs the entry (it takes over the return
        // address there); a free has none and may skip a costly first
        // instruction.
        let entry_skip = match return_program {
            Some(_) => 0,
            None => {
                let code = data.get(file_offset as usize..).unwrap_or(&[]);
                probe_placement::entry_probe_offset(&code[..code.len().min(32)])
            }
        };
        if entry_skip > 0 {
            log::debug!(
                "{function}: entry probe at +{entry_skip}, past `test %rdi,%rdi`, on the NULL check's jump, which the kernel emulates instead of single-stepping"
            );
        }
        sites.push(ProbeSite {
            function,
            entry_program,
            return_program,
            file_offset,
            entry_skip,
            cookie: 1 << index,
        });
    }
    // mmap & co. are the C library's, never prefixed.
    let mapping_names = MAPPING_FUNCTIONS.map(|(name, _, _)| name);
    let mapping_addresses = function_addresses(&file, "", &mapping_names);
    for (function, entry_program, return_program) in MAPPING_FUNCTIONS {
        let offset = mapping_addresses.get(function).and_then(|&address| file_offset(&file, address));
        let Some(file_offset) = offset else { continue };
        if sites.iter().any(|site| site.file_offset == file_offset) {
            continue; // mmap64 is mmap
        }
        sites.push(ProbeSite {
            function,
            entry_program,
            return_program,
            file_offset,
            entry_skip: 0,
            cookie: 0,
        });
    }
    // An allocator needs malloc and a way to free. A binary linked with
    // tikv-jemallocator keeps only what Rust calls: _rjem_sdallocx, no free.
    let frees = ["free", "sdallocx", "dallocx"];
    if missing.contains(&"malloc") || frees.iter().all(|free| missing.contains(free)) {
        return Err(if prefix.is_empty() {
            AllocatorError::NoAllocator(path.to_path_buf())
        } else {
            AllocatorError::NoPrefixedAllocator {
                prefix: prefix.to_owned(),
                searched: display_path.to_owned(),
            }
        });
    }
    for function in &missing {
        log::debug!("{display_path} does not define {function}: not probed");
    }
    Ok(AttachPlan { path: path.to_path_buf(), display_path: display_path.to_owned(), sites })
}

/// Addresses of the defined functions among `names`, by unprefixed name,
/// from .dynsym first (what a stripped library still has), then .symtab.
fn function_addresses(file: &object::File, prefix: &str, names: &[&str]) -> BTreeMap<String, u64> {
    let mut addresses = BTreeMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.is_undefined() || symbol.address() == 0 || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        let Some(name) = symbol.name().ok().and_then(|name| name.strip_prefix(prefix)) else { continue };
        if names.contains(&name) {
            addresses.entry(name.to_owned()).or_insert(symbol.address());
        }
    }
    addresses
}

/// Converts a virtual address to the file offset uprobes are placed by.
fn file_offset(file: &object::File, address: u64) -> Option<u64> {
    file.segments().find_map(|segment| {
        let (offset, size) = segment.file_range();
        let start = segment.address();
        (address >= start && address < start + size).then(|| address - start + offset)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_name_their_files() {
        let line = "7f1c2a000000-7f1c2a022000 r--p 00000000 fe:01 1312 /usr/lib/x86_64-linux-gnu/libc.so.6";
        assert_eq!(mapped_file(line), Some("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        let deleted = "55d0-55d1 r-xp 00001000 fe:01 77 /tmp/app (deleted)";
        assert_eq!(mapped_file(deleted), Some("/tmp/app"));
        assert_eq!(mapped_file("7ffd-7ffe rw-p 00000000 00:00 0 [stack]"), None);
        assert_eq!(mapped_file("7ffd-7ffe rw-p 00000000 00:00 0"), None);
    }

    #[test]
    fn link_order_puts_the_binary_then_preloads_then_needed_libraries_first() {
        let mapped =
            ["/app/redis", "/lib/ld.so", "/lib/libc.so.6", "/lib/libm.so.6", "/opt/libjemalloc.so.2"];
        let needed = ["libjemalloc.so.2".to_owned(), "libm.so.6".to_owned(), "libc.so.6".to_owned()];
        assert_eq!(
            link_order(&mapped, &[], &needed),
            ["/app/redis", "/opt/libjemalloc.so.2", "/lib/libm.so.6", "/lib/libc.so.6", "/lib/ld.so"]
        );
        let preloads = ["/opt/libtcmalloc.so".to_owned()];
        let mapped = ["/app/a", "/lib/libc.so.6", "/opt/libtcmalloc.so"];
        assert_eq!(
            link_order(&mapped, &preloads, &["libc.so.6".to_owned()]),
            ["/app/a", "/opt/libtcmalloc.so", "/lib/libc.so.6"]
        );
    }

    #[test]
    fn preloads_are_read_from_the_environment() {
        let environ = b"HOME=/root\0LD_PRELOAD=/a.so:/b.so c.so\0PATH=/bin\0";
        assert_eq!(preloads(environ), ["/a.so", "/b.so", "c.so"]);
    }

    #[test]
    fn needed_libraries_come_in_order() {
        let data = fs::read("/proc/self/exe").unwrap();
        let needed = needed_libraries(&data);
        assert!(needed.iter().any(|name| name == "libc.so.6"), "{needed:?}");
    }

    #[test]
    fn glibc_plan_probes_every_function_once() {
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let plan = plan_for_object(libc, "libc.so.6", "").expect("the host libc has an allocator");
        let functions: Vec<_> = plan.sites.iter().map(|site| site.function).collect();
        for function in ["malloc", "calloc", "realloc", "free", "posix_memalign", "valloc", "mmap", "munmap"]
        {
            assert!(functions.contains(&function), "{function} missing from {functions:?}");
        }
        let free = plan.sites.iter().find(|site| site.function == "free").unwrap();
        assert_eq!(free.entry_skip, 3, "glibc's free starts with test %rdi,%rdi; je");
        assert!(plan
            .sites
            .iter()
            .filter(|site| site.return_program.is_some())
            .all(|site| site.entry_skip == 0));
        let mut offsets: Vec<_> = plan.sites.iter().map(|site| site.file_offset).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(offsets.len(), plan.sites.len(), "an offset is probed twice: {:?}", plan.sites);
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused() {
        let error = plan_for_object(Path::new("/etc/hostname"), "/etc/hostname", "").unwrap_err();
        assert!(matches!(error, AllocatorError::NotElf(_)), "{error}");
    }
}

#[cfg(test)]
mod prefix_tests {
    use super::*;

    #[test]
    fn a_prefix_that_matches_nothing_names_the_object() {
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let error = plan_for_object(libc, "/lib/x86_64-linux-gnu/libc.so.6", "je_").unwrap_err();
        assert_eq!(
            error.to_string(),
            "no je_malloc and je_free in /lib/x86_64-linux-gnu/libc.so.6: check --symbols-prefix, or give -O the object"
        );
    }

    #[test]
    fn a_prefix_is_stripped_before_matching() {
        // glibc exports __libc_malloc and __libc_free beside malloc and free.
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let plan = plan_for_object(libc, "libc.so.6", "__libc_").expect("glibc has __libc_malloc");
        let functions: Vec<_> = plan.sites.iter().map(|site| site.function).collect();
        assert!(functions.contains(&"malloc") && functions.contains(&"free"), "{functions:?}");
    }
}
