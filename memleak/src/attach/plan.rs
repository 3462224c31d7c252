//! The attach plan: which object serves the target's allocations, and at
//! which file offsets each allocator function starts.

use std::{
    fs::{self, File},
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
};

use memleak_common::{FunctionSet, ALLOCATOR_FUNCTIONS, MAPPING_FUNCTIONS};

use super::{link_order, placement};
use crate::{
    elf,
    process::{files, AddressSpace},
};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
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
    #[error("{0} is a Go program without cgo: Go allocates through its own runtime, not malloc, so there is nothing for memleak to probe (it traces the C allocations of Go programs built with cgo; for the Go heap, use runtime/pprof)")]
    GoWithoutCgo(String),
    #[error("cannot run `{0}`: it is neither an ELF executable nor a #! script")]
    NotExecutable(PathBuf),
    #[error("cannot find the libc that {program} will load: `{loader} --list` failed: {reason}")]
    Loader { program: PathBuf, loader: String, reason: String },
}

/// Which allocator to probe, as the user chose it.
#[derive(Clone, Debug, Default)]
pub struct AllocatorChoice {
    /// This object (-O), instead of the one the target's link map finds.
    pub object: Option<PathBuf>,
    /// Functions are named with this prefix (--symbols-prefix); `None`
    /// tries the plain names, then the prefixes of `AUTO_PREFIXES`.
    pub prefix: Option<String>,
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
    /// Its length in bytes, as its symbol says (0 if it does not).
    pub code_length: u64,
    /// Bytes past the start the entry and return probes go; see
    /// `placement`.
    pub entry_skip: u64,
    /// The function and each alias sharing its code; given to the probes
    /// as their attach cookie. Empty for the mapping functions.
    pub functions: FunctionSet,
}

impl ProbeSite {
    /// The site with its probes placed past its first instructions when
    /// that is safe (`entry_skip`): see `placement`. `data` is the
    /// object's file.
    fn placed(self, data: &[u8], display_path: &str) -> Self {
        Self { entry_skip: probes_offset(&self, data, display_path), ..self }
    }
}

/// The object to probe and the probe sites in it.
#[derive(Clone, Debug)]
pub struct AttachPlan {
    /// Path that opens the object from memleak's own mount namespace:
    /// memleak's descriptor of the file planned from (`object`).
    pub path: PathBuf,
    /// The object as the target names it, for reports.
    pub display_path: String,
    pub sites: Vec<ProbeSite>,
    /// The file planned from, held open for `path`; `None` for the kernel.
    pub object: Option<Arc<File>>,
    /// When the allocator's object has no mmap & co. (jemalloc's library
    /// calls the C library's), the C library's, probed for the program's
    /// own mappings: only mapping sites.
    pub mapping_object: Option<Box<AttachPlan>>,
}

impl AttachPlan {
    /// A plan of `sites` in `object`, which it holds open and probes
    /// through memleak's descriptor of it.
    fn holding(object: File, display_path: &str, sites: Vec<ProbeSite>) -> Self {
        let object = Arc::new(object);
        Self {
            path: PathBuf::from(format!("/proc/self/fd/{}", object.as_raw_fd())),
            display_path: display_path.to_owned(),
            sites,
            object: Some(object),
            mapping_object: None,
        }
    }

    /// What was probed, for people: "libc.so.6 (13 functions probed)".
    pub fn describe(&self) -> String {
        let own = format!("{} ({} functions probed)", self.display_path, self.sites.len());
        match &self.mapping_object {
            Some(mapping) => format!("{own}, with mmap & co. in {}", mapping.display_path),
            None => own,
        }
    }

    /// Adds the mapping functions of the first of `candidates` (link-map
    /// order) that has them, unless the allocator's object has its own.
    fn with_mapping_functions(mut self, candidates: &[(PathBuf, String)]) -> Self {
        if self.sites.iter().any(|site| site.functions == FunctionSet::default()) {
            return self;
        }
        self.mapping_object =
            candidates.iter().find_map(|(path, display)| mapping_plan(path, display)).map(Box::new);
        self
    }

