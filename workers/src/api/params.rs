//! Generation parameters both endpoints share ([`GenParams`], with the
//! type checks of the sampling parameters the simulator ignores), the
//! output-length override header and the output-length rule
//! ([`output_length`], see the module docs).

use serde::Serialize;
use serde_json::{Map, Value};

use super::fields::{check_n, field, opt_bool, opt_number, opt_string, wrong_type};
use super::{ApiError, OUTPUT_TOKENS_HEADER};

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

/// The parameters both endpoints share, and the type checks of the ignored
/// sampling parameters.
pub(super) fn common_params(obj: &Map<String, Value>, max_tokens: Option<u32>) -> Result<GenParams, ApiError> {
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
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The answer ended by itself.
    Stop,
    /// The answer hit `max_tokens`.
    Length,
    /// The answer is a tool call (chat: `tool_calls`).
    ToolCalls,
}

/// Where the answer would end by itself, with no `max_tokens` (see the
/// module docs): the override header's length, else the default; none
/// with `ignore_eos` and no header.
pub fn natural_length(params: &GenParams, override_tokens: Option<u32>, default_output_tokens: u32) -> Option<u32> {
    override_tokens.or((!params.ignore_eos).then_some(default_output_tokens))
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
