//! Stack storage that cannot lose or merge stacks silently, at the cost of
//! hashing only the frames a stack has.
//!
//! A kernel stack-trace map hashes a stack into a bucket: on a collision
//! it either drops the new stack for the rest of the run or overwrites the
//! old one, which misattributes every allocation that pointed at it. Here
//! a stack's 64-bit hash leads to an id (`STACK_IDS`), and the id to the
//! whole stack (STACKS), which every hit is compared with. A stack whose
//! slot holds another stack tries the next slots. The only ways to lose a
//! stack are a full map and `PROBE_SLOTS` collisions in a row, and both are
//! counted.
//!
//! The frames come from a walker in `unwind`; this module only stores
//! them.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::generated::{bpf_get_smp_processor_id, bpf_loop},
    EbpfContext,
};
use memleak_common::{lost_stack_id, Counter, StackKey, StackSlot, WalkEnd, KERNEL_TGID, MAX_STACK_DEPTH};

use crate::{
    counters,
    maps::{LastStack, LAST_STACK, PY_NEW_STACKS, STACKS, STACK_IDS, STACK_ID_COUNTERS, STACK_SCRATCH},
    python,
    scratch::{self, Slot},
    totals::atomic_fetch_add,
    tunables,
    unwind::{self, Walked},
};

/// Slots a stack may take after its own, for hash collisions.
const PROBE_SLOTS: u64 = 4;

/// Returns the id of the current user stack of process `tgid`, storing
/// the stack if it is new, or its process's `lost_stack_id` (counted) if
/// it cannot be stored. Only for return probes: there the registers are
/// the caller's, so its frame is the first.
pub fn current_user_stack_id<C: EbpfContext>(ctx: &C, tgid: u32) -> u64 {
    stack_id(ctx, tgid, true)
}

/// Like `current_user_stack_id`, for the kernel stack (kernel allocations
/// are recorded under tgid 0).
pub fn current_kernel_stack_id<C: EbpfContext>(ctx: &C) -> u64 {
    stack_id(ctx, KERNEL_TGID, false)
}

/// In the scratch slot the caller holds (see `scratch`), found afresh at
/// each use below rather than kept: a slot kept live across the walk
/// more than doubled the instructions the verifier checks.
fn stack_id<C: EbpfContext>(ctx: &C, tgid: u32, user: bool) -> u64 {
    store_current_stack(ctx, tgid, user).unwrap_or_else(|| lost_stack(tgid))
}

/// Process `tgid`'s `lost_stack_id`, for an allocation recorded without
/// its stack, counted.
pub fn lost_stack(tgid: u32) -> u64 {
    counters::increment(tgid, Counter::StacksLost);
    lost_stack_id(tgid)
}

fn store_current_stack<C: EbpfContext>(ctx: &C, tgid: u32, user: bool) -> Option<u64> {
    let key: *mut StackKey = STACK_SCRATCH.get_ptr_mut(scratch::slot()?.key())?;
    // SAFETY: this thread's scratch slot, which nothing else uses until
    // it is released; the maps copy it before returning.
    let key: &mut StackKey = unsafe { &mut *key };
    key.tgid = tgid;
    // Python first, leaving at least one native frame: see `python`.
    // Each Python frame takes two slots: its word, and its code object's
    // check if the stack is new.
    let python = if user { python::walk(tgid, tunables::stack_depth() - 1, scratch::slot()?) } else { 0 };
    // SAFETY: a field of the scratch key. Through memory, like the depth
    // below: the walk's many ways to end would each have the native walk
    // checked again, past the verifier's budget.
    let python = unsafe {
        core::ptr::write_volatile(&raw mut key.python_depth, python);
        core::ptr::read_volatile(&raw const key.python_depth)
    };
    let walked = if user {
        unwind::user_stack(ctx, tgid, key, 2 * python, scratch::slot()?)
    } else {
        Walked {
            depth: unwind::kernel_stack(ctx, &mut key.frames)?,
            end: WalkEnd::Root as u32,
            cached: false,
            unchanged: false,
        }
    };
    key.end = walked.end;
    let depth = walked.depth;
    // SAFETY: a field of the scratch key. Volatile, so that the depth is
    // read back from the map, where the verifier knows only its bounds:
    // otherwise it checks all that follows once per way the walk can end,
    // which made loading take seconds.
    unsafe { core::ptr::write_volatile(&raw mut key.depth, depth) };
    let python = python::append(key, depth_of(key) as u32, python, scratch::slot()?);
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(&raw mut key.python_depth, python) };
    if walked.unchanged {
        // Still stored: a stack is forgotten only with its process, and
        // the walk cache takes no process whose pid an exited one had
        // (table generations are unique across processes).
        if let Some(id) = unwind::last_stack_id(scratch::slot()?) {
            return Some(id);
        }
        unwind::copy_last_walk(key, scratch::slot()?);
    }
    let id = stored_id(key, scratch::slot()?);
    if walked.cached {
        unwind::remember_stack_id(id.filter(|_| python == 0), scratch::slot()?);
    }
    id
}

