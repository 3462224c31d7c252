//! bcc-style text: a timestamped header, then for each stack
//! `N bytes in M allocations from stack` and one frame per line.

use std::{
    borrow::Borrow,
    fmt::Write as _,
    io::{self, Write},
    sync::Arc,
};

use super::{culprit, diff::Diff, printable, subject, CgroupTotal, Report};
use crate::{
    clock,
    model::{Frame, MappingKind, Trend, Unwinding},
    status,
    symbolize::missing::{Lacking, MissingSymbols},
};

/// Writes `report`; runs of plumbing frames folded unless `full_stacks`.
pub fn render(report: &Report, full_stacks: bool, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    write_header(report, out)?;
    for stack in &report.stacks {
        writeln!(
            out,
            "\t{} bytes in {} {} from stack{}",
            stack.bytes,
            stack.allocations,
            source(stack.mapping),
            describe_trend(&stack.trend)
        )?;
        if !stack.replacing.is_none() {
            writeln!(
                out,
                "\t\treplacing: {} bytes in {} of them took the place of blocks from before memleak attached: not growth",
                stack.replacing.bytes, stack.replacing.allocations
            )?;
        }
        write_culprit(stack.culprit.as_ref(), &stack.frames, out)?;
        let plumbing = folded(full_stacks, stack.culprit.is_some(), &stack.plumbing);
        write_frames(stack.stack_lost, &stack.frames, plumbing, out)?;
        if let Some(truncation) = stack.truncated {
            writeln!(out, "\t\t[truncated {}]", truncation.describe())?;
        }
        for allocation in &stack.outstanding {
            writeln!(
                out,
                "\t\t\taddr = {:#x} size = {} age = {} ms",
                allocation.address, allocation.size, allocation.age_ms
            )?;
        }
    }
    write_totals(report, out)?;
    write_health(report, out)
}

/// `[HH:MM:SS] Top N stacks with outstanding allocations in pid P
/// (PROGRAM) through ALLOCATOR:` (see `subject`), or `in the kernel:`;
/// `Top stacks ...: none` without any.
fn write_header(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let whose = subject::of(report);
    let unwound = match report.unwinding {
        None => "",
        Some(Unwinding::Dwarf) => ", unwound with .eh_frame",
        Some(Unwinding::FramePointers) => ", unwound with frame pointers",
    };
    let time = clock::local_time(report.time_unix_ms);
    // Still "] Top " with none, which scripts look for as a report's start.
    let (top, none) = match report.stacks.len() {
        0 => (String::new(), " none"),
        shown => (format!(" {shown}"), ""),
    };
    writeln!(out, "[{time}] Top{top} stacks with outstanding allocations in {whose}{unwound}:{none}")?;
    if report.sample_rate > 1 {
        writeln!(
            out,
            "\t(sampled: about 1 in {} allocations recorded, figures scaled up by {})",
            report.sample_rate, report.sample_rate
        )?;
    }
    Ok(())
}

/// `culprit: make_session(int)+0x13 (sessions.cpp:25) [/srv/sessions]`:
/// the stack's first frame of the program's own code, said before the
/// frames when frames of allocation plumbing come first (otherwise the
/// first frame is the culprit, and the line would repeat it).
fn write_culprit(
    culprit: Option<&Arc<Frame>>,
    frames: &[Arc<Frame>],
    out: &mut (impl Write + ?Sized),
) -> io::Result<()> {
    match culprit {
        Some(culprit) if !frames.first().is_some_and(|first| Arc::ptr_eq(first, culprit)) => {
            writeln!(out, "\t\tculprit: {}", describe(culprit))
        }
        _ => Ok(()),
    }
}

/// A stack's frames, one per line, or what became of them (`frame_lines`).
fn write_frames<F: Borrow<Frame>>(
    stack_lost: bool,
    frames: &[F],
    plumbing: &[bool],
    out: &mut (impl Write + ?Sized),
) -> io::Result<()> {
    for line in frame_lines(stack_lost, frames, plumbing) {
        writeln!(out, "\t\t{line}")?;
    }
    Ok(())
}

