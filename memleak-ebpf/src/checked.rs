//! Map values the older verifiers accept.
//!
//! Kernels before 6.16 do not know that looking up key 0 of an array
//! cannot fail: they refuse any arithmetic on the returned pointer before
//! its null check. LLVM, which knows the check, is free to compute an
//! element's address first and test the base after; `non_null` puts the
//! check where those verifiers need it.

/// `value` once it is checked not to be null, passed through an assembly
/// move the compiler cannot look into, so no address computed from it
/// can move above the check.
#[expect(clippy::inline_always, reason = "a call would hand the verifier a pointer it cannot follow back")]
#[inline(always)]
pub fn non_null<T>(value: Option<*mut T>) -> Option<*mut T> {
    let mut value = value?;
    if value.is_null() {
        return None;
    }
    // SAFETY: a move of the register to itself, which only claims to
    // change it. Not an empty block: that leaves two line entries at one
    // instruction, which kernels before 6.x refuse.
    unsafe { core::arch::asm!("{0} = {0}", inout(reg) value) };
    Some(value)
}

/// `value`, with everything the compiler knows of it forgotten: a mask
/// applied to the result then stays in the program, where the compiler
/// would drop it as redundant and older verifiers, which know less of a
/// value's bounds than the compiler, would see an index out of bounds.
#[expect(clippy::inline_always, reason = "a call costs more than the move it hides")]
#[inline(always)]
pub fn opaque(mut value: u64) -> u64 {
    // SAFETY: a move of the register to itself, as in `non_null`.
    unsafe { core::arch::asm!("{0} = {0}", inout(reg) value) };
    value
}
