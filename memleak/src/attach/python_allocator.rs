//! CPython's small-object allocator: `PyObject_Malloc`, `PyObject_Calloc`,
//! `PyObject_Realloc` and `PyObject_Free`, which serve requests of 512
//! bytes and less from arenas of their own (1 MiB `mmap`s, 256 KiB before
//! 3.10) and hand larger ones on to `malloc` & co.
//!
//! With --python-allocator they are probed in the interpreter's object
//! (the `python3.X` executable or `libpython3.X.so`), with the C
//! functions' programs: they take the same arguments and mean the same.
//! So are `PyMem_Malloc` & co., which share the allocator and its arenas
//! (a list's items live there): probing only the objects' functions
//! would hide those blocks with the arenas.
//!
//! A large request is seen twice, as `PyObject_Malloc` and as the `malloc`
//! it calls; only the outer call counts (see memleak-ebpf's `calls`): it
//! has the size the program asked for and the stack of the Python line
//! that asked, and counting it alone is right whether or not the block
//! falls through to `malloc`. `PyObject_Free` likewise counts for the
//! `free` it calls. (Skipping the outer call instead would leave the
//! small objects, which call no `malloc`, uncounted.)
//!
//! An interpreter built with link-time optimisation (Debian's and
//! Ubuntu's are) has copies of the allocator's fast path inlined into
//! hundreds of its callers, which never enter the exported functions:
//! probing them there would see a fraction of the objects made and freed,
//! and report the rest as leaks or unknown frees. Such an interpreter is
//! recognised by its code (see [`inlined_copies`]) and its functions are
//! not probed; the report then labels its arenas as the interpreter's own.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use iced_x86::{Decoder, DecoderOptions, Instruction, OpKind};
use memleak_common::ALLOCATOR_FUNCTIONS;
use object::{Object as _, ObjectSection as _, SectionKind};

use crate::{elf, process::files};

/// What memleak knows of the interpreter a process runs, for the arenas
/// and, with --python-allocator, the probes.
#[derive(Clone, Debug)]
pub struct Interpreter {
    /// The object that defines `PyObject_Malloc`, held open: a mapping of
    /// the same file is the interpreter's code.
    pub file: std::sync::Arc<File>,
    /// The size of one of its arenas: `ARENA_SIZE`.
    pub arena_size: u64,
    /// Whether its small objects are tracked (its functions probed).
    pub objects_tracked: bool,
}

/// Whether the interpreter's functions can be probed, and if not, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probing {
    /// Every call of the allocator enters an exported function.
    Sound,
    /// Copies of the allocator's code in `copies` places outside them.
    Inlined { copies: usize },
}

/// The names of the functions probed, in `ALLOCATOR_FUNCTIONS` order,
/// with their places there.
pub fn functions() -> impl Iterator<Item = (usize, &'static str)> {
    ALLOCATOR_FUNCTIONS.iter().enumerate().filter(|(_, function)| function.python).map(|(i, f)| (i, f.name))
}

/// The interpreter's object, found among a process's objects.
pub struct Found {
    pub object: File,
    /// Its contents.
    pub data: Vec<u8>,
    /// As the process names it.
    pub display_path: String,
    /// `ARENA_SIZE` of its version.
    pub arena_size: u64,
}

/// The first of `candidates` (link-map order: whose definition the
/// program's calls bind to; memleak's path and the process's name of
/// each) named like an interpreter (`python3.X`, `libpython3.X.so`, or a
/// link to one) that defines `PyObject_Malloc` and `PyObject_Free`. Only
/// those are read: this runs for every process planned.
pub fn find(candidates: &[(PathBuf, String)]) -> Option<Found> {
    candidates.iter().find_map(|(path, display)| {
        // A link (python3 -> python3.11, or /proc/PID/map_files' entries)
        // names the file it leads to.
        let target = std::fs::read_link(path).ok();
        let names: Vec<&str> = [Some(display.as_str()), target.as_deref().and_then(Path::to_str)]
            .into_iter()
            .flatten()
            .filter(|name| file_name(name).starts_with("python") || file_name(name).starts_with("libpython"))
            .collect();
        if names.is_empty() {
            return None;
        }
        let object = files::open_regular(path).ok()?;
        let data = files::read_limited(&object, files::READ_LIMIT).ok()?;
        let file = object::File::parse(&*data).ok()?;
        let defines = |name| elf::dynamic_symbol(&file, name).is_some();
        if !(defines("PyObject_Malloc") && defines("PyObject_Free")) {
            return None;
        }
        let minor = names.iter().find_map(|name| minor_version(name));
        Some(Found { object, data, display_path: display.clone(), arena_size: arena_size(minor) })
    })
}

