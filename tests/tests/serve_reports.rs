//! `memleak serve`'s reports, read by their real consumers: `go tool
//! pprof` fetching `/debug/pprof/heap` itself, headless Chromium loading
//! the page, and the formats of `/api/v1/report`; and the bearer token
//! that guards them.

use std::{fs, thread};

use memleak_tests::{
    assert_refused_in_one_line,
    consumers::go_pprof_url,
    http::{get, get_until, get_with, serve, stop},
    svg_titles,
    tempdir::TempDir,
    Leaker, Memleak,
};
use serde_json::Value;

/// `memleak serve --pid PID` on a free port, once it serves and the
/// leaker's 17,264 bytes are in its reports.
fn serve_leaker(extra: &[&str]) -> (Leaker, Memleak, u16) {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid().to_string();
    let mut args = vec!["--pid", pid.as_str()];
    args.extend_from_slice(extra);
    let (memleak, port) = serve(&args);
    leaker.go();
    (leaker, memleak, port)
}

/// The text report of `pid`, once it holds the leaker's bytes.
fn text_report_until_leaked(port: u16, pid: u32) -> String {
    let path = format!("/api/v1/report?pid={pid}");
    get_until(port, &path, |response| response.body.contains("Outstanding: 17264 bytes in 15 allocations"))
        .body
}

#[test]
fn go_tool_pprof_fetches_the_heap_and_a_window_shows_only_its_growth() {
    let mut leaker = Leaker::start_waiting(&["steps"]);
    let pid = leaker.pid();
    let (mut memleak, port) = serve(&["--verbose", "--pid", &pid.to_string()]);
    leaker.go();
    leaker.send("step", "stepped");
    leaker.send("step", "stepped");
    let home = TempDir::new("memleak-serve-pprof");
    let url = format!("http://127.0.0.1:{port}/debug/pprof/heap?pid={pid}");
    let row_of = |top: &str, function: &str| {
        top.lines().find(|line| line.trim_end().ends_with(function)).unwrap_or("").trim_start().to_owned()
    };
    let whole = go_pprof_url(&url, home.path(), &["-top", "-unit=byte"]);
    assert!(row_of(&whole, "step_leak").starts_with("16384B "), "two steps of 8 KiB: {whole}");

    // pprof asks for ?seconds=3 itself; the step taken once the window
    // began is all the window shows.
    let windowed = thread::spawn({
        let (url, home) = (url.clone(), home.path().to_owned());
        move || go_pprof_url(&url, &home, &["-seconds", "3", "-top", "-unit=byte"])
    });
    memleak.stderr.wait_for("the window to begin", |line| line.ends_with("a window of 3 s begins"));
    leaker.send("step", "stepped");
    let window = windowed.join().expect("go tool pprof ran");
    assert!(row_of(&window, "step_leak").starts_with("8192B "), "one step in the window: {window}");
    assert!(window.contains(" of 8192B total"), "nothing else was allocated in it: {window}");
    assert!(!window.contains("alloc_space"), "what was allocated before the window is not in it: {window}");

    let unknown = get(port, "/debug/pprof/heap?pid=1").expect("GET pid=1");
    assert_eq!(unknown.status, 404, "{unknown:#?}");
    assert_eq!(unknown.body, "pid 1 is not followed: /api/v1/targets lists those that are\n");
    // Without a pid, every process's: this one's alone here.
    let node_wide = go_pprof_url(
        &format!("http://127.0.0.1:{port}/debug/pprof/heap"),
        home.path(),
        &["-top", "-unit=byte"],
    );
    assert!(row_of(&node_wide, "step_leak").starts_with("24576B "), "three steps of 8 KiB: {node_wide}");
    let bad = get(port, "/debug/pprof/heap?pid=x").expect("GET a bad pid");
    assert_eq!(
        (bad.status, bad.body.as_str()),
        (400, "pid=\"x\" is not a whole number from 1 to 4294967295\n")
    );
    stop(memleak);
}

