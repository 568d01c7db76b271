//! A dispatcher process's HTTP front: the OpenAI-compatible API, the
//! request pipeline and the pooled upstream client.
//!
//! # Routes
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses` (OpenAI's Responses API), `POST /v1/messages` (Anthropic's Messages API) | the inference pipeline below (JSON or SSE; errors on `/v1/messages` in Anthropic's shape) |
//! | `GET /v1/models` | the configured model pools ([`crate::pools`]); without them, the live servers' model lists merged, deduplicated by `id` |
//! | `GET /health` | 200 when at least one server is live, else 503 |
//! | `GET /metrics` | Prometheus text of the whole gateway ([`crate::metrics`]) |
//! | `GET /semlb/peer/load` | this gateway's load for its peers, with `x-semlb-peer-token` ([`crate::peers::summary`]; 404 without `peering.token_file`) |
//! | `POST /v1/embeddings`, `/v1/rerank`, `/v1/score`, `/v1/messages/count_tokens` | charged, then proxied to the least loaded live server of the pool its body's `model` names (unknown: 404; no model where keys or pools make it matter: 400) |
//!
//! Other paths, `/v1/...` included, get 404 from the gateway itself; wrong
//! methods 405 (with `Allow`); a path with a percent-encoded `/`, `\`,
//! `.` or control character, a `.` or `..` segment, `//` or a backslash
//! 400 `invalid_path` before any route is matched; all with an OpenAI
//! error body.
//!
//! # The inference pipeline
//!
//! 1. **Body**: at most `limits.max_body_bytes` (413, from `Content-Length`
//!    or while reading), parsed by [`crate::openai::prompt::parse_with`] (400), its
//!    `model` naming the model pool ([`crate::pools`]; unknown: 404
//!    `model_not_found`) whose chat template renders it and whose
//!    tokenizer, block size, servers and policy serve it.
//! 2. **Tokens**: the routing text is tokenized (on the blocking pool when
//!    longer than 4 KiB), token-id prompts are taken as given; the tokens are
//!    hashed into a block chain ([`crate::prefix::blocks`]) rooted at the model and
//!    the segment's seed.
//! 3. **Rate limits**: the caller's tenant's and the pool's buckets
//!    ([`crate::tenancy::rate_limit`]) are charged one request and the prompt's
//!    tokens, all or none (429 `rate_limit_exceeded` with `Retry-After`
//!    when one has no room); the answer carries `x-ratelimit-*` headers and
//!    its output tokens are charged when it ends.
//! 4. **Response cache**: the tenant (API key, or global), the exact key and
//!    the cacheability ([`crate::response_cache`]); a fresh entry answers
//!    at once without a server — as stored for JSON, replayed as SSE chunks
//!    for a streaming request (`sse::replay`).
//!    The cache lookup, the prefix match and the servers' load come from
//!    the store in one call ([`crate::store::RoutingStore::lookup`]: shared
//!    memory, or one Redis round trip).
//! 5. **Routing**: the live servers ([`crate::routing::live_candidates`]),
//!    the longest prefix match of the chain, the configured policy (which a
//!    configuration reload replaces in place: [`Dispatcher::set_policy`]). No
//!    server: 503 with `Retry-After: 1`. When the store cannot be reached
//!    the lookup has no prefix and local load only: the policy then
//!    chooses on load.
//! 6. **Proxy**: the request is counted in flight to the server in the
//!    store (the shm ledger; on Redis also the published counts; a drop
//!    guard ends it exactly once), the original body and the end-to-end
//!    headers go to `<server><path>`; a connection failure or a 5xx head
//!    (nothing sent to the client yet) is retried on another server up to
//!    `limits.retries` times, then 502. Failures also count towards the
//!    server's passive health check ([`crate::health::PassiveHealth`]): at
//!    `health.unhealthy_threshold` in a row it is set `Down` for every
//!    dispatcher; failures of the client or the gateway itself do not
//!    count ([`crate::dispatcher::failure::Origin`]). The answer is streamed through as
//!    it arrives (`relay::Relay`); a client that leaves drops the upstream
//!    request.
//! 7. **Learning**: a complete 2xx answer becomes a completion record —
//!    prompt chain, chain of prompt + answer, token counts and, for a
//!    cacheable 200, the body — pushed into this dispatcher's ring for a
//!    response process ([`crate::responder`]). A streamed answer is cached
//!    too: the response process stores the JSON response the whole stream
//!    stands for ([`crate::openai::answer::stream_as_response`]), so a repeat is
//!    answered as JSON, or replayed as SSE when it streams.
//!
//! Every inference answer carries `x-semlb-cache: hit|miss|bypass` (`miss`:
//! looked up or refreshed and may be stored; `bypass`: the cache was not
//! involved) and `x-semlb-backend: <server address | cache>`; an
//! authenticated caller gets these and the other diagnostic headers
//! (every [`DIAGNOSTIC_PREFIX`] header) only with `auth.debug_headers`.
//!
//! # Modules, in request order
//!
//! | module | step |
//! | --- | --- |
//! | `endpoints` | the route table: which handler answers a method and path (encoded separators and dot-segments refused first); `/health`, `/metrics` |
//! | `passthrough` | the engines' other `/v1` endpoints (embeddings, rerank, score, Messages' `count_tokens`): model, pool, charge, proxy |
//! | `inference` | the front half of an inference request: body → parse → tokens → block chain → cache key → lookup; cached answers |
//! | `concurrency` | the tenant's requests in flight on this host, counted while its answer runs: 429 past `max_concurrent_requests` |
//! | `charge` | the request's rate-limit buckets charged before it is routed, with its output reserved ([`crate::tenancy::rate_limit`]): 429, or the `x-ratelimit-*` headers of its answer; the reservation settled when the answer ends |
//! | `share` | a tenant's bounded share of the prefix table and the response cache (`auth.tenant_share_percent`) |
//! | `pick` | one attempt's routing decision (policy, or least load for other routes), the holding policies' check once counted, passive health |
//! | `proxy` | the attempts of one request: route, send, retry elsewhere on a retryable [`crate::dispatcher::failure::Failure`], then the gateway's headers |
//! | `peer_forward` | peer gateways ([`crate::peers`]): the load summary served them, the polls of theirs, a request forwarded to one and its answer relayed back |
//! | `relay` | the answer streamed to the client as it arrives, with a copy kept to learn from |
//! | `resume` | a chat stream whose engine breaks after its first byte, continued on another engine as one answer |
//! | `stream_usage` | the usage of every streamed answer asked for on the client's behalf (`stream_options.include_usage`) and kept from it |
//! | `meter` | an answer's output tokens, read as it passes: the engine's usage, else an estimate of everything generated |
//! | `learn` | the completion record a finished answer becomes, pushed into this dispatcher's ring |
//! | `stored_response` | the id of a response the engine stores (Responses API, `store` on), read as the answer passes and recorded for its engine ([`crate::routing::affinity`]) |
//! | `disagg` | disaggregated prefill and decode: the legs' bodies and what passes between them (vLLM's NixlConnector, SGLang's bootstrap rendezvous) |
//! | `queue` | the gateway queue of the holding policies and its pump |
//! | `models` | `GET /v1/models`: the live servers' lists merged |
//! | `client_io` | the client's connection, its writes bounded in time |
//! | `tenant_usage` | a request's counts per tenant and per model in the segment's usage table (`semlb status`, `/metrics`) |
//! | `epp` | the Gateway API Inference Extension's endpoint picker: Envoy's ext_proc over gRPC, the same stages and routing, the answer relayed as the proxy's |
//! | `inflight`, `timing`, `http`, `sse` | a request's in-flight count; its dispatch timing; HTTP helpers and OpenAI errors; SSE replay of cached answers |
//!
//! [`Dispatcher`] is defined here, with every method it has; its parts are
//! private to this file, and the steps reach them through accessors. The
//! steps depend on each other only downwards in this table's order
//! (`tests/architecture.rs` checks that files import no cycle).
//!
//! # Serving
//!
//! [`serve`] accepts HTTP/1.1 (keep-alive, `TCP_NODELAY`, TCP keepalive
//! probes after a minute of silence) until its shutdown future resolves,
//! then stops accepting, answers every request from then on with
//! `connection: close`, closes a connection still open a second later once
//! its current request is answered, and waits for them up to the drain
//! timeout. Upstream
//! connections are pooled and also use `TCP_NODELAY`.
//!
//! Clients are bounded: `limits.max_connections` connections per
//! dispatcher (one more gets a 503 and is closed), and
//! `limits.client_timeout_secs` to send a request's headers (hyper's header
//! timeout: the connection is closed), to send its body (408), and to read
//! on while an answer waits to be written (`client_io`: the connection is
//! closed, which ends the upstream request and releases its count).

