//! vLLM's tokenization endpoints as `semlb-sim` serves them, so that a router
//! in front of the simulator sees what it sees in front of a real vLLM
//! (vllm-router renders every chat call on a worker before routing it on
//! the prompt's token ids).
//!
//! | route | body | answer |
//! | --- | --- | --- |
//! | `POST /tokenize` | `{"model"?, "prompt": str, "add_special_tokens"?, "return_token_strs"?}` or `{"model"?, "messages": [...], "add_generation_prompt"?, "continue_final_message"?, "add_special_tokens"?, "return_token_strs"?, ...}` | `{"count", "max_model_len", "tokens", "token_strs"}` |
//! | `POST /detokenize` | `{"model"?, "tokens": [int]}` | `{"prompt"}` |
//! | `POST /v1/chat/completions/render` | a chat completion request | a `GenerateRequest`: `{"request_id", "token_ids", "features", "sampling_params", "model", "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params"}` |
//! | `POST /v1/completions/render` | a completion request | `[GenerateRequest]` (one prompt per request, as the simulator serves) |
//! | `GET /version` | | `{"version"}` (the simulator's version) |
//!
//! The shapes are vLLM's (`vllm/entrypoints/serve/tokenize/protocol.py`,
//! `vllm/entrypoints/serve/render/api_router.py`, which answers the render
//! routes with the token-in `GenerateRequest` of
//! `vllm/entrypoints/serve/disagg/protocol.py`; vllm-router 0.1.17 reads its
//! `token_ids`, and falls back to `/tokenize`'s `tokens` when render fails).
//!
//! # The same ids as the simulator's own prompts
//!
//! The ids are the ones the simulator computes for the same body: a chat
//! body is parsed, checked, rendered with the configured chat template and
//! tokenized exactly as `POST /v1/chat/completions` does it (the server
//! calls the same code), a `prompt` exactly as a `/v1/completions` text
//! prompt. So what a router routes on is what the engine caches. Where the
//! simulator differs from vLLM it differs here alike, and says so:
//!
//! - fields the simulator's chat endpoint ignores (`chat_template`,
//!   `chat_template_kwargs`) are ignored here too; `tools` are rendered,
//!   as the chat endpoint renders them;
//! - the simulator always renders the generation prompt, so
//!   `add_generation_prompt: false` and `continue_final_message: true` are
//!   a 400 (vLLM honours them), and both at once is vLLM's own 400;
//! - the simulator adds no special tokens to a prompt (nor does vLLM with
//!   the bundled GPT-2-style or the Qwen tokenizers), so `add_special_tokens`
//!   is type-checked and changes nothing;
//! - `token_strs` holds each token's decoded text, not the tokenizer's raw
//!   vocabulary strings (`Ġword`) that vLLM's `convert_ids_to_tokens` gives;
//! - `sampling_params` is the subset of vLLM's `SamplingParams` that
//!   [`SAMPLING_DEFAULTS`] lists, each the request's value or vLLM's default,
//!   with `max_tokens` as vLLM sets it (the request's, else what the
//!   context leaves); `features` (multimodal) is always `null`.
//!
//! Errors are the simulator's OpenAI-style bodies: 400 for a malformed
//! body, a prompt that leaves no room or a `max_tokens` past the context
//! (`context_length_exceeded`, as vLLM), an id outside the vocabulary;
//! 404 `model_not_found` for a model it does not serve.

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::api::{self, ApiError, GenParams};

/// What `POST /tokenize` tokenizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeInput {
    /// `{"prompt": "..."}`: the text, as a `/v1/completions` text prompt.
    Prompt(String),
    /// `{"messages": [...]}`: the whole body, as a `/v1/chat/completions`
    /// body (the caller renders it with the chat endpoint's own code).
    Chat,
}

/// A validated `POST /tokenize` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The text or the chat.
    pub input: TokenizeInput,
    /// `return_token_strs`: answer each token's text too.
    pub return_token_strs: bool,
}

