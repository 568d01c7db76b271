//! The request handlers: route dispatch, the inference pipeline (body →
//! parse → tokens → block chain → response cache → route → proxy with
//! retries), the generic `/v1/*` proxy, `/v1/models` and `/health`.
//! See the [parent module](super) for the pipeline's rules.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};
use shm_layout::{ResponseKey, ServerRef};

use super::Dispatcher;
use super::http::{
    BACKEND_HEADER, Body, CACHE_HEADER, client_response_headers, error_response, full_response, json_response,
    set_header, set_static_header, upstream_request_headers,
};
use super::queue::{QueueExit, Waiting};
use super::relay::{InflightGuard, Learn, Relay, RelayTimer};
use super::sse;
use crate::blocks::BlockHasher;
use crate::metrics::{CacheResult, DURATION, EndpointLabel, QueueOutcome, Snapshot, Stage};
use crate::prompt::{self, Endpoint, RoutingInput};
use crate::response_cache::{self, Cacheability, Tenant};
use crate::routing::{Reason, RouteInput, live_candidates};
use crate::store::{Lookup, LookupRequest};

/// Routing texts longer than this are tokenized on the blocking pool. The
/// native tokenizer takes about 25 ns per byte of new text (less for text
/// its segment cache holds), so this bounds the time one request holds the
/// reactor to about a millisecond; shorter texts cost less than the hand-off.
const BLOCKING_TOKENIZE_BYTES: usize = 48 << 10;

/// Largest `/v1/models` answer read from one server.
const MAX_MODELS_BYTES: usize = 8 << 20;

/// Answers one request (never fails: errors are responses).
pub(super) async fn handle(dispatcher: Arc<Dispatcher>, request: Request<Incoming>) -> Response<Body> {
    let start = std::time::Instant::now();
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    let allowed = match path.as_str() {
        "/v1/completions" | "/v1/chat/completions" => Some(Method::POST),
        "/v1/models" | "/health" | "/metrics" => Some(Method::GET),
        _ => None,
    };
    let mut response = match (path.as_str(), allowed) {
        (_, Some(m)) if m != method => {
            let mut r = error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} is not allowed on {path}; use {m}"),
                Some("method_not_allowed"),
            );
            set_header(r.headers_mut(), "allow", m.as_str());
            r
        }
        ("/v1/completions", _) => inference(&dispatcher, request, Endpoint::Completions).await,
        ("/v1/chat/completions", _) => inference(&dispatcher, request, Endpoint::ChatCompletions).await,
        ("/v1/models", _) => models(&dispatcher).await,
        ("/health", _) => health(&dispatcher),
        ("/metrics", _) => metrics(&dispatcher).await,
        (p, _) if p.starts_with("/v1/") => passthrough(&dispatcher, request).await,
        _ => error_response(
            StatusCode::NOT_FOUND,
            format!("{method} {path} is not a route of this server"),
            Some("unknown_url"),
        ),
    };
    let endpoint = EndpointLabel::of_path(&path);
    let m = dispatcher.metrics();
    m.request(endpoint, response.status().as_u16());
    // A relayed answer records its duration when its body ends; the others
    // (cached answers, errors) are complete now.
    let relayed = response.extensions_mut().remove::<Relayed>().is_some();
    if matches!(endpoint, EndpointLabel::Completions | EndpointLabel::ChatCompletions) && !relayed {
        m.observe_duration(DURATION, start.elapsed());
    }
    response
}

/// Marks a response whose body is a [`Relay`] (it records its own duration).
#[derive(Debug, Clone, Copy)]
struct Relayed;

/// `GET /metrics`: the whole gateway's counters (every process's stats
/// block summed) and the gauges read from the segment, as Prometheus text.
async fn metrics(dispatcher: &Arc<Dispatcher>) -> Response<Body> {
    let d = dispatcher.clone();
    // Counting the prefix table's entries scans it: off the reactor.
    let render = move || {
        let tables = d.segment.tables();
        Snapshot::collect(&tables, d.segment.clock().now_ms(), d.config.health.stale_after_ms).render()
    };
    match tokio::task::spawn_blocking(render).await {
        Ok(text) => full_response(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", text),
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}"),
            None,
        ),
    }
}

