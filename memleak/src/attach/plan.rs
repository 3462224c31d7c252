//! The attach plan: which object serves the target's allocations, and at
//! which file offsets each allocator function starts.

use std::{
    fmt::Write as _,
    fs::{self, File},
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
};

use memleak_common::{FunctionSet, ALLOCATOR_FUNCTIONS, MAPPING_FUNCTIONS, PROBED_AFTER_SYSTEM_CALL};

use super::{
    link_order,
    operators::{self, Form, Landing},
    placement,
    python_allocator::{self, Interpreter, Probing},
};
use crate::{
    elf,
    process::{files, AddressSpace},
};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot open {path}: {source}: memleak holds as many files as its limit allows (raise it: ulimit -n, or LimitNOFILE= in its unit)")]
    OutOfDescriptors { path: PathBuf, source: std::io::Error },
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
    /// Also probe CPython's `PyObject_Malloc` & co. in the interpreter's
    /// object (--python-allocator).
    pub python_allocator: bool,
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
    /// Whether the entry probe is past the function's system call.
    pub after_system_call: bool,
    /// The function and each alias sharing its code; given to the probes
    /// as their attach cookie. Empty for the mapping functions.
    pub functions: FunctionSet,
}

impl ProbeSite {
    /// The site with its probes placed past its first instructions when
    /// that is safe (`entry_skip`): see `placement`. `data` is the
    /// object's file.
    fn placed(self, data: &[u8], display_path: &str) -> Self {
        let placement = placement_of(&self, data, display_path);
        Self { entry_skip: placement.offset, after_system_call: placement.after_system_call, ..self }
    }

    /// The attach cookie of its probes: the functions it is, and whether
    /// the entry probe comes after the system call.
    pub fn cookie(&self) -> u64 {
        let after = if self.after_system_call { PROBED_AFTER_SYSTEM_CALL } else { 0 };
        u64::from(self.functions.0) | after
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
    /// Objects before the allocator's in link-map order that define forms
    /// of C++'s `operator new` or `delete` the program's calls land in
    /// (the program's own, say): only those sites.
    pub operator_objects: Vec<AttachPlan>,
    /// The forms of `operator new` and `delete` the program's calls land
    /// in that are not probed, and why.
    pub not_probed: Vec<NotProbed>,
    /// The CPython interpreter the process runs, if it runs one: its
    /// arenas are its own mappings.
    pub interpreter: Option<Interpreter>,
    /// With --python-allocator, its object: only the sites of
    /// `PyObject_Malloc` & co.
    pub interpreter_object: Option<Box<AttachPlan>>,
}

/// A form of C++'s `operator new` or `delete` that calls land in, not
/// probed because its probe would add nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotProbed {
    /// The form, as it reads: "operator delete(void*)".
    pub function: &'static str,
    /// The object that defines it, as the process names it.
    pub object: String,
    /// Why: "only jumps to free, probed".
    pub why: String,
}

impl AttachPlan {
    /// A plan of `sites` in `object`, which it holds open and probes
    /// through memleak's descriptor of it.
    fn holding(object: File, display_path: &str, sites: Vec<ProbeSite>) -> Self {
        Self::holding_shared(Arc::new(object), display_path, sites)
    }

    /// As `holding`, for an object held elsewhere too.
    fn holding_shared(object: Arc<File>, display_path: &str, sites: Vec<ProbeSite>) -> Self {
        Self {
            path: PathBuf::from(format!("/proc/self/fd/{}", object.as_raw_fd())),
            display_path: display_path.to_owned(),
            sites,
            object: Some(object),
            mapping_object: None,
            operator_objects: Vec::new(),
            not_probed: Vec::new(),
            interpreter: None,
            interpreter_object: None,
        }
    }

    /// The objects besides this one whose sites are probed with it.
    pub fn other_objects(&self) -> impl Iterator<Item = &AttachPlan> {
        self.mapping_object
            .iter()
            .map(Box::as_ref)
            .chain(&self.operator_objects)
            .chain(self.interpreter_object.as_deref())
    }

