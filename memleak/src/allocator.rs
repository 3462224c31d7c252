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
    #[error("process {pid} maps no libc and its binary {binary} has no malloc: give -O the object that provides the allocator")]
    NoLibc { pid: u32, binary: String },
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
    pub file_offset: u64,
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

/// Plans probes for a running process: `object` if given; else, with a
/// symbol prefix, the first mapped object that defines PREFIXmalloc; else
/// the libc it maps, or its own binary when that is statically linked.
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
    let mut mapped: Vec<&str> = Vec::new();
    for file in maps.lines().filter_map(mapped_file) {
        if !mapped.contains(&file) {
            mapped.push(file);
        }
    }
    let candidates: Vec<(PathBuf, String)> =
        mapped.iter().map(|file| (in_root(Path::new(file)), (*file).to_owned())).collect();
    if !prefix.is_empty() {
        return first_with_prefix(&candidates, prefix);
    }
    if let Some((path, display)) = candidates.iter().find(|(_, display)| is_libc(display)) {
        return plan_for_object(path, display, prefix);
    }
    let binary = mapped.first().copied().unwrap_or("");
    match plan_for_object(&in_root(Path::new(binary)), binary, prefix) {
        Err(AllocatorError::NoAllocator(_) | AllocatorError::NotElf(_) | AllocatorError::Read { .. }) => {
            Err(AllocatorError::NoLibc { pid, binary: binary.to_owned() })
        }
        plan => plan,
    }
}

/// Plans probes for a program about to be run: `object` if given; else,
/// with a symbol prefix, the first of the program and its libraries that
/// defines PREFIXmalloc; else the libc its dynamic loader resolves (asked
/// of the loader itself, so LD_LIBRARY_PATH and the ld.so cache count),
/// else the program itself.
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
    if !prefix.is_empty() {
        return first_with_prefix(&candidates, prefix);
    }
    let (path, display) = candidates.iter().find(|(_, display)| is_libc(display)).unwrap_or(&candidates[0]);
    plan_for_object(path, display, prefix)
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
    // Lines look like "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x7f...)".
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once("=> ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|path| path.starts_with('/'))
        .map(str::to_owned)
        .collect())
}

/// The first candidate that defines PREFIXmalloc and PREFIXfree.
fn first_with_prefix(candidates: &[(PathBuf, String)], prefix: &str) -> Result<AttachPlan, AllocatorError> {
    candidates.iter().find_map(|(path, display)| plan_for_object(path, display, prefix).ok()).ok_or_else(
        || AllocatorError::NoPrefixedAllocator {
            prefix: prefix.to_owned(),
            searched: candidates.iter().map(|(_, display)| display.as_str()).collect::<Vec<_>>().join(", "),
        },
    )
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

/// The file of a /proc/PID/maps line, if it maps one.
pub fn mapped_file(line: &str) -> Option<&str> {
    let path = line.splitn(6, ' ').nth(5)?.trim_start();
    path.starts_with('/').then(|| path.strip_suffix(" (deleted)").unwrap_or(path))
}

fn is_libc(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("libc.so") || name.starts_with("libc-") || name.starts_with("ld-musl-")
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
        let return_program = (function != "free").then_some(programs::ALLOCATION_RETURN);
        sites.push(ProbeSite { function, entry_program, return_program, file_offset, cookie: 1 << index });
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
        sites.push(ProbeSite { function, entry_program, return_program, file_offset, cookie: 0 });
    }
    if missing.contains(&"malloc") || missing.contains(&"free") {
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
    fn libc_is_recognised_by_file_name() {
        assert!(is_libc("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(is_libc("/lib/libc-2.31.so"));
        assert!(is_libc("/lib/ld-musl-x86_64.so.1"));
        assert!(!is_libc("/usr/lib/libcap.so.2"));
        assert!(!is_libc("/usr/lib/x86_64-linux-gnu/libcrypt.so.1"));
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
