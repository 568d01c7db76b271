//! SGLang's server-information endpoints, which `semlb-sim` also serves: a
//! deliberate hybrid of a vLLM-like engine and SGLang's management API, so
//! that the SGLang family of routers (sglang-router, SMG) can manage the
//! simulator as they manage an SGLang engine. sglang-router names a worker's
//! model from `/server_info` (`served_model_name`, else `model_path`) and
//! registers it as model `unknown` without it; SMG reads the same endpoints
//! when it takes a worker for SGLang, and SGLang's load report
//! `/v1/loads` for its load monitor.
//!
//! | route | answer |
//! | --- | --- |
//! | `GET /model_info`, `GET /get_model_info` (SGLang's older name) | `{"model_path", "tokenizer_path", "is_generation": true, "preferred_sampling_params": null, "weight_version": "default", "has_image_understanding": false, "has_audio_understanding": false, "model_type": null, "architectures": null}` |
//! | `GET /server_info`, `GET /get_server_info` | the fields of SGLang's answer that routers read (below) |
//! | `GET /v1/loads[?include=...&dp_rank=N]` | `{"timestamp", "version", "dp_rank_count": 1, "loads": [one rank], "aggregate"}` |
//!
//! `/server_info` answers the engine's own parameters in SGLang's names:
//! `model_path` and `served_model_name` (the served model),
//! `tokenizer_path` (the `--tokenizer` file, else the model's name, as
//! SGLang defaults it to the model path), `tp_size`, `dp_size` and
//! `pp_size` 1, `load_balance_method` `round_robin` (SGLang's
//! default), `disaggregation_mode` (the engine's P/D role: `prefill`,
//! `decode`, or `null` for both) and `disaggregation_bootstrap_port` (the
//! bound bootstrap port of an SGLang prefill engine, else the configured
//! one, 8998 by default, as SGLang reports its flag), `page_size` (the KV
//! block size), `context_length` (`max_model_len`), `max_running_requests`
//! (`max_num_seqs`, as if given as SGLang's `--max-running-requests`),
//! `max_total_tokens` `null` (that flag unset), `max_total_num_tokens` (the
//! KV cache's tokens), `max_req_input_len` (`max_model_len` − 1),
//! `is_embedding` `false`, `enable_metrics`, `weight_version` `default`
//! and `version` (the simulator's). SGLang's hundreds of other server
//! arguments and its `internal_states` are left out rather than made up.
//!
//! `/v1/loads` reports the one rank's scheduler state from the engine's
//! stats: `num_running_reqs`, `num_waiting_reqs`, `num_total_reqs`,
//! `num_used_tokens` (KV blocks held, in tokens), `max_total_num_tokens`,
//! `token_usage` (the KV usage vLLM's gauge shows), `cache_hit_rate`
//! (prefix-cache hits over queries since the start, where SGLang's is a
//! recent window) and `max_running_requests`; `gen_throughput` and
//! `utilization`, which the simulator does not measure, are left out. The
//! `include` sections are checked (an unknown one is a 400, as SGLang) and
//! the simulator has only the `core` one; `dp_rank` other than 0 selects no
//! rank. The server answers it only with the `vllm`, `sglang` and `both`
//! metric flavors: an engine set started to report no load (`none`, or
//! llama.cpp's `llamacpp`) reports none through this route either.

use std::time::SystemTime;

use bytes::Bytes;
use serde_json::{Value, json};

use crate::api::ApiError;
use crate::config::EngineConfig;
use crate::engine::EngineStats;

/// SGLang's `weight_version` when none was set.
const WEIGHT_VERSION: &str = "default";

/// The sections `/v1/loads?include=` takes (SGLang's).
const LOAD_SECTIONS: [&str; 7] = ["core", "memory", "spec", "lora", "disagg", "queues", "all"];

/// The tokenizer path reported: the file's, else the model's name.
fn tokenizer_path<'a>(config: &'a EngineConfig, tokenizer: Option<&'a str>) -> &'a str {
    tokenizer.unwrap_or(&config.model_name)
}

/// The answer to `GET /model_info` (and `/get_model_info`).
pub fn model_info_body(config: &EngineConfig, tokenizer: Option<&str>) -> Bytes {
    let body = json!({
        "model_path": config.model_name,
        "tokenizer_path": tokenizer_path(config, tokenizer),
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": WEIGHT_VERSION,
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": null,
        "architectures": null,
    });
    Bytes::from(body.to_string())
}

/// The KV cache's capacity in tokens (whole blocks).
fn kv_tokens(config: &EngineConfig) -> u64 {
    config.num_blocks() * u64::from(config.block_size)
}

/// What `/server_info` says of disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disaggregation {
    /// `disaggregation_mode`: `prefill`, `decode` or `null`.
    pub mode: &'static str,
    /// `disaggregation_bootstrap_port`.
    pub bootstrap_port: u16,
}