    /// What was probed, for people: "libc.so.6 (13 functions probed)".
    pub fn describe(&self) -> String {
        let mut own = format!("{} ({} functions probed)", self.display_path, self.sites.len());
        for operators in &self.operator_objects {
            let _ = write!(
                own,
                ", with operator new and delete in {} ({} probed)",
                operators.display_path,
                operators.sites.len()
            );
        }
        if let Some(interpreter) = &self.interpreter_object {
            let _ = write!(own, ", with PyObject_Malloc & co. in {}", interpreter.display_path);
        }
        match &self.mapping_object {
            Some(mapping) => format!("{own}, with mmap & co. in {}", mapping.display_path),
            None => own,
        }
    }

    /// Notes the CPython interpreter among `candidates` (link-map order),
    /// if there is one, and with `python_allocator` plans its
    /// `PyObject_Malloc` & co., when they see every small object (see
    /// `python_allocator`). Says why they are not probed when asked to be.
    fn with_interpreter(mut self, candidates: &[(PathBuf, String)], python_allocator: bool) -> Self {
        let Some(python_allocator::Found { object, data, display_path: display, arena_size }) =
            python_allocator::find(candidates)
        else {
            if python_allocator {
                log::warn!(
                    "--python-allocator: no CPython in {}: only the C allocator is probed",
                    candidates.first().map_or("the process", |(_, display)| display.as_str())
                );
            }
            return self;
        };
        let probing = if python_allocator { python_allocator::probing(&data) } else { Probing::Sound };
        let objects_tracked = python_allocator && probing == Probing::Sound;
        if let Probing::Inlined { copies } = probing {
            log::warn!(
                "--python-allocator: {display} has its small-object allocator inlined into {copies} places (a build with link-time optimisation), which PyObject_Malloc & co.'s probes would not see: not probed; its arenas are reported as its own (started with PYTHONMALLOC=malloc, it makes each object with malloc, which memleak sees)"
            );
        }
        let object = Arc::new(object);
        let interpreter = Interpreter { file: Arc::clone(&object), arena_size, objects_tracked };
        if objects_tracked {
            if let Ok(file) = object::File::parse(&*data) {
                let sites = python_sites(&file, &data, &display);
                self.interpreter_object = Some(Box::new(AttachPlan::holding_shared(object, &display, sites)));
            }
        }
        self.interpreter = Some(interpreter);
        self
    }

    /// Whether `mapped` is the interpreter's object.
    pub fn is_interpreter(&self, mapped: &File) -> bool {
        self.interpreter.as_ref().is_some_and(|interpreter| same_file(&interpreter.file, mapped))
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
        let inside = self.sites.iter().any(|site| {
            site.functions != FunctionSet::default()
                && (site.file_offset..site.file_offset + site.code_length).contains(&file_offset)
        }) && same_file(object, mapped);
        inside
            || self.operator_objects.iter().any(|operators| operators.in_allocator_call(mapped, file_offset))
            || self
                .interpreter_object
                .as_ref()
                .is_some_and(|python| python.in_allocator_call(mapped, file_offset))
    }
}

