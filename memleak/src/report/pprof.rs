//! pprof's profile.proto, gzipped: what `go tool pprof`, Pyroscope, Parca
//! and speedscope read. Encoded by hand: the format needs only varints
//! and length-delimited fields, which is less code than a protobuf
//! dependency and its build step.
//!
//! Sample types are `inuse_objects` and `inuse_space` (outstanding count and
//! bytes), after `alloc_objects` and `alloc_space` (made since attach, freed
//! or not) when every stack has them. Frames sharing an address (a function and what was inlined
//! into it) become one Location with several Lines, innermost first, as
//! pprof expects.

use std::{
    borrow::Borrow,
    collections::HashMap,
    io::{self, Write},
};

use flate2::{write::GzEncoder, Compression};

use super::{diff::Diff, Report};
use crate::model::{Frame, FrameKind, ModuleMapping, Workload};

/// What a profile is made of, from a report (frames `Frame`) or from a
/// diff (frames shared, `Arc<Frame>`).
struct Profile<'a, F> {
    /// (type, unit) of each value of a sample.
    sample_types: Vec<(&'static str, &'static str)>,
    /// One part per process: a report's profile has one.
    parts: Vec<Part<'a, F>>,
    time_unix_ms: u64,
    /// The period between the profiles a diff compares, in ns.
    duration_ns: u64,
    /// One allocation in this many was recorded (values are scaled up).
    sample_rate: u32,
    /// The sample type a viewer shows first: one of `sample_types`.
    default_sample_type: &'static str,
}

/// Which profile Go's `net/http/pprof` serves at a path: the same samples,
/// another sample type shown first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// `/debug/pprof/heap`: `inuse_space`, what is outstanding.
    Heap,
    /// `/debug/pprof/allocs`: `alloc_space`, all that was allocated, when
    /// the profile has it.
    Allocs,
}

/// One process's samples in a profile, with the mappings its addresses
/// fall in and the labels each of its samples carries.
struct Part<'a, F> {
    /// Frames innermost first, and one value per sample type.
    samples: Vec<(&'a [F], Vec<i64>)>,
    /// The main binary first: pprof takes the first mapping for it.
    mappings: Vec<&'a ModuleMapping>,
    labels: &'a [(String, String)],
}

/// A process's report and the labels its samples get in a profile of
/// several processes (`render_labelled`).
pub struct Labelled<'a> {
    pub report: &'a Report,
    /// (key, value): pprof string labels, which Pyroscope turns into the
    /// labels of the series a sample goes to.
    pub labels: Vec<(String, String)>,
}

const INUSE: [(&str, &str); 2] = [("inuse_objects", "count"), ("inuse_space", "bytes")];
const ALLOC: [(&str, &str); 2] = [("alloc_objects", "count"), ("alloc_space", "bytes")];

pub fn render(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    render_as(report, View::Heap, out)
}

/// `render`, with `view`'s sample type shown first.
pub fn render_as(report: &Report, view: View, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    write_gzipped(&encode_labelled(&[Labelled { report, labels: labels_of(report) }], view), out)
}

/// The growth between two snapshots as a profile whose values are the
/// changes, negative where a stack shrank: what `go tool pprof
/// -diff_base` shows.
pub fn render_diff(diff: &Diff, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let profile = Profile {
        sample_types: INUSE.to_vec(),
        parts: vec![Part {
            samples: diff
                .stacks
                .iter()
                .map(|stack| (&stack.frames[..], vec![stack.delta_allocations, stack.delta_bytes]))
                .collect(),
            mappings: main_binary_first(&diff.modules, &diff.new.program),
            labels: &[],
        }],
        time_unix_ms: diff.new.time_unix_ms,
        duration_ns: diff.new.time_unix_ms.saturating_sub(diff.base.time_unix_ms).saturating_mul(1_000_000),
        sample_rate: 1,
        default_sample_type: "inuse_space",
    };
    write_gzipped(&encode(&profile), out)
}

/// The uncompressed profile.proto message of a report.
#[cfg(test)]
pub fn encode_report(report: &Report) -> Vec<u8> {
    encode_labelled(&[Labelled { report, labels: labels_of(report) }], View::Heap)
}

/// The labels of a report's samples: its process's pid and program and,
/// from `memleak serve`, its container's and pod's, so that a profile
/// merged with others (Pyroscope splits series by them) still says whose
/// each sample is.
pub fn labels_of(report: &Report) -> Vec<(String, String)> {
    let process = [("pid", report.pid.to_string()), ("program", report.program.clone())];
    let workload =
        report.workload.iter().flat_map(Workload::labels).map(|(name, value)| (name, value.to_owned()));
    process.into_iter().chain(workload).map(|(name, value)| (name.to_owned(), value)).collect()
}