/// A stack's frames, a line each, or what became of them. A run of two
/// or more frames that `plumbing` marks is one line that says how many
/// and whose they are; `plumbing` may be shorter than `frames` (empty:
/// every frame). Also what `memleak top` shows of a stack opened.
pub fn frame_lines<F: Borrow<Frame>>(stack_lost: bool, frames: &[F], plumbing: &[bool]) -> Vec<String> {
    let mut lines = Vec::new();
    if stack_lost {
        lines.push("[stack lost: raise --max-stacks]".to_owned());
    }
    let is_plumbing = |i: usize| plumbing.get(i).copied().unwrap_or(false);
    let mut i = 0;
    while i < frames.len() {
        let run = (i..frames.len()).take_while(|&j| is_plumbing(j)).count();
        if run >= 2 {
            let run_frames = frames[i..i + run].iter().map(Borrow::borrow);
            lines.push(format!("... {run} frames of {}", whose(run_frames)));
            i += run;
        } else {
            lines.push(describe(frames[i].borrow()));
            i += 1;
        }
    }
    lines
}

/// The plumbing flags `write_frames` folds by: none with --full-stacks,
/// nor in a stack without a culprit, whose every frame is plumbing (an
/// allocation the runtime makes for itself): folded, it would say nothing.
pub fn folded(full_stacks: bool, has_culprit: bool, plumbing: &[bool]) -> &[bool] {
    if full_stacks || !has_culprit {
        &[]
    } else {
        plumbing
    }
}

/// Whose plumbing a run of frames is, for its folded line: `alloc, core
/// and std`; at most three names, then `and others`.
fn whose<'f>(frames: impl Iterator<Item = &'f Frame>) -> String {
    const NAMED: usize = 3;
    let mut names: Vec<String> = Vec::new();
    let mut others = false;
    for frame in frames {
        let name = owner(frame);
        if names.contains(&name) {
            continue;
        }
        if names.len() == NAMED {
            others = true;
        } else {
            names.push(name);
        }
    }
    let names: Vec<String> = names.iter().map(|name| printable(name).into_owned()).collect();
    match (names.as_slice(), others) {
        (_, true) => format!("{} and others", names.join(", ")),
        ([only], false) => only.clone(),
        ([first @ .., last], false) => format!("{} and {last}", first.join(", ")),
        ([], false) => String::new(),
    }
}

/// Whose code a frame is: the Rust library or crate of its source file
/// (`alloc`, `hashbrown`), else the first part of its qualified name
/// (`std` of `std::vector<int>::_M_realloc_insert`), else the shared
/// library it is in (`libc.so.6`), else its name (`__rust_alloc`).
fn owner(frame: &Frame) -> String {
    if let Some(library) = frame.file.as_deref().and_then(rust_library) {
        return library.to_owned();
    }
    let qualified =
        frame.function.as_deref().map(|name| culprit::qualified_name(name).trim_start_matches('<'));
    if let Some((first, _)) = qualified.and_then(|name| name.split_once("::")) {
        return first.to_owned();
    }
    let object = frame.module.as_deref().map(|module| module.rsplit('/').next().unwrap_or(module));
    match (object.filter(|file| file.contains(".so")), qualified, object) {
        (Some(object), _, _) | (None, None, Some(object)) => object.to_owned(),
        (None, Some(name), _) => name.to_owned(),
        (None, None, None) => "unknown code".to_owned(),
    }
}

/// The library of Rust's standard library, or the crate cargo unpacked,
/// that `file` belongs to.
fn rust_library(file: &str) -> Option<&str> {
    if let Some((_, rest)) = file.split_once("/library/") {
        return rest.split('/').next();
    }
    let (_, rest) = file.split_once("/.cargo/registry/src/")?;
    // index.crates.io-HASH/hashbrown-0.15.2/src/...
    let directory = rest.split('/').nth(1)?;
    let version_start = directory.rfind('-')?;
    Some(&directory[..version_start])
}

