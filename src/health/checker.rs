//! The supervisor's health task: active checks and load scraping of every
//! server in the shm server table (see the [parent module](super) for the
//! rules).
//!
//! [`spawn`] starts one tokio task running two loops side by side, so a
//! slow scrape never delays a check or the reverse:
//!
//! * **checks**, every `health.interval_ms`: the servers are read from the
//!   server table (so servers added or removed by a reload are followed
//!   without a restart), each one not draining whose [`Breaker`] admits a
//!   probe gets `GET <address><health.path>` concurrently, each bounded by
//!   `health.timeout_ms`; the breakers' transitions are written with
//!   [`ServerTable::transition`] (from the state the breaker knew to the new
//!   one, so a state someone else set meanwhile — an operator's drain — is
//!   never overwritten). Before probing, each breaker is brought in line
//!   with the table: a server a dispatcher ejected (passive check) opens
//!   it, one set back `Up` by someone else closes it, a draining one resets
//!   it.
//! * **scrapes**, every `health.scrape_interval_ms`: `GET <address>/metrics`
//!   of every server not down, parsed for the `metrics_flavor` its registration carries
//!   ([`super::prometheus::extract`]) and stored with the segment clock's
//!   time ([`ServerTable::store_load`]).
//!
//! * **engine info**, with the scrapes: `GET <address>/props` (and
//!   `/v1/models` when that gave no context) once per registration, again
//!   after the server was down or its engine restarted, until it answers.
//!   llama.cpp's `/props` says how many requests its engine runs at once
//!   and each slot's context, vLLM's `/v1/models` the context
//!   ([`super::engine_info`]), stored with
//!   [`ServerTable::set_engine_slots`] and
//!   [`ServerTable::set_engine_context`]; an answer that does not say
//!   stores none.
//!
//! Transitions are logged (`tracing` events), as are a server's scrapes starting or
//! stopping to fail (once each, not every interval).
//!
//! A server that comes back `Up` after being `Down` has most likely
//! restarted, and an engine that restarts starts with an empty prefix
//! cache: the checker forgets it in every entry of the segment's prefix
//! table at once ([`shm_layout::PrefixTable::remove_server`]) instead of
//! letting requests go there on the strength of entries it no longer
//! backs. So does a scrape whose prompt-token counter went back: the engine
//! restarted between two scrapes, perhaps too quickly for a health check
//! to see it down. (With `--store redis` the entries are in Redis; there
//! the response processes forget a server once its engine reports the
//! loss.)

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use shm_layout::{Segment, ServerInfo, ServerRef, ServerState, ServerTable};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::breaker::{Breaker, Health, Thresholds};
use super::engine_info::{self, EngineInfo};
use super::prometheus::{Engine, ExtractError, extract};
use crate::config::{HealthConfig, MetricsFlavor, ServeConfig};

/// Why a health check or a scrape of one server failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The server's URL does not make a request.
    #[error("bad URL {url}: {detail}")]
    BadUrl {
        /// The URL.
        url: String,
        /// Why.
        detail: String,
    },
    /// No connection, or it broke before an answer (the error and its causes).
    #[error("{0}")]
    Connect(String),
    /// The answer's body could not be read.
    #[error("reading the answer: {0}")]
    Body(String),
    /// No full answer within the timeout.
    #[error("no answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The server answered with a status that is not a success.
    #[error("{path} answered {status}")]
    Status {
        /// The path asked (`/health`, `/metrics`).
        path: String,
        /// Its status.
        status: StatusCode,
    },
    /// The `/metrics` text had no load figures of the expected flavour.
    #[error(transparent)]
    Metrics(#[from] ExtractError),
}

/// Largest health-check answer read (the status is what counts).
const MAX_CHECK_BYTES: usize = 64 << 10;
/// Largest `/metrics` answer read (vLLM's is a few hundred KiB with
/// several models' histograms).
const MAX_METRICS_BYTES: usize = 16 << 20;

/// Largest `/props` or `/v1/models` answer read (llama.cpp's `/props`
/// carries the chat template and the sampling defaults: tens of KiB).
const MAX_INFO_BYTES: usize = 1 << 20;

/// The pooled client of the checks and scrapes.
type HealthClient = Client<HttpConnector, Empty<Bytes>>;

/// Starts the health task on the current tokio runtime (the supervisor's):
/// active checks and scrapes of every server in `segment`'s server table,
/// with `config.health`'s settings and each registration's `metrics_flavor`, until
/// the handle is aborted or the runtime stops. The state it keeps besides
/// the table (breakers' counts) is rebuilt from the table, so a reload may
/// abort the task and spawn it again with a new configuration.
///
/// # Panics
///
/// Outside a tokio runtime (as [`tokio::spawn`]).
pub fn spawn(segment: Arc<Segment>, config: Arc<ServeConfig>) -> JoinHandle<()> {
    let checker = Arc::new(Checker::new(segment, &config));
    tokio::spawn(async move {
        tokio::join!(checker.clone().check_loop(), checker.scrape_loop());
    })
}

