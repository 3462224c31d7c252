//! The Python frames of the current thread, for processes user space put
//! in `PY_PROCS`: one word per frame (`py_frame_word`), innermost first,
//! which join the stack after its native frames.
//!
//! Walked before the native frames, so that a deep native stack cannot
//! squeeze them all out. Only the current thread's frames are read, and
//! it sits in the probe, so nothing moves under the walk. A failed read
//! ends the walk with the frames found so far; the allocation is recorded
//! anyway.
//!
//! A stack stored for the first time also gets a check of each frame's
//! code object (`check_frames`), for user space to tell it from another
//! code object allocated at its address after it was freed. Only then:
//! the walk that finds a stack already stored reads no code object.

use core::ffi::c_void;

use aya_ebpf::helpers::{
    bpf_probe_read_kernel, bpf_probe_read_user,
    generated::{bpf_get_current_task, bpf_probe_read_user as read_user_into},
};
use memleak_common::{
    python::{
        py_code_check, py_frame_parts, py_frame_word, PY_CFRAME, PY_ENTRY_FLAG, PY_FRAMEOBJ, PY_GROUP_END,
        PY_LASTI_BYTES, PY_MUSL, PY_OWNED_BY_CSTACK, PY_OWNER_SHIM,
    },
    StackKey, MAX_STACK_DEPTH,
};

use crate::{
    checked::opaque,
    loops,
    maps::{PyFrameWords, PyScratch, PyWalkState, PY_FRAME_BYTES, PY_PROCS, PY_SCRATCH, PY_WALKING},
    scratch::Slot,
    tunables,
};

/// Bytes of one frame the scratch holds (`PyScratch`'s).
const FRAME_BYTES: usize = PY_FRAME_BYTES;

/// One frame's bytes, as words: every field read is aligned in it.
type Frame = PyFrameWords;

/// Walks the current thread's Python frames into `PY_SCRATCH`, as many
/// as `room` frames of a stack hold with their checks (two each), and
/// returns how many it found: 0 for a process not in `PY_PROCS` or a
/// thread that never ran Python.
pub fn walk(tgid: u32, room: u32, slot: Slot) -> u32 {
    let limit = room / 2;
    // With --max-stack-depth 2 there is no room, known at load: a loop
    // of 0 iterations would leave its callback to the verifier as code
    // that never runs, which 6.18 rejects ("No program to jit").
    if limit == 0 {
        return 0;
    }
    let fsbase_offset = tunables::py_fsbase_offset();
    if fsbase_offset == 0 {
        return 0;
    }
    // An array's lookup, which the verifier inlines, where PY_PROCS's
    // would hash the pid.
    if PY_WALKING.get(0).is_none_or(|&walking| walking == 0) {
        return 0;
    }
    // SAFETY: the value of a live entry, copied at once.
    let Some(config) = (unsafe { PY_PROCS.get(tgid) }).copied() else { return 0 };
    let Some(scratch) = PY_SCRATCH.get_ptr_mut(slot.key()) else { return 0 };
    let Some(frame) = current_frame(&config, fsbase_offset) else { return 0 };
    let limit = limit.min(u32::from(config.max_frames)).min(MAX_STACK_DEPTH as u32);
    // SAFETY: this CPU's scratch, which nothing else uses while this
    // program runs.
    unsafe { (*scratch).walk = PyWalkState { frame, count: 0, last: 0 } };
    let mut walk = PyWalk {
        scratch,
        limit,
        flags: config.flags,
        read_size: u32::from(config.read_size),
        f_code: u32::from(config.f_code),
        f_back: u32::from(config.f_back),
        f_instr: u32::from(config.f_instr),
        f_entry: u32::from(config.f_entry),
        f_owner: u32::from(config.f_owner),
        co_code: u64::from(config.co_code),
    };
    // Twice the frames: 3.12's shims take an iteration and give no word.
    loops::repeat::<_, { 2 * MAX_STACK_DEPTH as u32 }>(limit * 2, step, &mut walk);
    // SAFETY: as above.
    unsafe { (*scratch).walk.count }
}

