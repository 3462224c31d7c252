//! The contract between memleak's BPF programs and user space.
//!
//! Everything both sides must agree on lives here and only here: record
//! layouts ([`records`], [`events`]), the functions probed and the
//! programs serving them ([`functions`]), and the names of maps, programs
//! and load-time tunables ([`names`]). Records are `#[repr(C)]` with
//! fixed-width fields and no implicit padding, so the BPF object and the
//! loader see the same bytes; the assertions at the end hold them to it.
#![no_std]
#![allow(
    clippy::pub_underscore_fields,
    reason = "explicit padding of #[repr(C)] records: public so that both sides can build them"
)]

pub mod events;
pub mod functions;
pub mod names;
pub mod python;
pub mod records;
pub mod unwind;

pub use events::{MappingChange, MappingEvent, TraceEvent, HELD, MAP_ANONYMOUS, MAP_STACK, PROT_NONE};
pub use functions::{
    AllocatorFunction, CxxForm, FunctionSet, MappingFunction, ALLOCATOR_FUNCTIONS, MAPPING_FUNCTIONS,
    OPERATOR_DELETE, OPERATOR_DELETE_FORMS, OPERATOR_NEW, OPERATOR_NEW_FORMS, PROBED_AFTER_SYSTEM_CALL,
    PY_MEM_FREE, PY_OBJECT_FREE,
};
pub use names::{
    programs, tunables, CgroupWalk, ExecHold, HeldCgroup, ALLOCATIONS_MAP, ALLOCATOR_CODE_MAP,
    CGROUP_FILTER_MAP, CGROUP_LEVEL_UNKNOWN, EVENTS_MAP, FOLLOWED_MAP, HELD_CGROUPS_MAP,
    KERNEL_STACK_RECORDER_MAP, KERNEL_STACK_STAGES, KERNEL_STAGE_INSERT, KERNEL_STAGE_STORE,
    MAPPING_EVENTS_MAP, MAX_CGROUP_CLIMB, MAX_HELD_CGROUPS, MAX_HELD_NAMES, MAX_IGNORED_PROCESSES,
    OOM_VICTIMS_MAP, PENDING_MAP, PROCESS_COUNTERS_MAP, PROCESS_MAPPINGS_MAP, PY_NEW_STACKS_MAP,
    PY_PROCS_MAP, PY_WALKING_MAP, REPLACEABLE_MAP, RESERVES_ADDRESS_SPACE, STACKS_MAP, STACK_IDS_MAP,
    STACK_TOTALS_MAP, STAGE_INSERT, STAGE_STORE, STAGE_WALK, TRACED_PROCESSES_MAP, UNWIND_RESCANS_MAP,
    UNWIND_ROWS_MAP, USER_STACK_RECORDER_MAP, USER_STACK_STAGES, WALK_COUNTS_MAP,
};
pub use python::PyProcConfig;
pub use records::{
    lost_stack_id, lost_stack_owner, Allocation, AllocationKey, AllocatorCode, CallKind, Counter,
    PendingCall, PendingMapping, ProcessCounters, StackFrames, StackKey, StackSlot, StackTotals,
    COUNTER_SLOTS, KERNEL_TGID, MAX_STACK_DEPTH, OVERFLOWED_SIZE, REPLACEMENT_WINDOW_NS, UPROBES_PAGE,
};
pub use unwind::{
    ExecMapping, ProcessMappings, Rule, RuleCacheEntry, RuleKind, UnwindRow, WalkCount, WalkCounts, WalkEnd,
    MAX_EXEC_MAPPINGS, RULE_CACHE_ENTRIES,
};

