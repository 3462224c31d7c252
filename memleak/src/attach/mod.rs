//! The attach plan: from a target to the object that serves its
//! allocations and the file offsets of the functions to probe in it.
//!
//! - `plan`: which object, and the probe sites in it;
//! - `link_order`: the dynamic linker's order, which decides whose malloc
//!   a program calls;
//! - `operators`: C++'s `operator new` and `delete`, where a program's
//!   calls land and which forms need a probe;
//! - `placement`: where on a function its entry probe goes;
//! - `python_allocator`: CPython's `PyObject_Malloc` & co. and its arenas;
//! - `kernel_btf`: what kernel tracing needs to know of the kernel.

pub mod kernel_btf;
pub mod link_order;
pub mod operators;
pub mod placement;
pub mod plan;
pub mod python_allocator;

pub use plan::{AllocatorChoice, AttachPlan, PlanError};
