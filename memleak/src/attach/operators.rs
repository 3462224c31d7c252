//! C++'s `operator new` and `operator delete`: which object a program's
//! calls to each of their forms land in, and which forms are worth a
//! probe there.
//!
//! The dynamic linker binds each form on its own, to the first object in
//! link-map order that defines it, as it binds `malloc`. tcmalloc,
//! jemalloc and mimalloc define every form, so a program linked with one,
//! or run with one preloaded, calls theirs, and their `operator new` does
//! not call their `malloc`: probing `malloc` alone sees none of its
//! allocations, while their `operator delete` often is their `free`, and
//! every delete counts. So the forms are probed where they land, except
//! where a probe would add nothing:
//!
//! - in the C++ runtime (libstdc++, libc++), whose `operator new` calls
//!   `malloc` (or `aligned_alloc`) and whose `operator delete` calls
//!   `free` through their PLT slots, which land in the allocator memleak
//!   probes: probing them too would double the cost of every `new` of the
//!   common glibc C++ program for no allocation more;
//! - a form whose code is only a jump, through a PLT slot or not, to
//!   another probed function (jemalloc's `operator delete(void*)` is `jmp
//!   free@plt`, its `operator new[]` is `jmp operator new`; mimalloc's
//!   aligned deletes go through `mi_free_size_aligned` to `mi_free`, its
//!   `free`): that function's probe fires for the call;
//! - a form at the address of another probed function (tcmalloc's
//!   `operator delete(void*)` is its `free`) shares its probe, and the
//!   cookie names both.
//!
//! A form that does more than jump is probed even when its code calls a
//! probed function (jemalloc's aligned `new` calls `aligned_alloc`; a
//! program's own `operator delete` may call `free`): nested allocations
//! are recorded once, at the outermost return, and a release inside an
//! `operator delete` of the same block is not counted again (see
//! memleak-ebpf's `calls::begin_release`).

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
use memleak_common::{CxxForm, ALLOCATOR_FUNCTIONS};
use object::{Object as _, ObjectSymbol as _, ObjectSymbolTable as _};

use crate::elf::{self, FunctionSymbol};

/// A form of `operator new` or `operator delete`, and the table entry it
/// belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Form {
    /// Its place in `ALLOCATOR_FUNCTIONS`: its bit in the cookie.
    pub function: usize,
    pub form: &'static CxxForm,
}

/// Every form of every operator, in table order.
pub fn all_forms() -> impl Iterator<Item = Form> {
    ALLOCATOR_FUNCTIONS
        .iter()
        .enumerate()
        .flat_map(|(function, entry)| entry.forms.iter().map(move |form| Form { function, form }))
}

/// The forms `file` defines and their symbols. From `.dynsym`, which
/// other objects' calls bind to; with `own_calls`, from `.symtab` too: a
/// program's own calls reach its own definitions without the dynamic
/// linker, even unexported ones.
pub fn defined_forms(file: &object::File, own_calls: bool) -> Vec<(Form, FunctionSymbol)> {
    let symbols: Vec<&str> = all_forms().map(|form| form.form.symbol).collect();
    let defined = if own_calls {
        elf::function_symbols(file, "", &symbols)
    } else {
        exported_functions(file, &symbols)
    };
    all_forms().filter_map(|form| Some((form, *defined.get(form.form.symbol)?))).collect()
}

/// The defined functions among `names` in `.dynsym` only.
fn exported_functions(file: &object::File, names: &[&str]) -> BTreeMap<String, FunctionSymbol> {
    let mut found = BTreeMap::new();
    for symbol in file.dynamic_symbols() {
        if symbol.is_undefined() || symbol.address() == 0 || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        if let Ok(name) = symbol.name().map(str::to_owned) {
            if names.contains(&name.as_str()) {
                found
                    .entry(name)
                    .or_insert(FunctionSymbol { address: symbol.address(), size: symbol.size() });
            }
        }
    }
    found
}

