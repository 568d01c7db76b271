//! Non-streaming answers: which endpoint a response is for, its `usage`,
//! and the `text_completion` / `chat.completion` object (a chat answer's
//! message holds text, or a tool call with `content: null`).

use serde::Serialize;

use super::{FinishReason, ToolCall};
use crate::engine::Usage;

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/responses` (OpenAI's Responses API).
    Responses,
    /// `/v1/messages` (Anthropic's Messages API).
    Messages,
}

impl Endpoint {
    /// The request field that holds the prompt (for error `param`s).
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::Chat | Endpoint::Messages => "messages",
            Endpoint::Responses => "input",
        }
    }

    /// Prefix of response ids (`cmpl-`, `chatcmpl-`, `resp_`, `msg_`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Completions => "cmpl-",
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Responses => "resp_",
            Endpoint::Messages => "msg_",
        }
    }

    /// Whether the request is a conversation rendered by the chat template.
    pub fn is_chat(self) -> bool {
        self != Endpoint::Completions
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
    /// `id` (`cmpl-…`, `chatcmpl-…`, `resp_…`, `msg_…`).
    pub id: String,
    /// `created`, Unix seconds.
    pub created: u64,
    /// `model`.
    pub model: String,
}

impl ResponseMeta {
    /// The hexadecimal part of the id, which the ids of the answer's
    /// parts (items, tool calls) share.
    pub fn id_hex(&self) -> &str {
        self.id.strip_prefix(self.endpoint.id_prefix()).unwrap_or(&self.id)
    }
}

/// A tool call of a chat answer: `{"id", "type": "function", "function":
/// {"name", "arguments"}}`, the arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCallBody {
    /// `call_…`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function called.
    pub function: FunctionBody,
}

/// `function` of a [`ToolCallBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionBody {
    /// The tool's name.
    pub name: String,
    /// The arguments, JSON text.
    pub arguments: String,
}

impl From<&ToolCall> for ToolCallBody {
    fn from(call: &ToolCall) -> Self {
        Self {
            id: call.id.clone(),
            kind: "function",
            function: FunctionBody {
                name: call.name.clone(),
                arguments: call.arguments_json.clone(),
            },
        }
    }
}

/// The assistant message of a chat answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The answer's text; `null` for a tool call.
    pub content: Option<String>,
    /// The tool call, if the answer is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallBody>>,
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
    /// The answer `text` for `meta`'s endpoint (completions or chat).
    pub fn new(meta: &ResponseMeta, text: String, finish_reason: FinishReason, usage: Usage) -> Self {
        Self::of(meta, text, None, finish_reason, usage)
    }

    /// A chat answer that is `call`.
    pub fn tool_call(meta: &ResponseMeta, call: &ToolCall, usage: Usage) -> Self {
        Self::of(meta, String::new(), Some(call), FinishReason::ToolCalls, usage)
    }

    fn of(
        meta: &ResponseMeta,
        text: String,
        call: Option<&ToolCall>,
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Self {
        let (object, text, message) = match meta.endpoint {
            Endpoint::Completions => ("text_completion", Some(text), None),
            _ => (
                "chat.completion",
                None,
                Some(AssistantMessage {
                    role: "assistant",
                    content: call.is_none().then_some(text),
                    tool_calls: call.map(|c| vec![c.into()]),
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
