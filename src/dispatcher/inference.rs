//! The front half of an inference request: body → parse → tokens →
//! context check ([`crate::dispatcher::context_limit`]) → block chain →
//! response-cache key → the store's lookup. A fresh cached
//! answer is returned from here; every other request goes on to the proxy
//! ([`super::proxy::forward`]) with what it learned
//! ([`super::proxy::InferenceCtx`]).

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use shm_layout::UsageCounter;

use super::Dispatcher;
use super::charge;
use super::http::{
    BACKEND_HEADER, Body, CACHE_HEADER, DISPATCH_HEADER, error_response, full_response, json_response, set_header,
    set_static_header, upstream_headers, upstream_request_headers,
};
use super::peer_forward::PeerCopy;
use super::pick;
use super::proxy::{InferenceCtx, Outbound, forward};
use super::sse;
use super::stream_usage::{with_include_usage, with_usage_option};
use super::tenant_usage;
use super::timing::{DispatchTiming, Mark};
use crate::config::StoreKind;
use crate::metrics::CacheResult;
use crate::openai::prompt::{self, Endpoint, RoutingInput};
use crate::pools::{ModelPools, Pool};
use crate::prefix::blocks::{BlockHasher, TenantSalt};
use crate::prefix::continuation::{EndProbe, answer_tokens_estimate};
use crate::response_cache::{self, Cacheability, Scope, Tenant};
use crate::routing::shared_header;
use crate::store::LookupRequest;
use crate::tenancy::auth::Caller;
use crate::tenancy::fair_share::{PRIORITY_HEADER, Priority, Share};

/// Routing texts longer than this are tokenized on the blocking pool. The
/// native tokenizer takes about 25 ns per byte of new text (less for text
/// its segment cache holds), so this bounds the time one request holds the
/// reactor to about a millisecond; shorter texts cost less than the hand-off.
const BLOCKING_TOKENIZE_BYTES: usize = 48 << 10;

/// Bodies longer than this are parsed, and their chats rendered, on the
/// blocking pool: parsing costs about 40 ns a byte for the worst shapes
/// (hundreds of thousands of tiny messages), so a body of the 16 MiB limit
/// would hold the reactor, and every other request of the dispatcher, for
/// up to 0.6 s. Below this (about 10 µs of parsing) the hand-off would
/// cost more than it saves.
pub(super) const BLOCKING_PARSE_BYTES: usize = 256 << 10;

/// The pool `model` names, if the caller may use it.
pub(super) fn pick_pool(
    pools: &ModelPools,
    caller: Option<&Caller>,
    model: &str,
) -> Result<Arc<Pool>, prompt::RequestError> {
    let pool = pools
        .find(model)
        .ok_or_else(|| prompt::RequestError::model_not_found(model))?;
    if caller.is_some_and(|c| !c.may_use(model, pool.chain_model(model))) {
        return Err(prompt::RequestError::model_not_allowed(model));
    }
    Ok(pool.clone())
}

/// `f(body)`, on the blocking pool when `body` is large (`None`: the
/// task did not finish, the runtime is shutting down).
pub(super) async fn off_reactor_if_large<T: Send + 'static>(
    body: &Bytes,
    f: impl FnOnce(&Bytes) -> T + Send + 'static,
) -> Option<T> {
    if body.len() <= BLOCKING_PARSE_BYTES {
        return Some(f(body));
    }
    let body = body.clone();
    tokio::task::spawn_blocking(move || f(&body)).await.ok()
}

