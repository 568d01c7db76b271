//! The HTTP front of `semlb-sim`: a hyper 1 HTTP/1.1 server with the
//! OpenAI routes, JSON and server-sent-event responses, and the fault
//! injection of [`crate::faults`].
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /v1/completions` | a completion, JSON or SSE (see [`crate::api`]) |
//! | `POST /v1/chat/completions` | a chat completion, JSON or SSE |
//! | `GET /v1/models` | the OpenAI model list with the one served model |
//! | `GET /health` | 200 with an empty body, as vLLM |
//! | `GET /metrics` | the Prometheus exposition (see [`crate::metrics`]); 404 with [`MetricsFlavor::None`] |
//! | `GET /props` | with [`Sim::with_props`] (on by default for `--metrics-flavor llamacpp`): llama.cpp's server properties, `total_slots` = `max_num_seqs` and each slot's `n_ctx`, as `llama-server` answers; else 404 |
//! | `GET /sim/metrics` | the same counters in vLLM's names, whatever the flavor: the simulator's own window for benchmarks and tests (no gateway scrapes it), so an engine set without metrics can still be measured |
//! | `POST /reset_prefix_cache` | empties the prefix cache, as vLLM's: 200; 409 `busy` while requests hold blocks (vLLM then only logs that it could not) |
//! | `POST /tokenize`, `POST /detokenize`, `POST /v1/chat/completions/render`, `POST /v1/completions/render`, `GET /version` | vLLM's tokenization endpoints (see [`crate::vllm_api`]): the ids the simulator computes for the same body |
//! | `GET /model_info`, `GET /get_model_info`, `GET /server_info`, `GET /get_server_info`, `GET /v1/loads` | SGLang's server-information endpoints (see [`crate::sglang_api`]), so that SGLang's routers can manage the simulator; `/v1/loads` only with the `vllm`, `sglang` and `both` metric flavors (else 404, as `/metrics` without metrics: an engine set that reports no load reports none there either) |
//!
//! Other methods on these paths get 405 (with `Allow`), other paths 404,
//! both with an OpenAI error body.
//!
//! # An inference request
//!
//! The body (at most [`MAX_BODY_BYTES`]) is parsed and validated by
//! [`crate::api`]; a chat request's messages are rendered with the
//! configured [`ChatTemplate`]; the prompt text is tokenized. The output
//! length follows [`api::output_length`], and the output token ids are
//! [`OutputVocab::generate`]`(seahash(prompt ids as little-endian u32
//! bytes), n)`, so the same prompt always gets the same answer; each
//! token's text is `Tokenizer::decode(&[id])`. The request is submitted to
//! the [`Engine`]; the response head is sent once the engine reports the
//! first token, with two extra headers:
//!
//! - `x-semlb-sim-ttft-ms`: the simulated time to first token (queueing +
//!   prefill) in milliseconds of simulated time;
//! - `x-semlb-sim-cached-tokens`: the prompt tokens found in the prefix cache.
//!
//! A non-streaming body is sent when the engine finishes; a streaming body
//! is written chunk by chunk as the engine emits tokens (hyper polls a
//! stream over the engine's events; nothing is buffered). When the client
//! goes away, hyper drops the response future or body, which drops the
//! [`EngineStream`] and so aborts the request in the engine.
//!
//! # Stopping
//!
//! [`serve`] takes the shutdown signal as a future. When it resolves, or
//! when `--exit-after` fires, the server stops accepting, lets every
//! connection finish its in-flight request (hyper's graceful shutdown;
//! idle keep-alive connections close at once; requests left hanging by
//! `--hang-after` are dropped without an answer), and returns.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::api::{
    self, ApiError, ChatRequest, Chunk, CompletionRequest, CompletionResponse, Endpoint, FinishReason, Prompt,
    ResponseMeta,
};
use crate::config::EngineConfig;
use crate::engine::{BlockKeys, Engine, EngineRequest, EngineStream, Event, SubmitError, Usage};
use crate::faults::{Decision, FaultConfig, Faults};
use crate::metrics::{self, MetricsFlavor};
use crate::output_vocab::OutputVocab;
use crate::{sglang_api, vllm_api};
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;

/// Largest request body accepted (larger ones get 413).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// Error type of response bodies and of the service.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body: a full buffer or a stream of chunks.
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Everything one simulated server needs: the engine, the tokenizer and
/// chat template, the output vocabulary, the fault state and the metrics
/// flavor. Shared by all connections behind an [`Arc`].
#[derive(Debug)]
pub struct Sim {
    engine: Engine,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    vocab: OutputVocab,
    faults: Faults,
    flavor: MetricsFlavor,
    /// Answers `GET /props` as llama.cpp does.
    props: bool,
    /// The tokenizer file `/model_info` and `/server_info` name, if any.
    tokenizer_path: Option<String>,
    /// Set when the server stops; releases requests left hanging.
    closing: watch::Sender<bool>,
    /// Counter for response ids.
    next_id: AtomicU64,
    /// Per-process part of response ids.
    id_salt: u64,
    /// Unix seconds at creation (`created` of the model).
    started: u64,
}

impl Sim {
    /// The simulator `semlb serve --demo` and the in-process tests run: an
    /// engine of `config` started on the current runtime, the bundled
    /// tokenizer, the canonical chat template and vLLM's metric names, with
    /// `faults`.
    pub fn bundled(config: EngineConfig, faults: FaultConfig) -> Self {
        Self::new(
            Engine::start(config),
            Tokenizer::bundled(),
            ChatTemplate::canonical(),
            faults,
            MetricsFlavor::Vllm,
        )
    }

    /// The same server with `flavor`'s metric names on `/metrics`
    /// ([`MetricsFlavor::None`]: no `/metrics`).
    pub fn with_metrics_flavor(mut self, flavor: MetricsFlavor) -> Self {
        self.flavor = flavor;
        self
    }

    /// The same server answering `GET /props` as `llama-server` does
    /// (`total_slots` = the engine's `max_num_seqs`), or not (404).
    pub fn with_props(mut self, props: bool) -> Self {
        self.props = props;
        self
    }

    /// The same server naming `path` as its tokenizer in SGLang's
    /// `/model_info` and `/server_info` (`None`: the model's name, as
    /// SGLang reports a tokenizer loaded with the model).
    pub fn with_tokenizer_path(mut self, path: Option<String>) -> Self {
        self.tokenizer_path = path;
        self
    }

    /// A server state around a started `engine`. The output vocabulary is
    /// picked from `tokenizer`.
    pub fn new(
        engine: Engine,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        faults: FaultConfig,
        flavor: MetricsFlavor,
    ) -> Self {
        let vocab = OutputVocab::new(&tokenizer);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let id_salt = seahash::hash(&[nanos.to_le_bytes(), u128::from(std::process::id()).to_le_bytes()].concat());
        Self {
            engine,
            tokenizer,
            template,
            vocab,
            faults: Faults::new(faults),
            flavor,
            props: flavor == MetricsFlavor::Llamacpp,
            tokenizer_path: None,
            closing: watch::Sender::new(false),
            next_id: AtomicU64::new(0),
            id_salt,
            started: unix_now(),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The tokenizer prompts are encoded with.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The fault state (counters, hang and exit flags).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The metric names `/metrics` uses.
    pub fn flavor(&self) -> MetricsFlavor {
        self.flavor
    }

    /// Whether `--exit-after` has fired: a [`serve`] that returned without
    /// its shutdown signal stopped for that.
    pub fn exit_requested(&self) -> bool {
        self.faults.exit_requested()
    }

    /// The next response id for `endpoint`.
    fn response_id(&self, endpoint: Endpoint) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{}{:016x}{n:016x}", endpoint.id_prefix(), self.id_salt)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// Serves HTTP/1.1 on `listener` until `shutdown` resolves or
/// `--exit-after` fires, then stops gracefully (see the module docs) and
/// returns. Accepted sockets get `TCP_NODELAY`. Errors accepting a
/// connection (such as running out of file descriptors) are reported on
/// stderr and retried after a short pause; they do not stop the server.
pub async fn serve(listener: TcpListener, sim: Arc<Sim>, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let exit = sim.faults.exit_signal();
    tokio::pin!(shutdown, exit);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            () = &mut exit => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    connections.spawn(serve_connection(stream, sim.clone(), stop_rx.clone()));
                }
                Err(e) => {
                    eprintln!("semlb-sim: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    drop(listener);
    sim.closing.send_replace(true);
    stop_tx.send_replace(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Serves one connection until it closes, or until `stop` is set and its
/// in-flight request is answered.
async fn serve_connection(stream: TcpStream, sim: Arc<Sim>, mut stop: watch::Receiver<bool>) {
    // Token-by-token streaming wants every small write on the wire at once.
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |request| handle(sim.clone(), request));
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new());
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = stop.wait_for(|stop| *stop) => {}
    }
    connection.as_mut().graceful_shutdown();
    let _ = connection.await;
}

/// Counts an inference request as completed (for `--exit-after`) when dropped.
struct Completion(Arc<Sim>);

impl Drop for Completion {
    fn drop(&mut self) {
        self.0.faults.complete();
    }
}

/// The paths the server knows, and the method each takes.
fn allowed_method(path: &str) -> Option<&'static str> {
    match path {
        "/v1/completions" | "/v1/chat/completions" | "/v1/embeddings" | "/reset_prefix_cache" => Some("POST"),
        "/tokenize" | "/detokenize" | "/v1/chat/completions/render" | "/v1/completions/render" => Some("POST"),
        "/v1/models" | "/health" | "/metrics" | "/props" | "/sim/metrics" => Some("GET"),
        "/version" | "/model_info" | "/get_model_info" | "/server_info" | "/get_server_info" | "/v1/loads" => {
            Some("GET")
        }
        _ => None,
    }
}

/// Answers one request.
async fn handle(sim: Arc<Sim>, request: Request<Incoming>) -> Result<Response<Body>, BoxError> {
    let path = request.uri().path().to_owned();
    let allowed = allowed_method(&path);
    let endpoint = match path.as_str() {
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/chat/completions" => Some(Endpoint::Chat),
        _ => None,
    };
    let decision = match endpoint {
        Some(endpoint) if request.method() == Method::POST => Some((endpoint, sim.faults.admit())),
        _ => None,
    };
    if decision.map_or_else(|| sim.faults.is_hanging(), |(_, d)| d.hang) {
        // Read, never answered: wait for the server to stop, then drop the
        // connection without a response.
        let mut closing = sim.closing.subscribe();
        let _ = closing.wait_for(|closing| *closing).await;
        return Err("semlb-sim: request left unanswered (--hang-after)".into());
    }
    let delay = sim.faults.delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let response = match (decision, allowed) {
        (Some((endpoint, decision)), _) => {
            let completion = Completion(sim.clone());
            inference(&sim, request, endpoint, decision, completion)
                .await
                .unwrap_or_else(error_response)
        }
        (None, Some(method)) if request.method().as_str() != method => {
            let mut response = error_response(ApiError::method_not_allowed(request.method().as_str(), &path));
            response.headers_mut().insert(ALLOW, HeaderValue::from_static(method));
            response
        }
        (None, Some(_)) => match path.as_str() {
            "/health" => full_response(StatusCode::OK, None, Bytes::new()),
            "/v1/embeddings" => embeddings(&sim, request).await.unwrap_or_else(error_response),
            "/tokenize" | "/detokenize" | "/v1/chat/completions/render" | "/v1/completions/render" => {
                tokenization(&sim, request, &path).await.unwrap_or_else(error_response)
            }
            "/version" => json_response(vllm_api::version_body()),
            "/model_info" | "/get_model_info" => json_response(sglang_api::model_info_body(
                sim.engine.config(),
                sim.tokenizer_path.as_deref(),
            )),
            "/server_info" | "/get_server_info" => json_response(sglang_api::server_info_body(
                sim.engine.config(),
                sim.tokenizer_path.as_deref(),
                sim.flavor != MetricsFlavor::None,
            )),
            // Only an engine that reports its load as vLLM or SGLang does:
            // `--metrics-flavor none` and `llamacpp` report none here either.
            "/v1/loads"
                if !matches!(
                    sim.flavor,
                    MetricsFlavor::Vllm | MetricsFlavor::Sglang | MetricsFlavor::Both
                ) =>
            {
                error_response(ApiError::path_not_found(request.method().as_str(), &path))
            }
            "/v1/loads" => match sglang_api::loads_query(request.uri().query()) {
                Ok(rank) => json_response(sglang_api::loads_body(
                    &sim.engine.stats(),
                    sim.engine.config(),
                    rank,
                    SystemTime::now(),
                )),
                Err(e) => error_response(e),
            },
            "/reset_prefix_cache" if sim.engine.reset_prefix_cache() => {
                full_response(StatusCode::OK, None, Bytes::new())
            }
            "/reset_prefix_cache" => error_response(ApiError::busy(
                "the prefix cache cannot be reset while requests hold blocks; retry when idle",
            )),
            "/v1/models" => {
                let config = sim.engine.config();
                let body = api::models_body(
                    &config.model_name,
                    &config.lora_adapters,
                    sim.started,
                    config.max_model_len,
                );
                full_response(StatusCode::OK, Some("application/json"), body)
            }
            "/props" if sim.props => {
                let config = sim.engine.config();
                let body = api::props_body(&config.model_name, config.max_num_seqs, config.max_model_len);
                full_response(StatusCode::OK, Some("application/json"), body)
            }
            // Not served by this engine (`/props` is, above, with `props`).
            "/props" => error_response(ApiError::path_not_found(request.method().as_str(), &path)),
            "/metrics" if sim.flavor == MetricsFlavor::None => {
                error_response(ApiError::path_not_found(request.method().as_str(), &path))
            }
            _ => {
                let flavor = if path == "/sim/metrics" {
                    MetricsFlavor::Vllm
                } else {
                    sim.flavor
                };
                let text = metrics::render(&sim.engine.stats(), sim.engine.config(), flavor);
                full_response(StatusCode::OK, Some(metrics::CONTENT_TYPE), Bytes::from(text))
            }
        },
        (None, None) => error_response(ApiError::path_not_found(request.method().as_str(), &path)),
    };
    Ok(response)
}

fn full_body(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn full_response(status: StatusCode, content_type: Option<&'static str>, body: Bytes) -> Response<Body> {
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    if let Some(content_type) = content_type {
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    response
}

fn json_response(body: Bytes) -> Response<Body> {
    full_response(StatusCode::OK, Some("application/json"), body)
}

fn error_response(error: ApiError) -> Response<Body> {
    full_response(error.status, Some("application/json"), error.body())
}

/// The error that cuts a response (`--reset-rate`).
fn reset_error() -> BoxError {
    "semlb-sim: response cut on purpose (--reset-rate)".into()
}

/// Reads the whole request body, at most [`MAX_BODY_BYTES`].
async fn read_body(body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(ApiError::payload_too_large(MAX_BODY_BYTES))
        }
        Err(e) => Err(ApiError::bad_request(
            format!("Cannot read the request body: {e}"),
            None,
        )),
    }
}

/// What a request body asks for: its prompt's token ids, its parameters,
/// the model it names (the base model when it names none) and that
/// model's prefix-cache root.
struct Prepared {
    prompt: Vec<u32>,
    params: api::GenParams,
    model: String,
    root: u64,
}

/// The prompt token ids and parameters of a request body.
fn prepare(sim: &Sim, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let config = sim.engine.config();
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
                Prompt::Text(text) => sim.tokenizer.encode(&text),
                Prompt::Tokens(ids) => ids,
            };
            (prompt, request.params, model)
        }
        Endpoint::Chat => {
            let request = ChatRequest::parse(body)?;
            let model = check_model(request.model)?;
            let text = sim
                .template
                .render(&request.messages)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
            (sim.tokenizer.encode(&text), request.params, model)
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
async fn embeddings(sim: &Arc<Sim>, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(request.into_body()).await?;
    let request = api::EmbeddingRequest::parse(&body)?;
    let config = sim.engine.config();
    let model = request.model.unwrap_or_else(|| config.model_name.clone());
    if config.cache_root(&model).is_none() {
        return Err(ApiError::model_not_found(&model));
    }
    let tokens = match request.input {
        Prompt::Text(text) => sim.tokenizer.encode(&text),
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
        Some(model) if sim.engine.config().cache_root(model).is_none() => Err(ApiError::model_not_found(model)),
        _ => Ok(()),
    }
}

/// vLLM's tokenization endpoints ([`vllm_api`]): a chat or completion body
/// is parsed, rendered and tokenized by [`prepare`], the code inference
/// requests go through, so the ids are the ones the engine would cache.
async fn tokenization(sim: &Arc<Sim>, request: Request<Incoming>, path: &str) -> Result<Response<Body>, ApiError> {
    let body = read_body(request.into_body()).await?;
    let max_model_len = sim.engine.config().max_model_len;
    let answer = match path {
        "/tokenize" => {
            let request = vllm_api::TokenizeRequest::parse(&body)?;
            let tokens = match request.input {
                vllm_api::TokenizeInput::Prompt(text) => {
                    served_model(sim, request.model.as_deref())?;
                    sim.tokenizer.encode(&text)
                }
                vllm_api::TokenizeInput::Chat => prepare(sim, Endpoint::Chat, &body)?.prompt,
            };
            let strs = request
                .return_token_strs
                .then(|| tokens.iter().map(|&id| sim.tokenizer.decode(&[id])).collect());
            vllm_api::tokenize_body(&tokens, max_model_len, strs)
        }
        "/detokenize" => {
            let request = vllm_api::DetokenizeRequest::parse(&body, sim.tokenizer.vocab_size())?;
            served_model(sim, request.model.as_deref())?;
            vllm_api::detokenize_body(&sim.tokenizer.decode(&request.tokens))
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

/// Answers an inference request (after the hang and delay faults).
async fn inference(
    sim: &Arc<Sim>,
    request: Request<Incoming>,
    endpoint: Endpoint,
    decision: Decision,
    completion: Completion,
) -> Result<Response<Body>, ApiError> {
    if decision.fail {
        return Err(ApiError::server_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Injected failure (semlb-sim --fail-rate)",
        ));
    }
    let override_tokens = request
        .headers()
        .get(api::OUTPUT_TOKENS_HEADER)
        .map(|value| api::parse_output_override(value.as_bytes()))
        .transpose()?;
    let body = read_body(request.into_body()).await?;
    let Prepared {
        prompt,
        params,
        model,
        root,
    } = prepare(sim, endpoint, &body)?;
    let config = sim.engine.config();
    let (n, finish) = api::output_length(&params, override_tokens, config.default_output_tokens);
    // Refuse an impossible length before drawing (and allocating) the output.
    let prompt_len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    if u64::from(prompt_len) + u64::from(n) > u64::from(config.max_model_len) {
        let error = SubmitError::TooLong {
            prompt: prompt_len,
            output: n,
            max: config.max_model_len,
        };
        return Err(ApiError::from_submit(&error, endpoint.prompt_param()));
    }
    let seed = seahash::hash(&prompt.iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>());
    let output = sim.vocab.generate(seed, n as usize);
    let mut events = sim
        .engine
        .submit(EngineRequest {
            prompt,
            output,
            root,
            keys: BlockKeys {
                // The base model's blocks name no adapter.
                lora_name: (model != config.model_name).then(|| model.clone()),
                // The simulator keeps a salt's hash, not the salt: its
                // events name the hash (a gateway only needs to see that
                // the block has extra keys).
                salt: params.cache_salt.map(|h| format!("{h:016x}")),
            },
        })
        .map_err(|e| ApiError::from_submit(&e, endpoint.prompt_param()))?;
    let engine_gone = || ApiError::server_error(StatusCode::INTERNAL_SERVER_ERROR, "The engine dropped the request");
    let Some(Event::FirstToken {
        id: first,
        cached_tokens,
        ttft_s,
    }) = events.next().await
    else {
        return Err(engine_gone());
    };
    let meta = ResponseMeta {
        endpoint,
        id: sim.response_id(endpoint),
        created: unix_now(),
        model,
    };
    let mut builder = Response::builder()
        .header(api::SIM_TTFT_HEADER, format!("{:.3}", ttft_s * 1000.0))
        .header(api::SIM_CACHED_TOKENS_HEADER, cached_tokens);

    if params.stream {
        let stream = SseStream {
            events,
            meta,
            tokenizer: sim.tokenizer.clone(),
            include_usage: params.include_usage,
            finish,
            expected: n,
            tokens: 0,
            pending: VecDeque::new(),
            emitted: 0,
            reset: decision.reset,
            done: false,
            _completion: completion,
        }
        .start(first);
        builder = builder
            .header(CONTENT_TYPE, "text/event-stream")
            .header(CACHE_CONTROL, "no-cache");
        let body = StreamBody::new(futures_util::stream::unfold(stream, SseStream::next_frame)).boxed_unsync();
        return builder
            .body(body)
            .map_err(|e| ApiError::server_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
    }

    let mut text = sim.tokenizer.decode(&[first]);
    let usage = loop {
        match events.next().await {
            Some(Event::Token { id }) => text.push_str(&sim.tokenizer.decode(&[id])),
            Some(Event::Finished { usage }) => break usage,
            Some(Event::FirstToken { .. }) => {}
            None => return Err(engine_gone()),
        }
    };
    let json = serde_json::to_vec(&CompletionResponse::new(&meta, text, finish, usage)).unwrap_or_default();
    builder = builder.header(CONTENT_TYPE, "application/json");
    let body = if decision.reset {
        // Head out (hyper flushes while the body is pending), then abort.
        let cut = futures_util::stream::once(async move {
            tokio::task::yield_now().await;
            drop(completion);
            Err::<Frame<Bytes>, BoxError>(reset_error())
        });
        StreamBody::new(cut).boxed_unsync()
    } else {
        full_body(Bytes::from(json))
    };
    builder
        .body(body)
        .map_err(|e| ApiError::server_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// The state of one SSE response: the engine's events turned into chunks.
struct SseStream {
    events: EngineStream,
    meta: ResponseMeta,
    tokenizer: Tokenizer,
    include_usage: bool,
    finish: FinishReason,
    /// Output tokens the request will get.
    expected: u32,
    /// Output tokens turned into chunks so far.
    tokens: u32,
    /// Chunks ready to send.
    pending: VecDeque<Bytes>,
    /// Chunks sent.
    emitted: u32,
    /// Cut the stream after the first chunk.
    reset: bool,
    /// Nothing more to send after `pending`.
    done: bool,
    _completion: Completion,
}

impl SseStream {
    /// Queues the opening chunks: the role chunk (chat) and the first token.
    fn start(mut self, first: u32) -> Self {
        if self.meta.endpoint == Endpoint::Chat {
            self.pending
                .push_back(Chunk::chat_role(&self.meta, self.include_usage).to_sse());
        }
        self.push_token(first);
        self
    }

    fn push_token(&mut self, id: u32) {
        self.tokens += 1;
        let finish = (self.tokens >= self.expected).then_some(self.finish);
        let text = self.tokenizer.decode(&[id]);
        self.pending
            .push_back(Chunk::token(&self.meta, text, finish, self.include_usage).to_sse());
    }

    fn push_end(&mut self, usage: Usage) {
        if self.include_usage {
            self.pending.push_back(Chunk::usage(&self.meta, usage).to_sse());
        }
        self.pending.push_back(Bytes::from_static(api::SSE_DONE));
        self.done = true;
    }

    /// The next body frame (the `unfold` step).
    async fn next_frame(mut self) -> Option<(Result<Frame<Bytes>, BoxError>, Self)> {
        loop {
            if self.reset && self.emitted >= 1 {
                if self.done && self.pending.is_empty() {
                    return None;
                }
                // Let hyper flush the first chunk, then abort the connection.
                tokio::task::yield_now().await;
                self.done = true;
                self.pending.clear();
                return Some((Err(reset_error()), self));
            }
            if let Some(chunk) = self.pending.pop_front() {
                self.emitted += 1;
                return Some((Ok(Frame::data(chunk)), self));
            }
            if self.done {
                return None;
            }
            match self.events.next().await {
                Some(Event::Token { id }) | Some(Event::FirstToken { id, .. }) => self.push_token(id),
                Some(Event::Finished { usage }) => self.push_end(usage),
                // The engine dropped the request: abort rather than end
                // the stream as if it were complete.
                None => {
                    self.done = true;
                    return Some((Err("semlb-sim: the engine dropped the request".into()), self));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(allowed_method("/v1/completions"), Some("POST"));
        assert_eq!(allowed_method("/v1/chat/completions"), Some("POST"));
        assert_eq!(allowed_method("/metrics"), Some("GET"));
        assert_eq!(allowed_method("/reset_prefix_cache"), Some("POST"));
        assert_eq!(allowed_method("/health"), Some("GET"));
        assert_eq!(allowed_method("/v1/models"), Some("GET"));
        assert_eq!(allowed_method("/v1/embeddings"), Some("POST"));
        for path in [
            "/tokenize",
            "/detokenize",
            "/v1/chat/completions/render",
            "/v1/completions/render",
        ] {
            assert_eq!(allowed_method(path), Some("POST"), "{path}");
        }
        for path in [
            "/version",
            "/model_info",
            "/get_model_info",
            "/server_info",
            "/get_server_info",
            "/v1/loads",
        ] {
            assert_eq!(allowed_method(path), Some("GET"), "{path}");
        }
        assert_eq!(allowed_method("/v1/rerank"), None);
        assert_eq!(allowed_method("/"), None);
    }
}