/// Reads a request body of at most `limits.max_body_bytes` (413 beyond).
async fn read_body(dispatcher: &Dispatcher, headers: &HeaderMap, body: Incoming) -> Result<Bytes, Response<Body>> {
    let max = usize::try_from(dispatcher.config.limits.max_body_bytes.0).unwrap_or(usize::MAX);
    let too_large = || {
        error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than the limit of {max} bytes"),
            Some("payload_too_large"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(error_response(
            StatusCode::BAD_REQUEST,
            format!("could not read the request body: {e}"),
            None,
        )),
    }
}

/// What a proxied request is: where it goes and what it carries.
struct Outbound {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
}

/// Where the dispatch time of one inference request goes: stamps taken
/// from the moment its headers arrived; shown to the client (and to
/// benchmarks) as `x-semlb-dispatch-ns: read=…,parse=…,tokenize=…,hash=…,cache=…,route=…,total=…`
/// (nanoseconds per stage; `cache` is the store lookup: response cache,
/// prefix match and load, one round trip on Redis; `route` is the policy's
/// choice; `total` ends when the request is handed to the upstream client).
#[derive(Debug, Clone, Copy)]
struct DispatchTiming {
    start: std::time::Instant,
    /// Cumulative nanoseconds at the end of each [`Mark`], in its order.
    marks: [u64; 5],
}

/// The stages [`DispatchTiming`] stamps the end of, in request order.
#[derive(Debug, Clone, Copy)]
enum Mark {
    /// The body read.
    Read,
    /// The body parsed and the chat rendered.
    Parse,
    /// The routing text tokenized.
    Tokenize,
    /// The block chain hashed.
    Hash,
    /// The store lookup (response cache, prefix match, load).
    Cache,
}

impl DispatchTiming {
    fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            marks: [0; 5],
        }
    }

    fn mark(&mut self, stage: Mark) {
        self.marks[stage as usize] = self.start.elapsed().as_nanos() as u64;
    }

    /// Cumulative nanoseconds at the end of `stage`.
    fn at(&self, stage: Mark) -> u64 {
        self.marks[stage as usize]
    }

    /// Records the stages into the dispatch histograms; `sent`: the
    /// upstream hand-off (`None` for a cached answer: no route stage), and
    /// `end` the end of dispatch in ns.
    fn observe(&self, dispatcher: &Dispatcher, routed: bool, end: u64) {
        let m = dispatcher.metrics();
        let secs = |ns: u64| ns as f64 / 1e9;
        let since = |a: Mark, b: Mark| secs(self.at(b).saturating_sub(self.at(a)));
        m.observe(Stage::Tokenize.histogram(), since(Mark::Parse, Mark::Tokenize));
        m.observe(Stage::Lookup.histogram(), since(Mark::Hash, Mark::Cache));
        if routed {
            m.observe(Stage::Route.histogram(), secs(end.saturating_sub(self.at(Mark::Cache))));
        }
        m.observe(Stage::Total.histogram(), secs(end));
    }

    /// The header value, with the upstream hand-off at `sent` ns.
    fn header(&self, sent: u64) -> String {
        let since = |a: Mark, b: Mark| self.at(b) - self.at(a);
        format!(
            "read={},parse={},tokenize={},hash={},cache={},route={},total={sent}",
            self.at(Mark::Read),
            since(Mark::Read, Mark::Parse),
            since(Mark::Parse, Mark::Tokenize),
            since(Mark::Tokenize, Mark::Hash),
            since(Mark::Hash, Mark::Cache),
            sent.saturating_sub(self.at(Mark::Cache))
        )
    }
}

/// The response header carrying a [`DispatchTiming`].
pub(crate) const DISPATCH_HEADER: &str = "x-semlb-dispatch-ns";

/// The response header naming why the server was chosen
/// ([`Reason::name`]).
pub(crate) const ROUTE_HEADER: &str = "x-semlb-route";

/// The response header carrying the milliseconds a request waited in the
/// gateway queue (absent when it did not wait).
pub(crate) const QUEUE_HEADER: &str = "x-semlb-queue-ms";

