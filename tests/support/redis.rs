//! A private `redis-server` per test: a free loopback port, no persistence,
//! killed on drop; `None` (after a loud message) when it is not installed.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A private `redis-server`, killed on drop.
pub struct RedisServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

pub fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

pub fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl RedisServer {
    /// A server on a free port, or `None` (after a loud message) if
    /// `redis-server` is not installed.
    pub fn start() -> Option<Self> {
        if !installed() {
            // Straight to the process's stderr: the harness captures
            // `eprintln!` of passing tests, and a skip must not be silent.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: redis-server not installed (CI installs it; `apt-get install redis-server`)"
            );
            return None;
        }
        Some(Self::start_on(free_port()))
    }

    /// A server on `port`; panics if it does not answer PING within 10 s.
    pub fn start_on(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let mut server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(port) {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("redis-server on port {port} exited: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} never answered PING"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A raw client connection, for inspecting and tampering.
    pub fn raw(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap()
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RedisServer {
    /// `kill -9`, then reap it (the port is free again).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The number of keys matching `pattern` (SCAN).
    pub fn count(&self, pattern: &str) -> usize {
        let mut conn = self.raw();
        redis::cmd("SCAN")
            .cursor_arg(0)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .clone()
            .iter::<String>(&mut conn)
            .map(Iterator::count)
            .unwrap_or(0)
    }

    /// An integer key's value (0 when absent or unreadable).
    pub fn int(&self, key: &str) -> i64 {
        redis::cmd("GET")
            .arg(key)
            .query::<Option<i64>>(&mut self.raw())
            .ok()
            .flatten()
            .unwrap_or(0)
    }
}
