//! The stored responses of `POST /v1/responses` (`store: true`, the
//! default), which a later request continues with `previous_response_id`,
//! as vLLM keeps them in memory: for each response id, the conversation
//! it answered (its messages as rendered, system messages included) and
//! its output as an assistant message.
//!
//! The store is bounded: at most [`MAX_RESPONSES`] responses and about
//! [`MAX_BYTES`] of message text; the oldest go first. A forgotten (or
//! never stored) id gets a 404 `response_not_found`, as in vLLM.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};

/// Responses kept at most.
pub const MAX_RESPONSES: usize = 10_000;

/// Bytes of message text kept at most (a long conversation's every turn
/// holds the whole conversation).
pub const MAX_BYTES: usize = 256 << 20;

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// The conversation it answered.
    pub messages: Vec<ChatMessage<'static>>,
    /// Its output, an assistant message.
    pub output: ChatMessage<'static>,
}

impl StoredResponse {
    /// The conversation a continuation starts from: the stored messages
    /// without their system messages (instructions do not carry over),
    /// then the output.
    pub fn history(&self) -> Vec<ChatMessage<'static>> {
        let mut history: Vec<ChatMessage<'static>> =
            self.messages.iter().filter(|m| m.role != "system").cloned().collect();
        history.push(self.output.clone());
        history
    }

    /// About how many bytes it holds.
    fn bytes(&self) -> usize {
        self.messages.iter().chain([&self.output]).map(message_bytes).sum()
    }
}

fn message_bytes(m: &ChatMessage<'_>) -> usize {
    let fields: usize = m.fields.iter().map(|(k, v)| k.len() + value_bytes(v)).sum();
    m.role.len() + m.content.len() + fields + 32
}

fn value_bytes(v: &TemplateValue<'_>) -> usize {
    match v {
        TemplateValue::String(s) => s.len() + 8,
        TemplateValue::Array(items) => items.iter().map(value_bytes).sum::<usize>() + 8,
        TemplateValue::Object(pairs) => pairs.iter().map(|(k, v)| k.len() + value_bytes(v)).sum::<usize>() + 8,
        _ => 8,
    }
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, (Arc<StoredResponse>, usize)>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

/// The store (shared by all connections).
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    /// Responses kept at most.
    max_responses: usize,
    /// Bytes kept at most.
    max_bytes: usize,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::with_limits(MAX_RESPONSES, MAX_BYTES)
    }
}

impl ResponseStore {
    /// An empty store with the default bounds.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store keeping at most `max_responses` responses and about
    /// `max_bytes` bytes.
    pub fn with_limits(max_responses: usize, max_bytes: usize) -> Self {
        Self {
            inner: Mutex::default(),
            max_responses,
            max_bytes,
        }
    }

    /// Keeps `response` under `id`, forgetting the oldest ones beyond the bounds.
    pub fn insert(&self, id: String, response: StoredResponse) {
        let size = response.bytes();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, old)) = inner.by_id.insert(id.clone(), (Arc::new(response), size)) {
            inner.bytes -= old;
            inner.order.retain(|k| *k != id);
        }
        inner.bytes += size;
        inner.order.push_back(id);
        while inner.order.len() > self.max_responses || (inner.bytes > self.max_bytes && inner.order.len() > 1) {
            let Some(oldest) = inner.order.pop_front() else { break };
            if let Some((_, size)) = inner.by_id.remove(&oldest) {
                inner.bytes -= size;
            }
        }
    }

    /// The response stored under `id`.
    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.by_id.get(id).map(|(r, _)| r.clone())
    }

    /// How many responses it holds.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).order.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(text: &str) -> StoredResponse {
        StoredResponse {
            messages: vec![
                ChatMessage::new("system", "be brief"),
                ChatMessage::new("user", text.to_owned()),
            ],
            output: ChatMessage::new("assistant", "ok"),
        }
    }

    #[test]
    fn history_drops_system_messages_and_ends_with_the_output() {
        let history = response("hi").history();
        let roles: Vec<&str> = history.iter().map(|m| m.role.as_ref()).collect();
        assert_eq!(roles, ["user", "assistant"]);
    }

    #[test]
    fn the_oldest_responses_go_first() {
        let store = ResponseStore::with_limits(100, 100_000);
        for i in 0..105 {
            store.insert(format!("resp_{i}"), response("x"));
        }
        assert_eq!(store.len(), 100);
        assert!(store.get("resp_4").is_none());
        assert!(store.get("resp_5").is_some());
        // Bytes: one huge response pushes the others out, but stays.
        store.insert("big".into(), response(&"y".repeat(200_000)));
        assert_eq!(store.len(), 1);
        assert!(store.get("big").is_some());
    }
}
