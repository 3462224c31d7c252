//! From return addresses to functions, files and lines.
//!
//! Each mapped file of the target is opened once, through
//! /proc/PID/map_files, and kept open: the stacks can then be symbolized
//! after the target has exited, after its binary was deleted, or when its
//! files exist only inside its container. Every stack is symbolized once
//! and cached by its id.

use std::{
    collections::HashMap,
    fs::{self, File},
    os::fd::AsRawFd as _,
    path::PathBuf,
    sync::Arc,
};

use blazesym::symbolize::{
    self,
    source::{Elf, Kernel, Source},
    Input, Symbolized,
};

use crate::{
    allocator::{mapped_file, mapped_file_paths},
    model::{Frame, ModuleMapping},
};

/// One file-backed mapping of the target.
#[derive(Clone, Debug)]
struct Mapping {
    start: u64,
    end: u64,
    /// File offset of `start`.
    offset: u64,
    executable: bool,
    /// The file as the target names it.
    path: String,
    file: Arc<File>,
}

/// The target's file-backed mappings, refreshed while it lives and kept
/// after it exits.
pub struct ProcessModules {
    pid: u32,
    mappings: Vec<Mapping>,
    last_maps: String,
    /// Open files by "device inode", so a library mapped five times is
    /// opened once.
    files: HashMap<String, Arc<File>>,
    /// Build ids by path, read once.
    build_ids: HashMap<String, Option<String>>,
    /// Every mapping with execute permission, files and anonymous memory
    /// (JIT code) alike, sorted: return addresses point there.
    code: Vec<(u64, u64)>,
}

impl ProcessModules {
    pub fn new(pid: u32) -> Self {
        Self {
            pid,
            mappings: Vec::new(),
            last_maps: String::new(),
            files: HashMap::new(),
            build_ids: HashMap::new(),
            code: Vec::new(),
        }
    }

    /// Re-reads /proc/PID/maps. Once the target is gone this keeps what it
    /// last saw. Mappings that disappeared (a dlclose) are kept unless a
    /// new mapping covers their addresses: old stacks may still point there.
    pub fn refresh(&mut self) {
        let Ok(maps) = fs::read_to_string(format!("/proc/{}/maps", self.pid)) else { return };
        if maps.is_empty() || maps == self.last_maps {
            return;
        }
        let mut fresh: Vec<Mapping> = maps.lines().filter_map(|line| self.mapping(line)).collect();
        let overlaps = |old: &Mapping| fresh.iter().any(|new| new.start < old.end && old.start < new.end);
        let kept: Vec<Mapping> = self.mappings.iter().filter(|old| !overlaps(old)).cloned().collect();
        fresh.extend(kept);
        fresh.sort_by_key(|mapping| mapping.start);
        self.mappings = fresh;
        self.code = maps.lines().filter_map(code_range).collect();
        self.last_maps = maps;
    }

    fn mapping(&mut self, line: &str) -> Option<Mapping> {
        let path = mapped_file(line)?.to_owned();
        let mut fields = line.split_whitespace();
        let range = fields.next()?;
        let (start, end) = range.split_once('-')?;
        let start = u64::from_str_radix(start, 16).ok()?;
        let end = u64::from_str_radix(end, 16).ok()?;
        let executable = fields.next()?.contains('x');
        let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
        let identity = format!("{} {}", fields.next()?, fields.next()?);
        let file = match self.files.get(&identity) {
            Some(file) => file.clone(),
            None => {
                let file = Arc::new(self.open(range, &path)?);
                self.files.insert(identity, file.clone());
                file
            }
        };
        Some(Mapping { start, end, offset, executable, path, file })
    }

    /// Opens a mapped file the way that works even for deleted files and
    /// files inside another mount namespace.
    fn open(&self, range: &str, path: &str) -> Option<File> {
        mapped_file_paths(self.pid, range, path).iter().find_map(|candidate| File::open(candidate).ok())
    }