impl TokenizeRequest {
    /// Parses and validates a request body (see the module docs).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = api::parse_object(body)?;
        let model = api::opt_string(&obj, "model")?;
        let return_token_strs = api::opt_bool(&obj, "return_token_strs")?.unwrap_or(false);
        api::opt_bool(&obj, "add_special_tokens")?;
        let input = match (api::field(&obj, "messages"), api::field(&obj, "prompt")) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request(
                    "Give either `prompt` or `messages`, not both",
                    Some("prompt"),
                ));
            }
            (Some(_), None) => {
                let generation_prompt = api::opt_bool(&obj, "add_generation_prompt")?;
                let continue_final = api::opt_bool(&obj, "continue_final_message")?.unwrap_or(false);
                if continue_final && generation_prompt == Some(true) {
                    return Err(ApiError::bad_request(
                        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                        Some("continue_final_message"),
                    ));
                }
                if continue_final {
                    return Err(unsupported("continue_final_message: true"));
                }
                if generation_prompt == Some(false) {
                    return Err(unsupported("add_generation_prompt: false"));
                }
                TokenizeInput::Chat
            }
            (None, Some(Value::String(text))) => TokenizeInput::Prompt(text.clone()),
            (None, Some(other)) => return Err(api::wrong_type("prompt", "a string", other)),
            (None, None) => {
                return Err(ApiError::bad_request(
                    "`prompt` or `messages` is required",
                    Some("prompt"),
                ));
            }
        };
        Ok(Self {
            model,
            input,
            return_token_strs,
        })
    }
}

/// The 400 for a rendering option the simulator does not have.
fn unsupported(option: &str) -> ApiError {
    let param = option.split(':').next().unwrap_or(option);
    ApiError::bad_request(
        format!("`{option}` is not supported: the simulator always renders the generation prompt"),
        Some(param),
    )
}

/// `POST /tokenize`'s answer.
#[derive(Debug, Serialize)]
struct TokenizeResponse<'a> {
    count: usize,
    max_model_len: u32,
    tokens: &'a [u32],
    token_strs: Option<Vec<String>>,
}

/// The answer to `POST /tokenize`: `tokens`, their `count`, the model's
/// `max_model_len`, and `token_strs` if asked for (else `null`, as vLLM).
pub fn tokenize_body(tokens: &[u32], max_model_len: u32, token_strs: Option<Vec<String>>) -> Bytes {
    let body = TokenizeResponse {
        count: tokens.len(),
        max_model_len,
        tokens,
        token_strs,
    };
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// A validated `POST /detokenize` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetokenizeRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// The ids, each below `vocab_size` (checked by [`parse`](Self::parse)).
    pub tokens: Vec<u32>,
}

impl DetokenizeRequest {
    /// Parses a request body; every id must be an integer below
    /// `vocab_size` (vLLM refuses ids outside the vocabulary with a 400).
    pub fn parse(body: &[u8], vocab_size: usize) -> Result<Self, ApiError> {
        let obj = api::parse_object(body)?;
        let model = api::opt_string(&obj, "model")?;
        let items = match api::field(&obj, "tokens") {
            None => return Err(ApiError::bad_request("`tokens` is required", Some("tokens"))),
            Some(Value::Array(items)) => items,
            Some(other) => return Err(api::wrong_type("tokens", "an array of token ids", other)),
        };
        let tokens = items
            .iter()
            .map(|v| {
                let id = v
                    .as_u64()
                    .ok_or_else(|| api::wrong_type("tokens", "an array of token ids", v))?;
                u32::try_from(id)
                    .ok()
                    .filter(|&id| (id as usize) < vocab_size)
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            format!("Token id {id} is out of vocabulary (size {vocab_size})"),
                            Some("tokens"),
                        )
                    })
            })
            .collect::<Result<Vec<u32>, ApiError>>()?;
        Ok(Self { model, tokens })
    }
}