/// What is outstanding over all stacks, and what was seen.
fn write_totals(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let shown = if report.total_stacks > report.stacks.len() {
        format!(", {} of {} stacks shown", report.stacks.len(), report.total_stacks)
    } else {
        String::new()
    };
    let older = match report.min_age_ms {
        0 => String::new(),
        ms => format!(" older than {ms} ms"),
    };
    writeln!(
        out,
        "Outstanding: {} bytes in {} allocations{older}{shown}",
        report.total_bytes, report.total_allocations,
    )?;
    if !report.total_replacing.is_none() {
        writeln!(
            out,
            "Of those, {} bytes in {} allocations replace blocks allocated before memleak attached (a cache \
             refilling): outstanding, but not growth",
            report.total_replacing.bytes, report.total_replacing.allocations
        )?;
    }
    write_resident(report, out)?;
    let health = &report.health;
    // Every call is seen; with -s only some allocations are recorded,
    // while every free is looked up. Say which figure counts what.
    let recorded = match (report.sample_rate, health.recorded_allocations) {
        // A snapshot saved before recorded allocations were counted.
        (_, None) => String::new(),
        (0 | 1, Some(recorded)) if recorded == health.allocations => String::new(),
        (0 | 1, Some(recorded)) => format!(" ({recorded} recorded)"),
        (rate, Some(sampled)) => format!(" ({sampled} sampled, 1 in {rate})"),
    };
    writeln!(
        out,
        "Seen: {} allocations{recorded}, {} frees, {} failed allocations; {} allocations not tracked, {} stacks lost",
        health.allocations,
        health.frees,
        health.failed_allocations,
        health.allocations_not_tracked,
        health.stacks_lost,
    )?;
    write_unrecorded_frees(report, out)
}

/// The process's resident memory by what holds it, and when its growth
/// is not the blocks memleak tracks, why it is not a leak memleak sees.
fn write_resident(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let Some(resident) = &report.memory.resident else { return Ok(()) };
    writeln!(
        out,
        "Resident: {}: {} anonymous (the heap and arenas {}, thread stacks {}), {} of files",
        status::readable_bytes(resident.resident_bytes),
        status::readable_bytes(resident.anon_bytes),
        status::readable_bytes(resident.heap_bytes),
        status::readable_bytes(resident.thread_stack_bytes),
        status::readable_bytes(resident.file_bytes),
    )?;
    if let Some(verdict) = &report.memory.not_a_leak {
        let mut verdict = verdict.clone();
        verdict.replace_range(..1, &verdict[..1].to_uppercase());
        writeln!(out, "{verdict}")?;
    }
    Ok(())
}

/// The frees of blocks memleak never saw allocated, if there were any,
/// and what they do to the trends.
fn write_unrecorded_frees(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    if let Some(frees @ 1..) = report.health.unrecorded_frees {
        writeln!(
            out,
            "{frees} of those frees were of blocks memleak never saw allocated (allocated before it attached, \
             or left out by -s, -z, -Z or --max-allocs), of sizes unknown"
        )?;
    }
    if let Some(frees @ 1..) = report.delta_unrecorded_frees {
        writeln!(
            out,
            "Since the last report: {frees} frees of blocks memleak never saw allocated; the blocks \
             allocated in their places count as replacing them, not as growth (unless -s, -z or -Z left \
             blocks out)"
        )?;
    }
    Ok(())
}

/// What memleak could not keep or left out, each with what to do.
fn write_health(report: &Report, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let health = &report.health;
    if !report.truncated_stacks.is_empty() {
        let why: Vec<String> = report
            .truncated_stacks
            .iter()
            .map(|(truncation, stacks)| format!("{stacks} {}", truncation.describe()))
            .collect();
        writeln!(out, "Truncated stacks: {}", why.join(", "))?;
    }
    if health.allocations_not_tracked > 0 {
        writeln!(out, "{} allocations not tracked: raise --max-allocs", health.allocations_not_tracked)?;
    }
    let hidden = &report.hidden_mappings;
    let not_shown: Vec<String> = [
        (hidden.allocator_bytes, "the allocator mapped for itself"),
        (hidden.thread_stack_bytes, "of thread stacks"),
        (hidden.reserved_bytes, "of address space reserved with PROT_NONE, not memory"),
        (
            hidden.python_arena_bytes,
            "of CPython's small-object arenas, whose objects only --python-allocator or PYTHONMALLOC=malloc show",
        ),
        (hidden.file_bytes, "of files mapped into memory"),
    ]
    .iter()
    .filter(|(bytes, _)| *bytes > 0)
    .map(|(bytes, what)| format!("{bytes} bytes {what}"))
    .collect();
    if !not_shown.is_empty() {
        writeln!(out, "Not shown: {} (--all-mmaps)", not_shown.join(", "))?;
    }
    if health.events_lost > 0 {
        writeln!(out, "{} trace events lost: memleak could not keep up", health.events_lost)?;
    }
    if health.stacks_lost > 0 {
        writeln!(out, "{} allocations without a stack: raise --max-stacks", health.stacks_lost)?;
    }
    for missing in &report.missing_symbols {
        writeln!(out, "{}", describe_missing(missing))?;
    }
    Ok(())
}