fn file_name(path: &str) -> &str {
    Path::new(path).file_name().and_then(|name| name.to_str()).unwrap_or("")
}

/// The minor version a file's name says: 11 for `python3.11` and
/// `libpython3.11.so.1.0`.
fn minor_version(path: &str) -> Option<u32> {
    let (_, rest) = file_name(path).split_once("python3.")?;
    rest.chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// `ARENA_SIZE` of CPython 3.`minor`: 256 KiB up to 3.9, 1 MiB from 3.10
/// on, where 64-bit builds use "large arenas" (Objects/obmalloc.c,
/// `USE_LARGE_ARENAS`). An unknown version is taken as recent.
fn arena_size(minor: Option<u32>) -> u64 {
    match minor {
        Some(minor) if minor < 10 => 256 << 10,
        _ => 1 << 20,
    }
}

/// Past this many copies, the allocator is inlined into its callers. A
/// build without link-time optimisation has a few places besides the
/// exported functions that name the internal allocator (the code that
/// installs it, `PYTHONMALLOC`'s report of it); one with it has copies in
/// every caller the compiler chose (193 in Debian's python3.11).
const MOST_PLACES_WITHOUT_INLINING: usize = 8;

/// Whether the allocator's functions in ELF file `data` are entered by
/// every allocation and release, as far as its code tells.
pub fn probing(data: &[u8]) -> Probing {
    let Ok(file) = object::File::parse(data) else { return Probing::Sound };
    let exported: Vec<(u64, u64)> = functions()
        .filter_map(|(_, name)| {
            let symbols = elf::function_symbols(&file, "", &[name]);
            symbols.get(name).map(|symbol| (symbol.address, symbol.size))
        })
        .collect();
    let copies = ["PyObject_Malloc", "PyObject_Free", "PyMem_Malloc", "PyMem_Free"]
        .iter()
        .map(|name| inlined_copies(&file, name, &exported))
        .max()
        .unwrap_or(0);
    if copies > MOST_PLACES_WITHOUT_INLINING {
        Probing::Inlined { copies }
    } else {
        Probing::Sound
    }
}

/// The places outside the `exported` functions (address, size) that name
/// the internal function `name` dispatches to.
///
/// `PyObject_Malloc` calls the allocator installed in `_PyObject` through
/// a pointer. When the compiler has inlined it, it guards the copy with a
/// comparison of that pointer against the internal function (GCC's
/// speculative devirtualisation: `cmp $_PyObject_Malloc,%rax`, or a
/// `lea` of it in position-independent code) and runs the copy when they
/// are equal. The exported function then names an address inside the
/// object's code; every other place naming it is a copy, or code that
/// installs or reports the allocator. Without such a guard (`jmp
/// *_PyObject+8(%rip)`), the exported function is the only way in.
fn inlined_copies(file: &object::File, name: &str, exported: &[(u64, u64)]) -> usize {
    let symbols = elf::function_symbols(file, "", &[name]);
    let Some(symbol) = symbols.get(name) else { return 0 };
    let code: Vec<(u64, &[u8])> = file
        .sections()
        .filter(|section| section.kind() == SectionKind::Text)
        .filter_map(|section| Some((section.address(), section.data().ok()?)))
        .collect();
    let in_code = |address: u64| {
        code.iter().any(|(start, bytes)| (*start..*start + bytes.len() as u64).contains(&address))
    };
    let own = symbol.address..symbol.address + symbol.size;
    let Some(internal) = code.iter().find_map(|(start, bytes)| {
        let offset = usize::try_from(own.start.checked_sub(*start)?).ok()?;
        let length = usize::try_from(symbol.size).ok()?;
        let function = bytes.get(offset..offset.checked_add(length)?)?;
        named_addresses(function, own.start).find(|&address| in_code(address) && !own.contains(&address))
    }) else {
        return 0;
    };
    let outside =
        |address: u64| !exported.iter().any(|&(start, size)| (start..start + size).contains(&address));
    code.iter()
        .map(|(start, bytes)| {
            let mut decoder = Decoder::with_ip(64, bytes, *start, DecoderOptions::NONE);
            let mut instruction = Instruction::default();
            let mut places = 0;
            while decoder.can_decode() {
                decoder.decode_out(&mut instruction);
                if outside(instruction.ip()) && names(&instruction).contains(&internal) {
                    places += 1;
                }
            }
            places
        })
        .sum()
}

/// The addresses the instructions of `code` (at `ip`) name: immediates
/// and RIP-relative operands.
fn named_addresses(code: &[u8], ip: u64) -> impl Iterator<Item = u64> + '_ {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    std::iter::from_fn(move || decoder.can_decode().then(|| decoder.decode()))
        .flat_map(|instruction| names(&instruction))
}