/// The id of stack `key`: this CPU's last stack's, or the id it is stored
/// under (stored now if new).
fn stored_id(key: &mut StackKey, slot: Slot) -> Option<u64> {
    let last = LAST_STACK.get_ptr_mut(slot.key())?;
    // SAFETY: this CPU's slot, like the scratch key.
    let last: &mut LastStack = unsafe { &mut *last };
    if last.known != 0 && same_stack(&last.key, key) {
        return Some(last.id);
    }
    let id = find_or_insert(key, slot)?;
    remember(last, key, id);
    Some(id)
}

/// The id of stack `key`, stored under a new id if it is new.
fn find_or_insert(key: &mut StackKey, scratch: Slot) -> Option<u64> {
    let (tgid, hash) = (key.tgid, hash_of(key));
    for slot in 0..PROBE_SLOTS {
        let slot = StackSlot { tgid, _padding: 0, hash: hash.wrapping_add(slot) };
        match STACK_IDS.get_ptr(slot) {
            // SAFETY: the value of a live entry; ids are never rewritten.
            Some(id) => {
                if let Some(id) = holding(unsafe { *id }, key) {
                    return Some(id);
                }
                // Another stack holds the slot: try the next.
            }
            None => match insert(&slot, key, scratch) {
                Inserted::Stored(id) => return Some(id),
                Inserted::Full => return None,
                // Another CPU filled the slot first, maybe with this stack.
                Inserted::Raced => {
                    // SAFETY: as above.
                    let id = STACK_IDS.get_ptr(slot).map(|id| unsafe { *id })?;
                    if let Some(id) = holding(id, key) {
                        return Some(id);
                    }
                }
            },
        }
    }
    None
}

/// Makes `key`, stored as `id`, this CPU's last stack.
fn remember(last: &mut LastStack, key: &StackKey, id: u64) {
    last.key.tgid = key.tgid;
    last.key.depth = depth_of(key) as u32;
    last.key.python_depth = python_depth_of(key) as u32;
    last.key.end = key.end;
    let mut pass = FramePass::new(key, &raw mut last.key);
    pass.run(frames_of(key), copy_step);
    last.id = id;
    last.known = 1;
}

/// `Some(id)` if stack `id` is `key`.
fn holding(id: u64, key: &StackKey) -> Option<u64> {
    let stored = STACKS.get_ptr(id)?;
    // SAFETY: the value of a live entry, written once before its id was
    // published in STACK_IDS.
    same_stack(unsafe { &*stored }, key).then_some(id)
}

enum Inserted {
    Stored(u64),
    Full,
    Raced,
}

/// Stores `key` under a fresh id, then publishes the id in `slot`.
fn insert(slot: &StackSlot, key: &mut StackKey, scratch: Slot) -> Inserted {
    let Some(id) = new_stack_id() else { return Inserted::Full };
    python::check_frames(key, depth_of(key) as u32, python_depth_of(key) as u32, scratch);
    // By reference: a copy would not fit the BPF stack.
    let stored: &StackKey = key;
    if STACKS.insert(id, stored, u64::from(BPF_NOEXIST)).is_err() {
        return Inserted::Full;
    }
    if STACK_IDS.insert(slot, id, u64::from(BPF_NOEXIST)).is_ok() {
        if python_depth_of(key) != 0 {
            announce_python_stack(id);
        }
        return Inserted::Stored(id);
    }
    let _ = STACKS.remove(id);
    // A full STACK_IDS also fails the insert; the retry then finds the
    // slot empty and gives up.
    if STACK_IDS.get_ptr(slot).is_some() {
        Inserted::Raced
    } else {
        Inserted::Full
    }
}

/// Tells user space of a new stack with Python frames: the code objects
/// they ran may be freed before the next report reads the stacks. An id
/// the full ring loses is resolved at that report.
fn announce_python_stack(id: u64) {
    let _ = PY_NEW_STACKS.output::<u64>(&id, 0);
}

/// FNV-1a over the process and the frames in use.
fn hash_of(key: &StackKey) -> u64 {
    let mut pass = FramePass::new(key, core::ptr::null_mut());
    pass.hash = (pass.hash ^ u64::from(key.tgid)).wrapping_mul(FNV_PRIME);
    pass.run(frames_of(key), hash_step);
    pass.hash
}

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x100_0000_01b3;

