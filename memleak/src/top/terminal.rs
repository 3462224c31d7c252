//! The terminal, taken for the live view and given back as it was on
//! every way out: `q`, Ctrl-C, SIGTERM, the targets' exit, an error, a
//! panic.
//!
//! The screen is drawn on `/dev/tty`, not on stdout: stdout and stderr
//! are pointed at a pipe while the view is up, so that memleak's own
//! lines and those of a command it started (`-c`) do not scribble over
//! the screen. What comes through the pipe is shown on the status line;
//! memleak's warnings and errors are written again to the real stderr
//! once the terminal is given back.

use std::{
    fs::File,
    io::{self, BufRead as _, Write as _},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    sync::{Arc, Mutex, PoisonError},
};

use crossterm::{
    cursor::{Hide, Show},
    event::Event,
    execute,
    terminal::{self, EnterAlternateScreen, LeaveAlternateScreen},
};
use ratatui::{backend::CrosstermBackend, Terminal};
use tokio::sync::mpsc;

/// What must be undone, held where a panic can reach it.
static TAKEN: Mutex<Option<Taken>> = Mutex::new(None);

struct Taken {
    tty: File,
    /// The stdout and stderr memleak had, moved aside.
    stdout: OwnedFd,
    stderr: OwnedFd,
    /// memleak's warnings and errors said while the view was up.
    said: Arc<Mutex<Vec<String>>>,
}

/// The view's terminal, until dropped.
pub struct Screen {
    /// Buffered: a frame goes out in one write at its end, so that a
    /// terminal never shows half of one (a busy machine can stop memleak
    /// between two of a frame's hundreds of small writes).
    pub terminal: Terminal<CrosstermBackend<io::BufWriter<File>>>,
    /// Keys and resizes.
    pub events: mpsc::UnboundedReceiver<Event>,
    /// Lines written to stdout or stderr meanwhile.
    pub lines: mpsc::UnboundedReceiver<String>,
}

impl Screen {
    /// Takes the terminal: raw mode, the alternate screen, no cursor, and
    /// stdout and stderr into a pipe.
    pub fn take() -> io::Result<Self> {
        let tty = File::options().read(true).write(true).open("/dev/tty")?;
        let Capture { lines, said, stdout, stderr } = capture_output()?;
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            give_back();
            hook(info);
        }));
        let mut screen_tty = tty.try_clone()?;
        {
            let mut taken = TAKEN.lock().unwrap_or_else(PoisonError::into_inner);
            *taken = Some(Taken { tty, stdout, stderr, said });
        }
        terminal::enable_raw_mode().inspect_err(|_| give_back())?;
        execute!(screen_tty, EnterAlternateScreen, Hide).inspect_err(|_| give_back())?;
        let terminal =
            Terminal::new(CrosstermBackend::new(io::BufWriter::with_capacity(1 << 16, screen_tty)))
                .inspect_err(|_| give_back())?;
        Ok(Self { terminal, events: read_events(), lines })
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        give_back();
    }
}

/// Gives the terminal back as it was, and stdout and stderr; says again
/// memleak's warnings and errors. Once: later calls do nothing.
pub fn give_back() {
    let Some(taken) = TAKEN.lock().unwrap_or_else(PoisonError::into_inner).take() else { return };
    let mut tty = &taken.tty;
    let _ = execute!(tty, LeaveAlternateScreen, Show);
    let _ = terminal::disable_raw_mode();
    let _ = tty.flush();
    // SAFETY: dup2 onto the standard descriptors, from descriptors this
    // process owns.
    unsafe {
        libc::dup2(taken.stdout.as_raw_fd(), libc::STDOUT_FILENO);
        libc::dup2(taken.stderr.as_raw_fd(), libc::STDERR_FILENO);
    }
    let said = taken.said.lock().unwrap_or_else(PoisonError::into_inner);
    for line in said.iter() {
        eprintln!("{line}");
    }
}

/// stdout and stderr pointed at a pipe (`capture_output`).
struct Capture {
    /// Each line written, as a thread reads it.
    lines: mpsc::UnboundedReceiver<String>,
    /// memleak's warnings and errors among them.
    said: Arc<Mutex<Vec<String>>>,
    /// The descriptors moved aside.
    stdout: OwnedFd,
    stderr: OwnedFd,
}

/// Points stdout and stderr at a pipe, whose lines a thread hands over.
fn capture_output() -> io::Result<Capture> {
    let mut ends: [RawFd; 2] = [0; 2];
    // SAFETY: pipe2 fills the array it is given.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 made both, and nothing else owns them.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    let stdout = moved_aside(libc::STDOUT_FILENO)?;
    let stderr = moved_aside(libc::STDERR_FILENO)?;
    // SAFETY: dup2 of a descriptor this process owns onto the standard
    // ones; the copies are inherited by a command memleak starts, the
    // pipe's own end (close-on-exec) is not.
    unsafe {
        libc::dup2(writer.as_raw_fd(), libc::STDOUT_FILENO);
        libc::dup2(writer.as_raw_fd(), libc::STDERR_FILENO);
    }
    drop(writer);
    let (send, lines) = mpsc::unbounded_channel();
    let said = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&said);
    std::thread::spawn(move || {
        for line in io::BufReader::new(File::from(reader)).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("memleak: warning:") || line.starts_with("memleak: error:") {
                kept.lock().unwrap_or_else(PoisonError::into_inner).push(line.clone());
            }
            if send.send(line).is_err() {
                break;
            }
        }
    });
    Ok(Capture { lines, said, stdout, stderr })
}

/// A copy of `fd` that a command memleak starts does not inherit.
fn moved_aside(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl duplicates a standard descriptor.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fcntl made it, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// Keys and resizes, read by a thread of their own (crossterm's reads
/// block).
fn read_events() -> mpsc::UnboundedReceiver<Event> {
    let (send, events) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        while let Ok(event) = crossterm::event::read() {
            if send.send(event).is_err() {
                break;
            }
        }
    });
    events
}