/// The answer to `GET /server_info` (and `/get_server_info`); `metrics`
/// says whether `/metrics` is served.
pub fn server_info_body(
    config: &EngineConfig,
    tokenizer: Option<&str>,
    metrics: bool,
    disaggregation: Disaggregation,
) -> Bytes {
    let body = json!({
        "model_path": config.model_name,
        "tokenizer_path": tokenizer_path(config, tokenizer),
        "served_model_name": config.model_name,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": disaggregation.mode,
        "disaggregation_bootstrap_port": disaggregation.bootstrap_port,
        "page_size": config.block_size,
        "context_length": config.max_model_len,
        "max_running_requests": config.max_num_seqs,
        "max_total_tokens": null,
        "max_total_num_tokens": kv_tokens(config),
        "max_req_input_len": config.max_model_len.saturating_sub(1),
        "is_embedding": false,
        "enable_metrics": metrics,
        "weight_version": WEIGHT_VERSION,
        "version": env!("CARGO_PKG_VERSION"),
    });
    Bytes::from(body.to_string())
}

/// What `/v1/loads`' query asks for: whether the one rank (0) is selected.
/// Unknown `include` sections and a `dp_rank` that is not a non-negative
/// integer are a 400.
pub fn loads_query(query: Option<&str>) -> Result<bool, ApiError> {
    let mut rank_selected = true;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "include" => {
                let value = value.replace("%2C", ",").replace("%2c", ",");
                if let Some(bad) = value
                    .split(',')
                    .map(str::trim)
                    .find(|s| !s.is_empty() && !LOAD_SECTIONS.contains(s))
                {
                    return Err(ApiError::bad_request(
                        format!(
                            "Invalid include section `{bad}`; valid sections: {}",
                            LOAD_SECTIONS.join(", ")
                        ),
                        Some("include"),
                    ));
                }
            }
            "dp_rank" => match value.parse::<u32>() {
                Ok(rank) => rank_selected = rank == 0,
                Err(_) => {
                    return Err(ApiError::bad_request(
                        format!("`dp_rank` must be a non-negative integer, got `{value}`"),
                        Some("dp_rank"),
                    ));
                }
            },
            _ => {}
        }
    }
    Ok(rank_selected)
}

/// The answer to `GET /v1/loads` at `now`: the engine's one rank if
/// `rank_selected` (see [`loads_query`]), else none.
pub fn loads_body(stats: &EngineStats, config: &EngineConfig, rank_selected: bool, now: SystemTime) -> Bytes {
    let capacity = kv_tokens(config);
    let token_usage = stats.kv_usage;
    let cache_hit_rate = if stats.prefix_cache_queries == 0 {
        0.0
    } else {
        stats.prefix_cache_hits as f64 / stats.prefix_cache_queries as f64
    };
    let loads: Vec<Value> = rank_selected
        .then(|| {
            json!({
                "dp_rank": 0,
                "num_running_reqs": stats.running,
                "num_waiting_reqs": stats.waiting,
                "num_total_reqs": stats.running + stats.waiting,
                "num_used_tokens": (token_usage * capacity as f64).round() as u64,
                "max_total_num_tokens": capacity,
                "token_usage": token_usage,
                "cache_hit_rate": cache_hit_rate,
                "max_running_requests": config.max_num_seqs,
            })
        })
        .into_iter()
        .collect();
    let aggregate = if rank_selected {
        json!({
            "total_running_reqs": stats.running,
            "total_waiting_reqs": stats.waiting,
            "total_reqs": stats.running + stats.waiting,
            "avg_token_usage": (token_usage * 10_000.0).round() / 10_000.0,
        })
    } else {
        json!({})
    };
    let body = json!({
        "timestamp": iso_utc(now),
        "version": env!("CARGO_PKG_VERSION"),
        "dp_rank_count": loads.len(),
        "loads": loads,
        "aggregate": aggregate,
    });
    Bytes::from(body.to_string())
}

