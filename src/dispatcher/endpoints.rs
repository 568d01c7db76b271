//! The route table: which handler answers which method and path (a path
//! with encoded separators or dot-segments is refused first), and the
//! small routes (`/health`, `/metrics`). See the [parent module](super)
//! for the list.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use super::Dispatcher;
use super::http::{Body, error_response, full_response, json_response, remove_diagnostics, set_header};
use super::inference::inference;
use super::models::models;
use super::passthrough;
use super::proxy::Relayed;
use crate::metrics::{DURATION, EndpointLabel, Snapshot};
use crate::openai::prompt::Endpoint;
use crate::routing::live_candidates;

/// Answers one request (never fails: errors are responses).
pub(super) async fn handle(dispatcher: Arc<Dispatcher>, request: Request<Incoming>) -> Response<Body> {
    let start = std::time::Instant::now();
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    if let Some(why) = path_refusal(&path) {
        dispatcher.metrics().request(EndpointLabel::Other, 400);
        return error_response(
            StatusCode::BAD_REQUEST,
            format!("the path {path:?} is refused: {why}"),
            Some("invalid_path"),
        );
    }
    let allowed = match path.as_str() {
        "/v1/completions" | "/v1/chat/completions" | "/v1/responses" | "/v1/messages" => Some(Method::POST),
        p if passthrough::PATHS.contains(&p) => Some(Method::POST),
        "/v1/models" | "/health" | "/metrics" | crate::peers::LOAD_PATH => Some(Method::GET),
        _ => None,
    };
    // Client authentication, on every /v1 route: the client's key, or a
    // peer gateway's credential and the tenant it authenticated.
    let caller = match dispatcher.keys() {
        Some(keys) if path.starts_with("/v1/") => {
            match super::peer_forward::forwarded_tenant(&dispatcher, request.headers()) {
                Some(Ok(tenant)) => Some(keys.peer_caller(tenant)),
                Some(Err(why)) => {
                    dispatcher.metrics().request(EndpointLabel::of_path(&path), 401);
                    return error_response(StatusCode::UNAUTHORIZED, why, Some("invalid_peer_token"));
                }
                None => match keys.caller(request.headers()) {
                    Ok(caller) => Some(caller),
                    Err(refusal) => {
                        let mut r = error_response(StatusCode::UNAUTHORIZED, refusal.message(), Some(refusal.code()));
                        set_header(r.headers_mut(), "www-authenticate", "Bearer");
                        dispatcher.metrics().request(EndpointLabel::of_path(&path), 401);
                        return r;
                    }
                },
            }
        }
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
        ("/v1/responses", _) => inference(&dispatcher, request, Endpoint::Responses, caller).await,
        ("/v1/messages", _) => inference(&dispatcher, request, Endpoint::Messages, caller).await,
        ("/v1/models", _) => models(&dispatcher, caller).await,
        ("/health", _) => health(&dispatcher),
        (crate::peers::LOAD_PATH, _) => super::peer_forward::load_summary(&dispatcher, request.headers()),
        // With a metrics listener of its own, /metrics is not a route here.
        ("/metrics", _) if dispatcher.config().metrics.listen.is_none() => {
            match scrape_refusal(&dispatcher, request.headers()) {
                Some(refused) => refused,
                None => metrics(&dispatcher).await,
            }
        }
        (p, _) if passthrough::PATHS.contains(&p) => passthrough::passthrough(&dispatcher, request, caller).await,
        _ => error_response(
            StatusCode::NOT_FOUND,
            format!("{method} {path} is not a route of this server"),
            Some("unknown_url"),
        ),
    };
    // An authenticated caller learns nothing of the fleet or of other
    // tenants from the answer's headers unless the operator allows it.
    if caller.is_some() && !dispatcher.config().auth.debug_headers {
        remove_diagnostics(response.headers_mut());
    }
    // Anthropic's clients read errors in Anthropic's shape.
    if path.starts_with("/v1/messages") {
        response = anthropic_shaped(response).await;
    }
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

/// `response` with an error the gateway answered itself (a JSON body it
/// built, not an engine's relayed answer) in Anthropic's error shape
/// ([`crate::openai::anthropic::error_body`]).
async fn anthropic_shaped(response: Response<Body>) -> Response<Body> {
    use http_body_util::BodyExt;
    let gateways = response.extensions().get::<Relayed>().is_none()
        && (response.status().is_client_error() || response.status().is_server_error())
        && response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes() == b"application/json");
    if !gateways {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // The gateway's own error bodies are whole: collecting does not wait.
    let Ok(bytes) = body.collect().await.map(|c| c.to_bytes()) else {
        return error_response(parts.status, "the error body could not be read", None);
    };
    let shaped = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(v) if v.get("error").is_some_and(|e| e.get("message").is_some()) => {
            crate::openai::anthropic::error_body(parts.status, &v)
                .to_string()
                .into()
        }
        _ => bytes,
    };
    parts.headers.remove(http::header::CONTENT_LENGTH);
    Response::from_parts(parts, super::http::full_body(shaped))
}