/// Whether `a` and `b` are the same file.
fn same_file(a: &File, b: &File) -> bool {
    match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// The sites of `PyObject_Malloc` & co. in the interpreter's object.
fn python_sites(file: &object::File, data: &[u8], display_path: &str) -> Vec<ProbeSite> {
    let names: Vec<&str> = python_allocator::functions().map(|(_, name)| name).collect();
    let symbols = elf::function_symbols(file, "", &names);
    let mut sites = Vec::new();
    for (index, name) in python_allocator::functions() {
        let Some(symbol) = symbols.get(name) else { continue };
        let Some(file_offset) = elf::file_offset(file, symbol.address) else { continue };
        FunctionSite { index, name, file_offset, symbol }.add_to(&mut sites, data, display_path);
    }
    sites
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
        return Ok(plan_for_file(file, &display, prefix.unwrap_or(""))?
            .with_mapping_functions(&candidates)
            .with_interpreter(&candidates, choice.python_allocator));
    }
    Ok(first_allocator(&candidates, prefix)?.with_interpreter(&candidates, choice.python_allocator))
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
        return Ok(plan
            .with_mapping_functions(&candidates)
            .with_interpreter(&candidates, choice.python_allocator));
    }
    Ok(first_allocator(&candidates, choice.prefix.as_deref())?
        .with_interpreter(&candidates, choice.python_allocator))
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
/// prefix given, the first that does so under any of `AUTO_PREFIXES`. The
/// forms of C++'s `operator new` and `delete` are planned where the
/// program's calls land: in the first candidate that defines each, up to
/// the allocator's object (see `operators`).
fn first_allocator(candidates: &[(PathBuf, String)], prefix: Option<&str>) -> Result<AttachPlan, PlanError> {
    let prefixes: &[&str] = match prefix {
        Some(prefix) => &[prefix],
        None => &AUTO_PREFIXES,
    };
    // Forms defined by an object before the allocator's: calls land there.
    let mut bound: Vec<Form> = Vec::new();
    let mut earlier: Vec<EarlierObject> = Vec::new();
    let mut not_probed = Vec::new();
    for (index, (path, display)) in candidates.iter().enumerate() {
        let (object, data) = match read_object(path, display) {
            Ok(read) => read,
            // Out of descriptors, every object would be skipped, and the
            // process said to have no allocator.
            Err(PlanError::Read { source, .. }) if is_out_of_descriptors(&source) => {
                return Err(PlanError::OutOfDescriptors { path: PathBuf::from(display), source });
            }
            Err(_) => continue,
        };
        let Ok(file) = object::File::parse(&*data) else { continue };
        let mut forms = operators::defined_forms(&file, index == 0);
        forms.retain(|(form, _)| !bound.contains(form));
        let found = prefixes.iter().find_map(|prefix| allocator_sites_in(&file, &data, prefix, display).ok());
        if let Some(mut sites) = found {
            let elsewhere = |_: &str, _: bool| None;
            not_probed.extend(operator_sites(&mut sites, &file, &data, display, &forms, &elsewhere));
            let mut plan = AttachPlan::holding(object, display, sites);
            for other in earlier {
                let (operators, skipped) = other.plan(&plan, &file);
                not_probed.extend(skipped);
                plan.operator_objects.extend(operators);
            }
            plan.not_probed = not_probed;
            for skipped in &plan.not_probed {
                log::debug!("{} in {} is not probed: {}", skipped.function, skipped.object, skipped.why);
            }
            return Ok(plan.with_mapping_functions(candidates));
        }
        bound.extend(forms.iter().map(|(form, _)| *form));
        if operators::is_cxx_runtime(display) {
            not_probed.extend(forms.iter().map(|(form, _)| NotProbed {
                function: form.form.name,
                object: display.clone(),
                why: "the C++ runtime's, which calls malloc and free: their probes see its calls".to_owned(),
            }));
        } else if !forms.is_empty() {
            earlier.push(EarlierObject { object, data, display: display.clone(), forms });
        }
    }
    // The program comes first; a Go program without cgo is the only
    // object and never calls a C allocator.
    if let Some((program, display)) = candidates.first() {
        let data = files::read_regular(program).unwrap_or_default();
        if object::File::parse(&*data).is_ok_and(|file| elf::is_go_program(&file)) {
            return Err(PlanError::GoWithoutCgo(display.clone()));
        }
    }
    let searched = candidates.iter().map(|(_, display)| display.as_str()).collect::<Vec<_>>().join(", ");
    Err(match prefix {
        None => PlanError::NoKnownAllocator { searched },
        Some(prefix) => PlanError::NoPrefixedAllocator { prefix: prefix.to_owned(), searched },
    })
}

