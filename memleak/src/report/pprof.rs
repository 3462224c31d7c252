//! pprof's profile.proto, gzipped: what `go tool pprof`, Pyroscope, Parca
//! and speedscope read. Encoded by hand: the format needs only varints
//! and length-delimited fields, which is less code than a protobuf
//! dependency and its build step.
//!
//! Sample types are inuse_objects and inuse_space (outstanding count and
//! bytes), after alloc_objects and alloc_space (made since attach, freed
//! or not) when every stack has them. Frames sharing an address (a function and what was inlined
//! into it) become one Location with several Lines, innermost first, as
//! pprof expects.

use std::{
    collections::HashMap,
    io::{self, Write},
};

use flate2::{write::GzEncoder, Compression};

use super::{diff::Diff, Report};
use crate::model::{Frame, ModuleMapping};

/// What a profile is made of, from a report or from a diff.
struct Profile<'a> {
    /// (type, unit) of each value of a sample.
    sample_types: Vec<(&'static str, &'static str)>,
    /// Frames innermost first, and one value per sample type.
    samples: Vec<(&'a [Frame], Vec<i64>)>,
    /// The main binary first: pprof takes the first mapping for it.
    mappings: Vec<&'a ModuleMapping>,
    time_unix_ms: u64,
    /// The period between the profiles a diff compares, in ns.
    duration_ns: u64,
    /// One allocation in this many was recorded (values are scaled up).
    sample_rate: u32,
}

const INUSE: [(&str, &str); 2] = [("inuse_objects", "count"), ("inuse_space", "bytes")];
const ALLOC: [(&str, &str); 2] = [("alloc_objects", "count"), ("alloc_space", "bytes")];

pub fn render(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    write_gzipped(&encode_report(report), out)
}

/// The growth between two snapshots as a profile whose values are the
/// changes, negative where a stack shrank: what `go tool pprof
/// -diff_base` shows.
pub fn render_diff(diff: &Diff, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let profile = Profile {
        sample_types: INUSE.to_vec(),
        samples: diff
            .stacks
            .iter()
            .map(|stack| (&stack.frames[..], vec![stack.delta_allocations, stack.delta_bytes]))
            .collect(),
        mappings: main_binary_first(&diff.modules, &diff.new.program),
        time_unix_ms: diff.new.time_unix_ms,
        duration_ns: diff.new.time_unix_ms.saturating_sub(diff.base.time_unix_ms).saturating_mul(1_000_000),
        sample_rate: 1,
    };
    write_gzipped(&encode(&profile), out)
}

