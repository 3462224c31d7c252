use super::*;
use crate::report::{culprit::SkipRules, options::SortKey, tests::sample_report, ReportStack};

fn saved() -> Vec<u8> {
    let mut bytes = Vec::new();
    write(&sample_report(usize::MAX), &mut bytes).unwrap();
    bytes
}

fn read_bytes(bytes: &[u8]) -> Result<Report, SavedError> {
    read_from(bytes, Path::new("heap.snap"), LIMITS)?.into_whole_report()
}

const HEADER: &str = "{\"format\":\"memleak-snapshot\",\"version\":1,\"written_by\":\"0.1.0\"}\n";

/// The start of a report whose first stack's frames come next.
const UP_TO_FRAMES: &str = "{\"pid\":1,\"program\":\"p\",\"time_unix_ms\":1,\"allocator\":\"a\",\"min_age_ms\":0,\
    \"sample_rate\":1,\"total_bytes\":1,\"total_allocations\":1,\"total_stacks\":1,\"stacks\":[{\"stack_id\":1,\
    \"bytes\":1,\"allocations\":1,\"stack_lost\":false,\"growing_reports\":0,\"frames\":[";

/// Endless content: `head`, then `piece(0)`, `piece(1)`... A file that
/// never ends. Reading more than `most` bytes of it panics: what proves a
/// reading bounded.
struct Endless<P> {
    head: Vec<u8>,
    piece: P,
    pieces: u64,
    pending: Vec<u8>,
    pulled: u64,
    most: u64,
}

fn endless<P: FnMut(u64) -> String>(head: &str, piece: P, most: u64) -> Endless<P> {
    Endless { head: head.as_bytes().to_vec(), piece, pieces: 0, pending: Vec::new(), pulled: 0, most }
}

impl<P: FnMut(u64) -> String> Read for Endless<P> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        assert!(
            self.pulled <= self.most,
            "read {} bytes of an endless file, past {}",
            self.pulled,
            self.most
        );
        while self.pending.len() < buf.len() {
            let next = if self.head.is_empty() {
                self.pieces += 1;
                (self.piece)(self.pieces - 1).into_bytes()
            } else {
                mem::take(&mut self.head)
            };
            self.pending.extend(next);
        }
        let read = buf.len();
        buf.copy_from_slice(&self.pending[..read]);
        self.pending.drain(..read);
        self.pulled += read as u64;
        Ok(read)
    }
}

/// An endless file gzipped as it is read, 4 KiB at a time, each flushed
/// so that the compressed stream never waits for more.
struct Gzipped<R> {
    plain: R,
    gzip: GzEncoder<Vec<u8>>,
    done: usize,
}

impl<R: Read> Read for Gzipped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.gzip.get_ref().len() == self.done {
            let mut piece = [0; 4096];
            self.plain.read_exact(&mut piece)?;
            self.gzip.write_all(&piece)?;
            self.gzip.flush()?;
        }
        let compressed = &self.gzip.get_ref()[self.done..];
        let read = compressed.len().min(buf.len());
        buf[..read].copy_from_slice(&compressed[..read]);
        self.done += read;
        Ok(read)
    }
}

/// The message reading `inflated` fails with, as a snapshot's content.
fn refusal(inflated: impl Read, limits: Limits) -> String {
    match read_inflated(inflated, Path::new("heap.snap"), limits) {
        Ok(saved) => panic!("an endless file read as a snapshot of {} stacks", saved.report().stacks.len()),
        Err(error) => error.to_string(),
    }
}

/// A snapshot keeps no culprits: they are named when it is rendered,
/// with that run's --skip-frames.
fn with_culprits(mut report: Report) -> Report {
    report.name_stacks(&SkipRules::default());
    report
}

#[test]
fn a_snapshot_reads_back_as_the_same_report() {
    assert_eq!(with_culprits(read_bytes(&saved()).unwrap()), sample_report(usize::MAX));
}

#[test]
fn bad_files_are_named_for_what_is_wrong() {
    let bytes = saved();
    let message = |bytes: &[u8]| read_bytes(bytes).unwrap_err().to_string();
    assert_eq!(
        message(b""),
        "heap.snap is not a memleak snapshot (written with --save): it is empty or too short"
    );
    assert_eq!(
        message(b"{\"pid\": 1}"),
        "heap.snap is not a memleak snapshot (written with --save): it is not gzip-compressed"
    );
    let cut = message(&bytes[..bytes.len() / 2]);
    assert!(cut.starts_with("heap.snap is truncated or corrupt: "), "{cut}");
    let mut flipped = bytes.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0xff;
    let flipped = message(&flipped);
    assert!(flipped.starts_with("heap.snap is truncated or corrupt: "), "{flipped}");
}

