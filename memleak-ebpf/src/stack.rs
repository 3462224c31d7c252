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

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated::bpf_get_smp_processor_id, EbpfContext};
use memleak_common::{lost_stack_id, Counter, StackKey, StackSlot, WalkEnd, KERNEL_TGID, MAX_STACK_DEPTH};

use crate::{
    counters, loops,
    maps::{
        LastStack, StackProbe, LAST_STACK, PY_NEW_STACKS, STACKS, STACK_IDS, STACK_ID_COUNTERS, STACK_PROBES,
        STACK_SCRATCH,
    },
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
#[cfg(not(feature = "legacy-kernels"))]
pub fn current_user_stack_id<C: EbpfContext>(ctx: &C, tgid: u32) -> u64 {
    store_current_stack(ctx, tgid, true).unwrap_or_else(|| lost_stack(tgid))
}

/// Like `current_user_stack_id`, for the kernel stack (kernel allocations
/// are recorded under tgid 0).
#[cfg(not(feature = "legacy-kernels"))]
pub fn current_kernel_stack_id<C: EbpfContext>(ctx: &C) -> u64 {
    store_current_stack(ctx, KERNEL_TGID, false).unwrap_or_else(|| lost_stack(KERNEL_TGID))
}

/// Process `tgid`'s `lost_stack_id`, for an allocation recorded without
/// its stack, counted.
pub fn lost_stack(tgid: u32) -> u64 {
    counters::increment(tgid, Counter::StacksLost);
    lost_stack_id(tgid)
}

/// The scratch slot the caller holds (see `scratch`) is found afresh at
/// each use below rather than kept: a slot kept live across the walk
/// more than doubled the instructions the verifier checks.
#[cfg(not(feature = "legacy-kernels"))]
fn store_current_stack<C: EbpfContext>(ctx: &C, tgid: u32, user: bool) -> Option<u64> {
    let key = scratch_key()?;
    key.tgid = tgid;
    key.python_depth = 0;
    let walked = if user {
        let python = python_first(key, tgid)?;
        unwind::user_stack(ctx, tgid, key, 2 * python, scratch::slot()?)
    } else {
        Walked {
            depth: unwind::kernel_stack(ctx, &mut key.frames)?,
            end: WalkEnd::Root as u32,
            cached: false,
            unchanged: false,
        }
    };
    store_walked(key, &walked)
}

/// The scratch slot's stack key.
fn scratch_key<'a>() -> Option<&'a mut StackKey> {
    let key: *mut StackKey = STACK_SCRATCH.get_ptr_mut(scratch::slot()?.key())?;
    // SAFETY: this thread's scratch slot, which nothing else uses until
    // it is released; the maps copy it before returning.
    Some(unsafe { &mut *key })
}

/// Walks the Python frames, first, leaving at least one native frame (see
/// `python`): how many it found. Each Python frame takes two slots: its
/// word, and its code object's check if the stack is new.
fn python_first(key: &mut StackKey, tgid: u32) -> Option<u32> {
    let python = python::walk(tgid, tunables::stack_depth() - 1, scratch::slot()?);
    // SAFETY: a field of the scratch key. Through memory, like the depth
    // below: the walk's many ways to end would each have the native walk
    // checked again, past the verifier's budget.
    Some(unsafe {
        core::ptr::write_volatile(&raw mut key.python_depth, python);
        core::ptr::read_volatile(&raw const key.python_depth)
    })
}

/// Starts the walk of the current user stack of process `tgid`, on
/// kernels where it goes in stages (see `probes::recorder`): its Python
/// frames, then the first of its native ones. Whether the native walk
/// goes on in `unwind::walk_on`; `None` if it could not start.
#[cfg(feature = "legacy-kernels")]
pub fn begin_user_stack<C: EbpfContext>(ctx: &C, tgid: u32) -> Option<bool> {
    let key = scratch_key()?;
    key.tgid = tgid;
    let python = python_first(key, tgid)?;
    Some(unwind::begin_user_stack(ctx, tgid, key, 2 * python, scratch::slot()?))
}

/// The user stack walked in stages, its Python frames appended.
/// Inlined, as are `walked_kernel_stack` and `completed`: a `Completed`
/// returned through memory had `New`'s undefined id stored from a
/// register the verifier knew unwritten, and refused.
#[cfg(feature = "legacy-kernels")]
#[expect(clippy::inline_always, reason = "a `Completed` through memory: see `walked_user_stack`")]
#[inline(always)]
pub fn walked_user_stack() -> Completed {
    scratch::slot().and_then(unwind::end_user_stack).map_or(Completed::Lost, |walked| completed(&walked))
}

/// Puts the current kernel stack in the scratch key, on kernels where it
/// is stored in a stage of its own (see `probes::kernel`); `None` if it
/// could not.
#[cfg(feature = "legacy-kernels")]
pub fn begin_kernel_stack<C: EbpfContext>(ctx: &C) -> Option<()> {
    let key = scratch_key()?;
    key.tgid = KERNEL_TGID;
    key.python_depth = 0;
    let depth = unwind::kernel_stack(ctx, &mut key.frames)?;
    // SAFETY: a field of the scratch key.
    unsafe { core::ptr::write_volatile(&raw mut key.depth, depth) };
    Some(())
}

/// The kernel stack `begin_kernel_stack` took.
#[cfg(feature = "legacy-kernels")]
#[expect(clippy::inline_always, reason = "a `Completed` through memory: see `walked_user_stack`")]
#[inline(always)]
pub fn walked_kernel_stack() -> Completed {
    let Some(key) = scratch_key() else { return Completed::Lost };
    let depth = depth_of(key) as u32;
    completed(&Walked { depth, end: WalkEnd::Root as u32, cached: false, unchanged: false })
}

/// Completes the stack of a walk that went in stages.
#[cfg(feature = "legacy-kernels")]
#[expect(clippy::inline_always, reason = "a `Completed` through memory: see `walked_user_stack`")]
#[inline(always)]
fn completed(walked: &Walked) -> Completed {
    // Without closures, which are functions of their own in BPF.
    let Some(key) = scratch_key() else { return Completed::Lost };
    if complete(key, walked).is_none() {
        return Completed::Lost;
    }
    let Some(slot) = scratch::slot() else { return Completed::Lost };
    if let Some(id) = last_stack_id(key, slot) {
        return Completed::Last(id);
    }
    let Some(probe) = STACK_PROBES.get_ptr_mut(slot.key()) else { return Completed::Lost };
    let hash = hash_of(key);
    // SAFETY: this CPU's slot, like the scratch key.
    unsafe { *probe = StackProbe { id: 0, outcome: SEARCHING, index: 0, hash } };
    Completed::New
}

/// A stack walked in stages, completed.
#[cfg(feature = "legacy-kernels")]
pub enum Completed {
    /// It is this CPU's last stack, whose id this is.
    Last(u64),
    /// Another: `probe_slot`, in stages of its own, stores it.
    New,
    /// It cannot be stored: its scratch was missing.
    Lost,
}

/// Tries one of the `PROBE_SLOTS` in `STACK_IDS` for the stack a stage
/// `Completed` as new, which makes it this CPU's last stack once stored
/// or found: the main object's `find_or_insert`, one slot a stage, as
/// the verifier of kernels without `bpf_loop` follows every frame of
/// the comparisons each slot makes (4 slots in one program took
/// 750 ms to load here, 22 s under emulation). Inlined, like `completed`.
#[cfg(feature = "legacy-kernels")]
#[expect(clippy::inline_always, reason = "a `Completed` through memory: see `walked_user_stack`")]
#[inline(always)]
pub fn probe_slot() -> Probed {
    let Some(slot) = scratch::slot() else { return Probed::Lost };
    let Some(probe) = STACK_PROBES.get_ptr_mut(slot.key()) else { return Probed::Lost };
    let Some(key) = scratch_key() else { return Probed::Lost };
    // SAFETY: this CPU's slot, like the scratch key.
    let (index, hash) = unsafe { ((*probe).index, (*probe).hash) };
    let mut probing = Probing { key, probe, hash, scratch: slot.key() };
    probe_step(u64::from(index), (&raw mut probing).cast());
    // SAFETY: as above.
    let StackProbe { id, outcome, .. } = unsafe { *probe };
    if outcome == FOUND {
        return match remember_as_last(key, slot, id) {
            Some(()) => Probed::Stored(id),
            None => Probed::Lost,
        };
    }
    if outcome == FULL || index + 1 >= PROBE_SLOTS as u32 {
        return Probed::Lost;
    }
    // SAFETY: as above.
    unsafe { (*probe).index = index + 1 };
    Probed::Again
}

/// Where `probe_slot` left the search.
#[cfg(feature = "legacy-kernels")]
pub enum Probed {
    /// The stack is stored under this id.
    Stored(u64),
    /// Another stack holds the slot: the next stage tries the next.
    Again,
    /// The stack cannot be stored: the map is full, or every slot holds
    /// another stack.
    Lost,
}

/// Stores the stack the walk left in `key`, with its Python frames after
/// its native ones: its id.
#[cfg(not(feature = "legacy-kernels"))]
fn store_walked(key: &mut StackKey, walked: &Walked) -> Option<u64> {
    let python = complete(key, walked)?;
    if walked.unchanged {
        // Still stored: a stack is forgotten only with its process, and
        // the walk cache takes no process whose pid an exited one had
        // (table generations are unique across processes).
        if let Some(id) = unwind::last_stack_id(scratch::slot()?) {
            return Some(id);
        }
        unwind::copy_last_walk(key, scratch::slot()?);
    }
    let slot = scratch::slot()?;
    let id = match last_stack_id(key, slot) {
        Some(id) => Some(id),
        None => new_stack_id_of(key, slot),
    };
    if walked.cached {
        unwind::remember_stack_id(id.filter(|_| python == 0), scratch::slot()?);
    }
    id
}

/// Completes the stack the walk left in `key`: how it ended, its depth,
/// and its Python frames after its native ones, whose count it returns.
fn complete(key: &mut StackKey, walked: &Walked) -> Option<u32> {
    key.end = walked.end;
    let depth = walked.depth;
    // SAFETY: a field of the scratch key. Volatile, so that the depth is
    // read back from the map, where the verifier knows only its bounds:
    // otherwise it checks all that follows once per way the walk can end,
    // which made loading take seconds.
    unsafe { core::ptr::write_volatile(&raw mut key.depth, depth) };
    let python = python_depth_of(key) as u32;
    let python = python::append(key, depth_of(key) as u32, python, scratch::slot()?);
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(&raw mut key.python_depth, python) };
    Some(python)
}

