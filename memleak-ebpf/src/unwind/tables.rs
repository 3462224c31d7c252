//! The user stack, walked with the unwind tables user space reduced each
//! object's `.eh_frame` to: full stacks through code built without frame
//! pointers.
//!
//! One frame per iteration of a loop (see `loops`): find the executable mapping of the
//! pc, then its object's row for the pc, then apply the row's rule to find
//! the caller's stack pointer (the CFA), return address and frame pointer.
//! Code without rows (JIT code, objects without unwind information) gets
//! a frame-pointer step, kept only if it lands in known code: a junk frame
//! would split one call path into many stacks.
//!
//! At each frame, the frames above it may be taken from the last walk of
//! the thread instead: see `reuse`.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_probe_read_user,
        generated::{bpf_ktime_get_ns, bpf_probe_read_user as bpf_probe_read_user_raw},
    },
    EbpfContext,
};
use memleak_common::{
    ExecMapping, ProcessMappings, Rule, RuleCacheEntry, RuleKind, StackKey, WalkEnd, MAX_EXEC_MAPPINGS,
    MAX_STACK_DEPTH, RULE_CACHE_ENTRIES,
};

use super::{
    reuse::{self, SLOT_SIGNAL},
    Walked,
};
use crate::{
    calls,
    checked::{non_null, opaque},
    loops,
    maps::{Frame, SearchBounds, WalkState, RULE_CACHE, UNWIND_RESCANS, UNWIND_ROWS, WALK_STATE},
    scratch::Slot,
};

/// Binary search steps: enough for 2^10 mappings and 2^21 rows per object.
const MAPPING_SEARCH_STEPS: u32 = 10;
const ROW_SEARCH_STEPS: u32 = 21;

/// Words read at once just below a CFA: the return address and, for all
/// but the largest frames, the saved rbp.
const WORDS_BELOW_CFA: u32 = 8;

/// Where the signal frame keeps the interrupted registers, from the stack
/// pointer `__restore_rt` would run with: `struct ucontext` (its
/// `uc_mcontext` at 40), whose `sigcontext` holds rbp at 80, rsp at 120
/// and rip at 128.
const SIGNAL_RBP: u64 = 40 + 80;
const SIGNAL_RSP: u64 = 40 + 120;
const SIGNAL_RIP: u64 = 40 + 128;

/// What each iteration is handed on the BPF stack: the pointers, which
/// map memory cannot hold. The rest of the walk's state is `WalkState`,
/// in map memory, where the verifier knows no value: there each frame
/// walked is not a state of its own to check, and the BPF stack keeps
/// room for `reuse`'s loop inside a step. Even the frames taken so far are
/// counted there, in the key's `depth`: counted on the stack, each depth
/// was a state of its own, and the verifier checked an iteration (with
/// the searches inside it) once per depth, most of memleak's start-up.
#[repr(C)]
struct Walking {
    mappings: *const ProcessMappings,
    key: *mut StackKey,
    /// The walk's state, in its scratch slot.
    state: *mut WalkState,
}

/// Walks the user stack of process `tgid` from the registers of a return
/// probe (there they are the caller's, so its frame is the first). With
/// `python_frames` (walked before), the key's frames are always filled;
/// without, a stack found unchanged leaves them to `copy_last_walk`.
#[cfg(not(feature = "legacy-kernels"))]
pub fn walk<C: EbpfContext>(
    ctx: &C,
    tgid: u32,
    mappings: *const ProcessMappings,
    key: &mut StackKey,
    limit: u32,
    python_frames: bool,
    scratch: Slot,
) -> Walked {
    let Some(state) = begin(ctx, tgid, mappings, key, limit, python_frames, scratch) else {
        return Walked { depth: 1, end: WalkEnd::BadFrame as u32, cached: false, unchanged: false };
    };
    let mut walking = Walking { mappings, key, state };
    // Each step takes a frame or more, or ends.
    loops::repeat::<_, { MAX_STACK_DEPTH as u32 }>(limit, step, &mut walking);
    finish(walking.key, walking.state)
}

