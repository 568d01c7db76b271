//! The routing text of an OpenAI request: what a dispatcher tokenizes to
//! find the servers that hold the request's prefix.
//!
//! * `POST /v1/completions`: the `prompt` — a string, a list of strings, a
//!   list of token ids, or a list of token-id lists. For a list of several
//!   prompts (a batch), the first one routes the request: they go to one
//!   server together.
//! * `POST /v1/chat/completions`: the `messages` rendered with the model's
//!   chat template (from a tokenizer_config.json) or, without one, the
//!   canonical rendering of `semlb_tokenizer::chat::ChatTemplate`, which
//!   keeps message boundaries so that turn N+1's prompt extends turn N's
//!   prompt and answer. A message's `content` may be a string, a list of
//!   parts (`{"type": "text", "text": ...}`; other part types are skipped for
//!   routing), or null (an assistant message with tool calls).
//!
//! The body is parsed once into a [`Json`] tree that borrows its strings
//! from the body ([`crate::openai::body`]) and is kept: the dispatcher forwards the
//! original bytes, and the response-cache key, the session key and the
//! stream options are read from the same tree. Malformed input is a
//! [`RequestError`], an OpenAI-style 400, never a panic.

use std::borrow::Cow;
use std::hash::Hasher;

use seahash::SeaHasher;
use semlb_tokenizer::chat::ChatTemplate;

use crate::openai::body::{Json, Object};
pub use crate::openai::request_error::RequestError;

/// Which OpenAI endpoint a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Messages,
}

impl Endpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// Whether its prompt is a conversation rendered by the chat template
    /// (its answer is the assistant's next message).
    pub fn is_chat(self) -> bool {
        self != Endpoint::Completions
    }
}

/// What the dispatcher tokenizes (or already has as tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoutingInput<'a> {
    /// Text to tokenize (a completions prompt borrowed from the body, or a
    /// rendered chat prompt).
    Text(Cow<'a, str>),
    /// Token ids given by the client.
    Tokens(Vec<u32>),
}

/// A parsed and checked request, borrowing from its body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest<'a> {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The `model` field.
    pub model: Cow<'a, str>,
    /// Whether the client asked for SSE.
    pub stream: bool,
    /// What routes it.
    pub input: RoutingInput<'a>,
    /// Bytes of the earlier answer the prompt carries: the text of the
    /// last assistant message, when a later message follows it (a
    /// conversation's next turn); 0 otherwise and for completions.
    pub earlier_answer_bytes: usize,
    /// Bytes of the routing text before any message's text: the chat
    /// template's opening (its role markers and any system prompt of its
    /// own), the same for every conversation the template renders. 0 for
    /// completions, and when the first message's text cannot be found in
    /// the rendered prompt.
    pub template_bytes: usize,
    /// The whole body.
    pub body: Object<'a>,
}

