//! memleak's BPF object seen from user space: loading and attaching it
//! (`tracer`), reading its maps once per report round (`contents`), its
//! ring buffers (`rings`), and the unwind tables' maps (`unwind_maps`);
//! munmap and mprotect seen from the kernel (`mapping_calls_in_kernel`);
//! what this kernel offers of the features the programs use
//! (`kernel_features`), what all that takes of privileges on this kernel
//! (`privileges`), the
//! multi-uprobe links it attaches through (`multi_uprobes`), and what each
//! sized map asks of the kernel's memory (`map_costs`).

pub mod contents;
pub mod kernel_features;
pub mod map_costs;
pub mod mapping_calls_in_kernel;
pub mod multi_uprobes;
pub mod overhead;
pub mod privileges;
pub mod rings;
pub mod tracer;
pub mod unwind_maps;

pub use contents::{MapContents, MapFill, StackCatalog};
pub use privileges::Traced;
pub use rings::EventRing;
pub use tracer::{Links, Tracer, TracerConfig, TracerError, TracerSettings};