/// Starts the walk: the first frame, and the walk's state in its scratch
/// slot, which it returns.
pub fn begin<C: EbpfContext>(
    ctx: &C,
    tgid: u32,
    mappings: *const ProcessMappings,
    key: &mut StackKey,
    limit: u32,
    python_frames: bool,
    scratch: Slot,
) -> Option<*mut WalkState> {
    let regs = crate::registers::Registers::of(ctx);
    let (ip, sp, bp) = (regs.instruction_pointer(), regs.stack_pointer(), regs.frame_pointer());
    key.frames[0] = ip;
    set_depth(key, 1);
    // SAFETY: a live map value, as in `next_frame`.
    let generation = unsafe { (*mappings).generation };
    reuse::begin(tgid, generation, scratch);
    let state = WALK_STATE.get_ptr_mut(scratch.key())?;
    // SAFETY: this CPU's value, which only this program run touches now.
    let walk = unsafe { &mut *state };
    *walk = WalkState {
        pc: ip,
        sp,
        bp,
        tgid,
        exact_pc: 0,
        end: WalkEnd::DepthLimit as u32,
        limit,
        python_frames: u32::from(python_frames),
        copy_pending: 0,
        // No mapping found yet: an empty range, and not zeros, which
        // beside `copy_pending` would be cleared by a call to a memset
        // that writes a byte per iteration.
        code_start: u64::MAX,
        code_end: 0,
        scratch: scratch.key(),
        by_tables: 1,
        ended: 0,
        _padding: 0,
        below_cfa: core::mem::MaybeUninit::uninit(),
        search: SearchBounds { low: 0, high: 0, found: 0, _padding: 0 },
    };
    reuse::note(0, &Frame { pc: ip, sp, bp, slot: 0 }, scratch);
    Some(state)
}

/// Takes up to `FRAMES` more frames of the walk under way in scratch
/// `slot` (see `begin`), for kernels where each program run takes a few
/// (see `probes::recorder`): whether the walk has ended.
#[cfg(feature = "legacy-kernels")]
pub fn walk_on<const FRAMES: u32>(slot: Slot) -> bool {
    use crate::maps::{PROCESS_MAPPINGS, STACK_SCRATCH};
    let Some(state) = WALK_STATE.get_ptr_mut(slot.key()) else { return true };
    // SAFETY: the slot's state, which only this program run touches now.
    let walk = unsafe { &mut *state };
    let Some(key) = STACK_SCRATCH.get_ptr_mut(slot.key()) else { return true };
    // Looked up again: a process's table may be replaced between two
    // runs, but never freed under one.
    let Some(mappings) = PROCESS_MAPPINGS.get_ptr(walk.tgid) else {
        walk.end = WalkEnd::UnknownCode as u32;
        return true;
    };
    let mut walking = Walking { mappings, key, state };
    loops::repeat::<_, FRAMES>(FRAMES, step, &mut walking);
    // SAFETY: as above.
    unsafe { (*state).ended != 0 }
}

/// Ends the walk whose state is at `state`: what it found.
pub fn finish(key: *mut StackKey, state: *mut WalkState) -> Walked {
    // SAFETY: the slot's state, which only this program run touches now.
    let (end, copy_pending) = unsafe { ((*state).end, (*state).copy_pending != 0) };
    // SAFETY: as above. From memory, like each step's (see `WalkState`).
    let scratch = Slot::from_key(unsafe { (*state).scratch });
    // SAFETY: the slot's key, alive for this program run.
    let depth = depth(unsafe { &*key });
    let mut unchanged = false;
    if reuse::ENABLED && copy_pending {
        unchanged = reuse::ended_as_last(depth, end, scratch);
        if !unchanged {
            reuse::copy_checked(key, scratch);
        }
    }
    reuse::end(depth, end, unchanged, scratch);
    Walked { depth, end, cached: true, unchanged }
}

