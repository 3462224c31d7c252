//! Where CPython keeps what the walk reads, per minor version (x86-64,
//! release builds with the GIL), as measured on CPython's own headers for
//! 3.8.18, 3.9.18, 3.10.13, 3.11.2 (Debian) and 3.11.7, 3.12.1, 3.13.0
//! (`shared/python-frames/offs/offsets_all.txt`).
//!
//! A table can go stale (a patch release, an odd build flag), so none is
//! trusted alone: 3.13 takes CPython's own `_Py_DebugOffsets` over it, and
//! every version is checked against `PyCode_Type.tp_members` and the live
//! threads before the walk is enabled.

/// How a frame says which instruction it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LastInstruction {
    /// `PyFrameObject.f_lasti`, an int counting bytes (3.8, 3.9).
    FrameObjectBytes,
    /// `PyFrameObject.f_lasti`, an int counting 2-byte code units (3.10).
    FrameObjectUnits,
    /// A pointer to the instruction (`prev_instr`, `instr_ptr`) into the
    /// code object's `co_code_adaptive` (3.11+).
    Pointer,
}

/// How the frames a native eval call ran are told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupEnd {
    /// One Python frame per native call (3.8 to 3.10).
    EveryFrame,
    /// The frame whose `is_entry` byte is set ends a group (3.11).
    EntryFlag { offset: u8 },
    /// A shim frame owned by the C stack precedes each group (3.12+).
    OwnerShim { offset: u8 },
}

/// `_PyInterpreterFrame` (3.11+) or `PyFrameObject`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameOffsets {
    pub code: u8,
    pub back: u8,
    pub instruction: u8,
    pub last_instruction: LastInstruction,
    pub group_end: GroupEnd,
    /// Bytes that hold every field above, and no more than a frame.
    pub read_size: u8,
}

/// `PyCodeObject`: what resolving a frame reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeOffsets {
    pub filename: u64,
    pub name: u64,
    /// `co_qualname` (3.11+).
    pub qualname: Option<u64>,
    pub firstlineno: u64,
    /// `co_lnotab` (3.8, 3.9) or `co_linetable` (3.10+), a bytes object.
    pub line_table: u64,
    /// `co_code_adaptive` (3.11+), which `PyCode_Type.tp_basicsize` also
    /// is; before 3.11, `tp_basicsize` is `sizeof(PyCodeObject)`.
    pub code_adaptive: Option<u64>,
    /// `PyCode_Type.tp_basicsize`.
    pub basic_size: u64,
}

/// Where the characters of a compact `str` start, and where a `bytes`
/// object keeps its size and data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StringLayout {
    /// `sizeof(PyASCIIObject)`: an ASCII string's data.
    pub ascii_data: u64,
    /// `sizeof(PyCompactUnicodeObject)`: any other compact string's data.
    pub compact_data: u64,
    /// `PyVarObject.ob_size` of a bytes object.
    pub bytes_size: u64,
    /// `PyBytesObject.ob_sval`.
    pub bytes_data: u64,
}

/// The runtime and thread-state side: finding each thread's frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadOffsets {
    /// The `Py_tss_t` in `_PyRuntime` (`{int _is_initialized; key}`).
    pub auto_tss_key: u64,
    /// `_PyRuntime.interpreters.head`.
    pub interpreters_head: u64,
    /// `PyInterpreterState.next`: the next interpreter, a sub-interpreter.
    pub interpreter_next: u64,
    /// `PyInterpreterState.threads.head` (`tstate_head` before 3.11).
    pub threads_head: u64,
    pub tstate_next: u64,
    /// `frame`, `cframe` or `current_frame`.
    pub tstate_frame: u64,
    /// `_PyCFrame.current_frame`, when the frame is behind a cframe.
    pub cframe_current: Option<u64>,
    /// `PyThreadState.thread_id`: the thread's `pthread_t`, which is its
    /// fsbase with glibc and musl.
    pub thread_id: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offsets {
    pub thread: ThreadOffsets,
    pub frame: FrameOffsets,
    pub code: CodeOffsets,
    pub strings: StringLayout,
}

/// The offsets of CPython 3.`minor` on the machine memleak runs on, if
/// they are known there. arm64's `pthread_mutex_t` is 48 bytes where
/// x86-64's is 40, and the GIL's two mutexes lie before `autoTSSkey` in
/// `_PyRuntimeState`: the key is 16 bytes further than in x86-64's table,
/// measured on Debian's 3.11 (`PyGILState_GetThisThreadState`); the other
/// versions are not measured on arm64 yet.
pub fn on_this_machine(minor: u32) -> Option<Offsets> {
    let mut offsets = for_minor(minor)?;
    if cfg!(target_arch = "aarch64") {
        if minor != 11 {
            return None;
        }
        offsets.thread.auto_tss_key += 0x10;
    }
    Some(offsets)
}

