//! What the client of a chat stream was given ([`Sent`]): its events, kept
//! as they went (shared, not copied) and read only when the stream breaks
//! ([`Sent::summary`]): the answer's `id`, `created` and `model`, its text
//! so far, and whether it was calling a tool or had finished.

use serde_json::Value;

use super::events;

/// Most bytes of events kept for one answer (about 20 000 chat chunks):
/// past it the answer is not resumed (its text so far is not known any
/// more) and nothing more is kept.
const MAX_SENT_BYTES: usize = 4 << 20;

/// The events a client was given (copied: a frame is a slice of the
/// connection's read buffer, which holding would keep whole).
#[derive(Debug, Default)]
pub(super) struct Sent {
    events: Vec<u8>,
    /// More than [`MAX_SENT_BYTES`] went.
    pub(super) overflow: bool,
}

/// What a broken stream's client has of the answer.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Summary {
    /// The first chunk's `id`, `created` and `model`.
    pub(super) id: Option<Value>,
    pub(super) created: Option<Value>,
    pub(super) model: Option<Value>,
    /// The content so far.
    pub(super) text: String,
    /// A tool call's deltas went (its arguments cannot be continued as
    /// text).
    pub(super) tool_call: bool,
    /// A `finish_reason` went: the answer is whole.
    pub(super) finished: bool,
    /// Chunks with content.
    pub(super) chunks: u32,
}

impl Sent {
    /// Keeps `data` (whole events) as given to the client.
    pub(super) fn push(&mut self, data: &[u8]) {
        if self.overflow {
            return;
        }
        if self.events.len() + data.len() > MAX_SENT_BYTES {
            self.overflow = true;
            self.events = Vec::new();
            return;
        }
        self.events.extend_from_slice(data);
    }

    /// What the events so far give the client.
    pub(super) fn summary(&self) -> Summary {
        let mut out = Summary::default();
        for line in events::split(&self.events) {
            let Some(chunk) = events::data_json(line).and_then(|j| serde_json::from_slice::<Value>(j).ok()) else {
                continue;
            };
            for (field, slot) in [
                ("id", &mut out.id),
                ("created", &mut out.created),
                ("model", &mut out.model),
            ] {
                if slot.is_none() {
                    *slot = chunk.get(field).cloned();
                }
            }
            let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
                continue;
            };
            let delta = choice.get("delta");
            // A chat chunk's `delta.content`, a completions chunk's `text`.
            let text = delta.and_then(|d| d.get("content")).or_else(|| choice.get("text"));
            if let Some(text) = text.and_then(Value::as_str)
                && !text.is_empty()
            {
                out.text.push_str(text);
                out.chunks += 1;
            }
            if delta.and_then(|d| d.get("tool_calls")).is_some_and(|c| !c.is_null()) {
                out.tool_call = true;
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                out.finished = true;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_reads_the_text_and_the_first_chunks_names() {
        let mut sent = Sent::default();
        sent.push(b"data: {\"id\":\"c1\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n");
        sent.push("data: {\"id\":\"c1\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" caf\u{e9}\"}}]}\n\ndata: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" ok\"},\"finish_reason\":null}]}\n\n".as_bytes());
        let s = sent.summary();
        assert_eq!(s.id, Some(Value::from("c1")));
        assert_eq!(s.created, Some(Value::from(7)));
        assert_eq!(s.text, " caf\u{e9} ok");
        assert_eq!(s.chunks, 2);
        assert!(!s.tool_call && !s.finished);
        sent.push(b"data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
        assert!(sent.summary().finished);
        let mut calls = Sent::default();
        calls.push(b"data: {\"id\":\"c2\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\"}}]}}]}\n\n");
        assert!(calls.summary().tool_call);
    }
}
