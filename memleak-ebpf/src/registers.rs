//! The user registers a probe reads, named for what they hold: the
//! instruction, stack and frame pointers, the return value, a system
//! call's arguments, and where a call returns to. x86-64 keeps a call's
//! return address on the stack at the callee's entry; arm64 keeps it in
//! the link register (x30), and its frame pointer in x29.

use aya_ebpf::EbpfContext;

/// A task's user registers, as the kernel saved them at its entry: a
/// uprobe's context, or what `bpf_task_pt_regs` and the system call
/// wrappers' argument point at.
#[derive(Clone, Copy)]
pub struct Registers(*const arch::UserRegisters);

#[expect(clippy::inline_always, reason = "a field read each: a BPF function call would cost more")]
impl Registers {
    /// The registers of the probe that `ctx` is the context of.
    #[inline(always)]
    pub fn of<C: EbpfContext>(ctx: &C) -> Self {
        Self(ctx.as_ptr() as *const arch::UserRegisters)
    }

    /// The registers at `regs`, a `struct pt_regs` pointer the kernel
    /// gave.
    #[cfg_attr(
        feature = "legacy-kernels",
        expect(dead_code, reason = "only the system calls' programs need it")
    )]
    #[inline(always)]
    pub fn at(regs: *const aya_ebpf::bindings::pt_regs) -> Self {
        Self(regs.cast::<arch::UserRegisters>())
    }

    /// The instruction the task stopped at.
    #[inline(always)]
    pub fn instruction_pointer(self) -> u64 {
        // SAFETY: registers the kernel saved, read through a pointer the
        // verifier checks.
        arch::instruction_pointer(unsafe { &*self.0 })
    }

    #[inline(always)]
    pub fn stack_pointer(self) -> u64 {
        // SAFETY: as above.
        arch::stack_pointer(unsafe { &*self.0 })
    }

    /// rbp on x86-64, x29 on arm64.
    #[inline(always)]
    pub fn frame_pointer(self) -> u64 {
        // SAFETY: as above.
        arch::frame_pointer(unsafe { &*self.0 })
    }

    /// What a function or a system call returned, at its return.
    #[inline(always)]
    pub fn return_value(self) -> u64 {
        // SAFETY: as above.
        arch::return_value(unsafe { &*self.0 })
    }

    /// A system call's first three arguments, as its registers keep them
    /// while the kernel runs it.
    #[cfg_attr(
        feature = "legacy-kernels",
        expect(dead_code, reason = "only the system calls' programs need it")
    )]
    #[inline(always)]
    pub fn system_call_arguments(self) -> [u64; 3] {
        // SAFETY: as above.
        arch::system_call_arguments(unsafe { &*self.0 })
    }

    /// Where the call whose entry the probe is at returns to, 0 if it
    /// cannot be read.
    #[inline(always)]
    pub fn return_address_at_entry(self) -> u64 {
        // SAFETY: as above.
        arch::return_address_at_entry(unsafe { &*self.0 })
    }
}

#[cfg(not(bpf_target_arch = "aarch64"))]
#[expect(clippy::inline_always, reason = "a field read each")]
mod arch {
    pub use aya_ebpf::bindings::pt_regs as UserRegisters;

    #[inline(always)]
    pub fn instruction_pointer(regs: &UserRegisters) -> u64 {
        regs.rip
    }

    #[inline(always)]
    pub fn stack_pointer(regs: &UserRegisters) -> u64 {
        regs.rsp
    }

    #[inline(always)]
    pub fn frame_pointer(regs: &UserRegisters) -> u64 {
        regs.rbp
    }

    #[inline(always)]
    pub fn return_value(regs: &UserRegisters) -> u64 {
        regs.rax
    }

    #[inline(always)]
    pub fn system_call_arguments(regs: &UserRegisters) -> [u64; 3] {
        [regs.rdi, regs.rsi, regs.rdx]
    }

    /// The word at the stack pointer, before the callee pushes anything.
    #[inline(always)]
    pub fn return_address_at_entry(regs: &UserRegisters) -> u64 {
        // SAFETY: a read of user memory, which the helper makes fault-safe.
        unsafe { aya_ebpf::helpers::bpf_probe_read_user(regs.rsp as *const u64) }.unwrap_or(0)
    }
}

#[cfg(bpf_target_arch = "aarch64")]
#[expect(clippy::inline_always, reason = "a field read each")]
mod arch {
    /// The kernel's `struct pt_regs` starts with the user registers.
    pub use aya_ebpf::bindings::user_pt_regs as UserRegisters;

    #[inline(always)]
    pub fn instruction_pointer(regs: &UserRegisters) -> u64 {
        regs.pc
    }

    #[inline(always)]
    pub fn stack_pointer(regs: &UserRegisters) -> u64 {
        regs.sp
    }

    /// x29.
    #[inline(always)]
    pub fn frame_pointer(regs: &UserRegisters) -> u64 {
        regs.regs[29]
    }

    #[inline(always)]
    pub fn return_value(regs: &UserRegisters) -> u64 {
        regs.regs[0]
    }

    #[inline(always)]
    pub fn system_call_arguments(regs: &UserRegisters) -> [u64; 3] {
        [regs.regs[0], regs.regs[1], regs.regs[2]]
    }

    /// The link register, x30: a call leaves its return address there.
    #[inline(always)]
    pub fn return_address_at_entry(regs: &UserRegisters) -> u64 {
        regs.regs[30]
    }
}

/// The system call number in the registers at `regs`, or -1 outside one
/// (a page fault): x86-64's `orig_rax`. Only x86-64 sees mapping calls at
/// the `mmap_lock` tracepoint.
#[cfg(not(bpf_target_arch = "aarch64"))]
#[cfg_attr(feature = "legacy-kernels", expect(dead_code, reason = "only the system calls' programs need it"))]
#[expect(clippy::inline_always, reason = "a field read")]
#[inline(always)]
pub fn system_call_number(regs: *const aya_ebpf::bindings::pt_regs) -> u64 {
    // SAFETY: registers the kernel saved, read through a pointer the
    // verifier checks.
    unsafe { (*regs).orig_rax }
}
