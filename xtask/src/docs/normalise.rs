//! What in an example's output is run-specific, and so neither a reason
//! to rewrite its block nor a failure of `--check`: clock times, pids,
//! addresses (ASLR), durations in `--stats`, ports, cgroup ids. Each is
//! masked before the old and the new text are compared; the text written
//! keeps the real values.
//!
//! Some examples vary more, by nature: how many allocations a timed run
//! catches (`Check::Numbers`), or which stacks a whole kernel holds
//! (`Check::Outline`). They are compared more loosely, as they say.

use std::{fmt::Write as _, sync::LazyLock};

use regex::Regex;

/// How an example's old and new text are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Equal once run-specific values are masked.
    Exact,
    /// Equal once every number is masked too: for runs whose counts depend
    /// on timing (a report every second of a program that leaks as it
    /// goes, a benchmark's random keys).
    Numbers,
    /// Only the commands, memleak's own lines and the reports' headers,
    /// numbers masked: for the kernel's allocations, which are the whole
    /// machine's, and a server's under a benchmark, whose stacks, totals
    /// and health lines differ run to run.
    Outline,
    /// The same lines in any order: for processes that run side by side,
    /// whose lines interleave as they come.
    Unordered,
}

/// Masks, in order: each pattern and what replaces it.
static MASKS: LazyLock<Vec<(Regex, &'static str)>> = LazyLock::new(|| {
    [
        // Clock times: report headers, --trace lines, go tool pprof.
        (r"\[\d\d:\d\d:\d\d(\.\d+)?\]", "[TIME]"),
        (r"(?m)^Time: .*$", "Time: TIME"),
        (r"(?m)^Saved profile in .*$", "Saved profile in PATH"),
        // pids, however they are written.
        (r"\bpids? \d+(,\d+)*", "pid PID"),
        (r#""pid":\d+"#, r#""pid":PID"#),
        (r#"pid="\d+""#, r#"pid="PID""#),
        (r"pid=\d+", "pid=PID"),
        (r"-p \d+(,\d+)*", "-p PID"),
        (r"/proc/\d+/", "/proc/PID/"),
        (r"\((\d+) in its namespace\)", "(PID in its namespace)"),
        (r"pid \d+ in its namespace", "pid PID in its namespace"),
        (r"(?m)^(\[TIME\] )\d+/\d+ ", "${1}PID/TID "),
        (r#"<tr><td class="num">\d+</td>"#, r#"<tr><td class="num">PID</td>"#),
        // Addresses: user and kernel ones, not offsets in a function.
        (r"0x[0-9a-f]{9,}", "0xADDRESS"),
        // Ids of one run: a stack's in a JSON report.
        (r#""stack_id":\d+"#, r#""stack_id":ID"#),
        // Times and durations in JSON.
        (r#"("[a-z_]*_ms"):\d+(\.\d+)?"#, "$1:N"),
        // How much stack walks took from their CPU's last walk: a thread
        // the scheduler moved to another CPU, or that another thread ran
        // between, meets another walk there. The walks and their frames
        // are the same each run.
        (r#""(reusing_walks|frames_reused)":\d+"#, r#""$1":N"#),
        // A process's resident memory: its libraries' pages in the page
        // cache, its heap's as the allocator laid it out this run.
        (r"(?m)^Resident: .*$", "Resident: MEMORY"),
        (r#""resident":\{[^}]*\}"#, r#""resident":{MEMORY}"#),
        (r#""resident_growth":\{[^}]*\}"#, r#""resident_growth":{GROWTH}"#),
        (r#""(resident_bytes|anon_bytes)":\d+"#, r#""$1":N"#),
        (r"(?m)^(memleak_resident_[a-z_]+\{[^}]*\}) \d+$", "$1 N"),
        (r"\d+(\.\d+)? [KMG]?i?B \(\d+(\.\d+)? [KMG]?i?B\)", "SIZE (SIZE)"),
        // The kernel --stats' started record names: the machine's.
        (r#""release":"[^"]*""#, r#""release":"RELEASE""#),
        // Whether `serve --exe` met a newcomer at its execve, or first in
        // its look through /proc, which runs on its own timer.
        (r", found at its execve", ""),
        // Ports a run found free, and ids the kernel gave.
        (r"127\.0\.0\.1:\d+", "127.0.0.1:PORT"),
        (r"--port \d+", "--port PORT"),
        (r"\(id \d+\)", "(id ID)"),
        // Containers' ids.
        (r"\b[0-9a-f]{64}\b", "CONTAINER"),
        (r"\bcontainer ([0-9a-f]{12})\b", "container CONTAINER"),
        (r"\(([0-9a-f]{12})\)", "(CONTAINER)"),
    ]
    .into_iter()
    .map(|(pattern, replacement)| (Regex::new(pattern).expect("a valid mask"), replacement))
    .collect()
});

static NUMBER: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"[+-]?\d[\d,.]*").expect("a valid pattern"));

/// `text` with what is run-specific masked, as `check` compares it.
pub fn normalised(check: Check, text: &str) -> String {
    let mut text = text.to_owned();
    for (pattern, replacement) in MASKS.iter() {
        text = pattern.replace_all(&text, *replacement).into_owned();
    }
    match check {
        Check::Exact => text,
        Check::Numbers => NUMBER.replace_all(&text, "N").into_owned(),
        Check::Unordered => {
            let mut lines: Vec<&str> = text.lines().collect();
            lines.sort_unstable();
            lines.join("\n")
        }
        Check::Outline => {
            let outline: Vec<&str> = text
                .lines()
                .filter(|line| ["$ ", "memleak: ", "["].iter().any(|start| line.starts_with(start)))
                .collect();
            NUMBER.replace_all(&outline.join("\n"), "N").into_owned()
        }
    }
}

/// The lines of `old` and `new` that differ once normalised, `-` then
/// `+` as a diff gives them; empty when they do not.
pub fn difference(check: Check, old: &str, new: &str) -> String {
    let (old, new) = (normalised(check, old), normalised(check, new));
    if old == new {
        return String::new();
    }
    let (old, new): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    // What the two share at each end is left out; what is between is the
    // change. Enough to see what moved, with no diff algorithm.
    let head = old.iter().zip(&new).take_while(|(a, b)| a == b).count();
    let tail = old[head..].iter().rev().zip(new[head..].iter().rev()).take_while(|(a, b)| a == b).count();
    let mut shown = String::new();
    let limit = 20;
    for line in old[head..old.len() - tail].iter().take(limit) {
        let _ = writeln!(shown, "- {line}");
    }
    for line in new[head..new.len() - tail].iter().take(limit) {
        let _ = writeln!(shown, "+ {line}");
    }
    if old.len() - tail - head > limit || new.len() - tail - head > limit {
        shown.push_str("  (more lines)\n");
    }
    if shown.is_empty() {
        shown.push_str("  (line endings)\n");
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_specific_values_are_masked() {
        let one = "[11:11:58] Top 1 stacks with outstanding allocations in pid 17531 (/tmp/x/leaker) through /usr/lib/libc.so.6:\n\
                   \t\t[unknown] 0x7f04f1177010 [anonymous executable memory]\n\
                   {\"pid\":21159,\"time_unix_ms\":1796055410578,\"load_ms\":105.458971}\n\
                   {\"event\":\"stack_walks\",\"walks\":17,\"reusing_walks\":16,\"frames\":102,\"frames_reused\":59}\n\
                   [14:16:45.554] 5293/5293 malloc(10) = 0x563ec410d2a0\n\
                   $ sudo memleak serve --pid 4677,3856\n\
                   memleak: tracing pid 7 (readme-leaker) through /usr/lib/libc.so.6 (13 functions probed)\n";
        let two = "[09:01:02] Top 1 stacks with outstanding allocations in pid 4242 (/tmp/x/leaker) through /usr/lib/libc.so.6:\n\
                   \t\t[unknown] 0x7f0400000010 [anonymous executable memory]\n\
                   {\"pid\":7,\"time_unix_ms\":1,\"load_ms\":99.1}\n\
                   {\"event\":\"stack_walks\",\"walks\":17,\"reusing_walks\":15,\"frames\":102,\"frames_reused\":55}\n\
                   [01:02:03.004] 12/13 malloc(10) = 0x563e00000000\n\
                   $ sudo memleak serve --pid 22,23\n\
                   memleak: tracing pid 7 (readme-leaker) through /usr/lib/libc.so.6 (13 functions probed), found at its execve\n";
        assert_eq!(difference(Check::Exact, one, two), "");
    }

    #[test]
    fn what_memleak_found_is_not_masked() {
        let old = "\t5000 bytes in 1 allocations from stack\n\t\tleak_realloc+0x27 (./tests/fixtures/leaker.c:45)\n";
        let new = "\t5300 bytes in 1 allocations from stack\n\t\tleak_realloc+0x27 (./tests/fixtures/leaker.c:45)\n";
        assert_eq!(
            difference(Check::Exact, old, new),
            "- \t5000 bytes in 1 allocations from stack\n+ \t5300 bytes in 1 allocations from stack\n"
        );
        assert_eq!(difference(Check::Numbers, old, new), "");
        let offset = "\t\tleak_realloc+0x2b (./tests/fixtures/leaker.c:45)\n";
        assert_ne!(
            difference(Check::Exact, "\t\tleak_realloc+0x27 (./tests/fixtures/leaker.c:45)\n", offset),
            ""
        );
    }

    #[test]
    fn an_outline_leaves_out_the_stacks() {
        let old = "[10:00:00] Top 2 stacks in the kernel:\n\t195264 bytes in 1017 allocations from stack\n\t\tkmem_cache_alloc_noprof+0x227 [kernel]\nOutstanding: 1 bytes\n";
        let new = "[10:00:05] Top 2 stacks in the kernel:\n\t92 bytes in 3 allocations from stack\n\t\tvma_alloc+0x1 [kernel]\nOutstanding: 7 bytes, 2 of 9 stacks shown\n3 allocations without a stack: raise --max-stacks\n";
        assert_eq!(difference(Check::Outline, old, new), "");
        assert_ne!(difference(Check::Outline, old, "[10:00:05] Top 2 stacks in pid 3:\n"), "");
    }

    #[test]
    fn unordered_lines_may_come_in_any_order() {
        assert_eq!(difference(Check::Unordered, "child done\ndone\n", "done\nchild done\n"), "");
        assert_ne!(difference(Check::Unordered, "child done\ndone\n", "done\n"), "");
    }
}
