//! `memleak top`: a live view in the terminal. The stacks that hold the
//! most memory, each with its growth and a sparkline of its past, updated
//! every interval; a stack opened to its frames; a filter, a pause, and
//! a snapshot saved and diffed against in place.
//!
//! The reports come from a session of its own (`local`) or from a
//! running `memleak serve` (`daemon`); `view` holds what is shown and
//! what keys do, `draw` draws it, and `terminal` takes the terminal and
//! gives it back.

mod daemon;
mod draw;
mod local;
mod terminal;
mod view;

use std::path::Path;

use crossterm::event::Event;
use hyper::StatusCode;
use tokio::signal::unix::{signal, Signal, SignalKind};

use self::{
    daemon::Daemon,
    draw::Heading,
    local::Local,
    terminal::Screen,
    view::{Asked, LastSave, Update, View},
};
use crate::{
    bpf::TracerError,
    config::{TopConfig, TopSource},
    output::{next_numbered, Documents, NumberedFiles},
    report::{culprit::SkipRules, saved, text, Report},
    session::SessionError,
};

#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Tracer(#[from] TracerError),
    /// The daemon cannot be reached, or refused.
    #[error("{0}")]
    Connect(String),
    /// The daemon answered with an error.
    #[error("{1}")]
    Status(StatusCode, String),
    #[error("pid {0} is no longer traced")]
    Gone(u32),
    #[error("memleak top needs a terminal: {0}")]
    Terminal(std::io::Error),
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
}

/// What a source of reports says next.
pub enum Happened {
    /// The processes' latest reports.
    Round(Vec<Update>),
    /// Something to show on the status line.
    Said(String),
    /// The last reports: every process traced exited, and why.
    Ended(Vec<Update>, String),
}

/// Where the reports come from.
enum Source {
    /// Boxed: a session is large beside a daemon's address.
    Local(Box<Local>),
    Daemon {
        daemon: Daemon,
        rounds: tokio::time::Interval,
    },
}

impl Source {
    async fn next(&mut self, skips: &SkipRules) -> Result<Happened, TopError> {
        match self {
            Source::Local(local) => local.next().await,
            Source::Daemon { daemon, rounds } => {
                rounds.tick().await;
                daemon.round(skips).await.map(Happened::Round)
            }
        }
    }

    async fn whole(&mut self, pid: u32) -> Result<Report, TopError> {
        match self {
            Source::Local(local) => local.whole(pid),
            Source::Daemon { daemon, .. } => daemon.whole(pid).await,
        }
    }
}

/// Shows the view until `q`, Ctrl-C, SIGTERM or SIGHUP, or until every
/// process traced exited, whose last reports are then printed as text.
pub async fn run(config: &TopConfig) -> Result<(), TopError> {
    let mut stops = Stops::new().map_err(TopError::Signals)?;
    let mut view = View::new(config.sort, config.skips.clone());
    // A daemon out of reach, or one that refuses the token, is said in a
    // line before the screen is taken.
    let daemon = match &config.source {
        TopSource::Daemon { url, token_file, pids } => {
            let daemon = Daemon::new(url, token_file.as_deref(), pids.clone())?;
            view.take(daemon.round(&config.skips).await?);
            Some(daemon)
        }
        TopSource::Trace { .. } => None,
    };
    let heading = Heading {
        source: match (&config.source, &daemon) {
            (_, Some(daemon)) => daemon.describe(),
            (TopSource::Trace { target, .. }, None) => Local::describe(target),
            (TopSource::Daemon { url, .. }, None) => url.clone(),
        },
        interval: config.interval,
        colour: std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty()),
    };
    let mut screen = Screen::take().map_err(TopError::Terminal)?;
    let mut source = match (daemon, &config.source) {
        (Some(daemon), _) => {
            let mut rounds =
                tokio::time::interval_at(tokio::time::Instant::now() + config.interval, config.interval);
            rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            Source::Daemon { daemon, rounds }
        }
        (None, TopSource::Trace { target, session }) => {
            // Attaching takes seconds in a large program: said meanwhile.
            "attaching...".clone_into(&mut view.status);
            redraw(&mut screen, &view, &heading)?;
            let local = Local::start(target, session, config.interval)?;
            view.status.clear();
            Source::Local(Box::new(local))
        }
        (None, TopSource::Daemon { .. }) => unreachable!("a daemon is connected to above"),
    };
    let ended = show(config, &mut screen, &mut source, &mut view, &heading, &mut stops).await?;
    drop(screen);
    if let Some(why) = ended {
        print_last_reports(&view);
        crate::status::say(&format!("{why}; its last report is above"));
    }
    Ok(())
}

