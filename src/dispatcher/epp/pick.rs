//! The pick: a request's head and whole body in, the endpoints out. The
//! same steps as the HTTP front's (`super::super::inference::prepare`:
//! parse, tokenize, admit, key, look up; then the proxy's routing,
//! [`super::super::proxy::pick`]), with the Gateway API Inference
//! Extension's headers read first: the fairness id as the tenant, the
//! objective as the class, the model rewrite, the subset hint.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode};
use shm_layout::ServerRef;

use super::wire::{Head, host_port};
use crate::dispatcher::concurrency::Counted;
use crate::dispatcher::http::{Body, error_response};
use crate::dispatcher::inference::{Ready, prepare};
use crate::dispatcher::proxy::{Outbound, Picked, pick};
use crate::dispatcher::timing::DispatchTiming;
use crate::dispatcher::{Dispatcher, concurrency, with_model};
use crate::openai::prompt::Endpoint;
use crate::routing::live_candidates;
use crate::tenancy::auth::{Caller, Keys};
use crate::tenancy::fair_share::PRIORITY_HEADER;

/// The header that names the request's tenant for fair share and limits.
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// The header that names the request's objective (its class).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The header that names the model to rewrite the body's `model` to.
pub const REWRITE_HEADER: &str = "x-gateway-model-name-rewrite";

/// Most fallbacks listed after the pick.
const FALLBACKS: usize = 2;

/// What a request's head and body come to.
pub enum Decision<'d> {
    /// Routed: the server picked (counted in flight), the endpoints to
    /// name, the body to send.
    Routed(Box<Routed<'d>>),
    /// The gateway's own answer (an error in the OpenAI shape, or the
    /// response cache's answer): Envoy sends it to the client.
    Answer(Response<Body>),
}

/// A request routed by the picker.
pub struct Routed<'d> {
    /// The server picked, counted in flight until the answer ends.
    pub picked: Picked<'d>,
    /// The pick, then its fallbacks, as `ip:port`, comma-separated.
    pub endpoints: String,
    /// The body to send the engine (`None`: the request has none).
    pub body: Option<Bytes>,
    /// Its tenant's place among its requests in flight on this host.
    pub counted: Option<Counted>,
}

/// Decides where the request `head` with `body` (`None`: it has none)
/// goes, among `subset` when Envoy gave a hint.
pub async fn decide<'d>(
    dispatcher: &'d Arc<Dispatcher>,
    mut head: Head,
    body: Option<Bytes>,
    subset: Option<&[String]>,
) -> Decision<'d> {
    let caller = caller_of(dispatcher, &head.headers);
    if objective_is_batch(head.headers.get(OBJECTIVE_HEADER)) {
        head.headers.insert(PRIORITY_HEADER, HeaderValue::from_static("batch"));
    }
    let avoid = match subset {
        Some(subset) => {
            let avoid = outside(dispatcher, subset);
            if subset.is_empty() || avoid.len() == registered(dispatcher) {
                return Decision::Answer(error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "none of the endpoints of the subset hint is an inference server of this gateway",
                    Some("no_server_available"),
                ));
            }
            avoid
        }
        None => Vec::new(),
    };
    let counted = match concurrency::begin(dispatcher, caller.as_deref()) {
        Ok(c) => c,
        Err(refused) => return Decision::Answer(*refused),
    };
    let endpoint = match head.path.split('?').next().unwrap_or("") {
        "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/responses" => Some(Endpoint::Responses),
        "/v1/messages" => Some(Endpoint::Messages),
        _ => None,
    };
    let (outbound, ctx) = match (endpoint, body) {
        (Some(endpoint), Some(body)) => {
            let body = match head.headers.get(REWRITE_HEADER).and_then(|v| v.to_str().ok()) {
                Some(name) if !name.is_empty() => match rewritten(&body, name) {
                    Some(body) => body,
                    None => return Decision::Answer(bad_json()),
                },
                _ => body,
            };
            let parts = parts_of(head);
            match prepare(
                dispatcher,
                caller.as_deref(),
                endpoint,
                parts,
                &body,
                DispatchTiming::new(),
            )
            .await
            {
                Ok(Ready { mut outbound, ctx, .. }) => {
                    // Envoy sends it: no peer gateway takes it from here.
                    outbound.peer = None;
                    (outbound, Some(ctx))
                }
                Err(answer) => return Decision::Answer(answer),
            }
        }
        // Not inference: the least loaded server, as for the HTTP front's
        // other routes.
        (_, body) => (other_request(head, body), None),
    };
    let had_body = !outbound.body.is_empty() || ctx.is_some();
    let picked = match pick(dispatcher, outbound, ctx, avoid.clone()).await {
        Ok(p) => p,
        Err(answer) => return Decision::Answer(answer),
    };
    let endpoints = endpoints(dispatcher, &picked, &avoid);
    let body = had_body.then(|| picked.body());
    Decision::Routed(Box::new(Routed {
        picked,
        endpoints,
        body,
        counted,
    }))
}

