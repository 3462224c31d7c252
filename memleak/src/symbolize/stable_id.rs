//! A stack's stable id: the same for the same call path of the same
//! binary, across reports, processes, restarts of memleak and machines,
//! and whether or not debug symbols are installed.
//!
//! The BPF stack id cannot serve: it is a slot in this run's map. Names
//! cannot either: installing a debug package names static functions that
//! were unnamed and moves offsets. What does not change is where the code
//! lies: each return address's object, known by its build id (else its
//! file name: the same binary may sit at different paths, in a container
//! or after a reinstall), and its offset in that object's file, which
//! addresses randomized at load (ASLR) leave alone.

use std::sync::Arc;

use super::WordMap;
use crate::model::Frame;

/// 12 hex digits of a 64-bit FNV-1a hash of the stack's code locations,
/// innermost first: of each frame's own hash, in turn an FNV-1a hash of
/// where its code lies. FNV-1a is written out here, not taken from `std`,
/// whose hashers may change between Rust releases: the ids must not.
///
/// Frames inlined into another share its return address and add nothing.
/// Frames of no file (JIT code a perf map names, kernel code) are hashed
/// by their names and offsets, which for them do not depend on debug
/// symbols; code in anonymous memory that nothing names adds only that.
/// A Python frame, which has no address, is hashed by its function, file
/// and line.
pub fn stable_id(frames: &[Arc<Frame>]) -> String {
    StableIds::default().of(frames)
}

/// Stable ids of many stacks, each frame hashed once: frames are shared
/// by the stacks through the same code.
#[derive(Default)]
pub struct StableIds {
    frames: WordMap<*const Frame, u64>,
}

impl StableIds {
    pub fn of(&mut self, frames: &[Arc<Frame>]) -> String {
        let mut hash = Fnv1a::default();
        for frame in frames.iter().filter(|frame| !frame.inlined) {
            let location = *self.frames.entry(Arc::as_ptr(frame)).or_insert_with(|| location_hash(frame));
            hash.write(&location.to_le_bytes());
        }
        format!("{:012x}", hash.finish() >> 16)
    }
}

/// Where a frame's code lies, hashed.
fn location_hash(frame: &Frame) -> u64 {
    let mut hash = Fnv1a::default();
    if frame.is_python() {
        hash.write(b"p");
        hash.write(frame.function.as_deref().unwrap_or("?").as_bytes());
        hash.write(b"\0");
        hash.write(frame.file.as_deref().unwrap_or("?").as_bytes());
        hash.write(&frame.line.unwrap_or(0).to_le_bytes());
    } else if let Some(file_offset) = frame.file_offset {
        hash.write(b"f");
        hash.write(object_identity(frame).as_bytes());
        hash.write(&file_offset.to_le_bytes());
    } else {
        hash.write(b"n");
        hash.write(frame.function.as_deref().unwrap_or("?").as_bytes());
        hash.write(&frame.offset.unwrap_or(u64::MAX).to_le_bytes());
        hash.write(module_file_name(frame).as_bytes());
    }
    hash.finish()
}

/// The object's build id, else its file name.
fn object_identity(frame: &Frame) -> &str {
    frame.build_id.as_deref().unwrap_or_else(|| module_file_name(frame))
}

/// The module's file name alone.
fn module_file_name(frame: &Frame) -> &str {
    let module = frame.module.as_deref().unwrap_or("");
    module.rsplit('/').next().unwrap_or(module)
}

/// FNV-1a, 64 bits: small, and defined by its constants alone.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn located(function: Option<&str>, offset: Option<u64>, file_offset: u64) -> Arc<Frame> {
        Arc::new(Frame {
            address: 0x5555_0000_0000 + file_offset,
            function: function.map(str::to_owned),
            offset,
            module: Some("/app/leaker".to_owned()),
            file_offset: Some(file_offset),
            build_id: Some("5d1e".to_owned()),
            ..Frame::default()
        })
    }

    #[test]
    fn fnv1a_gives_the_published_test_vectors() {
        // From the FNV reference: "" and "a".
        assert_eq!(Fnv1a::default().finish(), 0xcbf2_9ce4_8422_2325);
        let mut hash = Fnv1a::default();
        hash.write(b"a");
        assert_eq!(hash.finish(), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn symbols_and_load_addresses_do_not_change_the_id() {
        let stripped = [located(None, None, 0x1234), located(None, None, 0x2000)];
        let mut named = [located(Some("leak"), Some(0x14), 0x1234), located(Some("main"), Some(0x9), 0x2000)];
        let inlined = Arc::new(Frame { inlined: true, ..(*located(Some("helper"), None, 0x1234)).clone() });
        let with_inlined = [Arc::clone(&inlined), Arc::clone(&named[0]), Arc::clone(&named[1])];
        assert_eq!(stable_id(&stripped), stable_id(&named), "debug symbols installed or not");
        assert_eq!(stable_id(&stripped), stable_id(&with_inlined), "inlined frames share an address");
        for frame in &mut named {
            let frame = Arc::make_mut(frame);
            frame.address += 0x1000_0000;
            frame.module = Some("/proc/1/root/srv/leaker".to_owned());
        }
        assert_eq!(stable_id(&stripped), stable_id(&named), "load address and directory do not count");
        // A literal, computed apart (FNV-1a in Python over the same bytes):
        // a change to the hashing renames every stack on every dashboard,
        // and must be seen.
        assert_eq!(stable_id(&stripped), "a60acff05be3");
    }

    #[test]
    fn another_build_or_another_call_site_is_another_id() {
        let base = [located(None, None, 0x1234)];
        let mut rebuilt = base.clone();
        Arc::make_mut(&mut rebuilt[0]).build_id = Some("77aa".to_owned());
        let elsewhere = [located(None, None, 0x1238)];
        let ids = [stable_id(&base), stable_id(&rebuilt), stable_id(&elsewhere)];
        assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2], "{ids:?}");
        assert!(ids.iter().all(|id| id.len() == 12 && id.chars().all(|c| c.is_ascii_hexdigit())), "{ids:?}");
    }

    #[test]
    fn frames_of_no_file_are_known_by_name() {
        let jit = |name: &str| Arc::new(Frame { function: Some(name.to_owned()), ..Frame::default() });
        assert_ne!(stable_id(&[jit("JS:a")]), stable_id(&[jit("JS:b")]));
        assert_eq!(stable_id(&[jit("JS:a")]), stable_id(&[jit("JS:a")]));
    }
}