/// If the frame the walk stands at, its frame `index`, is one of the last
/// walk's, takes the frames above it from there where they still hold:
/// the walk then stands at the last one taken. Their copy into the key
/// waits when the stack may be the last one whole (`copy_pending`): its
/// id is known, unless the walk ends otherwise.
#[expect(clippy::inline_always, reason = "a call of its own would not fit the BPF stack beside the step's")]
#[inline(always)]
fn take_unchanged(walk: &mut WalkState, walking: &Walking, index: u32) {
    if !reuse::ENABLED {
        return;
    }
    let slot = if walk.exact_pc != 0 { SLOT_SIGNAL } else { 0 };
    let scratch = Slot::from_key(walk.scratch);
    if !reuse::matches(index, &Frame { pc: walk.pc, sp: walk.sp, bp: walk.bp, slot }, scratch) {
        return;
    }
    // None: no frame held, so none to copy either.
    let Some(taken) = reuse::check_unchanged(walk.limit, scratch) else { return };
    // SAFETY: the scratch key, valid for this program run.
    set_depth(unsafe { &mut *walking.key }, taken.depth);
    walk.pc = taken.frame.pc;
    walk.sp = taken.frame.sp;
    walk.bp = taken.frame.bp;
    walk.exact_pc = 0;
    if walk.python_frames == 0 && reuse::whole_last_walk_checked(scratch) {
        walk.copy_pending = 1;
    } else {
        reuse::copy_checked(walking.key, scratch);
    }
}

/// The frames the walk has taken, as the key counts them.
fn depth(key: &StackKey) -> u32 {
    // SAFETY: a field of a live key; volatile, for the verifier to read
    // it from memory (see `Walking`).
    unsafe { core::ptr::read_volatile(&raw const key.depth) }
}

fn set_depth(key: &mut StackKey, depth: u32) {
    // SAFETY: as in `depth`.
    unsafe { core::ptr::write_volatile(&raw mut key.depth, depth) };
}

/// One iteration: one frame more, or the end (returns 1).
#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `walk` passed this pointer to its own `Walking`.
    let walking = unsafe { &*ctx.cast::<Walking>() };
    // SAFETY: the walk's state, in the scratch slot this program run
    // holds.
    let walk = unsafe { &mut *walking.state };
    if next_frame(walk, walking).is_some() {
        return 0;
    }
    walk.ended = 1;
    1
}

/// Steps from the frame at `walk.pc` to its caller and records the
/// caller's return address; `None` when the walk ends, `walk.end` saying
/// why.
fn next_frame(walk: &mut WalkState, walking: &Walking) -> Option<()> {
    // SAFETY: the scratch key, valid for this program run.
    let key = unsafe { &mut *walking.key };
    take_unchanged(walk, walking, depth(key).saturating_sub(1));
    let taken = depth(key);
    if taken >= walk.limit || taken as usize >= MAX_STACK_DEPTH {
        walk.end = WalkEnd::DepthLimit as u32;
        return None;
    }
    // A return address points past its call: the call is the byte before.
    let pc = if walk.exact_pc != 0 { walk.pc } else { walk.pc - 1 };
    // SAFETY: a live map value, replaced whole and never freed under a
    // running program.
    let mappings = unsafe { &*walking.mappings };
    let rule = rule_at(walk, mappings, pc)?;
    let caller = match RuleKind::try_from(rule.kind()) {
        Ok(RuleKind::CfaRsp | RuleKind::CfaRbp | RuleKind::CfaRspReturnSlot) => cfa_step(walk, rule)?,
        Ok(RuleKind::Stop) => return end(walk, WalkEnd::Root),
        Ok(RuleKind::Signal) => signal_step(walk)?,
        Ok(RuleKind::FramePointer | RuleKind::Unsupported | RuleKind::GoStackSwitch) | Err(_) => {
            // Back from the system stack to a goroutine's, the frame
            // pointer may lie anywhere, below the stack pointer or above.
            let switching = rule.kind() == RuleKind::GoStackSwitch as u32;
            let caller = frame_pointer_step(walk, if switching { 0 } else { walk.sp })?;
            // No unwind information vouches for it: only a frame in code
            // the process maps is kept.
            if !in_known_code(walk, mappings, caller.pc.wrapping_sub(1)) {
                return end(walk, WalkEnd::NoUnwindInfo);
            }
            caller
        }
    };
    if caller.pc == 0 {
        return end(walk, WalkEnd::Root);
    }
    // Inside an allocator call whose return probe hijacked its return.
    let caller = Caller { pc: calls::real_return_address(caller.pc), ..caller };
    let Some(frame) = key.frames.get_mut(taken as usize) else { return end(walk, WalkEnd::DepthLimit) };
    *frame = caller.pc;
    set_depth(key, taken + 1);
    walk.pc = caller.pc;
    walk.sp = caller.sp;
    walk.bp = caller.bp;
    walk.exact_pc = u32::from(caller.slot == SLOT_SIGNAL);
    let frame = Frame { pc: caller.pc, sp: caller.sp, bp: caller.bp, slot: caller.slot };
    reuse::note(taken, &frame, Slot::from_key(walk.scratch));
    Some(())
}

