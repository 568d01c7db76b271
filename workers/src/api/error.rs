//! [`ApiError`]: an error answered to the client, its constructors for
//! each status the simulator answers (400, 404, 405, 409, 413, 5xx) and
//! its JSON body: OpenAI's, SGLang's for the errors of SGLang's
//! disaggregated serving, or Anthropic's on `/v1/messages`
//! ([`ErrorFormat`]).

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;

use crate::engine::SubmitError;

/// The shape of an error body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorFormat {
    /// OpenAI's (and vLLM's): `{"error": {"message", "type", "param", "code"}}`.
    #[default]
    OpenAi,
    /// SGLang's `ErrorResponse`: `{"object": "error", "message", "type",
    /// "param", "code"}`, `type` the exception's name (`BadRequestError`,
    /// `InternalServerError`) and `code` the HTTP status.
    Sglang,
    /// Anthropic's: `{"type": "error", "error": {"type", "message"}}`,
    /// the error `type` named after the status (`invalid_request_error`,
    /// `not_found_error`, `request_too_large`, `api_error`, ...).
    Anthropic,
}

/// Anthropic's error type for an HTTP status.
pub fn anthropic_error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 409 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An error answered to the client, with an OpenAI-style body:
/// `{"error": {"message", "type", "param", "code"}}` (or SGLang's, see
/// [`ErrorFormat`]).
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
    /// The body's shape.
    pub format: ErrorFormat,
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
            format: ErrorFormat::OpenAi,
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
            format: ErrorFormat::OpenAi,
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
            format: ErrorFormat::OpenAi,
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
            format: ErrorFormat::OpenAi,
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
            format: ErrorFormat::OpenAi,
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
            format: ErrorFormat::OpenAi,
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
            format: ErrorFormat::OpenAi,
        }
    }

    /// 404 for a `previous_response_id` the store does not hold (vLLM's
    /// answer).
    pub fn response_not_found(id: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("Response with id '{id}' not found."),
            kind: "invalid_request_error",
            param: Some("previous_response_id".into()),
            code: Some("response_not_found"),
            format: ErrorFormat::OpenAi,
        }
    }

    /// The same error in Anthropic's shape.
    pub fn in_anthropic_format(mut self) -> Self {
        self.format = ErrorFormat::Anthropic;
        self
    }

    /// The same error in SGLang's shape.
    pub fn in_sglang_format(mut self) -> Self {
        self.format = ErrorFormat::Sglang;
        self
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
        if self.format == ErrorFormat::Anthropic {
            let body = serde_json::json!({
                "type": "error",
                "error": {"type": anthropic_error_type(self.status), "message": self.message},
            });
            return Bytes::from(body.to_string());
        }
        if self.format == ErrorFormat::Sglang {
            let kind = match self.status {
                StatusCode::BAD_REQUEST => "BadRequestError",
                StatusCode::NOT_FOUND => "NotFoundError",
                StatusCode::INTERNAL_SERVER_ERROR => "InternalServerError",
                _ => self.kind,
            };
            let body = serde_json::json!({
                "object": "error",
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status.as_u16(),
            });
            return Bytes::from(body.to_string());
        }
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