/// Parses and checks a request body and picks its pool: inline, or on the
/// blocking pool for a body over [`BLOCKING_PARSE_BYTES`] (whose parsed
/// form then owns its strings).
async fn parse<'b>(
    pools: Arc<ModelPools>,
    caller: Option<&Caller>,
    endpoint: Endpoint,
    body: &'b Bytes,
    limits: prompt::RequestLimits,
) -> Result<(prompt::ParsedRequest<'b>, Arc<Pool>), Response<Body>> {
    let refused = |e: prompt::RequestError| json_response(e.status, &e.body());
    if body.len() <= BLOCKING_PARSE_BYTES {
        return prompt::parse_with(endpoint, body, &limits, |m| pick_pool(&pools, caller, m)).map_err(refused);
    }
    let (body, caller) = (body.clone(), caller.cloned());
    let parsed = tokio::task::spawn_blocking(move || {
        prompt::parse_with(endpoint, &body, &limits, |m| pick_pool(&pools, caller.as_ref(), m))
            .map(|(parsed, pool)| (parsed.into_owned(), pool))
    })
    .await;
    match parsed {
        Ok(parsed) => parsed.map_err(refused),
        // The parser does not panic (fuzzed: tests/fuzz's `request`
        // target): a task that did not finish is the runtime shutting down.
        Err(e) => Err(error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the gateway is shutting down ({e})"),
            None,
        )),
    }
}

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
    let limits = &dispatcher.config().limits;
    let request_limits = prompt::RequestLimits {
        max_messages: limits.max_messages as usize,
        max_prompt_bytes: usize::try_from(limits.max_prompt_bytes.bytes()).unwrap_or(usize::MAX),
    };
    let (mut parsed, pool) = match parse(dispatcher.pools(), caller, endpoint, &bytes, request_limits).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    timing.mark(Mark::Parse);
    let session = session_key(&pool, &parts.headers, &parsed);
    let tokenizer = &pool.tokenization().tokenizer;
    let prompt_bytes = match &parsed.input {
        RoutingInput::Text(text) => text.len(),
        RoutingInput::Tokens(_) => 0,
    };
    // A tenant whose prefixes are kept apart keeps its segments apart in
    // the tokenizer's caches too: how long its prompt takes to tokenize
    // says nothing of the lines other tenants sent or were answered.
    let segment_salt = caller.filter(|c| c.isolate_prefixes).map_or(0, |c| {
        TenantSalt::new(&c.tenant, dispatcher.segment().header().seed[0]).key
    });
    let prompt_tokens = match &mut parsed.input {
        RoutingInput::Text(text) if text.len() > BLOCKING_TOKENIZE_BYTES => {
            let (tokenizer, text) = (tokenizer.clone(), text.to_string());
            // Should the task fail, the request routes on load alone.
            let tokens: Vec<u32> = tokio::task::spawn_blocking(move || tokenizer.encode_salted(&text, segment_salt))
                .await
                .unwrap_or_default();
            tokens
        }
        RoutingInput::Text(text) => tokenizer.encode_salted(text, segment_salt),
        RoutingInput::Tokens(ids) => std::mem::take(ids),
    };
    dispatcher.report_segments(pool.tokenization());
    timing.mark(Mark::Tokenize);
    // What the prompt holds beyond the text tokenized (tools, a batch's
    // other prompts): in the context check and the limits.
    let extra = parsed.extra();
    let prompt_in_context = (prompt_tokens.len() as u64).saturating_add(extra.every_prompt);
    let charged_prompt = (prompt_tokens.len() as u64)
        .saturating_add(extra.every_prompt.saturating_mul(extra.prompts))
        .saturating_add(extra.other_prompts);
    if dispatcher.config().limits.check_context
        && let Err(exceeded) = crate::dispatcher::context_limit::check(
            &dispatcher.segment().tables().servers,
            |id| pool.members().admits(id),
            prompt_in_context,
            parsed.requested_output(),
        )
    {
        tracing::debug!(
            endpoint = endpoint.path(),
            prompt_tokens = prompt_tokens.len(),
            context = exceeded.context.tokens,
            "{} refused: no live engine's context takes it",
            endpoint.path()
        );
        return json_response(StatusCode::BAD_REQUEST, &exceeded.body(parsed.prompt_param()));
    }
    // Its output is reserved in its token buckets: what it asked for, at
    // most what the largest live context leaves.
    let reserve = || {
        crate::tenancy::rate_limit::output_reservation(
            parsed.requested_output(),
            parsed.answers().saturating_mul(extra.prompts),
            dispatcher.config().limits.reserve_output_tokens,
            crate::dispatcher::context_limit::largest(&dispatcher.segment().tables().servers, |id| {
                pool.members().admits(id)
            })
            .map(|c| u64::from(c.tokens).saturating_sub(prompt_in_context)),
        )
    };
    let mut admitted = match charge::admit(dispatcher, caller, &pool, charged_prompt, reserve).await {
        Ok(a) => a,
        Err(refused) => return refused,
    };
    // The namespace's seed with Redis (hosts sharing it hash alike), else
    // the segment's.
    let store = dispatcher.store();
    let namespace_seed = match store.chain_seed() {
        Some(seed) => Some(seed),
        None if store.kind() == StoreKind::Redis => store.await_chain_seed().await,
        None => None,
    };
    let seed = namespace_seed.unwrap_or(dispatcher.segment().header().seed[0]);
    // A tenant whose prefixes are kept apart roots its chains in its salt.
    let salt = caller
        .filter(|c| c.isolate_prefixes)
        .map(|c| TenantSalt::new(&c.tenant, seed));
    let mut root = BlockHasher::root_for(pool.chain_model(&parsed.model), seed);
    if let Some(salt) = &salt {
        root = BlockHasher::salted_root(root, salt);
    }
    let hasher = BlockHasher::new(root, pool.block_size());
    let mut chain = Vec::with_capacity(prompt_tokens.len() / hasher.block_size() + 1);
    hasher.chain(&prompt_tokens, &mut chain);
    let template_blocks = match &parsed.input {
        // Only the shared-header rule reads it: no tokenizing for nothing.
        RoutingInput::Text(text) if pool.shared_headers() && parsed.template_bytes >= hasher.block_size() => {
            let opening = tokenizer.encode_salted(&text[..parsed.template_bytes], segment_salt);
            shared_header::template_blocks(&prompt_tokens, &opening, hasher.block_size())
        }
        _ => 0,
    };
    timing.mark(Mark::Hash);

    // Response cache.
    let rc = &dispatcher.config().response_cache;
    let header_bytes = |name| parts.headers.get(name).map(HeaderValue::as_bytes);
    let cacheability = response_cache::cacheability(
        rc.enabled,
        rc.cache_nondeterministic,
        &parsed.body,
        header_bytes(header::CACHE_CONTROL),
    );
    let query = parts.uri.query().unwrap_or("");
    let key = (cacheability != Cacheability::Bypass).then(|| {
        let tenant = match caller {
            // Its answers are its own whatever the scope when its
            // prefixes are.
            Some(c) if c.isolate_prefixes => Tenant::named(Scope::Tenant, &c.tenant),
            Some(c) => Tenant::named(rc.scope, &c.tenant),
            None => Tenant::of(rc.scope, &parts.headers),
        };
        response_cache::key(
            &dispatcher.key_secret(seed),
            tenant,
            endpoint,
            query,
            &parts.headers,
            &parsed.body,
        )
    });
    // Without learning at dispatch nothing records end keys: no probes.
    let answer_tokens = if dispatcher.config().learn_at_dispatch {
        answer_tokens_estimate(parsed.earlier_answer_bytes, prompt_tokens.len(), prompt_bytes)
    } else {
        0
    };
    let request = LookupRequest {
        response_key: key.filter(|_| cacheability.reads()),
        chain: &chain,
        exclude: &[],
        members: pool.members(),
        stale_after_ms: dispatcher.config().health.stale_after_ms,
        continuation: Some(EndProbe {
            tokens: &prompt_tokens,
            chain: &chain,
            hasher,
            answer_tokens,
        }),
        precise: pool.precise(),
    };
    let mut lookup = pick::lookup(dispatcher, request).await;
    if let Some(stored) = lookup.response.take()
        && let Some(mut response) = cached_answer(&stored, endpoint, &parsed)
    {
        dispatcher.metrics().cache(CacheResult::Hit);
        tenant_usage::count(
            dispatcher,
            caller.map(|c| &*c.tenant),
            pool.name(),
            &[(UsageCounter::CacheHits, 1)],
        );
        timing.mark(Mark::Cache);
        let answered = timing.start.elapsed().as_nanos() as u64;
        tracing::debug!(
            endpoint = endpoint.path(),
            model = %parsed.model,
            prompt_tokens = prompt_tokens.len(),
            blocks = chain.len(),
            cache = "hit",
            degraded = lookup.degraded,
            dispatch_ns = answered,
            "{} answered from the response cache",
            endpoint.path()
        );
        timing.observe(dispatcher, false, answered);
        set_header(response.headers_mut(), DISPATCH_HEADER, &timing.header(answered));
        admitted.set_headers(&mut response);
        return response;
    }
    timing.mark(Mark::Cache);
    let cache = if cacheability.writes() {
        dispatcher.metrics().cache(CacheResult::Miss);
        "miss"
    } else {
        dispatcher.metrics().cache(CacheResult::Bypass);
        "bypass"
    };
    // A streamed answer reports its usage (the engine's cached tokens) only
    // when asked: ask on the client's behalf, and keep it from the client.
    // An alias: the engines know the model by its pool's name.
    // A peer gateway gets the client's request as it came, once: never one
    // a peer forwarded here.
    let forwarded_here = parts.headers.contains_key(crate::peers::HOP_HEADER);
    if forwarded_here {
        dispatcher.metrics().peer(crate::metrics::PeerEvent::Received);
    }
    let peer = (dispatcher.peers().is_some() && !forwarded_here).then(|| PeerCopy {
        headers: upstream_request_headers(&parts.headers),
        body: bytes.clone(),
        model: parsed.model.to_string(),
        tenant: caller.map(|c| c.tenant.clone()),
    });
    let bytes = match pool.upstream_name(&parsed.model) {
        Some(name) => with_model(&bytes, &parsed.model, name),
        None => bytes.clone(),
    };
    // The usage of a stream is always asked for when its output is
    // charged (and, with `stream_usage`, to learn the engine's cached
    // tokens), whatever `stream_options` the client sent.
    let ask_usage =
        parsed.stream && !parsed.include_usage() && (dispatcher.config().stream_usage || admitted.output.is_some());
    let asked = match parsed.body.get("stream_options") {
        _ if !ask_usage => None,
        None => with_include_usage(&bytes),
        Some(_) => match off_reactor_if_large(&bytes, |b| with_usage_option(b)).await {
            Some(rewritten) => rewritten,
            None => return error_response(StatusCode::SERVICE_UNAVAILABLE, "the gateway is shutting down", None),
        },
    };
    let strip_usage = asked.is_some();
    // What this tenant may add to the tables every tenant shares.
    let within = super::share::within(dispatcher, caller, chain.len() as u64, cacheability.writes());
    if within != super::share::Within::ALL {
        tracing::debug!(
            tenant = caller.map(|c| &*c.tenant),
            learn = within.learn,
            cache = within.cache,
            "a tenant past its share of the shared tables: its prompt is routed, not learned or cached"
        );
    }
    let ctx = InferenceCtx {
        learn: within.learn,
        timing,
        end_key: hasher.prompt_end_key(&prompt_tokens, &chain),
        answer_tokens,
        prompt_tokens,
        chain,
        template_blocks,
        hasher,
        store_key: key.filter(|_| cacheability.writes() && within.cache),
        cache,
        lookup: Some(lookup),
        endpoint,
        model: parsed.model.to_string(),
        session,
        strip_usage,
        output: admitted.output.take(),
        tenant: caller.map(|c| c.tenant.clone()),
        share: share_of(&pool, caller, &parts.headers, charged_prompt, parsed.requested_output()),
        charged: false,
    };
    let outbound = Outbound {
        method: Method::POST,
        // The query string as it came (Azure-style clients send
        // `api-version`); it is in the cache key too.
        path_and_query: match parts.uri.query() {
            Some(q) => format!("{}?{q}", endpoint.path()),
            None => endpoint.path().to_owned(),
        },
        headers: upstream_headers(&parts.headers, caller.is_some()),
        body: asked.unwrap_or(bytes),
        pool: Some(pool),
        cache_salt: salt.map(|s| s.engine),
        peer,
        metered: None,
        share: None,
    };
    let mut response = forward(dispatcher, outbound, Some(ctx)).await;
    admitted.set_headers(&mut response);
    super::concurrency::hold(response, counted)
}

