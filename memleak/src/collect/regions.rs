//! The memory regions a process mapped with mmap and still holds. A
//! munmap may cut a region anywhere, an mremap may move or resize it:
//! this needs an ordered interval map, which user space has and BPF does
//! not, so the BPF side sends the calls and the bookkeeping happens here.

use std::sync::Arc;

use std::collections::BTreeMap;

use memleak_common::{MappingChange, MappingEvent, MAP_ANONYMOUS, MAP_STACK, PROT_NONE};

use crate::model::{Frame, MappingKind};

/// The kernel maps whole pages.
const PAGE_SIZE: u64 = 4096;

/// A mapped region, `[start, end)`.
#[allow(
    clippy::struct_excessive_bools,
    reason = "independent facts of a mapping, each from a flag of its own"
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub end: u64,
    /// The stack of the mmap call that made it.
    pub stack_id: u64,
    /// When it was mapped, `CLOCK_MONOTONIC` nanoseconds.
    pub timestamp_ns: u64,
    /// Mapped by malloc & co. for themselves (arenas, large blocks).
    pub inside_allocator: bool,
    /// Mapped as a thread's stack (`MAP_STACK`).
    pub thread_stack: bool,
    /// `PROT_NONE`: address space set aside, which no page can back until
    /// an mprotect (or a `MAP_FIXED` mmap over it) makes it usable.
    pub reserved: bool,
    /// A file's pages (not `MAP_ANONYMOUS`): the page cache's, which the
    /// kernel can drop and read again, not the program's heap.
    pub file_backed: bool,
}

/// The live mmap regions of one process, by start address.
#[derive(Debug, Default)]
pub struct Regions {
    by_start: BTreeMap<u64, Region>,
}

impl Regions {
    pub fn apply(&mut self, event: &MappingEvent) {
        let end = |start: u64, length: u64| start.saturating_add(round_up_to_page(length));
        match MappingChange::try_from(event.change) {
            Ok(MappingChange::Map) => {
                // MAP_FIXED may map over regions we know: those parts are gone.
                self.unmap(event.address, end(event.address, event.length));
                let region = Region {
                    end: end(event.address, event.length),
                    stack_id: event.stack_id,
                    timestamp_ns: event.timestamp_ns,
                    inside_allocator: event.inside_allocator != 0,
                    thread_stack: event.flags & MAP_STACK != 0,
                    reserved: event.prot == PROT_NONE,
                    file_backed: event.flags & MAP_ANONYMOUS == 0,
                };
                self.by_start.insert(event.address, region);
            }
            Ok(MappingChange::Unmap) => {
                self.unmap(event.address, end(event.address, event.length));
            }
            Ok(MappingChange::Remap) => {
                let removed = self.unmap(event.address, end(event.address, event.length));
                // A region we did not see mapped stays unknown.
                let Some(&(_, moved)) = removed.first() else { return };
                let new_end = end(event.new_address, event.new_length);
                self.unmap(event.new_address, new_end);
                self.by_start.insert(event.new_address, Region { end: new_end, ..moved });
            }
            Ok(MappingChange::Protect) => {
                // Only the parts of regions we know change; each piece
                // keeps the stack that mapped it. Thread stacks and the
                // allocator's mappings are what they are whatever their
                // protection (glibc opens both up from PROT_NONE): they
                // stay whole, one region per mmap.
                let span = (event.address, end(event.address, event.length));
                for (start, region) in self.unmap(span.0, span.1) {
                    let reserved = if region.thread_stack || region.inside_allocator {
                        region.reserved
                    } else {
                        event.prot == PROT_NONE
                    };
                    self.by_start.insert(start, Region { reserved, ..region });
                }
                self.merge_around(span.0, span.1);
            }
            // The old program's regions stay for its final report; the
            // session then starts the process's books afresh. A fork is
            // another process's news.
            Ok(
                MappingChange::Exec
                | MappingChange::Fork
                | MappingChange::Launched
                | MappingChange::LoaderReady,
            ) => {}
            Err(unknown) => log::debug!("unknown mapping change {unknown}: ignored"),
        }
    }

