//! The load generator of `semlb bench proxy`: closed-loop keep-alive
//! HTTP/1.1 connections written directly on tokio's `TcpStream`.
//!
//! Each connection sends one request, reads the whole answer, and sends the
//! next at once, until the end of the window. A request is prepared in a
//! reusable buffer (a fixed byte string, or a ~2 000-token prompt spliced
//! from a pool of texts behind a per-request tag), and the answer is parsed
//! as little as the measurement needs: the status line, `Content-Length` /
//! `Transfer-Encoding: chunked` / `Connection: close`, `x-semlb-cache`, and,
//! when streaming, the SSE events (first event, `data: [DONE]`). The
//! connections run on one current-thread runtime per load CPU, each thread
//! pinned to its CPU, so the client costs a few microseconds per request
//! and stays off the front's core.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::super::end_to_end::SseScan;
use super::procs::{CpuList, Interrupt};

/// How long one request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The requests one workload sends.
#[derive(Debug)]
pub enum Requests {
    /// The same request every time.
    Fixed(Vec<u8>),
    /// A chat request per call: `head`, a unique tag, one of `texts`
    /// (JSON-escaped, without quotes), `tail`.
    Tagged {
        /// The body up to the content string's first character.
        head: String,
        /// Prompt texts, used in turn.
        texts: Vec<String>,
        /// The body after the content string's last character.
        tail: String,
        /// The tag also opens every line of the text, so no line of any
        /// request was seen before (no segment cache can hold it).
        every_line: bool,
    },
}

/// The HTTP request line and headers before `Content-Length`'s value.
const REQUEST_HEAD: &str =
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: ";

/// A short tag unique to request `n` of connection `conn` (lowercase
/// letters and a space, a few tokens).
pub fn line_tag(conn: usize, n: u64) -> String {
    let mut id = (n << 8) | (conn as u64 & 0xff);
    let mut tag = String::new();
    loop {
        tag.push(char::from(b'a' + (id % 26) as u8));
        id /= 26;
        if id == 0 {
            break;
        }
    }
    tag.push(' ');
    tag
}

/// `text` with `tag` at the start of it and of every line (after each
/// `newline`).
pub fn tag_lines(text: &str, newline: &str, tag: &str) -> String {
    let mut out = String::with_capacity(text.len() + tag.len() * (text.len() / 32 + 1));
    out.push_str(tag);
    let mut lines = text.split(newline);
    if let Some(first) = lines.next() {
        out.push_str(first);
    }
    for line in lines {
        out.push_str(newline);
        out.push_str(tag);
        out.push_str(line);
    }
    out
}

impl Requests {
    /// The whole HTTP request for a body to `/v1/chat/completions`.
    pub fn http(body: &[u8]) -> Vec<u8> {
        Self::http_to("/v1/chat/completions", body)
    }

    /// The whole HTTP request for a body to `path`.
    pub fn http_to(path: &str, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(body.len() + 128);
        out.extend_from_slice(
            format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: ")
                .as_bytes(),
        );
        out.extend_from_slice(format!("{}\r\n\r\n", body.len()).as_bytes());
        out.extend_from_slice(body);
        out
    }

    /// Writes request `n` of connection `conn` (HTTP head and body) to `out`.
    pub fn write(&self, conn: usize, n: u64, out: &mut Vec<u8>) {
        use std::io::Write;
        out.clear();
        match self {
            Requests::Fixed(bytes) => out.extend_from_slice(bytes),
            Requests::Tagged {
                head,
                texts,
                tail,
                every_line,
            } => {
                let text = &texts[(n as usize).wrapping_add(conn.wrapping_mul(7)) % texts.len()];
                let (tag, text) = if *every_line {
                    // `\n` is the JSON escape of a newline in the text; the
                    // tag opens the text, so it is not written twice.
                    let tag = line_tag(conn, n);
                    let text = tag_lines(text, "\\n", &tag);
                    (String::new(), std::borrow::Cow::Owned(text))
                } else {
                    (
                        format!("Request {conn}.{n}. "),
                        std::borrow::Cow::Borrowed(text.as_str()),
                    )
                };
                let len = head.len() + tag.len() + text.len() + tail.len();
                out.extend_from_slice(REQUEST_HEAD.as_bytes());
                let _ = write!(out, "{len}\r\n\r\n{head}{tag}{text}{tail}");
            }
        }
    }

    /// The body of request `n` of connection `conn` (for checks and sizes).
    pub fn body(&self, conn: usize, n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(conn, n, &mut out);
        let at = out.windows(4).position(|w| w == b"\r\n\r\n").map_or(0, |p| p + 4);
        out.split_off(at)
    }
}

