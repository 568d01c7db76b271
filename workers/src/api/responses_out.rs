//! Answers of `POST /v1/responses`: the `response` object and its output
//! item (a `message` with one `output_text` part, or a `function_call`),
//! and the named server-sent events of a streamed answer
//! ([`ResponsesWriter`]).
//!
//! A stream is `response.created` and `response.in_progress` (the response
//! `in_progress`, no output), `response.output_item.added`, then for text
//! `response.content_part.added`, one `response.output_text.delta` per
//! token, `response.output_text.done`, `response.content_part.done`; for
//! a call `response.function_call_arguments.delta` per piece of the
//! arguments and `response.function_call_arguments.done`; then
//! `response.output_item.done` and `response.completed` with the whole
//! response and its usage. Each event is `event: <type>\ndata: <json>\n\n`,
//! its data carrying `type` and a `sequence_number` from 0; there is no
//! `data: [DONE]`. An answer cut by `max_output_tokens` has status
//! `incomplete` and `incomplete_details: {"reason": "max_output_tokens"}`.

use std::collections::VecDeque;

use bytes::Bytes;
use serde_json::{Value, json};

use super::stream::{EventWriter, named_event};
use super::{FinishReason, ResponseMeta, ResponsesEcho, ToolCall};
use crate::engine::Usage;

/// `usage` of a response.
fn usage_value(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        // The openai client's model requires `cache_write_tokens` (0: the
        // engine reports no cache writes).
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens.saturating_add(usage.completion_tokens),
    })
}

/// The pieces of one Responses answer.
#[derive(Debug, Clone)]
pub struct ResponsesAnswer {
    /// Its id, creation time and model.
    pub meta: ResponseMeta,
    /// What it repeats of its request.
    pub echo: ResponsesEcho,
    /// The call, if the answer is one.
    pub call: Option<ToolCall>,
    /// Why it ends.
    pub finish: FinishReason,
}

impl ResponsesAnswer {
    /// The output item's id (`msg_…` or `fc_…`).
    pub fn item_id(&self) -> String {
        let prefix = if self.call.is_some() { "fc_" } else { "msg_" };
        format!("{prefix}{}", self.meta.id_hex())
    }

    /// The output item, `status` `in_progress` or `completed`, with `text`
    /// (a message; `None`: no content part yet) or the call's arguments.
    fn item(&self, status: &str, text: Option<&str>, arguments: &str) -> Value {
        match &self.call {
            Some(call) => json!({
                "type": "function_call",
                "id": self.item_id(),
                "call_id": call.id,
                "name": call.name,
                "arguments": arguments,
                "status": status,
            }),
            None => json!({
                "type": "message",
                "id": self.item_id(),
                "status": status,
                "role": "assistant",
                "content": text.map(|t| vec![text_part(t)]).unwrap_or_default(),
            }),
        }
    }

    /// The `response` object: `in_progress` with no output, or finished
    /// with its output item and usage.
    fn response(&self, done: Option<(&str, Usage)>) -> Value {
        let incomplete = done.is_some() && self.finish == FinishReason::Length;
        let status = match done {
            None => "in_progress",
            Some(_) if incomplete => "incomplete",
            Some(_) => "completed",
        };
        let output = match done {
            Some((text, _)) => {
                let arguments = self.call.as_ref().map_or("", |c| c.arguments_json.as_str());
                vec![self.item("completed", Some(text), arguments)]
            }
            None => Vec::new(),
        };
        let echo = &self.echo;
        json!({
            "id": self.meta.id,
            "object": "response",
            "created_at": self.meta.created,
            "status": status,
            "background": false,
            "error": null,
            "incomplete_details": incomplete.then(|| json!({"reason": "max_output_tokens"})),
            "instructions": echo.instructions,
            "max_output_tokens": echo.max_output_tokens,
            "max_tool_calls": null,
            "metadata": {},
            "model": self.meta.model,
            "output": output,
            "parallel_tool_calls": true,
            "previous_response_id": echo.previous_response_id,
            "reasoning": null,
            "service_tier": "auto",
            "store": echo.store,
            "temperature": echo.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": echo.tool_choice,
            "tools": echo.tools,
            "top_logprobs": 0,
            "top_p": echo.top_p,
            "truncation": "disabled",
            "usage": done.map(|(_, usage)| usage_value(usage)),
            "user": null,
        })
    }

    /// The non-streamed answer of `text` (ignored for a call).
    pub fn body(&self, text: &str, usage: Usage) -> Bytes {
        Bytes::from(self.response(Some((text, usage))).to_string())
    }
}

/// An `output_text` part.
fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The events of a streamed Responses answer (see the module docs).
#[derive(Debug, Clone)]
pub struct ResponsesWriter {
    answer: ResponsesAnswer,
    /// Output tokens.
    expected: u32,
    /// The next `sequence_number`.
    sequence: u64,
    /// The text so far.
    text: String,
}

impl ResponsesWriter {
    /// The writer of `answer`, `expected` tokens long.
    pub fn new(answer: ResponsesAnswer, expected: u32) -> Self {
        Self {
            answer,
            expected,
            sequence: 0,
            text: String::new(),
        }
    }

    /// Queues event `kind` with `data`'s fields.
    fn push(&mut self, out: &mut VecDeque<Bytes>, kind: &str, mut data: Value) {
        if let Value::Object(map) = &mut data {
            map.insert("type".into(), kind.into());
            map.insert("sequence_number".into(), self.sequence.into());
        }
        self.sequence += 1;
        out.push_back(named_event(kind, &data));
    }
}

impl EventWriter for ResponsesWriter {
    fn start(&mut self, out: &mut VecDeque<Bytes>) {
        let response = self.answer.response(None);
        self.push(out, "response.created", json!({"response": response}));
        self.push(out, "response.in_progress", json!({"response": response}));
        let item = self.answer.item("in_progress", None, "");
        self.push(
            out,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        if self.answer.call.is_none() {
            let id = self.answer.item_id();
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            self.push(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "part": part}),
            );
        }
    }

    fn token(&mut self, index: u32, text: &str, out: &mut VecDeque<Bytes>) {
        let id = self.answer.item_id();
        match &self.answer.call {
            None => {
                self.text.push_str(text);
                let data = json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []});
                self.push(out, "response.output_text.delta", data);
            }
            Some(call) => {
                let piece = call.piece(index, self.expected).to_owned();
                if !piece.is_empty() {
                    let data = json!({"item_id": id, "output_index": 0, "delta": piece});
                    self.push(out, "response.function_call_arguments.delta", data);
                }
            }
        }
    }

    fn end(&mut self, usage: Usage, out: &mut VecDeque<Bytes>) {
        let id = self.answer.item_id();
        let text = std::mem::take(&mut self.text);
        match &self.answer.call {
            None => {
                let data = json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []});
                self.push(out, "response.output_text.done", data);
                let data = json!({"item_id": id, "output_index": 0, "content_index": 0, "part": text_part(&text)});
                self.push(out, "response.content_part.done", data);
            }
            Some(call) => {
                let data =
                    json!({"item_id": id, "output_index": 0, "name": call.name, "arguments": call.arguments_json});
                self.push(out, "response.function_call_arguments.done", data);
            }
        }
        let arguments = self.answer.call.as_ref().map_or("", |c| c.arguments_json.as_str());
        let item = self.answer.item("completed", Some(&text), arguments);
        self.push(
            out,
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
        let response = self.answer.response(Some((&text, usage)));
        self.push(out, "response.completed", json!({"response": response}));
    }
}
