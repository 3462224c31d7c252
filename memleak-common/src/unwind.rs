//! The unwind tables: what user space reduces each object's `.eh_frame`
//! to, and what the BPF walker reads to step from one frame to the next
//! without frame pointers.
//!
//! Every object's rows live in one array ([`UNWIND_ROWS_MAP`]), each object
//! owning a contiguous range of it, shared by every process that maps the
//! object. Each traced process has a table of its executable mappings
//! ([`PROCESS_MAPPINGS_MAP`]), sorted by address, saying which range of
//! rows serves each and how to turn an address into a row's `pc`.
//!
//! [`UNWIND_ROWS_MAP`]: crate::UNWIND_ROWS_MAP
//! [`PROCESS_MAPPINGS_MAP`]: crate::PROCESS_MAPPINGS_MAP

/// How to step from a frame to its caller, for the code from
/// [`UnwindRow::pc`] up to the next row's.
///
/// The kinds are named for x86-64's registers; on arm64 rsp is sp, rbp is
/// the frame pointer x29, and the return address is where the callee
/// saved the link register x30: in the frame record, the slot just above
/// the saved x29 (`stp x29, x30, [sp, #-N]!`), so a rule's `rbp_slot` is
/// at least 2; or, with x29 left alone, in the slot of
/// [`RuleKind::CfaRspReturnSlot`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleKind {
    /// The caller's stack pointer (the CFA) is rsp plus the offset; the
    /// return address is just below it, at CFA - 8 (on arm64: just above
    /// the saved x29).
    CfaRsp = 0,
    /// The CFA is rbp plus the offset; the return address at CFA - 8 (on
    /// arm64: just above the saved x29).
    CfaRbp = 1,
    /// The end of the stack: no caller (`_start`, the child side of
    /// `clone`), the return address being undefined.
    Stop = 2,
    /// A signal trampoline (`__restore_rt`): the interrupted frame's
    /// registers are in the signal frame on the stack.
    Signal = 3,
    /// No unwind information here: one frame-pointer step, trusted only
    /// if it lands in code.
    FramePointer = 4,
    /// A rule the walker does not follow (a DWARF expression, a CFA in
    /// another register, a return address elsewhere): a frame-pointer
    /// step with the same checks.
    Unsupported = 5,
    /// Go's `runtime.asmcgocall`, where a cgo call left the goroutine's
    /// stack to run C on the system stack: rbp still holds the frame
    /// pointer of its Go caller, on the goroutine's stack, where Go's
    /// frame pointers lead on. One frame-pointer step that may move to
    /// another stack, trusted only if it lands in code.
    GoStackSwitch = 6,
    /// arm64 only: the CFA is sp plus the offset, the return address
    /// saved at CFA - 8 × the rule's `rbp_slot`, and x29 unchanged (a
    /// function that saves x30 alone, `str x30, [sp, #-16]!`).
    CfaRspReturnSlot = 7,
}

impl TryFrom<u32> for RuleKind {
    type Error = u32;

    fn try_from(raw: u32) -> Result<Self, u32> {
        match raw {
            0 => Ok(RuleKind::CfaRsp),
            1 => Ok(RuleKind::CfaRbp),
            2 => Ok(RuleKind::Stop),
            3 => Ok(RuleKind::Signal),
            4 => Ok(RuleKind::FramePointer),
            5 => Ok(RuleKind::Unsupported),
            6 => Ok(RuleKind::GoStackSwitch),
            7 => Ok(RuleKind::CfaRspReturnSlot),
            _ => Err(raw),
        }
    }
}

/// A packed rule: `kind << 28 | rbp_slot << 20 | cfa_offset / 8`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule(pub u32);

impl Rule {
    /// CFA offsets are multiples of 8 and below 8 MiB: redis has a 1 MiB
    /// frame, 16 bits would not do.
    pub const MAX_CFA_OFFSET: u32 = ((1 << 20) - 1) * 8;
    /// rbp is saved at most this many slots below the CFA.
    pub const MAX_RBP_SLOT: u32 = 0xff;