impl ParsedRequest<'_> {
    /// The request with nothing borrowed from its body (one parsed on the
    /// blocking pool comes back this way).
    pub fn into_owned(self) -> ParsedRequest<'static> {
        ParsedRequest {
            endpoint: self.endpoint,
            model: Cow::Owned(self.model.into_owned()),
            stream: self.stream,
            input: match self.input {
                RoutingInput::Text(text) => RoutingInput::Text(Cow::Owned(text.into_owned())),
                RoutingInput::Tokens(ids) => RoutingInput::Tokens(ids),
            },
            earlier_answer_bytes: self.earlier_answer_bytes,
            template_bytes: self.template_bytes,
            body: self.body.into_owned(),
        }
    }

    /// The output tokens the request asks for at most: a chat's
    /// `max_completion_tokens`, else `max_tokens` (both checked positive
    /// integers by [`parse`]); `None` if it does not say.
    pub fn requested_output(&self) -> Option<u64> {
        let field = |name| self.body.get(name).and_then(Json::as_u64);
        match self.endpoint {
            Endpoint::ChatCompletions => field("max_completion_tokens").or_else(|| field("max_tokens")),
            Endpoint::Completions | Endpoint::Messages => field("max_tokens"),
            Endpoint::Responses => field("max_output_tokens"),
        }
    }

    /// The answers it asks for: the larger of `n` and `best_of` (vLLM
    /// generates `best_of` and returns `n`), at least 1.
    pub fn answers(&self) -> u64 {
        ["n", "best_of"]
            .into_iter()
            .filter_map(|name| self.body.get(name).and_then(Json::as_u64))
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// What the prompt holds beyond its routing text, which the gateway
    /// does not tokenize: estimated at a token per four bytes (see
    /// [`PromptExtra`]).
    pub fn extra(&self) -> PromptExtra {
        let estimate = |bytes: usize| bytes.div_ceil(4) as u64;
        match self.endpoint {
            Endpoint::Responses | Endpoint::Messages => PromptExtra {
                every_prompt: 0,
                other_prompts: 0,
                prompts: 1,
            },
            Endpoint::ChatCompletions => PromptExtra {
                // In the engine's prompt but not in the gateway's text
                // (`tools` are rendered into it).
                every_prompt: ["functions", "response_format", "documents"]
                    .into_iter()
                    .filter_map(|name| self.body.get(name))
                    .filter(|v| !matches!(v, Json::Null))
                    .map(|v| estimate(v.text_bytes()))
                    .sum(),
                other_prompts: 0,
                prompts: 1,
            },
            Endpoint::Completions => {
                let items = self.body.get("prompt").and_then(Json::as_array).unwrap_or_default();
                let batch = match items.first() {
                    // A list of strings, or of token-id lists: a batch.
                    Some(Json::String(_)) | Some(Json::Array(_)) => &items[1..],
                    _ => &[],
                };
                PromptExtra {
                    every_prompt: 0,
                    other_prompts: batch
                        .iter()
                        .map(|v| match v {
                            Json::Array(ids) => ids.len() as u64,
                            other => estimate(other.text_bytes().saturating_sub(2)),
                        })
                        .sum(),
                    prompts: batch.len() as u64 + 1,
                }
            }
        }
    }

    /// The stored response a Responses request continues
    /// (`previous_response_id`), if it names one.
    pub fn previous_response_id(&self) -> Option<&str> {
        (self.endpoint == Endpoint::Responses)
            .then(|| self.body.get("previous_response_id").and_then(Json::as_str))
            .flatten()
            .filter(|id| !id.is_empty())
    }

    /// Whether the engine stores the answer of a Responses request (its
    /// `store`, true unless `false`), for a later `previous_response_id`.
    pub fn stores_response(&self) -> bool {
        self.endpoint == Endpoint::Responses && self.body.get("store").and_then(Json::as_bool) != Some(false)
    }

    /// Whether a Responses request carries its whole conversation (an
    /// earlier answer among its input items): without its stored response
    /// it can still be answered, sent without `previous_response_id`.
    pub fn carries_history(&self) -> bool {
        let items = self.body.get("input").and_then(Json::as_array).unwrap_or_default();
        items.iter().filter_map(Json::as_object).any(|item| {
            matches!(
                item.get("type").and_then(Json::as_str),
                Some("function_call" | "reasoning")
            ) || item.get("role").and_then(Json::as_str) == Some("assistant")
        })
    }

    /// The field that carries the prompt: `messages` or `prompt`.
    pub fn prompt_param(&self) -> &'static str {
        endpoint_prompt_param(self.endpoint)
    }

    /// Whether a streamed answer should end with a usage chunk
    /// (`stream_options.include_usage`; Responses and Messages streams
    /// always report their usage).
    pub fn include_usage(&self) -> bool {
        if matches!(self.endpoint, Endpoint::Responses | Endpoint::Messages) {
            return true;
        }
        self.body
            .get("stream_options")
            .and_then(Json::as_object)
            .and_then(|o| o.get("include_usage"))
            .and_then(Json::as_bool)
            .unwrap_or(false)
    }
}

/// What a request's prompt holds beyond the routing text the gateway
/// tokenizes: charged to its token limits, and the part in every prompt
/// counted in the context check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptExtra {
    /// Tokens in every prompt the engine renders, estimated: a chat's
    /// `functions`, `response_format` and `documents` (the gateway's text
    /// leaves them out; `tools` it renders as the template does).
    pub every_prompt: u64,
    /// Tokens of the other prompts of a completions batch (`prompt` as a
    /// list: the first one routes); token-id lists counted exactly, texts
    /// estimated.
    pub other_prompts: u64,
    /// Prompts in the request (a batch's, else 1): each gets its answers.
    pub prompts: u64,
}