/// The signals that end the view: in raw mode Ctrl-C is a key, but
/// `kill -INT` is not.
struct Stops {
    terminate: Signal,
    interrupt: Signal,
    hangup: Signal,
}

impl Stops {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }
}

/// The view, drawn after each key, line and round, until it is left
/// (`None`) or every process traced exited (why).
async fn show(
    config: &TopConfig,
    screen: &mut Screen,
    source: &mut Source,
    view: &mut View,
    heading: &Heading,
    stops: &mut Stops,
) -> Result<Option<String>, TopError> {
    loop {
        redraw(screen, view, heading)?;
        let happened = tokio::select! {
            Some(event) = screen.events.recv() => {
                let Event::Key(key) = event else { continue };
                let rows = view.rows().len();
                let page = draw::table_height(view, screen.terminal.size().map_or(24, |size| size.height));
                match view.key(key, rows, page.max(1)) {
                    Asked::Nothing => {}
                    Asked::Quit => return Ok(None),
                    Asked::Save(pid) => view.status = save(source, pid, &config.save, view).await,
                }
                continue;
            }
            Some(mut line) = screen.lines.recv() => {
                // A chatty command: its lines drawn a batch at a time.
                while let Ok(later) = screen.lines.try_recv() {
                    line = later;
                }
                view.status = line;
                continue;
            }
            happened = source.next(&config.skips) => happened,
            _ = stops.terminate.recv() => return Ok(None),
            _ = stops.interrupt.recv() => return Ok(None),
            _ = stops.hangup.recv() => return Ok(None),
        };
        match happened {
            Ok(Happened::Round(updates)) => view.take(updates),
            Ok(Happened::Said(said)) => view.status = said,
            Ok(Happened::Ended(updates, why)) => {
                view.take(updates);
                return Ok(Some(why));
            }
            // A daemon restarting, or a moment out of reach: the view
            // stays, and the next round tries again.
            Err(error) if matches!(source, Source::Daemon { .. }) => {
                view.status = format!("{error}; trying again every {} s", config.interval.as_secs_f64());
            }
            Err(error) => return Err(error),
        }
    }
}

fn redraw(screen: &mut Screen, view: &View, heading: &Heading) -> Result<(), TopError> {
    screen.terminal.draw(|frame| draw::draw(frame, view, heading)).map_err(TopError::Terminal)?;
    Ok(())
}

/// `s`: process `pid`'s report, whole, in the next numbered file after
/// `path`; read back as what `d` diffs against. Says what became of it.
async fn save(source: &mut Source, pid: u32, path: &Path, view: &mut View) -> String {
    let report = match source.whole(pid).await {
        Ok(report) => report,
        Err(error) => return format!("cannot save pid {pid}: {error}"),
    };
    let path = next_numbered(path);
    let written = NumberedFiles::new(&path, Documents::One, false)
        .and_then(|mut files| files.write(|out| saved::write(&report, out)))
        .map_err(|error| error.to_string())
        .and_then(|path| {
            saved::read(&path).map(|snapshot| (path, snapshot)).map_err(|error| error.to_string())
        });
    match written {
        Ok((path, snapshot)) => {
            let said = format!("saved pid {pid} to {}: d diffs against it", path.display());
            view.last_save = Some(LastSave { path, snapshot });
            said
        }
        Err(error) => format!("cannot save pid {pid}: {error}"),
    }
}

/// The last report of each process, as `memleak` prints reports, once
/// the terminal is given back: what the view showed stays in the
/// scrollback.
fn print_last_reports(view: &View) {
    let mut out = std::io::stdout().lock();
    for process in view.processes() {
        let mut report = (*process.report).clone();
        report.stacks.truncate(10);
        let _ = text::render(&report, false, &mut out);
    }
}
