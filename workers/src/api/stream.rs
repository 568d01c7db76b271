//! Streaming answers: the server-sent-event chunks (`text_completion` /
//! `chat.completion.chunk`, the role chunk, one per token, the usage
//! chunk) and the `data: [DONE]` that ends a stream.

use bytes::Bytes;
use serde::Serialize;

use super::{Endpoint, FinishReason, ResponseMeta, UsageBody};
use crate::engine::Usage;

/// The last event of a server-sent-event stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// `delta` of a chat chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delta {
    /// `assistant` in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// The token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streaming chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// Completions: the token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Chat: the delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    /// Always `null`.
    pub logprobs: Option<()>,
    /// Set on the last token's chunk, else `null`.
    pub finish_reason: Option<FinishReason>,
}

/// One streaming chunk (`text_completion` or `chat.completion.chunk`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// Response id (the same in every chunk).
    pub id: String,
    /// `text_completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Absent without `include_usage`; with it, `null` except in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

impl Chunk {
    fn with_choices(meta: &ResponseMeta, choices: Vec<ChunkChoice>, usage: Option<Option<UsageBody>>) -> Self {
        let object = match meta.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        Self {
            id: meta.id.clone(),
            object,
            created: meta.created,
            model: meta.model.clone(),
            choices,
            usage,
        }
    }

    /// The first chunk of a chat stream: `delta: {role: "assistant", content: ""}`.
    pub fn chat_role(meta: &ResponseMeta, include_usage: bool) -> Self {
        let delta = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
        };
        let choice = ChunkChoice {
            index: 0,
            text: None,
            delta: Some(delta),
            logprobs: None,
            finish_reason: None,
        };
        Self::with_choices(meta, vec![choice], include_usage.then_some(None))
    }

    /// The chunk of one token's `text`; `finish_reason` on the last one.
    pub fn token(meta: &ResponseMeta, text: String, finish_reason: Option<FinishReason>, include_usage: bool) -> Self {
        let (text, delta) = match meta.endpoint {
            Endpoint::Completions => (Some(text), None),
            Endpoint::Chat => (
                None,
                Some(Delta {
                    role: None,
                    content: Some(text),
                }),
            ),
        };
        let choice = ChunkChoice {
            index: 0,
            text,
            delta,
            logprobs: None,
            finish_reason,
        };
        Self::with_choices(meta, vec![choice], include_usage.then_some(None))
    }

    /// The final chunk with `include_usage`: no choices, the usage.
    pub fn usage(meta: &ResponseMeta, usage: Usage) -> Self {
        Self::with_choices(meta, Vec::new(), Some(Some(usage.into())))
    }

    /// The chunk as one server-sent event: `data: {json}\n\n`.
    pub fn to_sse(&self) -> Bytes {
        let mut out = b"data: ".to_vec();
        // Serializing these plain structs cannot fail.
        serde_json::to_writer(&mut out, self).unwrap_or_default();
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}
