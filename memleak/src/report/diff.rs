//! `memleak diff BASE NEW`: what grew and what shrank between two saved
//! snapshots, per stack; jeprof's `--base`, for any running process.
//!
//! Stacks are matched by their symbolized frames, not by id or address:
//! ids are per run and addresses move between runs (ASLR). A frame with no
//! function name falls back to its module and address.
//!
//! A diff works on snapshots as read (`Saved`), each distinct frame held
//! once: frames are numbered by identity across both snapshots, stacks
//! are matched by those numbers, and the stacks of the diff share the
//! snapshots' frames rather than copy them.

use std::{cmp::Ordering, collections::HashMap, sync::Arc};

use serde::{Serialize, Serializer};

use super::{culprit::SkipRules, options::DiffOrder, saved::Saved, Report, ReportStack};
use crate::model::{Frame, MappingKind, ModuleMapping};

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diff {
    pub base: Side,
    pub new: Side,
    /// Stacks whose outstanding bytes or count changed, largest growth
    /// first (in new memory, or in bytes, as `DiffOrder` says), then
    /// largest shrink last.
    pub stacks: Vec<DiffStack>,
    /// Changed stacks before the cut to the top N.
    pub total_stacks: usize,
    /// Frees of blocks memleak never saw allocated (allocated before it
    /// attached, or left out) made between the two snapshots, when both
    /// come from one process traced by one memleak (its counters never
    /// went down in between); `None` otherwise. Their sizes, and so their
    /// share of each stack's change, are unknown: a stack that replaced
    /// such blocks shows growth the program's memory does not have.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unrecorded_frees_between: Option<u64>,
    /// The newer snapshot's mappings, for pprof.
    #[serde(skip)]
    pub modules: Vec<ModuleMapping>,
}

/// What the diff says of each of its two snapshots.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Side {
    pub pid: u32,
    pub program: String,
    /// For the titles; not in JSON, whose diff fields predate it.
    #[serde(skip)]
    pub namespace_pid: Option<u32>,
    #[serde(skip)]
    pub allocator: String,
    pub time_unix_ms: u64,
    pub total_bytes: u64,
    pub total_allocations: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DiffStack {
    pub base_bytes: u64,
    pub new_bytes: u64,
    pub base_allocations: u64,
    pub new_allocations: u64,
    pub delta_bytes: i64,
    pub delta_allocations: i64,
    /// Of `base_bytes` and `new_bytes`, those in blocks that took the
    /// place of blocks from before memleak attached (`Replacing`).
    #[serde(skip_serializing_if = "is_zero")]
    pub base_replacing_bytes: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub new_replacing_bytes: u64,
    /// `delta_bytes` less what replacing blocks explain: the stack's
    /// growth in new memory.
    pub delta_new_bytes: i64,
    /// Innermost first, from the newer snapshot when the stack is in both;
    /// shared with the snapshot.
    #[serde(serialize_with = "frames_as_values")]
    pub frames: Vec<Arc<Frame>>,
    /// The first frame of the program's own code (`culprit`).
    pub culprit: Option<Arc<Frame>>,
    /// Which of `frames` are allocation plumbing: what a text diff folds.
    #[serde(skip)]
    pub plumbing: Vec<bool>,
    pub stack_lost: bool,
    pub mapping: Option<MappingKind>,
}

#[allow(clippy::trivially_copy_pass_by_ref, reason = "serde's skip_serializing_if passes a reference")]
fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// Frames as a list of frame objects, as a report's are.
fn frames_as_values<S: Serializer>(frames: &[Arc<Frame>], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(frames.iter().map(|frame| &**frame))
}

impl Diff {
    /// Compares two reports held whole; see `of`. (memleak itself only
    /// diffs snapshots as read.)
    #[cfg(test)]
    pub fn between(base: &Report, new: &Report, top: usize) -> Self {
        Self::of(
            &Saved::from_report(base.clone()),
            &Saved::from_report(new.clone()),
            top,
            DiffOrder::Growth,
            &SkipRules::default(),
        )
    }

