//! Helpers for the end-to-end tests: build the fixtures, run memleak
//! against them, read its reports, and check them with real consumers.
//!
//! - `fixtures`: compiling the C and C++ programs the tests trace;
//! - `memleak`: running memleak and reading its JSON reports;
//! - `leaker`: a leaker process for memleak to attach to;
//! - `http`: GET requests to `memleak serve`;
//! - `prometheus`: a real Prometheus server scraping `memleak serve`;
//! - `redis`: Debian's redis-server, filled with keys;
//! - `rootfs`: root filesystems for container tests;
//! - `podman`: real containers, in podman storage of the test's own;
//! - `consumers`: flame graphs and profiles, read as their users would;
//! - `bpf_maps`: what memleak's BPF maps hold, seen by bpftool;
//! - `cgroups`: cgroup v2 directories of a test's own;
//! - `uprobes`: memleak's uprobe links, and the breakpoints they place.
//! - `tmux`: a terminal for `memleak top`, driven and read.

pub mod bpf_maps;
pub mod cgroups;
pub mod consumers;
pub mod fixtures;
pub mod http;
pub mod leaker;
pub mod memleak;
pub mod podman;
pub mod prometheus;
pub mod redis;
pub mod rootfs;
pub mod tmux;
pub mod uprobes;

pub use consumers::{go_pprof, svg_titles};
pub use fixtures::{
    build_id, fixture, go_program, marker_line, musl_leaker, optimized, optimized_linked, run_ok,
    rust_jemalloc, rust_jemalloc_with_line_tables, shared_library, static_leaker, workspace_root,
};
pub use leaker::{Leaker, ALLOCATION_FUNCTION_LEAKS};
pub use memleak::{
    assert_refused_in_one_line, frame_functions, memleak_binary, run_to_end, stacks_at, stacks_through,
    trace_command, trace_fixture, trace_fixture_output, trace_fixture_output_with_env, trace_program,
    trace_running, usage_at, Lines, Memleak, PATIENCE, PERF_EVENT_UPROBES,
};
pub use rootfs::{leaker_rootfs, rootfs_with, tempdir};
