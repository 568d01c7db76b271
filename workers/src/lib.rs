//! # semlb-workers
//!
//! The inference-worker side of semlb: `semlb-sim`, a simulated
//! OpenAI-compatible inference engine that behaves like vLLM where routing
//! matters, for tests, benchmarks and trying a gateway without GPUs
//! (recipes for real engines live in `workers/recipes/`).
//!
//! # Layout
//!
//! | module | concept |
//! | --- | --- |
//! | [`config`] | every model parameter and flag, with defaults and why they are realistic |
//! | [`output_vocab`] | the deterministic output tokens (single-token words that re-tokenize to themselves) |
//! | [`prefix_cache`] | vLLM-style block KV cache: chained block hashes, LRU of unreferenced blocks |
//! | [`histogram`] | the latency histograms the engine records, with vLLM's bucket bounds |
//! | [`engine`] | continuous batching: FIFO queue, batch limits, prefill/decode timing, stats |
//! | [`kv_events`] | the engine's KV cache events published as vLLM publishes them (ZeroMQ, msgpack, replay) |
//! | [`metrics`] | the Prometheus text exposition of the engine's stats (vLLM and SGLang names) |
//! | [`api`] | the APIs' requests and answers (completions, chat, OpenAI's Responses, Anthropic's Messages), conversations as the chat template gets them, tool calls, streamed events, validation, error bodies |
//! | [`vllm_api`] | vLLM's tokenization endpoints: `/tokenize`, `/detokenize`, the render routes, `/version` |
//! | [`sglang_api`] | SGLang's server-information endpoints (`/model_info`, `/server_info`, `/v1/loads`), a deliberate hybrid so SGLang's routers can manage the simulator |
//! | [`faults`] | fault injection: 500s, mid-stream resets, delay, hang, exit |
//! | [`pd`] | disaggregated prefill/decode: vLLM's NIXL handoff and SGLang's bootstrap rendezvous, both legs |
//! | [`request_log`] | the last inference requests received, their bodies and outcomes (`/sim/requests`) |
//! | [`response_store`] | the stored answers of `/v1/responses`, which `previous_response_id` continues |
//! | [`server`] | the HTTP front: routes, JSON and SSE responses |
//!
//! # Flow
//!
//! `server` parses a request with `api`, renders and tokenizes the prompt
//! with `semlb_tokenizer` (the gateway's own tokenizer and chat templates),
//! draws the output tokens with `output_vocab` (or, for a tool call,
//! renders the call's turn with the template), and submits both to the
//! `engine`. The engine queues the request until the batch has room,
//! looks its prompt up in the `prefix_cache`, sleeps the simulated prefill
//! and decode time (scaled by `time_scale`), and streams events back; the
//! server turns them into a JSON body or SSE chunks. `/metrics` renders the
//! engine's stats with `metrics`. A leg of disaggregated serving goes
//! through `pd` before the engine (a decode leg pulls its prompt's KV
//! from its prefill engine) and after it (a prefill leg holds its prompt
//! for the decode and names it in its answer); `request_log` keeps what
//! each request was and how it ended.

pub mod api;
pub mod config;
pub mod engine;
pub mod faults;
pub mod histogram;
pub mod kv_events;
pub mod metrics;
pub mod output_vocab;
pub mod pd;
pub mod prefix_cache;
pub mod request_log;
pub mod response_store;
pub mod server;
pub mod sglang_api;
pub mod vllm_api;