/// What both loops share.
#[derive(Debug)]
struct Checker {
    segment: Arc<Segment>,
    health: HealthConfig,
    client: HealthClient,
    /// Forget a restarted server's prefix entries (`learn_from_reports`).
    forgets: bool,
}

impl Checker {
    fn new(segment: Arc<Segment>, config: &ServeConfig) -> Self {
        let health = config.health.clone();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(health.timeout()));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(2)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Self {
            segment,
            health,
            client,
            forgets: config.learn_from_reports,
        }
    }

    /// Forgets `server` in every prefix entry (its engine restarted) when
    /// `learn_from_reports` is on; how many entries listed it.
    fn forget(&self, server: ServerRef) -> u64 {
        if self.forgets {
            self.segment.tables().prefix.remove_server(server.tag())
        } else {
            0
        }
    }

    fn thresholds(&self) -> Thresholds {
        Thresholds {
            unhealthy: self.health.unhealthy_threshold,
            healthy: self.health.healthy_threshold,
        }
    }

    fn servers(&self) -> ServerTable<'_> {
        self.segment.tables().servers
    }

    /// `GET url`, at most `limit` bytes of body, all within `timeout`.
    async fn get(&self, url: &str, limit: usize, timeout: Duration) -> Result<(StatusCode, Bytes), CheckError> {
        get(&self.client, url, limit, timeout).await
    }
}

/// `GET url` through `client`, at most `limit` bytes of body, all within
/// `timeout` (the checker's, and the KV event subscribers' look at an
/// engine's `/v1/models`).
pub(crate) async fn get(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: &str,
    limit: usize,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), CheckError> {
    let bad_url = |detail: String| CheckError::BadUrl {
        url: url.to_owned(),
        detail,
    };
    let uri: Uri = url.parse().map_err(|e: http::uri::InvalidUri| bad_url(e.to_string()))?;
    let request = Request::get(uri)
        .header(header::USER_AGENT, "semlb-health")
        .body(Empty::new())
        .map_err(|e| bad_url(e.to_string()))?;
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| CheckError::Connect(crate::error_chain(&e)))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), limit)
            .collect()
            .await
            .map_err(|e| CheckError::Body(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(CheckError::Timeout(timeout)),
    }
}