/// What an inference request adds to a proxied one.
struct InferenceCtx {
    /// Where the dispatch time went.
    timing: DispatchTiming,
    prompt_tokens: Vec<u32>,
    chain: Vec<u64>,
    hasher: BlockHasher,
    /// Where a 200 answer may be stored.
    store_key: Option<ResponseKey>,
    /// The `x-semlb-cache` value.
    cache: &'static str,
    /// The store's answer for the first routing decision.
    lookup: Option<Lookup>,
    /// The endpoint (for the routing event).
    endpoint: Endpoint,
    /// The request's `model` (for the routing event).
    model: String,
    /// Its session key, hashed, if the policy uses one and it has one.
    session: Option<u64>,
}

async fn inference(dispatcher: &Arc<Dispatcher>, request: Request<Incoming>, endpoint: Endpoint) -> Response<Body> {
    let mut timing = DispatchTiming::new();
    let (parts, body) = request.into_parts();
    let bytes = match read_body(dispatcher, &parts.headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    timing.mark(Mark::Read);
    let mut parsed = match prompt::parse(endpoint, &bytes, &dispatcher.template) {
        Ok(p) => p,
        Err(e) => return json_response(StatusCode::BAD_REQUEST, &e.body()),
    };
    timing.mark(Mark::Parse);
    let session = dispatcher.session_key(&parts.headers, &parsed.body);
    let prompt_tokens = match &mut parsed.input {
        RoutingInput::Text(text) if text.len() > BLOCKING_TOKENIZE_BYTES => {
            let (tokenizer, text) = (dispatcher.tokenizer.clone(), text.to_string());
            // Should the task fail, the request routes on load alone.
            let tokens: Vec<u32> = tokio::task::spawn_blocking(move || tokenizer.encode(&text))
                .await
                .unwrap_or_default();
            tokens
        }
        RoutingInput::Text(text) => dispatcher.tokenizer.encode(text),
        RoutingInput::Tokens(ids) => std::mem::take(ids),
    };
    dispatcher.report_segments();
    timing.mark(Mark::Tokenize);
    let seed = dispatcher.segment.header().seed[0];
    let hasher = BlockHasher::new(
        BlockHasher::root_for(&parsed.model, seed),
        dispatcher.config.block_size.max(1),
    );
    let mut chain = Vec::with_capacity(prompt_tokens.len() / hasher.block_size() + 1);
    hasher.chain(&prompt_tokens, &mut chain);
    timing.mark(Mark::Hash);

    // Response cache.
    let rc = &dispatcher.config.response_cache;
    let header_bytes = |name| parts.headers.get(name).map(HeaderValue::as_bytes);
    let tenant = Tenant::of(rc.scope, &parts.headers);
    let cacheability = response_cache::cacheability(
        rc.enabled,
        rc.cache_nondeterministic,
        &parsed.body,
        header_bytes(header::CACHE_CONTROL),
    );
    let key = (cacheability != Cacheability::Bypass).then(|| response_cache::key(tenant, endpoint, &parsed.body));
    let mut lookup = dispatcher
        .store
        .lookup(LookupRequest {
            response_key: key.filter(|_| cacheability.reads()),
            chain: &chain,
            exclude: &[],
            stale_after_ms: dispatcher.config.health.stale_after_ms,
        })
        .await;
    if lookup.degraded {
        dispatcher.metrics().degraded_lookup();
    }
    if let Some(stored) = lookup.response.take()
        && let Some(mut response) = cached_answer(&stored, endpoint, &parsed)
    {
        dispatcher.metrics().cache(CacheResult::Hit);
        timing.mark(Mark::Cache);
        let answered = timing.start.elapsed().as_nanos() as u64;
        tracing::debug!(
            endpoint = endpoint.path(),
            model = %parsed.model,
            prompt_tokens = prompt_tokens.len(),
            blocks = chain.len(),
            cache = "hit",
            degraded = lookup.degraded,
            dispatch_ns = answered,
            "{} answered from the response cache",
            endpoint.path()
        );
        timing.observe(dispatcher, false, answered);
        set_header(response.headers_mut(), DISPATCH_HEADER, &timing.header(answered));
        return response;
    }
    timing.mark(Mark::Cache);
    let cache = if cacheability.writes() {
        dispatcher.metrics().cache(CacheResult::Miss);
        "miss"
    } else {
        dispatcher.metrics().cache(CacheResult::Bypass);
        "bypass"
    };
    let ctx = InferenceCtx {
        timing,
        prompt_tokens,
        chain,
        hasher,
        store_key: key.filter(|_| cacheability.writes() && !parsed.stream),
        cache,
        lookup: Some(lookup),
        endpoint,
        model: parsed.model.to_string(),
        session,
    };
    let outbound = Outbound {
        method: Method::POST,
        path_and_query: endpoint.path().to_owned(),
        headers: upstream_request_headers(&parts.headers),
        body: bytes,
    };
    forward(dispatcher, outbound, Some(ctx)).await
}

/// The answer to `parsed` from a fresh cached body (`None` if a streaming
/// replay of it cannot be made).
fn cached_answer(stored: &Bytes, endpoint: Endpoint, parsed: &prompt::ParsedRequest<'_>) -> Option<Response<Body>> {
    let mut response = if parsed.stream {
        let events = sse::replay(endpoint, stored, parsed.include_usage())?;
        let mut r = full_response(StatusCode::OK, "text/event-stream", events);
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    } else {
        full_response(StatusCode::OK, "application/json", stored.clone())
    };
    let headers = response.headers_mut();
    set_static_header(headers, CACHE_HEADER, "hit");
    set_static_header(headers, BACKEND_HEADER, "cache");
    Some(response)
}

/// Any other `/v1/...` request: proxied to the least loaded live server.
async fn passthrough(dispatcher: &Arc<Dispatcher>, request: Request<Incoming>) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let bytes = match read_body(dispatcher, &parts.headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let outbound = Outbound {
        method: parts.method,
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
        headers: upstream_request_headers(&parts.headers),
        body: bytes,
    };
    forward(dispatcher, outbound, None).await
}

/// What a routing decision is about.
#[derive(Debug, Clone, Copy)]
struct RouteRequest<'a> {
    /// The prompt's block chain (empty for a non-inference request).
    chain: &'a [u64],
    /// Prompt tokens.
    prompt_tokens: u32,
    /// The hashed session key.
    session: Option<u64>,
    /// An inference request (routed by the policy; others by least load).
    inference: bool,
}

