//! Non-streaming answers: which endpoint a response is for, its `usage`,
//! and the `text_completion` / `chat.completion` object.

use serde::Serialize;

use super::FinishReason;
use crate::engine::Usage;

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
