//! memleak's BPF programs: uprobes on the target's allocator that keep one
//! map entry per outstanding allocation and one per distinct user stack.
//!
//! The layout of every record and the name of every map and program come
//! from `memleak-common`, the only contract with user space.
#![no_std]
#![no_main]
// Inline assembly for the atomic add in totals.rs: core's atomics offer no
// fetch_add on the BPF target. The build already enables unstable features
// (RUSTC_BOOTSTRAP) for -Z build-std, and aya-ebpf uses this one too.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

mod allocation;
mod counters;
mod events;
mod free;
mod kernel;
mod maps;
mod mmap;
mod stack;
mod totals;
mod tunables;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach this.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
