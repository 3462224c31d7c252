//! A stack's culprit: its first frame of the program's own code, past the
//! allocation wrappers and the language runtime's allocation plumbing
//! that `skip_frames` lists. It is what a report names a stack by (the
//! text report's first line under it, `culprit` in JSON, the `frame`
//! label of `/metrics`): `make_session(int)`, not `operator new`;
//! `setKey`, not redis's `zmalloc`.
//!
//! In a stack that holds Python frames, the program's own code is Python:
//! the culprit is its first Python frame not passed over, never the
//! interpreter's C code between it and the allocator.

use std::sync::Arc;

use regex::RegexSet;

use super::skip_frames::{DEFAULT_SKIPPED_FILES, DEFAULT_SKIPS};
use crate::{model::Frame, symbolize::WordMap};

/// What a culprit is looked for past: the built-in table and the user's
/// patterns, compiled once.
#[derive(Clone, Debug)]
pub struct SkipRules {
    /// Searched in each frame's qualified name; `None` when there are none.
    names: Option<RegexSet>,
    /// Searched in each frame's source file (the built-in table's); `None`
    /// without it.
    files: Option<RegexSet>,
    /// Whether frames in the allocator's own object and in the C
    /// library's are passed over (with the built-in table).
    library_internals: bool,
}

impl Default for SkipRules {
    /// The built-in table alone.
    fn default() -> Self {
        Self::new(true, &[]).expect("the built-in patterns compile")
    }
}

impl SkipRules {
    /// The built-in table (unless `defaults` is false) and `extra`, the
    /// patterns of `--skip-frames`.
    pub fn new(defaults: bool, extra: &[String]) -> Result<Self, regex::Error> {
        let built_in = DEFAULT_SKIPS.iter().filter(|_| defaults).map(|rule| rule.pattern);
        let patterns: Vec<&str> = built_in.chain(extra.iter().map(String::as_str)).collect();
        let names = if patterns.is_empty() { None } else { Some(RegexSet::new(patterns)?) };
        let files = if defaults {
            Some(RegexSet::new(DEFAULT_SKIPPED_FILES.iter().map(|rule| rule.pattern))?)
        } else {
            None
        };
        Ok(Self { names, files, library_internals: defaults })
    }

    /// The culprit of a stack whose frames are `frames` (innermost first),
    /// in a report of `program` allocating through `allocator`: the first
    /// frame not passed over. `None` when every frame is, as in an
    /// allocation the C++ runtime makes for itself.
    #[cfg(test)]
    pub fn culprit<'f>(
        &self,
        frames: &'f [Arc<Frame>],
        allocator: &str,
        program: &str,
    ) -> Option<&'f Arc<Frame>> {
        self.culprits(allocator, program).named(frames).0
    }

    /// `culprit` for many stacks of one report: each frame is looked at
    /// once, as stacks through the same code share their frames.
    pub fn culprits<'r>(&'r self, allocator: &'r str, program: &'r str) -> Culprits<'r> {
        Culprits { rules: self, allocator, program, passed_over: WordMap::default() }
    }

    fn passes_over(&self, frame: &Frame, allocator: &str, program: &str) -> bool {
        // A program that links its allocator in (a Rust binary with
        // tikv-jemallocator) is the allocator's object: its own frames
        // are not the allocator's internals.
        if self.library_internals {
            if let Some(module) = frame.module.as_deref().filter(|module| *module != program) {
                if module == allocator || is_c_library(module) {
                    return true;
                }
            }
        }
        // An inlined frame of Rust's standard library has a short name
        // (`alloc`, `grow_one`) but the library's file.
        if let (Some(files), Some(file)) = (&self.files, frame.file.as_deref()) {
            if files.is_match(file) {
                return true;
            }
        }
        let (Some(names), Some(function)) = (&self.names, frame.function.as_deref()) else { return false };
        names.is_match(qualified_name(function))
    }
}

