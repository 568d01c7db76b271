//! What an engine says about itself once: how many requests it runs at once
//! and how many tokens of prompt and output one request may have.
//!
//! * **llama.cpp**: `llama-server` runs at most `--parallel` requests at
//!   once, one per *slot*, and defers the rest until a slot frees. Its
//!   `/props` answer says how many slots it has (`total_slots`) and each
//!   slot's context (`default_generation_settings.n_ctx`: `-c` divided
//!   among the slots), always, with or without `--metrics`:
//!
//!   ```json
//!   {"default_generation_settings": {…, "n_ctx": 4096}, "total_slots": 2,
//!    "model_path": "…", "build_info": "b11434-b11434", …}
//!   ```
//!
//!   Its `/v1/models` gives only the model's training context
//!   (`meta.n_ctx_train`), not what the server takes.
//! * **vLLM, SGLang, `semlb-sim`**: `/props` is a 404; `/v1/models` gives
//!   each model's `max_model_len`.
//! * **SGLang prefill engines** (`[[backend]] role = "prefill"` without a
//!   `bootstrap_port`): `/server_info` gives the port of the bootstrap
//!   server their decode partners meet them at
//!   (`disaggregation_bootstrap_port`).
//!
//! The slot count is exact where the learned admission limit
//! ([`crate::routing::capacity`]) is an estimate; the context lets the gateway
//! refuse a request no engine could take instead of forwarding it. The
//! health checker reads both once per registration (again after the engine
//! restarted) and stores them in the server table
//! ([`shm_layout::ServerTable::set_engine_slots`],
//! [`shm_layout::ServerTable::set_engine_context`]).

use shm_layout::EngineContext;

/// The most slots believed: llama.cpp's own bound on `--parallel` is far
/// lower; anything above is not a slot count.
pub const MAX_SLOTS: u32 = 4096;

/// The least context believed: below it a figure is not a context length.
pub const MIN_CONTEXT: u32 = 16;

/// What an engine said about itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineInfo {
    /// Requests it runs at once (llama.cpp's slots).
    pub slots: Option<u32>,
    /// Tokens one request may have.
    pub context: Option<EngineContext>,
    /// The port of its bootstrap server (an SGLang prefill engine).
    pub bootstrap_port: Option<u16>,
}

/// What a `/props` answer's body says: `total_slots`, if an integer in
/// `1..=MAX_SLOTS`, and `default_generation_settings.n_ctx`, if an integer
/// in `MIN_CONTEXT..=EngineContext::MAX_TOKENS`: a context the prompt
/// alone must stay below (llama.cpp stops generating at its end).
pub fn from_props(body: &[u8]) -> EngineInfo {
    #[derive(serde::Deserialize)]
    struct Settings {
        n_ctx: Option<serde_json::Value>,
    }
    #[derive(serde::Deserialize)]
    struct Props {
        total_slots: Option<serde_json::Value>,
        default_generation_settings: Option<Settings>,
    }
    let Ok(props) = serde_json::from_slice::<Props>(body) else {
        return EngineInfo::default();
    };
    let slots = props
        .total_slots
        .as_ref()
        .and_then(as_u32)
        .filter(|n| (1..=MAX_SLOTS).contains(n));
    let context = props
        .default_generation_settings
        .and_then(|s| s.n_ctx)
        .as_ref()
        .and_then(as_context)
        .map(|tokens| EngineContext {
            tokens,
            counts_output: false,
        });
    EngineInfo {
        slots,
        context,
        bootstrap_port: None,
    }
}

/// The context a `/v1/models` answer's body says: the largest
/// `max_model_len` of its models (integers in
/// `MIN_CONTEXT..=EngineContext::MAX_TOKENS`), which prompt and requested
/// output must fit together (vLLM, SGLang).
pub fn context_from_models(body: &[u8]) -> Option<EngineContext> {
    #[derive(serde::Deserialize)]
    struct Model {
        max_model_len: Option<serde_json::Value>,
    }
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Model>,
    }
    let list: List = serde_json::from_slice(body).ok()?;
    list.data
        .iter()
        .filter_map(|m| m.max_model_len.as_ref().and_then(as_context))
        .max()
        .map(|tokens| EngineContext {
            tokens,
            counts_output: true,
        })
}

