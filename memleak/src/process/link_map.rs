//! The dynamic linker's hook for debuggers, used on a command memleak
//! starts: ld.so calls `_dl_debug_state` when it has changed its list of
//! loaded objects, with `_r_debug.r_state` saying whether the list is
//! consistent again. gdb stops there to read a program's libraries before
//! they run; memleak does the same, once, at start-up, so that the
//! libraries' unwind tables are loaded before their constructors or the
//! program's first allocation, which would otherwise be walked before
//! memleak knew their code.
//!
//! A breakpoint (x86-64's int3, arm64's brk) goes on the hook at the
//! exec stop, while the program is single-threaded; it is removed at the
//! first stop that finds the list consistent, before any thread that
//! ptrace does not follow could meet it.

use std::{fs, io};

use super::{
    files,
    maps::{self, MapsEntry},
};
use crate::elf;

/// The dynamic linker's function a debugger breaks on: glibc's calls it
/// before and after it maps a program's libraries, musl's once they are.
pub const LOADER_HOOK: &str = "_dl_debug_state";

/// `r_state` of `struct r_debug`: after `int r_version`, its padding, and
/// two pointers-sized fields.
const R_STATE_OFFSET: u64 = 24;
/// `RT_CONSISTENT` of `enum r_state`.
const RT_CONSISTENT: libc::c_long = 0;

/// The breakpoint instruction and the bits of a word it takes: int3, one
/// byte; the program counter stops past it.
#[cfg(target_arch = "x86_64")]
mod breakpoint {
    pub const INSTRUCTION: libc::c_long = 0xcc;
    pub const MASK: libc::c_long = 0xff;
    /// Where the program counter is once the breakpoint at `address` trapped.
    pub fn stopped_at(address: u64) -> u64 {
        address + 1
    }
}

/// `brk #0`, one 4-byte instruction; the program counter stays on it.
#[cfg(target_arch = "aarch64")]
mod breakpoint {
    pub const INSTRUCTION: libc::c_long = 0xd420_0000;
    pub const MASK: libc::c_long = 0xffff_ffff;
    /// Where the program counter is once the breakpoint at `address` trapped.
    pub fn stopped_at(address: u64) -> u64 {
        address
    }
}

/// A breakpoint on the hook of a stopped tracee.
pub struct LinkMapHook {
    /// Where `_dl_debug_state` is in the tracee.
    address: u64,
    /// The word at `address` before the breakpoint replaced its first byte.
    original: libc::c_long,
    /// Where `_r_debug.r_state` is; `None` for a linker without `_r_debug`
    /// (musl's), whose first call is the consistent one.
    r_state: Option<u64>,
}

impl LinkMapHook {
    /// Puts the breakpoint into `pid`, stopped at its exec: its dynamic
    /// linker is mapped, nothing else of it ran yet. `None` for a static
    /// program, or if the hook cannot be found or written.
    pub fn set(pid: libc::pid_t) -> Option<Self> {
        let entries = maps::parse(&fs::read_to_string(format!("/proc/{pid}/maps")).ok()?);
        let (address, r_state) = entries.iter().find_map(|entry| hook_in(pid as u32, entry, &entries))?;
        let original = peek(pid, address).ok()?;
        poke(pid, address, with_breakpoint(original)).ok()?;
        Some(Self { address, original, r_state })
    }

    /// Whether the tracee, stopped by SIGTRAP, stopped at this breakpoint:
    /// then it is put back on the hooked instruction, the breakpoint taken
    /// out; `step_over` or `remove` follows.
    pub fn hit(&self, pid: libc::pid_t) -> bool {
        let Ok(mut registers) = registers(pid) else { return false };
        if *program_counter(&mut registers) != breakpoint::stopped_at(self.address) {
            return false;
        }
        *program_counter(&mut registers) = self.address;
        set_registers(pid, &mut registers).is_ok() && poke(pid, self.address, self.original).is_ok()
    }

    /// Whether the linker's list of objects is consistent: all mapped.
    pub fn consistent(&self, pid: libc::pid_t) -> bool {
        self.r_state
            .is_none_or(|address| peek(pid, address).is_ok_and(|word| word & 0xffff_ffff == RT_CONSISTENT))
    }

