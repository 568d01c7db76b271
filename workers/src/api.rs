//! The OpenAI API as `semlb-sim` speaks it: request parsing and validation
//! for `POST /v1/completions` and `POST /v1/chat/completions`, the response
//! and streaming-chunk types, and OpenAI-style error bodies.
//!
//! # Requests
//!
//! Bodies are parsed with `serde_json` into a [`serde_json::Value`] and then
//! checked field by field, so that every problem becomes a 400 with an
//! OpenAI error body naming the offending `param` (never a panic, never a
//! 5xx). Unknown fields are ignored: OpenAI clients send many. Sampling
//! parameters (`temperature`, `top_p`, `top_k`, `seed`, penalties, `stop`,
//! `logprobs`, ...) are type-checked where their type is simple and
//! otherwise ignored; the simulator's answers do not depend on them.
//!
//! | field | completions | chat | accepted |
//! | --- | --- | --- | --- |
//! | `model` | ✓ | ✓ | optional; if given it must be the served name, else **404** (as vLLM) |
//! | `prompt` | ✓ | | string, `[string]` (one element), `[int]` token ids, `[[int]]` (one element); not empty |
//! | `messages` | | ✓ | non-empty array of `{role, content}`; content is a string, `null`, or an array of `{"type": "text", "text": ...}` parts (joined with `\n`) |
//! | `max_tokens` | ✓ | ✓ | integer ≥ 1 or `null` |
//! | `max_completion_tokens` | | ✓ | integer ≥ 1 or `null`; wins over `max_tokens` |
//! | `stream` | ✓ | ✓ | boolean |
//! | `stream_options.include_usage` | ✓ | ✓ | boolean: a final chunk with empty `choices` and `usage` |
//! | `n`, `best_of` | ✓ | ✓ | only 1 (`n > 1 is not supported`) |
//! | `ignore_eos` | ✓ | ✓ | boolean (vLLM extension) |
//! | `cache_salt` | ✓ | ✓ | non-empty string (vLLM extension): mixed into the prefix cache's first block, so requests with different salts share no cached block |
//! | `echo` | ✓ | | only `false` |
//! | `user` | ✓ | ✓ | string, ignored |
//!
//! # Output length
//!
//! [`output_length`] decides how many tokens an answer has:
//!
//! 1. the `x-semlb-output-tokens: N` request header (a benchmark override,
//!    so a replayed trace gets its real output lengths) wins, capped by
//!    `max_tokens` if given;
//! 2. else, with `ignore_eos: true` and `max_tokens` given, exactly
//!    `max_tokens`;
//! 3. else `min(max_tokens, default_output_tokens)` (`default_output_tokens`
//!    alone without `max_tokens`).
//!
//! `finish_reason` is `"length"` when the output length equals a given
//! `max_tokens`, else `"stop"`.
//!
//! # Responses
//!
//! Shapes follow OpenAI (and vLLM): `text_completion` and `chat.completion`
//! objects with `choices[{index, text | message, finish_reason, logprobs:
//! null}]` and `usage {prompt_tokens, completion_tokens, total_tokens,
//! prompt_tokens_details: {cached_tokens}}`; streaming chunks
//! `text_completion` / `chat.completion.chunk`, the last token's chunk
//! carrying `finish_reason` (as vLLM does), then, with `include_usage`, a
//! chunk with empty `choices` and the usage (all other chunks then carry
//! `"usage": null`, as OpenAI does), then `data: [DONE]`.

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::engine::{SubmitError, Usage};
use semlb_tokenizer::chat::ChatMessage;

/// Header that overrides the output length (see [`output_length`]).
pub const OUTPUT_TOKENS_HEADER: &str = "x-semlb-output-tokens";

/// Response header with the simulated time to first token in milliseconds
/// (queueing + prefill, in simulated time, e.g. `12.345`).
pub const SIM_TTFT_HEADER: &str = "x-semlb-sim-ttft-ms";

/// Response header with the prompt tokens served from the prefix cache.
pub const SIM_CACHED_TOKENS_HEADER: &str = "x-semlb-sim-cached-tokens";