/// A request's tenant, class and cost in the gateway queue, when `pool`'s
/// policy holds requests (only such a policy orders them by it): `prompt`
/// tokens asking for `output`.
pub(super) fn share_of(
    pool: &Pool,
    caller: Option<&Caller>,
    headers: &HeaderMap,
    prompt: u64,
    output: Option<u64>,
) -> Option<Share> {
    pool.policy().current_arc().holds_requests().then(|| {
        Share::new(
            match caller {
                Some(c) => Tenant::named(Scope::Tenant, &c.tenant).0,
                None => Tenant::of(Scope::Tenant, headers).0,
            },
            caller
                .map_or(Priority::Interactive, |c| c.priority)
                .lowered_by(headers.get(PRIORITY_HEADER).map(HeaderValue::as_bytes)),
            caller.map_or(1, |c| c.weight),
            prompt,
            output,
        )
    })
}

/// The answer to `parsed` from a fresh cached body (`None` if a streaming
/// replay of it cannot be made).
fn cached_answer(stored: &Bytes, endpoint: Endpoint, parsed: &prompt::ParsedRequest<'_>) -> Option<Response<Body>> {
    let mut response = if parsed.stream {
        let events = sse::replay(endpoint, stored, parsed.include_usage())?;
        let mut r = full_response(StatusCode::OK, "text/event-stream", events);
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    } else {
        full_response(StatusCode::OK, "application/json", stored.clone())
    };
    let headers = response.headers_mut();
    set_static_header(headers, CACHE_HEADER, "hit");
    set_static_header(headers, BACKEND_HEADER, "cache");
    Some(response)
}

