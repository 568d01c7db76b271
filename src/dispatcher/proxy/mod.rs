//! Proxying: a request's attempts on chosen servers, with retries.
//!
//! [`forward`] runs the attempts of one request until one gets an answer
//! head, each in three steps:
//!
//! 1. [`Attempts::route`]: a server from the routing decision
//!    ([`super::pick::choose`]), or a wait in the gateway queue when every
//!    server the policy would use is full;
//! 2. [`Attempts::send`]: the request goes there; the head is awaited
//!    under the request's deadline. A pooled connection that the server
//!    had closed as the request went out
//!    ([`crate::dispatcher::failure::is_stale_connection`]) is no failure: the request
//!    goes to the same server again on a new connection, once per request;
//! 3. on a failure that another server may fix ([`Failure::retryable`]:
//!    a connection error, a 5xx head), the next attempt avoids the servers
//!    that failed, up to `limits.retries` retries and at most two servers
//!    answering 5xx (then the request is the likelier cause); then 502.
//!    A 5xx counts against its server's passive health only once another
//!    server answered the same request with a 2xx.
//!
//! A head that is not a failure is relayed ([`super::relay::Relay`]), and
//! [`Attempts::finish`] adds the gateway's headers. Step 1 is [`route`]'s,
//! step 2 [`send`]'s; the attempts' state, the relay and the finish are here.
//! [`picked`] runs step 1 and counts the request for a proxy that sends
//! it itself (the endpoint picker's Envoy), then relays the answer that
//! proxy streams back.

mod pd;
mod picked;
mod resumed;
mod route;
mod send;

pub(super) use picked::{Picked, pick};

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::Full;
use shm_layout::{Prediction, ResponseKey, ServerRef};
use tokio::time::Sleep;

use shm_layout::UsageCounter;

use super::Dispatcher;
use super::charge::Reservation;
use super::http::{
    BACKEND_HEADER, Body, CACHE_HEADER, DISPATCH_HEADER, PREFILL_HEADER, QUEUE_HEADER, ROUTE_HEADER,
    client_response_headers, error_response, set_header, set_static_header,
};
use super::inflight::InflightGuard;
use super::learn::Learn;
use super::peer_forward::{self, PeerCopy};
use super::pick::{Chosen, RouteRequest, Routed, choose, passive_failure};
use super::queue::{QueueExit, Waiting, wait_in_queue};
use super::relay::{Metered, Relay, RelayTimer, Upstream, UpstreamBody};
use super::resume::{Continuation, Resume};
use super::tenant_usage;
use super::timing::DispatchTiming;
use crate::dispatcher::failure::Failure;
use crate::metrics::PeerEvent;
use crate::metrics::QueueOutcome;
use crate::openai::prompt::Endpoint;
use crate::peers::affinity;
use crate::peers::book::{Forward, PeerBook};
use crate::pools::Pool;
use crate::prefix::blocks::BlockHasher;
use crate::prefix::continuation::EndProbe;
use crate::routing::Reason;
use crate::routing::affinity::Affinity;
use crate::store::Lookup;
use crate::tenancy::fair_share::{Priority, Share};

/// What a proxied request is: where it goes and what it carries.
pub(super) struct Outbound {
    pub method: Method,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The model pool whose servers may take it (`None`: any server).
    pub pool: Option<Arc<Pool>>,
    /// Its tenant's salt for engines that take vLLM's `cache_salt` (a
    /// tenant whose prefixes are kept apart: [`crate::prefix::blocks::TenantSalt`]).
    pub cache_salt: Option<String>,
    /// The client's request as it came, for a peer gateway, when it may be
    /// forwarded to one ([`crate::peers`]; `None`: it may not, e.g. it was
    /// forwarded here).
    pub peer: Option<PeerCopy>,
    /// What an answer without an inference context (a passthrough) is
    /// charged and counted to.
    pub metered: Option<Metered>,
    /// Without an inference context: its tenant, class and cost in the
    /// gateway queue (`None`: it never waits there).
    pub share: Option<Share>,
}

impl Outbound {
    /// The body to send a server: with the tenant's `cache_salt` when
    /// `salted` (its engine takes one), else as it is (shared, not copied).
    fn body_for(&self, salted: bool) -> Bytes {
        match self.cache_salt.as_deref().filter(|_| salted) {
            Some(salt) => with_cache_salt(&self.body, salt),
            None => self.body.clone(),
        }
    }

    /// The request to send to `uri` with `body`.
    fn request(&self, uri: Uri, body: Bytes) -> Request<Full<Bytes>> {
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = uri;
        *request.headers_mut() = self.headers.clone();
        request
    }
}

