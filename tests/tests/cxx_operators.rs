//! C++ programs on tcmalloc, mimalloc and jemalloc call the allocator's
//! own `operator new` and `delete`, not its `malloc` and `free`: memleak
//! probes them, and counts each allocation and each release once, as it
//! does for a program on glibc, whose C++ runtime calls `malloc`.

use std::{path::Path, process::Command};

use memleak_tests::{frame_functions, stacks_through, Leaker};
use serde_json::Value;

const LIBRARIES: &str = "/usr/lib/x86_64-linux-gnu";

/// How the session service gets its allocator.
#[derive(Clone, Copy, Debug)]
enum Allocator {
    /// glibc's malloc, through libstdc++'s operator new.
    Glibc,
    /// Linked with the library (`g++ sessions.cpp .../libtcmalloc_minimal.so.4`).
    Linked(&'static str),
    /// Run with the library in `LD_PRELOAD`.
    Preloaded(&'static str),
}

const ALLOCATORS: [Allocator; 4] = [
    Allocator::Glibc,
    Allocator::Linked("libtcmalloc_minimal.so.4"),
    Allocator::Linked("libmimalloc.so.2"),
    Allocator::Preloaded("libjemalloc.so.2"),
];

impl Allocator {
    /// The session service (tests/fixtures/sessions.cpp, g++ -O2) with
    /// `args`, on this allocator, held at "ready".
    fn sessions(self, args: &[&str]) -> Command {
        let library = |name: &str| {
            let path = Path::new(LIBRARIES).join(name);
            assert!(path.exists(), "{} is missing: cargo xtask test installs it", path.display());
            path
        };
        let mut command = match self {
            Allocator::Glibc | Allocator::Preloaded(_) => Command::new(memleak_tests::optimized("sessions")),
            Allocator::Linked(name) => {
                Command::new(memleak_tests::optimized_linked("sessions", &library(name)))
            }
        };
        if let Allocator::Preloaded(name) = self {
            command.env("LD_PRELOAD", library(name));
        }
        command.args(args).arg("--wait");
        command
    }

    /// What memleak's final report says of the service run with `args`,
    /// traced with -p from before its first request to after its last.
    fn report(self, args: &[&str]) -> Value {
        let mut target = Leaker::start_command(self.sessions(args));
        let (reports, _) = memleak_tests::trace_running(&mut target, &[]);
        target.exit();
        let report = reports.last().cloned().expect("a final report");
        let expected = match self {
            Allocator::Glibc => "libc.so.6",
            Allocator::Linked(name) | Allocator::Preloaded(name) => name,
        };
        let allocator = report["allocator"].as_str().unwrap();
        assert!(allocator.contains(expected), "{self:?}: the allocator probed is {allocator}");
        report
    }
}

/// (bytes, allocations) of a stack.
fn usage(stack: &Value) -> (u64, u64) {
    (stack["bytes"].as_u64().unwrap(), stack["allocations"].as_u64().unwrap())
}

/// The one stack through `make_session`, where every session is allocated.
fn sessions_stack(allocator: Allocator, report: &Value) -> &Value {
    let stacks = stacks_through(report, "make_session(int)");
    assert_eq!(stacks.len(), 1, "{allocator:?}: one call path, one stack: {report:#}");
    let stack = stacks[0];
    let functions = frame_functions(stack);
    let at = |name| functions.iter().position(|function| *function == name);
    assert!(
        at("make_session(int)") < at("open_session(int)") && at("handle_request(int)").is_some(),
        "{allocator:?}: frames from make_session to handle_request: {functions:?}"
    );
    stack
}

/// (allocations, frees) memleak saw.
fn seen(report: &Value) -> (u64, u64) {
    let health = &report["health"];
    (health["allocations"].as_u64().unwrap(), health["frees"].as_u64().unwrap())
}

#[test]
fn a_cxx_service_leaks_exactly_its_sessions_on_every_allocator() {
    for allocator in ALLOCATORS {
        let report = allocator.report(&["1000"]);
        // 1000 sessions of sizeof(Session) = 64 bytes, never deleted.
        let stack = sessions_stack(allocator, &report);
        assert_eq!(usage(stack), (64_000, 1000), "{allocator:?}: {report:#}");
        // Named by the code that said `new Session`, past the operator.
        assert_eq!(stack["culprit"]["function"], "make_session(int)", "{allocator:?}: {stack:#}");
        assert_eq!(seen(&report), (1000, 0), "{allocator:?}: {report:#}");
        assert_eq!(report["total_bytes"], 64_000, "{allocator:?}: nothing else: {report:#}");
    }
}

#[test]
fn every_form_of_new_and_delete_is_counted_once() {
    for allocator in ALLOCATORS {
        let report = allocator.report(&["1000", "--close-every-other", "--every-form"]);
        // Every other session is deleted (the sized operator delete, from
        // `delete`), and each request allocates and frees 12 blocks through
        // every form of new, new[], delete and delete[].
        assert_eq!(usage(sessions_stack(allocator, &report)), (32_000, 500), "{allocator:?}: {report:#}");
        assert_eq!(seen(&report), (1000 + 12_000, 500 + 12_000), "{allocator:?}: {report:#}");
        assert_eq!(report["total_bytes"], 32_000, "{allocator:?}: every form freed its block: {report:#}");
        assert_eq!(report["health"]["failed_allocations"], 0, "{allocator:?}");
        // No release inside another was taken for a free of a block never
        // seen allocated.
        assert_eq!(report["health"]["unrecorded_frees"], 0, "{allocator:?}: {report:#}");
    }
}

#[test]
fn every_form_of_delete_counts_a_block_from_before_the_attach() {
    for allocator in ALLOCATORS {
        // 12 blocks allocated through every form of new before memleak
        // attached, freed through every form of delete after: each is a
        // free of a block memleak never saw allocated, counted once, from
        // the program's call (not taken for the allocator's own free
        // inside a delete that calls another function to free).
        let report = allocator.report(&["0", "--free-old"]);
        assert_eq!(seen(&report), (0, 12), "{allocator:?}: {report:#}");
        assert_eq!(report["health"]["unrecorded_frees"], 12, "{allocator:?}: {report:#}");
    }
}
