//! Python frames in allocation stacks: finding a CPython 3.8 to 3.13
//! interpreter in a traced process, and all that the BPF walk of its
//! frames and the merge into native stacks need
//! (`shared/docs/python-frames.md` §6.2).
//!
//! [`detect`] finds the object that holds the interpreter, its version,
//! the offsets of that version (3.13: CPython's own `_Py_DebugOffsets`),
//! checks them against `PyCode_Type`'s own member table, reads the TSS
//! key, and self-tests the thread-state lookup on every thread the
//! interpreter has, through `/proc/PID/mem`. Any disagreement disables
//! Python frames for the process with a one-line reason: a wrong offset
//! would show wrong frames, which is worse than none.
//!
//! A frame record of the interpreter (code object address, instruction)
//! is resolved from the live process: `code` reads code objects and
//! caches them per process, `line_table` turns an instruction into its
//! line.
#![allow(dead_code, reason = "wired into the tracer in the next step of issue 23")]

pub mod code;
pub mod frames;
#[cfg(test)]
mod interpreter_tests;
pub mod line_table;
pub mod memory;
pub mod offsets;
pub mod runtime;
#[cfg(test)]
mod tests;
pub mod thread_state;

use std::{
    collections::HashMap,
    io,
    ops::Range,
    path::Path,
    sync::{Mutex, OnceLock, PoisonError},
};

use memleak_common::python::{
    PyProcConfig, PY_CFRAME, PY_DEFAULT_MAX_FRAMES, PY_ENTRY_FLAG, PY_FRAMEOBJ, PY_LASTI_BYTES, PY_MUSL,
    PY_OWNER_SHIM,
};
use object::read::ReadCache;

use self::{
    memory::ProcessMemory,
    offsets::{CodeOffsets, GroupEnd, LastInstruction, Offsets, StringLayout},
    runtime::PythonVersion,
    thread_state::{LibcLayout, SelfTest},
};
use crate::attach::kernel_btf;
use crate::process::files::FileIdentity;

/// What [`detect`] concluded about one process.
#[derive(Debug)]
pub enum Detection {
    /// A supported interpreter that passed every check.
    Enabled(Box<PythonRuntime>),
    /// No CPython in the process.
    NotPython,
    /// CPython, not initialised yet (a process caught at exec): detect
    /// again at the next refresh of its mappings.
    TryLater(String),
    /// CPython whose frames memleak will not read, and why, in a line.
    Disabled(String),
}

/// Where the offsets in use came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetsSource {
    /// memleak's table for the minor version.
    Table,
    /// CPython's `_Py_DebugOffsets` (3.13+), over the table.
    DebugOffsets,
}

/// A CPython interpreter found in a process, checked: what the BPF walk
/// ([`Self::config`]) and the user-space resolution and merge need.
#[derive(Clone, Debug)]
pub struct PythonRuntime {
    pub version: PythonVersion,
    /// The object holding the interpreter, as the process names it.
    pub path: String,
    /// Its load bias: runtime address minus its own addresses.
    pub bias: u64,
    /// `_PyRuntime`, at runtime.
    pub runtime_address: u64,
    /// `PyCode_Type`, at runtime: what a code object's `ob_type` is.
    pub pycode_type: u64,
    /// `PyUnicode_Type`, at runtime: what a `str`'s `ob_type` is.
    pub pyunicode_type: u64,
    /// `_PyEval_EvalFrameDefault` and its `.cold` part, at runtime, the
    /// function first.
    pub eval_ranges: Vec<Range<u64>>,
    pub offsets: Offsets,
    pub offsets_source: OffsetsSource,
    pub tss_key: u32,
    pub libc: LibcLayout,
    /// `offsetof(task_struct, thread.fsbase)` of the running kernel.
    pub fsbase_offset: u32,
    pub self_test: SelfTest,
    /// What the BPF walk is given, with [`PY_DEFAULT_MAX_FRAMES`].
    pub config: PyProcConfig,
}

impl PythonRuntime {
    /// The code-object fields resolving a frame reads.
    pub fn code_offsets(&self) -> CodeOffsets {
        self.offsets.code
    }

