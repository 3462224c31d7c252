//! `memleak report` and `memleak diff`: snapshots saved with --save,
//! rendered or compared later, without root and without the process.

use crate::{
    config::{DiffConfig, ReportConfig},
    output::{Documents, Output, OutputError},
    report::{
        diff::Diff,
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
    let mut report = saved::load(&config.snapshot)?;
    report.cut_for_display(&config.shown, config.output.rendering.format);
    let mut output = Output::open(&config.output, Documents::One)?;
    finish(output.report(&report), output)
}

pub fn diff(config: &DiffConfig) -> Result<(), OfflineError> {
    let base = saved::load(&config.base)?;
    let new = saved::load(&config.new)?;
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
            config.base.display(),
            config.new.display()
        );
    }
    if base.sample_rate != new.sample_rate {
        log::warn!(
            "the snapshots were sampled differently (1 in {} and 1 in {}): the figures are estimates",
            base.sample_rate,
            new.sample_rate
        );
    }
    let diff = Diff::between(&base, &new, config.top);
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
