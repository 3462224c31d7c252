//! The unwind tables of every traced process. Each object's rows are built
//! once from its `.eh_frame` and written to a range of the BPF rows array,
//! shared by every process that maps the object (keyed by build id, else
//! by device and inode). Each process gets a table of its executable
//! mappings pointing at those ranges. An object's range is freed when the
//! last process using it drops it, and reused only after a grace period,
//! so that a walk in flight on the old table never reads rows rewritten
//! under it.

use std::{
    collections::HashMap,
    ops::Range,
    path::Path,
    time::{Duration, Instant},
};

use memleak_common::{ExecMapping, ProcessMappings, Rule, RuleKind, UnwindRow, MAX_EXEC_MAPPINGS};
use object::{elf, read::elf::ProgramHeader as _};

use super::{
    debug_files,
    eh_frame::{self, ObjectTable},
};
use crate::{
    bpf::unwind_maps::RowArray,
    model::Unwinding,
    process::{
        address_space::{AddressSpace, CodeRange, FileId, MappedObject},
        files,
    },
    status,
};

/// How long a freed range of rows waits before it is reused: far longer
/// than any walk.
const GRACE_PERIOD: Duration = Duration::from_secs(2);

/// What the kernel maps by.
const PAGE_SIZE: u64 = 4096;

/// Row 0 of the array: a stop. The uprobe trampoline's mapping points at
/// it, so that a walk never steps through another return probe's
/// trampoline as if it were code.
const STOP_ROW: u32 = 0;

/// What identifies an object whatever its path: the same library in a
/// container and on the host shares one table.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum ObjectKey {
    BuildId(String),
    File(FileId),
}

/// An executable `PT_LOAD` segment, to turn a mapping's file offset into a
/// virtual address of the object.
#[derive(Clone, Copy, Debug)]
struct Segment {
    offset: u64,
    vaddr: u64,
    size: u64,
}

/// An object whose table is loaded (or that has none).
struct LoadedObject {
    /// Its rows in the array; `None` without unwind information, or when
    /// the array had no room: its code is walked with frame pointers.
    rows: Option<Range<u32>>,
    /// What a row's pc is relative to.
    text_base: u64,
    segments: Vec<Segment>,
    /// Processes whose table points at it.
    users: usize,
}

/// What the tables hold, for --stats and the health line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindStats {
    /// Objects loaded, with rows or without.
    pub objects: usize,
    /// Rows in use in the array.
    pub rows: u64,
    /// Objects without unwind information (walked with frame pointers).
    pub objects_without_rows: usize,
    /// Objects that did not fit the array (--max-unwind-rows).
    pub objects_not_fitting: usize,
}

/// One process's table, as built: what it took.
#[derive(Clone, Copy, Debug, Default)]
pub struct TableBuilt {
    /// Objects it maps, and those loaded for it now.
    pub objects: usize,
    pub new_objects: usize,
    /// Rows written for it now.
    pub new_rows: u64,
    /// Executable mappings left out: more than the table holds.
    pub mappings_left_out: usize,
    pub elapsed: Duration,
}

pub struct UnwindTables {
    rows: RowArray,
    /// Whether objects get rows (--unwind dwarf); without, every step
    /// follows the frame pointer, checked against the mappings.
    unwinding: Unwinding,
    space: RowSpace,
    objects: HashMap<ObjectKey, LoadedObject>,
    /// The objects each process's table points at.
    users: HashMap<u32, Vec<ObjectKey>>,
    stats: UnwindStats,
    /// The last generation handed out (see `new_generation`).
    generation: u32,
}

impl UnwindTables {
    pub fn new(mut rows: RowArray, unwinding: Unwinding) -> Self {
        let capacity = rows.capacity();
        rows.write(STOP_ROW, &[UnwindRow { pc: 0, rule: Rule::of(RuleKind::Stop) }]);
        let space = RowSpace::new(STOP_ROW + 1..capacity);
        Self {
            rows,
            unwinding,
            space,
            objects: HashMap::new(),
            users: HashMap::new(),
            stats: UnwindStats::default(),
            generation: 0,
        }
    }

    /// A generation for a new table (`ProcessMappings::generation`), of
    /// any process: unique across them, so that a table of a process that
    /// took an exited one's pid never passes for the old one's. The
    /// walkers' caches rely on it: the rules cached by pc, and the last
    /// walk of each CPU with its stack's id, which is taken without
    /// looking the stack up. 0 is never handed out: no table has it.
    pub fn new_generation(&mut self) -> u32 {
        self.generation = self.generation.wrapping_add(1).max(1);
        self.generation
    }