/// One profile of several processes' reports, each sample labelled with
/// its process's labels: what a scraper of a whole node reads, and
/// Pyroscope splits into a series per process. Each process keeps
/// mappings and locations of its own, as its addresses mean nothing in
/// another's address space.
pub fn render_labelled(reports: &[Labelled], view: View, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    write_gzipped(&encode_labelled(reports, view), out)
}

fn encode_labelled(reports: &[Labelled], view: View) -> Vec<u8> {
    // alloc_* only when every stack has them: mmap regions do not.
    let stacks = || reports.iter().flat_map(|labelled| &labelled.report.stacks);
    let with_allocated = stacks().next().is_some() && stacks().all(|stack| stack.allocated.is_some());
    let sample_types =
        if with_allocated { ALLOC.iter().chain(&INUSE).copied().collect() } else { INUSE.to_vec() };
    let parts = reports
        .iter()
        .map(|Labelled { report, labels }| Part {
            samples: report
                .stacks
                .iter()
                .map(|stack| {
                    let allocated = stack.allocated.filter(|_| with_allocated);
                    let values =
                        allocated.into_iter().flat_map(|allocated| [allocated.count, allocated.bytes]);
                    let values =
                        values.chain([stack.allocations, stack.bytes]).map(|value| value as i64).collect();
                    (&stack.frames[..], values)
                })
                .collect(),
            mappings: main_binary_first(&report.modules, &report.program),
            labels,
        })
        .collect();
    let profile = Profile {
        sample_types,
        parts,
        time_unix_ms: reports.iter().map(|labelled| labelled.report.time_unix_ms).max().unwrap_or(0),
        duration_ns: 0,
        // One session records every process at one rate.
        sample_rate: reports.first().map_or(1, |labelled| labelled.report.sample_rate),
        default_sample_type: if view == View::Allocs && with_allocated {
            "alloc_space"
        } else {
            "inuse_space"
        },
    };
    encode(&profile)
}

fn write_gzipped(profile: &[u8], out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
    gzip.write_all(profile)?;
    out.write_all(&gzip.finish()?)
}

fn main_binary_first<'a>(modules: &'a [ModuleMapping], program: &str) -> Vec<&'a ModuleMapping> {
    let mut mappings: Vec<&ModuleMapping> = modules.iter().collect();
    mappings.sort_by_key(|mapping| (mapping.path != program, mapping.start));
    mappings
}

/// The profile.proto message of `input`. Strings, functions and
/// locations are numbered in the order they are first met, so the same
/// input always makes the same bytes.
fn encode<F: Borrow<Frame>>(input: &Profile<F>) -> Vec<u8> {
    let mut encoder = Encoder::default();
    let mut profile = Vec::new();
    for &(kind, unit) in &input.sample_types {
        let value_type = encoder.value_type(kind, unit);
        field_bytes(&mut profile, 1, &value_type); // sample_type
    }
    let mut first_mapping_id = 1;
    for (index, part) in input.parts.iter().enumerate() {
        encoder.part = index;
        encoder.mappings = &part.mappings;
        encoder.first_mapping_id = first_mapping_id;
        let labels = encoder.labels(part.labels);
        for (frames, values) in &part.samples {
            let sample = encoder.sample(frames, values, &labels);
            field_bytes(&mut profile, 2, &sample); // sample
        }
        first_mapping_id += part.mappings.len() as u64;
    }
    let mut mapping_id = 1;
    for part in &input.parts {
        for mapping in &part.mappings {
            let message = encoder.mapping(mapping_id, mapping);
            field_bytes(&mut profile, 3, &message); // mapping
            mapping_id += 1;
        }
    }
    for location in &encoder.location_messages {
        field_bytes(&mut profile, 4, location);
    }
    for function in &encoder.function_messages {
        field_bytes(&mut profile, 5, function);
    }
    field_varint(&mut profile, 9, input.time_unix_ms.saturating_mul(1_000_000)); // time_nanos
    if input.duration_ns > 0 {
        field_varint(&mut profile, 10, input.duration_ns); // duration_nanos
    }
    // As Go's heap profiles say it: what the samples count, and how often.
    let period_type = encoder.value_type("space", "bytes");
    field_bytes(&mut profile, 11, &period_type); // period_type
    field_varint(&mut profile, 12, u64::from(input.sample_rate.max(1))); // period
    let default_type = encoder.strings.index(input.default_sample_type);
    field_varint(&mut profile, 14, default_type); // default_sample_type
    for string in &encoder.strings.table {
        field_bytes(&mut profile, 6, string.as_bytes()); // string_table
    }
    profile
}