/// The rule for the code at `pc`: from this CPU's cache, else from the
/// mapping's rows (then cached). `None` when `pc` is in no known mapping:
/// the walk ends, and a rescan is asked for.
fn rule_at(walk: &mut WalkState, mappings: &ProcessMappings, pc: u64) -> Option<Rule> {
    let owner = u64::from(walk.tgid) << 32 | u64::from(mappings.generation);
    let slot = non_null(RULE_CACHE.get_ptr_mut(Slot::from_key(walk.scratch).key())).map(|cache| {
        let index = (pc ^ (pc >> 12)) as usize & (RULE_CACHE_ENTRIES - 1);
        // SAFETY: this CPU's cache; an index masked into its bounds.
        unsafe { &mut (*cache)[index] }
    });
    if let Some(entry) = slot.as_deref().filter(|entry| entry.pc == pc && entry.owner == owner) {
        return Some(entry.rule);
    }
    let Some(mapping) = find_mapping(walk, mappings, pc) else {
        request_rescan(walk.tgid);
        end(walk, WalkEnd::UnknownCode);
        return None;
    };
    (walk.code_start, walk.code_end) = (mapping.start, mapping.end);
    let rule = if mapping.row_count == 0 {
        Rule::of(RuleKind::FramePointer)
    } else {
        find_rule(walk, mapping, pc.wrapping_sub(mapping.bias))
    };
    if let Some(entry) = slot {
        *entry = RuleCacheEntry { pc, owner, rule, _padding: 0 };
    }
    Some(rule)
}

fn end(walk: &mut WalkState, reason: WalkEnd) -> Option<()> {
    walk.end = reason as u32;
    None
}

/// The caller's registers, as one step found them, and where its rbp
/// came from (a `Frame` slot).
struct Caller {
    pc: u64,
    sp: u64,
    bp: u64,
    slot: u64,
}

/// Where a rule says a frame's caller saved its return address and its
/// frame pointer: slots below the CFA (at CFA - 8 × slot), the frame
/// pointer's 0 when it is left unchanged.
struct SavedSlots {
    return_address: u32,
    frame_pointer: u32,
}

/// x86-64: the call pushed the return address just below the CFA.
#[cfg(not(bpf_target_arch = "aarch64"))]
fn saved_slots(rule: Rule) -> SavedSlots {
    SavedSlots { return_address: 1, frame_pointer: rule.rbp_slot() }
}

/// arm64: the callee saved the link register, in its frame record just
/// above x29, or alone (see `RuleKind`).
#[cfg(bpf_target_arch = "aarch64")]
fn saved_slots(rule: Rule) -> SavedSlots {
    if rule.kind() == RuleKind::CfaRspReturnSlot as u32 {
        SavedSlots { return_address: rule.rbp_slot(), frame_pointer: 0 }
    } else {
        SavedSlots { return_address: rule.rbp_slot().saturating_sub(1), frame_pointer: rule.rbp_slot() }
    }
}

