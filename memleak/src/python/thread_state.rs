//! From a thread to its `PyThreadState`, as the BPF walk will do it: the
//! thread's fsbase, libc's thread-specific data at it, and CPython's TSS
//! key's slot there; then a self-test of exactly that on every thread the
//! interpreter knows, read through `/proc/PID/mem`.

use super::{
    memory::ProcessMemory,
    offsets::{GroupEnd, Offsets},
};

/// Where libc keeps a thread's `pthread_getspecific` values, from its
/// `struct pthread` (its `pthread_t`: at the thread pointer on x86-64,
/// `below_thread_pointer` bytes below it on arm64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibcLayout {
    /// `specific_1stblock[key].data` for keys below 32, `specific[key /
    /// 32][key % 32].data` above; slots of 16 bytes whose data is at +8.
    /// The same in glibc 2.27 to 2.38 (Pyroscope's table) and 2.36 here.
    Glibc { first_block: u32, second_level: u32, below_thread_pointer: u32 },
    /// `self->tsd[key]`: a pointer at `tsd` to an array of 8-byte values.
    Musl { tsd: u32 },
}

/// glibc's layout on x86-64.
pub const GLIBC: LibcLayout =
    LibcLayout::Glibc { first_block: 0x310, second_level: 0x510, below_thread_pointer: 0 };

/// glibc's layout on arm64, whose `struct pthread` starts with an 8-byte
/// header where x86-64's has a 192-byte `tcbhead_t` (glibc 2.36's
/// `pthread_getspecific`: `specific_1stblock` at 0x630 below the thread
/// pointer, `specific` at 0x430). The struct ends at the thread pointer,
/// so where it starts below it changes with its size from one glibc to
/// the next: `pthread_self` says (`mrs x0, tpidr_el0; sub x0, x0, #SIZE`).
pub fn glibc_arm64_layout(file: &std::fs::File) -> Result<LibcLayout, String> {
    use object::{read::ReadCache, ReadRef as _};
    /// `pthread_self`'s first instruction.
    const MRS_X0_TPIDR_EL0: u32 = 0xd53b_d040;
    let cache = ReadCache::new(file);
    let parsed = object::File::parse(&cache).map_err(|error| error.to_string())?;
    let (address, _) = super::runtime::symbol(&parsed, "pthread_self").ok_or("no symbol pthread_self")?;
    let offset = super::runtime::file_offset(&parsed, address).ok_or("pthread_self is not in the file")?;
    let code = cache.read_bytes_at(offset, 8).map_err(|()| "cannot read pthread_self")?;
    let word = |index: usize| u32::from_le_bytes(code[4 * index..4 * index + 4].try_into().expect("4 bytes"));
    // sub x0, x0, #imm12 (lsl #12 when bit 22 is set).
    let below = match (word(0), word(1)) {
        (MRS_X0_TPIDR_EL0, sub) if sub & 0xffc0_03ff == 0xd100_0000 => {
            let immediate = (sub >> 10) & 0xfff;
            if sub & (1 << 22) != 0 {
                immediate << 12
            } else {
                immediate
            }
        }
        (first, second) => {
            return Err(format!(
                "pthread_self is not `mrs x0, tpidr_el0; sub x0, x0, #N`: {first:#x} {second:#x}"
            ));
        }
    };
    Ok(LibcLayout::Glibc { first_block: 0x110, second_level: 0x310, below_thread_pointer: below })
}

/// glibc's `header.self` in `struct pthread`: the thread's own address.
const GLIBC_HEADER_SELF: u64 = 0x10;

/// Which libc a process runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Libc<'a> {
    Glibc,
    /// musl, whose object is mapped from `path`.
    Musl {
        path: &'a str,
    },
}

