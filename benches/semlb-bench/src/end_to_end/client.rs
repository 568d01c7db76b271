//! The HTTP side of the load generators: a keep-alive client on its own
//! tokio runtime ([`LoadClient`]), one streamed request and its
//! [`Outcome`] (status, TTFT, latency, the dispatch times the gateway
//! reports in `x-semlb-dispatch-ns`), and the incremental SSE scanner
//! behind it ([`SseScan`]). Shared with the replay and proxy reports.

use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A keep-alive HTTP/1.1 client on its own tokio runtime.
pub(crate) struct LoadClient {
    /// The runtime requests run on.
    pub(crate) runtime: tokio::runtime::Runtime,
    /// The pooled client.
    pub(crate) http: Client<HttpConnector, Full<Bytes>>,
}

/// How long one request may take before it counts as an error.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

impl LoadClient {
    /// A client on a two-thread runtime.
    pub(crate) fn new() -> Result<LoadClient> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let http = {
            let _guard = runtime.enter();
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector)
        };
        Ok(LoadClient { runtime, http })
    }

    /// `GET http://addr{path}` (blocking): status and body text.
    pub(crate) fn get(&self, addr: &str, path: &str) -> Result<(u16, String)> {
        let http = self.http.clone();
        let uri = format!("http://{addr}{path}");
        self.runtime.block_on(async move {
            let request = http::Request::get(uri).body(Full::new(Bytes::new()))?;
            let response = tokio::time::timeout(Duration::from_secs(5), http.request(request))
                .await
                .map_err(|_| anyhow!("timeout"))??;
            let status = response.status().as_u16();
            let body = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
                .await
                .map_err(|_| anyhow!("timeout"))??
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        })
    }
}

/// The result of one streamed request.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outcome {
    /// HTTP status (0: no answer).
    pub(crate) status: u16,
    /// From the reference instant to the first output event of the SSE
    /// stream ([`SseScan`]; to the whole answer when it is not streamed).
    pub(crate) ttft: Option<Duration>,
    /// From the reference instant to the end of the answer.
    pub(crate) latency: Duration,
    /// The stream ended with `data: [DONE]` (or a Responses or Messages
    /// stream with its last event, [`SseScan`]), or a JSON answer was a
    /// 200.
    pub(crate) done: bool,
    /// `x-semlb-dispatch-ns`, parsed ([`DISPATCH_STAGES`] order).
    pub(crate) dispatch: Option<[u64; 7]>,
    /// `x-semlb-backend`.
    pub(crate) backend: Option<String>,
    /// The simulated engine that answered, whatever the front: the
    /// per-process salt of its response id ([`engine_of`]).
    pub(crate) engine: Option<String>,
    /// What went wrong, if anything.
    pub(crate) error: Option<String>,
    /// The prompt tokens and, of those, the cached ones, as the answer's
    /// usage says (filled by the reports that read it: the replay's
    /// tool-calling agents).
    pub(crate) usage: Option<(u64, u64)>,
}

impl Outcome {
    /// A 200 stream that reached `[DONE]`.
    pub(crate) fn ok(&self) -> bool {
        self.status == 200 && self.done && self.error.is_none()
    }
}

/// Sends `body` (JSON) to `http://addr{path}` and reads the SSE stream to
/// its end; times are measured from `since` (the scheduled arrival).
pub(crate) async fn stream_request(
    http: &Client<HttpConnector, Full<Bytes>>,
    addr: &str,
    path: &str,
    body: Bytes,
    since: Instant,
) -> Outcome {
    request_with(http, addr, path, body, &[], since, None).await
}

