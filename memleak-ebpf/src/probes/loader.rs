//! A process held at its execve whose allocator was not mapped yet (its
//! program's first run under memleak) is let go with this uprobe on its
//! dynamic loader's `_dl_debug_state`, which the loader calls before and
//! after mapping the program's libraries and before running any of their
//! code: it stops the process again there, for user space to plan its
//! probes with its libraries mapped.

use aya_ebpf::{macros::uprobe, programs::ProbeContext};
use memleak_common::MappingChange;

use crate::{calls, holds};

#[uprobe]
pub fn loader_ready(_ctx: ProbeContext) -> u32 {
    holds::send_held(calls::process_id(), MappingChange::LoaderReady);
    0
}
