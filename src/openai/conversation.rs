//! A request's conversation as the engine's chat template renders it: the
//! messages (text, tool calls, tool results, reasoning) and the `tools`,
//! whichever API the request came in (chat completions, Responses,
//! Messages: [`super::chat`], [`super::responses`], [`super::anthropic`]).
//!
//! What a template is given follows vLLM, whose prompt the gateway must
//! match token for token for the prefix blocks it hashes to be the ones the
//! engine caches:
//!
//! - a message's content as text, its text parts joined with `"\n"`
//!   (vLLM's "string" content format; image and audio parts are not text);
//! - an assistant message's `tool_calls` as the client sent them, each
//!   call's `function.arguments` parsed as `json.loads` parses it (an
//!   object or a list kept, anything else, or text that is not JSON, `{}`);
//! - a tool message's `tool_call_id`, a message's `name`, an assistant
//!   message's reasoning as both `reasoning` and `reasoning_content`;
//! - `tools` as vLLM's `model_dump()` writes them: `{"type": "function",
//!   "function": {"name", "description", "parameters"}}`, a missing
//!   description or parameters as `null`, `strict` only when given.
//!
//! SGLang differs in small ways (tool results' parts joined with a space,
//! `None`-valued fields passed on); the docs say so.

use std::borrow::Cow;

use semlb_tokenizer::chat::{ChatMessage, ChatTemplate, RenderInputs, TemplateValue};

use super::body::{Json, Object};
use super::request_error::RequestError;

/// A conversation ready to render.
#[derive(Debug, Default)]
pub struct Conversation<'b> {
    /// The messages, in order.
    pub messages: Vec<ChatMessage<'b>>,
    /// The request's tools, in the form the template gets.
    pub tools: Option<Vec<TemplateValue<'b>>>,
}

/// A conversation rendered.
#[derive(Debug)]
pub struct ChatText {
    /// The rendered prompt.
    pub text: String,
    /// Bytes of the last assistant message (its text and tool calls) when
    /// another message follows it: the earlier answer this prompt carries.
    pub earlier_answer_bytes: usize,
    /// Bytes before the first message text (the template's opening).
    pub template_bytes: usize,
}

impl<'b> Conversation<'b> {
    /// Renders it with `template` (`param`: the request field a template
    /// error names).
    pub fn render(&self, template: &ChatTemplate, param: &'static str) -> Result<ChatText, RequestError> {
        let inputs = RenderInputs {
            tools: self.tools.as_deref(),
            variables: Vec::new(),
        };
        let mut text = String::new();
        template
            .render_with(&self.messages, &inputs, &mut text)
            .map_err(|e| RequestError::new(e.to_string(), Some(param)))?;
        let earlier_answer_bytes = match self.messages.iter().rposition(|m| m.role == "assistant") {
            Some(i) if i + 1 < self.messages.len() => answer_bytes(&self.messages[i]),
            _ => 0,
        };
        Ok(ChatText {
            template_bytes: template_bytes(&text, &self.messages),
            text,
            earlier_answer_bytes,
        })
    }

    /// The last message, if it is an assistant message (where a Responses
    /// item or an Anthropic block continuing the assistant's turn goes).
    pub fn assistant_tail(&mut self) -> Option<&mut ChatMessage<'b>> {
        self.messages.last_mut().filter(|m| m.role == "assistant")
    }
}

/// Bytes an assistant message's answer took: its text, and its tool calls
/// as JSON (about what the engine generated for them).
fn answer_bytes(message: &ChatMessage<'_>) -> usize {
    let calls = match message.field("tool_calls") {
        Some(TemplateValue::Array(calls)) => calls
            .iter()
            .map(|c| c.get("function").unwrap_or(c).to_json().len())
            .sum(),
        _ => 0,
    };
    message.content.len() + calls
}

/// Bytes of a message's text [`template_bytes`] looks for: enough to
/// tell it from the template's own text, and a search of a long message
/// costs no more than a short one's.
const TEMPLATE_PROBE_BYTES: usize = 64;

/// Where the first message with text starts in `text` (the first
/// occurrence of its first [`TEMPLATE_PROBE_BYTES`], trimmed as templates
/// often trim it; an earlier occurrence in the template's own text only
/// makes the opening shorter): everything before is the template's own.
/// 0 when it is not found (a template that rewrites the text) or no
/// message has text.
fn template_bytes(text: &str, messages: &[ChatMessage<'_>]) -> usize {
    messages
        .iter()
        .map(|m| m.content.trim())
        .find(|t| !t.is_empty())
        .and_then(|first| text.find(&first[..first.floor_char_boundary(TEMPLATE_PROBE_BYTES)]))
        .unwrap_or(0)
}

/// A JSON value of the body as the template gets it (strings borrowed).
pub fn template_value<'b>(v: &Json<'b>) -> TemplateValue<'b> {
    match v {
        Json::Null => TemplateValue::Null,
        Json::Bool(b) => TemplateValue::Bool(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => TemplateValue::Int(i.into()),
            (_, Some(u)) => TemplateValue::Int(u.into()),
            _ => TemplateValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => TemplateValue::String(s.clone()),
        Json::Array(items) => TemplateValue::Array(items.iter().map(template_value).collect()),
        Json::Object(o) => TemplateValue::Object(object_pairs(o)),
    }
}

