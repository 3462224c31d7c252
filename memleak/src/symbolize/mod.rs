//! From return addresses to functions, files and lines, with blazesym.
//!
//! A process's addresses are symbolized through the files its address
//! space holds open (see `process::address_space`): that works after the
//! process has exited, after its binary was deleted, and for files that
//! exist only inside its container. Every stack is symbolized once and
//! cached by its id.
//!
//! `call_paths`: stacks a reader could not tell apart, reported as one;
//! `stable_id`: a stack's id across runs and machines; `debug_links`: what
//! blazesym may read of an object's debug information; `perf_map`: names
//! of JIT code; `missing`: which objects lack names or lines, and where
//! they would come from.

use std::{
    cell::RefCell,
    collections::HashMap,
    hash::{BuildHasherDefault, Hasher},
    path::PathBuf,
    rc::{Rc, Weak},
    sync::Arc,
};

use blazesym::symbolize::{
    self,
    source::{Elf, Kernel, Source},
    Input, Symbolized,
};

use crate::{
    model::Frame,
    process::{address_space::MappedObject, AddressSpace},
};

pub mod call_paths;
mod debug_links;
pub mod missing;
mod perf_map;
pub mod stable_id;

use debug_links::{DebugLinks, Route};
use perf_map::PerfMap;

/// A map keyed by machine words memleak made itself, frame pointers and
/// stack ids: hashed by one multiply, where `std`'s `SipHash`, made to
/// resist keys an adversary chooses, costs a fifth of a report over
/// 65,536 stacks that every round looks up frame by frame.
pub type WordMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

/// See `WordMap`.
#[derive(Default)]
pub struct WordHasher(u64);

impl Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }

    fn finish(&self) -> u64 {
        // The product's low bits are the key's: a frame pointer's are all
        // zero. Its high bits are mixed: they make the bucket.
        self.0 ^ (self.0 >> 32)
    }
}

/// The module of a frame in anonymous executable memory that no perf map
/// names.
pub const ANONYMOUS_CODE: &str = "anonymous executable memory";

/// Symbolizes stacks of one process, or of the kernel, each once.
pub struct StackSymbolizer {
    /// Kernel stacks, symbolized through /proc/kallsyms.
    kernel: bool,
    /// Shared with other processes' (see `PROCESS_SYMBOLIZER`).
    symbolizer: Rc<symbolize::Symbolizer>,
    /// Each stack's frames, by stack id.
    cache: WordMap<u64, Arc<[Arc<Frame>]>>,
    /// The frames of each return address (inlined ones first), symbolized
    /// once and shared by every stack through it: 65,536 stacks of 37
    /// frames hold a few thousand distinct frames, not 2.4 million.
    addresses: WordMap<u64, Arc<[Arc<Frame>]>>,
    /// Names of JIT-compiled code, where the process writes them.
    jit: Option<PerfMap>,
    /// What blazesym may read of each object's debug information; none
    /// for the kernel.
    debug_links: Option<DebugLinks>,
}

/// A blazesym symbolizer that searches `debug_dirs` for debug files
/// objects link to.
fn symbolizer(debug_dirs: &[PathBuf]) -> symbolize::Symbolizer {
    symbolize::Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .enable_demangling(true)
        .set_debug_dirs(Some(debug_dirs))
        .build()
}

/// Processes that share one symbolizer: a symbolizer never lets go of a
/// file it parsed, so a daemon that sees processes come and go for weeks
/// starts a new one now and then; the old one goes with its last process.
const PROCESSES_PER_SYMBOLIZER: usize = 256;

/// The symbolizer new processes share, and how many it has served.
struct SharedSymbolizer {
    current: Weak<symbolize::Symbolizer>,
    served: usize,
}

