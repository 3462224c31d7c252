//! Python code objects read out of a live process: the qualified name,
//! file and line table that turn a frame record (code object address,
//! instruction) into `function (file:line)`.
//!
//! Everything is read through `/proc/PID/mem`, which needs
//! `PTRACE_MODE_ATTACH` on the process but does not stop it. What is read
//! may have been freed and reused since the frame was recorded, so each
//! read is checked (the object's type is `PyCode_Type`, its strings are
//! compact str objects that end where their length says) and a frame whose
//! code fails a check is shown as unknown rather than as another function.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::hash::Hash;
use std::io;
use std::sync::Arc;

use memleak_common::python::py_code_check;

pub use super::memory::{Memory, ProcessMemory};
use super::{
    line_table::{Instruction, LineTableFormat},
    offsets,
};

/// Where the fields a resolution reads lie in CPython 3.`minor`'s objects
/// (x86-64, release build with the GIL), and the address of `PyCode_Type`
/// in the process: [`Self::from_offsets`] takes them from the offsets
/// detection checked in the process (`offsets`, the one table of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeLayout {
    pub minor: u8,
    /// `&PyCode_Type` in the process: what `ob_type` of a live code
    /// object holds.
    pub code_type: u64,
    pub co_name: usize,
    /// 3.11+; the name shown when there is one (`Class.method`).
    pub co_qualname: Option<usize>,
    pub co_filename: usize,
    pub co_firstlineno: usize,
    /// `co_linetable` (3.10+) or `co_lnotab` (3.8, 3.9): a bytes object.
    pub co_lines: usize,
    /// `sizeof(PyASCIIObject)`: where an ASCII str's characters start.
    pub ascii_size: usize,
    /// `sizeof(PyCompactUnicodeObject)`: where a non-ASCII compact str's
    /// characters start.
    pub compact_size: usize,
}

impl CodeLayout {
    /// The layout of CPython 3.`minor` as `offsets`' table has it, before
    /// any check; `None` outside 3.8–3.13.
    pub fn for_version(minor: u8, code_type: u64) -> Option<Self> {
        Some(Self::from_offsets(minor, code_type, &offsets::for_minor(u32::from(minor))?))
    }

    /// The layout given by `offsets`, as detection checked them in the
    /// process (3.13: from CPython's own debug offsets).
    pub fn from_offsets(minor: u8, code_type: u64, offsets: &offsets::Offsets) -> Self {
        let at = |offset: u64| usize::try_from(offset).unwrap_or(usize::MAX);
        let code = &offsets.code;
        Self {
            minor,
            code_type,
            co_name: at(code.name),
            co_qualname: code.qualname.map(at),
            co_filename: at(code.filename),
            co_firstlineno: at(code.firstlineno),
            co_lines: at(code.line_table),
            ascii_size: at(offsets.strings.ascii_data),
            compact_size: at(offsets.strings.compact_data),
        }
    }

    fn line_table_format(&self) -> Option<LineTableFormat> {
        LineTableFormat::for_version(self.minor)
    }

    /// How much of a code object a read takes: through the last field
    /// used.
    fn header_size(&self) -> usize {
        let pointers = [self.co_name, self.co_qualname.unwrap_or(0), self.co_filename, self.co_lines]
            .map(|offset| offset + 8);
        pointers.into_iter().chain([self.co_firstlineno + 4]).max().unwrap_or(0)
    }
}

/// `PyObject.ob_type`, the same in every version.
const OB_TYPE: usize = 8;
/// `PyASCIIObject.length` and `.state`, the same in 3.8–3.13.
const STR_LENGTH: usize = 0x10;
const STR_STATE: usize = 0x20;
/// `PyBytesObject.ob_size` and `.ob_sval`.
const BYTES_SIZE: usize = 0x10;
const BYTES_DATA: usize = 0x20;
/// Longer names or file names are taken for garbage: a path is at most
/// 4096 bytes, and a qualified name is far shorter.
const MAX_STRING_CHARS: usize = 16 * 1024;
/// Longer line tables are taken for garbage: a table takes a few bytes per
/// instruction, and a frame record cannot point past 2^18 code units.
const MAX_LINE_TABLE: usize = 1 << 20;
/// Code objects kept per process; past it, the least recently used goes.
pub const CODE_CACHE_CAPACITY: usize = 64 * 1024;
/// Bytes of names, file names and line tables kept per process; past
/// it, the least recently used code objects go. A real program's take a
/// few MiB; without a budget, a process making thousands of code objects
/// with megabyte line tables made memleak copy gigabytes.
pub const CODE_CACHE_BUDGET: usize = 32 << 20;
/// Bytes of them kept for every process together: a daemon following a
/// hundred such processes would hold 3 GiB at 32 MiB each. The process
/// whose code object would pass it lets its own least recently used go.
pub const ALL_PROCESSES_BUDGET: usize = 256 << 20;
/// What the code caches of every process hold together (see
/// `ALL_PROCESSES_BUDGET`).
static ALL_PROCESSES_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Code objects let go to stay within `CODE_CACHE_BUDGET` or
/// `ALL_PROCESSES_BUDGET`, every process's since memleak started.
static LET_GO_PAST_BUDGET: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many code objects every process's cache has let go to stay within
/// a budget (not counting those let go for `CODE_CACHE_CAPACITY`).
pub fn let_go_past_budget() -> u64 {
    LET_GO_PAST_BUDGET.load(std::sync::atomic::Ordering::Relaxed)
}

