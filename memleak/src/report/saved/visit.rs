//! Reading a snapshot's report as it is parsed: each frame looked up in a
//! table of those met so far and kept once, and every byte kept counted
//! against a budget. serde's derived `Deserialize` for `Report` would hold
//! every stack's frames as their own strings (and buffers each stack whole
//! first, for its flattened `Trend`); these visitors read the same fields,
//! as `Report` and `ReportStack` serialize them. A field added to either
//! must be read here too: `finish` below builds both whole, so it does not
//! compile until it is.
//!
//! The budget is an estimate of the heap a snapshot takes once read:
//! each distinct frame with its strings and its places in the table and
//! the index; 4 bytes per frame of a stack; each stack, allocation and
//! mapping. Vectors that grow as they are read are counted twice, for the
//! room they keep spare.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    hash::{Hash, Hasher},
    marker::PhantomData,
    mem::size_of,
    sync::Arc,
};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::model::{
    Allocated, Frame, HealthCounters, HiddenMappings, MappingKind, ModuleMapping, OutstandingAllocation,
    Replacing, Trend, Truncation, Unwinding, Workload,
};
use crate::{
    report::{Report, ReportStack},
    symbolize::missing::MissingSymbols,
};

/// Which limit stopped a reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exceeded {
    Inflated,
    Value,
    Memory,
}

/// malloc's own bytes per allocation, about.
const MALLOC_OVERHEAD: usize = 16;

/// What a frame takes on the heap: itself and its strings.
pub fn frame_cost(frame: &Frame) -> usize {
    let strings = [&frame.function, &frame.file, &frame.module, &frame.build_id];
    size_of::<Frame>()
        + strings
            .iter()
            .map(|text| text.as_ref().map_or(0, |text| text.len() + MALLOC_OVERHEAD))
            .sum::<usize>()
}

/// What a distinct frame takes besides itself: its `Arc`, its place in the
/// table and its entry in the index, with the index's spare room.
const INTERNED_OVERHEAD: usize = 2 * size_of::<usize>()
    + MALLOC_OVERHEAD
    + size_of::<Arc<Frame>>()
    + 2 * (size_of::<FrameKey>() + size_of::<u32>());

/// The memory a reading may still take.
pub struct Budget {
    left: u64,
    exceeded: bool,
}

impl Budget {
    pub fn left(&self) -> u64 {
        self.left
    }

    pub fn exceeded(&self) -> Option<Exceeded> {
        self.exceeded.then_some(Exceeded::Memory)
    }

    /// Takes `bytes` from what is left, or fails the parse.
    fn take<E: de::Error>(&mut self, bytes: usize) -> Result<(), E> {
        let Some(left) = self.left.checked_sub(bytes as u64) else {
            self.exceeded = true;
            return Err(E::custom("past the memory a snapshot may take"));
        };
        self.left = left;
        Ok(())
    }
}

/// Each distinct frame met, once, numbered in the order first met.
#[derive(Default)]
pub struct Interner {
    table: Vec<Arc<Frame>>,
    index: HashMap<FrameKey, u32>,
}

/// A frame as a key: hashed on every field, as `Frame`'s `Eq` compares them.
struct FrameKey(Arc<Frame>);

impl Hash for FrameKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let Frame {
            address,
            function,
            offset,
            file,
            line,
            inlined,
            module,
            file_offset,
            build_id,
            cold_part,
            kind,
        } = &*self.0;
        (address, function, offset, file, line, inlined, module, file_offset, build_id, cold_part, kind)
            .hash(state);
    }
}

impl PartialEq for FrameKey {
    fn eq(&self, other: &Self) -> bool {
        *self.0 == *other.0
    }
}

impl Eq for FrameKey {}

impl Interner {
    /// The place of `frame` in the table; with the memory it takes, when it
    /// is new.
    #[allow(clippy::cast_possible_truncation, reason = "fewer than 2^32 frames: each takes over 100 bytes")]
    pub fn intern(&mut self, frame: Frame) -> (u32, Option<usize>) {
        let key = FrameKey(Arc::new(frame));
        if let Some(&place) = self.index.get(&key) {
            return (place, None);
        }
        let place = self.table.len() as u32;
        let cost = frame_cost(&key.0) + INTERNED_OVERHEAD;
        self.table.push(Arc::clone(&key.0));
        self.index.insert(key, place);
        (place, Some(cost))
    }

