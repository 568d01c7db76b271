//! A request the gateway refuses before it reaches an engine: an
//! OpenAI-style `invalid_request_error` (Anthropic's shape on
//! `/v1/messages`: [`super::anthropic::error_body`]).

use serde_json::Value;

/// A request the gateway refuses: an OpenAI-style `invalid_request_error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// Human-readable message.
    pub message: String,
    /// The offending parameter, if one.
    pub param: Option<&'static str>,
    /// The status: 400, or 413 for a prompt over the size limit.
    pub status: http::StatusCode,
    /// OpenAI's error code, where it has one.
    pub code: Option<&'static str>,
}

impl RequestError {
    /// A 400 `invalid_request_error` naming `param`.
    pub(crate) fn new(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            message: message.into(),
            param,
            status: http::StatusCode::BAD_REQUEST,
            code: None,
        }
    }

    /// OpenAI's 404 for a model the gateway does not serve.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            param: Some("model"),
            status: http::StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
        }
    }

    /// 403 for a model the caller's key may not use ([`crate::tenancy::auth`]).
    pub fn model_not_allowed(model: &str) -> Self {
        Self {
            message: format!("Your API key may not use the model `{model}`."),
            param: Some("model"),
            status: http::StatusCode::FORBIDDEN,
            code: Some("model_not_allowed"),
        }
    }

    /// The JSON error body (`{"error": {...}}`).
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// 400 `array_above_max_length` (as OpenAI answers) for a list of `len`
/// messages or items, `param`, longer than `max`.
pub(crate) fn check_message_count(len: usize, max: usize, param: &'static str) -> Result<(), RequestError> {
    if len <= max {
        return Ok(());
    }
    Err(RequestError {
        code: Some("array_above_max_length"),
        ..RequestError::new(
            format!(
                "Invalid '{param}': array too long. Expected an array with maximum length {max}, but got an array with length {len} instead."
            ),
            Some(param),
        )
    })
}
