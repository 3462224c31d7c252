//! The domain model: what a report is made of, independent of BPF and of
//! output formats.

use serde::{Deserialize, Serialize};

/// Outstanding memory of one process at one moment, grouped by stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub pid: u32,
    /// Wall-clock time the snapshot was taken, ms since the Unix epoch.
    pub time_unix_ms: u64,
    /// One entry per stack that holds memory, in no particular order.
    pub stacks: Vec<StackUsage>,
    pub counters: HealthCounters,
    /// mmap regions left out of `stacks` (shown with --all-mmaps).
    pub hidden: HiddenMappings,
}

/// The movement of one stack since the previous report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trend {
    /// Change in outstanding bytes since the previous report; `None` in the
    /// first report, which has nothing to compare with.
    pub delta_bytes: Option<i64>,
    /// Reports in a row, this one included, in which the stack grew in
    /// new memory: blocks that replace blocks from before the attach
    /// (`Replacing`) are not growth.
    pub growing_reports: u32,
    /// While growing: the average growth per report over that streak, in
    /// bytes of new memory. A slow steady leak shows here behind a big
    /// stable cache.
    pub growth_per_report: Option<i64>,
}

impl Trend {
    /// The amounts `scale` times: a sampled run's estimate of the whole.
    #[must_use]
    pub fn scaled(self, scale: u64) -> Self {
        let scale = scale as i64;
        Self {
            delta_bytes: self.delta_bytes.map(|delta| delta * scale),
            growth_per_report: self.growth_per_report.map(|growth| growth * scale),
            ..self
        }
    }
}

/// Why a stack stops before its root: the frames shown are right, but
/// the callers past them are not known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// `--max-stack-depth` frames were taken.
    DepthLimit,
    /// Code without unwind information whose frame pointer led nowhere.
    NoUnwindInfo,
    /// A caller in code memleak did not know yet (a library loaded since
    /// the last rescan).
    UnknownCode,
    /// The stack could not be read, or a frame did not move up it.
    BadFrame,
    /// Walked with frame pointers: the process's unwind tables were not
    /// loaded yet.
    FramePointers,
    /// At a switch to another stack that the walk cannot follow (Go's
    /// `runtime.asmcgocall`, where a cgo call leaves the goroutine's stack).
    StackSwitch,
    /// Its innermost `--max-python-depth` Python frames were taken: the
    /// callers past them may be missing.
    PythonDepthLimit,
}

impl Truncation {
    /// What the truncation means, for people.
    pub fn describe(self) -> &'static str {
        match self {
            Truncation::DepthLimit => "at --max-stack-depth",
            Truncation::NoUnwindInfo => "in code without unwind information",
            Truncation::UnknownCode => "in code not known yet",
            Truncation::BadFrame => "at a frame that could not be read",
            Truncation::FramePointers => "walked with frame pointers",
            Truncation::StackSwitch => "at a switch to another stack",
            Truncation::PythonDepthLimit => "at --max-python-depth",
        }
    }
}

/// How user stacks were walked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unwinding {
    /// With the unwind tables of each object's `.eh_frame`.
    Dwarf,
    /// With frame pointers only.
    FramePointers,
}

/// What an mmap region is, when it is not plain program memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MappingKind {
    /// Mapped by the program itself.
    Mmap,
    /// Mapped by malloc & co. for their own use (arenas, large blocks):
    /// already counted as what malloc handed out.
    AllocatorMmap,
    /// A thread's stack, mapped by `pthread_create`.
    ThreadStack,
    /// Address space reserved with `PROT_NONE`: no memory until made
    /// usable (Go's heap arenas, JIT code spaces).
    Reservation,
    /// An arena of CPython's small-object allocator, whose objects are not
    /// tracked (they are with --python-allocator).
    PythonArena,
    /// A file mapped into memory (a locale archive, a database file read
    /// through mmap): the page cache's pages, not a leak of the heap.
    FileMapping,
}

/// A process's resident memory by what holds it, in bytes, from its
/// smaps (`process::resident`).
#[allow(clippy::struct_field_names, reason = "each is a number of bytes; the names are the JSON's")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentMemory {
    pub resident_bytes: u64,
    /// Anonymous memory: the heap, stacks and private mappings.
    pub anon_bytes: u64,
    /// Of it, the heap and glibc's arenas, where blocks freed stay until
    /// the allocator gives them back.
    pub heap_bytes: u64,
    /// Of it, the main thread's stack and those of the other threads.
    pub thread_stack_bytes: u64,
    /// The pages of files mapped, shared memory included: the page cache's.
    pub file_bytes: u64,
}

