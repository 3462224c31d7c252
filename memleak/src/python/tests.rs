//! Detection against real interpreters: each CPython that the machine
//! image ships under pyenv (a `libpython3.X.so` each), Debian's own
//! python3.11 (static libpython, stripped `.symtab`), older Pythons that
//! must be refused, a process that is no Python, and one in a container.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
};

use object::{Object as _, ObjectSymbol as _};

use super::*;

/// Three threads asleep in `sleeper`, the main thread blocked reading
/// stdin in `main`; "ready" once every sleeper runs nothing but `sleeper`
/// (a thread just started may still be in `threading`'s own code, which
/// would add frames). Python 2 runs it too.
const THREE_SLEEPERS: &str = r"
import sys, threading, time
def sleeper():
    time.sleep(3600)
def main():
    for _ in range(3):
        thread = threading.Thread(target=sleeper)
        thread.daemon = True
        thread.start()
    me = threading.current_thread().ident
    def asleep():
        frames = sys._current_frames().items()
        return sum(1 for ident, frame in frames if ident != me and frame.f_code.co_name == 'sleeper')
    while asleep() < 3:
        time.sleep(0.01)
    sys.stdout.write('ready\n')
    sys.stdout.flush()
    sys.stdin.readline()
main()
";

/// A process killed when dropped, so that a failed assertion leaves none.
struct Running {
    child: Child,
    _stdin: ChildStdin,
}

impl Running {
    /// Starts `command` and waits for its "ready" line.
    fn start(mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot start {command:?}: {error}"));
        let stdin = child.stdin.take().expect("piped stdin");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n", "{command:?} did not get ready");
        Self { child, _stdin: stdin }
    }

    fn python(interpreter: &str) -> Self {
        assert!(Path::new(interpreter).exists(), "the machine image ships {interpreter}");
        let mut command = Command::new(interpreter);
        command.args(["-c", THREE_SLEEPERS]);
        Self::start(command)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn enabled(detection: Detection) -> PythonRuntime {
    match detection {
        Detection::Enabled(runtime) => *runtime,
        other => panic!("expected Python frames enabled, got {other:?}"),
    }
}

/// The fsbase offset, measured independently of `detect`'s reading.
fn btf_fsbase_offset() -> u32 {
    let btf = Path::new(kernel_btf::VMLINUX_BTF);
    kernel_btf::member_offset(btf, "task_struct", "thread").unwrap()
        + kernel_btf::member_offset(btf, "thread_struct", "fsbase").unwrap()
}

/// The address and size of `name` in the ELF file at `path`.
fn symbol_in(path: &str, name: &str) -> Option<(u64, u64)> {
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|symbol| symbol.name() == Ok(name))
        .map(|symbol| (symbol.address(), symbol.size()))
}

/// The lowest address process `pid` maps `file_name` at.
fn first_mapping(pid: u32, file_name: &str) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let line =
        maps.lines().find(|line| line.ends_with(&format!("/{file_name}"))).expect("the file is mapped");
    u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap()
}

/// Everything detection says of pyenv's CPython `version`, whose
/// interpreter is `libpython3.X.so.1.0`.
fn check_pyenv(version: &str, tss_key: u32, source: OffsetsSource) {
    let minor = version.split('.').nth(1).unwrap();
    let running = Running::python(&format!("/root/.pyenv/versions/{version}/bin/python3"));
    let runtime = enabled(detect(running.pid()));
    let library = format!("libpython3.{minor}.so.1.0");
    let library_path = format!("/root/.pyenv/versions/{version}/lib/{library}");
    assert_eq!(runtime.version.to_string(), version);
    assert_eq!(runtime.path, library_path, "the library, which the executable links");
    assert_eq!(runtime.bias, first_mapping(running.pid(), &library), "its first segment is at 0");
    let (runtime_symbol, _) = symbol_in(&library_path, "_PyRuntime").unwrap();
    assert_eq!(runtime.runtime_address, runtime.bias + runtime_symbol);
    assert_eq!(runtime.pycode_type, runtime.bias + symbol_in(&library_path, "PyCode_Type").unwrap().0);
    assert_eq!(runtime.tss_key, tss_key);
    assert_eq!(runtime.libc, thread_state::GLIBC);
    assert_eq!(runtime.fsbase_offset, btf_fsbase_offset());
    assert_eq!(runtime.offsets_source, source);
    // 3 sleepers of 4 frames (sleeper, Thread.run, _bootstrap_inner,
    // _bootstrap) and the main thread's 2 (main, <module>).
    assert_eq!(runtime.self_test, SelfTest { threads: 4, frames: 14, in_transit: 0 });
    let (eval, size) = symbol_in(&library_path, "_PyEval_EvalFrameDefault").unwrap();
    assert_eq!(runtime.eval_ranges[0], runtime.bias + eval..runtime.bias + eval + size);
    // No jump leaves pyenv's eval loop (objdump -d): its `.cold` symbols
    // name traps other functions share, which the loop never reaches.
    assert_eq!(runtime.eval_ranges.len(), 1, "{:x?}", runtime.eval_ranges);
    assert_eq!(runtime.config.tss_key, tss_key);
}

