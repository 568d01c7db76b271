//! Stage 5, look up or answer: the store's lookup of the prompt's chain
//! (the prefix match on each server, and a conversation's continuation),
//! and of the response cache; a fresh cached answer is the answer, replayed
//! as a stream when the client asked for one.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use shm_layout::UsageCounter;

use super::key::Keyed;
use super::parse::Parsed;
use super::tokenize::Tokens;
use crate::dispatcher::charge::Admitted;
use crate::dispatcher::http::{
    BACKEND_HEADER, Body, CACHE_HEADER, DISPATCH_HEADER, full_response, set_header, set_static_header,
};
use crate::dispatcher::timing::{DispatchTiming, Mark};
use crate::dispatcher::{pick, sse, tenant_usage};
use crate::metrics::CacheResult;
use crate::openai::prompt::{Endpoint, ParsedRequest};
use crate::prefix::continuation::{EndProbe, answer_tokens_estimate};
use crate::routing::Leg;
use crate::routing::affinity::Affinity;
use crate::store::{Lookup, LookupRequest};

/// What the lookup found.
pub(super) enum Found {
    /// The answer, from the response cache.
    Answered(Response<Body>),
    /// The request goes on to a server: the lookup, and the tokens of an
    /// earlier answer its prompt carries (estimated; 0: none).
    Route { lookup: Lookup, answer_tokens: u32 },
}

/// Looks the request up; answers it from the response cache if it can.
pub(super) async fn look_up(
    super::Asked {
        dispatcher,
        caller,
        endpoint,
    }: super::Asked<'_>,
    request: &Parsed<'_>,
    tokens: &Tokens,
    keyed: &Keyed,
    admitted: &Admitted,
    timing: &mut DispatchTiming,
) -> Found {
    let Parsed { parsed, pool, .. } = request;
    // Without learning at dispatch nothing records end keys: no probes.
    let answer_tokens = if dispatcher.config().learn_at_dispatch {
        answer_tokens_estimate(parsed.earlier_answer_bytes, tokens.ids.len(), tokens.text_bytes)
    } else {
        0
    };
    let lookup_request = LookupRequest {
        response_key: keyed.key.filter(|_| keyed.cacheability.reads()),
        chain: &keyed.chain,
        exclude: &[],
        members: pool.members(),
        leg: Leg::Request,
        stale_after_ms: dispatcher.config().health.stale_after_ms,
        continuation: Some(EndProbe {
            tokens: &tokens.ids,
            chain: &keyed.chain,
            hasher: keyed.hasher,
            answer_tokens,
        }),
        precise: pool.precise(),
        affinity: request.affinity.map(Affinity::key),
    };
    let mut lookup = pick::lookup(dispatcher, lookup_request).await;
    let Some(mut response) = lookup
        .response
        .take()
        .and_then(|stored| cached_answer(&stored, endpoint, parsed))
    else {
        timing.mark(Mark::Cache);
        return Found::Route { lookup, answer_tokens };
    };
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
        prompt_tokens = tokens.ids.len(),
        blocks = keyed.chain.len(),
        cache = "hit",
        degraded = lookup.degraded,
        dispatch_ns = answered,
        "{} answered from the response cache",
        endpoint.path()
    );
    timing.observe(dispatcher, false, answered);
    set_header(response.headers_mut(), DISPATCH_HEADER, &timing.header(answered));
    admitted.set_headers(&mut response);
    Found::Answered(response)
}

/// The answer to `parsed` from a fresh cached body (`None` if a streaming
/// replay of it cannot be made).
fn cached_answer(stored: &Bytes, endpoint: Endpoint, parsed: &ParsedRequest<'_>) -> Option<Response<Body>> {
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
