//! From a request body to token ids: [`prepare`] (the prompt of a chat
//! or completions body, rendered and tokenized, its parameters, model and
//! prefix-cache root), which inference requests and vLLM's tokenization
//! routes share ([`tokenization`]), and the embeddings route.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::{Body, Sim, full_response, json_response, read_body};
use crate::api::{self, ApiError, ChatRequest, CompletionRequest, Endpoint, Prompt};
use crate::vllm_api;

/// What a request body asks for: its prompt's token ids, its parameters,
/// the model it names (the base model when it names none) and that
/// model's prefix-cache root.
pub(super) struct Prepared {
    pub(super) prompt: Vec<u32>,
    pub(super) params: api::GenParams,
    pub(super) model: String,
    pub(super) root: u64,
}

/// The prompt token ids and parameters of a request body.
pub(super) fn prepare(sim: &Sim, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let config = sim.engine().config();
    let check_model = |model: Option<String>| {
        let model = model.unwrap_or_else(|| config.model_name.clone());
        match config.cache_root(&model) {
            Some(root) => Ok((model, root)),
            None => Err(ApiError::model_not_found(&model)),
        }
    };
    let (prompt, params, (model, root)) = match endpoint {
        Endpoint::Completions => {
            let request = CompletionRequest::parse(body)?;
            let model = check_model(request.model)?;
            let prompt = match request.prompt {
                Prompt::Text(text) => sim.tokenizer().encode(&text),
                Prompt::Tokens(ids) => ids,
            };
            (prompt, request.params, model)
        }
        Endpoint::Chat => {
            let request = ChatRequest::parse(body)?;
            let model = check_model(request.model)?;
            let text = sim
                .template()
                .render(&request.messages)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
            (sim.tokenizer().encode(&text), request.params, model)
        }
    };
    // A salt keys the whole chain, as vLLM mixes it into the first block.
    let root = match params.cache_salt {
        Some(salt) => seahash::hash_seeded(&root.to_le_bytes(), salt, !salt, 0x73616c74, 1).max(1),
        None => root,
    };
    Ok(Prepared {
        prompt,
        params,
        model,
        root,
    })
}

/// `POST /v1/embeddings`: the input's tokens, after the time their
/// prefill takes (not batched with generation), as a vector
/// ([`api::embedding_body`]).
pub(super) async fn embeddings(sim: &Arc<Sim>, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(request.into_body()).await?;
    let request = api::EmbeddingRequest::parse(&body)?;
    let config = sim.engine().config();
    let model = request.model.unwrap_or_else(|| config.model_name.clone());
    if config.cache_root(&model).is_none() {
        return Err(ApiError::model_not_found(&model));
    }
    let tokens = match request.input {
        Prompt::Text(text) => sim.tokenizer().encode(&text),
        Prompt::Tokens(ids) => ids,
    };
    let limit = config.max_model_len as usize;
    if tokens.len() > limit {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {limit} tokens, the input has {}",
                tokens.len()
            ),
            Some("input"),
        ));
    }
    tokio::time::sleep(config.real(config.prefill_time(tokens.len() as u64))).await;
    Ok(full_response(
        StatusCode::OK,
        Some("application/json"),
        api::embedding_body(&model, &tokens),
    ))
}

/// Checks the model a tokenization body names (none: the base model): the
/// 404 for one the engine does not serve.
fn served_model(sim: &Sim, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if sim.engine().config().cache_root(model).is_none() => Err(ApiError::model_not_found(model)),
        _ => Ok(()),
    }
}

/// vLLM's tokenization endpoints ([`vllm_api`]): a chat or completion body
/// is parsed, rendered and tokenized by [`prepare`], the code inference
/// requests go through, so the ids are the ones the engine would cache.
pub(super) async fn tokenization(
    sim: &Arc<Sim>,
    request: Request<Incoming>,
    path: &str,
) -> Result<Response<Body>, ApiError> {
    let body = read_body(request.into_body()).await?;
    let max_model_len = sim.engine().config().max_model_len;
    let answer = match path {
        "/tokenize" => {
            let request = vllm_api::TokenizeRequest::parse(&body)?;
            let tokens = match request.input {
                vllm_api::TokenizeInput::Prompt(text) => {
                    served_model(sim, request.model.as_deref())?;
                    sim.tokenizer().encode(&text)
                }
                vllm_api::TokenizeInput::Chat => prepare(sim, Endpoint::Chat, &body)?.prompt,
            };
            let strs = request
                .return_token_strs
                .then(|| tokens.iter().map(|&id| sim.tokenizer().decode(&[id])).collect());
            vllm_api::tokenize_body(&tokens, max_model_len, strs)
        }
        "/detokenize" => {
            let request = vllm_api::DetokenizeRequest::parse(&body, sim.tokenizer().vocab_size())?;
            served_model(sim, request.model.as_deref())?;
            vllm_api::detokenize_body(&sim.tokenizer().decode(&request.tokens))
        }
        _ => {
            let endpoint = if path == "/v1/completions/render" {
                Endpoint::Completions
            } else {
                Endpoint::Chat
            };
            let prepared = prepare(sim, endpoint, &body)?;
            let param = endpoint.prompt_param();
            let max_tokens =
                vllm_api::render_max_tokens(prepared.prompt.len(), prepared.params.max_tokens, max_model_len, param)?;
            let id = sim.response_id(endpoint);
            let rendered = vllm_api::generate_request(&body, &prepared.prompt, id, max_tokens, &prepared.params)?;
            // The completions route answers one request per prompt.
            let rendered = match endpoint {
                Endpoint::Completions => serde_json::Value::Array(vec![rendered]),
                Endpoint::Chat => rendered,
            };
            Bytes::from(rendered.to_string())
        }
    };
    Ok(json_response(answer))
}