    pub fn unwinding(&self) -> Unwinding {
        self.unwinding
    }

    pub fn stats(&self) -> UnwindStats {
        self.stats
    }

    /// The table of executable mappings of process `pid`, whose address
    /// space is `space`, loading the rows of the objects not loaded yet.
    /// The process uses those objects until its next table or `forget`.
    pub fn table_for(&mut self, pid: u32, space: &AddressSpace) -> (Box<ProcessMappings>, TableBuilt) {
        let started = Instant::now();
        let mut built = TableBuilt::default();
        let mut table = Box::new(ProcessMappings {
            count: 0,
            generation: 0,
            mappings: [ExecMapping::default(); MAX_EXEC_MAPPINGS],
        });
        let mut used = Vec::new();
        let mut progress = Progress::default();
        for range in space.code() {
            if table.count as usize == MAX_EXEC_MAPPINGS {
                built.mappings_left_out += 1;
                continue;
            }
            let mapping = match (&range.object, range.uprobes_trampoline) {
                (_, true) => ExecMapping {
                    start: range.start,
                    end: range.end,
                    bias: range.start,
                    first_row: STOP_ROW,
                    row_count: 1,
                },
                (Some(object), false) => {
                    let key = self.load(pid, object, &mut built);
                    progress.object_loaded(pid, &built, started);
                    let mapping = self.mapping_of(&key, range);
                    used.push(key);
                    mapping
                }
                (None, false) => ExecMapping { start: range.start, end: range.end, ..ExecMapping::default() },
            };
            table.mappings[table.count as usize] = mapping;
            table.count += 1;
        }
        used.sort_by_key(|key| format!("{key:?}"));
        used.dedup();
        built.objects = used.len();
        for key in &used {
            if let Some(object) = self.objects.get_mut(key) {
                object.users += 1;
            }
        }
        if let Some(previous) = self.users.insert(pid, used) {
            self.release(&previous);
        }
        built.elapsed = started.elapsed();
        progress.finished(pid, &built);
        (table, built)
    }

    /// Process `pid` is gone: it no longer uses its objects.
    pub fn forget(&mut self, pid: u32) {
        if let Some(previous) = self.users.remove(&pid) {
            self.release(&previous);
        }
    }

    /// One less user for each of `keys`; an object nobody uses is dropped
    /// and its rows freed.
    fn release(&mut self, keys: &[ObjectKey]) {
        let now = Instant::now();
        for key in keys {
            let Some(object) = self.objects.get_mut(key) else { continue };
            object.users = object.users.saturating_sub(1);
            if object.users > 0 {
                continue;
            }
            if let Some(object) = self.objects.remove(key) {
                self.stats.objects -= 1;
                match object.rows {
                    Some(rows) => {
                        self.stats.rows -= u64::from(rows.end - rows.start);
                        self.space.free(rows, now);
                    }
                    None => self.stats.objects_without_rows -= 1,
                }
            }
        }
    }

    /// The key of `object`, its rows loaded if they were not.
    fn load(&mut self, pid: u32, object: &MappedObject, built: &mut TableBuilt) -> ObjectKey {
        let key = match object.build_id() {
            Some(id) => ObjectKey::BuildId(id.to_owned()),
            None => ObjectKey::File(object.id),
        };
        if self.objects.contains_key(&key) {
            return key;
        }
        let loaded = self.build(pid, object);
        built.new_objects += 1;
        self.stats.objects += 1;
        match &loaded.rows {
            Some(rows) => {
                let count = u64::from(rows.end - rows.start);
                self.stats.rows += count;
                built.new_rows += count;
            }
            None => self.stats.objects_without_rows += 1,
        }
        self.objects.insert(key.clone(), loaded);
        key
    }