/// Servers that may answer one request with a 5xx head before it is
/// answered 502 without asking more of them.
const MAX_5XX_ANSWERS: usize = 2;

/// What an inference request adds to a proxied one.
pub(super) struct InferenceCtx {
    /// Where the dispatch time went.
    pub timing: DispatchTiming,
    pub prompt_tokens: Vec<u32>,
    pub chain: Vec<u64>,
    /// Leading blocks of the chain that are the chat template's own text
    /// (see [`super::pick::RouteRequest::template_blocks`]).
    pub template_blocks: u32,
    pub hasher: BlockHasher,
    /// The prompt's end key ([`BlockHasher::end_key`]).
    pub end_key: u64,
    /// Tokens of the earlier answer the prompt carries (estimated; 0: none).
    pub answer_tokens: u32,
    /// The sequences it asks to generate (`n`, `best_of`; at least 1).
    pub choices: u64,
    /// Where a 200 answer may be stored.
    pub store_key: Option<ResponseKey>,
    /// The `x-semlb-cache` value.
    pub cache: &'static str,
    /// The store's answer for the first routing decision.
    pub lookup: Option<Lookup>,
    /// The endpoint (for the routing event).
    pub endpoint: Endpoint,
    /// The request's `model` (for the routing event).
    pub model: String,
    /// Its session key, hashed, if the policy uses one and it has one.
    pub session: Option<u64>,
    /// Where it wants to go: the engine of the stored response it
    /// continues, or its session's ([`crate::routing::affinity`]).
    pub affinity: Option<Affinity>,
    /// The tenant's salt of its affinity keys.
    pub affinity_salt: u64,
    /// The `previous_response_id` it continues (for the 404 when no
    /// engine holds it).
    pub previous_response_id: Option<String>,
    /// It carries its whole conversation: sent without
    /// `previous_response_id` when no engine holds that response.
    pub carries_history: bool,
    /// The engine stores its answer (a Responses request with `store` on):
    /// the answer's id is recorded for that engine.
    pub stores_response: bool,
    /// The gateway asked for the stream's usage, which the client did not
    /// (see `super::stream_usage`).
    pub strip_usage: bool,
    /// The rate-limit buckets its output tokens are charged to.
    pub output: Option<Reservation>,
    /// Its tenant, class and cost in the gateway queue (`None`: its pool's
    /// policy never queues).
    pub share: Option<Share>,
    /// A routing charged its share already: a retry costs nothing more,
    /// and the relay settles the charge when the answer ends.
    pub charged: bool,
    /// Its prompt may be learned (its tenant is within its share of the
    /// prefix table: `super::share`).
    pub learn: bool,
    /// Its caller's tenant (with `[auth]`), for the usage counts.
    pub tenant: Option<Arc<str>>,
    /// A chat stream: resumed when its engine breaks mid-answer, unless
    /// the reason given ([`super::resume`]).
    pub resume: Option<Option<&'static str>>,
}

impl InferenceCtx {
    /// The prompt's chain past its first `held` blocks (those the server
    /// was not listed for yet).
    fn unlisted(&self, held: u32) -> &[u64] {
        &self.chain[(held as usize).min(self.chain.len())..]
    }
}

/// Whether an answer with `headers` is an event stream (SSE).
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// Marks a response whose body is a [`Relay`] (it records its own duration).
#[derive(Debug, Clone, Copy)]
pub(super) struct Relayed;

/// Sends `outbound` to a chosen server, retrying elsewhere on failures
/// another server may fix, and relays the answer.
pub(super) async fn forward(
    dispatcher: &Arc<Dispatcher>,
    outbound: Outbound,
    ctx: Option<InferenceCtx>,
) -> Response<Body> {
    let deadline = tokio::time::Instant::now() + dispatcher.config().limits.request_timeout();
    // One timer for the whole request: the wait for a head, then the
    // relayed body (registering a timer is not free at 20 K requests/s).
    let mut timer = Box::pin(tokio::time::sleep_until(deadline));
    let mut attempts = Attempts::new(dispatcher, outbound, ctx, deadline);
    let response = loop {
        let (chosen, admitted) = match attempts.route().await {
            Ok(routed) => routed,
            Err(Next::Retry) => continue,
            Err(Next::Answer(r)) => break r,
        };
        match attempts.send(chosen, admitted, timer.as_mut()).await {
            Ok(head) => break attempts.relay(head, timer),
            Err(Next::Answer(r)) => break r,
            Err(Next::Retry) => continue,
        }
    };
    attempts.finish(response)
}