/// The uncompressed profile.proto message of a report.
pub fn encode_report(report: &Report) -> Vec<u8> {
    // alloc_* only when every stack has them: mmap regions do not.
    let with_allocated = !report.stacks.is_empty() && report.stacks.iter().all(|s| s.allocated.is_some());
    let sample_types =
        if with_allocated { ALLOC.iter().chain(&INUSE).copied().collect() } else { INUSE.to_vec() };
    let samples = report
        .stacks
        .iter()
        .map(|stack| {
            let allocated = stack.allocated.filter(|_| with_allocated);
            let values = allocated.into_iter().flat_map(|allocated| [allocated.count, allocated.bytes]);
            let values = values.chain([stack.allocations, stack.bytes]).map(|value| value as i64).collect();
            (&stack.frames[..], values)
        })
        .collect();
    let profile = Profile {
        sample_types,
        samples,
        mappings: main_binary_first(&report.modules, &report.program),
        time_unix_ms: report.time_unix_ms,
        duration_ns: 0,
        sample_rate: report.sample_rate,
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

fn encode(input: &Profile) -> Vec<u8> {
    let mut strings = Strings::default();
    let mut profile = Vec::new();
    for &(kind, unit) in &input.sample_types {
        let mut value_type = Vec::new();
        field_varint(&mut value_type, 1, strings.index(kind));
        field_varint(&mut value_type, 2, strings.index(unit));
        field_bytes(&mut profile, 1, &value_type); // sample_type
    }
    let mapping_of = |address: u64| {
        let index = input.mappings.iter().position(|m| m.start <= address && address < m.end)?;
        Some(index as u64 + 1)
    };
    let mut functions: HashMap<(String, String), u64> = HashMap::new();
    let mut locations: HashMap<(u64, Vec<(u64, i64)>), u64> = HashMap::new();
    let mut function_messages = Vec::new();
    let mut location_messages = Vec::new();
    for (frames, values) in &input.samples {
        let mut location_ids = Vec::new();
        // Frames of one address are consecutive: the inlined ones, then
        // the function that holds them.
        for frames_at_address in frames.chunk_by(|a, b| a.address == b.address) {
            let address = frames_at_address[0].address;
            let mut lines = Vec::new();
            // An address with no symbol gets no Line: the location stays a
            // bare address in its mapping, which pprof shows as such.
            let named = frames_at_address.iter().filter_map(|frame| Some((frame, frame.function.clone()?)));
            for (frame, name) in named {
                let file = frame.file.clone().or_else(|| frame.module.clone()).unwrap_or_default();
                let next_id = functions.len() as u64 + 1;
                let function_id = *functions.entry((name.clone(), file.clone())).or_insert_with(|| {
                    let mut function = Vec::new();
                    field_varint(&mut function, 1, next_id);
                    field_varint(&mut function, 2, strings.index(&name));
                    field_varint(&mut function, 3, strings.index(&name));
                    field_varint(&mut function, 4, strings.index(&file));
                    function_messages.push(function);
                    next_id
                });
                lines.push((function_id, i64::from(frame.line.unwrap_or(0))));
            }
            let next_id = locations.len() as u64 + 1;
            let location_id = *locations.entry((address, lines.clone())).or_insert_with(|| {
                let mut location = Vec::new();
                field_varint(&mut location, 1, next_id);
                if let Some(mapping_id) = mapping_of(address) {
                    field_varint(&mut location, 2, mapping_id);
                }
                field_varint(&mut location, 3, address);
                for (function_id, line) in &lines {
                    let mut line_message = Vec::new();
                    field_varint(&mut line_message, 1, *function_id);
                    field_varint(&mut line_message, 2, *line as u64);
                    field_bytes(&mut location, 4, &line_message);
                }
                location_messages.push(location);
                next_id
            });
            location_ids.push(location_id);
        }
        let mut sample = Vec::new();
        field_packed(&mut sample, 1, &location_ids);
        // int64 values: a negative one is its two's complement, as protobuf
        // encodes int64.
        let values: Vec<u64> = values.iter().map(|&value| value as u64).collect();
        field_packed(&mut sample, 2, &values);
        field_bytes(&mut profile, 2, &sample); // sample
    }
    for (index, mapping) in input.mappings.iter().enumerate() {
        let mut message = Vec::new();
        field_varint(&mut message, 1, index as u64 + 1);
        field_varint(&mut message, 2, mapping.start);
        field_varint(&mut message, 3, mapping.end);
        field_varint(&mut message, 4, mapping.file_offset);
        field_varint(&mut message, 5, strings.index(&mapping.path));
        if let Some(build_id) = &mapping.build_id {
            field_varint(&mut message, 6, strings.index(build_id));
        }
        // Already symbolized: pprof must not look for the binaries.
        for has in [7, 8, 9, 10] {
            field_varint(&mut message, has, 1);
        }
        field_bytes(&mut profile, 3, &message); // mapping
    }
    for location in &location_messages {
        field_bytes(&mut profile, 4, location);
    }
    for function in &function_messages {
        field_bytes(&mut profile, 5, function);
    }
    field_varint(&mut profile, 9, input.time_unix_ms.saturating_mul(1_000_000)); // time_nanos
    if input.duration_ns > 0 {
        field_varint(&mut profile, 10, input.duration_ns); // duration_nanos
    }
    // As Go's heap profiles say it: what the samples count, and how often.
    let mut period_type = Vec::new();
    field_varint(&mut period_type, 1, strings.index("space"));
    field_varint(&mut period_type, 2, strings.index("bytes"));
    field_bytes(&mut profile, 11, &period_type); // period_type
    field_varint(&mut profile, 12, u64::from(input.sample_rate.max(1))); // period
    let default_type = strings.index("inuse_space");
    field_varint(&mut profile, 14, default_type); // default_sample_type
    for string in &strings.table {
        field_bytes(&mut profile, 6, string.as_bytes()); // string_table
    }
    profile
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
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
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
