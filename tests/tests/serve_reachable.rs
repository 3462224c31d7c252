//! `memleak serve` stays reachable whatever other clients hold: a scraper
//! asking `/metrics` twice a second for ten seconds gets every answer,
//! each within a second, beside 2,000 idle sockets, 64 sockets re-opened as
//! soon as they are closed, 64 slowloris heads (a byte every 1.5 s) or 64
//! keep-alive clients. Each once held every connection of the daemon.
//!
//! The four run at once, each against a daemon of its own, so that the
//! whole takes the ten seconds once.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::TcpStream,
    sync::atomic::{AtomicBool, Ordering},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use memleak_tests::{
    http::{serve_pid, stop},
    Leaker,
};

/// Scrapes in a scenario, one every `SCRAPE_EVERY`: over ten seconds,
/// seven of the slowloris flood's 1.5 s cycles and three of the
/// keep-alive clients' 3 s ones.
const SCRAPES: u32 = 20;
const SCRAPE_EVERY: Duration = Duration::from_millis(500);
/// The longest a scrape may take: the bound.
const SCRAPE_BOUND: Duration = Duration::from_secs(1);
/// Sockets of the idle flood.
const IDLE_SOCKETS: usize = 2_000;
/// Clients of each of the other floods.
const CLIENTS: usize = 64;

/// How a flood behaves: it opens its sockets, says it is ready, then
/// keeps at it until `stop` is set.
type Flood = fn(u16, &AtomicBool, &mpsc::Sender<()>);

#[test]
fn a_scraper_gets_every_answer_within_a_second_whatever_other_clients_hold() {
    // The idle flood's sockets, the others', and the daemons', which
    // inherit the limit and size their connections from it.
    raise_descriptor_limit(4096);
    let floods: [(&str, Flood); 4] = [
        ("2,000 idle sockets", idle_sockets),
        ("64 sockets re-opened when closed", reopened_sockets),
        ("64 slowloris heads", slowloris_heads),
        ("64 keep-alive clients", keep_alive_clients),
    ];
    let outcomes: Vec<(&str, Vec<Scrape>)> = thread::scope(|scope| {
        let running: Vec<_> = floods
            .into_iter()
            .map(|(name, flood)| scope.spawn(move || (name, scrapes_beside(flood))))
            .collect();
        running.into_iter().map(|scenario| scenario.join().expect("a scenario's thread")).collect()
    });
    let mut failures = Vec::new();
    for (name, scrapes) in &outcomes {
        assert_eq!(scrapes.len(), SCRAPES as usize, "{name}");
        let slowest = scrapes.iter().filter_map(|scrape| scrape.as_ref().ok().map(|(_, took)| *took)).max();
        eprintln!("{name}: the slowest scrape answered took {slowest:?}");
        for (index, scrape) in scrapes.iter().enumerate() {
            match scrape {
                Ok((200, took)) if *took < SCRAPE_BOUND => {}
                other => failures.push(format!("{name}: scrape {index}: {other:?}")),
            }
        }
    }
    assert!(failures.is_empty(), "scrapes not answered with 200 within {SCRAPE_BOUND:?}:\n{failures:#?}");
}

/// What one scrape came to: its status and how long it took, or why it
/// failed and after how long.
type Scrape = Result<(u16, Duration), String>;

/// A daemon following a leaker, the flood against it, and `SCRAPES`
/// scrapes meanwhile.
fn scrapes_beside(flood: Flood) -> Vec<Scrape> {
    let leaker = Leaker::start_waiting(&["all"]);
    let (memleak, port) = serve_pid(leaker.pid());
    let stopping = AtomicBool::new(false);
    let stopping = &stopping;
    let scrapes = thread::scope(|scope| {
        let (ready, flooded) = mpsc::channel();
        let flooding = scope.spawn(move || flood(port, stopping, &ready));
        flooded.recv_timeout(memleak_tests::PATIENCE).expect("the flood to open its sockets");
        let start = Instant::now();
        let scrapes = (0..SCRAPES)
            .map(|index| {
                let at = start + SCRAPE_EVERY * index;
                thread::sleep(at.saturating_duration_since(Instant::now()));
                let asked = Instant::now();
                match scrape(port) {
                    Ok(status) => Ok((status, asked.elapsed())),
                    Err(error) => Err(format!("{error} after {:?}", asked.elapsed())),
                }
            })
            .collect();
        stopping.store(true, Ordering::Relaxed);
        flooding.join().expect("the flood's thread");
        scrapes
    });
    stop(memleak);
    drop(leaker);
    scrapes
}

/// `GET /metrics` as Prometheus asks it, on a connection of its own:
/// the answer's status. Given up after `SCRAPE_PATIENCE`, so that a
/// scrape that hangs fails as one, without holding up the next.
fn scrape(port: u16) -> std::io::Result<u16> {
    const SCRAPE_PATIENCE: Duration = Duration::from_secs(5);
    let mut socket = TcpStream::connect(("127.0.0.1", port))?;
    socket.set_read_timeout(Some(SCRAPE_PATIENCE))?;
    socket.set_write_timeout(Some(SCRAPE_PATIENCE))?;
    socket.write_all(b"GET /metrics HTTP/1.1\r\nHost: memleak\r\nConnection: close\r\n\r\n")?;
    let mut answer = Vec::new();
    socket.read_to_end(&mut answer)?;
    let status_line = answer.split(|&byte| byte == b'\r').next().unwrap_or_default();
    let status = std::str::from_utf8(status_line).ok().and_then(|line| line.split(' ').nth(1));
    status
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status in {:?}", String::from_utf8_lossy(&answer))))
}