    /// Where strings and bytes keep their data.
    pub fn string_layout(&self) -> StringLayout {
        self.offsets.strings
    }

    /// Whether `address` (a return address minus one) is inside the eval
    /// loop, where the merge puts Python frames.
    pub fn in_eval(&self, address: u64) -> bool {
        self.eval_ranges.iter().any(|range| range.contains(&address))
    }

    /// [`Self::config`] walking at most `max_frames` Python frames.
    pub fn config_with_max_frames(&self, max_frames: u16) -> PyProcConfig {
        PyProcConfig { max_frames, ..self.config }
    }
}

impl std::fmt::Display for PythonRuntime {
    /// The line said at attach.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match self.offsets_source {
            OffsetsSource::Table => "memleak's table",
            OffsetsSource::DebugOffsets => "CPython's debug offsets",
        };
        write!(
            f,
            "python {} ({}): _PyRuntime {:#x}, TSS key {} ok on {}/{} threads, offsets from {source} checked via PyCode_Type",
            self.version,
            self.path,
            self.runtime_address,
            self.tss_key,
            self.self_test.threads,
            self.self_test.threads
        )
    }
}

/// Why a process that runs sub-interpreters has no Python frames.
pub const SUBINTERPRETERS: &str =
    "it runs sub-interpreters, whose threads' current frames the thread-state key does not give";

/// Whether the interpreter whose `_PyRuntime` is at `runtime_address` has
/// started a sub-interpreter: a second interpreter in the runtime's list.
/// From 3.12 a thread of a sub-interpreter keeps its current thread state
/// in a thread-local variable, and the TSS key may still give its main
/// interpreter's: its frames would be another thread state's.
pub fn runs_subinterpreters(
    memory: &ProcessMemory,
    runtime_address: u64,
    offsets: &Offsets,
) -> io::Result<bool> {
    // The newest interpreter heads the list.
    let newest = memory.u64(runtime_address + offsets.thread.interpreters_head)?;
    Ok(newest != 0 && memory.u64(newest + offsets.thread.interpreter_next)? != 0)
}

/// Detects CPython in process `pid` (see the module's documentation).
pub fn detect(pid: u32) -> Detection {
    detect_or_refuse(pid).map_or_else(|refusal| refusal, |runtime| Detection::Enabled(Box::new(runtime)))
}

/// A refusal is a reason to disable, unless said otherwise.
impl From<String> for Detection {
    fn from(reason: String) -> Self {
        Detection::Disabled(reason)
    }
}

impl From<&str> for Detection {
    fn from(reason: &str) -> Self {
        Detection::Disabled(reason.to_owned())
    }
}

const SUPPORTED_MINORS: std::ops::RangeInclusive<u32> = 8..=13;

/// The runtime, or the [`Detection`] that is not `Enabled`.
fn detect_or_refuse(pid: u32) -> Result<PythonRuntime, Detection> {
    check_interpreter(pid, inspect_files(pid)?)
}

