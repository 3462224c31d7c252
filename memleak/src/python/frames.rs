//! A stack's Python frames as a report shows them: resolved to function,
//! file and line while the process is alive, then merged into the stack's
//! native frames in place of the eval-loop calls that ran them.
//!
//! BPF stores, after a stack's return addresses, one word per Python frame,
//! innermost first, marking the last frame each native call of
//! `_PyEval_EvalFrameDefault` ran (a group: one frame up to 3.10, the
//! frames of Python-to-Python calls that one C call runs from 3.11). The
//! merge walks the native frames from the allocation outwards and puts
//! the next group where it meets a frame of the eval loop, which it knows
//! by address: Debian's interpreter is stripped, so its `.cold` part has
//! no name of its own.

use std::sync::Arc;

use memleak_common::python::py_frame_parts;

use super::{
    code::{CodeCache, PyFrame},
    line_table::Instruction,
    PythonRuntime,
};
use crate::{
    model::{Frame, FrameKind},
    symbolize::WordMap,
};

/// What a target that is a walked CPython process knows of its stacks'
/// Python frames.
pub struct PythonStacks {
    /// Python frames BPF walks per stack at most.
    limit: usize,
    /// Each stack's Python frames, resolved when the stack was first
    /// seen, in the groups one native eval call ran, innermost first.
    resolved: WordMap<u64, Arc<[Vec<Arc<Frame>>]>>,
    /// Each stack's frames, native and Python, once merged.
    merged: WordMap<u64, Arc<[Arc<Frame>]>>,
}

impl PythonStacks {
    /// For a process whose stacks hold at most `limit` Python frames.
    pub fn new(limit: u16) -> Self {
        Self { limit: usize::from(limit), resolved: WordMap::default(), merged: WordMap::default() }
    }

    /// Whether stack `stack_id` has as many Python frames as the walk
    /// takes: the outer ones may be missing.
    pub fn reached_limit(&self, stack_id: u64) -> bool {
        self.resolved
            .get(&stack_id)
            .is_some_and(|groups| groups.iter().map(Vec::len).sum::<usize>() >= self.limit)
    }

    /// Resolves the Python frames of stack `stack_id`, whose words BPF
    /// stored as `words`, unless done already; returns its innermost
    /// frame if it does. Done as soon as the stack is seen: a code object
    /// freed later would lose its name.
    /// Each word's code object is checked against `checks`, BPF's check of
    /// it when the stack was stored (0 or missing: unchecked).
    pub fn resolve(
        &mut self,
        stack_id: u64,
        words: &[u64],
        checks: &[u64],
        codes: &mut CodeCache,
    ) -> Option<Arc<Frame>> {
        if words.is_empty() || self.resolved.contains_key(&stack_id) {
            return None;
        }
        let mut groups: Vec<Vec<Arc<Frame>>> = vec![Vec::new()];
        for (index, &word) in words.iter().enumerate() {
            let (code, lasti, group_end) = py_frame_parts(word);
            let check = checks.get(index).copied().unwrap_or(0);
            let frame = codes.resolve_checked(code, Instruction::from_units(lasti), check);
            if !is_init_cleanup(&frame) {
                groups.last_mut().expect("one group at least").push(Arc::new(python_frame(frame)));
            }
            if group_end {
                groups.push(Vec::new());
            }
        }
        groups.retain(|group| !group.is_empty());
        let innermost = groups.first().and_then(|group| group.first()).cloned();
        self.resolved.insert(stack_id, groups.into());
        innermost
    }

    /// Stack `stack_id`'s frames: its `native` frames with its Python
    /// frames merged in, or `native` alone if it has none.
    pub fn merged(
        &mut self,
        stack_id: u64,
        native: Arc<[Arc<Frame>]>,
        runtime: &PythonRuntime,
    ) -> Arc<[Arc<Frame>]> {
        let Some(groups) = self.resolved.get(&stack_id) else { return native };
        Arc::clone(
            self.merged
                .entry(stack_id)
                .or_insert_with(|| merge(&native, groups, |address| runtime.in_eval(address)).into()),
        )
    }
}

