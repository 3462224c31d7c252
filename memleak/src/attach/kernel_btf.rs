//! What kernel tracing needs to know of the running kernel.
//!
//! Reads two facts from the kernel's BTF. Where a struct keeps a field:
//! the `kmem_cache_alloc` tracepoint passes the cache, not the object
//! size, so the BPF side needs the offset of `size` in `struct
//! kmem_cache`, which differs between kernel builds. And how many
//! arguments a tracepoint passes, which tells kernels apart where one
//! changed. aya keeps its BTF type walker private, and this walk is short.

use std::{ops::Range, path::Path};

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("cannot read the kernel's BTF at {path}: {source}: kernel tracing needs CONFIG_DEBUG_INFO_BTF")]
    Read { path: String, source: std::io::Error },
    #[error("the kernel's BTF is malformed: {0}")]
    Malformed(&'static str),
    #[error("the kernel's BTF has no field {member} in struct {structure}")]
    NoMember { structure: String, member: String },
}

pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Byte offset of `member` in `struct structure`, from the BTF at `path`.
pub fn member_offset(path: &Path, structure: &str, member: &str) -> Result<u32, BtfError> {
    let [offset] = member_offsets(path, [(structure, member)])?;
    Ok(offset)
}

/// The byte offset of each (struct, member) of `fields`, from the BTF at
/// `path` read once: a kernel's is some MB.
pub fn member_offsets<const N: usize>(path: &Path, fields: [(&str, &str); N]) -> Result<[u32; N], BtfError> {
    let data =
        std::fs::read(path).map_err(|source| BtfError::Read { path: path.display().to_string(), source })?;
    let mut offsets = [0; N];
    for (offset, (structure, member)) in offsets.iter_mut().zip(fields) {
        *offset = find_member_offset(&data, structure, member)?.ok_or_else(|| BtfError::NoMember {
            structure: structure.to_owned(),
            member: member.to_owned(),
        })?;
    }
    Ok(offsets)
}

/// Byte offset of a field reached through nested members, from struct
/// `structure` in the BTF at `path`, each member's type followed:
/// `("task_struct", ["thread", "fsbase"])` is where `task->thread.fsbase`
/// lies in a task. A member whose struct has no name of its own (arm64's
/// `thread.uw`) is followed as any other.
pub fn member_path_offset(path: &Path, structure: &str, members: &[&str]) -> Result<u32, BtfError> {
    let data =
        std::fs::read(path).map_err(|source| BtfError::Read { path: path.display().to_string(), source })?;
    let btf = Btf::new(&data)?;
    let missing =
        |member: &str| BtfError::NoMember { structure: structure.to_owned(), member: member.to_owned() };
    let named = btf.types().find(|found| {
        found
            .as_ref()
            .map_or(true, |found| found.kind() == KIND_STRUCT && btf.name(found) == structure.as_bytes())
    });
    let mut current = named.transpose()?.ok_or_else(|| missing(members.first().copied().unwrap_or("")))?;
    let mut total = 0;
    for (index, &member) in members.iter().enumerate() {
        let (offset, type_id) = member_of(&btf, &current, member)?.ok_or_else(|| missing(member))?;
        total += offset;
        if index + 1 < members.len() {
            current = composite(&btf, type_id)?.ok_or_else(|| missing(member))?;
        }
    }
    Ok(total)
}

/// The byte offset and type id of member `member` of struct or union
/// `found`.
fn member_of(btf: &Btf<'_>, found: &BtfType, member: &str) -> Result<Option<(u32, u32)>, BtfError> {
    let bitfields = found.info >> 31 == 1;
    for index in 0..found.vlen() {
        let entry = found.data_at + index * 12;
        if btf.string(word(btf.data, entry)?) == member.as_bytes() {
            let offset = word(btf.data, entry + 8)?;
            let bits = if bitfields { offset & 0x00ff_ffff } else { offset };
            return Ok(Some((bits / 8, word(btf.data, entry + 4)?)));
        }
    }
    Ok(None)
}

/// The struct or union type `id` is, through typedefs and qualifiers.
fn composite(btf: &Btf<'_>, mut id: u32) -> Result<Option<BtfType>, BtfError> {
    // Each step goes one typedef or qualifier down: a few at most.
    for _ in 0..16 {
        let Some(found) = btf.get(id)? else { return Ok(None) };
        match found.kind() {
            KIND_STRUCT | KIND_UNION => return Ok(Some(found)),
            KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                id = found.size_or_type;
            }
            _ => return Ok(None),
        }
    }
    Ok(None)
}

