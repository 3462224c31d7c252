//! An object's unwind table: its call frame information (`.eh_frame`, and
//! `.debug_frame` of its own or of a separate debug file) reduced to the
//! sorted [`UnwindRow`]s the BPF walker binary-searches.
//!
//! The walker runs at a return probe, where every frame stands at a call
//! site, and steps with three facts per address: where the CFA is (rsp or
//! rbp plus an offset), that the return address lies just below it, and in
//! which slot below it the caller's rbp was saved. Whatever else CFI can
//! say (expressions, other registers) becomes an [`RuleKind::Unsupported`]
//! row and code without CFI gets [`RuleKind::FramePointer`] rows, both of
//! which the walker takes as a checked frame-pointer step. Repeated rules
//! are merged, also across the alignment padding between functions, which
//! keeps Debian's libc at about 23 k rows of 8 bytes.
//!
//! Row pcs are offsets from the object's lowest executable address, so
//! every object fits 32 bits and one table serves every process that maps
//! the object, wherever it is loaded.

#![allow(
    dead_code,
    reason = "the debug-file lookup and the health counters that use the rest are not written yet"
)]

use std::{
    borrow::Cow,
    collections::BTreeMap,
    io::Read as _,
    ops::{Bound, Range},
    path::{Path, PathBuf},
};

use gimli::{
    AArch64, BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianSlice, FrameDescriptionEntry,
    LittleEndian, RegisterRule, UnwindContext, UnwindSection, UnwindTableRow, Vendor, X86_64,
};
use memleak_common::{Rule, RuleKind, UnwindRow};
use object::{
    elf::{EM_AARCH64, EM_X86_64, PF_X, PT_LOAD},
    read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _},
    read::ReadCache,
    CompressedData, CompressionFormat, Endianness, Object as _, ObjectSection as _, ObjectSymbol as _,
    ReadRef,
};

/// A gap of at most this many bytes between two FDEs is alignment padding
/// (functions are aligned to 16 bytes at most), not code without CFI: the
/// rule before it simply goes on, as in the OpenTelemetry profiler
/// (`MinimumGap`).
const MAX_PADDING: u64 = 15;

/// Decompressed sections are allocated up front up to this size only, so
/// that a corrupt header cannot ask for gigabytes before any byte is read.
const MAX_PREALLOCATION: u64 = 64 << 20;

/// The largest call frame section read, before or after decompression:
/// far more than any object's (Debian's libLLVM's `.eh_frame` is a few
/// megabytes), and what a crafted file (a debug file a container ships,
/// a zlib bomb) can make memleak hold at most.
const MAX_SECTION: u64 = 256 << 20;

/// The unwind rows of one object, the same for every process mapping it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectTable {
    /// The lowest `p_vaddr` of the object's executable `PT_LOAD` segments;
    /// every row's pc is an offset from it.
    pub text_base: u64,
    /// Sorted by pc, each pc once, never empty: an object without any call
    /// frame information gets a single frame-pointer row at 0, and the last
    /// row is always a frame-pointer row where the last FDE ends.
    pub rows: Vec<UnwindRow>,
    pub stats: TableStats,
}

/// What went into a table: for the health counters, and for a caller
/// judging from the coverage whether a separate debug file is worth
/// looking for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// FDEs with rows in the table, from every section.
    pub fdes: usize,
    /// Of those, from the object's own `.debug_frame`.
    pub debug_frame_fdes: usize,
    /// Of those, from the separate debug file's `.debug_frame`.
    pub debug_file_fdes: usize,
    /// FDEs gimli could not parse or evaluate (libgcrypt has two): their
    /// code gets frame-pointer rows.
    pub skipped_fdes: usize,
    /// FDEs for no code of this object (`.debug_frame` keeps FDEs at zero
    /// or tombstone addresses for functions the linker dropped), or for
    /// code that an FDE of a preferred section already covers.
    pub ignored_fdes: usize,
    /// Sections whose entries could not be parsed to the end: the FDEs
    /// after the damage are missing.
    pub truncated_sections: usize,
    /// Signal trampolines (FDE augmentation 'S'), one Signal row each.
    pub signal_fdes: usize,
    /// Rows gimli produced, before they were mapped to rules and merged
    /// (a signal trampoline's are not evaluated).
    pub cfi_rows: usize,
    /// Of those, rows that became [`RuleKind::Unsupported`]; by reason in
    /// `unsupported`.
    pub unsupported_rows: usize,
    pub unsupported: UnsupportedRows,
    /// Stop rows in the table, where walks reach the root of a stack.
    pub stop_rows: usize,
    /// Bytes of code with call frame information, and of executable
    /// segments in all.
    pub covered_bytes: u64,
    pub code_bytes: u64,
}

/// Why rows of call frame information became [`RuleKind::Unsupported`],
/// counted per gimli row, by the first thing found wrong: the return
/// address, then the CFA, then rbp.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnsupportedRows {
    /// The return address is not at CFA - 8: libc's `longjmp` family and
    /// `setcontext` take it from a register or from memory elsewhere.
    pub return_address: usize,
    /// The CFA is a DWARF expression: one PLT row per object, and
    /// hand-written assembly (libcrypto).
    pub cfa_expression: usize,
    /// The CFA is relative to a register other than rsp and rbp (ld.so's
    /// `_dl_runtime_resolve*`, libcrypto).
    pub cfa_register: usize,
    /// rbp is saved other than in a slot below the CFA.
    pub saved_rbp: usize,
    /// An offset the packed rule cannot hold: negative, not a multiple of
    /// 8, or too large.
    pub offset_range: usize,
}

/// A separate debug file of the object, found by build id or
/// `.gnu_debuglink`: its `.debug_frame` fills in code that the object's own
/// sections leave without call frame information. Read from the open file
/// as needed (its headers, build id and `.debug_frame`), never whole: a
/// debug file is mostly DWARF that unwinding does not use.
#[derive(Clone, Copy, Debug)]
pub struct DebugFile<'a> {
    /// Names the file in errors.
    pub path: &'a Path,
    pub file: &'a std::fs::File,
}