    pub fn into_table(self) -> Vec<Arc<Frame>> {
        self.table
    }
}

/// What reading one snapshot keeps while it reads.
pub struct Reading {
    pub interner: Interner,
    pub budget: Budget,
}

impl Reading {
    pub fn new(memory: u64) -> Self {
        Self { interner: Interner::default(), budget: Budget { left: memory, exceeded: false } }
    }
}

/// Stacks as read: each without its frames, and those frames as places in
/// the interner's table.
type Stacks = (Vec<ReportStack>, Vec<Box<[u32]>>);

/// A report as read: its stacks without frames, and each one's frames as
/// places in the interner's table.
pub struct Body {
    pub report: Report,
    pub stack_frames: Vec<Box<[u32]>>,
}

/// Reads a report into a `Body`.
pub struct ReportSeed<'r>(pub &'r mut Reading);

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum ReportField {
    Pid,
    Program,
    NamespacePid,
    Workload,
    TimeUnixMs,
    Allocator,
    MinAgeMs,
    SampleRate,
    Unwinding,
    TotalBytes,
    TotalAllocations,
    TotalReplacing,
    TotalStacks,
    Stacks,
    Health,
    DeltaUnrecordedFrees,
    TruncatedStacks,
    HiddenMappings,
    Modules,
    MissingSymbols,
    #[serde(other)]
    Other,
}

/// A report's fields as they are met; `None` until then.
#[derive(Default)]
struct ReportFields {
    pid: Option<u32>,
    program: Option<String>,
    namespace_pid: Option<u32>,
    workload: Option<Workload>,
    time_unix_ms: Option<u64>,
    allocator: Option<String>,
    min_age_ms: Option<u64>,
    sample_rate: Option<u32>,
    unwinding: Option<Unwinding>,
    total_bytes: Option<u64>,
    total_allocations: Option<u64>,
    total_replacing: Option<Replacing>,
    total_stacks: Option<usize>,
    stacks: Option<Stacks>,
    health: Option<HealthCounters>,
    delta_unrecorded_frees: Option<u64>,
    truncated_stacks: BTreeMap<Truncation, usize>,
    hidden_mappings: Option<HiddenMappings>,
    modules: Vec<ModuleMapping>,
    missing_symbols: Vec<MissingSymbols>,
}

fn required<T, E: de::Error>(value: Option<T>, field: &'static str) -> Result<T, E> {
    value.ok_or_else(|| E::missing_field(field))
}

impl<'de> DeserializeSeed<'de> for ReportSeed<'_> {
    type Value = Body;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Body, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ReportSeed<'_> {
    type Value = Body;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a memleak report")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body, A::Error> {
        let mut fields = ReportFields::default();
        while let Some(field) = map.next_key::<ReportField>()? {
            match field {
                ReportField::Pid => fields.pid = Some(map.next_value()?),
                ReportField::Program => fields.program = Some(map.next_value()?),
                ReportField::NamespacePid => fields.namespace_pid = map.next_value()?,
                ReportField::Workload => fields.workload = map.next_value()?,
                ReportField::TimeUnixMs => fields.time_unix_ms = Some(map.next_value()?),
                ReportField::Allocator => fields.allocator = Some(map.next_value()?),
                ReportField::MinAgeMs => fields.min_age_ms = Some(map.next_value()?),
                ReportField::SampleRate => fields.sample_rate = Some(map.next_value()?),
                ReportField::Unwinding => fields.unwinding = map.next_value()?,
                ReportField::TotalBytes => fields.total_bytes = Some(map.next_value()?),
                ReportField::TotalAllocations => fields.total_allocations = Some(map.next_value()?),
                ReportField::TotalReplacing => fields.total_replacing = Some(map.next_value()?),
                ReportField::TotalStacks => fields.total_stacks = Some(map.next_value()?),
                ReportField::Stacks => fields.stacks = Some(map.next_value_seed(StacksSeed(&mut *self.0))?),
                ReportField::Health => fields.health = Some(map.next_value()?),
                ReportField::DeltaUnrecordedFrees => {
                    fields.delta_unrecorded_frees = map.next_value()?;
                }
                ReportField::TruncatedStacks => fields.truncated_stacks = map.next_value()?,
                ReportField::HiddenMappings => fields.hidden_mappings = Some(map.next_value()?),
                ReportField::Modules => {
                    fields.modules = map.next_value_seed(Counted::new(&mut self.0.budget, module_cost))?;
                }
                ReportField::MissingSymbols => {
                    fields.missing_symbols =
                        map.next_value_seed(Counted::new(&mut self.0.budget, missing_symbols_cost))?;
                }
                ReportField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        fields.finish()
    }
}

