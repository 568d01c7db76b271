//! A private `redis-server` per test or benchmark run: a free loopback
//! port, no persistence, killed on drop. Tests take `None` (after a loud
//! message) when it is not installed ([`RedisServer::start`]); the bench
//! gets an [`Error`] ([`RedisServer::try_start`]).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

/// A private `redis-server`, killed on drop.
pub struct RedisServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

/// Whether `redis-server` runs (`--version`).
pub fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A loopback port nobody listens on (at the time of asking).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// Whether a Redis on `port` of 127.0.0.1 answers `PING`.
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
        Self::try_start_on(Path::new("redis-server"), port).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `binary` (a `redis-server`) on a free port, once it answers PING.
    pub fn try_start(binary: &Path) -> Result<Self, Error> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|source| Error::Spawn {
                what: "a loopback listener for redis-server".into(),
                source,
            })?
            .port();
        Self::try_start_on(binary, port)
    }

    /// `binary` on `port`, once it answers PING (at most 10 s).
    pub fn try_start_on(binary: &Path, port: u16) -> Result<Self, Error> {
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| Error::Spawn {
                what: binary.display().to_string(),
                source,
            })?;
        let mut server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ping(port) {
            let what = match server.child.try_wait() {
                Ok(Some(status)) => format!("{} on port {port} exited: {status}", binary.display()),
                _ if Instant::now() >= deadline => format!("{} on port {port} never answered PING", binary.display()),
                _ => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            return Err(Error::NotReady {
                what,
                stderr: String::new(),
            });
        }
        Ok(server)
    }

    /// `redis://127.0.0.1:<port>/`.
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

    /// Sends `sig` to the server.
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
