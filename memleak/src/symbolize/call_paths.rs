//! One call path, one stack: BPF stacks that a reader could not tell
//! apart are reported as one.
//!
//! BPF stores a stack per distinct list of return addresses, and several
//! lists can read the same once symbolized:
//!
//! - a walk that ends in memory that is no code records that last address
//!   (the walk may have met a library loaded since memleak last looked),
//!   and the report drops it once it is known to be no code: a cgo call's
//!   walk ends on the goroutine's stack, at an address that differs from
//!   call to call, and one leak became as many stacks as goroutines;
//! - two calls on one line (`a = malloc(n); b = malloc(n);`, or a loop
//!   the compiler unrolled) return to different addresses of the same
//!   function, file and line.
//!
//! Such stacks form one call path, reported under the BPF id of the first
//! one seen, so that its trend goes on as members join, and shown with the
//! frames of the member whose stable id is the smallest, so that the path's
//! stable id does not depend on which member came first.
//!
//! A stack that stopped short because the code it met was not known yet
//! (a library mapped since the last look) is folded into the one whole
//! call path it begins, when there is exactly one; with several, it is
//! left as a stack of its own, which says it is truncated.

use std::{
    collections::{hash_map::DefaultHasher, HashMap},
    hash::{Hash, Hasher},
    sync::Arc,
};

use memleak_common::lost_stack_owner;

use super::{stable_id::stable_id, WordMap};
use crate::model::{Frame, MappingKind, Snapshot, StackUsage, Truncation};

/// The call paths of one process's stacks, kept from report to report.
#[derive(Default)]
pub struct CallPaths {
    /// Each BPF stack id met, and the id of its call path: the id of the
    /// path's first stack.
    path_of: WordMap<u64, u64>,
    /// Each call path by what its frames read as (a hash of their
    /// `frame_key`s).
    by_key: HashMap<u64, u64>,
    /// For a call path of several stacks, the one it is shown with and
    /// that one's stable id, the smallest; a path of one stack is shown
    /// as itself.
    shown: HashMap<u64, (u64, String)>,
    /// Stacks that stopped short in code not known yet, with their frames'
    /// keys, until the first whole call path they begin comes.
    unfolded: HashMap<u64, Vec<u64>>,
    /// The whole call paths, which a stack cut short may begin.
    whole: Vec<u64>,
}

/// What is known of one BPF stack when it is met.
pub struct Met {
    pub frames: Arc<[Arc<Frame>]>,
    pub truncation: Option<Truncation>,
}

/// Each frame's `frame_key`, worked out once in a merge: frames are shared
/// by the stacks through the same code.
#[derive(Default)]
struct FrameKeys(WordMap<*const Frame, u64>);

impl FrameKeys {
    fn of(&mut self, frames: &[Arc<Frame>]) -> Vec<u64> {
        frames
            .iter()
            .map(|frame| *self.0.entry(Arc::as_ptr(frame)).or_insert_with(|| frame_key(frame)))
            .collect()
    }
}

impl CallPaths {
    /// Puts the snapshot's stacks of one call path together, under the
    /// path's id. `meet` symbolizes a stack (the first time it is met,
    /// then from the symbolizer's cache).
    pub fn merge(&mut self, snapshot: &mut Snapshot, mut meet: impl FnMut(u64) -> Met) {
        let mut keys = FrameKeys::default();
        // Every stack met first: a whole path met now may take in a stack
        // cut short met before it.
        for usage in &snapshot.stacks {
            if lost_stack_owner(usage.stack_id).is_none() {
                self.path_of(usage.stack_id, &mut meet, &mut keys);
            }
        }
        let mut merged: Vec<StackUsage> = Vec::with_capacity(snapshot.stacks.len());
        let mut place: HashMap<(u64, Option<MappingKind>), usize> = HashMap::new();
        for mut usage in std::mem::take(&mut snapshot.stacks) {
            if let Some(&path) = self.path_of.get(&usage.stack_id) {
                usage.stack_id = path;
            }
            if let Some(&index) = place.get(&(usage.stack_id, usage.mapping)) {
                add(&mut merged[index], usage);
            } else {
                place.insert((usage.stack_id, usage.mapping), merged.len());
                merged.push(usage);
            }
        }
        snapshot.stacks = merged;
    }

    /// The BPF stack whose frames call path `path` is shown with.
    pub fn shown(&self, path: u64) -> u64 {
        self.shown.get(&path).map_or(path, |(shown, _)| *shown)
    }