/// An object before the allocator's in link-map order that defines forms
/// of C++'s operators the program's calls land in (the program itself,
/// with an `operator new` of its own).
struct EarlierObject {
    object: File,
    data: Vec<u8>,
    display: String,
    forms: Vec<(Form, elf::FunctionSymbol)>,
}

impl EarlierObject {
    /// A plan of its forms worth probing, and those that are not, given
    /// the allocator's `plan` and ELF file: a form that only jumps to a
    /// function probed there (`jmp free@plt`) needs no probe of its own.
    fn plan(
        self,
        allocator: &AttachPlan,
        allocator_file: &object::File,
    ) -> (Option<AttachPlan>, Vec<NotProbed>) {
        let Ok(file) = object::File::parse(&*self.data) else { return (None, Vec::new()) };
        let elsewhere = |name: &str, releases: bool| {
            let offset = elf::dynamic_symbol(allocator_file, name)
                .and_then(|a| elf::file_offset(allocator_file, a))?;
            let site = allocator.sites.iter().find(|site| site.file_offset == offset)?;
            (releases_at(site) == Some(releases))
                .then(|| format!("{} in {}", site.function, allocator.display_path))
        };
        let mut sites = Vec::new();
        let not_probed =
            operator_sites(&mut sites, &file, &self.data, &self.display, &self.forms, &elsewhere);
        let plan = (!sites.is_empty()).then(|| AttachPlan::holding(self.object, &self.display, sites));
        (plan, not_probed)
    }
}

/// Where a site's jumps lead.
enum Reach {
    /// Another site of the same object, at this place.
    Site(usize),
    /// A function probed in another object, as it is to be named.
    Probed(String),
}

/// Whether the functions probed at `site` release memory; `None` for a
/// mapping function's.
fn releases_at(site: &ProbeSite) -> Option<bool> {
    (site.functions != FunctionSet::default()).then(|| site.functions.intersects(FunctionSet::RELEASING))
}

/// The file at `path`, opened and read once.
/// Whether `error` is the process's or the system's descriptors running
/// out.
pub fn is_out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

