//! Stage 6, send: the request as it goes upstream (the pool's model name
//! for an alias, the stream's usage asked for on the client's behalf, a
//! copy kept for a peer gateway) and what the proxy learns from
//! ([`InferenceCtx`]), for the hand-off to the proxy.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};

use super::key::Keyed;
use super::parse::{Parsed, off_reactor_if_large};
use super::tokenize::Tokens;
use crate::dispatcher::charge::Admitted;
use crate::dispatcher::http::{Body, error_response, upstream_headers, upstream_request_headers};
use crate::dispatcher::peer_forward::PeerCopy;
use crate::dispatcher::proxy::{InferenceCtx, Outbound};
use crate::dispatcher::share;
use crate::dispatcher::stream_usage::{with_include_usage, with_usage_option};
use crate::dispatcher::timing::DispatchTiming;
use crate::openai::prompt::Endpoint;
use crate::pools::Pool;
use crate::response_cache::{Scope, Tenant};
use crate::store::Lookup;
use crate::tenancy::auth::Caller;
use crate::tenancy::fair_share::{PRIORITY_HEADER, Priority, Share};

/// What the stages before gathered, handed to the proxy.
pub(super) struct Gathered {
    pub tokens: Tokens,
    pub keyed: Keyed,
    pub lookup: Lookup,
    pub answer_tokens: u32,
    pub timing: DispatchTiming,
}

/// The request as it goes to the server its policy picks (or a peer
/// gateway), and what the proxy learns from; `Err`: the gateway's answer.
pub(super) async fn prepare(
    super::Asked {
        dispatcher,
        caller,
        endpoint,
    }: super::Asked<'_>,
    request: Parsed<'_>,
    bytes: &Bytes,
    gathered: Gathered,
    admitted: &mut Admitted,
) -> Result<(Outbound, InferenceCtx), Response<Body>> {
    let Parsed {
        parts,
        parsed,
        pool,
        session,
        affinity,
        affinity_salt,
    } = request;
    let Gathered {
        tokens,
        keyed,
        lookup,
        answer_tokens,
        timing,
    } = gathered;
    let cache = if keyed.cacheability.writes() {
        dispatcher.metrics().cache(crate::metrics::CacheResult::Miss);
        "miss"
    } else {
        dispatcher.metrics().cache(crate::metrics::CacheResult::Bypass);
        "bypass"
    };
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
    // An alias: the engines know the model by its pool's name.
    let bytes = match pool.upstream_name(&parsed.model) {
        Some(name) => with_model(bytes, &parsed.model, name),
        None => bytes.clone(),
    };
    // A streamed answer reports its usage (the engine's cached tokens) only
    // when asked: ask on the client's behalf, and keep it from the client.
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
            None => {
                return Err(error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the gateway is shutting down",
                    None,
                ));
            }
        },
    };
    let strip_usage = asked.is_some();
    // What this tenant may add to the tables every tenant shares.
    let within = share::within(
        dispatcher,
        caller,
        keyed.chain.len() as u64,
        keyed.cacheability.writes(),
    );
    if within != share::Within::ALL {
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
        end_key: keyed.hasher.prompt_end_key(&tokens.ids, &keyed.chain),
        answer_tokens,
        choices: parsed.answers(),
        template_blocks: keyed.template_blocks,
        hasher: keyed.hasher,
        store_key: keyed.key.filter(|_| keyed.cacheability.writes() && within.cache),
        cache,
        lookup: Some(lookup),
        endpoint,
        model: parsed.model.to_string(),
        session,
        affinity,
        affinity_salt,
        previous_response_id: parsed.previous_response_id().map(str::to_owned),
        carries_history: parsed.carries_history(),
        stores_response: parsed.stores_response(),
        strip_usage,
        output: admitted.output.take(),
        tenant: caller.map(|c| c.tenant.clone()),
        share: share_of(&pool, caller, &parts.headers, tokens.charged, parsed.requested_output()),
        charged: false,
        prompt_tokens: tokens.ids,
        chain: keyed.chain,
        resume: match endpoint {
            Endpoint::ChatCompletions | Endpoint::Completions if parsed.stream => Some(
                crate::dispatcher::resume::blocked(&parsed.body, endpoint == Endpoint::Completions),
            ),
            _ => None,
        },
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
        cache_salt: keyed.salt.map(|s| s.engine),
        peer,
        metered: None,
        share: None,
    };
    Ok((outbound, ctx))
}

/// A request's tenant, class and cost in the gateway queue, when `pool`'s
/// policy holds requests (only such a policy orders them by it): `prompt`
/// tokens asking for `output`.
pub(in crate::dispatcher) fn share_of(
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
    crate::dispatcher::http::with_string_field(body, "model", name)
}