#[test]
fn pyenv_3_8() {
    check_pyenv("3.8.18", 0, OffsetsSource::Table);
}

#[test]
fn pyenv_3_9() {
    check_pyenv("3.9.18", 0, OffsetsSource::Table);
}

#[test]
fn pyenv_3_10() {
    check_pyenv("3.10.13", 0, OffsetsSource::Table);
}

#[test]
fn pyenv_3_11() {
    check_pyenv("3.11.7", 0, OffsetsSource::Table);
}

#[test]
fn pyenv_3_12() {
    check_pyenv("3.12.1", 0, OffsetsSource::Table);
}

#[test]
fn pyenv_3_13_from_its_debug_offsets() {
    check_pyenv("3.13.0", 1, OffsetsSource::DebugOffsets);
}

/// Debian's python3.11: not PIE, libpython linked in, `.symtab` stripped,
/// so the eval loop's cold part is found through `.eh_frame` alone.
#[test]
fn debians_static_stripped_python3_11() {
    let running = Running::python("/usr/bin/python3.11");
    let runtime = enabled(detect(running.pid()));
    assert_eq!(runtime.path, "/usr/bin/python3.11");
    assert_eq!(runtime.version.to_string(), "3.11.2");
    assert_eq!((runtime.bias, runtime.runtime_address, runtime.pycode_type), (0, 0xa5_b740, 0x95_9440));
    assert_eq!(runtime.eval_ranges, [0x52_b0f0..0x53_8a4c, 0x43_0f05..0x43_455e]);
    assert_eq!(runtime.tss_key, 0);
    assert_eq!(runtime.fsbase_offset, btf_fsbase_offset());
    assert_eq!(runtime.self_test, SelfTest { threads: 4, frames: 14, in_transit: 0 });
    assert_eq!(
        runtime.config,
        PyProcConfig {
            flags: PY_CFRAME | PY_ENTRY_FLAG,
            tss_key: 0,
            tsd_off: 0x310,
            tsd_l2_off: 0x510,
            pthread_below_tp: 0,
            ts_frame: 0x38,
            cframe_cur: 0x8,
            f_code: 0x20,
            f_back: 0x30,
            f_instr: 0x38,
            f_entry: 0x44,
            f_owner: 0,
            read_size: 0x48,
            _pad: 0,
            co_code: 0xb8,
            max_frames: 63,
            // co_firstlineno at 0x48, co_filename at 0x70, co_qualname
            // at 0x80.
            co_check: 0x48,
            co_check_size: 0x40,
            co_check_name: 0x38,
            co_check_file: 0x28,
            co_check_line: 0,
            _pad2: [0; 5],
        }
    );
    assert_eq!(
        runtime.to_string(),
        "python 3.11.2 (/usr/bin/python3.11): _PyRuntime 0xa5b740, TSS key 0 ok on 4/4 threads, \
         offsets from memleak's table checked via PyCode_Type"
    );
}

fn disabled(detection: Detection) -> String {
    match detection {
        Detection::Disabled(reason) => reason,
        other => panic!("expected Python frames disabled, got {other:?}"),
    }
}