fn read_object(path: &Path, display_path: &str) -> Result<(File, Vec<u8>), PlanError> {
    let read_error = |source| PlanError::Read { path: PathBuf::from(display_path), source };
    let object = files::open_regular(path).map_err(read_error)?;
    let data = files::read_limited(&object, files::READ_LIMIT).map_err(read_error)?;
    Ok((object, data))
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
/// by the time the probes are placed. The forms of C++'s operators it
/// defines are planned too: the user chose it as the allocator.
fn plan_for_file(object: File, display_path: &str, prefix: &str) -> Result<AttachPlan, PlanError> {
    let read_error = |source| PlanError::Read { path: PathBuf::from(display_path), source };
    let data = files::read_limited(&object, files::READ_LIMIT).map_err(read_error)?;
    let file = object::File::parse(&*data).map_err(|_| PlanError::NotElf(PathBuf::from(display_path)))?;
    let mut sites = allocator_sites_in(&file, &data, prefix, display_path)?;
    let forms = operators::defined_forms(&file, true);
    let not_probed = operator_sites(&mut sites, &file, &data, display_path, &forms, &|_, _| None);
    for skipped in &not_probed {
        log::debug!("{} in {} is not probed: {}", skipped.function, skipped.object, skipped.why);
    }
    let mut plan = AttachPlan::holding(object, display_path, sites);
    plan.not_probed = not_probed;
    Ok(plan)
}

/// The sites of the allocator functions, named `PREFIXmalloc` and so on,
/// in one ELF object, and of the mapping functions beside them; an error
/// if it has no allocator.
fn allocator_sites_in(
    file: &object::File,
    data: &[u8],
    prefix: &str,
    display_path: &str,
) -> Result<Vec<ProbeSite>, PlanError> {
    let path = PathBuf::from(display_path);
    let (mut sites, missing) = allocator_sites(file, data, prefix, display_path);
    // An allocator needs malloc and a way to free. A binary linked with
    // tikv-jemallocator keeps only what Rust calls: _rjem_sdallocx, no free.
    let frees = ["free", "sdallocx", "dallocx"];
    if missing.contains(&"malloc") || frees.iter().all(|free| missing.contains(free)) {
        return Err(if prefix.is_empty() {
            PlanError::NoAllocator(path)
        } else {
            PlanError::NoPrefixedAllocator { prefix: prefix.to_owned(), searched: display_path.to_owned() }
        });
    }
    for function in &missing {
        log::debug!("{display_path} does not define {function}: not probed");
    }
    let mapping = mapping_sites(file, data, &sites, display_path);
    sites.extend(mapping);
    Ok(sites)
}

/// Adds to `sites` a site for each of `forms` (C++ operator forms that
/// `file` defines) worth a probe; returns those that are not. A form at
/// the address of a site already there is an alias: its probe is shared,
/// its cookie bit added. A form whose code only jumps to another site, or
/// to a symbol `elsewhere` says is probed in another object (given the
/// symbol and whether the form releases), is left out.
fn operator_sites(
    sites: &mut Vec<ProbeSite>,
    file: &object::File,
    data: &[u8],
    display_path: &str,
    forms: &[(Form, elf::FunctionSymbol)],
    elsewhere: &dyn Fn(&str, bool) -> Option<String>,
) -> Vec<NotProbed> {
    if forms.is_empty() {
        return Vec::new(); // a C program's: nothing to read the relocations for
    }
    let first_added = sites.len();
    let added = add_form_sites(sites, file, data, display_path, forms);
    let reaches = jumps_of(sites, first_added, &added, file, data, elsewhere);
    // The function whose probe a jumping site's calls reach, through the
    // sites they jump to that are left out too.
    let probed_at = |start: &Reach| {
        let mut reach = start;
        for _ in 0..=reaches.len() {
            match reach {
                Reach::Probed(function) => return Some(function.clone()),
                Reach::Site(other) => {
                    match other.checked_sub(first_added).and_then(|i| reaches[i].as_ref()) {
                        Some(further) => reach = further,
                        None => return Some(sites[*other].function.to_owned()),
                    }
                }
            }
        }
        None // jumps that go round in a circle: keep them all
    };
    let mut not_probed = Vec::new();
    let mut dropped = Vec::new();
    for (i, added) in added.iter().enumerate() {
        let Some(function) = reaches[i].as_ref().and_then(probed_at) else { continue };
        dropped.push(first_added + i);
        not_probed.extend(added.forms.iter().map(|name| NotProbed {
            function: name,
            object: display_path.to_owned(),
            why: format!("only jumps to {function}, probed"),
        }));
    }
    let mut place = 0;
    sites.retain(|_| {
        place += 1;
        !dropped.contains(&(place - 1))
    });
    not_probed
}

/// A site `add_form_sites` added: its entry's virtual address, and the
/// forms that share it.
struct AddedSite {
    entry: u64,
    forms: Vec<&'static str>,
}

/// Adds a site to `sites` for each of `forms` that is not at the address
/// of one there already (then it is an alias, and adds its bit to that
/// site's cookie); returns the sites added, in order.
fn add_form_sites(
    sites: &mut Vec<ProbeSite>,
    file: &object::File,
    data: &[u8],
    display_path: &str,
    forms: &[(Form, elf::FunctionSymbol)],
) -> Vec<AddedSite> {
    let first_added = sites.len();
    let mut added: Vec<AddedSite> = Vec::new();
    for (form, symbol) in forms {
        let Some(file_offset) = elf::file_offset(file, symbol.address) else { continue };
        let new_site = FunctionSite { index: form.function, name: form.form.name, file_offset, symbol };
        match new_site.add_to(sites, data, display_path) {
            Some(place) => {
                if let Some(added) = place.checked_sub(first_added).and_then(|i| added.get_mut(i)) {
                    added.forms.push(form.form.name);
                }
            }
            None => added.push(AddedSite { entry: symbol.address, forms: vec![form.form.name] }),
        }
    }
    added
}

/// An allocator function (or form of a C++ operator) found in an object.
struct FunctionSite<'a> {
    /// Its place in `ALLOCATOR_FUNCTIONS`.
    index: usize,
    /// As it is named.
    name: &'static str,
    file_offset: u64,
    symbol: &'a elf::FunctionSymbol,
}