/// A step by a CFA rule: the caller's stack pointer is the CFA, its
/// return address and rbp where the rule says they were saved.
fn cfa_step(walk: &mut WalkState, rule: Rule) -> Option<Caller> {
    let base = if rule.kind() == RuleKind::CfaRbp as u32 { walk.bp } else { walk.sp };
    let cfa = base.wrapping_add(u64::from(rule.cfa_offset()));
    let SavedSlots { return_address: pc_slot, frame_pointer: slot } = saved_slots(rule);
    if cfa <= walk.sp || pc_slot == 0 {
        end(walk, WalkEnd::BadFrame);
        return None;
    }
    // One read for the return address and a saved rbp, which sit just
    // below the CFA in all but huge frames: each read is a helper call.
    let words = (&raw mut walk.below_cfa).cast::<[u64; WORDS_BELOW_CFA as usize]>();
    // SAFETY: a fault-safe read of user memory into the walk's own words,
    // map memory as large as the read.
    let status = unsafe {
        bpf_probe_read_user_raw(
            words.cast(),
            8 * WORDS_BELOW_CFA,
            (cfa - 8 * u64::from(WORDS_BELOW_CFA)) as *const c_void,
        )
    };
    let (pc, bp) = if status == 0 && slot < WORDS_BELOW_CFA && pc_slot < WORDS_BELOW_CFA {
        // SAFETY: the words the read above has just filled.
        let words = unsafe { &*words };
        let index = opaque(u64::from(WORDS_BELOW_CFA - slot)) as usize & (WORDS_BELOW_CFA as usize - 1);
        let bp = if slot == 0 { walk.bp } else { words[index] };
        // On x86-64 the word just below the CFA, a constant.
        let pc_index = if cfg!(bpf_target_arch = "aarch64") {
            opaque(u64::from(WORDS_BELOW_CFA - pc_slot)) as usize & (WORDS_BELOW_CFA as usize - 1)
        } else {
            WORDS_BELOW_CFA as usize - 1
        };
        (words[pc_index], bp)
    } else {
        // Near the stack's end, or saved further down: word by word.
        let Some(pc) = read(cfa.wrapping_sub(8 * u64::from(pc_slot))) else {
            end(walk, WalkEnd::BadFrame);
            return None;
        };
        let bp = if slot == 0 { walk.bp } else { read(cfa.wrapping_sub(8 * u64::from(slot))).unwrap_or(0) };
        (pc, bp)
    };
    Some(Caller { pc: super::code_address(pc), sp: cfa, bp, slot: Frame::slot_of(slot) })
}

/// A step through a signal frame: the interrupted code's registers.
fn signal_step(walk: &mut WalkState) -> Option<Caller> {
    let sp = walk.sp;
    let registers = (read(sp + SIGNAL_RIP), read(sp + SIGNAL_RSP), read(sp + SIGNAL_RBP));
    let (Some(pc), Some(caller_sp), Some(bp)) = registers else {
        end(walk, WalkEnd::BadFrame);
        return None;
    };
    // The one place the stack pointer may move down: the handler may run
    // on an alternate stack.
    Some(Caller { pc, sp: caller_sp, bp, slot: SLOT_SIGNAL })
}

/// A step through the frame pointer: the saved rbp, then the return
/// address, at rbp, which must not lie below `lowest` (the stack pointer,
/// but for a step to another stack).
fn frame_pointer_step(walk: &mut WalkState, lowest: u64) -> Option<Caller> {
    let bp = walk.bp;
    if bp == 0 {
        end(walk, WalkEnd::Root);
        return None;
    }
    if !bp.is_multiple_of(8) || bp < lowest {
        end(walk, WalkEnd::NoUnwindInfo);
        return None;
    }
    // SAFETY: a read of user memory, which the helper makes fault-safe.
    let Ok([caller_bp, pc]) = (unsafe { bpf_probe_read_user(bp as *const [u64; 2]) }) else {
        end(walk, WalkEnd::NoUnwindInfo);
        return None;
    };
    // The caller's rbp was the word at its stack pointer - 16.
    Some(Caller { pc: super::code_address(pc), sp: bp + 16, bp: caller_bp, slot: 2 })
}

/// Whether `pc` lies in an executable mapping of the process. Most
/// frame-pointer steps land in the object of the frame before (a JIT's
/// code calling itself, a library without unwind rows): the last mapping
/// found is tried before the search, which took most of such a step.
fn in_known_code(walk: &mut WalkState, mappings: &ProcessMappings, pc: u64) -> bool {
    if (walk.code_start..walk.code_end).contains(&pc) {
        return true;
    }
    let Some(mapping) = find_mapping(walk, mappings, pc) else { return false };
    (walk.code_start, walk.code_end) = (mapping.start, mapping.end);
    true
}