#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("{path} is not a 64-bit ELF object: {source}")]
    NotElf { path: PathBuf, source: object::Error },
    #[error("{path} is not an {} object, the code of the machine memleak runs on", Machine::HOST.name())]
    OtherMachine { path: PathBuf },
    #[error("{path} has no executable segment")]
    NoExecutableCode { path: PathBuf },
    #[error("the code of {path} spans {span:#x} bytes, more than unwind rows address (4 GiB)")]
    TooLarge { path: PathBuf, span: u64 },
    #[error("cannot read the {section} section of {path}: {source}")]
    Section { path: PathBuf, section: &'static str, source: object::Error },
    #[error("cannot decompress the {section} section of {path}: {source}")]
    Decompress { path: PathBuf, section: &'static str, source: std::io::Error },
    #[error("the {section} section of {path} is {size} bytes, more than memleak reads ({MAX_SECTION})")]
    SectionTooLarge { path: PathBuf, section: &'static str, size: u64 },
    #[error("the {section} section of {path} is compressed as {format}, which memleak does not read")]
    Compression { path: PathBuf, section: &'static str, format: String },
    #[error("{debug_file} is not the debug file of {path}: their build ids differ")]
    DebugFileMismatch { path: PathBuf, debug_file: PathBuf },
}

/// The unwind table of the ELF object `elf`, which `path` names in errors.
pub fn build(path: &Path, elf: &[u8]) -> Result<ObjectTable, TableError> {
    build_with_debug_file(path, elf, None)
}

/// [`build`], also reading the `.debug_frame` of the object's separate
/// debug file, which covers code that the object's own `.eh_frame` and
/// `.debug_frame` do not (they win where both describe the same code). A
/// debug file that cannot be used is an error rather than silently left
/// out: [`build`] gives the table without it.
pub fn build_with_debug_file(
    path: &Path,
    elf: &[u8],
    debug_file: Option<DebugFile<'_>>,
) -> Result<ObjectTable, TableError> {
    build_for(Machine::HOST, path, elf, debug_file)
}

/// [`build_with_debug_file`] for the code of `machine`.
fn build_for(
    machine: Machine,
    path: &Path,
    elf: &[u8],
    debug_file: Option<DebugFile<'_>>,
) -> Result<ObjectTable, TableError> {
    let object = parse_elf(machine, path, elf)?;
    let mut builder = Builder::new(machine, ExecutableCode::of(path, &object)?);
    builder.add_go_runtime_rules(&object);
    if let Some(section) = section_bytes(path, &object, ".eh_frame")? {
        let mut eh_frame = EhFrame::new(&section.bytes, LittleEndian);
        eh_frame.set_address_size(8);
        eh_frame.set_vendor(machine.vendor());
        builder.add_section(path, &eh_frame, &eh_frame_bases(&object, section.address), Source::EhFrame);
    }
    builder.add_debug_frame(path, &object, Source::DebugFrame)?;
    if let Some(debug_file) = debug_file {
        let cache = ReadCache::new(debug_file.file);
        let debug_object = parse_elf(machine, debug_file.path, &cache)?;
        if build_id(&object).zip(build_id(&debug_object)).is_some_and(|(ours, its)| ours != its) {
            return Err(TableError::DebugFileMismatch {
                path: path.to_owned(),
                debug_file: debug_file.path.to_owned(),
            });
        }
        builder.add_debug_frame(debug_file.path, &debug_object, Source::DebugFile)?;
    }
    builder.finish(path)
}

/// One FDE of an object's `.eh_frame`: the code it covers, in the
/// object's own addresses, and whether that code is entered by a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdeSpan {
    pub code: Range<u64>,
    /// Its first row puts the CFA where a call leaves it (x86-64: rsp +
    /// 8, just past the return address; arm64: sp): a function's entry.
    /// A part the compiler moved out of a function (GCC's `.cold`) is
    /// jumped to from its body, with the body's frame on the stack, and
    /// starts with that frame's rule instead.
    pub entered_by_call: bool,
}

/// The machines whose code memleak unwinds: each object's table is built
/// for the machine memleak runs on, whose registers its BPF walker steps
/// with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Machine {
    X86_64,
    Aarch64,
}

impl Machine {
    const HOST: Self = if cfg!(target_arch = "aarch64") { Self::Aarch64 } else { Self::X86_64 };

    fn e_machine(self) -> u16 {
        match self {
            Self::X86_64 => EM_X86_64,
            Self::Aarch64 => EM_AARCH64,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::X86_64 => "x86-64",
            Self::Aarch64 => "arm64",
        }
    }

    /// How gimli reads the machine's vendor extensions: arm64's
    /// `DW_CFA_AARCH64_negate_ra_state`, in every function that signs its
    /// return address, shares its opcode with SPARC's `window_save`.
    fn vendor(self) -> Vendor {
        match self {
            Self::X86_64 => Vendor::Default,
            Self::Aarch64 => Vendor::AArch64,
        }
    }

    /// The CFA at a function's first instruction, just after a call.
    fn cfa_at_entry(self) -> CfaRule<usize> {
        match self {
            Self::X86_64 => CfaRule::RegisterAndOffset { register: X86_64::RSP, offset: 8 },
            Self::Aarch64 => CfaRule::RegisterAndOffset { register: AArch64::SP, offset: 0 },
        }
    }
}

/// The FDEs of the object's `.eh_frame`, sorted by address: functions,
/// and parts of functions that no symbol may name.
pub fn fde_spans<'data, R: ReadRef<'data>>(path: &Path, data: R) -> Result<Vec<FdeSpan>, TableError> {
    let machine = Machine::HOST;
    let object = parse_elf(machine, path, data)?;
    let Some(section) = section_bytes(path, &object, ".eh_frame")? else { return Ok(Vec::new()) };
    let mut eh_frame = EhFrame::new(&section.bytes, LittleEndian);
    eh_frame.set_address_size(8);
    eh_frame.set_vendor(machine.vendor());
    let bases = eh_frame_bases(&object, section.address);
    let mut context = UnwindContext::new();
    let mut entries = eh_frame.entries(&bases);
    let mut spans = Vec::new();
    // An unreadable entry ends the walk: what came before still stands.
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else { continue };
        let first_cfa = fde
            .rows(&eh_frame, &bases, &mut context)
            .ok()
            .and_then(|mut rows| rows.next_row().ok().flatten().map(|row| row.cfa().clone()));
        let entered_by_call = first_cfa == Some(machine.cfa_at_entry());
        spans.push(FdeSpan { code: fde.initial_address()..fde.end_address(), entered_by_call });
    }
    spans.sort_by_key(|span| (span.code.start, span.code.end));
    Ok(spans)
}

type Elf<'data, R = &'data [u8]> = ElfFile64<'data, Endianness, R>;
type Reader<'data> = EndianSlice<'data, LittleEndian>;

/// The object at `data`, if it is one of `machine`'s.
fn parse_elf<'data, R: ReadRef<'data>>(
    machine: Machine,
    path: &Path,
    data: R,
) -> Result<Elf<'data, R>, TableError> {
    let object =
        Elf::<R>::parse(data).map_err(|source| TableError::NotElf { path: path.to_owned(), source })?;
    if object.elf_header().e_machine(object.endian()) != machine.e_machine() || !object.is_little_endian() {
        return Err(TableError::OtherMachine { path: path.to_owned() });
    }
    Ok(object)
}

fn build_id<'data, R: ReadRef<'data>>(object: &Elf<'data, R>) -> Option<&'data [u8]> {
    object.build_id().ok().flatten()
}

/// A section's address and contents, decompressed if need be (debug
/// files usually compress theirs).
struct SectionBytes<'data> {
    address: u64,
    bytes: Cow<'data, [u8]>,
}

/// `None` if the object has no such section. A `SHT_NOBITS` section (a
/// debug file's `.eh_frame`) is empty.
fn section_bytes<'data, R: ReadRef<'data>>(
    path: &Path,
    object: &Elf<'data, R>,
    section: &'static str,
) -> Result<Option<SectionBytes<'data>>, TableError> {
    let Some(found) = object.section_by_name(section) else { return Ok(None) };
    let too_large = |size| TableError::SectionTooLarge { path: path.to_owned(), section, size };
    // Its size in the file, before its bytes are read.
    if found.size() > MAX_SECTION {
        return Err(too_large(found.size()));
    }
    let compressed = found.compressed_data().map_err(|source| TableError::Section {
        path: path.to_owned(),
        section,
        source,
    })?;
    if compressed.uncompressed_size > MAX_SECTION {
        return Err(too_large(compressed.uncompressed_size));
    }
    let bytes = match compressed.format {
        CompressionFormat::None => Cow::Borrowed(compressed.data),
        CompressionFormat::Zlib => {
            Cow::Owned(inflate(&compressed).map_err(|source| TableError::Decompress {
                path: path.to_owned(),
                section,
                source,
            })?)
        }
        format => {
            return Err(TableError::Compression {
                path: path.to_owned(),
                section,
                format: format!("{format:?}"),
            })
        }
    };
    Ok(Some(SectionBytes { address: found.address(), bytes }))
}

fn inflate(compressed: &CompressedData<'_>) -> std::io::Result<Vec<u8>> {
    let size = compressed.uncompressed_size;
    let mut bytes = Vec::with_capacity(usize::try_from(size.min(MAX_PREALLOCATION)).unwrap_or(0));
    flate2::read::ZlibDecoder::new(compressed.data).take(size).read_to_end(&mut bytes)?;
    if bytes.len() as u64 != size {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{} bytes instead of {size}", bytes.len()),
        ));
    }
    Ok(bytes)
}

