//! `memleak report` and `memleak diff`: snapshots saved with --save,
//! rendered or compared later, without root and without the process.
//! Each snapshot is read with its frames held once (`Saved`): a report
//! copies out the frames of the stacks it shows, a diff shares them.

use crate::{
    config::{DiffConfig, ReportConfig},
    output::{Documents, Output, OutputError},
    report::{
        diff::Diff,
        printable,
        saved::{self, SavedError},
    },
};

#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error(transparent)]
    Saved(#[from] SavedError),
    #[error(transparent)]
    Output(#[from] OutputError),
}

pub fn report(config: &ReportConfig) -> Result<(), OfflineError> {
    let mut report =
        saved::read(&config.snapshot)?.into_report(&config.shown, config.output.rendering.format)?;
    report.name_stacks(&config.skips);
    let mut output = Output::open(&config.output, Documents::One)?;
    finish(output.report(&report), output)
}

pub fn diff(config: &DiffConfig) -> Result<(), OfflineError> {
    let base = saved::read(&config.base)?;
    let new = saved::read(&config.new)?;
    let (base_report, new_report) = (base.report(), new.report());
    if base_report.program != new_report.program {
        log::warn!(
            "the snapshots are of different programs ({} and {}): stacks are compared by function names",
            printable(&base_report.program),
            printable(&new_report.program)
        );
    }
    if base_report.time_unix_ms > new_report.time_unix_ms {
        log::warn!(
            "{} was taken after {}: growth shows as shrinking",
            config.base.display(),
            config.new.display()
        );
    }
    if base_report.sample_rate != new_report.sample_rate {
        log::warn!(
            "the snapshots were sampled differently (1 in {} and 1 in {}): the figures are estimates",
            base_report.sample_rate,
            new_report.sample_rate
        );
    }
    let diff = Diff::of(&base, &new, config.top, config.order, &config.skips);
    // The diff shares the frames it shows; the rest of both snapshots goes.
    drop((base, new));
    let mut output = Output::open(&config.output, Documents::One)?;
    finish(output.diff(&diff), output)
}

/// Puts the output in place once written; a closed stdout is no error.
fn finish(written: Result<(), OutputError>, output: Output) -> Result<(), OfflineError> {
    match written {
        Ok(()) => Ok(output.finish()?),
        Err(OutputError::ReaderGone) => Ok(()),
        Err(error) => Err(error.into()),
    }
}
