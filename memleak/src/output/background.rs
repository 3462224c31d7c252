//! Whole documents written by a thread of their own (--save's snapshots):
//! a snapshot of 65,536 deep stacks takes seconds to serialize and
//! compress, and the report loop must not stand still meanwhile, nor the
//! reports that go to the terminal or the output file.

use std::{
    io::{self, Write},
    path::PathBuf,
    sync::mpsc::{sync_channel, SyncSender},
    thread::JoinHandle,
};

use super::{NumberedFiles, OutputError};

/// What renders one document.
type Render = Box<dyn FnOnce(&mut dyn Write) -> io::Result<()> + Send>;

/// `NumberedFiles` written in order by one thread. At most one document
/// waits while another is written: past that `write` waits, so a run whose
/// documents take longer than its interval holds two reports at most, not
/// a growing queue. The first error ends the writing; it is returned by
/// the next `write`, or by `finish`.
pub struct BackgroundFiles {
    documents: Option<SyncSender<Render>>,
    writer: Option<JoinHandle<Result<(), OutputError>>>,
    /// As the user gave it, for messages.
    path: PathBuf,
}

impl BackgroundFiles {
    pub fn new(mut files: NumberedFiles) -> Result<Self, OutputError> {
        let (documents, waiting) = sync_channel::<Render>(1);
        let path = files.path.clone();
        let writer = std::thread::Builder::new()
            .name("memleak-save".to_owned())
            .spawn(move || {
                for render in waiting {
                    files.write(render)?;
                }
                Ok(())
            })
            .map_err(|source| OutputError::Write { path: path.clone(), source })?;
        Ok(Self { documents: Some(documents), writer: Some(writer), path })
    }

    /// Hands `render`'s document to the writer; returns the error that
    /// stopped it, if one did.
    pub fn write(
        &mut self,
        render: impl FnOnce(&mut dyn Write) -> io::Result<()> + Send + 'static,
    ) -> Result<(), OutputError> {
        if self.writer.as_ref().is_some_and(JoinHandle::is_finished) {
            return self.finish();
        }
        match &self.documents {
            Some(documents) if documents.send(Box::new(render)).is_ok() => Ok(()),
            // The writer stopped on an error, which `finish` returns.
            _ => self.finish(),
        }
    }

    /// Waits until every document handed over is written; returns the
    /// first error, if any.
    pub fn finish(&mut self) -> Result<(), OutputError> {
        drop(self.documents.take());
        match self.writer.take().map(JoinHandle::join) {
            None => Ok(()),
            Some(Ok(written)) => written,
            Some(Err(_)) => Err(OutputError::Write {
                path: self.path.clone(),
                source: io::Error::other("the thread writing it panicked"),
            }),
        }
    }
}

impl Drop for BackgroundFiles {
    /// Documents handed over are written before memleak goes, whatever
    /// ended the run; an error is said by `finish`, which a run that ends
    /// well calls.
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
