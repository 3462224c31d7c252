//! A plain HTTP/1.1 GET over a TCP socket, for `memleak serve`: the
//! tests read what curl or Prometheus would, with no client library.

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
};

use crate::memleak::PATIENCE;

/// A response: its status code and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: String,
}

/// `GET path` from 127.0.0.1:`port`, the connection closed after it.
/// `Err` when nothing answers (the server not listening yet, say).
pub fn get(port: u16, path: &str) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(PATIENCE))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no end of head in {raw:?}"));
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP status line: {status_line:?}"));
    let content_type = lines.find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("content-type").then(|| value.trim().to_owned())
    });
    Ok(Response { status, content_type, body: body.to_owned() })
}

/// A loopback port free now, for a server the test starts.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind a free loopback port");
    listener.local_addr().expect("the port bound").port()
}