/// The last event of a server-sent-event stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// An error answered to the client, with an OpenAI-style body:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error `type` (`invalid_request_error`, `server_error`).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// OpenAI error `code` (`model_not_found`, `context_length_exceeded`, ...), if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    /// The same error with an OpenAI `code`.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 404 for a `model` that is not the served one (what vLLM answers).
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 404 for an unknown path.
    pub fn path_not_found(method: &str, path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("Not found: {method} {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    /// 409 for an operation the engine cannot do in its current state
    /// (resetting the prefix cache while requests hold blocks).
    pub fn busy(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::CONFLICT,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("busy"),
        }
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("Method {method} is not allowed for {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    /// 413 for a request body over the size limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("The request body exceeds {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A 5xx `server_error` (injected faults, engine gone).
    pub fn server_error(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The 400 for a request the engine refused. `param` is the prompt's
    /// field (`prompt` or `messages`).
    pub fn from_submit(error: &SubmitError, param: &str) -> Self {
        let e = Self::bad_request(error.to_string(), Some(param));
        match error {
            SubmitError::TooLong { .. } | SubmitError::ExceedsKvCapacity { .. } => {
                e.with_code("context_length_exceeded")
            }
            SubmitError::EmptyPrompt | SubmitError::NoOutput => e,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Bytes {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct Outer<'a> {
            error: Inner<'a>,
        }
        let body = Outer {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
    }
}

/// Generation parameters shared by both endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GenParams {
    /// `max_tokens` (chat: `max_completion_tokens` if given), at least 1.
    pub max_tokens: Option<u32>,
    /// Answer as server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `ignore_eos` (vLLM extension): generate exactly `max_tokens`.
    pub ignore_eos: bool,
    /// `cache_salt` (vLLM extension), hashed: requests with different
    /// salts share no cached prefix block.
    pub cache_salt: Option<u64>,
}

/// The prompt of a completion request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text, to tokenize.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// A validated `POST /v1/completions` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The prompt (never empty).
    pub prompt: Prompt,
    /// Generation parameters.
    pub params: GenParams,
}

/// A validated `POST /v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The messages, content flattened to text (never empty).
    pub messages: Vec<ChatMessage<'static>>,
    /// Generation parameters.
    pub params: GenParams,
}

/// Parses the body as a JSON object.
pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request("The request body must be a JSON object", None)),
        Err(e) => Err(ApiError::bad_request(
            format!("The request body is not valid JSON: {e}"),
            None,
        )),
    }
}

/// The JSON type name of `v`, for messages.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub(crate) fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::bad_request(
        format!("`{param}` must be {expected}, not {}", type_name(got)),
        Some(param),
    )
}

/// A field that is absent or `null` → `None`.
pub(crate) fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(key, "a boolean", other)),
    }
}

pub(crate) fn opt_string(obj: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(wrong_type(key, "a string", other)),
    }
}

pub(crate) fn opt_int(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            // Integers beyond i64 saturate; fractions are refused.
            None if n.as_u64().is_some() => Ok(Some(i64::MAX)),
            None => Err(wrong_type(key, "an integer", v)),
        },
        Some(other) => Err(wrong_type(key, "an integer", other)),
    }
}

fn opt_number(obj: &Map<String, Value>, key: &str) -> Result<(), ApiError> {
    match field(obj, key) {
        None | Some(Value::Number(_)) => Ok(()),
        Some(other) => Err(wrong_type(key, "a number", other)),
    }
}

