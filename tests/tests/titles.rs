//! Every title names the process by its pid and program, the allocator
//! beside it: the text header, a flame graph's title, a diff's header and
//! `memleak serve`'s page. A title that named only the allocator (libc,
//! most of the time) told one process from another no better than a pid.

use std::process::{Command, Stdio};

use memleak_tests::{
    fixture,
    http::{get_until, serve_pid, stop},
    tempdir::TempDir,
    Leaker, Lines, Memleak,
};

/// The path memleak names a program by: the file it runs, links resolved.
fn program(path: &std::path::Path) -> String {
    std::fs::canonicalize(path).unwrap().display().to_string()
}

/// `memleak: tracing pid P through ALLOCATOR (...)`: the pid and the
/// allocator memleak says it probed, for the titles to be checked against.
fn traced(stderr: &mut Lines) -> (String, String) {
    let line = stderr.wait_for("memleak to attach", |line| line.starts_with("memleak: tracing pid "));
    let rest = line.strip_prefix("memleak: tracing pid ").unwrap();
    let (pid, rest) = rest.split_once(" through ").unwrap_or_else(|| panic!("{line}"));
    let (allocator, _) = rest.split_once(" (").unwrap_or_else(|| panic!("{line}"));
    (pid.to_owned(), allocator.to_owned())
}

/// Runs `memleak -c 'leaker all --exit' ARGS` to its end; returns the pid
/// and allocator it traced, and what it printed.
fn trace_leaker(args: &[&str]) -> (String, String, Vec<String>) {
    let command = format!("{} all --exit", fixture("leaker").display());
    let mut full = vec!["-c", &command];
    full.extend_from_slice(args);
    let mut memleak = Memleak::start(&full);
    let (pid, allocator) = traced(&mut memleak.stderr);
    let stdout = memleak.stdout.rest();
    let status = memleak.child.wait().unwrap();
    assert!(status.success(), "memleak {full:?}: {status}; stderr: {:#?}", memleak.stderr.rest());
    (pid, allocator, stdout)
}

#[test]
fn a_text_report_is_headed_by_the_program_and_its_allocator() {
    let (pid, allocator, stdout) = trace_leaker(&["-T", "1", "3600"]);
    let leaker = program(&fixture("leaker"));
    let header = stdout.iter().find(|line| line.starts_with('[')).expect("a report header");
    let (_clock, rest) = header.split_once("] ").unwrap();
    assert_eq!(
        rest,
        format!(
            "Top 1 stacks with outstanding allocations in pid {pid} ({leaker}) through {allocator}, \
             unwound with .eh_frame:"
        )
    );
}

/// The title of an SVG: the text of its first text element that starts
/// with `memleak: ` (inferno's `id="title"`, or the one line of an empty
/// graph's).
fn svg_title(svg: &str) -> &str {
    svg.split("<text")
        .skip(1)
        .filter_map(|element| {
            let text = &element[element.find('>')? + 1..];
            Some(&text[..text.find("</text>")?])
        })
        .find(|text| text.starts_with("memleak: "))
        .unwrap_or_else(|| panic!("no title in {svg}"))
}

#[test]
fn a_flame_graph_and_a_diff_are_titled_by_the_program_and_its_allocator() {
    let dir = TempDir::new("memleak-titles");
    let svg = dir.path().join("leaks.svg");
    let snapshot = dir.path().join("heap.snap");
    let (pid, allocator, _) =
        trace_leaker(&["--output", svg.to_str().unwrap(), "--save", snapshot.to_str().unwrap(), "3600", "1"]);
    let leaker = program(&fixture("leaker"));
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(
        svg_title(&svg),
        format!("memleak: outstanding bytes in pid {pid} ({leaker}) through {allocator}")
    );

    let snapshot = snapshot.to_str().unwrap();
    let diff = |format: &str| {
        let output = Command::new(memleak_tests::memleak_binary())
            .args(["diff", snapshot, snapshot, "--format", format])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    assert_eq!(
        diff("text").lines().next().unwrap(),
        format!("Changes in outstanding memory in pid {pid} ({leaker}) through {allocator}, 0 s later:")
    );
    // A snapshot against itself: nothing changed, an empty graph that
    // keeps its title.
    assert_eq!(
        svg_title(&diff("svg")),
        format!(
            "memleak: outstanding bytes in pid {pid} ({leaker}) through {allocator}, \
             red: grew since the base, blue: shrank: nothing changed"
        )
    );
}

#[test]
fn the_serve_page_is_titled_by_the_process_it_follows() {
    let mut leaker = Leaker::start_waiting(&["all"]);
    let pid = leaker.pid();
    let (memleak, port) = serve_pid(pid);
    let allocator = {
        let line = memleak.stderr.seen.iter().find(|line| line.starts_with("memleak: tracing pid ")).cloned();
        let line = line.expect("memleak said what it traces");
        line.split_once(" through ").unwrap().1.split_once(" (").unwrap().0.to_owned()
    };
    leaker.go();
    let title = format!("memleak: pid {pid} ({}) through {allocator}", program(&fixture("leaker")));
    let page = get_until(port, "/", |response| response.body.contains(&title));
    assert!(page.body.contains(&format!("<title>{title}</title>")), "{}", page.body);
    assert!(page.body.contains(&format!("<h1>{title}</h1>")), "{}", page.body);
    stop(memleak);
    leaker.exit();
}