/// The checks of the interpreter `found` in process `pid`'s files against
/// its memory, which may be read a while after its files: the process
/// runs on meanwhile.
fn check_interpreter(pid: u32, found: InterpreterFile) -> Result<PythonRuntime, Detection> {
    let memory = ProcessMemory::open(pid).map_err(|error| {
        format!("cannot read /proc/{pid}/mem: {error}: reading Python frames needs root or CAP_SYS_PTRACE")
    })?;
    let InterpreterFile { version, runtime_address, pycode_type, .. } = found;
    let (offsets, offsets_source) = if version.minor >= 13 {
        let raw = memory
            .bytes(runtime_address, offsets::DEBUG_OFFSETS_SIZE)
            .map_err(|error| format!("cannot read _PyRuntime at {runtime_address:#x}: {error}"))?;
        (offsets::apply_debug_offsets(&found.table, &raw, version.hex_minor())?, OffsetsSource::DebugOffsets)
    } else {
        (found.table, OffsetsSource::Table)
    };
    cross_check(&memory, pycode_type, found.pyunicode_type, version, &offsets)
        .map_err(|reason| format!("CPython {version}'s offsets do not match its PyCode_Type: {reason}"))?;
    let tss_key = thread_state::tss_key(&memory, runtime_address, &offsets)
        .map_err(|error| format!("cannot read _PyRuntime's TSS key: {error}"))?
        .ok_or_else(|| {
            Detection::TryLater("the interpreter has not initialised its thread-state key yet".to_owned())
        })?;
    let interpreters = memory
        .u64(runtime_address + offsets.thread.interpreters_head)
        .map_err(|error| format!("cannot read _PyRuntime's interpreters: {error}"))?;
    if interpreters == 0 {
        return Err(Detection::TryLater("the interpreter has no interpreter state yet".to_owned()));
    }
    if runs_subinterpreters(&memory, runtime_address, &offsets)
        .map_err(|error| format!("cannot read the interpreters' list: {error}"))?
    {
        return Err(SUBINTERPRETERS.into());
    }
    let subject = thread_state::Subject {
        memory: &memory,
        runtime: runtime_address,
        offsets: &offsets,
        key: tss_key,
        pycode_type,
    };
    // Checked after the interpreter is seen initialised: a process caught
    // at exec maps no libc yet. Its mappings are read again: those read
    // before may be from before its loader mapped libc, as the process
    // runs on meanwhile, and would disable it for good.
    let mappings =
        runtime::Mappings::read(pid).map_err(|error| format!("cannot read /proc/{pid}/maps: {error}"))?;
    let layout = libc_layout(pid, &mappings)?;
    let self_test = self_test_settled(&subject, layout)
        .map_err(|reason| format!("the thread-state lookup failed its self-test: {reason}"))?;
    Ok(PythonRuntime {
        version,
        path: found.path,
        bias: found.bias,
        runtime_address,
        pycode_type,
        pyunicode_type: found.pyunicode_type,
        eval_ranges: found.eval_ranges,
        offsets,
        offsets_source,
        tss_key,
        libc: layout,
        fsbase_offset: fsbase_offset()?,
        self_test,
        config: config(&offsets, tss_key, layout)?,
    })
}

/// What the files a process maps say of its interpreter.
struct InterpreterFile {
    path: String,
    bias: u64,
    version: PythonVersion,
    /// The table for the version, before anything is checked.
    table: Offsets,
    runtime_address: u64,
    pycode_type: u64,
    pyunicode_type: u64,
    eval_ranges: Vec<Range<u64>>,
}

/// What an interpreter's file says, in its own addresses: the same for
/// every process that maps it.
#[derive(Clone)]
struct InterpreterFacts {
    version: PythonVersion,
    table: Offsets,
    runtime_address: u64,
    pycode_type: u64,
    pyunicode_type: u64,
    eval_ranges: Vec<Range<u64>>,
}

/// The facts of each interpreter file read so far. Reading them takes
/// most of a detection (the eval loop's `.cold` part is found through
/// `.eh_frame`); a process caught at its exec is looked at every few
/// milliseconds until its interpreter has initialised, and forked
/// workers and containers run the same files. Few files are interpreters:
/// emptied when it reaches `KNOWN_INTERPRETERS`.
static INTERPRETERS: Mutex<Option<HashMap<FileIdentity, Result<InterpreterFacts, String>>>> =
    Mutex::new(None);
const KNOWN_INTERPRETERS: usize = 64;

/// The interpreter object of process `pid`, if a supported one: its
/// version, and its addresses at runtime.
fn inspect_files(pid: u32) -> Result<InterpreterFile, Detection> {
    let mappings =
        runtime::Mappings::read(pid).map_err(|error| format!("cannot read /proc/{pid}/maps: {error}"))?;
    let Some(object) = runtime::find_interpreter(pid, &mappings) else {
        if runtime::links_interpreter(pid, &mappings) {
            return Err(Detection::TryLater("its libpython is not loaded yet".to_owned()));
        }
        return Err(Detection::NotPython);
    };
    let facts = {
        let mut known = INTERPRETERS.lock().unwrap_or_else(PoisonError::into_inner);
        let known = known.get_or_insert_with(HashMap::new);
        if let Some(facts) = known.get(&object.identity) {
            facts.clone()
        } else {
            let facts = read_facts(&object);
            if known.len() >= KNOWN_INTERPRETERS {
                known.clear();
            }
            known.insert(object.identity, facts.clone());
            facts
        }
    }?;
    let at_runtime = |address: u64| object.bias.wrapping_add(address);
    Ok(InterpreterFile {
        runtime_address: at_runtime(facts.runtime_address),
        pycode_type: at_runtime(facts.pycode_type),
        pyunicode_type: at_runtime(facts.pyunicode_type),
        eval_ranges: facts
            .eval_ranges
            .iter()
            .map(|range| at_runtime(range.start)..at_runtime(range.end))
            .collect(),
        path: object.path,
        bias: object.bias,
        version: facts.version,
        table: facts.table,
    })
}