impl ReportFields {
    fn finish<E: de::Error>(self) -> Result<Body, E> {
        let (stacks, stack_frames) = required(self.stacks, "stacks")?;
        let report = Report {
            pid: required(self.pid, "pid")?,
            program: required(self.program, "program")?,
            namespace_pid: self.namespace_pid,
            workload: self.workload,
            time_unix_ms: required(self.time_unix_ms, "time_unix_ms")?,
            allocator: required(self.allocator, "allocator")?,
            min_age_ms: required(self.min_age_ms, "min_age_ms")?,
            sample_rate: required(self.sample_rate, "sample_rate")?,
            unwinding: self.unwinding,
            total_bytes: required(self.total_bytes, "total_bytes")?,
            total_allocations: required(self.total_allocations, "total_allocations")?,
            total_replacing: self.total_replacing.unwrap_or_default(),
            total_stacks: required(self.total_stacks, "total_stacks")?,
            stacks,
            health: required(self.health, "health")?,
            delta_unrecorded_frees: self.delta_unrecorded_frees,
            truncated_stacks: self.truncated_stacks,
            hidden_mappings: required(self.hidden_mappings, "hidden_mappings")?,
            modules: self.modules,
            missing_symbols: self.missing_symbols,
            memory: crate::report::memory::MemoryAccount::default(),
        };
        Ok(Body { report, stack_frames })
    }
}

fn missing_symbols_cost(missing: &MissingSymbols) -> usize {
    size_of::<MissingSymbols>()
        + [Some(&missing.module), missing.build_id.as_ref(), Some(&missing.advice)]
            .iter()
            .map(|text| text.map_or(0, |text| text.len() + MALLOC_OVERHEAD))
            .sum::<usize>()
}

fn module_cost(module: &ModuleMapping) -> usize {
    let build_id = module.build_id.as_ref().map_or(0, |id| id.len() + MALLOC_OVERHEAD);
    2 * size_of::<ModuleMapping>() + module.path.len() + MALLOC_OVERHEAD + build_id
}

fn allocation_cost(_: &OutstandingAllocation) -> usize {
    2 * size_of::<OutstandingAllocation>()
}

/// A stack, its frames aside, and the room it takes in the stack lists.
const STACK_COST: usize = 2 * (size_of::<ReportStack>() + size_of::<Box<[u32]>>());

/// Reads a report's stacks.
struct StacksSeed<'r>(&'r mut Reading);

impl<'de> DeserializeSeed<'de> for StacksSeed<'_> {
    type Value = Stacks;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for StacksSeed<'_> {
    type Value = Stacks;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a list of stacks")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let (mut stacks, mut stack_frames) = (Vec::new(), Vec::new());
        while let Some((stack, frames)) = seq.next_element_seed(StackSeed(&mut *self.0))? {
            self.0.budget.take(STACK_COST)?;
            stacks.push(stack);
            stack_frames.push(frames);
        }
        Ok((stacks, stack_frames))
    }
}

/// Reads one stack: a `ReportStack` without frames, and its frames' places.
struct StackSeed<'r>(&'r mut Reading);

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum StackField {
    StackId,
    Bytes,
    Allocations,
    Frames,
    StackLost,
    Truncated,
    DeltaBytes,
    GrowingReports,
    GrowthPerReport,
    Mapping,
    Allocated,
    Replacing,
    Outstanding,
    #[serde(other)]
    Other,
}