/// An object's entries as Python's dict holds them: each key once, at its
/// first place, with its last value.
fn object_pairs<'b>(o: &Object<'b>) -> Vec<(Cow<'b, str>, TemplateValue<'b>)> {
    let mut pairs: Vec<(Cow<'b, str>, TemplateValue<'b>)> = Vec::new();
    for (k, v) in o.entries() {
        let value = template_value(v);
        match pairs.iter_mut().find(|(key, _)| key == k) {
            Some(pair) => pair.1 = value,
            None => pairs.push((Cow::Owned(k.to_owned()), value)),
        }
    }
    pairs
}

/// A tool call's arguments as vLLM gives them to the template: a JSON
/// string parsed (`json.loads`), kept if an object or a list; an object
/// or a list given as such kept; anything else `{}`.
pub fn call_arguments<'b>(arguments: Option<&Json<'b>>) -> TemplateValue<'b> {
    let empty = || TemplateValue::Object(Vec::new());
    match arguments {
        Some(Json::String(text)) => match TemplateValue::parse(text) {
            Ok(v @ (TemplateValue::Object(_) | TemplateValue::Array(_))) => v,
            _ => empty(),
        },
        Some(v @ (Json::Object(_) | Json::Array(_))) => template_value(v),
        _ => empty(),
    }
}

/// A tool call as the template gets it: `{"id", "type": "function",
/// "function": {"name", "arguments"}}`.
pub fn tool_call<'b>(id: Cow<'b, str>, name: Cow<'b, str>, arguments: TemplateValue<'b>) -> TemplateValue<'b> {
    TemplateValue::Object(vec![
        (Cow::Borrowed("id"), TemplateValue::String(id)),
        (Cow::Borrowed("type"), TemplateValue::String(Cow::Borrowed("function"))),
        (
            Cow::Borrowed("function"),
            TemplateValue::Object(vec![
                (Cow::Borrowed("name"), TemplateValue::String(name)),
                (Cow::Borrowed("arguments"), arguments),
            ]),
        ),
    ])
}

/// How an API words a malformed field: OpenAI's (`'tools' must be a
/// list`, `tools[0]`) or Anthropic's, which is pydantic's (`tools: must be
/// a list`, `tools.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wording {
    /// Chat completions and Responses.
    OpenAi,
    /// Messages.
    Anthropic,
}

/// The request's `tools`, each object given to `tool` with its index to
/// make its chat form ([`function_tool`]; `None`: a tool the template is
/// not given, such as a server tool). `None`: the request has no `tools`;
/// 400: `tools` is not a list of objects, or `tool` refused one.
pub fn tool_list<'b>(
    body: &Object<'b>,
    wording: Wording,
    mut tool: impl FnMut(usize, &Object<'b>) -> Result<Option<TemplateValue<'b>>, RequestError>,
) -> Result<Option<Vec<TemplateValue<'b>>>, RequestError> {
    let param = Some("tools");
    let tools = match body.get("tools") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(tools)) => tools,
        Some(v) => {
            let message = match wording {
                Wording::OpenAi => format!("'tools' must be a list, not {}", v.kind()),
                Wording::Anthropic => format!("tools: must be a list, not {}", v.kind()),
            };
            return Err(RequestError::new(message, param));
        }
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let Some(t) = t.as_object() else {
            let message = match wording {
                Wording::OpenAi => format!("tools[{i}] must be an object"),
                Wording::Anthropic => format!("tools.{i}: must be an object"),
            };
            return Err(RequestError::new(message, param));
        };
        out.extend(tool(i, t)?);
    }
    Ok(Some(out))
}

/// A function tool as vLLM's `model_dump()` writes it (see the [module
/// docs](self)).
pub fn function_tool<'b>(
    name: Cow<'b, str>,
    description: Option<&Json<'b>>,
    parameters: Option<TemplateValue<'b>>,
    strict: Option<&Json<'b>>,
) -> TemplateValue<'b> {
    let mut function = vec![
        (Cow::Borrowed("name"), TemplateValue::String(name)),
        (
            Cow::Borrowed("description"),
            description.map_or(TemplateValue::Null, template_value),
        ),
        (Cow::Borrowed("parameters"), parameters.unwrap_or(TemplateValue::Null)),
    ];
    if let Some(strict) = strict.filter(|s| !s.is_null()) {
        function.push((Cow::Borrowed("strict"), template_value(strict)));
    }
    TemplateValue::Object(vec![
        (Cow::Borrowed("type"), TemplateValue::String(Cow::Borrowed("function"))),
        (Cow::Borrowed("function"), TemplateValue::Object(function)),
    ])
}