/// What a cached code object costs beyond its strings and table: its
/// slot, its `CodeInfo` and the `by_use` entry.
const SLOT_OVERHEAD: usize = 160;

/// What a frame shows of its code object.
#[derive(Debug)]
pub struct CodeInfo {
    /// `co_qualname` on 3.11+ (`Class.method`), `co_name` before.
    pub name: Arc<str>,
    /// `co_filename`: the path as the process sees it.
    pub file: Arc<str>,
    pub first_line: i32,
    /// What BPF's check of this code object reads as
    /// (`memleak_common::python::py_code_check`).
    pub check: u64,
    line_table: Arc<[u8]>,
    format: LineTableFormat,
}

impl CodeInfo {
    /// The line `instruction` is on: the first line before the first
    /// instruction, as CPython says; `None` for an instruction CPython
    /// gives no line.
    pub fn line(&self, instruction: Instruction) -> Option<i32> {
        match instruction.byte_offset() {
            None => Some(self.first_line),
            Some(offset) => self.format.line_at(&self.line_table, self.first_line, offset),
        }
    }
}

/// Why a code object could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    #[error("cannot read the {what} at {address:#x}: {source}")]
    Unreadable { what: &'static str, address: u64, source: io::Error },
    #[error("{address:#x} is not a code object: its type is {found:#x}, PyCode_Type is {expected:#x}")]
    NotCode { address: u64, found: u64, expected: u64 },
    #[error("the {what} of the code object at {code:#x} is not a str object: {why}")]
    BadString { what: &'static str, code: u64, why: String },
    #[error("the line table of the code object at {code:#x} is not a bytes object: {why}")]
    BadLineTable { code: u64, why: String },
    #[error("no line table format is known for python 3.{minor}")]
    UnsupportedVersion { minor: u8 },
}

/// The fields of a code object that say which code it is. A cached code
/// object is used again only while its address still holds these: an
/// address freed and reused by another code object reads anew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    name: u64,
    file: u64,
    first_line: i32,
    line_table: u64,
}

/// Reads the code object at `address`.
fn read_identity(memory: &impl Memory, layout: &CodeLayout, address: u64) -> Result<Identity, CodeError> {
    let mut header = vec![0; layout.header_size()];
    memory.read_exact_at(address, &mut header).map_err(|source| CodeError::Unreadable {
        what: "code object",
        address,
        source,
    })?;
    let found = u64_at(&header, OB_TYPE);
    if found != layout.code_type {
        return Err(CodeError::NotCode { address, found, expected: layout.code_type });
    }
    Ok(Identity {
        name: u64_at(&header, layout.co_qualname.unwrap_or(layout.co_name)),
        file: u64_at(&header, layout.co_filename),
        first_line: i32::from_ne_bytes(header[layout.co_firstlineno..][..4].try_into().unwrap_or_default()),
        line_table: u64_at(&header, layout.co_lines),
    })
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_ne_bytes(bytes[offset..][..8].try_into().unwrap_or_default())
}

/// Reads what `identity` points to, for the code object at `code`, its
/// strings and line table shared through `kept` with every cached code
/// object that has the same.
fn read_code_info(
    memory: &impl Memory,
    layout: &CodeLayout,
    code: u64,
    identity: Identity,
    kept: &mut Kept,
) -> Result<CodeInfo, CodeError> {
    let format = layout.line_table_format().ok_or(CodeError::UnsupportedVersion { minor: layout.minor })?;
    let (name_type, name) = read_str(memory, layout, identity.name).map_err(|why| why.of("name", code))?;
    let (file_type, file) =
        read_str(memory, layout, identity.file).map_err(|why| why.of("file name", code))?;
    if name_type != file_type {
        let why = format!("its type {name_type:#x} is not that of the file name, {file_type:#x}");
        return Err(CodeError::BadString { what: "name", code, why });
    }
    let line_table = read_bytes(memory, identity.line_table).map_err(|why| why.of_line_table(code))?;
    let check = py_code_check(identity.name, identity.file, identity.first_line);
    Ok(CodeInfo {
        name: kept.strings.share(name),
        file: kept.strings.share(file),
        first_line: identity.first_line,
        check,
        line_table: kept.line_tables.share(line_table.into()),
        format,
    })
}

/// Why a str or bytes object was refused, before it is known whose it is.
struct Refused(String);

impl Refused {
    fn of(self, what: &'static str, code: u64) -> CodeError {
        CodeError::BadString { what, code, why: self.0 }
    }

    fn of_line_table(self, code: u64) -> CodeError {
        CodeError::BadLineTable { code, why: self.0 }
    }
}

fn read_refused(memory: &impl Memory, address: u64, buffer: &mut [u8]) -> Result<(), Refused> {
    memory
        .read_exact_at(address, buffer)
        .map_err(|error| Refused(format!("cannot read {address:#x}: {error}")))
}