/// A location: the part it is of, its address and its (function id,
/// line) lines.
type LocationKey = (usize, u64, Vec<(u64, i64)>);

/// The tables a profile's samples point into, built as samples are met.
#[derive(Default)]
struct Encoder<'a> {
    /// The part whose samples are being encoded.
    part: usize,
    /// Its mappings, main binary first; ids are their places, from
    /// `first_mapping_id`.
    mappings: &'a [&'a ModuleMapping],
    first_mapping_id: u64,
    strings: Strings,
    /// Function ids by (name, file, kind).
    functions: HashMap<(String, String, FrameKind), u64>,
    /// Location ids by part, address and (function id, line) lines.
    locations: HashMap<LocationKey, u64>,
    function_messages: Vec<Vec<u8>>,
    location_messages: Vec<Vec<u8>>,
}

impl Encoder<'_> {
    /// A `ValueType` message: (type, unit).
    fn value_type(&mut self, kind: &str, unit: &str) -> Vec<u8> {
        let mut value_type = Vec::new();
        field_varint(&mut value_type, 1, self.strings.index(kind));
        field_varint(&mut value_type, 2, self.strings.index(unit));
        value_type
    }

    /// The Label messages of (key, value) string labels.
    fn labels(&mut self, labels: &[(String, String)]) -> Vec<Vec<u8>> {
        labels
            .iter()
            .map(|(key, value)| {
                let mut label = Vec::new();
                field_varint(&mut label, 1, self.strings.index(key));
                field_varint(&mut label, 2, self.strings.index(value));
                label
            })
            .collect()
    }

    /// A Sample message: its locations, innermost first, its values and
    /// its labels.
    fn sample<F: Borrow<Frame>>(&mut self, frames: &[F], values: &[i64], labels: &[Vec<u8>]) -> Vec<u8> {
        // Frames of one address are consecutive: the inlined ones, then
        // the function that holds them. A recursive call returns to the
        // same address twice, and Python frames have none: each is a
        // location of its own.
        let location_ids: Vec<u64> = frames
            .chunk_by(|a, b| a.borrow().inlined && a.borrow().address == b.borrow().address)
            .map(|at_address| self.location_id(at_address))
            .collect();
        let mut sample = Vec::new();
        field_packed(&mut sample, 1, &location_ids);
        // int64 values: a negative one is its two's complement, as protobuf
        // encodes int64.
        let values: Vec<u64> = values.iter().map(|&value| value as u64).collect();
        field_packed(&mut sample, 2, &values);
        for label in labels {
            field_bytes(&mut sample, 3, label);
        }
        sample
    }

    /// The id of the location of frames sharing one address, numbered the
    /// first time it is met.
    fn location_id<F: Borrow<Frame>>(&mut self, frames_at_address: &[F]) -> u64 {
        let address = frames_at_address[0].borrow().address;
        // An address with no symbol gets no Line: the location stays a bare
        // address in its mapping, which pprof shows as such.
        let lines: Vec<(u64, i64)> = frames_at_address
            .iter()
            .map(Borrow::<Frame>::borrow)
            .filter_map(|frame| Some((frame, frame.function.as_deref()?)))
            .map(|(frame, name)| {
                let file = frame.file.as_deref().or(frame.module.as_deref()).unwrap_or_default();
                (self.function_id(name, file, frame.kind), i64::from(frame.line.unwrap_or(0)))
            })
            .collect();
        let key = (self.part, address, lines);
        if let Some(&id) = self.locations.get(&key) {
            return id;
        }
        let lines = &key.2;
        let id = self.locations.len() as u64 + 1;
        let mut location = Vec::new();
        field_varint(&mut location, 1, id);
        let mapping = self.mappings.iter().position(|m| m.start <= address && address < m.end);
        if let Some(index) = mapping {
            field_varint(&mut location, 2, self.first_mapping_id + index as u64);
        }
        field_varint(&mut location, 3, address);
        for (function_id, line) in lines {
            let mut line_message = Vec::new();
            field_varint(&mut line_message, 1, *function_id);
            field_varint(&mut line_message, 2, *line as u64);
            field_bytes(&mut location, 4, &line_message);
        }
        self.location_messages.push(location);
        self.locations.insert(key, id);
        id
    }

    /// The id of function `name` in `file`, numbered the first time it is
    /// met.
    ///
    /// A Python function has no system name: pprof takes a function whose
    /// system name is its name and holds `<`, `>`, `[`, `]` or `::` for
    /// demangled C++, and simplifies it by dropping what lies between `<`
    /// and `>`, which would leave `<module>`, `<lambda>` and `<listcomp>`
    /// nameless.
    fn function_id(&mut self, name: &str, file: &str, kind: FrameKind) -> u64 {
        let key = (name.to_owned(), file.to_owned(), kind);
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let mut function = Vec::new();
        field_varint(&mut function, 1, id);
        field_varint(&mut function, 2, self.strings.index(name));
        if kind == FrameKind::Native {
            field_varint(&mut function, 3, self.strings.index(name));
        }
        field_varint(&mut function, 4, self.strings.index(file));
        self.function_messages.push(function);
        self.functions.insert(key, id);
        id
    }

    /// The Mapping message of mapping `id`.
    fn mapping(&mut self, id: u64, mapping: &ModuleMapping) -> Vec<u8> {
        let mut message = Vec::new();
        field_varint(&mut message, 1, id);
        field_varint(&mut message, 2, mapping.start);
        field_varint(&mut message, 3, mapping.end);
        field_varint(&mut message, 4, mapping.file_offset);
        field_varint(&mut message, 5, self.strings.index(&mapping.path));
        if let Some(build_id) = &mapping.build_id {
            field_varint(&mut message, 6, self.strings.index(build_id));
        }
        // Already symbolized: pprof must not look for the binaries.
        for has in [7, 8, 9, 10] {
            field_varint(&mut message, has, 1);
        }
        message
    }
}

