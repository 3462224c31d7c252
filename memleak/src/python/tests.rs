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
/// stdin in `main`; "ready" once every thread is in `sleeper`. Python 2
/// runs it too.
const THREE_SLEEPERS: &str = r"
import sys, threading, time
def sleeper(started):
    started.set()
    time.sleep(3600)
def main():
    events = [threading.Event() for _ in range(3)]
    for started in events:
        threading.Thread(target=sleeper, args=(started,)).daemon = True
    threads = [threading.Thread(target=sleeper, args=(started,)) for started in events]
    for thread in threads:
        thread.daemon = True
        thread.start()
    for started in events:
        started.wait()
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
    assert_eq!(runtime.self_test, SelfTest { threads: 4, frames: 14 });
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
    assert_eq!(runtime.self_test, SelfTest { threads: 4, frames: 14 });
    assert_eq!(
        runtime.config,
        PyProcConfig {
            flags: PY_CFRAME | PY_ENTRY_FLAG,
            tss_key: 0,
            tsd_off: 0x310,
            tsd_l2_off: 0x510,
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
            max_frames: 64,
            _pad2: 0,
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
