//! Server-sent events as OpenAI-compatible servers send them: the framing
//! checked, the `data:` payloads and the streamed text read out; a chat or
//! completions stream read as it comes ([`stream_to`], [`Streamed`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// The `data:` payloads of a whole SSE body, checking its framing: every
/// event is one `data: ` line followed by a blank line.
pub fn events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "SSE body must end with a blank line: {body:?}");
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"));
            assert!(!data.contains('\n'), "one line per event: {event:?}");
            data.to_owned()
        })
        .collect()
}

/// The text of a chat or completions stream, checking that `[DONE]` ends
/// it and appears once.
pub fn text(body: &str) -> String {
    let events = events(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1, "{body}");
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk not JSON ({err}): {e}"));
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
        }
    }
    text
}

/// What a client read of a chat or completions stream.
#[derive(Debug, Default)]
pub struct Streamed {
    /// The `x-semlb-backend` of its head (`host:port`).
    pub backend: String,
    /// The chunks' `id`s, each once, in order.
    pub ids: Vec<String>,
    /// The text (chat `delta.content`, completions `text`).
    pub text: String,
    /// Chunks with text.
    pub chunks: usize,
    /// The last `finish_reason`.
    pub finish: Option<String>,
    /// The last `usage`.
    pub usage: Option<Value>,
    /// Error events (`{"error": ...}`).
    pub errors: Vec<Value>,
    /// `data: [DONE]` came, and was the last event.
    pub done_last: bool,
    /// The raw events, for messages.
    pub raw: String,
}

impl Streamed {
    fn read_event(&mut self, data: &str) {
        self.done_last = data == "[DONE]";
        if self.done_last {
            return;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("not JSON ({e}): {data}"));
        if v.get("error").is_some() {
            self.errors.push(v);
            return;
        }
        if let Some(id) = v["id"].as_str()
            && !self.ids.iter().any(|i| i == id)
        {
            self.ids.push(id.to_owned());
        }
        if let Some(c) = v["choices"].get(0) {
            let text = c["delta"]["content"].as_str().or(c["text"].as_str());
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                self.text.push_str(t);
                self.chunks += 1;
            }
            if let Some(f) = c["finish_reason"].as_str() {
                self.finish = Some(f.to_owned());
            }
        }
        if !v["usage"].is_null() {
            self.usage = Some(v["usage"].clone());
        }
    }

    /// A clean answer: one id, no error, `[DONE]` last.
    pub fn assert_clean(&self) {
        assert!(self.errors.is_empty(), "error events: {:?}\n{}", self.errors, self.raw);
        assert_eq!(self.ids.len(), 1, "one id: {:?}", self.ids);
        assert!(self.done_last, "[DONE] last:\n{}", self.raw);
    }
}

/// Streams the chat completion `body` from `addr` (see [`stream_to`]).
pub fn stream(addr: &str, body: &Value, progress: impl FnMut(&Streamed)) -> Streamed {
    stream_to(addr, "/v1/chat/completions", body, progress)
}

/// Streams `body` posted to `path` at `addr` (HTTP/1.0: the body ends
/// when the connection closes), calling `progress` with what was read so
/// far after every read.
pub fn stream_to(addr: &str, path: &str, body: &Value, mut progress: impl FnMut(&Streamed)) -> Streamed {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let payload = body.to_string();
    write!(
        conn,
        "POST {path} HTTP/1.0\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let mut got = Streamed::default();
    let (mut buf, mut head_done, mut at) = (Vec::new(), false, 0);
    let mut chunk = [0u8; 16 << 10];
    loop {
        let n = conn.read(&mut chunk).expect("read");
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if !head_done {
            let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            assert!(
                head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
                "{head}"
            );
            got.backend = head
                .lines()
                .find_map(|l| l.strip_prefix("x-semlb-backend: "))
                .unwrap_or_default()
                .trim_start_matches("http://")
                .to_owned();
            head_done = true;
            at = end + 4;
        }
        while let Some(end) = buf[at..].windows(2).position(|w| w == b"\n\n") {
            let event = String::from_utf8(buf[at..at + end].to_vec()).expect("UTF-8 events");
            at += end + 2;
            got.raw.push_str(&event);
            got.raw.push_str("\n\n");
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"));
            got.read_event(data);
        }
        progress(&got);
    }
    assert_eq!(
        at,
        buf.len(),
        "the stream ended inside an event:\n{}",
        String::from_utf8_lossy(&buf)
    );
    got
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_and_text_of_a_chat_stream() {
        let body = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
                    data: {\"choices\":[{\"delta\":{\"content\":\" there\"}}]}\n\n\
                    data: [DONE]\n\n";
        assert_eq!(events(body).len(), 3);
        assert_eq!(text(body), "Hi there");
    }

    #[test]
    #[should_panic(expected = "not a data event")]
    fn a_comment_line_is_not_an_event() {
        events(": keep-alive\n\ndata: [DONE]\n\n");
    }
}