/// The offsets of CPython 3.`minor` on x86-64, if it is a supported one.
#[allow(clippy::too_many_lines, reason = "a table, one entry per version")]
pub fn for_minor(minor: u32) -> Option<Offsets> {
    let old_strings =
        StringLayout { ascii_data: 0x30, compact_data: 0x48, bytes_size: 0x10, bytes_data: 0x20 };
    let new_strings = StringLayout { ascii_data: 0x28, compact_data: 0x38, ..old_strings };
    let frame_object = |instruction, last_instruction, read_size| FrameOffsets {
        code: 0x20,
        back: 0x18,
        instruction,
        last_instruction,
        group_end: GroupEnd::EveryFrame,
        read_size,
    };
    let old_thread = |auto_tss_key| ThreadOffsets {
        auto_tss_key,
        interpreters_head: 0x20,
        interpreter_next: 0,
        threads_head: 0x8,
        tstate_next: 0x8,
        tstate_frame: 0x18,
        cframe_current: None,
        thread_id: 0xb0,
    };
    let old_code = |line_table| CodeOffsets {
        filename: 0x68,
        name: 0x70,
        qualname: None,
        firstlineno: 0x28,
        line_table,
        code_adaptive: None,
        basic_size: 0xb0,
    };
    let new_code = |firstlineno, code_adaptive| CodeOffsets {
        filename: 0x70,
        name: 0x78,
        qualname: Some(0x80),
        firstlineno,
        line_table: 0x88,
        code_adaptive: Some(code_adaptive),
        basic_size: code_adaptive,
    };
    let new_frame = |code, back, group_end| FrameOffsets {
        code,
        back,
        instruction: 0x38,
        last_instruction: LastInstruction::Pointer,
        group_end,
        read_size: 0x48,
    };
    Some(match minor {
        8 => Offsets {
            thread: old_thread(0x570),
            frame: frame_object(0x68, LastInstruction::FrameObjectBytes, 0x70),
            code: old_code(0x78),
            strings: old_strings,
        },
        9 => Offsets {
            thread: old_thread(0x248),
            frame: frame_object(0x68, LastInstruction::FrameObjectBytes, 0x70),
            code: old_code(0x78),
            strings: old_strings,
        },
        10 => Offsets {
            thread: old_thread(0x248),
            frame: frame_object(0x60, LastInstruction::FrameObjectUnits, 0x68),
            code: old_code(0x78),
            strings: old_strings,
        },
        11 => Offsets {
            thread: ThreadOffsets {
                auto_tss_key: 0x250,
                interpreters_head: 0x28,
                interpreter_next: 0,
                threads_head: 0x10,
                tstate_next: 0x8,
                tstate_frame: 0x38,
                cframe_current: Some(0x8),
                thread_id: 0x98,
            },
            frame: new_frame(0x20, 0x30, GroupEnd::EntryFlag { offset: 0x44 }),
            code: new_code(0x48, 0xb8),
            strings: old_strings,
        },
        12 => Offsets {
            thread: ThreadOffsets {
                auto_tss_key: 0x608,
                interpreters_head: 0x28,
                interpreter_next: 0,
                threads_head: 0x48,
                tstate_next: 0x8,
                tstate_frame: 0x38,
                cframe_current: Some(0),
                thread_id: 0x88,
            },
            frame: new_frame(0, 0x8, GroupEnd::OwnerShim { offset: 0x46 }),
            code: new_code(0x44, 0xc0),
            strings: new_strings,
        },
        13 => Offsets {
            thread: ThreadOffsets {
                auto_tss_key: 0x870,
                interpreters_head: 0x278,
                interpreter_next: 0x1c60,
                threads_head: 0x1cb0,
                tstate_next: 0x8,
                tstate_frame: 0x48,
                cframe_current: None,
                thread_id: 0x98,
            },
            frame: new_frame(0, 0x8, GroupEnd::OwnerShim { offset: 0x46 }),
            code: new_code(0x44, 0xc8),
            strings: new_strings,
        },
        _ => return None,
    })
}

/// What `_Py_DebugOffsets` (3.13, at `_PyRuntime + 0`) holds: a cookie,
/// the version, whether the build is free-threaded, then sections of
/// u64s, each starting with the size of what it describes.
pub const DEBUG_OFFSETS_SIZE: usize = 584;
const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";