/// `t` as Python's `datetime.now(timezone.utc).isoformat()` writes it:
/// `2026-01-15T19:32:23.123456+00:00`.
fn iso_utc(t: SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(t).to_rfc3339_opts(chrono::SecondsFormat::Micros, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::histogram::Histogram;
    use std::time::{Duration, UNIX_EPOCH};

    fn config() -> EngineConfig {
        EngineConfig {
            model_name: "m".into(),
            block_size: 16,
            kv_capacity_tokens: 1_000,
            max_num_seqs: 8,
            max_model_len: 4_096,
            ..EngineConfig::default()
        }
    }

    fn json_of(bytes: Bytes) -> Value {
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn model_info_names_the_served_model() {
        let v = json_of(model_info_body(&config(), None));
        assert_eq!(v["model_path"], "m");
        assert_eq!(v["tokenizer_path"], "m");
        assert_eq!(v["is_generation"], true);
        assert_eq!(v["weight_version"], "default");
        assert_eq!(v["model_type"], Value::Null);
        let v = json_of(model_info_body(&config(), Some("/t/tokenizer.json")));
        assert_eq!(v["tokenizer_path"], "/t/tokenizer.json");
    }

    #[test]
    fn server_info_has_what_routers_read() {
        let null = Disaggregation {
            mode: "null",
            bootstrap_port: 8998,
        };
        let v = json_of(server_info_body(&config(), None, true, null));
        for (key, value) in [
            ("model_path", json!("m")),
            ("served_model_name", json!("m")),
            ("tp_size", json!(1)),
            ("dp_size", json!(1)),
            ("load_balance_method", json!("round_robin")),
            ("disaggregation_mode", json!("null")),
            ("disaggregation_bootstrap_port", json!(8998)),
            ("page_size", json!(16)),
            ("context_length", json!(4096)),
            ("max_running_requests", json!(8)),
            ("max_total_tokens", Value::Null),
            // 62 whole blocks of 16.
            ("max_total_num_tokens", json!(992)),
            ("max_req_input_len", json!(4095)),
            ("is_embedding", json!(false)),
            ("enable_metrics", json!(true)),
            ("version", json!(env!("CARGO_PKG_VERSION"))),
        ] {
            assert_eq!(v[key], value, "{key}");
        }
        assert_eq!(
            json_of(server_info_body(&config(), None, false, null))["enable_metrics"],
            false
        );
        let prefill = Disaggregation {
            mode: "prefill",
            bootstrap_port: 40123,
        };
        let v = json_of(server_info_body(&config(), None, true, prefill));
        assert_eq!(
            (&v["disaggregation_mode"], &v["disaggregation_bootstrap_port"]),
            (&json!("prefill"), &json!(40123))
        );
    }

    #[test]
    fn loads_query_checks_sections_and_rank() {
        assert!(loads_query(None).unwrap());
        assert!(loads_query(Some("include=core,disagg,queues,memory")).unwrap());
        assert!(loads_query(Some("include=core%2Cspec&dp_rank=0&other=1")).unwrap());
        assert!(!loads_query(Some("dp_rank=1")).unwrap());
        for (bad, param) in [
            ("include=core,bogus", "include"),
            ("dp_rank=-1", "dp_rank"),
            ("dp_rank=x", "dp_rank"),
        ] {
            let e = loads_query(Some(bad)).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}");
        }
    }

    #[test]
    fn loads_report_the_engines_state() {
        let stats = EngineStats {
            waiting: 2,
            running: 3,
            kv_usage: 0.25,
            num_blocks: 62,
            prefix_cache_queries: 200,
            prefix_cache_hits: 50,
            prompt_tokens: 0,
            generation_tokens: 0,
            requests_finished: 0,
            requests_aborted: 0,
            ttft: Histogram::new(&[1.0]),
            e2e: Histogram::new(&[1.0]),
        };
        let at = UNIX_EPOCH + Duration::from_micros(1_768_505_543_123_456);
        let v = json_of(loads_body(&stats, &config(), true, at));
        assert_eq!(v["timestamp"], "2026-01-15T19:32:23.123456+00:00");
        assert_eq!(v["dp_rank_count"], 1);
        let rank = &v["loads"][0];
        assert_eq!(rank["dp_rank"], 0);
        assert_eq!(rank["num_running_reqs"], 3);
        assert_eq!(rank["num_waiting_reqs"], 2);
        assert_eq!(rank["num_total_reqs"], 5);
        assert_eq!(rank["num_used_tokens"], 248);
        assert_eq!(rank["max_total_num_tokens"], 992);
        assert_eq!(rank["token_usage"], 0.25);
        assert_eq!(rank["cache_hit_rate"], 0.25);
        assert_eq!(rank["max_running_requests"], 8);
        assert_eq!(v["aggregate"]["total_reqs"], 5);
        let v = json_of(loads_body(&stats, &config(), false, at));
        assert_eq!(v["dp_rank_count"], 0);
        assert_eq!(v["loads"], json!([]));
    }

    #[test]
    fn iso_timestamps_match_pythons() {
        assert_eq!(iso_utc(UNIX_EPOCH), "1970-01-01T00:00:00.000000+00:00");
        // A leap day, and the last second of a year.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(iso_utc(t), "2000-02-29T00:00:00.000000+00:00");
        let t = UNIX_EPOCH + Duration::from_secs(1_767_225_599);
        assert_eq!(iso_utc(t), "2025-12-31T23:59:59.000000+00:00");
    }
}
