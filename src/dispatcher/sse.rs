//! Server-sent events both ways: reading the answer text out of a relayed
//! OpenAI stream ([`SseCapture`]), and replaying a cached non-streaming
//! answer as a stream ([`replay`]).
//!
//! A relayed stream is parsed as it passes, event line by event line
//! (`data: {json}`), without holding the stream back: the text of
//! choice 0 (`choices[0].text` for completions, `choices[0].delta.content`
//! for chat) is accumulated for the completion record, and the usage
//! chunk's `completion_tokens` is kept if the client asked for one.
//!
//! A replay turns a stored `text_completion` / `chat.completion` JSON body
//! into the chunks an engine would have sent: per choice one chunk with the
//! whole text (chat: with `role: assistant`), then one with its
//! `finish_reason`; a usage chunk when the request has
//! `stream_options.include_usage`; then `data: [DONE]`.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::prompt::Endpoint;

/// Longest SSE line or accumulated answer text kept (bytes); past it the
/// capture gives up (the answer is still relayed, only not learned from).
const MAX_CAPTURE_BYTES: usize = 16 << 20;

/// The answer text of a relayed event stream, gathered as it passes.
#[derive(Debug, Default)]
pub(crate) struct SseCapture {
    line: Vec<u8>,
    /// Text of choice 0 so far.
    pub text: String,
    /// `usage.completion_tokens`, if a chunk carried it.
    pub completion_tokens: Option<u64>,
    /// Whether `data: [DONE]` was seen.
    pub done: bool,
    /// Whether a line or the text grew past the limit (the capture is void).
    pub overflow: bool,
}

impl SseCapture {
    /// Feeds the next bytes of the stream.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !self.overflow && !bytes.is_empty() {
            match bytes.iter().position(|b| *b == b'\n') {
                Some(i) => {
                    if self.line.is_empty() {
                        self.event_line(&bytes[..i]);
                    } else {
                        self.line.extend_from_slice(&bytes[..i]);
                        let line = std::mem::take(&mut self.line);
                        self.event_line(&line);
                        self.line = line;
                        self.line.clear();
                    }
                    bytes = &bytes[i + 1..];
                }
                None => {
                    self.line.extend_from_slice(bytes);
                    if self.line.len() > MAX_CAPTURE_BYTES {
                        self.overflow = true;
                    }
                    return;
                }
            }
        }
    }

    fn event_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        if let Some(choice) = choice_zero(&chunk) {
            let piece = choice.get("text").and_then(Value::as_str).or_else(|| {
                choice
                    .get("delta")
                    .and_then(|d| d.get("content"))
                    .and_then(Value::as_str)
            });
            if let Some(piece) = piece {
                self.text.push_str(piece);
                if self.text.len() > MAX_CAPTURE_BYTES {
                    self.overflow = true;
                }
            }
        }
        if let Some(n) = chunk
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64)
        {
            self.completion_tokens = Some(n);
        }
    }
}

/// The choice with index 0 (or the first one) of a response or chunk.
pub(crate) fn choice_zero(v: &Value) -> Option<&Value> {
    let choices = v.get("choices")?.as_array()?;
    choices
        .iter()
        .find(|c| c.get("index").and_then(Value::as_u64) == Some(0))
        .or_else(|| choices.first())
}

/// The answer text and completion tokens of a non-streaming response body.
pub(crate) fn json_answer(body: &[u8]) -> Option<(String, Option<u64>)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let choice = choice_zero(&v)?;
    let text = choice
        .get("text")
        .and_then(Value::as_str)
        .or_else(|| {
            choice
                .get("message")
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
        })
        .unwrap_or_default()
        .to_owned();
    let tokens = v
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(Value::as_u64);
    Some((text, tokens))
}

fn event(out: &mut Vec<u8>, value: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(value.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// The SSE body replaying the stored JSON `stored` for a streaming request
/// to `endpoint` (ending with a usage chunk if `include_usage`); `None` if
/// `stored` is not a response of that endpoint (then it is treated as a
/// miss).
pub(crate) fn replay(endpoint: Endpoint, stored: &[u8], include_usage: bool) -> Option<Bytes> {
    let v: Value = serde_json::from_slice(stored).ok()?;
    let choices = v.get("choices")?.as_array()?;
    let object = match endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::ChatCompletions => "chat.completion.chunk",
    };
    let chunk = |choices: Value| {
        let mut c = json!({
            "id": v.get("id").cloned().unwrap_or(Value::Null),
            "object": object,
            "created": v.get("created").cloned().unwrap_or(Value::Null),
            "model": v.get("model").cloned().unwrap_or(Value::Null),
            "choices": choices,
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    let mut out = Vec::with_capacity(stored.len() + 256);
    for (i, choice) in choices.iter().enumerate() {
        let index = choice.get("index").cloned().unwrap_or_else(|| json!(i));
        let finish = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
        let (content, end) = match endpoint {
            Endpoint::Completions => {
                let text = choice.get("text")?.as_str()?;
                (
                    json!({"index": index, "text": text, "logprobs": null, "finish_reason": null}),
                    json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish}),
                )
            }
            Endpoint::ChatCompletions => {
                let message = choice.get("message")?;
                let mut delta = Map::new();
                delta.insert("role".into(), json!("assistant"));
                for (k, val) in message.as_object()? {
                    if k != "role" {
                        delta.insert(k.clone(), val.clone());
                    }
                }
                (
                    json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}),
                    json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}),
                )
            }
        };
        event(&mut out, &chunk(Value::Array(vec![content])));
        event(&mut out, &chunk(Value::Array(vec![end])));
    }
    if include_usage {
        let mut c = chunk(Value::Array(Vec::new()));
        c["usage"] = v.get("usage").cloned().unwrap_or(Value::Null);
        event(&mut out, &c);
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(body: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(body).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }

    #[test]
    fn capture_reassembles_text_across_split_chunks() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" Hello\"}}]}\r\n\r\n",
            ": comment\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n"
        );
        for split in [1, 3, 7, 50, stream.len()] {
            let mut c = SseCapture::default();
            for piece in stream.as_bytes().chunks(split) {
                c.feed(piece);
            }
            assert_eq!(c.text, " Hello world", "split {split}");
            assert_eq!(c.completion_tokens, Some(2));
            assert!(c.done && !c.overflow);
        }
    }

    #[test]
    fn replay_of_a_chat_answer() {
        let stored = br#"{"id":"chatcmpl-1","object":"chat.completion","created":5,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":" hi there"},"finish_reason":"stop"}],
            "usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let body = replay(Endpoint::ChatCompletions, stored, true).unwrap();
        let ev = events(&body);
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[0]["object"], "chat.completion.chunk");
        assert_eq!(ev[0]["choices"][0]["delta"]["content"], " hi there");
        assert_eq!(ev[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(ev[2]["usage"]["completion_tokens"], 2);
        let mut c = SseCapture::default();
        c.feed(&body);
        assert_eq!(c.text, " hi there");
        // A completions body is not a chat answer.
        assert!(replay(Endpoint::ChatCompletions, br#"{"choices":[{"text":"x"}]}"#, true).is_none());
    }

    #[test]
    fn replay_of_a_completion_without_usage() {
        let stored = br#"{"id":"cmpl-1","object":"text_completion","created":5,"model":"m",
            "choices":[{"index":0,"text":" a b","finish_reason":"length"}]}"#;
        let body = replay(Endpoint::Completions, stored, false).unwrap();
        let ev = events(&body);
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0]["choices"][0]["text"], " a b");
        assert!(ev[0].get("usage").is_none());
        assert_eq!(json_answer(stored).unwrap().0, " a b");
    }
}
