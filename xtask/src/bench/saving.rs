//! `--save` at 65,536 distinct stacks of 37 frames (the shape of
//! tests/fixtures/spread.c's 16 levels): the time one snapshot takes to
//! serialize, compress and write, measured on a synthetic report by
//! memleak's own code (an ignored test of `report::saved`, run in release),
//! and the time the report loop gives it. The goal is under 2 s a
//! snapshot; unbuffered, serde's small writes into the compressor took
//! 32-45 s.

use std::process::Stdio;

use anyhow::{bail, Context as _, Result};

use crate::cargo;

const GOAL_SECONDS: f64 = 2.0;
const TEST: &str = "report::saved::tests::bench_saving_65536_stacks_of_37_frames";

pub struct Saving {
    /// Serializing, compressing and writing one snapshot, fsync included.
    seconds: f64,
    bytes: u64,
    /// Copying the report for the thread that writes it: what the report
    /// loop waits for.
    copied_seconds: f64,
}

pub fn measure() -> Result<Saving> {
    let output = cargo()
        .args(["test", "--release", "--package", "memleak", "--bin", "memleak", "--", "--ignored", "--exact"])
        .args([TEST, "--nocapture"])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo test")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!("{TEST} failed with {}: {stdout}", output.status);
    }
    // bench: saved 65536 stacks of 37 frames in S s, B bytes; copied in C s
    let line =
        stdout.lines().find_map(|line| line.strip_prefix("bench: saved ")).context("no timing printed")?;
    let number_after = |word: &str| -> Result<f64> {
        let rest = line.split_once(word).with_context(|| format!("no `{word}` in {line}"))?.1;
        let number = rest.split([' ', ',', ';']).next().unwrap_or("");
        number.parse().with_context(|| format!("not a number after `{word}` in {line}"))
    };
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a byte count, printed whole"
    )]
    let bytes = number_after("s, ")? as u64;
    Ok(Saving { seconds: number_after(" in ")?, bytes, copied_seconds: number_after("copied in ")? })
}

pub fn print(result: &Result<Saving>) {
    println!();
    println!("--save at 65536 stacks of 37 frames (a synthetic report, memleak's own writer):");
    println!();
    match result {
        Ok(saving) => {
            println!(
                "- one snapshot written in {:.2} s ({:.1} MB gzipped): {:.2} of the {GOAL_SECONDS:.0} s goal",
                saving.seconds,
                saving.bytes as f64 / 1e6,
                saving.seconds / GOAL_SECONDS
            );
            println!(
                "- the report loop gives it {:.0} ms (a copy of the report for the writing thread)",
                saving.copied_seconds * 1000.0
            );
        }
        Err(error) => println!("- failed: {error:#}"),
    }
}