#[test]
fn the_report_endpoint_writes_every_format_of_the_cli() {
    let (leaker, memleak, port) = serve_leaker(&[]);
    let pid = leaker.pid();
    let text = text_report_until_leaked(port, pid);
    assert!(text.contains("leak_malloc+"), "{text}");
    let report = |query: &str| {
        let response = get(port, &format!("/api/v1/report?pid={pid}&{query}")).expect("GET a report");
        assert_eq!(response.status, 200, "{query}: {response:#?}");
        response
    };
    let top_two = report("top=2&sort=count");
    assert!(top_two.body.contains("2 of 11 stacks shown"), "{}", top_two.body);

    let json = report("format=json");
    assert_eq!(json.content_type.as_deref(), Some("application/json"));
    let parsed: Value =
        serde_json::from_str(&json.body).unwrap_or_else(|error| panic!("{error}: {}", json.body));
    assert_eq!(
        (parsed["total_bytes"].as_u64(), parsed["total_allocations"].as_u64()),
        (Some(17_264), Some(15))
    );

    let folded = report("format=folded&weight=count");
    assert!(folded.body.lines().any(|line| line.ends_with(";all;leak_calloc 3")), "{}", folded.body);

    let svg = report("format=svg");
    assert_eq!(svg.content_type.as_deref(), Some("image/svg+xml"));
    let titles = svg_titles(&svg.body);
    assert!(titles.iter().any(|title| title.starts_with("leak_realloc (5,300 bytes")), "{titles:#?}");

    for (query, reason) in [
        ("format=png", "/api/v1/report: format=\"png\" is not one of text, json, folded, svg, pprof\n"),
        ("sort=age", "/api/v1/report: sort=\"age\" is not one of size, count, growth\n"),
        ("top=0", "/api/v1/report: top=\"0\" is not a whole number from 1 to 4294967295\n"),
        ("colour=red", "/api/v1/report: unknown parameter \"colour\": this endpoint takes pid, format, weight, sort, top, older, seconds\n"),
    ] {
        let refused = get(port, &format!("/api/v1/report?pid={pid}&{query}")).expect("GET a bad report");
        assert_eq!((refused.status, refused.body.as_str()), (400, reason), "{query}");
    }
    // An exited process's last report is still served, whole.
    leaker.exit();
    get_until(port, "/api/v1/targets", |response| response.body.contains("\"exited\":true"));
    let last = report("format=json");
    let parsed: Value =
        serde_json::from_str(&last.body).unwrap_or_else(|error| panic!("{error}: {}", last.body));
    assert_eq!(parsed["total_bytes"], 17_264, "{parsed:#}");
    let aged = get(port, &format!("/api/v1/report?pid={pid}&older=10")).expect("GET older");
    assert_eq!(aged.status, 400, "{aged:#?}");
    stop(memleak);
}

#[test]
fn headless_chromium_shows_the_followed_process_on_the_page() {
    let (leaker, memleak, port) = serve_leaker(&[]);
    let pid = leaker.pid();
    text_report_until_leaked(port, pid);
    let profile = TempDir::new("memleak-chromium");
    let output = std::process::Command::new("chromium")
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("http://127.0.0.1:{port}/"))
        .env("HOME", profile.path())
        .output()
        .expect("run chromium (`cargo xtask test` installs it)");
    let dom = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "chromium: {}", String::from_utf8_lossy(&output.stderr));
    let row = format!(
        "<tr><td class=\"num\">{pid}</td><td title=\"{}\">leaker</td>",
        memleak_tests::fixture("leaker").display()
    );
    assert!(dom.contains(&row), "the process's row: {dom}");
    assert!(
        dom.contains("<td class=\"num\">17,264</td><td class=\"num\">"),
        "outstanding bytes, then growth: {dom}"
    );
    // The culprit of the largest stack: leak_realloc's 5000 bytes.
    let culprit = format!("leak_realloc (leaker.c:{})", memleak_tests::marker_line("leaker", "realloc"));
    // Its allocations, then its resident memory (and of it anonymous).
    assert!(dom.contains("</td><td class=\"num\">15</td><td class=\"num\" title=\""), "{dom}");
    assert!(
        dom.contains(&format!(
            " MiB)</td><td class=\"culprit\">{culprit}</td>\
             <td title=\"/usr/lib/x86_64-linux-gnu/libc.so.6\">libc.so.6</td>"
        )) || dom.contains(&format!(
            " KiB)</td><td class=\"culprit\">{culprit}</td>\
             <td title=\"/usr/lib/x86_64-linux-gnu/libc.so.6\">libc.so.6</td>"
        )),
        "{dom}"
    );
    assert!(
        dom.contains(&format!("<a href=\"/api/v1/report?pid={pid}&amp;format=svg\">flame graph</a>")),
        "{dom}"
    );
    stop(memleak);
}

#[test]
fn a_token_guards_every_endpoint_but_healthz() {
    let directory = TempDir::new("memleak-token");
    let token_file = directory.path().join("token");
    fs::write(&token_file, "s3cret-t0ken-for-tests\n").expect("write the token");
    let token_path = token_file.to_str().expect("a UTF-8 path");
    let (leaker, memleak, port) = serve_leaker(&["--listen", "0.0.0.0", "--token-file", token_path]);
    let pid = leaker.pid();
    let bearer = [("Authorization", "Bearer s3cret-t0ken-for-tests")];
    for path in [
        "/",
        "/metrics",
        "/api/v1/targets",
        &format!("/api/v1/report?pid={pid}"),
        &format!("/debug/pprof/heap?pid={pid}"),
        "/debug/pprof/allocs",
        "/api/v1/sd",
        &format!("/metrics?pid={pid}"),
    ] {
        let refused = get(port, path).expect("GET without a token");
        assert_eq!(refused.status, 401, "{path}: {refused:#?}");
        assert_eq!(refused.header("www-authenticate"), Some("Bearer"), "{path}");
        let wrong = get_with(port, path, &[("Authorization", "Bearer s3cret-t0ken-for-tesTs")]).expect("GET");
        assert_eq!(wrong.status, 401, "{path}: a wrong token: {wrong:#?}");
        let admitted = get_with(port, path, &bearer).expect("GET with the token");
        assert_eq!(admitted.status, 200, "{path}: {admitted:#?}");
    }
    assert_eq!(get(port, "/healthz").expect("GET /healthz").status, 200);
    stop(memleak);

    let refused = std::process::Command::new(memleak_tests::memleak_binary())
        .args(["serve", "--pid", &pid.to_string(), "--listen", "0.0.0.0"])
        .output()
        .expect("run memleak");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert_eq!(
        stderr.trim_end(),
        "memleak: error: --listen 0.0.0.0: beyond loopback, memleak serve needs --token-file FILE, the token clients must send"
    );
}

