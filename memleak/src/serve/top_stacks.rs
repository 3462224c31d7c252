//! The stacks of a process that `/metrics` shows: the largest K, each
//! under an id that stays the same for the same stack of the same binary,
//! across scrapes, processes and restarts of memleak
//! (`symbolize::stable_id`), and named after its first named frame.

use std::collections::BTreeMap;

use crate::report::{history, text::frame_name, Report, ReportStack};

/// What the `frame` label says of a stack without any named frame.
const NO_NAMED_FRAME: &str = "[unknown]";
const LOST_STACK_FRAME: &str = "[stack lost]";

/// A frame name longer than this is cut in the label: C++ names run to
/// kilobytes, which every sample would carry.
const FRAME_LABEL_CHARS: usize = 120;

/// One stack as `/metrics` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShownStack {
    /// 12 hex digits, or `lost`.
    pub id: String,
    /// Its first named frame, printable, cut to `FRAME_LABEL_CHARS`.
    pub frame: String,
    pub bytes: u64,
    pub allocations: u64,
    /// Of `bytes`, those in blocks that took the place of blocks from
    /// before memleak attached.
    pub replacing_bytes: u64,
}

impl ShownStack {
    /// Bytes that replacing old blocks does not explain.
    fn new_bytes(&self) -> u64 {
        self.bytes.saturating_sub(self.replacing_bytes)
    }
}

/// The `top` stacks of `report` holding the most new memory (bytes that
/// replacing blocks from before the attach does not explain), then the
/// most bytes, stacks under the same id added together; ties in id order,
/// so that a scrape lists them as the one before did. A big cache
/// refilling after a late attach does not push a leak out.
pub fn top_stacks(report: &Report, top: usize) -> Vec<ShownStack> {
    if top == 0 {
        return Vec::new();
    }
    let mut by_id: BTreeMap<String, ShownStack> = BTreeMap::new();
    for stack in report.stacks.iter().filter(|stack| stack.allocations > 0) {
        let id = history::stack_key(stack);
        let shown = by_id.entry(id.clone()).or_insert_with(|| ShownStack {
            id,
            frame: frame_label(stack),
            bytes: 0,
            allocations: 0,
            replacing_bytes: 0,
        });
        shown.bytes += stack.bytes;
        shown.allocations += stack.allocations;
        shown.replacing_bytes += stack.replacing.bytes;
    }
    let mut shown: Vec<ShownStack> = by_id.into_values().collect();
    // Stable: equal amounts keep the id order of the map.
    shown.sort_by(|a, b| {
        (b.new_bytes(), b.bytes, b.allocations).cmp(&(a.new_bytes(), a.bytes, a.allocations))
    });
    shown.truncate(top);
    shown
}

/// The stack's culprit (`report::culprit`), or its first named frame
/// when every frame is allocation plumbing: the code that asked for
/// memory. A frame without a name is its module and offset.
fn frame_label(stack: &ReportStack) -> String {
    if stack.stack_lost {
        return LOST_STACK_FRAME.to_owned();
    }
    let frame = stack
        .culprit
        .as_deref()
        .or_else(|| stack.frames.iter().find(|frame| frame.function.is_some()).map(|frame| &**frame));
    let name = frame.map_or_else(|| NO_NAMED_FRAME.to_owned(), frame_name);
    match name.char_indices().nth(FRAME_LABEL_CHARS) {
        Some((cut, _)) => format!("{}...", &name[..cut]),
        None => name,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        model::Frame,
        report::{
            culprit::SkipRules,
            tests::{frame, sample_report},
        },
    };

    fn stack(frames: Vec<Frame>, bytes: u64, allocations: u64) -> ReportStack {
        let mut stack = sample_report(1).stacks.remove(0);
        stack.frames = frames.into_iter().map(Arc::new).collect();
        stack.culprit =
            SkipRules::default().culprit(&stack.frames, "/usr/lib/libc.so.6", "/app/leaker").cloned();
        stack.stable_id = None;
        stack.bytes = bytes;
        stack.allocations = allocations;
        stack
    }

    #[test]
    fn the_frame_label_is_the_culprit() {
        let frames = vec![
            frame("malloc", "/src/a.c", 2),
            frame("operator new(unsigned long)", "", 3),
            frame("Cache::fill", "/src/a.cc", 4),
        ];
        assert_eq!(frame_label(&stack(frames, 1, 1)), "Cache::fill");
        let mut stripped = frame("x", "/src/a.c", 1);
        (stripped.function, stripped.file_offset) = (None, Some(0x1a2b3));
        assert_eq!(
            frame_label(&stack(vec![stripped], 1, 1)),
            "leaker+0x1a2b3",
            "a frame without a name is the culprit"
        );
        assert_eq!(
            frame_label(&stack(vec![frame("operator new(unsigned long)", "", 3)], 1, 1)),
            "operator new(unsigned long)",
            "with nothing of the program's own, the first named frame"
        );
        let long = "n".repeat(500);
        assert_eq!(frame_label(&stack(vec![frame(&long, "", 1)], 1, 1)), format!("{}...", &long[..120]));
        assert_eq!(frame_label(&stack(vec![frame("a\nb", "", 1)], 1, 1)), "a\\nb");
    }

    #[test]
    fn the_largest_k_are_kept_with_stacks_of_one_id_added_together() {
        let mut report = sample_report(10);
        report.stacks = vec![
            stack(vec![frame("small", "/src/a.c", 1)], 10, 1),
            stack(vec![frame("big", "/src/a.c", 2)], 500, 2),
            // Same frames as "big": another BPF stack symbolized alike.
            stack(vec![frame("big", "/src/a.c", 2)], 100, 1),
            stack(vec![frame("middle", "/src/a.c", 3)], 400, 4),
            stack(vec![frame("freed", "/src/a.c", 4)], 0, 0),
        ];
        let shown = top_stacks(&report, 2);
        let amounts: Vec<_> = shown.iter().map(|s| (s.frame.as_str(), s.bytes, s.allocations)).collect();
        assert_eq!(amounts, [("big", 600, 3), ("middle", 400, 4)]);
        assert_eq!(top_stacks(&report, 10).len(), 3, "a stack holding nothing is not shown");
        assert!(top_stacks(&report, 0).is_empty());
    }

    #[test]
    fn a_lost_stack_is_shown_as_lost() {
        let report = sample_report(10);
        let lost = top_stacks(&report, 10)
            .into_iter()
            .find(|s| s.id == history::LOST_STACK_KEY)
            .expect("the lost stack");
        assert_eq!((lost.frame.as_str(), lost.bytes), ("[stack lost]", 64));
    }
}