#[test]
fn another_version_is_refused_by_its_header() {
    let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
    gzip.write_all(b"{\"format\":\"memleak-snapshot\",\"version\":99,\"written_by\":\"9.0.0\"}\n{}\n")
        .unwrap();
    let error = read_bytes(&gzip.finish().unwrap()).unwrap_err().to_string();
    assert_eq!(error, "heap.snap is snapshot version 99 (from memleak 9.0.0); this memleak reads version 1");
}

/// A gzip bomb, as a file: a string that never ends. Reading stops a
/// megabyte into it (and an inflated buffer or two past), not when memory
/// runs out.
#[test]
fn a_gzip_bomb_is_refused_a_megabyte_in() {
    let string = endless(&format!("{HEADER}{{\"pid\":1,\"program\":\""), |_| "A".repeat(4096), 4 << 20);
    let bomb = Gzipped { plain: string, gzip: GzEncoder::new(Vec::new(), Compression::fast()), done: 0 };
    let error = read_from(bomb, Path::new("heap.snap"), LIMITS).unwrap_err().to_string();
    assert_eq!(
        error,
        "heap.snap is not a memleak snapshot (written with --save): it holds a value over 1 MiB long"
    );
}

#[test]
fn an_endless_string_is_refused_a_megabyte_in() {
    let string =
        endless(&format!("{HEADER}{{\"pid\":1,\"program\":\""), |_| "A".repeat(4096), (1 << 20) + (64 << 10));
    assert_eq!(
        refusal(string, LIMITS),
        "heap.snap is not a memleak snapshot (written with --save): it holds a value over 1 MiB long"
    );
}

#[test]
fn endless_white_space_is_refused_a_megabyte_in() {
    let space = endless(HEADER, |_| " ".repeat(4096), (1 << 20) + (64 << 10));
    assert_eq!(
        refusal(space, LIMITS),
        "heap.snap is not a memleak snapshot (written with --save): it holds a value over 1 MiB long"
    );
}

#[test]
fn an_endless_first_line_is_no_header() {
    let line = endless("{\"format\":\"memleak-snapshot\",\"written_by\":\"", |_| "A".repeat(4096), 64 << 10);
    assert_eq!(
        refusal(line, LIMITS),
        "heap.snap is not a memleak snapshot (written with --save): its first line is not a snapshot header"
    );
}

/// Frames held once cost little, however often they repeat: the
/// inflated size is what stops an endless list of them.
#[test]
fn endless_frames_stop_at_the_inflated_limit() {
    let limits = Limits { inflated: 1 << 20, ..LIMITS };
    let frame = |_| "{\"address\":\"0x1\",\"inlined\":false},".to_owned();
    let frames = endless(&format!("{HEADER}{UP_TO_FRAMES}"), frame, (1 << 20) + (64 << 10));
    assert_eq!(
        refusal(frames, limits),
        "heap.snap inflates past 1 MiB: not a memleak snapshot, or one too large to read \
         (65,536 stacks of 127 frames inflate to about 1.7 GB)"
    );
}

/// Frames that all differ are each held: the memory they take stops them,
/// long before the inflated size would.
#[test]
fn endless_distinct_frames_stop_at_the_memory_limit() {
    let limits = Limits { memory: 1 << 20, ..LIMITS };
    let frame = |n: u64| format!("{{\"address\":\"{n:#x}\",\"function\":\"f{n}\",\"inlined\":false}},");
    let frames = endless(&format!("{HEADER}{UP_TO_FRAMES}"), frame, 1 << 20);
    assert_eq!(
        refusal(frames, limits),
        "heap.snap would take over 1 MiB of memory to read: not a memleak snapshot, or one too large to read"
    );
}

/// What is read whole counts against the memory limit as it is expanded.
#[test]
fn showing_every_frame_counts_against_the_memory_limit() {
    let bytes = saved();
    let unlimited = read_from(&bytes[..], Path::new("heap.snap"), LIMITS).unwrap();
    let held = LIMITS.memory - unlimited.memory_left;
    let limits = Limits { memory: held + 1, ..LIMITS };
    let error =
        read_from(&bytes[..], Path::new("heap.snap"), limits).unwrap().into_whole_report().unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "heap.snap has too many frames to show every stack in {} of memory: \
             --format text or json show its top stacks",
            size(held + 1)
        )
    );
}