    /// The call path of BPF stack `stack_id`, which joins or starts one
    /// the first time it is met.
    fn path_of(&mut self, stack_id: u64, meet: &mut impl FnMut(u64) -> Met, keys: &mut FrameKeys) -> u64 {
        if let Some(&path) = self.path_of.get(&stack_id) {
            return path;
        }
        let stack = meet(stack_id);
        let frame_keys = keys.of(&stack.frames);
        let whole_key = hash_of(&frame_keys);
        let path = if let Some(&path) = self.by_key.get(&whole_key) {
            self.join(path, stack_id, &stack.frames, meet);
            path
        } else if let Some(path) = self.folded_into(stack_id, &frame_keys, stack.truncation, meet, keys) {
            path
        } else {
            self.by_key.insert(whole_key, stack_id);
            if stack.truncation.is_none() {
                self.fold_unfolded_into(stack_id, &frame_keys, meet, keys);
                self.whole.push(stack_id);
            }
            stack_id
        };
        self.path_of.insert(stack_id, path);
        path
    }

    /// Stack `stack_id`, whose frames are `frames`, joins call path `path`:
    /// the path is shown as whichever has the smaller stable id.
    fn join(&mut self, path: u64, stack_id: u64, frames: &[Arc<Frame>], meet: &mut impl FnMut(u64) -> Met) {
        let stable = stable_id(frames);
        let (shown, shown_stable) = match self.shown.get(&path) {
            Some((shown, shown_stable)) => (*shown, shown_stable.clone()),
            None => (path, stable_id(&meet(path).frames)),
        };
        let smallest = if stable < shown_stable { (stack_id, stable) } else { (shown, shown_stable) };
        self.shown.insert(path, smallest);
    }

    /// The call path a stack cut short in unknown code joins: the one
    /// whole path it begins, if exactly one does. With none, it waits in
    /// `unfolded` for one; with several, it stays a stack of its own.
    fn folded_into(
        &mut self,
        stack_id: u64,
        frame_keys: &[u64],
        truncation: Option<Truncation>,
        meet: &mut impl FnMut(u64) -> Met,
        keys: &mut FrameKeys,
    ) -> Option<u64> {
        if truncation != Some(Truncation::UnknownCode) || frame_keys.is_empty() {
            return None;
        }
        let begun: Vec<u64> = self.whole_paths_beginning_with(frame_keys, meet, keys).take(2).collect();
        match begun[..] {
            [path] => Some(path),
            [] => {
                self.unfolded.insert(stack_id, frame_keys.to_vec());
                None
            }
            _ => None,
        }
    }

    /// Folds into `path`, a new whole call path whose frames' keys are
    /// `frame_keys`, the stacks cut short that it begins, unless another
    /// whole path begins them too. Either way they wait no more: whole
    /// paths are never forgotten, so the answer cannot change back.
    fn fold_unfolded_into(
        &mut self,
        path: u64,
        frame_keys: &[u64],
        meet: &mut impl FnMut(u64) -> Met,
        keys: &mut FrameKeys,
    ) {
        let begun: Vec<(u64, Vec<u64>)> = self
            .unfolded
            .iter()
            .filter(|(_, short)| short.len() < frame_keys.len() && frame_keys.starts_with(short))
            .map(|(&short, short_keys)| (short, short_keys.clone()))
            .collect();
        for (short, short_keys) in begun {
            self.unfolded.remove(&short);
            if self.whole_paths_beginning_with(&short_keys, meet, keys).next().is_some() {
                continue;
            }
            self.by_key.retain(|_, existing| *existing != short);
            for member in self.path_of.values_mut().filter(|member| **member == short) {
                *member = path;
            }
        }
    }

    /// The whole call paths known so far whose frames begin with
    /// `frame_keys` (and have more).
    fn whole_paths_beginning_with<'a>(
        &'a self,
        frame_keys: &'a [u64],
        meet: &'a mut impl FnMut(u64) -> Met,
        keys: &'a mut FrameKeys,
    ) -> impl Iterator<Item = u64> + 'a {
        self.whole.iter().copied().filter(move |&path| {
            let frames = meet(path).frames;
            frames.len() > frame_keys.len() && keys.of(&frames[..frame_keys.len()]) == frame_keys
        })
    }
}

/// Adds `other`, a stack of the same call path, to `usage`.
fn add(usage: &mut StackUsage, other: StackUsage) {
    usage.bytes += other.bytes;
    usage.allocations += other.allocations;
    usage.outstanding.extend(other.outstanding);
    usage.allocated = match (usage.allocated, other.allocated) {
        (Some(mut a), Some(b)) => {
            a.bytes += b.bytes;
            a.count += b.count;
            Some(a)
        }
        (a, b) => a.or(b),
    };
}

/// What a frame reads as: its module, function, file and line, and
/// whether it was inlined; where it has no line, its offset in the
/// function, and without a name, where it lies in its file. Two frames of
/// one line read the same whatever their addresses.
fn frame_key(frame: &Frame) -> u64 {
    let mut hasher = DefaultHasher::new();
    (&frame.module, &frame.function, &frame.file, frame.line, frame.inlined).hash(&mut hasher);
    match (&frame.function, frame.line) {
        (_, Some(_)) => {}
        (Some(_), None) => frame.offset.hash(&mut hasher),
        (None, None) => (frame.file_offset, frame.address).hash(&mut hasher),
    }
    hasher.finish()
}