/// The outcome of [`Dispatcher::choose`].
enum Routed {
    /// Send it there (already counted in flight when the policy holds
    /// requests: choosing and counting are then confirmed together).
    Chosen(Chosen, Option<InflightGuard>),
    /// Every server the policy would use is full: queue it (the lookup's
    /// prefix match goes with it).
    Wait {
        /// The lookup the request was routed with.
        lookup: Lookup,
        /// Whether the policy was asked (else the request joined a
        /// non-empty queue unasked, and its first look from the queue is
        /// its first look at all).
        asked: bool,
    },
    /// No server is available.
    NoServer,
}

impl Dispatcher {
    /// `server` as a policy sees it, read from the segment now: in-flight
    /// and pending counts of this host and its fresh scraped load.
    pub(super) fn counted_candidate(&self, server: ServerRef) -> crate::routing::Candidate {
        let mut c = crate::routing::candidate(&self.segment.tables().servers, server);
        let now_ms = self.segment.clock().now_ms();
        c.load = crate::health::fresh_load(c.load, now_ms, self.config.health.stale_after_ms).unwrap_or_default();
        c
    }

    /// The hashed session key of a request, from the first of the
    /// policy's session headers it carries, else its body's `user` field
    /// (when the policy asks for either; see [`crate::routing::SessionSource`]).
    fn session_key(&self, headers: &HeaderMap, body: &crate::body::Object<'_>) -> Option<u64> {
        let policy = self.policy.current_arc();
        let source = policy.session_source()?;
        let from_header = source
            .headers
            .iter()
            .find_map(|name| headers.get(name.as_str()))
            .map(HeaderValue::as_bytes)
            .filter(|v| !v.is_empty());
        let from_user = || {
            source
                .user_field
                .then(|| body.get("user").and_then(crate::body::Json::as_str))
                .flatten()
                .filter(|u| !u.is_empty())
                .map(str::as_bytes)
        };
        from_header.or_else(from_user).map(seahash::hash)
    }

