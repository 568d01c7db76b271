//! From a request body to token ids: [`prepare`] (the prompt of a
//! completions body, or of a conversation — chat, Responses, Messages —
//! rendered and tokenized, its parameters, model and prefix-cache root),
//! which inference requests and vLLM's tokenization routes share
//! ([`tokenization`]), and the embeddings route.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use semlb_tokenizer::chat::continue_final;
use semlb_tokenizer::chat::{RenderInputs, TemplateValue};

use super::{Body, Sim, full_response, json_response, read_body};
use crate::api::{
    self, ApiError, ChatRequest, CompletionRequest, Conversation, Ending, Endpoint, MessagesRequest, Prompt,
    ResponsesEcho, ResponsesRequest,
};
use crate::vllm_api;

/// A conversation and its rendered prompt text.
pub(super) struct Chat {
    pub(super) conversation: Conversation,
    pub(super) text: String,
}

/// What a request body asks for: its prompt's token ids, its parameters,
/// the model it names (the base model when it names none) and that
/// model's prefix-cache root; a conversation's messages and text; what a
/// Responses answer repeats.
pub(super) struct Prepared {
    pub(super) prompt: Vec<u32>,
    pub(super) params: api::GenParams,
    pub(super) model: String,
    pub(super) root: u64,
    pub(super) chat: Option<Chat>,
    pub(super) echo: Option<ResponsesEcho>,
    /// The partial answer a chat request continues.
    pub(super) continued: Option<Continued>,
}

/// Renders `conversation` with the simulator's chat template (`param`:
/// the field a template error names), ending as it asks: a conversation
/// whose final message is continued is cut right after it, as vLLM has
/// Hugging Face cut it ([`continue_final`]).
pub(super) fn render(sim: &Sim, conversation: &Conversation, param: &str) -> Result<String, ApiError> {
    let variables = match conversation.ending {
        Ending::Generation => Vec::new(),
        Ending::Bare | Ending::ContinueFinal => vec![("add_generation_prompt".into(), TemplateValue::Bool(false))],
    };
    let inputs = RenderInputs {
        tools: conversation.tools.as_deref(),
        variables,
    };
    let mut text = String::new();
    let bad = |e: semlb_tokenizer::chat::TemplateError| ApiError::bad_request(e.to_string(), Some(param));
    sim.template()
        .render_with(&conversation.messages, &inputs, &mut text)
        .map_err(bad)?;
    if conversation.ending == Ending::ContinueFinal {
        let content = conversation.messages.last().map_or("", |m| &m.content);
        continue_final::cut_after_final(&mut text, content).map_err(bad)?;
    }
    Ok(text)
}

/// The seed of a prompt: what the simulator "generates" for it is drawn
/// from it ([`crate::output_vocab::OutputVocab::generate`]).
pub(super) fn prompt_seed(prompt: &[u32]) -> u64 {
    seahash::hash(&prompt.iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>())
}

/// A chat request that continues its final assistant message
/// (`continue_final_message`): the seed of the prompt that message
/// answers (the conversation before it, with a generation prompt), and
/// its text. The answer continues the one drawn from that seed when the
/// text is how that answer begins, as a deterministic model would.
pub(super) struct Continued {
    pub(super) seed: u64,
    pub(super) text: String,
}

/// What a continued conversation continues (see [`Continued`]); `None`
/// unless its last message is an assistant's text.
fn continued(sim: &Sim, conversation: &Conversation, param: &str) -> Result<Option<Continued>, ApiError> {
    let Some((last, before)) = conversation.messages.split_last() else {
        return Ok(None);
    };
    if conversation.ending != Ending::ContinueFinal || last.role != "assistant" || !last.fields.is_empty() {
        return Ok(None);
    }
    let base = Conversation {
        messages: before.to_vec(),
        tools: conversation.tools.clone(),
        tool_choice: conversation.tool_choice.clone(),
        ending: Ending::Generation,
    };
    let text = render(sim, &base, param)?;
    Ok(Some(Continued {
        seed: prompt_seed(&sim.tokenizer().encode(&text)),
        text: last.content.to_string(),
    }))
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
    let mut echo = None;
    let (conversation, params, (model, root)) = match endpoint {
        Endpoint::Completions => {
            let request = CompletionRequest::parse(body)?;
            let model = check_model(request.model)?;
            let prompt = match request.prompt {
                Prompt::Text(text) => sim.tokenizer().encode(&text),
                Prompt::Tokens(ids) => ids,
            };
            let (model, root) = model;
            return Ok(Prepared {
                prompt,
                root: salted(root, request.params.cache_salt),
                params: request.params,
                model,
                chat: None,
                echo: None,
                continued: None,
            });
        }
        Endpoint::Chat => {
            let request = ChatRequest::parse(body)?;
            (request.conversation, request.params, check_model(request.model)?)
        }
        Endpoint::Responses => {
            let request = ResponsesRequest::parse(body)?;
            let model = check_model(request.model.clone())?;
            let history = match &request.echo.previous_response_id {
                Some(id) => sim
                    .responses()
                    .get(id)
                    .ok_or_else(|| ApiError::response_not_found(id))?
                    .history(),
                None => Vec::new(),
            };
            let conversation = request.messages(history);
            echo = Some(request.echo);
            (conversation, request.params, model)
        }
        Endpoint::Messages => {
            let request = MessagesRequest::parse(body)?;
            (request.conversation, request.params, check_model(request.model)?)
        }
    };
    let text = render(sim, &conversation, endpoint.prompt_param())?;
    Ok(Prepared {
        prompt: sim.tokenizer().encode(&text),
        root: salted(root, params.cache_salt),
        params,
        model,
        continued: continued(sim, &conversation, endpoint.prompt_param())?,
        chat: Some(Chat { conversation, text }),
        echo,
    })
}

/// A salt keys the whole chain, as vLLM mixes it into the first block.
fn salted(root: u64, salt: Option<u64>) -> u64 {
    match salt {
        Some(salt) => seahash::hash_seeded(&root.to_le_bytes(), salt, !salt, 0x73616c74, 1).max(1),
        None => root,
    }
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
                _ => rendered,
            };
            Bytes::from(rendered.to_string())
        }
    };
    Ok(json_response(answer))
}
