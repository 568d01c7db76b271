//! `GET /v1/models`: with model pools, the configured models (each name
//! and alias, an adapter with its `parent`, and how many live servers
//! serve it); without, every live server's model list, merged by `id`.
//!
//! The merged list is asked of the servers at most once per
//! [`MERGED_FRESH`] per dispatcher: requests meanwhile get the last one,
//! and requests that arrive while it is being asked wait for it (one
//! fan-out, however many clients ask). A server's answer is read up to
//! [`MAX_MODELS_BYTES`] and [`MAX_MODELS`] entries, merged in linear time
//! (an engine answering a list of a million models costs one pass).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{Value, json};

use super::Dispatcher;
use super::http::{Body, error_response, full_response, json_response};
use super::proxy::unavailable;
use crate::pools::ModelPools;
use crate::routing::live_candidates;
use crate::tenancy::auth::Caller;

/// Largest `/v1/models` answer read from one server.
const MAX_MODELS_BYTES: usize = 8 << 20;

/// Most models in the merged list (and read from one server).
const MAX_MODELS: usize = 4096;

/// How long a merged list is answered again without asking the servers.
pub(super) const MERGED_FRESH: Duration = Duration::from_secs(2);

/// The last merged list of the implicit pool's servers, and when it was
/// made (one per dispatcher; its lock is held while one is made).
pub(super) type MergedModels = tokio::sync::Mutex<Option<(tokio::time::Instant, Bytes)>>;

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
    let mut merged = dispatcher.merged_models().lock().await;
    if let Some((made, body)) = merged.as_ref()
        && made.elapsed() < MERGED_FRESH
    {
        return full_response(StatusCode::OK, "application/json", body.clone());
    }
    match merge_live(dispatcher).await {
        Ok(body) => {
            *merged = Some((tokio::time::Instant::now(), body.clone()));
            full_response(StatusCode::OK, "application/json", body)
        }
        Err(refused) => refused,
    }
}

/// Every live server's list, merged by `id`: the JSON body, or the error
/// to answer.
async fn merge_live(dispatcher: &Arc<Dispatcher>) -> Result<Bytes, Response<Body>> {
    let addresses = live_addresses(dispatcher);
    if addresses.is_empty() {
        return Err(unavailable("no inference server is available", "no_server_available"));
    }
    let wait = dispatcher
        .config()
        .limits
        .request_timeout()
        .min(Duration::from_secs(10));
    let lists = futures_util::future::join_all(addresses.iter().map(|a| fetch_models(dispatcher, a, wait))).await;
    let answered = lists.iter().filter(|l| l.is_some()).count();
    if answered == 0 {
        return Err(error_response(
            StatusCode::BAD_GATEWAY,
            "no inference server answered /v1/models",
            Some("upstream_unavailable"),
        ));
    }
    let body = json!({"object": "list", "data": merge(lists.into_iter().flatten())});
    Ok(Bytes::from(serde_json::to_vec(&body).expect("a JSON value serializes")))
}

/// The models of `lists`, the first of each `id` kept, at most
/// [`MAX_MODELS`] (linear in the entries).
fn merge(lists: impl Iterator<Item = Vec<Value>>) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    let mut data = Vec::new();
    for model in lists.flat_map(|l| l.into_iter().take(MAX_MODELS)) {
        if data.len() >= MAX_MODELS {
            break;
        }
        if seen.insert(model.get("id").map(Value::to_string)) {
            data.push(model);
        }
    }
    data
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
    let keys: Vec<_> = candidates
        .iter()
        .map(|c| tables.servers.membership(c.server.slot))
        .collect();
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
                "live_servers": keys.iter().filter(|k| pool.members().admits(**k)).count(),
            })
        })
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_merge_by_id_in_one_pass_and_are_bounded() {
        let list = |ids: &[&str]| -> Vec<Value> { ids.iter().map(|id| json!({"id": id})).collect() };
        let merged = merge([list(&["a", "b"]), list(&["b", "c"]), list(&["a"])].into_iter());
        let ids: Vec<&str> = merged.iter().map(|m| m["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["a", "b", "c"]);
        // A hostile engine's million models: one pass, at most MAX_MODELS.
        let huge: Vec<Value> = (0..1_000_000).map(|i| json!({"id": format!("m{i}")})).collect();
        let merged = merge([huge, list(&["z"])].into_iter());
        assert_eq!(merged.len(), MAX_MODELS);
    }
}