    /// Reads `object`'s unwind information and writes its rows; `pid` maps
    /// it, and its debug files are looked for in its root first.
    fn build(&mut self, pid: u32, object: &MappedObject) -> LoadedObject {
        let without_rows = |segments| LoadedObject { rows: None, text_base: 0, segments, users: 0 };
        if self.unwinding == Unwinding::FramePointers {
            return without_rows(Vec::new());
        }
        let data = match files::read_regular(&object.fd_path()) {
            Ok(data) => data,
            Err(error) => {
                log::debug!("cannot read {} for its unwind table: {error}", object.path);
                return without_rows(Vec::new());
            }
        };
        let segments = executable_segments(&data);
        let table = match eh_frame::build(Path::new(&object.path), &data) {
            Ok(table) => with_debug_file(pid, object, &data, table),
            Err(error) => {
                log::debug!("no unwind table for {}: {error}", object.path);
                return without_rows(segments);
            }
        };
        if table.rows.is_empty() {
            return without_rows(segments);
        }
        let Some(rows) = self.space.allocate(table.rows.len(), Instant::now()) else {
            self.stats.objects_not_fitting += 1;
            log::warn!(
                "no room for the {} unwind rows of {} (--max-unwind-rows): its code is walked with frame pointers",
                table.rows.len(),
                object.path
            );
            return without_rows(segments);
        };
        self.rows.write(rows.start, &table.rows);
        log::debug!("{} unwind rows for {}", table.rows.len(), object.path);
        LoadedObject { rows: Some(rows), text_base: table.text_base, segments, users: 0 }
    }

    /// The table entry of `range`, a mapping of the object of `key`.
    fn mapping_of(&self, key: &ObjectKey, range: &CodeRange) -> ExecMapping {
        let mut mapping = ExecMapping { start: range.start, end: range.end, ..ExecMapping::default() };
        let Some(object) = self.objects.get(key) else { return mapping };
        let Some(rows) = &object.rows else { return mapping };
        // The kernel maps whole pages: a segment that does not start on a
        // page (lld lays them out so) is mapped from the page before.
        let segment = object.segments.iter().find(|segment| {
            segment.offset & !(PAGE_SIZE - 1) <= range.offset && range.offset < segment.offset + segment.size
        });
        let Some(segment) = segment else { return mapping };
        // The object's address of the mapping's first byte (before the
        // segment's own, if it starts mid-page); the load bias is how far
        // the mapping moved it.
        let vaddr = segment.vaddr.wrapping_add(range.offset).wrapping_sub(segment.offset);
        mapping.bias = range.start.wrapping_sub(vaddr).wrapping_add(object.text_base);
        mapping.first_row = rows.start;
        mapping.row_count = rows.end - rows.start;
        mapping
    }
}

/// `table`, or if it covers less than half of the object's code, the
/// table with the `.debug_frame` of the object's separate debug file, if
/// one is installed (see `debug_files` for where, and what is checked
/// before it is read).
fn with_debug_file(pid: u32, object: &MappedObject, data: &[u8], table: ObjectTable) -> ObjectTable {
    if table.stats.covered_bytes * 2 >= table.stats.code_bytes {
        return table;
    }
    let Some(found) = debug_files::find(pid, object) else { return table };
    let debug_file = eh_frame::DebugFile { path: &found.place.path, file: &found.file };
    match eh_frame::build_with_debug_file(Path::new(&object.path), data, Some(debug_file)) {
        Ok(fuller) => {
            log::debug!("unwind rows for {} from {}", object.path, found.place);
            fuller
        }
        Err(error) => {
            log::debug!("{error}");
            table
        }
    }
}

/// The executable `PT_LOAD` segments of an ELF file.
fn executable_segments(data: &[u8]) -> Vec<Segment> {
    let Ok(object::File::Elf64(file)) = object::File::parse(data) else { return Vec::new() };
    let endian = file.endian();
    file.elf_program_headers()
        .iter()
        .filter(|header| header.p_type(endian) == elf::PT_LOAD && header.p_flags(endian) & elf::PF_X != 0)
        .map(|header| Segment {
            offset: header.p_offset(endian),
            vaddr: header.p_vaddr(endian),
            size: header.p_filesz(endian),
        })
        .collect()
}

/// Lines on stderr while a table takes long to build (a large process,
/// a slow disk): silence for the first second.
#[derive(Default)]
struct Progress {
    said: bool,
}

impl Progress {
    const QUIET_FOR: Duration = Duration::from_secs(1);

    fn object_loaded(&mut self, pid: u32, built: &TableBuilt, started: Instant) {
        if !self.said && started.elapsed() > Self::QUIET_FOR {
            self.said = true;
            status::say(&format!(
                "building unwind tables for pid {pid}: {} objects, {} rows so far...",
                built.new_objects, built.new_rows
            ));
        }
    }

