//! The APIs an `agents` session can speak (`--agents-api`): chat
//! completions as the plain `agents` workload sends them, or a
//! tool-calling agent loop over chat completions, OpenAI's Responses API
//! or Anthropic's Messages API.
//!
//! A tool-calling session keeps its conversation in an API-neutral form
//! ([`Turn`]) and renders it whole for every call ([`AgentsApi::body`]):
//! the system prompt, the task, and every answer the engine gave with what
//! followed it. Every call carries the same [`TOOLS`] (three function
//! tools; the system prompts are shared by many sessions, so are the
//! tools). The engine (`semlb-sim`) answers a conversation with tools whose
//! last message is not a tool result with one tool call, and one whose
//! last message is a tool result with text, so a session alternates: the
//! task (a user message) → a tool call → its result (the workload's "Tool
//! result" text, sent as that API's tool result) → a text answer → the
//! next user message (the workload's next message) → a tool call → ...
//!
//! | API | path | tools | a tool call answered | sent back as | prompt tokens | cached tokens |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | `chat` | `/v1/chat/completions` | none (the plain `agents` calls: tool results are user messages) | - | - | `usage.prompt_tokens` | `usage.prompt_tokens_details.cached_tokens` |
//! | `chat-tools` | `/v1/chat/completions` | `tools: [{type: function, function: {...}}]` | `message.tool_calls[0]` | that assistant message, then `{role: tool, tool_call_id, content}` | as `chat` | as `chat` |
//! | `responses` | `/v1/responses` (`store: false`, the whole input every call, `instructions` = the system prompt) | `tools: [{type: function, name, ...}]` | an output item `{type: function_call, call_id, name, arguments}` | that item, then `{type: function_call_output, call_id, output}` | `usage.input_tokens` | `usage.input_tokens_details.cached_tokens` |
//! | `messages` | `/v1/messages` (`system` = the system prompt) | `tools: [{name, description, input_schema}]` | a `tool_use` block `{id, name, input}` | the assistant message with that block, then a user message with `{type: tool_result, tool_use_id, content}` | `usage.input_tokens + usage.cache_read_input_tokens` | `usage.cache_read_input_tokens` |
//!
//! Streamed calls ask chat completions for `stream_options.include_usage`;
//! a Responses stream's usage is in its `response.completed` event's
//! response, a Messages stream's prompt tokens in `message_start`. Every
//! call has `max_tokens` (`max_output_tokens`) = the workload's output
//! length, `ignore_eos` and `temperature` 1, as the plain calls, but for
//! Responses calls, which have no `ignore_eos` (smg's Responses request
//! type refuses fields it does not know, and the simulator's
//! `x-semlb-output-tokens` header is dropped by every peer router), so a
//! Responses text answer is min(`max_output_tokens`, the engine's default
//! output length) long, the same for every row; a tool call is as long as
//! the template renders it. A Responses tool call is
//! sent back as the output item came (with its `id` and `status`), an
//! assistant text as `{type: message, role: assistant, content: text}`.

use clap::ValueEnum;
use serde_json::{Value, json};

/// The API of an `agents` session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, ValueEnum)]
pub enum AgentsApi {
    /// Chat completions without tools (the plain `agents` workload).
    #[default]
    Chat,
    /// A tool-calling loop over chat completions.
    ChatTools,
    /// A tool-calling loop over OpenAI's Responses API.
    Responses,
    /// A tool-calling loop over Anthropic's Messages API.
    Messages,
}

/// The tools every tool-calling call carries: name, description, the one
/// string property.
pub const TOOLS: [(&str, &str, &str); 3] = [
    (
        "run_query",
        "Run a query against the index and return the matching records.",
        "query",
    ),
    ("read_record", "Read one record of a table by its key.", "key"),
    ("write_record", "Write a value into a record of a table.", "value"),
];

/// One turn of a tool-calling conversation, whatever the API.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    /// A user message.
    User(String),
    /// The engine's text answer.
    Assistant(String),
    /// The engine's tool call: its id, tool and arguments (JSON text).
    Call {
        /// `call_id` / `tool_use` id / `tool_calls[].id`.
        id: String,
        /// The Responses output item's own id (`fc_…`), sent back with it.
        item: Option<String>,
        /// The tool.
        name: String,
        /// The arguments, JSON text.
        arguments: String,
    },
    /// The result of call `id`.
    Result {
        /// The call's id.
        id: String,
        /// The result text.
        output: String,
    },
}

