//! Files made to hurt whoever reads them: a snapshot that inflates to a
//! gigabyte is refused with one line, in bounded memory, by a user
//! without privileges.

use std::{
    io::Write as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use memleak_tests::{memleak_binary, tempdir::TempDir};

/// The address space memleak may take: a reader that held what the bomb
/// inflates to would need four times as much.
const ADDRESS_SPACE: u64 = 300 << 20;

/// A gzip bomb: a valid snapshot header, then a report whose `program` is
/// a string of 1 GiB, gzipped by gzip(1) to about 5 MB.
fn string_bomb(dir: &Path) -> PathBuf {
    let path = dir.join("bomb.snap");
    let file = std::fs::File::create(&path).expect("create the bomb");
    let mut gzip =
        Command::new("gzip").arg("-1").stdin(Stdio::piped()).stdout(file).spawn().expect("run gzip");
    let mut input = gzip.stdin.take().unwrap();
    input
        .write_all(b"{\"format\":\"memleak-snapshot\",\"version\":1,\"written_by\":\"0.1.0\"}\n{\"pid\":1,\"program\":\"")
        .unwrap();
    let filler = vec![b'A'; 1 << 20];
    for _ in 0..1024 {
        input.write_all(&filler).expect("feed gzip");
    }
    drop(input);
    assert!(gzip.wait().unwrap().success(), "gzip failed");
    path
}

/// Runs `memleak ARGS` as user nobody, its address space limited to
/// `ADDRESS_SPACE`; returns its exit code and stderr.
fn run_limited(args: &[&str]) -> (Option<i32>, String) {
    let mut command = Command::new(memleak_binary());
    command.args(args).stdin(Stdio::null()).uid(65534).gid(65534);
    // SAFETY: setrlimit is async-signal-safe, and the hook touches nothing
    // else of the parent.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: ADDRESS_SPACE, rlim_max: ADDRESS_SPACE };
            if libc::setrlimit(libc::RLIMIT_AS, &raw const limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command.output().expect("run memleak");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

fn assert_refused(args: &[&str], bomb: &Path) {
    let (code, stderr) = run_limited(args);
    let expected = format!(
        "memleak: error: {} is not a memleak snapshot (written with --save): it holds a value over 1 MiB long\n",
        bomb.display()
    );
    assert_eq!(
        (code, stderr.as_str()),
        (Some(2), expected.as_str()),
        "memleak {args:?} in {} MiB of address space",
        ADDRESS_SPACE >> 20
    );
}

#[test]
fn a_gzip_bomb_is_refused_in_bounded_memory() {
    let dir = TempDir::new("memleak-hostile");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let bomb = string_bomb(dir.path());
    let compressed = std::fs::metadata(&bomb).unwrap().len();
    assert!(compressed < 8 << 20, "the bomb is small: {compressed} bytes");
    let path = bomb.to_str().unwrap();
    assert_refused(&["report", path], &bomb);
    assert_refused(&["report", path, "--format", "folded"], &bomb);
    assert_refused(&["diff", path, path], &bomb);
}
