//! Allocation entry probes and the shared return probe.
//!
//! The entry probe saves what the call asked for, per thread; the return
//! probe sees the result and takes the user stack, which at entry would
//! miss the caller's frame.

use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::uretprobe,
    programs::{ProbeContext, RetProbeContext},
};
use memleak_common::{AllocationKey, CallKind, Counter, OVERFLOWED_SIZE};

use super::free;
use crate::{
    calls::{self, enter},
    counters, deferred, events, record, scratch, tunables,
};

/// What an entry probe reads of its function's arguments: every
/// allocator function reads as one of these.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// `malloc(size)`, `valloc(size)`, `pvalloc(size)`, `mallocx(size,
    /// flags)`, `operator new(size, ...)`.
    Malloc,
    /// `calloc(count, size)`.
    Calloc,
    /// `realloc(ptr, size)`, `rallocx(ptr, size, flags)`.
    Realloc,
    /// `reallocarray(ptr, count, size)`.
    Reallocarray,
    /// `memalign(alignment, size)`, `aligned_alloc(alignment, size)`.
    Memalign,
    /// `posix_memalign(out, alignment, size)`.
    PosixMemalign,
    /// `free(ptr)` and every other release: see `free`.
    Free,
}

/// The entry of an allocator function that reads as `reads`, whose
/// `FunctionSet` is `function`.
#[expect(clippy::inline_always, reason = "each program's own copy, with `reads` a constant")]
#[inline(always)]
pub fn entered(ctx: &ProbeContext, reads: Reads, function: u32) -> u32 {
    scratch::own_stack(ctx);
    let arg = |index| ctx.arg::<u64>(index).unwrap_or(0);
    match reads {
        Reads::Malloc => enter(ctx, arg(0), 0, CallKind::Allocate, function),
        Reads::Calloc => enter(ctx, array_size(arg(0), arg(1)), 0, CallKind::Allocate, function),
        Reads::Realloc => enter(ctx, arg(1), arg(0), CallKind::Reallocate, function),
        Reads::Reallocarray => enter(ctx, array_size(arg(1), arg(2)), arg(0), CallKind::Reallocate, function),
        Reads::Memalign => enter(ctx, arg(1), 0, CallKind::Allocate, function),
        Reads::PosixMemalign => enter(ctx, arg(2), arg(0), CallKind::AllocateThroughPointer, function),
        Reads::Free => free::released(ctx, function),
    }
    0
}

/// The entry programs of kernels with attach cookies (5.15), one per way
/// of reading: the cookie says which function fired.
#[cfg(not(feature = "legacy-kernels"))]
mod by_cookie {
    use aya_ebpf::{macros::uprobe, programs::ProbeContext};

    use super::{entered, Reads};
    use crate::calls::attach_cookie;

    #[uprobe]
    pub fn malloc_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::Malloc, attach_cookie(&ctx) as u32)
    }

    #[uprobe]
    pub fn calloc_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::Calloc, attach_cookie(&ctx) as u32)
    }

    #[uprobe]
    pub fn realloc_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::Realloc, attach_cookie(&ctx) as u32)
    }

    #[uprobe]
    pub fn reallocarray_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::Reallocarray, attach_cookie(&ctx) as u32)
    }

    #[uprobe]
    pub fn memalign_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::Memalign, attach_cookie(&ctx) as u32)
    }

    #[uprobe]
    pub fn posix_memalign_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::PosixMemalign, attach_cookie(&ctx) as u32)
    }

    #[uprobe]
    pub fn free_enter(ctx: ProbeContext) -> u32 {
        entered(&ctx, Reads::Free, attach_cookie(&ctx) as u32)
    }
}

/// The entry programs of kernels without attach cookies: one per
/// function of `ALLOCATOR_FUNCTIONS`, named as
/// `programs::ENTRY_OF_FUNCTION` names them, each knowing its function.
#[cfg(feature = "legacy-kernels")]
mod by_function {
    use aya_ebpf::{macros::uprobe, programs::ProbeContext};
    use memleak_common::{FunctionSet, ALLOCATOR_FUNCTIONS};

    use super::{entered, Reads};