impl FunctionSite<'_> {
    /// Adds a site for it to `sites`, probes placed; or, if a site there
    /// has its address (glibc's `aligned_alloc` and `memalign` share code,
    /// tcmalloc's operator delete is its free), adds it to that site's
    /// cookie, so that its calls are counted once: the place of that site.
    fn add_to(self, sites: &mut Vec<ProbeSite>, data: &[u8], display_path: &str) -> Option<usize> {
        if let Some(place) = sites.iter().position(|site| site.file_offset == self.file_offset) {
            let site = &mut sites[place];
            log::debug!("{} is an alias of {} in {display_path}: probed once", self.name, site.function);
            site.functions = site.functions.union(FunctionSet::of(self.index));
            return Some(place);
        }
        let function = &ALLOCATOR_FUNCTIONS[self.index];
        let site = ProbeSite {
            function: self.name,
            entry_program: function.entry_program,
            return_program: function.return_program(),
            file_offset: self.file_offset,
            code_length: self.symbol.size,
            entry_skip: 0,
            after_system_call: false,
            functions: FunctionSet::of(self.index),
        };
        sites.push(site.placed(data, display_path));
        None
    }
}

/// Where the code of each of the `added` sites (from `first_added` on in
/// `sites`) leads when it is only a jump: to another site of the same
/// kind (allocating or releasing), or to a function probed in another
/// object, as `elsewhere` names it.
fn jumps_of(
    sites: &[ProbeSite],
    first_added: usize,
    added: &[AddedSite],
    file: &object::File,
    data: &[u8],
    elsewhere: &dyn Fn(&str, bool) -> Option<String>,
) -> Vec<Option<Reach>> {
    let jumps = operators::Jumps::new(file, data);
    let site_at = |address: u64| {
        let offset = elf::file_offset(file, address)?;
        sites.iter().position(|site| site.file_offset == offset)
    };
    added
        .iter()
        .enumerate()
        .map(|(i, added)| {
            let place = first_added + i;
            let releases = releases_at(&sites[place]);
            match jumps.follow(added.entry, |address| site_at(address).is_some())? {
                Landing::Here(address) if address != added.entry => site_at(address)
                    .filter(|&other| other != place && releases_at(&sites[other]) == releases)
                    .map(Reach::Site),
                Landing::Here(_) => None,
                Landing::Elsewhere(symbol) => elsewhere(&symbol, releases == Some(true)).map(Reach::Probed),
            }
        })
        .collect()
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

/// A site for each C allocator function the object defines, aliases
/// probed once; and the names of those it does not define. C++'s
/// operators are `operator_sites`' concern.
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
    let c_functions = ALLOCATOR_FUNCTIONS
        .iter()
        .enumerate()
        .filter(|(_, function)| function.forms.is_empty() && !function.python);
    for (index, function) in c_functions {
        let symbol = symbols.get(function.name);
        let Some((file_offset, symbol)) =
            symbol.and_then(|symbol| Some((elf::file_offset(file, symbol.address)?, symbol)))
        else {
            missing.push(function.name);
            continue;
        };
        FunctionSite { index, name: function.name, file_offset, symbol }.add_to(
            &mut sites,
            data,
            display_path,
        );
    }
    (sites, missing)
}

