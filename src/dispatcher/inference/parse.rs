//! Stage 1, parse: the request body read and parsed once, its model pool
//! picked (and the caller's right to it checked), its session key taken.
//! Large bodies are parsed on the blocking pool.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Response, StatusCode, request};

use crate::config::SessionsConfig;
use crate::dispatcher::http::{Body, error_response, json_response};
use crate::openai::body::Json;
use crate::openai::prompt::{self, Endpoint};
use crate::pools::{ModelPools, Pool};
use crate::prefix::blocks::TenantSalt;
use crate::routing::affinity::{self, Affinity};
use crate::tenancy::auth::Caller;

/// Bodies longer than this are parsed, and their chats rendered, on the
/// blocking pool: parsing costs about 40 ns a byte for the worst shapes
/// (hundreds of thousands of tiny messages), so a body of the 16 MiB limit
/// would hold the reactor, and every other request of the dispatcher, for
/// up to 0.6 s. Below this (about 10 µs of parsing) the hand-off would
/// cost more than it saves.
pub(in crate::dispatcher) const BLOCKING_PARSE_BYTES: usize = 256 << 10;

/// A parsed inference request: its head, its parsed body (borrowing the
/// body's bytes), the pool it is for, its session key (for the policy's
/// hash ring), and where it wants to go ([`Affinity`]).
pub(super) struct Parsed<'b> {
    pub parts: request::Parts,
    pub parsed: prompt::ParsedRequest<'b>,
    pub pool: Arc<Pool>,
    pub session: Option<u64>,
    pub affinity: Option<Affinity>,
    /// The tenant's salt of its affinity keys (0: no tenants).
    pub affinity_salt: u64,
}

/// Parses `bytes` (the body of the request whose head is `parts`) and
/// picks its pool; an unparsable body, an unknown model or one the caller
/// may not use is answered here.
pub(super) async fn parse<'b>(
    super::Asked {
        dispatcher,
        caller,
        endpoint,
    }: super::Asked<'_>,
    parts: request::Parts,
    bytes: &'b Bytes,
) -> Result<Parsed<'b>, Response<Body>> {
    let limits = &dispatcher.config().limits;
    let request_limits = prompt::RequestLimits {
        max_messages: limits.max_messages as usize,
        max_prompt_bytes: usize::try_from(limits.max_prompt_bytes.bytes()).unwrap_or(usize::MAX),
    };
    let (parsed, pool) = parse_body(dispatcher.pools(), caller, endpoint, bytes, request_limits).await?;
    let session = session_key(&pool, &parts.headers, &parsed);
    let affinity_salt = caller.map_or(0, |c| {
        TenantSalt::new(&c.tenant, dispatcher.segment().header().seed[0]).key
    });
    let affinity = affinity(&dispatcher.config().sessions, affinity_salt, &parts.headers, &parsed);
    Ok(Parsed {
        parts,
        parsed,
        pool,
        session,
        affinity,
        affinity_salt,
    })
}

/// The pool `model` names, if the caller may use it.
pub(in crate::dispatcher) fn pick_pool(
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
pub(in crate::dispatcher) async fn off_reactor_if_large<T: Send + 'static>(
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
async fn parse_body<'b>(
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

/// Where a request wants to go: the engine that stored the response a
/// Responses request continues (`previous_response_id`), else its
/// session's engine (the first of `sessions`' headers, then body fields,
/// it carries), keyed for the tenant salted `salt`.
fn affinity(
    sessions: &SessionsConfig,
    salt: u64,
    headers: &HeaderMap,
    parsed: &prompt::ParsedRequest<'_>,
) -> Option<Affinity> {
    if let Some(previous) = parsed.previous_response_id() {
        return Some(Affinity::Stored(affinity::stored_key(salt, previous)));
    }
    if !sessions.enabled {
        return None;
    }
    let from_header = sessions
        .headers
        .iter()
        .find_map(|name| headers.get(name.as_str()))
        .map(HeaderValue::as_bytes)
        .filter(|v| !v.is_empty());
    let from_field = || {
        sessions.fields.iter().find_map(|path| {
            let mut parts = path.split('.');
            let first = parsed.body.get(parts.next()?)?;
            let value = parts.try_fold(first, |v, name| v.as_object()?.get(name))?;
            match value {
                Json::String(s) if !s.is_empty() => Some(s.as_bytes()),
                _ => None,
            }
        })
    };
    from_header
        .or_else(from_field)
        .map(|value| Affinity::Session(affinity::session_key(salt, value)))
}
