//! Walking only the frames that changed: between two allocations of one
//! thread, most of its stack is the same, and only the frames nearest the
//! allocation differ.
//!
//! Each CPU keeps the last table walk it made, with every frame's
//! registers as the walk found them (pc, stack pointer, rbp) and where the
//! walk read the frame's rbp. A new walk of the same thread looks, at each
//! frame, for the cached frame at the same stack pointer. When pc, stack
//! pointer and rbp all match, it takes the cached frames above it as long
//! as each one's words on the stack still hold what the last walk read
//! there.
//!
//! Why that is exact: a step from one frame to its caller is a function
//! of the frame's pc, stack pointer and rbp, the process's unwind table
//! (the same generation: the walk's rule cache relies on it too), and the
//! words it reads: the return address just below the caller's stack
//! pointer, and the caller's saved rbp when the rule says where. Each frame
//! taken has both words read again from the stack and compared (one read
//! of the stack serves many frames), so a frame is taken only if a full
//! walk would step to it from the frame before: by induction, the frames
//! taken are those a full walk finds. A frame reached through a signal
//! frame came from registers the signal saved, which are not checked: the
//! taking stops before it, and the walk steps on. Nor is the walk's end
//! taken from the cache: after the last frame taken, the walk steps on as
//! usual.

use core::ffi::c_void;

use aya_ebpf::helpers::generated::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use memleak_common::{StackKey, WalkCount, MAX_STACK_DEPTH};

use crate::{
    checked::opaque,
    loops,
    maps::{
        Frame, ReuseProgress, WalkCache, WalkCaches, CACHED_FRAMES, STACK_WINDOW_WORDS, WALK_CACHES,
        WALK_COUNTS,
    },
    scratch::Slot,
    totals::atomic_add,
    tunables,
};

/// Whether walks take frames from the last one. Not on kernels before
/// 5.17: without `bpf_loop`, the verifier would follow the check's loop
/// over the cached frames inside every iteration of the walk's, past its
/// million instructions. A walk there steps through every frame, and
/// finds the same ones. Nor on arm64 yet, where the return address is not
/// the word just below a caller's stack pointer, the one the check reads.
pub const ENABLED: bool = cfg!(not(any(feature = "legacy-kernels", bpf_target_arch = "aarch64")));

/// A frame's rbp came from the word at its stack pointer minus 8 × its
/// slot, or, at 0, was its callee's unchanged. A slot past this lies
/// beyond the words checked with the return address: such a frame is not
/// taken.
const MAX_CHECKED_SLOT: u64 = 7;
/// A frame whose rbp slot is past `MAX_CHECKED_SLOT`.
const SLOT_UNCHECKED: u64 = 0xfe;
/// A frame found through a signal frame: its registers came from the
/// signal's context, not from its callee's frame.
pub const SLOT_SIGNAL: u64 = 0xff;

/// Bytes of stack read at once to check frames.
const WINDOW_BYTES: u64 = (STACK_WINDOW_WORDS * 8) as u64;
/// Bytes below a frame's stack pointer that its check reads: its return
/// address and rbp slots 1 to 7.
const BELOW_SP: u64 = 8 * (MAX_CHECKED_SLOT + 1);

impl Frame {
    /// `*to = *self`, a field at a time: copied whole between two maps'
    /// frames, which the compiler cannot tell apart, it became a call to
    /// a memmove that moves a byte per iteration.
    fn copy_to(&self, to: &mut Frame) {
        to.pc = self.pc;
        to.sp = self.sp;
        to.bp = self.bp;
        to.slot = self.slot;
    }

    /// The slot of a frame whose rbp a step found at CFA - 8 × `rbp_slot`
    /// (0: unchanged).
    pub fn slot_of(rbp_slot: u32) -> u64 {
        let rbp_slot = u64::from(rbp_slot);
        if rbp_slot <= MAX_CHECKED_SLOT {
            rbp_slot
        } else {
            SLOT_UNCHECKED
        }
    }
}

/// This CPU's caches, as one program run sees them: the last walk, the
/// walk under way, and where it stands.
struct Caches<'a> {
    previous: &'a mut WalkCache,
    fresh: &'a mut WalkCache,
    progress: &'a mut ReuseProgress,
    window: &'a mut [u64; STACK_WINDOW_WORDS],
}

