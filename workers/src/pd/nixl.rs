//! vLLM's NixlConnector handoff, both sides.
//!
//! **Prefill side** ([`Pins`]). A prefill leg that finished on its length
//! cap holds its prompt's blocks ([`crate::engine::KvHandoff::hold_prompt`])
//! under its request id; its answer carries the [`transfer_params`] that
//! name them. The pin lasts until the decode side releases it after its
//! read, or until the abort timeout (vLLM's
//! `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s) expires it. The side channel,
//! on the simulator's own HTTP port:
//!
//! | route | body | answer |
//! | --- | --- | --- |
//! | `POST /sim/nixl/query` | `{"remote_engine_id", "remote_request_id"}` | 200 `{"engine_id", "request_id", "num_tokens", "block_ids": [[...]], "block_hashes": [...], "block_size"}`; 404 if this engine holds no such prompt (another engine's id, released, expired) |
//! | `POST /sim/nixl/release` | the same, and `"pulled_tokens"` | 200 `{"released": true}` (NIXL's "done reading" notification: the pin is freed); 404 as above |
//!
//! **Decode side** ([`pull`]). A decode leg with complete parameters asks
//! the prefill's side channel what it holds, checks that the prompt is
//! the one it has (token count and full-block hashes), counts the prompt
//! tokens its own prefix cache already holds (vLLM pulls only the blocks
//! it lacks), waits the transfer time of the rest (scaled by the time
//! scale), tells the prefill it is done (which frees the pin), and hands
//! the engine a [`KvHandoff`] whose pulled tokens count as computed. Any
//! failure is a [`PullError`]; the caller then recomputes the prompt.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::StatusCode;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::client::{self, SideChannelError};
use super::legs::RemotePrefill;
use super::{PdConfig, PdCounters};
use crate::engine::{Engine, KvHandoff, PinnedPrompt};
use crate::prefix_cache::chained_hashes;

/// The side channel's query route.
pub const QUERY_PATH: &str = "/sim/nixl/query";

/// The side channel's release route.
pub const RELEASE_PATH: &str = "/sim/nixl/release";

/// The `kv_transfer_params` of a prefill's answer, as vLLM's
/// NixlConnector writes them: the prompt's block ids (one list per
/// KV-cache group; the simulator has one group), this engine's id, the
/// request's id, where to read from, its tensor parallelism and the
/// prompt's length.
pub fn transfer_params(engine_id: &str, request_id: &str, held: &PinnedPrompt, host: &str, port: u16) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [held.block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": held.num_tokens,
    })
}

/// One held prompt.
#[derive(Debug)]
struct Held {
    /// The engine's pin key.
    key: u64,
    info: PinnedPrompt,
    /// Expires it.
    timer: JoinHandle<()>,
}

/// The prompts this engine holds for remote decodes, by request id.
#[derive(Debug, Default)]
pub struct Pins {
    held: Mutex<HashMap<String, Held>>,
}

impl Pins {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds the prompt the engine pinned under `key` for `request_id`,
    /// until [`release`](Self::release) or `timeout` (real time) expires
    /// it; what is held, if the engine still pins it.
    pub fn hold(
        self: &Arc<Self>,
        engine: &Engine,
        key: u64,
        request_id: &str,
        timeout: Duration,
        counters: &Arc<PdCounters>,
    ) -> Option<PinnedPrompt> {
        let info = engine.pinned(key)?;
        counters.pins.fetch_add(1, Ordering::Relaxed);
        let timer = {
            let (pins, engine, counters) = (Arc::downgrade(self), engine.clone(), Arc::clone(counters));
            let id = request_id.to_owned();
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                let Some(pins) = pins.upgrade() else { return };
                if let Some(held) = pins.lock().remove(&id) {
                    engine.release_pin(held.key);
                    counters.pins_expired.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "semlb-sim: the prompt of {id} ({} tokens) was never pulled; freed after the abort timeout",
                        held.info.num_tokens
                    );
                }
            })
        };
        let held = Held {
            key,
            info: info.clone(),
            timer,
        };
        if let Some(old) = self.lock().insert(request_id.to_owned(), held) {
            old.timer.abort();
            engine.release_pin(old.key);
        }
        Some(info)
    }

    /// What is held for `request_id`.
    pub fn query(&self, request_id: &str) -> Option<PinnedPrompt> {
        self.lock().get(request_id).map(|held| held.info.clone())
    }

    /// Frees what is held for `request_id`; false if nothing was.
    pub fn release(&self, engine: &Engine, request_id: &str) -> bool {
        let Some(held) = self.lock().remove(request_id) else {
            return false;
        };
        held.timer.abort();
        engine.release_pin(held.key)
    }
}