/// Where past a function's start to put its probes: see `placement`.
/// Without a size, its branches cannot be checked, and it keeps the entry.
fn placement_of(site: &ProbeSite, data: &[u8], display_path: &str) -> placement::Placement {
    // Past this, a function's branches are not looked through: no
    // allocator entry point is near that long.
    const LONGEST: u64 = 64 << 10;
    let code = usize::try_from(site.file_offset)
        .ok()
        .zip(usize::try_from(site.code_length.min(LONGEST)).ok())
        .and_then(|(start, length)| data.get(start..start.checked_add(length)?))
        .unwrap_or(&[]);
    let function = site.function;
    let placement = placement::probe_placement(code, site.entry_program);
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
    placement
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
                after_system_call: false,
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

    /// The plan of one of Debian's allocators, chosen with -O.
    fn debian_plan(library: &str) -> AttachPlan {
        let path = Path::new("/usr/lib/x86_64-linux-gnu").join(library);
        plan_for_object(&path, library, "").expect("installed by cargo xtask test")
    }

    /// The functions the probe of site `function` names, if there is one.
    fn cookie(plan: &AttachPlan, function: &str) -> Option<Vec<&'static str>> {
        let site = plan.sites.iter().find(|site| site.function == function)?;
        Some(site.functions.functions().map(|function| function.name).collect())
    }

    /// Why form `function` is not probed, if it is not.
    fn not_probed<'a>(plan: &'a AttachPlan, function: &str) -> Option<&'a str> {
        plan.not_probed.iter().find(|form| form.function == function).map(|form| form.why.as_str())
    }

    #[test]
    fn tcmallocs_operators_are_probed_and_its_delete_is_its_free() {
        let plan = debian_plan("libtcmalloc_minimal.so.4");
        // operator delete(void*) is tc_delete, at free's address: one probe.
        assert_eq!(cookie(&plan, "free"), Some(vec!["free", "operator delete"]));
        assert_eq!(cookie(&plan, "operator new(unsigned long)"), Some(vec!["operator new"]));
        assert_eq!(cookie(&plan, "operator delete(void*, unsigned long)"), Some(vec!["operator delete"]));
        let operators = plan.sites.iter().filter(|site| site.function.starts_with("operator")).count();
        assert_eq!(operators, 9, "4 forms of new, 5 of delete besides free's: {:#?}", plan.sites);
        assert!(plan.not_probed.is_empty(), "{:#?}", plan.not_probed);
    }

    #[test]
    fn jemallocs_deletes_that_jump_to_free_are_not_probed() {
        let plan = debian_plan("libjemalloc.so.2");
        assert_eq!(not_probed(&plan, "operator delete(void*)"), Some("only jumps to free, probed"));
        assert_eq!(
            not_probed(&plan, "operator new[](unsigned long)"),
            Some("only jumps to operator new(unsigned long), probed")
        );
        // The sized deletes call an internal body of sdallocx, not a probed
        // function: they need probes of their own.
        assert_eq!(cookie(&plan, "operator delete(void*, unsigned long)"), Some(vec!["operator delete"]));
        assert!(cookie(&plan, "operator new(unsigned long)").is_some());
    }

    #[test]
    fn mimallocs_deletes_all_reach_its_free() {
        let plan = debian_plan("libmimalloc.so.2");
        assert_eq!(cookie(&plan, "free"), Some(vec!["free", "operator delete"]));
        assert!(
            plan.sites.iter().all(|site| !site.function.starts_with("operator delete")),
            "{:#?}",
            plan.sites
        );
        assert_eq!(
            not_probed(&plan, "operator delete(void*, unsigned long, std::align_val_t)"),
            Some("only jumps to free, probed"),
            "through mi_free_size_aligned and mi_free_size"
        );
        assert!(cookie(&plan, "operator new(unsigned long, std::align_val_t)").is_some());
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