/// The hashed session key of a request, from the first of the
/// policy's session headers it carries, else its body's `user` field,
/// else a chat's opening (each when the policy asks for it; see
/// [`crate::routing::SessionSource`]).
fn session_key(pool: &Pool, headers: &HeaderMap, parsed: &prompt::ParsedRequest<'_>) -> Option<u64> {
    let body = &parsed.body;
    let policy = pool.policy().current_arc();
    let source = policy.session_source()?;
    let from_header = source
        .headers
        .iter()
        .find_map(|name| headers.get(name.as_str()))
        .map(HeaderValue::as_bytes)
        .filter(|v| !v.is_empty());
    let from_user = || {
        source
            .user_field
            .then(|| body.get("user").and_then(crate::openai::body::Json::as_str))
            .flatten()
            .filter(|u| !u.is_empty())
            .map(str::as_bytes)
    };
    from_header
        .or_else(from_user)
        .map(seahash::hash)
        .or_else(|| source.opening.then(|| prompt::opening(&parsed.body)).flatten())
}

/// `body` with its `model` field, whose value is `model` (borrowed from
/// `body` unless it had escapes), set to `name`: the bytes around it kept
/// as they are, else the body parsed and written again.
pub(crate) fn with_model(body: &Bytes, model: &str, name: &str) -> Bytes {
    let start = (model.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    let quoted = serde_json::to_string(name).expect("a string serializes");
    if start < body.len() && start + model.len() <= body.len() && body[start..start + model.len()] == *model.as_bytes()
    {
        let mut out = Vec::with_capacity(body.len() + quoted.len());
        out.extend_from_slice(&body[..start]);
        out.extend_from_slice(&quoted.as_bytes()[1..quoted.len() - 1]);
        out.extend_from_slice(&body[start + model.len()..]);
        return Bytes::from(out);
    }
    super::http::with_string_field(body, "model", name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::body::Json;

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
