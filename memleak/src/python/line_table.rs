//! From an instruction of a Python code object to its source line: the
//! three line-table formats CPython 3.8 to 3.13 use, decoded as CPython's
//! own `PyCode_Addr2Line` does, from the table's bytes alone.
//!
//! The tables come from another process's memory, so every decoder takes
//! any bytes: a truncated or garbled table gives `None` or a wrong line,
//! never a panic or a loop.

/// Which line table a code object carries, by CPython minor version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTableFormat {
    /// 3.8 and 3.9: `co_lnotab`, pairs of (byte delta u8, line delta i8).
    Lnotab,
    /// 3.10: `co_linetable`, pairs of (byte delta u8, line delta i8), a
    /// line delta of -128 marking instructions without a line.
    Linetable310,
    /// 3.11 to 3.13: `co_linetable`, the location table of CPython's
    /// `Objects/locations.md`.
    Locations,
}

impl LineTableFormat {
    /// The format of CPython 3.`minor`; `None` outside 3.8–3.13.
    pub fn for_version(minor: u8) -> Option<Self> {
        match minor {
            8 | 9 => Some(Self::Lnotab),
            10 => Some(Self::Linetable310),
            11..=13 => Some(Self::Locations),
            _ => None,
        }
    }

    /// The line of the instruction that starts `byte_offset` bytes into
    /// the code, for a code object whose first line is `first_line`.
    /// `None` where CPython says the instruction has no line, and past
    /// the table's end on 3.10 and later.
    pub fn line_at(self, table: &[u8], first_line: i32, byte_offset: u64) -> Option<i32> {
        match self {
            Self::Lnotab => lnotab_line(table, first_line, byte_offset),
            Self::Linetable310 => linetable310_line(table, first_line, byte_offset),
            Self::Locations => location_table_line(table, first_line, byte_offset),
        }
    }
}

/// Where a frame stands in its code object. A frame record carries this
/// as a count of 2-byte code units; the interpreters count differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Instruction {
    /// The frame has not run its first instruction (lasti -1): CPython
    /// then reports the code object's first line.
    NotStarted,
    /// The instruction this many code units into the code.
    Unit(u32),
}

impl Instruction {
    /// From a lasti counted in code units, as a frame record holds it;
    /// negative means not started.
    pub fn from_units(units: i64) -> Self {
        u32::try_from(units).map_or(Self::NotStarted, Self::Unit)
    }

    /// From a frame's lasti as CPython 3.`minor` keeps it: 3.8 and 3.9's
    /// `f_lasti` counts bytes, 3.10's code units, and 3.11+ compute it in
    /// code units from the instruction pointer; -1 before the first
    /// instruction in every version.
    pub fn from_lasti(minor: u8, lasti: i64) -> Self {
        if minor <= 9 && lasti >= 0 {
            Self::from_units(lasti / 2)
        } else {
            Self::from_units(lasti)
        }
    }

    /// The offset into the code, in bytes, that the line tables index.
    pub fn byte_offset(self) -> Option<u64> {
        match self {
            Self::NotStarted => None,
            Self::Unit(units) => Some(u64::from(units) * 2),
        }
    }
}

/// Lines are summed in i64 and must end within i32, so that a garbled
/// table cannot overflow.
fn to_line(line: i64) -> Option<i32> {
    i32::try_from(line).ok()
}