    /// Whether `file_offset` of `mapped` lies inside one of the allocator's
    /// entry points: code that runs only during a call into the allocator.
    pub fn in_allocator_call(&self, mapped: &File, file_offset: u64) -> bool {
        let Some(object) = &self.object else { return false };
        let same_file = |a: &File, b: &File| match (a.metadata(), b.metadata()) {
            (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
            _ => false,
        };
        self.sites.iter().any(|site| {
            site.functions != FunctionSet::default()
                && (site.file_offset..site.file_offset + site.code_length).contains(&file_offset)
        }) && same_file(object, mapped)
    }
}

/// Symbol prefixes tried when the user names none: plain names, then
/// jemalloc's `je_` and tikv-jemallocator's `_rjem_` builds.
const AUTO_PREFIXES: [&str; 3] = ["", "je_", "_rjem_"];

/// Plans probes for a running process: the chosen object if there is one,
/// else the first object in link-map order that defines the allocator.
/// That order is the binary, then `LD_PRELOAD`, then the binary's `DT_NEEDED`
/// libraries, so a preloaded or linked-in jemalloc wins over libc, as it
/// does in the dynamic linker.
pub fn plan_for_process(space: &AddressSpace, choice: &AllocatorChoice) -> Result<AttachPlan, PlanError> {
    let candidates = link_ordered_objects(space);
    let prefix = choice.prefix.as_deref();
    if let Some(object) = &choice.object {
        // As the target sees it: a container's own file, never the host's.
        let pid = space.pid();
        let display = if files::shares_root(pid) {
            object.display().to_string()
        } else {
            format!("{} in the root of pid {pid}", object.display())
        };
        let file = files::open_in_root(pid, object)
            .map_err(|source| PlanError::Read { path: PathBuf::from(&display), source })?;
        return Ok(plan_for_file(file, &display, prefix.unwrap_or(""))?.with_mapping_functions(&candidates));
    }
    first_allocator(&candidates, prefix)
}

/// The objects process `space` maps, in link-map order, each as memleak's
/// path to it and the path the process names it by.
fn link_ordered_objects(space: &AddressSpace) -> Vec<(PathBuf, String)> {
    let objects = space.objects();
    let needed = objects
        .first()
        .and_then(|binary| files::read_regular(&binary.fd_path()).ok())
        .map(|data| elf::needed_libraries(&data))
        .unwrap_or_default();
    let environ = fs::read(format!("/proc/{}/environ", space.pid())).unwrap_or_default();
    let mapped: Vec<&str> = objects.iter().map(|object| object.path.as_str()).collect();
    let ordered = link_order::link_order(&mapped, &link_order::preloads(&environ), &needed);
    ordered
        .iter()
        .filter_map(|path| objects.iter().find(|object| object.path == *path))
        // Probed through memleak's own descriptor: the very file read here,
        // whatever the target's root holds at its path.
        .map(|object| (object.fd_path(), object.name.clone()))
        .collect()
}

/// Plans probes for a program about to be run: the chosen object if there
/// is one, else the first object in the link map its dynamic loader will
/// build (asked of the loader itself, so `LD_PRELOAD`, `LD_LIBRARY_PATH` and
/// the ld.so cache count) that defines the allocator.
pub fn plan_for_program(program: &Path, choice: &AllocatorChoice) -> Result<AttachPlan, PlanError> {
    let data = files::read_regular(program)
        .map_err(|source| PlanError::Read { path: program.to_path_buf(), source })?;
    if let Some(interpreter) = script_interpreter(&data) {
        // A script: the allocator is its interpreter's.
        return plan_for_program(&interpreter, choice);
    }
    let file = object::File::parse(&*data).map_err(|_| PlanError::NotExecutable(program.to_path_buf()))?;
    let mut candidates = vec![(program.to_path_buf(), program.display().to_string())];
    if let Some(loader) = elf::interpreter(&file) {
        for library in loaded_libraries(program, &loader)? {
            candidates.push((PathBuf::from(&library), library));
        }
    }
    if let Some(object) = &choice.object {
        let plan =
            plan_for_object(object, &object.display().to_string(), choice.prefix.as_deref().unwrap_or(""))?;
        return Ok(plan.with_mapping_functions(&candidates));
    }
    first_allocator(&candidates, choice.prefix.as_deref())
}

/// The libraries `program` will load, in load order, as its dynamic loader
/// resolves them (`ld.so --list` loads them but runs none of their code).
fn loaded_libraries(program: &Path, loader: &str) -> Result<Vec<String>, PlanError> {
    let fail = |reason: String| PlanError::Loader {
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

/// The first candidate that defines `PREFIXmalloc` and `PREFIXfree`; with no
/// prefix given, the first that does so under any of `AUTO_PREFIXES`.
fn first_allocator(candidates: &[(PathBuf, String)], prefix: Option<&str>) -> Result<AttachPlan, PlanError> {
    let prefixes: &[&str] = match prefix {
        Some(prefix) => &[prefix],
        None => &AUTO_PREFIXES,
    };
    let found = candidates.iter().find_map(|(path, display)| {
        prefixes.iter().find_map(|prefix| plan_for_object(path, display, prefix).ok())
    });
    let found = found.map(|plan| plan.with_mapping_functions(candidates));
    found.ok_or_else(|| {
        // The program comes first; a Go program without cgo is the only
        // object and never calls a C allocator.
        if let Some((program, display)) = candidates.first() {
            let data = files::read_regular(program).unwrap_or_default();
            if object::File::parse(&*data).is_ok_and(|file| elf::is_go_program(&file)) {
                return PlanError::GoWithoutCgo(display.clone());
            }
        }
        let searched = candidates.iter().map(|(_, display)| display.as_str()).collect::<Vec<_>>().join(", ");
        match prefix {
            None => PlanError::NoKnownAllocator { searched },
            Some(prefix) => PlanError::NoPrefixedAllocator { prefix: prefix.to_owned(), searched },
        }
    })
}

/// The interpreter named on a script's `#!` line.
fn script_interpreter(data: &[u8]) -> Option<PathBuf> {
    let line = data.strip_prefix(b"#!")?.split(|&byte| byte == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    line.split_whitespace().next().map(PathBuf::from)
}

/// Finds the allocator functions, named `PREFIXmalloc` and so on, in one ELF
/// object, and the mapping functions beside them.
pub fn plan_for_object(path: &Path, display_path: &str, prefix: &str) -> Result<AttachPlan, PlanError> {
    let read_error = |source| PlanError::Read { path: PathBuf::from(display_path), source };
    plan_for_file(files::open_regular(path).map_err(read_error)?, display_path, prefix)
}

/// As `plan_for_object`, for a file opened already: the plan probes that
/// very file, through memleak's own descriptor, whatever its path leads to
/// by the time the probes are placed.
fn plan_for_file(object: File, display_path: &str, prefix: &str) -> Result<AttachPlan, PlanError> {
    let read_error = |source| PlanError::Read { path: PathBuf::from(display_path), source };
    let data = files::read_limited(&object, files::READ_LIMIT).map_err(read_error)?;
    let path = PathBuf::from(display_path);
    let file = object::File::parse(&*data).map_err(|_| PlanError::NotElf(path.clone()))?;
    let (mut sites, missing) = allocator_sites(&file, &data, prefix, display_path);
    // An allocator needs malloc and a way to free. A binary linked with
    // tikv-jemallocator keeps only what Rust calls: _rjem_sdallocx, no free.
    let frees = ["free", "sdallocx", "dallocx"];
    if missing.contains(&"malloc") || frees.iter().all(|free| missing.contains(free)) {
        return Err(if prefix.is_empty() {
            PlanError::NoAllocator(path.clone())
        } else {
            PlanError::NoPrefixedAllocator { prefix: prefix.to_owned(), searched: display_path.to_owned() }
        });
    }
    for function in &missing {
        log::debug!("{display_path} does not define {function}: not probed");
    }
    let mapping = mapping_sites(&file, &data, &sites, display_path);
    sites.extend(mapping);
    Ok(AttachPlan::holding(object, display_path, sites))
}

/// A plan of only the mapping functions of the object at `path`, if it
/// defines any (the C library does).
fn mapping_plan(path: &Path, display_path: &str) -> Option<AttachPlan> {
    let object = files::open_regular(path).ok()?;
    let data = files::read_limited(&object, files::READ_LIMIT).ok()?;
    let sites = mapping_sites(&object::File::parse(&*data).ok()?, &data, &[], display_path);
    if sites.is_empty() {
        return None;
    }
    Some(AttachPlan::holding(object, display_path, sites))
}

/// A site for each allocator function the object defines, aliases probed
/// once; and the names of those it does not define.
fn allocator_sites(
    file: &object::File,
    data: &[u8],
    prefix: &str,
    display_path: &str,
) -> (Vec<ProbeSite>, Vec<&'static str>) {
    let names = ALLOCATOR_FUNCTIONS.map(|function| function.name);
    let symbols = elf::function_symbols(file, prefix, &names);
    let mut sites: Vec<ProbeSite> = Vec::new();
    let mut missing = Vec::new();
    for (index, function) in ALLOCATOR_FUNCTIONS.iter().enumerate() {
        let symbol = symbols.get(function.name);
        let Some((file_offset, symbol)) =
            symbol.and_then(|symbol| Some((elf::file_offset(file, symbol.address)?, symbol)))
        else {
            missing.push(function.name);
            continue;
        };
        // Aliases (glibc's aligned_alloc and memalign share code) are probed
        // once, or every call would count twice; the cookie names them all.
        if let Some(first) = sites.iter_mut().find(|site| site.file_offset == file_offset) {
            log::debug!("{} is an alias of {} in {display_path}: probed once", function.name, first.function);
            first.functions = first.functions.union(FunctionSet::of(index));
            continue;
        }
        let site = ProbeSite {
            function: function.name,
            entry_program: function.entry_program,
            return_program: function.return_program(),
            file_offset,
            code_length: symbol.size,
            entry_skip: 0,
            functions: FunctionSet::of(index),
        };
        sites.push(site.placed(data, display_path));
    }
    (sites, missing)
}

/// Bytes past a function's start to put its probes at: see `placement`.
/// Without a size, its branches cannot be checked, and it keeps the entry.
fn probes_offset(site: &ProbeSite, data: &[u8], display_path: &str) -> u64 {
    // Past this, a function's branches are not looked through: no
    // allocator entry point is near that long.
    const LONGEST: u64 = 64 << 10;
    let code = usize::try_from(site.file_offset)
        .ok()
        .zip(usize::try_from(site.code_length.min(LONGEST)).ok())
        .and_then(|(start, length)| data.get(start..start.checked_add(length)?))
        .unwrap_or(&[]);
    let function = site.function;
    let placement = placement::probe_placement(code, placement::arguments_read(site.entry_program));
    match placement.single_stepped {
        _ if placement.offset > 0 => log::debug!(
            "{function} in {display_path}: probes at +{}, on `{:?}`, which the kernel emulates, past what it would single-step",
            placement.offset,
            placement.probed
        ),
        Some(first) => log::debug!(
            "{function} in {display_path}: probes at the entry, on `{first:?}`, which the kernel single-steps: no emulated instruction they may move to"
        ),
        None => {}
    }
    placement.offset
}

/// A site for each mapping function the object defines that is not
/// already among `sites`. mmap & co. are the C library's, never prefixed.
fn mapping_sites(
    file: &object::File,
    data: &[u8],
    sites: &[ProbeSite],
    display_path: &str,
) -> Vec<ProbeSite> {
    let names = MAPPING_FUNCTIONS.map(|function| function.name);
    let symbols = elf::function_symbols(file, "", &names);
    let mut mapping: Vec<ProbeSite> = Vec::new();
    for function in MAPPING_FUNCTIONS {
        let symbol = symbols.get(function.name);
        let Some((file_offset, symbol)) =
            symbol.and_then(|symbol| Some((elf::file_offset(file, symbol.address)?, symbol)))
        else {
            continue;
        };
        if sites.iter().chain(&mapping).any(|site| site.file_offset == file_offset) {
            continue; // mmap64 is mmap
        }
        mapping.push(
            ProbeSite {
                function: function.name,
                entry_program: function.entry_program,
                return_program: function.return_program,
                file_offset,
                code_length: symbol.size,
                entry_skip: 0,
                functions: FunctionSet::default(),
            }
            .placed(data, display_path),
        );
    }
    mapping
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut offsets: Vec<_> = plan.sites.iter().map(|site| site.file_offset).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(offsets.len(), plan.sites.len(), "an offset is probed twice: {:?}", plan.sites);
    }

    #[test]
    fn debians_allocators_are_probed_past_what_the_kernel_single_steps() {
        // (library, function, bytes past its entry) on Debian 12's builds;
        // the end-to-end tests check the counts are exact with these.
        let expected = [
            ("libjemalloc.so.2", "malloc", 7), // cmp $0x1000,%rdi; ja
            ("libjemalloc.so.2", "free", 48),  // nine moves and arithmetic; jne
            ("libtcmalloc_minimal.so.4", "free", 10),
            ("libmimalloc.so.2", "free", 6), // mov %rdi,%rcx; test %rdi,%rdi; je
            ("libc.so.6", "malloc", 0),      // push %r12, emulated where it is
        ];
        for (library, function, offset) in expected {
            let path = Path::new("/usr/lib/x86_64-linux-gnu").join(library);
            let plan = plan_for_object(&path, library, "").expect("installed by cargo xtask test");
            let site = plan.sites.iter().find(|site| site.function == function).unwrap();
            assert_eq!(site.entry_skip, offset, "{library} {function}");
        }
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused() {
        let error = plan_for_object(Path::new("/etc/hostname"), "/etc/hostname", "").unwrap_err();
        assert!(matches!(error, PlanError::NotElf(_)), "{error}");
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
