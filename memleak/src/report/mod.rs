//! Reports: a snapshot with symbolized stacks, sorted and cut to the top
//! N, and the renderers that write it, each format in a file of its own.
//! `render` and `render_diff` write any report into any `Write`, with no
//! stdout or file involved (`crate::output` is where reports go).
//!
//! - `options`: the vocabulary (format, weight, sort, top N);
//! - `culprit` and `skip_frames`: what names a stack, past the allocation
//!   plumbing that the one table of `skip_frames` lists;
//! - `text`, `json`, `folded`, `svg`, `pprof`: the renderers;
//! - `diff`: what changed between two reports; `saved`: the --save file
//!   format; `trace`: --trace's event lines; `subject`: whom a report is
//!   about, as every title names it.

pub mod culprit;
pub mod diff;
pub mod folded;
pub mod history;
pub mod json;
pub mod memory;
pub mod options;
pub mod pprof;
pub mod saved;
pub mod skip_frames;
pub mod subject;
pub mod svg;
pub mod text;
pub mod trace;

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    io,
    sync::Arc,
};

use memleak_common::{lost_stack_owner, ALLOCATOR_FUNCTIONS};
use serde::{Deserialize, Serialize};

use crate::model::{
    Allocated, Frame, HealthCounters, HiddenMappings, MappingKind, ModuleMapping, OutstandingAllocation,
    Replacing, Snapshot, StackUsage, Trend, Truncation, Unwinding, Workload,
};
use crate::symbolize::{missing::MissingSymbols, stable_id::StableIds};
use culprit::SkipRules;
use diff::Diff;
use options::{Format, Rendering, ReportOptions, SortKey};

/// Writes `report` as `rendering` says.
pub fn render(rendering: Rendering, report: &Report, out: &mut dyn io::Write) -> io::Result<()> {
    match rendering.format {
        Format::Text => text::render(report, rendering.full_stacks, out),
        Format::Json => json::render(report, out),
        Format::Folded => folded::render(report, rendering.weight, out),
        Format::Svg => svg::render(report, rendering.weight, out),
        Format::Pprof => pprof::render(report, out),
    }
}