/// [`stream_request`] with extra request `headers` (name, value), also
/// keeping the answer's bytes in `keep` when given (an agent reads its
/// answer from them). An answer that is not an event stream (a request
/// sent with `"stream": false`) is read whole: its first token reaches the
/// client with the last, so its TTFT is its latency, and it is done when
/// it is a 200.
pub(crate) async fn request_with(
    http: &Client<HttpConnector, Full<Bytes>>,
    addr: &str,
    path: &str,
    body: Bytes,
    headers: &[(&str, String)],
    since: Instant,
    mut keep: Option<&mut Vec<u8>>,
) -> Outcome {
    let mut outcome = Outcome::default();
    // The start of a failed answer's body, for its error.
    let mut failed_body = String::new();
    // The start of the body, for the engine's response id.
    let mut head: Vec<u8> = Vec::new();
    let run = async {
        let mut request =
            http::Request::post(format!("http://{addr}{path}")).header(http::header::CONTENT_TYPE, "application/json");
        for (name, value) in headers {
            request = request.header(*name, value.as_str());
        }
        let request = request.body(Full::new(body)).map_err(|e| e.to_string())?;
        let response = http.request(request).await.map_err(|e| format!("request: {e}"))?;
        outcome.status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        outcome.dispatch = header("x-semlb-dispatch-ns").and_then(|v| parse_dispatch(&v));
        outcome.backend = header("x-semlb-backend");
        let streamed = header("content-type").is_some_and(|t| t.starts_with("text/event-stream"));
        let mut body = response.into_body();
        if !streamed {
            let bytes = body.collect().await.map_err(|e| format!("body: {e}"))?.to_bytes();
            head.extend_from_slice(&bytes[..bytes.len().min(HEAD_BYTES)]);
            if let Some(keep) = keep.as_deref_mut() {
                keep.extend_from_slice(&bytes);
            }
            outcome.done = outcome.status == 200;
            outcome.ttft = outcome.done.then(|| since.elapsed());
            if !outcome.done {
                failed_body = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            }
            return Ok(());
        }
        let mut scan = SseScan::default();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("body: {e}"))?;
            if let Some(data) = frame.data_ref() {
                if head.len() < HEAD_BYTES {
                    head.extend_from_slice(&data[..data.len().min(HEAD_BYTES - head.len())]);
                }
                if let Some(keep) = keep.as_deref_mut() {
                    keep.extend_from_slice(data);
                }
                if scan.feed(data) {
                    outcome.ttft = Some(since.elapsed());
                }
            }
        }
        outcome.done = scan.done;
        Ok::<(), String>(())
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => outcome.error = Some(e),
        Err(_) => outcome.error = Some(format!("timeout after {REQUEST_TIMEOUT:?}")),
    }
    outcome.latency = since.elapsed();
    if outcome.status == 200 {
        outcome.engine = engine_of(&head);
    }
    if outcome.error.is_none() && outcome.status != 200 {
        outcome.error = Some(if failed_body.is_empty() {
            format!("HTTP {}", outcome.status)
        } else {
            format!("HTTP {}: {failed_body}", outcome.status)
        });
    } else if outcome.error.is_none() && !outcome.done {
        outcome.error = Some("stream ended without [DONE] (response.completed, message_stop)".into());
    }
    outcome
}

/// Bytes of an answer's start kept for [`engine_of`].
const HEAD_BYTES: usize = 1024;

/// The simulated engine that wrote an answer starting with `head` (JSON,
/// or the SSE stream's first event): the simulator's response ids are
/// `cmpl-<salt><counter>`, `chatcmpl-<salt><counter>`, `resp_…` and
/// `msg_…` (Responses, Messages), 16 hex digits
/// each, the salt drawn once per engine process, so the salt names the
/// engine whichever front passed the answer on. `None` for any other id.
pub(crate) fn engine_of(head: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    let after = &text[text.find("\"id\"")? + 4..];
    let value = after.trim_start().strip_prefix(':')?.trim_start().strip_prefix('"')?;
    let id = &value[..value.find('"')?];
    let hex = &id[id.rfind(['-', '_'])? + 1..];
    (hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| hex[..16].to_owned())
}

/// Incremental scanner of a server-sent-event stream: counts `data:`
/// events, notices the first *output* event and the stream's end.
///
/// An event without an `event:` name (chat and completions chunks) is
/// output. Of the named events of the Responses and Messages APIs, the
/// output ones are those carrying generated tokens
/// (`response.output_text.delta`, `response.function_call_arguments.delta`
/// and any other `response.*.delta`; Anthropic's `content_block_delta`);
/// their lifecycle events (`response.created`, `message_start`,
/// `content_block_start`, `ping`, ...) are not. Any other name counts as
/// output. The stream ends with `data: [DONE]`, or with the event
/// `response.completed` / `response.incomplete` (Responses) or
/// `message_stop` (Messages), which have no `[DONE]` after them.
#[derive(Debug, Default)]
pub(crate) struct SseScan {
    pending: Vec<u8>,
    /// `data:` events other than `[DONE]` seen so far.
    pub(crate) data_events: u32,
    /// Of those, output events.
    pub(crate) output_events: u32,
    /// `data: [DONE]`, or a Responses or Messages stream's last event,
    /// was seen.
    pub(crate) done: bool,
}

/// The named events of the Responses and Messages APIs that carry no
/// generated token.
const LIFECYCLE_EVENTS: [&str; 7] = [
    "message_start",
    "content_block_start",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
    "error",
];

/// Named events that end a stream with no `data: [DONE]` after them.
const END_EVENTS: [&str; 3] = ["response.completed", "response.incomplete", "message_stop"];

/// Whether an event named `name` carries generated tokens.
fn is_output_event(name: &[u8]) -> bool {
    let name = String::from_utf8_lossy(name);
    if name.starts_with("response.") {
        return name.ends_with(".delta");
    }
    !LIFECYCLE_EVENTS.contains(&name.as_ref())
}