/// The libc among the mapped files `paths`, if memleak knows it: glibc's
/// `libc.so.6`, or musl's `ld-musl-*.so.1` (Alpine; its libc is also
/// linked as `libc.musl-*`), which Debian's musl keeps as
/// `x86_64-linux-musl/libc.so`.
pub fn libc_of<'a>(mut paths: impl Iterator<Item = &'a str>) -> Option<Libc<'a>> {
    paths.find_map(|path| {
        let name = path.rsplit('/').next().unwrap_or(path);
        let musl = name.starts_with("ld-musl-")
            || name.starts_with("libc.musl-")
            || (name == "libc.so" && path.contains("-linux-musl/"));
        if name == "libc.so.6" {
            Some(Libc::Glibc)
        } else if musl {
            Some(Libc::Musl { path })
        } else {
            None
        }
    })
}

/// musl's layout, from its own `pthread_getspecific`: `mov %fs:0,%rax;
/// mov TSD(%rax),%rax; mov (%rax,%rdi,8),%rax`. `struct pthread` changed
/// between musl releases (1.2.3 has `tsd` at 0x80; Pyroscope's table
/// has 136 and 152 for others), so the code, not a table, says where.
pub fn musl_layout(file: &std::fs::File) -> Result<LibcLayout, String> {
    use iced_x86::{Decoder, DecoderOptions, Register};
    use object::{read::ReadCache, ReadRef as _};
    if !cfg!(target_arch = "x86_64") {
        return Err("memleak reads musl's layout from its x86-64 code only".to_owned());
    }
    let cache = ReadCache::new(file);
    let parsed = object::File::parse(&cache).map_err(|error| error.to_string())?;
    let (address, _) =
        super::runtime::symbol(&parsed, "pthread_getspecific").ok_or("no symbol pthread_getspecific")?;
    let offset =
        super::runtime::file_offset(&parsed, address).ok_or("pthread_getspecific is not in the file")?;
    let code = cache.read_bytes_at(offset, 32).map_err(|()| "cannot read pthread_getspecific")?;
    let mut thread = None;
    for instruction in Decoder::with_ip(64, code, address, DecoderOptions::NONE).into_iter().take(8) {
        let register = instruction.op0_register();
        match thread {
            None if instruction.segment_prefix() == Register::FS
                && instruction.memory_displacement64() == 0 =>
            {
                thread = Some(register);
            }
            Some(base)
                if instruction.memory_base() == base && instruction.memory_index() == Register::None =>
            {
                let tsd = u32::try_from(instruction.memory_displacement64())
                    .map_err(|_| "a negative tsd offset".to_owned())?;
                return Ok(LibcLayout::Musl { tsd });
            }
            _ => {}
        }
    }
    Err("its pthread_getspecific is not musl's fs:0, then self->tsd".to_owned())
}

/// CPython's `autoTSSkey`, read from `_PyRuntime`: `Ok(None)` while it is
/// not initialised yet (an interpreter still starting).
pub fn tss_key(memory: &ProcessMemory, runtime: u64, offsets: &Offsets) -> std::io::Result<Option<u32>> {
    let initialised = memory.u32(runtime + offsets.thread.auto_tss_key)?;
    let key = memory.u32(runtime + offsets.thread.auto_tss_key + 4)?;
    Ok((initialised == 1).then_some(key))
}

/// The `PyThreadState*` that the thread whose fsbase is `fsbase` has in
/// its slot for `key`, read as the BPF walk will.
pub fn tsd_value(memory: &ProcessMemory, layout: LibcLayout, fsbase: u64, key: u32) -> std::io::Result<u64> {
    let key = u64::from(key);
    match layout {
        LibcLayout::Glibc { first_block, .. } if key < 32 => {
            memory.u64(fsbase + u64::from(first_block) + 16 * key + 8)
        }
        LibcLayout::Glibc { second_level, .. } => {
            let block = memory.u64(fsbase + u64::from(second_level) + 8 * (key >> 5))?;
            if block == 0 {
                return Ok(0);
            }
            memory.u64(block + 16 * (key & 31) + 8)
        }
        LibcLayout::Musl { tsd } => memory.u64(memory.u64(fsbase + u64::from(tsd))? + 8 * key),
    }
}

/// What the self-test found on every thread of the interpreter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelfTest {
    /// Threads whose lookup found their own thread state.
    pub threads: usize,
    /// Frames whose code object was checked, over those threads.
    pub frames: usize,
    /// Thread states of threads starting or ending, whose slot held none,
    /// or whose `thread_id` was still that of a thread that passed (the
    /// thread that creates another fills in the new state, before 3.12),
    /// or that could not be read through (a thread that ended, its memory
    /// freed under the walk).
    pub in_transit: usize,
}