/// The executable mapping holding `pc`.
fn find_mapping<'a>(walk: &mut WalkState, mappings: &'a ProcessMappings, pc: u64) -> Option<&'a ExecMapping> {
    walk.search = SearchBounds { low: 0, high: mappings.count, found: u32::MAX, _padding: 0 };
    let mut search = MappingSearch { mappings, pc, bounds: &raw mut walk.search };
    // A loop of its own, so that the verifier checks one step once rather
    // than every step of the search.
    loops::repeat::<_, MAPPING_SEARCH_STEPS>(MAPPING_SEARCH_STEPS, mapping_step, &mut search);
    mappings.mappings.get(walk.search.found as usize)
}

/// A binary search of a process's mappings, one step per iteration.
#[repr(C)]
struct MappingSearch<'a> {
    mappings: &'a ProcessMappings,
    pc: u64,
    bounds: *mut SearchBounds,
}

#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn mapping_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `find_mapping` passed its own search, whose bounds are in
    // the walk's state.
    let search = unsafe { &*ctx.cast::<MappingSearch>() };
    // SAFETY: as above.
    let bounds = unsafe { &mut *search.bounds };
    if bounds.low >= bounds.high {
        return 1;
    }
    let middle = bounds.low + (bounds.high - bounds.low) / 2;
    let mapping = &search.mappings.mappings[middle as usize & (MAX_EXEC_MAPPINGS - 1)];
    if search.pc < mapping.start {
        bounds.high = middle;
    } else if search.pc >= mapping.end {
        bounds.low = middle + 1;
    } else {
        bounds.found = middle;
        return 1;
    }
    0
}

/// The rule of the last row at or before `relative_pc` in the mapping's
/// object; a frame-pointer step before its first row.
fn find_rule(walk: &mut WalkState, mapping: &ExecMapping, relative_pc: u64) -> Rule {
    let Ok(relative_pc) = u32::try_from(relative_pc) else { return Rule::of(RuleKind::FramePointer) };
    // The first row above the pc, then one back.
    walk.search = SearchBounds { low: 0, high: mapping.row_count, found: 0, _padding: 0 };
    let mut search =
        RowSearch { first_row: mapping.first_row, pc: relative_pc, bounds: &raw mut walk.search };
    loops::repeat::<_, ROW_SEARCH_STEPS>(ROW_SEARCH_STEPS, row_step, &mut search);
    match walk.search.low.checked_sub(1) {
        Some(index) => UNWIND_ROWS
            .get(mapping.first_row.wrapping_add(index))
            .map_or(Rule::of(RuleKind::FramePointer), |row| row.rule),
        None => Rule::of(RuleKind::FramePointer),
    }
}

/// A binary search of an object's rows, one step per iteration.
#[repr(C)]
struct RowSearch {
    first_row: u32,
    pc: u32,
    bounds: *mut SearchBounds,
}

#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn row_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `find_rule` passed its own search, whose bounds are in the
    // walk's state.
    let search = unsafe { &*ctx.cast::<RowSearch>() };
    // SAFETY: as above.
    let bounds = unsafe { &mut *search.bounds };
    if bounds.low >= bounds.high {
        return 1;
    }
    let middle = bounds.low + (bounds.high - bounds.low) / 2;
    match UNWIND_ROWS.get(search.first_row.wrapping_add(middle)) {
        Some(row) if row.pc <= search.pc => bounds.low = middle + 1,
        Some(_) => bounds.high = middle,
        None => {
            bounds.low = 0;
            return 1;
        }
    }
    0
}

/// Asks user space to rescan the process's mappings: its code is in none
/// it knows. One request until user space takes it.
fn request_rescan(tgid: u32) {
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let _ = UNWIND_RESCANS.insert(tgid, now, u64::from(BPF_NOEXIST));
}

/// Eight bytes of user memory.
fn read(address: u64) -> Option<u64> {
    // SAFETY: a read of user memory, which the helper makes fault-safe.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}
