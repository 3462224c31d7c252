//! Is it even a leak? A process's resident memory can grow while the
//! blocks memleak tracks do not: the allocator keeping freed blocks
//! (fragmentation, or memory it does not give back), thread stacks,
//! mappings made outside the allocator. Beside the tracked blocks, how
//! the process's memory moved since the series' first report says which,
//! with the knobs that exist for it.

use serde::{Deserialize, Serialize};

use crate::model::ResidentMemory;

/// Growth of anonymous memory below this is not judged: a few pages come
/// and go in any process.
const JUDGED_FROM: i64 = 4 << 20;

/// Tracked blocks that grew less than this share of the anonymous
/// memory's growth do not explain it.
const EXPLAINED_SHARE: i64 = 4;

/// A process's resident memory beside the blocks memleak tracks, in a
/// report of its series (none in the kernel's, nor in saved snapshots).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryAccount {
    /// Its resident memory by what holds it, as the report was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<ResidentMemory>,
    /// How it and the blocks memleak tracks moved since the series' first
    /// report, which tells a leak from memory the allocator keeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_growth: Option<ResidentGrowth>,
    /// When that growth is not the blocks memleak tracks: why it is not a
    /// leak memleak sees, where it grew, and what to try.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_a_leak: Option<String>,
}

/// How a process's memory moved since the series' first report, in bytes
/// (negative when it shrank).
#[allow(clippy::struct_field_names, reason = "each is a number of bytes; the names are the JSON's")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentGrowth {
    /// Over how long.
    pub seconds: u64,
    pub anon_bytes: i64,
    /// The outstanding blocks memleak tracks, and CPython's arenas, whose
    /// small objects it tracks only with --python-allocator.
    pub tracked_bytes: i64,
    pub heap_bytes: i64,
    pub thread_stack_bytes: i64,
    pub file_bytes: i64,
}

impl ResidentGrowth {
    /// The growth from `first` (with `first_tracked` bytes tracked) to
    /// `now` (with `tracked`), `seconds` later.
    pub fn between(
        (first, first_tracked): (&ResidentMemory, u64),
        (now, tracked): (&ResidentMemory, u64),
        seconds: u64,
    ) -> Self {
        let delta = |before: u64, after: u64| {
            i64::try_from(i128::from(after) - i128::from(before)).unwrap_or(if after > before {
                i64::MAX
            } else {
                i64::MIN
            })
        };
        Self {
            seconds,
            anon_bytes: delta(first.anon_bytes, now.anon_bytes),
            tracked_bytes: delta(first_tracked, tracked),
            heap_bytes: delta(first.heap_bytes, now.heap_bytes),
            thread_stack_bytes: delta(first.thread_stack_bytes, now.thread_stack_bytes),
            file_bytes: delta(first.file_bytes, now.file_bytes),
        }
    }

    /// Of the anonymous memory's growth, what is neither the heap nor
    /// thread stacks: mappings of their own (big blocks, mmap outside the
    /// allocator, an allocator that maps its own regions).
    pub fn elsewhere_bytes(&self) -> i64 {
        self.anon_bytes.saturating_sub(self.heap_bytes).saturating_sub(self.thread_stack_bytes)
    }

    /// When the anonymous memory grew and the blocks memleak tracks do not
    /// explain it: why it is not a leak memleak sees, where it grew, and
    /// what to try, for a process whose allocator is `allocator`.
    pub fn not_a_leak(&self, allocator: &str) -> Option<String> {
        if self.anon_bytes < JUDGED_FROM
            || self.tracked_bytes.saturating_mul(EXPLAINED_SHARE) >= self.anon_bytes
        {
            return None;
        }
        let places = [
            (self.heap_bytes, Place::Heap),
            (self.thread_stack_bytes, Place::ThreadStacks),
            (self.elsewhere_bytes(), Place::Elsewhere),
        ];
        let (bytes, place) = places.into_iter().max_by_key(|(bytes, _)| *bytes)?;
        let allocator = Allocator::of(allocator);
        Some(format!(
            "mostly not a leak: anonymous memory grew {} in {} s, the blocks memleak tracks {}; most of it {} ({}): {}",
            signed(self.anon_bytes),
            self.seconds,
            signed(self.tracked_bytes),
            place.describe(allocator),
            signed(bytes),
            place.advice(allocator),
        ))
    }
}