/// The answer to `POST /detokenize`: `{"prompt": text}`.
pub fn detokenize_body(text: &str) -> Bytes {
    Bytes::from(json!({ "prompt": text }).to_string())
}

/// The answer to `GET /version`.
pub fn version_body() -> Bytes {
    Bytes::from(json!({ "version": env!("CARGO_PKG_VERSION") }).to_string())
}

/// `max_tokens` of a rendered request, as vLLM sets it: the request's, else
/// what the context leaves after the prompt. A prompt that fills the
/// context, or a `max_tokens` past it, is vLLM's 400
/// `context_length_exceeded` (`param` is the prompt's field).
pub fn render_max_tokens(
    prompt_len: usize,
    requested: Option<u32>,
    max_model_len: u32,
    param: &str,
) -> Result<u32, ApiError> {
    let prompt = u32::try_from(prompt_len).unwrap_or(u32::MAX);
    let left = max_model_len.saturating_sub(prompt);
    match requested {
        Some(max) if left > 0 && max <= left => Ok(max),
        None if left > 0 => Ok(left),
        _ => Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens \
                 ({prompt} in the prompt, {} in the completion). Please reduce the length of the prompt or completion.",
                u64::from(prompt) + u64::from(requested.unwrap_or(1)),
                requested.unwrap_or(1),
            ),
            Some(param),
        )
        .with_code("context_length_exceeded")),
    }
}

/// The real-valued fields of vLLM's `SamplingParams` a rendered request
/// carries, with vLLM's defaults. It also carries `n` (1), `top_k` and
/// `min_tokens` (0), `seed` (`null`), `stop` and `stop_token_ids` (`[]`),
/// `ignore_eos`, `max_tokens`, `logprobs` (`null`) and
/// `skip_special_tokens` (`true`).
pub const SAMPLING_DEFAULTS: [(&str, f64); 6] = [
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("min_p", 0.0),
];