/// Bounds on the work one request makes the gateway do before it reaches
/// an engine. 480 000 one-byte messages (a 14 MiB body) took 0.77 s to
/// parse and render with a Jinja template on this 2-core machine; 4 096
/// messages of 4 000 bytes (15 MiB) took 23 ms. (The dispatcher parses
/// bodies over 256 KiB on its blocking pool, so such a parse holds one
/// blocking thread, not the reactor that serves every connection.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most chat messages (more: 400 `array_above_max_length`, as OpenAI
    /// answers, before any is rendered). `limits.max_messages`.
    pub max_messages: usize,
    /// Largest routing text, the rendered chat or the completions prompt,
    /// in bytes (larger: 413 `prompt_too_large`, before tokenization).
    /// `limits.max_prompt_bytes`.
    pub max_prompt_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_messages: 4096,
            max_prompt_bytes: 8 << 20,
        }
    }
}

/// Parses and checks a request body for `endpoint`, rendering chat messages
/// with `template`, within `limits`.
pub fn parse<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    template: &ChatTemplate,
    limits: &RequestLimits,
) -> Result<ParsedRequest<'a>, RequestError> {
    parse_with(endpoint, body, limits, |_| Ok(template)).map(|(parsed, _)| parsed)
}

/// What serves a request's model, as far as parsing is concerned: the chat
/// template its messages are rendered with.
pub trait Templated {
    /// The chat template.
    fn template(&self) -> &ChatTemplate;
}

impl Templated for &ChatTemplate {
    fn template(&self) -> &ChatTemplate {
        self
    }
}

/// [`parse`], with the template chosen by the request's model: `pick`
/// maps the `model` field to what serves it (or refuses it, e.g. with
/// [`RequestError::model_not_found`]) before any rendering, and that
/// one's chat template renders the messages.
pub fn parse_with<'a, P: Templated>(
    endpoint: Endpoint,
    body: &'a [u8],
    limits: &RequestLimits,
    pick: impl FnOnce(&str) -> Result<P, RequestError>,
) -> Result<(ParsedRequest<'a>, P), RequestError> {
    let body = body_object(body)?;
    let model = request_model(&body)?;
    let picked = pick(&model)?;
    let template = picked.template();
    let stream = match body.get("stream") {
        None | Some(Json::Null) => false,
        Some(Json::Bool(b)) => *b,
        Some(v) => {
            return Err(RequestError::new(
                format!("'stream' must be a boolean, not {}", v.kind()),
                Some("stream"),
            ));
        }
    };
    check_numbers(&body)?;
    let conversation = match endpoint {
        Endpoint::Completions => None,
        Endpoint::ChatCompletions => Some(super::chat::conversation(&body, limits.max_messages)?),
        Endpoint::Responses => Some(super::responses::conversation(&body, limits.max_messages)?),
        Endpoint::Messages => Some(super::anthropic::conversation(&body, limits.max_messages)?),
    };
    let (input, earlier_answer_bytes, template_bytes) = match conversation {
        None => (completions_input(body.get("prompt"))?, 0, 0),
        Some(conversation) => {
            let chat = conversation.render(template, endpoint_prompt_param(endpoint))?;
            (
                RoutingInput::Text(Cow::Owned(chat.text)),
                chat.earlier_answer_bytes,
                chat.template_bytes,
            )
        }
    };
    if let RoutingInput::Text(text) = &input
        && text.len() > limits.max_prompt_bytes
    {
        return Err(RequestError {
            message: format!(
                "the prompt is {} bytes{}, more than the gateway's limit of {} bytes",
                text.len(),
                if endpoint.is_chat() { " rendered" } else { "" },
                limits.max_prompt_bytes
            ),
            param: Some(endpoint_prompt_param(endpoint)),
            status: http::StatusCode::PAYLOAD_TOO_LARGE,
            code: Some("prompt_too_large"),
        });
    }
    let parsed = ParsedRequest {
        endpoint,
        model,
        stream,
        input,
        earlier_answer_bytes,
        template_bytes,
        body,
    };
    Ok((parsed, picked))
}

/// A request body as the JSON object every API of the gateway takes (400
/// when it is not valid JSON or not an object).
pub fn body_object(body: &[u8]) -> Result<Object<'_>, RequestError> {
    let value =
        Json::parse(body).map_err(|e| RequestError::new(format!("the request body is not valid JSON: {e}"), None))?;
    match value {
        Json::Object(object) => Ok(object),
        other => Err(RequestError::new(
            format!("the request body must be a JSON object, not {}", other.kind()),
            None,
        )),
    }
}

