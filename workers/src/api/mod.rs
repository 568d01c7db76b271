//! The APIs `semlb-sim` speaks, as vLLM serves them: request parsing and
//! validation for `POST /v1/completions`, `POST /v1/chat/completions`,
//! `POST /v1/responses` (OpenAI's Responses API) and `POST /v1/messages`
//! (Anthropic's Messages API), the answers and their streamed events, and
//! the error bodies (OpenAI's; Anthropic's on `/v1/messages`).
//!
//! # Layout
//!
//! | module | concept |
//! | --- | --- |
//! | `fields`, `params` | reading typed fields; the generation parameters every API shares, the output-length rule |
//! | `completions`, `chat` | the completions prompt; the chat messages, tools and tool choice |
//! | `conversation` | a conversation as vLLM hands it to the chat template, whichever API: text parts, tool calls (arguments parsed as `json.loads` parses them), tool results, reasoning, tools in the chat form, key order kept |
//! | `responses`, `messages` | Responses and Messages requests as conversations (their mapping tables are there) |
//! | `tool_call` | the tool call the simulator answers with: its arguments, the message it becomes, its streamed pieces |
//! | `response`, `stream` | OpenAI's answers and chunks ([`EventWriter`]: the events of a streamed answer, whichever API) |
//! | `responses_out`, `messages_out` | Responses and Messages answers and their named events |
//! | `answer` | [`AnswerSpec`]: one answer, whole or streamed, whichever API |
//! | `error` | [`ApiError`] and its bodies |
//! | `embeddings`, `info` | `/v1/embeddings`; `/v1/models` and `/props` |
//!
//! # Requests
//!
//! Bodies are parsed with `serde_json` into a [`serde_json::Value`] and then
//! checked field by field, so that every problem becomes a 400 naming the
//! offending `param` (never a panic, never a 5xx). Conversations are read a
//! second time keeping key order (a tool's `parameters`, a call's
//! arguments reach the template in the order the client sent them).
//! Unknown fields are ignored: clients send many. Sampling parameters
//! (`temperature`, `top_p`, `top_k`, `seed`, penalties, `stop`,
//! `logprobs`, ...) are type-checked where their type is simple and
//! otherwise ignored; the simulator's answers do not depend on them.
//!
//! | field | completions | chat | Responses | Messages | accepted |
//! | --- | --- | --- | --- | --- | --- |
//! | `model` | ✓ | ✓ | ✓ | ✓ | optional; if given it must be the served name, else **404** (as vLLM) |
//! | `prompt` | ✓ | | | | string, `[string]` (one element), `[int]` token ids, `[[int]]` (one element); not empty |
//! | `messages` | | ✓ | | ✓ | non-empty array; chat: `{role, content, tool_calls, tool_call_id, name, reasoning}` (below); Messages: see `messages` |
//! | `input`, `instructions` | | | ✓ | | a string or an array of items (see `responses`); `instructions` a system message first |
//! | `system` | | | | ✓ | a string or text blocks |
//! | `tools` | | ✓ | ✓ | ✓ | function tools, rendered by the template (other tools left out) |
//! | `tool_choice` | | ✓ | ✓ | ✓ | `"none"` / `{"type": "none"}`: no tool call; a named tool: that one; anything else: the first |
//! | `max_tokens` | ✓ | ✓ | | ✓ | integer ≥ 1 or `null`; **required** by Messages |
//! | `max_completion_tokens` | | ✓ | | | integer ≥ 1 or `null`; wins over `max_tokens` |
//! | `max_output_tokens` | | | ✓ | | integer ≥ 1 or `null` |
//! | `previous_response_id`, `store` | | | ✓ | | continue a stored response (404 `response_not_found` if unknown); `store: false` keeps the answer out of the store |
//! | `stream` | ✓ | ✓ | ✓ | ✓ | boolean |
//! | `stream_options.include_usage` | ✓ | ✓ | | | boolean: a final chunk with empty `choices` and `usage` |
//! | `n`, `best_of` | ✓ | ✓ | ✓ | ✓ | only 1 (`n > 1 is not supported`) |
//! | `ignore_eos` | ✓ | ✓ | ✓ | ✓ | boolean (vLLM extension) |
//! | `cache_salt` | ✓ | ✓ | ✓ | ✓ | non-empty string (vLLM extension): mixed into the prefix cache's first block, so requests with different salts share no cached block |
//! | `echo` | ✓ | | | | only `false` |
//! | `user` | ✓ | ✓ | ✓ | | string, ignored |
//!
//! A chat message's `content` is a string, `null` (empty) or an array of
//! parts: `text`, `input_text`, `output_text`, `refusal` and `thinking`
//! parts are text (joined with `\n`), other parts (`image_url`, ...) are
//! left out, a part that is not an object is a 400. An assistant's
//! `tool_calls` go to the template as sent, each `function.arguments`
//! parsed (a JSON string giving an object or a list: that value; an
//! object or a list: as is; else `{}`; an empty list is dropped); a tool
//! message's `tool_call_id`, any message's `name` and an assistant's
//! `reasoning` / `reasoning_content` (given as both) too.
//!
//! # Tool calls
//!
//! A conversation with tools whose last message is not a tool result is
//! answered with one call ([`ToolCall`]) to its first tool (or the named
//! one), arguments `{"<first property>": "<word>"}`; its output tokens are
//! the template's rendering of that assistant turn (see
//! `crate::server`), so the next turn is a cache hit. After a tool result
//! the answer is text. A call that would not fit in `max_tokens` is not
//! made (the answer is text); the `x-semlb-output-tokens` header does not
//! apply to a call. Chat: `message.tool_calls` (`call_…`, arguments as
//! JSON text), `content: null`, `finish_reason: "tool_calls"`; streamed,
//! a delta naming the call, then deltas with pieces of the arguments.
//! Responses: a `function_call` item (`fc_…`, `call_id` `call_…`);
//! Messages: a `tool_use` block (`toolu_…`), `stop_reason: "tool_use"`.
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
//! # Answers
//!
//! Shapes follow OpenAI (and vLLM): `text_completion` and `chat.completion`
//! objects with `choices[{index, text | message, finish_reason, logprobs:
//! null}]` and `usage {prompt_tokens, completion_tokens, total_tokens,
//! prompt_tokens_details: {cached_tokens}}`; streaming chunks
//! `text_completion` / `chat.completion.chunk`, the last token's chunk
//! carrying `finish_reason` (as vLLM does), then, with `include_usage`, a
//! chunk with empty `choices` and the usage (all other chunks then carry
//! `"usage": null`, as OpenAI does), then `data: [DONE]`.
//!
//! Responses: a `response` object (`resp_…`, `status` `completed`, or
//! `incomplete` at `max_output_tokens`, `output` with one `message` or
//! `function_call` item, `usage {input_tokens, input_tokens_details:
//! {cached_tokens, cache_write_tokens: 0}, output_tokens,
//! output_tokens_details, total_tokens}`);
//! streamed as named events (`response.created` ... `response.completed`,
//! see `responses_out`), no `[DONE]`. Messages: Anthropic's `message`
//! (`msg_…`, one `text` or `tool_use` block, `stop_reason` `end_turn`,
//! `max_tokens` or `tool_use`, `usage {input_tokens` (uncached),
//! `output_tokens, cache_read_input_tokens, cache_creation_input_tokens}`);
//! streamed as Anthropic's events (`message_start` ... `message_stop`, see
//! `messages_out`). Errors on `/v1/messages` are Anthropic's: `{"type":
//! "error", "error": {"type", "message"}}`.

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
pub use conversation::{Conversation, Ending, Ordered, ToolChoice};
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
    Chunk, ChunkChoice, Delta, EventWriter, FunctionDelta, SSE_DONE, ToolCallDelta, data_event, typed_event,
};
pub use tool_call::{InOrder, ToolCall};

/// Header that overrides the output length (see [`output_length`]).
pub const OUTPUT_TOKENS_HEADER: &str = "x-semlb-output-tokens";

/// Response header with the simulated time to first token in milliseconds
/// (queueing + prefill, in simulated time, e.g. `12.345`).
pub const SIM_TTFT_HEADER: &str = "x-semlb-sim-ttft-ms";

/// Response header with the prompt tokens served from the prefix cache.
pub const SIM_CACHED_TOKENS_HEADER: &str = "x-semlb-sim-cached-tokens";
