//! A Responses API request's conversation (`POST /v1/responses`): its
//! `instructions` and `input` as the chat messages vLLM renders for it,
//! and its function tools in the chat form ([`super::conversation`]).
//!
//! | Responses | chat message |
//! | --- | --- |
//! | `instructions` | a `system` message, first |
//! | `input` as a string | a `user` message |
//! | a `message` item (or an item with a `role`) | a message of its role, its `input_text` / `output_text` parts joined with `"\n"` |
//! | a `function_call` item | a tool call (`id` its `call_id`) of the assistant message before it, or of a new one |
//! | a `function_call_output` item | a `tool` message (`tool_call_id` its `call_id`) |
//! | a `reasoning` item | the reasoning of the assistant message before it, or of a new one |
//! | other items (built-in tool calls, references) | not text the template renders: left out |
//! | a `function` tool (`name`, `description`, `parameters`, `strict` at the top) | `{"type": "function", "function": {...}}` |
//! | other tools (web search, file search, MCP) | left out (the engine does not render them) |
//!
//! An assistant `message` item fills the text of an assistant message
//! that holds only reasoning, as the model's output list (reasoning, then
//! the message) was one turn. A request with `previous_response_id` is
//! the conversation's continuation on the engine that stored the earlier
//! response; the gateway renders only what the request carries.

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};

use super::body::{Json, Object};
use super::chat::{TEXT_PARTS, set_reasoning};
use super::conversation::{
    Conversation, Wording, call_arguments, function_tool, parts_text, string_field, template_value, tool_list,
};
use super::request_error::{RequestError, check_message_count};

/// Roles a Responses `message` item takes.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// The messages and tools of a Responses body (at most `max_items` input
/// items).
pub(super) fn conversation<'b>(body: &Object<'b>, max_items: usize) -> Result<Conversation<'b>, RequestError> {
    let param = Some("input");
    let mut out = Conversation {
        messages: Vec::new(),
        tools: tools(body)?,
    };
    match body.get("instructions") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => out.messages.push(ChatMessage::new("system", s.clone())),
        Some(v) => {
            return Err(RequestError::new(
                format!("'instructions' must be a string, not {}", v.kind()),
                Some("instructions"),
            ));
        }
    }
    let items = match body.get("input") {
        None | Some(Json::Null) => return Err(RequestError::new("'input' is required", param)),
        Some(Json::String(s)) => {
            out.messages.push(ChatMessage::new("user", s.clone()));
            return Ok(out);
        }
        Some(Json::Array(items)) if items.is_empty() => {
            return Err(RequestError::new("'input' must not be an empty list", param));
        }
        Some(Json::Array(items)) => items,
        Some(v) => {
            return Err(RequestError::new(
                format!("'input' must be a string or a list of items, not {}", v.kind()),
                param,
            ));
        }
    };
    check_message_count(items.len(), max_items, "input")?;
    for (i, item) in items.iter().enumerate() {
        let Json::Object(item) = item else {
            return Err(RequestError::new(
                format!("input[{i}] must be an object, not {}", item.kind()),
                param,
            ));
        };
        let kind = match item.get("type").and_then(Json::as_str) {
            Some(kind) => kind,
            None if item.get("role").is_some() => "message",
            None => return Err(RequestError::new(format!("input[{i}] needs a 'type'"), param)),
        };
        match kind {
            "message" => message(&mut out, i, item)?,
            "function_call" => {
                let (Some(call_id), Some(name)) = (string_field(item, "call_id"), string_field(item, "name")) else {
                    return Err(RequestError::new(
                        format!("input[{i}] (function_call) needs a string 'call_id' and 'name'"),
                        param,
                    ));
                };
                let call = super::conversation::tool_call(
                    call_id.clone(),
                    name.clone(),
                    call_arguments(item.get("arguments")),
                );
                push_call(&mut out, call);
            }
            "function_call_output" => {
                let Some(call_id) = string_field(item, "call_id") else {
                    return Err(RequestError::new(
                        format!("input[{i}] (function_call_output) needs a string 'call_id'"),
                        param,
                    ));
                };
                let output = match item.get("output") {
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(parts)) => parts_text(parts, &TEXT_PARTS, &format!("input[{i}].output"), "input")?,
                    _ => {
                        return Err(RequestError::new(
                            format!("input[{i}].output must be a string or a list of parts"),
                            param,
                        ));
                    }
                };
                out.messages.push(
                    ChatMessage::new("tool", output).with("tool_call_id", TemplateValue::String(call_id.clone())),
                );
            }
            "reasoning" => {
                let first_text = |name| {
                    item.get(name)
                        .and_then(Json::as_array)
                        .and_then(|parts| parts.first())
                        .and_then(Json::as_object)
                        .and_then(|p| string_field(p, "text"))
                        .cloned()
                };
                if let Some(text) = first_text("content").or_else(|| first_text("summary")) {
                    match out.assistant_tail() {
                        Some(tail) if tail.field("reasoning").is_none() => set_reasoning(tail, text),
                        _ => {
                            let mut m = ChatMessage::new("assistant", "");
                            set_reasoning(&mut m, text);
                            out.messages.push(m);
                        }
                    }
                }
            }
            // Built-in tool calls, item references: nothing the template renders.
            _ => {}
        }
    }
    Ok(out)
}