impl SseScan {
    /// Feeds the next bytes of the stream; true when they complete the
    /// first output event (the time to first token).
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> bool {
        let before = self.output_events;
        let searched_from = self.pending.len().saturating_sub(1);
        self.pending.extend(bytes.iter().copied().filter(|b| *b != b'\r'));
        let mut start = 0;
        let mut from = searched_from;
        while let Some(pos) = self.pending[from..].windows(2).position(|w| w == b"\n\n") {
            let end = from + pos;
            let mut name: Option<&[u8]> = None;
            let mut data = false;
            for line in self.pending[start..end].split(|b| *b == b'\n') {
                if let Some(n) = line.strip_prefix(b"event:") {
                    name = Some(n.trim_ascii());
                } else if let Some(d) = line.strip_prefix(b"data:") {
                    if d.trim_ascii() == b"[DONE]" {
                        self.done = true;
                    } else {
                        data = true;
                    }
                }
            }
            if data {
                self.data_events += 1;
                if name.is_none_or(is_output_event) {
                    self.output_events += 1;
                }
            }
            if name.is_some_and(|n| END_EVENTS.iter().any(|e| e.as_bytes() == n)) {
                self.done = true;
            }
            start = end + 2;
            from = start;
        }
        self.pending.drain(..start);
        before == 0 && self.output_events > 0
    }
}

/// The stages of `x-semlb-dispatch-ns`, in order.
pub(crate) const DISPATCH_STAGES: [&str; 7] = ["read", "parse", "tokenize", "hash", "cache", "route", "total"];

/// Parses `read=…,parse=…,tokenize=…,hash=…,cache=…,route=…,total=…`
/// (nanoseconds); `None` unless every stage is there.
pub(crate) fn parse_dispatch(value: &str) -> Option<[u64; 7]> {
    let mut out = [None; 7];
    for part in value.split(',') {
        let (k, v) = part.trim().split_once('=')?;
        let i = DISPATCH_STAGES.iter().position(|s| *s == k)?;
        out[i] = Some(v.parse().ok()?);
    }
    let mut values = [0; 7];
    for (dst, src) in values.iter_mut().zip(out) {
        *dst = src?;
    }
    Some(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_scan_finds_the_first_event_and_done_across_splits() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut s = SseScan::default();
            let first_a = s.feed(&stream[..cut]);
            let first_b = s.feed(&stream[cut..]);
            // The first event completes at byte 15 (after "\n\n").
            assert_eq!(first_a, cut >= 15, "cut {cut}");
            assert_eq!(first_b, cut < 15, "cut {cut}");
            assert_eq!((s.data_events, s.done), (2, true), "cut {cut}");
        }
        let mut s = SseScan::default();
        assert!(!s.feed(b"data: [DONE]\r\n\r\n"));
        assert!(s.done && s.data_events == 0);
        let mut s = SseScan::default();
        assert!(!s.feed(b"event: response.created\ndata: {}\n\nevent: response.output_item.added\ndata: {}\n\n"));
        assert!(s.feed(b"event: response.function_call_arguments.delta\ndata: {}\n\n"));
        assert!(!s.done);
        assert!(!s.feed(b"event: response.completed\ndata: {}\n\n"));
        assert!(s.done && s.data_events == 4 && s.output_events == 1);
        let mut s = SseScan::default();
        assert!(!s.feed(
            b"event: message_start\ndata: {}\n\nevent: content_block_start\ndata: {}\n\nevent: ping\ndata: {}\n\n"
        ));
        assert!(s.feed(b"event: content_block_delta\ndata: {}\n\n"));
        assert!(!s.feed(b"event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {}\n\n"));
        assert!(s.done);
        let mut s = SseScan::default();
        assert!(!s.feed(b": comment\n\n"));
        assert!(s.feed(b"event: x\ndata: {}\n\n"));
        assert!(!s.feed(b"data: {}\n\n"));
    }

    #[test]
    fn the_engine_is_the_salt_of_the_response_id() {
        let chunk = br#"data: {"id":"cmpl-12bc24eed0216e530000000000000007","object":"text_completion"}"#;
        assert_eq!(engine_of(chunk).as_deref(), Some("12bc24eed0216e53"));
        let json = br#"{"id": "chatcmpl-a54f910138e8018f00000000000000b3","object":"chat.completion"}"#;
        assert_eq!(engine_of(json).as_deref(), Some("a54f910138e8018f"));
        assert_eq!(engine_of(br#"{"id":"chatcmpl-xyz"}"#), None);
        assert_eq!(engine_of(br#"{"object":"list"}"#), None);
        assert_eq!(engine_of(b"data: {\"id\":\"cmpl-12bc"), None);
        let created = br#"event: response.created
data: {"type":"response.created","response":{"id":"resp_a54f910138e8018f00000000000000b3"}}"#;
        assert_eq!(engine_of(created).as_deref(), Some("a54f910138e8018f"));
        let start = br#"{"id":"msg_12bc24eed0216e530000000000000007","type":"message"}"#;
        assert_eq!(engine_of(start).as_deref(), Some("12bc24eed0216e53"));
    }

    #[test]
    fn dispatch_header_parses_every_stage() {
        let v = "read=1,parse=2,tokenize=3,hash=4,cache=5,route=6,total=21";
        assert_eq!(parse_dispatch(v), Some([1, 2, 3, 4, 5, 6, 21]));
        assert_eq!(parse_dispatch("read=1,parse=2"), None);
        assert_eq!(
            parse_dispatch("read=x,parse=2,tokenize=3,hash=4,cache=5,route=6,total=21"),
            None
        );
    }
}
