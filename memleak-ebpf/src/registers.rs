//! The user registers a probe reads, named for what they hold: the
//! instruction, stack and frame pointers, the return value, a system
//! call's arguments, and where a call returns to. x86-64 keeps a call's
//! return address on the stack at the callee's entry; arm64 keeps it in
//! the link register (x30), and its frame pointer in x29.

#[cfg(not(bpf_target_arch = "aarch64"))]
use aya_ebpf::bindings::pt_regs as UserRegisters;
#[cfg(bpf_target_arch = "aarch64")]
use aya_ebpf::bindings::user_pt_regs as UserRegisters;
use aya_ebpf::EbpfContext;

/// A task's user registers, as the kernel saved them at its entry: a
/// uprobe's context, or what `bpf_task_pt_regs` and the system call
/// wrappers' argument point at. (arm64's `struct pt_regs` starts with
/// its user registers.)
#[derive(Clone, Copy)]
pub struct Registers(*const UserRegisters);

#[expect(clippy::inline_always, reason = "a field read each: a BPF function call would cost more")]
impl Registers {
    /// The registers of the probe that `ctx` is the context of.
    #[inline(always)]
    pub fn of<C: EbpfContext>(ctx: &C) -> Self {
        Self(ctx.as_ptr() as *const UserRegisters)
    }

    /// The registers at `regs`, a `struct pt_regs` pointer the kernel
    /// gave.
    #[cfg_attr(
        feature = "legacy-kernels",
        expect(dead_code, reason = "only the system calls' programs need it")
    )]
    #[inline(always)]
    pub fn at(regs: *const aya_ebpf::bindings::pt_regs) -> Self {
        Self(regs.cast::<UserRegisters>())
    }

    #[inline(always)]
    fn saved(self) -> &'static UserRegisters {
        // SAFETY: registers the kernel saved, read through a pointer the
        // verifier checks, for as long as the program runs.
        unsafe { &*self.0 }
    }
}

#[cfg(not(bpf_target_arch = "aarch64"))]
#[expect(clippy::inline_always, reason = "a field read each")]
impl Registers {
    /// The instruction the task stopped at.
    #[inline(always)]
    pub fn instruction_pointer(self) -> u64 {
        self.saved().rip
    }

    #[inline(always)]
    pub fn stack_pointer(self) -> u64 {
        self.saved().rsp
    }

    #[inline(always)]
    pub fn frame_pointer(self) -> u64 {
        self.saved().rbp
    }

    /// What a function or a system call returned, at its return.
    #[inline(always)]
    pub fn return_value(self) -> u64 {
        self.saved().rax
    }

    /// A system call's first three arguments, as its registers keep them
    /// while the kernel runs it.
    #[cfg_attr(
        feature = "legacy-kernels",
        expect(dead_code, reason = "only the system calls' programs need it")
    )]
    #[inline(always)]
    pub fn system_call_arguments(self) -> [u64; 3] {
        let saved = self.saved();
        [saved.rdi, saved.rsi, saved.rdx]
    }

    /// Where the call whose entry the probe is at returns to: the word at
    /// the stack pointer, before the callee pushes anything; 0 if it
    /// cannot be read.
    #[inline(always)]
    pub fn return_address_at_entry(self) -> u64 {
        // SAFETY: a read of user memory, which the helper makes fault-safe.
        unsafe { aya_ebpf::helpers::bpf_probe_read_user(self.stack_pointer() as *const u64) }.unwrap_or(0)
    }

    /// The system call number, or -1 outside one (a page fault). Only
    /// x86-64 sees mapping calls at the `mmap_lock` tracepoint.
    #[cfg_attr(
        feature = "legacy-kernels",
        expect(dead_code, reason = "only the tracepoint's program needs it")
    )]
    #[inline(always)]
    pub fn system_call_number(self) -> u64 {
        self.saved().orig_rax
    }
}

#[cfg(bpf_target_arch = "aarch64")]
#[expect(clippy::inline_always, reason = "a field read each")]
impl Registers {
    /// The instruction the task stopped at.
    #[inline(always)]
    pub fn instruction_pointer(self) -> u64 {
        self.saved().pc
    }

    #[inline(always)]
    pub fn stack_pointer(self) -> u64 {
        self.saved().sp
    }

    /// x29.
    #[inline(always)]
    pub fn frame_pointer(self) -> u64 {
        self.saved().regs[29]
    }

    /// What a function or a system call returned, at its return.
    #[inline(always)]
    pub fn return_value(self) -> u64 {
        self.saved().regs[0]
    }

    /// A system call's first three arguments, as its registers keep them
    /// while the kernel runs it.
    #[cfg_attr(
        feature = "legacy-kernels",
        expect(dead_code, reason = "only the system calls' programs need it")
    )]
    #[inline(always)]
    pub fn system_call_arguments(self) -> [u64; 3] {
        let saved = self.saved();
        [saved.regs[0], saved.regs[1], saved.regs[2]]
    }

    /// Where the call whose entry the probe is at returns to: the link
    /// register, x30.
    #[inline(always)]
    pub fn return_address_at_entry(self) -> u64 {
        self.saved().regs[30]
    }
}