impl Checker {
    /// One active check of the server at `address`.
    async fn probe(&self, address: &str) -> Result<(), CheckError> {
        let url = format!("{address}{}", self.health.path);
        let (status, _) = self.get(&url, MAX_CHECK_BYTES, self.health.timeout()).await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(CheckError::Status {
                path: self.health.path.clone(),
                status,
            })
        }
    }

    /// Active checks, forever (see the module docs).
    async fn check_loop(self: Arc<Self>) {
        let thresholds = self.thresholds();
        let mut breakers: HashMap<u16, (ServerRef, Breaker)> = HashMap::new();
        let mut tick = tokio::time::interval(self.health.interval());
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let servers: Vec<ServerInfo> = self.servers().servers().collect();
            breakers.retain(|_, (server, _)| servers.iter().any(|s| s.server == *server));
            let mut due = Vec::new();
            for info in &servers {
                let (server, breaker) = breakers
                    .entry(info.server.slot)
                    .or_insert_with(|| (info.server, Breaker::new(thresholds)));
                if *server != info.server {
                    *server = info.server;
                    *breaker = Breaker::new(thresholds);
                }
                match info.state {
                    ServerState::Up => breaker.admit(),
                    ServerState::Down => breaker.eject(),
                    // Left to whoever drains it; checked afresh once it is back.
                    _ => {
                        *breaker = Breaker::new(thresholds);
                        continue;
                    }
                }
                if breaker.start_probe() {
                    due.push(info);
                }
            }
            let results = futures_util::future::join_all(due.iter().map(|info| self.probe(&info.address))).await;
            for (info, result) in due.into_iter().zip(results) {
                let Some((_, breaker)) = breakers
                    .get_mut(&info.server.slot)
                    .filter(|(server, _)| *server == info.server)
                else {
                    continue;
                };
                let Some(transition) = breaker.record(result.is_ok()) else {
                    continue;
                };
                let (from, to) = match transition.to {
                    Health::Down => (ServerState::Up, ServerState::Down),
                    Health::Up => (ServerState::Down, ServerState::Up),
                };
                // If the state changed meanwhile (a dispatcher ejected it, an
                // operator drains it), the next round re-syncs the breaker.
                if self.servers().transition(info.server, from, to) {
                    match result {
                        Err(e) => tracing::warn!(
                            backend = %info.address,
                            failures = transition.after,
                            error = %e,
                            "backend {} is down: {} health checks in a row failed (last: {e})",
                            info.address,
                            transition.after
                        ),
                        Ok(()) => {
                            let forgotten = self.forget(info.server);
                            tracing::info!(
                                backend = %info.address,
                                successes = transition.after,
                                forgotten,
                                "backend {} is up again: {} health checks in a row passed; its {forgotten} prefix entries are forgotten (a restarted engine's cache is empty)",
                                info.address,
                                transition.after
                            );
                        }
                    }
                }
            }
        }
    }

    /// One scrape of the server at `address`: its figures' source.
    async fn scrape(&self, address: &str, flavor: MetricsFlavor) -> Result<super::prometheus::EngineLoad, CheckError> {
        let url = format!("{address}/metrics");
        let timeout = self.health.timeout().min(self.health.scrape_interval());
        let (status, body) = self.get(&url, MAX_METRICS_BYTES, timeout).await?;
        if !status.is_success() {
            return Err(CheckError::Status {
                path: "/metrics".to_owned(),
                status,
            });
        }
        Ok(extract(&String::from_utf8_lossy(&body), flavor)?)
    }

    /// What the engine at `address` says about itself
    /// ([`super::engine_info`]): `/props`, then `/v1/models` for the
    /// context if `/props` did not give it. An error only if one of them
    /// got no answer (asked again next round); an answer that says nothing
    /// is an empty [`EngineInfo`].
    async fn engine_info(&self, address: &str, wants_port: bool) -> Result<EngineInfo, CheckError> {
        let timeout = self.health.timeout();
        let (status, body) = self.get(&format!("{address}/props"), MAX_INFO_BYTES, timeout).await?;
        let mut info = if status.is_success() {
            engine_info::from_props(&body)
        } else {
            EngineInfo::default()
        };
        if info.context.is_none() {
            let (status, body) = self
                .get(&format!("{address}/v1/models"), MAX_INFO_BYTES, timeout)
                .await?;
            if status.is_success() {
                info.context = engine_info::context_from_models(&body);
            }
        }
        if wants_port {
            let (status, body) = self
                .get(&format!("{address}/server_info"), MAX_INFO_BYTES, timeout)
                .await?;
            if status.is_success() {
                info.bootstrap_port = engine_info::bootstrap_port_from_server_info(&body);
            }
        }
        Ok(info)
    }

    /// Load scraping, forever (see the module docs).
    async fn scrape_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.health.scrape_interval());
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut failing: HashSet<ServerRef> = HashSet::new();
        let mut engines: HashMap<ServerRef, Engine> = HashMap::new();
        let mut prompt_tokens: HashMap<ServerRef, f64> = HashMap::new();
        // The servers whose engines answered about themselves (saying or not).
        let mut asked: HashSet<ServerRef> = HashSet::new();
        loop {
            tick.tick().await;
            let servers: Vec<ServerInfo> = self
                .servers()
                .servers()
                .filter(|s| s.state != ServerState::Down)
                .collect();
            failing.retain(|f| servers.iter().any(|s| s.server == *f));
            engines.retain(|f, _| servers.iter().any(|s| s.server == *f));
            prompt_tokens.retain(|f, _| servers.iter().any(|s| s.server == *f));
            asked.retain(|f| servers.iter().any(|s| s.server == *f));
            let to_ask: Vec<&ServerInfo> = servers.iter().filter(|s| !asked.contains(&s.server)).collect();
            let (results, answers) = tokio::join!(
                futures_util::future::join_all(servers.iter().map(|info| {
                    let flavor = MetricsFlavor::of_code(self.servers().settings(info.server).metrics);
                    self.scrape(&info.address, flavor)
                })),
                futures_util::future::join_all(to_ask.iter().map(|info| {
                    // A prefill engine whose bootstrap port nobody gave.
                    let d = info.disaggregation;
                    let wants_port = d.role == shm_layout::ServerRole::Prefill && d.bootstrap_port.is_none();
                    self.engine_info(&info.address, wants_port)
                })),
            );
            for (info, answer) in to_ask.into_iter().zip(answers) {
                // No answer (refused, timed out): asked again next round.
                let Ok(said) = answer else { continue };
                asked.insert(info.server);
                let servers = self.servers();
                if servers.set_engine_slots(info.server, said.slots)
                    && let Some(slots) = said.slots
                {
                    tracing::info!(
                        backend = %info.address,
                        slots,
                        "backend {}: its engine runs at most {slots} requests at once (/props total_slots); holding policies count what is sent beyond them as queued",
                        info.address
                    );
                }
                if let Some(port) = said.bootstrap_port
                    && servers.set_disaggregation(
                        info.server,
                        shm_layout::Disaggregation {
                            bootstrap_port: Some(port),
                            ..info.disaggregation
                        },
                    )
                {
                    tracing::info!(
                        backend = %info.address,
                        port,
                        "backend {}: its bootstrap server listens on port {port} (/server_info)",
                        info.address
                    );
                }
                if servers.set_engine_context(info.server, said.context)
                    && let Some(context) = said.context
                {
                    let (tokens, what) = if context.counts_output {
                        (context.tokens, "prompt and requested output")
                    } else {
                        (context.tokens, "prompt")
                    };
                    tracing::info!(
                        backend = %info.address,
                        context = tokens,
                        "backend {}: its engine's context is {tokens} tokens of {what}; requests no live engine can take get a 400 at the gateway",
                        info.address
                    );
                }
            }
            for (info, result) in servers.iter().zip(results) {
                match result {
                    Ok(load) => {
                        let now_ms = self.segment.clock().now_ms();
                        let pending = self.servers().pending(info.server).0;
                        self.servers().store_load(info.server, load.figures(now_ms, pending));
                        if let Some(now) = load.prompt_tokens
                            && let Some(before) = prompt_tokens.insert(info.server, now)
                            && now < before
                        {
                            let forgotten = self.forget(info.server);
                            // A restarted engine may have other slots.
                            asked.remove(&info.server);
                            tracing::warn!(
                                backend = %info.address,
                                forgotten,
                                "backend {}: its prompt-token counter went back from {before} to {now}: it restarted, so its {forgotten} prefix entries are forgotten (a restarted engine's cache is empty)",
                                info.address
                            );
                        }
                        if failing.remove(&info.server) {
                            tracing::info!(backend = %info.address, "backend {}: reading its /metrics again", info.address);
                        }
                        if engines.insert(info.server, load.engine) != Some(load.engine) {
                            tracing::info!(
                                backend = %info.address,
                                engine = load.engine.name(),
                                "backend {}: load from its {} metrics",
                                info.address,
                                load.engine.name()
                            );
                        }
                    }
                    Err(e) => {
                        if failing.insert(info.server) {
                            tracing::warn!(
                                backend = %info.address,
                                error = %e,
                                "backend {}: cannot read its load from /metrics ({e}); routing ignores its figures once older than {} ms",
                                info.address, self.health.stale_after_ms
                            );
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use shm_layout::LayoutPlan;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::watch;

    /// A tiny HTTP server: `/health` answers `health` (a status code, 0 =
    /// close without answering), `/metrics` answers `metrics`.
    async fn server(health: watch::Receiver<u16>, metrics: &'static str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let health = *health.borrow();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    let (status, body) = if got.starts_with(b"GET /metrics") {
                        (200, metrics)
                    } else {
                        (health, "")
                    };
                    if status == 0 {
                        return;
                    }
                    let answer = format!(
                        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(answer.as_bytes()).await;
                });
            }
        });
        format!("http://{addr}")
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn checks_eject_and_readmit_and_scrapes_store_load() {
        let (health, health_rx) = watch::channel(200u16);
        let address = server(
            health_rx,
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 2\n\
             vllm:num_requests_running{model_name=\"m\"} 5\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n",
        )
        .await;
        let segment = Arc::new(Segment::heap(&LayoutPlan::for_size(16 << 20).unwrap()));
        let servers = segment.tables().servers;
        let a = servers.register(0, &address, 0).unwrap();
        let drained = servers.register(1, "http://127.0.0.1:9", 0).unwrap();
        servers.set_state(drained, ServerState::Draining);
        let mut config = ServeConfig::default();
        config.backends.push(crate::config::BackendConfig::new(address.clone()));
        config.health.interval_ms = 20;
        config.health.timeout_ms = 20;
        config.health.scrape_interval_ms = 20;
        config.health.unhealthy_threshold = 2;
        config.health.healthy_threshold = 2;
        let task = spawn(segment.clone(), Arc::new(config));
        let state = |s: ServerRef| servers.current(s.slot).map(|(_, st)| st);

        until("load scraped", || servers.load(a).scraped_at_ms > 0).await;
        let f = servers.load(a);
        assert_eq!((f.waiting, f.running, f.kv_usage_permyriad), (2, 5, 5000));

        health.send_replace(503);
        until("ejected", || state(a) == Some(ServerState::Down)).await;
        health.send_replace(0);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(state(a), Some(ServerState::Down));
        health.send_replace(200);
        until("re-admitted", || state(a) == Some(ServerState::Up)).await;

        // A passive ejection is held until the checks pass again.
        assert!(crate::health::eject(&servers, a));
        until("re-admitted after a passive ejection", || {
            state(a) == Some(ServerState::Up)
        })
        .await;

        // A draining server is never touched (its address does not answer).
        assert_eq!(state(drained), Some(ServerState::Draining));
        assert_eq!(servers.load(drained).scraped_at_ms, 0);
        task.abort();
    }
}