/// The culprits of the stacks of one report (`SkipRules::culprits`).
pub struct Culprits<'r> {
    rules: &'r SkipRules,
    allocator: &'r str,
    program: &'r str,
    /// Whether each frame met is passed over.
    passed_over: WordMap<*const Frame, bool>,
}

impl Culprits<'_> {
    /// A stack's culprit and which of its frames are plumbing, worked out
    /// together: what a report keeps of each stack it shows.
    pub fn named<'f>(&mut self, frames: &'f [Arc<Frame>]) -> (Option<&'f Arc<Frame>>, Vec<bool>) {
        let python_only = holds_python(frames);
        let plumbing = self.plumbing(frames);
        let culprit = frames
            .iter()
            .zip(&plumbing)
            .find(|(frame, plumbing)| (frame.is_python() || !python_only) && !**plumbing)
            .map(|(frame, _)| frame);
        (culprit, plumbing)
    }

    /// Whether each of `frames` is allocation plumbing: passed over by the
    /// rules, or a frame without a name between two that are, in their
    /// object (nginx's `ngx_palloc_small`, a static function of a
    /// stripped build, between `ngx_memalign` and `ngx_pcalloc`).
    pub fn plumbing(&mut self, frames: &[Arc<Frame>]) -> Vec<bool> {
        let Self { rules, allocator, program, passed_over } = self;
        let mut plumbing: Vec<bool> = frames
            .iter()
            .map(|frame| {
                *passed_over
                    .entry(Arc::as_ptr(frame))
                    .or_insert_with(|| rules.passes_over(frame, allocator, program))
            })
            .collect();
        for i in 1..frames.len().saturating_sub(1) {
            let (inner, frame, outer) = (&frames[i - 1], &frames[i], &frames[i + 1]);
            if frame.function.is_none()
                && !frame.is_python()
                && plumbing[i - 1]
                && plumbing[i + 1]
                && frame.module.is_some()
                && frame.module == inner.module
                && frame.module == outer.module
            {
                plumbing[i] = true;
            }
        }
        plumbing
    }
}

/// Whether `module` is one of the C library's own objects: glibc's libc
/// and dynamic loader, the parts split from libc before glibc 2.34
/// (libpthread, libdl, librt), its resolver and NSS modules, or musl's
/// libc. None of them holds a reader's code: what they allocate, they
/// allocate for their caller (`opendir`'s buffer, `getaddrinfo`'s and
/// `iconv_open`'s tables, a new thread's thread-local storage, `dlopen`'s
/// link map), under whichever allocator the program uses. A program
/// that links its C library in statically is the program, and goes by
/// the table's names.
fn is_c_library(module: &str) -> bool {
    let file = module.rsplit('/').next().unwrap_or(module);
    if !file.contains(".so") {
        return false;
    }
    // libc.so.6, libc-2.31.so, libc.musl-x86_64.so.1, ld-linux-x86-64.so.2,
    // ld-musl-x86_64.so.1, libnss_files.so.2: the name before its first
    // dot or dash.
    let stem = file.split(['.', '-']).next().unwrap_or(file);
    matches!(stem, "libc" | "ld" | "libpthread" | "libdl" | "librt" | "libresolv" | "libanl")
        || stem.starts_with("libnss_")
}

fn holds_python(frames: &[Arc<Frame>]) -> bool {
    frames.iter().any(|frame| frame.is_python())
}

/// A function's name without its parameter list, and for a C++ template
/// function, without the return type demangling writes first:
/// `void std::vector<int>::_M_realloc_insert<int const&>(iterator, int const&)`
/// is `std::vector<int>::_M_realloc_insert<int const&>`. Names of C
/// functions and Rust's come back as they are.
pub fn qualified_name(name: &str) -> &str {
    let end = parameter_list_start(name).unwrap_or(name.len());
    let name = name[..end].trim_end();
    // Only a function template's name carries a return type, and only it
    // ends in template arguments.
    if !name.ends_with('>') {
        return name;
    }
    let mut depth = 0i32;
    let mut start = 0;
    for (index, c) in name.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            ' ' if depth == 0 => start = index + 1,
            _ => {}
        }
    }
    &name[start..]
}

