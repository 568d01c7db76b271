//! Server-information bodies: `GET /v1/models` (the served model and its
//! LoRA adapters) and llama.cpp's `GET /props`.

use bytes::Bytes;
use serde::Serialize;

/// `GET /props` as `llama-server` (b11434) answers it, with the fields a
/// gateway reads: `total_slots` (requests run at once) and each slot's
/// context (`default_generation_settings.n_ctx`).
pub fn props_body(model: &str, total_slots: u32, n_ctx: u32) -> Bytes {
    let body = serde_json::json!({
        "default_generation_settings": {"n_ctx": n_ctx},
        "total_slots": total_slots,
        "model_alias": model,
        "model_path": model,
        "endpoint_slots": false,
        "endpoint_props": false,
        "endpoint_metrics": true,
        "build_info": concat!("semlb-sim-", env!("CARGO_PKG_VERSION")),
        "is_sleeping": false,
    });
    Bytes::from(body.to_string())
}

/// `GET /v1/models`: the served model, then its LoRA adapters (with the
/// model as `parent`, as vLLM lists them), each `owned_by` the engine the
/// simulator plays (`vllm`, `sglang`).
pub fn models_body<'a>(
    model: &'a str,
    adapters: &'a [String],
    created: u64,
    max_model_len: u32,
    owned_by: &'a str,
) -> Bytes {
    #[derive(Serialize)]
    struct Model<'a> {
        id: &'a str,
        object: &'a str,
        created: u64,
        owned_by: &'a str,
        root: &'a str,
        parent: Option<&'a str>,
        max_model_len: u32,
    }
    #[derive(Serialize)]
    struct List<'a> {
        object: &'a str,
        data: Vec<Model<'a>>,
    }
    let entry = |id: &'a str, parent: Option<&'a str>| Model {
        id,
        object: "model",
        created,
        owned_by,
        root: id,
        parent,
        max_model_len,
    };
    let data = std::iter::once(entry(model, None))
        .chain(adapters.iter().map(|a| entry(a, Some(model))))
        .collect();
    Bytes::from(serde_json::to_vec(&List { object: "list", data }).unwrap_or_default())
}
