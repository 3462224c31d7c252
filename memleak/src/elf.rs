//! What memleak reads from ELF files: function symbols and the file
//! offsets uprobes are placed by, the program interpreter and the needed
//! libraries that decide link order, and build ids. The attach planner,
//! the address-space model and the exporters share these.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use object::{
    read::elf::{Dyn as _, FileHeader as _, ProgramHeader as _},
    Object as _, ObjectSegment as _, ObjectSymbol as _,
};

/// A function's symbol: where it starts, and its length in bytes (0 when
/// the symbol does not say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FunctionSymbol {
    pub address: u64,
    pub size: u64,
}

/// The defined functions among `names`, by unprefixed name, from .dynsym
/// first (what a stripped library still has), then .symtab.
pub fn function_symbols(
    file: &object::File,
    prefix: &str,
    names: &[&str],
) -> BTreeMap<String, FunctionSymbol> {
    let mut addresses = BTreeMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.is_undefined() || symbol.address() == 0 || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        let Some(name) = symbol.name().ok().and_then(|name| name.strip_prefix(prefix)) else { continue };
        if names.contains(&name) {
            let function = FunctionSymbol { address: symbol.address(), size: symbol.size() };
            addresses.entry(name.to_owned()).or_insert(function);
        }
    }
    addresses
}

/// Whether the Go toolchain built it: Go's linker always writes the
/// build information section.
pub fn is_go_program<'data>(file: &impl object::Object<'data>) -> bool {
    file.section_by_name(".go.buildinfo").is_some()
}

/// The address of a symbol of the dynamic symbol table, function or data.
pub fn dynamic_symbol(file: &object::File, name: &str) -> Option<u64> {
    file.dynamic_symbols()
        .find(|symbol| !symbol.is_undefined() && symbol.name() == Ok(name))
        .map(|symbol| symbol.address())
}

/// The virtual address of the first `PT_LOAD` segment: where the object
/// starts once loaded, its load bias aside.
pub fn first_load_vaddr(file: &object::File) -> Option<u64> {
    let object::File::Elf64(elf) = file else { return None };
    let endian = elf.endian();
    elf.elf_program_headers()
        .iter()
        .find(|header| header.p_type(endian) == object::elf::PT_LOAD)
        .map(|header| header.p_vaddr(endian))
}

/// Converts a virtual address to the file offset uprobes are placed by.
pub fn file_offset(file: &object::File, address: u64) -> Option<u64> {
    file.segments().find_map(|segment| {
        let (offset, size) = segment.file_range();
        let start = segment.address();
        (address >= start && address < start + size).then(|| address - start + offset)
    })
}

/// The loadable segments of the ELF file `file`, as (file offset, size in
/// the file, virtual address); reads only its headers.
pub fn load_segments(file: &std::fs::File) -> Vec<(u64, u64, u64)> {
    let cache = object::read::ReadCache::new(file);
    let Ok(parsed) = object::File::parse(&cache) else { return Vec::new() };
    parsed
        .segments()
        .map(|segment| {
            let (offset, size) = segment.file_range();
            (offset, size, segment.address())
        })
        .collect()
}

/// The `DT_NEEDED` entries of an ELF file, in order.
pub fn needed_libraries(data: &[u8]) -> Vec<String> {
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

/// The `PT_INTERP` of an ELF file, if it is dynamically linked.
pub fn interpreter(file: &object::File) -> Option<String> {
    let object::File::Elf64(elf) = file else { return None };
    let endian = elf.endian();
    let data = elf.data();
    elf.elf_program_headers().iter().find_map(|header| {
        let bytes = header.interpreter(endian, data).ok()??;
        Some(String::from_utf8_lossy(bytes).into_owned())
    })
}

/// The `PT_INTERP` of the ELF file at `path`, read from its first 64
/// KiB only: a program's headers and its interpreter's name come first,
/// and a program may be hundreds of MB.
pub fn interpreter_at(path: &Path) -> Option<String> {
    use std::io::Read as _;
    let mut start = Vec::new();
    std::fs::File::open(path).ok()?.take(64 << 10).read_to_end(&mut start).ok()?;
    let data = start.as_slice();
    let header = object::elf::FileHeader64::<object::Endianness>::parse(data).ok()?;
    let endian = header.endian().ok()?;
    header.program_headers(endian, data).ok()?.iter().find_map(|segment| {
        let bytes = segment.interpreter(endian, data).ok()??;
        Some(String::from_utf8_lossy(bytes).into_owned())
    })
}

/// The GNU build id of the ELF file at `path`, in hex.
pub fn build_id(path: &Path) -> Option<String> {
    let bytes = blazesym::helper::read_elf_build_id(path).ok().flatten()?;
    Some(hex(&bytes))
}

/// `bytes` in lowercase hex, as build ids are written.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needed_libraries_come_in_order() {
        let data = std::fs::read("/proc/self/exe").unwrap();
        let needed = needed_libraries(&data);
        assert!(needed.iter().any(|name| name == "libc.so.6"), "{needed:?}");
    }

    #[test]
    fn a_dynamic_executable_names_its_interpreter_and_build_id() {
        let data = std::fs::read("/proc/self/exe").unwrap();
        let file = object::File::parse(&*data).unwrap();
        assert_eq!(interpreter(&file).as_deref(), Some("/lib64/ld-linux-x86-64.so.2"));
        let id = build_id(Path::new("/proc/self/exe")).expect("rustc links a build id");
        assert!(id.len() >= 32 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    }
}