/// The `GenerateRequest` a render endpoint answers for a request `body`
/// (already validated by the chat or completions parser, which gave
/// `params`) whose prompt is `token_ids`. `priority` must be an integer.
pub fn generate_request(
    body: &[u8],
    token_ids: &[u32],
    request_id: String,
    max_tokens: u32,
    params: &GenParams,
) -> Result<Value, ApiError> {
    let obj = api::parse_object(body)?;
    let priority = api::opt_int(&obj, "priority")?.unwrap_or(0);
    let mut sampling = Map::new();
    sampling.insert("n".into(), json!(1));
    for (key, default) in SAMPLING_DEFAULTS {
        let value = api::field(&obj, key).filter(|v| v.is_number()).cloned();
        sampling.insert(key.into(), value.unwrap_or_else(|| json!(default)));
    }
    let integer = |key: &str| api::field(&obj, key).filter(|v| v.is_i64() || v.is_u64()).cloned();
    sampling.insert("top_k".into(), integer("top_k").unwrap_or(json!(0)));
    sampling.insert("min_tokens".into(), integer("min_tokens").unwrap_or(json!(0)));
    sampling.insert("seed".into(), integer("seed").unwrap_or(Value::Null));
    let stop = match api::field(&obj, "stop") {
        Some(Value::String(s)) => json!([s]),
        Some(v @ Value::Array(_)) => v.clone(),
        _ => json!([]),
    };
    sampling.insert("stop".into(), stop);
    sampling.insert("stop_token_ids".into(), json!([]));
    sampling.insert("ignore_eos".into(), json!(params.ignore_eos));
    sampling.insert("max_tokens".into(), json!(max_tokens));
    sampling.insert("logprobs".into(), Value::Null);
    sampling.insert("skip_special_tokens".into(), json!(true));
    let stream_options = match api::field(&obj, "stream_options") {
        Some(options) if params.stream => options.clone(),
        _ => Value::Null,
    };
    Ok(json!({
        "request_id": request_id,
        "token_ids": token_ids,
        "features": null,
        "sampling_params": sampling,
        "model": api::field(&obj, "model").cloned().unwrap_or(Value::Null),
        "stream": params.stream,
        "stream_options": stream_options,
        "cache_salt": api::field(&obj, "cache_salt").cloned().unwrap_or(Value::Null),
        "priority": priority,
        "kv_transfer_params": null,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn tokenize(body: &str) -> Result<TokenizeRequest, ApiError> {
        TokenizeRequest::parse(body.as_bytes())
    }

    fn refused(r: Result<impl std::fmt::Debug, ApiError>) -> (StatusCode, Option<String>) {
        let e = r.expect_err("should be refused");
        (e.status, e.param)
    }

    #[test]
    fn tokenize_takes_vllms_two_forms() {
        assert_eq!(
            tokenize(r#"{"model":"m","prompt":"Hi there","add_special_tokens":true}"#).unwrap(),
            TokenizeRequest {
                model: Some("m".into()),
                input: TokenizeInput::Prompt("Hi there".into()),
                return_token_strs: false,
            }
        );
        // vllm-router's own body.
        let chat = tokenize(
            r#"{"model":"m","continue_final_message":false,"messages":[{"role":"user","content":"Hi"}],
                "return_token_strs":true}"#,
        )
        .unwrap();
        assert_eq!(chat.input, TokenizeInput::Chat);
        assert!(chat.return_token_strs);
        assert_eq!(
            tokenize(r#"{"messages":[],"add_generation_prompt":true}"#)
                .unwrap()
                .input,
            TokenizeInput::Chat
        );
        assert_eq!(
            tokenize(r#"{"prompt":""}"#).unwrap().input,
            TokenizeInput::Prompt(String::new())
        );
    }

    #[test]
    fn tokenize_refuses_what_it_cannot_do_with_a_400() {
        for (bad, param) in [
            ("{", None),
            ("[]", None),
            (r#"{}"#, Some("prompt")),
            (r#"{"prompt":"a","messages":[]}"#, Some("prompt")),
            (r#"{"prompt":[1,2]}"#, Some("prompt")),
            (r#"{"prompt":"a","model":7}"#, Some("model")),
            (r#"{"prompt":"a","return_token_strs":"yes"}"#, Some("return_token_strs")),
            (r#"{"prompt":"a","add_special_tokens":1}"#, Some("add_special_tokens")),
            (
                r#"{"messages":[],"add_generation_prompt":false}"#,
                Some("add_generation_prompt"),
            ),
            (
                r#"{"messages":[],"continue_final_message":true}"#,
                Some("continue_final_message"),
            ),
            (
                r#"{"messages":[],"continue_final_message":true,"add_generation_prompt":true}"#,
                Some("continue_final_message"),
            ),
        ] {
            let (status, p) = refused(tokenize(bad));
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(p.as_deref(), param, "{bad}");
        }
    }

    #[test]
    fn tokenize_answers_vllms_shape() {
        let v: Value = serde_json::from_slice(&tokenize_body(&[5, 6, 7], 4096, None)).unwrap();
        assert_eq!(
            v,
            json!({"count": 3, "max_model_len": 4096, "tokens": [5, 6, 7], "token_strs": null})
        );
        let v: Value = serde_json::from_slice(&tokenize_body(&[1], 8, Some(vec!["a".into()]))).unwrap();
        assert_eq!(v["token_strs"], json!(["a"]));
    }

    #[test]
    fn detokenize_checks_ids_against_the_vocabulary() {
        let r = DetokenizeRequest::parse(br#"{"model":"m","tokens":[0,9]}"#, 10).unwrap();
        assert_eq!(r.tokens, [0, 9]);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(
            DetokenizeRequest::parse(br#"{"tokens":[]}"#, 10)
                .unwrap()
                .tokens
                .is_empty()
        );
        for bad in [
            r#"{"tokens":[10]}"#,
            r#"{"tokens":[-1]}"#,
            r#"{"tokens":[1.5]}"#,
            r#"{"tokens":[4294967296]}"#,
            r#"{"tokens":"1"}"#,
            r#"{"tokens":null}"#,
            r#"{}"#,
        ] {
            let (status, p) = refused(DetokenizeRequest::parse(bad.as_bytes(), 10));
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(p.as_deref(), Some("tokens"), "{bad}");
        }
        let v: Value = serde_json::from_slice(&detokenize_body("Hi")).unwrap();
        assert_eq!(v, json!({"prompt": "Hi"}));
    }

    #[test]
    fn max_tokens_as_vllm_sets_it() {
        assert_eq!(render_max_tokens(10, None, 100, "messages").unwrap(), 90);
        assert_eq!(render_max_tokens(10, Some(90), 100, "messages").unwrap(), 90);
        assert_eq!(render_max_tokens(10, Some(5), 100, "messages").unwrap(), 5);
        for (prompt, requested) in [(10, Some(91)), (100, None), (150, None), (99, Some(2))] {
            let e = render_max_tokens(prompt, requested, 100, "messages").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.code, Some("context_length_exceeded"));
            assert_eq!(e.param.as_deref(), Some("messages"));
        }
    }

    #[test]
    fn a_rendered_request_is_vllms_generate_request() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},
            "temperature":0.5,"top_k":5,"seed":3,"stop":"x","cache_salt":"s","priority":-2,"ignore_eos":true}"#;
        let params = GenParams {
            stream: true,
            include_usage: true,
            ignore_eos: true,
            ..GenParams::default()
        };
        let v = generate_request(body, &[1, 2], "chatcmpl-1".into(), 7, &params).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut expected = [
            "request_id",
            "token_ids",
            "features",
            "sampling_params",
            "model",
            "stream",
            "stream_options",
            "cache_salt",
            "priority",
            "kv_transfer_params",
        ];
        expected.sort_unstable();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(keys, expected);
        assert_eq!(v["request_id"], "chatcmpl-1");
        assert_eq!(v["token_ids"], json!([1, 2]));
        assert_eq!(v["features"], Value::Null);
        assert_eq!(v["model"], "m");
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"], json!({"include_usage": true}));
        assert_eq!(v["cache_salt"], "s");
        assert_eq!(v["priority"], -2);
        let sp = &v["sampling_params"];
        assert_eq!(sp["max_tokens"], 7);
        assert_eq!(sp["temperature"], 0.5);
        assert_eq!(sp["top_p"], 1.0);
        assert_eq!(sp["top_k"], 5);
        assert_eq!(sp["seed"], 3);
        assert_eq!(sp["stop"], json!(["x"]));
        assert_eq!(sp["ignore_eos"], true);
        assert_eq!(sp["n"], 1);

        // Defaults, and no stream options on a request that does not stream.
        let v = generate_request(
            br#"{"messages":[],"stream_options":{"include_usage":true}}"#,
            &[1],
            "chatcmpl-2".into(),
            3,
            &GenParams::default(),
        )
        .unwrap();
        assert_eq!(v["model"], Value::Null);
        assert_eq!(v["stream"], false);
        assert_eq!(v["stream_options"], Value::Null);
        assert_eq!(v["cache_salt"], Value::Null);
        assert_eq!(v["priority"], 0);
        assert_eq!(v["sampling_params"]["temperature"], 1.0);
        assert_eq!(v["sampling_params"]["top_k"], 0);
        assert_eq!(v["sampling_params"]["seed"], Value::Null);
        assert_eq!(v["sampling_params"]["stop"], json!([]));

        let e = generate_request(br#"{"priority":"high"}"#, &[1], "x".into(), 1, &GenParams::default()).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("priority"))
        );
    }

    #[test]
    fn version_is_the_simulators() {
        let v: Value = serde_json::from_slice(&version_body()).unwrap();
        assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    }
}