/// How many arguments the kernel's BTF-enabled tracepoint `name` passes
/// (its `btf_trace_NAME` prototype, less the leading `void *`), from the
/// BTF at `path`; `None` if the kernel has no such tracepoint.
pub fn tracepoint_arguments(path: &Path, name: &str) -> Result<Option<usize>, BtfError> {
    let data =
        std::fs::read(path).map_err(|source| BtfError::Read { path: path.display().to_string(), source })?;
    let btf = Btf::new(&data)?;
    let typedef = format!("btf_trace_{name}");
    let mut typedefs = btf.types().filter(|found| {
        found
            .as_ref()
            .map_or(true, |found| found.kind() == KIND_TYPEDEF && btf.name(found) == typedef.as_bytes())
    });
    let Some(typedef) = typedefs.next().transpose()? else { return Ok(None) };
    // typedef -> pointer -> function prototype.
    let pointer = btf.get(typedef.size_or_type)?;
    let prototype = match pointer {
        Some(pointer) => btf.get(pointer.size_or_type)?,
        None => None,
    };
    match prototype {
        Some(prototype) if prototype.kind() == KIND_FUNC_PROTO => {
            Ok(Some(prototype.vlen().saturating_sub(1)))
        }
        _ => Err(BtfError::Malformed("a tracepoint's typedef is not a function pointer")),
    }
}

/// Whether enum `name` of the kernel's BTF at `path` has a value named
/// `value`: `bpf_func_id` lists every BPF helper the kernel has.
pub fn enum_has_value(path: &Path, name: &str, value: &str) -> Result<bool, BtfError> {
    let data =
        std::fs::read(path).map_err(|source| BtfError::Read { path: path.display().to_string(), source })?;
    let btf = Btf::new(&data)?;
    for found in btf.types() {
        let found = found?;
        if found.kind() != KIND_ENUM || btf.name(&found) != name.as_bytes() {
            continue;
        }
        for index in 0..found.vlen() {
            if btf.string(word(&data, found.data_at + index * 8)?) == value.as_bytes() {
                return Ok(true);
            }
        }
        return Ok(false);
    }
    Ok(false)
}

const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_TYPE_TAG: u32 = 18;

/// One type of a BTF blob: its common header, and where the data of its
/// kind follows.
struct BtfType {
    name_offset: u32,
    info: u32,
    size_or_type: u32,
    data_at: usize,
}

impl BtfType {
    fn kind(&self) -> u32 {
        (self.info >> 24) & 0x1f
    }

    fn vlen(&self) -> usize {
        (self.info & 0xffff) as usize
    }

    /// Bytes of the kind-specific data that follows the header.
    fn data_len(&self) -> Result<usize, BtfError> {
        let vlen = self.vlen();
        Ok(match self.kind() {
            1 | 14 | 17 => 4,             // int, var, decl_tag
            3 => 12,                      // array
            4 | 5 | 15 | 19 => 12 * vlen, // struct, union, datasec, enum64
            6 | 13 => 8 * vlen,           // enum, func_proto
            2 | 7..=12 | 16 | 18 => 0,
            _ => return Err(BtfError::Malformed("unknown type kind")),
        })
    }
}

/// A BTF blob, whose types are read in id order as they are asked for:
/// each question reads no further than its answer. A kernel's BTF holds
/// over 100,000 types: reading them all for each question (in a debug
/// build) held up the first look at a Python interpreter, which needs
/// the fsbase offset, until after its script's first line had run.
struct Btf<'a> {
    data: &'a [u8],
    first: usize,
    end: usize,
    strings: usize,
}

impl<'a> Btf<'a> {
    fn new(data: &'a [u8]) -> Result<Self, BtfError> {
        if data.get(0..2) != Some(&[0x9f, 0xeb]) {
            return Err(BtfError::Malformed("bad magic"));
        }
        let header_len = word(data, 4)? as usize;
        let first = header_len + word(data, 8)? as usize;
        let end = first + word(data, 12)? as usize;
        let strings = header_len + word(data, 16)? as usize;
        Ok(Self { data, first, end, strings })
    }