/// The things the self-test needs besides the offsets.
pub struct Subject<'a> {
    pub memory: &'a ProcessMemory,
    pub runtime: u64,
    pub offsets: &'a Offsets,
    pub key: u32,
    pub pycode_type: u64,
}

/// Frames checked per thread: enough to catch wrong frame offsets.
const FRAMES_CHECKED: usize = 8;
/// More threads than any interpreter has: a cycle in a list being
/// rewritten is cut short.
const MAX_THREADS: usize = 100_000;

/// The word at `address`, or a line saying it could not read `what` there.
fn read(memory: &ProcessMemory, address: u64, what: &str) -> Result<u64, String> {
    memory.u64(address).map_err(|error| format!("cannot read {what} at {address:#x}: {error}"))
}

/// Walks `interpreters.head`'s thread states and checks, for each, that
/// the lookup the BPF walk does leads back to it, and that its first
/// frames hold code objects. The first failure is the error, in a line.
pub fn self_test(subject: &Subject<'_>, layout: LibcLayout) -> Result<SelfTest, String> {
    let Subject { memory, runtime, offsets, key, .. } = *subject;
    let read = |address: u64, what: &str| read(memory, address, what);
    let interpreter = read(runtime + offsets.thread.interpreters_head, "_PyRuntime.interpreters.head")?;
    if interpreter == 0 {
        return Err("the interpreter has no interpreter state".to_owned());
    }
    let mut tstate = read(interpreter + offsets.thread.threads_head, "the interpreter's threads.head")?;
    let mut result = SelfTest { threads: 0, frames: 0, in_transit: 0 };
    let mut passed = Vec::new();
    let mut others = Vec::new();
    // The first thread state that could not be read through: the error,
    // if no thread passes (wrong offsets fail on every thread).
    let mut unreadable = None;
    let mut walked = 0;
    while tstate != 0 && walked < MAX_THREADS {
        walked += 1;
        let fsbase = read(tstate + offsets.thread.thread_id, "a thread state's thread_id")?;
        let next = read(tstate + offsets.thread.tstate_next, "a thread state's next")?;
        // 0: created for a thread that has not started yet (3.12+ binds a
        // thread state in the thread itself): no thread looks it up.
        if fsbase != 0 {
            match check_thread(subject, layout, tstate, fsbase)? {
                Thread::Passed { frames } => {
                    result.frames += frames;
                    result.threads += 1;
                    passed.push(fsbase);
                }
                Thread::Starting => result.in_transit += 1,
                Thread::Other { found } => others.push((tstate, fsbase, found)),
                Thread::Unreadable(failure) => {
                    unreadable.get_or_insert(failure);
                    result.in_transit += 1;
                }
            }
        }
        tstate = next;
    }
    if result.threads == 0 {
        if let Some(failure) = unreadable {
            return Err(failure);
        }
        return Err(match others.first() {
            Some(&(tstate, fsbase, found)) => {
                format!("thread {fsbase:#x}: its TSS key {key} slot holds {found:#x}, not its thread state {tstate:#x}")
            }
            None => format!("no thread's TSS key {key} slot holds its thread state"),
        });
    }
    for (tstate, fsbase, found) in others {
        if !passed.contains(&fsbase) {
            return Err(format!(
                "thread {fsbase:#x}: its TSS key {key} slot holds {found:#x}, not its thread state {tstate:#x}"
            ));
        }
        result.in_transit += 1;
    }
    Ok(result)
}

/// What one thread state of the list showed.
enum Thread {
    /// The lookup leads back to it, and its first frames run code objects.
    Passed { frames: usize },
    /// Its thread's slot holds no thread state yet.
    Starting,
    /// Its thread's slot holds thread state `found`.
    Other { found: u64 },
    /// Something on the way could not be read, or its `thread_id` led to
    /// no glibc thread: a thread that ended, its memory freed under the
    /// walk, or wrong offsets.
    Unreadable(String),
}