mod charge;
mod client_io;
pub mod concurrency;
pub mod context_limit;
mod disagg;
mod endpoints;
#[cfg(feature = "epp")]
pub mod epp;
pub mod failure;
mod http;
mod inference;
mod inflight;
mod learn;
mod meter;
mod models;
mod passthrough;
mod peer_forward;
mod pick;
mod proxy;
mod queue;
pub mod reactor_watch;
mod relay;
mod resume;
mod share;
mod sse;
mod stored_response;
mod stream_usage;
mod tenant_usage;
mod timing;

pub use http::DIAGNOSTIC_PREFIX;
pub use peer_forward::Peering;
/// The stream and body rewriters the fuzz targets reach ([`crate::fuzzing`]).
pub use sse::replay;
pub use stream_usage::UsageStrip;
pub(crate) use {
    inference::with_model, proxy::with_cache_salt, stream_usage::with_include_usage, stream_usage::with_usage_option,
};

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use shm_layout::Segment;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::ServeConfig;
use crate::health::PassiveHealth;
use crate::metrics::Metrics;
use crate::peers::book::PeerBook;
use crate::pools::{ModelPools, Pool, PoolError, Tokenization, TokenizerLoader};
use crate::routing::least_load::LeastLoad;
use crate::routing::shared_header::SharedHeaders;
use crate::store::RoutingStore;
use crate::store::local::LocalState;
use crate::store::shm::ShmStore;
use crate::tenancy::auth::Keys;

