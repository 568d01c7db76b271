//! Replaying a cached non-streaming answer as a stream ([`replay`]; a
//! Responses or Messages answer as its API's events:
//! [`crate::openai::agent_streams`]).
//! (Reading the answer text out of a relayed stream is
//! [`crate::openai::answer`]'s.)
//!
//! A replay turns a stored `text_completion` / `chat.completion` JSON body
//! into the chunks an engine would have sent: per choice one chunk with the
//! whole text (chat: with `role: assistant`), then one with its
//! `finish_reason`; a usage chunk when the request has
//! `stream_options.include_usage`; then `data: [DONE]`.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::openai::agent_streams::AgentStream;
use crate::openai::prompt::Endpoint;

fn event(out: &mut Vec<u8>, value: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(value.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// The SSE body replaying the stored JSON `stored` for a streaming request
/// to `endpoint` (ending with a usage chunk if `include_usage`); `None` if
/// `stored` is not a response of that endpoint (then it is treated as a
/// miss).
pub fn replay(endpoint: Endpoint, stored: &[u8], include_usage: bool) -> Option<Bytes> {
    match endpoint {
        Endpoint::Responses => return AgentStream::Responses.replay(stored).map(Bytes::from),
        Endpoint::Messages => return AgentStream::Messages.replay(stored).map(Bytes::from),
        Endpoint::Completions | Endpoint::ChatCompletions => {}
    }
    let v: Value = serde_json::from_slice(stored).ok()?;
    let choices = v.get("choices")?.as_array()?;
    let object = match endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::ChatCompletions => "chat.completion.chunk",
        Endpoint::Responses | Endpoint::Messages => return None,
    };
    let chunk = |choices: Value| {
        let mut c = json!({
            "id": v.get("id").cloned().unwrap_or(Value::Null),
            "object": object,
            "created": v.get("created").cloned().unwrap_or(Value::Null),
            "model": v.get("model").cloned().unwrap_or(Value::Null),
            "choices": choices,
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    let mut out = Vec::with_capacity(stored.len() + 256);
    for (i, choice) in choices.iter().enumerate() {
        let index = choice.get("index").cloned().unwrap_or_else(|| json!(i));
        let finish = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
        let (content, end) = match endpoint {
            Endpoint::Completions => {
                let text = choice.get("text")?.as_str()?;
                (
                    json!({"index": index, "text": text, "logprobs": null, "finish_reason": null}),
                    json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish}),
                )
            }
            Endpoint::ChatCompletions => {
                let message = choice.get("message")?;
                let mut delta = Map::new();
                delta.insert("role".into(), json!("assistant"));
                for (k, val) in message.as_object()? {
                    if k != "role" {
                        delta.insert(k.clone(), val.clone());
                    }
                }
                (
                    json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null}),
                    json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}),
                )
            }
            Endpoint::Responses | Endpoint::Messages => return None,
        };
        event(&mut out, &chunk(Value::Array(vec![content])));
        event(&mut out, &chunk(Value::Array(vec![end])));
    }
    if include_usage {
        let mut c = chunk(Value::Array(Vec::new()));
        c["usage"] = v.get("usage").cloned().unwrap_or(Value::Null);
        event(&mut out, &c);
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(body: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(body).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }

    #[test]
    fn replay_of_a_chat_answer() {
        let stored = br#"{"id":"chatcmpl-1","object":"chat.completion","created":5,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":" hi there"},"finish_reason":"stop"}],
            "usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let body = replay(Endpoint::ChatCompletions, stored, true).unwrap();
        let ev = events(&body);
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[0]["object"], "chat.completion.chunk");
        assert_eq!(ev[0]["choices"][0]["delta"]["content"], " hi there");
        assert_eq!(ev[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(ev[2]["usage"]["completion_tokens"], 2);
        let read = crate::openai::answer::answer_text(crate::openai::answer::AnswerForm::EventStream, &body);
        assert_eq!(
            read.map(|(text, r)| (text, r.completion_tokens)),
            Some((" hi there".to_owned(), Some(2))),
            "a replay reads back as the answer"
        );
        // A completions body is not a chat answer.
        assert!(replay(Endpoint::ChatCompletions, br#"{"choices":[{"text":"x"}]}"#, true).is_none());
    }

    #[test]
    fn replay_of_a_completion_without_usage() {
        let stored = br#"{"id":"cmpl-1","object":"text_completion","created":5,"model":"m",
            "choices":[{"index":0,"text":" a b","finish_reason":"length"}]}"#;
        let body = replay(Endpoint::Completions, stored, false).unwrap();
        let ev = events(&body);
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0]["choices"][0]["text"], " a b");
        assert!(ev[0].get("usage").is_none());
        let read = crate::openai::answer::answer_text(crate::openai::answer::AnswerForm::EventStream, &body);
        assert_eq!(
            read,
            Some((" a b".to_owned(), crate::openai::answer::Reported::default()))
        );
    }
}
