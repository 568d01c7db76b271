//! The inference APIs' bodies as the gateway reads and rewrites them:
//! the request body parsed once ([`body`]), the routing text of a request
//! ([`prompt`]: completions prompt forms; a conversation of chat
//! completions, the Responses API or Anthropic's Messages API rendered by
//! the chat template) and the answer text of a response, JSON or event
//! stream ([`answer`]).
//!
//! | module | step |
//! | --- | --- |
//! | [`body`] | the request body parsed once: a JSON tree borrowing its strings from the body |
//! | [`prompt`] | the routing text of a request: which endpoint, its checks, completions prompt forms, the conversation rendered |
//! | [`request_error`] | a request the gateway refuses, in OpenAI's error shape |
//! | [`conversation`] | a conversation as the chat template gets it (what vLLM gives it): messages, tool calls, tool results, reasoning, tools |
//! | [`chat`] | a chat completions request's messages and tools |
//! | [`responses`] | a Responses API request's instructions, input items and tools |
//! | [`anthropic`] | an Anthropic Messages request's system, content blocks and tools; errors in Anthropic's shape |
//! | [`answer`] | the answer text of a response (JSON body or event stream, of any of the four APIs), read by the response processes |
//! | [`agent_streams`] | Responses and Messages event streams as the whole answers they stand for, and stored answers replayed as such streams (the response cache) |

pub mod agent_streams;
pub mod answer;
pub mod anthropic;
pub mod body;
pub mod chat;
pub mod conversation;
pub mod prompt;
pub mod request_error;
pub mod responses;