/// The bases of the pointer encodings `.eh_frame` may use: relative to
/// itself, to `.eh_frame_hdr`, to `.text` or to `.got`.
fn eh_frame_bases<'data, R: ReadRef<'data>>(object: &Elf<'data, R>, eh_frame: u64) -> BaseAddresses {
    let address = |name| object.section_by_name(name).map(|section| section.address());
    let mut bases = BaseAddresses::default().set_eh_frame(eh_frame);
    if let Some(eh_frame_hdr) = address(".eh_frame_hdr") {
        bases = bases.set_eh_frame_hdr(eh_frame_hdr);
    }
    if let Some(text) = address(".text") {
        bases = bases.set_text(text);
    }
    if let Some(got) = address(".got") {
        bases = bases.set_got(got);
    }
    bases
}

/// The object's executable segments: FDEs for code outside them describe
/// nothing the walker can meet.
struct ExecutableCode {
    text_base: u64,
    segments: Vec<Range<u64>>,
}

impl ExecutableCode {
    fn of(path: &Path, object: &Elf<'_>) -> Result<Self, TableError> {
        let endian = object.endian();
        let segments: Vec<Range<u64>> = object
            .elf_program_headers()
            .iter()
            .filter(|header| header.p_type(endian) == PT_LOAD && header.p_flags(endian) & PF_X != 0)
            .map(|header| {
                header.p_vaddr(endian)..header.p_vaddr(endian).saturating_add(header.p_memsz(endian))
            })
            .collect();
        let Some(text_base) = segments.iter().map(|segment| segment.start).min() else {
            return Err(TableError::NoExecutableCode { path: path.to_owned() });
        };
        let code = Self { text_base, segments };
        if code.span() > u64::from(u32::MAX) {
            return Err(TableError::TooLarge { path: path.to_owned(), span: code.span() });
        }
        Ok(code)
    }

    /// From the lowest executable address to the end of the highest.
    fn span(&self) -> u64 {
        self.segments.iter().map(|segment| segment.end).max().unwrap_or(self.text_base) - self.text_base
    }

    fn contains(&self, code: &Range<u64>) -> bool {
        self.segments.iter().any(|segment| segment.start <= code.start && code.end <= segment.end)
    }
}

/// Go's runtime functions whose call frame information does not say how
/// to leave them, and the rule that does. Go's linker writes one rule
/// for a whole assembly function, from its declared frame size, whatever
/// it does to the stack pointer.
const GO_RUNTIME_RULES: [(&str, RuleKind); 11] = [
    // The roots of Go's stacks: each goroutine's, the main thread's, each
    // other thread's. Go marks them TOPFRAME, but says so in .debug_frame
    // only on architectures with a link register: past them, a walk read
    // whatever lay above the stack.
    ("runtime.goexit", RuleKind::Stop),
    ("runtime.rt0_go", RuleKind::Stop),
    ("runtime.mstart", RuleKind::Stop),
    // Calls that leave the goroutine's stack for the system stack: a cgo
    // call, and the runtime's own work there (growing the heap, starting
    // a goroutine, growing a goroutine's stack, scheduling). Each leaves
    // its caller's frame pointer in rbp; a step through it reaches the
    // caller's caller, as the caller's own return address is only in the
    // goroutine's saved state.
    ("runtime.asmcgocall", RuleKind::GoStackSwitch),
    ("runtime.asmcgocall_no_g", RuleKind::GoStackSwitch),
    ("runtime.systemstack", RuleKind::GoStackSwitch),
    ("runtime.morestack", RuleKind::GoStackSwitch),
    ("runtime.mcall", RuleKind::GoStackSwitch),
    // Calls into the C library's mmap, munmap and sigaction, which align
    // the stack pointer for C: their frame pointers still hold.
    ("runtime.callCgoMmap", RuleKind::FramePointer),
    ("runtime.callCgoMunmap", RuleKind::FramePointer),
    ("runtime.callCgoSigaction", RuleKind::FramePointer),
];

/// Whether `function` is one of Go's runtime functions that leave a
/// goroutine's stack for the system stack, by its name in DWARF or in the
/// symbol table (`.abi0`).
pub fn is_go_stack_switch(function: &str) -> bool {
    let function = function.strip_suffix(".abi0").unwrap_or(function);
    GO_RUNTIME_RULES.iter().any(|&(name, kind)| kind == RuleKind::GoStackSwitch && name == function)
}

/// Where an FDE comes from, in order of preference where two describe the
/// same code: memleak's own rules for Go's runtime, then `.eh_frame`,
/// which is what the program's own unwinder trusts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    GoRuntime,
    EhFrame,
    DebugFrame,
    DebugFile,
}

/// One FDE's rows in [`Builder::rows`], before the sections are merged.
struct FdeRows {
    code: Range<u64>,
    rows: Range<usize>,
    source: Source,
}

/// The part of an FDE's code that no preferred FDE covers, and its rows.
struct Piece {
    code: Range<u64>,
    rows: Range<usize>,
}

#[derive(Clone, Copy, Debug)]
enum Unsupported {
    CfaExpression,
    CfaRegister,
    ReturnAddress,
    SavedRbp,
    OffsetRange,
}

struct Builder {
    machine: Machine,
    code: ExecutableCode,
    /// Every FDE's rows as (address, rule), merged within each FDE only.
    rows: Vec<(u64, Rule)>,
    /// In order of preference: by section, then as the section lists them.
    fdes: Vec<FdeRows>,
    context: UnwindContext<usize>,
    stats: TableStats,
    /// The object is Go's: its own `.debug_frame` describes Go code.
    go: bool,
}

impl Builder {
    fn new(machine: Machine, code: ExecutableCode) -> Self {
        Self {
            machine,
            code,
            rows: Vec::new(),
            fdes: Vec::new(),
            context: UnwindContext::new(),
            stats: TableStats::default(),
            go: false,
        }
    }

    /// In a Go program (or a library built with `-buildmode=c-shared`),
    /// one rule over each of `GO_RUNTIME_RULES`' functions that its
    /// symbol table names. Since Go 1.17 an assembly function's symbol
    /// is `NAME.abi0`, and `NAME` a wrapper for Go callers with a frame
    /// of its own, which keeps the rules its call frame information
    /// gives.
    /// x86-64's only: Go's stack switches on arm64 are not followed yet.
    fn add_go_runtime_rules<'data, R: ReadRef<'data>>(&mut self, object: &Elf<'data, R>) {
        if self.machine != Machine::X86_64 || !crate::elf::is_go_program(object) {
            return;
        }
        self.go = true;
        // Per function of the table: its code, and whether that is the
        // `.abi0` symbol's.
        let mut found: [Option<(Range<u64>, bool)>; GO_RUNTIME_RULES.len()] = Default::default();
        for symbol in object.symbols() {
            let Ok(name) = symbol.name() else { continue };
            let (function, abi0) =
                name.strip_suffix(".abi0").map_or((name, false), |function| (function, true));
            let Some(index) = GO_RUNTIME_RULES.iter().position(|(known, _)| *known == function) else {
                continue;
            };
            if found[index].as_ref().is_none_or(|(_, found_abi0)| abi0 && !found_abi0) {
                found[index] = Some((symbol.address()..symbol.address().saturating_add(symbol.size()), abi0));
            }
        }
        for (&(_, kind), found) in GO_RUNTIME_RULES.iter().zip(found) {
            let Some((code, _)) = found.filter(|(code, _)| !code.is_empty() && self.code.contains(code))
            else {
                continue;
            };
            let row = self.rows.len();
            self.rows.push((code.start, Rule::of(kind)));
            self.fdes.push(FdeRows { code, rows: row..row + 1, source: Source::GoRuntime });
        }
    }