/// A token-count limit: integer ≥ 1.
fn opt_limit(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, ApiError> {
    match opt_int(obj, key)? {
        None => Ok(None),
        Some(i) if i < 1 => Err(ApiError::bad_request(
            format!("`{key}` must be at least 1, got {i}"),
            Some(key),
        )),
        Some(i) => Ok(Some(u32::try_from(i).unwrap_or(u32::MAX))),
    }
}

/// Checks `n` / `best_of`: only 1 is supported.
fn check_n(obj: &Map<String, Value>, key: &str) -> Result<(), ApiError> {
    match opt_int(obj, key)? {
        None | Some(1) => Ok(()),
        Some(n) if n > 1 => Err(ApiError::bad_request(format!("{key} > 1 is not supported"), Some(key))),
        Some(n) => Err(ApiError::bad_request(
            format!("`{key}` must be at least 1, got {n}"),
            Some(key),
        )),
    }
}

/// The parameters both endpoints share, and the type checks of the ignored
/// sampling parameters.
fn common_params(obj: &Map<String, Value>, max_tokens: Option<u32>) -> Result<GenParams, ApiError> {
    check_n(obj, "n")?;
    check_n(obj, "best_of")?;
    for key in [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "seed",
        "min_tokens",
    ] {
        opt_number(obj, key)?;
    }
    opt_string(obj, "user")?;
    match field(obj, "stop") {
        None | Some(Value::String(_)) => {}
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {}
        Some(other) => return Err(wrong_type("stop", "a string or an array of strings", other)),
    }
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(options)) => match field(options, "include_usage") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(wrong_type("stream_options.include_usage", "a boolean", other)),
        },
        Some(other) => return Err(wrong_type("stream_options", "an object", other)),
    };
    let ignore_eos = opt_bool(obj, "ignore_eos")?.unwrap_or(false);
    let cache_salt = match opt_string(obj, "cache_salt")? {
        Some(salt) if salt.is_empty() => {
            return Err(ApiError::bad_request(
                "`cache_salt` must not be empty",
                Some("cache_salt"),
            ));
        }
        salt => salt.map(|s| seahash::hash(s.as_bytes())),
    };
    Ok(GenParams {
        max_tokens,
        stream,
        include_usage,
        ignore_eos,
        cache_salt,
    })
}

/// Token ids of a JSON array of integers, or `None` if it is not one.
fn token_ids(items: &[Value]) -> Option<Result<Vec<u32>, ApiError>> {
    if !items.iter().all(Value::is_number) {
        return None;
    }
    Some(
        items
            .iter()
            .map(|v| {
                v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                    ApiError::bad_request(
                        format!("`prompt` token ids must be integers in 0..2^32, got {v}"),
                        Some("prompt"),
                    )
                })
            })
            .collect(),
    )
}

fn empty_prompt() -> ApiError {
    ApiError::bad_request("The prompt is empty", Some("prompt"))
}

fn parse_prompt(value: Option<&Value>) -> Result<Prompt, ApiError> {
    let one_prompt = || ApiError::bad_request("Only one prompt per request is supported", Some("prompt"));
    let expected = "a string, an array of one string, an array of token ids or an array of one array of token ids";
    let prompt = match value {
        None => return Err(ApiError::bad_request("`prompt` is required", Some("prompt"))),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) if items.is_empty() => return Err(empty_prompt()),
        Some(Value::Array(items)) => {
            if let Some(ids) = token_ids(items) {
                Prompt::Tokens(ids?)
            } else if items.len() > 1 {
                return Err(one_prompt());
            } else {
                match &items[0] {
                    Value::String(s) => Prompt::Text(s.clone()),
                    Value::Array(inner) => match token_ids(inner) {
                        Some(ids) => Prompt::Tokens(ids?),
                        None => {
                            return Err(ApiError::bad_request(
                                format!("`prompt` must be {expected}"),
                                Some("prompt"),
                            ));
                        }
                    },
                    other => return Err(wrong_type("prompt", expected, other)),
                }
            }
        }
        Some(other) => return Err(wrong_type("prompt", expected, other)),
    };
    match &prompt {
        Prompt::Text(s) if s.is_empty() => Err(empty_prompt()),
        Prompt::Tokens(ids) if ids.is_empty() => Err(empty_prompt()),
        _ => Ok(prompt),
    }
}

impl CompletionRequest {
    /// Parses and validates a request body.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let prompt = parse_prompt(field(&obj, "prompt"))?;
        if opt_bool(&obj, "echo")? == Some(true) {
            return Err(ApiError::bad_request("echo is not supported", Some("echo")));
        }
        match field(&obj, "logprobs") {
            None | Some(Value::Number(_)) => {}
            Some(other) => return Err(wrong_type("logprobs", "an integer", other)),
        }
        let max_tokens = opt_limit(&obj, "max_tokens")?;
        let params = common_params(&obj, max_tokens)?;
        Ok(Self { model, prompt, params })
    }
}

/// A validated `POST /v1/embeddings` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// `input`: one text or token-id list (a batch of several is refused,
    /// as `prompt`'s).
    pub input: Prompt,
}

/// Length of the simulator's embeddings.
pub const EMBEDDING_DIMENSIONS: usize = 16;

impl EmbeddingRequest {
    /// Parses and validates a request body (`input` takes the forms of
    /// a completions `prompt`).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let input = parse_prompt(field(&obj, "input")).map_err(|e| ApiError {
            message: e
                .message
                .replace("`prompt`", "`input`")
                .replace("The prompt", "The input"),
            param: Some("input".into()),
            ..e
        })?;
        Ok(Self { model, input })
    }
}