#[test]
fn python_2_7_and_3_7_are_refused_by_version() {
    let running = Running::python("/root/.pyenv/versions/2.7.18/bin/python2.7");
    assert_eq!(
        disabled(detect(running.pid())),
        "CPython 2.7.18 (/root/.pyenv/versions/2.7.18/lib/libpython2.7.so.1.0) is not supported: \
         Python frames need CPython 3.8 to 3.13"
    );
    let running = Running::python("/root/.pyenv/versions/3.7.16/bin/python3.7");
    assert_eq!(
        disabled(detect(running.pid())),
        "CPython 3.7.16 (/root/.pyenv/versions/3.7.16/lib/libpython3.7m.so.1.0) is not supported: \
         Python frames need CPython 3.8 to 3.13"
    );
}

#[test]
fn a_process_that_is_not_python_is_left_alone() {
    let mut command = Command::new("sh");
    command.args(["-c", "echo ready; read line"]);
    let running = Running::start(command);
    assert!(matches!(detect(running.pid()), Detection::NotPython));
}

/// The checks catch a wrong offset rather than walk with it: each one
/// is given the live 3.12 interpreter and a table with one field wrong.
#[test]
fn a_wrong_offset_fails_the_checks() {
    let running = Running::python("/root/.pyenv/versions/3.12.1/bin/python3");
    let runtime = enabled(detect(running.pid()));
    let memory = ProcessMemory::open(running.pid()).unwrap();
    let version = runtime.version;
    let cross_checked = |offsets: &Offsets| {
        cross_check(&memory, runtime.pycode_type, runtime.pyunicode_type, version, offsets)
    };
    assert_eq!(cross_checked(&runtime.offsets), Ok(()));
    let mut wrong = runtime.offsets;
    wrong.code.firstlineno = 0x48;
    assert_eq!(cross_checked(&wrong), Err("co_firstlineno is at 0x44, not 0x48".to_owned()));
    let mut wrong = runtime.offsets;
    wrong.code.basic_size = 0xb8;
    assert_eq!(cross_checked(&wrong), Err("tp_basicsize is 0xc0, not 0xb8".to_owned()));
    let mut wrong = runtime.offsets;
    wrong.strings.compact_data = 0x48;
    assert_eq!(cross_checked(&wrong), Err("PyUnicode_Type's tp_basicsize is 0x40, not 0x50".to_owned()));

    let self_test = |offsets: &Offsets, key: u32| {
        let subject = thread_state::Subject {
            memory: &memory,
            runtime: runtime.runtime_address,
            offsets,
            key,
            pycode_type: runtime.pycode_type,
        };
        thread_state::self_test(&subject, thread_state::GLIBC)
    };
    assert_eq!(self_test(&runtime.offsets, 0), Ok(runtime.self_test));
    let error = self_test(&runtime.offsets, 1).unwrap_err();
    assert_eq!(error, "no thread's TSS key 1 slot holds its thread state");
    let mut wrong = runtime.offsets;
    wrong.thread.thread_id = 0x90; // native_thread_id: a tid, no pthread
    let error = self_test(&wrong, 0).unwrap_err();
    assert!(
        error.contains("cannot read a thread's glibc header") || error.contains("is not a glibc thread"),
        "{error}"
    );
    let mut wrong = runtime.offsets;
    wrong.frame.code = 0x10; // f_builtins: a dict
    let error = self_test(&wrong, 0).unwrap_err();
    assert!(error.contains("is not PyCode_Type"), "{error}");
}

/// glibc keeps keys below 32 in the thread's own block, others in blocks
/// it allocates: both read as the walk will, on this test's own thread.
#[test]
fn glibc_thread_specific_data_is_found_for_any_key() {
    let mut fsbase = 0u64;
    // SAFETY: ARCH_GET_FS writes the thread's fs base to the u64 given.
    assert_eq!(unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1003, &raw mut fsbase) }, 0);
    let memory = ProcessMemory::open(std::process::id()).unwrap();
    let mut keys = Vec::new();
    // Past 32 keys in all, whatever the process created before.
    while keys.last().is_none_or(|&key| key < 40) {
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: a new key, no destructor.
        assert_eq!(unsafe { libc::pthread_key_create(&raw mut key, None) }, 0);
        keys.push(key);
    }
    for &key in &keys {
        let value = 0x1000 + u64::from(key);
        // SAFETY: the key is live; the value is never dereferenced.
        assert_eq!(unsafe { libc::pthread_setspecific(key, value as *const libc::c_void) }, 0);
        assert_eq!(
            thread_state::tsd_value(&memory, thread_state::GLIBC, fsbase, key).unwrap(),
            value,
            "key {key}"
        );
    }
    for key in keys {
        // SAFETY: the key was created above and is deleted once.
        unsafe { libc::pthread_key_delete(key) };
    }
}