/// The port of an SGLang prefill engine's bootstrap server, as its
/// `/server_info` (or `/get_server_info`) says it
/// (`disaggregation_bootstrap_port`, an integer 1 to 65535).
pub fn bootstrap_port_from_server_info(body: &[u8]) -> Option<u16> {
    let info: serde_json::Value = serde_json::from_slice(body).ok()?;
    as_u32(info.get("disaggregation_bootstrap_port")?)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

/// A context length: an integer in `MIN_CONTEXT..=EngineContext::MAX_TOKENS`.
fn as_context(v: &serde_json::Value) -> Option<u32> {
    as_u32(v).filter(|n| (MIN_CONTEXT..=EngineContext::MAX_TOKENS).contains(n))
}

/// A JSON integer that fits a `u32` (not a float, string or negative).
fn as_u32(v: &serde_json::Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_slots_and_context_of_a_real_props_answer_and_nothing_else() {
        // Trimmed from a b11434 `llama-server -c 8192 -np 2` answer.
        let real = br#"{"default_generation_settings":{"n_ctx":4096,"params":{"seed":4294967295}},"total_slots":2,"model_alias":"m.gguf","model_path":"m.gguf","modalities":{"vision":false},"endpoint_slots":true,"endpoint_props":false,"endpoint_metrics":true,"build_info":"b11434-b11434","is_sleeping":false}"#;
        assert_eq!(
            from_props(real),
            EngineInfo {
                slots: Some(2),
                context: Some(EngineContext {
                    tokens: 4096,
                    counts_output: false
                }),
                bootstrap_port: None,
            }
        );
        for not_slots in [
            &br#"{"total_slots":0}"#[..],
            br#"{"total_slots":-1}"#,
            br#"{"total_slots":2.5}"#,
            br#"{"total_slots":"2"}"#,
            br#"{"total_slots":4097}"#,
            br#"{"model_path":"m.gguf"}"#,
            br#"{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}"#,
            b"<html>not found</html>",
            b"",
        ] {
            assert_eq!(
                from_props(not_slots).slots,
                None,
                "{}",
                String::from_utf8_lossy(not_slots)
            );
        }
        assert_eq!(from_props(br#"{"total_slots":4096}"#).slots, Some(4096));
        for not_context in [
            &br#"{"default_generation_settings":{"n_ctx":0}}"#[..],
            br#"{"default_generation_settings":{"n_ctx":15}}"#,
            br#"{"default_generation_settings":{"n_ctx":-4096}}"#,
            br#"{"default_generation_settings":{"n_ctx":4096.5}}"#,
            br#"{"default_generation_settings":{"n_ctx":"4096"}}"#,
            br#"{"default_generation_settings":{"n_ctx":4294967296}}"#,
            br#"{"default_generation_settings":{"n_ctx":2147483648}}"#,
            br#"{"default_generation_settings":null,"total_slots":2}"#,
        ] {
            let info = from_props(not_context);
            assert_eq!(info.context, None, "{}", String::from_utf8_lossy(not_context));
        }
        assert_eq!(
            from_props(br#"{"default_generation_settings":null,"total_slots":2}"#).slots,
            Some(2),
            "one field wrong or missing leaves the other"
        );
    }

    #[test]
    fn reads_the_largest_max_model_len_of_a_models_list() {
        // vLLM's shape (trimmed), and two models.
        let vllm = br#"{"object":"list","data":[{"id":"Qwen/Qwen3-8B","object":"model","created":1,"owned_by":"vllm","root":"Qwen/Qwen3-8B","parent":null,"max_model_len":32768,"permission":[]}]}"#;
        let fits = |tokens| {
            Some(EngineContext {
                tokens,
                counts_output: true,
            })
        };
        assert_eq!(context_from_models(vllm), fits(32768));
        let two = br#"{"object":"list","data":[{"id":"a","max_model_len":4096},{"id":"b","max_model_len":8192}]}"#;
        assert_eq!(context_from_models(two), fits(8192));
        // llama.cpp's: the training context is not the server's.
        let llama = br#"{"models":[{"name":"m.gguf"}],"object":"list","data":[{"id":"m.gguf","object":"model","owned_by":"llamacpp","meta":{"n_ctx_train":8192}}]}"#;
        assert_eq!(context_from_models(llama), None);
        for not_context in [
            &br#"{"data":[{"id":"a","max_model_len":0}]}"#[..],
            br#"{"data":[{"id":"a","max_model_len":"4096"}]}"#,
            br#"{"data":[]}"#,
            br#"{"object":"list"}"#,
            b"not json",
        ] {
            assert_eq!(
                context_from_models(not_context),
                None,
                "{}",
                String::from_utf8_lossy(not_context)
            );
        }
    }

    #[test]
    fn an_sglang_prefill_engine_names_its_bootstrap_port() {
        let said = |body: &str| bootstrap_port_from_server_info(body.as_bytes());
        assert_eq!(
            said(r#"{"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998}"#),
            Some(8998)
        );
        assert_eq!(said(r#"{"disaggregation_bootstrap_port": 0}"#), None);
        assert_eq!(said(r#"{"disaggregation_bootstrap_port": 70000}"#), None);
        assert_eq!(said(r#"{"disaggregation_bootstrap_port": "8998"}"#), None);
        assert_eq!(said(r#"{"disaggregation_mode": "null"}"#), None);
        assert_eq!(said("not json"), None);
    }
}
