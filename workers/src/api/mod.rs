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
//! The answer's *natural length* ([`natural_length`]) is where it would
//! end by itself, with no `max_tokens`: the header's length, else
//! `default_output_tokens`, and none with `ignore_eos` (it never stops by
//! itself). The prefill leg of disaggregated serving checks the end of
//! the answer (EOS) before the length cap, as vLLM's `check_stop` does,
//! so a prefill leg capped at one token whose natural length is 1 stops
//! on EOS (see [`crate::pd`]).
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

mod answer;
mod chat;
mod completions;
mod conversation;
mod embeddings;
mod error;
mod fields;
mod info;
mod messages;
mod messages_out;
mod params;
mod response;
mod responses;
mod responses_out;
mod stream;
#[cfg(test)]
mod tests;
mod tool_call;

pub use answer::AnswerSpec;
pub use chat::ChatRequest;
pub use completions::{CompletionRequest, Prompt};
pub use conversation::{Conversation, Ordered, ToolChoice};
pub use embeddings::{EMBEDDING_DIMENSIONS, EmbeddingRequest, embedding_body};
pub use error::{ApiError, ErrorFormat, anthropic_error_type};
pub(crate) use fields::{field, opt_bool, opt_int, opt_string, parse_object, wrong_type};
pub use info::{models_body, props_body};
pub use messages::MessagesRequest;
pub use messages_out::{MessagesUsage, stop_reason};
pub use params::{FinishReason, GenParams, natural_length, output_length, parse_output_override};
pub use response::{
    AssistantMessage, Choice, CompletionResponse, Endpoint, FunctionBody, PromptTokensDetails, ResponseMeta,
    ToolCallBody, UsageBody,
};
pub use responses::{InputItem, ResponsesEcho, ResponsesRequest};
pub use stream::{
    Chunk, ChunkChoice, Delta, EventWriter, FunctionDelta, SSE_DONE, ToolCallDelta, data_event, named_event,
};
pub use tool_call::{InOrder, ToolCall};

/// Header that overrides the output length (see [`output_length`]).
pub const OUTPUT_TOKENS_HEADER: &str = "x-semlb-output-tokens";

/// Response header with the simulated time to first token in milliseconds
/// (queueing + prefill, in simulated time, e.g. `12.345`).
pub const SIM_TTFT_HEADER: &str = "x-semlb-sim-ttft-ms";

/// Response header with the prompt tokens served from the prefix cache.
pub const SIM_CACHED_TOKENS_HEADER: &str = "x-semlb-sim-cached-tokens";