    /// Removes `[start, end)`, cutting the regions that straddle it, and
    /// returns the pieces removed.
    fn unmap(&mut self, start: u64, end: u64) -> Vec<(u64, Region)> {
        // Regions never overlap, so going down from `end`, the first one
        // that ends at or before `start` ends the search.
        let overlapping: Vec<(u64, Region)> = self
            .by_start
            .range(..end)
            .rev()
            .take_while(|(_, region)| region.end > start)
            .map(|(&region_start, &region)| (region_start, region))
            .collect();
        let mut removed = Vec::with_capacity(overlapping.len());
        for (region_start, region) in overlapping {
            self.by_start.remove(&region_start);
            if region_start < start {
                self.by_start.insert(region_start, Region { end: start, ..region });
            }
            if region.end > end {
                self.by_start.insert(end, region);
            }
            let cut_start = region_start.max(start);
            removed.push((cut_start, Region { end: region.end.min(end), ..region }));
        }
        removed.reverse();
        removed
    }

    /// Joins the pieces at `start` and `end` back to their neighbours when
    /// nothing tells them apart.
    fn merge_around(&mut self, start: u64, end: u64) {
        for boundary in [end, start] {
            let Some((&before_start, &before)) = self.by_start.range(..boundary).next_back() else {
                continue;
            };
            let Some(&after) = self.by_start.get(&boundary) else { continue };
            if before.end == boundary && (Region { end: after.end, ..before }) == after {
                self.by_start.remove(&boundary);
                self.by_start.insert(before_start, after);
            }
        }
    }

    /// Every region, by start address.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Region)> {
        self.by_start.iter().map(|(&start, region)| (start, region))
    }
}

/// Tells the allocator's own mappings, thread stacks and reservations
/// from the program's mmaps. `frames` is the stack that mapped the
/// region; `in_allocator` says whether a return address lies in one of
/// the allocator's entry points.
pub fn classify(region: &Region, frames: &[Arc<Frame>], in_allocator: impl Fn(u64) -> bool) -> MappingKind {
    // The BPF side marks mappings made during an allocation call. A free
    // can map memory too (glibc's free sets up a thread's tcache, and so
    // its arena, the first time that thread calls the allocator): its
    // frame on the stack says so.
    let from_allocator = region.inside_allocator || frames.iter().any(|frame| in_allocator(frame.address));
    // glibc maps thread stacks with MAP_STACK; musl does not, and there the
    // caller is pthread_create (`__pthread_create_2_1` in a static glibc).
    let creates_thread = region.thread_stack
        || frames.iter().any(|frame| {
            frame
                .function
                .as_deref()
                .is_some_and(|name| name.contains("pthread_create") || name == "allocate_stack")
        });
    if from_allocator {
        MappingKind::AllocatorMmap
    } else if creates_thread {
        MappingKind::ThreadStack
    } else if region.reserved {
        MappingKind::Reservation
    } else if region.file_backed {
        MappingKind::FileMapping
    } else {
        MappingKind::Mmap
    }
}

/// Whether a region of `length` bytes that `frames` mapped is an arena of
/// CPython's small-object allocator: as long as one (`arena_size`), and
/// mapped by a call in the interpreter's code (`in_interpreter`, given the
/// return address of the mmap call). obmalloc's `new_arena` maps them so,
/// and nothing else in the interpreter maps that size: its other mappings
/// (3.11's frame stacks) are smaller, and Python code's own `mmap.mmap`
/// calls from the `mmap` module, an extension object of its own in
/// Debian's and pyenv's builds.
pub fn is_python_arena(
    length: u64,
    frames: &[Arc<Frame>],
    arena_size: u64,
    in_interpreter: impl Fn(u64) -> bool,
) -> bool {
    length == arena_size && frames.first().is_some_and(|frame| in_interpreter(frame.address))
}

