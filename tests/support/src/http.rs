//! A minimal HTTP/1.1 client for the multi-process tests: one request per
//! connection (`Connection: close`), chunked bodies decoded.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// An answer.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The header fields in order, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body (chunked transfer decoded).
    pub body: Vec<u8>,
}

impl Response {
    /// The first header field `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON; panics (with the body) when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The OpenAI-style error message, asserting the body has one.
    pub fn error_message(&self) -> String {
        let body = self.json();
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        body["error"]["message"].as_str().expect("a message").to_owned()
    }
}

/// One HTTP/1.1 request with `Connection: close`; chunked bodies decoded.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    let payload = body.map(|b| b.to_string());
    http_bytes(addr, method, path, payload.as_deref().map(str::as_bytes), headers)
}

/// [`http`] with the body as raw bytes (sent as `application/json`, valid or not).
pub fn http_bytes(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Result<Response, String> {
    exchange(addr, &request_bytes(addr, method, path, body, headers))
}

/// The bytes of an HTTP/1.1 request with `Connection: close`.
pub fn request_bytes(addr: &str, method: &str, path: &str, body: Option<&[u8]>, headers: &[(&str, &str)]) -> Vec<u8> {
    let payload = body.unwrap_or_default();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        payload.len()
    );
    if body.is_some() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut req = req.into_bytes();
    req.extend_from_slice(payload);
    req
}

/// Sends `request` (a whole HTTP/1.1 request, which should ask for
/// `Connection: close`) and reads the answer until the server closes.
///
/// A server may answer before it has read the whole request (413) and
/// close with unread bytes in its socket, which resets the connection: a
/// write error is then ignored, and a reset after a complete head ends the
/// answer instead of failing it.
pub fn exchange(addr: &str, request: &[u8]) -> Result<Response, String> {
    exchange_over(connect(addr)?, request)
}

/// A connection to `addr` with 30 s read and write timeouts.
pub fn connect(addr: &str) -> Result<TcpStream, String> {
    let s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    Ok(s)
}

/// [`exchange`] over an open stream `s` (TLS or not).
pub fn exchange_over(mut s: impl Read + Write, request: &[u8]) -> Result<Response, String> {
    let written = s.write_all(request);
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    let has_head = raw.windows(4).any(|w| w == b"\r\n\r\n");
    match read {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && has_head => {}
        Err(e) => return Err(format!("{e} (write: {written:?})")),
    }
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no header end")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("status")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size =
                usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).map_err(|e| e.to_string())?;
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        body = out;
    }
    Ok(Response { status, headers, body })
}