    /// The mapping `address` falls in, with the build id of its file.
    pub fn module_mapping(&mut self, address: u64) -> Option<ModuleMapping> {
        let mapping = self.find(address)?.clone();
        Some(self.describe(mapping))
    }

    /// The executable code of the file at `path`, as the process names it.
    pub fn executable_mapping(&mut self, path: &str) -> Option<ModuleMapping> {
        let mapping =
            self.mappings.iter().find(|mapping| mapping.path == path && mapping.executable)?.clone();
        Some(self.describe(mapping))
    }

    fn describe(&mut self, mapping: Mapping) -> ModuleMapping {
        let build_id = self
            .build_ids
            .entry(mapping.path.clone())
            .or_insert_with(|| {
                let opened = format!("/proc/self/fd/{}", mapping.file.as_raw_fd());
                let bytes = blazesym::helper::read_elf_build_id(&opened).ok().flatten()?;
                Some(bytes.iter().map(|byte| format!("{byte:02x}")).collect())
            })
            .clone();
        ModuleMapping {
            start: mapping.start,
            end: mapping.end,
            file_offset: mapping.offset,
            path: mapping.path,
            build_id,
        }
    }

    /// Whether `address` can be a return address: it is in code the
    /// process maps, or mapped before (a library since unloaded). Not in
    /// its data, heap or stacks, and not in memory it never mapped. With
    /// no mappings known, anything can be.
    fn may_be_code(&self, address: u64) -> bool {
        let index = self.code.partition_point(|&(start, _)| start <= address);
        self.code.is_empty()
            || index.checked_sub(1).is_some_and(|index| address < self.code[index].1)
            || self.find(address).is_some_and(|mapping| mapping.executable)
    }

    fn find(&self, address: u64) -> Option<&Mapping> {
        let index = self.mappings.partition_point(|mapping| mapping.start <= address);
        let mapping = self.mappings.get(index.checked_sub(1)?)?;
        (address < mapping.end).then_some(mapping)
    }
}

/// The range of a /proc/PID/maps line mapped with execute permission.
fn code_range(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let executable = fields.next()?.contains('x');
    executable.then_some((u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?))
}

/// Symbolizes stacks of one process, or of the kernel, each once.
pub struct StackSymbolizer {
    pub modules: ProcessModules,
    /// Kernel stacks, symbolized through /proc/kallsyms.
    kernel: bool,
    symbolizer: symbolize::Symbolizer,
    cache: HashMap<u64, Arc<[Frame]>>,
}

impl StackSymbolizer {
    pub fn new(pid: u32) -> Self {
        // Separate debug files (by build id, or named by .gnu_debuglink) are
        // looked for inside the target's root first: a container ships its
        // own. Then on the host.
        let debug_dirs: Vec<PathBuf> = ["usr/lib/debug", "lib/debug"]
            .iter()
            .map(|dir| PathBuf::from(format!("/proc/{pid}/root")).join(dir))
            .chain(["/usr/lib/debug", "/lib/debug"].map(PathBuf::from))
            .collect();
        let symbolizer = symbolize::Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .set_debug_dirs(Some(&debug_dirs))
            .build();
        Self { modules: ProcessModules::new(pid), kernel: false, symbolizer, cache: HashMap::new() }
    }

    /// For kernel stacks.
    pub fn kernel() -> Self {
        Self { kernel: true, ..Self::new(memleak_common::KERNEL_TGID) }
    }

    pub fn cached(&self, stack_id: u64) -> Option<Arc<[Frame]>> {
        self.cache.get(&stack_id).cloned()
    }