/// Writes what changed between two reports as `rendering` says.
pub fn render_diff(rendering: Rendering, diff: &Diff, out: &mut dyn io::Write) -> io::Result<()> {
    match rendering.format {
        Format::Text => text::render_diff(diff, rendering.full_stacks, out),
        Format::Json => json::render_diff(diff, out),
        Format::Folded => folded::render_diff(diff, rendering.weight, out),
        Format::Svg => svg::render_diff(diff, rendering.weight, out),
        Format::Pprof => pprof::render_diff(diff, out),
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub pid: u32,
    /// The traced program's executable, as the process names it; `kernel`
    /// in kernel mode.
    pub program: String,
    /// The pid the process has in its own pid namespace (a container's),
    /// when that differs from `pid`.
    pub namespace_pid: Option<u32>,
    /// The container and pod it runs in, as `memleak serve` names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    pub time_unix_ms: u64,
    /// The object whose allocator was probed.
    pub allocator: String,
    /// Allocations younger than this were left out.
    pub min_age_ms: u64,
    /// One allocation in this many was recorded; every figure below is
    /// already scaled up by it.
    pub sample_rate: u32,
    /// How the user stacks were walked; none for the kernel's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unwinding: Option<Unwinding>,
    /// Over all stacks, not only those shown; never the allocator's own
    /// regions, which hold blocks counted already (--all-mmaps shows them).
    pub total_bytes: u64,
    pub total_allocations: u64,
    /// Of those, the blocks that took the place of blocks from before the
    /// attach (see `Replacing`), over all stacks.
    #[serde(default, skip_serializing_if = "Replacing::is_none")]
    pub total_replacing: Replacing,
    /// Stacks that hold memory, before the cut to the top N.
    pub total_stacks: usize,
    /// Largest first (most allocations first with --sort count).
    pub stacks: Vec<ReportStack>,
    /// For all traced processes together.
    pub health: HealthCounters,
    /// Of `health.unrecorded_frees`, those made since the previous report
    /// of the series; `None` in the first. Blocks memleak never saw
    /// allocated, freed meanwhile: a stack that replaces them looks like
    /// growth in this report's trends although the program's memory may
    /// hold still.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_unrecorded_frees: Option<u64>,
    /// How many of the process's stacks stop short, by why; over all its
    /// stacks, not only those shown.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub truncated_stacks: BTreeMap<Truncation, usize>,
    /// mmap regions not shown (--all-mmaps shows them).
    pub hidden_mappings: HiddenMappings,
    /// The file mappings the frames' addresses fall in, when an exporter
    /// needs them (pprof, saved snapshots).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules: Vec<ModuleMapping>,
    /// The objects whose frames shown lack names, or whose culprits lack
    /// file and line, and where those would come from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_symbols: Vec<MissingSymbols>,
    /// The process's resident memory beside the blocks tracked.
    #[serde(flatten)]
    pub memory: memory::MemoryAccount,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReportStack {
    /// The stack's id in this run; ids of different runs are unrelated.
    pub stack_id: u64,
    pub bytes: u64,
    pub allocations: u64,
    /// Innermost first; `frames[0]` called the allocator. Empty when the
    /// stack was lost. Shared with every other stack through the same
    /// code, and with the next report's.
    pub frames: Vec<Arc<Frame>>,
    /// The first frame of the program's own code, past the allocation
    /// plumbing (`culprit`): what the stack is named by. Marked where
    /// the report is built, with the rules of that run.
    #[serde(default)]
    pub culprit: Option<Arc<Frame>>,
    /// Which of `frames` are allocation plumbing, as the culprit's rules
    /// say: what a text report folds. Empty until the stack is named.
    #[serde(skip)]
    pub plumbing: Vec<bool>,
    /// The same for the same call path of the same binary in any run,
    /// with or without debug symbols (`symbolize::stable_id`); `/metrics`
    /// names the stack by it. `None` for a lost stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_id: Option<String>,
    /// The stack could not be stored (--max-stacks reached).
    pub stack_lost: bool,
    /// Why the walk stopped short of the stack's root, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<Truncation>,
    /// How the stack moved since the previous report.
    #[serde(flatten)]
    pub trend: Trend,
    /// For mmap regions, which kind; null for malloc & co.
    pub mapping: Option<MappingKind>,
    /// What the stack allocated since attach, freed or not, when tracked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<Allocated>,
    /// Of `bytes` and `allocations`, the blocks that took the place of
    /// blocks from before the attach: outstanding, but not growth.
    #[serde(default, skip_serializing_if = "Replacing::is_none")]
    pub replacing: Replacing,
    /// Each allocation, with -a.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outstanding: Vec<OutstandingAllocation>,
}

/// A cgroup's total over the processes reported in one round, written
/// after their reports, and over those that exited since the last total.
/// Fields in the order JSON has always had them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CgroupTotal {
    pub cgroup: String,
    pub processes: usize,
    pub total_allocations: u64,
    pub total_bytes: u64,
    /// The processes that exited since the last total, as their final
    /// reports had them: without them, a cgroup whose one process exited
    /// said 0 bytes in 0 processes under that process's report.
    #[serde(skip_serializing_if = "ExitedTotal::is_empty")]
    pub exited: ExitedTotal,
}

/// What processes that exited held, by their final reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExitedTotal {
    pub processes: usize,
    pub total_allocations: u64,
    pub total_bytes: u64,
}

impl ExitedTotal {
    /// Counts the final report of a process that exited.
    pub fn add(&mut self, report: &Report) {
        self.processes += 1;
        self.total_allocations += report.total_allocations;
        self.total_bytes += report.total_bytes;
    }

    pub fn is_empty(&self) -> bool {
        self.processes == 0
    }
}

impl CgroupTotal {
    /// The total of `reports`, the processes of cgroup `cgroup`, beside
    /// what those that exited since the last one held.
    pub fn of(cgroup: &std::path::Path, reports: &[Report], exited: ExitedTotal) -> Self {
        Self {
            cgroup: cgroup.display().to_string(),
            processes: reports.len(),
            total_allocations: reports.iter().map(|report| report.total_allocations).sum(),
            total_bytes: reports.iter().map(|report| report.total_bytes).sum(),
            exited,
        }
    }
}

