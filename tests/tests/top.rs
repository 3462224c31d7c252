//! `memleak top` in a real terminal (tmux): the growing stack found
//! beside a larger cache that holds still, opened, filtered, saved and
//! diffed; the same view of a daemon's process; and the terminal given
//! back as it was.

use std::{fs, process::Command};

use memleak_tests::{
    fixture, http, marker_line, memleak_binary,
    tempdir::TempDir,
    tmux::{wait_for_file, Tmux},
};

/// The window: the 80x24 a terminal starts with.
const WIDTH: u16 = 80;
const HEIGHT: u16 = 24;

/// The table's rows, the selected one marked `>`: the lines after the
/// column titles, but the status line.
fn rows(screen: &str) -> Vec<&str> {
    let lines: Vec<&str> = screen.lines().collect();
    let Some(titles) = lines.iter().position(|line| line.contains("BYTES") && line.contains("CULPRIT"))
    else {
        return Vec::new();
    };
    lines[titles + 1..lines.len().saturating_sub(1)]
        .iter()
        .copied()
        .filter(|line| line.starts_with("> ") || line.starts_with("  ") && !line.starts_with("      "))
        .filter(|line| !line.trim().is_empty())
        .collect()
}

fn first_row(screen: &str) -> &str {
    rows(screen).first().copied().unwrap_or("")
}

/// A row's growth column.
fn growth_of(row: &str) -> &str {
    row.trim_start_matches('>').split_whitespace().nth(3).unwrap_or("")
}

/// A script that runs `memleak top` on the growth fixture's cache-leak in
/// `directory`, keeping `stty -a` before and after, and its status.
fn top_of_cache_leak(directory: &std::path::Path) -> String {
    format!(
        "cd {dir} && stty -a > before && {memleak} top -c \"{growth} cache-leak 64\" 1; echo $? > status; \
         stty -a > after; sleep 600",
        dir = quoted(directory),
        memleak = quoted(&memleak_binary()),
        growth = fixture("growth").display(),
    )
}

/// `path` quoted for the shell: a test's directory has parentheses.
fn quoted(path: &std::path::Path) -> String {
    format!("'{}'", path.display())
}

/// The cache's row: 128 blocks of 64 KiB, exactly.
fn assert_cache_row(screen: &str) {
    let cache =
        rows(screen).into_iter().find(|row| row.contains("fill_cache")).unwrap_or_else(|| panic!("{screen}"));
    let fields: Vec<&str> = cache.trim_start_matches('>').split_whitespace().collect();
    assert_eq!(&fields[..3], ["8.0", "MiB", "128"], "{cache}");
}

#[test]
fn the_live_view_finds_the_leak_opens_filters_saves_diffs_and_gives_the_terminal_back() {
    let directory = TempDir::new("memleak-top");
    let tmux = Tmux::start("live", WIDTH, HEIGHT, &top_of_cache_leak(directory.path()));
    let leak_line = marker_line("growth", "slow-leak");
    // By growth, the leak comes first once it has grown over a round;
    // the cache holds more, and still.
    let screen = tmux.wait_for("the leak first", |screen| {
        first_row(screen).contains("leak_slowly")
            && growth_of(first_row(screen)).starts_with('+')
            && rows(screen).iter().any(|row| row.contains("fill_cache"))
    });
    // The culprit's file is cut from the left to fit 80 columns, never
    // its line.
    assert!(first_row(&screen).trim_end().ends_with(&format!("growth.c:{leak_line})")), "{screen}");
    assert!(growth_of(first_row(&screen)).starts_with('+'), "the leak grows: {screen}");
    assert_cache_row(&screen);
    assert!(screen.contains("order: growth"), "{screen}");

    // By bytes, the cache.
    tmux.send(&["o"]);
    let screen = tmux.wait_for("the cache first", |screen| {
        screen.contains("order: bytes") && first_row(screen).contains("fill_cache")
    });
    assert!(first_row(&screen).contains("fill_cache"), "{screen}");

    // Opened: its frames, the cache's allocation line and main's.
    tmux.send(&["Enter"]);
    let cache_line = marker_line("growth", "cache");
    let screen = tmux.wait_for("the cache's frames", |screen| {
        screen.contains("      fill_cache+0x") && screen.lines().any(|line| line.starts_with("      main+0x"))
    });
    assert!(screen.contains(&format!("growth.c:{cache_line})")), "{screen}");
    assert!(screen.lines().any(|line| line.starts_with("      main+0x")), "{screen}");

    // Filtered to the leak.
    tmux.send(&["/"]);
    tmux.type_text("leak_slowly");
    tmux.send(&["Enter"]);
    let screen = tmux.wait_for("the filter", |screen| {
        screen.contains("filter: leak_slowly") && !rows(screen).iter().any(|row| row.contains("fill_cache"))
    });
    let shown = rows(&screen);
    assert_eq!(shown.len(), 1, "{screen}");
    assert!(shown[0].contains("leak_slowly"), "{screen}");
    tmux.send(&["Escape"]);
    tmux.wait_for("the filter gone", |screen| !screen.contains("filter:") && screen.contains("fill_cache"));

    // Saved, then diffed against as the leak goes on: only the leak
    // changed.
    tmux.send(&["s"]);
    let saved = directory.path().join("memleak.1.snap");
    tmux.wait_for("the save", |screen| screen.contains("saved memleak.1.snap"));
    assert!(saved.exists());
    tmux.send(&["d"]);
    let screen = tmux.wait_for("the diff", |screen| {
        screen.contains("order: growth since memleak.1.snap")
            && first_row(screen).contains("leak_slowly")
            && growth_of(first_row(screen)).starts_with('+')
            && !screen.contains("fill_cache")
    });
    assert!(screen.contains("SINCE SAVE"), "{screen}");
    assert!(first_row(&screen).contains("leak_slowly"), "{screen}");
    assert!(!screen.contains("fill_cache"), "the cache did not change: {screen}");

    // q: out, with the terminal as it was.
    tmux.send(&["q"]);
    assert_eq!(wait_for_file(&directory.path().join("status")), "0\n");
    let after = wait_for_file(&directory.path().join("after"));
    assert_eq!(fs::read_to_string(directory.path().join("before")).unwrap(), after, "stty -a changed");
}

