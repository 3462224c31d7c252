//! Python frames: what user space tells the BPF walker about one CPython
//! process ([`PyProcConfig`]), and how the walker packs each Python frame
//! into one word of a stack.
//!
//! User space detects the interpreter, checks its offsets and self-tests
//! the thread-state lookup before it writes a config; the walker trusts
//! the config and only bounds what it reads.

/// `tstate->cframe->current_frame` (3.11, 3.12): one more read to reach
/// the current frame.
pub const PY_CFRAME: u32 = 1 << 0;
/// A frame whose `is_entry` byte ([`PyProcConfig::f_entry`]) is non-zero
/// ends a group (3.11).
pub const PY_ENTRY_FLAG: u32 = 1 << 1;
/// A frame whose owner byte ([`PyProcConfig::f_owner`]) is
/// [`PY_OWNED_BY_CSTACK`] is the C stack's shim: not reported, and the
/// frame before it ends a group (3.12+).
pub const PY_OWNER_SHIM: u32 = 1 << 2;
/// Frames are `PyFrameObject`s whose `f_lasti` is an `int`, each run by
/// its own native eval call (3.8 to 3.10).
pub const PY_FRAMEOBJ: u32 = 1 << 3;
/// `f_lasti` counts bytes, not 2-byte code units (3.8, 3.9).
pub const PY_LASTI_BYTES: u32 = 1 << 4;
/// musl's thread-specific data: `*(fsbase + tsd_off) + 8 * key`.
pub const PY_MUSL: u32 = 1 << 5;

/// CPython's `FRAME_OWNED_BY_CSTACK` (3.12, 3.13).
pub const PY_OWNED_BY_CSTACK: u8 = 3;

/// Python frames walked per stack unless told otherwise.
pub const PY_DEFAULT_MAX_FRAMES: u16 = 63;

/// A stack word that is a Python frame, not a return address: user-space
/// return addresses are below 2^47 on x86-64, 2^48 on arm64.
pub const PY_FRAME: u64 = 1 << 63;
/// The last Python frame one native `_PyEval_EvalFrameDefault` ran.
pub const PY_GROUP_END: u64 = 1 << 62;
/// Bits 61..17 of a Python frame word: the code object's address >> 3
/// (below 2^48, and 8-aligned as every object is).
pub const PY_CODE_SHIFT: u32 = 17;
/// How many bits of the word the code object's address >> 3 takes.
pub const PY_CODE_BITS: u32 = 45;
/// Bits 16..0: the instruction index + 1, in 2-byte code units, clamped
/// (a function of more than 131,070 code units is rare); 0 is a frame
/// that has not started (its line is `co_firstlineno`).
pub const PY_LASTI_MASK: u64 = (1 << PY_CODE_SHIFT) - 1;