/// Reads `object`'s [`InterpreterFacts`], or why it is not supported.
fn read_facts(object: &runtime::InterpreterObject) -> Result<InterpreterFacts, String> {
    let path = &object.path;
    let cache = ReadCache::new(&object.file);
    let parsed =
        object::File::parse(&cache).map_err(|error| format!("{path} is not a readable ELF file: {error}"))?;
    let (version, free_threaded) = runtime::version(object, &parsed, &cache)
        .ok_or_else(|| format!("cannot tell which version of CPython {path} is"))?;
    if version.major != 3 || !SUPPORTED_MINORS.contains(&version.minor) || !object.has_runtime {
        return Err(format!(
            "CPython {version} ({path}) is not supported: Python frames need CPython 3.8 to 3.13"
        ));
    }
    if free_threaded {
        return Err(format!("free-threaded CPython {version} ({path}) is not supported"));
    }
    let table = offsets::on_this_machine(version.minor)
        .ok_or_else(|| format!("no offsets for CPython {version} ({path}) on {}", std::env::consts::ARCH))?;
    let symbol = |name: &str| {
        runtime::symbol(&parsed, name)
            .map(|(address, _)| address)
            .ok_or_else(|| format!("{path} has no symbol {name}"))
    };
    let eval_ranges = runtime::eval_ranges(Path::new(path), &parsed, &cache)
        .map_err(|reason| format!("cannot find the eval loop of {path}: {reason}"))?;
    Ok(InterpreterFacts {
        runtime_address: runtime::runtime_address(&parsed).ok_or("no _PyRuntime")?,
        pycode_type: symbol("PyCode_Type")?,
        pyunicode_type: symbol("PyUnicode_Type")?,
        version,
        table,
        eval_ranges,
    })
}

/// Where the libc process `pid` runs on keeps thread-specific data.
fn libc_layout(pid: u32, mappings: &runtime::Mappings) -> Result<LibcLayout, String> {
    match thread_state::libc_of(mappings.paths()) {
        Some(thread_state::Libc::Glibc) if cfg!(target_arch = "x86_64") => Ok(thread_state::GLIBC),
        Some(thread_state::Libc::Glibc) => {
            let path = mappings.paths().find(|path| path.ends_with("/libc.so.6")).unwrap_or("libc.so.6");
            let file = mappings.open(pid, path).ok_or_else(|| format!("cannot open glibc's {path}"))?;
            thread_state::glibc_arm64_layout(&file)
                .map_err(|reason| format!("cannot read glibc's layout in {path}: {reason}"))
        }
        Some(thread_state::Libc::Musl { path }) => {
            let file = mappings.open(pid, path).ok_or_else(|| format!("cannot open musl's {path}"))?;
            thread_state::musl_layout(&file)
                .map_err(|reason| format!("cannot read musl's layout in {path}: {reason}"))
        }
        None => {
            Err("the process maps neither glibc nor musl, whose thread-specific data memleak reads"
                .to_owned())
        }
    }
}

/// The self-test. A thread starting while the list is read has a thread
/// state its own lookup does not find yet (before 3.12 its `thread_id`
/// is its creator's until it runs), and one ending may be freed under the
/// walk: a failure is tried again a little later before it counts.
fn self_test_settled(subject: &thread_state::Subject<'_>, layout: LibcLayout) -> Result<SelfTest, String> {
    const ATTEMPTS: usize = 3;
    let mut outcome = thread_state::self_test(subject, layout);
    for _ in 1..ATTEMPTS {
        if outcome.is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        outcome = thread_state::self_test(subject, layout);
    }
    outcome
}