/// pprof's string table: index 0 is the empty string.
struct Strings {
    table: Vec<String>,
    index: HashMap<String, u64>,
}

impl Default for Strings {
    fn default() -> Self {
        Self { table: vec![String::new()], index: HashMap::from([(String::new(), 0)]) }
    }
}

impl Strings {
    fn index(&mut self, text: &str) -> u64 {
        if let Some(&index) = self.index.get(text) {
            return index;
        }
        let index = self.table.len() as u64;
        self.table.push(text.to_owned());
        self.index.insert(text.to_owned(), index);
        index
    }
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(low_byte(value) | 0x80);
        value >>= 7;
    }
    out.push(low_byte(value));
}

/// The low 7 bits of `value`, and the eighth.
fn low_byte(value: u64) -> u8 {
    (value & 0xff) as u8
}

fn field_varint(out: &mut Vec<u8>, field: u64, value: u64) {
    varint(out, field << 3);
    varint(out, value);
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn field_packed(out: &mut Vec<u8>, field: u64, values: &[u64]) {
    let mut packed = Vec::new();
    for &value in values {
        varint(&mut packed, value);
    }
    field_bytes(out, field, &packed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
    }

    /// A message's fields as (number, varint value), for messages of
    /// varints only.
    fn varint_fields(message: &[u8]) -> Vec<(u64, u64)> {
        let mut values = Vec::new();
        let (mut value, mut shift) = (0, 0);
        for &byte in message {
            value |= u64::from(byte & 0x7f) << shift;
            shift += 7;
            if byte < 0x80 {
                values.push(value);
                (value, shift) = (0, 0);
            }
        }
        values.chunks(2).map(|pair| (pair[0] >> 3, pair[1])).collect()
    }

    #[test]
    fn python_functions_have_no_system_name_for_pprof_to_simplify() {
        let mut encoder = Encoder::default();
        encoder.function_id("<module>", "/app/svc.py", FrameKind::Python);
        encoder.function_id("std::vector<int>::push_back", "/src/a.cpp", FrameKind::Native);
        let fields: Vec<Vec<u64>> = encoder
            .function_messages
            .iter()
            .map(|message| varint_fields(message).iter().map(|&(field, _)| field).collect())
            .collect();
        assert_eq!(fields, [vec![1, 2, 4], vec![1, 2, 3, 4]]);
        assert_eq!(encoder.strings.table[1], "<module>");
    }

    /// A message's fields as (number, value): a varint's value, or a
    /// length-delimited field's bytes.
    fn fields(mut message: &[u8]) -> Vec<(u64, Result<u64, &[u8]>)> {
        let varint = |message: &mut &[u8]| {
            let (mut value, mut shift) = (0, 0);
            loop {
                let (&byte, rest) = message.split_first().expect("a whole varint");
                *message = rest;
                value |= u64::from(byte & 0x7f) << shift;
                shift += 7;
                if byte < 0x80 {
                    return value;
                }
            }
        };
        let mut fields = Vec::new();
        while !message.is_empty() {
            let key = varint(&mut message);
            if key & 7 == 2 {
                let length = usize::try_from(varint(&mut message)).unwrap();
                fields.push((key >> 3, Err(&message[..length])));
                message = &message[length..];
            } else {
                fields.push((key >> 3, Ok(varint(&mut message))));
            }
        }
        fields
    }

    /// The varint field `number` of a message.
    fn varint_of(message: &[u8], number: u64) -> Option<u64> {
        fields(message).into_iter().find_map(|(field, value)| value.ok().filter(|_| field == number))
    }

    /// The submessages in field `number`.
    fn messages(message: &[u8], number: u64) -> Vec<&[u8]> {
        fields(message)
            .into_iter()
            .filter(|&(field, _)| field == number)
            .filter_map(|(_, v)| v.err())
            .collect()
    }

    #[test]
    fn a_profile_of_several_processes_labels_each_sample_and_keeps_each_process_s_addresses_apart() {
        // Two processes at the same addresses in different programs.
        let report_of = |pid: u32, program: &str| {
            let mut report = sample_report(10);
            report.pid = pid;
            program.clone_into(&mut report.program);
            report.modules = vec![ModuleMapping {
                start: 0x0040_0000,
                end: 0x0050_0000,
                file_offset: 0,
                path: program.to_owned(),
                build_id: None,
            }];
            report
        };
        let (first, second) = (report_of(1, "/app/a"), report_of(2, "/app/b"));
        let profile = encode_labelled(
            &[
                Labelled { report: &first, labels: labels_of("1", "/app/a") },
                Labelled { report: &second, labels: labels_of("2", "/app/b") },
            ],
            View::Heap,
        );
        let strings: Vec<String> =
            messages(&profile, 6).iter().map(|text| String::from_utf8_lossy(text).into_owned()).collect();
        let text = |index: Option<u64>| strings[usize::try_from(index.unwrap()).unwrap()].clone();
        // Each sample's labels, as (key, value) texts, and the mappings of
        // its locations.
        let locations: HashMap<u64, Option<u64>> = messages(&profile, 4)
            .iter()
            .map(|location| (varint_of(location, 1).unwrap(), varint_of(location, 2)))
            .collect();
        let samples: Vec<(Labels, Vec<u64>)> = messages(&profile, 2)
            .iter()
            .map(|sample| {
                let labels = messages(sample, 3)
                    .iter()
                    .map(|label| (text(varint_of(label, 1)), text(varint_of(label, 2))))
                    .collect();
                // Addresses outside every mapping ([stack lost]) have none.
                let ids = packed_varints(messages(sample, 1)[0]);
                let mut mappings: Vec<u64> = ids.iter().filter_map(|id| locations[id]).collect();
                mappings.dedup();
                (labels, mappings)
            })
            .collect();
        let per_process = first.stacks.len();
        assert_eq!(samples.len(), 2 * per_process);
        for (index, (labels, mappings)) in samples.iter().enumerate() {
            let (pid, program, mapping) =
                if index < per_process { ("1", "/app/a", 1) } else { ("2", "/app/b", 2) };
            assert_eq!(labels, &labels_of(pid, program), "sample {index}");
            assert!(mappings.iter().all(|&id| id == mapping), "sample {index}: its own process's mapping");
        }
        let mapping_paths: Vec<(Option<u64>, String)> = messages(&profile, 3)
            .iter()
            .map(|mapping| (varint_of(mapping, 1), text(varint_of(mapping, 5))))
            .collect();
        assert_eq!(mapping_paths, [(Some(1), "/app/a".to_owned()), (Some(2), "/app/b".to_owned())]);
    }

    fn packed_varints(packed: &[u8]) -> Vec<u64> {
        let mut values = Vec::new();
        let (mut value, mut shift) = (0, 0);
        for &byte in packed {
            value |= u64::from(byte & 0x7f) << shift;
            shift += 7;
            if byte < 0x80 {
                values.push(value);
                (value, shift) = (0, 0);
            }
        }
        values
    }

    type Labels = Vec<(String, String)>;

    fn labels_of(pid: &str, program: &str) -> Labels {
        vec![("pid".to_owned(), pid.to_owned()), ("program".to_owned(), program.to_owned())]
    }

    #[test]
    fn the_profile_holds_the_sample_types_and_names() {
        let profile = encode_report(&sample_report(10));
        let text = String::from_utf8_lossy(&profile);
        for name in ["inuse_objects", "inuse_space", "count", "bytes", "fibonacci", "child", "/src/leaker.c"]
        {
            assert!(text.contains(name), "{name} is in the string table");
        }
        let mut gzipped = Vec::new();
        render(&sample_report(10), &mut gzipped).unwrap();
        assert_eq!(&gzipped[..2], [0x1f, 0x8b], "gzip magic");
    }
}
