//! From what the BPF maps hold to one `Snapshot` per traced process:
//! outstanding memory grouped by stack, from the per-stack totals or from
//! each allocation, with the process's live mmap regions (`regions`) and
//! how each stack moved since the previous report (`trend`).

pub mod regions;
pub mod trend;

use std::collections::{HashMap, HashSet};

use memleak_common::{Allocation, AllocationKey, StackTotals};

use crate::{
    bpf::MapContents,
    model::{Allocated, HealthCounters, MappingKind, OutstandingAllocation, Replacing, Snapshot, StackUsage},
};
use regions::{Region, Regions};

/// What a snapshot holds beyond each stack's outstanding totals.
#[allow(clippy::struct_excessive_bools, reason = "independent choices, each one a driver makes")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollectOptions {
    /// bcc's `-o`: only allocations at least this old (ns) count. Ages
    /// need each allocation read, so any value, 0 included, reads them.
    pub min_age_ns: Option<u64>,
    /// Only allocations made at or after this `CLOCK_MONOTONIC` time (ns)
    /// count: what a window of time left outstanding (`memleak serve`'s
    /// `?seconds=N`). Reads each allocation, as `min_age_ns` does.
    pub born_since_ns: Option<u64>,
    /// Each allocation's address, size and age (`-a`, a saved snapshot).
    pub each_allocation: bool,
    /// The stacks whose every allocation was freed, with what they
    /// allocated: pprof's `alloc_space` shows them, and a saved snapshot
    /// keeps them for it.
    pub freed_stacks: bool,
    /// The file mappings the frames fall in (pprof, a saved snapshot).
    pub modules: bool,
    /// The allocator's own mmaps and thread stacks, which are otherwise
    /// left out and counted (`--all-mmaps`).
    pub all_mmaps: bool,
}

impl CollectOptions {
    /// Per-stack totals only, as `Default` gives, for a `const`.
    pub const NONE: Self = Self {
        min_age_ns: None,
        born_since_ns: None,
        each_allocation: false,
        freed_stacks: false,
        modules: false,
        all_mmaps: false,
    };

    /// Whether the maps must be read allocation by allocation, not only
    /// per stack.
    pub fn reads_each_allocation(&self) -> bool {
        self.each_allocation || self.min_age_ns.is_some() || self.born_since_ns.is_some()
    }

    /// Whether an allocation made at `timestamp_ns` counts at `now_ns`.
    fn counts(&self, timestamp_ns: u64, now_ns: u64) -> bool {
        now_ns.saturating_sub(timestamp_ns) >= self.min_age_ns.unwrap_or(0)
            && self.born_since_ns.is_none_or(|since| timestamp_ns >= since)
    }
}

/// The snapshot of process `pid` from the maps: from each allocation when
/// they were read, else from the per-stack totals kept in BPF. `owner`
/// tells which process a stack id belongs to.
pub fn snapshot(
    pid: u32,
    maps: &MapContents,
    owner: impl Fn(u64) -> Option<u32>,
    options: &CollectOptions,
) -> Snapshot {
    let mut counters = maps.counters_of(pid);
    counters.recorded_allocations = Some(
        maps.totals
            .iter()
            .filter(|(stack_id, _)| owner(*stack_id) == Some(pid))
            .map(|(_, totals)| totals.allocated_count)
            .sum(),
    );
    // Counted by every memleak that reads this map: 0 until the first.
    counters.unrecorded_frees.get_or_insert(0);
    let mut snapshot = match &maps.allocations {
        Some(allocations) => aggregate(pid, maps.time_unix_ms, maps.now_ns, allocations, counters, options),
        None => from_totals(pid, maps.time_unix_ms, &maps.totals, &owner, counters),
    };
    add_allocated(&mut snapshot, &maps.totals, &owner, options.freed_stacks);
    snapshot
}

/// Outstanding memory being summed up per stack (and, for mmap regions,
/// per kind).
struct ByStack {
    usage: HashMap<(u64, Option<MappingKind>), StackUsage>,
    each_allocation: bool,
}

impl ByStack {
    fn new(options: &CollectOptions) -> Self {
        Self { usage: HashMap::new(), each_allocation: options.each_allocation }
    }

    /// Adds a block of `size` bytes at `address`, `age_ns` old, of which
    /// `replaced` stand in for bytes from before the attach.
    fn add(
        &mut self,
        stack_id: u64,
        mapping: Option<MappingKind>,
        address: u64,
        size: u64,
        age_ns: u64,
        replaced: u64,
    ) {
        let usage = self.usage.entry((stack_id, mapping)).or_insert_with(|| StackUsage {
            stack_id,
            mapping,
            ..StackUsage::default()
        });
        usage.bytes += size;
        usage.allocations += 1;
        if replaced > 0 {
            usage.replacing.bytes += replaced;
            usage.replacing.allocations += 1;
        }
        if self.each_allocation {
            usage.outstanding.push(OutstandingAllocation { address, size, age_ms: age_ns / 1_000_000 });
        }
    }