fn round_up_to_page(length: u64) -> u64 {
    length.div_ceil(PAGE_SIZE).saturating_mul(PAGE_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = PAGE_SIZE;

    fn event(change: MappingChange, address: u64, length: u64) -> MappingEvent {
        let prot = 3; // PROT_READ | PROT_WRITE
        let flags = MAP_ANONYMOUS;
        MappingEvent {
            address,
            length,
            change: change as u32,
            stack_id: 7,
            prot,
            flags,
            ..MappingEvent::default()
        }
    }

    fn reserved(regions: &Regions) -> Vec<(u64, u64, bool)> {
        regions.iter().map(|(start, region)| (start, region.end, region.reserved)).collect()
    }

    #[test]
    fn mprotect_makes_parts_of_a_reservation_usable() {
        // Go and glibc reserve address space with PROT_NONE and open it up
        // piece by piece.
        let mut regions = Regions::default();
        let mut map = event(MappingChange::Map, 10 * PAGE, 8 * PAGE);
        map.prot = PROT_NONE;
        regions.apply(&map);
        assert_eq!(reserved(&regions), [(10 * PAGE, 18 * PAGE, true)]);
        regions.apply(&event(MappingChange::Protect, 12 * PAGE, 2 * PAGE));
        assert_eq!(
            reserved(&regions),
            [(10 * PAGE, 12 * PAGE, true), (12 * PAGE, 14 * PAGE, false), (14 * PAGE, 18 * PAGE, true)]
        );
        let mut back = event(MappingChange::Protect, 13 * PAGE, PAGE);
        back.prot = PROT_NONE;
        regions.apply(&back);
        assert_eq!(reserved(&regions)[1..], [(12 * PAGE, 13 * PAGE, false), (13 * PAGE, 18 * PAGE, true)]);
        // A MAP_FIXED mapping over a reservation replaces that part.
        regions.apply(&event(MappingChange::Map, 16 * PAGE, PAGE));
        assert!(reserved(&regions).contains(&(16 * PAGE, 17 * PAGE, false)));
        assert!(regions.iter().all(|(_, region)| region.stack_id == 7));
    }

    #[test]
    fn a_thread_stack_stays_one_region_whatever_its_protection() {
        // glibc maps a stack PROT_NONE and opens all but the guard page.
        let mut regions = Regions::default();
        let mut map = event(MappingChange::Map, 10 * PAGE, 8 * PAGE);
        (map.prot, map.flags) = (PROT_NONE, MAP_STACK);
        regions.apply(&map);
        regions.apply(&event(MappingChange::Protect, 11 * PAGE, 7 * PAGE));
        assert_eq!(reserved(&regions), [(10 * PAGE, 18 * PAGE, true)]);
    }

    #[test]
    fn what_a_region_is() {
        let region = |flags: u32, prot: u32, inside_allocator: u32| {
            let mut regions = Regions::default();
            let mut map = event(MappingChange::Map, PAGE, PAGE);
            (map.flags, map.prot, map.inside_allocator) = (flags, prot, inside_allocator);
            regions.apply(&map);
            let (_, region) = regions.iter().next().map(|(start, region)| (start, *region)).unwrap();
            region
        };
        let frame = |address: u64, function: &str| {
            Arc::new(Frame { address, function: Some(function.to_owned()), ..Frame::default() })
        };
        let program = [frame(0x100, "main")];
        let free = |address: u64| address == 0x200;
        let plain = region(MAP_ANONYMOUS, 3, 0);
        assert_eq!(classify(&plain, &program, free), MappingKind::Mmap);
        assert_eq!(classify(&region(MAP_ANONYMOUS, 3, 1), &program, free), MappingKind::AllocatorMmap);
        // A free's arena: no allocation call in flight, free on the stack.
        let arena = [frame(0x150, "alloc_new_heap"), frame(0x200, "__libc_free"), frame(0x100, "main")];
        assert_eq!(classify(&region(MAP_ANONYMOUS, PROT_NONE, 0), &arena, free), MappingKind::AllocatorMmap);
        assert_eq!(
            classify(&region(MAP_STACK | MAP_ANONYMOUS, PROT_NONE, 0), &program, free),
            MappingKind::ThreadStack
        );
        let static_glibc = [frame(0x300, "__pthread_create_2_1"), frame(0x100, "main")];
        assert_eq!(classify(&plain, &static_glibc, free), MappingKind::ThreadStack);
        assert_eq!(classify(&region(MAP_ANONYMOUS, PROT_NONE, 0), &program, free), MappingKind::Reservation);
        // A file's pages, read-only or not: the page cache's.
        assert_eq!(classify(&region(0, 1, 0), &program, free), MappingKind::FileMapping);
    }

    #[test]
    fn an_arena_is_its_size_mapped_from_the_interpreter() {
        let frame = |address: u64| Arc::new(Frame { address, ..Frame::default() });
        let interpreter = |address: u64| (0x1000..0x2000).contains(&address);
        let from_interpreter = [frame(0x1500), frame(0x9000)];
        assert!(is_python_arena(1 << 20, &from_interpreter, 1 << 20, interpreter));
        assert!(!is_python_arena(16 << 10, &from_interpreter, 1 << 20, interpreter), "3.11's frame stacks");
        // Python's own mmap.mmap(-1, 1 MiB): called from the mmap module.
        let from_elsewhere = [frame(0x9000), frame(0x1500)];
        assert!(!is_python_arena(1 << 20, &from_elsewhere, 1 << 20, interpreter));
        assert!(!is_python_arena(1 << 20, &[], 1 << 20, interpreter));
    }

    fn spans(regions: &Regions) -> Vec<(u64, u64)> {
        regions.iter().map(|(start, region)| (start, region.end)).collect()
    }

    #[test]
    fn partial_unmaps_shrink_and_split() {
        let mut regions = Regions::default();
        regions.apply(&event(MappingChange::Map, 10 * PAGE, 8 * PAGE));
        regions.apply(&event(MappingChange::Unmap, 10 * PAGE, PAGE)); // the front
        regions.apply(&event(MappingChange::Unmap, 17 * PAGE, PAGE)); // the back
        regions.apply(&event(MappingChange::Unmap, 13 * PAGE, 2 * PAGE)); // a hole
        assert_eq!(spans(&regions), [(11 * PAGE, 13 * PAGE), (15 * PAGE, 17 * PAGE)]);
        assert!(regions.iter().all(|(_, region)| region.stack_id == 7));
        regions.apply(&event(MappingChange::Unmap, 0, 100 * PAGE));
        assert_eq!(spans(&regions), []);
    }

    #[test]
    fn lengths_are_rounded_up_to_pages() {
        let mut regions = Regions::default();
        regions.apply(&event(MappingChange::Map, PAGE, 5000));
        assert_eq!(spans(&regions), [(PAGE, 3 * PAGE)]);
    }

    #[test]
    fn remap_moves_and_resizes_keeping_the_origin() {
        let mut regions = Regions::default();
        regions.apply(&event(MappingChange::Map, 10 * PAGE, 2 * PAGE));
        let mut remap = event(MappingChange::Remap, 10 * PAGE, 2 * PAGE);
        remap.new_address = 50 * PAGE;
        remap.new_length = 4 * PAGE;
        remap.stack_id = 0;
        regions.apply(&remap);
        assert_eq!(spans(&regions), [(50 * PAGE, 54 * PAGE)]);
        assert_eq!(regions.iter().next().unwrap().1.stack_id, 7, "the stack that mapped it");
    }

    #[test]
    fn unknown_regions_are_left_alone() {
        let mut regions = Regions::default();
        let mut remap = event(MappingChange::Remap, 10 * PAGE, 2 * PAGE);
        remap.new_address = 50 * PAGE;
        remap.new_length = 4 * PAGE;
        regions.apply(&remap);
        regions.apply(&event(MappingChange::Unmap, 10 * PAGE, PAGE));
        assert_eq!(spans(&regions), []);
    }
}