/// The request's tenant: the fairness id (under the keys file's rules for
/// it with `[auth]`), else the key it presents with `[auth]`. The picker
/// authenticates no one: Envoy, in front of it, does.
fn caller_of(dispatcher: &Dispatcher, headers: &http::HeaderMap) -> Option<Arc<Caller>> {
    let keys = dispatcher.keys();
    let fairness = headers
        .get(FAIRNESS_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    match (fairness, keys) {
        (Some(tenant), Some(keys)) => Some(keys.peer_caller(tenant)),
        (Some(tenant), None) => Some(Keys::default().peer_caller(tenant)),
        (None, Some(keys)) => keys.caller(headers).ok(),
        (None, None) => None,
    }
}

/// Whether an objective names the batch class. The gateway has two
/// classes, interactive (the default) and batch: an objective named
/// `batch` or `sheddable`, or a negative priority, is batch; any other
/// is interactive (a tenant's class is only ever lowered).
fn objective_is_batch(objective: Option<&HeaderValue>) -> bool {
    let Some(objective) = objective.and_then(|v| v.to_str().ok()).map(str::trim) else {
        return false;
    };
    objective.eq_ignore_ascii_case("batch")
        || objective.eq_ignore_ascii_case("sheddable")
        || objective.parse::<i64>().is_ok_and(|p| p < 0)
}

/// `body` with its `model` set to `name` (`None`: not a JSON object).
fn rewritten(body: &Bytes, name: &str) -> Option<Bytes> {
    use crate::openai::body::Json;
    let Ok(Json::Object(parsed)) = Json::parse(body) else {
        return None;
    };
    match crate::openai::prompt::request_model(&parsed) {
        Ok(model) => Some(with_model(body, &model, name)),
        Err(_) => Some(crate::dispatcher::http::with_string_field(body, "model", name)),
    }
}

/// 400 for a body that is not a JSON object, in the HTTP front's shape.
fn bad_json() -> Response<Body> {
    error_response(
        StatusCode::BAD_REQUEST,
        "the request body is not a JSON object",
        Some("invalid_json"),
    )
}

/// The request head as the pipeline's stages read it.
fn parts_of(head: Head) -> http::request::Parts {
    let mut request = http::Request::new(());
    *request.method_mut() = Method::from_bytes(head.method.as_bytes()).unwrap_or(Method::POST);
    if let Ok(uri) = head.path.parse() {
        *request.uri_mut() = uri;
    }
    *request.headers_mut() = head.headers;
    request.into_parts().0
}

/// A request that is not inference, routed by load to any server.
fn other_request(head: Head, body: Option<Bytes>) -> Outbound {
    Outbound {
        method: Method::from_bytes(head.method.as_bytes()).unwrap_or(Method::GET),
        path_and_query: head.path,
        headers: head.headers,
        body: body.unwrap_or_default(),
        pool: None,
        cache_salt: None,
        peer: None,
        metered: None,
        share: None,
    }
}

/// How many servers are registered.
fn registered(dispatcher: &Dispatcher) -> usize {
    let servers = &dispatcher.segment().tables().servers;
    (0..servers.capacity() as u16)
        .filter(|slot| servers.current(*slot).is_some())
        .count()
}

/// The registered servers whose address is not one of `subset`'s.
fn outside(dispatcher: &Dispatcher, subset: &[String]) -> Vec<ServerRef> {
    let servers = &dispatcher.segment().tables().servers;
    (0..servers.capacity() as u16)
        .filter_map(|slot| servers.get(slot))
        .filter(|info| !subset.iter().any(|s| *s == host_port(&info.address)))
        .map(|info| info.server)
        .collect()
}

/// The pick, then up to [`FALLBACKS`] other live servers of its pool and
/// role (least loaded first, none of `avoid`), as `ip:port`,
/// comma-separated: a split request's decode leg falls back on decode
/// engines only, which can pull the same prefill.
fn endpoints(dispatcher: &Dispatcher, picked: &Picked<'_>, avoid: &[ServerRef]) -> String {
    let tables = dispatcher.segment().tables();
    let mut out = host_port(picked.address());
    let mut live = Vec::new();
    live_candidates(&tables, &mut live);
    live.retain(|c| {
        c.server != picked.server()
            && !avoid.contains(&c.server)
            && picked.same_leg(c.server)
            && picked.admits(tables.servers.membership(c.server.slot))
    });
    live.sort_by_key(|c| (c.inflight, c.inflight_tokens));
    for c in live.iter().take(FALLBACKS) {
        if let Some(info) = tables.servers.get(c.server.slot).filter(|i| i.server == c.server) {
            out.push(',');
            out.push_str(&host_port(&info.address));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_batch_like_objectives_lower_the_class() {
        let of = |v: &'static str| objective_is_batch(Some(&HeaderValue::from_static(v)));
        assert!(of("batch"));
        assert!(of("Sheddable"));
        assert!(of("-1"));
        assert!(!of("critical"));
        assert!(!of("5"));
        assert!(!of("food-review"));
        assert!(!objective_is_batch(None));
    }
}