/// Looked up afresh wherever needed (an array lookup, inlined): pointers
/// kept on the BPF stack would not fit beside the walk's own.
fn caches<'a>(slot: Slot) -> Option<Caches<'a>> {
    WALK_CACHES.get_ptr_mut(slot.key()).map(caches_at)
}

/// The caches of a scratch slot, from their map value: what the loops'
/// steps are handed, so that they look nothing up.
fn caches_at<'a>(caches: *mut WalkCaches) -> Caches<'a> {
    // SAFETY: a scratch slot's value, which only the program run holding
    // the slot touches.
    let caches: &mut WalkCaches = unsafe { &mut *caches };
    let [first, second] = &mut caches.caches;
    let (previous, fresh) = if caches.current & 1 == 0 { (first, second) } else { (second, first) };
    Caches { previous, fresh, progress: &mut caches.progress, window: &mut caches.window }
}

/// Starts a walk of the current thread of `tgid` under table
/// `generation`.
pub fn begin(tgid: u32, generation: u32, slot: Slot) {
    let Some(Caches { previous, fresh, progress, .. }) = caches(slot) else { return };
    // SAFETY: a helper without arguments.
    let thread = unsafe { bpf_get_current_pid_tgid() } as u32;
    let usable = previous.depth != 0
        && previous.tid == thread
        && previous.tgid == tgid
        && previous.generation == generation
        && tunables::stack_reuse();
    fresh.tid = thread;
    fresh.tgid = tgid;
    fresh.generation = generation;
    fresh.depth = 0;
    fresh.stack_known = 0;
    fresh.stack_id = 0;
    progress.usable = u32::from(usable);
    progress.from_first = 0;
    progress.cursor = 0;
    progress.reused = 0;
}

/// Notes the walk's frame `index` in the fresh cache.
pub fn note(index: u32, frame: &Frame, slot: Slot) {
    let Some(Caches { fresh, .. }) = caches(slot) else { return };
    let cached = &mut fresh.frames[index as usize & (CACHED_FRAMES - 1)];
    *cached = *frame;
    // The check reads whole words of a window that starts 8-aligned, just
    // below a stack pointer. A frame whose stack pointer is not aligned
    // (no code that follows the ABI has one) is never checked.
    if !frame.sp.is_multiple_of(8) && frame.slot <= MAX_CHECKED_SLOT {
        cached.slot = SLOT_UNCHECKED;
    }
}

/// Ends the walk at `depth` frames, ended as `end` says: its frames
/// become the cache the next walk on this CPU looks at, unless it found
/// the last walk's frames exactly (`unchanged`), which then stay. Takes
/// the counts.
pub fn end(depth: u32, end: u32, unchanged: bool, slot: Slot) {
    let Some(Caches { fresh, progress, .. }) = caches(slot) else { return };
    let reused = progress.reused;
    if !unchanged {
        fresh.depth = depth;
        fresh.end = end;
        if let Some(caches) = WALK_CACHES.get_ptr_mut(slot.key()) {
            // SAFETY: as in `caches`.
            unsafe { (*caches).current ^= 1 };
        }
    }
    if let Some(counts) = WALK_COUNTS.get_ptr_mut(0) {
        // SAFETY: this CPU's counts, which walks in its other scratch
        // slots add to as well: atomically.
        let counts = unsafe { &mut *counts };
        unsafe {
            atomic_add(&raw mut counts[WalkCount::Walks as usize], 1);
            atomic_add(&raw mut counts[WalkCount::Frames as usize], u64::from(depth));
            if reused != 0 {
                atomic_add(&raw mut counts[WalkCount::ReusingWalks as usize], 1);
                atomic_add(&raw mut counts[WalkCount::FramesReused as usize], u64::from(reused));
            }
        }
    }
}

/// The id the last walk's stack was stored under, if known.
#[cfg(not(feature = "legacy-kernels"))]
pub fn last_stack_id(slot: Slot) -> Option<u64> {
    // The last walk is `previous` once `end` has swapped them, or kept it.
    let Caches { previous, .. } = caches(slot)?;
    (previous.stack_known != 0).then_some(previous.stack_id)
}