/// The answer to an embeddings request of `tokens` for `model`: a unit
/// vector of [`EMBEDDING_DIMENSIONS`] drawn from the tokens (the same
/// tokens, the same vector), and the usage.
pub fn embedding_body(model: &str, tokens: &[u32]) -> Bytes {
    let mut state = seahash::hash(&tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>());
    let mut vector: Vec<f64> = (0..EMBEDDING_DIMENSIONS)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        })
        .collect();
    let norm = vector.iter().map(|x| x * x).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
    vector.iter_mut().for_each(|x| *x /= norm);
    let body = serde_json::json!({
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": model,
        "usage": {"prompt_tokens": tokens.len(), "total_tokens": tokens.len()},
    });
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
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

/// Parses the `x-semlb-output-tokens` header value: an integer ≥ 1.
pub fn parse_output_override(value: &[u8]) -> Result<u32, ApiError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .filter(|n| *n >= 1)
        .ok_or_else(|| {
            ApiError::bad_request(
                format!(
                    "The {OUTPUT_TOKENS_HEADER} header must be an integer from 1 to {}",
                    u32::MAX
                ),
                Some(OUTPUT_TOKENS_HEADER),
            )
        })
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// The answer ended by itself.
    Stop,
    /// The answer hit `max_tokens`.
    Length,
}

/// The output length and finish reason of a request (see the module docs).
pub fn output_length(
    params: &GenParams,
    override_tokens: Option<u32>,
    default_output_tokens: u32,
) -> (u32, FinishReason) {
    let n = match (override_tokens, params.max_tokens) {
        (Some(o), Some(max)) => o.min(max),
        (Some(o), None) => o,
        (None, Some(max)) if params.ignore_eos => max,
        (None, Some(max)) => max.min(default_output_tokens),
        (None, None) => default_output_tokens,
    };
    let finish = if params.max_tokens == Some(n) {
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    (n, finish)
}

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Endpoint {
    /// The request field that holds the prompt (for error `param`s).
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::Chat => "messages",
        }
    }

    /// Prefix of response ids (`cmpl-`, `chatcmpl-`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Completions => "cmpl-",
            Endpoint::Chat => "chatcmpl-",
        }
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UsageBody {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
    /// Cached prompt tokens.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl From<Usage> for UsageBody {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens.saturating_add(u.completion_tokens),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// What identifies one response: id, creation time, model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseMeta {
    /// Which endpoint.
    pub endpoint: Endpoint,
    /// `id` (`cmpl-…` / `chatcmpl-…`).
    pub id: String,
    /// `created`, Unix seconds.
    pub created: u64,
    /// `model`.
    pub model: String,
}

/// The assistant message of a chat answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The answer.
    pub content: String,
}

/// One choice of a non-streaming answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// Always 0.
    pub index: u32,
    /// Completions: the text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Chat: the message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    /// Always `null`.
    pub logprobs: Option<()>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
}

/// A non-streaming answer (`text_completion` or `chat.completion`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CompletionResponse {
    /// Response id.
    pub id: String,
    /// `text_completion` or `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: UsageBody,
}

impl CompletionResponse {
    /// The answer `text` for `meta`'s endpoint.
    pub fn new(meta: &ResponseMeta, text: String, finish_reason: FinishReason, usage: Usage) -> Self {
        let (object, text, message) = match meta.endpoint {
            Endpoint::Completions => ("text_completion", Some(text), None),
            Endpoint::Chat => (
                "chat.completion",
                None,
                Some(AssistantMessage {
                    role: "assistant",
                    content: text,
                }),
            ),
        };
        Self {
            id: meta.id.clone(),
            object,
            created: meta.created,
            model: meta.model.clone(),
            choices: vec![Choice {
                index: 0,
                text,
                message,
                logprobs: None,
                finish_reason,
            }],
            usage: usage.into(),
        }
    }
}

/// `delta` of a chat chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Delta {
    /// `assistant` in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// The token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a streaming chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// Completions: the token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Chat: the delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    /// Always `null`.
    pub logprobs: Option<()>,
    /// Set on the last token's chunk, else `null`.
    pub finish_reason: Option<FinishReason>,
}