/// Where the parameter list opens: the first `(` outside template
/// arguments that is not part of a name, as `(anonymous namespace)` and
/// `operator()` are.
fn parameter_list_start(name: &str) -> Option<usize> {
    const ANONYMOUS: &str = "(anonymous namespace)";
    let mut depth = 0i32;
    let mut index = 0;
    while let Some(c) = name[index..].chars().next() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            '(' if depth == 0 && name[index..].starts_with(ANONYMOUS) => {
                index += ANONYMOUS.len();
                continue;
            }
            '(' if depth == 0 && name[..index].ends_with("operator") && name[index..].starts_with("()") => {
                index += 2;
                continue;
            }
            '(' if depth == 0 => return Some(index),
            _ => {}
        }
        index += c.len_utf8();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(function: &str, module: &str) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(function.to_owned()),
            module: Some(module.to_owned()),
            ..Frame::default()
        })
    }

    fn culprit_of(rules: &SkipRules, functions: &[(&str, &str)]) -> Option<String> {
        let frames: Vec<Arc<Frame>> =
            functions.iter().map(|(function, module)| named(function, module)).collect();
        rules
            .culprit(&frames, "/usr/lib/libtcmalloc.so.4", "/srv/app")
            .and_then(|frame| frame.function.clone())
    }

    #[test]
    fn names_lose_their_parameters_and_template_return_types() {
        let cases = [
            ("make_session(int)", "make_session"),
            ("Session::Session(int)", "Session::Session"),
            (
                "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int const&)",
                "std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>",
            ),
            ("std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_create(unsigned long&, unsigned long)", "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_create"),
            ("operator new(unsigned long)", "operator new"),
            ("(anonymous namespace)::pool::allocate(unsigned long)", "(anonymous namespace)::pool::allocate"),
            ("Functor::operator()(int) const", "Functor::operator()"),
            ("alloc::raw_vec::RawVec<T,A>::grow_one", "alloc::raw_vec::RawVec<T,A>::grow_one"),
            ("zmalloc", "zmalloc"),
        ];
        for (name, qualified) in cases {
            assert_eq!(qualified_name(name), qualified, "{name}");
        }
    }

    /// A frame of a Rust build with line tables: inlined, named as in the
    /// source, in `file`.
    fn inlined(function: &str, file: &str) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(function.to_owned()),
            file: Some(file.to_owned()),
            line: Some(1),
            inlined: true,
            module: Some("/srv/app".to_owned()),
            ..Frame::default()
        })
    }

    #[test]
    fn inlined_frames_of_the_rust_library_are_plumbing_whatever_their_names() {
        let library = "/rustc/59807616e1fa2540724bfbac14d7976d7e4a3860/library";
        let registry = "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f";
        let frames = [
            inlined("alloc", &format!("{registry}/tikv-jemallocator-0.6.1/src/lib.rs")),
            named("__rust_alloc", "/srv/app"),
            inlined("alloc", &format!("{library}/alloc/src/alloc.rs")),
            inlined("grow_one<u8>", &format!("{library}/alloc/src/raw_vec/mod.rs")),
            inlined("{closure#0}", &format!("{library}/core/src/ops/function.rs")),
            inlined("insert<u64, u8>", &format!("{registry}/hashbrown-0.15.2/src/map.rs")),
            inlined("record_audit_event", "/srv/src/audit.rs"),
        ];
        let rules = SkipRules::default();
        let culprit = rules.culprit(&frames, "/srv/app", "/srv/app");
        assert_eq!(culprit.and_then(|frame| frame.function.as_deref()), Some("record_audit_event"));
        let plumbing = rules.culprits("/srv/app", "/srv/app").plumbing(&frames);
        assert_eq!(plumbing, [true, true, true, true, true, true, false]);
    }

    #[test]
    fn an_unnamed_frame_between_plumbing_of_its_object_is_plumbing() {
        let nginx = "/usr/sbin/nginx";
        let unnamed =
            |address| Arc::new(Frame { address, module: Some(nginx.to_owned()), ..Frame::default() });
        let frames = [
            named("ngx_memalign", nginx),
            unnamed(0x277b2),
            named("ngx_pcalloc", nginx),
            unnamed(0x4000),
            named("ngx_http_init", nginx),
        ];
        let rules = SkipRules::default();
        let culprit = rules.culprit(&frames, "/usr/lib/x86_64-linux-gnu/libc.so.6", nginx);
        // The second unnamed frame is not between two plumbing frames: it
        // may be the program's own code, and is the culprit.
        assert_eq!(culprit.map(|frame| frame.address), Some(0x4000));
    }

    #[test]
    fn the_culprit_is_past_the_plumbing_of_each_language() {
        let rules = SkipRules::default();
        let app = "/srv/app";
        let cases: [&[(&str, &str)]; 6] = [
            &[("operator new(unsigned long)", "/usr/lib/libstdc++.so.6"), ("Session::Session(int)", app)],
            &[
                ("std::__new_allocator<char>::allocate(unsigned long, void const*)", app),
                ("std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_create(unsigned long&, unsigned long)", app),
                ("void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(int const&)", app),
                ("Session::Session(int)", app),
            ],
            &[
                ("alloc::alloc::alloc", app),
                ("<tikv_jemallocator::Jemalloc as core::alloc::global::GlobalAlloc>::alloc", app),
                ("alloc::raw_vec::RawVec<T,A>::grow_one", app),
                ("<[T] as alloc::slice::hack::ConvertVec>::to_vec", app),
                ("Session::Session(int)", app),
            ],
            &[("zmalloc_usable", "/usr/bin/redis-server"), ("_sdsnewlen", "/usr/bin/redis-server"), ("Session::Session(int)", app)],
            &[("tcmalloc::ThreadCache::FetchFromCentralCache", "/usr/lib/libtcmalloc.so.4"), ("internal_only", "/usr/lib/libtcmalloc.so.4"), ("Session::Session(int)", app)],
            &[
                ("_cgo_598f940fc3ef_Cfunc__Cmalloc", app),
                ("runtime.asmcgocall", app),
                ("main._cgo_cmalloc", app),
                ("main._Cfunc_CString", app),
                ("Session::Session(int)", app),
            ],
        ];
        for frames in cases {
            assert_eq!(culprit_of(&rules, frames).as_deref(), Some("Session::Session(int)"), "{frames:?}");
        }
        assert_eq!(
            culprit_of(
                &rules,
                &[
                    ("_PyMem_RawMalloc", "/usr/bin/python3"),
                    ("PyObject_Malloc", "/usr/bin/python3"),
                    ("bytearray___init__", "/usr/bin/python3")
                ]
            )
            .as_deref(),
            Some("bytearray___init__")
        );
        assert_eq!(
            culprit_of(&rules, &[("operator new(unsigned long)", "/usr/lib/libstdc++.so.6")]),
            None,
            "nothing of the program's own"
        );
    }

    #[test]
    fn a_user_function_taking_standard_types_is_not_plumbing() {
        let rules = SkipRules::default();
        let frames = [("my_cache_put(std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > const&)", "/srv/app")];
        assert!(culprit_of(&rules, &frames).is_some_and(|name| name.starts_with("my_cache_put")));
        let frames = [("<myapp::Cache as core::default::Default>::default", "/srv/app")];
        assert!(
            culprit_of(&rules, &frames).is_some(),
            "a user type's impl of a std trait is the user's code"
        );
    }

    #[test]
    fn skip_frames_adds_and_no_default_skips_empties() {
        let frames = [
            ("operator new(unsigned long)", "/usr/lib/libstdc++.so.6"),
            ("pool_grow", "/srv/app"),
            ("handle", "/srv/app"),
        ];
        let extra = SkipRules::new(true, &["^pool_".to_owned()]).unwrap();
        assert_eq!(culprit_of(&extra, &frames).as_deref(), Some("handle"));
        let none = SkipRules::new(false, &[]).unwrap();
        assert_eq!(culprit_of(&none, &frames).as_deref(), Some("operator new(unsigned long)"));
        let only_user = SkipRules::new(false, &["^operator new".to_owned()]).unwrap();
        assert_eq!(culprit_of(&only_user, &frames).as_deref(), Some("pool_grow"));
        assert!(SkipRules::new(true, &["(".to_owned()]).is_err());
    }

    #[test]
    fn the_allocator_linked_into_the_program_is_not_skipped_whole() {
        let rules = SkipRules::default();
        let frames = [named("_rjem_malloc", "/srv/app"), named("handle", "/srv/app")];
        let culprit = rules.culprit(&frames, "/srv/app", "/srv/app").and_then(|frame| frame.function.clone());
        assert_eq!(culprit.as_deref(), Some("handle"));
    }

    #[test]
    fn the_c_library_allocates_for_its_caller_under_any_allocator() {
        let rules = SkipRules::default();
        let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
        let loader = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2";
        let directory = [("__alloc_dir", libc), ("opendir_tail", libc), ("open_directories", "/srv/app")];
        assert_eq!(culprit_of(&rules, &directory).as_deref(), Some("open_directories"));
        let thread = [
            ("allocate_dtv", loader),
            ("__GI__dl_allocate_tls", loader),
            ("__pthread_create_2_1", libc),
            ("start_threads", "/srv/app"),
        ];
        assert_eq!(culprit_of(&rules, &thread).as_deref(), Some("start_threads"));
        let none = SkipRules::new(false, &[]).unwrap();
        assert_eq!(culprit_of(&none, &thread).as_deref(), Some("allocate_dtv"), "--no-default-skips");
        // Linked in statically, the C library is the program's own object.
        let frames = [named("__alloc_dir", "/srv/static-app"), named("open_directories", "/srv/static-app")];
        let culprit = rules.culprit(&frames, "/srv/static-app", "/srv/static-app");
        assert_eq!(culprit.and_then(|frame| frame.function.as_deref()), Some("__alloc_dir"));
    }

    #[test]
    fn the_c_librarys_objects_are_known_by_their_file_names() {
        let c_library = [
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/ld-linux-x86-64.so.2",
            "/lib/x86_64-linux-gnu/libc-2.31.so",
            "/lib/x86_64-linux-gnu/libpthread.so.0",
            "/lib/ld-musl-x86_64.so.1",
            "/usr/lib/libc.musl-x86_64.so.1",
            "/lib/x86_64-linux-gnu/libnss_files.so.2",
            "libresolv.so.2",
        ];
        for module in c_library {
            assert!(is_c_library(module), "{module}");
        }
        let others = [
            "/usr/lib/x86_64-linux-gnu/libc++.so.1",
            "/usr/lib/x86_64-linux-gnu/libcrypto.so.3",
            "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
            "/usr/bin/ld",
            "/srv/libc",
        ];
        for module in others {
            assert!(!is_c_library(module), "{module}");
        }
    }

    #[test]
    fn a_frame_without_a_name_is_never_passed_over() {
        let rules = SkipRules::default();
        let unnamed = Arc::new(Frame {
            module: Some("/usr/bin/memcached".to_owned()),
            file_offset: Some(0x1a2b3),
            ..Frame::default()
        });
        let frames = [
            named("malloc", "/usr/lib/libc.so.6"),
            Arc::clone(&unnamed),
            named("main", "/usr/bin/memcached"),
        ];
        assert!(rules
            .culprit(&frames, "/usr/lib/libc.so.6", "/usr/bin/memcached")
            .is_some_and(|frame| Arc::ptr_eq(frame, &unnamed)));
    }
}