/// An answer head from a server, not a failure.
struct Head {
    response: Response<UpstreamBody>,
    server: ServerRef,
    /// The server's base URL.
    address: String,
    /// The request's in-flight count, ended by the relay.
    guard: InflightGuard,
    /// The blocks the server was already listed for, when the prompt was
    /// recorded for it at dispatch.
    recorded: Option<u32>,
    /// The answer's first data, read already (a split request's SGLang
    /// decode leg streams: its head comes at once, its first data only
    /// once the prefill leg handed over).
    first: Option<Bytes>,
}

/// What follows a step that did not produce the answer.
enum Next {
    /// Try again (another server, or the same decision after a change).
    Retry,
    /// Answer the client with this (an error the gateway produced).
    Answer(Response<Body>),
}

/// The attempts of one proxied request and what they learned.
struct Attempts<'d> {
    dispatcher: &'d Arc<Dispatcher>,
    outbound: Outbound,
    ctx: Option<InferenceCtx>,
    /// The store's answer for the first decision (taken by it).
    first_lookup: Option<Lookup>,
    /// Servers that failed this request.
    failed: Vec<ServerRef>,
    /// The last failure (for the 502's message).
    last_failure: Option<Failure>,
    /// Attempts made.
    attempt: u32,
    /// When the first attempt was handed upstream (ns from arrival).
    dispatch_ns: Option<u64>,
    /// Time spent in the gateway queue.
    queued_ms: Option<u64>,
    /// Why the last server was chosen.
    last_reason: Option<Reason>,
    /// What the last server was expected to hold of the prompt.
    last_prediction: Prediction,
    /// The request was resent once after a stale pooled connection.
    resent_stale: bool,
    /// Servers that answered it with a 5xx head: counted against their
    /// passive health only if another server then answers it with a 2xx
    /// (see [`crate::dispatcher::failure`]).
    answered_5xx: Vec<(ServerRef, String, Failure)>,
    /// The request's deadline.
    deadline: tokio::time::Instant,
    /// A peer gateway was tried already (a request is offered to one once).
    tried_peer: AtomicBool,
    /// Without an inference context: a routing charged the outbound's
    /// share already.
    share_charged: bool,
    /// Its split into a prefill and a decode leg, in a pool with prefill
    /// engines ([`pd`]).
    pd: pd::PdState,
    /// Prompt tokens of a request without an inference context that the
    /// gateway knows anyway (a stream's continuation: the request's and
    /// the text carried), counted as its prefill work.
    known_prompt_tokens: u64,
}

impl<'d> Attempts<'d> {
    fn new(
        dispatcher: &'d Arc<Dispatcher>,
        outbound: Outbound,
        mut ctx: Option<InferenceCtx>,
        deadline: tokio::time::Instant,
    ) -> Self {
        Self {
            deadline,
            tried_peer: AtomicBool::new(false),
            share_charged: false,
            dispatcher,
            outbound,
            first_lookup: ctx.as_mut().and_then(|c| c.lookup.take()),
            ctx,
            failed: Vec::new(),
            last_failure: None,
            attempt: 0,
            dispatch_ns: None,
            queued_ms: None,
            last_reason: None,
            last_prediction: Prediction::default(),
            resent_stale: false,
            answered_5xx: Vec::new(),
            pd: pd::PdState::default(),
            known_prompt_tokens: 0,
        }
    }

