//! An inference request (`/v1/chat/completions`, `/v1/completions`) as
//! named stages over one request, each a file of this folder:
//!
//! | stage | file | what it does |
//! | --- | --- | --- |
//! | read | here | the tenant's place among its requests in flight, the body read within the dispatcher's budget |
//! | parse | [`parse`] | the body parsed once, its model pool picked, its session key |
//! | tokenize | [`tokenize`] | the routing text to token ids, the prompt's size as the limits count it |
//! | admit | [`admit`] | the context check (the engines' 400), the tenant's and pool's buckets charged (429) |
//! | key | [`key`] | the block chain in the store's seed, the response-cache key |
//! | look up or answer | [`lookup`] | the store's lookup; a fresh cached answer returned |
//! | send | [`send`] | the request as it goes upstream, handed to the proxy ([`super::proxy::forward`]) |
//!
//! Each stage either hands its result to the next or answers the client
//! (an error in the API's own shape, or the cached answer).
//!
//! [`prepare`] runs the stages after the read; the HTTP front hands what
//! it prepared to the proxy, the endpoint picker ([`super::epp`]) to the
//! picking proxy ([`super::proxy::pick`]).

mod admit;
mod key;
mod lookup;
mod parse;
mod send;
mod tokenize;

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, request};
use hyper::body::Incoming;

pub(super) use self::parse::{off_reactor_if_large, pick_pool};
pub(super) use self::send::share_of;
pub(crate) use self::send::with_model;
use super::Dispatcher;
use super::charge::Admitted;
use super::http::Body;
use super::proxy::{InferenceCtx, Outbound, forward};
use super::timing::{DispatchTiming, Mark};
use crate::openai::prompt::Endpoint;
use crate::tenancy::auth::Caller;

/// What every stage reads: the dispatcher, who asks (with `[auth]`), and
/// the endpoint asked.
#[derive(Clone, Copy)]
struct Asked<'a> {
    dispatcher: &'a Arc<Dispatcher>,
    caller: Option<&'a Caller>,
    endpoint: Endpoint,
}

/// Answers one inference request: its stages in order.
pub(super) async fn inference(
    dispatcher: &Arc<Dispatcher>,
    request: Request<Incoming>,
    endpoint: Endpoint,
    caller: Option<&Caller>,
) -> Response<Body> {
    let mut timing = DispatchTiming::new();
    // The tenant's place among its requests in flight, held by the answer.
    let counted = match super::concurrency::begin(dispatcher, caller) {
        Ok(c) => c,
        Err(refused) => return *refused,
    };
    let (parts, body) = request.into_parts();
    // The permit holds the body's place in the dispatcher's budget until
    // the request is handed on.
    let (bytes, _permit) = match dispatcher.read_body(&parts.headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    timing.mark(Mark::Read);
    let Ready {
        outbound,
        ctx,
        admitted,
    } = match prepare(dispatcher, caller, endpoint, parts, &bytes, timing).await {
        Ok(ready) => ready,
        Err(answer) => return answer,
    };
    let mut response = forward(dispatcher, outbound, Some(ctx)).await;
    admitted.set_headers(&mut response);
    super::concurrency::hold(response, counted)
}

/// An inference request ready to be routed: what goes upstream, what the
/// proxy learns from, and its charge (the `x-ratelimit-*` headers of its
/// answer).
pub(in crate::dispatcher) struct Ready {
    pub outbound: Outbound,
    pub ctx: InferenceCtx,
    pub admitted: Admitted,
}

/// The stages after the read of an inference request (head `parts`, body
/// `bytes`, arrived as `timing` started): parse, tokenize, admit, key, look
/// up, the request as it goes upstream. `Err`: the answer already (an
/// error in the API's shape, or the response cache's answer).
pub(in crate::dispatcher) async fn prepare(
    dispatcher: &Arc<Dispatcher>,
    caller: Option<&Caller>,
    endpoint: Endpoint,
    parts: request::Parts,
    bytes: &Bytes,
    mut timing: DispatchTiming,
) -> Result<Ready, Response<Body>> {
    let asked = Asked {
        dispatcher,
        caller,
        endpoint,
    };
    let mut request = parse::parse(asked, parts, bytes).await?;
    timing.mark(Mark::Parse);
    let tokens = tokenize::tokenize(asked, &request.pool, &mut request.parsed).await;
    timing.mark(Mark::Tokenize);
    let mut admitted = admit::admit(asked, &request.pool, &request.parsed, &tokens).await?;
    let keyed = key::key(asked, &request, &tokens, &mut timing).await;
    let found = lookup::look_up(asked, &request, &tokens, &keyed, &admitted, &mut timing).await;
    let (lookup, answer_tokens) = match found {
        lookup::Found::Answered(response) => return Err(response),
        lookup::Found::Route { lookup, answer_tokens } => (lookup, answer_tokens),
    };
    let gathered = send::Gathered {
        tokens,
        keyed,
        lookup,
        answer_tokens,
        timing,
    };
    let (outbound, ctx) = send::prepare(asked, request, bytes, gathered, &mut admitted).await?;
    Ok(Ready {
        outbound,
        ctx,
        admitted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::body::Json;
    use crate::openai::prompt;
    use bytes::Bytes;

    #[test]
    fn an_alias_is_replaced_by_the_pools_name_and_nothing_else_changes() {
        let body = Bytes::from_static(br#"{"model": "fast",  "prompt":"fast"}"#);
        let Json::Object(parsed) = Json::parse(&body).unwrap() else {
            panic!()
        };
        let model = prompt::request_model(&parsed).unwrap();
        assert_eq!(
            with_model(&body, &model, "llama \"3\""),
            Bytes::from_static(br#"{"model": "llama \"3\"",  "prompt":"fast"}"#)
        );
        // An escaped name is not borrowed from the body: written again.
        let body = Bytes::from_static(br#"{"model":"f\u0061st","prompt":"x"}"#);
        let Json::Object(parsed) = Json::parse(&body).unwrap() else {
            panic!()
        };
        let model = prompt::request_model(&parsed).unwrap();
        let out: serde_json::Value = serde_json::from_slice(&with_model(&body, &model, "big")).unwrap();
        assert_eq!(out, serde_json::json!({"model": "big", "prompt": "x"}));
    }
}