/// Bytes of the mmap regions a report does not show by default.
#[allow(clippy::struct_field_names, reason = "each is a number of bytes; the names are the JSON's")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HiddenMappings {
    pub allocator_bytes: u64,
    pub thread_stack_bytes: u64,
    #[serde(default)]
    pub reserved_bytes: u64,
    /// CPython's arenas, whose objects are not tracked. Left out of
    /// JSON when 0, as it is for every process that is not Python.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub python_arena_bytes: u64,
    /// Files mapped into memory. Left out of JSON when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub file_bytes: u64,
}

#[allow(clippy::trivially_copy_pass_by_ref, reason = "serde's skip_serializing_if passes a reference")]
fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// The outstanding allocations made from one call stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StackUsage {
    /// Id of the stack in the BPF stack map, or a `lost_stack_id`.
    pub stack_id: u64,
    pub bytes: u64,
    pub allocations: u64,
    /// Each allocation; filled in only when the user asked for them.
    pub outstanding: Vec<OutstandingAllocation>,
    /// For mmap regions: which kind; `None` for malloc & co.
    pub mapping: Option<MappingKind>,
    /// What the stack allocated since attach, when that is tracked.
    pub allocated: Option<Allocated>,
    /// Of `bytes` and `allocations`, the blocks that took the place of
    /// blocks from before the attach.
    pub replacing: Replacing,
}

impl StackUsage {
    /// Outstanding bytes that replacing blocks from before the attach does
    /// not explain: what the stack's growth is measured in.
    pub fn new_bytes(&self) -> u64 {
        self.bytes.saturating_sub(self.replacing.bytes)
    }
}

/// Of a stack's outstanding blocks, those that took the place of blocks
/// memleak never saw allocated: the allocator handed out the address of
/// one the program had just freed (a cache replacing entries it made
/// before the attach), or the stack had freed a block that had itself
/// replaced one. Their bytes are outstanding, but not growth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replacing {
    pub bytes: u64,
    pub allocations: u64,
}

impl std::iter::Sum for Replacing {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |total, each| Self {
            bytes: total.bytes + each.bytes,
            allocations: total.allocations + each.allocations,
        })
    }
}

impl Replacing {
    pub fn is_none(&self) -> bool {
        self.allocations == 0
    }

    /// Both counts `scale` times: a sampled run's estimate of the whole.
    #[must_use]
    pub fn scaled(self, scale: u64) -> Self {
        Self { bytes: self.bytes * scale, allocations: self.allocations * scale }
    }
}

/// What a stack allocated since memleak attached, freed or not: pprof's
/// `alloc_space` and `alloc_objects`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocated {
    pub bytes: u64,
    pub count: u64,
}

