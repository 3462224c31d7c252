//! The records BPF sends to user space through ring buffers.

/// One allocation or free, sent through [`EVENTS_MAP`](crate::EVENTS_MAP)
/// with --trace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceEvent {
    /// `CLOCK_MONOTONIC` nanoseconds.
    pub timestamp_ns: u64,
    /// The block returned, or the one freed.
    pub address: u64,
    /// Bytes requested; for a free, the size recorded at allocation or 0
    /// if it was not recorded.
    pub size: u64,
    pub tgid: u32,
    pub tid: u32,
    /// The function called, a [`FunctionSet`](crate::FunctionSet), as in
    /// [`PendingCall`](crate::PendingCall).
    pub function: u32,
    pub _padding: u32,
}

/// What a [`MappingEvent`] reports.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappingChange {
    /// mmap returned `address`, `length` bytes.
    Map = 0,
    /// munmap(`address`, `length`) was called.
    Unmap = 1,
    /// mremap moved or resized `address`, `length` to `new_address`,
    /// `new_length`.
    Remap = 2,
    /// The process called execve: a new program, a new address space.
    Exec = 3,
    /// mprotect(`address`, `length`, `prot`) was called.
    Protect = 4,
    /// A followed process forked: `tgid` is the new process, `address`
    /// the one that forked it.
    Fork = 5,
    /// A process memleak does not trace called execve (reported only when
    /// user space asks for it): `tgid` may be one to follow. `address` is
    /// [`HELD`] when BPF stopped it there (see
    /// [`tunables::EXEC_HOLD`](crate::tunables::EXEC_HOLD)).
    Launched = 6,
    /// A process held at its execve reached its dynamic loader's
    /// `_dl_debug_state`, its libraries mapped or about to be, and was
    /// stopped there again; `address` is [`HELD`].
    LoaderReady = 7,
}

/// A [`MappingEvent`]'s `address` for an event whose process BPF stopped
/// with `SIGSTOP` as it sent it: user space sends `SIGCONT` once done.
pub const HELD: u64 = 1;

impl TryFrom<u32> for MappingChange {
    type Error = u32;

    fn try_from(raw: u32) -> Result<Self, u32> {
        match raw {
            0 => Ok(MappingChange::Map),
            1 => Ok(MappingChange::Unmap),
            2 => Ok(MappingChange::Remap),
            3 => Ok(MappingChange::Exec),
            4 => Ok(MappingChange::Protect),
            5 => Ok(MappingChange::Fork),
            6 => Ok(MappingChange::Launched),
            7 => Ok(MappingChange::LoaderReady),
            _ => Err(raw),
        }
    }
}

/// An mmap, munmap, mremap, mprotect, exec or fork of a traced process, sent through
/// [`MAPPING_EVENTS_MAP`](crate::MAPPING_EVENTS_MAP). These are rare next
/// to malloc and free, and a partial munmap needs interval bookkeeping
/// that a BPF hash map cannot do, so user space keeps the regions.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingEvent {
    /// `CLOCK_MONOTONIC` nanoseconds.
    pub timestamp_ns: u64,
    pub address: u64,
    /// Bytes.
    pub length: u64,
    pub new_address: u64,
    /// Bytes.
    pub new_length: u64,
    /// For `Map`: the stack of the mmap call, as in
    /// [`Allocation`](crate::Allocation).
    pub stack_id: u64,
    pub tgid: u32,
    /// A [`MappingChange`] as u32.
    pub change: u32,
    /// 1 if the call came from inside malloc & co.: the allocator's own
    /// arenas and large blocks, already counted as what malloc returned.
    pub inside_allocator: u32,
    /// For `Map` and `Protect`: the protection asked for (`PROT_*`);
    /// `PROT_NONE` reserves address space without making memory.
    pub prot: u32,
    /// For `Map`: mmap's flags (`MAP_STACK` marks a thread's stack).
    pub flags: u32,
    pub _padding: u32,
}

/// No access: address space reserved, not memory.
pub const PROT_NONE: u32 = 0;
/// mmap's flag for a thread's stack (glibc's `allocate_stack` sets it).
pub const MAP_STACK: u32 = 0x20000;
/// mmap's flag for memory that no file backs.
pub const MAP_ANONYMOUS: u32 = 0x20;

impl MappingEvent {
    /// Whether this is a region's change that moves its bytes between
    /// memory and reserved address space: a region reserved by the
    /// program's own mmap, or one an mprotect takes all access from. The
    /// allocator's mappings and thread stacks are counted whole whatever
    /// their protection. An mprotect that gives access is news only in a
    /// process that reserved address space of its own before.
    pub fn reserves_address_space(&self) -> bool {
        match MappingChange::try_from(self.change) {
            Ok(MappingChange::Map) => {
                self.prot == PROT_NONE && self.inside_allocator == 0 && self.flags & MAP_STACK == 0
            }
            Ok(MappingChange::Protect) => self.prot == PROT_NONE,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(change: MappingChange, prot: u32, inside_allocator: u32, flags: u32) -> MappingEvent {
        MappingEvent { change: change as u32, prot, inside_allocator, flags, ..MappingEvent::default() }
    }

    #[test]
    fn only_the_programs_own_reservations_and_taking_access_reserve_address_space() {
        const PROT_READ_WRITE: u32 = 3;
        assert!(event(MappingChange::Map, PROT_NONE, 0, 0).reserves_address_space());
        assert!(!event(MappingChange::Map, PROT_NONE, 1, 0).reserves_address_space(), "the allocator's");
        assert!(
            !event(MappingChange::Map, PROT_NONE, 0, MAP_STACK).reserves_address_space(),
            "a thread's stack"
        );
        assert!(!event(MappingChange::Map, PROT_READ_WRITE, 0, 0).reserves_address_space());
        assert!(event(MappingChange::Protect, PROT_NONE, 0, 0).reserves_address_space());
        assert!(!event(MappingChange::Protect, PROT_READ_WRITE, 0, 0).reserves_address_space());
        assert!(!event(MappingChange::Unmap, PROT_NONE, 0, 0).reserves_address_space());
    }
}