/// Whether `frame` runs CPython 3.13's `_Py_InitCleanup`: the frame a
/// specialised call of a class pushes under its `__init__`, to check that
/// `__init__` returned None. It is not the program's: CPython leaves it
/// out of tracebacks (it is never "complete"), and so do reports. Its
/// code object is static, named `__init__` with `__init__` for a file,
/// and has no line table, so no line.
fn is_init_cleanup(frame: &PyFrame) -> bool {
    matches!(frame, PyFrame::Code { function, file, line: None }
        if &**function == "__init__" && &**file == "__init__")
}

/// A resolved Python frame as a report's frame.
fn python_frame(frame: PyFrame) -> Frame {
    let (function, file, line) = match frame {
        PyFrame::Code { function, file, line } => {
            (function.to_string(), Some(file.to_string()), line.and_then(|line| u32::try_from(line).ok()))
        }
        unknown @ PyFrame::Unknown { .. } => (unknown.to_string(), None, None),
    };
    Frame { function: Some(function), file, line, kind: FrameKind::Python, ..Frame::default() }
}

/// `native` (innermost first) with each frame of the eval loop, as
/// `in_eval` tells a call's address, replaced by the next of `groups`.
///
/// As py-spy does, it tolerates the two disagreeing: an eval frame beyond
/// the groups (one being entered or left) stays as it is, and groups beyond
/// the eval frames (the native walk stopped short) go at the end, where
/// the report already says the stack is cut short.
pub fn merge(
    native: &[Arc<Frame>],
    groups: &[Vec<Arc<Frame>>],
    in_eval: impl Fn(u64) -> bool,
) -> Vec<Arc<Frame>> {
    let mut merged = Vec::with_capacity(native.len() + groups.iter().map(Vec::len).sum::<usize>());
    let mut groups = groups.iter();
    // A frame with functions inlined into it is several frames of one
    // address, the inlined ones first: one eval call, replaced once.
    let mut replaced_address = None;
    for frame in native {
        // A return address is one past its call: the call is in the loop.
        let in_loop = !frame.is_python() && in_eval(frame.address.saturating_sub(1));
        if in_loop && replaced_address == Some(frame.address) {
            continue;
        }
        if in_loop {
            if let Some(group) = groups.next() {
                merged.extend(group.iter().cloned());
                replaced_address = Some(frame.address);
                continue;
            }
        }
        replaced_address = None;
        merged.push(Arc::clone(frame));
    }
    merged.extend(groups.flatten().cloned());
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVAL: std::ops::Range<u64> = 0x52_b0f0..0x53_8a4c;
    const EVAL_COLD: std::ops::Range<u64> = 0x43_0f05..0x43_455e;

    fn in_eval(address: u64) -> bool {
        EVAL.contains(&address) || EVAL_COLD.contains(&address)
    }

    fn native(function: &str, address: u64) -> Arc<Frame> {
        Arc::new(Frame { address, function: Some(function.to_owned()), ..Frame::default() })
    }

    fn inlined(function: &str, address: u64) -> Arc<Frame> {
        Arc::new(Frame { address, function: Some(function.to_owned()), inlined: true, ..Frame::default() })
    }

    fn python(function: &str, line: u32) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(function.to_owned()),
            file: Some("/app/svc.py".to_owned()),
            line: Some(line),
            kind: FrameKind::Python,
            ..Frame::default()
        })
    }

    fn names(frames: &[Arc<Frame>]) -> Vec<String> {
        frames
            .iter()
            .map(|frame| {
                let name = frame.function.clone().unwrap_or_default();
                if frame.is_python() {
                    format!("{name}:{}", frame.line.unwrap_or(0))
                } else {
                    name
                }
            })
            .collect()
    }

    /// Debian's 3.11 in a worker thread: two eval calls, the first run
    /// from its `.cold` part, each running a group.
    #[test]
    fn each_eval_call_is_replaced_by_the_group_it_ran_cold_part_included() {
        let stack = [
            native("malloc", 0x7f00_0000_1000),
            native("bytearray___init__", 0x4a_0000),
            native("", EVAL_COLD.start + 0x20),
            native("_PyFunction_Vectorcall", 0x4b_0000),
            native("", EVAL.start + 0x100),
            native("thread_run", 0x4c_0000),
            native("start_thread", 0x7f00_0000_2000),
        ];
        let groups = [
            vec![python("cache_payload", 7), python("handle", 11), python("worker_loop", 16)],
            vec![python("Thread.run", 982), python("Thread._bootstrap_inner", 1045)],
        ];
        assert_eq!(
            names(&merge(&stack, &groups, in_eval)),
            [
                "malloc",
                "bytearray___init__",
                "cache_payload:7",
                "handle:11",
                "worker_loop:16",
                "_PyFunction_Vectorcall",
                "Thread.run:982",
                "Thread._bootstrap_inner:1045",
                "thread_run",
                "start_thread",
            ]
        );
    }

    /// 3.13's `_Py_InitCleanup` frame is CPython's, not the program's; a
    /// function named `__init__` in a real file is the program's.
    #[test]
    fn the_init_cleanup_frame_is_left_out() {
        let code = |function: &str, file: &str, line| PyFrame::Code {
            function: function.into(),
            file: file.into(),
            line,
        };
        assert!(is_init_cleanup(&code("__init__", "__init__", None)));
        assert!(!is_init_cleanup(&code("__init__", "/app/svc.py", None)));
        assert!(!is_init_cleanup(&code("Entry.__init__", "/app/svc.py", Some(3))));
    }

    /// Up to 3.10 every Python frame is its own eval call.
    #[test]
    fn one_frame_groups_replace_one_eval_call_each() {
        let stack = [
            native("malloc", 0x7f00_0000_1000),
            native("_PyEval_EvalFrameDefault", EVAL.start + 0x10),
            native("_PyEval_EvalFrameDefault", EVAL.start + 0x20),
            native("Py_BytesMain", 0x4d_0000),
        ];
        let groups = [vec![python("leak", 3)], vec![python("<module>", 9)]];
        assert_eq!(
            names(&merge(&stack, &groups, in_eval)),
            ["malloc", "leak:3", "<module>:9", "Py_BytesMain"]
        );
    }

    /// A return address at the end of the loop is a call at its last
    /// byte; one at its start is a call before it.
    #[test]
    fn the_call_before_a_return_address_is_what_lies_in_the_loop() {
        let stack = [native("last call", EVAL.end), native("before", EVAL.start)];
        let merged = merge(&stack, &[vec![python("f", 1)]], in_eval);
        assert_eq!(names(&merged), ["f:1", "before"]);
    }

    /// With a debug file, the eval loop's frame holds what was inlined
    /// into it, all at its one address: replaced once, as a whole.
    #[test]
    fn an_eval_frame_with_inlined_functions_is_replaced_once() {
        let address = EVAL.start + 0x40;
        let stack =
            [native("malloc", 0x7f00_0000_1000), inlined("_PyEval_Vector", address), native("eval", address)];
        let groups = [vec![python("f", 1)], vec![python("g", 2)]];
        assert_eq!(names(&merge(&stack, &groups, in_eval)), ["malloc", "f:1", "g:2"]);
    }

    /// An eval frame being entered has no group yet: it stays native.
    #[test]
    fn eval_frames_beyond_the_groups_stay_native() {
        let stack = [native("eval", EVAL.start + 1), native("eval", EVAL.start + 2)];
        assert_eq!(names(&merge(&stack, &[vec![python("f", 1)]], in_eval)), ["f:1", "eval"]);
    }

    /// A native walk cut short keeps every group, at its end.
    #[test]
    fn groups_beyond_a_truncated_native_stack_go_at_its_end() {
        let stack = [native("malloc", 0x7f00_0000_1000), native("eval", EVAL.start + 1)];
        let groups = [vec![python("f", 1)], vec![python("g", 2), python("h", 3)]];
        assert_eq!(names(&merge(&stack, &groups, in_eval)), ["malloc", "f:1", "g:2", "h:3"]);
    }

    #[test]
    fn a_stack_without_eval_frames_gets_its_groups_at_the_end() {
        let stack = [native("malloc", 0x7f00_0000_1000)];
        assert_eq!(names(&merge(&stack, &[vec![python("f", 1)]], in_eval)), ["malloc", "f:1"]);
    }
}