#[test]
fn connect_shows_a_daemons_process_and_a_wrong_token_is_one_line() {
    let directory = TempDir::new("memleak-top-connect");
    let mut leaking = Running(
        Command::new(fixture("growth"))
            .args(["cache-leak", "64"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start growth"),
    );
    let mut said = memleak_tests::Lines::new(leaking.0.stdout.take().expect("its stdout"));
    said.wait_for("the cache", |line| line == "cache full");
    let token = directory.path().join("token");
    fs::write(&token, "a-token-long-enough-for-memleak\n").unwrap();
    let wrong = directory.path().join("wrong");
    fs::write(&wrong, "not-the-token-the-daemon-wants\n").unwrap();
    let pid = leaking.0.id().to_string();
    let (daemon, port) =
        http::serve(&["--pid", &pid, "--token-file", token.to_str().unwrap(), "--interval", "1"]);
    let url = format!("http://127.0.0.1:{port}");
    let memleak = quoted(&memleak_binary());
    let dir = quoted(directory.path());
    let script = format!(
        "cd {dir} && {memleak} top --connect {url} --token-file {wrong} 2> refused; echo $? > refused-status; \
         stty -a > before && {memleak} top --connect {url} --token-file {token} 1; echo $? > status; \
         stty -a > after; sleep 600",
        wrong = quoted(&wrong),
        token = quoted(&token),
    );
    let tmux = Tmux::start("connect", WIDTH, HEIGHT, &script);
    assert_eq!(wait_for_file(&directory.path().join("refused-status")), "2\n");
    assert_eq!(
        fs::read_to_string(directory.path().join("refused")).unwrap(),
        format!("memleak: error: {url} refused the token of --token-file\n")
    );
    let screen = tmux.wait_for("the daemon's leak first", |screen| {
        first_row(screen).contains("leak_slowly") && growth_of(first_row(screen)).starts_with('+')
    });
    assert!(screen.contains(&format!("memleak top · {url} · pid {pid} growth")), "{screen}");
    // The cache was filled before the daemon attached: not seen.
    assert!(!screen.contains("fill_cache"), "{screen}");
    tmux.send(&["C-c"]);
    assert_eq!(wait_for_file(&directory.path().join("status")), "0\n");
    let after = wait_for_file(&directory.path().join("after"));
    assert_eq!(fs::read_to_string(directory.path().join("before")).unwrap(), after, "stty -a changed");
    http::stop(daemon);
}

/// A process the test started, killed when the test ends, however.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn without_a_terminal_top_prints_the_plain_reports() {
    let growth = fixture("growth");
    let command = format!("{} cache-leak 64", growth.display());
    let mut memleak = memleak_tests::Memleak::start(&["top", "-c", &command, "1"]);
    let line = memleak.stdout.wait_for("a text report", |line| line.contains("fill_cache+0x"));
    assert!(line.contains("growth.c"), "{line}");
    memleak.signal(libc::SIGINT);
    let status = memleak.child.wait().expect("wait for memleak");
    assert!(status.success(), "{status}");
}

#[test]
fn sigterm_and_the_last_process_exiting_give_the_terminal_back() {
    let directory = TempDir::new("memleak-top-ends");
    let growth = fixture("growth");
    // `exec`: the pid written is memleak's.
    let script = format!(
        "cd {dir} && stty -a > before; sh -c 'echo $$ > pid; exec {memleak} top -c \"{growth} cache-leak 64\" 1'; \
         echo $? > status; stty -a > after; \
         clear; {memleak} top -c 'sleep 1' 1; echo $? > exited-status; stty -a > after-exit; sleep 600",
        dir = quoted(directory.path()),
        memleak = quoted(&memleak_binary()),
        growth = growth.display(),
    );
    let tmux = Tmux::start("ends", WIDTH, HEIGHT, &script);
    tmux.wait_for("the view", |screen| screen.contains("leak_slowly"));
    let pid: libc::pid_t = wait_for_file(&directory.path().join("pid")).trim().parse().unwrap();
    // SAFETY: kill(2) on the memleak this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert_eq!(wait_for_file(&directory.path().join("status")), "0\n");
    let before = fs::read_to_string(directory.path().join("before")).unwrap();
    assert_eq!(before, wait_for_file(&directory.path().join("after")), "stty -a changed");
    // The command exits by itself: memleak top ends, and its last report
    // is printed once the terminal is given back.
    assert_eq!(wait_for_file(&directory.path().join("exited-status")), "0\n");
    assert_eq!(before, wait_for_file(&directory.path().join("after-exit")), "stty -a changed");
    let screen = tmux.wait_for("the last report", |screen| {
        screen.contains("exited, the last traced; its last report is above")
    });
    assert!(screen.lines().any(|line| line.starts_with("Outstanding: ")), "{screen}");
}
