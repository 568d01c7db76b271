//! `POST /v1/responses` requests (OpenAI's Responses API, as vLLM serves
//! it): `instructions` and `input` as chat messages, function tools in the
//! chat form, `previous_response_id` and `store`.
//!
//! | Responses | chat message |
//! | --- | --- |
//! | `instructions` | a `system` message, first (not carried over to a continuation) |
//! | `input` as a string | a `user` message |
//! | a `message` item (or an item with a `role` and no `type`) | a message of its role (`user`, `assistant`, `system`, `developer`), its text parts joined with `"\n"` |
//! | a `function_call` item (`call_id`, `name`, `arguments`) | a tool call `{id: call_id, type: "function", function: {name, arguments}}` of the assistant message before it, or of a new one with empty content |
//! | a `function_call_output` item (`call_id`, `output`) | a `tool` message with `tool_call_id` |
//! | a `reasoning` item | the reasoning (its first `content` text, else its first `summary` text) of the assistant message before it, or of a new one |
//! | other items | left out |
//! | a `function` tool (`name`, `description`, `parameters`, `strict`) | `{"type": "function", "function": {...}}` |
//! | other tools | left out |
//!
//! An assistant `message` item fills the content of an assistant message
//! that holds only reasoning (reasoning, then the message, was one turn).
//! With `previous_response_id`, the items apply after the stored
//! conversation ([`ResponsesRequest::messages`]).

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};
use serde_json::Value;

use super::conversation::{
    Conversation, Ordered, TEXT_PARTS, ToolChoice, call_arguments, function_tool, get, not_a, ordered_body, parts_text,
    push_call, set_reasoning, string, string_field, tool_call, tool_list,
};
use super::fields::{opt_bool, opt_limit, opt_string, parse_object};
use super::params::common_params;
use super::{ApiError, Ending, GenParams};

/// Roles a `message` item takes.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// One input item, as it changes the conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum InputItem {
    /// A message of a role.
    Message {
        /// Its role.
        role: String,
        /// Its text.
        text: String,
    },
    /// A call the model made (`{id, type, function}` as the template gets it).
    FunctionCall(Ordered),
    /// A call's result.
    FunctionCallOutput {
        /// The call it answers.
        call_id: String,
        /// Its text.
        output: String,
    },
    /// The model's reasoning.
    Reasoning(String),
}

/// What a Responses answer repeats of its request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponsesEcho {
    /// `instructions`.
    pub instructions: Option<String>,
    /// `max_output_tokens`.
    pub max_output_tokens: Option<u32>,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// `store` (default true).
    pub store: bool,
    /// `tools`, as sent.
    pub tools: Vec<Value>,
    /// `tool_choice`, as sent (default `"auto"`).
    pub tool_choice: Value,
    /// `temperature`, `top_p`, as sent.
    pub temperature: Value,
    /// `top_p`.
    pub top_p: Value,
}

/// A validated `POST /v1/responses` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The input items, in order.
    pub input: Vec<InputItem>,
    /// Function tools (chat form) and tool choice; no messages (see
    /// [`ResponsesRequest::messages`]).
    pub tools: Conversation,
    /// What the answer repeats.
    pub echo: ResponsesEcho,
    /// Generation parameters (`max_output_tokens` as `max_tokens`).
    pub params: GenParams,
}

impl ResponsesRequest {
    /// Parses and validates a request body.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let ordered = ordered_body(body)?;
        let max_output_tokens = opt_limit(&obj, "max_output_tokens")?;
        let params = common_params(&obj, max_output_tokens)?;
        let input = match get(&ordered, "input") {
            None => return Err(ApiError::bad_request("`input` is required", Some("input"))),
            Some(TemplateValue::String(s)) => vec![InputItem::Message {
                role: "user".into(),
                text: s.to_string(),
            }],
            Some(TemplateValue::Array(items)) if items.is_empty() => {
                return Err(ApiError::bad_request("`input` must not be empty", Some("input")));
            }
            Some(TemplateValue::Array(items)) => items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| input_item(i, item).transpose())
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => return Err(not_a("input", "a string or an array of items", other)),
        };
        let tool_choice = match get(&ordered, "tool_choice") {
            None => ToolChoice::Auto,
            Some(TemplateValue::String(s)) if s == "none" => ToolChoice::None,
            Some(TemplateValue::String(_)) => ToolChoice::Auto,
            Some(choice @ TemplateValue::Object(_)) => match string_field(choice, "name") {
                Some(name) => ToolChoice::Named(name.to_owned()),
                None => ToolChoice::Auto,
            },
            Some(other) => return Err(not_a("tool_choice", "a string or an object", other)),
        };
        let echo = ResponsesEcho {
            instructions: opt_string(&obj, "instructions")?,
            max_output_tokens,
            previous_response_id: opt_string(&obj, "previous_response_id")?,
            store: opt_bool(&obj, "store")?.unwrap_or(true),
            tools: match obj.get("tools") {
                Some(Value::Array(tools)) => tools.clone(),
                _ => Vec::new(),
            },
            tool_choice: obj.get("tool_choice").cloned().unwrap_or_else(|| "auto".into()),
            temperature: obj.get("temperature").cloned().unwrap_or(Value::Null),
            top_p: obj.get("top_p").cloned().unwrap_or(Value::Null),
        };
        if echo.previous_response_id.as_deref() == Some("") {
            return Err(ApiError::bad_request(
                "`previous_response_id` must not be empty",
                Some("previous_response_id"),
            ));
        }
        let tools = Conversation {
            messages: Vec::new(),
            tools: tools(&ordered)?,
            tool_choice,
            ending: Ending::Generation,
        };
        Ok(Self {
            model,
            input,
            tools,
            echo,
            params,
        })
    }

    /// The conversation to render: the new `instructions` as a system
    /// message, then `history` (a stored conversation and its answer,
    /// without its system messages), then the input items applied in
    /// order; with the request's tools.
    pub fn messages(&self, history: Vec<ChatMessage<'static>>) -> Conversation {
        let mut out = Conversation {
            messages: Vec::with_capacity(history.len() + self.input.len() + 1),
            ..self.tools.clone()
        };
        if let Some(instructions) = &self.echo.instructions {
            out.messages.push(ChatMessage::new("system", instructions.clone()));
        }
        out.messages.extend(history.into_iter().filter(|m| m.role != "system"));
        for item in &self.input {
            apply(&mut out, item);
        }
        out
    }
}

