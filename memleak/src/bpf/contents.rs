//! What the BPF maps hold, read once per report round for every process
//! reported on, and the stacks read from the stack map so far.

use std::collections::HashMap;

use memleak_common::{lost_stack_owner, Allocation, AllocationKey, StackTotals};

use super::{Tracer, TracerError};
use crate::{clock, model::HealthCounters};

/// The maps at one moment.
pub struct MapContents {
    pub time_unix_ms: u64,
    /// `CLOCK_MONOTONIC`, the clock of the BPF timestamps.
    pub now_ns: u64,
    /// Each process's health counters, by process id.
    counters: HashMap<u32, HealthCounters>,
    pub totals: Vec<(u64, StackTotals)>,
    /// Each allocation, read only when its age or address is wanted: the
    /// totals are one map entry per stack.
    pub allocations: Option<Vec<(AllocationKey, Allocation)>>,
}

impl MapContents {
    pub fn read(tracer: &Tracer, each_allocation: bool) -> Result<Self, TracerError> {
        let totals = tracer.stack_totals()?;
        Ok(Self {
            time_unix_ms: clock::wall_ms(),
            now_ns: clock::monotonic_ns(),
            counters: tracer.counters()?,
            allocations: if each_allocation { Some(tracer.allocations()?) } else { None },
            totals,
        })
    }

    /// The health counters of process `pid` (all zero before it counted
    /// anything).
    pub fn counters_of(&self, pid: u32) -> HealthCounters {
        self.counters.get(&pid).copied().unwrap_or_default()
    }

    /// Allocations recorded and not freed, of every process: each is one
    /// entry of the allocation map, and is counted in its stack's totals.
    pub fn recorded_allocations(&self) -> u64 {
        // Each total wraps (a free adds minus one); their sum does not.
        let sum = self.totals.iter().fold(0u64, |sum, (_, totals)| sum.wrapping_add(totals.allocations));
        u64::try_from(sum.cast_signed()).unwrap_or(0)
    }

    /// Every stack id the contents mention.
    pub fn stack_ids(&self) -> impl Iterator<Item = u64> + '_ {
        let allocations = self.allocations.iter().flatten().map(|(_, allocation)| allocation.stack_id);
        self.totals.iter().map(|(id, _)| *id).chain(allocations)
    }
}

/// How full the maps that bound what memleak records are, at one
/// moment. Past `max_allocations`, allocations go untracked; past
/// `max_stacks`, stacks are lost (both counted in `HealthCounters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapFill {
    /// Entries of the allocation map: allocations recorded, not freed.
    pub allocations: u64,
    /// Its capacity, --max-allocs.
    pub max_allocations: u64,
    /// Entries of the stack map, as last read: stacks of every process,
    /// those that hold nothing now included.
    pub stacks: u64,
    /// Its capacity, --max-stacks.
    pub max_stacks: u64,
}

/// The stacks read from the BPF stack map so far, by id. The map is read
/// again only when a report meets an id not seen yet, and then only the
/// stacks not known yet.
#[derive(Default)]
pub struct StackCatalog {
    stacks: HashMap<u64, StoredStack>,
}

/// A stack as the catalog keeps it: its frames only, not the map's room
/// for `MAX_STACK_DEPTH` of them.
struct StoredStack {
    tgid: u32,
    /// How the walk ended, a `WalkEnd` as u32.
    end: u32,
    addresses: Box<[u64]>,
    /// The Python frames' words (`memleak_common::python::py_frame_word`),
    /// innermost first, then as many checks of their code objects.
    python: Box<[u64]>,
}

impl StackCatalog {
    /// Makes sure every stack of `stack_ids` is known, if it is stored.
    pub fn ensure(
        &mut self,
        tracer: &Tracer,
        stack_ids: impl IntoIterator<Item = u64>,
    ) -> Result<(), TracerError> {
        let mut ids = stack_ids.into_iter().filter(|id| lost_stack_owner(*id).is_none());
        if ids.any(|id| !self.stacks.contains_key(&id)) {
            let mut new = Vec::new();
            tracer.stacks(
                |id, key| {
                    let addresses = key.addresses().into();
                    let python = [key.python_words(), key.python_checks()].concat().into();
                    new.push((id, StoredStack { tgid: key.tgid, end: key.end, addresses, python }));
                },
                |id| self.stacks.contains_key(&id),
            )?;
            self.stacks.extend(new);
        }
        Ok(())
    }

    /// The Python frames' words of a stack, innermost first; none if
    /// unknown or walked without them.
    pub fn python_words(&self, stack_id: u64) -> &[u64] {
        self.python(stack_id).0
    }

    /// The checks of a stack's Python frames' code objects, one per word
    /// (`memleak_common::python::py_code_check`); 0 for unchecked.
    pub fn python_checks(&self, stack_id: u64) -> &[u64] {
        self.python(stack_id).1
    }

    fn python(&self, stack_id: u64) -> (&[u64], &[u64]) {
        self.stacks.get(&stack_id).map_or((&[], &[]), |stack| stack.python.split_at(stack.python.len() / 2))
    }

    /// Stacks known: the stack map's entries when it was last read, which
    /// it is whenever a report meets a stack not known yet.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// The process a stack id belongs to.
    pub fn owner(&self, stack_id: u64) -> Option<u32> {
        lost_stack_owner(stack_id).or_else(|| self.stacks.get(&stack_id).map(|key| key.tgid))
    }

    /// The return addresses of a stack, innermost first; none if unknown.
    pub fn addresses(&self, stack_id: u64) -> &[u64] {
        self.stacks.get(&stack_id).map_or(&[], |stack| &stack.addresses)
    }

    /// How the walk of a stored stack ended, a `WalkEnd` as u32.
    pub fn walk_end(&self, stack_id: u64) -> Option<u32> {
        self.stacks.get(&stack_id).map(|stack| stack.end)
    }

    /// Drops the stacks of process `tgid`.
    pub fn forget(&mut self, tgid: u32) {
        self.stacks.retain(|_, stack| stack.tgid != tgid);
    }
}
