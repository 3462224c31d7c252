//! memleak's BPF programs: uprobes on the target's allocator that keep one
//! map entry per outstanding allocation and one per distinct user stack.
//!
//! The layout of every record and the name of every map and program come
//! from `memleak-common`, the only contract with user space.
//!
//! - `probes`: the entry points, thin, one file per kind of function;
//! - `calls`: allocator calls in flight between entry and return;
//! - `record`: recording and forgetting allocations, with `totals`;
//! - `unwind`: the stack walkers; `python`: the Python frames; `stack`: storing a walked stack once;
//!   `deferred`: handing work that needs the stack to the one program
//!   that walks it;
//!   `scratch`: holding the per-CPU memory they work in; `loops`: loops
//!   on every kernel;
//! - `maps`, `tunables`, `counters`, `events`: state and plumbing.
#![no_std]
#![no_main]
// Inline assembly for the atomic add in totals.rs: core's atomics offer no
// fetch_add on the BPF target. The build already enables unstable features
// (RUSTC_BOOTSTRAP) for -Z build-std, and aya-ebpf uses this one too.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]
#![allow(
    clippy::needless_pass_by_value,
    reason = "aya's program macros hand each program its context by value"
)]
#![allow(
    clippy::cast_possible_truncation,
    reason = "BPF helpers pack two u32s into a u64 (pid_tgid), and depths are bounded by MAX_STACK_DEPTH"
)]

mod calls;
mod checked;
mod counters;
mod deferred;
mod events;
mod holds;
mod loops;
mod maps;
mod probes;
mod process_events;
mod python;
mod record;
mod registers;
mod scratch;
mod stack;
mod totals;
mod tunables;
mod unwind;

// Only for the BPF target: a host build (clippy's) links std's handler.
#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach this.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