/// `No symbols for MODULE: ADVICE`, or `No file:line for` one: what would
/// name a report's frames better. Also `memleak top`'s.
pub fn describe_missing(missing: &MissingSymbols) -> String {
    let lacking = match missing.lacking {
        Lacking::Names => "No symbols for",
        Lacking::Lines => "No file:line for",
    };
    format!("{lacking} {}: {}", printable(&missing.module), printable(&missing.advice))
}

/// What grew and what shrank between two snapshots, growth first; runs of
/// plumbing frames folded unless `full_stacks`.
pub fn render_diff(diff: &Diff, full_stacks: bool, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    let (base, new) = (&diff.base, &diff.new);
    let seconds = (new.time_unix_ms.abs_diff(base.time_unix_ms) + 500) / 1000;
    let later = if new.time_unix_ms >= base.time_unix_ms { "later" } else { "earlier" };
    let (base_subject, new_subject) = (subject::of_side(base), subject::of_side(new));
    if base_subject == new_subject {
        writeln!(out, "Changes in outstanding memory in {new_subject}, {seconds} s {later}:")?;
    } else {
        writeln!(
            out,
            "Changes in outstanding memory: base {base_subject}, new {new_subject}, {seconds} s {later}:"
        )?;
    }
    for stack in &diff.stacks {
        writeln!(
            out,
            "\t{:+} bytes in {:+} {} from stack ({} -> {} bytes)",
            stack.delta_bytes,
            stack.delta_allocations,
            source(stack.mapping),
            stack.base_bytes,
            stack.new_bytes
        )?;
        let replacing = stack.new_replacing_bytes as i64 - stack.base_replacing_bytes as i64;
        if replacing != 0 {
            writeln!(
                out,
                "\t\treplacing: {replacing:+} bytes of blocks that took the place of blocks from before memleak \
                 attached; {:+} bytes of new memory",
                stack.delta_new_bytes
            )?;
        }
        write_culprit(stack.culprit.as_ref(), &stack.frames, out)?;
        let plumbing = folded(full_stacks, stack.culprit.is_some(), &stack.plumbing);
        write_frames(stack.stack_lost, &stack.frames, plumbing, out)?;
    }
    let shown = if diff.total_stacks > diff.stacks.len() {
        format!(", {} shown", diff.stacks.len())
    } else {
        String::new()
    };
    writeln!(
        out,
        "Net: {:+} bytes ({} -> {} bytes, {} -> {} allocations), {} stacks changed{shown}",
        diff.delta_bytes(),
        base.total_bytes,
        new.total_bytes,
        base.total_allocations,
        new.total_allocations,
        diff.total_stacks
    )?;
    if let Some(frees @ 1..) = diff.unrecorded_frees_between {
        writeln!(
            out,
            "Between these snapshots the program freed {frees} blocks memleak never saw allocated, of sizes \
             unknown; the blocks allocated in their places count as replacing them, not as growth (unless -s, \
             -z or -Z left blocks out)"
        )?;
    }
    Ok(())
}

pub fn render_cgroup_total(total: &CgroupTotal, out: &mut (impl Write + ?Sized)) -> io::Result<()> {
    write!(
        out,
        "Cgroup {}: {} bytes in {} allocations outstanding in {} processes",
        printable(&total.cgroup),
        total.total_bytes,
        total.total_allocations,
        total.processes
    )?;
    let exited = &total.exited;
    match exited.processes {
        0 => writeln!(out),
        1 => writeln!(
            out,
            "; 1 process exited since, with {} bytes in {} allocations outstanding at its exit",
            exited.total_bytes, exited.total_allocations
        ),
        processes => writeln!(
            out,
            "; {processes} processes exited since, with {} bytes in {} allocations outstanding at their exits",
            exited.total_bytes, exited.total_allocations
        ),
    }
}

/// What a stack's amounts count.
fn source(mapping: Option<MappingKind>) -> &'static str {
    match mapping {
        None => "allocations",
        Some(MappingKind::Mmap) => "mmap regions",
        Some(MappingKind::AllocatorMmap) => "allocator mmap regions",
        Some(MappingKind::ThreadStack) => "thread stacks",
        Some(MappingKind::Reservation) => "PROT_NONE reservations",
        Some(MappingKind::PythonArena) => "CPython arenas",
        Some(MappingKind::FileMapping) => "file mappings",
    }
}