thread_local! {
    /// blazesym parses each file once per symbolizer (keyed by device,
    /// inode, size and modification time): processes that share one, as a
    /// node's hundred workers of one program do, share their libc's
    /// parse, and its descriptor.
    static PROCESS_SYMBOLIZER: RefCell<SharedSymbolizer> =
        const { RefCell::new(SharedSymbolizer { current: Weak::new(), served: 0 }) };
}

/// The symbolizer of a new process's stacks, shared (see
/// `PROCESS_SYMBOLIZER`). No debug directories: blazesym follows no debug
/// link of a process's objects; memleak finds their debug files itself
/// (see `debug_links`).
fn process_symbolizer() -> Rc<symbolize::Symbolizer> {
    PROCESS_SYMBOLIZER.with_borrow_mut(|shared| {
        if let Some(current) = shared.current.upgrade().filter(|_| shared.served < PROCESSES_PER_SYMBOLIZER) {
            shared.served += 1;
            return current;
        }
        let fresh = Rc::new(symbolizer(&[]));
        *shared = SharedSymbolizer { current: Rc::downgrade(&fresh), served: 1 };
        fresh
    })
}

impl StackSymbolizer {
    /// For process `pid`, whose pid in its own namespace is
    /// `namespace_pid` (if it differs).
    pub fn new(pid: u32, namespace_pid: Option<u32>) -> Self {
        Self {
            kernel: false,
            symbolizer: process_symbolizer(),
            cache: WordMap::default(),
            addresses: WordMap::default(),
            jit: Some(PerfMap::of_process(pid, namespace_pid)),
            debug_links: Some(DebugLinks::new(pid)),
        }
    }

    /// For kernel stacks.
    pub fn kernel() -> Self {
        Self {
            kernel: true,
            symbolizer: Rc::new(symbolizer(&debug_links::KERNEL_DEBUG_DIRS.map(PathBuf::from))),
            cache: WordMap::default(),
            addresses: WordMap::default(),
            jit: None,
            debug_links: None,
        }
    }

    pub fn cached(&self, stack_id: u64) -> Option<Arc<[Arc<Frame>]>> {
        self.cache.get(&stack_id).cloned()
    }

    /// Symbolizes and caches a stack given as return addresses, innermost
    /// first, of the process whose address space is `space`.
    pub fn symbolize(&mut self, stack_id: u64, addresses: &[u64], space: &AddressSpace) -> Arc<[Arc<Frame>]> {
        let mut frames: Vec<Arc<Frame>> = Vec::with_capacity(addresses.len());
        for &address in addresses {
            let at_address = if let Some(known) = self.addresses.get(&address) {
                Arc::clone(known)
            } else {
                let symbolized: Arc<[Arc<Frame>]> =
                    self.frames_at(address, space).into_iter().map(Arc::new).collect();
                self.addresses.insert(address, Arc::clone(&symbolized));
                symbolized
            };
            frames.extend(at_address.iter().cloned());
        }
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
        let frames: Arc<[Arc<Frame>]> = frames.into();
        self.cache.insert(stack_id, Arc::clone(&frames));
        frames
    }

    /// A frame in code of no file: named from the perf map if the runtime
    /// that compiled it writes one; else, in anonymous executable memory,
    /// said to be there, which tells JIT code or a trampoline from an
    /// address memleak knows nothing of.
    fn jit_frame(&mut self, address: u64, space: &AddressSpace) -> Frame {
        let named = self.jit.as_mut().and_then(|jit| jit.name(address - 1));
        match named {
            // The runtime's name often carries the source location
            // ("JS:^handle /app/server.js:12:3"): an offset would read as
            // part of it.
            Some((name, _)) => Frame {
                address,
                function: Some(name.to_owned()),
                module: Some("jit".to_owned()),
                ..Frame::default()
            },
            None => Frame {
                address,
                module: space.in_anonymous_code(address - 1).then(|| ANONYMOUS_CODE.to_owned()),
                ..Frame::default()
            },
        }
    }