/// What detection says of `python -c pass` caught right after its exec.
fn detect_at_exec(python: &str) -> Detection {
    use std::os::unix::process::CommandExt as _;
    let mut command = Command::new(python);
    command.args(["-c", "pass"]);
    // SAFETY: ptrace(PTRACE_TRACEME) is async-signal-safe; the child then
    // stops at its execve with SIGTRAP.
    unsafe {
        command.pre_exec(|| {
            if libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = command.spawn().unwrap();
    let mut status = 0;
    // SAFETY: waits for this test's own child to stop.
    let waited = unsafe { libc::waitpid(child.id() as libc::pid_t, &raw mut status, 0) };
    assert_eq!(waited, child.id() as libc::pid_t);
    assert!(libc::WIFSTOPPED(status), "stopped at exec: {status:#x}");
    let detection = detect(child.id());
    let _ = child.kill();
    let _ = child.wait();
    detection
}

/// A process caught right after its exec: the interpreter is mapped, not
/// initialised. Detection says to try again, and does not disable.
#[test]
fn an_interpreter_not_initialised_yet_is_tried_later() {
    match detect_at_exec("/usr/bin/python3.11") {
        Detection::TryLater(reason) => {
            assert_eq!(reason, "the interpreter has not initialised its thread-state key yet");
        }
        other => panic!("expected TryLater, got {other:?}"),
    }
}

/// An executable linked with libpython, caught at its exec: only it and
/// its loader are mapped, not yet the libpython that holds the
/// interpreter. It is CPython to look for again, not a process without.
#[test]
fn an_interpreter_whose_libpython_is_not_loaded_yet_is_tried_later() {
    match detect_at_exec("/root/.pyenv/versions/3.12.1/bin/python3.12") {
        Detection::TryLater(reason) => assert_eq!(reason, "its libpython is not loaded yet"),
        other => panic!("expected TryLater, got {other:?}"),
    }
}

/// A container made as a runtime would (own mount and pid namespaces,
/// `pivot_root`), whose interpreter is at /app/bin/python3.11, a path the
/// host does not have: the file is opened through `/proc/PID/map_files`.
#[test]
fn an_interpreter_inside_a_container() {
    let root = std::env::temp_dir().join(format!("memleak-python-root-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let copy = |from: &Path, to: &str| {
        let to = root.join(to.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, &to).unwrap_or_else(|error| panic!("copy {}: {error}", from.display()));
    };
    copy(Path::new("/usr/bin/python3.11"), "/app/bin/python3.11");
    let listing =
        Command::new("/lib64/ld-linux-x86-64.so.2").args(["--list", "/usr/bin/python3.11"]).output().unwrap();
    for line in String::from_utf8_lossy(&listing.stdout).lines() {
        if let Some(path) = line.split_whitespace().rfind(|word| word.starts_with('/')) {
            copy(Path::new(path), path);
        }
    }
    // What the interpreter imports at startup with -S -I.
    for entry in std::fs::read_dir("/usr/lib/python3.11/encodings").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|extension| extension == "py") {
            copy(
                &path,
                &format!("/usr/lib/python3.11/encodings/{}", path.file_name().unwrap().to_string_lossy()),
            );
        }
    }
    // The landmarks of its prefix and exec prefix, or it says on stderr
    // that it cannot find them.
    copy(Path::new("/usr/lib/python3.11/os.py"), "/usr/lib/python3.11/os.py");
    std::fs::create_dir_all(root.join("usr/lib/python3.11/lib-dynload")).unwrap();
    std::fs::create_dir_all(root.join("proc")).unwrap();
    let script = "import sys\ndef main():\n    sys.stdout.write('ready\\n')\n    sys.stdout.flush()\n    sys.stdin.readline()\nmain()\n";
    let enter = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/enter-container.sh");
    let mut command = Command::new("unshare");
    command.args(["--mount", "--pid", "--fork", "--kill-child", "sh"]).arg(enter).arg(&root).args([
        "/app/bin/python3.11",
        "-S",
        "-I",
        "-c",
        script,
    ]);
    let running = Running::start(command);
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", running.pid())).unwrap();
    let pid: u32 = children.split_whitespace().next().expect("unshare's child").parse().unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(maps.contains(" /app/bin/python3.11\n"), "the process sees its interpreter at /app/bin: {maps}");
    assert!(!Path::new("/app/bin/python3.11").exists(), "and the host does not");
    let runtime = enabled(detect(pid));
    drop(running);
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(runtime.path, "/app/bin/python3.11");
    assert_eq!(runtime.version.to_string(), "3.11.2");
    assert_eq!(runtime.eval_ranges, [0x52_b0f0..0x53_8a4c, 0x43_0f05..0x43_455e]);
    // One thread, in main and <module>.
    assert_eq!(runtime.self_test, SelfTest { threads: 1, frames: 2, in_transit: 0 });
}

/// Threads that start and end all the time: a thread state in the list
/// whose thread is not running yet, or is gone, does not disable Python
/// frames for the whole process.
#[test]
fn threads_coming_and_going_do_not_fail_the_self_test() {
    const CHURN: &str = r"
import sys, threading
def nothing():
    pass
def churn():
    while True:
        thread = threading.Thread(target=nothing)
        thread.start()
        thread.join()
def main():
    for _ in range(2):
        thread = threading.Thread(target=churn)
        thread.daemon = True
        thread.start()
    sys.stdout.write('ready\n')
    sys.stdout.flush()
    sys.stdin.readline()
main()
";
    // Debian's 3.11: a thread state is filled in by the thread creating
    // it, with the creator's thread_id, until the new thread runs.
    let mut command = Command::new("/usr/bin/python3.11");
    command.args(["-c", CHURN]);
    let running = Running::start(command);
    let mut seen_in_transit = 0;
    // About every other detection meets a thread starting or ending.
    for _ in 0..100 {
        let runtime = enabled(detect(running.pid()));
        assert!(runtime.self_test.threads >= 3, "the main and churning threads: {:?}", runtime.self_test);
        seen_in_transit += usize::from(runtime.self_test.in_transit > 0);
        if seen_in_transit == 3 {
            break;
        }
    }
    assert_eq!(seen_in_transit, 3, "threads in transit were met");
}

/// A process looked at while its loader has mapped the interpreter and
/// not yet libc, and checked once the interpreter has initialised (it
/// runs on while its files are read): its libc is found, not missed for
/// good.
#[test]
fn an_interpreter_read_before_libc_is_mapped_is_checked_with_its_libc() {
    use std::os::unix::process::CommandExt as _;
    let mut command = Command::new("/usr/bin/python3.11");
    command.args(["-c", "import sys; print('ready', flush=True); sys.stdin.readline()"]);
    command.stdin(Stdio::piped()).stdout(Stdio::piped());
    // SAFETY: ptrace(PTRACE_TRACEME) is async-signal-safe; the child then
    // stops at its execve with SIGTRAP.
    unsafe {
        command.pre_exec(|| {
            if libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = command.spawn().unwrap();
    let pid = child.id();
    let mut status = 0;
    // SAFETY: waits for this test's own child to stop.
    let waited = unsafe { libc::waitpid(pid as libc::pid_t, &raw mut status, 0) };
    assert_eq!(waited, pid as libc::pid_t);
    assert!(libc::WIFSTOPPED(status), "stopped at exec: {status:#x}");
    let Ok(found) = inspect_files(pid) else { panic!("the interpreter is mapped at exec") };
    // SAFETY: lets this test's own stopped child run on.
    assert_eq!(unsafe { libc::ptrace(libc::PTRACE_DETACH, pid as libc::pid_t, 0, 0) }, 0);
    let mut ready = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut ready).unwrap();
    assert_eq!(ready, "ready\n");
    let checked = check_interpreter(pid, found);
    drop(child.stdin.take());
    child.wait().unwrap();
    if let Err(refused) = checked {
        panic!("expected the interpreter enabled, got {refused:?}");
    }
}