/// The side channel's two routes (`path` is [`QUERY_PATH`] or
/// [`RELEASE_PATH`]): status and JSON body.
pub fn answer(
    pins: &Pins,
    engine: &Engine,
    engine_id: &str,
    counters: &PdCounters,
    path: &str,
    body: &[u8],
) -> (StatusCode, Value) {
    let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(body) else {
        return (
            StatusCode::BAD_REQUEST,
            json!({"error": "the body must be a JSON object"}),
        );
    };
    let text = |key: &str| body.get(key).and_then(Value::as_str);
    let (Some(asked), Some(request_id)) = (text("remote_engine_id"), text("remote_request_id")) else {
        return (
            StatusCode::BAD_REQUEST,
            json!({"error": "remote_engine_id and remote_request_id (strings) are required"}),
        );
    };
    let gone = || {
        (
            StatusCode::NOT_FOUND,
            json!({"error": format!("engine {engine_id} holds no KV for request {request_id} (released, expired or never held)")}),
        )
    };
    if asked != engine_id {
        return gone();
    }
    if path == QUERY_PATH {
        let Some(info) = pins.query(request_id) else {
            return gone();
        };
        let body = json!({
            "engine_id": engine_id,
            "request_id": request_id,
            "num_tokens": info.num_tokens,
            "block_ids": [info.block_ids],
            "block_hashes": info.block_hashes,
            "block_size": engine.config().block_size,
        });
        return (StatusCode::OK, body);
    }
    if !pins.release(engine, request_id) {
        return gone();
    }
    counters.pins_released.fetch_add(1, Ordering::Relaxed);
    (StatusCode::OK, json!({"released": true}))
}

/// Why a decode leg could not pull its prompt's KV (it recomputes it).
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The side channel did not answer.
    #[error("the prefill's side channel is unreachable: {0}")]
    Unreachable(#[from] SideChannelError),
    /// The prefill holds no such prompt (expired, released, another engine).
    #[error("the prefill engine no longer holds the prompt (HTTP {0})")]
    Gone(StatusCode),
    /// The prefill holds another prompt than this leg's.
    #[error("the prefill's prompt is not this request's ({0})")]
    Mismatch(String),
}

/// A decode leg's pull of its prompt's KV from `remote` (see the module
/// docs): the handoff to submit with, the tokens pulled.
pub async fn pull(
    engine: &Engine,
    remote: &RemotePrefill,
    root: u64,
    prompt: &[u32],
    config: &PdConfig,
) -> Result<(KvHandoff, usize), PullError> {
    let local = engine.cached_prefix_tokens(root, prompt);
    let ids = json!({"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id});
    let reply = client::post_json(&remote.host, remote.port, QUERY_PATH, &ids).await?;
    if reply.status != StatusCode::OK {
        return Err(PullError::Gone(reply.status));
    }
    let block_size = engine.config().block_size;
    let ours = chained_hashes(root, prompt.iter().copied(), block_size);
    let theirs: Option<Vec<u64>> = reply.body["block_hashes"]
        .as_array()
        .and_then(|h| h.iter().map(Value::as_u64).collect());
    let num_tokens = reply.body["num_tokens"].as_u64();
    let same = num_tokens == Some(prompt.len() as u64) && theirs.as_deref() == Some(&ours[..]);
    if !same {
        let why = format!(
            "{} tokens there, {} here, or other blocks",
            num_tokens.unwrap_or(0),
            prompt.len()
        );
        // The pin is of no use to anyone: free it.
        let _ = client::post_json(&remote.host, remote.port, RELEASE_PATH, &ids).await;
        return Err(PullError::Mismatch(why));
    }
    let pulled = prompt.len() - local;
    let transfer = config.transfer_time(pulled as u64);
    tokio::time::sleep(engine.config().real(transfer)).await;
    let mut done = ids;
    done["pulled_tokens"] = json!(pulled);
    let reply = client::post_json(&remote.host, remote.port, RELEASE_PATH, &done).await?;
    if reply.status != StatusCode::OK {
        // The pin expired during the read: what was read is void.
        return Err(PullError::Gone(reply.status));
    }
    let handoff = KvHandoff {
        pulled_from: Some(local),
        waited: transfer,
        ..KvHandoff::default()
    };
    Ok((handoff, pulled))
}