    /// The name of the policy routing it (its pool's).
    fn policy_name(&self) -> &'static str {
        self.outbound.pool.as_ref().map_or("least_load", |p| p.policy().name())
    }

    fn prompt_tokens(&self) -> u64 {
        self.ctx
            .as_ref()
            .map_or(self.known_prompt_tokens, |c| c.prompt_tokens.len() as u64)
    }

    /// The prefill work of the request at a server predicted to hold
    /// `predicted` of its leading blocks: what the ledger counts in flight
    /// ([`crate::routing::uncached_tokens`]).
    fn prefill_tokens(&self, predicted: u32) -> u64 {
        let block = self
            .ctx
            .as_ref()
            .map_or(0, |c| u32::try_from(c.hasher.block_size()).unwrap_or(u32::MAX));
        crate::routing::uncached_tokens(
            u32::try_from(self.prompt_tokens()).unwrap_or(u32::MAX),
            predicted,
            block,
        )
    }

    /// A failure that another server may fix: remembered, the server avoided.
    fn failed_on(&mut self, server: ServerRef, failure: Failure) {
        self.failed.push(server);
        self.last_failure = Some(failure);
    }

    /// The answer of `head`, relayed to the client as it arrives, until
    /// `deadline`.
    /// The last step: the request's chain moves into what the relay learns
    /// from (no copy; [`finish`](Self::finish) needs only the timing).
    fn relay(&mut self, head: Head, deadline: Pin<Box<Sleep>>) -> Response<Body> {
        let dispatcher = self.dispatcher;
        let Head {
            response,
            server,
            address,
            guard,
            recorded,
            first,
        } = head;
        let (parts, incoming) = response.into_parts();
        if let Some(held) = recorded.filter(|_| !parts.status.is_success()) {
            // Refused (a 4xx): the server did not take the prompt in.
            self.forget_route(server, held);
        }
        let sse = is_event_stream(&parts.headers);
        let learn = match &mut self.ctx {
            Some(c) if parts.status.is_success() => Some(Learn {
                server,
                prompt_tokens: u32::try_from(c.prompt_tokens.len()).unwrap_or(u32::MAX),
                tail: c.prompt_tokens[c.chain.len() * c.hasher.block_size()..].to_vec(),
                chain: std::mem::take(&mut c.chain),
                hasher: c.hasher,
                cache_key: c.store_key.filter(|_| parts.status == StatusCode::OK),
                chat: c.endpoint.is_chat(),
                prediction: self.last_prediction,
                timing: None,
                pool: self.outbound.pool.clone(),
                output: c.output.take(),
                tenant: c.tenant.clone(),
                share: c.share.filter(|_| c.charged),
                stored: c.stores_response.then(|| (c.affinity_salt, Default::default())),
                record: c.learn,
            }),
            _ => None,
        };
        // The relay reports the body's end or failure to the passive health
        // check (a head alone is not yet a success).
        let relay_timer = self
            .ctx
            .as_ref()
            .map(|c| RelayTimer::new(dispatcher.clone(), c.timing.start));
        let mut headers = http::HeaderMap::new();
        client_response_headers(&parts.headers, &mut headers);
        set_header(&mut headers, BACKEND_HEADER, &address);
        let upstream = Upstream {
            body: incoming,
            address,
            guard,
            companion: self.pd.leg.take(),
            decode_leg: self.pd.decode_sent.take(),
            first,
        };
        let strip_usage = self.ctx.as_ref().is_some_and(|c| c.strip_usage);
        // A passthrough's reservation stays with the request (given back
        // when it ends) unless an answer comes that may carry output.
        let metered = if parts.status.is_success() {
            let share = self.outbound.share.filter(|_| self.share_charged);
            self.outbound.metered.take().map(|m| Metered { share, ..m })
        } else {
            None
        };
        let relay = Relay::new(
            dispatcher.clone(),
            upstream,
            deadline,
            learn,
            sse,
            relay_timer,
            strip_usage,
            metered,
        );
        // A chat stream goes on elsewhere if its engine breaks: the request
        // is kept for that (moved: the attempts are over).
        let blocked = self
            .ctx
            .as_ref()
            .and_then(|c| c.resume)
            .filter(|_| sse && parts.status.is_success());
        let relay = match blocked {
            Some(blocked) => {
                let prompt_tokens = self.prompt_tokens();
                let outbound = &mut self.outbound;
                let request = Continuation {
                    path_and_query: std::mem::take(&mut outbound.path_and_query),
                    headers: std::mem::take(&mut outbound.headers),
                    body: std::mem::take(&mut outbound.body),
                    pool: outbound.pool.clone(),
                    cache_salt: outbound.cache_salt.take(),
                    completions: self.ctx.as_ref().is_some_and(|c| c.endpoint == Endpoint::Completions),
                    prompt_tokens,
                    send: resumed::send,
                };
                relay.resumable(Resume::new(dispatcher.clone(), request, blocked))
            }
            None => relay,
        };
        let mut response = Response::new(relay.boxed());
        response.extensions_mut().insert(Relayed);
        *response.status_mut() = parts.status;
        *response.headers_mut() = headers;
        response
    }

    /// Step 3: the gateway's headers on the answer.
    fn finish(self, mut response: Response<Body>) -> Response<Body> {
        let headers = response.headers_mut();
        if let Some(reason) = self.last_reason {
            set_static_header(headers, ROUTE_HEADER, reason.name());
        }
        if let Some(ms) = self.queued_ms {
            set_header(headers, QUEUE_HEADER, &ms.to_string());
        }
        if let Some(prefill) = &self.pd.prefill {
            set_header(headers, PREFILL_HEADER, prefill);
        }
        // A peer gateway's answer keeps what the peer's cache did.
        let forwarded = headers.contains_key(crate::peers::PEER_HEADER);
        if let Some(c) = self.ctx.as_ref().filter(|_| !forwarded) {
            set_static_header(headers, CACHE_HEADER, c.cache);
            if let Some(sent) = self.dispatch_ns {
                set_header(headers, DISPATCH_HEADER, &c.timing.header(sent));
            }
        }
        response
    }

    fn bad_gateway(&self) -> Response<Body> {
        let last = self.last_failure.as_ref().map(ToString::to_string).unwrap_or_default();
        error_response(
            StatusCode::BAD_GATEWAY,
            format!(
                "no inference server could answer ({} tried; last: {last})",
                self.attempt
            ),
            Some("upstream_unavailable"),
        )
    }
}

