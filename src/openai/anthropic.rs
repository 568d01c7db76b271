//! Anthropic's Messages API (`POST /v1/messages`): a request's conversation
//! as the chat messages vLLM renders for it ([`super::conversation`]), and
//! errors in Anthropic's shape.
//!
//! | Messages | chat message |
//! | --- | --- |
//! | `system` (a string, or text blocks joined with nothing between) | a `system` message, first |
//! | a `text` block | text (a message's text blocks joined with `"\n"`) |
//! | an `image` or `document` block | not text: left out |
//! | an assistant's `thinking` block | its reasoning |
//! | an assistant's `tool_use` block (`id`, `name`, `input`) | a tool call, `input` as its arguments |
//! | a user's `tool_result` block (`tool_use_id`, `content`) | a `tool` message before the user's text |
//! | a tool (`name`, `description`, `input_schema`) | `{"type": "function", "function": {"name", "description", "parameters": input_schema}}` |
//! | a server tool (no `input_schema`: web search, bash, ...) | left out |
//!
//! `max_tokens` is required, as Anthropic requires it.

use std::borrow::Cow;

use http::StatusCode;
use semlb_tokenizer::chat::{ChatMessage, TemplateValue};
use serde_json::{Value, json};

use super::body::{Json, Object};
use super::chat::set_reasoning;
use super::conversation::{
    Conversation, Wording, call_arguments, function_tool, string_field, template_value, tool_call, tool_list,
};
use super::request_error::{RequestError, check_message_count};

/// System blocks vLLM drops (Claude Code's billing line, which changes
/// with every request and is no prompt).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The messages and tools of a Messages body (at most `max_messages`).
pub(super) fn conversation<'b>(body: &Object<'b>, max_messages: usize) -> Result<Conversation<'b>, RequestError> {
    let param = Some("messages");
    match body.get("max_tokens") {
        Some(Json::Number(_)) => {}
        None | Some(Json::Null) => return Err(RequestError::new("max_tokens: Field required", Some("max_tokens"))),
        Some(v) => {
            return Err(RequestError::new(
                format!("max_tokens: must be an integer, not {}", v.kind()),
                Some("max_tokens"),
            ));
        }
    }
    let mut out = Conversation {
        messages: Vec::new(),
        tools: tools(body)?,
    };
    match body.get("system") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => out.messages.push(ChatMessage::new("system", s.clone())),
        Some(Json::Array(blocks)) => {
            let mut text = String::new();
            for (i, block) in blocks.iter().enumerate() {
                match block.as_object().and_then(|b| string_field(b, "text")) {
                    Some(t) if t.starts_with(BILLING_HEADER) => {}
                    Some(t) => text.push_str(t),
                    None => {
                        return Err(RequestError::new(
                            format!("system[{i}] must be a text block"),
                            Some("system"),
                        ));
                    }
                }
            }
            out.messages.push(ChatMessage::new("system", text));
        }
        Some(v) => {
            return Err(RequestError::new(
                format!("system: must be a string or a list of text blocks, not {}", v.kind()),
                Some("system"),
            ));
        }
    }
    let messages = match body.get("messages") {
        Some(Json::Array(m)) if !m.is_empty() => m,
        Some(Json::Array(_)) => return Err(RequestError::new("messages: at least one message is required", param)),
        None | Some(Json::Null) => return Err(RequestError::new("messages: Field required", param)),
        Some(v) => {
            return Err(RequestError::new(
                format!("messages: must be a list, not {}", v.kind()),
                param,
            ));
        }
    };
    check_message_count(messages.len(), max_messages, "messages")?;
    for (i, m) in messages.iter().enumerate() {
        let Some(m) = m.as_object() else {
            return Err(RequestError::new(format!("messages.{i}: must be an object"), param));
        };
        let role: &'static str = match string_field(m, "role").map(|r| &**r) {
            Some("user") => "user",
            Some("assistant") => "assistant",
            Some(r) => {
                return Err(RequestError::new(
                    format!("messages.{i}.role: Input should be 'user' or 'assistant', not '{r}'"),
                    param,
                ));
            }
            None => return Err(RequestError::new(format!("messages.{i}.role: Field required"), param)),
        };
        match m.get("content") {
            Some(Json::String(s)) => out.messages.push(ChatMessage::new(role, s.clone())),
            Some(Json::Array(blocks)) => blocks_message(&mut out, i, role, blocks)?,
            _ => {
                return Err(RequestError::new(
                    format!("messages.{i}.content: must be a string or a list of content blocks"),
                    param,
                ));
            }
        }
    }
    Ok(out)
}

