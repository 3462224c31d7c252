//! The frames a stack's culprit is looked for past: code whose job is to
//! hand out memory for its caller, so that the caller, not it, is what a
//! reader of the report has to open. One table, by language and library;
//! `--skip-frames REGEX` adds to it, `--no-default-skips` empties it.
//!
//! Each pattern is a regular expression (the `regex` crate's syntax)
//! searched in a frame's *qualified name*: its function name without the
//! parameter list and, for a C++ template function, without the return
//! type that demangling puts first (`void std::vector<int>::_M_realloc_insert<int>(...)`
//! is matched as `std::vector<int>::_M_realloc_insert<int>`). Anchor a
//! pattern with `^` and `$` to match a whole name. Frames without a name
//! are never skipped: nothing says what they are.
//!
//! Besides these names, every frame in the allocator's own object (the
//! library memleak probes, when it is not the program itself) is skipped:
//! jemalloc's, tcmalloc's and mimalloc's internals, whatever they are
//! called; and every frame in the C library's shared objects, whatever
//! the allocator (`culprit::is_c_library`). The C library's names below
//! matter where it is linked in statically.
//!
//! To add a wrapper: one line below, in its group, with the functions
//! that do nothing but allocate (or grow, or copy into new memory) for
//! their caller. A function that decides *what* to keep is the caller's
//! business and stays visible.

/// One pattern of the table, and who writes such frames.
#[derive(Clone, Copy, Debug)]
pub struct SkipRule {
    #[allow(dead_code, reason = "read by the test that keeps the book's table in step with this one")]
    pub group: &'static str,
    pub pattern: &'static str,
}

const fn rule(group: &'static str, pattern: &'static str) -> SkipRule {
    SkipRule { group, pattern }
}