/// Writes a cgroup's total: a line in text and JSON; nothing in the other
/// formats, which it would break.
pub fn render_cgroup_total(format: Format, total: &CgroupTotal, out: &mut dyn io::Write) -> io::Result<()> {
    match format {
        Format::Folded | Format::Svg | Format::Pprof => Ok(()),
        Format::Json => json::render_cgroup_total(total, out),
        Format::Text => text::render_cgroup_total(total, out),
    }
}

/// What a report is made with besides the snapshot.
pub struct ReportContext<'a> {
    pub program: &'a str,
    pub allocator: &'a str,
    pub namespace_pid: Option<u32>,
    pub min_age_ms: u64,
    pub top: usize,
    pub sort: SortKey,
    pub sample_rate: u32,
    pub unwinding: Option<Unwinding>,
    /// What a stack's culprit is looked for past.
    pub skips: &'a SkipRules,
}

/// Where a report gets its stacks' frames, each symbolized once, and how
/// their walks ended.
pub trait StackSource {
    fn frames(&mut self, stack_id: u64) -> Arc<[Arc<Frame>]>;
    fn truncation(&self, stack_id: u64) -> Option<Truncation>;
}

/// Frames alone, from a function: no stack is known to be truncated.
impl<F: FnMut(u64) -> Arc<[Arc<Frame>]>> StackSource for F {
    fn frames(&mut self, stack_id: u64) -> Arc<[Arc<Frame>]> {
        self(stack_id)
    }

    fn truncation(&self, _stack_id: u64) -> Option<Truncation> {
        None
    }
}

impl Report {
    /// The stack holding the most bytes, and its culprit as a reader
    /// looks for it: `make_session(int) (sessions.cpp:25)`.
    pub fn largest_culprit(&self) -> Option<(&ReportStack, String)> {
        let largest =
            self.stacks.iter().filter(|stack| stack.allocations > 0).max_by_key(|stack| stack.bytes)?;
        let culprit = largest.culprit.as_deref()?;
        let file = culprit.file.as_deref().map(|file| file.rsplit('/').next().unwrap_or(file));
        let named = match (file, culprit.line) {
            (Some(file), Some(line)) => format!("{} ({file}:{line})", text::frame_name(culprit)),
            _ => text::frame_name(culprit),
        };
        Some((largest, named))
    }

    /// Sorts the snapshot's stacks, keeps the top N and attaches their
    /// frames: stacks cut off are never symbolized.
    pub fn build(
        snapshot: Snapshot,
        context: &ReportContext,
        trends: &HashMap<u64, Trend>,
        mut stack_source: impl StackSource,
    ) -> Self {
        // Sampling applies to malloc & co.; mmaps are all recorded.
        let sampled = u64::from(context.sample_rate.max(1));
        let scale = |usage: &StackUsage| if usage.mapping.is_some() { 1 } else { sampled };
        let (total_bytes, total_allocations, total_replacing) = totals(&snapshot.stacks, scale);
        let total_stacks = snapshot.stacks.iter().filter(|stack| stack.allocations > 0).count();
        let truncated_stacks = truncations(&snapshot, &stack_source);
        let mut stacks: Vec<ReportStack> = snapshot
            .stacks
            .into_iter()
            .map(|usage| {
                let scale = scale(&usage);
                let trend = trends.get(&usage.stack_id).copied().unwrap_or_default().scaled(scale);
                ReportStack {
                    stack_id: usage.stack_id,
                    bytes: usage.bytes * scale,
                    allocations: usage.allocations * scale,
                    frames: Vec::new(),
                    culprit: None,
                    plumbing: Vec::new(),
                    stable_id: None,
                    stack_lost: lost_stack_owner(usage.stack_id).is_some(),
                    truncated: stack_source.truncation(usage.stack_id),
                    trend,
                    mapping: usage.mapping,
                    allocated: usage.allocated.map(|allocated| allocated.scaled(scale)),
                    replacing: usage.replacing.scaled(scale),
                    outstanding: usage.outstanding,
                }
            })
            .collect();
        sort_stacks(&mut stacks, context.sort);
        stacks.truncate(context.top);
        for stack in stacks.iter_mut().filter(|stack| !stack.stack_lost) {
            stack.frames = without_allocator_frames(&stack_source.frames(stack.stack_id), context.allocator);
        }
        let mut report = Report {
            pid: snapshot.pid,
            program: context.program.to_owned(),
            namespace_pid: context.namespace_pid,
            workload: None,
            time_unix_ms: snapshot.time_unix_ms,
            allocator: context.allocator.to_owned(),
            min_age_ms: context.min_age_ms,
            sample_rate: context.sample_rate,
            unwinding: context.unwinding,
            total_bytes,
            total_allocations,
            total_replacing,
            total_stacks,
            stacks,
            health: snapshot.counters,
            delta_unrecorded_frees: None,
            truncated_stacks,
            hidden_mappings: snapshot.hidden,
            modules: Vec::new(),
            missing_symbols: Vec::new(),
            memory: memory::MemoryAccount::default(),
        };
        report.name_stacks(context.skips);
        report
    }