/// Applies one input item to the conversation (see the module docs).
fn apply(out: &mut Conversation, item: &InputItem) {
    match item {
        InputItem::Message { role, text } => {
            if role == "assistant"
                && let Some(tail) = out.assistant_tail()
                && tail.content.is_empty()
                && tail.field("tool_calls").is_none()
            {
                tail.content = text.clone().into();
                return;
            }
            out.messages.push(ChatMessage::new(role.clone(), text.clone()));
        }
        InputItem::FunctionCall(call) => push_call(out, call.clone()),
        InputItem::FunctionCallOutput { call_id, output } => out
            .messages
            .push(ChatMessage::new("tool", output.clone()).with("tool_call_id", string(call_id))),
        InputItem::Reasoning(text) => match out.assistant_tail() {
            Some(tail) if tail.field("reasoning").is_none() => set_reasoning(tail, text),
            _ => {
                let mut message = ChatMessage::new("assistant", "");
                set_reasoning(&mut message, text);
                out.messages.push(message);
            }
        },
    }
}

/// A required string field of an item.
fn required_string<'v>(item: &'v Ordered, i: usize, key: &str) -> Result<&'v str, ApiError> {
    let param = format!("input[{i}].{key}");
    match item.get(key) {
        Some(TemplateValue::String(s)) => Ok(s),
        Some(other) => Err(not_a(&param, "a string", other)),
        None => Err(ApiError::bad_request(format!("`{param}` is required"), Some(&param))),
    }
}

/// Text given as a string or as text parts.
fn text_or_parts(value: Option<&Ordered>, param: &str) -> Result<String, ApiError> {
    match value {
        Some(TemplateValue::String(s)) => Ok(s.to_string()),
        Some(TemplateValue::Array(parts)) => parts_text(parts, &TEXT_PARTS, param),
        Some(other) => Err(not_a(param, "a string or an array of content parts", other)),
        None => Err(ApiError::bad_request(format!("`{param}` is required"), Some(param))),
    }
}

/// One item of `input` (`None`: an item the template does not see).
fn input_item(i: usize, item: &Ordered) -> Result<Option<InputItem>, ApiError> {
    let param = format!("input[{i}]");
    if !matches!(item, TemplateValue::Object(_)) {
        return Err(not_a(&param, "an object", item));
    }
    let kind = match item.get("type") {
        Some(TemplateValue::String(kind)) => &**kind,
        None if item.get("role").is_some() => "message",
        _ => {
            let p = format!("{param}.type");
            return Err(ApiError::bad_request(
                format!("`{p}` is required and must be a string"),
                Some(&p),
            ));
        }
    };
    Ok(Some(match kind {
        "message" => {
            let role = required_string(item, i, "role")?;
            if !ROLES.contains(&role) {
                let p = format!("{param}.role");
                return Err(ApiError::bad_request(
                    format!("`{p}` must be one of `user`, `assistant`, `system`, `developer`, not `{role}`"),
                    Some(&p),
                ));
            }
            InputItem::Message {
                role: role.to_owned(),
                text: text_or_parts(item.get("content"), &format!("{param}.content"))?,
            }
        }
        "function_call" => {
            let call_id = required_string(item, i, "call_id")?;
            let name = required_string(item, i, "name")?;
            InputItem::FunctionCall(tool_call(call_id, name, call_arguments(item.get("arguments"))))
        }
        "function_call_output" => InputItem::FunctionCallOutput {
            call_id: required_string(item, i, "call_id")?.to_owned(),
            output: text_or_parts(item.get("output"), &format!("{param}.output"))?,
        },
        "reasoning" => {
            let first_text = |key: &str| match item.get(key) {
                Some(TemplateValue::Array(parts)) => parts.first().and_then(|p| string_field(p, "text")),
                _ => None,
            };
            match first_text("content").or_else(|| first_text("summary")) {
                Some(text) => InputItem::Reasoning(text.to_owned()),
                None => return Ok(None),
            }
        }
        _ => return Ok(None),
    }))
}

/// The request's function tools in the chat form (others left out).
fn tools(body: &Ordered) -> Result<Option<Vec<Ordered>>, ApiError> {
    let tools = tool_list(body, |tool, param| {
        if string_field(tool, "type") != Some("function") {
            return Ok(None);
        }
        let Some(name) = string_field(tool, "name") else {
            let p = format!("{param}.name");
            return Err(ApiError::bad_request(format!("`{p}` must be a string"), Some(&p)));
        };
        Ok(Some(function_tool(
            name,
            tool.get("description"),
            tool.get("parameters").cloned(),
            tool.get("strict"),
        )))
    })?;
    Ok(tools.filter(|t| !t.is_empty()))
}