/// Notes the id the last walk's stack was stored under, or that it is not
/// known.
#[cfg(not(feature = "legacy-kernels"))]
pub fn remember_stack_id(id: Option<u64>, slot: Slot) {
    let Some(Caches { previous, .. }) = caches(slot) else { return };
    previous.stack_known = u32::from(id.is_some());
    previous.stack_id = id.unwrap_or(0);
}

/// Where a walk stands after taking frames from the cache.
pub struct Taken {
    /// The last frame taken: the walk steps on from it.
    pub frame: Frame,
    /// Frames in the key now.
    pub depth: u32,
}

/// Whether the walk's frame `index`, `frame`, is a frame of the last
/// walk, with the same registers: then `check_unchanged` checks the
/// frames above it. A walk checks once: after it, it looks for no more.
pub fn matches(index: u32, frame: &Frame, slot: Slot) -> bool {
    if !ENABLED || frame.slot == SLOT_SIGNAL {
        return false;
    }
    let Some(Caches { previous, progress, .. }) = caches(slot) else { return false };
    if progress.usable == 0 {
        return false;
    }
    // The cached frames' stack pointers rise from the leaf: those below
    // the walk's are skipped, as many as lie there (a walk whose frames
    // below the shared ones are fewer than the last walk's must skip
    // several at once, or never meet them).
    let cursor = progress.cursor;
    if cursor < previous.depth && previous.frames[cursor as usize & (CACHED_FRAMES - 1)].sp < frame.sp {
        skip_below(frame.sp, slot);
    }
    // Afresh: the skipping moved the cursor.
    let Some(Caches { previous, progress, .. }) = caches(slot) else { return false };
    let cursor = progress.cursor;
    let matched = &previous.frames[cursor as usize & (CACHED_FRAMES - 1)];
    if cursor >= previous.depth
        || matched.sp != frame.sp
        || matched.pc != frame.pc
        || matched.bp != frame.bp
        || matched.slot == SLOT_SIGNAL
    {
        return false;
    }
    progress.from_first = u32::from(index == 0 && cursor == 0);
    progress.next = cursor + 1;
    progress.index = index + 1;
    true
}

/// Moves the cursor past the cached frames whose stack pointers lie below
/// `sp`. A loop of its own, one frame an iteration: unrolled in the step,
/// each more frame had the verifier check the step as many times again
/// (loading took 500 ms at 8 frames, 320 at 1).
fn skip_below(sp: u64, slot: Slot) {
    let Some(caches) = WALK_CACHES.get_ptr_mut(slot.key()) else { return };
    let mut skipping = Skipping { sp, caches };
    loops::repeat::<_, { CACHED_FRAMES as u32 }>(CACHED_FRAMES as u32, skip_step, &mut skipping);
}

/// What `skip_step` is handed: the stack pointer to skip below, and the
/// walk's caches.
#[derive(Clone, Copy)]
#[repr(C)]
struct Skipping {
    sp: u64,
    caches: *mut WalkCaches,
}

/// Skips the cached frame at the cursor if its stack pointer is below
/// the one `ctx` gives: on (0), or the end (1).
#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn skip_step(_iteration: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `skip_below` passed its own `Skipping`.
    let Skipping { sp, caches } = unsafe { *ctx.cast::<Skipping>() };
    let Caches { previous, progress, .. } = caches_at(caches);
    let cursor = progress.cursor;
    if cursor >= previous.depth || previous.frames[cursor as usize & (CACHED_FRAMES - 1)].sp >= sp {
        return 1;
    }
    progress.cursor = cursor + 1;
    0
}

/// Checks the cached frames above the matched one, up to `limit` frames
/// in all, for as long as their words on the stack hold: the walk stands
/// at the last one checked. They are in the key and the fresh cache only
/// once `copy_checked` has put them there, which an unchanged stack need
/// not wait for.
pub fn check_unchanged(limit: u32, slot: Slot) -> Option<Taken> {
    if !ENABLED {
        return None;
    }
    let caches = WALK_CACHES.get_ptr_mut(slot.key())?;
    let Caches { progress, .. } = caches_at(caches);
    progress.usable = 0;
    // No window read yet: an empty range (zeros side by side would be
    // cleared by a call to a byte-by-byte memset).
    progress.low = u64::MAX;
    progress.high = 0;
    progress.first_cached = progress.next;
    progress.first_index = progress.index;
    let mut checking = Checking { limit: limit.min(MAX_STACK_DEPTH as u32), caches };
    loops::repeat::<_, { MAX_STACK_DEPTH as u32 }>(MAX_STACK_DEPTH as u32, check_step, &mut checking);
    let Caches { previous, progress, .. } = caches_at(caches);
    let depth = progress.index;
    let checked = depth.checked_sub(progress.first_index).filter(|&checked| checked != 0)?;
    progress.reused = checked;
    let last = progress.next.wrapping_sub(1) as usize & (CACHED_FRAMES - 1);
    Some(Taken { frame: previous.frames[last], depth })
}

