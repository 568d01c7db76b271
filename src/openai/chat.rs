//! A chat completions request's conversation: its `messages` (roles
//! checked as OpenAI checks them, content as text, tool calls, tool
//! results, reasoning) and its `tools`, as the chat template is given
//! them ([`super::conversation`]).

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};

use super::body::{Json, Object};
use super::conversation::{
    Conversation, Wording, call_arguments, function_tool, parts_text, string_field, template_value, tool_list,
};
use super::request_error::RequestError;

/// The chat roles OpenAI's API takes; any other is a 400 `invalid_value`.
pub(super) const CHAT_ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "function"];

/// Content part types whose `text` is text to the template (vLLM's).
pub(super) const TEXT_PARTS: [&str; 5] = ["text", "input_text", "output_text", "refusal", "thinking"];

/// A message's text: its `content` string (borrowed), its text parts
/// joined with `"\n"`, or empty.
pub(super) fn message_text<'b>(i: usize, content: Option<&Json<'b>>) -> Result<Cow<'b, str>, RequestError> {
    let param = Some("messages");
    match content {
        None | Some(Json::Null) => Ok(Cow::Borrowed("")),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => parts_text(parts, &TEXT_PARTS, &format!("messages[{i}].content"), "messages"),
        Some(v) => Err(RequestError::new(
            format!(
                "messages[{i}].content must be a string, a list of parts or null, not {}",
                v.kind()
            ),
            param,
        )),
    }
}

/// The messages and tools of a chat completions body (at most
/// `max_messages` messages).
pub(super) fn conversation<'b>(body: &Object<'b>, max_messages: usize) -> Result<Conversation<'b>, RequestError> {
    let param = Some("messages");
    let messages = match body.get("messages") {
        None | Some(Json::Null) => return Err(RequestError::new("'messages' is required", param)),
        Some(Json::Array(m)) if m.is_empty() => {
            return Err(RequestError::new("'messages' must not be empty", param));
        }
        Some(Json::Array(m)) => m,
        Some(v) => {
            return Err(RequestError::new(
                format!("'messages' must be a list, not {}", v.kind()),
                param,
            ));
        }
    };
    super::request_error::check_message_count(messages.len(), max_messages, "messages")?;
    let mut out = Conversation {
        messages: Vec::with_capacity(messages.len()),
        tools: tools(body)?,
    };
    for (i, m) in messages.iter().enumerate() {
        let Json::Object(m) = m else {
            return Err(RequestError::new(
                format!("messages[{i}] must be an object, not {}", m.kind()),
                param,
            ));
        };
        let role = match m.get("role") {
            Some(Json::String(r)) if CHAT_ROLES.contains(&&**r) => r,
            Some(Json::String(r)) if !r.is_empty() => {
                // OpenAI's answer to an unknown role (engines that take any
                // role would render it into a prompt no model was trained on).
                return Err(RequestError {
                    code: Some("invalid_value"),
                    ..RequestError::new(
                        format!(
                            "Invalid value for messages[{i}].role: '{r}'. Supported values are: 'system', 'assistant', 'user', 'function', 'tool', and 'developer'."
                        ),
                        param,
                    )
                });
            }
            _ => {
                return Err(RequestError::new(
                    format!("messages[{i}].role must be a non-empty string"),
                    param,
                ));
            }
        };
        let mut message = ChatMessage::new(role.clone(), message_text(i, m.get("content"))?);
        if &**role == "assistant"
            && let Some(calls) = tool_calls(i, m.get("tool_calls"))?
        {
            message = message.with("tool_calls", calls);
        }
        if &**role == "tool"
            && let Some(id) = string_field(m, "tool_call_id")
        {
            message = message.with("tool_call_id", TemplateValue::String(id.clone()));
        }
        if let Some(name) = string_field(m, "name") {
            message = message.with("name", TemplateValue::String(name.clone()));
        }
        if &**role == "assistant"
            && let Some(reasoning) = string_field(m, "reasoning").or_else(|| string_field(m, "reasoning_content"))
        {
            set_reasoning(&mut message, reasoning.clone());
        }
        out.messages.push(message);
    }
    Ok(out)
}

/// Gives `message` its reasoning, under both names vLLM gives it.
pub(super) fn set_reasoning<'b>(message: &mut ChatMessage<'b>, reasoning: Cow<'b, str>) {
    message
        .fields
        .retain(|(k, _)| k != "reasoning" && k != "reasoning_content");
    message
        .fields
        .push((Cow::Borrowed("reasoning"), TemplateValue::String(reasoning.clone())));
    message
        .fields
        .push((Cow::Borrowed("reasoning_content"), TemplateValue::String(reasoning)));
}

/// An assistant message's `tool_calls`, each as the client sent it with
/// its arguments parsed (`None`: none, or an empty list, which vLLM drops).
fn tool_calls<'b>(i: usize, calls: Option<&Json<'b>>) -> Result<Option<TemplateValue<'b>>, RequestError> {
    let param = Some("messages");
    let calls = match calls {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(calls)) if calls.is_empty() => return Ok(None),
        Some(Json::Array(calls)) => calls,
        Some(v) => {
            return Err(RequestError::new(
                format!("messages[{i}].tool_calls must be a list, not {}", v.kind()),
                param,
            ));
        }
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let Json::Object(call) = call else {
            return Err(RequestError::new(
                format!("messages[{i}].tool_calls[{j}] must be an object"),
                param,
            ));
        };
        let Some(Json::Object(function)) = call.get("function") else {
            return Err(RequestError::new(
                format!("messages[{i}].tool_calls[{j}].function must be an object"),
                param,
            ));
        };
        if string_field(function, "name").is_none() {
            return Err(RequestError::new(
                format!("messages[{i}].tool_calls[{j}].function.name must be a string"),
                param,
            ));
        }
        let TemplateValue::Object(mut pairs) = template_value(&Json::Object(call.clone())) else {
            unreachable!("an object's value is an object")
        };
        for (k, v) in pairs.iter_mut() {
            if k == "function"
                && let TemplateValue::Object(fields) = v
            {
                let arguments = call_arguments(function.get("arguments"));
                match fields.iter_mut().find(|(k, _)| k == "arguments") {
                    Some(slot) => slot.1 = arguments,
                    None => fields.push((Cow::Borrowed("arguments"), arguments)),
                }
            }
        }
        out.push(TemplateValue::Object(pairs));
    }
    Ok(Some(TemplateValue::Array(out)))
}

/// The request's `tools`, as `{"type": "function", "function": {...}}`
/// model dumps (`None`: no tools; 400: a malformed tool).
fn tools<'b>(body: &Object<'b>) -> Result<Option<Vec<TemplateValue<'b>>>, RequestError> {
    let param = Some("tools");
    tool_list(body, Wording::OpenAi, |i, tool| {
        let function = Some(tool)
            .filter(|t| t.get("type").and_then(Json::as_str).is_none_or(|t| t == "function"))
            .and_then(|t| t.get("function"))
            .and_then(Json::as_object);
        let Some(function) = function else {
            return Err(RequestError::new(
                format!("tools[{i}] must be an object of type 'function' with a 'function' object"),
                param,
            ));
        };
        let Some(name) = string_field(function, "name") else {
            return Err(RequestError::new(
                format!("tools[{i}].function.name must be a string"),
                param,
            ));
        };
        Ok(Some(function_tool(
            name.clone(),
            function.get("description"),
            function.get("parameters").map(template_value),
            function.get("strict"),
        )))
    })
}
