//! The report vocabulary: which format, what flame graphs weigh, how
//! stacks are ordered and how many are kept. Plain types that the CLI, the
//! offline subcommands and any other driver fill in; nothing here knows
//! where the values came from.

use std::path::Path;

/// A closed set of named choices, as a command line or a query string
/// names them. `ALL` lists them in the order help texts show them.
pub trait Choice: Copy + Sized + 'static {
    const ALL: &'static [Self];

    /// The name a user types.
    fn name(self) -> &'static str;

    /// One line saying what the choice means.
    fn description(self) -> &'static str;
}

/// How a report is written out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
    Folded,
    Svg,
    Pprof,
}

impl Choice for Format {
    const ALL: &'static [Self] = &[Format::Text, Format::Json, Format::Folded, Format::Svg, Format::Pprof];

    fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Json => "json",
            Format::Folded => "folded",
            Format::Svg => "svg",
            Format::Pprof => "pprof",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Format::Text => "bcc-style text",
            Format::Json => "One JSON object per report, one per line",
            Format::Folded => {
                "Collapsed stacks, root first, for flame graph tools; every stack, not only the top N"
            }
            Format::Svg => "A flame graph, as SVG; every stack",
            Format::Pprof => {
                "A gzipped pprof profile (profile.proto), for go tool pprof, Pyroscope, Parca and speedscope; every stack"
            }
        }
    }
}

impl Format {
    /// The format a file name asks for, by its extension.
    pub fn of_file(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_str()?;
        if name.ends_with(".pb.gz") {
            return Some(Format::Pprof);
        }
        let (_, extension) = name.rsplit_once('.')?;
        match extension {
            "pprof" => Some(Format::Pprof),
            "svg" => Some(Format::Svg),
            "folded" => Some(Format::Folded),
            "json" | "jsonl" => Some(Format::Json),
            "txt" | "text" => Some(Format::Text),
            _ => None,
        }
    }

    /// A whole document per report (not a stream): only the final report
    /// is written, with every stack.
    pub fn is_document(self) -> bool {
        matches!(self, Format::Svg | Format::Pprof)
    }

    /// For flame graph tools: every stack, not the top N.
    pub fn wants_every_stack(self) -> bool {
        matches!(self, Format::Folded | Format::Svg | Format::Pprof)
    }

    /// pprof's `alloc_space` and `alloc_objects` include the stacks whose
    /// every allocation was freed; no other format shows them.
    pub fn shows_freed_stacks(self) -> bool {
        self == Format::Pprof
    }

    /// pprof attributes addresses to the files mapped at them.
    pub fn needs_modules(self) -> bool {
        self == Format::Pprof
    }
}

/// What folded stacks and flame graphs weigh stacks by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weight {
    Bytes,
    Count,
}

impl Choice for Weight {
    const ALL: &'static [Self] = &[Weight::Bytes, Weight::Count];

    fn name(self) -> &'static str {
        match self {
            Weight::Bytes => "bytes",
            Weight::Count => "count",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Weight::Bytes => "Outstanding bytes",
            Weight::Count => "Outstanding allocations",
        }
    }
}

/// The order of a report's stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    Size,
    Count,
    Growth,
}

impl Choice for SortKey {
    const ALL: &'static [Self] = &[SortKey::Size, SortKey::Count, SortKey::Growth];

    fn name(self) -> &'static str {
        match self {
            SortKey::Size => "size",
            SortKey::Count => "count",
            SortKey::Growth => "growth",
        }
    }

    fn description(self) -> &'static str {
        match self {
            SortKey::Size => "Outstanding bytes, largest first",
            SortKey::Count => "Outstanding allocations, most first",
            SortKey::Growth => {
                "Steady growth: the longest run of growing reports first, then the fastest growth per report. Finds a slow leak behind big stable caches"
            }
        }
    }
}

/// The order of a diff's stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiffOrder {
    Growth,
    Bytes,
}

impl Choice for DiffOrder {
    const ALL: &'static [Self] = &[DiffOrder::Growth, DiffOrder::Bytes];

    fn name(self) -> &'static str {
        match self {
            DiffOrder::Growth => "growth",
            DiffOrder::Bytes => "bytes",
        }
    }

    fn description(self) -> &'static str {
        match self {
            DiffOrder::Growth => {
                "Growth in new memory, largest first: blocks that took the place of blocks from before memleak attached (a cache refilling) are not growth"
            }
            DiffOrder::Bytes => "Change in outstanding bytes, largest first, replacing blocks included",
        }
    }
}

/// How a report is written: its format, for flame graphs the weight, and
/// for text whether runs of plumbing frames are folded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rendering {
    pub format: Format,
    pub weight: Weight,
    /// Every frame of each stack in text (--full-stacks); the other
    /// formats always have them all.
    pub full_stacks: bool,
}

/// Which stacks a report shows, and how much of each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReportOptions {
    pub sort: SortKey,
    /// Stacks shown; `usize::MAX` for all.
    pub top: usize,
    /// Each allocation's address, size and age under its stack (-a).
    pub show_allocs: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_name_formats() {
        assert_eq!(Format::of_file(Path::new("/tmp/leak.svg")), Some(Format::Svg));
        assert_eq!(Format::of_file(Path::new("stacks.folded")), Some(Format::Folded));
        assert_eq!(Format::of_file(Path::new("reports.json")), Some(Format::Json));
        assert_eq!(Format::of_file(Path::new("profile.pb.gz")), Some(Format::Pprof));
        assert_eq!(Format::of_file(Path::new("archive.tar.gz")), None);
        assert_eq!(Format::of_file(Path::new("noextension")), None);
    }
}