/// Whether the frames checked are all of the last walk's, from its first,
/// and its stack's id is known: if the walk ends as the last one did, its
/// stack is that one.
pub fn whole_last_walk_checked(slot: Slot) -> bool {
    if !ENABLED {
        return false;
    }
    caches(slot).is_some_and(|Caches { previous, progress, .. }| {
        progress.from_first != 0 && progress.next == previous.depth && previous.stack_known != 0
    })
}

/// Whether a walk of `depth` frames ending as `end` says ended as the
/// last one did.
pub fn ended_as_last(depth: u32, end: u32, slot: Slot) -> bool {
    if !ENABLED {
        return false;
    }
    caches(slot).is_some_and(|Caches { previous, .. }| previous.depth == depth && previous.end == end)
}

/// Puts the checked frames in `key` and the fresh cache.
pub fn copy_checked(key: *mut StackKey, slot: Slot) {
    if !ENABLED {
        return;
    }
    let Some(caches) = WALK_CACHES.get_ptr_mut(slot.key()) else { return };
    let mut copying = Copying { key, caches };
    loops::repeat::<_, { MAX_STACK_DEPTH as u32 }>(MAX_STACK_DEPTH as u32, copy_step, &mut copying);
}

/// What `copy_step` is handed: the key copied to, and the walk's caches.
#[derive(Clone, Copy)]
#[repr(C)]
struct Copying {
    key: *mut StackKey,
    caches: *mut WalkCaches,
}

/// Puts the last walk's frames in `key`: its stack, when the walk took
/// them all without copying them (`whole_last_walk_checked`).
#[cfg(not(feature = "legacy-kernels"))]
pub fn copy_last_walk(key: *mut StackKey, slot: Slot) {
    if !ENABLED {
        return;
    }
    if let Some(Caches { progress, .. }) = caches(slot) {
        progress.first_cached = 0;
        progress.first_index = 0;
        copy_checked(key, slot);
    }
}

/// Checks up to `FRAMES_PER_CHECK` cached frames from `progress.next`: on
/// (0), or the end (1).
#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn check_step(_iteration: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `check_unchanged` passed its own `Checking`.
    let Checking { limit, caches } = unsafe { *ctx.cast::<Checking>() };
    let Caches { previous, progress, window, .. } = caches_at(caches);
    i64::from(!check_frames(previous, progress, window, limit))
}

/// What `check_step` is handed: the frames the walk may have in all, and
/// its caches.
#[derive(Clone, Copy)]
#[repr(C)]
struct Checking {
    limit: u32,
    caches: *mut WalkCaches,
}

/// Frames one iteration of `check_step` checks at most. The lookup and
/// the call an iteration costs were most of a frame's check when each
/// checked one.
const FRAMES_PER_CHECK: u32 = 8;

