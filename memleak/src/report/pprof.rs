//! pprof's profile.proto, gzipped: what `go tool pprof`, Pyroscope, Parca
//! and speedscope read. Encoded by hand: the format needs only varints
//! and length-delimited fields, which is less code than a protobuf
//! dependency and its build step.
//!
//! Sample types are inuse_objects and inuse_space (outstanding count and
//! bytes). Frames sharing an address (a function and what was inlined
//! into it) become one Location with several Lines, innermost first, as
//! pprof expects.

use std::{
    collections::HashMap,
    io::{self, Write},
};

use flate2::{write::GzEncoder, Compression};

use super::Report;

pub fn render(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let profile = encode(report);
    let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
    gzip.write_all(&profile)?;
    out.write_all(&gzip.finish()?)
}

/// The uncompressed profile.proto message.
pub fn encode(report: &Report) -> Vec<u8> {
    let mut strings = Strings::default();
    let mut profile = Vec::new();
    for (kind, unit) in [("inuse_objects", "count"), ("inuse_space", "bytes")] {
        let mut value_type = Vec::new();
        field_varint(&mut value_type, 1, strings.index(kind));
        field_varint(&mut value_type, 2, strings.index(unit));
        field_bytes(&mut profile, 1, &value_type); // sample_type
    }
    let mut functions: HashMap<(String, String), u64> = HashMap::new();
    let mut locations: HashMap<(u64, Vec<(u64, i64)>), u64> = HashMap::new();
    let mut function_messages = Vec::new();
    let mut location_messages = Vec::new();
    for stack in &report.stacks {
        let mut location_ids = Vec::new();
        // Frames of one address are consecutive: the inlined ones, then
        // the function that holds them.
        let mut index = 0;
        while index < stack.frames.len() {
            let address = stack.frames[index].address;
            let mut lines = Vec::new();
            while index < stack.frames.len() && stack.frames[index].address == address {
                let frame = &stack.frames[index];
                let name = frame.function.clone().unwrap_or_else(|| format!("{address:#x}"));
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
                index += 1;
            }
            let next_id = locations.len() as u64 + 1;
            let location_id = *locations.entry((address, lines.clone())).or_insert_with(|| {
                let mut location = Vec::new();
                field_varint(&mut location, 1, next_id);
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
        field_packed(&mut sample, 2, &[stack.allocations, stack.bytes]);
        field_bytes(&mut profile, 2, &sample); // sample
    }
    for location in &location_messages {
        field_bytes(&mut profile, 4, location);
    }
    for function in &function_messages {
        field_bytes(&mut profile, 5, function);
    }
    field_varint(&mut profile, 9, report.time_unix_ms.saturating_mul(1_000_000)); // time_nanos
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
        let profile = encode(&sample_report(10));
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