/// What the responses of one measured window were.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Latencies of the 200 answers completed in the window, µs.
    pub latency_us: Vec<f64>,
    /// Times to the first SSE event of those answers, µs (streaming only).
    pub ttft_us: Vec<f64>,
    /// Answers other than 200, per status code.
    pub statuses: std::collections::BTreeMap<u16, u64>,
    /// Transport failures: refused or reset connections, timeouts,
    /// malformed answers, streams without `[DONE]`.
    pub transport_errors: u64,
    /// The first failure, for the output.
    pub first_error: Option<String>,
    /// `x-semlb-cache` values seen (`hit`, `miss`, `bypass`).
    pub cache: std::collections::BTreeMap<String, u64>,
    /// Connections opened during the window (keep-alive: 0 expected).
    pub reconnects: u64,
}

impl Tally {
    /// Successful requests.
    pub fn ok(&self) -> u64 {
        self.latency_us.len() as u64
    }

    /// Non-200 answers.
    pub fn non_200(&self) -> u64 {
        self.statuses.values().sum()
    }

    /// Every failed request.
    pub fn errors(&self) -> u64 {
        self.non_200() + self.transport_errors
    }

    fn merge(&mut self, other: Tally) {
        self.latency_us.extend(other.latency_us);
        self.ttft_us.extend(other.ttft_us);
        for (k, v) in other.statuses {
            *self.statuses.entry(k).or_default() += v;
        }
        self.transport_errors += other.transport_errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        for (k, v) in other.cache {
            *self.cache.entry(k).or_default() += v;
        }
        self.reconnects += other.reconnects;
    }

    fn error(&mut self, e: String) {
        self.transport_errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// One closed-loop run: `connections` connections to `addr` from `from -
/// warm-up` to `until`; only answers completed in `[from, until)` count.
#[derive(Debug, Clone)]
pub struct Plan {
    /// `host:port`.
    pub addr: String,
    /// Concurrent connections.
    pub connections: usize,
    /// Start of the measured window (before it: warm-up).
    pub from: Instant,
    /// End of the window.
    pub until: Instant,
    /// Whether the requests ask for SSE.
    pub stream: bool,
}

/// Runs `plan` on one thread per CPU of `cpus` (connections dealt round
/// robin), each pinned to its CPU; returns when every connection is done.
pub fn spawn(
    plan: Plan,
    requests: Arc<Requests>,
    cpus: &CpuList,
    interrupt: Interrupt,
) -> Vec<std::thread::JoinHandle<Tally>> {
    let threads = cpus.cpus().len().clamp(1, plan.connections.max(1));
    (0..threads)
        .map(|t| {
            let cpu = CpuList::new(vec![cpus.cpus()[t % cpus.cpus().len()]]);
            let plan = plan.clone();
            let requests = requests.clone();
            let interrupt = interrupt.clone();
            std::thread::spawn(move || {
                let _ = cpu.pin_this_thread();
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                    let mut t = Tally::default();
                    t.error("cannot start a load runtime".into());
                    return t;
                };
                runtime.block_on(async move {
                    let tasks: Vec<_> = (t..plan.connections)
                        .step_by(threads)
                        .map(|c| tokio::spawn(connection(plan.clone(), requests.clone(), c, interrupt.clone())))
                        .collect();
                    let mut tally = Tally::default();
                    for task in tasks {
                        match task.await {
                            Ok(t) => tally.merge(t),
                            Err(e) => tally.error(format!("load task: {e}")),
                        }
                    }
                    tally
                })
            })
        })
        .collect()
}

/// Joins the threads of [`spawn`].
pub fn join(threads: Vec<std::thread::JoinHandle<Tally>>) -> Tally {
    let mut tally = Tally::default();
    for t in threads {
        match t.join() {
            Ok(t) => tally.merge(t),
            Err(_) => tally.error("a load thread panicked".into()),
        }
    }
    tally
}

/// One closed-loop connection.
async fn connection(plan: Plan, requests: Arc<Requests>, id: usize, interrupt: Interrupt) -> Tally {
    let mut tally = Tally::default();
    let mut conn: Option<Conn> = None;
    let mut request = Vec::with_capacity(16 * 1024);
    let mut n = 0u64;
    loop {
        let now = Instant::now();
        if now >= plan.until || interrupt.raised() {
            break;
        }
        let in_window = |t: Instant| t >= plan.from && t < plan.until;
        let c = match &mut conn {
            Some(c) => c,
            None => match TcpStream::connect(&plan.addr).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    if in_window(now) {
                        tally.reconnects += 1;
                    }
                    conn.insert(Conn::new(s))
                }
                Err(e) => {
                    if in_window(now) {
                        tally.error(format!("connect {}: {e}", plan.addr));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        requests.write(id, n, &mut request);
        n += 1;
        let start = Instant::now();
        let result = tokio::time::timeout(REQUEST_TIMEOUT, c.exchange(&request, plan.stream)).await;
        let end = Instant::now();
        let counted = in_window(end);
        match result {
            Ok(Ok(answer)) => {
                if answer.close {
                    conn = None;
                }
                if !counted {
                    continue;
                }
                if let Some(v) = answer.cache {
                    *tally.cache.entry(v).or_default() += 1;
                }
                if answer.status != 200 {
                    *tally.statuses.entry(answer.status).or_default() += 1;
                    if tally.first_error.is_none() {
                        tally.first_error = Some(format!("HTTP {}", answer.status));
                    }
                } else if plan.stream && !answer.done {
                    tally.error("a stream ended without data: [DONE] (response.completed, message_stop)".into());
                } else {
                    tally.latency_us.push((end - start).as_secs_f64() * 1e6);
                    if let Some(t) = answer.first_event {
                        tally.ttft_us.push((t - start).as_secs_f64() * 1e6);
                    }
                }
            }
            Ok(Err(e)) => {
                conn = None;
                if counted {
                    tally.error(e);
                }
            }
            Err(_) => {
                conn = None;
                if counted {
                    tally.error(format!("no complete answer within {REQUEST_TIMEOUT:?}"));
                }
            }
        }
    }
    tally
}

/// What the client keeps of an answer.
#[derive(Debug, Default)]
struct Answer {
    status: u16,
    /// The server will close the connection.
    close: bool,
    /// `x-semlb-cache`.
    cache: Option<String>,
    /// The SSE stream ended with `data: [DONE]`.
    done: bool,
    /// When the first SSE event arrived.
    first_event: Option<Instant>,
}

/// A keep-alive connection and its read buffer.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Bytes of `buf` already consumed.
    pos: usize,
}

impl Conn {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(64 * 1024),
            pos: 0,
        }
    }