/// Whether the object the process names `display` is a C++ runtime
/// library (libstdc++, LLVM's libc++), whose operators only call `malloc`
/// and `free`.
pub fn is_cxx_runtime(display: &str) -> bool {
    let name = Path::new(display).file_name().and_then(|name| name.to_str()).unwrap_or(display);
    name.starts_with("libstdc++.so") || name.starts_with("libc++.so")
}

/// Where a run of jumps from a function's entry leads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Landing {
    /// Code of the object at this virtual address: code that is not a
    /// jump, or the entry of a function `Jumps::follow` was told to stop at.
    Here(u64),
    /// A PLT slot (or GOT entry) for this symbol, which the object does not
    /// define: another object's.
    Elsewhere(String),
}

/// Past this many jumps, a run is not followed further (mimalloc's
/// longest is three, through two PLT slots).
const MAX_JUMPS: usize = 8;

/// The jumps of one object's code: its PLT slots' symbols, read once.
pub struct Jumps<'a> {
    file: &'a object::File<'a>,
    data: &'a [u8],
    /// GOT slot address -> the symbol its relocation names, and its
    /// address when the object defines it.
    slots: HashMap<u64, (String, Option<u64>)>,
}

impl<'a> Jumps<'a> {
    pub fn new(file: &'a object::File<'a>, data: &'a [u8]) -> Self {
        let mut slots = HashMap::new();
        let symbols = file.dynamic_symbol_table();
        for (slot, relocation) in file.dynamic_relocations().into_iter().flatten() {
            let object::RelocationTarget::Symbol(index) = relocation.target() else { continue };
            let Some(symbol) = symbols.as_ref().and_then(|table| table.symbol_by_index(index).ok()) else {
                continue;
            };
            let Ok(name) = symbol.name() else { continue };
            let defined = (!symbol.is_undefined() && symbol.address() != 0).then(|| symbol.address());
            slots.insert(slot, (name.to_owned(), defined));
        }
        Self { file, data, slots }
    }

    /// Follows the jumps from `entry` (a virtual address): each `jmp`
    /// that is the first instruction after `endbr64` and nops, into the
    /// object or through a PLT stub or GOT slot, to where it leads, or to
    /// the first address past `entry` that `stop` accepts. `None` past
    /// `MAX_JUMPS`.
    pub fn follow(&self, entry: u64, stop: impl Fn(u64) -> bool) -> Option<Landing> {
        let mut at = entry;
        for _ in 0..MAX_JUMPS {
            if at != entry && stop(at) {
                return Some(Landing::Here(at));
            }
            match self.jump_at(at) {
                None => return Some(Landing::Here(at)),
                Some(Target::Code(next)) => at = next,
                Some(Target::Slot(slot)) => match self.slots.get(&slot) {
                    Some((_, Some(defined))) => at = *defined,
                    Some((name, None)) => return Some(Landing::Elsewhere(name.clone())),
                    // A slot without a relocation: nothing known of it.
                    None => return Some(Landing::Here(at)),
                },
            }
        }
        None
    }

    /// Where the code at virtual address `address` jumps, if its first
    /// instruction (past `endbr64` and nops) is an unconditional jump.
    fn jump_at(&self, address: u64) -> Option<Target> {
        let offset = usize::try_from(elf::file_offset(self.file, address)?).ok()?;
        let code = self.data.get(offset..)?;
        let code = &code[..code.len().min(64)];
        let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
        while decoder.can_decode() {
            let instruction = decoder.decode();
            match instruction.mnemonic() {
                Mnemonic::Endbr64 | Mnemonic::Nop => {}
                Mnemonic::Jmp if instruction.is_jmp_short_or_near() => {
                    return Some(Target::Code(instruction.near_branch_target()));
                }
                Mnemonic::Jmp
                    if instruction.op0_kind() == OpKind::Memory && instruction.is_ip_rel_memory_operand() =>
                {
                    return Some(Target::Slot(instruction.ip_rel_memory_address()));
                }
                _ => return None,
            }
        }
        None
    }
}