pub use crate::routing::swappable::SwappablePolicy;

/// Who this dispatcher is in the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Its registry slot (also its row in the in-flight ledger).
    pub slot: u16,
    /// Its registry incarnation.
    pub incarnation: u32,
    /// The completion ring it pushes into.
    pub ring: usize,
}

/// This dispatcher's counters, read from its block of the segment's stats
/// region (the one source of truth; [`crate::metrics`] renders them for all
/// processes). A restarted dispatcher continues its slot's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsSnapshot {
    /// HTTP requests answered (every route).
    pub requests: u64,
    /// Inference requests answered from the response cache.
    pub cache_hits: u64,
    /// Inference requests the cache could have answered but did not (or that refresh it).
    pub cache_misses: u64,
    /// Inference requests the cache was not involved in.
    pub cache_bypasses: u64,
    /// Upstream attempts after the first one of a request.
    pub retries: u64,
    /// Upstream failures: connection errors, 5xx heads, bodies cut or timed out.
    pub upstream_errors: u64,
    /// Requests resent on a new connection to the same server because the
    /// server had closed the pooled one (not failures).
    pub stale_connections: u64,
    /// Answers with a 4xx status.
    pub client_errors: u64,
    /// Answers with a 5xx status.
    pub server_errors: u64,
    /// Completion records pushed into the ring.
    pub records_pushed: u64,
    /// Completion records dropped (ring full, record too large, no ring).
    pub records_dropped: u64,
}

/// The pooled upstream HTTP client.
type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// Everything a dispatcher needs to serve requests; shared by its tasks.
/// Its parts are private to this file: the request's steps (the child
/// modules) reach them through the accessors below.
#[derive(Debug)]
pub struct Dispatcher {
    segment: Arc<Segment>,
    identity: Identity,
    config: Arc<ServeConfig>,
    /// The model pools (replaced whole by a reload, [`set_models`](Self::set_models)).
    pools: std::sync::RwLock<Arc<ModelPools>>,
    /// Loads the pools' tokenizers, each file once.
    loader: std::sync::Mutex<TokenizerLoader>,
    /// The keys it lets in (`None`: no authentication; [`crate::tenancy::auth`]).
    keys: std::sync::RwLock<Option<Arc<Keys>>>,
    /// How requests that are not inference choose a server.
    least_load: LeastLoad,
    /// The prefixes many different prompts diverge at, which the
    /// policies see as weak evidence ([`crate::routing::shared_header`]).
    shared_headers: SharedHeaders,
    store: Arc<dyn RoutingStore>,
    /// The most bytes of a cacheable event stream kept whole to learn from
    /// and cache: what one completion record and one cached response can
    /// hold (fixed by the segment's layout).
    cacheable_stream_bytes: usize,
    /// The most bytes a completion record carries (fixed by the segment's
    /// layout): what a relay keeps of an answer's text to learn from is
    /// bounded by it, so an engine's endless answer grows no dispatcher.
    max_record: usize,
    client: UpstreamClient,
    /// A client without a pool, for sending a request again after a pooled
    /// connection turned out closed: the pool may hold another connection
    /// the server is closing (hyper keeps the connection it opened while
    /// an idle one was checked out), and the request must not meet it.
    fresh_client: UpstreamClient,
    health: PassiveHealth,
    queue: queue::GatewayQueue,
    /// `[peering]` and its view of the peer gateways (replaced whole by a
    /// reload that changes them, [`set_peering`](Self::set_peering)).
    peering: std::sync::RwLock<Arc<Peering>>,
    /// Each tokenizer's segment counters last added to the metrics.
    segments_reported: std::sync::Mutex<std::collections::HashMap<u64, semlb_tokenizer::SegmentCacheStats>>,
    /// The implicit pool's last merged `/v1/models` (`models`).
    merged_models: models::MergedModels,
    /// The request bodies it holds at once.
    body_budget: http::BodyBudget,
    /// `metrics.token_file`'s token.
    metrics_token: std::sync::RwLock<Option<Arc<str>>>,
    /// The response-cache key secret of the first chain seed it saw (the
    /// seed is the segment's or the Redis namespace's, so it does not change).
    key_secret: std::sync::OnceLock<(u64, crate::response_cache::KeySecret)>,
}