/// This CPU's last stack's id, if `key` is that stack.
fn last_stack_id(key: &StackKey, slot: Slot) -> Option<u64> {
    let last = LAST_STACK.get_ptr(slot.key())?;
    // SAFETY: this CPU's slot, like the scratch key.
    let last: &LastStack = unsafe { &*last };
    (last.known != 0 && same_stack(&last.key, key)).then_some(last.id)
}

/// The id stack `key` is stored under (stored now if new), which makes
/// it this CPU's last stack.
#[cfg(not(feature = "legacy-kernels"))]
fn new_stack_id_of(key: &mut StackKey, slot: Slot) -> Option<u64> {
    let id = find_or_insert(key, slot)?;
    remember_as_last(key, slot, id)?;
    Some(id)
}

/// Makes `key`, stored as `id`, this CPU's last stack.
fn remember_as_last(key: &StackKey, slot: Slot, id: u64) -> Option<()> {
    let last = LAST_STACK.get_ptr_mut(slot.key())?;
    // SAFETY: this CPU's slot, like the scratch key.
    remember(unsafe { &mut *last }, key, id);
    Some(())
}

/// The id of stack `key`, stored under a new id if it is new: the first
/// of its `PROBE_SLOTS` in `STACK_IDS` that holds it, or the first free
/// one. A loop with its outcome in map memory (`StackProbe`), so that the
/// verifier checks a slot's step once, not once per way the slot before
/// it ended.
#[cfg(not(feature = "legacy-kernels"))]
fn find_or_insert(key: &mut StackKey, scratch: Slot) -> Option<u64> {
    let probe = STACK_PROBES.get_ptr_mut(scratch.key())?;
    // SAFETY: this CPU's slot, like the scratch key.
    unsafe { *probe = StackProbe { id: 0, outcome: SEARCHING, index: 0, hash: 0 } };
    let mut probing = Probing { key, probe, hash: hash_of(key), scratch: scratch.key() };
    loops::repeat::<_, { PROBE_SLOTS as u32 }>(PROBE_SLOTS as u32, probe_step, &mut probing);
    // SAFETY: as above.
    let StackProbe { id, outcome, .. } = unsafe { *probe };
    (outcome == FOUND).then_some(id)
}

