//! `GET /v1/models`: with model pools, the configured models (each name
//! and alias, an adapter with its `parent`, and how many live servers
//! serve it); without, every live server's model list, merged by `id`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{Value, json};

use super::Dispatcher;
use super::http::{Body, error_response, json_response};
use super::proxy::unavailable;
use crate::auth::Caller;
use crate::pools::ModelPools;
use crate::routing::live_candidates;

/// Largest `/v1/models` answer read from one server.
const MAX_MODELS_BYTES: usize = 8 << 20;

/// The live servers' addresses.
fn live_addresses(dispatcher: &Dispatcher) -> Vec<String> {
    let tables = dispatcher.segment().tables();
    let mut candidates = Vec::new();
    live_candidates(&tables, &mut candidates);
    candidates
        .iter()
        .filter_map(|c| tables.servers.get(c.server.slot).filter(|i| i.server == c.server))
        .map(|i| i.address)
        .collect()
}

/// `GET /v1/models`: the configured models, or every live server's list
/// merged by `id` when there are no pools.
pub(super) async fn models(dispatcher: &Arc<Dispatcher>, caller: Option<&Caller>) -> Response<Body> {
    let pools = dispatcher.pools();
    if !pools.is_implicit() {
        return configured(dispatcher, &pools, caller);
    }
    let addresses = live_addresses(dispatcher);
    if addresses.is_empty() {
        return unavailable("no inference server is available", "no_server_available");
    }
    let wait = dispatcher
        .config()
        .limits
        .request_timeout()
        .min(Duration::from_secs(10));
    let lists = futures_util::future::join_all(addresses.iter().map(|a| fetch_models(dispatcher, a, wait))).await;
    let mut data: Vec<Value> = Vec::new();
    let mut answered = 0;
    for list in lists.into_iter().flatten() {
        answered += 1;
        for model in list {
            let id = model.get("id").cloned();
            if !data.iter().any(|m| m.get("id").cloned() == id) {
                data.push(model);
            }
        }
    }
    if answered == 0 {
        return error_response(
            StatusCode::BAD_GATEWAY,
            "no inference server answered /v1/models",
            Some("upstream_unavailable"),
        );
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// One server's `data` list, or `None` if it did not answer well.
async fn fetch_models(dispatcher: &Dispatcher, address: &str, wait: Duration) -> Option<Vec<Value>> {
    let uri: Uri = format!("{address}/v1/models").parse().ok()?;
    let mut request = Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = uri;
    let response = tokio::time::timeout(wait, dispatcher.client().request(request))
        .await
        .ok()?
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    let body = tokio::time::timeout(wait, Limited::new(response.into_body(), MAX_MODELS_BYTES).collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    match serde_json::from_slice::<Value>(&body).ok()?.get_mut("data")?.take() {
        Value::Array(list) => Some(list),
        _ => None,
    }
}

/// The configured models, in OpenAI's list shape (with vLLM's `root` and
/// `parent` for adapters) and the live servers of each.
fn configured(dispatcher: &Dispatcher, pools: &ModelPools, caller: Option<&Caller>) -> Response<Body> {
    let tables = dispatcher.segment().tables();
    let mut candidates = Vec::new();
    live_candidates(&tables, &mut candidates);
    let ids: Vec<Option<u64>> = candidates.iter().map(|c| tables.servers.id_of(c.server.slot)).collect();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let data: Vec<Value> = pools
        .names()
        .filter(|(id, pool)| caller.is_none_or(|c| c.may_use(id, pool.chain_model(id))))
        .map(|(id, pool)| {
            let name = pool.name().unwrap_or(id);
            json!({
                "id": id,
                "object": "model",
                "created": created,
                "owned_by": "semlb",
                "root": pool.base().unwrap_or(name),
                "parent": pool.base(),
                "live_servers": ids.iter().filter(|i| pool.members().admits(**i)).count(),
            })
        })
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}