/// Follows the lookup from thread state `tstate`, whose `thread_id` is
/// `fsbase`, and checks its frames. An error is a frame that runs no code
/// object, or that cannot be read again and again: wrong offsets.
fn check_thread(
    subject: &Subject<'_>,
    layout: LibcLayout,
    tstate: u64,
    fsbase: u64,
) -> Result<Thread, String> {
    let Subject { memory, key, .. } = *subject;
    // x86-64's glibc thread starts with its `tcbhead_t`, whose `self`
    // points at itself; arm64's has none.
    if matches!(layout, LibcLayout::Glibc { below_thread_pointer: 0, .. }) {
        match read(memory, fsbase + GLIBC_HEADER_SELF, "a thread's glibc header") {
            Ok(own) if own == fsbase => {}
            Ok(own) => {
                return Ok(Thread::Unreadable(format!(
                    "thread state {tstate:#x}: thread_id {fsbase:#x} is not a glibc thread (header.self {own:#x})"
                )));
            }
            Err(failure) => return Ok(Thread::Unreadable(failure)),
        }
    }
    let found = match tsd_value(memory, layout, fsbase, key) {
        Ok(found) => found,
        Err(error) => {
            return Ok(Thread::Unreadable(format!(
                "cannot read the TSS slot of thread {fsbase:#x}: {error}"
            )));
        }
    };
    if found == 0 {
        return Ok(Thread::Starting);
    }
    if found != tstate {
        return Ok(Thread::Other { found });
    }
    // A running thread's frames change under the reads: a frame freed
    // meanwhile, or popped and its memory taken by the next call before
    // its code object was read (a thread starting or ending), is read
    // again from the thread's frames as they are then. Wrong offsets fail
    // every attempt alike.
    let mut outcome = check_frames(subject, tstate);
    for _ in 1..FRAME_CHECK_ATTEMPTS {
        if outcome.is_ok() {
            break;
        }
        outcome = check_frames(subject, tstate);
    }
    match outcome {
        Ok(frames) => Ok(Thread::Passed { frames }),
        Err(FrameCheck::Unreadable(failure) | FrameCheck::NotCode(failure)) => Err(failure),
    }
}

/// Checks of a thread's frames before a read that fails counts.
const FRAME_CHECK_ATTEMPTS: usize = 5;

/// Why a thread's frames did not check out.
enum FrameCheck {
    /// A read failed.
    Unreadable(String),
    /// A frame runs something that is not a code object.
    NotCode(String),
}

