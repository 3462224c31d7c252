//! SIGINT or SIGTERM at any moment of memleak's start, for `-p`, `-c` and
//! `serve`: a clean end (exit 0, no error), no probe left in the target,
//! and with `-c` the command ended. A signal while the kernel verified
//! the BPF programs used to fail the start with "the kernel rejected BPF
//! program `record_with_user_stack`: Resource temporarily unavailable".

use std::{
    fs,
    time::{Duration, Instant},
};

use memleak_tests::{
    uprobes::{byte_in_file, byte_in_process, multi_links},
    Leaker, Memleak, PATIENCE,
};

const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

/// The signal's moments after memleak has taken charge of it: from its
/// first lines to past the loading of its programs (about 0.1 s after,
/// much later on a busy machine).
const DELAYS_MS: std::ops::RangeInclusive<u64> = 0..=300;
const DELAY_STEP_MS: usize = 20;

/// The signal's moments after memleak says it loads its uprobe programs:
/// the verifier takes 30 to 90 ms over the first, after a few ms of
/// preparing it, so several of these fall inside.
const LOADING_DELAYS_MS: std::ops::RangeInclusive<u64> = 0..=60;
const LOADING_DELAY_STEP_MS: usize = 4;

/// What memleak says with -v just before it loads its uprobe programs.
const LOADING_LINE: &str = "memleak: debug: uprobes: ";

/// The offsets in libc where memleak places its probes.
fn probed_offsets() -> Vec<u64> {
    let leaker = Leaker::start_waiting(&["none"]);
    let pid = leaker.pid().to_string();
    let mut memleak = Memleak::start(&["-p", &pid, "--format", "json", "3600"]);
    memleak.wait_attached();
    let offsets: Vec<u64> =
        multi_links(memleak.child.id()).iter().flat_map(|link| link.offsets.clone()).collect();
    memleak.signal(libc::SIGINT);
    assert!(memleak.finish().0.success());
    leaker.exit();
    assert!(!offsets.is_empty());
    offsets
}

/// Whether `signal` is blocked or caught by process `pid`: memleak has
/// taken charge of it. Before its first instruction no program can.
fn takes_charge_of(pid: u32, signal: libc::c_int) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    let bit = 1u64 << (signal - 1);
    ["SigBlk:", "SigCgt:"].iter().any(|field| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & bit != 0)
    })
}

/// When memleak is signalled.
#[derive(Clone, Copy, Debug)]
enum Moment {
    /// This long after it took charge of the signal.
    AfterTakingCharge(Duration),
    /// This long after it said it loads its uprobe programs.
    IntoLoading(Duration),
}

/// Starts memleak with `args`, signals it at `moment`, and checks that it
/// ended cleanly. Returns its stderr.
fn signalled_at(args: &[&str], signal: libc::c_int, moment: Moment) -> Vec<String> {
    let mut memleak = Memleak::start(args);
    let pid = memleak.child.id();
    let deadline = Instant::now() + PATIENCE;
    while !(takes_charge_of(pid, libc::SIGINT) && takes_charge_of(pid, libc::SIGTERM)) {
        assert!(Instant::now() < deadline, "memleak never took charge of SIGINT and SIGTERM");
        std::thread::sleep(Duration::from_micros(200));
    }
    // The moment of the signal is what is tested.
    match moment {
        Moment::AfterTakingCharge(delay) => std::thread::sleep(delay),
        Moment::IntoLoading(delay) => {
            memleak.stderr.wait_for("memleak to load its programs", |line| line.starts_with(LOADING_LINE));
            std::thread::sleep(delay);
        }
    }
    memleak.signal(signal);
    let stderr_lines = {
        let status = memleak.child.wait().expect("wait for memleak");
        let stderr = memleak.stderr.rest();
        assert_eq!(status.code(), Some(0), "{args:?}, signal {signal} at {moment:?}: {stderr:#?}");
        stderr
    };
    let errors: Vec<&String> =
        stderr_lines.iter().filter(|line| line.starts_with("memleak: error")).collect();
    assert!(errors.is_empty(), "{args:?}, signal {signal} at {moment:?}: {errors:#?}");
    stderr_lines
}

/// Every delay of both kinds, SIGINT and SIGTERM by turns.
fn moments() -> impl Iterator<Item = (libc::c_int, Moment)> {
    let after_taking_charge =
        DELAYS_MS.step_by(DELAY_STEP_MS).map(|delay| Moment::AfterTakingCharge(Duration::from_millis(delay)));
    let into_loading = LOADING_DELAYS_MS
        .step_by(LOADING_DELAY_STEP_MS)
        .map(|delay| Moment::IntoLoading(Duration::from_millis(delay)));
    after_taking_charge
        .chain(into_loading)
        .enumerate()
        .map(|(index, moment)| (if index % 2 == 0 { libc::SIGINT } else { libc::SIGTERM }, moment))
}

fn assert_no_probe_left(target: u32, offsets: &[u64], what: &str) {
    for &offset in offsets {
        assert_eq!(
            byte_in_process(target, LIBC, offset),
            byte_in_file(LIBC, offset),
            "{what}: a breakpoint left at {offset:#x}"
        );
    }
}

#[test]
fn a_signal_at_any_moment_of_the_start_of_p_is_a_clean_end() {
    let offsets = probed_offsets();
    let leaker = Leaker::start_waiting(&["none"]);
    let pid = leaker.pid().to_string();
    for (signal, moment) in moments() {
        signalled_at(&["-v", "-p", &pid, "--format", "json", "3600"], signal, moment);
        assert_no_probe_left(leaker.pid(), &offsets, &format!("-p, signal {signal} at {moment:?}"));
    }
    leaker.exit();
}

#[test]
fn a_signal_at_any_moment_of_the_start_of_serve_is_a_clean_end() {
    let offsets = probed_offsets();
    let leaker = Leaker::start_waiting(&["none"]);
    let pid = leaker.pid().to_string();
    for (signal, moment) in moments() {
        signalled_at(&["serve", "-v", "--pid", &pid, "--port", "0"], signal, moment);
        assert_no_probe_left(leaker.pid(), &offsets, &format!("serve, signal {signal} at {moment:?}"));
    }
    leaker.exit();
}

#[test]
fn a_signal_at_any_moment_of_the_start_of_c_is_a_clean_end_and_ends_the_command() {
    let leaker = memleak_tests::fixture("leaker");
    let command = format!("{} none --wait", leaker.display());
    for (signal, moment) in moments() {
        let stderr = signalled_at(&["-v", "-c", &command, "--format", "json", "3600"], signal, moment);
        // Traced if the signal came after the command was let in: then it
        // was ended with memleak. Before, it never ran.
        let traced = stderr.iter().find_map(|line| {
            line.strip_prefix("memleak: tracing pid ")?.split_whitespace().next()?.parse::<u32>().ok()
        });
        if let Some(command_pid) = traced {
            let state = fs::read_to_string(format!("/proc/{command_pid}/stat")).ok();
            assert!(
                state
                    .is_none_or(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'))),
                "signal {signal} at {moment:?}: the command (pid {command_pid}) outlived memleak"
            );
        }
    }
}
