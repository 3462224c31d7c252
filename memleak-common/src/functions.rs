//! The functions memleak probes, declared once: each allocator function
//! with the BPF program at its entry and whether it releases memory, and
//! the memory-mapping functions. A function's place in
//! [`ALLOCATOR_FUNCTIONS`] is its bit in a [`FunctionSet`], the attach
//! cookie that tells the shared programs which function fired.

use crate::names::programs;

/// An allocator entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocatorFunction {
    pub name: &'static str,
    /// The program at its entry, which reads its arguments.
    pub entry_program: &'static str,
    /// It gives a block back (free-like): it has no return probe, and its
    /// entry probe may skip a costly first instruction.
    pub releases: bool,
}

impl AllocatorFunction {
    const fn allocates(name: &'static str, entry_program: &'static str) -> Self {
        Self { name, entry_program, releases: false }
    }

    const fn releases(name: &'static str) -> Self {
        Self { name, entry_program: programs::FREE_ENTER, releases: true }
    }

    /// The program at its return: the one shared return probe of every
    /// function that hands out memory.
    pub const fn return_program(&self) -> Option<&'static str> {
        if self.releases {
            None
        } else {
            Some(programs::ALLOCATION_RETURN)
        }
    }
}

/// The allocator functions memleak probes, named as a C library exports
/// them (an allocator built with a symbol prefix adds its own).
pub const ALLOCATOR_FUNCTIONS: [AllocatorFunction; 16] = [
    AllocatorFunction::allocates("malloc", programs::MALLOC_ENTER),
    AllocatorFunction::allocates("calloc", programs::CALLOC_ENTER),
    AllocatorFunction::allocates("realloc", programs::REALLOC_ENTER),
    AllocatorFunction::allocates("reallocarray", programs::REALLOCARRAY_ENTER),
    AllocatorFunction::allocates("posix_memalign", programs::POSIX_MEMALIGN_ENTER),
    AllocatorFunction::allocates("aligned_alloc", programs::MEMALIGN_ENTER),
    AllocatorFunction::allocates("memalign", programs::MEMALIGN_ENTER),
    AllocatorFunction::allocates("valloc", programs::MALLOC_ENTER),
    AllocatorFunction::allocates("pvalloc", programs::MALLOC_ENTER),
    AllocatorFunction::releases("free"),
    // jemalloc's own API, and the sized frees C++ and Rust allocators call.
    AllocatorFunction::allocates("mallocx", programs::MALLOC_ENTER), // mallocx(size, flags)
    AllocatorFunction::allocates("rallocx", programs::REALLOC_ENTER), // rallocx(ptr, size, flags)
    AllocatorFunction::releases("dallocx"),
    AllocatorFunction::releases("sdallocx"),
    AllocatorFunction::releases("free_sized"),
    AllocatorFunction::releases("free_aligned_sized"),
];

/// A set of [`ALLOCATOR_FUNCTIONS`], bit i standing for function i. It is
/// a probe's attach cookie: one program serves several functions and
/// still says which was called, and aliases probed once (glibc's
/// `aligned_alloc` and memalign share code) are all named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FunctionSet(pub u32);

impl FunctionSet {
    /// The set of the function at `index` in [`ALLOCATOR_FUNCTIONS`].
    pub const fn of(index: usize) -> Self {
        Self(1 << index)
    }

    /// The set of the function named `name`, if memleak probes it.
    pub fn named(name: &str) -> Option<Self> {
        ALLOCATOR_FUNCTIONS.iter().position(|function| function.name == name).map(Self::of)
    }

    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    pub const fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// The functions in the set, in table order.
    pub fn functions(self) -> impl Iterator<Item = &'static AllocatorFunction> {
        ALLOCATOR_FUNCTIONS
            .iter()
            .enumerate()
            .filter(move |(index, _)| self.0 & (1 << index) != 0)
            .map(|(_, f)| f)
    }

    /// Every function that gives memory back.
    pub const RELEASING: Self = {
        let mut set = Self(0);
        let mut index = 0;
        while index < ALLOCATOR_FUNCTIONS.len() {
            if ALLOCATOR_FUNCTIONS[index].releases {
                set = set.union(Self::of(index));
            }
            index += 1;
        }
        set
    };
}

/// A memory-mapping function of the C library, probed in the allocator's
/// object when it has it, to follow the regions a program maps itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingFunction {
    pub name: &'static str,
    pub entry_program: &'static str,
    pub return_program: Option<&'static str>,
}

/// The mapping functions memleak probes (mmap64 is mmap on 64-bit
/// systems; where it is a symbol of its own, it is probed once).
pub const MAPPING_FUNCTIONS: [MappingFunction; 5] = [
    MappingFunction {
        name: "mmap",
        entry_program: programs::MMAP_ENTER,
        return_program: Some(programs::MAPPING_RETURN),
    },
    MappingFunction {
        name: "mmap64",
        entry_program: programs::MMAP_ENTER,
        return_program: Some(programs::MAPPING_RETURN),
    },
    MappingFunction { name: "munmap", entry_program: programs::MUNMAP_ENTER, return_program: None },
    // Turns a PROT_NONE reservation into memory that can be touched, or back.
    MappingFunction { name: "mprotect", entry_program: programs::MPROTECT_ENTER, return_program: None },
    MappingFunction {
        name: "mremap",
        entry_program: programs::MREMAP_ENTER,
        return_program: Some(programs::MAPPING_RETURN),
    },
];

// Cookies are u32 bit sets.
const _: () = assert!(ALLOCATOR_FUNCTIONS.len() <= 32);