/// The `model` field: required, a non-empty string.
pub fn request_model<'a>(body: &Object<'a>) -> Result<Cow<'a, str>, RequestError> {
    match body.get("model") {
        Some(Json::String(m)) if !m.is_empty() => Ok(m.clone()),
        Some(Json::String(_)) => Err(RequestError::new("'model' must not be empty", Some("model"))),
        Some(v) => Err(RequestError::new(
            format!("'model' must be a string, not {}", v.kind()),
            Some("model"),
        )),
        None => Err(RequestError::new("'model' is required", Some("model"))),
    }
}

/// The field of `endpoint`'s requests that carries the prompt.
fn endpoint_prompt_param(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages => "messages",
        Endpoint::Completions => "prompt",
        Endpoint::Responses => "input",
    }
}

/// Generation parameters every engine validates; checking their types here
/// turns a wrong type into a 400 from the gateway instead of a backend error.
fn check_numbers(body: &Object<'_>) -> Result<(), RequestError> {
    const NUMBERS: [&str; 6] = [
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "n",
    ];
    const COUNTS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];
    for name in NUMBERS.into_iter().chain(COUNTS) {
        match body.get(name) {
            None | Some(Json::Null) => {}
            Some(Json::Number(n)) => {
                let param = Some(name);
                if COUNTS.contains(&name) && n.as_u64().is_none_or(|v| v == 0) {
                    return Err(RequestError::new(
                        format!("'{name}' must be a positive integer, not {n}"),
                        param,
                    ));
                }
                if name == "n" && n.as_u64().is_none_or(|v| v == 0) {
                    return Err(RequestError::new(
                        format!("'n' must be a positive integer, not {n}"),
                        param,
                    ));
                }
            }
            Some(v) => {
                let param = NUMBERS.iter().chain(&COUNTS).find(|p| **p == name).copied();
                return Err(RequestError::new(
                    format!("'{name}' must be a number, not {}", v.kind()),
                    param,
                ));
            }
        }
    }
    Ok(())
}

fn token_ids(items: &[Json<'_>]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

fn completions_input<'a>(prompt: Option<&Json<'a>>) -> Result<RoutingInput<'a>, RequestError> {
    let param = Some("prompt");
    let bad = |what: String| Err(RequestError::new(what, param));
    match prompt {
        None | Some(Json::Null) => bad("'prompt' is required".into()),
        Some(Json::String(s)) if s.is_empty() => bad("'prompt' must not be empty".into()),
        Some(Json::String(s)) => Ok(RoutingInput::Text(s.clone())),
        Some(Json::Array(items)) => match items.first() {
            None => bad("'prompt' must not be an empty list".into()),
            Some(Json::String(first)) => match items.iter().position(|v| v.as_str().is_none()) {
                Some(i) => bad(format!("'prompt' mixes strings with {} at index {i}", items[i].kind())),
                None if first.is_empty() => bad("'prompt' must not be empty".into()),
                None => Ok(RoutingInput::Text(first.clone())),
            },
            Some(Json::Number(_)) => match token_ids(items) {
                Some(ids) => Ok(RoutingInput::Tokens(ids)),
                None => bad("'prompt' token ids must be integers from 0 to 4294967295".into()),
            },
            Some(Json::Array(first)) => {
                if items.iter().any(|v| v.as_array().is_none()) {
                    return bad("'prompt' mixes token-id lists with other values".into());
                }
                match token_ids(first) {
                    Some(ids) if !ids.is_empty() => Ok(RoutingInput::Tokens(ids)),
                    Some(_) => bad("'prompt' must not be an empty token list".into()),
                    None => bad("'prompt' token ids must be integers from 0 to 4294967295".into()),
                }
            }
            Some(v) => bad(format!(
                "'prompt' must be a string, a list of strings or token ids, not a list of {}",
                v.kind().trim_start_matches("a ").trim_start_matches("an ")
            )),
        },
        Some(v) => bad(format!(
            "'prompt' must be a string, a list of strings or token ids, not {}",
            v.kind()
        )),
    }
}