    /// Compares every stack of `base` and `new`; keeps the `top` that grew
    /// most and the `top` that shrank most, as `order` measures it, each
    /// named by its culprit as `skips` says.
    pub fn of(base: &Saved, new: &Saved, top: usize, order: DiffOrder, skips: &SkipRules) -> Self {
        let sides = Sides::new([base, new]);
        let mut changed = sides.changes();
        let total_stacks = changed.len();
        // In new memory, a cache that replaced blocks from before the
        // attach comes after every stack that grew; by how much it took
        // up, before those that shrank.
        let rank = |change: &Change| match order {
            DiffOrder::Growth => (change.delta_new_bytes(), change.delta_bytes, change.delta_allocations),
            DiffOrder::Bytes => (change.delta_bytes, change.delta_allocations, 0),
        };
        // Ties broken by the frames, so that a diff prints the same twice.
        changed.sort_by(|a, b| rank(b).cmp(&rank(a)).then_with(|| sides.compare_frames(a.source, b.source)));
        let grew = changed.iter().take_while(|change| rank(change) > (0, 0, 0)).count().min(top);
        let shrank = changed.iter().rev().take_while(|change| rank(change) < (0, 0, 0)).count().min(top);
        let shrank_from = changed.len() - shrank;
        let stacks = changed[..grew]
            .iter()
            .chain(&changed[shrank_from..])
            .map(|change| sides.stack(change, skips))
            .collect();
        Diff {
            base: Side::of(base.report()),
            new: Side::of(new.report()),
            stacks,
            total_stacks,
            unrecorded_frees_between: unrecorded_frees_between(base.report(), new.report()),
            modules: new.report().modules.clone(),
        }
    }

    /// Bytes outstanding in the newer snapshot minus the base.
    pub fn delta_bytes(&self) -> i64 {
        self.new.total_bytes as i64 - self.base.total_bytes as i64
    }
}

/// The frees of blocks memleak never saw allocated made between `base`
/// and `new`, if both are of one process and one run of memleak: the same
/// pid, `new` no earlier, and none of its health counters, which count
/// from the moment memleak attached, below `base`'s.
fn unrecorded_frees_between(base: &Report, new: &Report) -> Option<u64> {
    let (before, after) = (&base.health, &new.health);
    let one_run = base.pid == new.pid
        && base.time_unix_ms <= new.time_unix_ms
        && before.allocations <= after.allocations
        && before.frees <= after.frees;
    let (before, after) = (before.unrecorded_frees?, after.unrecorded_frees?);
    (one_run && before <= after).then(|| after - before)
}

impl Side {
    fn of(report: &Report) -> Self {
        Side {
            pid: report.pid,
            program: report.program.clone(),
            namespace_pid: report.namespace_pid,
            allocator: report.allocator.clone(),
            time_unix_ms: report.time_unix_ms,
            total_bytes: report.total_bytes,
            total_allocations: report.total_allocations,
        }
    }
}

const BASE: usize = 0;
const NEW: usize = 1;

/// A stack of one of the two snapshots: which one, and its place there.
#[derive(Clone, Copy, Debug)]
struct Source {
    side: usize,
    stack: usize,
}

/// A stack whose amounts changed, its frames not copied yet.
struct Change {
    base_bytes: u64,
    new_bytes: u64,
    base_replacing_bytes: u64,
    new_replacing_bytes: u64,
    base_allocations: u64,
    new_allocations: u64,
    delta_bytes: i64,
    delta_allocations: i64,
    stack_lost: bool,
    mapping: Option<MappingKind>,
    /// Whose frames the stack shows: the newer snapshot's when it is in both.
    source: Source,
}

impl Change {
    /// The change less what replacing blocks explain.
    fn delta_new_bytes(&self) -> i64 {
        let replacing = self.new_replacing_bytes as i64 - self.base_replacing_bytes as i64;
        self.delta_bytes - replacing
    }
}

/// What makes two stacks of different snapshots the same stack: their
/// kind, and their frames' identities (see `identity`) in order.
#[derive(PartialEq, Eq, Hash)]
struct StackKey {
    mapping: Option<MappingKind>,
    stack_lost: bool,
    identities: Box<[u32]>,
}

/// The two snapshots, with each distinct frame's identity numbered across
/// both.
struct Sides<'a> {
    saved: [&'a Saved; 2],
    /// For each side, the identity of each frame of its table.
    identities: [Vec<u32>; 2],
}