impl Dispatcher {
    /// A dispatcher over an opened segment whose server table already holds
    /// the backends (the supervisor registers them), with `config`'s model
    /// pools, their tokenizers loaded by `loader`.
    pub fn new(
        segment: Arc<Segment>,
        identity: Identity,
        config: Arc<ServeConfig>,
        mut loader: TokenizerLoader,
    ) -> Result<Self, PoolError> {
        let pools = ModelPools::build(&config, &mut loader, None)?;
        let ttl_ms = config.response_cache.ttl_secs.saturating_mul(1000);
        let store = Arc::new(ShmStore::new(segment.clone(), identity.slot, ttl_ms));
        let (cacheable_stream_bytes, max_record) = {
            let tables = segment.tables();
            let record = if identity.ring < tables.ring_count() {
                tables.ring(identity.ring).max_record()
            } else {
                0
            };
            (
                record.min(tables.responses.max_value()).max(relay::RAW_STREAM_BYTES),
                record,
            )
        };
        let mut connector = HttpConnector::new();
        // Without it, small SSE writes wait for delayed ACKs (~40 ms each).
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.limits.connect_timeout()));
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_timer(TokioTimer::new())
            .build(connector.clone());
        // Keeps no connection: a request it sends always goes out on a new
        // one (see `fresh_client`).
        let fresh_client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        let dispatcher = Self {
            // Before `config` moves into the struct.
            health: PassiveHealth::new(&config.health),
            body_budget: http::BodyBudget::new(config.limits.max_inflight_body_bytes.bytes()),
            queue: queue::GatewayQueue::new(config.policy.queue, config.dispatchers),
            segment,
            identity,
            config,
            pools: std::sync::RwLock::new(Arc::new(pools)),
            loader: std::sync::Mutex::new(loader),
            keys: std::sync::RwLock::new(None),
            least_load: LeastLoad::new(),
            shared_headers: SharedHeaders::new(),
            store,
            cacheable_stream_bytes,
            max_record,
            client,
            fresh_client,
            peering: std::sync::RwLock::new(Arc::new(Peering::default())),
            segments_reported: std::sync::Mutex::default(),
            merged_models: models::MergedModels::default(),
            metrics_token: std::sync::RwLock::new(None),
            key_secret: std::sync::OnceLock::new(),
        };
        // Requests a predecessor in this slot left queued when it was killed.
        dispatcher.metrics().settle_queue();
        let first = dispatcher.pools().pools()[0].clone();
        dispatcher.publish_tuned(first.policy().tuned_weight());
        Ok(dispatcher)
    }

    /// Publishes the value its policy tunes online in its registry slot
    /// (none clears it), for `/metrics` and `semlb status`.
    fn publish_tuned(&self, value: Option<f64>) {
        let id = self.identity;
        self.segment
            .tables()
            .registry
            .publish_tuned(id.slot, id.incarnation, value.unwrap_or(0.0));
    }

    /// A request `pool`'s policy routed with the tuner's `arm` saw its
    /// first token after `ttft_us`: the policy learns from it
    /// ([`crate::routing::Policy::observe`]), and the weight it tunes is
    /// published (the last pool's to learn: one value per dispatcher).
    pub(super) fn observe_route(&self, pool: &Pool, arm: u8, ttft_us: u32) {
        let tuned = pool.policy().observe(arm, ttft_us);
        self.publish_tuned(tuned);
    }

    /// Adds to the metrics what `tokenization`'s segment cache did since
    /// the last call.
    fn report_segments(&self, tokenization: &Tokenization) {
        let now = tokenization.tokenizer.segment_cache_stats();
        let mut reported = self.segments_reported.lock().unwrap_or_else(|e| e.into_inner());
        let last = reported.entry(tokenization.id).or_default();
        if now != *last {
            self.metrics().segments(last, &now);
            *last = now;
        }
    }

    /// The same dispatcher on another routing-state store (the default is
    /// the segment's tables).
    pub fn with_store(mut self, store: Arc<dyn RoutingStore>) -> Self {
        self.store = store;
        self
    }

    /// With `peering` ([`Peering::of`]): its peers to forward to, and the
    /// token peers must present to read its load.
    pub fn with_peering(self, peering: Peering) -> Self {
        *self.peering.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(peering);
        self
    }

    /// Runs `peering` from now on, unless it is the same as what runs (the
    /// same settings, peers and tokens: then what the book knows is kept);
    /// whether it changed. The new peers are polled at once; requests
    /// forwarded already end in the book they were chosen from. Call it
    /// inside the dispatcher's runtime.
    pub fn set_peering(self: &Arc<Self>, peering: Peering) -> bool {
        if self.peering().same_as(&peering) {
            return false;
        }
        let peering = Arc::new(peering);
        *self.peering.write().unwrap_or_else(|e| e.into_inner()) = peering.clone();
        peer_forward::start_polls(self, &peering);
        true
    }

    /// The response-cache key secret of chain seed `seed`: expanded once.
    fn key_secret(&self, seed: u64) -> std::borrow::Cow<'_, crate::response_cache::KeySecret> {
        use crate::response_cache::KeySecret;
        match self.key_secret.get_or_init(|| (seed, KeySecret::new(seed))) {
            (cached, secret) if *cached == seed => std::borrow::Cow::Borrowed(secret),
            _ => std::borrow::Cow::Owned(KeySecret::new(seed)),
        }
    }

    /// The implicit pool's last merged `/v1/models`.
    fn merged_models(&self) -> &models::MergedModels {
        &self.merged_models
    }

    /// `[peering]` as it runs, with the peer book.
    pub fn peering(&self) -> Arc<Peering> {
        self.peering.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its view of the peer gateways, with peers.
    pub fn peers(&self) -> Option<Arc<PeerBook>> {
        self.peering.read().unwrap_or_else(|e| e.into_inner()).book.clone()
    }

    /// Its routing-state store.
    pub fn store(&self) -> &dyn RoutingStore {
        &*self.store
    }

    /// Its counters (from its block of the stats region).
    pub fn stats(&self) -> StatsSnapshot {
        use crate::metrics::CacheResult;
        let m = self.metrics();
        StatsSnapshot {
            requests: m.requests(None),
            cache_hits: m.cache_count(CacheResult::Hit),
            cache_misses: m.cache_count(CacheResult::Miss),
            cache_bypasses: m.cache_count(CacheResult::Bypass),
            retries: m.retries(),
            upstream_errors: m.upstream_errors(),
            stale_connections: m.stale_connections(),
            client_errors: m.requests(Some(4)),
            server_errors: m.requests(Some(5)),
            records_pushed: m.records(true),
            records_dropped: m.records(false),
        }
    }

    /// Where it records its metrics: its registry slot's stats block.
    pub fn metrics(&self) -> Metrics<'_> {
        Metrics::new(self.segment.tables().stats, self.identity.slot)
    }

    /// Who it is in the segment.
    pub fn identity(&self) -> Identity {
        self.identity
    }

    /// Lets in only the keys of `keys` from now on (`None`: every
    /// request; at start and on reload).
    pub fn set_keys(&self, keys: Option<Keys>) {
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = keys.map(Arc::new);
    }

    /// The bearer token a scrape of `/metrics` must present from now on
    /// (`metrics.token_file`; `None`: none set).
    pub fn set_metrics_token(&self, token: Option<String>) {
        *self.metrics_token.write().unwrap_or_else(|e| e.into_inner()) = token.map(Arc::from);
    }

    /// The bearer token a scrape of `/metrics` must present, if any.
    fn metrics_token(&self) -> Option<Arc<str>> {
        self.metrics_token.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The keys it lets in now (`None`: no authentication).
    fn keys(&self) -> Option<Arc<Keys>> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its model pools now.
    pub fn pools(&self) -> Arc<ModelPools> {
        self.pools.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Serves the next requests with the model pools and routing policies
    /// `config` describes (a configuration reload; validate `config`
    /// first). Requests already routed finish as they were. A pool whose
    /// policy configuration is unchanged keeps its policy, with what it
    /// learned (the `cost` policy's tuned weight); tokenizers already
    /// loaded are not loaded again. The rest of the configuration (limits,
    /// response cache) stays as the dispatcher started with. Loading a new
    /// tokenizer takes time: call it off the reactor. On an error (a
    /// tokenizer that does not load) the running pools stay.
    pub fn set_models(&self, config: &ServeConfig) -> Result<(), PoolError> {
        let rebuilt = {
            let mut loader = self.loader.lock().unwrap_or_else(|e| e.into_inner());
            self.pools().rebuild(config, &mut loader)?
        };
        let first = rebuilt.pools()[0].clone();
        *self.pools.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(rebuilt);
        self.queue.set_params(config.policy.queue);
        self.publish_tuned(first.policy().tuned_weight());
        Ok(())
    }

    /// Requests waiting in this dispatcher's gateway queue.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// A request's body, read within the limits: at most
    /// `limits.max_body_bytes` (413) within `limits.client_timeout_secs`
    /// (408); the error answer otherwise ([`http::read_body`]).
    async fn read_body(
        &self,
        headers: &::http::HeaderMap,
        body: hyper::body::Incoming,
    ) -> Result<(Bytes, http::BodyPermit), ::http::Response<http::Body>> {
        let max = usize::try_from(self.config.limits.max_body_bytes.0).unwrap_or(usize::MAX);
        http::read_body(
            headers,
            body,
            max,
            self.config.limits.client_timeout(),
            &self.body_budget,
        )
        .await
    }

    // The parts the request's steps use.

    fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    fn config(&self) -> &ServeConfig {
        &self.config
    }

    fn least_load(&self) -> &LeastLoad {
        &self.least_load
    }

    fn shared_headers(&self) -> &SharedHeaders {
        &self.shared_headers
    }

    /// The host's candidates and this dispatcher's ledger row (its
    /// store's).
    fn local(&self) -> &LocalState {
        self.store.local()
    }

    /// The request bodies it holds at once.
    fn body_budget(&self) -> &http::BodyBudget {
        &self.body_budget
    }

    fn cacheable_stream_bytes(&self) -> usize {
        self.cacheable_stream_bytes
    }

    fn max_record(&self) -> usize {
        self.max_record
    }

    fn fresh_client(&self) -> &UpstreamClient {
        &self.fresh_client
    }

    fn client(&self) -> &UpstreamClient {
        &self.client
    }

    fn passive_health(&self) -> &PassiveHealth {
        &self.health
    }

    fn queue(&self) -> &queue::GatewayQueue {
        &self.queue
    }

    /// `server`'s registration, if it is still current (`None` once it was
    /// removed or its slot re-registered).
    fn registration(&self, server: shm_layout::ServerRef) -> Option<shm_layout::ServerInfo> {
        self.segment
            .tables()
            .servers
            .get(server.slot)
            .filter(|i| i.server == server)
    }

    /// Whether `server`'s engine takes vLLM's `cache_salt` (`[[backend]]
    /// cache_salt`, the admin API's, discovery's: its registration says).
    fn takes_cache_salt(&self, server: shm_layout::ServerRef) -> bool {
        self.segment.tables().servers.takes_cache_salt(server)
    }

    /// A request started or ended, or got its first token: a server may
    /// have room now, so the gateway queue looks again.
    fn wake_queue(&self) {
        self.queue.wake();
    }
}

/// How long a draining dispatcher keeps an idle keep-alive connection open
/// for the client's next request, which it answers with `connection:
/// close` (at most the drain timeout).
const DRAIN_LINGER: Duration = Duration::from_secs(1);

/// Serves HTTP on `listener` until `shutdown` resolves, then stops
/// accepting and lets in-flight requests finish (bounded by the
/// configuration's drain timeout).
pub async fn serve(
    listener: TcpListener,
    dispatcher: Arc<Dispatcher>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    // `[tls]`: every connection is a TLS one (checked when the
    // configuration was read; a file changed since fails the start).
    let tls = match &dispatcher.config.tls {
        Some(tls) => Some(crate::tls::acceptor(tls).map_err(std::io::Error::other)?),
        None => None,
    };
    peer_forward::start_polls(&dispatcher, &dispatcher.peering());
    let per_ip = client_io::PerIp::new(dispatcher.config.limits.max_connections_per_ip);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let per_ip = per_ip.admit(peer.ip());
                    if connections.len() >= dispatcher.config.limits.max_connections as usize || per_ip.is_none() {
                        // Over TLS nothing can be said before a handshake: closed.
                        if tls.is_none() {
                            tokio::spawn(refuse_connection(stream));
                        }
                        continue;
                    }
                    let (tls, dispatcher, stop) = (tls.clone(), dispatcher.clone(), stop_rx.clone());
                    connections.spawn(async move {
                        let _counted = per_ip;
                        accept_connection(stream, tls, dispatcher, stop).await;
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: pause, do not stop.
                    tracing::error!(error = %e, "accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    drop(listener);
    stop_tx.send_replace(true);
    let drained = tokio::time::timeout(dispatcher.config.drain_timeout(), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        connections.shutdown().await;
    }
    Ok(())
}

/// Answers a connection over `limits.max_connections` with a 503 (an
/// OpenAI-style error, `Retry-After: 1`) without reading its request, and
/// closes it; a client that does not take the answer within a second is
/// dropped.
async fn refuse_connection(mut stream: TcpStream) {
    use tokio::io::AsyncWriteExt;
    const BODY: &str = r#"{"error":{"message":"this gateway process serves as many connections as it may (limits.max_connections); retry later","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        // Closing with the request unread would reset the connection, and
        // the client might never see the answer: read it away first.
        let mut sink = [0u8; 4096];
        while tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Sets up an accepted connection (its socket options, its TLS handshake
/// within the client timeout when `tls`) and serves it.
async fn accept_connection(
    stream: TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
    dispatcher: Arc<Dispatcher>,
    stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    // A peer that vanished (power, network) without closing is found out.
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
    let Some(acceptor) = tls else {
        return serve_connection(stream, dispatcher, stop).await;
    };
    let client_timeout = dispatcher.config().limits.client_timeout();
    match tokio::time::timeout(client_timeout, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => serve_connection(stream, dispatcher, stop).await,
        Ok(Err(e)) => tracing::debug!(error = %e, "a TLS handshake failed: {e}"),
        Err(_) => tracing::debug!("a TLS handshake took longer than the client timeout"),
    }
}

/// Serves one connection until it closes, or until `stop` is set and its
/// in-flight request is answered.
async fn serve_connection<S>(stream: S, dispatcher: Arc<Dispatcher>, mut stop: watch::Receiver<bool>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let client_timeout = dispatcher.config().limits.client_timeout();
    let linger = DRAIN_LINGER.min(dispatcher.config().drain_timeout());
    // Set once draining: every answer from then on says `connection: close`.
    let closing = Arc::new(AtomicBool::new(false));
    let closing_service = closing.clone();
    let service = service_fn(move |request| {
        let dispatcher = dispatcher.clone();
        let closing = closing_service.clone();
        async move {
            let mut response = endpoints::handle(dispatcher, request).await;
            if closing.load(Ordering::Relaxed) {
                response.headers_mut().insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
            }
            Ok::<_, Infallible>(response)
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(client_timeout);
    let stream = client_io::StallLimited::new(stream, client_timeout);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = stop.wait_for(|stop| *stop) => {}
    }
    // Draining. Closing an idle keep-alive connection at once would race a
    // client sending its next request on it (an agent does so the instant
    // an answer ends) and fail that request; instead the next answer says
    // `connection: close` and the client reconnects (during an upgrade, to
    // the new dispatchers on the same socket). A connection still open
    // after the linger is closed once its request in flight, if any, is
    // answered.
    closing.store(true, Ordering::Relaxed);
    if tokio::time::timeout(linger, connection.as_mut()).await.is_ok() {
        return;
    }
    connection.as_mut().graceful_shutdown();
    let _ = connection.await;
}
