//! Answers of `POST /v1/responses`: the `response` object and its output
//! item (a `message` with one `output_text` part, or a `function_call`),
//! and the named server-sent events of a streamed answer
//! ([`ResponsesWriter`]). Members come in OpenAI's order (`id` first).
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
use serde::Serialize;
use serde_json::Value;

use super::stream::{EventWriter, to_json, typed_event};
use super::{FinishReason, ResponseMeta, ResponsesEcho, ToolCall};
use crate::engine::Usage;

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
struct InputDetails {
    cached_tokens: u32,
    /// 0: the engine reports no cache writes (the openai client's model
    /// requires the member).
    cache_write_tokens: u32,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
struct OutputDetails {
    reasoning_tokens: u32,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Serialize)]
struct ResponsesUsage {
    input_tokens: u32,
    input_tokens_details: InputDetails,
    output_tokens: u32,
    output_tokens_details: OutputDetails,
    total_tokens: u32,
}

impl From<Usage> for ResponsesUsage {
    fn from(u: Usage) -> Self {
        Self {
            input_tokens: u.prompt_tokens,
            input_tokens_details: InputDetails {
                cached_tokens: u.cached_tokens,
                cache_write_tokens: 0,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: OutputDetails { reasoning_tokens: 0 },
            total_tokens: u.prompt_tokens.saturating_add(u.completion_tokens),
        }
    }
}

/// An `output_text` part.
#[derive(Debug, Clone, Serialize)]
struct TextPart<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
    annotations: [(); 0],
    logprobs: [(); 0],
}

fn text_part(text: &str) -> TextPart<'_> {
    TextPart {
        kind: "output_text",
        text,
        annotations: [],
        logprobs: [],
    }
}

/// An output item.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
enum Item<'a> {
    Message {
        #[serde(rename = "type")]
        kind: &'static str,
        id: String,
        status: &'static str,
        role: &'static str,
        content: Vec<TextPart<'a>>,
    },
    FunctionCall {
        #[serde(rename = "type")]
        kind: &'static str,
        id: String,
        call_id: &'a str,
        name: &'a str,
        arguments: &'a str,
        status: &'static str,
    },
}

/// `incomplete_details`.
#[derive(Debug, Clone, Copy, Serialize)]
struct IncompleteDetails {
    reason: &'static str,
}

/// `text`: the output format.
#[derive(Debug, Clone, Copy, Serialize)]
struct TextConfig {
    format: TextFormat,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct TextFormat {
    #[serde(rename = "type")]
    kind: &'static str,
}

/// The `response` object, members in OpenAI's order.
#[derive(Debug, Clone, Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'static str,
    background: bool,
    error: Option<()>,
    incomplete_details: Option<IncompleteDetails>,
    instructions: Option<&'a str>,
    max_output_tokens: Option<u32>,
    max_tool_calls: Option<()>,
    metadata: serde_json::Map<String, Value>,
    model: &'a str,
    output: Vec<Item<'a>>,
    parallel_tool_calls: bool,
    previous_response_id: Option<&'a str>,
    reasoning: Option<()>,
    service_tier: &'static str,
    store: bool,
    temperature: &'a Value,
    text: TextConfig,
    tool_choice: &'a Value,
    tools: &'a [Value],
    top_logprobs: u32,
    top_p: &'a Value,
    truncation: &'static str,
    usage: Option<ResponsesUsage>,
    user: Option<()>,
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
    /// (a message; `None`: no content part yet) or the call's arguments
    /// (all of them once completed).
    fn item<'a>(&'a self, status: &'static str, text: Option<&'a str>) -> Item<'a> {
        match &self.call {
            Some(call) => Item::FunctionCall {
                kind: "function_call",
                id: self.item_id(),
                call_id: &call.id,
                name: &call.name,
                arguments: if status == "completed" {
                    &call.arguments_json
                } else {
                    ""
                },
                status,
            },
            None => Item::Message {
                kind: "message",
                id: self.item_id(),
                status,
                role: "assistant",
                content: text.map(|t| vec![text_part(t)]).unwrap_or_default(),
            },
        }
    }

    /// The `response` object: `in_progress` with no output, or finished
    /// with its output item (of `text`) and usage.
    fn response<'a>(&'a self, done: Option<(&'a str, Usage)>) -> ResponseObject<'a> {
        let incomplete = done.is_some() && self.finish == FinishReason::Length;
        let status = match done {
            None => "in_progress",
            Some(_) if incomplete => "incomplete",
            Some(_) => "completed",
        };
        let echo = &self.echo;
        ResponseObject {
            id: &self.meta.id,
            object: "response",
            created_at: self.meta.created,
            status,
            background: false,
            error: None,
            incomplete_details: incomplete.then_some(IncompleteDetails {
                reason: "max_output_tokens",
            }),
            instructions: echo.instructions.as_deref(),
            max_output_tokens: echo.max_output_tokens,
            max_tool_calls: None,
            metadata: serde_json::Map::new(),
            model: &self.meta.model,
            output: done
                .map(|(text, _)| vec![self.item("completed", Some(text))])
                .unwrap_or_default(),
            parallel_tool_calls: true,
            previous_response_id: echo.previous_response_id.as_deref(),
            reasoning: None,
            service_tier: "auto",
            store: echo.store,
            temperature: &echo.temperature,
            text: TextConfig {
                format: TextFormat { kind: "text" },
            },
            tool_choice: &echo.tool_choice,
            tools: &echo.tools,
            top_logprobs: 0,
            top_p: &echo.top_p,
            truncation: "disabled",
            usage: done.map(|(_, usage)| usage.into()),
            user: None,
        }
    }

    /// The non-streamed answer of `text` (ignored for a call).
    pub fn body(&self, text: &str, usage: Usage) -> Bytes {
        Bytes::from(to_json(&self.response(Some((text, usage)))))
    }
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

    /// Queues event `kind`: `type`, `sequence_number`, then `fields`.
    fn push(&mut self, out: &mut VecDeque<Bytes>, kind: &str, fields: Vec<(&str, String)>) {
        let mut all = vec![("sequence_number", self.sequence.to_string())];
        all.extend(fields);
        self.sequence += 1;
        out.push_back(typed_event(kind, &all));
    }

    /// The fields locating the output item (and its content part).
    fn at(&self, part: bool) -> Vec<(&'static str, String)> {
        let mut fields = vec![
            ("item_id", to_json(&self.answer.item_id())),
            ("output_index", "0".into()),
        ];
        if part {
            fields.push(("content_index", "0".into()));
        }
        fields
    }
}

