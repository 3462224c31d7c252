//! An interactive flame graph of a report, drawn in-process by inferno
//! from the folded lines: no perl, no flamegraph.pl.

use std::io::{self, Write};

use inferno::flamegraph::{self, Options};

use super::{folded, Report};
use crate::cli::Weight;

pub fn render(report: &Report, weight: Weight, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let lines = folded::lines(report, weight);
    let mut options = Options::default();
    let (what, unit) = match weight {
        Weight::Bytes => ("bytes", "bytes"),
        Weight::Count => ("allocations", "allocations"),
    };
    options.title = if report.pid == memleak_common::KERNEL_TGID {
        format!("memleak: outstanding {what} in the kernel")
    } else {
        format!("memleak: outstanding {what} in pid {} ({})", report.pid, report.allocator)
    };
    options.count_name = unit.to_owned();
    options.name_type = "Function:".to_owned();
    if lines.is_empty() {
        // inferno refuses an empty graph; an empty report is still an answer.
        return writeln!(out, "<?xml version=\"1.0\" standalone=\"no\"?><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"600\" height=\"40\"><text x=\"10\" y=\"25\">{}: nothing outstanding</text></svg>", options.title);
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
        assert!(svg.contains("outstanding bytes in pid 4242"), "the title says what is drawn");
    }
}