/// Many stacks over a few functions: each distinct frame is held once.
#[test]
fn each_distinct_frame_is_held_once() {
    let mut report = sample_report(usize::MAX);
    let template = report.stacks[0].clone();
    report.stacks = (0..1000)
        .map(|id| {
            let mut stack = template.clone();
            stack.stack_id = id;
            // The same two frames, one repeated a different number of times.
            stack.frames = vec![template.frames[0].clone(); 1 + (id % 7) as usize];
            stack.frames.push(template.frames[1].clone());
            stack
        })
        .collect();
    let mut bytes = Vec::new();
    write(&report, &mut bytes).unwrap();
    let saved = read_from(&bytes[..], Path::new("heap.snap"), LIMITS).unwrap();
    assert_eq!(saved.frame_table().len(), 2, "two distinct frames in 1000 stacks");
    assert_eq!(saved.frames_of(6), [0, 0, 0, 0, 0, 0, 0, 1]);
    assert_eq!(with_culprits(saved.into_whole_report().unwrap()), with_culprits(report));
}

/// `memleak report` expands only the stacks shown: the same ones, in the
/// same order and with the same frames, as cutting the whole report.
#[test]
fn a_report_shows_what_the_whole_report_cut_shows() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden/new.snap");
    for &format in <Format as crate::report::options::Choice>::ALL {
        for (sort, top, show_allocs) in
            [(SortKey::Size, 10, false), (SortKey::Count, 2, true), (SortKey::Growth, 1, false)]
        {
            let options = ReportOptions { sort, top, show_allocs };
            let mut cut = load(&golden).unwrap();
            cut.cut_for_display(&options, format);
            let shown = read(&golden).unwrap().into_report(&options, format).unwrap();
            assert_eq!(shown, cut, "{format:?} {sort:?} top {top}");
        }
    }
}

#[test]
fn a_missing_field_makes_the_file_corrupt() {
    let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
    gzip.write_all(format!("{HEADER}{UP_TO_FRAMES}]}}]}}\n").as_bytes()).unwrap();
    let error = read_bytes(&gzip.finish().unwrap()).unwrap_err().to_string();
    assert!(error.starts_with("heap.snap is truncated or corrupt: missing field `health`"), "{error}");
}

/// What a message quotes from the file cannot reach the terminal raw, nor
/// run over a line.
#[test]
fn messages_quote_the_file_escaped_and_short() {
    let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
    gzip.write_all(
        b"{\"format\":\"memleak-snapshot\",\"version\":2,\"written_by\":\"\\u001b]0;owned\\u0007\"}\n",
    )
    .unwrap();
    let error = read_bytes(&gzip.finish().unwrap()).unwrap_err().to_string();
    assert_eq!(
        error,
        "heap.snap is snapshot version 2 (from memleak \\x1b]0;owned\\x07); this memleak reads version 1"
    );

    let mut gzip = GzEncoder::new(Vec::new(), Compression::fast());
    let mapping = format!("\\u001b[2J{}", "A".repeat(5000));
    gzip.write_all(format!("{HEADER}{UP_TO_FRAMES}],\"mapping\":\"{mapping}\"}}]}}\n").as_bytes()).unwrap();
    let error = read_bytes(&gzip.finish().unwrap()).unwrap_err().to_string();
    assert!(error.starts_with("heap.snap is truncated or corrupt: unknown variant `\\x1b[2JAAA"), "{error}");
    assert!(error.ends_with("AAA..."), "cut short: {error}");
    assert!(error.len() < 300 && !error.chars().any(char::is_control), "{error}");
}

