//! Brendan Gregg's collapsed stacks: one line per stack, root first,
//! frames joined by `;`, then the weight. The input of flamegraph.pl,
//! inferno, speedscope and most flame graph tools.

use std::{
    borrow::Borrow,
    collections::HashMap,
    io::{self, Write},
};

use super::{diff::Diff, options::Weight, printable, Report};
use crate::model::Frame;

/// The folded lines of a report, identical stacks merged, in order.
pub fn lines(report: &Report, weight: Weight) -> Vec<String> {
    let mut names = FrameNames::default();
    let mut merged: HashMap<String, u64> = HashMap::new();
    for stack in &report.stacks {
        let amount = match weight {
            Weight::Bytes => stack.bytes,
            Weight::Count => stack.allocations,
        };
        *merged.entry(names.folded_stack(&stack.frames, stack.stack_lost)).or_default() += amount;
    }
    sorted(merged).into_iter().map(|(stack, amount)| format!("{stack} {amount}")).collect()
}

/// A diff's lines in the two-column form of difffolded.pl, `stack base
/// new`, which flame graph tools draw as a differential flame graph.
pub fn diff_lines(diff: &Diff, weight: Weight) -> Vec<String> {
    let mut names = FrameNames::default();
    let mut merged: HashMap<String, (u64, u64)> = HashMap::new();
    for stack in &diff.stacks {
        let (base, new) = match weight {
            Weight::Bytes => (stack.base_bytes, stack.new_bytes),
            Weight::Count => (stack.base_allocations, stack.new_allocations),
        };
        let amounts = merged.entry(names.folded_stack(&stack.frames, stack.stack_lost)).or_default();
        amounts.0 += base;
        amounts.1 += new;
    }
    sorted(merged).into_iter().map(|(stack, (base, new))| format!("{stack} {base} {new}")).collect()
}

/// Merged in a hash map, sorted once: stacks share long prefixes, which
/// every comparison of a tree map would read again.
fn sorted<V>(merged: HashMap<String, V>) -> Vec<(String, V)> {
    let mut lines: Vec<(String, V)> = merged.into_iter().collect();
    lines.sort_unstable_by(|(a, _), (b, _)| a.cmp(b));
    lines
}

/// Each frame's folded name, made once: frames are shared by the stacks
/// through the same code, so one is met again and again.
#[derive(Default)]
struct FrameNames {
    /// By the frame's address in memory, which is stable while the report
    /// is borrowed.
    names: HashMap<*const Frame, String>,
}

impl FrameNames {
    /// Frame names root first, joined by `;`.
    fn folded_stack<F: Borrow<Frame>>(&mut self, frames: &[F], stack_lost: bool) -> String {
        if stack_lost {
            return "[stack lost]".to_owned();
        }
        if frames.is_empty() {
            return "[no frames]".to_owned();
        }
        let mut folded = String::new();
        for frame in frames.iter().rev() {
            let frame: &Frame = frame.borrow();
            let name = self.names.entry(std::ptr::from_ref(frame)).or_insert_with(|| frame_name(frame));
            if !folded.is_empty() {
                folded.push(';');
            }
            folded.push_str(name);
        }
        folded
    }
}

/// A frame's folded name: its function, or without one, its module's
/// file name and the offset in that file (`memcached+0x1a2b3`), or
/// `[unknown]`.
fn frame_name(frame: &Frame) -> String {
    let unnamed = frame.function.is_none().then(|| frame.file_location()).flatten();
    folded_name(frame.function.as_deref().or(unnamed.as_deref()), frame.inlined)
}

/// `;` separates frames and a space ends the stack, so neither may appear
/// in a name (C++ and Rust names hold spaces); nor may a line break or any
/// other control character (`printable`).
fn folded_name(function: Option<&str>, inlined: bool) -> String {
    let name = printable(function.unwrap_or("[unknown]")).replace(';', ":").replace(' ', "\u{a0}");
    if inlined {
        format!("{name}_[i]")
    } else {
        name
    }
}

pub fn render(report: &Report, weight: Weight, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    lines(report, weight).iter().try_for_each(|line| writeln!(out, "{line}"))
}

pub fn render_diff(diff: &Diff, weight: Weight, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    diff_lines(diff, weight).iter().try_for_each(|line| writeln!(out, "{line}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    #[test]
    fn folded_matches_the_golden_file() {
        let mut out = Vec::new();
        render(&sample_report(10), Weight::Bytes, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), include_str!("../../tests/data/report.folded"));
    }

    #[test]
    fn counts_weigh_by_allocations() {
        let lines = lines(&sample_report(10), Weight::Count);
        assert!(lines.contains(&"child;fibonacci 3".to_owned()), "{lines:?}");
        assert!(lines.contains(&"other 3".to_owned()), "two stacks with the same frames merge: {lines:?}");
    }

    #[test]
    fn a_diff_matches_the_golden_file() {
        let mut out = Vec::new();
        render_diff(&crate::report::diff::tests::sample_diff(10), Weight::Bytes, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), include_str!("../../tests/data/diff.folded"));
    }

    #[test]
    fn names_cannot_break_the_format() {
        assert_eq!(
            folded_name(Some("operator new(unsigned long)"), false),
            "operator\u{a0}new(unsigned\u{a0}long)"
        );
        assert_eq!(folded_name(Some("a;b"), true), "a:b_[i]");
        assert_eq!(folded_name(None, false), "[unknown]");
    }

    #[test]
    fn control_characters_in_names_are_escaped() {
        assert_eq!(folded_name(Some("\x1b[31mred\nline 2;x"), false), "\\x1b[31mred\\nline\u{a0}2:x");
        let mut report = sample_report(10);
        std::sync::Arc::make_mut(&mut report.stacks[0].frames[1]).function =
            Some("child\n\u{9b}2J".to_owned());
        let lines = lines(&report, Weight::Bytes);
        assert!(lines.contains(&"child\\n\\u{9b}2J;fibonacci 24576".to_owned()), "{lines:?}");
    }
}