/// What `probe_step` is handed.
#[repr(C)]
struct Probing {
    key: *mut StackKey,
    probe: *mut StackProbe,
    hash: u64,
    scratch: u32,
}

/// `StackProbe::outcome`s.
const SEARCHING: u32 = 0;
const FOUND: u32 = 1;
const FULL: u32 = 2;

/// Tries slot `index` after the stack's own: on (0) while other stacks
/// hold them, or the end (1).
#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn probe_step(index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `find_or_insert` passed its own `Probing`, whose pointers
    // are to this CPU's slot.
    let probing = unsafe { &*ctx.cast::<Probing>() };
    // SAFETY: as above.
    let (key, probe) = unsafe { (&mut *probing.key, &mut *probing.probe) };
    let slot = StackSlot { tgid: key.tgid, _padding: 0, hash: probing.hash.wrapping_add(index) };
    let id = match STACK_IDS.get_ptr(slot) {
        // SAFETY: the value of a live entry; ids are never rewritten.
        Some(id) => unsafe { *id },
        None => match insert(&slot, key, Slot::from_key(probing.scratch)) {
            Inserted::Stored(id) => {
                probe.id = id;
                probe.outcome = FOUND;
                return 1;
            }
            Inserted::Full => {
                probe.outcome = FULL;
                return 1;
            }
            // Another CPU filled the slot first, maybe with this stack.
            Inserted::Raced => match STACK_IDS.get_ptr(slot) {
                // SAFETY: as above.
                Some(id) => unsafe { *id },
                None => return 0,
            },
        },
    };
    if holding(id, key).is_some() {
        probe.id = id;
        probe.outcome = FOUND;
        return 1;
    }
    // Another stack holds the slot: try the next.
    0
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

/// A pass over a stack's frames, one iteration per frame (see `loops`): the
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

type FrameStep = loops::Step;

impl FramePass {
    fn new(frames: &StackKey, other: *mut StackKey) -> Self {
        // The hash starts at FNV's offset basis, which `hash_of` goes on
        // from, not 0: zero fields side by side are cleared by a call to
        // a memset that writes a byte per iteration.
        Self { frames, other, hash: FNV_OFFSET_BASIS, differs: 0 }
    }

    /// Calls `step` for frames `0..depth`, until it returns 1.
    fn run(&mut self, depth: usize, step: FrameStep) {
        loops::repeat::<_, { MAX_STACK_DEPTH as u32 }>(depth.min(MAX_STACK_DEPTH) as u32, step, self);
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

#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn hash_step(index: u64, ctx: *mut c_void) -> i64 {
    let pass = pass_of(ctx);
    let Some((frame, _)) = pass.frames(index) else { return 1 };
    pass.hash = (pass.hash ^ frame).wrapping_mul(FNV_PRIME);
    0
}

#[cfg_attr(feature = "legacy-kernels", inline(never))]
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

#[cfg_attr(feature = "legacy-kernels", inline(never))]
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