/// 503 with `Retry-After: 1`.
pub(super) fn unavailable(message: impl Into<String>, code: &str) -> Response<Body> {
    let mut r = error_response(StatusCode::SERVICE_UNAVAILABLE, message, Some(code));
    set_header(r.headers_mut(), "retry-after", "1");
    r
}

/// `body` (a JSON object) with `"cache_salt": salt`, replacing one the
/// client sent: put first when the body has none, else the body parsed and
/// written again.
pub(crate) fn with_cache_salt(body: &Bytes, salt: &str) -> Bytes {
    let quoted = serde_json::to_string(salt).expect("a string serializes");
    let has_salt = has_cache_salt(body);
    let open = body.iter().position(|b| !b.is_ascii_whitespace());
    if !has_salt && let Some(i) = open.filter(|i| body[*i] == b'{') {
        let rest = &body[i + 1..];
        let empty = rest.iter().all(|b| b.is_ascii_whitespace() || *b == b'}');
        let mut out = Vec::with_capacity(body.len() + quoted.len() + 16);
        out.extend_from_slice(&body[..=i]);
        out.extend_from_slice(b"\"cache_salt\":");
        out.extend_from_slice(quoted.as_bytes());
        if !empty {
            out.push(b',');
        }
        out.extend_from_slice(rest);
        return Bytes::from(out);
    }
    super::http::with_string_field(body, "cache_salt", salt)
}

/// Whether the JSON object `body` may have a `cache_salt` member: its
/// key as such, or (found by reading the keys) written with escapes,
/// `"cache\u005fsalt"`, which an engine's parser reads as `cache_salt` and
/// which, after the one put first, would win. Yes when it does not parse.
fn has_cache_salt(body: &[u8]) -> bool {
    if memchr::memmem::find(body, b"cache_salt").is_some() {
        return true;
    }
    // Only `\uXXXX` writes a letter or `_` as something else.
    if memchr::memmem::find(body, br"\u").is_none() {
        return false;
    }
    serde_json::from_slice::<std::collections::HashMap<String, serde::de::IgnoredAny>>(body)
        .map_or(true, |members| members.contains_key("cache_salt"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_escaped_cache_salt_key_cannot_win_over_the_tenants() {
        // Python's json (vLLM, SGLang) decodes the key and keeps the last
        // duplicate: the client's escaped salt must not survive.
        let body = Bytes::from_static(br#"{"model":"m","cache\u005fsalt":"theirs","prompt":"x"}"#);
        let out = with_cache_salt(&body, "ours");
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(!text.contains("theirs"), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["cache_salt"], "ours");
        assert_eq!(v["prompt"], "x");
    }

    #[test]
    fn the_cache_salt_is_put_in_or_replaces_the_clients() {
        let salted = |body: &'static str| -> serde_json::Value {
            serde_json::from_slice(&with_cache_salt(&Bytes::from_static(body.as_bytes()), "s1")).unwrap()
        };
        assert_eq!(
            salted(r#" {"model":"m"}"#),
            serde_json::json!({"model": "m", "cache_salt": "s1"})
        );
        assert_eq!(salted("{ }"), serde_json::json!({"cache_salt": "s1"}));
        assert_eq!(
            salted(r#"{"cache_salt":"mine","model":"m"}"#),
            serde_json::json!({"model": "m", "cache_salt": "s1"})
        );
        // A salt whose key is escaped is the client's too (fuzz target
        // body_rewrite, tests/fuzz/regressions/body_rewrite): put first,
        // ours would lose to it in an engine's parser.
        assert_eq!(
            salted(r#"{"model":"m","cache\u005fsalt":"another tenant's"}"#),
            serde_json::json!({"model": "m", "cache_salt": "s1"})
        );
        // Other escapes keep the fast path.
        let body = Bytes::from_static(br#"{"prompt":"caf\u00e9"}"#);
        assert_eq!(
            with_cache_salt(&body, "s1"),
            Bytes::from_static(br#"{"cache_salt":"s1","prompt":"caf\u00e9"}"#)
        );
    }
}