/// The text of a content list: its text parts (of the `text_types`)
/// joined with `"\n"`; parts of other types (images, audio, files) are
/// not text and are left out. `at` names the list in errors.
pub fn parts_text<'b>(
    parts: &[Json<'b>],
    text_types: &[&str],
    at: &str,
    param: &'static str,
) -> Result<Cow<'b, str>, RequestError> {
    let mut texts: Vec<&Cow<'b, str>> = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        let Json::Object(part) = part else {
            return Err(RequestError::new(format!("{at}[{j}] must be an object"), Some(param)));
        };
        match part.get("type").and_then(Json::as_str) {
            Some(t) if text_types.contains(&t) => match part.get("text") {
                Some(Json::String(text)) => texts.push(text),
                _ => {
                    return Err(RequestError::new(
                        format!("{at}[{j}].text must be a string"),
                        Some(param),
                    ));
                }
            },
            Some(_) => {}
            None => return Err(RequestError::new(format!("{at}[{j}] needs a 'type'"), Some(param))),
        }
    }
    Ok(match texts[..] {
        [] => Cow::Borrowed(""),
        [one] => one.clone(),
        _ => Cow::Owned(texts.iter().map(|t| &***t).collect::<Vec<&str>>().join("\n")),
    })
}

/// A string field of an object, if it has one.
pub fn string_field<'o, 'b>(o: &'o Object<'b>, name: &str) -> Option<&'o Cow<'b, str>> {
    match o.get(name) {
        Some(Json::String(s)) => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::prompt::{Endpoint, RequestLimits, RoutingInput, parse};

    #[test]
    fn arguments_are_what_json_loads_gives_the_template() {
        let parse = |s: &'static str| Json::parse(s.as_bytes()).unwrap();
        let args = parse(r#""{\"b\": 1, \"a\": [2.5, null]}""#);
        assert_eq!(call_arguments(Some(&args)).to_json(), r#"{"b": 1, "a": [2.5, null]}"#);
        for odd in [r#""not json""#, r#""42""#, "7", "null"] {
            assert_eq!(call_arguments(Some(&parse(odd))).to_json(), "{}", "{odd}");
        }
        assert_eq!(call_arguments(None).to_json(), "{}");
        assert_eq!(call_arguments(Some(&parse(r#"{"x":"é"}"#))).to_json(), r#"{"x": "é"}"#);
    }

    #[test]
    fn tools_are_model_dumps() {
        let described = Json::String(Cow::Borrowed("Looks up."));
        let t = function_tool(Cow::Borrowed("f"), Some(&described), None, Some(&Json::Bool(true)));
        assert_eq!(
            t.to_json(),
            r#"{"type": "function", "function": {"name": "f", "description": "Looks up.", "parameters": null, "strict": true}}"#
        );
        let t = function_tool(
            Cow::Borrowed("g"),
            None,
            Some(TemplateValue::Object(vec![])),
            Some(&Json::Null),
        );
        assert_eq!(
            t.to_json(),
            r#"{"type": "function", "function": {"name": "g", "description": null, "parameters": {}}}"#
        );
    }

    #[test]
    fn text_parts_are_joined_with_newlines() {
        let parts = Json::parse(
            br#"[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},{"type":"text","text":"b"}]"#,
        )
        .unwrap();
        let text = parts_text(parts.as_array().unwrap(), &["text"], "messages[0].content", "messages").unwrap();
        assert_eq!(text, "a\nb");
        let bad = Json::parse(br#"[{"text":"a"}]"#).unwrap();
        assert!(parts_text(bad.as_array().unwrap(), &["text"], "m", "messages").is_err());
    }

    // The three conversational APIs against each other: one agent
    // conversation (a tool call, its result, an answer, a new question) sent
    // as a chat completion, as a Responses request and as an Anthropic
    // Messages request renders to the same prompt, with the canonical template
    // and with Qwen2.5's (which renders tools and tool calls), so a session
    // finds its blocks whichever API it speaks.
    const CHAT: &str = r#"{"model":"m","tools":[{"type":"function","function":{"name":"get_weather","description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],
     "messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"call_1","content":"18C"},
      {"role":"assistant","content":"It is 18C."},{"role":"user","content":"And Rome?"}]}"#;

    const RESPONSES: &str = r#"{"model":"m","instructions":"Be brief.","tools":[{"type":"function","name":"get_weather","description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}},{"type":"web_search"}],
     "input":[{"role":"user","content":"Weather in Paris?"},
      {"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
      {"type":"function_call_output","call_id":"call_1","output":"18C"},
      {"type":"message","role":"assistant","content":[{"type":"output_text","text":"It is 18C."}]},
      {"role":"user","content":[{"type":"input_text","text":"And Rome?"}]}]}"#;

    const MESSAGES: &str = r#"{"model":"m","max_tokens":64,"system":[{"type":"text","text":"Be brief."}],"tools":[{"name":"get_weather","description":"Weather of a city.","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}],
     "messages":[{"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":[{"type":"tool_use","id":"call_1","name":"get_weather","input":{"city":"Paris"}}]},
      {"role":"user","content":[{"type":"tool_result","tool_use_id":"call_1","content":[{"type":"text","text":"18C"}]}]},
      {"role":"assistant","content":[{"type":"text","text":"It is 18C."}]},
      {"role":"user","content":"And Rome?"}]}"#;

    fn text(endpoint: Endpoint, body: &str, template: &ChatTemplate) -> String {
        let parsed = parse(endpoint, body.as_bytes(), template, &RequestLimits::default()).unwrap();
        match parsed.input {
            RoutingInput::Text(t) => t.into_owned(),
            RoutingInput::Tokens(_) => panic!("text"),
        }
    }

    #[test]
    fn one_conversation_renders_alike_through_every_api() {
        let qwen = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tokenizer/tests/templates/qwen2.5.jinja"
        ))
        .unwrap();
        for template in [
            ChatTemplate::canonical(),
            ChatTemplate::from_source(&qwen, None, None).unwrap(),
        ] {
            let chat = text(Endpoint::ChatCompletions, CHAT, &template);
            // The call's arguments as json.dumps writes the parsed object.
            assert!(
                chat.contains(r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#),
                "{chat}"
            );
            assert!(chat.contains("18C") && chat.contains("Weather of a city."), "{chat}");
            assert_eq!(
                text(Endpoint::Responses, RESPONSES, &template),
                chat,
                "{}",
                template.renderer_name()
            );
            assert_eq!(
                text(Endpoint::Messages, MESSAGES, &template),
                chat,
                "{}",
                template.renderer_name()
            );
        }
    }

    #[test]
    fn the_earlier_answer_counts_its_tool_calls() {
        let template = ChatTemplate::canonical();
        let call_only = CHAT.replace(
            r#",
      {"role":"assistant","content":"It is 18C."},{"role":"user","content":"And Rome?"}"#,
            "",
        );
        let parsed = parse(
            Endpoint::ChatCompletions,
            call_only.as_bytes(),
            &template,
            &RequestLimits::default(),
        )
        .unwrap();
        assert_eq!(
            parsed.earlier_answer_bytes,
            r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#.len()
        );
    }

    #[test]
    fn malformed_agent_requests_are_400s_naming_the_field() {
        let template = ChatTemplate::canonical();
        let refused = |endpoint, body: &str| {
            parse(endpoint, body.as_bytes(), &template, &RequestLimits::default())
                .err()
                .map(|e| (e.status.as_u16(), e.param, e.message))
        };
        let cases = [
            (Endpoint::Responses, r#"{"model":"m"}"#, "input"),
            (Endpoint::Responses, r#"{"model":"m","input":[]}"#, "input"),
            (
                Endpoint::Responses,
                r#"{"model":"m","input":[{"type":"function_call","name":"f"}]}"#,
                "input",
            ),
            (
                Endpoint::Responses,
                r#"{"model":"m","input":"x","instructions":7}"#,
                "instructions",
            ),
            (
                Endpoint::Responses,
                r#"{"model":"m","input":"x","max_output_tokens":0}"#,
                "max_output_tokens",
            ),
            (
                Endpoint::Responses,
                r#"{"model":"m","input":[{"role":"robot","content":"x"}]}"#,
                "input",
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
                "max_tokens",
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","max_tokens":5,"messages":[]}"#,
                "messages",
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"x"}]}"#,
                "messages",
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","max_tokens":5,"system":5,"messages":[{"role":"user","content":"x"}]}"#,
                "system",
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","max_tokens":5,"tools":[{"input_schema":{}}],"messages":[{"role":"user","content":"x"}]}"#,
                "tools",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"user","content":"x"}]}"#,
                "tools",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{}}]}]}"#,
                "messages",
            ),
        ];
        for (endpoint, body, param) in cases {
            let Some((status, got, message)) = refused(endpoint, body) else {
                panic!("{body} was taken")
            };
            assert_eq!((status, got), (400, Some(param)), "{body}: {message}");
        }
    }
}
