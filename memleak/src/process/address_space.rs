//! A process's address space as memleak needs it: the files it maps, each
//! opened once and kept open, with their build ids.
//!
//! Files are opened through `/proc/PID/map_files` (then the process's root,
//! see `files::open_mapped`):
//! that works for files that exist only inside a container and for files
//! deleted since they were mapped. Kept open, they serve the symbolizer
//! and the pprof mappings after the process has exited. The attach planner
//! reads the same objects, and `refresh` says which objects came and went
//! so that whatever follows them (a table of unwind rows, say) can too.

use std::{
    collections::HashMap,
    fs::File,
    ops::Range,
    os::fd::AsRawFd as _,
    path::{Component, PathBuf},
    sync::{Arc, Mutex, OnceLock, Weak},
};

use super::{
    files::{self, FileIdentity},
    maps::{self, MapsEntry, Pathname},
};
use crate::{elf, model::ModuleMapping};

/// What tells two files apart whatever their paths: device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    pub device: (u32, u32),
    pub inode: u64,
}

/// A file mapped by the process, opened once.
#[derive(Debug)]
pub struct MappedObject {
    pub id: FileId,
    /// The file as /proc/PID/maps names it: its links resolved.
    pub path: String,
    /// The file as reports name it: `path`, except for the program started
    /// through a link (see `started_as`).
    pub name: String,
    open: Arc<OpenFile>,
}

/// A mapped file memleak holds open, one for every process that maps it:
/// a node's hundred workers of one program hold one descriptor of each of
/// its objects, read its build id once, and are symbolized through one
/// `fd_path`, which the symbolizer parses once.
#[derive(Debug)]
struct OpenFile {
    file: File,
    build_id: OnceLock<Option<String>>,
}

/// The mapped files held open, by identity, while some process's model
/// holds them.
static OPEN_FILES: Mutex<OpenFiles> = Mutex::new(OpenFiles { by_identity: None, pruned_at: 0 });

struct OpenFiles {
    by_identity: Option<HashMap<FileIdentity, Weak<OpenFile>>>,
    /// How many entries there were after the last pruning: the next is
    /// due when they have doubled.
    pruned_at: usize,
}

/// The file `entry` of process `pid` maps: the one held open already if
/// another process maps it, else opened now. Its identity is taken from
/// the file itself (`stat` of its `map_files` link, no descriptor), not
/// from the maps' device and inode: btrfs subvolumes share a device
/// there, and repeat inode numbers.
fn open_shared(pid: u32, entry: &MapsEntry) -> Option<Arc<OpenFile>> {
    let map_files = format!("/proc/{pid}/map_files/{:x}-{:x}", entry.start, entry.end);
    let identity = std::fs::metadata(map_files).ok().map(|metadata| FileIdentity::of_metadata(&metadata));
    let mut open_files = OPEN_FILES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let by_identity = open_files.by_identity.get_or_insert_with(HashMap::new);
    if let Some(held) = identity.and_then(|identity| by_identity.get(&identity)?.upgrade()) {
        return Some(held);
    }
    let file = files::open_mapped(pid, entry)?;
    let open = Arc::new(OpenFile { file, build_id: OnceLock::new() });
    if let Some(identity) = FileIdentity::of(&open.file) {
        by_identity.insert(identity, Arc::downgrade(&open));
        if by_identity.len() >= 2 * open_files.pruned_at.max(64) {
            let by_identity = open_files.by_identity.get_or_insert_with(HashMap::new);
            by_identity.retain(|_, held| held.strong_count() > 0);
            open_files.pruned_at = by_identity.len();
        }
    }
    Some(open)
}

impl MappedObject {
    /// A path that reopens this very file from memleak's own process, for
    /// as long as memleak holds it, whatever happens to the process.
    pub fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.open.file.as_raw_fd()))
    }

    /// The file itself, open.
    pub fn file(&self) -> &File {
        &self.open.file
    }

    /// Whether the host's file at `path` is this very file (device and
    /// inode): then what lies beside it on the host, its package and its
    /// debug files, is the object's own, not a container's choice. The
    /// host's path is only stat'ed, never opened.
    pub fn is_hosts_own(&self) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        let identity = |metadata: std::fs::Metadata| (metadata.dev(), metadata.ino());
        let on_host = std::fs::metadata(&self.path).map(identity);
        on_host.is_ok_and(|on_host| self.file().metadata().map(identity).is_ok_and(|ours| ours == on_host))
    }

    /// The GNU build id, in hex, read once.
    pub fn build_id(&self) -> Option<&str> {
        self.open.build_id.get_or_init(|| elf::build_id(&self.fd_path())).as_deref()
    }
}

