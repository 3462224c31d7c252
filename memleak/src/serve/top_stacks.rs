//! The stacks of a process that `/metrics` shows: the largest K, each
//! under an id that stays the same for the same stack of the same binary,
//! across scrapes, processes and restarts of memleak, and named after its
//! first named frame.
//!
//! The BPF stack id cannot serve: it is a slot in this run's map. The id
//! here is a hash of what symbolizing a stack gives, which addresses
//! randomized at load (ASLR) do not change: each frame's function, its
//! offset in that function, whether it was inlined, and the file name of
//! its module. A frame that could not be named has only its module: two
//! stacks that differ only in frames without names share an id, and
//! their amounts are added under it.

use std::collections::BTreeMap;

use memleak_common::ALLOCATOR_FUNCTIONS;

use crate::{
    model::Frame,
    report::{printable, Report, ReportStack},
};

/// The id of a stack whose frames could not be stored.
pub const LOST_STACK_ID: &str = "lost";

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
}

/// The `top` stacks of `report` holding the most bytes, stacks under the
/// same id added together; ties in id order, so that a scrape lists them
/// as the one before did.
pub fn top_stacks(report: &Report, top: usize) -> Vec<ShownStack> {
    if top == 0 {
        return Vec::new();
    }
    let mut by_id: BTreeMap<String, ShownStack> = BTreeMap::new();
    for stack in report.stacks.iter().filter(|stack| stack.allocations > 0) {
        let id = stable_id(stack);
        let shown = by_id.entry(id.clone()).or_insert_with(|| ShownStack {
            id,
            frame: frame_label(stack),
            bytes: 0,
            allocations: 0,
        });
        shown.bytes += stack.bytes;
        shown.allocations += stack.allocations;
    }
    let mut shown: Vec<ShownStack> = by_id.into_values().collect();
    // Stable: equal amounts keep the id order of the map.
    shown.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(b.allocations.cmp(&a.allocations)));
    shown.truncate(top);
    shown
}

/// The stack's id: 12 hex digits of a 64-bit FNV-1a hash of its frames,
/// innermost first. FNV-1a is written out here, not taken from `std`,
/// whose hashers may change between Rust releases: the ids must not.
pub fn stable_id(stack: &ReportStack) -> String {
    if stack.stack_lost {
        return LOST_STACK_ID.to_owned();
    }
    let mut hash = Fnv1a::default();
    for frame in &stack.frames {
        hash.write(frame.function.as_deref().unwrap_or("?").as_bytes());
        hash.write(&frame.offset.map_or(u64::MAX, |offset| offset).to_le_bytes());
        hash.write(&[u8::from(frame.inlined)]);
        hash.write(module_file_name(frame).as_bytes());
        // Ends the frame: ("ab", "c") and ("a", "bc") differ.
        hash.write(&[0xff]);
    }
    format!("{:012x}", hash.finish() >> 16)
}

/// The module's file name alone: the same binary may sit at different
/// paths (in a container, or after a reinstall).
fn module_file_name(frame: &Frame) -> &str {
    let module = frame.module.as_deref().unwrap_or("");
    module.rsplit('/').next().unwrap_or(module)
}

/// The first frame that names a function other than the allocator's: the
/// code that asked for memory. `Report::build` already dropped the
/// allocator's own entry frames; an allocator function met again (calloc
/// calling malloc inside another allocator, say) is passed over, and so
/// is C++'s `operator new`, which only forwards to malloc.
fn frame_label(stack: &ReportStack) -> String {
    if stack.stack_lost {
        return LOST_STACK_FRAME.to_owned();
    }
    let named = stack.frames.iter().filter_map(|frame| frame.function.as_deref()).find(|name| {
        !ALLOCATOR_FUNCTIONS.iter().any(|function| function.name == *name)
            && !name.starts_with("operator new")
    });
    let name = printable(named.unwrap_or(NO_NAMED_FRAME));
    match name.char_indices().nth(FRAME_LABEL_CHARS) {
        Some((cut, _)) => format!("{}...", &name[..cut]),
        None => name.into_owned(),
    }
}

/// FNV-1a, 64 bits: small, and defined by its constants alone.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::report::tests::{frame, sample_report};

    fn stack(frames: Vec<Frame>, bytes: u64, allocations: u64) -> ReportStack {
        let mut stack = sample_report(1).stacks.remove(0);
        stack.frames = frames.into_iter().map(Arc::new).collect();
        stack.bytes = bytes;
        stack.allocations = allocations;
        stack
    }

    #[test]
    fn fnv1a_gives_the_published_test_vectors() {
        // From the FNV reference: "" and "a".
        assert_eq!(Fnv1a::default().finish(), 0xcbf2_9ce4_8422_2325);
        let mut hash = Fnv1a::default();
        hash.write(b"a");
        assert_eq!(hash.finish(), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn the_id_is_the_same_wherever_the_binary_was_loaded_and_never_changes() {
        let here = stack(
            vec![frame("leak_malloc", "/src/leaker.c", 35), frame("main", "/src/leaker.c", 90)],
            3000,
            3,
        );
        let mut elsewhere = here.clone();
        for frame in &mut elsewhere.frames {
            let frame = Arc::make_mut(frame);
            frame.address += 0x7f00_0000_0000;
            frame.module = Some("/proc/1/root/app/leaker".to_owned());
        }
        assert_eq!(stable_id(&here), stable_id(&elsewhere), "addresses and directories do not count");
        // A literal, computed apart (FNV-1a in Python over the same bytes):
        // a change to the hashing would rename every stack on every
        // dashboard, and must be seen.
        assert_eq!(stable_id(&here), "9aa4a22a7504");
    }

    #[test]
    fn stacks_that_differ_in_a_frame_or_an_offset_have_different_ids() {
        let base = stack(vec![frame("leak_malloc", "/src/leaker.c", 35)], 1, 1);
        let mut other_offset = base.clone();
        Arc::make_mut(&mut other_offset.frames[0]).offset = Some(0x20);
        let caller =
            stack(vec![frame("leak_malloc", "/src/leaker.c", 35), frame("main", "/src/leaker.c", 9)], 1, 1);
        let ids = [stable_id(&base), stable_id(&other_offset), stable_id(&caller)];
        assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2], "{ids:?}");
        assert!(ids.iter().all(|id| id.len() == 12 && id.chars().all(|c| c.is_ascii_hexdigit())), "{ids:?}");
    }

    #[test]
    fn the_frame_label_passes_over_allocator_functions_and_unnamed_frames() {
        let mut unnamed = frame("x", "/src/a.c", 1);
        unnamed.function = None;
        let frames = vec![
            unnamed,
            frame("malloc", "/src/a.c", 2),
            frame("operator new(unsigned long)", "", 3),
            frame("Cache::fill", "/src/a.cc", 4),
        ];
        assert_eq!(frame_label(&stack(frames, 1, 1)), "Cache::fill");
        let mut nameless = frame("x", "/src/a.c", 1);
        nameless.function = None;
        assert_eq!(frame_label(&stack(vec![nameless], 1, 1)), "[unknown]");
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
        let lost =
            top_stacks(&report, 10).into_iter().find(|s| s.id == LOST_STACK_ID).expect("the lost stack");
        assert_eq!((lost.frame.as_str(), lost.bytes), ("[stack lost]", 64));
    }
}
