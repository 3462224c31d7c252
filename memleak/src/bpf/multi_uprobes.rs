//! Multi-uprobe links (`BPF_TRACE_UPROBE_MULTI`, Linux 6.6): all of one
//! object's sites for one program in a single link, made and taken out
//! in one `bpf()` call each. A perf-event uprobe costs the kernel a
//! synchronisation on removal, about 0.1 s each, so a process's 23 of
//! them took over two seconds to detach; a link takes one.
//!
//! aya 0.14 can neither load a uprobe program with the expected attach
//! type such links require nor make them. memleak therefore loads its
//! uprobe programs itself: from its BPF object parsed again with
//! `aya-obj` (aya's own parser), relocated against the maps aya created,
//! so that both see the same maps.

use std::{
    collections::{HashMap, HashSet},
    ffi::{CStr, CString},
    io,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    path::Path,
};

use aya::{maps::MapData, Ebpf};
use aya_obj::btf::BtfFeatures;

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

/// Set, memleak attaches one perf-event uprobe per site even where the
/// kernel has multi-uprobe links: to test that way on a new kernel.
pub const PERF_EVENT_UPROBES: &str = "MEMLEAK_PERF_EVENT_UPROBES";

/// The head of `union bpf_attr` for `BPF_PROG_LOAD`: the kernel reads
/// only the size it is given and treats the rest as zero. These structs
/// have no padding: the kernel would read its bytes, which are undefined.
#[repr(C)]
#[derive(Default)]
struct ProgramLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
}

/// `union bpf_attr` for `BPF_BTF_LOAD`.
#[repr(C)]
#[derive(Default)]
struct BtfLoad {
    btf: u64,
    log_buf: u64,
    size: u32,
    log_size: u32,
    log_level: u32,
    log_true_size: u32,
}

/// `union bpf_attr` for `BPF_LINK_CREATE` of a multi-uprobe link.
#[repr(C)]
#[derive(Default)]
struct UprobeMultiLink {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    link_flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    count: u32,
    flags: u32,
    pid: u32,
    _pad: u32,
}

