//! Golden files: two snapshots saved by memleak tracing the leaker
//! fixture, and what `memleak report` and `memleak diff` made of them in
//! every format. Every rendering must stay byte for byte the same (pprof
//! compared before gzip, whose bytes depend on the compressor), unless a
//! change means to change it: then `MEMLEAK_BLESS=1 cargo test golden`
//! writes the new renderings, to be read in the commit's diff. Text's
//! header clock is local time: it is masked.

use std::path::{Path, PathBuf};

use super::{
    culprit::SkipRules,
    diff::Diff,
    options::{Format, Rendering, ReportOptions, SortKey, Weight},
    saved, Report,
};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden").join(name)
}

fn load(name: &str) -> Report {
    saved::load(&data(name)).unwrap_or_else(|error| panic!("{error}"))
}

fn rendering(format: Format) -> Rendering {
    Rendering { format, weight: Weight::Bytes, full_stacks: false }
}

/// What `memleak report` shows: the top 10, every stack for flame graphs.
fn shown(format: Format, sort: SortKey, top: usize, show_allocs: bool) -> ReportOptions {
    ReportOptions { sort, top: if format.wants_every_stack() { usize::MAX } else { top }, show_allocs }
}

fn expected(name: &str) -> Vec<u8> {
    std::fs::read(data(name)).unwrap_or_else(|error| panic!("{name}: {error}"))
}

/// A rendering as compared: pprof gunzipped (the golden file is stored
/// so), text's clock masked.
fn comparable(format: Format, bytes: Vec<u8>) -> Vec<u8> {
    match format {
        Format::Pprof => {
            let mut plain = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut plain).unwrap();
            plain
        }
        Format::Text => mask_clock(bytes),
        Format::Json | Format::Folded | Format::Svg => bytes,
    }
}

/// `[09:45:28]` at the start of a report's header becomes `[HH:MM:SS]`.
fn mask_clock(mut text: Vec<u8>) -> Vec<u8> {
    if text.first() == Some(&b'[') && text.get(9) == Some(&b']') {
        text[1..9].copy_from_slice(b"HH:MM:SS");
    }
    text
}

fn extension(format: Format) -> &'static str {
    match format {
        Format::Text => "text",
        Format::Json => "json",
        Format::Folded => "folded",
        Format::Svg => "svg",
        Format::Pprof => "pb",
    }
}

fn assert_same(name: &str, format: Format, rendered: Vec<u8>) {
    let file = format!("{name}.{}", extension(format));
    if std::env::var_os("MEMLEAK_BLESS").is_some() {
        let stored =
            if format == Format::Pprof { comparable(format, rendered.clone()) } else { rendered.clone() };
        std::fs::write(data(&file), stored).unwrap();
    }
    let want = if format == Format::Pprof { expected(&file) } else { comparable(format, expected(&file)) };
    let got = comparable(format, rendered);
    assert!(
        want == got,
        "{file} differs:\n--- expected\n{}\n--- rendered\n{}",
        String::from_utf8_lossy(&want),
        String::from_utf8_lossy(&got)
    );
}

/// Renders snapshot `file` in every format, shown as `memleak report`
/// shows it with these options, against the golden files `name.*`.
fn assert_report_renders_as_before(file: &str, name: &str, sort: SortKey, top: usize, show_allocs: bool) {
    for &format in <Format as super::options::Choice>::ALL {
        let mut report = load(file);
        report.cut_for_display(&shown(format, sort, top, show_allocs), format);
        report.name_stacks(&SkipRules::default());
        let mut out = Vec::new();
        super::render(rendering(format), &report, &mut out).unwrap();
        assert_same(name, format, out);
    }
}

#[test]
fn a_saved_report_renders_as_before_in_every_format() {
    assert_report_renders_as_before("base.snap", "report", SortKey::Size, 10, false);
}

#[test]
fn each_allocation_sorted_by_count_renders_as_before() {
    assert_report_renders_as_before("new.snap", "report-a", SortKey::Count, 2, true);
}

#[test]
fn a_diff_renders_as_before_in_every_format() {
    let (base, new) = (load("base.snap"), load("new.snap"));
    for &format in <Format as super::options::Choice>::ALL {
        let top = if format.wants_every_stack() { usize::MAX } else { 10 };
        let mut out = Vec::new();
        super::render_diff(rendering(format), &Diff::between(&base, &new, top), &mut out).unwrap();
        assert_same("diff", format, out);
    }
}