#[derive(Clone, Copy)]
enum Place {
    Heap,
    ThreadStacks,
    Elsewhere,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Allocator {
    Glibc,
    Jemalloc,
    Tcmalloc,
    Mimalloc,
    Other,
}

impl Allocator {
    fn of(path: &str) -> Self {
        let name = path.rsplit('/').next().unwrap_or(path);
        if name.contains("jemalloc") {
            Allocator::Jemalloc
        } else if name.contains("tcmalloc") {
            Allocator::Tcmalloc
        } else if name.contains("mimalloc") {
            Allocator::Mimalloc
        } else if name.starts_with("libc.so") || name.starts_with("libc-") {
            Allocator::Glibc
        } else {
            Allocator::Other
        }
    }
}

impl Place {
    fn describe(self, allocator: Allocator) -> &'static str {
        match (self, allocator) {
            (Place::Heap, _) => "in the heap and the allocator's arenas, in blocks freed that it keeps",
            (Place::ThreadStacks, _) => "in thread stacks",
            (Place::Elsewhere, Allocator::Jemalloc | Allocator::Tcmalloc | Allocator::Mimalloc) => {
                "in anonymous mappings: the allocator's own, with blocks freed that it keeps, or mmap outside it"
            }
            (Place::Elsewhere, _) => "in anonymous mappings outside the heap: mmap outside the allocator, or big blocks",
        }
    }

    fn advice(self, allocator: Allocator) -> &'static str {
        match (self, allocator) {
            (Place::Heap, Allocator::Glibc | Allocator::Other) => {
                "fragmentation, or free memory glibc keeps; malloc_trim(0) gives it back, MALLOC_ARENA_MAX=2 \
                 bounds the arenas of many threads, and MALLOC_TRIM_THRESHOLD_ how much it keeps"
            }
            (Place::Heap | Place::Elsewhere, Allocator::Jemalloc) => {
                "jemalloc keeps freed pages for dirty_decay_ms (10 s): MALLOC_CONF=dirty_decay_ms:1000,\
                 muzzy_decay_ms:0 gives them back sooner, background_thread:true without waiting for a call"
            }
            (Place::Heap | Place::Elsewhere, Allocator::Tcmalloc) => {
                "tcmalloc keeps freed pages: TCMALLOC_RELEASE_RATE raises how fast it gives them back, \
                 MallocExtension::ReleaseFreeMemory() gives them back at once"
            }
            (Place::Heap | Place::Elsewhere, Allocator::Mimalloc) => {
                "mimalloc keeps freed pages: MIMALLOC_PURGE_DELAY=0 gives them back at once"
            }
            (Place::ThreadStacks, _) => "more threads, or deeper stacks: count them in /proc/PID/task",
            (Place::Elsewhere, _) => "--all-mmaps shows the mappings memleak saw made, with their stacks",
        }
    }
}

/// `+79.5 MiB`, `-1.0 MiB`, `+640 bytes`.
fn signed(bytes: i64) -> String {
    let sign = if bytes < 0 { "-" } else { "+" };
    format!("{sign}{}", crate::status::readable_bytes(bytes.unsigned_abs()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn memory(anon: u64, heap: u64, stacks: u64) -> ResidentMemory {
        ResidentMemory {
            resident_bytes: anon + 10 * MIB,
            anon_bytes: anon,
            heap_bytes: heap,
            thread_stack_bytes: stacks,
            file_bytes: 10 * MIB,
        }
    }

    #[test]
    fn a_heap_that_grows_with_few_tracked_blocks_is_not_a_leak_and_glibc_s_knobs_are_named() {
        let growth = ResidentGrowth::between(
            (&memory(20 * MIB, 10 * MIB, MIB), 0),
            (&memory(100 * MIB, 89 * MIB, MIB), 640),
            30,
        );
        let said = growth.not_a_leak("/usr/lib/x86_64-linux-gnu/libc.so.6").expect("a verdict");
        assert_eq!(
            said,
            "mostly not a leak: anonymous memory grew +80.0 MiB in 30 s, the blocks memleak tracks +640 bytes; most of \
             it in the heap and the allocator's arenas, in blocks freed that it keeps (+79.0 MiB): fragmentation, \
             or free memory glibc keeps; malloc_trim(0) gives it back, MALLOC_ARENA_MAX=2 bounds the arenas of \
             many threads, and MALLOC_TRIM_THRESHOLD_ how much it keeps"
        );
    }

    #[test]
    fn a_leak_the_tracked_blocks_explain_and_small_growth_get_no_verdict() {
        let leak = ResidentGrowth::between(
            (&memory(20 * MIB, 10 * MIB, MIB), 0),
            (&memory(100 * MIB, 90 * MIB, MIB), 78 * MIB),
            30,
        );
        assert_eq!(leak.not_a_leak("libc.so.6"), None);
        let small = ResidentGrowth::between(
            (&memory(20 * MIB, 10 * MIB, MIB), 0),
            (&memory(22 * MIB, 12 * MIB, MIB), 0),
            30,
        );
        assert_eq!(small.not_a_leak("libc.so.6"), None);
    }

    #[test]
    fn jemalloc_s_own_mappings_get_its_decay_knobs() {
        let growth =
            ResidentGrowth::between((&memory(20 * MIB, 0, MIB), 0), (&memory(60 * MIB, 0, MIB), MIB), 30);
        let said = growth.not_a_leak("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2").expect("a verdict");
        assert!(said.contains("the allocator's own") && said.contains("dirty_decay_ms"), "{said}");
    }
}