/// `union bpf_attr` for `BPF_MAP_UPDATE_ELEM`.
#[repr(C)]
#[derive(Default)]
struct MapUpdate {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

fn bpf<T>(command: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `repr(C)` head of `union
    // bpf_attr` for `command`, passed with its exact size; every pointer
    // in it points at memory that outlives the call.
    let result = unsafe {
        libc::syscall(libc::SYS_bpf, command, std::ptr::from_mut(attr).cast::<libc::c_void>(), size_of::<T>())
    };
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// A descriptor a successful `bpf()` call returned.
fn bpf_fd<T>(command: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    let fd = RawFd::try_from(bpf(command, attr)?).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this descriptor to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn address<T>(items: &[T]) -> u64 {
    items.as_ptr() as u64
}

/// Whether this kernel makes multi-uprobe links, asked the way libbpf
/// asks: a trivial program loaded for them, linked to `/`. A kernel that
/// has them refuses `/` as no regular file (EBADF); one that does not
/// refuses the attach type (EINVAL).
pub fn supported() -> bool {
    // r0 = 0; exit
    let instructions: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];
    let Ok(program) = load(&instructions, c"GPL", "probe", None, &[], &[]) else { return false };
    let offsets = [0_u64];
    let error = link(&program, c"/", &offsets, &[], None, false).err();
    error.and_then(|error| error.raw_os_error()) == Some(libc::EBADF)
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot parse memleak's BPF object again: {0}")]
    Parse(#[from] aya_obj::ParseError),
    #[error("cannot relocate memleak's BPF object: {0}")]
    Relocate(#[from] aya_obj::relocation::EbpfRelocationError),
    #[error("the BPF object's type information: {0}")]
    Btf(#[from] aya_obj::btf::BtfError),
    #[error("the kernel refused the BPF object's type information: {0}")]
    BtfRefused(io::Error),
    #[error("aya did not create map {0}")]
    MissingMap(String),
    #[error("the object lacks program {0}")]
    MissingProgram(&'static str),
    #[error("the kernel rejected BPF program `{program}`: {source}{log}")]
    Verifier { program: &'static str, source: io::Error, log: String },
}

/// memleak's uprobe programs, loaded for multi-uprobe links.
pub struct MultiUprobePrograms {
    programs: HashMap<&'static str, OwnedFd>,
    /// The object's type information the programs were loaded with.
    _btf: Option<OwnedFd>,
}

impl MultiUprobePrograms {
    /// Loads `names` from `object`, whose maps aya has created in `ebpf`.
    /// Nothing is relocated against the kernel's types: memleak's BPF code
    /// reads kernel structures at offsets given as tunables, not by CO-RE.
    pub fn load(object: &[u8], ebpf: &Ebpf, names: &[&'static str]) -> Result<Self, LoadError> {
        let mut object = aya_obj::Object::parse(object)?;
        let maps = object
            .maps
            .iter()
            .map(|(name, map)| {
                let fd = ebpf.map(name).map(map_data).ok_or_else(|| LoadError::MissingMap(name.clone()))?;
                Ok((name.clone(), fd.fd().as_fd().as_raw_fd(), map.clone()))
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let text_sections: HashSet<usize> = object.functions.keys().map(|(section, _)| *section).collect();
        object.relocate_maps(maps.iter().map(|(name, fd, map)| (name.as_str(), *fd, map)), &text_sections)?;
        object.relocate_calls(&text_sections)?;
        // Every kernel with multi-uprobe links has every BTF feature.
        let features = BtfFeatures::new(true, true, true, true, true, true, true, true);
        let btf = match object.fixup_and_sanitize_btf(&features)? {
            Some(btf) => Some(load_btf(&btf.to_bytes()).map_err(LoadError::BtfRefused)?),
            None => None,
        };
        let mut programs = HashMap::new();
        for &name in names {
            let program = object.programs.get(name).ok_or(LoadError::MissingProgram(name))?;
            let function = &object.functions[&program.function_key()];
            let instructions: Vec<u64> =
                function.instructions.iter().copied().map(instruction_bits).collect();
            let loading = std::time::Instant::now();
            let fd = load(
                &instructions,
                &program.license,
                name,
                btf.as_ref().map(|btf| (btf, function)),
                &function.func_info.func_info_bytes(),
                &function.line_info.line_info_bytes(),
            )
            .map_err(|(source, log)| LoadError::Verifier { program: name, source, log })?;
            log::debug!("{name} verified and loaded in {} ms", loading.elapsed().as_millis());
            programs.insert(name, fd);
        }
        Ok(Self { programs, _btf: btf })
    }

    /// Every program loaded, by name.
    pub fn programs(&self) -> impl Iterator<Item = (&'static str, &OwnedFd)> {
        self.programs.iter().map(|(name, fd)| (*name, fd))
    }

    pub fn program(&self, name: &'static str) -> Option<&OwnedFd> {
        self.programs.get(name)
    }
}

/// The descriptor of a map aya made, whatever its kind.
fn map_data(map: &aya::maps::Map) -> &MapData {
    use aya::maps::Map;
    match map {
        Map::Array(data)
        | Map::ArrayOfMaps(data)
        | Map::BloomFilter(data)
        | Map::CgroupArray(data)
        | Map::CgroupStorage(data)
        | Map::CgrpStorage(data)
        | Map::CpuMap(data)
        | Map::DevMap(data)
        | Map::DevMapHash(data)
        | Map::HashMap(data)
        | Map::HashOfMaps(data)
        | Map::InodeStorage(data)
        | Map::LpmTrie(data)
        | Map::LruHashMap(data)
        | Map::PerCpuArray(data)
        | Map::PerCpuCgroupStorage(data)
        | Map::PerCpuHashMap(data)
        | Map::PerCpuLruHashMap(data)
        | Map::PerfEventArray(data)
        | Map::ProgramArray(data)
        | Map::Queue(data)
        | Map::ReusePortSockArray(data)
        | Map::RingBuf(data)
        | Map::SockHash(data)
        | Map::SockMap(data)
        | Map::SkStorage(data)
        | Map::Stack(data)
        | Map::StackTraceMap(data)
        | Map::Unsupported(data)
        | Map::XskMap(data) => data,
    }
}

/// One BPF instruction as the kernel reads it: opcode, registers,
/// offset and immediate in eight little-endian bytes.
fn instruction_bits(instruction: aya_obj::generated::bpf_insn) -> u64 {
    let registers = u64::from(instruction.dst_reg()) | (u64::from(instruction.src_reg()) << 4);
    #[expect(clippy::cast_sign_loss, reason = "the fields' bits, as they are")]
    let offset = u64::from(instruction.off as u16);
    #[expect(clippy::cast_sign_loss, reason = "the fields' bits, as they are")]
    let immediate = u64::from(instruction.imm as u32);
    u64::from(instruction.code) | (registers << 8) | (offset << 16) | (immediate << 32)
}

fn load_btf(btf: &[u8]) -> io::Result<OwnedFd> {
    let mut attr = BtfLoad {
        btf: address(btf),
        size: u32::try_from(btf.len()).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
        ..BtfLoad::default()
    };
    bpf_fd(BPF_BTF_LOAD, &mut attr)
}

/// Loads one program for multi-uprobe links; on failure, the error and
/// the end of the verifier's log.
fn load(
    instructions: &[u64],
    license: &CStr,
    name: &str,
    btf: Option<(&OwnedFd, &aya_obj::Function)>,
    func_info: &[u8],
    line_info: &[u8],
) -> Result<OwnedFd, (io::Error, String)> {
    let mut prog_name = [0_u8; 16];
    // The kernel keeps 15 bytes of a name and its NUL.
    for (slot, byte) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *slot = byte;
    }
    let count = |bytes: &[u8], record: usize| u32::try_from(bytes.len() / record.max(1)).unwrap_or(0);
    let mut attr = ProgramLoad {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: u32::try_from(instructions.len()).unwrap_or(u32::MAX),
        insns: address(instructions),
        license: license.as_ptr() as u64,
        prog_name,
        expected_attach_type: BPF_TRACE_UPROBE_MULTI,
        ..ProgramLoad::default()
    };
    if let Some((btf, function)) = btf {
        attr.prog_btf_fd = btf.as_raw_fd().cast_unsigned();
        attr.func_info_rec_size = u32::try_from(function.func_info_rec_size).unwrap_or(0);
        attr.func_info = address(func_info);
        attr.func_info_cnt = count(func_info, function.func_info_rec_size);
        attr.line_info_rec_size = u32::try_from(function.line_info_rec_size).unwrap_or(0);
        attr.line_info = address(line_info);
        attr.line_info_cnt = count(line_info, function.line_info_rec_size);
    }
    match bpf_fd(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(fd),
        Err(error) => {
            // Again with the verifier's log, to say why.
            let mut log = vec![0_u8; 1 << 20];
            attr.log_level = 1;
            attr.log_size = u32::try_from(log.len()).unwrap_or(0);
            attr.log_buf = address(&log);
            let _ = bpf_fd(BPF_PROG_LOAD, &mut attr);
            log.truncate(log.iter().position(|&byte| byte == 0).unwrap_or(log.len()));
            let text = String::from_utf8_lossy(&log);
            let lines: Vec<&str> = text.lines().collect();
            let tail =
                lines[lines.len().saturating_sub(20)..].iter().fold(String::new(), |mut tail, line| {
                    tail.push('\n');
                    tail.push_str(line);
                    tail
                });
            Err((error, tail))
        }
    }
}

/// Attaches `program` at `offsets` of the file at `path` (each with its
/// cookie, or none), for process `pid` only or for every process, on
/// entry or on return. Closing the link detaches every probe at once.
pub fn link(
    program: &OwnedFd,
    path: &CStr,
    offsets: &[u64],
    cookies: &[u64],
    pid: Option<u32>,
    on_return: bool,
) -> io::Result<OwnedFd> {
    debug_assert!(cookies.is_empty() || cookies.len() == offsets.len());
    let mut attr = UprobeMultiLink {
        prog_fd: program.as_raw_fd().cast_unsigned(),
        attach_type: BPF_TRACE_UPROBE_MULTI,
        path: path.as_ptr() as u64,
        offsets: address(offsets),
        cookies: if cookies.is_empty() { 0 } else { address(cookies) },
        count: u32::try_from(offsets.len()).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
        flags: if on_return { BPF_F_UPROBE_MULTI_RETURN } else { 0 },
        pid: pid.unwrap_or(0),
        ..UprobeMultiLink::default()
    };
    bpf_fd(BPF_LINK_CREATE, &mut attr)
}

/// Puts `program` at `index` of the program array `map`, for tail calls.
pub fn set_tail_call(map: &aya::maps::Map, index: u32, program: &OwnedFd) -> io::Result<()> {
    let map = map_data(map);
    let value = program.as_raw_fd().cast_unsigned();
    let mut attr = MapUpdate {
        map_fd: map.fd().as_fd().as_raw_fd().cast_unsigned(),
        key: std::ptr::from_ref(&index) as u64,
        value: std::ptr::from_ref(&value) as u64,
        ..MapUpdate::default()
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(|_| ())
}

/// The path as the kernel takes it.
pub fn c_path(path: &Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt as _;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}