/// An unconditional jump's destination.
enum Target {
    /// Code at this virtual address (a function, or a PLT stub).
    Code(u64),
    /// Through the pointer at this address: a GOT slot.
    Slot(u64),
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIBRARIES: &str = "/usr/lib/x86_64-linux-gnu";

    fn with_library<T>(name: &str, check: impl FnOnce(&object::File, &[u8]) -> T) -> T {
        let data = std::fs::read(Path::new(LIBRARIES).join(name)).expect("installed by cargo xtask test");
        let file = object::File::parse(&*data).unwrap();
        check(&file, &data)
    }

    fn address_of(file: &object::File, symbol: &str) -> u64 {
        elf::dynamic_symbol(file, symbol).unwrap_or_else(|| panic!("{symbol} is not defined"))
    }

    #[test]
    fn every_form_is_in_the_table_once() {
        let forms: Vec<&str> = all_forms().map(|form| form.form.symbol).collect();
        assert_eq!(forms.len(), 20);
        let mut unique = forms.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 20, "{forms:?}");
        let releases = |form: Form| ALLOCATOR_FUNCTIONS[form.function].releases;
        assert!(all_forms().all(|form| releases(form) == form.form.symbol.starts_with("_Zd")));
    }

    #[test]
    fn jemallocs_deletes_jump_to_its_free_and_new_array_to_new() {
        with_library("libjemalloc.so.2", |file, data| {
            let jumps = Jumps::new(file, data);
            let free = address_of(file, "free");
            let at_free = |address| address == free;
            for delete in ["_ZdlPv", "_ZdaPv", "_ZdlPvSt11align_val_t", "_ZdaPvRKSt9nothrow_t"] {
                assert_eq!(
                    jumps.follow(address_of(file, delete), at_free),
                    Some(Landing::Here(free)),
                    "{delete}"
                );
            }
            // The sized delete calls an internal body of sdallocx: real code.
            let sized = address_of(file, "_ZdlPvm");
            assert_eq!(jumps.follow(sized, at_free), Some(Landing::Here(sized)));
            let new = address_of(file, "_Znwm");
            assert_eq!(jumps.follow(address_of(file, "_Znam"), |a| a == new), Some(Landing::Here(new)));
        });
    }

    #[test]
    fn mimallocs_aligned_deletes_reach_its_free_through_plt_slots() {
        with_library("libmimalloc.so.2", |file, data| {
            let jumps = Jumps::new(file, data);
            let free = address_of(file, "free");
            for delete in
                ["_ZdlPvm", "_ZdlPvSt11align_val_t", "_ZdlPvmSt11align_val_t", "_ZdaPvmSt11align_val_t"]
            {
                // Even without stopping at free: the run ends at its code.
                assert_eq!(
                    jumps.follow(address_of(file, delete), |_| false),
                    Some(Landing::Here(free)),
                    "{delete}"
                );
            }
            // operator new(size_t, nothrow_t const&) is `jmp mi_new_nothrow@plt`.
            let nothrow = address_of(file, "mi_new_nothrow");
            assert_eq!(
                jumps.follow(address_of(file, "_ZnwmRKSt9nothrow_t"), |_| false),
                Some(Landing::Here(nothrow))
            );
        });
    }

    #[test]
    fn libstdcxx_delete_jumps_to_another_objects_free() {
        with_library("libstdc++.so.6", |file, data| {
            let jumps = Jumps::new(file, data);
            let delete = address_of(file, "_ZdlPv");
            assert_eq!(jumps.follow(delete, |_| false), Some(Landing::Elsewhere("free".to_owned())));
            assert!(is_cxx_runtime("/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30"));
            assert!(!is_cxx_runtime("/usr/lib/x86_64-linux-gnu/libc.so.6"));
            assert_eq!(defined_forms(file, false).len(), 20, "libstdc++ defines every form");
        });
    }
}