    /// Reads more bytes; an error at end of stream.
    async fn fill(&mut self) -> Result<(), String> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        if self.buf.capacity() - self.buf.len() < 16 * 1024 {
            self.buf.reserve(64 * 1024);
        }
        match self.stream.read_buf(&mut self.buf).await {
            Ok(0) => Err("the server closed the connection".into()),
            Ok(_) => Ok(()),
            Err(e) => Err(format!("read: {e}")),
        }
    }

    /// The next CRLF-terminated line (without CRLF), as a range of `buf`.
    async fn line(&mut self) -> Result<std::ops::Range<usize>, String> {
        let mut searched = self.pos;
        loop {
            if let Some(i) = self.buf[searched..].windows(2).position(|w| w == b"\r\n") {
                let range = self.pos..searched + i;
                self.pos = searched + i + 2;
                return Ok(range);
            }
            if self.buf.len() - self.pos > 64 * 1024 {
                return Err("a header line longer than 64 KiB".into());
            }
            let back = self.buf.len().saturating_sub(1).max(self.pos) - self.pos;
            self.fill().await?;
            searched = self.pos + back;
        }
    }

    /// Consumes `n` body bytes, feeding them to `sse` if given.
    async fn body_bytes(
        &mut self,
        mut n: usize,
        mut sse: Option<(&mut SseScan, &mut Option<Instant>)>,
    ) -> Result<(), String> {
        while n > 0 {
            if self.pos == self.buf.len() {
                self.fill().await?;
            }
            let take = n.min(self.buf.len() - self.pos);
            if let Some((scan, first)) = sse.as_mut()
                && scan.feed(&self.buf[self.pos..self.pos + take])
                && first.is_none()
            {
                **first = Some(Instant::now());
            }
            self.pos += take;
            n -= take;
        }
        Ok(())
    }

    /// Sends `request` and reads its whole answer.
    async fn exchange(&mut self, request: &[u8], stream: bool) -> Result<Answer, String> {
        self.stream
            .write_all(request)
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Answer::default();
        let status_line = self.line().await?;
        let status = &self.buf[status_line];
        answer.status = status
            .split(|b| *b == b' ')
            .nth(1)
            .and_then(|c| std::str::from_utf8(c).ok())
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("not an HTTP status line: {:?}", String::from_utf8_lossy(status)))?;
        let http10 = status.starts_with(b"HTTP/1.0");
        let mut length: Option<usize> = None;
        let mut chunked = false;
        let mut close = http10;
        loop {
            let range = self.line().await?;
            if range.is_empty() {
                break;
            }
            let line = &self.buf[range];
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
            if name.eq_ignore_ascii_case(b"content-length") {
                length = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                chunked = value.eq_ignore_ascii_case(b"chunked");
            } else if name.eq_ignore_ascii_case(b"connection") {
                close = value.eq_ignore_ascii_case(b"close");
            } else if name.eq_ignore_ascii_case(b"x-semlb-cache") {
                answer.cache = Some(String::from_utf8_lossy(value).into_owned());
            }
        }
        answer.close = close;
        let mut scan = SseScan::default();
        let sse = stream && answer.status == 200;
        let mut first = None;
        if chunked {
            loop {
                let range = self.line().await?;
                let size_text = &self.buf[range];
                let hex = size_text.split(|b| *b == b';').next().unwrap_or_default().trim_ascii();
                let size = std::str::from_utf8(hex)
                    .ok()
                    .and_then(|h| usize::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("bad chunk size {:?}", String::from_utf8_lossy(size_text)))?;
                if size == 0 {
                    // Trailers, if any, then the empty line.
                    while !self.line().await?.is_empty() {}
                    break;
                }
                self.body_bytes(size, sse.then_some((&mut scan, &mut first))).await?;
                if !self.line().await?.is_empty() {
                    return Err("a chunk not followed by CRLF".into());
                }
            }
        } else if let Some(n) = length {
            self.body_bytes(n, sse.then_some((&mut scan, &mut first))).await?;
        } else if answer.status != 204 && answer.status != 304 {
            // Delimited by the end of the connection.
            answer.close = true;
            loop {
                let avail = self.buf.len() - self.pos;
                self.body_bytes(avail, sse.then_some((&mut scan, &mut first))).await?;
                if self.fill().await.is_err() {
                    break;
                }
            }
        }
        answer.done = scan.done;
        answer.first_event = first;
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves `answers` (raw bytes, one per request read) on a loopback
    /// port, then closes.
    async fn serve(answers: Vec<&'static [u8]>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0; 65536];
            for a in answers {
                let _ = s.read(&mut buf).await.unwrap();
                // Split the answer to exercise partial reads.
                let mid = a.len() / 2;
                s.write_all(&a[..mid]).await.unwrap();
                s.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
                s.write_all(&a[mid..]).await.unwrap();
            }
        });
        addr
    }

    #[tokio::test]
    async fn answers_parse_by_length_chunks_and_sse() {
        let addr = serve(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-semlb-cache: bypass\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
              f\r\ndata: {\"a\":1}\n\n\r\n\
              e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
            b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno",
        ])
        .await;
        let mut c = Conn::new(TcpStream::connect(&addr).await.unwrap());
        let req = Requests::http(b"{}");
        assert!(Requests::http_to("/v1/messages", b"{}").starts_with(b"POST /v1/messages HTTP/1.1\r\n"));
        let a = c.exchange(&req, false).await.unwrap();
        assert_eq!((a.status, a.close, a.cache.as_deref()), (200, false, Some("bypass")));
        let a = c.exchange(&req, true).await.unwrap();
        assert_eq!(a.status, 200);
        assert!(a.done && a.first_event.is_some());
        let a = c.exchange(&req, false).await.unwrap();
        assert_eq!((a.status, a.close), (503, true));
        assert!(c.exchange(&req, false).await.is_err(), "closed");
    }

    #[test]
    fn tagged_requests_differ_and_are_valid_json() {
        let r = Requests::Tagged {
            head: r#"{"model":"m","messages":[{"role":"user","content":""#.into(),
            texts: vec!["one \\\"quoted\\\"".into(), "two".into()],
            tail: r#""}],"max_tokens":16}"#.into(),
            every_line: false,
        };
        let a: serde_json::Value = serde_json::from_slice(&r.body(0, 0)).unwrap();
        let b: serde_json::Value = serde_json::from_slice(&r.body(0, 1)).unwrap();
        assert_ne!(a, b);
        assert!(
            a["messages"][0]["content"]
                .as_str()
                .unwrap()
                .starts_with("Request 0.0. ")
        );
        let mut http = Vec::new();
        r.write(3, 9, &mut http);
        let text = String::from_utf8(http).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.ends_with(&format!("Content-Length: {}", body.len())), "{head}");
    }

    #[test]
    fn unseen_requests_tag_every_line() {
        let r = Requests::Tagged {
            head: r#"{"model":"m","messages":[{"role":"user","content":""#.into(),
            texts: vec!["first\\nsecond\\n\\nthird".into()],
            tail: r#""}],"max_tokens":16}"#.into(),
            every_line: true,
        };
        let a: serde_json::Value = serde_json::from_slice(&r.body(2, 5)).unwrap();
        let tag = line_tag(2, 5);
        assert_eq!(
            a["messages"][0]["content"],
            format!("{tag}first\n{tag}second\n{tag}\n{tag}third")
        );
        assert_ne!(line_tag(2, 6), tag);
        assert_ne!(line_tag(3, 5), tag);
    }
}
