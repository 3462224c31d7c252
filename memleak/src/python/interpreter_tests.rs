//! Code objects read from live interpreters, checked against what the
//! interpreter itself says: every CPython the machine image has under
//! pyenv (3.8 to 3.13, each with a shared libpython) and Debian's
//! python3.11 (static, not PIE).
//!
//! Each test starts the interpreter on a script that prints, for every code
//! object of its own file and of two it compiles, the address, type
//! address, name, file and the line of every instruction as CPython
//! computes it (`co_lines()` from 3.10, `dis.findlinestarts` before), with
//! each instruction given as that version's frames count it; then it waits
//! on stdin while the test reads its memory.

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use serde_json::Value;

use super::code::{CodeCache, CodeLayout, PyFrame, Unnamed};
use super::line_table::Instruction;

/// Its names cover every kind of str: ASCII, Latin-1 (`grüße`, and `é` in
/// its own file name), UCS-2 (`Класс.функция`, `/tmp/файл.py`) and UCS-4
/// (`𐌰𐌱`, `/tmp/🐍 snake.py`).
const SCRIPT: &str = r#"import dis, json, sys, types


def plain(n):
    total = 0
    for i in range(n):
        if i % 2:
            total += i
    return total


def grüße(name):
    return "grüße, " + name


class Класс:
    def функция(self, x):
        try:
            return 1 / x
        except ZeroDivisionError:
            return None


def 𐌰𐌱():
    return [x * 2 for x in range(3)]


def generator():
    yield 1
    yield 2


square = lambda x: x * x


def outer():
    def inner():
        return outer
    return inner


def codes(code):
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from codes(constant)


