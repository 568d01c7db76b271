//! `POST /v1/completions` requests: the prompt in its four forms (text,
//! one text in an array, token ids, one array of token ids) and the
//! request's other fields.

use serde_json::Value;

use super::fields::{field, opt_bool, opt_limit, opt_string, parse_object, wrong_type};
use super::params::common_params;
use super::{ApiError, GenParams};

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

/// The prompt of a completions request (`prompt`), in any of its forms.
pub(super) fn parse_prompt(value: Option<&Value>) -> Result<Prompt, ApiError> {
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
