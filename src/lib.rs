//! # semlb (library)
//!
//! The parts of the gateway that the `semlb` binary's processes share,
//! kept in a library so they are unit-tested and benchmarked on their own.
//!
//! # Layout: the dispatch path, in request order
//!
//! | module | concept |
//! | --- | --- |
//! | [`answer`] | the answer text of an OpenAI response (JSON body or event stream), read by the response processes |
//! | [`body`] | the request body parsed once: a JSON tree borrowing its strings from the body |
//! | [`auth`] | client authentication: the keys file of key digests, the caller (tenant, allowed models) a request's key names |
//! | [`pools`] | model pools: the pool a request's `model` names, its servers, tokenizer, block size and policy |
//! | [`prompt`] | the routing text of an OpenAI request: completions prompt forms, rendered chat messages |
//! | [`rate_limit`] | requests and tokens per minute per tenant and per model: the buckets a request is charged to, all-or-none admission, OpenAI's `x-ratelimit-*` headers and 429 |
//! | [`context_limit`] | a prompt no live engine's context can take gets the engines' 400 at the gateway |
//! | [`blocks`] | token ids → the chain of block hashes the shm prefix table is keyed by |
//! | [`continuation`] | conversations that continue on the server that answered them: prompt end keys, the credit for an answer not yet written back |
//! | [`response_cache`] | the exact-request key of the response cache, tenants, cacheability, TTL-stamped entries |
//! | [`routing`] | policies that choose a server from the prefix match and the shared load figures |
//! | [`reactor_watch`] | a dispatcher's heartbeat on its own thread, beating while its reactor pulses |
//! | [`dispatcher`] | a dispatcher process's HTTP front, one module per step in request order: routes, inference (parse, tokenize, look up), route, proxy (attempts and retries), relay, learn (the completion record), queue |
//! | [`fair_share`] | the gateway queue's order: priority classes with a starvation bound, and a token-weighted fair share among tenants (virtual token counters) |
//! | [`failure`] | why a proxied request failed: client, engine or gateway, and whether a retry may help |
//! | [`fuzzing`] | the bodies of the fuzz targets (`tests/fuzz`) and the properties they check |
//! | [`responder`] | what a response process does with a completion record: prefix write-back, response caching |
//! | [`capacity`] | each server's admission limit, learned by the response processes from request latencies, for the holding policies when engine metrics are missing |
//! | [`responder_loop`] | a response process's loop: poll its rings, apply the records, count, heartbeat, until its shutdown flag is set |
//! | [`config`] | `semlb serve` configuration: TOML file, flags over it, validation |
//! | [`metrics`] | the gateway's Prometheus `/metrics`: counters in the segment's stats region, gauges read at scrape time |
//! | [`health`] | health of the inference servers: active and passive checks, circuit breakers, `/metrics` load scraping |
//! | [`kv_events`] | the engines' own KV cache events (vLLM's publisher): the wire format decoded, an engine's block hashes mapped to the gateway's chain |
//! | [`peers`] | peer gateways in other regions (SkyLB): the load summary they exchange, each dispatcher's view of them, the choice of a peer to forward to |
//! | [`tls`] | TLS with rustls: the listener's certificate (`[tls]`, mutual TLS with a client CA), the client side of `https://` peers |
//! | [`segment_store`] | the token segments every process shares: the tokenizer's second-level cache in the shm segment |
//! | [`size`] | human byte sizes (`256MiB`) |
//! | [`store`] | where the routing state lives, behind one interface: shm (default) or Redis ([`store::redis`]; its client, [`store::redis::client`]: prefix entries, responses, in-flight counters and round trips; the Lua scripts it runs in Redis, `store::redis::scripts`; credentials and TLS, [`store::redis::credentials`]; URLs without their passwords, [`store::redis::url`]; servers named by ids of their addresses, [`store::redis::server_id`]); what this host knows whatever the store ([`store::local`]: live candidates with fresh load, the in-flight ledger) |
//!
//! A dispatcher turns a request body into routing text ([`prompt`]),
//! tokenizes it (the gateway's own tokenizer crate, which the simulator shares,
//! `semlb_tokenizer`), hashes the tokens into a block chain
//! ([`blocks`]), looks up the response cache under the request's key
//! ([`response_cache`]), then the prefix table, asks the configured
//! [`routing`] policy for a server, proxies, and pushes a completion record
//! that a response process applies ([`responder`]).

pub mod answer;
pub mod auth;
pub mod blocks;
pub mod body;
pub mod capacity;
pub mod config;
pub mod context_limit;
pub mod continuation;
pub mod dispatcher;
pub mod failure;
pub mod fair_share;
pub mod fuzzing;
pub mod health;
pub mod kv_events;
pub mod metrics;
pub mod peers;
pub mod pools;
pub mod prompt;
pub mod rate_limit;
pub mod reactor_watch;
pub mod responder;
pub mod responder_loop;
pub mod response_cache;
pub mod routing;
pub mod segment_store;
pub mod size;
pub mod store;
pub mod tls;

/// An error and its sources, for messages (the upstream HTTP client
/// nests the cause of a failed connection several levels deep).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}