/// The u64 index (after the cookie) of each field 3.13's struct has.
mod debug_field {
    pub const VERSION: usize = 0;
    pub const FREE_THREADED: usize = 1;
    pub const INTERPRETERS_HEAD: usize = 4;
    pub const INTERPRETER_NEXT: usize = 7;
    pub const THREADS_HEAD: usize = 8;
    pub const TSTATE_NEXT: usize = 20;
    pub const CURRENT_FRAME: usize = 22;
    pub const THREAD_ID: usize = 23;
    pub const FRAME_SIZE: usize = 27;
    pub const FRAME_PREVIOUS: usize = 28;
    pub const FRAME_EXECUTABLE: usize = 29;
    pub const FRAME_INSTR_PTR: usize = 30;
    pub const FRAME_OWNER: usize = 32;
    pub const CODE_FILENAME: usize = 34;
    pub const CODE_NAME: usize = 35;
    pub const CODE_QUALNAME: usize = 36;
    pub const CODE_LINETABLE: usize = 37;
    pub const CODE_FIRSTLINENO: usize = 38;
    pub const CODE_ADAPTIVE: usize = 42;
    pub const BYTES_OB_SIZE: usize = 64;
    pub const BYTES_OB_SVAL: usize = 65;
    pub const ASCIIOBJECT_SIZE: usize = 69;
}

