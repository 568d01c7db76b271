//! Streaming answers: [`EventWriter`], what turns an answer's tokens into
//! server-sent events whichever API it is, and the OpenAI chunks
//! ([`ChunkWriter`]: `text_completion` / `chat.completion.chunk`, the role
//! chunk, one per token, the usage chunk, `data: [DONE]`). A chat answer
//! that is a tool call streams `tool_calls` deltas: the first names the
//! call (`id`, `type`, `function.name`, empty `arguments`), the next ones
//! carry pieces of the arguments (see [`ToolCall::piece`]; tokens whose
//! piece is empty send nothing, except the last, which carries the
//! `finish_reason`).

use std::collections::VecDeque;

use bytes::Bytes;
use serde::Serialize;

use super::{Endpoint, FinishReason, ResponseMeta, ToolCall, UsageBody};
use crate::engine::Usage;

/// The last event of an OpenAI chunk stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Turns an answer into server-sent events as its tokens come.
pub trait EventWriter: Send {
    /// The events before the first token.
    fn start(&mut self, out: &mut VecDeque<Bytes>);
    /// The events of token `index` (from 0), whose text is `text`.
    fn token(&mut self, index: u32, text: &str, out: &mut VecDeque<Bytes>);
    /// The events after the last token, with the answer's `usage`.
    fn end(&mut self, usage: Usage, out: &mut VecDeque<Bytes>);
    /// The events of a failure mid-answer (`message`), which end the
    /// stream: vLLM's error event (an OpenAI error object) and
    /// `data: [DONE]`.
    fn error(&mut self, message: &str, out: &mut VecDeque<Bytes>) {
        let error = serde_json::json!({"error": {
            "message": message, "type": "InternalServerError", "param": null, "code": 500,
        }});
        out.push_back(data_event(&error));
        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

/// `data: {json}\n\n`.
pub fn data_event(data: &impl Serialize) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serializing these plain values cannot fail.
    serde_json::to_writer(&mut out, data).unwrap_or_default();
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// `v` as JSON text.
pub fn to_json(v: &impl Serialize) -> String {
    // Serializing these plain values cannot fail.
    serde_json::to_string(v).unwrap_or_default()
}

/// `event: {name}\ndata: {"type": name, fields...}\n\n`, the fields (each
/// a key and its value as JSON text) in the order given, after `type`.
pub fn typed_event(name: &str, fields: &[(&str, String)]) -> Bytes {
    let mut out = format!("event: {name}\ndata: {{\"type\":{}", to_json(&name));
    for (key, value) in fields {
        out.push(',');
        out.push_str(&to_json(key));
        out.push(':');
        out.push_str(value);
    }
    out.push_str("}\n\n");
    Bytes::from(out)
}

/// `function` of a [`ToolCallDelta`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionDelta {
    /// The tool's name, in the first delta only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A piece of the arguments.
    pub arguments: String,
}

/// One element of `delta.tool_calls`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCallDelta {
    /// Always 0 (one call).
    pub index: u32,
    /// The call's id, in the first delta only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in the first delta only.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The function's name and a piece of the arguments.
    pub function: FunctionDelta,
}

/// `delta` of a chat chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delta {
    /// `assistant` in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// The token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// A tool call's delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
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
            _ => "chat.completion.chunk",
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

    fn chat_delta(meta: &ResponseMeta, delta: Delta, finish_reason: Option<FinishReason>, include_usage: bool) -> Self {
        let choice = ChunkChoice {
            index: 0,
            text: None,
            delta: Some(delta),
            logprobs: None,
            finish_reason,
        };
        Self::with_choices(meta, vec![choice], include_usage.then_some(None))
    }

    /// The first chunk of a chat stream: `delta: {role: "assistant", content: ""}`.
    pub fn chat_role(meta: &ResponseMeta, include_usage: bool) -> Self {
        let delta = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
            tool_calls: None,
        };
        Self::chat_delta(meta, delta, None, include_usage)
    }

    /// The chunk of one token's `text`; `finish_reason` on the last one.
    pub fn token(meta: &ResponseMeta, text: String, finish_reason: Option<FinishReason>, include_usage: bool) -> Self {
        if meta.endpoint != Endpoint::Completions {
            let delta = Delta {
                role: None,
                content: Some(text),
                tool_calls: None,
            };
            return Self::chat_delta(meta, delta, finish_reason, include_usage);
        }
        let choice = ChunkChoice {
            index: 0,
            text: Some(text),
            delta: None,
            logprobs: None,
            finish_reason,
        };
        Self::with_choices(meta, vec![choice], include_usage.then_some(None))
    }

    /// A chat chunk with a tool call's delta: the head (`first`: id, type
    /// and name) or a piece of the arguments.
    pub fn tool_call(
        meta: &ResponseMeta,
        call: &ToolCall,
        first: bool,
        arguments: &str,
        finish_reason: Option<FinishReason>,
        include_usage: bool,
    ) -> Self {
        let delta = ToolCallDelta {
            index: 0,
            id: first.then(|| call.id.clone()),
            kind: first.then_some("function"),
            function: FunctionDelta {
                name: first.then(|| call.name.clone()),
                arguments: arguments.to_owned(),
            },
        };
        let delta = Delta {
            role: None,
            content: None,
            tool_calls: Some(vec![delta]),
        };
        Self::chat_delta(meta, delta, finish_reason, include_usage)
    }

    /// The final chunk with `include_usage`: no choices, the usage.
    pub fn usage(meta: &ResponseMeta, usage: Usage) -> Self {
        Self::with_choices(meta, Vec::new(), Some(Some(usage.into())))
    }

    /// The chunk as one server-sent event: `data: {json}\n\n`.
    pub fn to_sse(&self) -> Bytes {
        data_event(self)
    }
}

/// The OpenAI chunks of a completions or chat answer.
#[derive(Debug, Clone)]
pub struct ChunkWriter {
    /// Whose answer.
    pub meta: ResponseMeta,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// The last token's finish reason.
    pub finish: FinishReason,
    /// The call, if the answer is one.
    pub call: Option<ToolCall>,
    /// Output tokens.
    pub expected: u32,
}

impl EventWriter for ChunkWriter {
    fn start(&mut self, out: &mut VecDeque<Bytes>) {
        if self.meta.endpoint != Endpoint::Completions {
            out.push_back(Chunk::chat_role(&self.meta, self.include_usage).to_sse());
        }
    }

    fn token(&mut self, index: u32, text: &str, out: &mut VecDeque<Bytes>) {
        let last = index + 1 >= self.expected;
        let finish = last.then_some(self.finish);
        let chunk = match &self.call {
            None => Chunk::token(&self.meta, text.to_owned(), finish, self.include_usage),
            Some(call) => {
                let piece = call.piece(index, self.expected);
                if index > 0 && piece.is_empty() && !last {
                    return;
                }
                Chunk::tool_call(&self.meta, call, index == 0, piece, finish, self.include_usage)
            }
        };
        out.push_back(chunk.to_sse());
    }

    fn end(&mut self, usage: Usage, out: &mut VecDeque<Bytes>) {
        if self.include_usage {
            out.push_back(Chunk::usage(&self.meta, usage).to_sse());
        }
        out.push_back(Bytes::from_static(SSE_DONE));
    }
}