/// A chat's **opening**, hashed: its messages up to and including the
/// first `user` message (roles and texts, each length-prefixed). Every
/// turn of a conversation has the same opening, and conversations that
/// share only a system prompt have different ones: the session key
/// `consistent_hash` falls back to. `None` without messages or a user
/// message (and for a body [`parse`] refuses). Computed only when a
/// policy asks for it.
pub fn opening(body: &Object<'_>) -> Option<u64> {
    let mut h = SeaHasher::new();
    for (i, m) in body.get("messages")?.as_array()?.iter().enumerate() {
        let m = m.as_object()?;
        let role = m.get("role")?.as_str()?;
        let text = super::chat::message_text(i, m.get("content")).ok()?;
        h.write_usize(role.len());
        h.write(role.as_bytes());
        h.write_usize(text.len());
        h.write(text.as_bytes());
        if role == "user" {
            return Some(h.finish());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ParsedRequest<'_>, RequestError> {
        parse(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            &ChatTemplate::canonical(),
            &RequestLimits::default(),
        )
    }

    fn completion(body: &str) -> Result<ParsedRequest<'_>, RequestError> {
        parse(
            Endpoint::Completions,
            body.as_bytes(),
            &ChatTemplate::canonical(),
            &RequestLimits::default(),
        )
    }

    /// The prompt parts the gateway does not tokenize are estimated, and a
    /// batch's other prompts counted (issue 39: they were charged 0 and
    /// escaped the context check). Tools are rendered into the text (issue
    /// 43), so counted with it, not estimated again.
    #[test]
    fn tools_and_a_batchs_other_prompts_are_counted() {
        let tool = r#"{"type":"function","function":{"name":"lookup","description":"Looks a customer up by id.","parameters":{"type":"object","properties":{"id":{"type":"string"}}}}}"#;
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"Hi"}}],"tools":[{tool},{tool}],"response_format":{{"type":"json_object"}}}}"#
        );
        let with_tools = chat(&body).unwrap();
        let extra = with_tools.extra();
        // A small format: ~6 tokens; the tools are in the text.
        assert!((4..=8).contains(&extra.every_prompt), "{extra:?}");
        let RoutingInput::Text(text) = &with_tools.input else {
            panic!("text")
        };
        assert_eq!(text.matches("Looks a customer up by id.").count(), 2, "{text}");
        assert_eq!((extra.other_prompts, extra.prompts), (0, 1));
        let plain = chat(r#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"tools":null}"#).unwrap();
        assert_eq!(plain.extra().every_prompt, 0);
        // A batch: the first routes; the others are counted.
        let batch = completion(r#"{"model":"m","prompt":["first prompt","abcdefgh","ijklmnopqrst"]}"#).unwrap();
        assert_eq!(
            batch.extra(),
            PromptExtra {
                every_prompt: 0,
                other_prompts: 2 + 3,
                prompts: 3
            }
        );
        let ids = completion(r#"{"model":"m","prompt":[[1,2,3],[4,5],[6]]}"#).unwrap();
        assert_eq!((ids.extra().other_prompts, ids.extra().prompts), (3, 3));
        let one = completion(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!((one.extra().other_prompts, one.extra().prompts), (0, 1));
        let n = completion(r#"{"model":"m","prompt":"x","n":3,"best_of":5}"#).unwrap();
        assert_eq!(n.answers(), 5);
    }

    /// A chat's opening is its messages up to the first user message: the
    /// same for every turn of a conversation, different between
    /// conversations that share only a system prompt.
    #[test]
    fn the_opening_is_the_messages_up_to_the_first_user_message() {
        let opening = |b: &str| opening(&chat(b).unwrap().body);
        let sys = r#"{"role":"system","content":"Be brief."}"#;
        let first = opening(&format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"Hi"}}]}}"#
        ));
        let later = opening(&format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"Hi"}},{{"role":"assistant","content":"Hello"}},{{"role":"user","content":"More"}}]}}"#
        ));
        let other = opening(&format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"Yo"}}]}}"#
        ));
        let no_system = opening(r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]}"#);
        let parts = opening(&format!(
            r#"{{"model":"m","messages":[{sys},{{"role":"user","content":[{{"type":"text","text":"Hi"}}]}}]}}"#
        ));
        assert!(first.is_some());
        assert_eq!(first, later, "every turn of a conversation");
        assert_eq!(first, parts, "the same text as parts");
        assert_ne!(first, other, "another first question");
        assert_ne!(first, no_system, "another system prompt");
        // Role and text boundaries count: "ab" + "c" is not "a" + "bc".
        let split = |a: &str, b: &str| {
            opening(&format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{a}"}},{{"role":"user","content":"{b}"}}]}}"#
            ))
        };
        assert_ne!(split("ab", "c"), split("a", "bc"));
        assert_eq!(
            opening(r#"{"model":"m","messages":[{"role":"system","content":"x"}]}"#),
            None
        );
        assert_eq!(
            super::opening(&completion(r#"{"model":"m","prompt":"hi"}"#).unwrap().body),
            None
        );
    }

    #[test]
    fn completion_prompt_forms() {
        fn text(b: &str) -> RoutingInput<'_> {
            completion(b).unwrap().input
        }
        assert_eq!(text(r#"{"model":"m","prompt":"hi"}"#), RoutingInput::Text("hi".into()));
        assert_eq!(
            text(r#"{"model":"m","prompt":["a","b"]}"#),
            RoutingInput::Text("a".into())
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":[1,2,3]}"#),
            RoutingInput::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":[[4,5],[6]]}"#),
            RoutingInput::Tokens(vec![4, 5])
        );
        let r = completion(r#"{"model":"m","prompt":"x","stream":true,"extra":{"k":1}}"#).unwrap();
        assert!(r.stream);
        assert_eq!(r.model, "m");
        let extra = r.body.get("extra").and_then(Json::as_object);
        assert_eq!(
            extra.and_then(|e| e.get("k")).and_then(Json::as_u64),
            Some(1),
            "unknown fields are kept for the backend"
        );
    }

    #[test]
    fn chat_is_rendered_with_the_template_and_turns_extend() {
        let one =
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#;
        let RoutingInput::Text(t1) = chat(one).unwrap().input else {
            panic!("text")
        };
        assert_eq!(t1, "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n");
        let two = r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},
            {"role":"assistant","content":"Hello!"},{"role":"user","content":[{"type":"text","text":"How"},{"type":"image_url","image_url":{}},{"type":"text","text":" are you?"}]}]}"#;
        let RoutingInput::Text(t2) = chat(two).unwrap().input else {
            panic!("text")
        };
        assert!(t2.starts_with(&format!("{t1}Hello!\n")), "{t2:?}");
        // Text parts joined with a newline, as vLLM joins them.
        assert!(t2.contains("How\n are you?"), "{t2:?}");
        assert_eq!(chat(one).unwrap().earlier_answer_bytes, 0);
        assert_eq!(chat(two).unwrap().earlier_answer_bytes, "Hello!".len());
        // An assistant message last (a prefill to continue) is not an earlier answer.
        let last = r#"{"model":"m","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hel"}]}"#;
        assert_eq!(chat(last).unwrap().earlier_answer_bytes, 0);
        // The template's opening: what comes before the first message text.
        assert_eq!(chat(one).unwrap().template_bytes, "<|system|>\n".len());
        let empty_first =
            r#"{"model":"m","messages":[{"role":"system","content":" "},{"role":"user","content":"Hi"}]}"#;
        assert_eq!(
            chat(empty_first).unwrap().template_bytes,
            "<|system|>\n \n<|user|>\n".len()
        );
        assert_eq!(completion(r#"{"model":"m","prompt":"Hi"}"#).unwrap().template_bytes, 0);
        // A long first message, cut inside a multi-byte character.
        let long = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"a{}"}}]}}"#,
            "é".repeat(100)
        );
        assert_eq!(chat(&long).unwrap().template_bytes, "<|user|>\n".len());
        // A tool-calling assistant message has null content.
        assert!(chat(r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[]}]}"#).is_ok());
    }

    #[test]
    fn an_unknown_role_is_openais_400_and_every_known_role_renders() {
        for role in super::super::chat::CHAT_ROLES {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"{role}","content":"Hi"}}]}}"#);
            assert!(chat(&body).is_ok(), "{role}");
        }
        for role in ["narrator", "User", "ipython"] {
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"Hi"}},{{"role":"{role}","content":"x"}}]}}"#
            );
            let e = chat(&body).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
            assert_eq!(e.code, Some("invalid_value"));
            assert!(
                e.message.contains(&format!("messages[1].role: '{role}'")),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn too_many_messages_are_a_400_before_rendering_and_a_long_prompt_a_413() {
        let limits = RequestLimits {
            max_messages: 3,
            max_prompt_bytes: 200,
        };
        let template = ChatTemplate::canonical();
        let messages = |n: usize, text: &str| {
            let m: Vec<String> = (0..n)
                .map(|_| format!(r#"{{"role":"user","content":"{text}"}}"#))
                .collect();
            format!(r#"{{"model":"m","messages":[{}]}}"#, m.join(","))
        };
        assert!(
            parse(
                Endpoint::ChatCompletions,
                messages(3, "hi").as_bytes(),
                &template,
                &limits
            )
            .is_ok()
        );
        let four = messages(4, "hi");
        let e = parse(Endpoint::ChatCompletions, four.as_bytes(), &template, &limits).unwrap_err();
        assert_eq!(
            (e.status, e.param, e.code),
            (
                http::StatusCode::BAD_REQUEST,
                Some("messages"),
                Some("array_above_max_length")
            )
        );
        assert!(
            e.message.contains("maximum length 3, but got an array with length 4"),
            "{}",
            e.message
        );
        assert_eq!(e.body()["error"]["code"], "array_above_max_length");
        // Within the count, a rendered prompt over the size: 413.
        let long = messages(2, &"x".repeat(150));
        let e = parse(Endpoint::ChatCompletions, long.as_bytes(), &template, &limits).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (http::StatusCode::PAYLOAD_TOO_LARGE, Some("prompt_too_large"))
        );
        let prompt = format!(r#"{{"model":"m","prompt":"{}"}}"#, "y".repeat(201));
        let e = parse(Endpoint::Completions, prompt.as_bytes(), &template, &limits).unwrap_err();
        assert_eq!(
            (e.status, e.param),
            (http::StatusCode::PAYLOAD_TOO_LARGE, Some("prompt"))
        );
        // Token ids are not text: no byte limit applies to them.
        let ids = format!(r#"{{"model":"m","prompt":[{}]}}"#, vec!["1"; 300].join(","));
        assert!(parse(Endpoint::Completions, ids.as_bytes(), &template, &limits).is_ok());
    }

    #[test]
    fn malformed_requests_are_400s_naming_the_parameter() {
        let cases: &[(Endpoint, &str, Option<&str>)] = &[
            (Endpoint::Completions, "", None),
            (Endpoint::Completions, "{", None),
            (Endpoint::Completions, "[]", None),
            (Endpoint::Completions, "42", None),
            (Endpoint::Completions, r#"{"prompt":"x"}"#, Some("model")),
            (Endpoint::Completions, r#"{"model":7,"prompt":"x"}"#, Some("model")),
            (Endpoint::Completions, r#"{"model":"","prompt":"x"}"#, Some("model")),
            (Endpoint::Completions, r#"{"model":"m"}"#, Some("prompt")),
            (Endpoint::Completions, r#"{"model":"m","prompt":""}"#, Some("prompt")),
            (Endpoint::Completions, r#"{"model":"m","prompt":[]}"#, Some("prompt")),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":{"a":1}}"#,
                Some("prompt"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":["a",1]}"#,
                Some("prompt"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":[1,-2]}"#,
                Some("prompt"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":[1,2.5]}"#,
                Some("prompt"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":[[1],2]}"#,
                Some("prompt"),
            ),
            (Endpoint::Completions, r#"{"model":"m","prompt":[[]]}"#, Some("prompt")),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","stream":"yes"}"#,
                Some("stream"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","max_tokens":0}"#,
                Some("max_tokens"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","max_tokens":-5}"#,
                Some("max_tokens"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","max_tokens":"10"}"#,
                Some("max_tokens"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","temperature":"hot"}"#,
                Some("temperature"),
            ),
            (Endpoint::Completions, r#"{"model":"m","prompt":"x","n":0}"#, Some("n")),
            (Endpoint::ChatCompletions, r#"{"model":"m"}"#, Some("messages")),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[]}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":"hi"}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":["hi"]}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"content":"hi"}]}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":[5]}]}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}"#,
                Some("messages"),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":1}]}]}"#,
                Some("messages"),
            ),
        ];
        assert!(cases.len() >= 20);
        for (endpoint, body, param) in cases {
            let err = parse(
                *endpoint,
                body.as_bytes(),
                &ChatTemplate::canonical(),
                &RequestLimits::default(),
            )
            .expect_err(body);
            assert_eq!(err.param, *param, "{body}: {}", err.message);
            assert_eq!(err.body()["error"]["type"], "invalid_request_error");
            assert!(!err.message.is_empty());
        }
    }
}
