//! What blazesym may read of an object's debug information, and from
//! which file.
//!
//! Given an object with a `.gnu_debuglink`, blazesym looks for the file
//! it names by itself: in its debug directories, and beside the object's
//! path as memleak's own process resolves it (the canonical path of
//! `/proc/self/fd/N`: a host path, even for a container's file), following
//! the host's links and reading whatever it finds whole for its CRC. A
//! traced program chooses the name, and memleak runs as root: a container
//! could have it read the host's `/etc/passwd`, or a 1 GiB file. So
//! blazesym never follows a link:
//!
//! - an object that names no other file: blazesym reads its own DWARF;
//! - an object with a plain debug link: memleak finds its debug file
//!   itself (`unwind::debug_files`: inside the target's root, on the host
//!   only for the host's own objects, checked before it is read) and holds
//!   it open; blazesym reads that file alone, by virtual address. None
//!   found: the object's symbol table alone, and its frames have no file
//!   and line;
//! - an object that names paths (`.gnu_debugaltlink`, `.debug_sup`): its
//!   symbol table alone.

use std::{
    collections::HashMap,
    fs::File,
    os::fd::AsRawFd as _,
    path::PathBuf,
    sync::{Arc, Mutex, Weak},
};

use crate::{
    elf,
    process::{
        address_space::{FileId, MappedObject},
        files::FileIdentity,
    },
    unwind::debug_files,
};

/// The kernel's debug directories, the host's: the kernel is the host's
/// own.
pub const KERNEL_DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];

/// Where blazesym reads an object's symbols and lines from.
#[derive(Clone)]
pub enum Route {
    /// The object's own sections, its DWARF included.
    Own,
    /// The object's symbol table alone.
    SymbolsOnly,
    /// Its separate debug file, by virtual address.
    Separate(Arc<SeparateFile>),
}

/// A separate debug file memleak found and checked, held open.
pub struct SeparateFile {
    file: File,
    /// The object's loadable segments: (file offset, size in the file,
    /// virtual address). A debug file keeps the addresses, not the file
    /// layout, so a file offset becomes an address through these.
    segments: Vec<(u64, u64, u64)>,
}

impl SeparateFile {
    /// A path that reopens this very file, for as long as it is held.
    pub fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// The virtual address of the object's `file_offset`.
    pub fn virtual_offset(&self, file_offset: u64) -> Option<u64> {
        self.segments.iter().find_map(|&(offset, size, address)| {
            (offset <= file_offset && file_offset < offset + size).then(|| file_offset - offset + address)
        })
    }
}

/// The routes of one process's objects, each decided once.
pub struct DebugLinks {
    pid: u32,
    routes: HashMap<FileId, Route>,
    /// Each object's separate debug file, looked for once.
    separate: HashMap<FileId, Option<Arc<SeparateFile>>>,
}

impl DebugLinks {
    pub fn new(pid: u32) -> Self {
        Self { pid, routes: HashMap::new(), separate: HashMap::new() }
    }

    /// Where blazesym reads `object`'s symbols and lines from.
    pub fn route(&mut self, object: &MappedObject) -> Route {
        if let Some(route) = self.routes.get(&object.id) {
            return route.clone();
        }
        let links = debug_files::object_links(object).unwrap_or_default();
        let route = if links.none() {
            Route::Own
        } else if links.names_paths {
            log::debug!("{}: its debug links name paths; symbolized from its symbol table only", object.path);
            Route::SymbolsOnly
        } else {
            self.separate_file(object).map_or(Route::SymbolsOnly, Route::Separate)
        };
        self.routes.insert(object.id, route.clone());
        route
    }

    /// `object`'s separate debug file, found by build id or debug link,
    /// if there is one.
    pub fn separate_file(&mut self, object: &MappedObject) -> Option<Arc<SeparateFile>> {
        let pid = self.pid;
        self.separate
            .entry(object.id)
            .or_insert_with(|| {
                let found = debug_files::find(pid, object)?;
                log::debug!("debug file of {}: {}", object.path, found.place);
                Some(shared_separate_file(object, found.file))
            })
            .clone()
    }
}

/// Separate debug files held open, by their identity and their object's,
/// while some process's routes hold them: processes that map the same
/// object share one descriptor of its debug file.
static SEPARATE_FILES: Mutex<Option<SeparateFiles>> = Mutex::new(None);

/// (debug file, object) -> the debug file held open.
type SeparateFiles = HashMap<(FileIdentity, FileIdentity), Weak<SeparateFile>>;

/// `debug_file`, found for `object`, as the one held open already if
/// another process's object found it too.
fn shared_separate_file(object: &MappedObject, debug_file: File) -> Arc<SeparateFile> {
    let make = |file| Arc::new(SeparateFile { file, segments: elf::load_segments(object.file()) });
    let (Some(debug), Some(object)) = (FileIdentity::of(&debug_file), FileIdentity::of(object.file())) else {
        return make(debug_file);
    };
    let mut held = SEPARATE_FILES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let held = held.get_or_insert_with(HashMap::new);
    if let Some(shared) = held.get(&(debug, object)).and_then(Weak::upgrade) {
        return shared;
    }
    held.retain(|_, file| file.strong_count() > 0);
    let shared = make(debug_file);
    held.insert((debug, object), Arc::downgrade(&shared));
    shared
}