/// A report as `--save` writes one for tests/fixtures/spread.c at 65,536
/// stacks 16 levels deep: 37 frames each (the allocator, `allocate`, 16
/// levels of `walk` and `zero` or `one`, `main` and libc's start-up),
/// shared as the symbolizer shares them, and one allocation per stack.
fn spread_report(stacks: u32) -> Report {
    use crate::model::OutstandingAllocation;
    let frame = |function: &str, file: &str, line: u32, address: u64| {
        Arc::new(Frame {
            address,
            function: Some(function.to_owned()),
            offset: Some(0x1f),
            file: Some(file.to_owned()),
            line: Some(line),
            module: Some("/usr/local/bin/spread".to_owned()),
            file_offset: Some(address - 0x40_0000),
            build_id: Some("4f2a9c0b61d8e3f7a5b2c9d0e1f2a3b4c5d6e7f8".to_owned()),
            ..Frame::default()
        })
    };
    let malloc = Arc::new(Frame {
        module: Some("/usr/lib/x86_64-linux-gnu/libc.so.6".to_owned()),
        ..(*frame("malloc", "./malloc/malloc.c", 3287, 0x7f00_0000_1234)).clone()
    });
    let allocate = frame("allocate", "tests/fixtures/spread.c", 52, 0x40_1100);
    let start = [
        frame("main", "tests/fixtures/spread.c", 90, 0x40_1300),
        frame("__libc_start_call_main", "../sysdeps/nptl/libc_start_call_main.h", 58, 0x7f00_0000_2000),
        frame("__libc_start_main_impl", "../csu/libc-start.c", 360, 0x7f00_0000_3000),
    ];
    // Each level's walk, zero and one: the same frames in many stacks.
    let level = |level| {
        [("walk", 60, 0x40_1200), ("zero", 33, 0x40_1180), ("one", 39, 0x40_11c0)].map(
            |(function, line, address)| frame(function, "tests/fixtures/spread.c", line, address + level),
        )
    };
    let levels: Vec<[Arc<Frame>; 3]> = (0..16u64).map(level).collect();
    let mut report = sample_report(usize::MAX);
    report.stacks = (0..stacks)
        .map(|path| {
            let mut frames = vec![Arc::clone(&malloc), Arc::clone(&allocate)];
            for (level, [walk, zero, one]) in levels.iter().enumerate().rev() {
                frames.push(Arc::clone(walk));
                frames.push(Arc::clone(if path >> level & 1 == 1 { one } else { zero }));
            }
            frames.extend(start.iter().cloned());
            let address = 0x5600_0000_0000 + u64::from(path) * 64;
            ReportStack {
                stack_id: u64::from(path) + 1,
                frames,
                bytes: 16 + u64::from(path % 49),
                allocations: 1,
                culprit: Some(Arc::clone(&allocate)),
                plumbing: Vec::new(),
                stable_id: Some(format!("{:016x}", u64::from(path).wrapping_mul(0x9e37_79b9_7f4a_7c15))),
                outstanding: vec![OutstandingAllocation {
                    address,
                    size: 16 + u64::from(path % 49),
                    age_ms: 1500,
                }],
                ..report.stacks[0].clone()
            }
        })
        .collect();
    report.total_stacks = report.stacks.len();
    report
}

#[test]
fn a_spread_report_has_the_benchs_shape() {
    let report = spread_report(4);
    assert_eq!(report.stacks.len(), 4);
    assert!(report.stacks.iter().all(|stack| stack.frames.len() == 37));
    let mut bytes = Vec::new();
    write(&report, &mut bytes).unwrap();
    let read = read_bytes(&bytes).unwrap();
    assert_eq!(read.stacks.len(), 4);
    for (read, written) in read.stacks.iter().zip(&report.stacks) {
        assert_eq!((&read.frames, &read.outstanding), (&written.frames, &written.outstanding));
    }
}

/// `cargo xtask bench` runs this in release: the time to save a report of
/// 65,536 stacks of 37 frames, as --save does (the median of three, on a
/// machine others share), and the time the report loop gives it (a copy
/// of the report, handed to the writing thread).
#[test]
#[ignore = "a benchmark: cargo xtask bench runs it in release"]
fn bench_saving_65536_stacks_of_37_frames() {
    let report = spread_report(65_536);
    let copying = std::time::Instant::now();
    let report = report.clone();
    let copied = copying.elapsed().as_secs_f64();
    let dir = std::env::temp_dir().join(format!("memleak-bench-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bench.snap");
    let mut times = Vec::new();
    let mut size = 0;
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let mut file = File::create(&path).unwrap();
        write(&report, &mut file).unwrap();
        file.sync_all().unwrap();
        times.push(started.elapsed().as_secs_f64());
        size = file.metadata().unwrap().len();
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[1];
    let round_trip = read(&path).map(|saved| saved.report.stacks.len());
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(round_trip.ok(), Some(65_536), "the snapshot reads back");
    println!(
        "bench: saved 65536 stacks of 37 frames in {seconds:.3} s, {size} bytes; copied in {copied:.3} s \
         (times {times:.3?})"
    );
}