/// A message given as content blocks.
fn blocks_message<'b>(
    out: &mut Conversation<'b>,
    i: usize,
    role: &'static str,
    blocks: &[Json<'b>],
) -> Result<(), RequestError> {
    let param = Some("messages");
    let mut texts: Vec<Cow<'b, str>> = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning: Option<Cow<'b, str>> = None;
    let mut tool_results = false;
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("messages.{i}.content.{j}");
        let Some(block) = block.as_object() else {
            return Err(RequestError::new(format!("{at}: must be an object"), param));
        };
        match block.get("type").and_then(Json::as_str) {
            Some("text") => match string_field(block, "text") {
                Some(t) => texts.push(t.clone()),
                None => return Err(RequestError::new(format!("{at}.text: Field required"), param)),
            },
            Some("thinking") if role == "assistant" => {
                if let Some(t) = string_field(block, "thinking") {
                    reasoning = Some(match reasoning.take() {
                        Some(r) => Cow::Owned(format!("{r}{t}")),
                        None => t.clone(),
                    });
                }
            }
            Some("tool_use") if role == "assistant" => {
                let (Some(id), Some(name)) = (string_field(block, "id"), string_field(block, "name")) else {
                    return Err(RequestError::new(
                        format!("{at}: tool_use needs a string 'id' and 'name'"),
                        param,
                    ));
                };
                calls.push(tool_call(id.clone(), name.clone(), call_arguments(block.get("input"))));
            }
            Some("tool_result") if role == "user" => {
                let Some(id) = string_field(block, "tool_use_id") else {
                    return Err(RequestError::new(format!("{at}.tool_use_id: Field required"), param));
                };
                let text = match block.get("content") {
                    None | Some(Json::Null) => Cow::Borrowed(""),
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(parts)) => {
                        let texts: Vec<&str> = parts
                            .iter()
                            .filter_map(Json::as_object)
                            .filter(|p| p.get("type").and_then(Json::as_str) == Some("text"))
                            .filter_map(|p| string_field(p, "text").map(|t| &**t))
                            .collect();
                        Cow::Owned(texts.join("\n"))
                    }
                    Some(v) => {
                        return Err(RequestError::new(
                            format!("{at}.content: must be a string or a list of blocks, not {}", v.kind()),
                            param,
                        ));
                    }
                };
                out.messages
                    .push(ChatMessage::new("tool", text).with("tool_call_id", TemplateValue::String(id.clone())));
                tool_results = true;
            }
            Some(_) => {} // images, documents, redacted thinking, server tool blocks
            None => return Err(RequestError::new(format!("{at}.type: Field required"), param)),
        }
    }
    if tool_results && texts.is_empty() {
        return Ok(());
    }
    let text = match texts.len() {
        0 => Cow::Borrowed(""),
        1 => texts.pop().unwrap_or_default(),
        _ => Cow::Owned(texts.join("\n")),
    };
    let mut message = ChatMessage::new(role, text);
    if let Some(r) = reasoning {
        set_reasoning(&mut message, r);
    }
    if !calls.is_empty() {
        message = message.with("tool_calls", TemplateValue::Array(calls));
    }
    out.messages.push(message);
    Ok(())
}

/// The request's client tools in the chat form (server tools left out).
fn tools<'b>(body: &Object<'b>) -> Result<Option<Vec<TemplateValue<'b>>>, RequestError> {
    let tools = tool_list(body, Wording::Anthropic, |i, tool| {
        let Some(schema) = tool.get("input_schema") else {
            return Ok(None); // a server tool
        };
        let Some(name) = string_field(tool, "name") else {
            return Err(RequestError::new(
                format!("tools.{i}.name: Field required"),
                Some("tools"),
            ));
        };
        let mut parameters = template_value(schema);
        if let TemplateValue::Object(pairs) = &mut parameters
            && !pairs.iter().any(|(k, _)| k == "type")
        {
            pairs.insert(
                0,
                (Cow::Borrowed("type"), TemplateValue::String(Cow::Borrowed("object"))),
            );
        }
        Ok(Some(function_tool(
            name.clone(),
            tool.get("description"),
            Some(parameters),
            None,
        )))
    })?;
    Ok(tools.filter(|t| !t.is_empty()))
}

/// Anthropic's error type for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 409 | 422 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An error body in Anthropic's shape, `{"type": "error", "error": {"type",
/// "message"}}`, for an error the gateway answers with `status`, from the
/// OpenAI-shaped body it would have sent (its `error.message`).
pub fn error_body(status: StatusCode, openai: &Value) -> Value {
    let message = openai
        .get("error")
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("error"));
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}