/// The built-in table.
pub const DEFAULT_SKIPS: &[SkipRule] = &[
    // The C allocator's entry points, wherever they are (ld.so inlines a
    // calloc of its own), and the C library's functions that allocate for
    // their caller.
    rule(
        "C allocators",
        r"^(malloc|calloc|realloc|reallocarray|free|posix_memalign|aligned_alloc|memalign|valloc|pvalloc|mallocx|rallocx)$",
    ),
    rule(
        "C allocators",
        r"^(__libc_(malloc|calloc|realloc|memalign)|_int_(malloc|realloc|memalign)|tcache_init|sysmalloc|_mid_memalign)$",
    ),
    rule("C allocators", r"^(je_|_rjem_|tc_|mi_|_mi_|tcmalloc::|__tcmalloc)"),
    rule(
        "C library",
        r"^(__GI_)*_*(strdup|strndup|wcsdup|asprintf|vasprintf|__vasprintf_internal|getline|getdelim|realpath|open_memstream|scandir)$",
    ),
    rule("C library", r"^(__GI_)*_IO_"),
    // Locales load their data for the program that asked for one.
    rule("C library", r"^(_nl_|(__GI_)*_*(setlocale|newlocale)$)"),
    // stdio allocates a stream's buffer at its first use, and the FILE at
    // fopen: the culprit is who read, wrote or opened.
    rule(
        "C library",
        r"^(__GI_)*_*(getchar|getc|fgetc|fgets|fread|fscanf|scanf|vfscanf|printf|fprintf|vfprintf|puts|fputs|fputc|putchar|putc|fwrite|fflush|fopen|fopen64|fdopen|freopen|popen|tmpfile|setvbuf|uflow|overflow|underflow|opendir|fdopendir)$",
    ),
    // The dynamic loader's work for dlopen: the culprit is its caller.
    rule("C library", r"^(_dl_|dl_open_worker|__libc_dlopen|_*dlopen|_*dlmopen|_?dlerror_run|_dlerror_run)"),
    // C++: operator new and the standard library's allocators and
    // containers: the culprit is the code that grew the container.
    rule("C++", r"^operator (new|delete)"),
    rule("C++", r"^(std|__gnu_cxx|__cxxabiv1|__gnu_debug)::"),
    rule("C++", r"^__cxa_allocate_"),
    // Rust: the global allocator and the standard library's collections,
    // whatever the allocator behind them (tikv-jemallocator, mimalloc).
    rule("Rust", r"^<?(alloc|core|std|hashbrown)::"),
    rule("Rust", r"^<[^:<>]* as (alloc|core|std)::"),
    rule("Rust", r"^(__rust_(alloc|alloc_zeroed|realloc|dealloc|no_alloc_shim_is_unstable)|__rdl_|__rg_)"),
    rule("Rust", r" as core::alloc::global::GlobalAlloc>::"),
    rule("Rust", r"^<?(tikv_jemallocator|tikv_jemalloc_sys|mimalloc|libmimalloc_sys)::"),
    // Go with cgo: the runtime (its heap, its threads, its switch to the
    // system stack for a C call) and the standard library's internal
    // packages, and the wrappers cgo writes around each C function
    // (`main._Cfunc_CString`, `_cgo_<hash>_Cfunc__Cmalloc`): the culprit
    // is the Go code that called C.
    rule("Go", r"^(runtime|internal/[\w/]+)\."),
    rule("Go", r"(^|\.)_(Cfunc|cgo)_|^x_cgo_"),
    // CPython's memory API and object allocation: the culprit is the
    // interpreter code, or the extension, that made the object.
    rule("CPython", r"^_?(PyMem|PyObject)_(Raw)?(Malloc|Calloc|Realloc)"),
    rule("CPython", r"^_?PyMem_"),
    rule(
        "CPython",
        r"^(_PyObject_GC_(New|NewVar|Malloc|Calloc|Resize|Link|Alloc)|_PyObject_(New|NewVar)|PyObject_GC_(New|NewVar)|PyObject_(New|NewVar|Init|InitVar)|_PyObject_MallocWithType)$",
    ),
    rule(
        "CPython",
        r"^(pymalloc_(alloc|realloc)|PyType_GenericAlloc|_PyType_AllocNoTrack|gc_alloc|_PyObject_GC_Alloc|allocate_from_new_pool|new_arena|_PyObject_Arena(Mmap|Malloc)|arena_map_get|arena_map_mark_used)$",
    ),
    // JIT runtimes: what their compiled code calls to allocate. With the
    // runtime's perf map, the culprit is the JIT-compiled function (`JS:`
    // and `LazyCompile:` frames of node, Java methods).
    rule(
        "V8 and node",
        r"^(v8::internal::|v8::ArrayBuffer::|v8::(Array)?BufferAllocator|node::NodeArrayBufferAllocator::|node::ArrayBufferAllocator::|node::Buffer::|node::[A-Za-z]*Allocator::)",
    ),
    // Code V8 generates for itself: its builtins, as the binary's symbols
    // (`Builtins_CEntry_...`) or node's perf map (`Builtin:...`) name them.
    rule("V8 and node", r"^(Builtins_|construct_stub_|(Builtin|BytecodeHandler|Stub|Handler|RegExp):)"),
    // node's own JavaScript (`JS:^alloc node:buffer:391:30`): the
    // culprit is the program's.
    rule("V8 and node", r"^(JS|LazyCompile|Function):[~^*]?\S* node:"),
    rule(
        "HotSpot",
        r"^(os::(malloc|realloc|reserve_memory|commit_memory)|AllocateHeap|ReallocateHeap|CHeapObj<.*>::operator new|Arena::|ChunkPool::|Chunk::operator new)",
    ),
    // Well-known allocation wrappers of C programs and libraries.
    rule("redis", r"^_?z(try)?(malloc|calloc|realloc)(_usable|_no_tcache|_num|_usable_num)?$"),
    rule("redis", r"^(zstrdup|zfree|zfree_usable|extend_to_usable)$"),
    rule(
        "redis",
        r"^_?(sdsnewlen|sdsnew|sdsempty|sdsdup|sdsMakeRoomFor(NonGreedy)?|sdscatlen|sdscpylen|sdsgrowzero|sdsRemoveFreeSpace|sdsResize|_sdsMakeRoomFor|_sdsnewlen|sdstrynewlen)$",
    ),
    rule("GLib", r"^g_(try_)?(malloc|malloc0|realloc|malloc_n|malloc0_n|realloc_n)$"),
    rule(
        "GLib",
        r"^g_(slice_(alloc|alloc0|copy)|strdup|strndup|memdup|memdup2|strdup_printf|strdup_vprintf|strconcat|string_sized_new|array_(append|insert|prepend)_vals|ptr_array_add|byte_array_append)$",
    ),
    rule(
        "GNU xmalloc",
        r"^x(malloc|calloc|realloc|zalloc|strdup|strndup|memdup|nmalloc|nrealloc|2nrealloc|charalloc|mallocz|asprintf|vasprintf|reallocarray)$",
    ),
    rule(
        "SQLite",
        r"^sqlite3(_malloc|_malloc64|_realloc|_realloc64|Malloc|MallocZero|Realloc|DbMallocRaw|DbMallocRawNN|DbMallocZero|DbRealloc|DbReallocOrFree|DbStrDup|DbStrNDup|MemMalloc|MemRealloc|MallocSize)$",
    ),
    rule("SQLite", r"^(dbMallocRawFinish|dbReallocFinish|mallocWithAlarm|sqlite3MallocAlarm)$"),
    rule(
        "nginx",
        r"^ngx_(alloc|calloc|memalign|palloc|pnalloc|pcalloc|pmemalign|palloc_small|palloc_block|palloc_large|create_pool|array_push|array_push_n|array_create|list_push|list_create|pstrdup|create_temp_buf|alloc_chain_link|chain_get_free_buf)$",
    ),
    rule(
        "PostgreSQL",
        r"^(palloc|palloc0|palloc_extended|palloc_aligned|repalloc|repalloc0|repalloc_huge|repalloc_extended|pstrdup|pnstrdup|psprintf|pvsnprintf)$",
    ),
    rule(
        "PostgreSQL",
        r"^(MemoryContextAlloc|MemoryContextAllocZero|MemoryContextAllocZeroAligned|MemoryContextAllocExtended|MemoryContextAllocHuge|MemoryContextAllocAligned|MemoryContextStrdup|MemoryContextCreate)$",
    ),
    rule(
        "PostgreSQL",
        r"^(AllocSet|Generation|Slab|Bump)(Alloc|AllocLarge|AllocFromNewBlock|AllocChunkFromBlock|Realloc|ContextCreateInternal)$",
    ),
    rule(
        "OpenSSL",
        r"^CRYPTO_(malloc|zalloc|realloc|clear_realloc|strdup|strndup|memdup|secure_malloc|secure_zalloc)$",
    ),
    rule("Lua", r"^(l_alloc|luaM_malloc_|luaM_realloc_|luaM_growaux_|luaM_shrinkvector_|luaM_saferealloc_)$"),
    rule("libuv", r"^uv__(malloc|calloc|realloc|reallocf|strdup|strndup)$"),
    rule(
        "libxml2",
        r"^xml(Malloc|MallocAtomic|Realloc|Strdup|Strndup|MemMalloc|MemRealloc|MemStrdup|MallocLoc|ReallocLoc)$",
    ),
];

