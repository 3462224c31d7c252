//! The entry points: uprobes on the target's allocator and mapping
//! functions, the kernel's allocation tracepoints, and its exec
//! and fork tracepoints, and the OOM killer's pick. Each reads
//! its arguments and hands over to `calls`, `record` and `stack`.

mod alloc;
mod calibration;
mod exec;
mod fork;
mod free;
mod kernel;
mod loader;
pub(crate) mod mmap;
mod oom;
pub(crate) mod recorder;