/// Where a task keeps its user thread pointer, which the C library's
/// thread data hangs from: x86-64's fsbase.
#[cfg(target_arch = "x86_64")]
const THREAD_POINTER: [&str; 2] = ["thread", "fsbase"];
/// arm64's `TPIDR_EL0`, saved at each switch.
#[cfg(target_arch = "aarch64")]
const THREAD_POINTER: [&str; 3] = ["thread", "uw", "tp_value"];

/// `offsetof(task_struct, thread.fsbase)` (`thread.uw.tp_value` on
/// arm64), read once from the kernel's BTF: where BPF finds the current
/// thread's thread pointer.
pub fn fsbase_offset() -> Result<u32, String> {
    static OFFSET: OnceLock<Result<u32, String>> = OnceLock::new();
    OFFSET
        .get_or_init(|| {
            kernel_btf::member_path_offset(Path::new(kernel_btf::VMLINUX_BTF), "task_struct", &THREAD_POINTER)
                .map_err(|error| format!("cannot find a thread's thread pointer in the kernel: {error}"))
        })
        .clone()
}

/// `PyTypeObject.tp_basicsize` and `tp_members`, the same from 3.8 to
/// 3.13; `PyMemberDef` is `{name, type, offset, flags, doc}`, 40 bytes.
const TP_BASICSIZE: u64 = 32;
const TP_MEMBERS: u64 = 240;
const MEMBER_DEF_SIZE: u64 = 40;
const MEMBER_DEF_OFFSET: u64 = 16;
/// More members than `PyCode_Type` has (about 20): a table without its
/// terminating entry is cut short.
const MAX_MEMBERS: u64 = 64;

/// Checks the code-object offsets against `PyCode_Type`'s member table
/// and size, and the string layout against `PyUnicode_Type`'s size, as
/// the running interpreter has them.
fn cross_check(
    memory: &ProcessMemory,
    pycode_type: u64,
    pyunicode_type: u64,
    version: PythonVersion,
    offsets: &Offsets,
) -> Result<(), String> {
    let read =
        |address: u64| memory.u64(address).map_err(|error| format!("cannot read {address:#x}: {error}"));
    let basic_size = read(pycode_type + TP_BASICSIZE)?;
    if basic_size != offsets.code.basic_size {
        return Err(format!("tp_basicsize is {basic_size:#x}, not {:#x}", offsets.code.basic_size));
    }
    let table = read(pycode_type + TP_MEMBERS)?;
    let mut members = HashMap::new();
    for index in 0..MAX_MEMBERS {
        let entry = table + index * MEMBER_DEF_SIZE;
        let name = read(entry)?;
        if name == 0 {
            break;
        }
        let name =
            memory.c_string(name, 64).map_err(|error| format!("cannot read a member's name: {error}"))?;
        members.insert(String::from_utf8_lossy(&name).into_owned(), read(entry + MEMBER_DEF_OFFSET)?);
    }
    let line_table = if version.minor <= 9 { "co_lnotab" } else { "co_linetable" };
    let code = &offsets.code;
    let expected = [
        Some(("co_filename", code.filename)),
        Some(("co_name", code.name)),
        code.qualname.map(|qualname| ("co_qualname", qualname)),
        Some(("co_firstlineno", code.firstlineno)),
        Some((line_table, code.line_table)),
    ];
    for (member, offset) in expected.into_iter().flatten() {
        match members.get(member) {
            Some(&found) if found == offset => {}
            Some(&found) => return Err(format!("{member} is at {found:#x}, not {offset:#x}")),
            None => return Err(format!("it has no member {member}")),
        }
    }
    // `PyUnicodeObject` is the compact header and a pointer to the data.
    let unicode_size = read(pyunicode_type + TP_BASICSIZE)?;
    if unicode_size != offsets.strings.compact_data + 8 {
        return Err(format!(
            "PyUnicode_Type's tp_basicsize is {unicode_size:#x}, not {:#x}",
            offsets.strings.compact_data + 8
        ));
    }
    Ok(())
}

