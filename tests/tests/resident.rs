//! Is it even a leak? Each report puts the process's resident memory
//! beside the blocks memleak tracks: a glibc program whose freed memory
//! stays in its arenas grows its resident memory while the blocks it
//! holds do not, and its report says so, naming where it grew and what to
//! try; a leak is not told so.

use memleak_tests::{fixture, fixtures::marker_line, memleak::stacks_at, Memleak};
use serde_json::Value;

/// memleak -c on the growth fixture doing `kind`, blocks younger than
/// half a second left out (those a round holds a moment), a JSON report
/// every 3 s: its second report.
fn second_report(kind: &str) -> Value {
    let command = format!("{} {kind}", fixture("growth").display());
    let memleak = Memleak::start(&["-c", &command, "--format", "json", "-o", "500", "3", "2"]);
    let (status, reports) = memleak.finish();
    assert!(status.success(), "memleak exited with {status}");
    let [_, second] = reports.as_slice() else { panic!("not two reports: {reports:#?}") };
    second.clone()
}

#[test]
fn memory_an_allocator_keeps_grows_resident_memory_and_is_said_not_to_be_a_leak() {
    let report = second_report("fragment");
    let resident = &report["resident"];
    let growth = &report["resident_growth"];
    let figure =
        |value: &Value, name: &str| value[name].as_i64().unwrap_or_else(|| panic!("no {name}: {report:#}"));
    // The fixture's two threads take 4 blocks of 64 KiB more a round, ten
    // rounds a second: about 5 MiB a second, which their arenas keep.
    let (anon, heap, tracked) =
        (figure(growth, "anon_bytes"), figure(growth, "heap_bytes"), figure(growth, "tracked_bytes"));
    assert!(anon >= 4 << 20, "anonymous memory grew {anon} bytes in 3 s: {report:#}");
    assert!(heap * 10 >= anon * 9, "the arenas grew {heap} of its {anon}: {report:#}");
    assert!(tracked * 4 < anon, "the blocks tracked grew {tracked} of {anon}: {report:#}");
    assert!(figure(resident, "heap_bytes") <= figure(resident, "anon_bytes"), "{resident:#}");
    assert!(figure(resident, "anon_bytes") <= figure(resident, "resident_bytes"), "{resident:#}");
    let verdict = report["not_a_leak"].as_str().unwrap_or_else(|| panic!("no verdict: {report:#}"));
    assert!(
        verdict.starts_with("mostly not a leak: anonymous memory grew +")
            && verdict.contains("most of it in the heap and the allocator's arenas")
            && verdict.contains("malloc_trim(0)"),
        "{verdict}"
    );
    // What it holds are the pins, whole blocks of 8 KiB.
    let pins = stacks_at(&report, "fragment_thread", marker_line("growth", "fragment-pin"));
    let (bytes, allocations): (u64, u64) = pins
        .iter()
        .map(|stack| (stack["bytes"].as_u64().unwrap(), stack["allocations"].as_u64().unwrap()))
        .fold((0, 0), |(bytes, count), (b, c)| (bytes + b, count + c));
    assert!(allocations > 0 && bytes == allocations * 8192, "{allocations} pins, {bytes} bytes: {report:#}");
    // Besides, the threads' own (glibc's calloc of their TLS vectors).
    let total = report["total_bytes"].as_u64().unwrap();
    assert!(total >= bytes && total - bytes < 4096, "nothing held but the pins: {report:#}");
}

#[test]
fn a_leak_that_grows_resident_memory_is_not_said_otherwise() {
    let report = second_report("leak 4096");
    let growth = &report["resident_growth"];
    let (anon, tracked) = (growth["anon_bytes"].as_i64().unwrap(), growth["tracked_bytes"].as_i64().unwrap());
    assert!(
        anon >= 4 << 20 && tracked * 4 >= anon,
        "a leak's growth, {anon} bytes, tracked {tracked}: {report:#}"
    );
    assert_eq!(report["not_a_leak"], Value::Null, "{report:#}");
}