/// Sockets that connect and send nothing, ever. Ready once the daemon
/// has accepted them all: the scrapes measure a daemon holding them, not
/// how fast it takes in a burst of 2,000 (a tenth of a second, idle).
fn idle_sockets(port: u16, stopping: &AtomicBool, ready: &mpsc::Sender<()>) {
    let sockets: Vec<TcpStream> = (0..IDLE_SOCKETS).map(|_| connect(port)).collect();
    let deadline = Instant::now() + memleak_tests::PATIENCE;
    while accept_queue(port) > 0 {
        assert!(Instant::now() < deadline, "the daemon did not accept the idle sockets");
        thread::sleep(Duration::from_millis(10));
    }
    let _ = ready.send(());
    hold_until(stopping);
    drop(sockets);
}

/// Sockets that send nothing, each opened again as soon as the daemon
/// closes it.
fn reopened_sockets(port: u16, stopping: &AtomicBool, ready: &mpsc::Sender<()>) {
    let open = || {
        let socket = connect(port);
        socket.set_nonblocking(true).expect("a nonblocking socket");
        socket
    };
    let mut sockets: Vec<TcpStream> = (0..CLIENTS).map(|_| open()).collect();
    let _ = ready.send(());
    let mut byte = [0u8; 1];
    while !stopping.load(Ordering::Relaxed) {
        for socket in &mut sockets {
            let closed = match socket.read(&mut byte) {
                Ok(0) => true,
                Ok(_) => false,
                Err(error) => error.kind() != ErrorKind::WouldBlock,
            };
            if closed {
                *socket = open();
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Sockets that send a request's head a byte every 1.5 s, each opened
/// again when the daemon closes it.
fn slowloris_heads(port: u16, stopping: &AtomicBool, ready: &mpsc::Sender<()>) {
    const HEAD: &[u8] =
        b"GET /metrics HTTP/1.1\r\nHost: memleak\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut sockets: Vec<(TcpStream, usize)> = (0..CLIENTS).map(|_| (connect(port), 0)).collect();
    let _ = ready.send(());
    while !stopping.load(Ordering::Relaxed) {
        for (socket, sent) in &mut sockets {
            if socket.write_all(&HEAD[*sent..=*sent]).is_ok() {
                *sent = (*sent + 1) % HEAD.len();
            } else {
                *socket = connect(port);
                *sent = 0;
            }
        }
        hold_for(Duration::from_millis(1500), stopping);
    }
}

/// Clients that keep their connection alive, asking `/healthz` on it
/// every 3 s, each connecting again when the daemon closes it.
fn keep_alive_clients(port: u16, stopping: &AtomicBool, ready: &mpsc::Sender<()>) {
    let mut clients: Vec<Option<TcpStream>> = (0..CLIENTS).map(|_| Some(connect(port))).collect();
    let _ = ready.send(());
    while !stopping.load(Ordering::Relaxed) {
        for client in &mut clients {
            let socket = client.take().unwrap_or_else(|| connect(port));
            if ask_kept_alive(&socket).is_ok() {
                *client = Some(socket);
            }
        }
        hold_for(Duration::from_secs(3), stopping);
    }
}

/// `GET /healthz` on a connection kept alive, its answer read whole.
fn ask_kept_alive(mut socket: &TcpStream) -> std::io::Result<()> {
    socket.set_read_timeout(Some(Duration::from_secs(5)))?;
    socket.write_all(b"GET /healthz HTTP/1.1\r\nHost: memleak\r\n\r\n")?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    // "ok\n" ends the body; the head says keep-alive by default in 1.1.
    while !answer.ends_with(b"\r\n\r\nok\n") {
        let read = socket.read(&mut buffer)?;
        if read == 0 {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        answer.extend_from_slice(&buffer[..read]);
    }
    Ok(())
}

/// Connections the kernel holds for the daemon's listening socket on
/// loopback `port`, not accepted yet: a listening socket's receive queue
/// in /proc/net/tcp.
fn accept_queue(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("read /proc/net/tcp");
    let local = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A"))
        .and_then(|fields| fields.get(4)?.split_once(':').map(|(_, queued)| queued.to_owned()))
        .and_then(|queued| usize::from_str_radix(&queued, 16).ok())
        .unwrap_or_else(|| panic!("no listening socket on 127.0.0.1:{port} in /proc/net/tcp"))
}

fn connect(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).expect("connect to the daemon")
}

fn hold_until(stopping: &AtomicBool) {
    while !stopping.load(Ordering::Relaxed) {
        thread::sleep(Duration::from_millis(50));
    }
}

/// Sleeps `duration`, or less if the scenario is stopping.
fn hold_for(duration: Duration, stopping: &AtomicBool) {
    let end = Instant::now() + duration;
    while !stopping.load(Ordering::Relaxed) && Instant::now() < end {
        thread::sleep(Duration::from_millis(50));
    }
}

/// Raises this process's soft `RLIMIT_NOFILE` to `wanted`, which its
/// hard limit must allow.
fn raise_descriptor_limit(wanted: libc::rlim_t) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct passed, alive for the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) }, 0, "getrlimit");
    if limit.rlim_cur >= wanted {
        return;
    }
    assert!(
        limit.rlim_max >= wanted,
        "the test needs {wanted} descriptors; the hard limit is {}",
        limit.rlim_max
    );
    limit.rlim_cur = wanted;
    // SAFETY: setrlimit reads the struct passed, alive for the call.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit) }, 0, "setrlimit");
}