def lines(code):
    """[lasti, line] for every instruction, lasti as this version's frames
    count it (bytes before 3.10, code units from 3.10) and the line as
    CPython says (None: no line)."""
    if sys.version_info >= (3, 10):
        return [[offset // 2, line] for start, end, line in code.co_lines() for offset in range(start, end, 2)]
    starts = dict(dis.findlinestarts(code))
    line, out = code.co_firstlineno, []
    for offset in range(0, len(code.co_code), 2):
        line = starts.get(offset, line)
        out.append([offset, line])
    return out


KEEP = list(codes(sys._getframe().f_code))
KEEP += codes(compile("def ssss(a):\n    b = a + 1\n\n    return b\n", "/tmp/🐍 snake.py", "exec"))
KEEP += codes(compile("x = 1\ny = [x]\n", "/tmp/файл.py", "exec"))
NOT_CODE = [b"bytes, not code", "a str", plain, Класс]
print(json.dumps({
    "version": list(sys.version_info[:2]),
    "code_type": id(types.CodeType),
    "codes": [{
        "address": id(code),
        "name": getattr(code, "co_qualname", code.co_name),
        "file": code.co_filename,
        "first_line": code.co_firstlineno,
        "lines": lines(code),
    } for code in KEEP],
    "not_code": [id(thing) for thing in NOT_CODE],
}), flush=True)
sys.stdin.read()
"#;

/// The script's file name, with a Latin-1 character in it.
const SCRIPT_NAME: &str = "café_grüße.py";

/// The interpreter running the script, killed when the test ends, and the
/// directory it runs from, removed.
struct Interpreter {
    child: Child,
    dir: PathBuf,
}

impl Drop for Interpreter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts `python` on [`SCRIPT`] and returns it with what it printed.
fn start(python: &str, tag: &str) -> (Interpreter, Value) {
    assert!(
        std::path::Path::new(python).exists(),
        "{python} is not installed: these tests need the interpreters of the machine image"
    );
    let dir = std::env::temp_dir().join(format!("memleak-python-code-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join(SCRIPT_NAME);
    std::fs::write(&script, SCRIPT).unwrap();
    let child = Command::new(python)
        .arg(&script)
        // The file name is UTF-8 whatever the test's locale.
        .env("PYTHONUTF8", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {python}: {error}"));
    let mut interpreter = Interpreter { child, dir };
    let mut line = String::new();
    BufReader::new(interpreter.child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let printed =
        serde_json::from_str(&line).unwrap_or_else(|error| panic!("{python} printed {line:?}: {error}"));
    (interpreter, printed)
}

fn u64_of(value: &Value) -> u64 {
    value.as_u64().unwrap_or_else(|| panic!("not an address: {value}"))
}

/// Reads every code object the script listed out of its memory, and
/// checks that each instruction resolves to CPython's own name, file and
/// line, that a frame not started is on the first line, and that objects
/// that are not code are refused.
fn check_interpreter(python: &str, minor: u8) {
    let (interpreter, printed) = start(python, &python.replace('/', "_"));
    assert_eq!(printed["version"], serde_json::json!([3, minor]), "{python}");
    let layout = CodeLayout::for_version(minor, u64_of(&printed["code_type"])).unwrap();
    let mut cache = CodeCache::open(interpreter.child.id(), layout).unwrap();
    let mut mismatches = String::new();
    let mut names = Vec::new();
    let mut instructions = 0;
    for code in printed["codes"].as_array().unwrap() {
        let address = u64_of(&code["address"]);
        let function: Arc<str> = code["name"].as_str().unwrap().into();
        let file: Arc<str> = code["file"].as_str().unwrap().into();
        let first_line = i32::try_from(code["first_line"].as_i64().unwrap()).unwrap();
        names.push((function.to_string(), file.to_string()));
        let expect = |line| PyFrame::Code { function: function.clone(), file: file.clone(), line };
        let mut check = |lasti: i64, line: Option<i32>| {
            let got = cache.resolve(address, Instruction::from_lasti(minor, lasti));
            if got != expect(line) {
                let _ =
                    writeln!(mismatches, "{address:#x} lasti {lasti}: expected {}, got {got}", expect(line));
            }
        };
        check(-1, Some(first_line));
        for pair in code["lines"].as_array().unwrap() {
            let line = pair[1].as_i64().map(|line| i32::try_from(line).unwrap());
            check(pair[0].as_i64().unwrap(), line);
            instructions += 1;
        }
    }
    assert!(
        mismatches.is_empty(),
        "{python}: {} mismatches over {instructions} instructions:\n{mismatches}",
        mismatches.lines().count()
    );
    // What the test covers: enough instructions, and names of each kind.
    assert!(instructions > 300, "{python}: only {instructions} instructions");
    let script_path = interpreter.dir.join(SCRIPT_NAME).display().to_string();
    let method = if minor >= 11 { "Класс.функция" } else { "функция" };
    for (function, file) in [
        ("grüße", &*script_path),
        (method, &script_path),
        ("𐌰𐌱", &script_path),
        ("ssss", "/tmp/🐍 snake.py"),
        ("<module>", "/tmp/файл.py"),
    ] {
        assert!(
            names.contains(&(function.into(), file.into())),
            "{python}: no {function} of {file} in {names:?}"
        );
    }
    let cached = cache.len();
    assert_eq!(cached, names.len(), "{python}: every code object read and kept");
    for thing in printed["not_code"].as_array().unwrap().iter().map(u64_of).chain([8]) {
        let got = cache.resolve(thing, Instruction::Unit(3));
        assert_eq!(
            got,
            PyFrame::Unknown { code: thing, instruction: Instruction::Unit(3), why: Unnamed::Freed },
            "{python}: {thing:#x}"
        );
        assert_eq!(got.to_string(), format!("<freed code {thing:#x} +3>"));
    }
}

#[test]
fn python_3_8_code_objects_resolve_as_cpython_says() {
    check_interpreter("/root/.pyenv/versions/3.8.18/bin/python3", 8);
}

#[test]
fn python_3_9_code_objects_resolve_as_cpython_says() {
    check_interpreter("/root/.pyenv/versions/3.9.18/bin/python3", 9);
}

#[test]
fn python_3_10_code_objects_resolve_as_cpython_says() {
    check_interpreter("/root/.pyenv/versions/3.10.13/bin/python3", 10);
}

#[test]
fn python_3_11_code_objects_resolve_as_cpython_says() {
    check_interpreter("/root/.pyenv/versions/3.11.7/bin/python3", 11);
}

#[test]
fn python_3_12_code_objects_resolve_as_cpython_says() {
    check_interpreter("/root/.pyenv/versions/3.12.1/bin/python3", 12);
}

#[test]
fn python_3_13_code_objects_resolve_as_cpython_says() {
    check_interpreter("/root/.pyenv/versions/3.13.0/bin/python3", 13);
}

#[test]
fn debian_python_3_11_code_objects_resolve_as_cpython_says() {
    check_interpreter("/usr/bin/python3.11", 11);
}