    /// Outstanding bytes that replacing blocks from before the attach does
    /// not explain.
    pub fn total_new_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.total_replacing.bytes)
    }

    /// Names each stack: its culprit, as `skips` says, and its stable id.
    pub fn name_stacks(&mut self, skips: &SkipRules) {
        let mut stable_ids = StableIds::default();
        let mut culprits = skips.culprits(&self.allocator, &self.program);
        for stack in &mut self.stacks {
            let (culprit, plumbing) = culprits.named(&stack.frames);
            (stack.culprit, stack.plumbing) = (culprit.cloned(), plumbing);
            stack.stable_id = (!stack.stack_lost).then(|| stable_ids.of(&stack.frames));
        }
    }

    /// Re-sorts the stacks and keeps the top N, as `build` does.
    fn keep_top(&mut self, sort: SortKey, top: usize) {
        sort_stacks(&mut self.stacks, sort);
        self.stacks.truncate(top);
    }

    /// Cuts a report built whole (a snapshot) to what is shown in
    /// `format`: the top N, each allocation only with -a, and stacks that
    /// hold nothing now (kept for what they allocated) only where the
    /// format shows freed stacks (pprof's `alloc_space`).
    pub fn cut_for_display(&mut self, options: &ReportOptions, format: Format) {
        if !options.show_allocs {
            self.stacks.iter_mut().for_each(|stack| stack.outstanding.clear());
        }
        if !format.shows_freed_stacks() {
            self.stacks.retain(|stack| stack.allocations > 0);
        }
        self.keep_top(options.sort, options.top);
    }
}

/// Outstanding bytes, allocations and replacing blocks over `stacks`,
/// each scaled as `scale` says. The allocator's own regions (--all-mmaps
/// shows them) are left out: they hold blocks counted already, as a glibc
/// block of 1 MiB is an mmap of its own.
fn totals(stacks: &[StackUsage], scale: impl Fn(&StackUsage) -> u64) -> (u64, u64, Replacing) {
    let counted = || stacks.iter().filter(|stack| stack.mapping != Some(MappingKind::AllocatorMmap));
    (
        counted().map(|stack| stack.bytes * scale(stack)).sum(),
        counted().map(|stack| stack.allocations * scale(stack)).sum(),
        stacks.iter().map(|stack| stack.replacing.scaled(scale(stack))).sum(),
    )
}

/// How many of the stacks holding memory stop short, by why.
fn truncations(snapshot: &Snapshot, stack_source: &impl StackSource) -> BTreeMap<Truncation, usize> {
    let mut truncated_stacks = BTreeMap::new();
    for stack in snapshot.stacks.iter().filter(|stack| stack.allocations > 0) {
        if let Some(truncation) = stack_source.truncation(stack.stack_id) {
            *truncated_stacks.entry(truncation).or_default() += 1;
        }
    }
    truncated_stacks
}

