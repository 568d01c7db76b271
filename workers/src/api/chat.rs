//! `POST /v1/chat/completions` requests: the messages as vLLM hands them
//! to the chat template (content as text, tool calls, tool results, names,
//! reasoning), the `tools` and `tool_choice`, and the request's other
//! fields (see [`super::conversation`]).

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};
use serde_json::{Map, Value};

use super::conversation::{
    Conversation, Ordered, TEXT_PARTS, ToolChoice, call_arguments, function_tool, get, not_a, ordered_body, parts_text,
    set_reasoning, string, string_field, tool_list,
};
use super::fields::{opt_bool, opt_limit, opt_string, parse_object, wrong_type};
use super::params::common_params;
use super::{ApiError, Ending, GenParams};

/// A validated `POST /v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The messages (never empty), tools and tool choice.
    pub conversation: Conversation,
    /// Generation parameters.
    pub params: GenParams,
}

/// The text of a message's `content`: a string, `null` (empty) or parts.
fn message_content(index: usize, value: Option<&Ordered>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match value {
        None => Ok(String::new()),
        Some(TemplateValue::String(s)) => Ok(s.to_string()),
        Some(TemplateValue::Array(parts)) => parts_text(parts, &TEXT_PARTS, &param),
        Some(other) => Err(not_a(&param, "a string or an array of content parts", other)),
    }
}

/// An assistant message's `tool_calls`, each as the client sent it with
/// its arguments parsed (`None`: none, or an empty list, which vLLM drops).
fn tool_calls(i: usize, calls: Option<&Ordered>) -> Result<Option<Ordered>, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let calls = match calls {
        None => return Ok(None),
        Some(TemplateValue::Array(calls)) if calls.is_empty() => return Ok(None),
        Some(TemplateValue::Array(calls)) => calls,
        Some(other) => return Err(not_a(&param, "an array", other)),
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let call_param = format!("{param}[{j}]");
        let TemplateValue::Object(pairs) = call else {
            return Err(not_a(&call_param, "an object", call));
        };
        let function = match call.get("function") {
            Some(f @ TemplateValue::Object(_)) => f,
            Some(other) => return Err(not_a(&format!("{call_param}.function"), "an object", other)),
            None => {
                let p = format!("{call_param}.function");
                return Err(ApiError::bad_request(format!("`{p}` is required"), Some(&p)));
            }
        };
        if string_field(function, "name").is_none() {
            let p = format!("{call_param}.function.name");
            return Err(ApiError::bad_request(format!("`{p}` must be a string"), Some(&p)));
        }
        let arguments = call_arguments(function.get("arguments"));
        let mut pairs = pairs.clone();
        for (k, v) in pairs.iter_mut() {
            if k == "function"
                && let TemplateValue::Object(fields) = v
            {
                match fields.iter_mut().find(|(k, _)| k == "arguments") {
                    Some(slot) => slot.1 = arguments.clone(),
                    None => fields.push((Cow::Borrowed("arguments"), arguments.clone())),
                }
            }
        }
        out.push(TemplateValue::Object(pairs));
    }
    Ok(Some(TemplateValue::Array(out)))
}

/// One message of `messages`.
fn message(i: usize, item: &Ordered) -> Result<ChatMessage<'static>, ApiError> {
    if !matches!(item, TemplateValue::Object(_)) {
        return Err(not_a(&format!("messages[{i}]"), "an object", item));
    }
    let role = match item.get("role") {
        Some(TemplateValue::String(role)) if !role.is_empty() => role.to_string(),
        Some(TemplateValue::String(_)) | None => {
            let param = format!("messages[{i}].role");
            return Err(ApiError::bad_request(format!("`{param}` is required"), Some(&param)));
        }
        Some(other) => return Err(not_a(&format!("messages[{i}].role"), "a string", other)),
    };
    let content = message_content(i, get(item, "content"))?;
    let assistant = role == "assistant";
    let mut message = ChatMessage::new(role.clone(), content);
    if assistant && let Some(calls) = tool_calls(i, get(item, "tool_calls"))? {
        message = message.with("tool_calls", calls);
    }
    if role == "tool"
        && let Some(id) = string_field(item, "tool_call_id")
    {
        message = message.with("tool_call_id", string(id));
    }
    if let Some(name) = string_field(item, "name") {
        message = message.with("name", string(name));
    }
    if assistant
        && let Some(reasoning) = string_field(item, "reasoning").or_else(|| string_field(item, "reasoning_content"))
    {
        set_reasoning(&mut message, reasoning);
    }
    Ok(message)
}

