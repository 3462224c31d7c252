//! Where on a function to put its entry probe.
//!
//! The kernel emulates some instructions under a uprobe (push, jumps) and
//! single-steps the rest, at about ten times the cost (0.8 µs against
//! 10 µs, measured on our machines). glibc's free starts with `test
//! %rdi,%rdi`, which is single-stepped, and free runs as often as malloc. The probe can go on
//! the next instruction instead, when that is provably the same for the
//! BPF program: the skipped instruction only reads the pointer argument
//! and sets flags, and the next one is the conditional jump for a NULL
//! pointer, which the kernel emulates and which every call executes.
//! Anything else keeps the probe at the entry.

use iced_x86::{Code, Decoder, DecoderOptions, Instruction, OpKind, Register};

/// Bytes past the function's entry to put its entry probe at: 0, or the
/// length of a leading `test %rdi,%rdi` followed by a conditional jump.
/// `code` starts at the function's entry.
pub fn entry_probe_offset(code: &[u8]) -> u64 {
    let mut decoder = Decoder::new(64, code, DecoderOptions::NONE);
    let mut first = Instruction::default();
    let mut second = Instruction::default();
    if !decoder.can_decode() {
        return 0;
    }
    decoder.decode_out(&mut first);
    if !decoder.can_decode() {
        return 0;
    }
    decoder.decode_out(&mut second);
    let tests_first_argument = first.code() == Code::Test_rm64_r64
        && first.op0_kind() == OpKind::Register
        && first.op0_register() == Register::RDI
        && first.op1_register() == Register::RDI;
    if tests_first_argument && second.is_jcc_short_or_near() && !second.is_invalid() {
        first.len() as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_free_skips_its_null_test() {
        // test %rdi,%rdi; je +0xbf; push %rbp (glibc 2.36's free)
        let code = [0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0, 0, 0, 0x55];
        assert_eq!(entry_probe_offset(&code), 3);
        // The same with a short je.
        assert_eq!(entry_probe_offset(&[0x48, 0x85, 0xff, 0x74, 0x10, 0x55]), 3);
    }

    #[test]
    fn anything_else_keeps_the_entry() {
        // push %r12: already emulated, nothing to gain.
        assert_eq!(entry_probe_offset(&[0x41, 0x54, 0x55]), 0);
        // test %rsi,%rsi; je: not the first argument.
        assert_eq!(entry_probe_offset(&[0x48, 0x85, 0xf6, 0x74, 0x10]), 0);
        // test %rdi,%rdi; mov %rdi,%rax: no jump follows.
        assert_eq!(entry_probe_offset(&[0x48, 0x85, 0xff, 0x48, 0x89, 0xf8]), 0);
        // mov %rax,%rdi; je: writes the argument register.
        assert_eq!(entry_probe_offset(&[0x48, 0x89, 0xc7, 0x74, 0x10]), 0);
        // test %edi,%edi (32-bit); je: not the whole pointer.
        assert_eq!(entry_probe_offset(&[0x85, 0xff, 0x74, 0x10]), 0);
        // Truncated code.
        assert_eq!(entry_probe_offset(&[0x48, 0x85]), 0);
    }
}
