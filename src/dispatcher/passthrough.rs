//! The `/v1/*` passthrough: the engines' other OpenAI-compatible endpoints
//! (embeddings, rerank, score, Messages' token count), proxied to the least
//! loaded live server of the pool the body's `model` names.
//!
//! # What is forwarded
//!
//! Only [`PATHS`], each with `POST`: the endpoints vLLM, SGLang and
//! llama.cpp serve under `/v1` that name a model in a JSON body. Any other
//! `/v1/...` path is answered 404 by the gateway itself and never reaches
//! an engine (it used to be forwarded as it came: `/v1/chat%2Fcompletions`
//! reached uvicorn, which decodes `%2F`, and ran a chat completion that
//! was never metered, queued or context-checked; issue 39).
//!
//! # Which servers
//!
//! The body is parsed (on the blocking pool when larger than
//! `inference::parse::BLOCKING_PARSE_BYTES`) for its `model`:
//!
//! * a model the configuration serves: its pool (an alias is rewritten to
//!   the pool's upstream name), if the caller's key may use it (403);
//! * an unknown model: 404 `model_not_found`;
//! * no `model`, or a body that is not a JSON object (serde_json refuses
//!   what Python's parser takes: `NaN`, a byte-order mark, UTF-16): a 400
//!   whenever the answer depends on the model, that is with `[auth]` (an
//!   authenticated caller never falls back to "any server", which would
//!   pass over the models its key may use) or with `[[model]]` pools
//!   (which pool?). Only a gateway with neither, where every server serves
//!   every request alike, forwards such a body to the least loaded server.
//!
//! # What is charged
//!
//! One request and an estimate of its prompt tokens
//! ([`estimated_tokens`]: a token per [`BYTES_PER_TOKEN`] bytes of body,
//! never 0) to the caller's and the pool's rate-limit buckets, before it is
//! forwarded (429 when they have no room). These endpoints' prompt is not
//! one text the gateway can tokenize (a batch of inputs, documents to
//! rank), and an estimate is what the review asked for in place of the 0
//! charged before. None of them generates output. (The Responses and
//! Messages APIs, which do, are inference requests: `super::inference`.)
//!
//! # Queued
//!
//! In a pool whose policy holds requests (`selective_push`, ...), they
//! wait in the gateway queue like chats when its servers are full, with
//! their tenant's share and class ([`share_of`]); the server is then the
//! least loaded one the policy admits.

use std::borrow::Cow;
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::Dispatcher;
use super::charge;
use super::http::{Body, error_response, json_response, upstream_headers, with_string_field};
use super::inference::{off_reactor_if_large, pick_pool, share_of};
use super::proxy::{Outbound, forward};
use super::relay::Metered;
use crate::openai::prompt::RequestError;
use crate::tenancy::auth::Caller;

/// The `/v1` paths forwarded to an engine, all with `POST`.
pub(super) const PATHS: [&str; 4] = ["/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/messages/count_tokens"];

/// Body bytes per prompt token charged (the common rule of thumb for
/// English text in BPE vocabularies; JSON punctuation makes it an
/// overestimate rather than an underestimate).
pub const BYTES_PER_TOKEN: usize = 4;

/// The prompt tokens charged for a body of `bytes` bytes: one per
/// [`BYTES_PER_TOKEN`], at least 1.
pub fn estimated_tokens(bytes: usize) -> u64 {
    bytes.div_ceil(BYTES_PER_TOKEN).max(1) as u64
}

/// The model a passthrough body names (400: not a JSON object, or no
/// non-empty string `model`).
fn model_named(body: &[u8]) -> Result<String, RequestError> {
    let object = crate::openai::prompt::body_object(body)?;
    crate::openai::prompt::request_model(&object).map(Cow::into_owned)
}

