//! `memleak diff BASE NEW`: what grew and what shrank between two saved
//! snapshots, per stack; jeprof's `--base`, for any running process.
//!
//! Stacks are matched by their symbolized frames, not by id or address:
//! ids are per run and addresses move between runs (ASLR). A frame with no
//! function name falls back to its module and address.

use std::collections::HashMap;

use serde::Serialize;

use super::{Report, ReportStack};
use crate::model::{Frame, MappingKind, ModuleMapping};

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diff {
    pub base: Side,
    pub new: Side,
    /// Stacks whose outstanding bytes or count changed, largest growth
    /// first, then largest shrink last.
    pub stacks: Vec<DiffStack>,
    /// Changed stacks before the cut to the top N.
    pub total_stacks: usize,
    /// The newer snapshot's mappings, for pprof.
    #[serde(skip)]
    pub modules: Vec<ModuleMapping>,
}

/// What the diff says of each of its two snapshots.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Side {
    pub pid: u32,
    pub program: String,
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
    /// Innermost first, from the newer snapshot when the stack is in both.
    pub frames: Vec<Frame>,
    pub stack_lost: bool,
    pub mapping: Option<MappingKind>,
}

impl Diff {
    /// Compares every stack of `base` and `new`; keeps the `top` that grew
    /// most and the `top` that shrank most.
    pub fn between(base: &Report, new: &Report, top: usize) -> Self {
        let mut by_identity: HashMap<String, DiffStack> = HashMap::new();
        for (stack, is_new) in
            base.stacks.iter().map(|s| (s, false)).chain(new.stacks.iter().map(|s| (s, true)))
        {
            let entry = by_identity.entry(identity(stack)).or_insert_with(|| DiffStack {
                base_bytes: 0,
                new_bytes: 0,
                base_allocations: 0,
                new_allocations: 0,
                delta_bytes: 0,
                delta_allocations: 0,
                frames: stack.frames.clone(),
                stack_lost: stack.stack_lost,
                mapping: stack.mapping,
            });
            if is_new {
                entry.new_bytes += stack.bytes;
                entry.new_allocations += stack.allocations;
                entry.frames.clone_from(&stack.frames);
            } else {
                entry.base_bytes += stack.bytes;
                entry.base_allocations += stack.allocations;
            }
        }
        let mut changed: Vec<DiffStack> = by_identity
            .into_values()
            .map(|mut stack| {
                stack.delta_bytes = stack.new_bytes as i64 - stack.base_bytes as i64;
                stack.delta_allocations = stack.new_allocations as i64 - stack.base_allocations as i64;
                stack
            })
            .filter(|stack| stack.delta_bytes != 0 || stack.delta_allocations != 0)
            .collect();
        let total_stacks = changed.len();
        // Ties broken by the frames, so that a diff prints the same twice.
        changed.sort_by(|a, b| {
            (b.delta_bytes, b.delta_allocations)
                .cmp(&(a.delta_bytes, a.delta_allocations))
                .then_with(|| identity_of_frames(&a.frames).cmp(&identity_of_frames(&b.frames)))
        });
        let grew = changed.iter().take_while(|stack| stack.delta_bytes > 0).count().min(top);
        let shrank = changed.iter().rev().take_while(|stack| stack.delta_bytes < 0).count().min(top);
        let shrank_from = changed.len() - shrank;
        let stacks = changed[..grew].iter().chain(&changed[shrank_from..]).cloned().collect();
        Diff { base: Side::of(base), new: Side::of(new), stacks, total_stacks, modules: new.modules.clone() }
    }

    /// Bytes outstanding in the newer snapshot minus the base.
    pub fn delta_bytes(&self) -> i64 {
        self.new.total_bytes as i64 - self.base.total_bytes as i64
    }
}

impl Side {
    fn of(report: &Report) -> Self {
        Side {
            pid: report.pid,
            program: report.program.clone(),
            time_unix_ms: report.time_unix_ms,
            total_bytes: report.total_bytes,
            total_allocations: report.total_allocations,
        }
    }
}

/// What makes two stacks of different snapshots the same stack.
fn identity(stack: &ReportStack) -> String {
    let kind = match stack.mapping {
        None => "",
        Some(MappingKind::Mmap) => "mmap;",
        Some(MappingKind::AllocatorMmap) => "allocator mmap;",
        Some(MappingKind::ThreadStack) => "thread stack;",
    };
    if stack.stack_lost {
        return format!("{kind}[stack lost]");
    }
    format!("{kind}{}", identity_of_frames(&stack.frames))
}

fn identity_of_frames(frames: &[Frame]) -> String {
    let names: Vec<String> = frames
        .iter()
        .map(|frame| match &frame.function {
            Some(function) => {
                format!("{function}@{}:{}", frame.file.as_deref().unwrap_or(""), frame.line.unwrap_or(0))
            }
            None => format!("{}@{:#x}", frame.module.as_deref().unwrap_or(""), frame.address),
        })
        .collect();
    names.join(";")
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
            frames: functions.iter().map(|name| frame(name, "/src/app.c", 10)).collect(),
            stack_lost: false,
            truncated: None,
            trend: crate::model::Trend::default(),
            mapping: None,
            allocated: None,
            outstanding: Vec::new(),
        }
    }

    pub fn report(pid: u32, time_unix_ms: u64, stacks: Vec<ReportStack>) -> Report {
        Report {
            pid,
            program: "/app/server".to_owned(),
            namespace_pid: None,
            time_unix_ms,
            allocator: "/usr/lib/libc.so.6".to_owned(),
            min_age_ms: 0,
            sample_rate: 1,
            total_bytes: stacks.iter().map(|s| s.bytes).sum(),
            total_allocations: stacks.iter().map(|s| s.allocations).sum(),
            total_stacks: stacks.len(),
            stacks,
            unwinding: None,
            health: crate::model::HealthCounters::default(),
            truncated_stacks: std::collections::BTreeMap::new(),
            hidden_mappings: crate::model::HiddenMappings::default(),
            modules: Vec::new(),
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

    #[test]
    fn unnamed_frames_match_by_module_and_address() {
        let mut unnamed = frame("x", "", 0);
        unnamed.function = None;
        let mut elsewhere = unnamed.clone();
        elsewhere.address += 0x10;
        assert_ne!(identity_of_frames(&[unnamed.clone()]), identity_of_frames(&[elsewhere]));
        assert_eq!(identity_of_frames(&[unnamed.clone()]), identity_of_frames(&[unnamed]));
    }
}
