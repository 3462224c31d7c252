//! `memleak report` and `memleak diff`: snapshots saved with --save,
//! rendered or compared later, without root and without the process.

use crate::{
    cli::{DiffArgs, Offline, Rendering, ReportArgs},
    report::{diff::Diff, output::Output, snapshot},
};

pub fn run(offline: Offline) -> anyhow::Result<()> {
    match offline {
        Offline::Report(args) => report(args),
        Offline::Diff(args) => diff(args),
    }
}

fn report(args: ReportArgs) -> anyhow::Result<()> {
    let mut report = snapshot::load(&args.snapshot)?;
    let rendering = &args.rendering;
    report.cut_for_display(args.sort, rendering.stacks_kept(), rendering.format(), args.show_allocs);
    let mut output = open(&args.rendering)?;
    if output.report(&report)? {
        output.finish()?;
    }
    Ok(())
}

fn diff(args: DiffArgs) -> anyhow::Result<()> {
    let base = snapshot::load(&args.base)?;
    let new = snapshot::load(&args.new)?;
    if base.program != new.program {
        log::warn!(
            "the snapshots are of different programs ({} and {}): stacks are compared by function names",
            base.program,
            new.program
        );
    }
    if base.time_unix_ms > new.time_unix_ms {
        log::warn!(
            "{} was taken after {}: growth shows as shrinking",
            args.base.display(),
            args.new.display()
        );
    }
    if base.sample_rate != new.sample_rate {
        log::warn!(
            "the snapshots were sampled differently (1 in {} and 1 in {}): the figures are estimates",
            base.sample_rate,
            new.sample_rate
        );
    }
    let diff = Diff::between(&base, &new, args.rendering.stacks_kept());
    let mut output = open(&args.rendering)?;
    if output.diff(&diff)? {
        output.finish()?;
    }
    Ok(())
}

/// One rendering: a single file, never numbered.
fn open(rendering: &Rendering) -> anyhow::Result<Output> {
    rendering.validate(false).map_err(anyhow::Error::msg)?;
    let output = Output::open(
        rendering.output.as_deref(),
        rendering.force,
        false,
        rendering.format(),
        rendering.weight,
    )?;
    Ok(output)
}