/// A `message` item.
fn message<'b>(out: &mut Conversation<'b>, i: usize, item: &Object<'b>) -> Result<(), RequestError> {
    let param = Some("input");
    let role = match string_field(item, "role") {
        Some(r) if ROLES.contains(&&**r) => r.clone(),
        Some(r) => {
            return Err(RequestError {
                code: Some("invalid_value"),
                ..RequestError::new(
                    format!(
                        "Invalid value for input[{i}].role: '{r}'. Supported values are: 'user', 'assistant', 'system', and 'developer'."
                    ),
                    param,
                )
            });
        }
        None => return Err(RequestError::new(format!("input[{i}].role must be a string"), param)),
    };
    let text = match item.get("content") {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => parts_text(parts, &TEXT_PARTS, &format!("input[{i}].content"), "input")?,
        _ => {
            return Err(RequestError::new(
                format!("input[{i}].content must be a string or a list of parts"),
                param,
            ));
        }
    };
    if role == "assistant"
        && let Some(tail) = out.assistant_tail()
        && tail.content.is_empty()
        && tail.field("tool_calls").is_none()
    {
        tail.content = text;
        return Ok(());
    }
    out.messages.push(ChatMessage::new(role, text));
    Ok(())
}

/// Adds a tool call to the assistant message at the end, or to a new one.
fn push_call<'b>(out: &mut Conversation<'b>, call: TemplateValue<'b>) {
    if let Some(tail) = out.assistant_tail() {
        match tail.fields.iter_mut().find(|(k, _)| k == "tool_calls") {
            Some((_, TemplateValue::Array(calls))) => calls.push(call),
            _ => tail
                .fields
                .push((Cow::Borrowed("tool_calls"), TemplateValue::Array(vec![call]))),
        }
        return;
    }
    out.messages
        .push(ChatMessage::new("assistant", "").with("tool_calls", TemplateValue::Array(vec![call])));
}

/// The request's function tools in the chat form (others left out; 400:
/// a function tool without a name).
fn tools<'b>(body: &Object<'b>) -> Result<Option<Vec<TemplateValue<'b>>>, RequestError> {
    let tools = tool_list(body, Wording::OpenAi, |i, tool| {
        if tool.get("type").and_then(Json::as_str) != Some("function") {
            return Ok(None);
        }
        let Some(name) = string_field(tool, "name") else {
            return Err(RequestError::new(
                format!("tools[{i}].name must be a string"),
                Some("tools"),
            ));
        };
        Ok(Some(function_tool(
            name.clone(),
            tool.get("description"),
            tool.get("parameters").map(template_value),
            tool.get("strict"),
        )))
    })?;
    Ok(tools.filter(|t| !t.is_empty()))
}