    fn into_stacks(self) -> impl Iterator<Item = StackUsage> {
        self.usage.into_values().map(|mut stack| {
            stack.outstanding.sort_by_key(|allocation| allocation.address);
            stack
        })
    }
}

/// Groups the allocations of process `pid` by stack. `now_ns` is
/// `CLOCK_MONOTONIC`, the clock of the BPF timestamps.
pub fn aggregate(
    pid: u32,
    time_unix_ms: u64,
    now_ns: u64,
    allocations: &[(AllocationKey, Allocation)],
    counters: HealthCounters,
    options: &CollectOptions,
) -> Snapshot {
    let mut by_stack = ByStack::new(options);
    for (key, allocation) in allocations.iter().filter(|(key, _)| key.tgid == pid) {
        if options.counts(allocation.timestamp_ns, now_ns) {
            let age_ns = now_ns.saturating_sub(allocation.timestamp_ns);
            by_stack.add(
                allocation.stack_id,
                None,
                key.address,
                allocation.size,
                age_ns,
                allocation.replaced,
            );
        }
    }
    Snapshot { pid, time_unix_ms, stacks: by_stack.into_stacks().collect(), counters, ..Snapshot::default() }
}

/// Adds the process's live mmap regions to `snapshot`, one entry per stack
/// and kind (`kind_of` a region, given its start). Allocator-internal
/// regions, CPython's arenas and thread stacks are counted in `hidden`
/// instead, unless `options.all_mmaps`.
pub fn add_regions(
    snapshot: &mut Snapshot,
    regions: &Regions,
    now_ns: u64,
    options: &CollectOptions,
    mut kind_of: impl FnMut(u64, &Region) -> MappingKind,
) {
    let mut by_stack = ByStack::new(options);
    for (start, region) in regions.iter() {
        if !options.counts(region.timestamp_ns, now_ns) {
            continue;
        }
        let age_ns = now_ns.saturating_sub(region.timestamp_ns);
        let size = region.end - start;
        match kind_of(start, region) {
            MappingKind::AllocatorMmap if !options.all_mmaps => snapshot.hidden.allocator_bytes += size,
            MappingKind::ThreadStack if !options.all_mmaps => snapshot.hidden.thread_stack_bytes += size,
            MappingKind::Reservation if !options.all_mmaps => snapshot.hidden.reserved_bytes += size,
            MappingKind::PythonArena if !options.all_mmaps => snapshot.hidden.python_arena_bytes += size,
            MappingKind::FileMapping if !options.all_mmaps => snapshot.hidden.file_bytes += size,
            kind => by_stack.add(region.stack_id, Some(kind), start, size, age_ns, 0),
        }
    }
    snapshot.stacks.extend(by_stack.into_stacks());
}

/// Builds the snapshot of process `pid` from the per-stack totals kept in
/// BPF: one map entry per stack, none per allocation. `owner` tells which
/// process a stack id belongs to.
pub fn from_totals(
    pid: u32,
    time_unix_ms: u64,
    totals: &[(u64, StackTotals)],
    owner: impl Fn(u64) -> Option<u32>,
    counters: HealthCounters,
) -> Snapshot {
    let stacks = totals
        .iter()
        // The BPF side adds frees as negative amounts: a stack whose every
        // allocation was freed sits at zero.
        .filter(|(_, totals)| (totals.allocations as i64) > 0)
        .filter(|(stack_id, _)| owner(*stack_id) == Some(pid))
        .map(|&(stack_id, totals)| StackUsage {
            stack_id,
            bytes: totals.bytes,
            allocations: totals.allocations,
            replacing: Replacing { bytes: totals.replacing_bytes, allocations: totals.replacing_allocations },
            ..StackUsage::default()
        })
        .collect();
    Snapshot { pid, time_unix_ms, stacks, counters, ..Snapshot::default() }
}