    /// A rule; `None` if an offset does not fit, for the caller to fall
    /// back to [`RuleKind::Unsupported`].
    pub const fn new(kind: RuleKind, cfa_offset: u32, rbp_slot: u32) -> Option<Self> {
        if !cfa_offset.is_multiple_of(8) || cfa_offset > Self::MAX_CFA_OFFSET || rbp_slot > Self::MAX_RBP_SLOT
        {
            return None;
        }
        Some(Self((kind as u32) << 28 | rbp_slot << 20 | (cfa_offset / 8)))
    }

    /// A rule of a kind that takes no offsets.
    pub const fn of(kind: RuleKind) -> Self {
        Self((kind as u32) << 28)
    }

    /// The raw kind; see [`RuleKind::try_from`].
    pub const fn kind(self) -> u32 {
        self.0 >> 28
    }

    /// Bytes from rsp (or rbp) to the CFA.
    pub const fn cfa_offset(self) -> u32 {
        (self.0 & 0xf_ffff) * 8
    }

    /// 0 if rbp is unchanged in this frame; n if the caller's rbp is saved
    /// at CFA - 8n.
    pub const fn rbp_slot(self) -> u32 {
        (self.0 >> 20) & 0xff
    }
}

/// One row of an object's unwind table, the value of
/// [`UNWIND_ROWS_MAP`](crate::UNWIND_ROWS_MAP).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindRow {
    /// The first instruction the row covers, as an offset from the
    /// object's lowest executable address, so that every object fits 32
    /// bits. Rows are sorted by it; a row lasts until the next.
    pub pc: u32,
    pub rule: Rule,
}

/// One executable mapping of a traced process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecMapping {
    /// Addresses `[start, end)` in the process.
    pub start: u64,
    pub end: u64,
    /// Subtracted from an address in the mapping, gives a row's `pc`.
    pub bias: u64,
    /// The object's rows: `row_count` of them from `first_row` in
    /// [`UNWIND_ROWS_MAP`](crate::UNWIND_ROWS_MAP). No rows (JIT code, an
    /// object without unwind information, a full table): frame-pointer
    /// steps.
    pub first_row: u32,
    pub row_count: u32,
}

/// Executable mappings a process may have in its table. More are left
/// out (and their code unwinds as unknown): a Debian python3 with its
/// extension modules loaded maps about 40 objects.
pub const MAX_EXEC_MAPPINGS: usize = 512;

/// The value of [`PROCESS_MAPPINGS_MAP`](crate::PROCESS_MAPPINGS_MAP): a
/// traced process's executable mappings, sorted by `start`, replaced whole
/// when they change, so that a walker sees the old table or the new one,
/// never a mix.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessMappings {
    /// Mappings in use, at most [`MAX_EXEC_MAPPINGS`].
    pub count: u32,
    /// New with every new table of any process, so that the walkers'
    /// caches (of rules by pc, [`RuleCacheEntry`], and of the last walk)
    /// never serve a rule of code since unmapped, nor a stack of an exited
    /// process whose pid a new one took.
    pub generation: u32,
    pub mappings: [ExecMapping; MAX_EXEC_MAPPINGS],
}

/// One entry of the walkers' per-CPU cache of rules by pc: a loop that
/// allocates from one place walks the same frames each time, and finds
/// their rules here without searching the mappings and rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCacheEntry {
    /// The pc looked up (a return address minus one, or an exact pc).
    pub pc: u64,
    /// Whose table the rule came from: process id << 32 | generation.
    pub owner: u64,
    pub rule: Rule,
    pub _padding: u32,
}

/// Entries in each CPU's cache of rules, a power of two.
pub const RULE_CACHE_ENTRIES: usize = 1024;

/// Each CPU's counts of its table walks, the value of
/// [`WALK_COUNTS_MAP`](crate::WALK_COUNTS_MAP), indexed by
/// [`WalkCount`]; user space sums the CPUs.
pub type WalkCounts = [u64; WalkCount::ALL.len()];