/// The addresses one instruction names: a 32-bit immediate taken as an
/// address (non-PIE code compares with `$0x4fb450`), or the target of a
/// RIP-relative `lea`.
fn names(instruction: &Instruction) -> Vec<u64> {
    let mut named = Vec::new();
    for operand in 0..instruction.op_count() {
        match instruction.op_kind(operand) {
            OpKind::Immediate32to64 | OpKind::Immediate32 => {
                named.push(instruction.immediate(operand));
            }
            OpKind::Memory
                if instruction.is_ip_rel_memory_operand()
                    && instruction.mnemonic() == iced_x86::Mnemonic::Lea =>
            {
                named.push(instruction.ip_rel_memory_address());
            }
            _ => {}
        }
    }
    named
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probing_of(path: &str) -> Probing {
        probing(&std::fs::read(path).expect("part of the test machine"))
    }

    #[test]
    fn debians_python_inlines_its_allocator() {
        // Built with LTO and PGO: pymalloc's fast path is copied into its
        // callers, which never enter PyObject_Malloc.
        let Probing::Inlined { copies } = probing_of("/usr/bin/python3.11") else {
            panic!("Debian's python3.11 has the allocator inlined")
        };
        assert!(copies > 50, "{copies}");
    }

    #[test]
    fn a_plain_build_calls_its_exported_allocator() {
        for version in ["3.8.18", "3.11.7", "3.13.0"] {
            let minor = &version[..version.rfind('.').unwrap()];
            let path = format!("/root/.pyenv/versions/{version}/lib/libpython{minor}.so.1.0");
            assert_eq!(probing_of(&path), Probing::Sound, "{path}");
        }
    }

    #[test]
    fn arenas_are_a_mebibyte_from_3_10() {
        let size = |path: &str| arena_size(minor_version(path));
        assert_eq!(size("/usr/bin/python3.11"), 1 << 20);
        assert_eq!(size("/opt/lib/libpython3.9.so.1.0"), 256 << 10);
        assert_eq!(size("/opt/lib/libpython3.8.so.1.0"), 256 << 10);
        assert_eq!(size("/usr/local/bin/python3.13"), 1 << 20);
        assert_eq!(size("/usr/bin/python3"), 1 << 20);
    }

    #[test]
    fn only_objects_named_like_an_interpreter_are_read() {
        let candidates = |program: &str| {
            vec![
                (PathBuf::from(program), program.to_owned()),
                (PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"), "libc.so.6".to_owned()),
            ]
        };
        let found = find(&candidates("/usr/bin/python3")).expect("Debian's python3 links to python3.11");
        assert_eq!((found.display_path.as_str(), found.arena_size), ("/usr/bin/python3", 1 << 20));
        let found = find(&candidates("/root/.pyenv/versions/3.9.18/lib/libpython3.9.so.1.0")).unwrap();
        assert_eq!(found.arena_size, 256 << 10);
        assert!(find(&candidates("/bin/bash")).is_none());
    }
}
