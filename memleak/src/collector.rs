//! Turns the raw BPF maps into a `Snapshot`.

use std::collections::HashMap;

use memleak_common::Allocation;

use crate::model::{HealthCounters, OutstandingAllocation, Snapshot, StackUsage};

/// What to keep of each allocation.
#[derive(Clone, Copy, Debug)]
pub struct CollectOptions {
    /// Allocations younger than this are left out (bcc's `-o`).
    pub min_age_ns: u64,
    /// Keep each allocation, not just per-stack totals (bcc's `-a`).
    pub keep_allocations: bool,
}

/// Groups allocations by stack. `now_ns` is CLOCK_MONOTONIC, the clock of
/// the BPF timestamps.
pub fn aggregate(
    pid: u32,
    time_unix_ms: u64,
    now_ns: u64,
    allocations: &[(u64, Allocation)],
    counters: HealthCounters,
    options: CollectOptions,
) -> Snapshot {
    let mut by_stack: HashMap<u64, StackUsage> = HashMap::new();
    for &(address, allocation) in allocations {
        let age_ns = now_ns.saturating_sub(allocation.timestamp_ns);
        if age_ns < options.min_age_ns {
            continue;
        }
        let usage = by_stack
            .entry(allocation.stack_id)
            .or_insert_with(|| StackUsage { stack_id: allocation.stack_id, ..StackUsage::default() });
        usage.bytes += allocation.size;
        usage.allocations += 1;
        if options.keep_allocations {
            usage.outstanding.push(OutstandingAllocation {
                address,
                size: allocation.size,
                age_ms: age_ns / 1_000_000,
            });
        }
    }
    let mut stacks: Vec<StackUsage> = by_stack.into_values().collect();
    for stack in &mut stacks {
        stack.outstanding.sort_by_key(|allocation| allocation.address);
    }
    Snapshot { pid, time_unix_ms, stacks, counters }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocation(size: u64, timestamp_ns: u64, stack_id: u64) -> Allocation {
        Allocation { size, timestamp_ns, stack_id }
    }

    #[test]
    fn allocations_are_summed_per_stack_and_young_ones_left_out() {
        let allocations = [
            (0x1000, allocation(100, 1_000, 7)),
            (0x2000, allocation(50, 2_000, 7)),
            (0x3000, allocation(8, 3_000, 9)),
            (0x4000, allocation(1_000, 9_500, 9)), // 500 ns old: too young
        ];
        let options = CollectOptions { min_age_ns: 1_000, keep_allocations: true };
        let snapshot = aggregate(42, 0, 10_000, &allocations, HealthCounters::default(), options);
        let mut stacks = snapshot.stacks.clone();
        stacks.sort_by_key(|stack| stack.stack_id);
        assert_eq!(stacks.len(), 2);
        assert_eq!((stacks[0].stack_id, stacks[0].bytes, stacks[0].allocations), (7, 150, 2));
        assert_eq!((stacks[1].stack_id, stacks[1].bytes, stacks[1].allocations), (9, 8, 1));
        assert_eq!(stacks[0].outstanding[1], OutstandingAllocation { address: 0x2000, size: 50, age_ms: 0 });
    }

    #[test]
    fn per_allocation_detail_is_kept_only_on_request() {
        let allocations = [(0x1000, allocation(100, 0, 1))];
        let options = CollectOptions { min_age_ns: 0, keep_allocations: false };
        let snapshot = aggregate(1, 0, 5, &allocations, HealthCounters::default(), options);
        assert!(snapshot.stacks[0].outstanding.is_empty());
    }
}