    /// The frames of one return address: the inlined ones innermost first,
    /// then the function that holds them.
    fn frames_at(&mut self, address: u64, space: &AddressSpace) -> Vec<Frame> {
        let unknown = Frame { address, ..Frame::default() };
        if self.kernel {
            let source = Source::Kernel(Kernel::default());
            // A return address points after the call; the call itself, whose
            // line we want, is the byte before.
            let symbolized = self.symbolizer.symbolize_single(&source, Input::AbsAddr(address - 1));
            let Ok(Symbolized::Sym(sym)) = symbolized else { return vec![unknown] };
            // Kernel symbols name their module ("[ext4]"), or none for vmlinux.
            let module = sym
                .module
                .as_ref()
                .map_or("kernel".to_owned(), |module| module.to_string_lossy().into_owned());
            let named = Frame { module: Some(module), offset: Some(sym.offset as u64 + 1), ..unknown };
            return frames_of_symbol(&sym, named);
        }
        let Some(mapping) = space.find(address) else { return vec![self.jit_frame(address, space)] };
        let object = &mapping.object;
        let in_file = Frame {
            module: Some(object.name.clone()),
            file_offset: Some(mapping.file_offset(address)),
            build_id: object.build_id().map(str::to_owned),
            ..unknown
        };
        let call_offset = mapping.file_offset(address - 1);
        let route = self.debug_links.as_mut().map_or(Route::SymbolsOnly, |links| links.route(object));
        let debug_syms = !matches!(route, Route::SymbolsOnly);
        let from_debug_file = match &route {
            Route::Separate(debug_file) => {
                debug_file.virtual_offset(call_offset).and_then(|virtual_offset| {
                    let mut elf = Elf::new(debug_file.fd_path());
                    elf.debug_syms = true;
                    let input = Input::VirtOffset(virtual_offset);
                    match self.symbolizer.symbolize_single(&Source::Elf(elf), input) {
                        Ok(Symbolized::Sym(sym)) => Some(sym),
                        _ => None,
                    }
                })
            }
            Route::Own | Route::SymbolsOnly => None,
        };
        let symbolized = if let Some(sym) = from_debug_file {
            Ok(Symbolized::Sym(sym))
        } else {
            let mut elf = Elf::new(object.fd_path());
            elf.debug_syms = matches!(route, Route::Own);
            self.symbolizer.symbolize_single(&Source::Elf(elf), Input::FileOffset(call_offset))
        };
        let Ok(Symbolized::Sym(sym)) = symbolized else { return vec![in_file] };
        let mut frames = frames_of_symbol(&sym, in_file);
        let own_symbol = SymbolPart::of(&sym);
        // Where the function starts comes from the symbol tables: blazesym
        // counts a DWARF function's offsets from the lowest address of all
        // its parts, which for a function with a cold part is far from the
        // code (`make_session(int)+0x14b4` in a function 0x54 bytes long).
        let part = if debug_syms { self.symbol_part(object, call_offset) } else { Some(own_symbol) };
        if let Some(function) = frames.last_mut() {
            function.offset = part.map(|part| part.call_offset + 1);
            function.cold_part = part.is_some_and(|part| part.cold);
            // A symbol table's name of a cold part names the part.
            if let Some(name) = function.function.as_mut() {
                let length = split_cold(name).0.len();
                name.truncate(length);
            }
        }
        frames
    }

