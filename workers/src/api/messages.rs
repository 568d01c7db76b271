//! `POST /v1/messages` requests (Anthropic's Messages API, as vLLM serves
//! it): the conversation as chat messages, the tools in the chat form.
//!
//! | Messages | chat message |
//! | --- | --- |
//! | `system` (a string, or text blocks joined with nothing between; blocks starting with `x-anthropic-billing-header` dropped) | a `system` message, first |
//! | `text` blocks | the message's text, joined with `"\n"` |
//! | `image`, `document` and other blocks | left out |
//! | an assistant's `thinking` block | its reasoning |
//! | an assistant's `tool_use` block (`id`, `name`, `input`) | a tool call, `input` as its arguments |
//! | a user's `tool_result` block (`tool_use_id`, `content`: a string or text blocks joined with `"\n"`) | a `tool` message with `tool_call_id`, before the user's text (no user message when it held only tool results) |
//! | a tool (`name`, `description`, `input_schema`) | `{"type": "function", "function": {"name", "description", "parameters": input_schema}}`, `"type": "object"` put first in a schema without a `type` |
//! | a tool without `input_schema` (a server tool) | left out |
//!
//! `max_tokens` is required (an integer ≥ 1), as Anthropic requires it;
//! `tool_choice` `{"type": "none"}` forbids tool calls, `{"type": "tool",
//! "name"}` names the tool. `metadata`, `stop_sequences`, `temperature`,
//! `top_p`, `top_k` are accepted and ignored.

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};

use super::conversation::{
    Conversation, Ordered, ToolChoice, call_arguments, function_tool, get, not_a, ordered_body, set_reasoning, string,
    string_field, tool_call, tool_list,
};
use super::fields::{opt_limit, opt_string, parse_object};
use super::params::common_params;
use super::{ApiError, Ending, GenParams};

/// System blocks vLLM drops (a billing line that changes with every request).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// A validated `POST /v1/messages` request.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The messages, tools and tool choice.
    pub conversation: Conversation,
    /// Generation parameters.
    pub params: GenParams,
}

impl MessagesRequest {
    /// Parses and validates a request body.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let Some(max_tokens) = opt_limit(&obj, "max_tokens")? else {
            return Err(ApiError::bad_request("`max_tokens` is required", Some("max_tokens")));
        };
        let params = common_params(&obj, Some(max_tokens))?;
        let ordered = ordered_body(body)?;
        let mut conversation = Conversation {
            messages: Vec::new(),
            tools: tools(&ordered)?,
            tool_choice: tool_choice(&ordered)?,
            ending: Ending::Generation,
        };
        if let Some(system) = system(&ordered)? {
            conversation.messages.push(ChatMessage::new("system", system));
        }
        let messages = match get(&ordered, "messages") {
            None => return Err(ApiError::bad_request("`messages` is required", Some("messages"))),
            Some(TemplateValue::Array(m)) if m.is_empty() => {
                return Err(ApiError::bad_request("`messages` must not be empty", Some("messages")));
            }
            Some(TemplateValue::Array(m)) => m,
            Some(other) => return Err(not_a("messages", "an array", other)),
        };
        for (i, m) in messages.iter().enumerate() {
            message(&mut conversation, i, m)?;
        }
        Ok(Self {
            model,
            conversation,
            params,
        })
    }
}

/// The `system` prompt, if any.
fn system(body: &Ordered) -> Result<Option<String>, ApiError> {
    match get(body, "system") {
        None => Ok(None),
        Some(TemplateValue::String(s)) => Ok(Some(s.to_string())),
        Some(TemplateValue::Array(blocks)) => {
            let mut text = String::new();
            for (i, block) in blocks.iter().enumerate() {
                match string_field(block, "text") {
                    Some(t) if t.starts_with(BILLING_HEADER) => {}
                    Some(t) => text.push_str(t),
                    None => {
                        let p = format!("system[{i}]");
                        return Err(ApiError::bad_request(format!("`{p}` must be a text block"), Some(&p)));
                    }
                }
            }
            Ok(Some(text))
        }
        Some(other) => Err(not_a("system", "a string or an array of text blocks", other)),
    }
}

/// One message of `messages`.
fn message(out: &mut Conversation, i: usize, m: &Ordered) -> Result<(), ApiError> {
    let param = format!("messages[{i}]");
    if !matches!(m, TemplateValue::Object(_)) {
        return Err(not_a(&param, "an object", m));
    }
    let role = match m.get("role") {
        Some(TemplateValue::String(r)) if r == "user" || r == "assistant" => r.to_string(),
        Some(_) | None => {
            let p = format!("{param}.role");
            return Err(ApiError::bad_request(
                format!("`{p}` must be `user` or `assistant`"),
                Some(&p),
            ));
        }
    };
    match m.get("content") {
        Some(TemplateValue::String(s)) => {
            out.messages.push(ChatMessage::new(role, s.to_string()));
            Ok(())
        }
        Some(TemplateValue::Array(blocks)) => blocks_message(out, &param, &role, blocks),
        Some(other) => Err(not_a(
            &format!("{param}.content"),
            "a string or an array of content blocks",
            other,
        )),
        None => {
            let p = format!("{param}.content");
            Err(ApiError::bad_request(format!("`{p}` is required"), Some(&p)))
        }
    }
}