    /// A server for `route`, avoiding `exclude`, with its address and why.
    /// `lookup` is the store's answer for this request if one was already
    /// made (the first attempt).
    ///
    /// With a policy that [holds requests](crate::routing::Policy::holds_requests):
    /// a request arriving while others wait in this dispatcher's queue
    /// joins them (first in, first out: none overtakes), and a chosen server
    /// is counted at once and checked again with the policy
    /// ([`admits`](crate::routing::Policy::admits)): if another dispatcher
    /// filled it meanwhile, the request is uncounted and queued.
    async fn choose(
        self: &Arc<Self>,
        route: RouteRequest<'_>,
        exclude: &[ServerRef],
        lookup: Option<Lookup>,
    ) -> Routed {
        let RouteRequest {
            chain,
            prompt_tokens,
            session,
            inference,
        } = route;
        let mut lookup = match lookup {
            Some(l) => l,
            None => {
                let request = LookupRequest {
                    response_key: None,
                    chain: if inference { chain } else { &[] },
                    exclude,
                    stale_after_ms: self.config.health.stale_after_ms,
                };
                let l = self.store.lookup(request).await;
                if l.degraded {
                    self.metrics().degraded_lookup();
                }
                l
            }
        };
        let servers = self.segment.tables().servers;
        let policy = self.policy.current_arc();
        let holds = inference && policy.holds_requests();
        if holds && !lookup.candidates.is_empty() && self.queue.len() > 0 {
            return Routed::Wait { lookup, asked: false };
        }
        loop {
            if lookup.candidates.is_empty() {
                return Routed::NoServer;
            }
            let (choice, reason) = if inference {
                let input = RouteInput {
                    prompt_blocks: u32::try_from(chain.len()).unwrap_or(u32::MAX),
                    chain,
                    prompt_tokens,
                    block_tokens: self.block_tokens(),
                    session,
                    repeat: !exclude.is_empty(),
                    prefix: &lookup.prefix,
                    candidates: &lookup.candidates,
                };
                let Some(choice) = policy.choose(&input) else {
                    return if policy.holds_requests() {
                        Routed::Wait { lookup, asked: true }
                    } else {
                        Routed::NoServer
                    };
                };
                if exclude.is_empty() {
                    // The first choice of the request: how much of its prompt it has.
                    self.metrics()
                        .prefix_match(lookup.prefix.blocks_for(choice.server.tag()), chain.len());
                }
                (choice.server, choice.reason)
            } else {
                let Some(least) = lookup.candidates.iter().min_by_key(|c| (c.inflight, c.inflight_tokens)) else {
                    return Routed::NoServer;
                };
                (least.server, Reason::LeastLoad)
            };
            let Some(info) = servers.get(choice.slot).filter(|i| i.server == choice) else {
                // Re-registered or unreadable meanwhile: ask again without it.
                lookup.candidates.retain(|c| c.server != choice);
                continue;
            };
            let guard = if holds {
                let Some(guard) = InflightGuard::begin(self, choice, u64::from(prompt_tokens)) else {
                    lookup.candidates.retain(|c| c.server != choice);
                    continue;
                };
                if !policy.admits(&self.counted_candidate(choice)) {
                    drop(guard);
                    return Routed::Wait { lookup, asked: true };
                }
                Some(guard)
            } else {
                None
            };
            return Routed::Chosen(
                Chosen {
                    server: choice,
                    address: info.address,
                    reason,
                    candidates: lookup.candidates.len(),
                    degraded: lookup.degraded,
                },
                guard,
            );
        }
    }
}

impl Dispatcher {
    /// Passive health check (see [`crate::health`]): a request to `server`
    /// failed; at `health.unhealthy_threshold` failures in a row through
    /// this dispatcher, the server is set `Down` in the server table, for
    /// every dispatcher at once (the supervisor's checker re-admits it).
    pub(super) fn passive_failure(&self, server: ServerRef, address: &str, error: &str) {
        if self.health.failure(server) && crate::health::eject(&self.segment.tables().servers, server) {
            tracing::warn!(
                backend = %address,
                failures = self.config.health.unhealthy_threshold,
                error = %error,
                "backend {address} is down: {} requests in a row failed (last: {error})",
                self.config.health.unhealthy_threshold
            );
        }
    }

