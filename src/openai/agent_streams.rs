//! The Responses API's and Anthropic Messages' event streams as the whole
//! answers they stand for, and the other way round: what lets the response
//! cache store a streamed answer of these APIs and replay a stored one to
//! a client that streams ([`crate::openai::answer::stream_as_response`]
//! and the dispatcher's replay do the same for chat and completions).
//!
//! | API | stream → body | body → stream |
//! | --- | --- | --- |
//! | Responses | the `response` of its `response.completed` event (the whole response, usage included) | `response.created`, `response.in_progress`, then per output message `output_item.added`, `content_part.added`, one `output_text.delta` with the whole text, `output_text.done`, `content_part.done`, `output_item.done`, and `response.completed` with the stored body |
//! | Messages | the message of `message_start` with the text of its `text_delta`s as one text block, the `stop_reason` and output tokens of `message_delta` | `message_start`, then per text block `content_block_start`, one `text_delta`, `content_block_stop`, then `message_delta` and `message_stop` |
//!
//! Only answers that are text can be stood for: a stream with tool calls,
//! reasoning or an error, or cut before its last event, gives `None` and
//! is not cached; a stored body with anything but text is not replayed
//! (a miss).

use serde_json::{Map, Value, json};

/// Which API's stream it is, from its first event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentStream {
    /// OpenAI's Responses API.
    Responses,
    /// Anthropic's Messages API.
    Messages,
}

/// The `data:` JSON of each event of `stream` (events whose data is not
/// JSON: `None` for the whole stream).
fn events(stream: &[u8]) -> Option<Vec<Value>> {
    let text = std::str::from_utf8(stream).ok()?;
    text.lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str(d.trim_start()).ok())
        .collect()
}

impl AgentStream {
    /// The API of a stream whose first event is `first` (`None`: chat or
    /// completions).
    pub fn of(stream: &[u8]) -> Option<Self> {
        let head = &stream[..stream.len().min(512)];
        let has = |name: &[u8]| memchr::memmem::find(head, name).is_some();
        if has(b"\"response.created\"") || has(b"\"response.in_progress\"") {
            Some(AgentStream::Responses)
        } else if has(b"\"message_start\"") {
            Some(AgentStream::Messages)
        } else {
            None
        }
    }

    /// The whole answer `stream` stands for, as JSON bytes (see the
    /// [module docs](self)).
    pub fn as_response(self, stream: &[u8]) -> Option<Vec<u8>> {
        let events = events(stream)?;
        let body = match self {
            AgentStream::Responses => responses_body(&events)?,
            AgentStream::Messages => messages_body(&events)?,
        };
        serde_json::to_vec(&body).ok()
    }

    /// The event stream replaying the stored body `stored` (see the
    /// [module docs](self)).
    pub fn replay(self, stored: &[u8]) -> Option<Vec<u8>> {
        let body: Value = serde_json::from_slice(stored).ok()?;
        let mut out = Vec::with_capacity(stored.len() * 2 + 512);
        match self {
            AgentStream::Responses => replay_responses(&body, &mut out)?,
            AgentStream::Messages => replay_messages(&body, &mut out)?,
        }
        Some(out)
    }
}

/// A Responses stream's whole response: its `response.completed`'s, when
/// every output item is a text message.
fn responses_body(events: &[Value]) -> Option<Value> {
    let completed = events.last().filter(|e| e["type"] == "response.completed")?;
    let response = completed.get("response")?;
    text_messages_only(response)?;
    Some(response.clone())
}

/// The texts of a Responses body's output, if every item is a message of
/// `output_text` parts.
fn text_messages_only(response: &Value) -> Option<Vec<(Value, Vec<String>)>> {
    response
        .get("output")?
        .as_array()?
        .iter()
        .map(|item| {
            if item["type"] != "message" {
                return None;
            }
            let parts = item["content"].as_array()?;
            let texts = parts
                .iter()
                .map(|p| {
                    (p["type"] == "output_text")
                        .then(|| p["text"].as_str().map(str::to_owned))
                        .flatten()
                })
                .collect::<Option<Vec<String>>>()?;
            Some((item.clone(), texts))
        })
        .collect()
}

/// A Messages stream's whole message, when its blocks are text.
fn messages_body(events: &[Value]) -> Option<Value> {
    if events.last()?["type"] != "message_stop" {
        return None;
    }
    let mut message = events.first().filter(|e| e["type"] == "message_start")?["message"].clone();
    if !message.is_object() {
        return None;
    }
    if !message["usage"].is_object() {
        message["usage"] = json!({});
    }
    let mut blocks: Vec<String> = Vec::new();
    for e in &events[1..] {
        match e["type"].as_str()? {
            "content_block_start" => {
                if e["content_block"]["type"] != "text" {
                    return None;
                }
                blocks.push(e["content_block"]["text"].as_str().unwrap_or_default().to_owned());
            }
            "content_block_delta" => {
                let delta = &e["delta"];
                if delta["type"] != "text_delta" {
                    return None;
                }
                blocks.last_mut()?.push_str(delta["text"].as_str()?);
            }
            "message_delta" => {
                for (k, v) in e["delta"].as_object()? {
                    message[k] = v.clone();
                }
                if let Some(usage) = e.get("usage").and_then(Value::as_object) {
                    for (k, v) in usage {
                        message["usage"][k] = v.clone();
                    }
                }
            }
            "content_block_stop" | "message_stop" | "ping" => {}
            _ => return None,
        }
    }
    message["content"] = blocks
        .into_iter()
        .map(|text| json!({"type": "text", "text": text}))
        .collect();
    Some(message)
}