/// One streaming chunk (`text_completion` or `chat.completion.chunk`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// Response id (the same in every chunk).
    pub id: String,
    /// `text_completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Absent without `include_usage`; with it, `null` except in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageBody>>,
}

impl Chunk {
    fn with_choices(meta: &ResponseMeta, choices: Vec<ChunkChoice>, usage: Option<Option<UsageBody>>) -> Self {
        let object = match meta.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        Self {
            id: meta.id.clone(),
            object,
            created: meta.created,
            model: meta.model.clone(),
            choices,
            usage,
        }
    }

    /// The first chunk of a chat stream: `delta: {role: "assistant", content: ""}`.
    pub fn chat_role(meta: &ResponseMeta, include_usage: bool) -> Self {
        let delta = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
        };
        let choice = ChunkChoice {
            index: 0,
            text: None,
            delta: Some(delta),
            logprobs: None,
            finish_reason: None,
        };
        Self::with_choices(meta, vec![choice], include_usage.then_some(None))
    }

    /// The chunk of one token's `text`; `finish_reason` on the last one.
    pub fn token(meta: &ResponseMeta, text: String, finish_reason: Option<FinishReason>, include_usage: bool) -> Self {
        let (text, delta) = match meta.endpoint {
            Endpoint::Completions => (Some(text), None),
            Endpoint::Chat => (
                None,
                Some(Delta {
                    role: None,
                    content: Some(text),
                }),
            ),
        };
        let choice = ChunkChoice {
            index: 0,
            text,
            delta,
            logprobs: None,
            finish_reason,
        };
        Self::with_choices(meta, vec![choice], include_usage.then_some(None))
    }

    /// The final chunk with `include_usage`: no choices, the usage.
    pub fn usage(meta: &ResponseMeta, usage: Usage) -> Self {
        Self::with_choices(meta, Vec::new(), Some(Some(usage.into())))
    }

    /// The chunk as one server-sent event: `data: {json}\n\n`.
    pub fn to_sse(&self) -> Bytes {
        let mut out = b"data: ".to_vec();
        // Serializing these plain structs cannot fail.
        serde_json::to_writer(&mut out, self).unwrap_or_default();
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}

/// `GET /props` as `llama-server` (b11434) answers it, with the fields a
/// gateway reads: `total_slots` (requests run at once) and each slot's
/// context (`default_generation_settings.n_ctx`).
pub fn props_body(model: &str, total_slots: u32, n_ctx: u32) -> Bytes {
    let body = serde_json::json!({
        "default_generation_settings": {"n_ctx": n_ctx},
        "total_slots": total_slots,
        "model_alias": model,
        "model_path": model,
        "endpoint_slots": false,
        "endpoint_props": false,
        "endpoint_metrics": true,
        "build_info": concat!("semlb-sim-", env!("CARGO_PKG_VERSION")),
        "is_sleeping": false,
    });
    Bytes::from(body.to_string())
}