/// `POST` to one of [`PATHS`]: charged, then proxied (see the
/// [module docs](self)).
pub(super) async fn passthrough(
    dispatcher: &Arc<Dispatcher>,
    request: Request<Incoming>,
    caller: Option<&Caller>,
) -> Response<Body> {
    let counted = match super::concurrency::begin(dispatcher, caller) {
        Ok(c) => c,
        Err(refused) => return *refused,
    };
    let (parts, body) = request.into_parts();
    let (mut bytes, _permit) = match dispatcher.read_body(&parts.headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    // Without pools or keys every server takes it alike: nothing to read.
    let pools = dispatcher.pools();
    let pool;
    if !pools.is_implicit() || caller.is_some() {
        let Some(named) = off_reactor_if_large(&bytes, |b| model_named(b)).await else {
            return shutting_down();
        };
        let (found, model) = match named.and_then(|model| Ok((pick_pool(&pools, caller, &model)?, model))) {
            Ok(found) => found,
            Err(e) => return json_response(e.status, &e.body()),
        };
        if let Some(name) = found.upstream_name(&model).map(str::to_owned) {
            let Some(rewritten) = off_reactor_if_large(&bytes, move |b| with_string_field(b, "model", &name)).await
            else {
                return shutting_down();
            };
            bytes = rewritten;
        }
        pool = Some(found);
    } else {
        // The implicit pool of every server: its limits, if it has any.
        pool = pools.pools().first().cloned();
    }
    // Nothing these endpoints answer is generated output.
    let mut admitted = match &pool {
        Some(pool) => match charge::admit(dispatcher, caller, pool, estimated_tokens(bytes.len()), || 0).await {
            Ok(a) => a,
            Err(refused) => return refused,
        },
        None => Default::default(),
    };
    let metered = Metered {
        output: admitted.output.take(),
        tenant: caller.map(|c| c.tenant.clone()),
        pool: pool.clone(),
        share: None,
    };
    // A pool whose policy holds requests queues these as it queues chats.
    let share = pool
        .as_ref()
        .and_then(|p| share_of(p, caller, &parts.headers, estimated_tokens(bytes.len()), Some(0)));
    let outbound = Outbound {
        method: parts.method,
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
        headers: upstream_headers(&parts.headers, caller.is_some()),
        body: bytes,
        pool,
        cache_salt: None,
        peer: None,
        metered: Some(metered),
        share,
    };
    let mut response = forward(dispatcher, outbound, None).await;
    admitted.set_headers(&mut response);
    super::concurrency::hold(response, counted)
}

/// A blocking task that did not finish: the runtime is shutting down.
fn shutting_down() -> Response<Body> {
    error_response(StatusCode::SERVICE_UNAVAILABLE, "the gateway is shutting down", None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_is_a_token_per_four_bytes_and_never_zero() {
        assert_eq!(estimated_tokens(0), 1);
        assert_eq!(estimated_tokens(1), 1);
        assert_eq!(estimated_tokens(4), 1);
        assert_eq!(estimated_tokens(5), 2);
        assert_eq!(estimated_tokens(4_000), 1_000);
    }

    #[test]
    fn a_body_must_be_a_json_object_naming_a_model() {
        assert_eq!(model_named(br#"{"model": "m", "input": "x"}"#).unwrap(), "m");
        assert_eq!(model_named(br#"{"model": "m\u002Fx"}"#).unwrap(), "m/x");
        for (body, says) in [
            (&br#"{"input": "x"}"#[..], "'model' is required"),
            (br#"{"model": ""}"#, "must not be empty"),
            (br#"{"model": 1}"#, "must be a string"),
            (br#"["m"]"#, "must be a JSON object"),
            (br#"{"model": "m", "x": NaN}"#, "not valid JSON"),
            (b"\xef\xbb\xbf{\"model\": \"m\"}", "not valid JSON"),
            (b"", "not valid JSON"),
        ] {
            let e = model_named(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(
                e.message.contains(says),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
        }
    }
}