    fn finished(&self, pid: u32, built: &TableBuilt) {
        if self.said {
            status::say(&format!(
                "unwind tables for pid {pid}: {} objects, {} rows in {:.1} s",
                built.new_objects,
                built.new_rows,
                built.elapsed.as_secs_f64()
            ));
        }
    }
}

/// Which ranges of the rows array are free: first fit, neighbours merged.
struct RowSpace {
    free: Vec<Range<u32>>,
    /// Ranges freed, with when: reused after `GRACE_PERIOD`.
    cooling: Vec<(Instant, Range<u32>)>,
}

impl RowSpace {
    fn new(all: Range<u32>) -> Self {
        Self { free: vec![all], cooling: Vec::new() }
    }

    fn allocate(&mut self, rows: usize, now: Instant) -> Option<Range<u32>> {
        let rows = u32::try_from(rows).ok()?;
        self.reclaim(now);
        let index = self.free.iter().position(|range| range.end - range.start >= rows)?;
        let start = self.free[index].start;
        self.free[index].start += rows;
        if self.free[index].is_empty() {
            self.free.remove(index);
        }
        Some(start..start + rows)
    }

    fn free(&mut self, rows: Range<u32>, now: Instant) {
        self.cooling.push((now, rows));
    }

    /// Returns the ranges whose grace period is over to the free list.
    fn reclaim(&mut self, now: Instant) {
        let (ready, cooling): (Vec<_>, Vec<_>) =
            self.cooling.drain(..).partition(|(freed, _)| now.duration_since(*freed) >= GRACE_PERIOD);
        self.cooling = cooling;
        for (_, range) in ready {
            let index = self.free.partition_point(|free| free.start < range.start);
            self.free.insert(index, range);
        }
        self.free = std::mem::take(&mut self.free).into_iter().fold(Vec::new(), |mut merged, range| {
            match merged.last_mut() {
                Some(last) if last.end == range.start => last.end = range.end,
                _ => merged.push(range),
            }
            merged
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bias_takes_mappings_to_row_pcs_with_segments_off_page() {
        // lld's layout: the code segment starts mid-page in the file, and
        // the kernel maps it from the page before.
        let segment = Segment { offset: 0x2_7190, vaddr: 0x2_8190, size: 0x8_7170 };
        let object =
            LoadedObject { rows: Some(1..100), text_base: 0x2_8190, segments: vec![segment], users: 1 };
        let key = ObjectKey::BuildId("ab".to_owned());
        let rows = RowArray::for_tests();
        let mut tables = UnwindTables::new(rows, Unwinding::Dwarf);
        tables.objects.insert(key.clone(), object);
        let range = CodeRange {
            start: 0x5569_1d1d_e000,
            end: 0x5569_1d26_6000,
            offset: 0x2_7000,
            object: None,
            uprobes_trampoline: false,
            anonymous: false,
        };
        let mapping = tables.mapping_of(&key, &range);
        assert_eq!((mapping.first_row, mapping.row_count), (1, 99));
        // The segment's first byte is at 0x190 into the mapping, and it is
        // the object's text base: row pc 0.
        assert_eq!((range.start + 0x190).wrapping_sub(mapping.bias), 0);
    }

    #[test]
    fn table_generations_are_handed_out_once_each_and_never_zero() {
        let mut tables = UnwindTables::new(RowArray::for_tests(), Unwinding::Dwarf);
        let first: Vec<u32> = (0..3).map(|_| tables.new_generation()).collect();
        assert_eq!(first, [1, 2, 3], "one counter for every process's tables");
        tables.generation = u32::MAX - 1;
        let wrapped: Vec<u32> = (0..3).map(|_| tables.new_generation()).collect();
        assert_eq!(wrapped, [u32::MAX, 1, 2], "0 is no table's, even after the counter wraps");
    }

    #[test]
    fn freed_rows_are_reused_after_the_grace_period_and_merged() {
        let start = Instant::now();
        let mut space = RowSpace::new(1..100);
        let a = space.allocate(40, start).unwrap();
        let b = space.allocate(40, start).unwrap();
        assert_eq!((a.clone(), b.clone()), (1..41, 41..81));
        assert_eq!(space.allocate(40, start), None, "19 rows left");
        space.free(a, start);
        space.free(b, start);
        assert_eq!(space.allocate(40, start + Duration::from_millis(10)), None, "still cooling");
        let later = start + GRACE_PERIOD;
        assert_eq!(space.allocate(90, later), Some(1..91), "both ranges and the tail, merged");
    }
}