    /// Runs the hooked instruction and puts the breakpoint back, for the
    /// next change of the list.
    pub fn step_over(&self, pid: libc::pid_t) -> io::Result<()> {
        // SAFETY: the tracee is in a ptrace stop.
        if unsafe { libc::ptrace(libc::PTRACE_SINGLESTEP, pid, 0, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut status = 0;
        // SAFETY: waits for our own tracee's single step.
        if unsafe { libc::waitpid(pid, &raw mut status, libc::__WALL) } < 0 || !libc::WIFSTOPPED(status) {
            return Err(io::Error::other("the tracee did not stop after one step"));
        }
        poke(pid, self.address, with_breakpoint(self.original))
    }
}

/// The hook and `_r_debug.r_state` in the tracee, if `entry` maps the
/// start of a dynamic linker.
fn hook_in(pid: u32, entry: &MapsEntry, entries: &[MapsEntry]) -> Option<(u64, Option<u64>)> {
    if entry.offset != 0 {
        return None;
    }
    let data = files::read_limited(&files::open_mapped(pid, entry)?, files::READ_LIMIT).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let hook = elf::dynamic_symbol(&file, LOADER_HOOK)?;
    let r_debug = elf::dynamic_symbol(&file, "_r_debug");
    // The bias that every mapping of this file shares.
    let first_vaddr = elf::first_load_vaddr(&file)?;
    let bias = entry.start.wrapping_sub(first_vaddr & !0xfff);
    let mapped = |address: u64| entries.iter().any(|other| other.start <= address && address < other.end);
    let hook = hook.wrapping_add(bias);
    mapped(hook).then_some((hook, r_debug.map(|r_debug| r_debug.wrapping_add(bias) + R_STATE_OFFSET)))
}

fn peek(pid: libc::pid_t, address: u64) -> io::Result<libc::c_long> {
    // PEEKTEXT returns the word; -1 is a word too, so errno tells.
    // SAFETY: errno is this thread's; the tracee is in a ptrace stop.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: as above.
    let word = unsafe { libc::ptrace(libc::PTRACE_PEEKTEXT, pid, address, 0) };
    let error = io::Error::last_os_error();
    if word == -1 && error.raw_os_error() != Some(0) {
        return Err(error);
    }
    Ok(word)
}

fn poke(pid: libc::pid_t, address: u64, word: libc::c_long) -> io::Result<()> {
    // SAFETY: writes one word of the stopped tracee's memory.
    if unsafe { libc::ptrace(libc::PTRACE_POKETEXT, pid, address, word) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `word` with the breakpoint in place of its first instruction's bytes.
fn with_breakpoint(word: libc::c_long) -> libc::c_long {
    (word & !breakpoint::MASK) | breakpoint::INSTRUCTION
}

/// The program counter among the registers.
fn program_counter(registers: &mut libc::user_regs_struct) -> &mut u64 {
    #[cfg(target_arch = "x86_64")]
    return &mut registers.rip;
    #[cfg(target_arch = "aarch64")]
    return &mut registers.pc;
}

/// The tracee's general registers, through `PTRACE_GETREGSET` (which
/// every architecture has, where `PTRACE_GETREGS` is x86's).
fn registers(pid: libc::pid_t) -> io::Result<libc::user_regs_struct> {
    // SAFETY: plain data that the kernel fills in.
    let mut registers: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    register_set(pid, Direction::Read, &mut registers)?;
    Ok(registers)
}

fn set_registers(pid: libc::pid_t, registers: &mut libc::user_regs_struct) -> io::Result<()> {
    register_set(pid, Direction::Write, registers)
}

#[derive(Clone, Copy)]
enum Direction {
    Read,
    Write,
}

/// Reads or writes the tracee's `NT_PRSTATUS` register set. (The two
/// requests are named, not passed: glibc's and musl's types differ.)
fn register_set(
    pid: libc::pid_t,
    direction: Direction,
    registers: &mut libc::user_regs_struct,
) -> io::Result<()> {
    let mut vector = libc::iovec {
        iov_base: std::ptr::from_mut(registers).cast(),
        iov_len: std::mem::size_of::<libc::user_regs_struct>(),
    };
    let set = libc::NT_PRSTATUS;
    // SAFETY: the tracee is in a ptrace stop; the vector describes
    // `registers`, which is as large as the set.
    let result = unsafe {
        match direction {
            Direction::Read => libc::ptrace(libc::PTRACE_GETREGSET, pid, set, &raw mut vector),
            Direction::Write => libc::ptrace(libc::PTRACE_SETREGSET, pid, set, &raw mut vector),
        }
    };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