/// Largest first by the sort key; ties broken by id so that equal reports
/// print identically.
fn sort_stacks(stacks: &mut [ReportStack], sort: SortKey) {
    stacks.sort_by(stack_order(sort));
}

/// The order in which stacks are shown: largest first by `sort`, then by id.
fn stack_order(sort: SortKey) -> impl Fn(&ReportStack, &ReportStack) -> std::cmp::Ordering {
    let rank = move |stack: &ReportStack| -> [i128; 3] {
        let (bytes, allocations) = (i128::from(stack.bytes), i128::from(stack.allocations));
        match sort {
            SortKey::Size => [bytes, allocations, 0],
            SortKey::Count => [allocations, bytes, 0],
            SortKey::Growth => [
                i128::from(stack.trend.growing_reports),
                i128::from(stack.trend.growth_per_report.unwrap_or(0)),
                bytes,
            ],
        }
    };
    move |a, b| rank(b).cmp(&rank(a)).then(a.stack_id.cmp(&b.stack_id))
}

/// The places in `stacks` of those `Report::cut_for_display` keeps, in
/// the order it leaves them: for a reader that holds stacks in a form of
/// its own (a saved snapshot's) and expands only the ones shown.
pub fn shown_stacks(stacks: &[ReportStack], options: &ReportOptions, format: Format) -> Vec<usize> {
    let mut shown: Vec<usize> =
        (0..stacks.len()).filter(|&i| format.shows_freed_stacks() || stacks[i].allocations > 0).collect();
    let order = stack_order(options.sort);
    // Stable, as `sort_stacks` is: equal stacks keep their order.
    shown.sort_by(|&a, &b| order(&stacks[a], &stacks[b]));
    shown.truncate(options.top);
    shown
}

/// `text` with each control character (C0, DEL and C1: what
/// `char::is_control` says) and each bidirectional embedding, override or
/// isolate (U+202A to U+202E, U+2066 to U+2069) written as an escape,
/// `\n`, `\x1b` or `\u{202e}`, so that a name cannot move the cursor,
/// retitle the terminal, start a line of its own or show its characters
/// in another order than they are. A backslash is written `\\`, so that
/// a name holding the four characters `\x1b` is not read as holding an
/// escape. Text without any of these comes back as it was, not copied.
///
/// Names are escaped here, as the text formats (text, folded, and svg,
/// drawn from folded lines) write them, not once when frames are
/// symbolized: JSON and pprof carry a name as data, which their encodings
/// already keep apart from the format's own characters, and their readers
/// want the real name; saved snapshots keep the real name too, so that
/// `memleak diff` matches stacks by it; and snapshots saved before names
/// were escaped are escaped when rendered. Only what these formats write
/// changes, and only where a name holds one of these characters.
pub fn printable(text: &str) -> Cow<'_, str> {
    let escaped_here = |c: char| c.is_control() || c == '\\' || is_bidirectional_control(c);
    if !text.chars().any(escaped_here) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match u32::from(c) {
            _ if !escaped_here(c) => escaped.push(c),
            _ if c == '\\' => escaped.push_str("\\\\"),
            _ if c == '\t' => escaped.push_str("\\t"),
            _ if c == '\n' => escaped.push_str("\\n"),
            _ if c == '\r' => escaped.push_str("\\r"),
            code @ ..0x80 => {
                let _ = write!(escaped, "\\x{code:02x}");
            }
            code => {
                let _ = write!(escaped, "\\u{{{code:x}}}");
            }
        }
    }
    Cow::Owned(escaped)
}

