//! # semlb (library)
//!
//! The parts of the gateway that the `semlb` binary's processes share,
//! kept in a library so they are unit-tested and benchmarked on their own.
//!
//! # Layout: a folder per concern
//!
//! The `semlb` binary (`src/bin/semlb/`) holds the process edge: the
//! command line, the supervisor, the children's entry points and the
//! commands. Everything a process does on the request path is here.
//!
//! | module | concept |
//! | --- | --- |
//! | [`config`] | `semlb serve` configuration: TOML file, flags over it, validation, byte sizes |
//! | [`openai`] | the OpenAI API's bodies: the request body parsed once, the routing text (prompt forms, rendered chat), the answer text of a response |
//! | [`tenancy`] | tenants: API keys and callers, requests and tokens per minute, the fair share of the gateway queue |
//! | [`pools`] | model pools: the pool a request's `model` names, its servers, tokenizer, block size and policy |
//! | [`prefix`] | token ids → block-hash chains, conversations that continue where they were answered, the `precise` prefix source |
//! | [`response_cache`] | the exact-request key of the response cache, tenants, cacheability, TTL-stamped entries |
//! | [`routing`] | policies that choose a server from the prefix match and the shared load figures, and each server's learned admission limit |
//! | [`store`] | where the routing state lives, behind one interface: shm (default) or Redis; what this host knows whatever the store; the tokenizer's token segments in shm |
//! | [`dispatcher`] | a dispatcher process's HTTP front, one module per step in request order (endpoints, inference, charge, pick, proxy, relay, learn, queue), the context check, the reactor's heartbeat, why a request failed |
//! | [`responder`] | a response process: what it does with a completion record (prefix write-back, response caching), and its loop |
//! | [`discovery`] | backends found at run time: an endpoints file, Kubernetes Pods, EndpointSlices or an InferencePool, followed as sets the supervisor reconciles |
//! | [`health`] | health of the inference servers: active and passive checks, circuit breakers, `/metrics` load scraping |
//! | [`kv_events`] | the engines' own KV cache events (vLLM's publisher): the wire format decoded, an engine's block hashes mapped to the gateway's chain |
//! | [`peers`] | peer gateways in other regions (SkyLB): the load summary they exchange, each dispatcher's view of them, the choice of a peer to forward to |
//! | [`metrics`] | the gateway's Prometheus `/metrics`: counters in the segment's stats region, gauges read at scrape time |
//! | [`tls`] | TLS with rustls: the listener's certificate (`[tls]`, mutual TLS with a client CA), the client side of `https://` peers |
//! | [`fuzzing`] | the bodies of the fuzz targets (`tests/fuzz`) and the properties they check |
//!
//! A dispatcher turns a request body into routing text ([`openai::prompt`]),
//! tokenizes it (the gateway's own tokenizer crate, which the simulator shares,
//! `semlb_tokenizer`), hashes the tokens into a block chain
//! ([`prefix::blocks`]), looks up the response cache under the request's key
//! ([`response_cache`]), then the prefix table, asks the configured
//! [`routing`] policy for a server, proxies, and pushes a completion record
//! that a response process applies ([`responder`]).

// Built without the endpoint picker (the fuzz crate does, see Cargo.toml's
// features), the request path's pieces only the picker shares (the pick
// without a proxy, the fed upstream body, the body budget's hold) are
// unused; the default build, which CI lints, keeps the dead-code lints.
#![cfg_attr(not(feature = "epp"), allow(dead_code, unused_imports))]

pub mod config;
pub mod discovery;
pub mod dispatcher;
pub mod fuzzing;
pub mod health;
pub mod kv_events;
pub mod metrics;
pub mod openai;
pub mod peers;
pub mod pools;
pub mod prefix;
pub mod responder;
pub mod response_cache;
pub mod routing;
pub mod store;
pub mod tenancy;
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