/// A token file is read as memleak reads every file it does not control:
/// a FIFO (which blocked the daemon's start for good, SIGTERM ignored), a
/// device (`/dev/zero`, read until the OOM killer came), a file far
/// larger than a token (300 MB of NULs, taken as the token) and a first
/// line of NULs are each refused in one line, at once.
#[test]
fn a_token_file_that_holds_no_token_is_refused_at_once() {
    let directory = TempDir::new("memleak-bad-token");
    let fifo = directory.path().join("fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().expect("run mkfifo");
    assert!(status.success(), "mkfifo: {status}");
    let nuls = directory.path().join("nuls");
    fs::write(&nuls, [0u8; 64]).expect("write 64 NULs");
    let large = directory.path().join("large");
    // Sparse: 300 MB of NULs that take no disk.
    fs::File::create(&large).and_then(|file| file.set_len(300_000_000)).expect("a 300 MB file");
    let pid = std::process::id().to_string();
    for (path, reason) in [
        (fifo.as_path(), "not a regular file"),
        (std::path::Path::new("/dev/zero"), "not a regular file"),
        (large.as_path(), "it is 300000000 bytes, more than memleak reads (4096)"),
        (nuls.as_path(), "the token on its first line must be printable ASCII without blanks"),
    ] {
        let path = path.to_str().expect("a UTF-8 path");
        assert_refused_in_one_line(
            &["serve", "--pid", &pid, "--port", "0", "--listen", "0.0.0.0", "--token-file", path],
            &format!("--token-file {path}: {reason}"),
        );
    }
}

/// Windows taken at once at most (`reports::WINDOWS_AT_ONCE`).
const WINDOWS_AT_ONCE: usize = 4;

/// More `?seconds=N` windows asked for at once than the daemon takes:
/// those it takes are served after their window, the others refused at
/// once (they waited the whole window, then most got 503), with a
/// `Retry-After` saying when the first window taken ends.
#[test]
fn windows_beyond_those_taken_are_refused_at_once_saying_when_to_retry() {
    const WINDOW_SECONDS: u64 = 10;
    const ASKED: usize = 10;
    let (leaker, memleak, port) = serve_leaker(&[]);
    let path = format!("/api/v1/report?pid={}&format=json&seconds={WINDOW_SECONDS}", leaker.pid());
    let start = std::time::Instant::now();
    let answers: Vec<(u16, Option<u64>, std::time::Duration)> = thread::scope(|scope| {
        let asking: Vec<_> = (0..ASKED)
            .map(|_| {
                scope.spawn(|| {
                    let response = get(port, &path).expect("GET a window");
                    let retry_after = response.header("retry-after").map(|value| {
                        value.parse().unwrap_or_else(|_| panic!("Retry-After {value:?}: {response:#?}"))
                    });
                    (response.status, retry_after, start.elapsed())
                })
            })
            .collect();
        asking.into_iter().map(|asked| asked.join().expect("a request's thread")).collect()
    });
    let served = answers.iter().filter(|(status, ..)| *status == 200).count();
    let refused: Vec<_> = answers.iter().filter(|(status, ..)| *status == 503).collect();
    assert_eq!((served, refused.len()), (WINDOWS_AT_ONCE, ASKED - WINDOWS_AT_ONCE), "{answers:#?}");
    // At once: long before the windows taken end (half a window is a
    // margin of thousands over a refusal's milliseconds), and told to
    // come back when the first of them ends.
    let half_window = std::time::Duration::from_secs(WINDOW_SECONDS / 2);
    for (_, retry_after, after) in refused {
        assert!(*after < half_window, "refused only after {after:?}: {answers:#?}");
        assert!(
            retry_after.is_some_and(|seconds| (WINDOW_SECONDS / 2..=WINDOW_SECONDS + 1).contains(&seconds)),
            "Retry-After is not when the first window ends: {answers:#?}"
        );
    }
    stop(memleak);
}