    /// How the functions whose entry program is `program` read.
    const fn reads_of(program: &str) -> Reads {
        use memleak_common::{functions::const_eq, names::programs};
        if const_eq(program, programs::MALLOC_ENTER) {
            Reads::Malloc
        } else if const_eq(program, programs::CALLOC_ENTER) {
            Reads::Calloc
        } else if const_eq(program, programs::REALLOC_ENTER) {
            Reads::Realloc
        } else if const_eq(program, programs::REALLOCARRAY_ENTER) {
            Reads::Reallocarray
        } else if const_eq(program, programs::MEMALIGN_ENTER) {
            Reads::Memalign
        } else if const_eq(program, programs::POSIX_MEMALIGN_ENTER) {
            Reads::PosixMemalign
        } else if const_eq(program, programs::FREE_ENTER) {
            Reads::Free
        } else {
            panic!("an entry program no function reads as")
        }
    }

    /// The entry of function `INDEX`.
    #[expect(clippy::inline_always, reason = "as `entered`")]
    #[inline(always)]
    fn entry<const INDEX: usize>(ctx: &ProbeContext) -> u32 {
        let reads = const { reads_of(ALLOCATOR_FUNCTIONS[INDEX].entry_program) };
        entered(ctx, reads, FunctionSet::of(INDEX).0)
    }

    macro_rules! entries {
        ($($name:ident = $index:literal),* $(,)?) => {
            $(
                #[uprobe]
                pub fn $name(ctx: ProbeContext) -> u32 {
                    entry::<$index>(&ctx)
                }
            )*
            // Every function has its program.
            const _: () = assert!([$($index),*].len() == ALLOCATOR_FUNCTIONS.len());
        };
    }

    entries!(
        entry_0 = 0,
        entry_1 = 1,
        entry_2 = 2,
        entry_3 = 3,
        entry_4 = 4,
        entry_5 = 5,
        entry_6 = 6,
        entry_7 = 7,
        entry_8 = 8,
        entry_9 = 9,
        entry_10 = 10,
        entry_11 = 11,
        entry_12 = 12,
        entry_13 = 13,
        entry_14 = 14,
        entry_15 = 15,
        entry_16 = 16,
        entry_17 = 17,
        entry_18 = 18,
        entry_19 = 19,
        entry_20 = 20,
        entry_21 = 21,
        entry_22 = 22,
        entry_23 = 23,
        entry_24 = 24,
        entry_25 = 25,
    );
}

/// The return of every function above.
#[uretprobe]
pub fn allocation_return(ctx: RetProbeContext) -> u32 {
    scratch::own_stack(&ctx);
    let returned: u64 = ctx.ret();
    let Some(call) = calls::leave() else { return 0 };
    let address = match CallKind::try_from(call.kind) {
        Ok(CallKind::Allocate) | Err(_) => returned,
        Ok(CallKind::Reallocate) => {
            // realloc(p, n) that fails leaves p allocated. One that succeeds,
            // or realloc(p, 0), which glibc treats as free(p), releases it.
            if returned != 0 || call.size == 0 {
                record::release_resized(calls::process_id(), call.argument);
            }
            returned
        }
        Ok(CallKind::AllocateThroughPointer) => {
            if returned as i32 != 0 || call.argument == 0 {
                0
            } else {
                // SAFETY: reads the caller's out-pointer, which posix_memalign
                // has just written; a fault only yields an error.
                unsafe { bpf_probe_read_user(call.argument as *const u64) }.unwrap_or(0)
            }
        }
    };
    events::send(call.function, address, call.size);
    let tgid = calls::process_id();
    if address == 0 {
        if call.size != 0 {
            counters::increment(tgid, Counter::FailedAllocations);
        }
        return 0;
    }
    counters::increment(tgid, Counter::Allocations);
    if call.sampled == 0
        || call.size == OVERFLOWED_SIZE
        || call.size < tunables::min_size()
        || call.size > tunables::max_size()
    {
        return 0;
    }
    deferred::store_allocation(&ctx, AllocationKey { tgid, _padding: 0, address }, call.size);
    0
}

/// `count * size`, or `OVERFLOWED_SIZE` when the product overflows (the
/// call then fails and returns NULL). Division, because BPF has no
/// overflow-checked multiply.
fn array_size(count: u64, size: u64) -> u64 {
    if count != 0 && size > (OVERFLOWED_SIZE - 1) / count {
        OVERFLOWED_SIZE
    } else {
        count * size
    }
}
