//! Where on a function to put its probes.
//!
//! The kernel emulates some instructions under a uprobe (push, jumps,
//! calls, conditional jumps, nops) and single-steps the rest, at about ten
//! times the cost (0.8 µs against 10 µs, measured on our machines).
//! glibc's free starts with `test %rdi,%rdi` and jemalloc's malloc with
//! `cmp $0x1000,%rdi`, both single-stepped, and they run on every call.
//! The probe can go on a later instruction instead, when that is provably
//! the same for the BPF programs:
//!
//! - the instructions skipped run straight from the entry, on every call,
//!   with no branch among them;
//! - none of them writes an argument register (the entry programs read
//!   them) or the stack pointer (a return probe takes over the return
//!   address at the top of the stack, where the call left it);
//! - no branch of the function lands inside the skipped run or on the
//!   probed instruction, which would fire the probe without a call;
//! - the probed instruction is one the kernel emulates.
//!
//! mprotect's probe (where the kernel's tracepoint does not see the call
//! instead: see memleak-ebpf's `probes::mmap`) may also go past its
//! system call (glibc's is `mov
//! $10,%eax; syscall; cmp; jae`, nothing emulated before the call): the
//! kernel gives back every register but rax, rcx and r11, so the program
//! reads the same arguments, and sees in rax whether the call succeeded.
//! Single-stepped, the probe made each call cost 8 µs more; emulated, well
//! under one. munmap's stays before its call: the address range it frees
//! may be mapped again by another thread as soon as the call returns, and
//! its event must come first.
//!
//! Anything else keeps the probes at the entry.

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, Register,
};
use memleak_common::programs;

/// At most this many instructions are skipped.
const MAX_SKIPPED: usize = 16;

/// The argument registers (System V) that the entry program `program`
/// reads: see each program in memleak-ebpf/src/probes. All six for one
/// not listed.
fn arguments_read(program: &str) -> &'static [Register] {
    use Register::{R8, R9, RCX, RDI, RDX, RSI};
    match program {
        programs::MALLOC_ENTER | programs::FREE_ENTER => &[RDI],
        programs::MEMALIGN_ENTER => &[RSI],
        programs::CALLOC_ENTER | programs::REALLOC_ENTER | programs::MUNMAP_ENTER => &[RDI, RSI],
        programs::POSIX_MEMALIGN_ENTER => &[RDI, RDX],
        programs::MMAP_ENTER => &[RSI, RDX, RCX],
        programs::REALLOCARRAY_ENTER | programs::MREMAP_ENTER | programs::MPROTECT_ENTER => &[RDI, RSI, RDX],
        _ => &[RDI, RSI, RDX, RCX, R8, R9],
    }
}

/// Whether `program`'s probe may go past a system call (see the module's
/// doc): its program then reads the call's result.
fn may_follow_the_system_call(program: &str) -> bool {
    program == programs::MPROTECT_ENTER
}

/// Where a function's probes go, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Bytes past the function's entry.
    pub offset: u64,
    /// Whether the probe is past a system call, whose result is in rax.
    pub after_system_call: bool,
    /// The instruction probed, for -v: "ja", "push r12"...
    pub probed: Mnemonic,
    /// The first instruction, when the probe could not move past it.
    pub single_stepped: Option<Mnemonic>,
}

/// Where to probe the function whose machine code is `code` (from its
/// entry to its end, as its symbol's size says), for entry program
/// `program`.
pub fn probe_placement(code: &[u8], program: &str) -> Placement {
    let arguments = arguments_read(program);
    // x86-64's machine code alone is decoded: elsewhere (arm64) the probes
    // stay at the entry, where the return address is still in its register.
    let instructions = if cfg!(target_arch = "x86_64") { decode(code) } else { Vec::new() };
    let Some(first) = instructions.first() else {
        return Placement {
            offset: 0,
            after_system_call: false,
            probed: Mnemonic::INVALID,
            single_stepped: None,
        };
    };
    let mut info = InstructionInfoFactory::new();
    let mut after_system_call = false;
    for (index, instruction) in instructions.iter().enumerate().take(MAX_SKIPPED + 1) {
        let offset = instruction.ip();
        if is_emulated(instruction) {
            if offset > 0 && lands_in(&instructions, offset) {
                break;
            }
            return Placement {
                offset,
                after_system_call,
                probed: instruction.mnemonic(),
                single_stepped: None,
            };
        }
        if index == MAX_SKIPPED {
            break;
        }
        if instruction.mnemonic() == Mnemonic::Syscall && may_follow_the_system_call(program) {
            after_system_call = true;
        } else if !can_skip(instruction, arguments, &mut info) {
            break;
        }
    }
    Placement {
        offset: 0,
        after_system_call: false,
        probed: first.mnemonic(),
        single_stepped: (!is_emulated(first)).then_some(first.mnemonic()),
    }
}

/// The function's instructions, their `ip` the offset from its entry; up
/// to the first that does not decode.
fn decode(code: &[u8]) -> Vec<Instruction> {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut instructions = Vec::new();
    while decoder.can_decode() {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            break;
        }
        instructions.push(instruction);
    }
    instructions
}

/// Whether the kernel's uprobes emulate `instruction` instead of
/// single-stepping it: relative jumps and calls, conditional jumps, a
/// register push, a nop.
fn is_emulated(instruction: &Instruction) -> bool {
    instruction.is_jcc_short_or_near()
        || instruction.is_jmp_short_or_near()
        || instruction.is_call_near()
        || matches!(instruction.mnemonic(), Mnemonic::Nop)
        || (instruction.mnemonic() == Mnemonic::Push && instruction.op0_kind() == iced_x86::OpKind::Register)
}