/// `GET /metrics`: the whole gateway's counters (every process's stats
/// block summed) and the gauges read from the segment, as Prometheus text.
/// Why a scrape of `/metrics` on the gateway's listener is refused: with
/// `metrics.token_file`, a request without its bearer token (401); with
/// `[auth]` and no token file, every request (404: the metrics name
/// tenants, their usage and the engines' addresses; serve them on
/// `metrics.listen` or behind a token).
fn scrape_refusal(dispatcher: &Dispatcher, headers: &http::HeaderMap) -> Option<Response<Body>> {
    match dispatcher.metrics_token() {
        Some(token) => {
            let presented = headers
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes())
                .map(crate::response_cache::bearer_token)
                .unwrap_or_default();
            (!crate::tenancy::auth::constant_time_eq(presented.trim_ascii(), token.as_bytes())).then(|| {
                let mut r = error_response(
                    StatusCode::UNAUTHORIZED,
                    "/metrics needs the metrics token (metrics.token_file) as a bearer token",
                    Some("invalid_metrics_token"),
                );
                set_header(r.headers_mut(), "www-authenticate", "Bearer");
                r
            })
        }
        None if dispatcher.keys().is_some() => Some(error_response(
            StatusCode::NOT_FOUND,
            "/metrics is not served to clients when [auth] is on: scrape metrics.listen, or set metrics.token_file and present its token",
            Some("unknown_url"),
        )),
        None => None,
    }
}

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

/// Why `path` is refused before any route is matched (`None`: it is a
/// plain path): a percent-encoded `/`, `\\`, `.` or control character,
/// a `.` or `..` segment, an empty segment or a backslash. The routes
/// match the path as it comes, while an engine behind the gateway may
/// decode and resolve it (uvicorn, which serves vLLM and SGLang, decodes
/// `%2F`): `/v1/chat%2Fcompletions` would be a route the gateway does not
/// know and an engine does.
fn path_refusal(path: &str) -> Option<&'static str> {
    let bytes = path.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'\\' {
            return Some("a backslash");
        }
        if b == b'%' {
            let hex = |j: usize| bytes.get(j).and_then(|&h| (h as char).to_digit(16));
            let Some(decoded) = hex(i + 1).zip(hex(i + 2)).map(|(h, l)| (h * 16 + l) as u8) else {
                return Some("a '%' that is not followed by two hex digits");
            };
            if matches!(decoded, b'/' | b'\\' | b'.' | b'%') || decoded.is_ascii_control() {
                return Some("a percent-encoded '/', '\\', '.', '%' or control character");
            }
        }
    }
    if path.contains("//") {
        return Some("an empty segment ('//')");
    }
    path.split('/')
        .any(|segment| segment == "." || segment == "..")
        .then_some("a '.' or '..' segment")
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

#[cfg(test)]
mod tests {
    use super::path_refusal;

    #[test]
    fn plain_paths_pass_and_encoded_separators_and_dot_segments_do_not() {
        for plain in [
            "/",
            "/health",
            "/v1/chat/completions",
            "/v1/chat/completions/",
            "/v1/models/org%20model",
            "/v1/files/file-abc.jsonl",
            "/v1/..x/y",
        ] {
            assert_eq!(path_refusal(plain), None, "{plain}");
        }
        for refused in [
            "/v1/chat%2Fcompletions",
            "/v1/chat%2fcompletions",
            "/v1/%2e%2e/admin",
            "/v1/%2E",
            "/v1/a%5cb",
            "/v1/a%00",
            "/v1/a%7F",
            "/v1/a%25",
            "/v1/a%",
            "/v1/a%2",
            "/v1/a%zz",
            "/v1/./chat/completions",
            "/v1/../v1/chat/completions",
            "/v1/..",
            "/..",
            "/v1//chat/completions",
            "//v1/chat/completions",
            "/v1/chat\\completions",
        ] {
            assert!(path_refusal(refused).is_some(), "{refused}");
        }
    }
}