/// ` (+8192 bytes since last report, growing for 3 reports, +8192 bytes
/// per report)`; nothing in the first report.
fn describe_trend(trend: &Trend) -> String {
    let Some(delta) = trend.delta_bytes else { return String::new() };
    let change = match delta {
        0 => "unchanged since last report".to_owned(),
        _ => format!("{delta:+} bytes since last report"),
    };
    match (trend.growing_reports, trend.growth_per_report) {
        (reports, Some(growth)) if reports >= 2 => {
            format!(" ({change}, growing for {reports} reports, {growth:+} bytes per report)")
        }
        _ => format!(" ({change})"),
    }
}

/// `function+0xoff (file:line) [module]`, with `[inlined]` for frames
/// inlined into the next one, and `function (file:line) [python]` for a
/// Python function. Names are escaped (`printable`).
pub fn describe(frame: &Frame) -> String {
    let mut text = frame_name(frame);
    if let Some(offset) = frame.offset.filter(|_| frame.function.is_some()) {
        let _ = write!(text, "+{offset:#x}");
    }
    if let Some(file) = frame.file.as_deref().map(printable) {
        let _ = match frame.line {
            Some(line) => write!(text, " ({file}:{line})"),
            None => write!(text, " ({file})"),
        };
    }
    if frame.is_python() {
        text.push_str(" [python]");
    } else if frame.inlined {
        text.push_str(" [inlined]");
    } else if let Some(module) = frame.module.as_deref().map(printable) {
        let _ = write!(text, " [{module}]");
    }
    text
}

