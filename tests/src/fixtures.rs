//! The programs the tests trace: C and C++ fixtures from tests/fixtures,
//! compiled on demand, and what the tests read off them.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, PoisonError},
    thread,
};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is in the workspace").to_path_buf()
}

/// Compiles tests/fixtures/NAME.c or NAME.cpp (unoptimised, with frame
/// pointers, as a debug build would be) and returns the executable.
pub fn fixture(name: &str) -> PathBuf {
    let (source, compiler) = source_of(name);
    compile(compiler, &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread"], &source, name)
}

/// Compiles tests/fixtures/NAME.c or NAME.cpp as a release build would
/// be: -O2 and no frame pointers, with debug info for the names of its
/// lines. Built as NAME-O2.
pub fn optimized(name: &str) -> PathBuf {
    let (source, compiler) = source_of(name);
    compile(compiler, &["-g", "-O2", "-fomit-frame-pointer", "-pthread"], &source, &format!("{name}-O2"))
}

/// As `optimized`, linked with `library` too (a path: Debian's allocator
/// libraries have no development symlink), which the program's link map
/// then lists before the C++ runtime and the C library. Built as
/// NAME-O2-LIBRARY.
pub fn optimized_linked(name: &str, library: &Path) -> PathBuf {
    let (source, compiler) = source_of(name);
    let file = library.file_name().and_then(|file| file.to_str()).expect("a library file");
    let output = format!("{name}-O2-{file}");
    compile_linked(compiler, &["-g", "-O2", "-fomit-frame-pointer", "-pthread"], &source, &[library], &output)
}

/// Compiles tests/fixtures/NAME.c into a shared library, libNAME.so,
/// with -O2 and no frame pointers.
pub fn shared_library(name: &str) -> PathBuf {
    let (source, compiler) = source_of(name);
    compile(
        compiler,
        &["-g", "-O2", "-fomit-frame-pointer", "-fPIC", "-shared"],
        &source,
        &format!("lib{name}.so"),
    )
}

/// tests/fixtures/NAME.c, or NAME.cpp, and its compiler.
fn source_of(name: &str) -> (PathBuf, &'static str) {
    let c_source = workspace_root().join(format!("tests/fixtures/{name}.c"));
    if c_source.exists() {
        (c_source, "gcc")
    } else {
        (c_source.with_extension("cpp"), "g++")
    }
}

/// The leaker built against musl (Debian's musl-tools) instead of glibc.
pub fn musl_leaker() -> PathBuf {
    let source = workspace_root().join("tests/fixtures/leaker.c");
    compile("musl-gcc", &["-g", "-O0", "-fno-omit-frame-pointer"], &source, "leaker-musl")
}

/// The leaker linked statically against glibc: malloc, mmap and
/// `pthread_create` live in the binary itself.
pub fn static_leaker() -> PathBuf {
    let source = workspace_root().join("tests/fixtures/leaker.c");
    compile("gcc", &["-g", "-O0", "-fno-omit-frame-pointer", "-pthread", "-static"], &source, "leaker-static")
}

/// Compiles tests/fixtures/NAME.c linked statically and stripped: no
/// symbol names its allocator, and memleak cannot trace it. Built as
/// NAME-static-stripped.
pub fn static_stripped(name: &str) -> PathBuf {
    let (source, compiler) = source_of(name);
    compile(compiler, &["-O1", "-static", "-s"], &source, &format!("{name}-static-stripped"))
}

/// Builds the Go program in tests/fixtures/NAME with Debian's golang-go,
/// into target/fixtures/NAME.
pub fn go_program(name: &str) -> PathBuf {
    let dir = workspace_root().join("target/fixtures");
    fs::create_dir_all(&dir).expect("create target/fixtures");
    let output = dir.join(name);
    let private = dir.join(format!("{name}.{}.{:?}", std::process::id(), thread::current().id()));
    let status = Command::new("go")
        .args(["build", "-o"])
        .arg(&private)
        .arg("main.go")
        .current_dir(workspace_root().join("tests/fixtures").join(name))
        // A lone file, no module: nothing to download.
        .env("GO111MODULE", "off")
        .status()
        .unwrap_or_else(|error| panic!("run go (cargo xtask test installs golang-go): {error}"));
    assert!(status.success(), "go build failed on tests/fixtures/{name}");
    fs::rename(&private, &output).expect("rename fixture");
    output
}

/// Copies the executable `from` to `to` with `cp`, not from this process.
/// A file this process writes stays open for writing in every child any
/// test thread forks meanwhile, until that child's exec closes it, and
/// running the copy in that moment fails with ETXTBSY (the `containers`
/// test of a deleted binary failed so in a full run).
pub fn copy_executable(from: &Path, to: &Path) {
    let status = Command::new("cp").arg(from).arg(to).status().expect("run cp");
    assert!(status.success(), "cp {} {}", from.display(), to.display());
}

/// Moves `program`'s debug information into a file of its own beside it,
/// `PROGRAM.debug`, that its `.gnu_debuglink` names, as distributions
/// ship them; `strip` is how much `strip` takes out of the program
/// (`--strip-debug`, `--strip-all`). Returns the debug file.
pub fn split_debug_file(program: &Path, strip: &str) -> PathBuf {
    let debug_file = program.with_extension("debug");
    let run = |command: &mut Command| assert!(command.status().unwrap().success(), "{command:?}");
    run(Command::new("objcopy").arg("--only-keep-debug").arg(program).arg(&debug_file));
    run(Command::new("strip").arg(strip).arg(program));
    run(Command::new("objcopy").arg(format!("--add-gnu-debuglink={}", debug_file.display())).arg(program));
    debug_file
}

/// The Rust program of tests/fixtures/rust-jemalloc, a release build with
/// Cargo's defaults (no frame pointers, no line tables) that allocates
/// through tikv-jemallocator: the build with line tables, stripped of
/// them. Debug information changes no code, and building jemalloc twice,
/// once per profile, took more than a minute of the suite.
pub fn rust_jemalloc() -> PathBuf {
    // Once per test process: a fixture must never be replaced under a
    // process another test started from it (see `compile`).
    static STRIPPED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    STRIPPED.get_or_init(strip_rust_jemalloc).clone()
}

fn strip_rust_jemalloc() -> PathBuf {
    let with_lines = rust_jemalloc_with_line_tables();
    let stripped = workspace_root().join("target/fixtures/rust-jemalloc/stripped");
    std::fs::create_dir_all(&stripped).expect("create target/fixtures/rust-jemalloc/stripped");
    let program = stripped.join("rust-jemalloc");
    // Under a private name, then renamed: no test runs a half-written file.
    let private = stripped.join(format!("rust-jemalloc.{}", std::process::id()));
    let status = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(&with_lines)
        .arg(&private)
        .status()
        .expect("run objcopy (binutils)");
    assert!(status.success(), "objcopy --strip-debug {} failed", with_lines.display());
    std::fs::rename(&private, &program).expect("rename the stripped program");
    program
}

/// The same program built with line tables (its `release-lines` profile),
/// as services that want `file:line` in their panics build it: inlined
/// frames, named as the source writes them.
pub fn rust_jemalloc_with_line_tables() -> PathBuf {
    rust_jemalloc_built("release-lines")
}

fn rust_jemalloc_built(profile: &str) -> PathBuf {
    let manifest = workspace_root().join("tests/fixtures/rust-jemalloc/Cargo.toml");
    let target_dir = workspace_root().join("target/fixtures/rust-jemalloc");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(["build", "--quiet", "--profile", profile, "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target_dir)
        .env_remove("RUSTFLAGS")
        .status()
        .expect("run cargo");
    assert!(status.success(), "building the tikv-jemallocator fixture ({profile}) failed");
    target_dir.join(profile).join("rust-jemalloc")
}

/// Compiles `source` with `compiler` and `flags` into target/fixtures/NAME.
/// Tests run in parallel: each builds under a private name, then renames,
/// so that no test ever runs a half-written file.
/// Compiles `source` to target/fixtures/`name`, once per test process:
/// a test's fixture must never be replaced under a process another test
/// started from it, or the kernel would name that process's program
/// "... (deleted)".
fn compile(compiler: &str, flags: &[&str], source: &Path, name: &str) -> PathBuf {
    compile_linked(compiler, flags, source, &[], name)
}

/// Set by `cargo xtask kernels`: a fixture built already (by the host's
/// run of the tests, just before) and newer than its source is used as it
/// is. In an emulated kernel, compiling it again took most of a test's
/// time.
pub const REUSE_FIXTURES: &str = "MEMLEAK_TESTS_REUSE_FIXTURES";

fn newer_than(output: &Path, source: &Path) -> bool {
    let modified = |path: &Path| fs::metadata(path).and_then(|metadata| metadata.modified()).ok();
    matches!((modified(output), modified(source)), (Some(output), Some(source)) if output > source)
}

/// As `compile`, linking `libraries` after the source.
fn compile_linked(compiler: &str, flags: &[&str], source: &Path, libraries: &[&Path], name: &str) -> PathBuf {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(output) = built.get(name) {
        return output.clone();
    }
    let dir = workspace_root().join("target/fixtures");
    fs::create_dir_all(&dir).expect("create target/fixtures");
    let output = dir.join(name);
    if std::env::var_os(REUSE_FIXTURES).is_some() && newer_than(&output, source) {
        built.insert(name.to_owned(), output.clone());
        return output;
    }
    let private = dir.join(format!("{name}.{}.{:?}", std::process::id(), thread::current().id()));
    let status = Command::new(compiler)
        .args(flags)
        .arg("-o")
        .arg(&private)
        .arg(source)
        .args(libraries)
        .status()
        .unwrap_or_else(|error| panic!("run {compiler} (cargo xtask test installs it): {error}"));
    assert!(status.success(), "{compiler} failed on {}", source.display());
    fs::rename(&private, &output).expect("rename fixture");
    built.insert(name.to_owned(), output.clone());
    output
}

/// The line of the fixture NAME.c that carries `/* ALLOC(marker) */`.
pub fn marker_line(name: &str, marker: &str) -> u64 {
    let (path, _) = source_of(name);
    let source = fs::read_to_string(&path).unwrap();
    let needle = format!("ALLOC({marker})");
    let index = source.lines().position(|line| line.contains(&needle));
    index.unwrap_or_else(|| panic!("no {needle} in {}", path.display())) as u64 + 1
}

/// The GNU build id of an ELF file, in hex, as readelf prints it.
pub fn build_id(binary: &Path) -> String {
    let output = Command::new("readelf").arg("-n").arg(binary).output().expect("run readelf");
    let notes = String::from_utf8_lossy(&output.stdout);
    let line = notes.lines().find_map(|line| line.trim().strip_prefix("Build ID: "));
    line.unwrap_or_else(|| panic!("{} has no build id: {notes}", binary.display())).to_owned()
}

/// Runs `program args` (a tool `cargo xtask test` installs); fails the
/// test with its output unless it succeeded.
pub fn run_ok<A: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    program: &str,
    args: &[A],
) -> std::process::Output {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("cannot run {program} (`cargo xtask test` installs it): {error}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}