/// What the client read of an answer: the turn it adds to the
/// conversation and the engine's usage.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Reading {
    /// The answer as a turn (`None`: the answer could not be read).
    pub turn: Option<Turn>,
    /// Prompt tokens and, of those, cached ones, as the API's usage says
    /// (`None`: no usage in the answer).
    pub usage: Option<(u64, u64)>,
}

impl AgentsApi {
    /// Its name on the command line and in outputs.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::ChatTools => "chat-tools",
            Self::Responses => "responses",
            Self::Messages => "messages",
        }
    }

    /// The path its calls go to.
    pub const fn path(self) -> &'static str {
        match self {
            Self::Chat | Self::ChatTools => "/v1/chat/completions",
            Self::Responses => "/v1/responses",
            Self::Messages => "/v1/messages",
        }
    }

    /// Whether its calls carry tools and send tool calls back.
    pub const fn tools(self) -> bool {
        !matches!(self, Self::Chat)
    }

    /// The `tools` member of a call.
    fn tools_json(self) -> Value {
        TOOLS
            .iter()
            .map(|(name, description, property)| {
                let schema = json!({
                    "type": "object",
                    "properties": {*property: {"type": "string", "description": format!("The {property}.")}},
                    "required": [property],
                });
                match self {
                    Self::Chat | Self::ChatTools => json!({"type": "function", "function": {
                        "name": name, "description": description, "parameters": schema}}),
                    Self::Responses => {
                        json!({"type": "function", "name": name, "description": description, "parameters": schema})
                    }
                    Self::Messages => json!({"name": name, "description": description, "input_schema": schema}),
                }
            })
            .collect()
    }

    /// The body of a call: `system`, then `turns`, streamed or not,
    /// `max_tokens` long (with `ignore_eos`, `temperature` 1).
    pub fn body(self, system: &str, turns: &[Turn], max_tokens: u32, stream: bool) -> Value {
        let mut body = json!({
            "model": "semlb-sim",
            "stream": stream,
            "ignore_eos": true,
            "temperature": 1.0,
        });
        match self {
            Self::Chat | Self::ChatTools => {
                let mut messages = vec![json!({"role": "system", "content": system})];
                messages.extend(turns.iter().map(|t| match t {
                    Turn::User(text) => json!({"role": "user", "content": text}),
                    Turn::Assistant(text) => json!({"role": "assistant", "content": text}),
                    Turn::Call {
                        id, name, arguments, ..
                    } => json!({"role": "assistant", "content": null,
                        "tool_calls": [{"id": id, "type": "function",
                                        "function": {"name": name, "arguments": arguments}}]}),
                    Turn::Result { id, output } => json!({"role": "tool", "tool_call_id": id, "content": output}),
                }));
                body["messages"] = messages.into();
                body["max_tokens"] = max_tokens.into();
                if stream {
                    body["stream_options"] = json!({"include_usage": true});
                }
            }
            Self::Responses => {
                let input: Vec<Value> = turns
                    .iter()
                    .map(|t| match t {
                        Turn::User(text) => json!({"type": "message", "role": "user", "content": text}),
                        Turn::Assistant(text) => json!({"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": text}]}),
                        // The output item as it came, as the SDKs send it back.
                        Turn::Call {
                            id,
                            item,
                            name,
                            arguments,
                        } => {
                            let mut call = json!({"type": "function_call", "call_id": id, "name": name,
                                                  "arguments": arguments, "status": "completed"});
                            if let Some(item) = item {
                                call["id"] = item.as_str().into();
                            }
                            call
                        }
                        Turn::Result { id, output } => {
                            json!({"type": "function_call_output", "call_id": id, "output": output})
                        }
                    })
                    .collect();
                body["instructions"] = system.into();
                body["input"] = input.into();
                body["max_output_tokens"] = max_tokens.into();
                body["store"] = false.into();
                // smg's Responses type refuses unknown fields: no
                // `ignore_eos` (the answer ends where the engine would end
                // it, at most `max_output_tokens`).
                if let Some(o) = body.as_object_mut() {
                    o.remove("ignore_eos");
                }
            }
            Self::Messages => {
                // Consecutive turns of one role are one message.
                let mut messages: Vec<Value> = Vec::new();
                for t in turns {
                    let (role, block) = match t {
                        Turn::User(text) => ("user", json!({"type": "text", "text": text})),
                        Turn::Assistant(text) => ("assistant", json!({"type": "text", "text": text})),
                        Turn::Call {
                            id, name, arguments, ..
                        } => (
                            "assistant",
                            json!({"type": "tool_use", "id": id, "name": name,
                                   "input": serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| json!({}))}),
                        ),
                        Turn::Result { id, output } => (
                            "user",
                            json!({"type": "tool_result", "tool_use_id": id, "content": output}),
                        ),
                    };
                    match messages.last_mut() {
                        Some(last) if last["role"] == role => {
                            last["content"].as_array_mut().expect("content blocks").push(block);
                        }
                        _ => messages.push(json!({"role": role, "content": [block]})),
                    }
                }
                body["system"] = system.into();
                body["messages"] = messages.into();
                body["max_tokens"] = max_tokens.into();
            }
        }
        if self.tools() {
            body["tools"] = self.tools_json();
        }
        body
    }

    /// What an answer of this API says: `bytes` a JSON body, or the event
    /// stream when `streamed`.
    pub fn read(self, bytes: &[u8], streamed: bool) -> Reading {
        let text = String::from_utf8_lossy(bytes);
        if !streamed {
            return serde_json::from_str::<Value>(&text).map_or_else(|_| Reading::default(), |v| self.read_json(&v));
        }
        let events = sse_events(&text);
        match self {
            Self::Chat | Self::ChatTools => read_chat_stream(&events),
            // The last event carries the whole response.
            Self::Responses => events
                .iter()
                .rev()
                .find(|(name, _)| matches!(name.as_deref(), Some("response.completed" | "response.incomplete")))
                .map_or_else(Reading::default, |(_, data)| self.read_json(&data["response"])),
            Self::Messages => read_messages_stream(&events),
        }
    }

    /// A whole (non-streamed) answer.
    fn read_json(self, v: &Value) -> Reading {
        let u = &v["usage"];
        match self {
            Self::Chat | Self::ChatTools => {
                let message = &v["choices"][0]["message"];
                let turn = match message["tool_calls"].get(0) {
                    Some(call) => call_turn(
                        &call["id"],
                        None,
                        &call["function"]["name"],
                        call["function"]["arguments"].as_str().unwrap_or("{}"),
                    ),
                    None => message["content"].as_str().map(|t| Turn::Assistant(t.to_owned())),
                };
                Reading {
                    turn,
                    usage: chat_usage(u),
                }
            }
            Self::Responses => {
                let mut turn = None;
                for item in v["output"].as_array().into_iter().flatten() {
                    match item["type"].as_str() {
                        Some("function_call") => {
                            turn = call_turn(
                                &item["call_id"],
                                item["id"].as_str(),
                                &item["name"],
                                item["arguments"].as_str().unwrap_or("{}"),
                            );
                        }
                        Some("message") => {
                            let text: String = item["content"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .filter_map(|p| p["text"].as_str())
                                .collect();
                            turn = Some(Turn::Assistant(text));
                        }
                        _ => {}
                    }
                }
                let usage = u["input_tokens"]
                    .as_u64()
                    .map(|p| (p, u["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)));
                Reading { turn, usage }
            }
            Self::Messages => {
                let mut turn = None;
                for block in v["content"].as_array().into_iter().flatten() {
                    match block["type"].as_str() {
                        Some("tool_use") => {
                            turn = call_turn(&block["id"], None, &block["name"], &block["input"].to_string());
                        }
                        Some("text") => turn = block["text"].as_str().map(|t| Turn::Assistant(t.to_owned())),
                        _ => {}
                    }
                }
                Reading {
                    turn,
                    usage: messages_usage(u),
                }
            }
        }
    }
}

/// A tool call turn, if its id and name are strings.
fn call_turn(id: &Value, item: Option<&str>, name: &Value, arguments: &str) -> Option<Turn> {
    Some(Turn::Call {
        id: id.as_str()?.to_owned(),
        item: item.map(str::to_owned),
        name: name.as_str()?.to_owned(),
        arguments: arguments.to_owned(),
    })
}

/// Chat's usage: prompt and cached tokens.
fn chat_usage(u: &Value) -> Option<(u64, u64)> {
    let prompt = u["prompt_tokens"].as_u64()?;
    Some((
        prompt,
        u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
    ))
}

/// Messages' usage: prompt (uncached + cached) and cached tokens.
fn messages_usage(u: &Value) -> Option<(u64, u64)> {
    let uncached = u["input_tokens"].as_u64()?;
    let cached = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
    Some((uncached + cached, cached))
}

/// The events of an SSE stream: each one's `event:` name and `data:`
/// JSON (events whose data is not JSON, `[DONE]` among them, left out).
fn sse_events(text: &str) -> Vec<(Option<String>, Value)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let (mut name, mut data) = (None, String::new());
        for line in block.lines() {
            let line = line.trim_end_matches('\r');
            if let Some(n) = line.strip_prefix("event:") {
                name = Some(n.trim().to_owned());
            } else if let Some(d) = line.strip_prefix("data:") {
                data.push_str(d.trim_start());
            }
        }
        if let Ok(v) = serde_json::from_str::<Value>(&data) {
            out.push((name, v));
        }
    }
    out
}

/// A streamed chat answer: its text or its first tool call, and the usage
/// chunk.
fn read_chat_stream(events: &[(Option<String>, Value)]) -> Reading {
    let (mut text, mut call, mut usage) = (None::<String>, None::<(String, String, String)>, None);
    for (_, v) in events {
        if let Some(u) = chat_usage(&v["usage"]) {
            usage = Some(u);
        }
        let delta = &v["choices"][0]["delta"];
        if let Some(t) = delta["content"].as_str() {
            text.get_or_insert_with(String::new).push_str(t);
        }
        if let Some(c) = delta["tool_calls"].get(0) {
            let entry = call.get_or_insert_with(Default::default);
            if let Some(id) = c["id"].as_str() {
                entry.0 = id.to_owned();
            }
            if let Some(name) = c["function"]["name"].as_str() {
                entry.1 = name.to_owned();
            }
            if let Some(piece) = c["function"]["arguments"].as_str() {
                entry.2.push_str(piece);
            }
        }
    }
    let turn = match call {
        Some((id, name, arguments)) => Some(Turn::Call {
            id,
            item: None,
            name,
            arguments,
        }),
        None => text.map(Turn::Assistant),
    };
    Reading { turn, usage }
}

/// A streamed Messages answer: its block rebuilt from `content_block_start`
/// and the deltas, the prompt tokens from `message_start`.
fn read_messages_stream(events: &[(Option<String>, Value)]) -> Reading {
    let (mut usage, mut turn) = (None, None);
    let mut partial = String::new();
    for (_, v) in events {
        match v["type"].as_str() {
            Some("message_start") => usage = messages_usage(&v["message"]["usage"]),
            Some("content_block_start") => {
                let b = &v["content_block"];
                partial.clear();
                turn = match b["type"].as_str() {
                    Some("tool_use") => call_turn(&b["id"], None, &b["name"], ""),
                    _ => Some(Turn::Assistant(b["text"].as_str().unwrap_or("").to_owned())),
                };
            }
            Some("content_block_delta") => {
                let d = &v["delta"];
                match (&mut turn, d["type"].as_str()) {
                    (Some(Turn::Assistant(text)), Some("text_delta")) => {
                        text.push_str(d["text"].as_str().unwrap_or(""))
                    }
                    (Some(Turn::Call { .. }), Some("input_json_delta")) => {
                        partial.push_str(d["partial_json"].as_str().unwrap_or(""));
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    if let Some(Turn::Call { arguments, .. }) = &mut turn {
        *arguments = if partial.is_empty() { "{}".to_owned() } else { partial };
    }
    Reading { turn, usage }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation() -> Vec<Turn> {
        vec![
            Turn::User("Task 1".into()),
            Turn::Call {
                id: "call_1".into(),
                item: Some("fc_1".into()),
                name: "run_query".into(),
                arguments: r#"{"query":"cache"}"#.into(),
            },
            Turn::Result {
                id: "call_1".into(),
                output: "Tool result 0".into(),
            },
            Turn::Assistant("done".into()),
            Turn::User("next".into()),
        ]
    }

    #[test]
    fn bodies_render_the_conversation_in_each_api() {
        let turns = conversation();
        let chat = AgentsApi::ChatTools.body("sys", &turns, 64, true);
        assert_eq!(chat["messages"].as_array().unwrap().len(), 6);
        assert_eq!(chat["messages"][2]["tool_calls"][0]["function"]["name"], "run_query");
        assert_eq!(chat["messages"][3]["role"], "tool");
        assert_eq!(chat["stream_options"]["include_usage"], true);
        assert_eq!(chat["tools"][0]["function"]["name"], "run_query");
        let plain = AgentsApi::Chat.body("sys", &turns[..1], 64, false);
        assert!(plain.get("tools").is_none() && plain.get("stream_options").is_none());
        let r = AgentsApi::Responses.body("sys", &turns, 64, true);
        assert_eq!(
            (r["instructions"].as_str(), r["store"].as_bool()),
            (Some("sys"), Some(false))
        );
        assert_eq!(r["max_output_tokens"], 64);
        let types: Vec<&str> = r["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            types,
            ["message", "function_call", "function_call_output", "message", "message"]
        );
        assert_eq!(r["tools"][1]["name"], "read_record");
        assert_eq!(
            (r["input"][1]["id"].as_str(), r["input"][1]["status"].as_str()),
            (Some("fc_1"), Some("completed"))
        );
        assert!(r.get("ignore_eos").is_none());
        assert_eq!(AgentsApi::Messages.body("s", &[], 1, false)["ignore_eos"], true);
        let m = AgentsApi::Messages.body("sys", &turns, 64, false);
        let roles: Vec<&str> = m["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["role"].as_str().unwrap())
            .collect();
        // The tool result and the user message after the answer are
        // separate user messages: the text answer lies between them.
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user"]);
        assert_eq!(m["messages"][1]["content"][0]["input"]["query"], "cache");
        assert_eq!(m["messages"][2]["content"][0]["tool_use_id"], "call_1");
        assert_eq!(m["tools"][2]["input_schema"]["required"][0], "value");
    }

    #[test]
    fn answers_are_read_whole_and_streamed() {
        let r = AgentsApi::Responses.read(
            br#"{"output":[{"type":"function_call","call_id":"call_9","name":"run_query","arguments":"{\"query\":\"x\"}"}],
                "usage":{"input_tokens":100,"input_tokens_details":{"cached_tokens":64},"output_tokens":9}}"#,
            false,
        );
        assert_eq!(r.usage, Some((100, 64)));
        assert!(matches!(r.turn, Some(Turn::Call { ref id, .. }) if id == "call_9"));
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\n\
            event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n\
            event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"hi\"}]}],\"usage\":{\"input_tokens\":10,\"input_tokens_details\":{\"cached_tokens\":0}}}}\n\n";
        let r = AgentsApi::Responses.read(stream.as_bytes(), true);
        assert_eq!((r.turn, r.usage), (Some(Turn::Assistant("hi".into())), Some((10, 0))));
        let stream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":30,\"cache_read_input_tokens\":70}}}\n\n\
            event: content_block_start\ndata: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"read_record\",\"input\":{}}}\n\n\
            event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"key\\\":\"}}\n\n\
            event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\\\"a\\\"}\"}}\n\n\
            event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let r = AgentsApi::Messages.read(stream.as_bytes(), true);
        assert_eq!(r.usage, Some((100, 70)));
        assert_eq!(
            r.turn,
            Some(Turn::Call {
                id: "toolu_1".into(),
                item: None,
                name: "read_record".into(),
                arguments: r#"{"key":"a"}"#.into()
            })
        );
        let stream = "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"id\":\"call_2\",\"function\":{\"name\":\"run_query\",\"arguments\":\"\"}}]}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\ndata: [DONE]\n\n";
        let r = AgentsApi::ChatTools.read(stream.as_bytes(), true);
        assert_eq!(r.usage, Some((5, 2)));
        assert!(matches!(r.turn, Some(Turn::Call { ref arguments, .. }) if arguments == "{}"));
    }
}