/// The slots of [`WalkCounts`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkCount {
    /// User stacks walked with unwind tables.
    Walks = 0,
    /// Of those, the walks that took frames unchanged from the last walk
    /// of their thread.
    ReusingWalks = 1,
    /// Frames of all the walks.
    Frames = 2,
    /// Of those, the frames taken unchanged, each checked on the stack.
    FramesReused = 3,
    /// Stacks not walked because a run preempted mid-walk on the same CPU
    /// held its memory: recorded under their process's lost stack. In
    /// kernel mode, allocations made in an interrupt during memleak's own
    /// program: left out (see memleak-ebpf's `probes::kernel`).
    CpuBusy = 4,
}

impl WalkCount {
    pub const ALL: [WalkCount; 5] = [
        WalkCount::Walks,
        WalkCount::ReusingWalks,
        WalkCount::Frames,
        WalkCount::FramesReused,
        WalkCount::CpuBusy,
    ];
}

/// How a stack walk ended, kept with the stack in
/// [`StackKey::end`](crate::StackKey).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkEnd {
    /// At the root of the stack: an unwind row said so, or a zero return
    /// address or frame pointer. The stack is whole.
    Root = 0,
    /// `--max-stack-depth` frames were taken.
    DepthLimit = 1,
    /// Code without unwind information whose frame pointer led nowhere
    /// known: the rest is not trusted.
    NoUnwindInfo = 2,
    /// A return address in no mapping memleak knows yet (a library loaded
    /// since the last rescan, which is requested).
    UnknownCode = 3,
    /// The stack could not be read, or a frame did not move up it.
    BadFrame = 4,
    /// Walked through frame pointers alone, before the process's table of
    /// mappings was loaded: where it ends is not known, and frames were
    /// not checked against its code.
    FramePointers = 5,
}

impl TryFrom<u32> for WalkEnd {
    type Error = u32;

    fn try_from(raw: u32) -> Result<Self, u32> {
        match raw {
            0 => Ok(WalkEnd::Root),
            1 => Ok(WalkEnd::DepthLimit),
            2 => Ok(WalkEnd::NoUnwindInfo),
            3 => Ok(WalkEnd::UnknownCode),
            4 => Ok(WalkEnd::BadFrame),
            5 => Ok(WalkEnd::FramePointers),
            _ => Err(raw),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_pack_and_unpack() {
        let rule = Rule::new(RuleKind::CfaRbp, 16, 2).unwrap();
        assert_eq!(
            (RuleKind::try_from(rule.kind()), rule.cfa_offset(), rule.rbp_slot()),
            (Ok(RuleKind::CfaRbp), 16, 2)
        );
        let redis_frame = Rule::new(RuleKind::CfaRsp, 1_048_720, 0).unwrap();
        assert_eq!(redis_frame.cfa_offset(), 1_048_720, "redis's memtest frame fits");
        assert_eq!(Rule::new(RuleKind::CfaRsp, 12, 0), None, "offsets are multiples of 8");
        assert_eq!(Rule::new(RuleKind::CfaRsp, Rule::MAX_CFA_OFFSET + 8, 0), None);
        assert_eq!(Rule::new(RuleKind::CfaRsp, 8, 256), None);
        assert_eq!(RuleKind::try_from(Rule::of(RuleKind::Stop).kind()), Ok(RuleKind::Stop));
        for raw in 0..6 {
            assert_eq!(RuleKind::try_from(raw).map(|kind| kind as u32), Ok(raw));
            assert_eq!(WalkEnd::try_from(raw).map(|end| end as u32), Ok(raw));
        }
        assert_eq!(RuleKind::try_from(6), Ok(RuleKind::GoStackSwitch));
        assert_eq!(RuleKind::try_from(7), Ok(RuleKind::CfaRspReturnSlot));
        assert_eq!(RuleKind::try_from(8), Err(8));
    }
}
