//! Debian's redis-server, run by a test on a loopback port of its own, and
//! filled with keys as a client would.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    process::{Child, Command, Stdio},
};

/// A redis-server that is killed when dropped.
pub struct Redis {
    child: Child,
    connection: TcpStream,
}

impl Redis {
    /// Starts redis-server without persistence and connects to it.
    pub fn start() -> Self {
        let port = crate::http::free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is installed by cargo xtask test");
        let connection = crate::http::connect_when_listening(port);
        Self { child, connection }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SETs `key:0` to `key:{count - 1}` to 100 bytes each, pipelined, and
    /// waits for every reply.
    pub fn set_keys(&mut self, count: u64) {
        let mut commands = Vec::new();
        for i in 0..count {
            let key = format!("key:{i}");
            write!(commands, "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n$100\r\n{}\r\n", key.len(), "v".repeat(100))
                .unwrap();
        }
        self.connection.write_all(&commands).unwrap();
        let mut replies = Vec::new();
        let mut buffer = vec![0u8; 65536];
        while (replies.windows(3).filter(|window| window == b"+OK").count() as u64) < count {
            let read = self.connection.read(&mut buffer).unwrap();
            assert!(read > 0, "redis closed the connection");
            replies.extend_from_slice(&buffer[..read]);
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