impl Allocated {
    /// Both counts `scale` times: a sampled run's estimate of the whole.
    #[must_use]
    pub fn scaled(self, scale: u64) -> Self {
        Self { bytes: self.bytes * scale, count: self.count * scale }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutstandingAllocation {
    pub address: u64,
    pub size: u64,
    pub age_ms: u64,
}

/// How much the tracer saw and what it could not keep, since attach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthCounters {
    /// Allocation calls that returned a block, recorded or not.
    pub allocations: u64,
    /// Those recorded: all of them, unless sampling (-s) or a size range
    /// (-z, -Z) left some out, or --max-allocs was reached. `None` in
    /// snapshots saved before memleak counted them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_allocations: Option<u64>,
    /// Releases seen: free-like calls, and old blocks realloc gave up; a
    /// release made inside another of the same block (an `operator
    /// delete` calling `free`) counts once.
    pub frees: u64,
    /// Those of the `frees` whose block memleak had not recorded: allocated
    /// before it attached, through a function it does not probe, or left
    /// out by -s, -z, -Z or a full --max-allocs. Their sizes are unknown.
    /// A stack that replaces such blocks grows in memleak's eyes while the
    /// program's memory holds still. `None` in snapshots saved before
    /// memleak counted them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unrecorded_frees: Option<u64>,
    /// Allocation calls that returned NULL (never counted as leaks).
    pub failed_allocations: u64,
    /// Allocations dropped because --max-allocs was reached.
    pub allocations_not_tracked: u64,
    /// Allocations whose stack could not be stored (--max-stacks reached).
    pub stacks_lost: u64,
    /// --trace events dropped because memleak did not keep up.
    pub events_lost: u64,
}

/// One frame of a symbolized stack. Unknown values are `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// The return address in the process, as the stack recorded it.
    #[serde(serialize_with = "hex_address", deserialize_with = "address_from_hex")]
    pub address: u64,
    pub function: Option<String>,
    /// Bytes from the start of the function to `address`, or from the
    /// start of its cold part (`cold_part`); `None` for inlined frames,
    /// which have no address of their own, and where no symbol table
    /// says where the function starts.
    pub offset: Option<u64>,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// The function was inlined into the next frame of the stack.
    pub inlined: bool,
    /// The executable or library holding the code, as the target sees it.
    pub module: Option<String>,
    /// Where `address` lies in the module's file. With the module's build
    /// id it names the code whatever its symbols and wherever it was
    /// loaded: what a stack's stable id is made of, and what a
    /// symbolizer can read later for a frame without a name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_offset: Option<u64>,
    /// The module's GNU build id, in hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
    /// The address lies in the part of the function that the compiler
    /// moved away as unlikely to run (gcc's `.cold` clones): `offset`
    /// counts from the start of that part.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cold_part: bool,
    /// Native code, or a Python function that an interpreter ran there.
    #[serde(default, skip_serializing_if = "FrameKind::is_native")]
    pub kind: FrameKind,
}

/// What ran in a frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FrameKind {
    /// Machine code at `address`.
    #[default]
    Native,
    /// A Python function run by the CPython eval loop the stack went
    /// through: `function` is its qualified name, `file` and `line` what
    /// the interpreter was running. It has no address, module or offset.
    Python,
}

impl FrameKind {
    #[allow(
        clippy::trivially_copy_pass_by_ref,
        reason = "serde's skip_serializing_if hands over a reference"
    )]
    pub fn is_native(&self) -> bool {
        *self == Self::Native
    }
}

impl Frame {
    pub fn is_python(&self) -> bool {
        self.kind == FrameKind::Python
    }

    /// Where a frame of a file lies, as a report names a frame without a
    /// function: the file's name and the offset in it, `memcached+0x1a2b3`.
    pub fn file_location(&self) -> Option<String> {
        let (module, file_offset) = (self.module.as_deref()?, self.file_offset?);
        Some(format!("{}+{file_offset:#x}", module.rsplit('/').next().unwrap_or(module)))
    }
}

#[allow(clippy::trivially_copy_pass_by_ref, reason = "serde's serialize_with hands over a reference")]
fn hex_address<S: serde::Serializer>(address: &u64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format!("{address:#x}"))
}

fn address_from_hex<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let text = String::deserialize(deserializer)?;
    let digits =
        text.strip_prefix("0x").ok_or_else(|| serde::de::Error::custom("an address starts with 0x"))?;
    u64::from_str_radix(digits, 16).map_err(serde::de::Error::custom)
}

/// One file-backed mapping of a process's address space, for the exporters
/// that attribute addresses to binaries (pprof's Mapping).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleMapping {
    #[serde(serialize_with = "hex_address", deserialize_with = "address_from_hex")]
    pub start: u64,
    #[serde(serialize_with = "hex_address", deserialize_with = "address_from_hex")]
    pub end: u64,
    /// Offset in the file of `start`.
    pub file_offset: u64,
    /// The file as the process names it.
    pub path: String,
    /// The GNU build id, in hex.
    pub build_id: Option<String>,
}

/// Which container, pod and node a process runs in, named as cAdvisor and
/// kube-state-metrics name their labels, so that memleak's series join
/// theirs: every output that names a process in a container carries
/// these. A name that could not be found is left out, never guessed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// The pod's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The container's name (in its pod, or as podman or docker name it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The pod's uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// `<runtime>://<full id>`: `containerd://`, `cri-o://`, `docker://`
    /// or `podman://`; the bare id when the runtime is not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The node (`NODE_NAME`, else the host name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

impl Workload {
    /// Each label that has a value, name first, always in this order.
    pub fn labels(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("namespace", &self.namespace),
            ("pod", &self.pod),
            ("container", &self.container),
            ("uid", &self.uid),
            ("container_id", &self.container_id),
            ("node", &self.node),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value.as_deref()?)))
    }
}