    /// Passive health check: a request to `server` was answered in full.
    pub(super) fn passive_success(&self, server: ServerRef) {
        self.health.success(server);
    }
}

/// A routing decision of [`Dispatcher::choose`].
struct Chosen {
    server: ServerRef,
    /// Its base URL.
    address: String,
    /// Why the policy chose it.
    reason: Reason,
    /// How many servers it was chosen from.
    candidates: usize,
    /// Whether the store's lookup failed (no prefix, local load only).
    degraded: bool,
}

/// Sends `outbound` to a chosen server, retrying elsewhere on connection
/// failures and 5xx heads, and relays the answer.
async fn forward(dispatcher: &Arc<Dispatcher>, outbound: Outbound, mut ctx: Option<InferenceCtx>) -> Response<Body> {
    let limits = &dispatcher.config.limits;
    let deadline = tokio::time::Instant::now() + limits.request_timeout();
    // One timer for the whole request: the wait for a head, then the
    // relayed body (registering a timer is not free at 20 K requests/s).
    let mut timer = Box::pin(tokio::time::sleep_until(deadline));
    let mut first_lookup = ctx.as_mut().and_then(|c| c.lookup.take());
    let chain: &[u64] = ctx.as_ref().map_or(&[], |c| &c.chain);
    let prompt_tokens = ctx.as_ref().map_or(0, |c| c.prompt_tokens.len() as u64);
    let mut failed: Vec<ServerRef> = Vec::new();
    let mut last_error = String::new();
    let mut attempt = 0u32;
    let mut dispatch_ns: Option<u64> = None;
    // Time spent in the gateway queue, and the last routing reason (headers).
    let mut queued_ms: Option<u64> = None;
    let mut last_reason: Option<Reason> = None;
    let mut response = loop {
        let route = RouteRequest {
            chain,
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            session: ctx.as_ref().and_then(|c| c.session),
            inference: ctx.is_some(),
        };
        let (chosen, admitted) = match dispatcher.choose(route, &failed, first_lookup.take()).await {
            Routed::Chosen(chosen, guard) => (chosen, guard),
            Routed::Wait { lookup, asked } => {
                let waiting = Waiting {
                    chain: chain.to_vec(),
                    prompt_tokens: route.prompt_tokens,
                    session: route.session,
                    prefix: lookup.prefix,
                    exclude: failed.clone(),
                    seen: asked || !failed.is_empty(),
                };
                let since = std::time::Instant::now();
                let admitted = match dispatcher.wait_in_queue(waiting).await {
                    Ok(a) => a,
                    Err(QueueExit::Full) => {
                        dispatcher.metrics().queue_left(QueueOutcome::Full, Duration::ZERO);
                        let mut r = error_response(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "every inference server is busy and the gateway queue is full; retry later",
                            Some("queue_full"),
                        );
                        set_header(r.headers_mut(), "retry-after", "1");
                        break r;
                    }
                    Err(QueueExit::Timeout) => {
                        let mut r = error_response(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!(
                                "no inference server became free within {} ms while the request waited in the gateway queue",
                                since.elapsed().as_millis()
                            ),
                            Some("queue_timeout"),
                        );
                        set_header(r.headers_mut(), "retry-after", "1");
                        break r;
                    }
                };
                queued_ms = Some(queued_ms.unwrap_or(0) + since.elapsed().as_millis() as u64);
                let server = admitted.guard.server();
                let Some(info) = dispatcher
                    .segment
                    .tables()
                    .servers
                    .get(server.slot)
                    .filter(|i| i.server == server)
                else {
                    failed.push(server);
                    last_error = "a server was re-registered while the request waited".to_owned();
                    continue;
                };
                let chosen = Chosen {
                    server,
                    address: info.address,
                    reason: admitted.choice.reason,
                    candidates: lookup.candidates.len(),
                    degraded: lookup.degraded,
                };
                (chosen, Some(admitted.guard))
            }
            Routed::NoServer => {
                if let Some(c) = &ctx {
                    tracing::debug!(
                        endpoint = c.endpoint.path(),
                        model = %c.model,
                        prompt_tokens,
                        blocks = chain.len(),
                        cache = c.cache,
                        policy = dispatcher.policy_name(),
                        attempt = attempt + 1,
                        "{} not routed: no inference server is available",
                        c.endpoint.path()
                    );
                }
                break if attempt == 0 {
                    let mut r = error_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no inference server is available",
                        Some("no_server_available"),
                    );
                    set_header(r.headers_mut(), "retry-after", "1");
                    r
                } else {
                    bad_gateway(attempt, &last_error)
                };
            }
        };
        let Chosen {
            server,
            address,
            reason,
            candidates,
            degraded,
        } = chosen;
        last_reason = Some(reason);
        if attempt > 0 {
            dispatcher.metrics().retry();
        }
        attempt += 1;
        let guard = match admitted {
            Some(g) => g,
            None => match InflightGuard::begin(dispatcher, server, prompt_tokens) {
                Some(g) => g,
                None => {
                    failed.push(server);
                    last_error = format!("{address} was re-registered");
                    continue;
                }
            },
        };
        let uri = match format!("{address}{}", outbound.path_and_query).parse::<Uri>() {
            Ok(u) => u,
            Err(e) => {
                failed.push(server);
                last_error = format!("{address}: bad address: {e}");
                continue;
            }
        };
        let mut request = Request::new(Full::new(outbound.body.clone()));
        *request.method_mut() = outbound.method.clone();
        *request.uri_mut() = uri;
        *request.headers_mut() = outbound.headers.clone();
        // Dispatch ends here for the first attempt: the request goes upstream.
        let sent = ctx
            .as_ref()
            .filter(|_| attempt == 1)
            .map(|c| c.timing.start.elapsed().as_nanos() as u64);
        if let (Some(c), Some(sent)) = (&ctx, sent) {
            c.timing.observe(dispatcher, true, sent);
        }
        dispatch_ns = sent.or(dispatch_ns);
        if let Some(c) = &ctx {
            // The routing decision and why (one event per attempt: a retry
            // adds one). Nothing is computed unless debug is enabled.
            tracing::debug!(
                endpoint = c.endpoint.path(),
                model = %c.model,
                prompt_tokens,
                blocks = chain.len(),
                cache = c.cache,
                policy = dispatcher.policy_name(),
                server = %address,
                reason = reason.name(),
                matched_blocks = match reason {
                    Reason::Prefix { blocks } => blocks,
                    _ => 0,
                },
                candidates,
                degraded,
                attempt,
                dispatch_ns = sent.unwrap_or_else(|| c.timing.start.elapsed().as_nanos() as u64),
                "{} routed to {address}: {}",
                c.endpoint.path(),
                reason
            );
        }
        let result = tokio::select! {
            biased;
            head = dispatcher.client.request(request) => Ok(head),
            () = timer.as_mut() => Err(()),
        };
        let upstream = match result {
            Err(_) => {
                dispatcher.metrics().upstream(server.slot, false);
                // Passive health check: no head within the request timeout.
                dispatcher.passive_failure(server, &address, "no answer within the request timeout");
                break error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("{address} did not answer within {} s", limits.request_timeout_secs),
                    Some("upstream_timeout"),
                );
            }
            Ok(Err(e)) => {
                dispatcher.metrics().upstream(server.slot, false);
                last_error = format!("{address}: {}", crate::error_chain(&e));
                // Passive health check: a connection error.
                dispatcher.passive_failure(server, &address, &last_error);
                failed.push(server);
                None
            }
            Ok(Ok(r)) if r.status().is_server_error() => {
                dispatcher.metrics().upstream(server.slot, false);
                last_error = format!("{address} answered {}", r.status());
                // Passive health check: a 5xx head.
                dispatcher.passive_failure(server, &address, &last_error);
                failed.push(server);
                None
            }
            Ok(Ok(r)) => Some(r),
        };
        let Some(upstream) = upstream else {
            if attempt > limits.retries {
                break bad_gateway(attempt, &last_error);
            }
            continue;
        };
        let (parts, incoming) = upstream.into_parts();
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let learn = match &ctx {
            Some(c) if parts.status.is_success() => Some((
                dispatcher.clone(),
                Learn {
                    server,
                    prompt_tokens: u32::try_from(c.prompt_tokens.len()).unwrap_or(u32::MAX),
                    tail: c.prompt_tokens[c.chain.len() * c.hasher.block_size()..].to_vec(),
                    chain: c.chain.clone(),
                    hasher: c.hasher,
                    cache_key: c.store_key.filter(|_| parts.status == StatusCode::OK && !sse),
                    chat: c.endpoint == Endpoint::ChatCompletions,
                },
            )),
            _ => None,
        };
        // The relay reports the body's end or failure to the passive health
        // check (a head alone is not yet a success).
        let relay_timer = ctx
            .as_ref()
            .map(|c| RelayTimer::new(dispatcher.clone(), c.timing.start));
        let mut response = Response::new(Relay::new(incoming, timer, guard, learn, sse, relay_timer).boxed());
        response.extensions_mut().insert(Relayed);
        *response.status_mut() = parts.status;
        client_response_headers(&parts.headers, response.headers_mut());
        set_header(response.headers_mut(), BACKEND_HEADER, &address);
        break response;
    };
    if let Some(reason) = last_reason {
        set_static_header(response.headers_mut(), ROUTE_HEADER, reason.name());
    }
    if let Some(ms) = queued_ms {
        set_header(response.headers_mut(), QUEUE_HEADER, &ms.to_string());
    }
    if let Some(c) = &ctx {
        set_static_header(response.headers_mut(), CACHE_HEADER, c.cache);
        if let Some(sent) = dispatch_ns {
            set_header(response.headers_mut(), DISPATCH_HEADER, &c.timing.header(sent));
        }
    }
    response
}