    /// The symbol-table entry holding `call_offset` of `object`: the
    /// object's own symbols, else those of its separate debug file (found
    /// by build id, as distributions install them), whose addresses are
    /// virtual.
    fn symbol_part(&mut self, object: &MappedObject, call_offset: u64) -> Option<SymbolPart> {
        let mut own = Elf::new(object.fd_path());
        own.debug_syms = false;
        if let Ok(Symbolized::Sym(sym)) =
            self.symbolizer.symbolize_single(&Source::Elf(own), Input::FileOffset(call_offset))
        {
            return Some(SymbolPart::of(&sym));
        }
        let debug_file = self.debug_links.as_mut()?.separate_file(object)?;
        let virtual_offset = debug_file.virtual_offset(call_offset)?;
        let mut elf = Elf::new(debug_file.fd_path());
        elf.debug_syms = false;
        match self.symbolizer.symbolize_single(&Source::Elf(elf), Input::VirtOffset(virtual_offset)) {
            Ok(Symbolized::Sym(sym)) => Some(SymbolPart::of(&sym)),
            _ => None,
        }
    }
}

/// Whether `frame` is where a stack was left for another: a Go
/// program's cgo call runs its C code on the system stack, as does the
/// runtime's own work there. The walk follows the frame pointer its Go
/// caller left back to the goroutine's stack (`RuleKind::GoStackSwitch`);
/// a walk that ends at one of them ended at the switch.
pub fn ends_at_stack_switch(frame: &Frame) -> bool {
    !frame.inlined && frame.function.as_deref().is_some_and(crate::unwind::eh_frame::is_go_stack_switch)
}

/// Where a symbol-table entry puts an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SymbolPart {
    /// Bytes from the entry's start to the call.
    call_offset: u64,
    /// The entry is a cold part of its function.
    cold: bool,
}

impl SymbolPart {
    fn of(sym: &symbolize::Sym) -> Self {
        Self { call_offset: sym.offset as u64, cold: split_cold(&sym.name).1 }
    }
}

/// A function's name without the suffix gcc gives the part of it that it
/// moved away as unlikely to run, and whether it had one:
/// `make_session(int) [clone .cold]` (demangled) and `parse.cold` are
/// parts of `make_session(int)` and `parse`.
fn split_cold(name: &str) -> (&str, bool) {
    for suffix in [" [clone .cold]", ".cold"] {
        if let Some(function) = name.strip_suffix(suffix) {
            return (function, true);
        }
    }
    (name, false)
}

/// The frames a symbol gives: its inlined functions, innermost first, then
/// itself, as `named` (its address, module and offset) says.
fn frames_of_symbol(sym: &symbolize::Sym, named: Frame) -> Vec<Frame> {
    let location = |info: Option<&symbolize::CodeInfo>| match info {
        Some(info) => (Some(info.to_path().display().to_string()), info.line),
        None => (None, None),
    };
    let mut frames = Vec::with_capacity(sym.inlined.len() + 1);
    for inlined in sym.inlined.iter().rev() {
        let (file, line) = location(inlined.code_info.as_ref());
        frames.push(Frame {
            function: Some(inlined.name.to_string()),
            offset: None,
            file,
            line,
            inlined: true,
            cold_part: false,
            ..named.clone()
        });
    }
    let (file, line) = location(sym.code_info.as_deref());
    frames.push(Frame { function: Some(sym.name.to_string()), file, line, inlined: false, ..named });
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn a_function_of_ours() -> u64 {
        a_function_of_ours as fn() -> u64 as usize as u64
    }

    #[test]
    fn stacks_through_the_same_code_share_its_frames() {
        let pid = std::process::id();
        let space = AddressSpace::read(pid).unwrap();
        let mut symbolizer = StackSymbolizer::new(pid, None);
        // Return addresses one byte into the function: the call is before.
        let ours = a_function_of_ours() + 2;
        let other = stacks_through_the_same_code_share_its_frames as fn() as usize as u64 + 2;
        let first = symbolizer.symbolize(1, &[ours, other], &space);
        let second = symbolizer.symbolize(2, &[other, ours], &space);
        assert!(first[0].function.as_deref().is_some_and(|name| name.contains("a_function_of_ours")));
        assert!(Arc::ptr_eq(&first[0], &second[second.len() - 1]), "one frame for one address");
        assert!(Arc::ptr_eq(&first[first.len() - 1], &second[0]));
    }
}