/// `table` with what 3.13's `_Py_DebugOffsets` (`raw`, read from
/// `_PyRuntime`) says, after checking that it is one, of version
/// `version_hex`'s minor, and not free-threaded.
pub fn apply_debug_offsets(table: &Offsets, raw: &[u8], version_hex: u32) -> Result<Offsets, String> {
    if raw.len() < DEBUG_OFFSETS_SIZE || &raw[..8] != DEBUG_COOKIE {
        return Err("_PyRuntime does not start with CPython's debug offsets (cookie \"xdebugpy\")".to_owned());
    }
    let field = |index: usize| {
        let at = 8 + 8 * index;
        u64::from_le_bytes(raw[at..at + 8].try_into().expect("eight bytes"))
    };
    let their_version = field(debug_field::VERSION);
    if their_version >> 16 != u64::from(version_hex >> 16) {
        return Err(format!(
            "the debug offsets are of version {their_version:#x}, the interpreter {version_hex:#x}"
        ));
    }
    if field(debug_field::FREE_THREADED) != 0 {
        return Err("free-threaded CPython is not supported".to_owned());
    }
    let byte = |index: usize| {
        u8::try_from(field(index))
            .map_err(|_| format!("debug offset {index} is {:#x}, past a frame", field(index)))
    };
    let frame_size = field(debug_field::FRAME_SIZE);
    let mut offsets = *table;
    offsets.thread.interpreters_head = field(debug_field::INTERPRETERS_HEAD);
    offsets.thread.interpreter_next = field(debug_field::INTERPRETER_NEXT);
    offsets.thread.threads_head = field(debug_field::THREADS_HEAD);
    offsets.thread.tstate_next = field(debug_field::TSTATE_NEXT);
    offsets.thread.tstate_frame = field(debug_field::CURRENT_FRAME);
    offsets.thread.thread_id = field(debug_field::THREAD_ID);
    offsets.frame.code = byte(debug_field::FRAME_EXECUTABLE)?;
    offsets.frame.back = byte(debug_field::FRAME_PREVIOUS)?;
    offsets.frame.instruction = byte(debug_field::FRAME_INSTR_PTR)?;
    offsets.frame.group_end = GroupEnd::OwnerShim { offset: byte(debug_field::FRAME_OWNER)? };
    let code_adaptive = field(debug_field::CODE_ADAPTIVE);
    offsets.code = CodeOffsets {
        filename: field(debug_field::CODE_FILENAME),
        name: field(debug_field::CODE_NAME),
        qualname: Some(field(debug_field::CODE_QUALNAME)),
        firstlineno: field(debug_field::CODE_FIRSTLINENO),
        line_table: field(debug_field::CODE_LINETABLE),
        code_adaptive: Some(code_adaptive),
        basic_size: code_adaptive,
    };
    offsets.strings.ascii_data = field(debug_field::ASCIIOBJECT_SIZE);
    offsets.strings.bytes_size = field(debug_field::BYTES_OB_SIZE);
    offsets.strings.bytes_data = field(debug_field::BYTES_OB_SVAL);
    // The fixed-size read of a frame must hold every field and stay within
    // the frame (`localsplus` follows the fields read).
    let needed = [offsets.frame.code, offsets.frame.back, offsets.frame.instruction]
        .into_iter()
        .map(|offset| u64::from(offset) + 8)
        .chain([u64::from(byte(debug_field::FRAME_OWNER)?) + 1])
        .max()
        .unwrap_or(0);
    if needed > u64::from(offsets.frame.read_size) || frame_size < u64::from(offsets.frame.read_size) {
        return Err(format!(
            "the debug offsets' frame fields end at {needed:#x} of a {frame_size:#x}-byte frame; \
             the walk reads {:#x}",
            offsets.frame.read_size
        ));
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `_Py_DebugOffsets` as pyenv's 3.13.0 initialises it (read live
    /// with `pywalk.dump_debug_offsets`): the fields memleak reads.
    fn debug_offsets_3_13_0() -> Vec<u8> {
        let mut fields = [0u64; (DEBUG_OFFSETS_SIZE - 8) / 8];
        for (index, value) in [
            (debug_field::VERSION, 0x30d_00f0),
            (debug_field::INTERPRETERS_HEAD, 0x278),
            (debug_field::THREADS_HEAD, 0x1cb0),
            (debug_field::INTERPRETER_NEXT, 0x1c60),
            (debug_field::TSTATE_NEXT, 0x8),
            (debug_field::CURRENT_FRAME, 0x48),
            (debug_field::THREAD_ID, 0x98),
            (debug_field::FRAME_SIZE, 0x50),
            (debug_field::FRAME_PREVIOUS, 0x8),
            (debug_field::FRAME_EXECUTABLE, 0x0),
            (debug_field::FRAME_INSTR_PTR, 0x38),
            (debug_field::FRAME_OWNER, 0x46),
            (debug_field::CODE_FILENAME, 0x70),
            (debug_field::CODE_NAME, 0x78),
            (debug_field::CODE_QUALNAME, 0x80),
            (debug_field::CODE_LINETABLE, 0x88),
            (debug_field::CODE_FIRSTLINENO, 0x44),
            (debug_field::CODE_ADAPTIVE, 0xc8),
            (debug_field::BYTES_OB_SIZE, 0x10),
            (debug_field::BYTES_OB_SVAL, 0x20),
            (debug_field::ASCIIOBJECT_SIZE, 0x28),
        ] {
            fields[index] = value;
        }
        DEBUG_COOKIE.iter().copied().chain(fields.iter().flat_map(|field| field.to_le_bytes())).collect()
    }

    #[test]
    fn the_3_13_table_agrees_with_cpythons_own_debug_offsets() {
        let table = for_minor(13).unwrap();
        let applied = apply_debug_offsets(&table, &debug_offsets_3_13_0(), 0x30d_00f0).unwrap();
        assert_eq!(applied, table);
    }

    #[test]
    fn debug_offsets_of_another_kind_are_refused() {
        let table = for_minor(13).unwrap();
        let raw = debug_offsets_3_13_0();
        let error = apply_debug_offsets(&table, &raw, 0x30e_00f0).unwrap_err();
        assert!(error.contains("of version 0x30d00f0"), "{error}");
        let mut free_threaded = raw.clone();
        free_threaded[16] = 1;
        let error = apply_debug_offsets(&table, &free_threaded, 0x30d_00f0).unwrap_err();
        assert!(error.contains("free-threaded"), "{error}");
        let mut no_cookie = raw.clone();
        no_cookie[0] = b'y';
        assert!(apply_debug_offsets(&table, &no_cookie, 0x30d_00f0).unwrap_err().contains("cookie"));
        let mut owner_past_the_read = raw;
        let at = 8 + 8 * debug_field::FRAME_OWNER;
        owner_past_the_read[at] = 0x48;
        let error = apply_debug_offsets(&table, &owner_past_the_read, 0x30d_00f0).unwrap_err();
        assert!(error.contains("the walk reads 0x48"), "{error}");
    }

    #[test]
    fn the_tables_match_the_offsets_compiled_from_the_headers() {
        // offsets_all.txt: a few fields per version that tell versions apart.
        let v38 = for_minor(8).unwrap();
        assert_eq!(
            (v38.thread.auto_tss_key, v38.frame.instruction, v38.code.line_table),
            (0x570, 0x68, 0x78)
        );
        let v310 = for_minor(10).unwrap();
        assert_eq!(
            (v310.frame.instruction, v310.frame.last_instruction),
            (0x60, LastInstruction::FrameObjectUnits)
        );
        let v311 = for_minor(11).unwrap();
        assert_eq!(
            (v311.frame.back, v311.code.basic_size, v311.thread.cframe_current),
            (0x30, 0xb8, Some(8))
        );
        let v312 = for_minor(12).unwrap();
        assert_eq!(
            (v312.thread.threads_head, v312.thread.thread_id, v312.strings.ascii_data),
            (0x48, 0x88, 0x28)
        );
        assert!(for_minor(7).is_none() && for_minor(14).is_none());
    }
}