fn bad_gateway(attempts: u32, last_error: &str) -> Response<Body> {
    error_response(
        StatusCode::BAD_GATEWAY,
        format!("no inference server could answer ({attempts} tried; last: {last_error})"),
        Some("upstream_unavailable"),
    )
}

/// The live servers' addresses.
fn live_addresses(dispatcher: &Dispatcher) -> Vec<String> {
    let tables = dispatcher.segment.tables();
    let mut candidates = Vec::new();
    live_candidates(&tables, &mut candidates);
    candidates
        .iter()
        .filter_map(|c| tables.servers.get(c.server.slot).filter(|i| i.server == c.server))
        .map(|i| i.address)
        .collect()
}

/// `GET /v1/models`: every live server's list, merged by `id`.
async fn models(dispatcher: &Arc<Dispatcher>) -> Response<Body> {
    let addresses = live_addresses(dispatcher);
    if addresses.is_empty() {
        let mut r = error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "no inference server is available",
            Some("no_server_available"),
        );
        set_header(r.headers_mut(), "retry-after", "1");
        return r;
    }
    let wait = dispatcher.config.limits.request_timeout().min(Duration::from_secs(10));
    let lists = futures_util::future::join_all(addresses.iter().map(|a| fetch_models(dispatcher, a, wait))).await;
    let mut data: Vec<Value> = Vec::new();
    let mut answered = 0;
    for list in lists.into_iter().flatten() {
        answered += 1;
        for model in list {
            let id = model.get("id").cloned();
            if !data.iter().any(|m| m.get("id").cloned() == id) {
                data.push(model);
            }
        }
    }
    if answered == 0 {
        return error_response(
            StatusCode::BAD_GATEWAY,
            "no inference server answered /v1/models",
            Some("upstream_unavailable"),
        );
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// One server's `data` list, or `None` if it did not answer well.
async fn fetch_models(dispatcher: &Dispatcher, address: &str, wait: Duration) -> Option<Vec<Value>> {
    let uri: Uri = format!("{address}/v1/models").parse().ok()?;
    let mut request = Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = uri;
    let response = tokio::time::timeout(wait, dispatcher.client.request(request))
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

/// `GET /health`: 200 when a server is live.
fn health(dispatcher: &Dispatcher) -> Response<Body> {
    let tables = dispatcher.segment.tables();
    let mut candidates = Vec::new();
    live_candidates(&tables, &mut candidates);
    if candidates.is_empty() {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "no inference server is live",
            Some("no_server_available"),
        );
    }
    json_response(
        StatusCode::OK,
        &json!({"status": "ok", "live_servers": candidates.len()}),
    )
}
