//! The entry points: uprobes on the target's allocator and mapping
//! functions, and the kernel's allocation tracepoints. Each reads its
//! arguments and hands over to `calls`, `record` and `stack`.

mod alloc;
mod free;
mod kernel;
mod mmap;