/// Adds to each stack of `snapshot` what it allocated since attach, from
/// the BPF totals. With `keep_freed`, stacks of the process that allocated
/// but hold nothing now are added too, at zero: for pprof's `alloc_space`.
pub fn add_allocated(
    snapshot: &mut Snapshot,
    totals: &[(u64, StackTotals)],
    owner: impl Fn(u64) -> Option<u32>,
    keep_freed: bool,
) {
    let allocated: HashMap<u64, Allocated> = totals
        .iter()
        .filter(|(stack_id, _)| owner(*stack_id) == Some(snapshot.pid))
        .map(|(stack_id, totals)| {
            (*stack_id, Allocated { bytes: totals.allocated_bytes, count: totals.allocated_count })
        })
        .collect();
    for stack in snapshot.stacks.iter_mut().filter(|stack| stack.mapping.is_none()) {
        stack.allocated = allocated.get(&stack.stack_id).copied();
    }
    if keep_freed {
        let present: HashSet<u64> = snapshot.stacks.iter().map(|stack| stack.stack_id).collect();
        let freed = allocated.iter().filter(|(stack_id, _)| !present.contains(stack_id));
        snapshot.stacks.extend(freed.map(|(&stack_id, &allocated)| StackUsage {
            stack_id,
            allocated: Some(allocated),
            ..StackUsage::default()
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocation(size: u64, timestamp_ns: u64, stack_id: u64) -> Allocation {
        Allocation { size, timestamp_ns, stack_id, replaced: 0 }
    }

    fn key(tgid: u32, address: u64) -> AllocationKey {
        AllocationKey { tgid, _padding: 0, address }
    }

    #[test]
    fn allocations_are_summed_per_stack_and_young_ones_left_out() {
        let allocations = [
            (key(42, 0x1000), allocation(100, 1_000, 7)),
            (key(42, 0x2000), allocation(50, 2_000, 7)),
            (key(42, 0x3000), allocation(8, 3_000, 9)),
            (key(42, 0x4000), allocation(1_000, 9_500, 9)), // 500 ns old: too young
            (key(43, 0x1000), allocation(64, 0, 11)),       // another process
        ];
        let options =
            CollectOptions { min_age_ns: Some(1_000), each_allocation: true, ..CollectOptions::default() };
        let snapshot = aggregate(42, 0, 10_000, &allocations, HealthCounters::default(), &options);
        let mut stacks = snapshot.stacks.clone();
        stacks.sort_by_key(|stack| stack.stack_id);
        assert_eq!(stacks.len(), 2);
        assert_eq!((stacks[0].stack_id, stacks[0].bytes, stacks[0].allocations), (7, 150, 2));
        assert_eq!((stacks[1].stack_id, stacks[1].bytes, stacks[1].allocations), (9, 8, 1));
        assert_eq!(stacks[0].outstanding[1], OutstandingAllocation { address: 0x2000, size: 50, age_ms: 0 });
    }

    #[test]
    fn a_window_counts_only_the_allocations_made_since_it_began() {
        let allocations = [
            (key(42, 0x1000), allocation(100, 1_000, 7)), // before the window
            (key(42, 0x2000), allocation(50, 4_000, 7)),  // as it began
            (key(42, 0x3000), allocation(8, 9_000, 9)),
        ];
        let options = CollectOptions { born_since_ns: Some(4_000), ..CollectOptions::default() };
        assert!(options.reads_each_allocation());
        let snapshot = aggregate(42, 0, 10_000, &allocations, HealthCounters::default(), &options);
        let mut stacks: Vec<_> =
            snapshot.stacks.iter().map(|s| (s.stack_id, s.bytes, s.allocations)).collect();
        stacks.sort_unstable();
        assert_eq!(stacks, [(7, 50, 1), (9, 8, 1)]);
    }

    #[test]
    fn per_allocation_detail_is_kept_only_on_request() {
        let allocations = [(key(1, 0x1000), allocation(100, 0, 1))];
        let options = CollectOptions::default();
        let snapshot = aggregate(1, 0, 5, &allocations, HealthCounters::default(), &options);
        assert!(snapshot.stacks[0].outstanding.is_empty());
    }

    #[test]
    fn totals_keep_the_process_stacks_that_hold_memory() {
        let totals = [
            (
                1,
                StackTotals {
                    bytes: 300,
                    allocations: 3,
                    allocated_bytes: 500,
                    allocated_count: 5,
                    ..StackTotals::default()
                },
            ),
            (
                2,
                StackTotals {
                    bytes: 0,
                    allocations: 0,
                    allocated_bytes: 64,
                    allocated_count: 2,
                    ..StackTotals::default()
                },
            ), // all freed
            (
                3,
                StackTotals {
                    bytes: 64,
                    allocations: 1,
                    allocated_bytes: 64,
                    allocated_count: 1,
                    ..StackTotals::default()
                },
            ), // another process
        ];
        let owner = |id| Some(if id == 3 { 8 } else { 7 });
        let mut snapshot = from_totals(7, 0, &totals, owner, HealthCounters::default());
        assert_eq!(snapshot.stacks.len(), 1);
        assert_eq!((snapshot.stacks[0].stack_id, snapshot.stacks[0].bytes), (1, 300));
        add_allocated(&mut snapshot, &totals, owner, false);
        assert_eq!(snapshot.stacks[0].allocated, Some(Allocated { bytes: 500, count: 5 }));
        assert_eq!(snapshot.stacks.len(), 1, "freed stacks only on request");
        add_allocated(&mut snapshot, &totals, owner, true);
        let freed: Vec<_> = snapshot.stacks.iter().map(|s| (s.stack_id, s.bytes, s.allocated)).collect();
        assert_eq!(
            freed,
            [
                (1, 300, Some(Allocated { bytes: 500, count: 5 })),
                (2, 0, Some(Allocated { bytes: 64, count: 2 }))
            ]
        );
    }
}
