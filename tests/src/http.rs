//! A plain HTTP/1.1 GET over a TCP socket, for `memleak serve`: the
//! tests read what curl or Prometheus would, with no client library.

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
};

use std::time::{Duration, Instant};

use crate::memleak::{Memleak, PATIENCE};

/// A response: its status code, head and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub content_type: Option<String>,
    /// Each header, its name in lower case.
    pub headers: Vec<(String, String)>,
    /// The body as text, or lossily so for a binary one.
    pub body: String,
    pub bytes: Vec<u8>,
}

impl Response {
    /// The value of header `name` (in lower case), if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(header, _)| header == name).map(|(_, value)| value.as_str())
    }
}

/// `GET path` from 127.0.0.1:`port`, the connection closed after it.
/// `Err` when nothing answers (the server not listening yet, say).
pub fn get(port: u16, path: &str) -> std::io::Result<Response> {
    get_with(port, path, &[])
}

/// `GET path` with extra request headers (`Authorization`, say).
pub fn get_with(port: u16, path: &str, headers: &[(&str, &str)]) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(PATIENCE))?;
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.extend([name, ": ", value, "\r\n"]);
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let end_of_head = raw
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..end_of_head]).into_owned();
    let bytes = raw[end_of_head + 4..].to_vec();
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP status line: {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            Some((name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        })
        .collect();
    let content_type =
        headers.iter().find(|(name, _)| name == "content-type").map(|(_, value)| value.clone());
    Ok(Response { status, content_type, headers, body: String::from_utf8_lossy(&bytes).into_owned(), bytes })
}

/// A connection to 127.0.0.1:`port`, once a server the test started
/// listens there (it is given 5 s).
pub fn connect_when_listening(port: u16) -> std::net::TcpStream {
    (0..100)
        .find_map(|_| {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .map_err(|_| std::thread::sleep(std::time::Duration::from_millis(50)))
                .ok()
        })
        .unwrap_or_else(|| panic!("nothing listens on port {port}"))
}

/// A loopback port free now, for a server the test starts.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind a free loopback port");
    listener.local_addr().expect("the port bound").port()
}

/// `memleak serve ARGS --port PORT` on a free port, once it serves.
pub fn serve(args: &[&str]) -> (Memleak, u16) {
    serve_with_env(args, &[])
}

/// As `serve`, with extra environment for memleak (where podman keeps
/// its containers, say, for the `podman inspect` memleak runs).
pub fn serve_with_env(args: &[&str], env: &[(&str, &str)]) -> (Memleak, u16) {
    let port = free_port();
    let port_text = port.to_string();
    let mut command_line = vec!["serve"];
    command_line.extend_from_slice(args);
    command_line.extend_from_slice(&["--port", &port_text]);
    let mut memleak = Memleak::start_with_env(&command_line, env);
    memleak.stderr.wait_for("memleak to serve", |line| line.starts_with("memleak: serving http://"));
    (memleak, port)
}

/// `memleak serve --pid PID` on a free port, once it serves.
pub fn serve_pid(pid: u32) -> (Memleak, u16) {
    serve(&["--pid", &pid.to_string()])
}

/// Ends the daemon with SIGTERM, which must end it with status 0.
pub fn stop(memleak: Memleak) {
    memleak.signal(libc::SIGTERM);
    let (status, _) = memleak.finish();
    assert!(status.success(), "SIGTERM: {status}");
}

/// GETs `path` until `wanted` holds for the response, or gives up after
/// `PATIENCE` with the last response seen.
pub fn get_until(port: u16, path: &str, wanted: impl Fn(&Response) -> bool) -> Response {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let response = get(port, path).unwrap_or_else(|error| panic!("GET {path}: {error}"));
        if wanted(&response) {
            return response;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path}: not the response wanted after {PATIENCE:?}: {response:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