    /// Symbolizes and caches a stack given as return addresses, innermost
    /// first.
    pub fn symbolize(&mut self, stack_id: u64, addresses: &[u64]) -> Arc<[Frame]> {
        // A "return address" outside code (in data, the heap, a stack, or
        // nothing mapped) is what a frame pointer walk finds past code built
        // without frame pointers: the stack is not known beyond it.
        let mut frames: Vec<Frame> = addresses
            .iter()
            .take_while(|&&address| address != 0 && (self.kernel || self.modules.may_be_code(address)))
            .flat_map(|&address| self.frames_at(address))
            .collect();
        if self.kernel {
            // A kernel stack starts in memleak's own BPF program and the
            // tracepoint's dispatch; the allocator comes after them.
            // With several programs on one tracepoint, __traceiter_* runs them.
            const TRACING: [&str; 4] = ["bpf_prog_", "bpf_trace_run", "__traceiter_", "__bpf_trace_"];
            let is_tracing = |frame: &Frame| {
                frame
                    .function
                    .as_deref()
                    .is_some_and(|name| TRACING.iter().any(|prefix| name.starts_with(prefix)))
            };
            let skip = frames.iter().take_while(|frame| is_tracing(frame)).count();
            frames.drain(..skip);
        }
        let frames: Arc<[Frame]> = frames.into();
        self.cache.insert(stack_id, frames.clone());
        frames
    }

    /// The frames of one return address: the inlined ones innermost first,
    /// then the function that holds them.
    fn frames_at(&self, address: u64) -> Vec<Frame> {
        let unknown = Frame { address, ..Frame::default() };
        // A return address points after the call; the call itself, whose
        // line we want, is the byte before.
        let (symbolized, module) = if self.kernel {
            let source = Source::Kernel(Kernel::default());
            (self.symbolizer.symbolize_single(&source, Input::AbsAddr(address - 1)), None)
        } else {
            let Some(mapping) = self.modules.find(address) else { return vec![unknown] };
            let call_offset = address - 1 - mapping.start + mapping.offset;
            let source = Source::Elf(Elf::new(format!("/proc/self/fd/{}", mapping.file.as_raw_fd())));
            let symbolized = self.symbolizer.symbolize_single(&source, Input::FileOffset(call_offset));
            (symbolized, Some(mapping.path.clone()))
        };
        let Ok(Symbolized::Sym(sym)) = symbolized else {
            return vec![Frame { module, ..unknown }];
        };
        // Kernel symbols name their module ("[ext4]"), or none for vmlinux.
        let module = module.or_else(|| {
            Some(
                sym.module
                    .as_ref()
                    .map_or("kernel".to_owned(), |module| module.to_string_lossy().into_owned()),
            )
        });
        let location = |info: Option<&symbolize::CodeInfo>| match info {
            Some(info) => (Some(info.to_path().display().to_string()), info.line),
            None => (None, None),
        };
        let mut frames = Vec::with_capacity(sym.inlined.len() + 1);
        for inlined in sym.inlined.iter().rev() {
            let (file, line) = location(inlined.code_info.as_ref());
            frames.push(Frame {
                address,
                function: Some(inlined.name.to_string()),
                offset: None,
                file,
                line,
                inlined: true,
                module: module.clone(),
            });
        }
        let (file, line) = location(sym.code_info.as_deref());
        frames.push(Frame {
            address,
            function: Some(sym.name.to_string()),
            offset: Some(sym.offset as u64 + 1),
            file,
            line,
            inlined: false,
            module,
        });
        frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_addresses_point_into_code() {
        let maps = "\
55d0a0000000-55d0a0001000 r--p 00000000 08:01 42 /usr/bin/app
55d0a0001000-55d0a0002000 r-xp 00001000 08:01 42 /usr/bin/app
55d0a1000000-55d0a1021000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000010000 rwxp 00000000 00:00 0
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0 [stack]";
        let mut modules = ProcessModules::new(0);
        assert!(modules.may_be_code(0x400), "nothing known: anything goes");
        modules.code = maps.lines().filter_map(code_range).collect();
        assert!(modules.may_be_code(0x55d0a0001010), "a binary's code");
        assert!(modules.may_be_code(0x7f0000000100), "JIT code");
        assert!(!modules.may_be_code(0x55d0a0000010), "a file's read-only data");
        assert!(!modules.may_be_code(0x55d0a1000070), "the heap");
        assert!(!modules.may_be_code(0x7ffc00000008), "a stack");
        assert!(!modules.may_be_code(0x400), "nothing mapped");
    }
}
