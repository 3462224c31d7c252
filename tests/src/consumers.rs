//! The real consumers of memleak's output, as the tests use them: an XML
//! parser for flame graphs and `go tool pprof` for profiles.

use std::{path::Path, process::Command};

/// Checks that `svg` is well-formed XML with an `<svg>` root, and returns
/// the text of its `<title>` elements: a flame graph names each frame in
/// one, with its weight.
pub fn svg_titles(svg: &str) -> Vec<String> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(svg);
    reader.config_mut().check_end_names = true;
    let (mut titles, mut in_title, mut root) = (Vec::new(), false, None);
    loop {
        match reader.read_event() {
            Ok(Event::Start(tag)) => {
                let name = String::from_utf8_lossy(tag.name().as_ref()).into_owned();
                in_title = name == "title";
                root.get_or_insert(name);
            }
            Ok(Event::Text(text)) if in_title => titles.push(String::from_utf8_lossy(&text).into_owned()),
            Ok(Event::End(_)) => in_title = false,
            Ok(Event::Eof) => break,
            Ok(_) => {}
            Err(error) => panic!("not well-formed XML at byte {}: {error}", reader.buffer_position()),
        }
    }
    assert_eq!(root.as_deref(), Some("svg"), "an SVG document");
    titles
}

/// Runs `go tool pprof ARGS PROFILE` and returns what it printed. Go
/// keeps a cache under $HOME: the profile's directory serves.
pub fn go_pprof(profile: &Path, args: &[&str]) -> String {
    go_pprof_source(profile.as_os_str(), profile.parent().expect("a profile in a directory"), args)
}

/// Runs `go tool pprof ARGS URL`, pprof fetching the profile itself, with
/// `home` for Go's cache and the copy pprof saves of what it fetched.
pub fn go_pprof_url(url: &str, home: &Path, args: &[&str]) -> String {
    go_pprof_source(url.as_ref(), home, args)
}

fn go_pprof_source(source: &std::ffi::OsStr, home: &Path, args: &[&str]) -> String {
    let output = Command::new("go")
        .args(["tool", "pprof"])
        .args(args)
        .arg(source)
        .env("HOME", home)
        .output()
        .expect("run go tool pprof (cargo xtask test installs golang-go)");
    assert!(output.status.success(), "go tool pprof {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}