/// A compact str object (every name and file name of a code object is
/// one), with its type. Its characters are 1, 2 or 4 bytes each, by its
/// `kind`, and start after the ASCII or the compact header; CPython ends
/// them with a NUL character, which is checked.
fn read_str(memory: &impl Memory, layout: &CodeLayout, address: u64) -> Result<(u64, Arc<str>), Refused> {
    let mut header = [0; STR_STATE + 4];
    read_refused(memory, address, &mut header)?;
    let length = u64_at(&header, STR_LENGTH);
    let count = usize::try_from(length).ok().filter(|&count| count <= MAX_STRING_CHARS);
    let state = u32::from_ne_bytes(header[STR_STATE..][..4].try_into().unwrap_or_default());
    let (kind, compact, ascii) = ((state >> 2) & 7, state & (1 << 5) != 0, state & (1 << 6) != 0);
    if !compact || !matches!(kind, 1 | 2 | 4) || (ascii && kind != 1) {
        return Err(Refused(format!("state {state:#x} is not that of a compact str")));
    }
    let Some(count) = count else {
        return Err(Refused(format!("{length} characters")));
    };
    let width = kind as usize;
    let data = address + if ascii { layout.ascii_size } else { layout.compact_size } as u64;
    let mut bytes = vec![0; (count + 1) * width];
    read_refused(memory, data, &mut bytes)?;
    let mut characters: Vec<u32> = bytes
        .chunks_exact(width)
        .map(|unit| match *unit {
            [byte] => u32::from(byte),
            [low, high] => u32::from(u16::from_le_bytes([low, high])),
            [a, b, c, d] => u32::from_le_bytes([a, b, c, d]),
            _ => unreachable!("chunks of 1, 2 or 4 bytes"),
        })
        .collect();
    if characters.pop() != Some(0) {
        return Err(Refused(format!("its {length} characters do not end in NUL")));
    }
    if ascii && characters.iter().any(|&character| character >= 0x80) {
        return Err(Refused("an ASCII str holds a character past 0x7f".into()));
    }
    // A str may hold lone surrogates, which Rust's str cannot.
    let text: String = characters
        .into_iter()
        .map(|character| char::from_u32(character).unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect();
    Ok((u64_at(&header, OB_TYPE), text.into()))
}

/// The bytes of a bytes object, which CPython ends with a NUL byte past
/// its size (checked).
fn read_bytes(memory: &impl Memory, address: u64) -> Result<Box<[u8]>, Refused> {
    let mut header = [0; BYTES_SIZE + 8];
    read_refused(memory, address, &mut header)?;
    let size = u64_at(&header, BYTES_SIZE);
    let Some(length) = usize::try_from(size).ok().filter(|&length| length <= MAX_LINE_TABLE) else {
        return Err(Refused(format!("{size} bytes")));
    };
    let mut bytes = vec![0; length + 1];
    read_refused(memory, address + BYTES_DATA as u64, &mut bytes)?;
    if bytes.pop() != Some(0) {
        return Err(Refused(format!("its {size} bytes do not end in NUL")));
    }
    Ok(bytes.into_boxed_slice())
}

/// A Python frame as a report shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyFrame {
    Code {
        function: Arc<str>,
        file: Arc<str>,
        /// `None` for an instruction CPython gives no line (code the
        /// compiler added, such as cleanup after an exception).
        line: Option<i32>,
    },
    /// The code object could not be named: shown as `<freed code 0x…
    /// +lasti>` or `<unreadable code 0x… +lasti>` (see `Unnamed`), never
    /// named after another.
    Unknown { code: u64, instruction: Instruction, why: Unnamed },
}

/// Why a Python frame has no name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unnamed {
    /// Its address no longer holds the code object that ran, or holds
    /// nothing readable: the code object was freed.
    Freed,
    /// The code object is there, but its name, file or line table could
    /// not be read (too long, or not the objects they should be).
    Unreadable,
}

impl Unnamed {
    fn label(self) -> &'static str {
        match self {
            Self::Freed => "freed",
            Self::Unreadable => "unreadable",
        }
    }
}

impl CodeError {
    /// Why a frame whose code object gave this error is unnamed: the
    /// object itself gone, or only what it points to unreadable.
    fn unnamed(&self) -> Unnamed {
        match self {
            Self::NotCode { .. } | Self::Unreadable { what: "code object", .. } => Unnamed::Freed,
            _ => Unnamed::Unreadable,
        }
    }
}

impl fmt::Display for PyFrame {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code { function, file, line: Some(line) } => {
                write!(formatter, "{function} ({file}:{line})")
            }
            Self::Code { function, file, line: None } => write!(formatter, "{function} ({file})"),
            Self::Unknown { code, instruction: Instruction::Unit(units), why } => {
                write!(formatter, "<{} code {code:#x} +{units}>", why.label())
            }
            Self::Unknown { code, instruction: Instruction::NotStarted, why } => {
                write!(formatter, "<{} code {code:#x}>", why.label())
            }
        }
    }
}

/// Values kept once however many cached code objects hold them, and
/// their bytes: in a module, every function has the same file name, and
/// generated code may share one name or line table among thousands.
struct Shared<T: ?Sized> {
    values: HashSet<Arc<T>>,
    bytes: usize,
}

impl<T: ?Sized + Hash + Eq> Shared<T> {
    fn new() -> Self {
        Self { values: HashSet::new(), bytes: 0 }
    }

