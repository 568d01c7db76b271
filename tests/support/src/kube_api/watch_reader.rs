//! A blocking reader of one watch, for tests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A blocking reader of one watch (or any chunked JSON-lines answer), for
/// tests of code that talks to the stand-in and of the stand-in itself.
pub struct WatchReader {
    /// The status code.
    pub status: u16,
    pub(super) reader: BufReader<TcpStream>,
    /// Bytes of the current chunk not read yet (`None`: the stream ended).
    pub(super) left: Option<usize>,
    pub(super) pending: Vec<u8>,
}

/// What [`WatchReader::next`] read.
#[derive(Debug, PartialEq)]
pub enum Next {
    /// One event (a JSON line).
    Event(Value),
    /// The server ended the stream cleanly (the terminating chunk).
    End,
    /// The connection closed mid-stream, or failed.
    Cut(String),
    /// Nothing within the wait.
    Quiet,
}

impl WatchReader {
    /// `GET path` on `addr` with `token` as a bearer token.
    pub fn open(addr: &str, path: &str, token: Option<&str>) -> Result<WatchReader, String> {
        let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Accept: application/json\r\nConnection: close\r\n\r\n"
        )
        .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut reader = BufReader::new(s);
        let mut line = String::new();
        reader.read_line(&mut line).map_err(|e| e.to_string())?;
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or(format!("status line {line:?}"))?;
        let mut chunked = false;
        loop {
            line.clear();
            reader.read_line(&mut line).map_err(|e| e.to_string())?;
            if line.trim().is_empty() {
                break;
            }
            let l = line.to_ascii_lowercase();
            if l.starts_with("transfer-encoding:") && l.contains("chunked") {
                chunked = true;
            }
        }
        if !chunked {
            return Err(format!("not a chunked answer (status {status})"));
        }
        Ok(WatchReader {
            status,
            reader,
            left: Some(0),
            pending: Vec::new(),
        })
    }

    /// The next event, waiting at most `wait`.
    pub fn next(&mut self, wait: Duration) -> Next {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=nl).collect();
                return match serde_json::from_slice(&line) {
                    Ok(v) => Next::Event(v),
                    Err(e) => Next::Cut(format!("not JSON: {e}: {}", String::from_utf8_lossy(&line))),
                };
            }
            let Some(left) = self.left else { return Next::End };
            let now = Instant::now();
            if now >= deadline {
                return Next::Quiet;
            }
            self.reader.get_ref().set_read_timeout(Some(deadline - now)).unwrap();
            match self.step(left) {
                Ok(()) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Next::Quiet;
                }
                Err(e) => {
                    self.left = None;
                    return Next::Cut(e.to_string());
                }
            }
        }
    }

    /// Reads some of the current chunk, or the next chunk's size line.
    pub(super) fn step(&mut self, left: usize) -> std::io::Result<()> {
        let eof = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed mid-stream");
        if left > 0 {
            let mut buf = vec![0; left.min(8192)];
            let n = self.reader.read(&mut buf)?;
            if n == 0 {
                return Err(eof());
            }
            self.pending.extend_from_slice(&buf[..n]);
            self.left = Some(left - n);
            if left == n {
                let mut crlf = [0; 2];
                self.reader.read_exact(&mut crlf)?;
            }
            return Ok(());
        }
        let mut size = String::new();
        if self.reader.read_line(&mut size)? == 0 {
            return Err(eof());
        }
        let size = usize::from_str_radix(size.trim(), 16)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("chunk size {size:?}")))?;
        self.left = if size == 0 { None } else { Some(size) };
        Ok(())
    }

    /// The events until `n` are read; panics with what came instead.
    pub fn take(&mut self, n: usize, wait: Duration) -> Vec<Value> {
        let mut out = Vec::new();
        while out.len() < n {
            match self.next(wait) {
                Next::Event(v) => out.push(v),
                other => panic!("expected {n} events, got {out:?} then {other:?}"),
            }
        }
        out
    }
}
