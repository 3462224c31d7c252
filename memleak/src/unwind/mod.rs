//! Unwinding user stacks without frame pointers: user space reduces each
//! mapped object's call frame information to the compact rows of
//! [`memleak_common::unwind`], which the BPF walker follows from frame to
//! frame at the allocation's return probe.
//!
//! `eh_frame`: one object's rows; `tables`: every traced process's
//! tables, each object's rows written once into BPF; `debug_files`: an
//! object's separate debug file, found and checked.

pub mod debug_files;
pub mod eh_frame;
pub mod tables;