/// What a frame is called: its function (` [clone .cold]` in its cold
/// part, as `nm -C` names that part); without one, its module's file name
/// and the offset in that file (`memcached+0x1a2b3`), which a symbolizer
/// can still read later; without a module either, its address.
pub fn frame_name(frame: &Frame) -> String {
    match (&frame.function, frame.file_location()) {
        (Some(function), _) if frame.cold_part => format!("{} [clone .cold]", printable(function)),
        (Some(function), _) => printable(function).into_owned(),
        (None, Some(location)) => printable(&location).into_owned(),
        (None, None) => format!("[unknown] {:#x}", frame.address),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample_report;

    /// The header's clock depends on the time zone: it is masked.
    #[test]
    fn text_matches_the_golden_file() {
        let mut out = Vec::new();
        render(&sample_report(3), false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let masked = format!("[HH:MM:SS]{}", &text["[HH:MM:SS]".len()..]);
        let expected = include_str!("../../tests/data/report.txt");
        assert_eq!(masked, expected);
    }

    #[test]
    fn runs_of_plumbing_are_folded_unless_every_frame_is_asked_for() {
        let frame = |function: &str, file: &str| {
            Arc::new(Frame {
                function: Some(function.to_owned()),
                file: Some(file.to_owned()),
                ..Frame::default()
            })
        };
        let frames = [
            frame("alloc", "/rustc/abc/library/alloc/src/alloc.rs"),
            frame("grow_one", "/rustc/abc/library/alloc/src/raw_vec.rs"),
            frame("insert", "/root/.cargo/registry/src/index.crates.io-1/hashbrown-0.15.2/src/map.rs"),
            frame("std::vector<int>::push_back", "/usr/include/c++/12/bits/stl_vector.h"),
            frame("record_audit_event", "/srv/src/audit.rs"),
            frame("call_once", "/rustc/abc/library/core/src/ops/function.rs"),
            frame("main", "/srv/src/main.rs"),
        ];
        let plumbing = [true, true, true, true, false, true, false];
        let mut out = Vec::new();
        write_frames(false, &frames, &plumbing, &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\t\t... 4 frames of alloc, hashbrown and std\n\t\trecord_audit_event (/srv/src/audit.rs)\n\
             \t\tcall_once (/rustc/abc/library/core/src/ops/function.rs)\n\t\tmain (/srv/src/main.rs)\n"
        );
        let mut out = Vec::new();
        write_frames(false, &frames, folded(true, true, &plumbing), &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap().lines().count(), 7, "--full-stacks");
        assert!(folded(false, false, &plumbing).is_empty(), "a stack without a culprit keeps its frames");
    }

    #[test]
    fn control_characters_in_names_are_escaped() {
        let mut frame = crate::report::tests::frame("\x1b]0;owned\x07main", "/src/\r\nforged.c", 3);
        frame.module = Some("/app/\u{9b}31m".to_owned());
        assert_eq!(describe(&frame), "\\x1b]0;owned\\x07main+0x1f (/src/\\r\\nforged.c:3) [/app/\\u{9b}31m]");
    }

    #[test]
    fn a_program_and_an_allocator_are_escaped_too() {
        let mut report = sample_report(1);
        report.allocator = "/lib/\x1b[2Jlibc.so.6".to_owned();
        let mut out = Vec::new();
        render(&report, false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.lines()
                .next()
                .unwrap()
                .ends_with("in pid 4242 (/app/leaker) through /lib/\\x1b[2Jlibc.so.6:"),
            "{text}"
        );
        let mut diff = crate::report::diff::tests::sample_diff(1);
        diff.new.program = "/app/\nserver".to_owned();
        let mut out = Vec::new();
        render_diff(&diff, false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with(
                "Changes in outstanding memory: base pid 7 (/app/server) through /usr/lib/libc.so.6, \
                 new pid 7 (/app/\\nserver) through /usr/lib/libc.so.6, "
            ),
            "{text}"
        );
    }

    /// The header names the process by its program, the allocator beside
    /// it: libc alone tells one process from another no better than a pid.
    #[test]
    fn the_header_names_the_program_and_its_allocator() {
        let mut out = Vec::new();
        render(&sample_report(1), false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            &text[text.find(']').unwrap()..text.find('\n').unwrap()],
            "] Top 1 stacks with outstanding allocations in pid 4242 (/app/leaker) through /usr/lib/libc.so.6:"
        );
        let mut kernel = sample_report(1);
        kernel.pid = memleak_common::KERNEL_TGID;
        let mut out = Vec::new();
        render(&kernel, false, &mut out).unwrap();
        assert!(String::from_utf8(out)
            .unwrap()
            .contains("] Top 1 stacks with outstanding allocations in the kernel:\n"));
    }

    #[test]
    fn a_diff_of_one_process_names_it_once() {
        let mut out = Vec::new();
        render_diff(&crate::report::diff::tests::sample_diff(1), false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text.lines().next().unwrap(),
            "Changes in outstanding memory in pid 7 (/app/server) through /usr/lib/libc.so.6, 60 s later:"
        );
    }

    #[test]
    fn a_diff_matches_the_golden_file() {
        let mut out = Vec::new();
        render_diff(&crate::report::diff::tests::sample_diff(10), false, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), include_str!("../../tests/data/diff.txt"));
    }

    /// CPython's arenas are counted apart, with how to see inside them.
    #[test]
    fn python_arenas_are_counted_apart_with_how_to_see_inside() {
        let mut report = sample_report(1);
        report.hidden_mappings.python_arena_bytes = 2 << 20;
        let mut out = Vec::new();
        render(&report, false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let line = text.lines().find(|line| line.starts_with("Not shown: ")).unwrap();
        assert_eq!(
            line,
            "Not shown: 2097152 bytes of CPython's small-object arenas, whose objects only --python-allocator or PYTHONMALLOC=malloc show (--all-mmaps)"
        );
    }

    #[test]
    fn a_cgroup_total_counts_the_processes_that_exited_apart() {
        let mut report = sample_report(1);
        let line = |exited: crate::report::ExitedTotal| {
            let total = CgroupTotal::of(std::path::Path::new("/sys/fs/cgroup/app"), &[], exited);
            let mut out = Vec::new();
            render_cgroup_total(&total, &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        let mut exited = crate::report::ExitedTotal::default();
        assert_eq!(
            line(exited),
            "Cgroup /sys/fs/cgroup/app: 0 bytes in 0 allocations outstanding in 0 processes\n"
        );
        report.total_bytes = 233_472;
        report.total_allocations = 57;
        exited.add(&report);
        assert_eq!(
            line(exited),
            "Cgroup /sys/fs/cgroup/app: 0 bytes in 0 allocations outstanding in 0 processes; 1 process exited \
             since, with 233472 bytes in 57 allocations outstanding at its exit\n"
        );
        exited.add(&report);
        assert!(line(exited).ends_with(
            "; 2 processes exited since, with 466944 bytes in 114 allocations outstanding at their exits\n"
        ));
    }
}
