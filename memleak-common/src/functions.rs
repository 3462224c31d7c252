//! The functions memleak probes, declared once: each allocator function
//! with the BPF program at its entry and whether it releases memory, and
//! the memory-mapping functions. A function's place in
//! [`ALLOCATOR_FUNCTIONS`] is its bit in a [`FunctionSet`], the attach
//! cookie that tells the shared programs which function fired.
//!
//! C++'s `operator new` and `operator delete` are one entry each, whatever
//! their form (array, nothrow, aligned, sized): every form of `new` takes
//! the size first, every form of `delete` the block first, so one program
//! serves them all, and a --trace line names the operator.

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
    /// The symbols that define it: empty for a C function, whose symbol is
    /// its name (after an allocator's prefix, if it has one); the mangled
    /// forms of a C++ operator, which no prefix changes.
    pub forms: &'static [CxxForm],
    /// CPython's small-object allocator (`PyObject_Malloc` & co., and
    /// `PyMem_Malloc` & co., which share it), probed in the interpreter's
    /// object with --python-allocator, never looked for in the
    /// allocator's.
    pub python: bool,
}

/// One form of a C++ operator: its symbol, mangled as the Itanium C++ ABI
/// does on x86-64 (`size_t` is `unsigned long`, `m`), and how it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CxxForm {
    pub symbol: &'static str,
    pub name: &'static str,
}

impl AllocatorFunction {
    const fn allocates(name: &'static str, entry_program: &'static str) -> Self {
        Self { name, entry_program, releases: false, forms: &[], python: false }
    }

    const fn releases(name: &'static str) -> Self {
        Self { name, entry_program: programs::FREE_ENTER, releases: true, forms: &[], python: false }
    }

