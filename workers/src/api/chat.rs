//! `POST /v1/chat/completions` requests: the messages (content as a string,
//! `null` or text parts) and the request's other fields.

use semlb_tokenizer::chat::ChatMessage;
use serde_json::Value;

use super::fields::{field, opt_limit, opt_string, parse_object, wrong_type};
use super::params::common_params;
use super::{ApiError, GenParams};

/// A validated `POST /v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The messages, content flattened to text (never empty).
    pub messages: Vec<ChatMessage<'static>>,
    /// Generation parameters.
    pub params: GenParams,
}

/// The text of a message's `content`.
fn message_content(index: usize, value: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match value {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let part_param = format!("{param}[{j}]");
                let Value::Object(part) = part else {
                    return Err(wrong_type(&part_param, "an object", part));
                };
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => {}
                    Some(other) => {
                        return Err(ApiError::bad_request(
                            format!("Content parts of type `{other}` are not supported; only `text`"),
                            Some(&part_param),
                        ));
                    }
                    None => {
                        return Err(ApiError::bad_request(
                            format!("`{part_param}.type` is required and must be a string"),
                            Some(&part_param),
                        ));
                    }
                }
                match part.get("text") {
                    Some(Value::String(t)) => texts.push(t.as_str()),
                    Some(other) => return Err(wrong_type(&format!("{part_param}.text"), "a string", other)),
                    None => {
                        return Err(ApiError::bad_request(
                            format!("`{part_param}.text` is required"),
                            Some(&part_param),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(wrong_type(&param, "a string or an array of content parts", other)),
    }
}

impl ChatRequest {
    /// Parses and validates a request body.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let items = match field(&obj, "messages") {
            None => return Err(ApiError::bad_request("`messages` is required", Some("messages"))),
            Some(Value::Array(items)) if items.is_empty() => {
                return Err(ApiError::bad_request("`messages` must not be empty", Some("messages")));
            }
            Some(Value::Array(items)) => items,
            Some(other) => return Err(wrong_type("messages", "an array", other)),
        };
        let mut messages = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let Value::Object(message) = item else {
                return Err(wrong_type(&format!("messages[{i}]"), "an object", item));
            };
            let role = match message.get("role") {
                Some(Value::String(role)) if !role.is_empty() => role.clone(),
                Some(Value::String(_)) | None => {
                    let param = format!("messages[{i}].role");
                    return Err(ApiError::bad_request(format!("`{param}` is required"), Some(&param)));
                }
                Some(other) => return Err(wrong_type(&format!("messages[{i}].role"), "a string", other)),
            };
            let content = message_content(i, field(message, "content"))?;
            messages.push(ChatMessage::new(role, content));
        }
        match field(&obj, "logprobs") {
            None | Some(Value::Bool(_)) => {}
            Some(other) => return Err(wrong_type("logprobs", "a boolean", other)),
        }
        let max_tokens = opt_limit(&obj, "max_tokens")?;
        let max_completion_tokens = opt_limit(&obj, "max_completion_tokens")?;
        let params = common_params(&obj, max_completion_tokens.or(max_tokens))?;
        Ok(Self {
            model,
            messages,
            params,
        })
    }
}