/// Checks that the first frames of thread state `tstate` run code objects
/// (the 3.12+ shim frame, owned by the C stack, runs none), and returns how
/// many were checked.
fn check_frames(subject: &Subject<'_>, tstate: u64) -> Result<usize, FrameCheck> {
    let Subject { memory, offsets, pycode_type, .. } = *subject;
    let read = |address: u64, what: &str| read(memory, address, what).map_err(FrameCheck::Unreadable);
    let mut frame = read(tstate + offsets.thread.tstate_frame, "a thread state's frame")?;
    if let Some(current) = offsets.thread.cframe_current {
        if frame != 0 {
            frame = read(frame + current, "a cframe's current_frame")?;
        }
    }
    let mut checked = 0;
    for _ in 0..FRAMES_CHECKED {
        if frame == 0 {
            break;
        }
        let bytes = memory.bytes(frame, usize::from(offsets.frame.read_size)).map_err(|error| {
            FrameCheck::Unreadable(format!("cannot read the frame at {frame:#x}: {error}"))
        })?;
        let word = |offset: u8| {
            let at = usize::from(offset);
            u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"))
        };
        let shim = matches!(offsets.frame.group_end, GroupEnd::OwnerShim { offset }
            if bytes[usize::from(offset)] == memleak_common::python::PY_OWNED_BY_CSTACK);
        if !shim {
            let code = word(offsets.frame.code);
            let code_type = read(code + 8, "a frame's code object")?;
            if code_type != pycode_type {
                return Err(FrameCheck::NotCode(format!(
                    "the frame at {frame:#x} runs {code:#x}, whose type {code_type:#x} is not PyCode_Type"
                )));
            }
            checked += 1;
        }
        frame = word(offsets.frame.back);
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian 12's arm64 glibc (libc6-arm64-cross): `pthread_self` is
    /// the thread pointer less 0x740, and `pthread_getspecific` reads key
    /// 0's slot at the thread pointer less 0x630: 0x110 into the thread.
    #[test]
    fn arm64_glibc_says_where_its_threads_start() {
        let open = |path: &str| std::fs::File::open(path).unwrap_or_else(|error| panic!("{path}: {error}"));
        assert_eq!(
            glibc_arm64_layout(&open("/usr/aarch64-linux-gnu/lib/libc.so.6")),
            Ok(LibcLayout::Glibc { first_block: 0x110, second_level: 0x310, below_thread_pointer: 0x740 })
        );
        let x86_64 = glibc_arm64_layout(&open("/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(x86_64.is_err_and(|error| error.starts_with("pthread_self is not `mrs x0, tpidr_el0")));
    }

    #[test]
    fn the_libc_is_told_by_its_file_name() {
        let glibc = ["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6"];
        assert_eq!(libc_of(glibc.into_iter()), Some(Libc::Glibc));
        let alpine = "/lib/ld-musl-x86_64.so.1";
        assert_eq!(libc_of([alpine].into_iter()), Some(Libc::Musl { path: alpine }));
        let debian = "/usr/lib/x86_64-linux-musl/libc.so";
        assert_eq!(libc_of([debian].into_iter()), Some(Libc::Musl { path: debian }));
        assert_eq!(libc_of(["/usr/bin/python3.11", "/usr/lib/libm.so.6", "/opt/libc.so"].into_iter()), None);
    }

    /// musl's layout, on a program built with Debian's musl (musl-tools):
    /// its keys' values read back through one of the candidate offsets.
    #[test]
    fn musl_thread_specific_data_is_found() {
        use std::io::BufRead as _;
        let dir = std::env::temp_dir().join(format!("memleak-musl-tsd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("keys.c");
        std::fs::write(
            &source,
            "#include <pthread.h>\n#include <stdio.h>\nint main(void) {\n\
             pthread_key_t keys[3];\n\
             for (int i = 0; i < 3; i++) { pthread_key_create(&keys[i], 0); \
             pthread_setspecific(keys[i], (void *)(0x1000L + keys[i])); }\n\
             printf(\"%lx %u %u %u\\n\", (unsigned long)pthread_self(), keys[0], keys[1], keys[2]);\n\
             fflush(stdout);\n getchar();\n return 0;\n}\n",
        )
        .unwrap();
        let program = dir.join("keys");
        let built = std::process::Command::new("musl-gcc").arg("-o").arg(&program).arg(&source).status();
        assert!(built.is_ok_and(|status| status.success()), "musl-gcc (Debian's musl-tools) builds it");
        let mut child = std::process::Command::new(&program)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap();
        let memory = ProcessMemory::open(child.id()).unwrap();
        let mut words = line.split_whitespace();
        let thread = u64::from_str_radix(words.next().unwrap(), 16).unwrap();
        let keys: Vec<u32> = words.map(|key| key.parse().unwrap()).collect();
        let paths: Vec<&str> = maps.lines().filter_map(|line| line.split_whitespace().nth(5)).collect();
        let Some(Libc::Musl { path }) = libc_of(paths.iter().copied()) else {
            panic!("musl is recognised: {maps}")
        };
        let layout = musl_layout(&std::fs::File::open(path).unwrap()).unwrap();
        assert_eq!(layout, LibcLayout::Musl { tsd: 0x80 }, "Debian 12's musl 1.2.3");
        // pthread_self() is the thread pointer, fsbase, in musl too.
        let values: Vec<u64> =
            keys.iter().map(|&key| tsd_value(&memory, layout, thread, key).unwrap()).collect();
        let _ = child.kill();
        let _ = child.wait();
        std::fs::remove_dir_all(&dir).unwrap();
        let expected: Vec<u64> = keys.iter().map(|&key| 0x1000 + u64::from(key)).collect();
        assert_eq!(values, expected, "keys {keys:?}");
    }
}