fn hash_of(keys: &[u64]) -> u64 {
    let mut hasher = DefaultHasher::new();
    keys.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame of `/app/server` at `file_offset`, in `function` at `line`.
    fn at(function: &str, line: u32, file_offset: u64) -> Arc<Frame> {
        Arc::new(Frame {
            address: 0x5555_0000_0000 + file_offset,
            function: Some(function.to_owned()),
            offset: Some(file_offset & 0xff),
            file: Some("/src/server.c".to_owned()),
            line: Some(line),
            module: Some("/app/server".to_owned()),
            file_offset: Some(file_offset),
            ..Frame::default()
        })
    }

    struct Stacks(HashMap<u64, (Vec<Arc<Frame>>, Option<Truncation>)>);

    impl Stacks {
        fn meet(&self, stack_id: u64) -> Met {
            let (frames, truncation) = &self.0[&stack_id];
            Met { frames: frames.clone().into(), truncation: *truncation }
        }
    }

    fn usage(stack_id: u64, bytes: u64) -> StackUsage {
        StackUsage { stack_id, bytes, allocations: 1, ..StackUsage::default() }
    }

    fn merged(paths: &mut CallPaths, stacks: &Stacks, ids: &[u64]) -> Vec<(u64, u64, u64)> {
        let mut snapshot =
            Snapshot { stacks: ids.iter().map(|&id| usage(id, id * 10)).collect(), ..Snapshot::default() };
        paths.merge(&mut snapshot, |id| stacks.meet(id));
        let mut amounts: Vec<_> =
            snapshot.stacks.iter().map(|s| (s.stack_id, s.bytes, s.allocations)).collect();
        amounts.sort_unstable();
        amounts
    }

    #[test]
    fn stacks_that_read_the_same_are_one_under_the_first_id() {
        let leak = || vec![at("c_leak", 7, 0x1000), at("handle", 20, 0x2000)];
        // One call on a line, and another on the same line elsewhere in it.
        let mut same_line = leak();
        same_line[0] = at("c_leak", 7, 0x1010);
        let stacks = Stacks(HashMap::from([
            (5, (leak(), None)),
            (3, (leak(), None)),
            (9, (same_line, None)),
            (4, (vec![at("other", 30, 0x3000)], None)),
        ]));
        let mut paths = CallPaths::default();
        assert_eq!(merged(&mut paths, &stacks, &[5, 3, 9, 4]), [(4, 40, 1), (5, 170, 3)]);
        assert_eq!(merged(&mut paths, &stacks, &[9, 3]), [(5, 120, 2)], "the path keeps its id");
        let shown = paths.shown(5);
        let smallest = [5, 9].into_iter().min_by_key(|id| stable_id(&stacks.0[id].0)).unwrap();
        assert_eq!(shown, smallest, "shown as the member of the smallest stable id");
    }

    #[test]
    fn a_stack_cut_short_in_unknown_code_joins_the_one_whole_path_it_begins() {
        let whole = vec![at("inner", 1, 0x100), at("middle", 2, 0x200), at("outer", 3, 0x300)];
        let other = vec![at("inner", 1, 0x100), at("elsewhere", 4, 0x400)];
        let short = vec![at("inner", 1, 0x100), at("middle", 2, 0x200)];
        let unknown = Some(Truncation::UnknownCode);
        let stacks = Stacks(HashMap::from([
            (1, (short.clone(), unknown)),
            (2, (whole.clone(), None)),
            (3, (other, None)),
            (4, (short[..1].to_vec(), unknown)),
        ]));
        let mut paths = CallPaths::default();
        // Met before its whole path: folded when the whole one comes.
        assert_eq!(merged(&mut paths, &stacks, &[1]), [(1, 10, 1)]);
        assert_eq!(merged(&mut paths, &stacks, &[1, 2]), [(2, 30, 2)]);
        // `inner` alone begins two whole paths: left as it is.
        assert_eq!(merged(&mut paths, &stacks, &[3, 4]), [(3, 30, 1), (4, 40, 1)]);
    }

    #[test]
    fn a_lost_stack_stays_as_it_is() {
        let lost = memleak_common::lost_stack_id(42);
        let mut paths = CallPaths::default();
        let stacks = Stacks(HashMap::new());
        let mut snapshot = Snapshot { stacks: vec![usage(lost, 64)], ..Snapshot::default() };
        paths.merge(&mut snapshot, |id| stacks.meet(id));
        assert_eq!(snapshot.stacks[0].stack_id, lost);
    }
}