/// Whether the probe may go past `instruction`: it falls through to the
/// next one and leaves `arguments` and the stack pointer alone.
fn can_skip(instruction: &Instruction, arguments: &[Register], info: &mut InstructionInfoFactory) -> bool {
    if instruction.flow_control() != FlowControl::Next {
        return false;
    }
    let used = info.info(instruction);
    !used.used_registers().iter().any(|used| {
        let written = !matches!(used.access(), OpAccess::Read | OpAccess::CondRead | OpAccess::None);
        let register = used.register().full_register();
        written && (register == Register::RSP || arguments.contains(&register))
    })
}

/// Whether a direct branch of the function lands past its entry and at or
/// before `offset`: there the probe would fire without a call.
fn lands_in(instructions: &[Instruction], offset: u64) -> bool {
    instructions.iter().any(|instruction| {
        let branches = instruction.is_jcc_short_or_near()
            || instruction.is_jmp_short_or_near()
            || instruction.is_call_near()
            || instruction.is_loop()
            || instruction.is_loopcc()
            || instruction.is_jcx_short();
        branches && (1..=offset).contains(&instruction.near_branch_target())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free's placement: it reads only %rdi.
    fn offset(code: &[u8]) -> u64 {
        probe_placement(code, programs::FREE_ENTER).offset
    }

    #[test]
    fn glibc_free_skips_its_null_test() {
        // test %rdi,%rdi; je +0xbf; push %rbp (glibc 2.36's free)
        let code = [0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0, 0, 0, 0x55];
        assert_eq!(offset(&code), 3);
        // The same with a short je.
        assert_eq!(offset(&[0x48, 0x85, 0xff, 0x74, 0x10, 0x55]), 3);
    }

    #[test]
    fn jemalloc_malloc_skips_its_size_test() {
        // cmp $0x1000,%rdi; ja +0x93; lea 0x2c7f5c(%rip),%rdx
        let code = [
            0x48, 0x81, 0xff, 0, 0x10, 0, 0, 0x0f, 0x87, 0x93, 0, 0, 0, 0x48, 0x8d, 0x15, 0x5c, 0x7f, 0x2c, 0,
        ];
        let placement = probe_placement(&code, programs::MALLOC_ENTER);
        assert_eq!(
            placement,
            Placement { offset: 7, after_system_call: false, probed: Mnemonic::Ja, single_stepped: None }
        );
    }

    #[test]
    fn an_emulated_first_instruction_is_probed_where_it_is() {
        // push %r12 (glibc 2.36's malloc)
        assert_eq!(offset(&[0x41, 0x54, 0x55]), 0);
    }

    #[test]
    fn arguments_and_the_stack_pointer_are_never_skipped_over() {
        // mov %rdi,%rax; shr $4,%rax; push %rbx: reads rdi, writes rax only.
        assert_eq!(offset(&[0x48, 0x89, 0xf8, 0x48, 0xc1, 0xe8, 0x04, 0x53]), 7);
        // mov %rax,%rdi; je: writes the first argument.
        assert_eq!(offset(&[0x48, 0x89, 0xc7, 0x74, 0x10]), 0);
        // sub $8,%rsp; je: moves the return address away from the top.
        assert_eq!(offset(&[0x48, 0x83, 0xec, 0x08, 0x74, 0x10]), 0);
        // xor %esi,%esi; je: writes the second argument through esi,
        // which calloc's program reads, and free's does not.
        let code = [0x31, 0xf6, 0x74, 0x10];
        assert_eq!(probe_placement(&code, programs::CALLOC_ENTER).offset, 0);
        assert_eq!(offset(&code), 2);
    }

    #[test]
    fn a_branch_into_the_skipped_run_keeps_the_entry() {
        // 0: test %rdi,%rdi  3: je +2  5: nop nop  7: jmp -6, back to the je
        let code = [0x48, 0x85, 0xff, 0x74, 0x02, 0x90, 0x90, 0xeb, 0xfa];
        assert_eq!(offset(&code), 0);
    }

    #[test]
    fn nothing_emulated_within_reach_keeps_the_entry() {
        // seventeen single-stepped instructions, then a jump.
        let mut code = [0x48, 0x89, 0xf8].repeat(17);
        code.extend([0x74, 0x10]);
        let placement = probe_placement(&code, programs::FREE_ENTER);
        assert_eq!((placement.offset, placement.single_stepped), (0, Some(Mnemonic::Mov)));
        // Truncated code.
        assert_eq!(offset(&[0x48, 0x85]), 0);
    }

    /// glibc 2.36's mprotect and munmap: `mov $N,%eax; syscall; cmp
    /// $-4095,%rax; jae +1; ret`.
    fn system_call_wrapper(number: u8) -> [u8; 16] {
        [0xb8, number, 0, 0, 0, 0x0f, 0x05, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, 0x73, 0x01, 0xc3]
    }

    #[test]
    fn mprotect_is_probed_past_its_system_call_and_munmap_before() {
        let mprotect = probe_placement(&system_call_wrapper(10), programs::MPROTECT_ENTER);
        assert_eq!(
            mprotect,
            Placement { offset: 13, after_system_call: true, probed: Mnemonic::Jae, single_stepped: None }
        );
        let munmap = probe_placement(&system_call_wrapper(11), programs::MUNMAP_ENTER);
        assert_eq!((munmap.offset, munmap.after_system_call), (0, false));
    }
}