#[cfg(feature = "user")]
mod pod {
    // SAFETY: both are repr(C), made only of u64/u32 fields with no padding
    // (checked by the size assertions below), so every bit pattern is valid.
    unsafe impl aya::Pod for super::Allocation {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PendingCall {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::StackKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::StackSlot {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AllocationKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CgroupWalk {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ExecHold {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::HeldCgroup {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::StackTotals {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::TraceEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::MappingEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::UnwindRow {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ProcessMappings {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AllocatorCode {}
    // SAFETY: as above, of u32, u16 and u8 fields, explicitly padded.
    unsafe impl aya::Pod for super::PyProcConfig {}
}

const _: () = assert!(core::mem::size_of::<Allocation>() == 32);
const _: () = assert!(core::mem::size_of::<ExecHold>() == 24 + 16 * MAX_HELD_NAMES);
const _: () = assert!(core::mem::size_of::<HeldCgroup>() == 16);
const _: () = assert!(core::mem::size_of::<AllocatorCode>() == 16);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 56);
const _: () = assert!(core::mem::size_of::<StackKey>() == 16 + 8 * MAX_STACK_DEPTH);
const _: () = assert!(core::mem::size_of::<UnwindRow>() == 8);
const _: () = assert!(core::mem::size_of::<ExecMapping>() == 32);
const _: () = assert!(core::mem::size_of::<ProcessMappings>() == 8 + 32 * MAX_EXEC_MAPPINGS);
const _: () = assert!(MAX_EXEC_MAPPINGS.is_power_of_two());
const _: () = assert!(core::mem::size_of::<RuleCacheEntry>() == 24);
const _: () = assert!(RULE_CACHE_ENTRIES.is_power_of_two());
const _: () = assert!(core::mem::size_of::<AllocationKey>() == 16);
const _: () = assert!(core::mem::size_of::<StackSlot>() == 16);
const _: () = assert!(core::mem::size_of::<StackTotals>() == 56);
const _: () = assert!(core::mem::size_of::<TraceEvent>() == 40);
const _: () = assert!(core::mem::size_of::<MappingEvent>() == 72);
const _: () = assert!(core::mem::size_of::<PendingMapping>() == 40);
const _: () = assert!(core::mem::size_of::<StackFrames>() == 8 * MAX_STACK_DEPTH);
const _: () = assert!(core::mem::size_of::<PyProcConfig>() == 44);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_read_back_from_their_raw_values() {
        for kind in [CallKind::Allocate, CallKind::Reallocate, CallKind::AllocateThroughPointer] {
            assert_eq!(CallKind::try_from(kind as u32), Ok(kind));
        }
        for change in [
            MappingChange::Map,
            MappingChange::Unmap,
            MappingChange::Remap,
            MappingChange::Exec,
            MappingChange::Protect,
            MappingChange::Fork,
            MappingChange::Launched,
            MappingChange::LoaderReady,
        ] {
            assert_eq!(MappingChange::try_from(change as u32), Ok(change));
        }
        for counter in Counter::ALL {
            assert_eq!(Counter::try_from(counter as u32), Ok(counter));
        }
        assert_eq!(CallKind::try_from(3), Err(3));
        assert_eq!(Counter::try_from(COUNTER_SLOTS), Err(COUNTER_SLOTS));
    }

    #[test]
    fn the_releasing_set_is_the_free_like_functions() {
        let names: [&str; 8] =
            core::array::from_fn(|i| FunctionSet::RELEASING.functions().nth(i).unwrap().name);
        assert_eq!(
            names,
            [
                "free",
                "dallocx",
                "sdallocx",
                "free_sized",
                "free_aligned_sized",
                "operator delete",
                "PyObject_Free",
                "PyMem_Free"
            ]
        );
        assert_eq!(FunctionSet::RELEASING.functions().count(), 8);
        assert!(FunctionSet::PY_OBJECT_FREE.releases_through_another());
        assert!(!FunctionSet::named("free")
            .unwrap()
            .union(FunctionSet::OPERATOR_DELETE)
            .releases_through_another());
        assert_eq!(FunctionSet::named("memalign"), Some(FunctionSet::of(6)));
        assert!(FunctionSet::RELEASING.intersects(FunctionSet::named("sdallocx").unwrap()));
        assert!(!FunctionSet::RELEASING.intersects(FunctionSet::named("realloc").unwrap()));
    }

    #[test]
    fn every_releasing_function_enters_through_the_free_program() {
        for function in ALLOCATOR_FUNCTIONS {
            assert_eq!(
                function.releases,
                function.entry_program == programs::FREE_ENTER,
                "{}",
                function.name
            );
            assert_eq!(function.return_program().is_none(), function.releases, "{}", function.name);
        }
    }
}