    /// The types from id 1 on (id 0 is void, not listed).
    fn types(&self) -> impl Iterator<Item = Result<BtfType, BtfError>> + '_ {
        let mut at = self.first;
        std::iter::from_fn(move || {
            if at >= self.end {
                return None;
            }
            let read = (|| {
                let found = BtfType {
                    name_offset: word(self.data, at)?,
                    info: word(self.data, at + 4)?,
                    size_or_type: word(self.data, at + 8)?,
                    data_at: at + 12,
                };
                Ok((found.data_at + found.data_len()?, found))
            })();
            match read {
                Ok((next, found)) => {
                    at = next;
                    Some(Ok(found))
                }
                Err(error) => {
                    at = self.end;
                    Some(Err(error))
                }
            }
        })
    }

    /// The type of id `id`; `None` for void or past the last.
    fn get(&self, id: u32) -> Result<Option<BtfType>, BtfError> {
        let Some(index) = (id as usize).checked_sub(1) else { return Ok(None) };
        self.types().nth(index).transpose()
    }

    fn name(&self, found: &BtfType) -> &'a [u8] {
        self.string(found.name_offset)
    }

    fn string(&self, offset: u32) -> &'a [u8] {
        let rest = self.data.get(self.strings + offset as usize..).unwrap_or(&[]);
        &rest[..rest.iter().position(|&byte| byte == 0).unwrap_or(rest.len())]
    }
}

fn word(data: &[u8], at: usize) -> Result<u32, BtfError> {
    let bytes = data.get(at..at + 4).ok_or(BtfError::Malformed("truncated"))?;
    Ok(u32::from_le_bytes(bytes.try_into().expect("four bytes")))
}

fn find_member_offset(data: &[u8], structure: &str, member: &str) -> Result<Option<u32>, BtfError> {
    let btf = Btf::new(data)?;
    for found in btf.types() {
        let found = found?;
        if found.kind() != KIND_STRUCT || btf.name(&found) != structure.as_bytes() {
            continue;
        }
        let bitfields = found.info >> 31 == 1;
        for index in 0..found.vlen() {
            let entry = found.data_at + index * 12;
            if btf.string(word(data, entry)?) == member.as_bytes() {
                let offset = word(data, entry + 8)?;
                let bits = if bitfields { offset & 0x00ff_ffff } else { offset };
                return Ok(Some(bits / 8));
            }
        }
    }
    Ok(None)
}

/// The kernel code that refills the BPF memory allocator's caches, which
/// memleak's own maps draw on, with kmalloc: `alloc_bulk`, and `__alloc`
/// where the compiler kept it apart (Debian's arm64 6.12, and x86's
/// 6.18), so that the range runs from one to the other. Both are
/// kernel/bpf/memalloc.c's, whose functions lie together, and those
/// between them free and allocate nothing; so the `__alloc` taken is the
/// one within `MEMALLOC_TEXT` of `alloc_bulk`, not another file's.
pub fn bpf_refill_range(kallsyms: &str) -> Option<Range<u64>> {
    /// Four times memalloc.c's code in Debian's arm64 6.12 (8 KiB, where
    /// `__alloc` lies 3.3 KiB below `alloc_bulk`; 1.9 KiB on x86's 6.18).
    const MEMALLOC_TEXT: u64 = 0x8000;
    let symbols = symbols_by_address(kallsyms);
    let bulk = function_ranges(&symbols, "alloc_bulk").into_iter().next()?;
    let apart = function_ranges(&symbols, "__alloc")
        .into_iter()
        .filter(|single| single.start.abs_diff(bulk.start) < MEMALLOC_TEXT)
        .min_by_key(|single| single.start.abs_diff(bulk.start));
    Some(match apart {
        Some(single) => single.start.min(bulk.start)..single.end.max(bulk.end),
        None => bulk,
    })
}

/// /proc/kallsyms' (address, name) pairs, sorted by address, those
/// hidden (address 0) left out.
fn symbols_by_address(kallsyms: &str) -> Vec<(u64, &str)> {
    let mut symbols: Vec<(u64, &str)> = kallsyms
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let address = u64::from_str_radix(fields.next()?, 16).ok()?;
            let _kind = fields.next()?;
            Some((address, fields.next()?))
        })
        .filter(|(address, _)| *address != 0)
        .collect();
    symbols.sort_unstable();
    symbols
}