/// One named event.
fn event(out: &mut Vec<u8>, name: &str, data: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// The Responses events of a stored text response.
fn replay_responses(body: &Value, out: &mut Vec<u8>) -> Option<()> {
    let items = text_messages_only(body)?;
    let mut sequence = 0u64;
    let mut emit = |out: &mut Vec<u8>, name: &str, mut data: Map<String, Value>| {
        data.insert("type".into(), json!(name));
        data.insert("sequence_number".into(), json!(sequence));
        sequence += 1;
        event(out, name, &Value::Object(data));
    };
    let obj = |v: Value| match v {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    let mut started = body.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    started["usage"] = Value::Null;
    emit(out, "response.created", obj(json!({"response": started})));
    emit(out, "response.in_progress", obj(json!({"response": started})));
    for (i, (item, texts)) in items.iter().enumerate() {
        let id = item["id"].clone();
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        added["content"] = json!([]);
        emit(
            out,
            "response.output_item.added",
            obj(json!({"output_index": i, "item": added})),
        );
        for (j, text) in texts.iter().enumerate() {
            let at = json!({"item_id": id, "output_index": i, "content_index": j});
            let empty = json!({"type": "output_text", "text": "", "annotations": []});
            let part = item["content"][j].clone();
            let with = |extra: Value| {
                let mut m = obj(at.clone());
                m.extend(obj(extra));
                m
            };
            emit(out, "response.content_part.added", with(json!({"part": empty})));
            emit(
                out,
                "response.output_text.delta",
                with(json!({"delta": text, "logprobs": []})),
            );
            emit(
                out,
                "response.output_text.done",
                with(json!({"text": text, "logprobs": []})),
            );
            emit(out, "response.content_part.done", with(json!({"part": part})));
        }
        emit(
            out,
            "response.output_item.done",
            obj(json!({"output_index": i, "item": item})),
        );
    }
    emit(out, "response.completed", obj(json!({"response": body})));
    Some(())
}

/// The Messages events of a stored text message.
fn replay_messages(body: &Value, out: &mut Vec<u8>) -> Option<()> {
    let blocks = body["content"].as_array()?;
    let texts: Vec<&str> = blocks
        .iter()
        .map(|b| (b["type"] == "text").then(|| b["text"].as_str()).flatten())
        .collect::<Option<_>>()?;
    let mut start = body.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["stop_sequence"] = Value::Null;
    event(
        out,
        "message_start",
        &json!({"type": "message_start", "message": start}),
    );
    for (i, text) in texts.iter().enumerate() {
        event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}),
        );
        event(
            out,
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": text}}),
        );
        event(
            out,
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": i}),
        );
    }
    let delta = json!({"type": "message_delta", "delta": {"stop_reason": body["stop_reason"],
        "stop_sequence": body["stop_sequence"]}, "usage": {"output_tokens": body["usage"]["output_tokens"]}});
    event(out, "message_delta", &delta);
    event(out, "message_stop", &json!({"type": "message_stop"}));
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::answer::{AnswerForm, answer_text};

    const RESPONSE: &str = r#"{"id":"resp_1","object":"response","status":"completed","model":"m","output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hello there","annotations":[]}]}],"usage":{"input_tokens":9,"output_tokens":2,"input_tokens_details":{"cached_tokens":0}}}"#;
    const MESSAGE: &str = r#"{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"Bonjour"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":3,"cache_read_input_tokens":0,"output_tokens":1}}"#;

    /// A stored body replayed as a stream stands for the same body again,
    /// and its text and usage read as the body's.
    #[test]
    fn a_body_replays_as_a_stream_that_stands_for_it() {
        for (api, stored) in [(AgentStream::Responses, RESPONSE), (AgentStream::Messages, MESSAGE)] {
            let stream = api.replay(stored.as_bytes()).unwrap();
            assert_eq!(AgentStream::of(&stream), Some(api));
            let back: Value = serde_json::from_slice(&api.as_response(&stream).unwrap()).unwrap();
            let original: Value = serde_json::from_str(stored).unwrap();
            assert_eq!(back, original, "{api:?}");
            assert_eq!(
                answer_text(AnswerForm::EventStream, &stream).map(|(t, r)| (t, r.completion_tokens)),
                answer_text(AnswerForm::Json, stored.as_bytes()).map(|(t, r)| (t, r.completion_tokens)),
            );
        }
    }

    #[test]
    fn tool_calls_and_cut_streams_are_not_stood_for() {
        let call = RESPONSE.replace(
            r#"{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hello there","annotations":[]}]}"#,
            r#"{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}"#,
        );
        assert!(AgentStream::Responses.replay(call.as_bytes()).is_none());
        let stream = AgentStream::Messages.replay(MESSAGE.as_bytes()).unwrap();
        let cut = &stream[..stream.len() - 40];
        assert!(AgentStream::Messages.as_response(cut).is_none());
        let tool = MESSAGE.replace(
            r#"{"type":"text","text":"Bonjour"}"#,
            r#"{"type":"tool_use","id":"t","name":"f","input":{}}"#,
        );
        assert!(AgentStream::Messages.replay(tool.as_bytes()).is_none());
        assert_eq!(AgentStream::of(b"data: {\"choices\":[]}\n\n"), None);
    }
}