impl<'a> Sides<'a> {
    #[allow(clippy::cast_possible_truncation, reason = "fewer than 2^32 frames: each takes over 100 bytes")]
    fn new(saved: [&'a Saved; 2]) -> Self {
        let mut numbers: HashMap<String, u32> = HashMap::new();
        let identities = saved.map(|side| {
            let table = side.frame_table();
            table
                .iter()
                .map(|frame| {
                    let next = numbers.len() as u32;
                    *numbers.entry(identity(frame)).or_insert(next)
                })
                .collect()
        });
        Self { saved, identities }
    }

    /// A stack's frames, as places in its side's frame table.
    fn frames(&self, source: Source) -> &'a [u32] {
        self.saved[source.side].frames_of(source.stack)
    }

    fn identity(&self, side: usize, frame: u32) -> u32 {
        self.identities[side][frame as usize]
    }

    fn key(&self, source: Source, stack: &ReportStack) -> StackKey {
        let identities = if stack.stack_lost {
            Box::default()
        } else {
            self.frames(source).iter().map(|&frame| self.identity(source.side, frame)).collect()
        };
        StackKey { mapping: stack.mapping, stack_lost: stack.stack_lost, identities }
    }

    /// Every stack whose amounts differ between the two sides.
    fn changes(&self) -> Vec<Change> {
        let mut by_key: HashMap<StackKey, Change> = HashMap::new();
        for side in [BASE, NEW] {
            for (place, stack) in self.saved[side].report().stacks.iter().enumerate() {
                let source = Source { side, stack: place };
                let change = by_key.entry(self.key(source, stack)).or_insert_with(|| Change {
                    base_bytes: 0,
                    new_bytes: 0,
                    base_replacing_bytes: 0,
                    new_replacing_bytes: 0,
                    base_allocations: 0,
                    new_allocations: 0,
                    delta_bytes: 0,
                    delta_allocations: 0,
                    stack_lost: stack.stack_lost,
                    mapping: stack.mapping,
                    source,
                });
                if side == NEW {
                    change.new_bytes += stack.bytes;
                    change.new_replacing_bytes += stack.replacing.bytes;
                    change.new_allocations += stack.allocations;
                    change.source = source;
                } else {
                    change.base_bytes += stack.bytes;
                    change.base_replacing_bytes += stack.replacing.bytes;
                    change.base_allocations += stack.allocations;
                }
            }
        }
        by_key
            .into_values()
            .map(|mut change| {
                change.delta_bytes = change.new_bytes as i64 - change.base_bytes as i64;
                change.delta_allocations = change.new_allocations as i64 - change.base_allocations as i64;
                change
            })
            .filter(|change| change.delta_bytes != 0 || change.delta_allocations != 0)
            .collect()
    }

    /// Orders two stacks as their identities, joined by `;`, compare as
    /// strings. Leading frames of the same identity are skipped by number;
    /// the rest is spelled out only as far as it takes to differ.
    fn compare_frames(&self, a: Source, b: Source) -> Ordering {
        let same = self
            .frames(a)
            .iter()
            .zip(self.frames(b))
            .take_while(|&(&x, &y)| self.identity(a.side, x) == self.identity(b.side, y))
            .count();
        self.spelled(a, same).cmp(self.spelled(b, same))
    }

    /// The bytes of a stack's identities joined by `;`, from frame `from` on.
    fn spelled(&self, source: Source, from: usize) -> impl Iterator<Item = u8> + 'a {
        let table = self.saved[source.side].frame_table();
        self.frames(source)[from..].iter().enumerate().flat_map(move |(i, &frame)| {
            let separator = if from + i > 0 { ";" } else { "" };
            format!("{separator}{}", identity(&table[frame as usize])).into_bytes()
        })
    }

    fn stack(&self, change: &Change, skips: &SkipRules) -> DiffStack {
        let table = self.saved[change.source.side].frame_table();
        let frames: Vec<Arc<Frame>> =
            self.frames(change.source).iter().map(|&frame| Arc::clone(&table[frame as usize])).collect();
        let report = self.saved[change.source.side].report();
        let (culprit, plumbing) = skips.culprits(&report.allocator, &report.program).named(&frames);
        let culprit = culprit.cloned();
        DiffStack {
            base_bytes: change.base_bytes,
            new_bytes: change.new_bytes,
            base_allocations: change.base_allocations,
            new_allocations: change.new_allocations,
            delta_bytes: change.delta_bytes,
            delta_allocations: change.delta_allocations,
            base_replacing_bytes: change.base_replacing_bytes,
            new_replacing_bytes: change.new_replacing_bytes,
            delta_new_bytes: change.delta_new_bytes(),
            frames,
            culprit,
            plumbing,
            stack_lost: change.stack_lost,
            mapping: change.mapping,
        }
    }
}