    /// The kept value equal to `value`, which is kept if none is.
    fn share(&mut self, value: Arc<T>) -> Arc<T> {
        if let Some(kept) = self.values.get(&value) {
            return kept.clone();
        }
        self.bytes += std::mem::size_of_val(&*value);
        self.values.insert(value.clone());
        value
    }

    /// Lets `value` go if nothing but this set holds it any more, once
    /// its holder drops it (so at a count of 2: this set and the holder).
    fn release(&mut self, value: &Arc<T>) {
        if Arc::strong_count(value) <= 2 && self.values.remove(value) {
            self.bytes -= std::mem::size_of_val(&**value);
        }
    }

    /// Lets go every value nothing else holds.
    fn sweep(&mut self) {
        let mut bytes = 0;
        self.values.retain(|value| {
            let held = Arc::strong_count(value) > 1;
            if held {
                bytes += std::mem::size_of_val(&**value);
            }
            held
        });
        self.bytes = bytes;
    }
}

/// The strings and line tables of a process's cached code objects.
struct Kept {
    strings: Shared<str>,
    line_tables: Shared<[u8]>,
}

impl Kept {
    fn bytes(&self) -> usize {
        self.strings.bytes + self.line_tables.bytes
    }

    /// Lets go what only `info`, about to be dropped, held.
    fn release(&mut self, info: &CodeInfo) {
        self.strings.release(&info.name);
        self.strings.release(&info.file);
        self.line_tables.release(&info.line_table);
    }

    fn sweep(&mut self) {
        self.strings.sweep();
        self.line_tables.sweep();
    }
}

struct Slot {
    identity: Identity,
    info: Arc<CodeInfo>,
    /// The value of [`CodeCache::clock`] when last used: its key in
    /// [`CodeCache::by_use`].
    used: u64,
}

/// One process's code objects, by address, read once each and kept while
/// the address holds the same code object; at most `capacity` of them,
/// in at most `budget` bytes, the least recently used going first.
pub struct CodeCache<M = ProcessMemory> {
    memory: M,
    layout: CodeLayout,
    slots: HashMap<u64, Slot>,
    /// Addresses by when they were last used, oldest first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    capacity: usize,
    kept: Kept,
    budget: usize,
    /// For a process's cache (`open`): its share of `ALL_PROCESSES_BYTES`,
    /// and what it has said of the budgets.
    accounting: Option<Accounting>,
}

/// A process's cache within the budget of every process.
struct Accounting {
    pid: u32,
    /// What this cache counts for in `ALL_PROCESSES_BYTES`.
    counted: usize,
    /// Whether passing a budget was said (once).
    said: bool,
}

impl CodeCache<ProcessMemory> {
    /// The cache of process `pid`, whose objects are laid out as `layout`.
    pub fn open(pid: u32, layout: CodeLayout) -> io::Result<Self> {
        let mut cache =
            Self::new(ProcessMemory::open(pid)?, layout, CODE_CACHE_CAPACITY).with_budget(CODE_CACHE_BUDGET);
        cache.accounting = Some(Accounting { pid, counted: 0, said: false });
        Ok(cache)
    }
}