/// A required string field of a block.
fn required(block: &Ordered, at: &str, key: &str) -> Result<String, ApiError> {
    match block.get(key) {
        Some(TemplateValue::String(s)) => Ok(s.to_string()),
        _ => {
            let p = format!("{at}.{key}");
            Err(ApiError::bad_request(format!("`{p}` must be a string"), Some(&p)))
        }
    }
}

/// A message given as content blocks.
fn blocks_message(out: &mut Conversation, param: &str, role: &str, blocks: &[Ordered]) -> Result<(), ApiError> {
    let mut texts: Vec<String> = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning: Option<String> = None;
    let mut tool_results = false;
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{param}.content[{j}]");
        if !matches!(block, TemplateValue::Object(_)) {
            return Err(not_a(&at, "an object", block));
        }
        match string_field(block, "type") {
            Some("text") => texts.push(required(block, &at, "text")?),
            Some("thinking") if role == "assistant" => {
                if let Some(t) = string_field(block, "thinking") {
                    reasoning.get_or_insert_with(String::new).push_str(t);
                }
            }
            Some("tool_use") if role == "assistant" => {
                let id = required(block, &at, "id")?;
                let name = required(block, &at, "name")?;
                calls.push(tool_call(&id, &name, call_arguments(block.get("input"))));
            }
            Some("tool_result") if role == "user" => {
                let id = required(block, &at, "tool_use_id")?;
                let text = match get(block, "content") {
                    None => String::new(),
                    Some(TemplateValue::String(s)) => s.to_string(),
                    Some(TemplateValue::Array(parts)) => parts
                        .iter()
                        .filter(|p| string_field(p, "type") == Some("text"))
                        .filter_map(|p| string_field(p, "text"))
                        .collect::<Vec<_>>()
                        .join("\n"),
                    Some(other) => return Err(not_a(&format!("{at}.content"), "a string or an array", other)),
                };
                out.messages
                    .push(ChatMessage::new("tool", text).with("tool_call_id", string(&id)));
                tool_results = true;
            }
            Some(_) => {} // images, documents, redacted thinking, server tool blocks
            None => {
                let p = format!("{at}.type");
                return Err(ApiError::bad_request(format!("`{p}` is required"), Some(&p)));
            }
        }
    }
    if tool_results && texts.is_empty() {
        return Ok(());
    }
    let mut message = ChatMessage::new(role.to_owned(), texts.join("\n"));
    if let Some(r) = reasoning {
        set_reasoning(&mut message, &r);
    }
    if !calls.is_empty() {
        message = message.with("tool_calls", TemplateValue::Array(calls));
    }
    out.messages.push(message);
    Ok(())
}

/// The request's client tools in the chat form (server tools left out).
fn tools(body: &Ordered) -> Result<Option<Vec<Ordered>>, ApiError> {
    let tools = tool_list(body, |tool, param| {
        let Some(schema) = tool.get("input_schema") else {
            return Ok(None); // a server tool
        };
        let Some(name) = string_field(tool, "name") else {
            let p = format!("{param}.name");
            return Err(ApiError::bad_request(format!("`{p}` must be a string"), Some(&p)));
        };
        let mut parameters = schema.clone();
        if let TemplateValue::Object(pairs) = &mut parameters
            && !pairs.iter().any(|(k, _)| k == "type")
        {
            pairs.insert(0, (Cow::Borrowed("type"), string("object")));
        }
        Ok(Some(function_tool(
            name,
            tool.get("description"),
            Some(parameters),
            None,
        )))
    })?;
    Ok(tools.filter(|t| !t.is_empty()))
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name"?}`.
fn tool_choice(body: &Ordered) -> Result<ToolChoice, ApiError> {
    match get(body, "tool_choice") {
        None => Ok(ToolChoice::Auto),
        Some(choice @ TemplateValue::Object(_)) => Ok(match string_field(choice, "type") {
            Some("none") => ToolChoice::None,
            Some("tool") => match string_field(choice, "name") {
                Some(name) => ToolChoice::Named(name.to_owned()),
                None => ToolChoice::Auto,
            },
            _ => ToolChoice::Auto,
        }),
        Some(other) => Err(not_a("tool_choice", "an object", other)),
    }
}