/// `GET /v1/models`: the served model, then its LoRA adapters (with the
/// model as `parent`, as vLLM lists them).
pub fn models_body<'a>(model: &'a str, adapters: &'a [String], created: u64, max_model_len: u32) -> Bytes {
    #[derive(Serialize)]
    struct Model<'a> {
        id: &'a str,
        object: &'a str,
        created: u64,
        owned_by: &'a str,
        root: &'a str,
        parent: Option<&'a str>,
        max_model_len: u32,
    }
    #[derive(Serialize)]
    struct List<'a> {
        object: &'a str,
        data: Vec<Model<'a>>,
    }
    let entry = |id: &'a str, parent: Option<&'a str>| Model {
        id,
        object: "model",
        created,
        owned_by: "semlb-sim",
        root: id,
        parent,
        max_model_len,
    };
    let data = std::iter::once(entry(model, None))
        .chain(adapters.iter().map(|a| entry(a, Some(model))))
        .collect();
    Bytes::from(serde_json::to_vec(&List { object: "list", data }).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
        CompletionRequest::parse(body.as_bytes())
    }

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(body.as_bytes())
    }

    fn err_param(r: Result<impl std::fmt::Debug, ApiError>) -> (StatusCode, Option<String>, String) {
        let e = r.expect_err("should be refused");
        (e.status, e.param, e.message)
    }

    #[test]
    fn prompt_forms() {
        assert_eq!(
            completion(r#"{"prompt":"hi"}"#).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            completion(r#"{"prompt":["hi"]}"#).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            completion(r#"{"prompt":[1,2,3]}"#).unwrap().prompt,
            Prompt::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            completion(r#"{"prompt":[[4,5]]}"#).unwrap().prompt,
            Prompt::Tokens(vec![4, 5])
        );
        for bad in [
            r#"{"prompt":""}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":[""]}"#,
            r#"{"prompt":[[]]}"#,
            r#"{"prompt":["a","b"]}"#,
            r#"{"prompt":[[1],[2]]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[1.5]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":5}"#,
            r#"{"prompt":{"a":1}}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[true]}"#,
            r#"{"prompt":null}"#,
            r#"{}"#,
        ] {
            let (status, param, _) = err_param(completion(bad));
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(param.as_deref(), Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn malformed_bodies_are_400() {
        for bad in ["", "{", "[1]", "\"x\"", "null", "{\"prompt\":\"a\",}"] {
            assert_eq!(err_param(completion(bad)).0, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(err_param(chat(bad)).0, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn parameters_are_checked_and_unknown_fields_ignored() {
        let r = completion(
            r#"{"model":"m","prompt":"x","max_tokens":7,"stream":true,"stream_options":{"include_usage":true},
                "ignore_eos":true,"temperature":0.7,"top_p":1,"n":1,"user":"u","stop":["a"],"whatever":{"x":[1]}}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(
            r.params,
            GenParams {
                max_tokens: Some(7),
                stream: true,
                include_usage: true,
                ignore_eos: true,
                cache_salt: None,
            }
        );
        assert_eq!(
            completion(r#"{"prompt":"x","max_tokens":null}"#)
                .unwrap()
                .params
                .max_tokens,
            None
        );
        assert_eq!(
            completion(r#"{"prompt":"x","max_tokens":1e30}"#)
                .map(|_| ())
                .unwrap_err()
                .param
                .as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            completion(r#"{"prompt":"x","max_tokens":99999999999}"#)
                .unwrap()
                .params
                .max_tokens,
            Some(u32::MAX)
        );
        for (bad, param) in [
            (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":-3}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":"5"}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":2.5}"#, "max_tokens"),
            (r#"{"prompt":"x","stream":"yes"}"#, "stream"),
            (r#"{"prompt":"x","stream_options":true}"#, "stream_options"),
            (
                r#"{"prompt":"x","stream_options":{"include_usage":1}}"#,
                "stream_options.include_usage",
            ),
            (r#"{"prompt":"x","n":2}"#, "n"),
            (r#"{"prompt":"x","n":0}"#, "n"),
            (r#"{"prompt":"x","best_of":3}"#, "best_of"),
            (r#"{"prompt":"x","temperature":"hot"}"#, "temperature"),
            (r#"{"prompt":"x","model":3}"#, "model"),
            (r#"{"prompt":"x","echo":true}"#, "echo"),
            (r#"{"prompt":"x","stop":[1]}"#, "stop"),
            (r#"{"prompt":"x","ignore_eos":"no"}"#, "ignore_eos"),
        ] {
            let (status, p, msg) = err_param(completion(bad));
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(p.as_deref(), Some(param), "{bad}: {msg}");
        }
        assert_eq!(
            err_param(completion(r#"{"prompt":"x","n":2}"#)).2,
            "n > 1 is not supported"
        );
    }

    #[test]
    fn chat_messages() {
        let r = chat(
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null,"tool_calls":[]}],"max_tokens":5,"max_completion_tokens":9}"#,
        )
        .unwrap();
        let msgs: Vec<(&str, &str)> = r
            .messages
            .iter()
            .map(|m| (m.role.as_ref(), m.content.as_ref()))
            .collect();
        assert_eq!(msgs, [("system", "s"), ("user", "a\nb"), ("assistant", "")]);
        assert_eq!(r.params.max_tokens, Some(9));
        for (bad, param) in [
            (r#"{}"#, "messages"),
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":"hi"}"#, "messages"),
            (r#"{"messages":["hi"]}"#, "messages[0]"),
            (r#"{"messages":[{"content":"hi"}]}"#, "messages[0].role"),
            (r#"{"messages":[{"role":1,"content":"hi"}]}"#, "messages[0].role"),
            (r#"{"messages":[{"role":"user","content":5}]}"#, "messages[0].content"),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
                "messages[0].content[0]",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
                "messages[0].content[0]",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"text","text":3}]}]}"#,
                "messages[0].content[0].text",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#,
                "max_completion_tokens",
            ),
            (r#"{"messages":[{"role":"user","content":"x"}],"n":5}"#, "n"),
        ] {
            let (status, p, msg) = err_param(chat(bad));
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(p.as_deref(), Some(param), "{bad}: {msg}");
        }
    }

    #[test]
    fn output_length_rule() {
        let p = |max_tokens, ignore_eos| GenParams {
            max_tokens,
            ignore_eos,
            ..GenParams::default()
        };
        use FinishReason::*;
        // Override wins, capped by max_tokens.
        assert_eq!(output_length(&p(None, false), Some(300), 128), (300, Stop));
        assert_eq!(output_length(&p(Some(50), false), Some(300), 128), (50, Length));
        assert_eq!(output_length(&p(Some(500), true), Some(300), 128), (300, Stop));
        // ignore_eos with max_tokens: exactly max_tokens.
        assert_eq!(output_length(&p(Some(500), true), None, 128), (500, Length));
        // Otherwise min(max_tokens, default).
        assert_eq!(output_length(&p(Some(500), false), None, 128), (128, Stop));
        assert_eq!(output_length(&p(Some(20), false), None, 128), (20, Length));
        assert_eq!(output_length(&p(Some(128), false), None, 128), (128, Length));
        assert_eq!(output_length(&p(None, true), None, 128), (128, Stop));
        assert_eq!(output_length(&p(None, false), None, 128), (128, Stop));
    }

    #[test]
    fn output_override_header() {
        assert_eq!(parse_output_override(b"42").unwrap(), 42);
        assert_eq!(parse_output_override(b" 7 ").unwrap(), 7);
        for bad in [&b"0"[..], b"-1", b"x", b"", b"99999999999", b"\xff"] {
            assert_eq!(
                parse_output_override(bad).unwrap_err().param.as_deref(),
                Some(OUTPUT_TOKENS_HEADER)
            );
        }
    }

    #[test]
    fn response_shapes() {
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 3,
            cached_tokens: 8,
        };
        let meta = |endpoint| ResponseMeta {
            endpoint,
            id: "x-1".into(),
            created: 5,
            model: "m".into(),
        };
        let v = serde_json::to_value(CompletionResponse::new(
            &meta(Endpoint::Completions),
            "abc".into(),
            FinishReason::Length,
            usage,
        ))
        .unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id":"x-1","object":"text_completion","created":5,"model":"m",
                "choices":[{"index":0,"text":"abc","logprobs":null,"finish_reason":"length"}],
                "usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":8}}})
        );
        let v = serde_json::to_value(CompletionResponse::new(
            &meta(Endpoint::Chat),
            "abc".into(),
            FinishReason::Stop,
            usage,
        ))
        .unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["choices"][0]["message"],
            serde_json::json!({"role":"assistant","content":"abc"})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["choices"][0].get("text").is_none());

        let sse = Chunk::chat_role(&meta(Endpoint::Chat), false).to_sse();
        let s = std::str::from_utf8(&sse).unwrap();
        assert!(s.starts_with("data: {") && s.ends_with("}\n\n"));
        let v: Value = serde_json::from_str(&s[6..]).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(
            v["choices"][0]["delta"],
            serde_json::json!({"role":"assistant","content":""})
        );
        assert!(v.get("usage").is_none());

        let c = Chunk::token(
            &meta(Endpoint::Completions),
            " a".into(),
            Some(FinishReason::Stop),
            true,
        );
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " a");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"], Value::Null);
        assert!(v.as_object().unwrap().contains_key("usage"));

        let v = serde_json::to_value(Chunk::usage(&meta(Endpoint::Chat), usage)).unwrap();
        assert_eq!(v["choices"], serde_json::json!([]));
        assert_eq!(v["usage"]["total_tokens"], 13);
    }

    #[test]
    fn error_body_shape() {
        let e = ApiError::bad_request("nope", Some("prompt")).with_code("context_length_exceeded");
        let v: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error":{"message":"nope","type":"invalid_request_error","param":"prompt","code":"context_length_exceeded"}})
        );
        let v: Value = serde_json::from_slice(&ApiError::model_not_found("x").body()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
    }
}