impl<M> Drop for CodeCache<M> {
    fn drop(&mut self) {
        if let Some(accounting) = &self.accounting {
            ALL_PROCESSES_BYTES.fetch_sub(accounting.counted, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl<M: Memory> CodeCache<M> {
    /// A cache of at most `capacity` code objects, without a byte budget.
    pub fn new(memory: M, layout: CodeLayout, capacity: usize) -> Self {
        Self {
            memory,
            layout,
            slots: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
            capacity: capacity.max(1),
            kept: Kept { strings: Shared::new(), line_tables: Shared::new() },
            budget: usize::MAX,
            accounting: None,
        }
    }

    /// This cache, keeping at most `budget` bytes of names, file names,
    /// line tables and slots.
    #[must_use]
    pub fn with_budget(mut self, budget: usize) -> Self {
        self.budget = budget;
        self
    }

    /// The code object at `address`. Each call reads its header again (one
    /// read of under 0x100 bytes) to check that the address still holds a
    /// code object, the same one as cached; its strings and line table are
    /// read only when it is new.
    pub fn code(&mut self, address: u64) -> Result<Arc<CodeInfo>, CodeError> {
        let identity = match read_identity(&self.memory, &self.layout, address) {
            Ok(identity) => identity,
            Err(error) => {
                self.forget(address);
                return Err(error);
            }
        };
        self.clock += 1;
        if let Some(slot) = self.slots.get_mut(&address) {
            if slot.identity == identity {
                self.by_use.remove(&slot.used);
                slot.used = self.clock;
                self.by_use.insert(self.clock, address);
                return Ok(slot.info.clone());
            }
        }
        self.forget(address);
        let info = Arc::new(read_code_info(&self.memory, &self.layout, address, identity, &mut self.kept)?);
        self.make_room();
        self.slots.insert(address, Slot { identity, info: info.clone(), used: self.clock });
        self.by_use.insert(self.clock, address);
        self.count_bytes();
        Ok(info)
    }

    /// The frame that runs `instruction` of the code object at `code`.
    pub fn resolve(&mut self, code: u64, instruction: Instruction) -> PyFrame {
        self.resolve_checked(code, instruction, 0)
    }

    /// As `resolve`, for a frame whose code object BPF found to be `check`
    /// when it stored the stack (0 for unchecked): the code object now at
    /// `code`, if another, was made there after that one was freed, and
    /// the frame is shown as unknown, never as the other.
    pub fn resolve_checked(&mut self, code: u64, instruction: Instruction, check: u64) -> PyFrame {
        match self.code(code) {
            Ok(info) if check != 0 && info.check != check => {
                log::debug!(
                    "python frame shown as unknown: {code:#x} holds {}, not the code object it ran",
                    info.name
                );
                PyFrame::Unknown { code, instruction, why: Unnamed::Freed }
            }
            Ok(info) => PyFrame::Code {
                function: info.name.clone(),
                file: info.file.clone(),
                line: info.line(instruction),
            },
            Err(error) => {
                log::debug!("python frame shown as unknown: {error}");
                PyFrame::Unknown { code, instruction, why: error.unnamed() }
            }
        }
    }

    /// The memory of the process the code objects are read from.
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// How many code objects are cached.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// The bytes this cache holds: its slots, and the strings and line
    /// tables they share.
    pub fn bytes(&self) -> usize {
        self.slots.len() * SLOT_OVERHEAD + self.kept.bytes()
    }

    fn forget(&mut self, address: u64) {
        if let Some(slot) = self.slots.remove(&address) {
            self.by_use.remove(&slot.used);
            self.kept.release(&slot.info);
            self.count_bytes();
        }
    }

    /// Brings this process's share of `ALL_PROCESSES_BYTES` up to date.
    fn count_bytes(&mut self) {
        let bytes = self.bytes();
        if let Some(accounting) = &mut self.accounting {
            ALL_PROCESSES_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
            ALL_PROCESSES_BYTES.fetch_sub(accounting.counted, std::sync::atomic::Ordering::Relaxed);
            accounting.counted = bytes;
        }
    }

    /// Whether one more code object's slot passes a budget: this cache's,
    /// or (a process's cache) that of every process together.
    fn over_budget(&self) -> bool {
        let bytes = self.bytes() + SLOT_OVERHEAD;
        let all = |accounting: &Accounting| {
            ALL_PROCESSES_BYTES.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(accounting.counted)
                + bytes
        };
        bytes > self.budget
            || self.accounting.as_ref().is_some_and(|accounting| all(accounting) > ALL_PROCESSES_BUDGET)
    }

    /// Lets the least recently used code objects go until one more fits
    /// in the capacity and everything in the budget. The one just read is
    /// kept however large: it is within `MAX_LINE_TABLE` and
    /// `MAX_STRING_CHARS`.
    fn make_room(&mut self) {
        let full = |cache: &Self| cache.slots.len() >= cache.capacity || cache.over_budget();
        if full(self) {
            // What callers dropped since it was released (a code object
            // whose frames were in hand when it went) goes first.
            self.kept.sweep();
        }
        let over_budget = self.over_budget();
        let own = self.bytes() + SLOT_OVERHEAD > self.budget;
        while full(self) {
            let past_budget = self.over_budget();
            let Some((_, oldest)) = self.by_use.pop_first() else { break };
            if let Some(slot) = self.slots.remove(&oldest) {
                self.kept.release(&slot.info);
                if past_budget {
                    LET_GO_PAST_BUDGET.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        if let Some(Accounting { pid, said: said @ false, .. }) = &mut self.accounting {
            if over_budget {
                *said = true;
                let budget = if own {
                    format!("the {} MiB memleak keeps of them a process", self.budget >> 20)
                } else {
                    format!(
                        "what is left of the {} MiB memleak keeps of them for every process",
                        ALL_PROCESSES_BUDGET >> 20
                    )
                };
                log::warn!(
                    "pid {pid}: its Python code objects' names and line tables pass {budget}: the least recently \
                     used are let go, and read again when a stack needs them"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// A process's memory made by hand: objects laid out one after the
    /// other from 0x10000, each in a region of its own, so that a read
    /// past an object's end fails as it would past a mapping's end.
    #[derive(Default)]
    struct FakeMemory {
        regions: BTreeMap<u64, Vec<u8>>,
        reads: Cell<usize>,
    }

    const CODE_TYPE: u64 = 0x5000;
    const STR_TYPE: u64 = 0x5100;
    const BYTES_TYPE: u64 = 0x5200;

    impl FakeMemory {
        fn put(&mut self, bytes: Vec<u8>) -> u64 {
            let address = self
                .regions
                .last_key_value()
                .map_or(0x10000, |(start, bytes)| (start + bytes.len() as u64 + 0x100) & !0xff);
            self.regions.insert(address, bytes);
            address
        }

        fn object(object_type: u64, size: usize) -> Vec<u8> {
            let mut bytes = vec![0; size];
            bytes[..8].copy_from_slice(&1u64.to_ne_bytes());
            bytes[8..16].copy_from_slice(&object_type.to_ne_bytes());
            bytes
        }

        /// A compact str of `text` as CPython 3.12 lays it out.
        fn put_str(&mut self, text: &str) -> u64 {
            let layout = layout();
            let characters: Vec<u32> = text.chars().map(u32::from).collect();
            let widest = characters.iter().max().copied().unwrap_or(0);
            let (kind, ascii) = match widest {
                0..0x80 => (1, true),
                0x80..0x100 => (1, false),
                0x100..0x1_0000 => (2, false),
                _ => (4, false),
            };
            let start = if ascii { layout.ascii_size } else { layout.compact_size };
            let mut bytes = Self::object(STR_TYPE, start);
            bytes[STR_LENGTH..][..8].copy_from_slice(&(characters.len() as u64).to_ne_bytes());
            let state = (kind << 2) | (1 << 5) | (u32::from(ascii) << 6);
            bytes[STR_STATE..][..4].copy_from_slice(&state.to_ne_bytes());
            for character in characters.into_iter().chain([0]) {
                bytes.extend_from_slice(&character.to_le_bytes()[..kind as usize]);
            }
            self.put(bytes)
        }

        fn put_bytes(&mut self, data: &[u8]) -> u64 {
            let mut bytes = Self::object(BYTES_TYPE, BYTES_DATA);
            bytes[BYTES_SIZE..][..8].copy_from_slice(&(data.len() as u64).to_ne_bytes());
            bytes.extend_from_slice(data);
            bytes.push(0);
            self.put(bytes)
        }

        /// A 3.12 code object named `name`, of `file`, starting at
        /// `first_line`, whose location table puts 4 code units on
        /// each of the next lines.
        fn put_code(&mut self, name: &str, file: &str, first_line: i32) -> u64 {
            let bytes = self.code_bytes(name, file, first_line);
            self.put(bytes)
        }

        fn code_bytes(&mut self, name: &str, file: &str, first_line: i32) -> Vec<u8> {
            let name = self.put_str(name);
            let file = self.put_str(file);
            // One-line forms, line +1 each, 4 units each.
            let table = self.put_bytes(&[0x80 | 11 << 3 | 3, 0, 0, 0x80 | 11 << 3 | 3, 0, 0]);
            Self::code_pointing_at(name, file, table, first_line)
        }

        /// A 3.12 code object of the str objects `name` and `file` and
        /// the line table `table`, which may be other code objects' too.
        fn code_pointing_at(name: u64, file: u64, table: u64, first_line: i32) -> Vec<u8> {
            let layout = layout();
            let mut bytes = Self::object(CODE_TYPE, 0xd0);
            bytes[layout.co_qualname.unwrap()..][..8].copy_from_slice(&name.to_ne_bytes());
            bytes[layout.co_filename..][..8].copy_from_slice(&file.to_ne_bytes());
            bytes[layout.co_firstlineno..][..4].copy_from_slice(&first_line.to_ne_bytes());
            bytes[layout.co_lines..][..8].copy_from_slice(&table.to_ne_bytes());
            bytes
        }
    }

    impl Memory for &FakeMemory {
        fn read_exact_at(&self, address: u64, buffer: &mut [u8]) -> io::Result<()> {
            self.reads.set(self.reads.get() + 1);
            let unmapped = || io::Error::from_raw_os_error(libc::EIO);
            let (start, bytes) = self.regions.range(..=address).next_back().ok_or_else(unmapped)?;
            let from = usize::try_from(address - start).map_err(|_| unmapped())?;
            let source = bytes.get(from..from + buffer.len()).ok_or_else(unmapped)?;
            buffer.copy_from_slice(source);
            Ok(())
        }
    }

    fn layout() -> CodeLayout {
        CodeLayout::for_version(12, CODE_TYPE).unwrap()
    }

    fn function(frame: &PyFrame) -> &str {
        match frame {
            PyFrame::Code { function, .. } => function,
            PyFrame::Unknown { .. } => panic!("expected a known frame, got {frame}"),
        }
    }

    #[test]
    fn a_code_object_resolves_to_its_name_file_and_lines() {
        let mut memory = FakeMemory::default();
        let code = memory.put_code("Cache.keep", "/app/svc.py", 9);
        let mut cache = CodeCache::new(&memory, layout(), 16);
        let frame = cache.resolve(code, Instruction::Unit(5));
        assert_eq!(frame.to_string(), "Cache.keep (/app/svc.py:11)");
        assert_eq!(cache.resolve(code, Instruction::NotStarted).to_string(), "Cache.keep (/app/svc.py:9)");
        // Past the table: no line.
        assert_eq!(cache.resolve(code, Instruction::Unit(8)).to_string(), "Cache.keep (/app/svc.py)");
    }

    #[test]
    fn a_cached_code_object_costs_one_read() {
        let mut memory = FakeMemory::default();
        let code = memory.put_code("keep", "/app/svc.py", 9);
        let mut cache = CodeCache::new(&memory, layout(), 16);
        let first = cache.code(code).unwrap();
        let reads = memory.reads.get();
        let again = cache.code(code).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(memory.reads.get() - reads, 1, "only the header is read again");
    }

    /// A line table of `length` bytes putting 4 code units on each line
    /// after the first.
    fn long_line_table(length: usize) -> Vec<u8> {
        [0x80 | 11 << 3 | 3, 0, 0].into_iter().cycle().take(length).collect()
    }

    #[test]
    fn code_objects_with_the_same_name_file_and_line_table_keep_one_copy() {
        let mut memory = FakeMemory::default();
        let name = memory.put_str(&"generated_".repeat(1_000));
        let file = memory.put_str("<string>");
        let table = memory.put_bytes(&long_line_table(MAX_LINE_TABLE));
        let codes: Vec<u64> =
            (0..64).map(|_| memory.put(FakeMemory::code_pointing_at(name, file, table, 1))).collect();
        let mut cache = CodeCache::new(&memory, layout(), CODE_CACHE_CAPACITY).with_budget(CODE_CACHE_BUDGET);
        for &code in &codes {
            assert_eq!(
                cache.resolve(code, Instruction::Unit(4)).to_string().len(),
                10_000 + " (<string>:3)".len()
            );
        }
        assert_eq!(cache.len(), 64);
        assert_eq!(cache.bytes(), 64 * SLOT_OVERHEAD + 10_000 + "<string>".len() + MAX_LINE_TABLE);
    }

    #[test]
    fn code_objects_past_the_budget_push_the_least_recently_used_out() {
        const TABLE: usize = 64 * 1024;
        let mut memory = FakeMemory::default();
        let file = memory.put_str("/app/gen.py");
        let codes: Vec<u64> = (0..40i32)
            .map(|index| {
                let name = memory.put_str(&format!("f{index}"));
                // Each of another length, so that no two are the same.
                let table = memory.put_bytes(&long_line_table((TABLE / 3 - index as usize) * 3));
                memory.put(FakeMemory::code_pointing_at(name, file, table, index))
            })
            .collect();
        let budget = 8 * TABLE;
        let mut cache = CodeCache::new(&memory, layout(), CODE_CACHE_CAPACITY).with_budget(budget);
        for (index, &code) in codes.iter().enumerate() {
            assert_eq!(
                cache.resolve(code, Instruction::Unit(4)).to_string(),
                format!("f{index} (/app/gen.py:{})", index + 2)
            );
            assert!(cache.bytes() <= budget, "{} bytes after {index}", cache.bytes());
        }
        assert_eq!(cache.len(), 7, "8 tables do not fit with their names and slots");
        // The first went long ago, and reads again.
        assert_eq!(cache.resolve(codes[0], Instruction::Unit(8)).to_string(), "f0 (/app/gen.py:3)");
        assert!(cache.bytes() <= budget);
    }

    #[test]
    fn the_least_recently_used_code_object_goes_first() {
        let mut memory = FakeMemory::default();
        let codes: Vec<u64> =
            ["a", "b", "c"].iter().map(|name| memory.put_code(name, "/app/svc.py", 1)).collect();
        let mut cache = CodeCache::new(&memory, layout(), 2);
        let a = cache.code(codes[0]).unwrap();
        let b = cache.code(codes[1]).unwrap();
        // a used again: b is now the oldest, and c pushes it out.
        assert!(Arc::ptr_eq(&a, &cache.code(codes[0]).unwrap()));
        cache.code(codes[2]).unwrap();
        assert_eq!(cache.len(), 2);
        assert!(Arc::ptr_eq(&a, &cache.code(codes[0]).unwrap()), "a stays");
        assert!(!Arc::ptr_eq(&b, &cache.code(codes[1]).unwrap()), "b was read again");
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn a_reused_address_is_read_again_by_the_same_cache() {
        // The cache holds its memory by reference here, so the reuse is
        // made through a cell of regions swapped under it.
        struct Swappable(std::cell::RefCell<FakeMemory>);
        impl Memory for &Swappable {
            fn read_exact_at(&self, address: u64, buffer: &mut [u8]) -> io::Result<()> {
                (&*self.0.borrow()).read_exact_at(address, buffer)
            }
        }
        let mut memory = FakeMemory::default();
        let code = memory.put_code("first", "/app/svc.py", 3);
        let reused = memory.code_bytes("second", "/app/svc.py", 30);
        let freed = FakeMemory::object(BYTES_TYPE, 0xd0);
        let memory = Swappable(std::cell::RefCell::new(memory));
        let mut cache = CodeCache::new(&memory, layout(), 16);
        assert_eq!(cache.resolve(code, Instruction::Unit(1)).to_string(), "first (/app/svc.py:4)");
        memory.0.borrow_mut().regions.insert(code, reused);
        assert_eq!(cache.resolve(code, Instruction::Unit(1)).to_string(), "second (/app/svc.py:31)");
        memory.0.borrow_mut().regions.insert(code, freed);
        assert_eq!(
            cache.resolve(code, Instruction::Unit(1)).to_string(),
            format!("<freed code {code:#x} +1>")
        );
        assert_eq!(cache.len(), 0, "a freed code object is not kept");
    }

    #[test]
    fn what_is_not_a_code_object_is_shown_as_unknown() {
        let mut memory = FakeMemory::default();
        // Long enough that reading it as a code object's header works.
        let string = memory.put_str(&"not code ".repeat(20));
        let mut cache = CodeCache::new(&memory, layout(), 16);
        for address in [string, 0, 8, 0xdead_0000] {
            assert_eq!(
                cache.resolve(address, Instruction::Unit(7)),
                PyFrame::Unknown { code: address, instruction: Instruction::Unit(7), why: Unnamed::Freed }
            );
        }
        assert!(matches!(cache.code(string), Err(CodeError::NotCode { found: STR_TYPE, .. })));
        assert!(matches!(cache.code(8), Err(CodeError::Unreadable { .. })));
        assert_eq!(cache.resolve(8, Instruction::NotStarted).to_string(), "<freed code 0x8>");
    }

    /// A code object whose name is the str `name`, edited by `edit`.
    fn code_with_edited_name(edit: impl FnOnce(&mut Vec<u8>)) -> Result<Arc<CodeInfo>, CodeError> {
        let mut memory = FakeMemory::default();
        let code = memory.put_code("keep", "/app/svc.py", 9);
        let name_address = u64_at(&memory.regions[&code], layout().co_qualname.unwrap());
        edit(memory.regions.get_mut(&name_address).unwrap());
        let mut cache = CodeCache::new(&memory, layout(), 16);
        cache.code(code)
    }

    #[test]
    fn a_live_code_object_whose_name_cannot_be_read_is_unreadable_not_freed() {
        let mut memory = FakeMemory::default();
        let code = memory.put_code("keep", "/app/svc.py", 9);
        let name_address = u64_at(&memory.regions[&code], layout().co_qualname.unwrap());
        let huge = u64::MAX.to_ne_bytes();
        memory.regions.get_mut(&name_address).unwrap()[STR_LENGTH..][..8].copy_from_slice(&huge);
        let mut cache = CodeCache::new(&memory, layout(), 16);
        let frame = cache.resolve(code, Instruction::Unit(4));
        assert_eq!(
            frame,
            PyFrame::Unknown { code, instruction: Instruction::Unit(4), why: Unnamed::Unreadable }
        );
        assert_eq!(frame.to_string(), format!("<unreadable code {code:#x} +4>"));
    }

    #[test]
    fn a_name_that_is_not_a_compact_str_is_refused() {
        assert!(code_with_edited_name(|_| ()).is_ok());
        let set_state = |state: u32| {
            move |bytes: &mut Vec<u8>| bytes[STR_STATE..][..4].copy_from_slice(&state.to_ne_bytes())
        };
        let ascii_kind_1 = (1 << 2) | (1 << 5) | (1 << 6);
        for (state, case) in [
            (ascii_kind_1 & !(1 << 5), "not compact"),
            ((3 << 2) | (1 << 5), "kind 3"),
            ((2 << 2) | (1 << 5) | (1 << 6), "ASCII of kind 2"),
        ] {
            let result = code_with_edited_name(set_state(state));
            assert!(matches!(result, Err(CodeError::BadString { what: "name", .. })), "{case}: {result:?}");
        }
        let longer = |bytes: &mut Vec<u8>| bytes[STR_LENGTH] += 1;
        assert!(
            matches!(code_with_edited_name(longer), Err(CodeError::BadString { .. })),
            "no NUL where the length ends"
        );
        let huge = |bytes: &mut Vec<u8>| bytes[STR_LENGTH..][..8].copy_from_slice(&u64::MAX.to_ne_bytes());
        assert!(matches!(code_with_edited_name(huge), Err(CodeError::BadString { .. })), "a huge length");
        let not_ascii = |bytes: &mut Vec<u8>| bytes[layout().ascii_size] = 0xe9;
        assert!(
            matches!(code_with_edited_name(not_ascii), Err(CodeError::BadString { .. })),
            "é in an ASCII str"
        );
        let other_type = |bytes: &mut Vec<u8>| bytes[OB_TYPE] ^= 0x10;
        assert!(
            matches!(code_with_edited_name(other_type), Err(CodeError::BadString { .. })),
            "a name of another type than the file's"
        );
    }

    #[test]
    fn names_of_every_kind_are_decoded() {
        let mut memory = FakeMemory::default();
        let names = ["ascii", "grüße", "Класс.функция", "𐌰𐌱.🐍"];
        let codes: Vec<u64> = names.iter().map(|name| memory.put_code(name, name, 1)).collect();
        let mut cache = CodeCache::new(&memory, layout(), 16);
        for (name, code) in names.iter().zip(codes) {
            let info = cache.code(code).unwrap();
            assert_eq!((&*info.name, &*info.file), (*name, *name));
        }
    }

    #[test]
    fn an_implausible_line_table_is_refused() {
        let mut memory = FakeMemory::default();
        let code = memory.put_code("keep", "/app/svc.py", 9);
        let table = u64_at(&memory.regions[&code], layout().co_lines);
        let bytes = memory.regions.get_mut(&table).unwrap();
        bytes[BYTES_SIZE..][..8].copy_from_slice(&(MAX_LINE_TABLE as u64 + 1).to_ne_bytes());
        let result = CodeCache::new(&memory, layout(), 16).code(code);
        assert!(matches!(result, Err(CodeError::BadLineTable { .. })), "{result:?}");
    }

    #[test]
    fn every_version_has_a_layout_and_a_line_table_format() {
        for minor in 8..=13 {
            let layout = CodeLayout::for_version(minor, CODE_TYPE).unwrap();
            assert!(layout.line_table_format().is_some());
            assert_eq!(layout.co_qualname.is_some(), minor >= 11, "3.{minor}");
        }
        assert_eq!(CodeLayout::for_version(7, CODE_TYPE), None);
        assert_eq!(CodeLayout::for_version(14, CODE_TYPE), None);
    }
}