/// What the BPF walk is given for these offsets, TSS key and libc.
fn config(offsets: &Offsets, tss_key: u32, libc: LibcLayout) -> Result<PyProcConfig, String> {
    let mut flags = 0;
    match offsets.frame.last_instruction {
        LastInstruction::FrameObjectBytes => flags |= PY_FRAMEOBJ | PY_LASTI_BYTES,
        LastInstruction::FrameObjectUnits => flags |= PY_FRAMEOBJ,
        LastInstruction::Pointer => {}
    }
    if offsets.thread.cframe_current.is_some() {
        flags |= PY_CFRAME;
    }
    let (f_entry, f_owner) = match offsets.frame.group_end {
        GroupEnd::EveryFrame => (0, 0),
        GroupEnd::EntryFlag { offset } => {
            flags |= PY_ENTRY_FLAG;
            (offset, 0)
        }
        GroupEnd::OwnerShim { offset } => {
            flags |= PY_OWNER_SHIM;
            (0, offset)
        }
    };
    let (tsd_off, tsd_l2_off, pthread_below_tp) = match libc {
        LibcLayout::Glibc { first_block, second_level, below_thread_pointer } => {
            (first_block, second_level, below_thread_pointer)
        }
        LibcLayout::Musl { tsd } => {
            flags |= PY_MUSL;
            (tsd, 0, 0)
        }
    };
    let too_far = |what: &str, offset: u64| format!("{what} at {offset:#x} is farther than the walk reads");
    let check = CodeCheckSpan::of(&offsets.code)?;
    Ok(PyProcConfig {
        flags,
        tss_key,
        tsd_off,
        tsd_l2_off,
        pthread_below_tp,
        ts_frame: u16::try_from(offsets.thread.tstate_frame)
            .map_err(|_| too_far("the thread state's frame", offsets.thread.tstate_frame))?,
        cframe_cur: u8::try_from(offsets.thread.cframe_current.unwrap_or(0))
            .map_err(|_| too_far("the cframe's current frame", offsets.thread.cframe_current.unwrap_or(0)))?,
        f_code: offsets.frame.code,
        f_back: offsets.frame.back,
        f_instr: offsets.frame.instruction,
        f_entry,
        f_owner,
        read_size: offsets.frame.read_size,
        _pad: 0,
        co_code: u16::try_from(offsets.code.code_adaptive.unwrap_or(0))
            .map_err(|_| too_far("co_code_adaptive", offsets.code.code_adaptive.unwrap_or(0)))?,
        max_frames: PY_DEFAULT_MAX_FRAMES,
        co_check: check.start,
        co_check_size: check.size,
        co_check_name: check.name,
        co_check_file: check.file,
        co_check_line: check.line,
        _pad2: [0; 5],
    })
}

/// The part of a code object BPF reads to check it: from the lowest of
/// its name, file and first line to the end of the highest, one read.
struct CodeCheckSpan {
    start: u8,
    size: u8,
    /// Within the span.
    name: u8,
    file: u8,
    line: u8,
}

impl CodeCheckSpan {
    fn of(code: &CodeOffsets) -> Result<Self, String> {
        let name = code.qualname.unwrap_or(code.name);
        let fields = [(name, 8), (code.filename, 8), (code.firstlineno, 4)];
        // Aligned down to a word, as the pointers are.
        let start = fields.iter().map(|&(offset, _)| offset).min().unwrap_or(0) & !7;
        let end = fields.iter().map(|&(offset, size)| offset + size).max().unwrap_or(0);
        let byte = |value: u64| {
            u8::try_from(value)
                .map_err(|_| format!("a code object's name, file and first line span {value:#x} bytes"))
        };
        let size = byte(end - start)?;
        if size > 120 {
            return Err(format!("a code object's name, file and first line span {size} bytes"));
        }
        Ok(Self {
            start: byte(start)?,
            size,
            name: byte(name - start)?,
            file: byte(code.filename - start)?,
            line: byte(code.firstlineno - start)?,
        })
    }
}