/// What makes frames of different snapshots the same frame: the function,
/// file and line; for a frame with no function name, its module and where
/// it lies in the module's file (its address, in snapshots saved before
/// memleak kept that), which a program loaded elsewhere keeps.
fn identity(frame: &Frame) -> String {
    let module = frame.module.as_deref().unwrap_or("");
    match (&frame.function, frame.file_offset) {
        (Some(function), _) => {
            format!("{function}@{}:{}", frame.file.as_deref().unwrap_or(""), frame.line.unwrap_or(0))
        }
        (None, Some(file_offset)) => format!("{module}+{file_offset:#x}"),
        (None, None) => format!("{module}@{:#x}", frame.address),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::report::tests::frame;

    fn stack(bytes: u64, allocations: u64, functions: &[&str]) -> ReportStack {
        ReportStack {
            stack_id: bytes,
            bytes,
            allocations,
            frames: functions.iter().map(|name| Arc::new(frame(name, "/src/app.c", 10))).collect(),
            culprit: None,
            plumbing: Vec::new(),
            stable_id: None,
            stack_lost: false,
            truncated: None,
            trend: crate::model::Trend::default(),
            mapping: None,
            allocated: None,
            replacing: crate::model::Replacing::default(),
            outstanding: Vec::new(),
        }
    }

    pub fn report(pid: u32, time_unix_ms: u64, stacks: Vec<ReportStack>) -> Report {
        Report {
            pid,
            program: "/app/server".to_owned(),
            namespace_pid: None,
            workload: None,
            time_unix_ms,
            allocator: "/usr/lib/libc.so.6".to_owned(),
            min_age_ms: 0,
            sample_rate: 1,
            total_bytes: stacks.iter().map(|s| s.bytes).sum(),
            total_allocations: stacks.iter().map(|s| s.allocations).sum(),
            total_replacing: crate::model::Replacing::default(),
            total_stacks: stacks.len(),
            stacks,
            unwinding: None,
            health: crate::model::HealthCounters::default(),
            delta_unrecorded_frees: None,
            truncated_stacks: std::collections::BTreeMap::new(),
            hidden_mappings: crate::model::HiddenMappings::default(),
            modules: Vec::new(),
            missing_symbols: Vec::new(),
            memory: crate::report::memory::MemoryAccount::default(),
        }
    }

    /// A base and a newer snapshot of one server: the session cache grew,
    /// the buffer pool shrank, the config did not move, a handler is new.
    pub fn sample_diff(top: usize) -> Diff {
        let base = report(
            7,
            1_000,
            vec![
                stack(8192, 2, &["cache_insert", "handle_request", "main"]),
                stack(65_536, 16, &["pool_grow", "main"]),
                stack(512, 1, &["load_config", "main"]),
            ],
        );
        let new = report(
            7,
            61_000,
            vec![
                stack(40_960, 10, &["cache_insert", "handle_request", "main"]),
                stack(16_384, 4, &["pool_grow", "main"]),
                stack(512, 1, &["load_config", "main"]),
                stack(100, 1, &["new_handler", "main"]),
            ],
        );
        Diff::between(&base, &new, top)
    }

    #[test]
    fn stacks_are_matched_by_frames_and_only_changes_kept() {
        let diff = sample_diff(10);
        let rows: Vec<_> = diff
            .stacks
            .iter()
            .map(|s| (s.frames[0].function.clone().unwrap(), s.base_bytes, s.new_bytes, s.delta_bytes))
            .collect();
        assert_eq!(
            rows,
            [
                ("cache_insert".to_owned(), 8192, 40_960, 32_768),
                ("new_handler".to_owned(), 0, 100, 100),
                ("pool_grow".to_owned(), 65_536, 16_384, -49_152),
            ]
        );
        assert_eq!(diff.total_stacks, 3);
        assert_eq!(diff.delta_bytes(), 57_956 - 74_240);
        assert_eq!(diff.stacks[0].delta_allocations, 8);
    }

    #[test]
    fn top_keeps_the_largest_growth_and_the_largest_shrink() {
        let diff = sample_diff(1);
        let deltas: Vec<i64> = diff.stacks.iter().map(|s| s.delta_bytes).collect();
        assert_eq!(deltas, [32_768, -49_152]);
    }

    /// The diff's stacks point at the snapshots' frames: a frame in many
    /// stacks is one frame in memory.
    #[test]
    fn stacks_share_their_frames() {
        let base = report(7, 1_000, vec![]);
        let new = report(7, 2_000, (1..=100).map(|n| stack(n, 1, &[&format!("leak{n}"), "main"])).collect());
        let diff = Diff::between(&base, &new, usize::MAX);
        assert_eq!(diff.stacks.len(), 100);
        let main = &diff.stacks[0].frames[1];
        assert_eq!(main.function.as_deref(), Some("main"));
        assert!(
            diff.stacks.iter().all(|stack| Arc::ptr_eq(&stack.frames[1], main)),
            "one `main` frame for all"
        );
    }

    /// Equal changes are ordered as the frames' identities joined by `;`
    /// compare as strings, not frame by frame: `f@/src/app.c:12;main...`
    /// comes before `f@/src/app.c:1;main...`, since `2` is before `;`.
    #[test]
    fn ties_are_ordered_as_the_joined_identities() {
        let at_line = |line: u32| ReportStack {
            frames: vec![Arc::new(frame("f", "/src/app.c", line)), Arc::new(frame("main", "/src/app.c", 5))],
            culprit: None,
            plumbing: Vec::new(),
            stable_id: None,
            ..stack(64, 1, &[])
        };
        let new = report(7, 2_000, vec![at_line(1), at_line(12), at_line(2)]);
        let diff = Diff::between(&report(7, 1_000, vec![]), &new, 10);
        let lines: Vec<_> = diff.stacks.iter().map(|stack| stack.frames[0].line.unwrap()).collect();
        assert_eq!(lines, [12, 1, 2]);
    }

    #[test]
    fn unrecorded_frees_between_snapshots_of_one_run() {
        let at = |pid, time, frees, unrecorded| {
            let mut report = report(pid, time, vec![stack(100, 1, &["cache_insert", "main"])]);
            report.health = crate::model::HealthCounters {
                allocations: 10 + frees,
                frees,
                unrecorded_frees: unrecorded,
                ..Default::default()
            };
            report
        };
        let between = |base: &Report, new: &Report| Diff::between(base, new, 10).unrecorded_frees_between;
        assert_eq!(between(&at(7, 1_000, 10, Some(4)), &at(7, 2_000, 130, Some(124))), Some(120));
        // Another process, or another run of memleak (its counters start
        // again), or a snapshot saved before memleak counted them.
        assert_eq!(between(&at(7, 1_000, 10, Some(4)), &at(8, 2_000, 130, Some(124))), None);
        assert_eq!(between(&at(7, 1_000, 130, Some(4)), &at(7, 2_000, 10, Some(9))), None);
        assert_eq!(between(&at(7, 1_000, 10, None), &at(7, 2_000, 130, Some(124))), None);
        let json =
            serde_json::to_value(Diff::between(&at(7, 1, 1, Some(1)), &at(7, 2, 3, Some(3)), 1)).unwrap();
        assert_eq!(json["unrecorded_frees_between"], 2);
    }

    #[test]
    fn unnamed_frames_match_by_module_and_address() {
        let mut unnamed = frame("x", "", 0);
        unnamed.function = None;
        let mut elsewhere = unnamed.clone();
        elsewhere.address += 0x10;
        assert_ne!(identity(&unnamed), identity(&elsewhere));
        assert_eq!(identity(&unnamed), identity(&unnamed.clone()));
    }
}