/// How the BPF walker finds and reads the Python frames of one process
/// (`PY_PROCS[tgid]`). Offsets are in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProcConfig {
    /// `PY_*` flags above.
    pub flags: u32,
    /// CPython's `autoTSSkey`: the pthread key whose value is the thread's
    /// `PyThreadState*`.
    pub tss_key: u32,
    /// glibc: `struct pthread.specific_1stblock` from fsbase (keys < 32;
    /// a slot is 16 bytes, its data at +8); musl: `struct pthread.tsd`.
    pub tsd_off: u32,
    /// glibc: `struct pthread.specific`, the second-level blocks (keys of
    /// 32 and more).
    pub tsd_l2_off: u32,
    /// How far below the thread pointer `struct pthread` starts, which
    /// the offsets above count from: 0 on x86-64, whose thread pointer is
    /// the `pthread_t`; `sizeof(struct pthread)` on arm64.
    pub pthread_below_tp: u32,
    /// `tstate->frame` (3.8 to 3.10), `tstate->cframe` (3.11, 3.12) or
    /// `tstate->current_frame` (3.13).
    pub ts_frame: u16,
    /// `_PyCFrame.current_frame`, with [`PY_CFRAME`].
    pub cframe_cur: u8,
    /// The frame's code object (`f_code`, `f_executable`).
    pub f_code: u8,
    /// The calling frame (`f_back`, `previous`).
    pub f_back: u8,
    /// `f_lasti` (int), or `prev_instr`/`instr_ptr` (pointer).
    pub f_instr: u8,
    /// `is_entry`, with [`PY_ENTRY_FLAG`].
    pub f_entry: u8,
    /// `owner`, with [`PY_OWNER_SHIM`].
    pub f_owner: u8,
    /// Bytes read of each frame: every field above lies within them, and
    /// no more than the frame itself (a 3.11+ frame may end a page).
    pub read_size: u8,
    pub _pad: u8,
    /// `offsetof(PyCodeObject, co_code_adaptive)` (3.11+): where the
    /// instructions `prev_instr`/`instr_ptr` point into begin.
    pub co_code: u16,
    /// Python frames walked at most.
    pub max_frames: u16,
    /// Where a code object's identity lies ([`py_code_check`]): the span
    /// of it read, from its start, and the identity's fields within the
    /// span: `co_qualname` (`co_name` before 3.11), `co_filename`,
    /// `co_firstlineno`.
    pub co_check: u8,
    pub co_check_size: u8,
    pub co_check_name: u8,
    pub co_check_file: u8,
    pub co_check_line: u8,
    pub _pad2: [u8; 5],
}

/// A code object's check: its name, file and first line, hashed. Taken
/// by BPF when a stack is first stored, after its Python words (one per
/// frame), and compared by user space with the code object it reads at
/// the frame's address: one freed and replaced by another there since is
/// told apart, not named as the other. Never 0, which is a frame whose
/// code object could not be read.
pub const fn py_code_check(name: u64, file: u64, first_line: i32) -> u64 {
    const PRIME: u64 = 0x100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    hash = (hash ^ name).wrapping_mul(PRIME);
    hash = (hash ^ file).wrapping_mul(PRIME);
    hash = (hash ^ first_line as u32 as u64).wrapping_mul(PRIME);
    hash | 1
}

/// The stack word of a Python frame running `code` at instruction `lasti`
/// (2-byte code units; -1 before the first), ending its group or not.
/// An index past what 18 bits hold is clamped: such a frame's line is
/// then that of its last instruction that fits.
pub const fn py_frame_word(code: u64, lasti: i64, group_end: bool) -> u64 {
    let code_bits = (code >> 3) & ((1 << PY_CODE_BITS) - 1);
    let after = lasti.saturating_add(1);
    let index = if after < 0 {
        0
    } else if after as u64 > PY_LASTI_MASK {
        PY_LASTI_MASK
    } else {
        after as u64
    };
    PY_FRAME | if group_end { PY_GROUP_END } else { 0 } | code_bits << PY_CODE_SHIFT | index
}

/// A Python frame's stack word read back: `(code, lasti, group_end)`,
/// `lasti` being -1 for a frame that has not started.
pub const fn py_frame_parts(word: u64) -> (u64, i64, bool) {
    let code = ((word >> PY_CODE_SHIFT) & ((1 << PY_CODE_BITS) - 1)) << 3;
    let lasti = (word & PY_LASTI_MASK) as i64 - 1;
    (code, lasti, word & PY_GROUP_END != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_word_reads_back() {
        let code = 0x7f12_3456_7890;
        for (lasti, end) in [(-1, false), (0, true), (20, false), (0x1fffe, true)] {
            let word = py_frame_word(code, lasti, end);
            assert_eq!(py_frame_parts(word), (code, lasti, end), "{word:#x}");
            assert!(word & PY_FRAME != 0, "marked as a Python frame");
        }
        assert_eq!(py_frame_parts(py_frame_word(code, 1 << 20, false)).1, 0x1fffe, "clamped");
        assert_eq!(py_frame_parts(py_frame_word(code, -5, false)).1, -1, "not started");
        // The highest user-space object address still fits (arm64's).
        let top = (1 << 48) - 16;
        assert_eq!(py_frame_parts(py_frame_word(top, 3, false)).0, top);
    }
}
