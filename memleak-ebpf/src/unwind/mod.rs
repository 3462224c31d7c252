//! Stack walkers: each fills a stack's frames, innermost first, and says
//! how many it found. Storing the stack is `stack`'s job, so a walker can
//! be added beside these without touching it.

mod frame_pointer;
mod kernel;

pub use frame_pointer::walk_user_stack;
pub use kernel::kernel_stack;
