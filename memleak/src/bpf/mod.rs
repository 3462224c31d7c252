//! memleak's BPF object seen from user space: loading and attaching it
//! (`tracer`), reading its maps once per report round (`contents`), and
//! its ring buffers (`rings`).

pub mod contents;
pub mod rings;
pub mod tracer;

pub use contents::{MapContents, StackCatalog};
pub use rings::EventRing;
pub use tracer::{Links, Tracer, TracerConfig, TracerError, TracerSettings};