/// The thread's innermost Python frame (null for none): its
/// `PyThreadState`, found in the libc thread-specific data at CPython's
/// TSS key, and the frame it runs.
fn current_frame(config: &memleak_common::PyProcConfig, fsbase_offset: u32) -> Option<u64> {
    // SAFETY: a helper without arguments.
    let task = unsafe { bpf_get_current_task() };
    // SAFETY: a kernel read at the offset user space found in the
    // kernel's BTF, which fails cleanly on a bad address.
    let thread_pointer: u64 =
        unsafe { bpf_probe_read_kernel((task + u64::from(fsbase_offset)) as *const u64) }.ok()?;
    // The thread's `struct pthread`, which libc's offsets count from.
    let pthread = thread_pointer.wrapping_sub(u64::from(config.pthread_below_tp));
    let key = u64::from(config.tss_key);
    let slot = if config.flags & PY_MUSL != 0 {
        read_user(pthread + u64::from(config.tsd_off))? + 8 * key
    } else if key < 32 {
        // glibc's `specific_1stblock`: 16-byte slots, the data at +8.
        pthread + u64::from(config.tsd_off) + 16 * key + 8
    } else {
        read_user(pthread + u64::from(config.tsd_l2_off) + 8 * (key >> 5))? + 16 * (key & 31) + 8
    };
    let thread_state = read_user(slot)?;
    if thread_state == 0 {
        return None;
    }
    let frame = read_user(thread_state + u64::from(config.ts_frame))?;
    if config.flags & PY_CFRAME != 0 && frame != 0 {
        return read_user(frame + u64::from(config.cframe_cur));
    }
    Some(frame)
}

fn read_user(address: u64) -> Option<u64> {
    // SAFETY: a user read that fails cleanly on a bad address.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}

/// A walk in progress, the context of `step`. The config's fields are
/// copied in as plain numbers: the callback then needs no map pointer.
/// Where the walk stands is in the scratch (`PyWalkState`).
#[repr(C)]
struct PyWalk {
    scratch: *mut PyScratch,
    limit: u32,
    flags: u32,
    read_size: u32,
    f_code: u32,
    f_back: u32,
    f_instr: u32,
    f_entry: u32,
    f_owner: u32,
    co_code: u64,
}

/// One iteration: one frame read, and its word kept unless it is a shim.
#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `walk` passed this pointer to its own `PyWalk`.
    let walk = unsafe { &*ctx.cast::<PyWalk>() };
    // SAFETY: this CPU's scratch, which nothing else uses while this
    // program runs.
    let scratch = unsafe { &mut *walk.scratch };
    if scratch.walk.frame == 0 || scratch.walk.count >= walk.limit {
        return 1;
    }
    // Exactly the frame's size: a 3.11+ frame may end its page.
    let size = walk.read_size & (FRAME_BYTES as u32 - 1);
    // SAFETY: at most FRAME_BYTES bytes into the scratch's frame buffer.
    let failed = unsafe {
        read_user_into(scratch.frame.as_mut_ptr().cast(), size, scratch.walk.frame as *const c_void)
    } != 0;
    if failed {
        return 1;
    }
    let code = word_at(&scratch.frame, walk.f_code);
    scratch.walk.frame = word_at(&scratch.frame, walk.f_back);
    if walk.flags & PY_OWNER_SHIM != 0 && byte_at(&scratch.frame, walk.f_owner) == PY_OWNED_BY_CSTACK {
        // The C stack's shim: the frame before it ends its group.
        if scratch.walk.count > 0 {
            if let Some(word) = scratch.words.get_mut(scratch.walk.last as usize) {
                *word |= PY_GROUP_END;
            }
        }
        return 0;
    }
    let lasti = if walk.flags & PY_FRAMEOBJ != 0 {
        let lasti = i64::from(int_at(&scratch.frame, walk.f_instr));
        if walk.flags & PY_LASTI_BYTES != 0 {
            lasti >> 1
        } else {
            lasti
        }
    } else {
        // `prev_instr`, one code unit before the code at the start.
        let instruction = word_at(&scratch.frame, walk.f_instr);
        (instruction.wrapping_sub(code).wrapping_sub(walk.co_code) as i64) >> 1
    };
    let group_end = walk.flags & PY_FRAMEOBJ != 0
        || (walk.flags & PY_ENTRY_FLAG != 0 && byte_at(&scratch.frame, walk.f_entry) != 0);
    let count = scratch.walk.count;
    let Some(word) = scratch.words.get_mut(count as usize) else { return 1 };
    *word = py_frame_word(code, lasti, group_end);
    scratch.walk.last = count;
    scratch.walk.count = count + 1;
    0
}

// The offsets come from user space, which checked each against the read
// size; masked here for the verifier, and aligned as the fields are.

fn word_at(frame: &Frame, offset: u32) -> u64 {
    frame[(offset as usize & (FRAME_BYTES - 8)) / 8]
}

