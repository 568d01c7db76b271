//! A conversation as vLLM hands it to the chat template, whichever API it
//! came in (chat completions, Responses, Messages): the messages with their
//! fields (tool calls, tool call ids, names, reasoning), the `tools`, and
//! the request's tool choice, which decides whether the simulator answers
//! with a tool call ([`Conversation::tool_to_call`]).
//!
//! Bodies are read a second time as [`TemplateValue`]s (the first reading,
//! a [`serde_json::Value`], does not keep key order): tool `parameters` and
//! tool-call arguments reach the template in the order the client sent
//! them, as Python's `json.loads` keeps them.
//!
//! - a message's content is text: text parts (`text`, `input_text`,
//!   `output_text`, `refusal`, `thinking`) joined with `"\n"`, other parts
//!   (images, audio, files) left out;
//! - a tool call's `function.arguments` is parsed as `json.loads` parses
//!   it: a JSON string giving an object or a list is that value; an object
//!   or a list given as such is kept; anything else is `{}`;
//! - an assistant's reasoning is given as both `reasoning` and
//!   `reasoning_content`;
//! - a tool is `{"type": "function", "function": {"name", "description",
//!   "parameters"}}` (a missing description or parameters as `null`,
//!   `strict` only when given), as vLLM's `model_dump()` writes it.

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, TemplateValue};

use super::ApiError;

/// A JSON value that keeps its keys' order.
pub type Ordered = TemplateValue<'static>;

/// Content part types whose `text` is text to the template (vLLM's).
pub const TEXT_PARTS: [&str; 5] = ["text", "input_text", "output_text", "refusal", "thinking"];

/// Which tool, if any, the client lets the model call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides (`auto`, `required`, Anthropic's `any`): the
    /// simulator calls the first tool.
    #[default]
    Auto,
    /// No tool call (`none`).
    None,
    /// This tool (a named choice).
    Named(String),
}

/// A request's conversation, ready to render.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Conversation {
    /// The messages, in order.
    pub messages: Vec<ChatMessage<'static>>,
    /// The request's tools in the chat form; `None` without tools.
    pub tools: Option<Vec<Ordered>>,
    /// The request's tool choice.
    pub tool_choice: ToolChoice,
    /// How the prompt ends (chat's `add_generation_prompt` and
    /// `continue_final_message`).
    pub ending: Ending,
}

/// How a rendered conversation ends: with the template's generation
/// prompt (a new assistant turn, the default), with nothing after the last
/// message (`add_generation_prompt: false`), or inside the last message,
/// which the model continues (`continue_final_message: true`, vLLM's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ending {
    /// A new assistant turn.
    #[default]
    Generation,
    /// Nothing after the last message.
    Bare,
    /// The last message continued.
    ContinueFinal,
}

impl Conversation {
    /// The `function` object of the tool the answer calls: the named one
    /// (else the first) when the request has tools, does not forbid calls
    /// and its last message is not a tool result; else `None` (the answer
    /// is text).
    pub fn tool_to_call(&self) -> Option<&Ordered> {
        let tools = self.tools.as_ref()?;
        if self.tool_choice == ToolChoice::None || self.messages.last().is_some_and(|m| m.role == "tool") {
            return None;
        }
        let named = match &self.tool_choice {
            ToolChoice::Named(name) => tools
                .iter()
                .find(|t| t.get("function").and_then(|f| f.get("name")).and_then(Ordered::as_str) == Some(name)),
            _ => None,
        };
        named.or(tools.first())?.get("function")
    }

    /// The last message, if it is an assistant message.
    pub fn assistant_tail(&mut self) -> Option<&mut ChatMessage<'static>> {
        self.messages.last_mut().filter(|m| m.role == "assistant")
    }
}

/// The body read again, keeping key order (it is known to be a JSON
/// object: [`super::parse_object`] read it first).
pub fn ordered_body(body: &[u8]) -> Result<Ordered, ApiError> {
    serde_json::from_slice::<Ordered>(body)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}"), None))
}

/// A field of an object, absent or `null` → `None`.
pub fn get<'v>(value: &'v Ordered, key: &str) -> Option<&'v Ordered> {
    value.get(key).filter(|v| !matches!(v, TemplateValue::Null))
}

/// A string field of an object.
pub fn string_field<'v>(value: &'v Ordered, key: &str) -> Option<&'v str> {
    value.get(key).and_then(Ordered::as_str)
}

/// The JSON type name of `v`, for messages.
pub fn kind(v: &Ordered) -> &'static str {
    match v {
        TemplateValue::Null => "null",
        TemplateValue::Bool(_) => "boolean",
        TemplateValue::Int(_) | TemplateValue::Float(_) => "number",
        TemplateValue::String(_) => "string",
        TemplateValue::Array(_) => "array",
        TemplateValue::Object(_) => "object",
    }
}

/// A 400 saying `param` must be `expected`.
pub fn not_a(param: &str, expected: &str, got: &Ordered) -> ApiError {
    ApiError::bad_request(format!("`{param}` must be {expected}, not {}", kind(got)), Some(param))
}

