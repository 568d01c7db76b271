//! Answers of `POST /v1/messages` in Anthropic's shape: the `message`
//! object (one `text` block, or one `tool_use` block), its `stop_reason`
//! and `usage`, and the named events of a streamed answer
//! ([`MessagesWriter`]).
//!
//! `usage.input_tokens` counts the prompt tokens that were *not* served
//! from the prefix cache, `cache_read_input_tokens` those that were
//! (llama.cpp's convention, which follows Anthropic's:
//! `input_tokens + cache_read_input_tokens` is the whole prompt), and
//! `cache_creation_input_tokens` is 0. A stream is `message_start` (the
//! message with no content, `output_tokens: 1`), `content_block_start`,
//! `ping`, one `content_block_delta` per token (`text_delta`, or an
//! `input_json_delta` per piece of a call's input), `content_block_stop`,
//! `message_delta` (`stop_reason`, the usage) and `message_stop`.

use std::collections::VecDeque;

use bytes::Bytes;
use serde::Serialize;
use serde_json::json;

use super::conversation::Ordered;
use super::stream::{EventWriter, to_json, typed_event};
use super::tool_call::InOrder;
use super::{FinishReason, ResponseMeta, ToolCall};
use crate::engine::Usage;

/// Anthropic's `stop_reason` for a finish reason.
pub fn stop_reason(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
    }
}

/// `usage` of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MessagesUsage {
    /// Prompt tokens not served from the cache.
    pub input_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// Prompt tokens served from the cache.
    pub cache_read_input_tokens: u32,
    /// Always 0.
    pub cache_creation_input_tokens: u32,
}

impl MessagesUsage {
    /// The usage of a prompt of `prompt` tokens, `cached` of them cached,
    /// and `output` output tokens.
    pub fn new(prompt: u32, cached: u32, output: u32) -> Self {
        Self {
            input_tokens: prompt.saturating_sub(cached),
            output_tokens: output,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
        }
    }
}

/// A content block.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    /// Text.
    Text { text: &'a str },
    /// A tool call.
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: InOrder<'a>,
    },
}

/// The `message` object.
#[derive(Debug, Clone, Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<Block<'a>>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<()>,
    usage: MessagesUsage,
}

/// The pieces of one Messages answer.
#[derive(Debug, Clone)]
pub struct MessagesAnswer {
    /// Its id (`msg_…`), model.
    pub meta: ResponseMeta,
    /// The call, if the answer is one.
    pub call: Option<ToolCall>,
    /// Why it ends.
    pub finish: FinishReason,
}

/// An empty `input` (a streamed `tool_use` block's start).
static NO_INPUT: Ordered = Ordered::Object(Vec::new());

impl MessagesAnswer {
    fn message<'a>(&'a self, content: Vec<Block<'a>>, stop: Option<&'static str>, usage: MessagesUsage) -> Message<'a> {
        Message {
            id: &self.meta.id,
            kind: "message",
            role: "assistant",
            model: &self.meta.model,
            content,
            stop_reason: stop,
            stop_sequence: None,
            usage,
        }
    }

    /// The answer's one block: `text`, or the call with `input`.
    fn block<'a>(&'a self, text: &'a str, input: &'a Ordered) -> Block<'a> {
        match &self.call {
            Some(call) => Block::ToolUse {
                id: &call.id,
                name: &call.name,
                input: InOrder(input),
            },
            None => Block::Text { text },
        }
    }

    /// The non-streamed answer of `text` (ignored for a call).
    pub fn body(&self, text: &str, usage: Usage) -> Bytes {
        let input = self.call.as_ref().map_or(&NO_INPUT, |c| &c.arguments);
        let usage = MessagesUsage::new(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens);
        let message = self.message(vec![self.block(text, input)], Some(stop_reason(self.finish)), usage);
        Bytes::from(to_json(&message))
    }
}

/// The events of a streamed Messages answer (see the module docs).
#[derive(Debug, Clone)]
pub struct MessagesWriter {
    answer: MessagesAnswer,
    /// Output tokens.
    expected: u32,
    /// Prompt tokens, and those served from the cache.
    prompt: (u32, u32),
}

impl MessagesWriter {
    /// The writer of `answer`, `expected` tokens long, for a prompt of
    /// `prompt_tokens` of which `cached_tokens` were cached.
    pub fn new(answer: MessagesAnswer, expected: u32, prompt_tokens: u32, cached_tokens: u32) -> Self {
        Self {
            answer,
            expected,
            prompt: (prompt_tokens, cached_tokens),
        }
    }
}

impl EventWriter for MessagesWriter {
    fn start(&mut self, out: &mut VecDeque<Bytes>) {
        let usage = MessagesUsage::new(self.prompt.0, self.prompt.1, 1);
        let message = to_json(&self.answer.message(Vec::new(), None, usage));
        out.push_back(typed_event("message_start", &[("message", message)]));
        let block = to_json(&self.answer.block("", &NO_INPUT));
        out.push_back(typed_event(
            "content_block_start",
            &[("index", "0".into()), ("content_block", block)],
        ));
        out.push_back(typed_event("ping", &[]));
    }

    fn token(&mut self, index: u32, text: &str, out: &mut VecDeque<Bytes>) {
        let delta = match &self.answer.call {
            None => json!({"type": "text_delta", "text": text}),
            Some(call) => match call.piece(index, self.expected) {
                "" => return,
                piece => json!({"type": "input_json_delta", "partial_json": piece}),
            },
        };
        out.push_back(typed_event(
            "content_block_delta",
            &[("index", "0".into()), ("delta", delta.to_string())],
        ));
    }

    fn end(&mut self, usage: Usage, out: &mut VecDeque<Bytes>) {
        out.push_back(typed_event("content_block_stop", &[("index", "0".into())]));
        let usage = MessagesUsage::new(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens);
        let delta = json!({"stop_reason": stop_reason(self.answer.finish), "stop_sequence": null});
        out.push_back(typed_event(
            "message_delta",
            &[("delta", delta.to_string()), ("usage", to_json(&usage))],
        ));
        out.push_back(typed_event("message_stop", &[]));
    }

    /// Anthropic's `error` event, which ends the stream.
    fn error(&mut self, message: &str, out: &mut VecDeque<Bytes>) {
        let error = json!({"type": "api_error", "message": message});
        out.push_back(typed_event("error", &[("error", error.to_string())]));
    }
}