/// The request's `tools`: `{"type": "function", "function": {...}}` each.
fn tools(body: &Ordered) -> Result<Option<Vec<Ordered>>, ApiError> {
    tool_list(body, |tool, param| {
        let function = match string_field(tool, "type").is_none_or(|t| t == "function") {
            true => get(tool, "function"),
            false => None,
        };
        let Some(function @ TemplateValue::Object(_)) = function else {
            return Err(ApiError::bad_request(
                format!("`{param}` must be an object of type `function` with a `function` object"),
                Some(param),
            ));
        };
        let Some(name) = string_field(function, "name") else {
            let p = format!("{param}.function.name");
            return Err(ApiError::bad_request(format!("`{p}` must be a string"), Some(&p)));
        };
        Ok(Some(function_tool(
            name,
            function.get("description"),
            function.get("parameters").cloned(),
            function.get("strict"),
        )))
    })
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or `{"type":
/// "function", "function": {"name"}}`.
fn tool_choice(body: &Ordered) -> Result<ToolChoice, ApiError> {
    match get(body, "tool_choice") {
        None => Ok(ToolChoice::Auto),
        Some(TemplateValue::String(s)) if s == "none" => Ok(ToolChoice::None),
        Some(TemplateValue::String(_)) => Ok(ToolChoice::Auto),
        Some(choice @ TemplateValue::Object(_)) => {
            Ok(match choice.get("function").and_then(|f| string_field(f, "name")) {
                Some(name) => ToolChoice::Named(name.to_owned()),
                None => ToolChoice::Auto,
            })
        }
        Some(other) => Err(not_a("tool_choice", "a string or an object", other)),
    }
}

/// How the prompt ends: `add_generation_prompt` (default true) and
/// `continue_final_message` (default false), refused together as vLLM
/// refuses them.
fn ending(obj: &Map<String, Value>) -> Result<Ending, ApiError> {
    let generation = opt_bool(obj, "add_generation_prompt")?;
    let continue_final = opt_bool(obj, "continue_final_message")?.unwrap_or(false);
    match (generation.unwrap_or(true), continue_final) {
        (true, true) => Err(ApiError::bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            Some("continue_final_message"),
        )),
        (_, true) => Ok(Ending::ContinueFinal),
        (false, false) => Ok(Ending::Bare),
        (true, false) => Ok(Ending::Generation),
    }
}

impl ChatRequest {
    /// Parses and validates a request body.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let ordered = ordered_body(body)?;
        let items = match get(&ordered, "messages") {
            None => return Err(ApiError::bad_request("`messages` is required", Some("messages"))),
            Some(TemplateValue::Array(items)) if items.is_empty() => {
                return Err(ApiError::bad_request("`messages` must not be empty", Some("messages")));
            }
            Some(TemplateValue::Array(items)) => items,
            Some(other) => return Err(not_a("messages", "an array", other)),
        };
        let messages = items
            .iter()
            .enumerate()
            .map(|(i, item)| message(i, item))
            .collect::<Result<Vec<_>, _>>()?;
        match obj.get("logprobs") {
            None | Some(Value::Null | Value::Bool(_)) => {}
            Some(other) => return Err(wrong_type("logprobs", "a boolean", other)),
        }
        let max_tokens = opt_limit(&obj, "max_tokens")?;
        let max_completion_tokens = opt_limit(&obj, "max_completion_tokens")?;
        let params = common_params(&obj, max_completion_tokens.or(max_tokens))?;
        let conversation = Conversation {
            messages,
            tools: tools(&ordered)?,
            tool_choice: tool_choice(&ordered)?,
            ending: ending(&obj)?,
        };
        Ok(Self {
            model,
            conversation,
            params,
        })
    }
}