/// A stack's fields as they are met; `None` until then.
#[derive(Default)]
struct StackFields {
    stack_id: Option<u64>,
    bytes: Option<u64>,
    allocations: Option<u64>,
    frames: Option<Box<[u32]>>,
    stack_lost: Option<bool>,
    truncated: Option<Truncation>,
    delta_bytes: Option<i64>,
    growing_reports: Option<u32>,
    growth_per_report: Option<i64>,
    mapping: Option<MappingKind>,
    allocated: Option<Allocated>,
    replacing: Option<Replacing>,
    outstanding: Vec<OutstandingAllocation>,
}

impl<'de> DeserializeSeed<'de> for StackSeed<'_> {
    type Value = (ReportStack, Box<[u32]>);

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for StackSeed<'_> {
    type Value = (ReportStack, Box<[u32]>);

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a stack")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = StackFields::default();
        while let Some(field) = map.next_key::<StackField>()? {
            match field {
                StackField::StackId => fields.stack_id = Some(map.next_value()?),
                StackField::Bytes => fields.bytes = Some(map.next_value()?),
                StackField::Allocations => fields.allocations = Some(map.next_value()?),
                StackField::Frames => fields.frames = Some(map.next_value_seed(FramesSeed(&mut *self.0))?),
                StackField::StackLost => fields.stack_lost = Some(map.next_value()?),
                StackField::Truncated => fields.truncated = map.next_value()?,
                StackField::DeltaBytes => fields.delta_bytes = map.next_value()?,
                StackField::GrowingReports => fields.growing_reports = Some(map.next_value()?),
                StackField::GrowthPerReport => fields.growth_per_report = map.next_value()?,
                StackField::Mapping => fields.mapping = map.next_value()?,
                StackField::Allocated => fields.allocated = map.next_value()?,
                StackField::Replacing => fields.replacing = Some(map.next_value()?),
                StackField::Outstanding => {
                    fields.outstanding =
                        map.next_value_seed(Counted::new(&mut self.0.budget, allocation_cost))?;
                }
                StackField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        fields.finish()
    }
}

impl StackFields {
    fn finish<E: de::Error>(self) -> Result<(ReportStack, Box<[u32]>), E> {
        let stack = ReportStack {
            stack_id: required(self.stack_id, "stack_id")?,
            bytes: required(self.bytes, "bytes")?,
            allocations: required(self.allocations, "allocations")?,
            frames: Vec::new(),
            culprit: None,
            plumbing: Vec::new(),
            stable_id: None,
            stack_lost: required(self.stack_lost, "stack_lost")?,
            truncated: self.truncated,
            trend: Trend {
                delta_bytes: self.delta_bytes,
                growing_reports: required(self.growing_reports, "growing_reports")?,
                growth_per_report: self.growth_per_report,
            },
            mapping: self.mapping,
            allocated: self.allocated,
            // Snapshots saved before memleak told replacement apart have
            // none.
            replacing: self.replacing.unwrap_or_default(),
            outstanding: self.outstanding,
        };
        Ok((stack, required(self.frames, "frames")?))
    }
}

/// Reads a stack's frames into places in the interner's table.
struct FramesSeed<'r>(&'r mut Reading);

impl<'de> DeserializeSeed<'de> for FramesSeed<'_> {
    type Value = Box<[u32]>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Box<[u32]>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for FramesSeed<'_> {
    type Value = Box<[u32]>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a list of frames")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Box<[u32]>, A::Error> {
        let Reading { interner, budget } = self.0;
        let mut places = Vec::new();
        while let Some(frame) = seq.next_element::<Frame>()? {
            let (place, new) = interner.intern(frame);
            budget.take(new.unwrap_or(0) + 2 * size_of::<u32>())?;
            places.push(place);
        }
        Ok(places.into_boxed_slice())
    }
}

/// Reads a list, each element's memory taken from the budget as it comes.
struct Counted<'b, T> {
    budget: &'b mut Budget,
    cost: fn(&T) -> usize,
    element: PhantomData<T>,
}

impl<'b, T> Counted<'b, T> {
    fn new(budget: &'b mut Budget, cost: fn(&T) -> usize) -> Self {
        Self { budget, cost, element: PhantomData }
    }
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Counted<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Counted<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("a list")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut elements = Vec::new();
        while let Some(element) = seq.next_element::<T>()? {
            self.budget.take((self.cost)(&element))?;
            elements.push(element);
        }
        Ok(elements)
    }
}