/// 3.8/3.9 (`Objects/lnotab_notes.txt`): the line grows by each pair's
/// line delta while the address, grown by the byte deltas, stays at or
/// below the one asked. Every instruction has a line.
fn lnotab_line(table: &[u8], first_line: i32, byte_offset: u64) -> Option<i32> {
    let mut line = i64::from(first_line);
    let mut address = 0u64;
    for pair in table.chunks_exact(2) {
        address += u64::from(pair[0]);
        if address > byte_offset {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    to_line(line)
}

/// 3.10 (`Objects/lnotab_notes.txt` of 3.10): each pair covers the next
/// `byte delta` bytes with the line grown by its line delta, or with no
/// line for -128 (which leaves the running line as it was). Pairs that
/// cover no bytes only move the line.
fn linetable310_line(table: &[u8], first_line: i32, byte_offset: u64) -> Option<i32> {
    const NO_LINE: i8 = -128;
    let mut line = i64::from(first_line);
    let mut end = 0u64;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += u64::from(pair[0]);
        let line_delta = pair[1] as i8;
        let this_line = if line_delta == NO_LINE {
            None
        } else {
            line += i64::from(line_delta);
            Some(line)
        };
        if start <= byte_offset && byte_offset < end {
            return this_line.and_then(to_line);
        }
    }
    None
}

/// 3.11+ (`Objects/locations.md`): entries that each start with a byte
/// whose bit 7 is set: bits 3–6 say the form, bits 0–2 the number of code
/// units covered, less one. The line delta is 0 for the short forms
/// (codes 0–9), `code - 10` for the one-line forms (10–12), a signed
/// varint after the first byte for the no-column (13) and long (14)
/// forms, and code 15 has no line. The rest of an entry (columns) is
/// skipped as CPython does, by looking for the next byte with bit 7 set.
fn location_table_line(table: &[u8], first_line: i32, byte_offset: u64) -> Option<i32> {
    const NO_LOCATION: u8 = 15;
    const LONG: u8 = 14;
    const NO_COLUMNS: u8 = 13;
    const ONE_LINE_0: u8 = 10;
    const ONE_LINE_2: u8 = 12;
    let mut line = i64::from(first_line);
    let mut address = 0u64;
    let mut at = 0;
    while let Some(&first) = table.get(at) {
        let entry_end = table[at + 1..]
            .iter()
            .position(|byte| byte & 0x80 != 0)
            .map_or(table.len(), |next| at + 1 + next);
        let body = &table[at + 1..entry_end];
        let code = (first >> 3) & 15;
        let line_delta = match code {
            NO_COLUMNS | LONG => signed_varint(body),
            ONE_LINE_0..=ONE_LINE_2 => i64::from(code - ONE_LINE_0),
            _ => 0,
        };
        line = line.saturating_add(line_delta);
        let end = address + 2 * (u64::from(first & 7) + 1);
        if address <= byte_offset && byte_offset < end {
            return if code == NO_LOCATION { None } else { to_line(line) };
        }
        address = end;
        at = entry_end;
    }
    None
}

/// A varint of the location table: 6-bit chunks, least significant
/// first, bit 6 set on every chunk but the last; then zigzag, the low bit
/// giving the sign. Chunks past 60 bits are ignored rather than shifted
/// out of range.
fn signed_varint(bytes: &[u8]) -> i64 {
    let mut value = 0u64;
    for (index, byte) in bytes.iter().enumerate() {
        if index < 10 {
            value |= u64::from(byte & 63) << (6 * index);
        }
        if byte & 64 == 0 {
            break;
        }
    }
    let magnitude = (value >> 1) as i64;
    if value & 1 == 1 {
        -magnitude
    } else {
        magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines of the instructions at code units 0..count.
    fn lines(format: LineTableFormat, table: &[u8], first_line: i32, count: u64) -> Vec<Option<i32>> {
        (0..count).map(|unit| format.line_at(table, first_line, unit * 2)).collect()
    }

    #[test]
    fn lnotab_lines_grow_and_shrink_by_signed_deltas() {
        // Line 10 for bytes 0..6, 11 for 6..10, 9 from 10 (delta -2);
        // then an address delta split in two (255 + 5, to 270, the line
        // +0 then +3) and a line delta split in two at the same address
        // (+127 then +1), as CPython writes deltas too big for a byte.
        let table = [6, 1, 4, 0xfe, 255, 0, 5, 3, 0, 127, 0, 1];
        let got: Vec<_> = [0, 4, 6, 8, 10, 14, 264, 268, 270, 272]
            .iter()
            .map(|&byte| lnotab_line(&table, 10, byte))
            .collect();
        let after_split = 9 + 3 + 127 + 1;
        assert_eq!(got, [10, 10, 11, 11, 9, 9, 9, 9, after_split, after_split].map(Some));
        // An empty table: every instruction is on the first line.
        assert_eq!(lnotab_line(&[], 7, 100), Some(7));
    }

    #[test]
    fn linetable_310_has_ranges_without_a_line_and_deltas_that_cover_nothing() {
        // Bytes 0..4 on line 5 (+0), a zero-length pair moving the line
        // to 8 (+3), bytes 4..8 on line 9 (+1), bytes 8..10 without a line
        // (-128, which keeps 9 as the running line), bytes 10..14 on
        // line 7 (-2).
        let table = [4, 0, 0, 3, 4, 1, 2, 0x80, 4, 0xfe];
        assert_eq!(
            lines(LineTableFormat::Linetable310, &table, 5, 8),
            [Some(5), Some(5), Some(9), Some(9), None, Some(7), Some(7), None]
        );
    }

    /// The first byte of a location-table entry.
    fn entry(code: u8, units: u8) -> u8 {
        0x80 | code << 3 | (units - 1)
    }

    #[test]
    fn location_table_reads_every_form() {
        let table = [
            // Long form: line +2 (zigzag 4), end line, columns; 1 unit.
            entry(14, 1),
            4,
            0,
            1,
            5,
            // Short form (code 3, one byte of columns): same line, 2 units.
            entry(3, 2),
            0x12,
            // One-line form +1 (code 11, two column bytes): 1 unit.
            entry(11, 1),
            4,
            9,
            // No location: 1 unit, no line.
            entry(15, 1),
            // No columns: line -3 (zigzag 7): 3 units.
            entry(13, 3),
            7,
            // One-line forms +0 and +2.
            entry(10, 1),
            1,
            2,
            entry(12, 1),
            1,
            2,
            // Long form with a two-chunk varint: +100 (zigzag 200 = 8 + 3*64).
            entry(14, 8),
            0x40 | 8,
            3,
            0,
            1,
            1,
        ];
        let first = 20;
        let expected = [
            Some(22),
            Some(22),
            Some(22),
            Some(23),
            None,
            Some(20),
            Some(20),
            Some(20),
            Some(20),
            Some(22),
            Some(122),
            Some(122),
            Some(122),
            Some(122),
            Some(122),
            Some(122),
            Some(122),
            Some(122),
            None,
        ];
        assert_eq!(lines(LineTableFormat::Locations, &table, first, expected.len() as u64), expected);
    }

    #[test]
    fn the_lasti_of_each_version_counts_its_own_units() {
        assert_eq!(Instruction::from_lasti(8, 14), Instruction::Unit(7));
        assert_eq!(Instruction::from_lasti(9, 0), Instruction::Unit(0));
        assert_eq!(Instruction::from_lasti(10, 14), Instruction::Unit(14));
        assert_eq!(Instruction::from_lasti(13, 3), Instruction::Unit(3));
        for minor in 8..=13 {
            assert_eq!(Instruction::from_lasti(minor, -1), Instruction::NotStarted, "3.{minor}");
        }
        assert_eq!(Instruction::Unit(7).byte_offset(), Some(14));
        assert_eq!(Instruction::NotStarted.byte_offset(), None);
    }

    #[test]
    fn garbled_tables_give_no_panic() {
        // A fixed pseudo-random sequence: tables of every length up to
        // 64, every byte value, every offset.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for length in 0..64 {
            let table: Vec<u8> = (0..length)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state.to_le_bytes()[0]
                })
                .collect();
            for format in [LineTableFormat::Lnotab, LineTableFormat::Linetable310, LineTableFormat::Locations]
            {
                for offset in (0..300).step_by(2) {
                    let _ = format.line_at(&table, i32::MAX - 1, offset);
                    let _ = format.line_at(&table, i32::MIN + 1, offset);
                }
            }
        }
        // Long runs of continuation chunks and huge deltas.
        let long = [entry(14, 1), 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 1];
        assert_eq!(LineTableFormat::Locations.line_at(&long, 1, 0), None);
    }
}