/// Checks cached frames from `progress.next` against the stack, reading
/// it into `window` first if the first of them lies outside: moves on past
/// those that hold, and says whether checking may go on.
#[expect(clippy::inline_always, reason = "a call of its own would need BPF stack the step has no room for")]
#[inline(always)]
fn check_frames(
    previous: &WalkCache,
    progress: &mut ReuseProgress,
    window: &mut [u64; STACK_WINDOW_WORDS],
    limit: u32,
) -> bool {
    let (first, index) = (progress.next, progress.index);
    if index >= limit {
        return false;
    }
    let last = previous.depth.min(first.saturating_add(limit - index));
    if first >= last || !window_holds(previous, progress, window, first) {
        return false;
    }
    // Offsets from the lowest stack pointer whose words the window holds:
    // one comparison tells whether a frame's are all in it.
    let base = progress.low + BELOW_SP;
    let span = progress.high - base;
    let count = (last - first) as usize;
    // Masked once: each frame is then at a constant offset from it in the
    // unrolled loop, where masking `first + checked` took six
    // instructions a frame.
    let frames = previous.frames.as_ptr().wrapping_add(first as usize & (CACHED_FRAMES - 1));
    let (checked, more) = 'check: {
        for checked in 0..FRAMES_PER_CHECK as usize {
            if checked >= count {
                break 'check (checked, false);
            }
            // SAFETY: frame `first + checked` of the cache, below `last`,
            // which is at most the cache's depth, at most CACHED_FRAMES.
            let frame = unsafe { &*frames.wrapping_add(checked) };
            let offset = frame.sp.wrapping_sub(base);
            // Past the window: the next iteration reads on. (The stack
            // pointers rise, so below it is only a frame on another stack:
            // through a signal, whose slot ends the checking anyway, or
            // back on a goroutine's stack from a cgo call, which the next
            // iteration reads the window at.)
            if offset > span {
                break 'check (checked, true);
            }
            // The word `bytes` below the stack pointer. The pointers checked
            // are aligned (see `note`), like the window: the mask changes no
            // offset, and bounds it for the verifier.
            let word = |bytes: u64| window[((offset + BELOW_SP - bytes) & (WINDOW_BYTES - 8)) as usize / 8];
            if frame.slot > MAX_CHECKED_SLOT
                || word(8) != frame.pc
                || (frame.slot != 0 && word(8 * frame.slot) != frame.bp)
            {
                break 'check (checked, false);
            }
        }
        (FRAMES_PER_CHECK as usize, true)
    };
    let checked = checked as u32;
    progress.next = first + checked;
    progress.index = index + checked;
    more
}

/// Whether `window` holds the words that cached frame `next`'s check
/// reads, reading the stack from just below them if it did not yet: up to
/// the outermost cached frame's stack pointer at most, stack the last walk
/// read through.
#[expect(clippy::inline_always, reason = "as `check_frames`")]
#[inline(always)]
fn window_holds(
    previous: &WalkCache,
    progress: &mut ReuseProgress,
    window: &mut [u64; STACK_WINDOW_WORDS],
    next: u32,
) -> bool {
    let sp = previous.frames[next as usize & (CACHED_FRAMES - 1)].sp;
    if sp < BELOW_SP {
        return false;
    }
    let low = sp - BELOW_SP;
    if low >= progress.low && sp <= progress.high {
        return true;
    }
    let outermost = previous.frames[(previous.depth - 1) as usize & (CACHED_FRAMES - 1)].sp;
    // A word short of the window: the mask below then bounds the size for
    // the verifier without changing it.
    let high = outermost.min(low + WINDOW_BYTES - 8);
    if high < sp {
        return false;
    }
    let size = (high - low) & (WINDOW_BYTES - 1);
    // SAFETY: reads user memory into this CPU's window, `size` bytes of at
    // most its length; the helper makes a fault an error.
    if unsafe { bpf_probe_read_user(window.as_mut_ptr().cast(), size as u32, low as *const c_void) } != 0 {
        return false;
    }
    progress.low = low;
    progress.high = high;
    true
}

/// Copies checked frame `first_cached + iteration` of the last walk.
#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn copy_step(iteration: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `copy_checked` passed its own `Copying`, whose key is
    // live for the program run.
    let Copying { key, caches } = unsafe { *ctx.cast::<Copying>() };
    // SAFETY: as above.
    let key = unsafe { &mut *key };
    let Caches { previous, fresh, progress, .. } = caches_at(caches);
    let iteration = iteration as u32;
    let cached = progress.first_cached + iteration;
    if cached >= progress.next {
        return 1;
    }
    // Opaque: the bound check and the address from one value (see
    // python's `copy_step`).
    let index = opaque(u64::from(progress.first_index + iteration)) as u32;
    let Some(frame_in_key) = key.frames.get_mut(index as usize) else { return 1 };
    let (from, to) = (cached as usize & (CACHED_FRAMES - 1), index as usize & (CACHED_FRAMES - 1));
    let frame = &previous.frames[from];
    *frame_in_key = frame.pc;
    frame.copy_to(&mut fresh.frames[to]);
    0
}