/// The text of a content list: its text parts (of `text_types`) joined
/// with `"\n"`; parts of other types are left out. A part that is not an
/// object, has no `type`, or whose text is not a string is a 400 naming
/// `param` (`messages[0].content`).
pub fn parts_text(parts: &[Ordered], text_types: &[&str], param: &str) -> Result<String, ApiError> {
    let mut texts: Vec<&str> = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        let part_param = format!("{param}[{j}]");
        if !matches!(part, TemplateValue::Object(_)) {
            return Err(not_a(&part_param, "an object", part));
        }
        match part.get("type") {
            Some(TemplateValue::String(t)) if text_types.contains(&&**t) => match part.get("text") {
                Some(TemplateValue::String(text)) => texts.push(text),
                Some(other) => return Err(not_a(&format!("{part_param}.text"), "a string", other)),
                None => {
                    return Err(ApiError::bad_request(
                        format!("`{part_param}.text` is required"),
                        Some(&part_param),
                    ));
                }
            },
            Some(TemplateValue::String(_)) => {} // images, audio, files: not text
            _ => {
                return Err(ApiError::bad_request(
                    format!("`{part_param}.type` is required and must be a string"),
                    Some(&part_param),
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// A tool call's arguments as vLLM gives them to the template (see the
/// module docs).
pub fn call_arguments(arguments: Option<&Ordered>) -> Ordered {
    let empty = || TemplateValue::Object(Vec::new());
    match arguments {
        Some(TemplateValue::String(text)) => match TemplateValue::parse(text) {
            Ok(v @ (TemplateValue::Object(_) | TemplateValue::Array(_))) => v,
            _ => empty(),
        },
        Some(v @ (TemplateValue::Object(_) | TemplateValue::Array(_))) => v.clone(),
        _ => empty(),
    }
}

/// A tool call as the template gets it: `{"id", "type": "function",
/// "function": {"name", "arguments"}}`.
pub fn tool_call(id: &str, name: &str, arguments: Ordered) -> Ordered {
    TemplateValue::Object(vec![
        (Cow::Borrowed("id"), string(id)),
        (Cow::Borrowed("type"), string("function")),
        (
            Cow::Borrowed("function"),
            TemplateValue::Object(vec![
                (Cow::Borrowed("name"), string(name)),
                (Cow::Borrowed("arguments"), arguments),
            ]),
        ),
    ])
}

/// The request's `tools`, each object given to `tool` with its index
/// (`param`, `tools[i]`) to make its chat form (`None`: left out, such as
/// a server tool). `None`: no `tools`; 400: `tools` is not an array of
/// objects, or `tool` refused one.
pub fn tool_list(
    body: &Ordered,
    mut tool: impl FnMut(&Ordered, &str) -> Result<Option<Ordered>, ApiError>,
) -> Result<Option<Vec<Ordered>>, ApiError> {
    let tools = match get(body, "tools") {
        None => return Ok(None),
        Some(TemplateValue::Array(tools)) => tools,
        Some(other) => return Err(not_a("tools", "an array", other)),
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        if !matches!(t, TemplateValue::Object(_)) {
            return Err(not_a(&param, "an object", t));
        }
        out.extend(tool(t, &param)?);
    }
    Ok(Some(out))
}

/// A function tool in the chat form (see the module docs).
pub fn function_tool(
    name: &str,
    description: Option<&Ordered>,
    parameters: Option<Ordered>,
    strict: Option<&Ordered>,
) -> Ordered {
    let mut function = vec![
        (Cow::Borrowed("name"), string(name)),
        (
            Cow::Borrowed("description"),
            description.cloned().unwrap_or(TemplateValue::Null),
        ),
        (Cow::Borrowed("parameters"), parameters.unwrap_or(TemplateValue::Null)),
    ];
    if let Some(strict) = strict.filter(|s| !matches!(s, TemplateValue::Null)) {
        function.push((Cow::Borrowed("strict"), strict.clone()));
    }
    TemplateValue::Object(vec![
        (Cow::Borrowed("type"), string("function")),
        (Cow::Borrowed("function"), TemplateValue::Object(function)),
    ])
}

/// An owned string value.
pub fn string(s: &str) -> Ordered {
    TemplateValue::String(Cow::Owned(s.to_owned()))
}

/// Gives `message` its reasoning, under both names vLLM gives it.
pub fn set_reasoning(message: &mut ChatMessage<'static>, reasoning: &str) {
    message
        .fields
        .retain(|(k, _)| k != "reasoning" && k != "reasoning_content");
    message.fields.push((Cow::Borrowed("reasoning"), string(reasoning)));
    message
        .fields
        .push((Cow::Borrowed("reasoning_content"), string(reasoning)));
}

/// Adds a tool call to the assistant message at the end of `messages`, or
/// to a new assistant message with empty content.
pub fn push_call(conversation: &mut Conversation, call: Ordered) {
    if let Some(tail) = conversation.assistant_tail() {
        match tail.fields.iter_mut().find(|(k, _)| k == "tool_calls") {
            Some((_, TemplateValue::Array(calls))) => calls.push(call),
            _ => tail
                .fields
                .push((Cow::Borrowed("tool_calls"), TemplateValue::Array(vec![call]))),
        }
        return;
    }
    conversation
        .messages
        .push(ChatMessage::new("assistant", "").with("tool_calls", TemplateValue::Array(vec![call])));
}
