//! The route table: which handler answers which method and path, and the
//! small routes (`/health`, `/metrics`, any other `/v1/...` proxied to the
//! least loaded server). See the [parent module](super) for the list.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use super::Dispatcher;
use super::http::{Body, error_response, full_response, json_response, set_header, upstream_headers};
use super::inference::{inference, with_model};
use super::models::models;
use super::proxy::{Outbound, Relayed, forward};
use super::rate;
use crate::auth::Caller;
use crate::body::Json;
use crate::metrics::{DURATION, EndpointLabel, Snapshot};
use crate::prompt::{Endpoint, RequestError};
use crate::routing::live_candidates;

/// Answers one request (never fails: errors are responses).
pub(super) async fn handle(dispatcher: Arc<Dispatcher>, request: Request<Incoming>) -> Response<Body> {
    let start = std::time::Instant::now();
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let allowed = match path.as_str() {
        "/v1/completions" | "/v1/chat/completions" => Some(Method::POST),
        "/v1/models" | "/health" | "/metrics" | crate::peers::LOAD_PATH => Some(Method::GET),
        _ => None,
    };
    // Client authentication, on every /v1 route.
    let caller = match dispatcher.keys() {
        Some(keys) if path.starts_with("/v1/") => match keys.caller(request.headers()) {
            Ok(caller) => Some(caller),
            Err(refusal) => {
                let mut r = error_response(StatusCode::UNAUTHORIZED, refusal.message(), Some(refusal.code()));
                set_header(r.headers_mut(), "www-authenticate", "Bearer");
                dispatcher.metrics().request(EndpointLabel::of_path(&path), 401);
                return r;
            }
        },
        _ => None,
    };
    let caller = caller.as_deref();
    let mut response = match (path.as_str(), allowed) {
        (_, Some(m)) if m != method => {
            let mut r = error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} is not allowed on {path}; use {m}"),
                Some("method_not_allowed"),
            );
            set_header(r.headers_mut(), "allow", m.as_str());
            r
        }
        ("/v1/completions", _) => inference(&dispatcher, request, Endpoint::Completions, caller).await,
        ("/v1/chat/completions", _) => inference(&dispatcher, request, Endpoint::ChatCompletions, caller).await,
        ("/v1/models", _) => models(&dispatcher, caller).await,
        ("/health", _) => health(&dispatcher),
        (crate::peers::LOAD_PATH, _) => super::peer_forward::load_summary(&dispatcher, request.headers()),
        // With a metrics listener of its own, /metrics is not a route here.
        ("/metrics", _) if dispatcher.config().metrics.listen.is_none() => metrics(&dispatcher).await,
        (p, _) if p.starts_with("/v1/") => passthrough(&dispatcher, request, caller).await,
        _ => error_response(
            StatusCode::NOT_FOUND,
            format!("{method} {path} is not a route of this server"),
            Some("unknown_url"),
        ),
    };
    let endpoint = EndpointLabel::of_path(&path);
    let m = dispatcher.metrics();
    m.request(endpoint, response.status().as_u16());
    // A relayed answer records its duration when its body ends; the others
    // (cached answers, errors) are complete now.
    let relayed = response.extensions_mut().remove::<Relayed>().is_some();
    if matches!(endpoint, EndpointLabel::Completions | EndpointLabel::ChatCompletions) && !relayed {
        m.observe_duration(DURATION, start.elapsed());
    }
    response
}

/// `GET /metrics`: the whole gateway's counters (every process's stats
/// block summed) and the gauges read from the segment, as Prometheus text.
async fn metrics(dispatcher: &Arc<Dispatcher>) -> Response<Body> {
    let d = dispatcher.clone();
    // Counting the prefix table's entries scans it: off the reactor.
    let render = move || Snapshot::text_of(d.segment(), d.config().health.stale_after_ms);
    match tokio::task::spawn_blocking(render).await {
        Ok(text) => full_response(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", text),
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}"),
            None,
        ),
    }
}

/// Any other `/v1/...` request: proxied to the least loaded live server
/// of the model pool its body names (`model`; an unknown one: 404), else
/// of every server.
async fn passthrough(
    dispatcher: &Arc<Dispatcher>,
    request: Request<Incoming>,
    caller: Option<&Caller>,
) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let bytes = match dispatcher.read_body(&parts.headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    // A body naming a model (embeddings, rerank, ...) goes to its pool.
    let pools = dispatcher.pools();
    let mut pool = None;
    let mut bytes = bytes;
    // Without pools or keys any server takes it: nothing to read.
    let by_model = !pools.is_implicit() || caller.is_some();
    if by_model
        && let Ok(Json::Object(body)) = Json::parse(&bytes)
        && let Some(Json::String(model)) = body.get("model")
    {
        match pools.find(model) {
            Some(found) if caller.is_some_and(|c| !c.may_use(model, found.chain_model(model))) => {
                let e = RequestError::model_not_allowed(model);
                return json_response(e.status, &e.body());
            }
            Some(found) => {
                if let Some(name) = found.upstream_name(model) {
                    let rewritten = with_model(&bytes, model, name);
                    drop(body);
                    bytes = rewritten;
                }
                pool = Some(found.clone());
            }
            None => {
                let e = RequestError::model_not_found(model);
                return json_response(e.status, &e.body());
            }
        }
    }
    // Its limits: one request (its tokens are not counted here).
    let admitted = match &pool {
        Some(pool) => match rate::admit(dispatcher, caller, pool, 0).await {
            Ok(a) => a,
            Err(refused) => return refused,
        },
        None => Default::default(),
    };
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
    };
    let mut response = forward(dispatcher, outbound, None).await;
    admitted.set_headers(&mut response);
    response
}

/// `GET /health`: 200 when a server is live.
fn health(dispatcher: &Dispatcher) -> Response<Body> {
    let tables = dispatcher.segment().tables();
    let mut candidates = Vec::new();
    live_candidates(&tables, &mut candidates);
    if candidates.is_empty() {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "no inference server is live",
            Some("no_server_available"),
        );
    }
    json_response(
        StatusCode::OK,
        &json!({"status": "ok", "live_servers": candidates.len()}),
    )
}