    fn add_debug_frame<'data, R: ReadRef<'data>>(
        &mut self,
        path: &Path,
        object: &Elf<'data, R>,
        source: Source,
    ) -> Result<(), TableError> {
        if let Some(section) = section_bytes(path, object, ".debug_frame")? {
            let mut debug_frame = DebugFrame::new(&section.bytes, LittleEndian);
            debug_frame.set_address_size(8);
            debug_frame.set_vendor(self.machine.vendor());
            // .debug_frame addresses are absolute: no bases needed.
            self.add_section(path, &debug_frame, &BaseAddresses::default(), source);
        }
        Ok(())
    }

    fn add_section<'data, S>(&mut self, path: &Path, section: &S, bases: &BaseAddresses, source: Source)
    where
        S: UnwindSection<Reader<'data>>,
    {
        let mut entries = section.entries(bases);
        loop {
            match entries.next() {
                Ok(None) => return,
                Ok(Some(CieOrFde::Cie(_))) => {}
                Ok(Some(CieOrFde::Fde(partial))) => match partial.parse(S::cie_from_offset) {
                    Ok(fde) => self.add_fde(path, section, bases, &fde, source),
                    Err(error) => {
                        log::debug!("{}: skipping an FDE of {source:?}: {error}", path.display());
                        self.stats.skipped_fdes += 1;
                    }
                },
                Err(error) => {
                    log::debug!("{}: the rest of {source:?} is unreadable: {error}", path.display());
                    self.stats.truncated_sections += 1;
                    return;
                }
            }
        }
    }

    /// Adds an FDE's rows, or none of them if gimli fails part way.
    fn add_fde<'data, S>(
        &mut self,
        path: &Path,
        section: &S,
        bases: &BaseAddresses,
        fde: &FrameDescriptionEntry<Reader<'data>>,
        source: Source,
    ) where
        S: UnwindSection<Reader<'data>>,
    {
        let code = fde.initial_address()..fde.end_address();
        if code.is_empty() || !self.code.contains(&code) {
            self.stats.ignored_fdes += 1;
            return;
        }
        let (first_row, stats_before) = (self.rows.len(), self.stats);
        let evaluated = if fde.is_signal_trampoline() && self.machine == Machine::X86_64 {
            // glibc's __restore_rt: the walker reads the signal frame
            // whatever the rows would say.
            self.stats.signal_fdes += 1;
            self.rows.push((code.start, Rule::of(RuleKind::Signal)));
            Ok(())
        } else {
            self.add_fde_rows(section, bases, fde, source)
        };
        match evaluated {
            Ok(()) if self.rows.len() > first_row => {
                self.fdes.push(FdeRows { code, rows: first_row..self.rows.len(), source });
            }
            Ok(()) => self.stats.ignored_fdes += 1,
            Err(error) => {
                log::debug!(
                    "{}: skipping the FDE for {:#x}..{:#x}: {error}",
                    path.display(),
                    code.start,
                    code.end
                );
                self.rows.truncate(first_row);
                self.stats = stats_before;
                self.stats.skipped_fdes += 1;
            }
        }
    }

    fn add_fde_rows<'data, S>(
        &mut self,
        section: &S,
        bases: &BaseAddresses,
        fde: &FrameDescriptionEntry<Reader<'data>>,
        source: Source,
    ) -> gimli::Result<()>
    where
        S: UnwindSection<Reader<'data>>,
    {
        let go_code = self.go && source == Source::DebugFrame;
        let first_row = self.rows.len();
        let mut table = fde.rows(section, bases, &mut self.context)?;
        while let Some(row) = table.next_row()? {
            // Rows past the FDE's end, or of no length, cover no code.
            if row.start_address() >= row.end_address().min(fde.end_address()) {
                continue;
            }
            self.stats.cfi_rows += 1;
            let rule = rule_of(self.machine, row).unwrap_or_else(|reason| {
                self.stats.count_unsupported(reason);
                Rule::of(RuleKind::Unsupported)
            });
            let rule = if go_code { with_go_saved_rbp(rule) } else { rule };
            let repeated =
                self.rows.len() > first_row && self.rows.last().is_some_and(|&(_, last)| last == rule);
            if !repeated {
                self.rows.push((row.start_address(), rule));
            }
        }
        Ok(())
    }

    fn finish(mut self, path: &Path) -> Result<ObjectTable, TableError> {
        let pieces = self.claim_pieces();
        let rows = table_rows(&pieces, &self.rows, self.code.text_base)
            .ok_or_else(|| TableError::TooLarge { path: path.to_owned(), span: self.code.span() })?;
        self.stats.stop_rows = rows.iter().filter(|row| row.rule == Rule::of(RuleKind::Stop)).count();
        self.stats.covered_bytes = pieces.iter().map(|piece| piece.code.end - piece.code.start).sum();
        self.stats.code_bytes = self.code.segments.iter().map(|segment| segment.end - segment.start).sum();
        Ok(ObjectTable { text_base: self.code.text_base, rows, stats: self.stats })
    }

    /// The FDEs, in order of preference, cut to the code no earlier FDE
    /// covers, sorted by address: the union of all sections, each address
    /// described by the first FDE that covers it.
    fn claim_pieces(&mut self) -> Vec<Piece> {
        let mut covered = BTreeMap::new();
        let mut free = Vec::new();
        let mut pieces = Vec::with_capacity(self.fdes.len());
        for fde in &self.fdes {
            free.clear();
            uncovered(&covered, &fde.code, &mut free);
            if free.is_empty() {
                self.stats.ignored_fdes += 1;
                continue;
            }
            self.stats.count_fde(fde.source);
            for code in free.drain(..) {
                covered.insert(code.start, code.end);
                pieces.push(Piece { rows: rows_within(&self.rows, &fde.rows, &code), code });
            }
        }
        pieces.sort_unstable_by_key(|piece| piece.code.start);
        pieces
    }
}

impl TableStats {
    fn count_fde(&mut self, source: Source) {
        self.fdes += 1;
        match source {
            Source::GoRuntime | Source::EhFrame => {}
            Source::DebugFrame => self.debug_frame_fdes += 1,
            Source::DebugFile => self.debug_file_fdes += 1,
        }
    }

    fn count_unsupported(&mut self, reason: Unsupported) {
        self.unsupported_rows += 1;
        let counter = match reason {
            Unsupported::CfaExpression => &mut self.unsupported.cfa_expression,
            Unsupported::CfaRegister => &mut self.unsupported.cfa_register,
            Unsupported::ReturnAddress => &mut self.unsupported.return_address,
            Unsupported::SavedRbp => &mut self.unsupported.saved_rbp,
            Unsupported::OffsetRange => &mut self.unsupported.offset_range,
        };
        *counter += 1;
    }
}

/// The walker's rule for a row of call frame information of `machine`'s
/// code.
fn rule_of(machine: Machine, row: &UnwindTableRow<usize>) -> Result<Rule, Unsupported> {
    match machine {
        Machine::X86_64 => x86_64_rule_of(row),
        Machine::Aarch64 => aarch64_rule_of(row),
    }
}