/// Source files whose frames are plumbing whatever their names: with
/// line tables, a Rust build's inlined frames are named as written in
/// the source (`alloc`, `grow_one`, `{closure#0}`), not by their path.
pub const DEFAULT_SKIPPED_FILES: &[SkipRule] = &[
    // The standard library, from rustc's remapped paths
    // (`/rustc/HASH/library/alloc/src/raw_vec.rs`) or rust-src's.
    rule("Rust", r"/library/(alloc|core|std|panic_unwind|panic_abort)/src/"),
    // The allocator and collection crates, as cargo unpacks them.
    rule(
        "Rust",
        r"/(hashbrown|tikv-jemallocator|tikv-jemalloc-sys|jemallocator|mimalloc|libmimalloc-sys|snmalloc-rs|smallvec|bytes)-[0-9][^/]*/src/",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_book_lists_every_group_of_the_table() {
        let chapter = include_str!("../../../docs/src/stacks.md");
        for rule in DEFAULT_SKIPS {
            assert!(
                chapter.contains(&format!("\n| {} | ", rule.group)),
                "the table of skipped frames in docs/src/stacks.md lacks {}",
                rule.group
            );
        }
    }

    #[test]
    fn every_pattern_compiles() {
        for rule in DEFAULT_SKIPS.iter().chain(DEFAULT_SKIPPED_FILES) {
            assert!(regex::Regex::new(rule.pattern).is_ok(), "{}: {}", rule.group, rule.pattern);
        }
    }
}