/// `key.depth`, read from memory (see `store_current_stack`).
fn depth_of(key: &StackKey) -> usize {
    // SAFETY: a field of a live key.
    unsafe { core::ptr::read_volatile(&raw const key.depth) as usize }
}

/// `key.python_depth`, read from memory like `depth_of`.
fn python_depth_of(key: &StackKey) -> usize {
    // SAFETY: a field of a live key.
    unsafe { core::ptr::read_volatile(&raw const key.python_depth) as usize }
}

/// The frames in use, native then Python.
fn frames_of(key: &StackKey) -> usize {
    depth_of(key) + python_depth_of(key)
}

fn same_stack(a: &StackKey, b: &StackKey) -> bool {
    if a.tgid != b.tgid || depth_of(a) != depth_of(b) || python_depth_of(a) != python_depth_of(b) {
        return false;
    }
    let mut pass = FramePass::new(a, core::ptr::from_ref(b).cast_mut());
    pass.run(frames_of(a), compare_step);
    pass.differs == 0
}

/// A pass over a stack's frames, one `bpf_loop` iteration per frame: the
/// verifier checks an iteration once, where it checked a loop of 127
/// bounded iterations whole at every call site (123,000 instructions
/// processed, most of 170 ms of loading).
#[repr(C)]
struct FramePass {
    frames: *const StackKey,
    /// The stack compared with, or copied to.
    other: *mut StackKey,
    hash: u64,
    differs: u64,
}

type FrameStep = extern "C" fn(u64, *mut c_void) -> i64;

impl FramePass {
    fn new(frames: &StackKey, other: *mut StackKey) -> Self {
        // The hash starts at FNV's offset basis, which `hash_of` goes on
        // from, not 0: zero fields side by side are cleared by a call to
        // a memset that writes a byte per iteration.
        Self { frames, other, hash: FNV_OFFSET_BASIS, differs: 0 }
    }

    /// Calls `step` for frames `0..depth`, until it returns 1.
    fn run(&mut self, depth: usize, step: FrameStep) {
        let count = depth.min(MAX_STACK_DEPTH) as u32;
        // SAFETY: the helper calls `step` at most `count` times with a
        // pointer to this pass, which outlives the call.
        unsafe { bpf_loop(count, step as *mut c_void, core::ptr::from_mut(self).cast(), 0) };
    }

    /// Frame `index` of the stack, and of the other one.
    fn frames(&self, index: u64) -> Option<(u64, *mut u64)> {
        let index = usize::try_from(index).ok()?;
        // SAFETY: both point at live stack keys for the pass's lifetime.
        let frame = *unsafe { &*self.frames }.frames.get(index)?;
        if self.other.is_null() {
            return Some((frame, core::ptr::null_mut()));
        }
        // SAFETY: as above.
        let other = unsafe { &mut *self.other }.frames.get_mut(index)?;
        Some((frame, other))
    }
}

fn pass_of<'a>(ctx: *mut c_void) -> &'a mut FramePass {
    // SAFETY: `FramePass::run` passes its own pass.
    unsafe { &mut *ctx.cast::<FramePass>() }
}

extern "C" fn hash_step(index: u64, ctx: *mut c_void) -> i64 {
    let pass = pass_of(ctx);
    let Some((frame, _)) = pass.frames(index) else { return 1 };
    pass.hash = (pass.hash ^ frame).wrapping_mul(FNV_PRIME);
    0
}

extern "C" fn compare_step(index: u64, ctx: *mut c_void) -> i64 {
    let pass = pass_of(ctx);
    // SAFETY: `frames` gives a pointer into the other live key.
    if pass.frames(index).is_some_and(|(frame, other)| frame == unsafe { *other }) {
        0
    } else {
        pass.differs = 1;
        1
    }
}

extern "C" fn copy_step(index: u64, ctx: *mut c_void) -> i64 {
    let Some((frame, other)) = pass_of(ctx).frames(index) else { return 1 };
    // SAFETY: as in `compare_step`.
    unsafe { *other = frame };
    0
}

/// A fresh id, unique across CPUs without contention: the CPU number in
/// the low 16 bits, that CPU's own running count above them (taken
/// atomically: walks in the CPU's other scratch slots take them too).
fn new_stack_id() -> Option<u64> {
    let count = STACK_ID_COUNTERS.get_ptr_mut(0)?;
    // SAFETY: this CPU's count, 8-byte aligned map memory; BPF programs do
    // not migrate mid-run.
    let local = unsafe { atomic_fetch_add(count, 1) };
    // SAFETY: a helper without arguments.
    let cpu = u64::from(unsafe { bpf_get_smp_processor_id() });
    Some((local << 16) | (cpu & 0xffff))
}