/// One file-backed mapping.
#[derive(Clone, Debug)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub executable: bool,
    pub object: Arc<MappedObject>,
}

impl Mapping {
    /// The file offset of `address`, which must lie in this mapping.
    pub fn file_offset(&self, address: u64) -> u64 {
        address - self.start + self.offset
    }

    fn describe(&self) -> ModuleMapping {
        ModuleMapping {
            start: self.start,
            end: self.end,
            file_offset: self.offset,
            path: self.object.name.clone(),
            build_id: self.object.build_id().map(str::to_owned),
        }
    }
}

/// A range of the address space mapped executable now: a file's code,
/// or anonymous code (JIT compilers, trampolines, `[vdso]`).
#[derive(Clone, Debug)]
pub struct CodeRange {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`, for a file's code.
    pub offset: u64,
    /// The file, if the range maps one memleak could open.
    pub object: Option<Arc<MappedObject>>,
    /// The kernel's `[uprobes]` page: where a function whose return is
    /// probed returns to. No code of the program's own.
    pub uprobes_trampoline: bool,
    /// Anonymous memory: code a JIT compiler or the program itself wrote.
    pub anonymous: bool,
}

/// What a `refresh` found changed.
#[derive(Debug, Default)]
pub struct Changes {
    /// Whether the mappings changed at all.
    pub any: bool,
    /// Objects mapped now that were not before.
    pub added: Vec<Arc<MappedObject>>,
    /// Objects mapped before that are not any more (a dlclose).
    pub removed: Vec<Arc<MappedObject>>,
}

/// The file mappings of one process, refreshed while it lives and kept
/// after it exits.
pub struct AddressSpace {
    pid: u32,
    /// Sorted by start. Mappings that disappeared stay unless a new one,
    /// of a file or not,
    /// covers their addresses: old stacks may still point there.
    mappings: Vec<Mapping>,
    /// The objects mapped now, by file.
    objects: HashMap<FileId, Arc<MappedObject>>,
    /// Every range mapped with execute permission now, files and anonymous
    /// memory (JIT code) alike, sorted: return addresses point there.
    code: Vec<CodeRange>,
    /// The maps text last read, to skip work when nothing changed.
    last_maps: String,
    /// The name of the program's executable, once it is mapped.
    executable: Option<String>,
    /// `CLOCK_MONOTONIC` ns, BPF's clock, when `read` began; 0 for a model
    /// filled in by `refresh` alone. A program the process runs after an
    /// execve from then on may not be the one modelled.
    read_ns: u64,
}

impl AddressSpace {
    /// An empty model of process `pid`; `refresh` fills it in.
    pub fn new(pid: u32) -> Self {
        Self {
            pid,
            mappings: Vec::new(),
            objects: HashMap::new(),
            code: Vec::new(),
            last_maps: String::new(),
            executable: None,
            read_ns: 0,
        }
    }

    /// The model of process `pid` as it is now.
    pub fn read(pid: u32) -> std::io::Result<Self> {
        let mut space = Self { read_ns: crate::clock::monotonic_ns(), ..Self::new(pid) };
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        space.update(&maps);
        Ok(space)
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// When `read` began (see `read_ns`).
    pub fn read_ns(&self) -> u64 {
        self.read_ns
    }

    /// Re-reads /proc/PID/maps and says which objects came and went. Once
    /// the process is gone this keeps what it last saw.
    pub fn refresh(&mut self) -> Changes {
        match std::fs::read_to_string(format!("/proc/{}/maps", self.pid)) {
            Ok(maps) if !maps.is_empty() && maps != self.last_maps => self.update(&maps),
            _ => Changes::default(),
        }
    }

    fn update(&mut self, maps: &str) -> Changes {
        let entries = maps::parse(maps);
        let mut objects = HashMap::new();
        let mut fresh = Vec::new();
        // The same text as the maps' paths: both are the kernel's d_path of
        // the file, seen from memleak's root.
        let executable = std::fs::read_link(format!("/proc/{}/exe", self.pid))
            .ok()
            .map(|path| path.to_string_lossy().into_owned());
        for entry in &entries {
            let Some(object) = self.object_of(entry, executable.as_deref(), &mut objects) else { continue };
            fresh.push(Mapping {
                start: entry.start,
                end: entry.end,
                offset: entry.offset,
                executable: entry.executable,
                object,
            });
        }
        // Any mapping counts, not only a file's: a JIT's code mmap'd where
        // a file was once mapped must not be taken for that file.
        let overlaps = |old: &Mapping| entries.iter().any(|new| new.start < old.end && old.start < new.end);
        let kept: Vec<Mapping> = self.mappings.iter().filter(|old| !overlaps(old)).cloned().collect();
        fresh.extend(kept);
        fresh.sort_by_key(|mapping| mapping.start);
        let changes = Changes {
            any: true,
            added: objects
                .iter()
                .filter(|(id, _)| !self.objects.contains_key(id))
                .map(|(_, o)| o.clone())
                .collect(),
            removed: self
                .objects
                .iter()
                .filter(|(id, _)| !objects.contains_key(id))
                .map(|(_, o)| o.clone())
                .collect(),
        };
        self.mappings = fresh;
        if let Some(program) = objects.values().find(|object| Some(&object.path) == executable.as_ref()) {
            self.executable = Some(program.name.clone());
        }
        self.objects = objects;
        self.code = entries
            .iter()
            .filter(|entry| entry.executable)
            .map(|entry| CodeRange {
                start: entry.start,
                end: entry.end,
                offset: entry.offset,
                object: entry
                    .file()
                    .and(self.objects.get(&FileId { device: entry.device, inode: entry.inode }).cloned()),
                uprobes_trampoline: entry.pathname == Pathname::Special("[uprobes]".to_owned()),
                anonymous: entry.pathname == Pathname::Anonymous,
            })
            .collect();
        maps.clone_into(&mut self.last_maps);
        changes
    }

    /// The object `entry` maps: known already, or opened now.
    fn object_of(
        &self,
        entry: &MapsEntry,
        executable: Option<&str>,
        objects: &mut HashMap<FileId, Arc<MappedObject>>,
    ) -> Option<Arc<MappedObject>> {
        let path = entry.file()?;
        let id = FileId { device: entry.device, inode: entry.inode };
        if let Some(object) = objects.get(&id).or_else(|| self.objects.get(&id)) {
            let object = object.clone();
            objects.insert(id, object.clone());
            return Some(object);
        }
        let open = open_shared(self.pid, entry)?;
        let name = if Some(path) == executable {
            started_as(self.pid, &open.file).unwrap_or_else(|| path.to_owned())
        } else {
            path.to_owned()
        };
        let object = Arc::new(MappedObject { id, path: path.to_owned(), name, open });
        objects.insert(id, object.clone());
        Some(object)
    }

    /// Every object mapped now, each once, in the order of its first
    /// mapping's address: the executable first.
    pub fn objects(&self) -> Vec<Arc<MappedObject>> {
        let mut seen = Vec::new();
        for mapping in &self.mappings {
            let current = self.objects.contains_key(&mapping.object.id);
            if current && !seen.iter().any(|object: &Arc<MappedObject>| object.id == mapping.object.id) {
                seen.push(mapping.object.clone());
            }
        }
        seen
    }

    /// The ranges mapped executable now, sorted by address.
    pub fn code(&self) -> &[CodeRange] {
        &self.code
    }

    /// Whether `address` is in anonymous memory mapped executable now.
    pub fn in_anonymous_code(&self, address: u64) -> bool {
        let index = self.code.partition_point(|range| range.start <= address);
        index.checked_sub(1).is_some_and(|index| self.code[index].anonymous && address < self.code[index].end)
    }

    /// The mapping `address` falls in.
    pub fn find(&self, address: u64) -> Option<&Mapping> {
        let index = self.mappings.partition_point(|mapping| mapping.start <= address);
        let mapping = self.mappings.get(index.checked_sub(1)?)?;
        (address < mapping.end).then_some(mapping)
    }

    /// The mapping `address` falls in, described for an exporter.
    pub fn module_mapping(&self, address: u64) -> Option<ModuleMapping> {
        self.find(address).map(Mapping::describe)
    }

    /// The executable code of the file reports name `name`.
    pub fn executable_mapping(&self, name: &str) -> Option<ModuleMapping> {
        let mapping =
            self.mappings.iter().find(|mapping| mapping.object.name == name && mapping.executable)?;
        Some(mapping.describe())
    }

    /// The name of the program's executable, as reports name it, once the
    /// process has been seen to map it.
    pub fn executable_name(&self) -> Option<&str> {
        self.executable.as_deref()
    }

    /// From the first to the end of the last executable mapping of the
    /// very file `file` is, if the process maps it now.
    pub fn code_of_file(&self, file: &File) -> Option<(u64, u64)> {
        let object = self.object_of_file(file)?;
        let ranges: Vec<&CodeRange> = self
            .code
            .iter()
            .filter(|range| range.object.as_ref().is_some_and(|mapped| Arc::ptr_eq(mapped, &object)))
            .collect();
        Some((ranges.iter().map(|range| range.start).min()?, ranges.iter().map(|range| range.end).max()?))
    }

    /// Where the bytes at file offsets `offsets` of the very file `file` is
    /// are mapped as code, from the first to the end of the last, if the
    /// process maps them now.
    pub fn code_at_offsets(&self, file: &File, offsets: Range<u64>) -> Option<(u64, u64)> {
        let object = self.object_of_file(file)?;
        let address_of = |offset: u64| {
            self.code.iter().find_map(|range| {
                let mapped = range.object.as_ref().is_some_and(|mapped| Arc::ptr_eq(mapped, &object));
                let length = range.end - range.start;
                (mapped && (range.offset..range.offset + length).contains(&offset))
                    .then(|| range.start + (offset - range.offset))
            })
        };
        let last = offsets.end.checked_sub(1).filter(|&last| last >= offsets.start)?;
        Some((address_of(offsets.start)?, address_of(last)? + 1))
    }

    /// Whether the very file `file` is is the program's own executable.
    pub fn is_executable(&self, file: &File) -> bool {
        self.object_of_file(file).is_some_and(|object| self.executable_name() == Some(object.name.as_str()))
    }

    /// The object mapped now that is the very file `file` is (device and
    /// inode): how a file planned from before the process ran is named as
    /// the process maps it.
    pub fn object_of_file(&self, file: &File) -> Option<Arc<MappedObject>> {
        let identity = identity(file)?;
        self.objects.values().find(|object| self::identity(object.file()) == Some(identity)).cloned()
    }

    /// The leading part of a walked stack that can be trusted: up to the
    /// first zero, and the first "return address" outside code (in data,
    /// the heap, a stack, or nothing mapped), which is what a frame-pointer
    /// walk finds past code built without frame pointers.
    pub fn code_prefix<'a>(&self, addresses: &'a [u64]) -> &'a [u64] {
        let end = addresses.iter().position(|&address| address == 0 || !self.may_be_code(address));
        &addresses[..end.unwrap_or(addresses.len())]
    }

    /// Whether `address` can be a return address: it is in code the
    /// process maps, or mapped before (a library since unloaded). Not in
    /// its data, heap or stacks, and not in memory it never mapped. With
    /// no mappings known, anything can be.
    pub fn may_be_code(&self, address: u64) -> bool {
        let index = self.code.partition_point(|range| range.start <= address);
        self.code.is_empty()
            || index.checked_sub(1).is_some_and(|index| address < self.code[index].end)
            || self.find(address).is_some_and(|mapping| mapping.executable)
    }
}

/// A file's device and inode, from its open descriptor.
fn identity(file: &File) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    file.metadata().ok().map(|metadata| (metadata.dev(), metadata.ino()))
}

/// The path process `pid` was started as, made absolute, if it leads to
/// `executable`, the file it maps as its program.
///
/// /proc/PID/maps and /proc/PID/exe name the file with its links resolved:
/// Debian's redis-server, a link to redis-check-rdb, would be reported as
/// redis-check-rdb, a program nobody ran. argv[0] is what was typed, but
/// programs rewrite it (redis-server's "redis-server 127.0.0.1:6379",
/// nginx's "nginx: master process"), and a bare name would have to be
/// looked up in a PATH the process may have changed. The kernel keeps the
/// path execve was given, after the shell's PATH search, at the top of the
/// process's stack (`AT_EXECFN`), past what those programs rewrite. The
/// process can still write there, so the path is taken only if it leads,
/// inside the process's root, to that very file (device and inode); a
/// relative one only when the process shares memleak's root (its working
/// directory is not known inside a container's). The file itself, not
/// this name, is what gets read and symbolized.
fn started_as(pid: u32, executable: &File) -> Option<String> {
    let started = PathBuf::from(exec_filename(pid)?);
    let candidate = if started.is_absolute() {
        started
    } else if files::shares_root(pid) {
        // execve's relative path was taken from the working directory of
        // the time; a process that has left it fails the check below.
        std::fs::read_link(format!("/proc/{pid}/cwd")).ok()?.join(started)
    } else {
        return None;
    };
    // The kernel resolves ".." through links: a name with ".." could say
    // another directory than the one it leads to.
    if candidate.components().any(|component| component == Component::ParentDir) {
        return None;
    }
    let opened = files::open_in_root(pid, &candidate).ok()?;
    // Collecting the components drops the "." of "./server".
    (identity(&opened)? == identity(executable)?)
        .then(|| candidate.components().collect::<PathBuf>().to_string_lossy().into_owned())
}

/// The path process `pid`'s execve was given: the string its `AT_EXECFN`
/// auxiliary vector entry points to, in its memory.
fn exec_filename(pid: u32) -> Option<String> {
    const AT_EXECFN: u64 = 31;
    const PATH_MAX: usize = 4096;
    const PAGE: usize = 4096;
    let auxv = std::fs::read(format!("/proc/{pid}/auxv")).ok()?;
    let entries = auxv.chunks_exact(16).map(|entry| {
        let word = |bytes: &[u8]| u64::from_ne_bytes(bytes.try_into().unwrap_or_default());
        (word(&entry[..8]), word(&entry[8..]))
    });
    let mut address = entries.into_iter().find(|&(kind, _)| kind == AT_EXECFN)?.1;
    let memory = File::open(format!("/proc/{pid}/mem")).ok()?;
    let mut name = Vec::new();
    // Page by page: the string ends near the end of the stack, and a read
    // past a mapping's end fails whole.
    while name.len() < PATH_MAX {
        let mut chunk = [0u8; PAGE];
        let wanted = PAGE - usize::try_from(address % PAGE as u64).ok()?;
        let read = std::os::unix::fs::FileExt::read_at(&memory, &mut chunk[..wanted], address).ok()?;
        if read == 0 {
            return None;
        }
        if let Some(end) = chunk[..read].iter().position(|&byte| byte == 0) {
            name.extend_from_slice(&chunk[..end]);
            return String::from_utf8(name).ok();
        }
        name.extend_from_slice(&chunk[..read]);
        address += read as u64;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_is_named_by_the_path_it_was_started_as() {
        let executable = File::open("/proc/self/exe").unwrap();
        let started = started_as(std::process::id(), &executable);
        // cargo starts the test binary by its path, links resolved.
        assert_eq!(started, Some(std::env::current_exe().unwrap().display().to_string()));
    }

    /// This test's own process: its binary and libc are real files.
    fn own_space() -> AddressSpace {
        AddressSpace::read(std::process::id()).expect("read own maps")
    }

    #[test]
    fn return_addresses_point_into_code() {
        let maps = "\
55d0a0000000-55d0a0001000 r--p 00000000 08:01 42 /nonexistent/app
55d0a0001000-55d0a0002000 r-xp 00001000 08:01 42 /nonexistent/app
55d0a1000000-55d0a1021000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000010000 rwxp 00000000 00:00 0
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0 [stack]";
        let mut space = AddressSpace::new(0);
        assert!(space.may_be_code(0x400), "nothing known: anything goes");
        space.update(maps);
        assert!(space.may_be_code(0x55d0_a000_1010), "a binary's code");
        assert!(space.may_be_code(0x7f00_0000_0100), "JIT code");
        assert!(!space.may_be_code(0x55d0_a000_0010), "a file's read-only data");
        assert!(!space.may_be_code(0x55d0_a100_0070), "the heap");
        assert!(!space.may_be_code(0x7ffc_0000_0008), "a stack");
        assert!(!space.may_be_code(0x400), "nothing mapped");
        let stack = [0x55d0_a000_1010, 0x7f00_0000_0100, 0x55d0_a100_0070, 0x55d0_a000_1010];
        assert_eq!(space.code_prefix(&stack), &stack[..2], "the walk is not trusted past the heap");
        assert_eq!(space.code_prefix(&[0x55d0_a000_1010, 0, 0x55d0_a000_1010]), &[0x55d0_a000_1010]);
    }

    #[test]
    fn code_mapped_where_a_file_was_is_not_that_file() {
        // A file that really exists, mapped at an address no longer mapped
        // now: its device and inode let AddressSpace open it by path.
        use std::os::unix::fs::MetadataExt as _;
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let metadata = std::fs::metadata(&exe).unwrap();
        let (major, minor) = (libc::major(metadata.dev()), libc::minor(metadata.dev()));
        let file = format!(
            "7f0000000000-7f0000001000 r--p 00000000 {major:x}:{minor:x} {} {}",
            metadata.ino(),
            exe.display()
        );
        let mut space = AddressSpace::new(std::process::id());
        space.update(&file);
        assert!(space.find(0x7f00_0000_0010).is_some(), "the file is mapped there");
        // A JIT's code mmap'd where the file was, as ld.so.cache's pages are
        // reused once unmapped.
        space.update("7f0000000000-7f0000001000 r-xp 00000000 00:00 0");
        assert!(space.find(0x7f00_0000_0010).is_none(), "the file is no longer there");
        assert!(space.in_anonymous_code(0x7f00_0000_0010));
        assert!(!space.in_anonymous_code(0x7f00_0000_1010), "past its end");
    }

    #[test]
    fn objects_are_opened_once_with_the_executable_first() {
        let space = own_space();
        let objects = space.objects();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        assert_eq!(std::path::Path::new(&objects[0].path), exe, "the executable is mapped first");
        let mut ids: Vec<FileId> = objects.iter().map(|object| object.id).collect();
        ids.dedup();
        assert_eq!(ids.len(), objects.len(), "each object once");
        let function = own_space as fn() -> AddressSpace as usize as u64;
        let mapping = space.find(function).expect("this function's code is mapped");
        assert!(mapping.executable && mapping.object.id == objects[0].id);
    }

    #[test]
    fn models_of_processes_that_map_one_file_hold_it_open_once() {
        // Two models of this process stand for two processes of one
        // program: a node's workers.
        let (first, second) = (own_space(), own_space());
        let (first, second) = (first.objects(), second.objects());
        assert_eq!(first.len(), second.len());
        for (one, other) in first.iter().zip(&second) {
            assert_eq!(one.fd_path(), other.fd_path(), "{}: one descriptor", one.path);
        }
    }

    #[test]
    fn file_offsets_of_the_executable_are_found_where_they_are_mapped() {
        let space = own_space();
        let exe = File::open("/proc/self/exe").unwrap();
        assert!(space.is_executable(&exe));
        let libc = space.objects().into_iter().find(|object| object.path.contains("libc.so")).unwrap();
        assert!(!space.is_executable(&File::open(&libc.path).unwrap()));
        let (start, end) = space.code_of_file(&exe).unwrap();
        let range = space.code().iter().find(|range| range.start == start).unwrap();
        let offsets = range.offset + 16..range.offset + 48;
        assert_eq!(space.code_at_offsets(&exe, offsets), Some((start + 16, start + 48)));
        assert!(start + 48 <= end);
        // Not mapped as code: the ELF header, at offset 0.
        assert_eq!(space.code_at_offsets(&exe, 0..4), None);
    }

    #[test]
    fn refresh_says_what_came_and_went() {
        let mut space = own_space();
        assert!(space.refresh().added.is_empty(), "nothing new since the read");
        let libc_line = space.last_maps.lines().find(|line| line.contains("libc.so")).unwrap().to_owned();
        let without_libc: String = space
            .last_maps
            .lines()
            .filter(|line| !line.contains("libc.so"))
            .flat_map(|line| [line, "\n"])
            .collect();
        let changes = space.update(&without_libc);
        assert_eq!(changes.removed.len(), 1);
        assert!(changes.removed[0].path.contains("libc.so"));
        let address = u64::from_str_radix(libc_line.split('-').next().unwrap(), 16).unwrap();
        assert!(space.find(address).is_some(), "a gone library's mappings stay for old stacks");
        let changes = space.refresh();
        assert_eq!(changes.added.len(), 1, "{:?}", changes.added);
    }
}