/// The characters that change the order text is shown in, up to the end
/// of the line: a name holding U+202E shows what follows it backwards.
fn is_bidirectional_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Drops leading frames inside the allocator's own entry points, so that
/// `frames[0]` is the code that asked for memory.
fn without_allocator_frames(frames: &[Arc<Frame>], allocator: &str) -> Vec<Arc<Frame>> {
    let is_allocator_entry = |frame: &Frame| {
        frame.module.as_deref() == Some(allocator)
            && frame
                .function
                .as_deref()
                .is_some_and(|name| ALLOCATOR_FUNCTIONS.iter().any(|f| f.name == name))
    };
    let skip = frames.iter().take_while(|frame| is_allocator_entry(frame)).count();
    frames[skip..].to_vec()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::StackUsage;
    use options::Rendering;

    pub fn frame(function: &str, file: &str, line: u32) -> Frame {
        Frame {
            address: 0x0040_1000 + u64::from(line),
            function: Some(function.to_owned()),
            offset: Some(0x1f),
            file: Some(file.to_owned()),
            line: Some(line),
            inlined: false,
            module: Some("/app/leaker".to_owned()),
            ..Frame::default()
        }
    }

    pub fn usage(stack_id: u64, bytes: u64, allocations: u64) -> StackUsage {
        StackUsage { stack_id, bytes, allocations, ..StackUsage::default() }
    }

    pub fn sample_report(top: usize) -> Report {
        sample_report_with(top, SortKey::Size, 1)
    }

    pub fn sample_report_with(top: usize, sort: SortKey, sample_rate: u32) -> Report {
        let snapshot = Snapshot {
            pid: 4242,
            time_unix_ms: 1_764_510_000_000,
            stacks: vec![
                usage(1, 100, 1),
                usage(2, 24_576, 3),
                usage(3, 100, 2),
                usage(memleak_common::lost_stack_id(4242), 64, 1),
            ],
            counters: HealthCounters { allocations: 12, frees: 5, stacks_lost: 1, ..Default::default() },
            ..Snapshot::default()
        };
        let context = ReportContext {
            program: "/app/leaker",
            allocator: "/usr/lib/libc.so.6",
            namespace_pid: None,
            min_age_ms: 500,
            top,
            sort,
            sample_rate,
            unwinding: None,
            skips: &SkipRules::default(),
        };
        let trends = HashMap::from([
            (2, Trend { delta_bytes: Some(8192), growing_reports: 3, growth_per_report: Some(8192) }),
            (3, Trend { delta_bytes: Some(50), growing_reports: 5, growth_per_report: Some(20) }),
        ]);
        Report::build(snapshot, &context, &trends, |id| match id {
            2 => [frame("fibonacci", "/src/leaker.c", 9), frame("child", "/src/leaker.c", 20)]
                .map(Arc::new)
                .into(),
            _ => [frame("other", "/src/leaker.c", 30)].map(Arc::new).into(),
        })
    }

    #[test]
    fn stacks_are_sorted_by_bytes_then_count_and_cut_to_top() {
        let report = sample_report(3);
        let sizes: Vec<_> = report.stacks.iter().map(|s| (s.bytes, s.allocations)).collect();
        assert_eq!(sizes, [(24_576, 3), (100, 2), (100, 1)]);
        assert_eq!(report.total_bytes, 24_576 + 100 + 100 + 64);
        assert_eq!(report.total_allocations, 7);
        assert_eq!(report.total_stacks, 4);
        assert_eq!(report.stacks[0].frames[0].function.as_deref(), Some("fibonacci"));
    }

    #[test]
    fn count_order_puts_the_most_allocations_first() {
        let report = sample_report_with(2, SortKey::Count, 1);
        let order: Vec<_> = report.stacks.iter().map(|s| (s.allocations, s.bytes)).collect();
        assert_eq!(order, [(3, 24_576), (2, 100)]);
    }

    #[test]
    fn growth_order_puts_the_steadiest_growth_first() {
        let report = sample_report_with(3, SortKey::Growth, 1);
        let order: Vec<_> = report.stacks.iter().map(|s| (s.bytes, s.allocations)).collect();
        // 100 bytes growing for 5 reports beats 24576 growing for 3.
        assert_eq!(order, [(100, 2), (24_576, 3), (100, 1)]);
    }

    #[test]
    fn sampled_figures_are_scaled_up() {
        let report = sample_report_with(1, SortKey::Size, 10);
        assert_eq!((report.total_bytes, report.total_allocations), (248_400, 70));
        assert_eq!((report.stacks[0].bytes, report.stacks[0].allocations), (245_760, 30));
        assert_eq!(report.stacks[0].trend.delta_bytes, Some(81_920));
    }

    #[test]
    fn a_lost_stack_keeps_its_bytes_without_frames() {
        let report = sample_report(10);
        let lost = report.stacks.iter().find(|s| s.stack_lost).expect("the lost stack is reported");
        assert_eq!((lost.bytes, lost.frames.len()), (64, 0));
    }

    #[test]
    fn allocator_entry_frames_are_dropped() {
        let mut malloc = frame("malloc", "malloc.c", 1);
        malloc.module = Some("/usr/lib/libc.so.6".to_owned());
        let frames = [malloc, frame("main", "/src/leaker.c", 5)];
        let kept = without_allocator_frames(&frames.map(Arc::new), "/usr/lib/libc.so.6");
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].function.as_deref(), Some("main"));
    }

    #[test]
    fn control_characters_are_escaped_and_nothing_else() {
        assert!(
            matches!(printable("operator new(unsigned long)"), Cow::Borrowed(_)),
            "nothing to escape: not copied"
        );
        assert_eq!(printable("\x1b[31mred\nline\ttab\x7f\0"), "\\x1b[31mred\\nline\\ttab\\x7f\\x00");
        assert_eq!(printable("\u{9b}2J\u{85}"), "\\u{9b}2J\\u{85}", "C1 controls too");
        let kept = "caf\u{e9} \u{a0}\u{2028}\u{200f}";
        assert_eq!(printable(kept), kept, "printable Unicode is left as it is");
        assert_eq!(printable("a\\x1b"), "a\\\\x1b", "a backslash is escaped, so no escape is forged");
        assert_eq!(
            printable("evil\u{202e}txt.exe\u{2066}"),
            "evil\\u{202e}txt.exe\\u{2066}",
            "bidirectional overrides and isolates"
        );
    }

    /// A report whose one stack a hostile program named: colour codes and a
    /// line break in the function, a bell in the file, a C1 CSI in the module.
    fn hostile_report() -> Report {
        let mut report = sample_report(1);
        let frame = Arc::make_mut(&mut report.stacks[0].frames[0]);
        frame.function = Some("\x1b[31mred\nforged 999 bytes".to_owned());
        frame.file = Some("/src/\x07bell.c".to_owned());
        frame.module = Some("/lib/\u{9b}2Jlib.so".to_owned());
        report
    }

    fn rendered(format: Format, report: &Report) -> String {
        let mut out = Vec::new();
        render(Rendering { format, weight: options::Weight::Bytes, full_stacks: false }, report, &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    /// What the format itself writes: lines, and tabs in text.
    fn is_format_character(c: char) -> bool {
        c == '\n' || c == '\t'
    }

    #[test]
    fn hostile_names_are_escaped_in_text_and_folded_and_kept_in_json() {
        let report = hostile_report();
        let text = rendered(Format::Text, &report);
        assert!(
            text.contains(
                "\n\t\t\\x1b[31mred\\nforged 999 bytes+0x1f (/src/\\x07bell.c:9) [/lib/\\u{9b}2Jlib.so]\n"
            ),
            "{text}"
        );
        assert!(!text.chars().any(|c| c.is_control() && !is_format_character(c)), "{text:?}");
        let folded = rendered(Format::Folded, &report);
        assert_eq!(folded, "child;\\x1b[31mred\\nforged\u{a0}999\u{a0}bytes 24576\n");
        let json: serde_json::Value = serde_json::from_str(&rendered(Format::Json, &report)).unwrap();
        let frame = &json["stacks"][0]["frames"][0];
        assert_eq!(frame["function"], "\x1b[31mred\nforged 999 bytes", "JSON keeps the name as it is");
        assert_eq!(
            (&frame["file"], &frame["module"]),
            (&"/src/\x07bell.c".into(), &"/lib/\u{9b}2Jlib.so".into())
        );
        let svg = rendered(Format::Svg, &report);
        assert!(svg.contains("\\x1b[31mred\\nforged"), "drawn escaped");
        assert!(
            !svg.chars().any(|c| c.is_control() && !is_format_character(c)),
            "no control character in the SVG"
        );
    }
}

#[cfg(test)]
mod golden_tests;
