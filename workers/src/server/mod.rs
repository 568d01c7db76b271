//! The HTTP front of `semlb-sim`: a hyper 1 HTTP/1.1 server with the
//! OpenAI routes, JSON and server-sent-event responses, and the fault
//! injection of [`crate::faults`].
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /v1/completions` | a completion, JSON or SSE (see [`crate::api`]) |
//! | `POST /v1/chat/completions` | a chat completion, JSON or SSE (a tool call when the request has tools) |
//! | `POST /v1/responses` | OpenAI's Responses API: a `response`, JSON or named events; stored for `previous_response_id` (see [`crate::response_store`]) |
//! | `POST /v1/messages` | Anthropic's Messages API: a `message`, JSON or Anthropic's events; errors in Anthropic's shape |
//! | `GET /v1/models` | the OpenAI model list with the one served model |
//! | `GET /health` | 200 with an empty body, as vLLM |
//! | `GET /metrics` | the Prometheus exposition (see [`crate::metrics`]); 404 with [`MetricsFlavor::None`] |
//! | `GET /props` | with [`Sim::with_props`] (on by default for `--metrics-flavor llamacpp`): llama.cpp's server properties, `total_slots` = `max_num_seqs` and each slot's `n_ctx`, as `llama-server` answers; else 404 |
//! | `GET /sim/metrics` | the same counters in vLLM's names, whatever the flavor: the simulator's own window for benchmarks and tests (no gateway scrapes it), so an engine set without metrics can still be measured |
//! | `POST /reset_prefix_cache` | empties the prefix cache, as vLLM's: 200; 409 `busy` while requests hold blocks (vLLM then only logs that it could not) |
//! | `POST /tokenize`, `POST /detokenize`, `POST /v1/chat/completions/render`, `POST /v1/completions/render`, `GET /version` | vLLM's tokenization endpoints (see [`crate::vllm_api`]): the ids the simulator computes for the same body |
//! | `GET /model_info`, `GET /get_model_info`, `GET /server_info`, `GET /get_server_info`, `GET /v1/loads` | SGLang's server-information endpoints (see [`crate::sglang_api`]), so that SGLang's routers can manage the simulator; `/v1/loads` only with the `vllm`, `sglang` and `both` metric flavors (else 404, as `/metrics` without metrics: an engine set that reports no load reports none there either) |
//! | `GET /sim/requests` | the last inference requests received: path, body, `x-request-id`, leg, outcome (see [`crate::request_log`]) |
//! | `POST /sim/nixl/query`, `POST /sim/nixl/release` | the NIXL side channel a vLLM decode leg pulls a prefill's prompt through (see [`crate::pd`]) |
//!
//! `GET /sim/metrics` also carries the P/D counters (`semlb_sim_pd_*`,
//! see [`crate::pd::Pd::metrics`]).
//!
//! Other methods on these paths get 405 (with `Allow`), other paths 404,
//! both with an OpenAI error body (Anthropic's on `/v1/messages`).
//!
//! # An inference request
//!
//! [`inference`] has the steps, and the legs of disaggregated serving;
//! [`tokens`] turns a body into token ids; `tools` decides a conversation's
//! tool call and its tokens; [`sse`] streams the answer.
//!
//! The body (at most [`MAX_BODY_BYTES`]) is parsed and validated by
//! [`crate::api`]; a conversation's messages (chat, Responses — after the
//! stored conversation it continues — or Messages) are rendered with the
//! configured [`ChatTemplate`], with the request's tools; the prompt text
//! is tokenized. The output length follows [`api::output_length`], and the
//! output token ids are [`OutputVocab::generate`]`(seahash(prompt ids as
//! little-endian u32 bytes), n)`, so the same prompt always gets the same
//! answer; each token's text is `Tokenizer::decode(&[id])`. A tool call's
//! output tokens are instead the template's rendering of the assistant
//! turn that holds it, past the prompt (`render(messages + [call])`
//! without the generation prompt, minus `render(messages)`), so that the
//! next turn, which renders the call the client sends back, extends the
//! prompt and output the engine cached. The request is submitted to
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

mod inference;
mod sse;
mod tokens;
mod tools;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::api::{self, ApiError, Endpoint};
use crate::config::EngineConfig;
use crate::engine::Engine;
use crate::faults::{FaultConfig, Faults};
use crate::metrics::{self, MetricsFlavor};
use crate::output_vocab::OutputVocab;
use crate::pd::{self, Pd};
use crate::request_log::RequestLog;
use crate::response_store::ResponseStore;
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
/// chat template, the output vocabulary, the fault state, the metrics
/// flavor, its part in disaggregated serving and the log of requests.
/// Shared by all connections behind an [`Arc`].
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
    /// Its role and protocol in disaggregated serving, and their state.
    pd: Pd,
    /// The last inference requests.
    requests: Arc<RequestLog>,
    /// The stored answers of `/v1/responses`.
    responses: ResponseStore,
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
            pd: Pd::plain(),
            requests: RequestLog::new(),
            responses: ResponseStore::new(),
        }
    }

    /// The same server playing its part in disaggregated serving as `pd`
    /// says (by default, [`Pd::plain`]: an aggregated vLLM-like engine
    /// that still takes vLLM's P/D legs).
    pub fn with_pd(mut self, pd: Pd) -> Self {
        self.pd = pd;
        self
    }

    /// Its part in disaggregated serving.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// The log of the last inference requests (`/sim/requests`).
    pub fn requests(&self) -> &Arc<RequestLog> {
        &self.requests
    }

    /// The stored answers of `/v1/responses` (`previous_response_id`).
    pub fn responses(&self) -> &ResponseStore {
        &self.responses
    }

    /// The chat template messages are rendered with.
    fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The output vocabulary answers are drawn from.
    fn vocab(&self) -> &OutputVocab {
        &self.vocab
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

    /// The next response id for `endpoint` (a prefill's request id too).
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
    // A prefill's `kv_transfer_params` name this address.
    sim.pd.advertise(listener.local_addr()?);
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
        "/v1/responses" | "/v1/messages" => Some("POST"),
        "/tokenize" | "/detokenize" | "/v1/chat/completions/render" | "/v1/completions/render" => Some("POST"),
        "/v1/models" | "/health" | "/metrics" | "/props" | "/sim/metrics" | "/sim/requests" => Some("GET"),
        pd::NIXL_QUERY_PATH | pd::NIXL_RELEASE_PATH => Some("POST"),
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
        "/v1/responses" => Some(Endpoint::Responses),
        "/v1/messages" => Some(Endpoint::Messages),
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
            inference::inference(&sim, request, endpoint, decision, completion).await
        }
        (None, Some(method)) if request.method().as_str() != method => {
            let error = ApiError::method_not_allowed(request.method().as_str(), &path);
            let error = match endpoint {
                Some(endpoint) => inference::in_shape(endpoint, error),
                None => error,
            };
            let mut response = error_response(error);
            response.headers_mut().insert(ALLOW, HeaderValue::from_static(method));
            response
        }
        (None, Some(_)) => match path.as_str() {
            "/health" => full_response(StatusCode::OK, None, Bytes::new()),
            "/v1/embeddings" => tokens::embeddings(&sim, request).await.unwrap_or_else(error_response),
            "/tokenize" | "/detokenize" | "/v1/chat/completions/render" | "/v1/completions/render" => {
                tokens::tokenization(&sim, request, &path)
                    .await
                    .unwrap_or_else(error_response)
            }
            "/sim/requests" => json_response(sim.requests.body()),
            pd::NIXL_QUERY_PATH | pd::NIXL_RELEASE_PATH => match read_body(request.into_body()).await {
                Ok(body) => {
                    let (status, answer) = sim.pd.nixl_side_channel(&sim.engine, &path, &body);
                    full_response(status, Some("application/json"), Bytes::from(answer.to_string()))
                }
                Err(e) => error_response(e),
            },
            "/version" => json_response(vllm_api::version_body()),
            "/model_info" | "/get_model_info" => json_response(sglang_api::model_info_body(
                sim.engine.config(),
                sim.tokenizer_path.as_deref(),
            )),
            "/server_info" | "/get_server_info" => json_response(sglang_api::server_info_body(
                sim.engine.config(),
                sim.tokenizer_path.as_deref(),
                sim.flavor != MetricsFlavor::None,
                sglang_api::Disaggregation {
                    mode: sim.pd.config().role.disaggregation_mode(),
                    bootstrap_port: sim.pd.bootstrap_port(),
                },
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
                    sim.pd.config().protocol.owned_by(),
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
                let mut text = metrics::render(&sim.engine.stats(), sim.engine.config(), flavor);
                if path == "/sim/metrics" {
                    text.push_str(&sim.pd.metrics(&sim.engine));
                }
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
        assert_eq!(allowed_method("/sim/requests"), Some("GET"));
        assert_eq!(allowed_method("/sim/nixl/query"), Some("POST"));
        assert_eq!(allowed_method("/sim/nixl/release"), Some("POST"));
        assert_eq!(allowed_method("/v1/rerank"), None);
        assert_eq!(allowed_method("/"), None);
    }
}
