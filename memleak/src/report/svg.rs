//! An interactive flame graph of a report, drawn in-process by inferno
//! from the folded lines: no perl, no flamegraph.pl. Names reach it with
//! control characters escaped (the folded lines and the title escape them,
//! which XML 1.0 would not take anyway), and inferno escapes `<`, `&` and
//! quotes in every text and title it writes.

use std::io::{self, Write};

use inferno::flamegraph::{self, Options};

use super::{diff::Diff, folded, options::Weight, subject, Report};

pub fn render(report: &Report, weight: Weight, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let title = format!("memleak: outstanding {} in {}", weight_name(weight), subject::of(report));
    draw(&folded::lines(report, weight), title, "nothing outstanding", weight, out)
}

/// A differential flame graph: widths are the newer snapshot's, red where
/// a stack grew since the base and blue where it shrank. The title names
/// the base too when it is of another process or program.
pub fn render_diff(diff: &Diff, weight: Weight, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let (base, new) = (subject::of_side(&diff.base), subject::of_side(&diff.new));
    let since = if base == new { String::new() } else { format!(" in {base}") };
    let title = format!(
        "memleak: outstanding {} in {new}, red: grew since the base{since}, blue: shrank",
        weight_name(weight)
    );
    draw(&folded::diff_lines(diff, weight), title, "nothing changed", weight, out)
}

fn weight_name(weight: Weight) -> &'static str {
    match weight {
        Weight::Bytes => "bytes",
        Weight::Count => "allocations",
    }
}

/// `empty`: what the one line of an empty graph says after the title.
fn draw(
    lines: &[String],
    title: String,
    empty: &str,
    weight: Weight,
    out: &mut (impl Write + ?Sized),
) -> io::Result<()> {
    let mut options = Options::default();
    options.title = title;
    weight_name(weight).clone_into(&mut options.count_name);
    "Function:".clone_into(&mut options.name_type);
    if lines.is_empty() {
        // inferno refuses an empty graph; an empty report is still an answer.
        // The title is text of the SVG: XML's own characters escaped.
        let title = options.title.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
        return writeln!(out, "<?xml version=\"1.0\" standalone=\"no\"?><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1200\" height=\"40\"><text x=\"10\" y=\"25\">{title}: {empty}</text></svg>");
    }
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), out).map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    #[test]
    fn an_svg_names_the_leaking_functions() {
        let mut out = Vec::new();
        render(&sample_report(10), Weight::Bytes, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(svg.starts_with("<?xml"), "{}", &svg[..80]);
        assert!(svg.contains("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("fibonacci") && svg.contains("child"), "frames are drawn");
        assert!(
            svg.contains(
                ">memleak: outstanding bytes in pid 4242 (/app/leaker) through /usr/lib/libc.so.6</text>"
            ),
            "the title names the program, then its allocator"
        );
    }

    #[test]
    fn an_empty_graph_keeps_its_title_text() {
        let mut report = sample_report(10);
        report.stacks.clear();
        report.allocator = "/lib/<script>\x1b&.so".to_owned();
        let mut out = Vec::new();
        render(&report, Weight::Bytes, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(
            svg.contains(
                ">memleak: outstanding bytes in pid 4242 (/app/leaker) through /lib/&lt;script&gt;\\x1b&amp;.so: \
                 nothing outstanding</text>"
            ),
            "{svg}"
        );
    }

    #[test]
    fn a_diff_is_drawn_in_the_growth_colours() {
        let mut out = Vec::new();
        render_diff(&crate::report::diff::tests::sample_diff(10), Weight::Bytes, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(svg.contains("cache_insert") && svg.contains("new_handler"), "grown stacks are drawn");
        // inferno colours growth red and shrinkage blue, in proportion.
        assert!(svg.contains("rgb(255,") && svg.contains(",255)"), "both colours are used");
        assert!(
            svg.contains(
                ">memleak: outstanding bytes in pid 7 (/app/server) through /usr/lib/libc.so.6, \
                 red: grew since the base, blue: shrank</text>"
            ),
            "the title names the process once"
        );
        let mut diff = crate::report::diff::tests::sample_diff(10);
        diff.base.pid = 6;
        let mut out = Vec::new();
        render_diff(&diff, Weight::Bytes, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(
            svg.contains("red: grew since the base in pid 6 (/app/server) through /usr/lib/libc.so.6, blue"),
            "a base of another process is named: {svg}"
        );
    }
}