fn int_at(frame: &Frame, offset: u32) -> i32 {
    let index = (offset as usize & (FRAME_BYTES - 4)) / 4;
    // SAFETY: 4 bytes within the buffer, 4-aligned.
    unsafe { *frame.as_ptr().cast::<i32>().add(index) }
}

fn byte_at(frame: &Frame, offset: u32) -> u8 {
    // SAFETY: a byte within the buffer.
    unsafe { *frame.as_ptr().cast::<u8>().add(offset as usize & (FRAME_BYTES - 1)) }
}

/// Writes, after the `count` Python words of a stack stored for the first
/// time, the check of each word's code object (`py_code_check`), read
/// now: 0 where it cannot be read. The walk left room for them.
pub fn check_frames(key: &mut StackKey, start: u32, count: u32, slot: Slot) {
    if count == 0 {
        return;
    }
    // SAFETY: the value of a live entry, copied at once.
    let Some(config) = (unsafe { PY_PROCS.get(key.tgid) }).copied() else { return };
    let Some(scratch) = PY_SCRATCH.get_ptr_mut(slot.key()) else { return };
    let mut checks = Checks {
        scratch,
        key,
        start,
        count,
        span_start: u64::from(config.co_check),
        span_size: u32::from(config.co_check_size),
        name: u32::from(config.co_check_name),
        file: u32::from(config.co_check_file),
        line: u32::from(config.co_check_line),
    };
    loops::repeat::<_, { MAX_STACK_DEPTH as u32 }>(count, check_step, &mut checks);
}

#[repr(C)]
struct Checks {
    scratch: *mut PyScratch,
    key: *mut StackKey,
    start: u32,
    count: u32,
    span_start: u64,
    span_size: u32,
    name: u32,
    file: u32,
    line: u32,
}

#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn check_step(index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `check_frames` passed this pointer to its own `Checks`,
    // whose pointers are to this CPU's scratch maps.
    let checks = unsafe { &mut *ctx.cast::<Checks>() };
    // SAFETY: as above.
    let (scratch, key) = unsafe { (&mut *checks.scratch, &mut *checks.key) };
    // Opaque, as in `copy_step`.
    let at = opaque(u64::from(checks.start) + index) as usize;
    let Some(&word) = key.frames.get(at) else { return 1 };
    let (code, _, _) = py_frame_parts(word);
    let size = checks.span_size & (FRAME_BYTES as u32 - 1);
    // SAFETY: at most FRAME_BYTES bytes into the scratch's frame buffer,
    // which the walk is done with.
    let read = unsafe {
        read_user_into(scratch.frame.as_mut_ptr().cast(), size, (code + checks.span_start) as *const c_void)
    };
    let check = if read == 0 {
        let name = word_at(&scratch.frame, checks.name);
        let file = word_at(&scratch.frame, checks.file);
        py_code_check(name, file, int_at(&scratch.frame, checks.line))
    } else {
        0
    };
    let Some(slot) = key.frames.get_mut(opaque((at + checks.count as usize) as u64) as usize) else {
        return 1;
    };
    *slot = check;
    0
}

/// Copies `count` words from `PY_SCRATCH` into `key.frames` after its
/// first `start` frames; returns how many fit.
pub fn append(key: &mut StackKey, start: u32, count: u32, slot: Slot) -> u32 {
    if count == 0 {
        return 0;
    }
    let Some(scratch) = PY_SCRATCH.get_ptr_mut(slot.key()) else { return 0 };
    let mut copy = Copy { scratch, key, start, copied: 0 };
    loops::repeat::<_, { MAX_STACK_DEPTH as u32 }>(count, copy_step, &mut copy);
    copy.copied
}

#[repr(C)]
struct Copy {
    scratch: *mut PyScratch,
    key: *mut StackKey,
    start: u32,
    copied: u32,
}

#[cfg_attr(feature = "legacy-kernels", inline(never))]
extern "C" fn copy_step(index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `append` passed this pointer to its own `Copy`, whose
    // pointers are to this CPU's scratch maps.
    let copy = unsafe { &mut *ctx.cast::<Copy>() };
    // SAFETY: as above.
    let (scratch, key) = unsafe { (&*copy.scratch, &mut *copy.key) };
    let Some(&word) = scratch.words.get(index as usize) else { return 1 };
    // Opaque: the bound check and the address then come from one value,
    // where the compiler computed `start`'s part of the address apart,
    // which a verifier following a bounded loop cannot tie to the check.
    let at = opaque(u64::from(copy.start) + index) as usize;
    let Some(slot) = key.frames.get_mut(at) else { return 1 };
    *slot = word;
    copy.copied += 1;
    0
}
