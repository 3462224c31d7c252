//! What each sized BPF map asks of the kernel's memory, so that a map the
//! kernel refuses is explained: how much was asked for, and which flag
//! sets it.

use std::mem::size_of;

use memleak_common::{
    Allocation, AllocationKey, AllocatorCode, ProcessMappings, PyProcConfig, StackKey, StackSlot,
    StackTotals, UnwindRow, ALLOCATIONS_MAP, ALLOCATOR_CODE_MAP, PROCESS_MAPPINGS_MAP, PY_PROCS_MAP,
    STACKS_MAP, STACK_IDS_MAP, STACK_TOTALS_MAP, UNWIND_RESCANS_MAP, UNWIND_ROWS_MAP,
};

use super::TracerSettings;

/// The kernel's bookkeeping per hash map element (`struct htab_elem`
/// before its key) and per bucket (`struct bucket`), on x86-64.
const HASH_ELEMENT_OVERHEAD: u64 = 48;
const HASH_BUCKET: u64 = 16;

/// What one map costs at its size.
#[derive(Debug, PartialEq, Eq)]
pub struct MapCost {
    pub entries: u64,
    /// Bytes the kernel allocates when the map is created.
    pub at_start: u64,
    /// Bytes once every entry is in use.
    pub when_full: u64,
    /// The command-line flag that sets `entries`.
    pub flag: &'static str,
}

/// How a map's memory grows with its entries.
enum Layout {
    /// `BPF_F_NO_PREALLOC`: a bucket array at creation, elements as they
    /// are inserted.
    HashOnDemand {
        key: usize,
        value: usize,
    },
    /// Every element allocated at creation.
    HashPreallocated {
        key: usize,
        value: usize,
    },
    Array {
        value: usize,
    },
}

/// The cost of map `name` as `settings` size it, for the maps that a flag
/// sizes; `None` for the others.
pub fn cost_of(name: &str, settings: &TracerSettings) -> Option<MapCost> {
    let stack_totals = settings.max_stacks.saturating_add(settings.max_processes);
    let (entries, flag, layout) = match name {
        ALLOCATIONS_MAP => (settings.max_allocations, "--max-allocs", hash::<AllocationKey, Allocation>()),
        STACKS_MAP => (settings.max_stacks, "--max-stacks", hash::<u64, StackKey>()),
        STACK_IDS_MAP => (settings.max_stacks, "--max-stacks", hash::<StackSlot, u64>()),
        STACK_TOTALS_MAP => (stack_totals, "--max-stacks", hash::<u64, StackTotals>()),
        UNWIND_ROWS_MAP => {
            (settings.unwind_rows(), "--max-unwind-rows", Layout::Array { value: size_of::<UnwindRow>() })
        }
        PROCESS_MAPPINGS_MAP => (settings.max_processes, "--max-processes", hash::<u32, ProcessMappings>()),
        UNWIND_RESCANS_MAP => (
            settings.max_processes,
            "--max-processes",
            Layout::HashPreallocated { key: size_of::<u32>(), value: size_of::<u64>() },
        ),
        ALLOCATOR_CODE_MAP => (
            settings.max_processes,
            "--max-processes",
            Layout::HashPreallocated { key: size_of::<u32>(), value: size_of::<AllocatorCode>() },
        ),
        PY_PROCS_MAP => (
            settings.max_processes,
            "--max-processes",
            Layout::HashPreallocated { key: size_of::<u32>(), value: size_of::<PyProcConfig>() },
        ),
        _ => return None,
    };
    let entries = u64::from(entries);
    let element = |key: usize, value: usize| HASH_ELEMENT_OVERHEAD + round_up_8(key) + round_up_8(value);
    let (at_start, when_full) = match layout {
        Layout::HashOnDemand { key, value } => {
            let buckets = entries.next_power_of_two() * HASH_BUCKET;
            (buckets, buckets + entries * element(key, value))
        }
        Layout::HashPreallocated { key, value } => {
            let all = entries.next_power_of_two() * HASH_BUCKET + entries * element(key, value);
            (all, all)
        }
        Layout::Array { value } => (entries * round_up_8(value), entries * round_up_8(value)),
    };
    Some(MapCost { entries, at_start, when_full, flag })
}

fn hash<K, V>() -> Layout {
    Layout::HashOnDemand { key: size_of::<K>(), value: size_of::<V>() }
}

fn round_up_8(size: usize) -> u64 {
    (size as u64).div_ceil(8) * 8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Unwinding;

    fn settings() -> TracerSettings {
        TracerSettings {
            min_size: 0,
            max_size: u64::MAX,
            stack_depth: 127,
            max_allocations: 1_000_000,
            max_stacks: 65_536,
            max_processes: 1024,
            sample_rate: 1,
            trace_events: false,
            unwinding: Unwinding::Dwarf,
            max_unwind_rows: 1 << 20,
            stack_reuse: true,
            python_max_frames: None,
        }
    }

    #[test]
    fn the_default_allocations_map_reserves_16_mib_of_buckets() {
        let cost = cost_of(ALLOCATIONS_MAP, &settings()).unwrap();
        assert_eq!((cost.entries, cost.at_start, cost.flag), (1_000_000, 16 << 20, "--max-allocs"));
        assert!(cost.when_full > cost.at_start);
    }

    #[test]
    fn stack_totals_grow_with_stacks_and_processes() {
        let huge = TracerSettings { max_stacks: (1 << 27) - 1, ..settings() };
        let cost = cost_of(STACK_TOTALS_MAP, &huge).unwrap();
        assert_eq!(cost.entries, (1 << 27) - 1 + 1024);
        // Past a power of two: the bucket array doubles, to 4 GiB.
        assert_eq!(cost.at_start, 4 << 30);
        assert_eq!(crate::status::readable_bytes(cost.at_start), "4.0 GiB");
        assert_eq!(cost_of("COUNTERS", &huge), None);
    }

    #[test]
    fn bytes_read_as_a_person_would() {
        assert_eq!(crate::status::readable_bytes(512), "512 bytes");
        assert_eq!(crate::status::readable_bytes(1536), "1.5 KiB");
        assert_eq!(crate::status::readable_bytes(16 << 20), "16.0 MiB");
    }
}