impl EventWriter for ResponsesWriter {
    fn start(&mut self, out: &mut VecDeque<Bytes>) {
        let response = to_json(&self.answer.response(None));
        self.push(out, "response.created", vec![("response", response.clone())]);
        self.push(out, "response.in_progress", vec![("response", response)]);
        let item = to_json(&self.answer.item("in_progress", None));
        self.push(
            out,
            "response.output_item.added",
            vec![("output_index", "0".into()), ("item", item)],
        );
        if self.answer.call.is_none() {
            let mut fields = self.at(true);
            fields.push(("part", r#"{"type":"output_text","text":"","annotations":[]}"#.into()));
            self.push(out, "response.content_part.added", fields);
        }
    }

    fn token(&mut self, index: u32, text: &str, out: &mut VecDeque<Bytes>) {
        let piece = match &self.answer.call {
            None => {
                self.text.push_str(text);
                let mut fields = self.at(true);
                fields.extend([("delta", to_json(&text)), ("logprobs", "[]".into())]);
                self.push(out, "response.output_text.delta", fields);
                return;
            }
            Some(call) => call.piece(index, self.expected).to_owned(),
        };
        if !piece.is_empty() {
            let mut fields = self.at(false);
            fields.push(("delta", to_json(&piece)));
            self.push(out, "response.function_call_arguments.delta", fields);
        }
    }

    fn end(&mut self, usage: Usage, out: &mut VecDeque<Bytes>) {
        let text = std::mem::take(&mut self.text);
        match &self.answer.call {
            None => {
                let mut fields = self.at(true);
                fields.extend([("text", to_json(&text)), ("logprobs", "[]".into())]);
                self.push(out, "response.output_text.done", fields);
                let mut fields = self.at(true);
                fields.push(("part", to_json(&text_part(&text))));
                self.push(out, "response.content_part.done", fields);
            }
            Some(call) => {
                let (name, arguments) = (to_json(&call.name), to_json(&call.arguments_json));
                let mut fields = self.at(false);
                fields.extend([("name", name), ("arguments", arguments)]);
                self.push(out, "response.function_call_arguments.done", fields);
            }
        }
        let item = to_json(&self.answer.item("completed", Some(&text)));
        self.push(
            out,
            "response.output_item.done",
            vec![("output_index", "0".into()), ("item", item)],
        );
        let response = to_json(&self.answer.response(Some((&text, usage))));
        self.push(out, "response.completed", vec![("response", response)]);
    }

    /// The Responses stream's `error` event, which ends it.
    fn error(&mut self, message: &str, out: &mut VecDeque<Bytes>) {
        let fields = vec![
            ("code", "\"server_error\"".into()),
            ("message", to_json(&message)),
            ("param", "null".into()),
        ];
        self.push(out, "error", fields);
    }
}
