//! A resumed attempt's events made part of the answer the client is
//! reading ([`Splice`]): every chunk carries the first attempt's `id`,
//! `created` and `model`; the new attempt's opening chunk (the
//! assistant's role, no text) is dropped, the client has it; its usage
//! counts the text it was given to continue as completion, not prompt.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::events;
use super::sent::Summary;

/// Rewrites a resumed attempt's events (see the module docs).
#[derive(Debug)]
pub(super) struct Splice {
    names: [(&'static str, Option<Value>); 3],
    /// Tokens of the text the attempt continued (in its prompt).
    carried: u64,
}

impl Splice {
    /// For an attempt continuing `summary`'s text, `carried` tokens long.
    pub(super) fn new(summary: &Summary, carried: u64) -> Self {
        Self {
            names: [
                ("id", summary.id.clone()),
                ("created", summary.created.clone()),
                ("model", summary.model.clone()),
            ],
            carried,
        }
    }

    /// The events of `data` (whole events) as the client is to get them.
    pub(super) fn rewrite(&self, data: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(data.len() + 64);
        for line in events::split(data) {
            let chunk = events::data_json(line).and_then(|json| serde_json::from_slice::<Value>(json).ok());
            let Some(mut chunk) = chunk else {
                // `[DONE]`, comments and other fields as they came.
                out.extend_from_slice(line);
                out.extend_from_slice(if line.starts_with(b"data:") { b"\n\n" } else { b"\n" });
                continue;
            };
            if let Some(obj) = chunk.as_object_mut() {
                if opens_the_answer(obj) {
                    continue;
                }
                for (name, value) in &self.names {
                    if let Some(value) = value.as_ref().filter(|_| obj.contains_key(*name)) {
                        obj.insert((*name).to_owned(), value.clone());
                    }
                }
                if let Some(usage) = obj.get_mut("usage").and_then(Value::as_object_mut) {
                    self.move_carried(usage);
                }
            }
            out.extend_from_slice(b"data: ");
            // A parsed value writes back.
            serde_json::to_writer(&mut out, &chunk).unwrap_or_default();
            out.extend_from_slice(b"\n\n");
        }
        Bytes::from(out)
    }

    /// The usage of the whole answer: the carried text is output, not
    /// prompt (the cached tokens at most the prompt).
    fn move_carried(&self, usage: &mut Map<String, Value>) {
        let get = |usage: &Map<String, Value>, key: &str| usage.get(key).and_then(Value::as_u64);
        let (Some(prompt), Some(completion)) = (get(usage, "prompt_tokens"), get(usage, "completion_tokens")) else {
            return;
        };
        let prompt = prompt.saturating_sub(self.carried);
        let completion = completion + self.carried;
        usage.insert("prompt_tokens".into(), prompt.into());
        usage.insert("completion_tokens".into(), completion.into());
        if usage.contains_key("total_tokens") {
            usage.insert("total_tokens".into(), (prompt + completion).into());
        }
        if let Some(details) = usage.get_mut("prompt_tokens_details").and_then(Value::as_object_mut)
            && let Some(cached) = details.get("cached_tokens").and_then(Value::as_u64)
        {
            details.insert("cached_tokens".into(), cached.min(prompt).into());
        }
    }
}

/// Whether `chunk` is an answer's opening chunk: the assistant's role
/// with no text, no call and no finish.
fn opens_the_answer(chunk: &Map<String, Value>) -> bool {
    let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
        return false;
    };
    let Some(delta) = choice.get("delta").and_then(Value::as_object) else {
        return false;
    };
    let empty = |key: &str| delta.get(key).is_none_or(|v| v.is_null() || v.as_str() == Some(""));
    delta.contains_key("role")
        && empty("content")
        && empty("reasoning_content")
        && delta.get("tool_calls").is_none_or(Value::is_null)
        && choice.get("finish_reason").is_none_or(Value::is_null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_attempt_reads_as_the_first_answer() {
        let summary = Summary {
            id: Some("chatcmpl-first".into()),
            created: Some(100.into()),
            model: Some("m".into()),
            ..Summary::default()
        };
        let splice = Splice::new(&summary, 3);
        let data = concat!(
            "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" on\"},\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"chatcmpl-2\",\"created\":200,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":23,\"completion_tokens\":5,\"total_tokens\":28,\"prompt_tokens_details\":{\"cached_tokens\":22}}}\n\n",
            "data: [DONE]\n\n"
        );
        let out = splice.rewrite(data.as_bytes());
        let text = std::str::from_utf8(&out).unwrap();
        let chunks: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(chunks.len(), 3, "{text}");
        let first: Value = serde_json::from_str(chunks[0].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(first["id"], "chatcmpl-first");
        assert_eq!(first["created"], 100);
        assert_eq!(first["choices"][0]["delta"]["content"], " on");
        let usage: Value = serde_json::from_str(chunks[1].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens"], 20);
        assert_eq!(usage["usage"]["completion_tokens"], 8);
        assert_eq!(usage["usage"]["total_tokens"], 28);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 20);
        assert_eq!(chunks[2], "data: [DONE]");
    }
}