/// The rule of a row of x86-64 code. The return address comes first:
/// where it is undefined the stack ends, whatever the CFA (`_start`, the
/// child side of `clone`).
fn x86_64_rule_of(row: &UnwindTableRow<usize>) -> Result<Rule, Unsupported> {
    match row.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => return Ok(Rule::of(RuleKind::Stop)),
        Some(RegisterRule::Offset(-8)) => {}
        _ => return Err(Unsupported::ReturnAddress),
    }
    let (kind, cfa_offset) = match *row.cfa() {
        CfaRule::RegisterAndOffset { register: X86_64::RSP, offset } => (RuleKind::CfaRsp, offset),
        CfaRule::RegisterAndOffset { register: X86_64::RBP, offset } => (RuleKind::CfaRbp, offset),
        CfaRule::RegisterAndOffset { .. } => return Err(Unsupported::CfaRegister),
        CfaRule::Expression(_) => return Err(Unsupported::CfaExpression),
    };
    // Undefined as well as unchanged: either way there is no saved rbp to
    // restore, and the walker keeps the one it has.
    let rbp_slot = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::SameValue | RegisterRule::Undefined) => 0,
        Some(RegisterRule::Offset(offset)) if offset < 0 && offset % 8 == 0 => {
            u32::try_from(offset.unsigned_abs() / 8).map_err(|_| Unsupported::OffsetRange)?
        }
        Some(_) => return Err(Unsupported::SavedRbp),
    };
    let cfa_offset = u32::try_from(cfa_offset).map_err(|_| Unsupported::OffsetRange)?;
    Rule::new(kind, cfa_offset, rbp_slot).ok_or(Unsupported::OffsetRange)
}

/// The rule of a row of arm64 code: the CFA on sp or x29, and where the
/// link register x30, which held the return address at the call, and
/// x29 were saved. Where x30 still holds it (a function's first
/// instructions, a leaf), no frame at a call site stands: a walk from a
/// return probe never meets the row, which becomes Unsupported.
fn aarch64_rule_of(row: &UnwindTableRow<usize>) -> Result<Rule, Unsupported> {
    let return_slot = match row.register(AArch64::X30) {
        Some(RegisterRule::Undefined) => return Ok(Rule::of(RuleKind::Stop)),
        Some(RegisterRule::Offset(offset)) => slot_below_cfa(offset).ok_or(Unsupported::ReturnAddress)?,
        _ => return Err(Unsupported::ReturnAddress),
    };
    let (kind, cfa_offset) = match *row.cfa() {
        CfaRule::RegisterAndOffset { register: AArch64::SP, offset } => (RuleKind::CfaRsp, offset),
        CfaRule::RegisterAndOffset { register: AArch64::X29, offset } => (RuleKind::CfaRbp, offset),
        CfaRule::RegisterAndOffset { .. } => return Err(Unsupported::CfaRegister),
        CfaRule::Expression(_) => return Err(Unsupported::CfaExpression),
    };
    let cfa_offset = u32::try_from(cfa_offset).map_err(|_| Unsupported::OffsetRange)?;
    let rule = match row.register(AArch64::X29) {
        None | Some(RegisterRule::SameValue | RegisterRule::Undefined) if kind == RuleKind::CfaRsp => {
            Rule::new(RuleKind::CfaRspReturnSlot, cfa_offset, return_slot)
        }
        // The frame record: x29, and x30 just above it.
        Some(RegisterRule::Offset(offset)) if slot_below_cfa(offset) == Some(return_slot + 1) => {
            Rule::new(kind, cfa_offset, return_slot + 1)
        }
        _ => return Err(Unsupported::SavedRbp),
    };
    rule.ok_or(Unsupported::OffsetRange)
}

/// The slot of a register saved at CFA + `offset`: n for CFA - 8n.
fn slot_below_cfa(offset: i64) -> Option<u32> {
    (offset < 0 && offset % 8 == 0).then(|| u32::try_from(offset.unsigned_abs() / 8).ok()).flatten()
}

/// A rule of Go's own `.debug_frame`, with where rbp was saved. Go's
/// compiler saves its caller's rbp just below the return address in every
/// frame it makes (`MOVQ BP, framesize-8(SP)`, since Go 1.7), but its
/// call frame information says nothing of rbp. Without it, rbp would go
/// up the Go frames unchanged, and a step through the frame pointer past
/// them (`RuleKind::GoStackSwitch`) would start from a callee's.
fn with_go_saved_rbp(rule: Rule) -> Rule {
    let frame_made = rule.kind() == RuleKind::CfaRsp as u32 && rule.cfa_offset() > 8;
    if !frame_made || rule.rbp_slot() != 0 {
        return rule;
    }
    Rule::new(RuleKind::CfaRsp, rule.cfa_offset(), 2).unwrap_or(rule)
}

/// Pushes onto `free` the parts of `code` that none of the `covered`
/// ranges (disjoint, keyed by start) overlaps.
fn uncovered(covered: &BTreeMap<u64, u64>, code: &Range<u64>, free: &mut Vec<Range<u64>>) {
    let mut cursor = code.start;
    if let Some((_, &end)) = covered.range(..=code.start).next_back() {
        cursor = cursor.max(end);
    }
    for (&start, &end) in covered.range((Bound::Excluded(code.start), Bound::Excluded(code.end))) {
        if start > cursor {
            free.push(cursor..start);
        }
        cursor = cursor.max(end);
    }
    if cursor < code.end {
        free.push(cursor..code.end);
    }
}

/// The rows of an FDE that apply to `code`, a part of the FDE's range:
/// the one in effect where it starts, and those that begin inside it.
fn rows_within(rows: &[(u64, Rule)], fde_rows: &Range<usize>, code: &Range<u64>) -> Range<usize> {
    let fde = &rows[fde_rows.clone()];
    let first = fde.partition_point(|&(address, _)| address <= code.start).saturating_sub(1);
    let end = fde.partition_point(|&(address, _)| address < code.end).max(first);
    fde_rows.start + first..fde_rows.start + end
}

/// The table: the pieces' rows as offsets from `text_base`, merged, with
/// frame-pointer rows for code without call frame information. `None` if
/// an offset does not fit 32 bits.
fn table_rows(pieces: &[Piece], rows: &[(u64, Rule)], text_base: u64) -> Option<Vec<UnwindRow>> {
    let frame_pointer = Rule::of(RuleKind::FramePointer);
    let mut table = MergedRows(Vec::with_capacity(rows.len() + pieces.len() / 8 + 2));
    let mut end_of_cfi = None;
    for piece in pieces {
        let (gap_start, padding) = match end_of_cfi {
            None => (text_base, 0),
            Some(end) => (end, MAX_PADDING),
        };
        if piece.code.start.saturating_sub(gap_start) > padding {
            table.push(gap_start - text_base, frame_pointer)?;
        }
        for &(address, rule) in &rows[piece.rows.clone()] {
            table.push(address.max(piece.code.start) - text_base, rule)?;
        }
        end_of_cfi = Some(piece.code.end);
    }
    table.push(end_of_cfi.unwrap_or(text_base) - text_base, frame_pointer)?;
    Some(table.0)
}

/// Rows sorted by pc, each pc once, no rule repeating the one before.
struct MergedRows(Vec<UnwindRow>);

