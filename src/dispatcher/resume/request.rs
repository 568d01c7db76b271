//! The request that resumes an answer ([`continuation_body`]): the
//! client's messages and the text it was given as the assistant's last
//! message, continued (`continue_final_message`, vLLM's and SGLang's),
//! with what is left of its output budget; and how an attempt of it is
//! sent ([`Continuation`], [`SendAttempt`]: the proxy's routing and
//! retries, among the engines that have not failed the answer).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use hyper::body::Incoming;
use serde_json::{Value, json};
use shm_layout::ServerRef;

use crate::dispatcher::Dispatcher;
use crate::dispatcher::inflight::InflightGuard;
use crate::pools::Pool;

/// A resumed attempt's answer head, 2xx: its body, where it comes from,
/// and its in-flight count there.
pub(in crate::dispatcher) struct ResumedHead {
    pub body: Incoming,
    pub server: ServerRef,
    pub address: String,
    pub guard: InflightGuard,
}

/// An attempt under way: its head, or why none came.
pub(in crate::dispatcher) struct Attempt(pub Pin<Box<dyn Future<Output = Result<ResumedHead, String>> + Send>>);

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Attempt")
    }
}

impl Future for Attempt {
    type Output = Result<ResumedHead, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

/// Sends a continuation (its body given) to its [`Targets`], until the
/// request's deadline (the proxy's).
pub(in crate::dispatcher) type SendAttempt =
    fn(Arc<Dispatcher>, &Continuation, Bytes, Targets, tokio::time::Instant) -> Attempt;

/// Where a continuation may go: `first`, if it is still registered, then
/// the pool's engines but `exclude`.
#[derive(Debug, Clone, Default)]
pub(in crate::dispatcher) struct Targets {
    /// The engine asked first (one whose error event said it is alive).
    pub first: Option<ServerRef>,
    /// The engines that failed the answer.
    pub exclude: Vec<ServerRef>,
    /// The continuation's prompt tokens: the request's and the text
    /// carried (its prefill work, as the engine's load counts it).
    pub prompt_tokens: u64,
}

/// The request an answer began as, to resume it from.
pub(in crate::dispatcher) struct Continuation {
    pub path_and_query: String,
    pub headers: HeaderMap,
    /// The body as it went upstream.
    pub body: Bytes,
    pub pool: Option<Arc<Pool>>,
    pub cache_salt: Option<String>,
    /// A completions request (else chat completions).
    pub completions: bool,
    /// The request's prompt tokens (the gateway's count).
    pub prompt_tokens: u64,
    pub send: SendAttempt,
}

/// The body that continues `original` (a chat completions body) from
/// `text`, which is `carried` tokens long: `text` as the assistant's last
/// message (appended to one the client asked to continue already), with
/// `continue_final_message: true` and `add_generation_prompt: false`,
/// and `max_tokens` / `max_completion_tokens` less what was produced
/// (at least 1); a completions body (`completions`) with `text` appended
/// to its `prompt`. `None` if the body is not such an object.
pub(super) fn continuation_body(original: &[u8], text: &str, carried: u64, completions: bool) -> Option<Bytes> {
    let mut body: Value = serde_json::from_slice(original).ok()?;
    let obj = body.as_object_mut()?;
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(limit) = obj.get(key).and_then(Value::as_u64) {
            obj.insert(key.into(), limit.saturating_sub(carried).max(1).into());
        }
    }
    if completions {
        match obj.get_mut("prompt")? {
            Value::String(prompt) => prompt.push_str(text),
            _ => return None,
        }
        return serde_json::to_vec(&body).ok().map(Bytes::from);
    }
    let continuing = obj.get("continue_final_message").and_then(Value::as_bool) == Some(true);
    let messages = obj.get_mut("messages")?.as_array_mut()?;
    let role = messages.last()?.get("role").and_then(Value::as_str);
    let extend = continuing && role == Some("assistant");
    match messages.last_mut().and_then(|m| m.get_mut("content")) {
        Some(Value::String(content)) if extend => content.push_str(text),
        _ => messages.push(json!({"role": "assistant", "content": text})),
    }
    obj.insert("continue_final_message".into(), Value::Bool(true));
    obj.insert("add_generation_prompt".into(), Value::Bool(false));
    serde_json::to_vec(&body).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: &Bytes) -> Value {
        serde_json::from_slice(body).unwrap()
    }

    #[test]
    fn the_continuation_carries_the_text_and_what_is_left_of_the_budget() {
        let original = br#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,"max_tokens":100,"stream_options":{"include_usage":true}}"#;
        let body = parsed(&continuation_body(original, " the river", 2, false).unwrap());
        assert_eq!(
            body["messages"][1],
            json!({"role": "assistant", "content": " the river"})
        );
        assert_eq!(body["continue_final_message"], true);
        assert_eq!(body["add_generation_prompt"], false);
        assert_eq!(body["max_tokens"], 98);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        // A budget used up leaves one token.
        let body = parsed(&continuation_body(original, "x", 500, false).unwrap());
        assert_eq!(body["max_tokens"], 1);
        // No budget given: none set.
        let body =
            parsed(&continuation_body(br#"{"messages":[{"role":"user","content":"Hi"}]}"#, "x", 1, false).unwrap());
        assert!(body.get("max_tokens").is_none());
    }

    #[test]
    fn a_prefill_the_client_asked_to_continue_is_extended() {
        let original = br#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Sure:"}],"continue_final_message":true,"add_generation_prompt":false,"max_completion_tokens":10}"#;
        let body = parsed(&continuation_body(original, " one two", 2, false).unwrap());
        assert_eq!(body["messages"].as_array().unwrap().len(), 2);
        assert_eq!(body["messages"][1]["content"], "Sure: one two");
        assert_eq!(body["max_completion_tokens"], 8);
        assert!(continuation_body(b"[1]", "x", 1, false).is_none());
        assert!(continuation_body(br#"{"messages":"no"}"#, "x", 1, false).is_none());
        // Completions: the text goes on the prompt.
        let original = br#"{"prompt":"Once upon","max_tokens":10,"stream":true}"#;
        let body = parsed(&continuation_body(original, " a time", 2, true).unwrap());
        assert_eq!(body["prompt"], "Once upon a time");
        assert_eq!(body["max_tokens"], 8);
        assert!(body.get("continue_final_message").is_none());
        assert!(continuation_body(br#"{"prompt":[1,2]}"#, "x", 1, true).is_none());
    }
}
