//! The tool call the simulator answers with ([`ToolCall`]): which tool,
//! with what arguments, the assistant message it becomes in the next
//! turn's conversation, and how its arguments are cut into the streamed
//! deltas of its tokens.
//!
//! The arguments are deterministic: `{"<first property>": "<word>"}` with
//! the first property of the tool's `parameters.properties` (in the order
//! the client sent them) and a word drawn from the prompt's seed, or `{}`
//! for a tool without properties. They are written as Python's
//! `json.dumps` writes them (`{"query": "river"}`), which is what vLLM's
//! tool parsers send back.

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

use super::conversation::{Ordered, string, tool_call};

/// One call to a tool.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The call's id as the client sees it (`call_…`, Anthropic's `toolu_…`).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, an object.
    pub arguments: Ordered,
    /// The arguments as JSON text.
    pub arguments_json: String,
}

impl ToolCall {
    /// A call `id` to the tool `function` (`{"name", "parameters", ...}`),
    /// its first property set to `word`.
    pub fn to(function: &Ordered, id: String, word: &str) -> Self {
        let name = function.get("name").and_then(Ordered::as_str).unwrap_or_default();
        let first_property = match function.get("parameters").and_then(|p| p.get("properties")) {
            Some(TemplateValue::Object(properties)) => properties.first().map(|(k, _)| k.to_string()),
            _ => None,
        };
        let arguments = TemplateValue::Object(
            first_property
                .map(|key| (Cow::Owned(key), string(word)))
                .into_iter()
                .collect(),
        );
        Self {
            id,
            name: name.to_owned(),
            arguments_json: arguments.to_json(),
            arguments,
        }
    }

    /// The call as the template gets it in an assistant message.
    pub fn template_value(&self) -> Ordered {
        tool_call(&self.id, &self.name, self.arguments.clone())
    }

    /// The assistant message the call is in the conversation: empty
    /// content, the call in `tool_calls`.
    pub fn message(&self) -> ChatMessage<'static> {
        ChatMessage::new("assistant", "").with("tool_calls", TemplateValue::Array(vec![self.template_value()]))
    }

    /// The call as JSON text, `{"name": ..., "arguments": {...}}`: its
    /// output when the template renders no tool calls.
    pub fn json_text(&self) -> String {
        TemplateValue::Object(vec![
            (Cow::Borrowed("name"), string(&self.name)),
            (Cow::Borrowed("arguments"), self.arguments.clone()),
        ])
        .to_json()
    }

    /// The part of the arguments streamed with token `index` of `tokens`:
    /// the first token names the call (no arguments, unless it is the only
    /// token), the others carry the arguments cut in equal parts (by
    /// characters; some may be empty).
    pub fn piece(&self, index: u32, tokens: u32) -> &str {
        let args = self.arguments_json.as_str();
        if tokens <= 1 {
            return args;
        }
        if index == 0 || index >= tokens {
            return "";
        }
        let parts = u64::from(tokens - 1);
        let chars = args.chars().count() as u64;
        let k = u64::from(index - 1);
        let byte_at = |c: u64| args.char_indices().nth(c as usize).map_or(args.len(), |(i, _)| i);
        &args[byte_at(k * chars / parts)..byte_at((k + 1) * chars / parts)]
    }
}

/// A [`TemplateValue`] serialized as JSON with its keys in order.
#[derive(Debug, Clone, Copy)]
pub struct InOrder<'a>(pub &'a Ordered);

impl Serialize for InOrder<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            TemplateValue::Null => s.serialize_unit(),
            TemplateValue::Bool(b) => s.serialize_bool(*b),
            TemplateValue::Int(i) => match i64::try_from(*i) {
                Ok(small) => s.serialize_i64(small),
                Err(_) => s.serialize_f64(*i as f64),
            },
            TemplateValue::Float(f) => s.serialize_f64(*f),
            TemplateValue::String(text) => s.serialize_str(text),
            TemplateValue::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(&InOrder(item))?;
                }
                seq.end()
            }
            TemplateValue::Object(pairs) => {
                let mut map = s.serialize_map(Some(pairs.len()))?;
                for (k, v) in pairs {
                    map.serialize_entry(&**k, &InOrder(v))?;
                }
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn function(json: &str) -> Ordered {
        TemplateValue::parse(json).unwrap()
    }

    #[test]
    fn the_call_sets_the_first_property() {
        let f = function(r#"{"name":"search","parameters":{"type":"object","properties":{"q":{},"a":{}}}}"#);
        let call = ToolCall::to(&f, "call_1".into(), "river");
        assert_eq!(call.name, "search");
        assert_eq!(call.arguments_json, r#"{"q": "river"}"#);
        assert_eq!(call.json_text(), r#"{"name": "search", "arguments": {"q": "river"}}"#);
        let bare = ToolCall::to(&function(r#"{"name":"now","parameters":null}"#), "c".into(), "x");
        assert_eq!(bare.arguments_json, "{}");
        assert_eq!(
            serde_json::to_string(&InOrder(&bare.template_value())).unwrap(),
            r#"{"id":"c","type":"function","function":{"name":"now","arguments":{}}}"#
        );
    }

    #[test]
    fn pieces_add_up_to_the_arguments() {
        let f = function(r#"{"name":"s","parameters":{"properties":{"query":{}}}}"#);
        let call = ToolCall::to(&f, "c".into(), "é word");
        for tokens in 1..30 {
            let joined: String = (0..tokens).map(|i| call.piece(i, tokens)).collect();
            assert_eq!(joined, call.arguments_json, "{tokens}");
        }
        assert_eq!(call.piece(0, 5), "");
    }

    #[test]
    fn in_order_keeps_key_order() {
        let v = function(r#"{"z":1,"a":[true,null,1.5,"s"]}"#);
        assert_eq!(
            serde_json::to_string(&InOrder(&v)).unwrap(),
            r#"{"z":1,"a":[true,null,1.5,"s"]}"#
        );
    }
}