/// The address range of each kernel function named `name`, in address
/// order: from its address to the next symbol's. Without a symbol of that
/// name, those of the copies GCC made of it, specialized
/// (`NAME.constprop.0`, `NAME.isra.0`, `NAME.part.0`): a kernel built so
/// has the function under that name alone.
fn function_ranges(symbols: &[(u64, &str)], name: &str) -> Vec<Range<u64>> {
    let clone_of = |symbol: &str| {
        symbol.strip_prefix(name).and_then(|rest| rest.strip_prefix('.')).is_some_and(|suffix| {
            ["constprop.", "isra.", "part."].iter().any(|kind| suffix.starts_with(kind))
        })
    };
    let named = symbols.iter().any(|&(_, symbol)| symbol == name);
    symbols
        .iter()
        .enumerate()
        .filter(|&(_, &(_, symbol))| if named { symbol == name } else { clone_of(symbol) })
        .filter_map(|(index, &(start, _))| {
            let end =
                symbols[index..].iter().map(|&(address, _)| address).find(|&address| address > start)?;
            Some(start..end)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_field_of_the_running_kernel() {
        // struct list_head { next; prev; }: prev is 8 bytes in on 64-bit.
        let offset = member_offset(Path::new(VMLINUX_BTF), "list_head", "prev").expect("BTF readable");
        assert_eq!(offset, 8);
        let missing = member_offset(Path::new(VMLINUX_BTF), "list_head", "nonexistent");
        assert!(matches!(missing, Err(BtfError::NoMember { .. })));
    }

    #[test]
    fn a_nested_field_adds_up_the_offsets_of_the_members_types() {
        let path = Path::new(VMLINUX_BTF);
        let thread = member_offset(path, "task_struct", "thread").unwrap();
        let fsbase = member_offset(path, "thread_struct", "fsbase").unwrap();
        assert_eq!(member_path_offset(path, "task_struct", &["thread", "fsbase"]).unwrap(), thread + fsbase);
        // task->signal is a pointer: no member is followed through it.
        let through_pointer = member_path_offset(path, "task_struct", &["signal", "tty"]);
        assert!(matches!(through_pointer, Err(BtfError::NoMember { .. })), "{through_pointer:?}");
    }

    #[test]
    fn counts_the_arguments_of_the_running_kernels_tracepoints() {
        let path = Path::new(VMLINUX_BTF);
        // sched_process_fork(parent, child) since Linux 4.x.
        assert_eq!(tracepoint_arguments(path, "sched_process_fork").unwrap(), Some(2));
        assert_eq!(tracepoint_arguments(path, "no_such_tracepoint").unwrap(), None);
    }

    #[test]
    fn a_function_ends_where_the_next_symbol_starts() {
        let first = |kallsyms, name| function_ranges(&symbols_by_address(kallsyms), name).into_iter().next();
        let kallsyms =
            "ffffffff81000200 t second\nffffffff81000100 T first\nffffffff81000100 t first_alias\n";
        assert_eq!(first(kallsyms, "first"), Some(0xffff_ffff_8100_0100..0xffff_ffff_8100_0200));
        assert_eq!(first(kallsyms, "missing"), None);
        let cloned = "ffffffff81000300 t alloc_bulk.constprop.0\nffffffff81000400 t free_bulk\n\
                      ffffffff81000100 t alloc_bulk_other\n";
        assert_eq!(first(cloned, "alloc_bulk"), Some(0xffff_ffff_8100_0300..0xffff_ffff_8100_0400));
        assert_eq!(first(cloned, "alloc"), None, "another function, not a copy of it");
    }

    #[test]
    fn the_refill_range_takes_in_the_nearby_alloc_kept_apart() {
        // Debian's arm64 6.12: __alloc, then functions that free, then
        // alloc_bulk; another file's __alloc far away.
        let apart = "ffffdab8f3000000 t __alloc\n\
                     ffffdab8f38d9370 t __alloc\nffffdab8f38d9438 t free_mem_alloc_no_barrier\n\
                     ffffdab8f38da050 t alloc_bulk\nffffdab8f38da3a8 t bpf_mem_refill\n";
        assert_eq!(bpf_refill_range(apart), Some(0xffff_dab8_f38d_9370..0xffff_dab8_f38d_a3a8));
        // x86's 6.1, __alloc inlined: alloc_bulk alone.
        let inlined = "ffffffff81000300 t alloc_bulk\nffffffff81000400 t free_bulk\n";
        assert_eq!(bpf_refill_range(inlined), Some(0xffff_ffff_8100_0300..0xffff_ffff_8100_0400));
        assert_eq!(bpf_refill_range("ffffffff81000300 t __alloc\n"), None);
    }
}