    /// `function` marked as CPython's.
    const fn python(function: Self) -> Self {
        Self { python: true, ..function }
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

const fn form(symbol: &'static str, name: &'static str) -> CxxForm {
    CxxForm { symbol, name }
}

/// Every replaceable `operator new` and `operator new[]` of C++17: the
/// size comes first in each, as `malloc`'s does.
pub const OPERATOR_NEW_FORMS: [CxxForm; 8] = [
    form("_Znwm", "operator new(unsigned long)"),
    form("_Znam", "operator new[](unsigned long)"),
    form("_ZnwmRKSt9nothrow_t", "operator new(unsigned long, std::nothrow_t const&)"),
    form("_ZnamRKSt9nothrow_t", "operator new[](unsigned long, std::nothrow_t const&)"),
    form("_ZnwmSt11align_val_t", "operator new(unsigned long, std::align_val_t)"),
    form("_ZnamSt11align_val_t", "operator new[](unsigned long, std::align_val_t)"),
    form(
        "_ZnwmSt11align_val_tRKSt9nothrow_t",
        "operator new(unsigned long, std::align_val_t, std::nothrow_t const&)",
    ),
    form(
        "_ZnamSt11align_val_tRKSt9nothrow_t",
        "operator new[](unsigned long, std::align_val_t, std::nothrow_t const&)",
    ),
];

/// Every replaceable `operator delete` and `operator delete[]` of C++17
/// (sized, aligned, nothrow): the block comes first in each, as `free`'s
/// does.
pub const OPERATOR_DELETE_FORMS: [CxxForm; 12] = [
    form("_ZdlPv", "operator delete(void*)"),
    form("_ZdaPv", "operator delete[](void*)"),
    form("_ZdlPvm", "operator delete(void*, unsigned long)"),
    form("_ZdaPvm", "operator delete[](void*, unsigned long)"),
    form("_ZdlPvRKSt9nothrow_t", "operator delete(void*, std::nothrow_t const&)"),
    form("_ZdaPvRKSt9nothrow_t", "operator delete[](void*, std::nothrow_t const&)"),
    form("_ZdlPvSt11align_val_t", "operator delete(void*, std::align_val_t)"),
    form("_ZdaPvSt11align_val_t", "operator delete[](void*, std::align_val_t)"),
    form("_ZdlPvmSt11align_val_t", "operator delete(void*, unsigned long, std::align_val_t)"),
    form("_ZdaPvmSt11align_val_t", "operator delete[](void*, unsigned long, std::align_val_t)"),
    form(
        "_ZdlPvSt11align_val_tRKSt9nothrow_t",
        "operator delete(void*, std::align_val_t, std::nothrow_t const&)",
    ),
    form(
        "_ZdaPvSt11align_val_tRKSt9nothrow_t",
        "operator delete[](void*, std::align_val_t, std::nothrow_t const&)",
    ),
];

/// The allocator functions memleak probes, named as a C library exports
/// them (an allocator built with a symbol prefix adds its own), then C++'s
/// operators.
///
/// The operators are probed where the program's calls to them land, and
/// only where that adds something (see memleak's `attach::operators`): an
/// allocator's own `operator new` (tcmalloc's, jemalloc's, mimalloc's) does
/// not call its `malloc`, so without it a C++ program's allocations go
/// unseen while their frees are counted. The C++ runtime's own operators
/// (libstdc++'s, libc++'s) only call `malloc` and `free` and are not
/// probed.
///
/// CPython's `PyObject_Malloc` & co. and `PyMem_Malloc` & co. come last:
/// they have the C functions' arguments and meaning, and are probed only
/// in the interpreter's object, only with --python-allocator.
pub const ALLOCATOR_FUNCTIONS: [AllocatorFunction; 26] = [
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
    // C++: every form of each operator, one entry for all of them.
    AllocatorFunction {
        forms: &OPERATOR_NEW_FORMS,
        ..AllocatorFunction::allocates(OPERATOR_NEW, programs::MALLOC_ENTER)
    },
    AllocatorFunction { forms: &OPERATOR_DELETE_FORMS, ..AllocatorFunction::releases(OPERATOR_DELETE) },
    AllocatorFunction::python(AllocatorFunction::allocates("PyObject_Malloc", programs::MALLOC_ENTER)),
    AllocatorFunction::python(AllocatorFunction::allocates("PyObject_Calloc", programs::CALLOC_ENTER)),
    AllocatorFunction::python(AllocatorFunction::allocates("PyObject_Realloc", programs::REALLOC_ENTER)),
    AllocatorFunction::python(AllocatorFunction::releases(PY_OBJECT_FREE)),
    // The same allocator, for the interpreter's own buffers (a list's items).
    AllocatorFunction::python(AllocatorFunction::allocates("PyMem_Malloc", programs::MALLOC_ENTER)),
    AllocatorFunction::python(AllocatorFunction::allocates("PyMem_Calloc", programs::CALLOC_ENTER)),
    AllocatorFunction::python(AllocatorFunction::allocates("PyMem_Realloc", programs::REALLOC_ENTER)),
    AllocatorFunction::python(AllocatorFunction::releases(PY_MEM_FREE)),
];

/// The name of CPython's `PyObject_Free` entry: it hands blocks over 512
/// bytes on to `free`.
pub const PY_OBJECT_FREE: &str = "PyObject_Free";
/// The name of CPython's `PyMem_Free` entry, which does the same.
pub const PY_MEM_FREE: &str = "PyMem_Free";

/// The name of C++'s `operator new` entry in [`ALLOCATOR_FUNCTIONS`]:
/// `new` and `new[]` in every form.
pub const OPERATOR_NEW: &str = "operator new";
/// The name of C++'s `operator delete` entry: `delete` and `delete[]` in
/// every form.
pub const OPERATOR_DELETE: &str = "operator delete";

/// A bit of a probe's attach cookie, above its [`FunctionSet`]: the probe
/// is past the function's system call, whose result is in rax (memleak's
/// `attach::placement` says when).
pub const PROBED_AFTER_SYSTEM_CALL: u64 = 1 << 32;

/// A set of [`ALLOCATOR_FUNCTIONS`], bit i standing for function i. It is
/// the low half of a probe's attach cookie: one program serves several functions and
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

    /// The set of the function named `name`, for a constant: `name` must be
    /// in the table.
    const fn of_name(name: &str) -> Self {
        let mut index = 0;
        while index < ALLOCATOR_FUNCTIONS.len() {
            if const_eq(ALLOCATOR_FUNCTIONS[index].name, name) {
                return Self::of(index);
            }
            index += 1;
        }
        panic!("not in ALLOCATOR_FUNCTIONS")
    }

    /// C++'s `operator delete`, alone: a probe with this cookie is on a
    /// form that is not also another release function (as tcmalloc's
    /// `operator delete(void*)` is its `free`), so it may call one.
    pub const OPERATOR_DELETE: Self = Self::of_name(OPERATOR_DELETE);

    /// CPython's `PyObject_Free`, which calls `free` for the blocks it did
    /// not serve from its arenas.
    pub const PY_OBJECT_FREE: Self = Self::of_name(PY_OBJECT_FREE);

    /// CPython's `PyMem_Free`, likewise.
    pub const PY_MEM_FREE: Self = Self::of_name(PY_MEM_FREE);

    /// Whether a probe with this cookie is on a release function that may
    /// call another one with the same block (`operator delete` and
    /// `PyObject_Free` and `PyMem_Free` call `free`): that inner release
    /// is not the program's, and is not counted again.
    pub const fn releases_through_another(self) -> bool {
        self.0 == Self::OPERATOR_DELETE.0 || self.0 == Self::PY_OBJECT_FREE.0 || self.0 == Self::PY_MEM_FREE.0
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
    /// The kernel function whose fentry program sees its calls (see
    /// `programs::MAPPING_SYSTEM_CALLS`), where it is attached: its
    /// uprobe is then left out.
    pub seen_in_kernel: Option<&'static str>,
}

/// The mapping functions memleak probes (mmap64 is mmap on 64-bit
/// systems; where it is a symbol of its own, it is probed once).
pub const MAPPING_FUNCTIONS: [MappingFunction; 5] = [
    MappingFunction {
        name: "mmap",
        entry_program: programs::MMAP_ENTER,
        return_program: Some(programs::MAPPING_RETURN),
        seen_in_kernel: None,
    },
    MappingFunction {
        name: "mmap64",
        entry_program: programs::MMAP_ENTER,
        return_program: Some(programs::MAPPING_RETURN),
        seen_in_kernel: None,
    },
    MappingFunction {
        name: "munmap",
        entry_program: programs::MUNMAP_ENTER,
        return_program: None,
        seen_in_kernel: Some(programs::SYS_MUNMAP),
    },
    // Turns a PROT_NONE reservation into memory that can be touched, or back.
    MappingFunction {
        name: "mprotect",
        entry_program: programs::MPROTECT_ENTER,
        return_program: None,
        seen_in_kernel: Some(programs::SYS_MPROTECT),
    },
    MappingFunction {
        name: "mremap",
        entry_program: programs::MREMAP_ENTER,
        return_program: Some(programs::MAPPING_RETURN),
        seen_in_kernel: None,
    },
];

/// `a == b`, for constants.
/// Whether two strings are equal, in a constant (`==` on `str` is not
/// const).
pub const fn const_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut index = 0;
    while index < a.len() {
        if a[index] != b[index] {
            return false;
        }
        index += 1;
    }
    true
}

// Cookies are u32 bit sets.
const _: () = assert!(ALLOCATOR_FUNCTIONS.len() <= 32);