impl MergedRows {
    /// Adds a row from `offset` on, which must not be below the last row's
    /// pc; at the same pc it replaces the last row. `None` if the offset
    /// does not fit 32 bits.
    fn push(&mut self, offset: u64, rule: Rule) -> Option<()> {
        let pc = u32::try_from(offset).ok()?;
        if self.0.last().is_some_and(|last| last.pc == pc) {
            self.0.pop();
        }
        if self.0.last().is_none_or(|last| last.rule != rule) {
            self.0.push(UnwindRow { pc, rule });
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fs,
        process::Command,
        time::{Duration, Instant},
    };

    use iced_x86::{Decoder, DecoderOptions, Mnemonic};
    use object::ObjectSymbol as _;

    use super::*;

    const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";
    const PYTHON: &str = "/usr/bin/python3.11";
    const REDIS: &str = "/usr/bin/redis-server";

    fn read(path: &str) -> Vec<u8> {
        fs::read(path).unwrap_or_else(|error| panic!("cannot read {path}: {error}"))
    }

    fn table_of(path: &str) -> ObjectTable {
        build(Path::new(path), &read(path)).unwrap_or_else(|error| panic!("{error}"))
    }

    fn rule(kind: RuleKind, cfa_offset: u32, rbp_slot: u32) -> Rule {
        Rule::new(kind, cfa_offset, rbp_slot).unwrap()
    }

    /// The rule the walker finds for the link-time `address`.
    fn rule_at(table: &ObjectTable, address: u64) -> Rule {
        let pc = u32::try_from(address - table.text_base).unwrap();
        let index = table.rows.partition_point(|row| row.pc <= pc);
        assert!(index > 0, "{address:#x} lies before the first row");
        table.rows[index - 1].rule
    }

    fn kind_at(table: &ObjectTable, address: u64) -> RuleKind {
        RuleKind::try_from(rule_at(table, address).kind()).unwrap()
    }

    fn executable_segments(data: &[u8]) -> Vec<(u64, &[u8])> {
        let object = Elf::parse(data).unwrap();
        let endian = object.endian();
        object
            .elf_program_headers()
            .iter()
            .filter(|header| header.p_type(endian) == PT_LOAD && header.p_flags(endian) & PF_X != 0)
            .map(|header| (header.p_vaddr(endian), header.data(endian, data).unwrap()))
            .collect()
    }

    /// The link-time addresses of the code that is exactly `bytes`.
    fn code_addresses(data: &[u8], bytes: &[u8]) -> Vec<u64> {
        let mut addresses = Vec::new();
        for (vaddr, code) in executable_segments(data) {
            let found = code.windows(bytes.len()).enumerate().filter(|(_, window)| *window == bytes);
            addresses.extend(found.map(|(offset, _)| vaddr + offset as u64));
        }
        addresses
    }

    /// The return address of the first call at `address` or after it: a
    /// pc a walk meets in that function.
    fn first_return_address(data: &[u8], address: u64) -> u64 {
        let (vaddr, code) = executable_segments(data)
            .into_iter()
            .find(|&(vaddr, code)| (vaddr..vaddr + code.len() as u64).contains(&address))
            .unwrap_or_else(|| panic!("{address:#x} is not in an executable segment"));
        let start = usize::try_from(address - vaddr).unwrap();
        let bytes = &code[start..code.len().min(start + 128)];
        let mut decoder = Decoder::with_ip(64, bytes, address, DecoderOptions::NONE);
        let call = decoder.iter().find(|instruction| instruction.mnemonic() == Mnemonic::Call);
        call.map_or_else(|| panic!("no call after {address:#x}"), |instruction| instruction.next_ip())
    }

    fn symbol(data: &[u8], name: &str) -> u64 {
        let object = Elf::parse(data).unwrap();
        let mut symbols = object.dynamic_symbols().chain(object.symbols());
        let found = symbols.find(|symbol| symbol.name() == Ok(name) && !symbol.is_undefined());
        found.map_or_else(|| panic!("no symbol {name}"), |symbol| symbol.address())
    }

    fn assert_well_formed(path: &str, table: &ObjectTable) {
        let unsorted = table.rows.windows(2).find(|pair| pair[0].pc >= pair[1].pc);
        assert_eq!(unsorted, None, "{path}: rows out of order");
        let repeated = table.rows.windows(2).find(|pair| pair[0].rule == pair[1].rule);
        assert_eq!(repeated, None, "{path}: a rule repeats the one before");
        let last = table.rows.last().map(|row| row.rule);
        assert_eq!(
            last,
            Some(Rule::of(RuleKind::FramePointer)),
            "{path}: the table ends with code without CFI"
        );
    }

    #[test]
    fn debian_objects_give_the_measured_row_counts() {
        // "table (proposed)" in the unwind design's §2, counted from
        // `readelf --debug-dump=frames-interp`; merging packed rules rather
        // than (CFA, rbp, RA) rules may only merge a little more.
        let measured = [
            (LIBC, 23_331),
            ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", 28_202),
            (PYTHON, 58_511),
            (REDIS, 34_790),
            ("/lib64/ld-linux-x86-64.so.2", 2_024),
        ];
        for (path, expected) in measured {
            let data = read(path);
            let started = Instant::now();
            let table = build(Path::new(path), &data).unwrap_or_else(|error| panic!("{error}"));
            let took = started.elapsed();
            eprintln!(
                "{path}: {} rows (measured {expected}) in {took:?}\n  {:?}",
                table.rows.len(),
                table.stats
            );
            let ratio = table.rows.len() as f64 / f64::from(expected);
            assert!((0.97..=1.01).contains(&ratio), "{path}: {} rows, measured {expected}", table.rows.len());
            assert_eq!(
                table.stats.skipped_fdes + table.stats.truncated_sections,
                0,
                "{path}: {:?}",
                table.stats
            );
            assert!(
                table.stats.covered_bytes * 100 > table.stats.code_bytes * 96,
                "{path}: {:?}",
                table.stats
            );
            assert_well_formed(path, &table);
            assert!(took < Duration::from_secs(2), "{path}: building the table took {took:?}");
        }
    }

    #[test]
    fn libc_malloc_starts_with_the_return_address_on_top() {
        let table = table_of(LIBC);
        let malloc = symbol(&read(LIBC), "malloc");
        assert_eq!(rule_at(&table, malloc), rule(RuleKind::CfaRsp, 8, 0));
    }

    #[test]
    fn libc_restore_rt_is_a_signal_frame() {
        let data = read(LIBC);
        let table = table_of(LIBC);
        // mov $15 (rt_sigreturn), %rax; syscall: __restore_rt, the return
        // address of every signal handler.
        let restore_rt = code_addresses(&data, &[0x48, 0xc7, 0xc0, 0x0f, 0, 0, 0, 0x0f, 0x05]);
        assert_eq!(restore_rt.len(), 1, "one __restore_rt in libc: {restore_rt:x?}");
        // The walker looks up a return address minus 1: glibc puts a nop,
        // inside the FDE, before the label.
        assert_eq!(kind_at(&table, restore_rt[0] - 1), RuleKind::Signal);
        assert_eq!(kind_at(&table, restore_rt[0]), RuleKind::Signal);
        assert_eq!(table.stats.signal_fdes, 1);
    }

    #[test]
    fn stacks_end_at_start_and_in_clone_children() {
        for program in [PYTHON, REDIS] {
            let data = read(program);
            let start = Elf::parse(&*data).unwrap().entry();
            let after_libc_start_main = first_return_address(&data, start);
            assert_eq!(kind_at(&table_of(program), after_libc_start_main - 1), RuleKind::Stop, "{program}");
        }
        let data = read(LIBC);
        let table = table_of(LIBC);
        // The child side of clone calls the thread function.
        let thread_start = first_return_address(&data, symbol(&data, "clone"));
        assert_eq!(kind_at(&table, thread_start - 1), RuleKind::Stop, "clone");
        // clone3 is not exported: mov $435 (clone3), %eax; syscall.
        let clone3 = code_addresses(&data, &[0xb8, 0xb3, 0x01, 0, 0, 0x0f, 0x05]);
        assert_eq!(clone3.len(), 1, "one clone3 in libc: {clone3:x?}");
        let clone3_thread_start = first_return_address(&data, clone3[0]);
        assert_eq!(kind_at(&table, clone3_thread_start - 1), RuleKind::Stop, "clone3");
        assert_eq!(table.stats.stop_rows, 2);
    }

    const WALKER_C: &str = r"
        __attribute__((noipa)) long leaf(long n) {
            volatile long x[64];
            for (long i = 0; i < n; i++) x[i % 64] = i;
            return x[n % 64];
        }
        __attribute__((noipa)) long walker(long n) { return leaf(n) * 3 + 1; }
        int main(int argc, char **argv) { (void)argv; return (int)walker(argc * 100); }
    ";

    /// A directory under /tmp for one test's files, removed when it ends.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(test: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("memleak-eh-frame-{}-{test}", std::process::id()));
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn run(&self, program: &str, args: &[&str]) {
            let status = Command::new(program).current_dir(&self.0).args(args).status();
            assert!(status.is_ok_and(|status| status.success()), "{program} {args:?} failed");
        }

        /// Compiles [`WALKER_C`] into `output`.
        fn compile(&self, output: &str, flags: &[&str]) -> PathBuf {
            self.compile_with("gcc", output, flags)
        }

        /// Compiles [`WALKER_C`] into `output` with `compiler`.
        fn compile_with(&self, compiler: &str, output: &str, flags: &[&str]) -> PathBuf {
            fs::write(self.0.join("walker.c"), WALKER_C).unwrap();
            self.run(compiler, &[flags, &["-o", output, "walker.c"]].concat());
            self.0.join(output)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Debian's arm64 C library, as its cross-compiling package
    /// (libc6-arm64-cross) ships it.
    const ARM64_LIBC: &str = "/usr/aarch64-linux-gnu/lib/libc.so.6";

    /// Debian's compiler for arm64 (gcc-aarch64-linux-gnu).
    const ARM64_GCC: &str = "aarch64-linux-gnu-gcc";

    fn arm64_table_of(path: &Path) -> ObjectTable {
        let data = fs::read(path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
        let table = build_for(Machine::Aarch64, path, &data, None).unwrap_or_else(|error| panic!("{error}"));
        assert_well_formed(&path.display().to_string(), &table);
        table
    }

    /// The addresses of the `bl` instructions (calls) in the function
    /// `name` of an arm64 program.
    fn arm64_calls_in(data: &[u8], name: &str) -> Vec<u64> {
        let object = Elf::parse(data).unwrap();
        let function = object.symbols().find(|symbol| symbol.name() == Ok(name)).expect("the function");
        let (address, size) = (function.address(), function.size());
        let (base, code) = executable_segments(data)
            .into_iter()
            .find(|(base, code)| (*base..*base + code.len() as u64).contains(&address))
            .unwrap();
        let start = usize::try_from(address - base).unwrap();
        code[start..start + usize::try_from(size).unwrap()]
            .chunks_exact(4)
            .enumerate()
            .filter(|(_, word)| u32::from_le_bytes((*word).try_into().unwrap()) >> 26 == 0b10_0101)
            .map(|(index, _)| address + 4 * index as u64)
            .collect()
    }

    #[test]
    fn arm64_code_steps_through_the_frame_records_it_saves() {
        let table = arm64_table_of(Path::new(ARM64_LIBC));
        eprintln!("{ARM64_LIBC}: {} rows\n  {:?}", table.rows.len(), table.stats);
        assert_eq!(table.stats.skipped_fdes + table.stats.truncated_sections, 0, "{:?}", table.stats);
        assert_eq!(table.stats.stop_rows, 1, "_start's undefined return address");
        let scratch = Scratch::new("arm64");
        for (output, flags, expected) in [
            // str x30, [sp, #-16]!: the return address alone, x29 left
            // as it was.
            ("walker-arm64", &["-O2", "-fomit-frame-pointer"][..], rule(RuleKind::CfaRspReturnSlot, 16, 2)),
            // paciasp; stp x29, x30, [sp, #-16]!; mov x29, sp: the frame
            // record, x29 in the CFA's second slot below, the return
            // address (signed) above it. Every function that signs it
            // negates the RA state, an opcode of arm64's own.
            (
                "walker-arm64-pac",
                &["-O2", "-fno-omit-frame-pointer", "-mbranch-protection=standard"][..],
                rule(RuleKind::CfaRsp, 16, 2),
            ),
        ] {
            let program = scratch.compile_with(ARM64_GCC, output, flags);
            let table = arm64_table_of(&program);
            let data = fs::read(&program).unwrap();
            let calls = arm64_calls_in(&data, "walker");
            assert_eq!(calls.len(), 1, "{output}: walker calls leaf once: {calls:x?}");
            assert_eq!(rule_at(&table, calls[0]), expected, "{output}");
            // At walker's entry the return address is still in x30: no
            // walk from a return probe stands there.
            assert_eq!(kind_at(&table, symbol(&data, "walker")), RuleKind::Unsupported, "{output}");
            assert_eq!(table.stats.skipped_fdes, 0, "{output}: {:?}", table.stats);
        }
    }

    /// The table of `program` and the pc of the call site in `walker`.
    fn walker_call_site(program: &Path, debug_file: Option<&Path>) -> (ObjectTable, u64) {
        let data = fs::read(program).unwrap();
        let opened = debug_file.map(|path| fs::File::open(path).unwrap());
        let debug_file = debug_file.zip(opened.as_ref()).map(|(path, file)| DebugFile { path, file });
        let table =
            build_with_debug_file(program, &data, debug_file).unwrap_or_else(|error| panic!("{error}"));
        assert_well_formed(&program.display().to_string(), &table);
        let call_site = first_return_address(&data, symbol(&data, "walker")) - 1;
        (table, call_site)
    }

    #[test]
    fn frame_pointer_code_has_the_cfa_on_rbp() {
        let scratch = Scratch::new("fp");
        let program = scratch.compile("fp", &["-O2", "-fno-omit-frame-pointer"]);
        let (table, call_site) = walker_call_site(&program, None);
        // push %rbp; mov %rsp, %rbp: the caller's rbp two slots below the
        // CFA, the return address one.
        assert_eq!(rule_at(&table, call_site), rule(RuleKind::CfaRbp, 16, 2));
        let entry = symbol(&fs::read(&program).unwrap(), "walker");
        assert_eq!(rule_at(&table, entry), rule(RuleKind::CfaRsp, 8, 0));
    }

    #[test]
    fn go_runtime_switches_and_roots_get_rules_of_their_own() {
        let scratch = Scratch::new("go");
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/go-cgo/main.go");
        fs::copy(fixture, scratch.0.join("main.go")).unwrap();
        let status = Command::new("go")
            .current_dir(&scratch.0)
            .env("GO111MODULE", "off")
            .env("GOCACHE", scratch.0.join("cache"))
            .args(["build", "-o", "gocgo", "main.go"])
            .status();
        assert!(
            status.is_ok_and(|status| status.success()),
            "go build (cargo xtask test installs golang-go)"
        );
        let path = scratch.0.join("gocgo").display().to_string();
        let data = read(&path);
        let table = table_of(&path);
        assert_well_formed(&path, &table);
        // Since Go 1.17 the assembly function is NAME.abi0; NAME is the
        // wrapper Go code calls, with a frame of its own and its rules.
        let switch = symbol(&data, "runtime.asmcgocall.abi0");
        assert_eq!(kind_at(&table, first_return_address(&data, switch)), RuleKind::GoStackSwitch);
        let wrapper = symbol(&data, "runtime.asmcgocall");
        assert_eq!(kind_at(&table, first_return_address(&data, wrapper) - 1), RuleKind::CfaRsp);
        assert_eq!(kind_at(&table, symbol(&data, "runtime.systemstack.abi0")), RuleKind::GoStackSwitch);
        assert_eq!(kind_at(&table, symbol(&data, "runtime.goexit.abi0")), RuleKind::Stop);
        assert!(is_go_stack_switch("runtime.asmcgocall") && is_go_stack_switch("runtime.mcall.abi0"));
        assert!(!is_go_stack_switch("runtime.goexit") && !is_go_stack_switch("main.main"));
        // A Go function's call site: rbp two slots below the CFA, as Go
        // saves it, though its .debug_frame does not say so.
        let remember = rule_at(&table, first_return_address(&data, symbol(&data, "main.remember")) - 1);
        assert_eq!((RuleKind::try_from(remember.kind()), remember.rbp_slot()), (Ok(RuleKind::CfaRsp), 2));
    }

    #[test]
    fn code_without_frame_pointers_leaves_rbp_alone() {
        let scratch = Scratch::new("nofp");
        let program = scratch.compile("nofp", &["-O2", "-fomit-frame-pointer"]);
        let (table, call_site) = walker_call_site(&program, None);
        let found = rule_at(&table, call_site);
        assert_eq!(RuleKind::try_from(found.kind()), Ok(RuleKind::CfaRsp), "{found:?}");
        assert!(found.cfa_offset() >= 16 && found.rbp_slot() == 0, "{found:?}");
    }

    #[test]
    fn a_call_frame_section_that_would_inflate_past_the_bound_is_refused_unread() {
        let scratch = Scratch::new("bomb");
        scratch.compile("dbg", &["-O2", "-g", "-fno-asynchronous-unwind-tables"]);
        scratch.run("objcopy", &["--only-keep-debug", "--compress-debug-sections=zlib", "dbg", "dbg.zdebug"]);
        scratch.run("objcopy", &["--strip-debug", "dbg", "dbg.stripped"]);
        // The compressed section's header (Elf64_Chdr) says how large it
        // inflates: 1 TiB, says this one.
        let bomb = scratch.0.join("dbg.zdebug");
        let mut data = fs::read(&bomb).unwrap();
        let (offset, _) =
            Elf::parse(&*data).unwrap().section_by_name(".debug_frame").unwrap().file_range().unwrap();
        let size_at = usize::try_from(offset).unwrap() + 8;
        data[size_at..size_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        fs::write(&bomb, &data).unwrap();
        let stripped = scratch.0.join("dbg.stripped");
        let error = build_with_debug_file(
            &stripped,
            &fs::read(&stripped).unwrap(),
            Some(DebugFile { path: &bomb, file: &fs::File::open(&bomb).unwrap() }),
        );
        assert!(
            matches!(
                error,
                Err(TableError::SectionTooLarge { section: ".debug_frame", size: 0x100_0000_0000, .. })
            ),
            "{error:?}"
        );
    }

    #[test]
    fn debug_frame_serves_from_the_object_or_its_debug_file() {
        let scratch = Scratch::new("debug-frame");
        // Call frame information in .debug_frame only, as -g without
        // unwind tables leaves it (the C runtime's objects keep .eh_frame).
        let program = scratch
            .compile("dbg", &["-O2", "-g", "-fno-asynchronous-unwind-tables", "-fno-omit-frame-pointer"]);
        let expected = rule(RuleKind::CfaRbp, 16, 2);
        let (table, call_site) = walker_call_site(&program, None);
        assert_eq!(rule_at(&table, call_site), expected);
        assert!(table.stats.debug_frame_fdes >= 3, "{:?}", table.stats);

        scratch.run("objcopy", &["--only-keep-debug", "dbg", "dbg.debug"]);
        scratch.run("objcopy", &["--compress-debug-sections=zlib", "dbg.debug", "dbg.zdebug"]);
        scratch.run("objcopy", &["--strip-debug", "dbg", "dbg.stripped"]);
        let stripped = scratch.0.join("dbg.stripped");
        let (table, _) = walker_call_site(&stripped, None);
        assert_eq!(kind_at(&table, call_site), RuleKind::FramePointer);
        for debug_file in ["dbg.debug", "dbg.zdebug"] {
            let (table, _) = walker_call_site(&stripped, Some(&scratch.0.join(debug_file)));
            assert_eq!(rule_at(&table, call_site), expected, "{debug_file}");
            assert!(table.stats.debug_file_fdes >= 3, "{debug_file}: {:?}", table.stats);
        }

        let error = build_with_debug_file(
            &stripped,
            &fs::read(&stripped).unwrap(),
            Some(DebugFile { path: Path::new(LIBC), file: &fs::File::open(LIBC).unwrap() }),
        );
        assert!(matches!(error, Err(TableError::DebugFileMismatch { .. })), "{error:?}");
    }

    #[test]
    fn objects_without_call_frame_information_take_frame_pointer_steps() {
        let scratch = Scratch::new("no-cfi");
        let library = scratch.compile(
            "nocfi.so",
            &["-O2", "-shared", "-fPIC", "-nostdlib", "-fno-asynchronous-unwind-tables"],
        );
        let table = build(&library, &fs::read(&library).unwrap()).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(table.rows, [UnwindRow { pc: 0, rule: Rule::of(RuleKind::FramePointer) }]);
        assert_eq!(table.stats.fdes, 0);

        let error = build(Path::new("walker.c"), WALKER_C.as_bytes());
        assert!(matches!(error, Err(TableError::NotElf { .. })), "{error:?}");
    }

    #[test]
    fn sections_merge_by_preference_and_padding_merges_away() {
        let mut builder = Builder::new(
            Machine::X86_64,
            ExecutableCode { text_base: 0x1000, segments: vec![0x1000..0x2000, 0x3000..0x3100] },
        );
        let (rsp8, rsp16, rbp) =
            (rule(RuleKind::CfaRsp, 8, 0), rule(RuleKind::CfaRsp, 16, 0), rule(RuleKind::CfaRbp, 16, 2));
        let mut add = |code: Range<u64>, rows: &[(u64, Rule)], source| {
            let first = builder.rows.len();
            builder.rows.extend_from_slice(rows);
            builder.fdes.push(FdeRows { code, rows: first..builder.rows.len(), source });
        };
        add(0x1010..0x1040, &[(0x1010, rsp8), (0x1011, rsp16), (0x1030, rsp8)], Source::EhFrame);
        // After 8 bytes of padding: its first rule merges into the last.
        add(0x1048..0x1060, &[(0x1048, rsp8), (0x1049, rsp16)], Source::EhFrame);
        // Overlaps the FDE before: only 0x1060.. is used, from the rule
        // in effect there.
        add(
            0x1050..0x1100,
            &[(0x1050, rsp8), (0x1051, rsp16), (0x1054, rbp), (0x10f0, rsp8)],
            Source::DebugFrame,
        );
        // Covered by the first FDE.
        add(0x1020..0x1030, &[(0x1020, rbp)], Source::DebugFile);
        // After a gap of 0x20 bytes, and in a second segment.
        add(0x1120..0x1130, &[(0x1120, rsp8)], Source::DebugFile);
        add(0x3000..0x3010, &[(0x3000, rsp16)], Source::EhFrame);
        let table = builder.finish(Path::new("synthetic")).unwrap();
        let fp = Rule::of(RuleKind::FramePointer);
        let expected = [
            (0, fp),
            (0x10, rsp8),
            (0x11, rsp16),
            (0x30, rsp8),
            (0x49, rsp16),
            (0x60, rbp),
            (0xf0, rsp8),
            (0x100, fp),
            (0x120, rsp8),
            (0x130, fp),
            (0x2000, rsp16),
            (0x2010, fp),
        ];
        let rows: Vec<(u32, Rule)> = table.rows.iter().map(|row| (row.pc, row.rule)).collect();
        assert_eq!(rows, expected);
        let stats = table.stats;
        assert_eq!(
            (stats.fdes, stats.debug_frame_fdes, stats.debug_file_fdes, stats.ignored_fdes),
            (5, 1, 1, 1)
        );
        assert_eq!(stats.covered_bytes, 0x30 + 0x18 + 0xa0 + 0x10 + 0x10);
    }
}
