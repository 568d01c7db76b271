//! `semlb bench e2e`: the whole gateway under load, shared memory against
//! Redis.
//!
//! # Set-up
//!
//! For each store (`shm`, then `redis` unless `--no-redis`), the report
//! starts `--engines` fresh simulated engines (`semlb __sim`, one process
//! each, `--time-scale` fast so that the gateway rather than the simulated
//! GPUs is what is measured) and a fresh gateway (`semlb serve` with
//! `--dispatchers` dispatcher processes and one response process, a unique
//! shm segment name, and for Redis `--store redis --redis-url …
//! --redis-namespace <unique>`). Every process is the `semlb` binary next to this one;
//! each is synchronised on the address line it prints and on `GET /health`,
//! and stopped with SIGTERM when the report ends, also on error.
//!
//! # Workload
//!
//! Multi-turn chats from `<data>/prompts/hh-rlhf-helpful-base-test.jsonl`
//! (a synthetic set when absent), sent turn by turn: a conversation's next
//! turn (the whole history so far, with the dataset's own assistant answers)
//! is only sent once its previous turn has completed, so prefixes repeat as
//! they do in a chat service. Every request is a streaming
//! `/v1/chat/completions` with `temperature` 0 (the response cache is looked
//! up; streams are never stored, so it misses), `ignore_eos` and
//! `--max-tokens` output tokens.
//!
//! # Phases
//!
//! 1. **Fixed rate**: an open-loop generator sends requests at scheduled
//!    arrival times (`--arrivals poisson` or `fixed`, `--rate` per second,
//!    for `--secs`), independent of completions; times are measured from a
//!    request's *scheduled* arrival, so client-side lag and queueing count
//!    (no coordinated omission).
//! 2. **Saturation**: `--concurrency` closed-loop clients, each sending its
//!    next request when the previous one ends, for `--saturation-secs`; the
//!    achieved request rate is the gateway's capacity on this machine.
//!
//! Per store and phase: completed requests per second; TTFT (time to the
//! first SSE `data:` event, which the simulator sends with the first token)
//! and end-to-end latency (to `data: [DONE]`) at p50/p90/p99; the dispatch
//! time the dispatchers report in `x-semlb-dispatch-ns` (total, and the
//! store-dependent part: response-cache lookup + prefix match and policy);
//! errors (non-200, transport errors, streams without `[DONE]`,
//! timeouts); and the ratios redis/shm.
//!
//! Defaults: 4 engines at time scale 0.01, 32 output tokens, 300 req/s for
//! 20 s, then 64 clients for 10 s. On the 2-core machine (load generator,
//! gateway, engines and Redis sharing it) both stores saturate at roughly
//! 750–1 100 req/s, so 300 req/s is a rate both sustain with room, and
//! Redis's tail starts to grow from about 450 req/s.
//!
//! Output: a table on stdout, `<out>/e2e.json`, `<out>/e2e.svg` (CDFs of
//! TTFT, latency and dispatch time in the fixed-rate phase, shm vs redis).
//!
//! The processes are `semlb-test-support`'s ([`Proc`], and the gateway by
//! [`start_gateway`]); they and the HTTP helpers here ([`LoadClient`],
//! [`SseScan`], ...) are shared with [`super::replay`].

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use semlb::routing::PolicyKind;
use serde_json::{Value, json};

use super::Common;
use super::output::{self, Table};
use super::plot::{self, Panel, Series};
use super::redis_server::BenchRedis;
use semlb_test_support::Rng;
use semlb_test_support::gateway::Gateway;
pub(super) use semlb_test_support::process::Proc;
use semlb_test_support::process::{ProcBuilder, Stderr};

/// `semlb bench e2e` flags.
#[derive(Debug, Clone, Args)]
pub struct EndToEndArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// Simulated engines behind the gateway.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub engines: usize,
    /// Dispatcher processes of the gateway.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dispatchers: usize,
    /// Offered load of the fixed-rate phase, requests per second.
    #[arg(long, value_name = "REQ_PER_S", default_value_t = 300.0)]
    pub rate: f64,
    /// Length of the fixed-rate phase, seconds.
    #[arg(long, value_name = "S", default_value_t = 20.0)]
    pub secs: f64,
    /// Arrival process of the fixed-rate phase.
    #[arg(long, value_enum, default_value_t = Arrivals::Poisson)]
    pub arrivals: Arrivals,
    /// Closed-loop clients of the saturation phase (0 skips it).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub concurrency: usize,
    /// Length of the saturation phase, seconds.
    #[arg(long, value_name = "S", default_value_t = 10.0)]
    pub saturation_secs: f64,
    /// Output tokens per request (`max_tokens` with `ignore_eos`).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub max_tokens: u32,
    /// `--time-scale` of the simulated engines (real seconds per simulated
    /// second; 0.01 = 100x faster than an A100).
    #[arg(long, value_name = "F", default_value_t = 0.01)]
    pub time_scale: f64,
    /// Seed of the arrival times.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
}

/// How the open-loop generator spaces arrivals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Arrivals {
    /// Exponential inter-arrival times (a Poisson process).
    Poisson,
    /// Exactly 1/rate apart.
    Fixed,
}

impl EndToEndArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            engines: 4,
            dispatchers: 2,
            rate: 300.0,
            secs: 20.0,
            arrivals: Arrivals::Poisson,
            concurrency: 64,
            saturation_secs: 10.0,
            max_tokens: 32,
            time_scale: 0.01,
            seed: 1,
        }
    }
}

// ---------------------------------------------------------------------------
// Processes (shared with the replay report).

/// A unique name for this run's resources (shm segment, Redis namespace).
pub(super) fn unique_name(tag: &str) -> String {
    semlb_test_support::process::unique("bench", tag)
}

/// `n` simulated engines (`semlb __sim`) with `time_scale`.
pub(super) fn start_engines(n: usize, time_scale: f64) -> Result<Vec<Proc>> {
    (0..n)
        .map(|i| {
            let scale = time_scale.to_string();
            let proc = ProcBuilder::new(["__sim", "--listen", "127.0.0.1:0", "--time-scale", &scale])
                .what(format!("simulated engine {i}"))
                .stderr(Stderr::Tail(40))
                .within(Duration::from_secs(30))
                .try_start()?;
            Ok(proc)
        })
        .collect()
}

/// Where the gateway keeps its routing state.
#[derive(Debug, Clone)]
pub(super) enum Store {
    /// The shared-memory segment.
    Shm,
    /// A Redis server, under a namespace.
    Redis {
        /// `redis://…` URL.
        url: String,
        /// Key prefix.
        namespace: String,
    },
}

/// What [`start_gateway`] runs.
#[derive(Debug, Clone)]
pub(super) struct GatewaySpec {
    /// Dispatcher processes.
    pub(super) dispatchers: usize,
    /// Routing policy (`None`: the default).
    pub(super) policy: Option<PolicyKind>,
    /// Routing-state store.
    pub(super) store: Store,
    /// `--shm-size`.
    pub(super) shm_size: String,
    /// A tag for the shm name.
    pub(super) tag: String,
    /// A configuration file's TOML text, passed as `--config` (written to a
    /// file of the run's own, removed with the gateway); `None`: no file.
    pub(super) config: Option<String>,
}

/// Why [`start_gateway`] failed.
#[derive(Debug)]
pub(super) enum GatewayError {
    /// `semlb serve` does not know a flag (e.g. `--store` in an older build).
    UnknownFlag(String),
    /// Anything else.
    Other(anyhow::Error),
}

/// Starts the gateway (supervisor, dispatchers, one responder) in front of
/// `engines` and waits until `/health` answers 200; it is stopped with
/// SIGTERM and its segment and files removed when dropped.
pub(super) fn start_gateway(spec: &GatewaySpec, engines: &[Proc]) -> Result<Gateway, GatewayError> {
    let mut builder = Gateway::builder()
        .shm(&unique_name(&spec.tag))
        .tag(&spec.tag)
        .shm_size(&spec.shm_size)
        .dispatchers(spec.dispatchers)
        .backends(&engines.iter().collect::<Vec<_>>())
        .stderr(Stderr::Tail(40))
        .within(Duration::from_secs(60));
    if let Some(policy) = spec.policy {
        builder = builder.policy(&policy.to_string());
    }
    if let Some(text) = &spec.config {
        builder = builder.config(text);
    }
    if let Store::Redis { url, namespace } = &spec.store {
        builder = builder.redis(url, namespace);
    }
    builder.try_start().map_err(|e| match e {
        semlb_test_support::Error::NoAddress { stderr, .. } if stderr.contains("unexpected argument") => {
            GatewayError::UnknownFlag(stderr)
        }
        e => GatewayError::Other(e.into()),
    })
}

// ---------------------------------------------------------------------------
// HTTP load client (shared with the replay report).

/// A keep-alive HTTP/1.1 client on its own tokio runtime.
pub(super) struct LoadClient {
    /// The runtime requests run on.
    pub(super) runtime: tokio::runtime::Runtime,
    /// The pooled client.
    pub(super) http: Client<HttpConnector, Full<Bytes>>,
}

/// How long one request may take before it counts as an error.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

impl LoadClient {
    /// A client on a two-thread runtime.
    pub(super) fn new() -> Result<LoadClient> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let http = {
            let _guard = runtime.enter();
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector)
        };
        Ok(LoadClient { runtime, http })
    }

    /// `GET http://addr{path}` (blocking): status and body text.
    pub(super) fn get(&self, addr: &str, path: &str) -> Result<(u16, String)> {
        let http = self.http.clone();
        let uri = format!("http://{addr}{path}");
        self.runtime.block_on(async move {
            let request = http::Request::get(uri).body(Full::new(Bytes::new()))?;
            let response = tokio::time::timeout(Duration::from_secs(5), http.request(request))
                .await
                .map_err(|_| anyhow!("timeout"))??;
            let status = response.status().as_u16();
            let body = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
                .await
                .map_err(|_| anyhow!("timeout"))??
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        })
    }
}

/// The result of one streamed request.
#[derive(Debug, Clone, Default)]
pub(super) struct Outcome {
    /// HTTP status (0: no answer).
    pub(super) status: u16,
    /// From the reference instant to the first SSE `data:` event.
    pub(super) ttft: Option<Duration>,
    /// From the reference instant to the end of the stream.
    pub(super) latency: Duration,
    /// The stream ended with `data: [DONE]`.
    pub(super) done: bool,
    /// `x-semlb-dispatch-ns`, parsed ([`DISPATCH_STAGES`] order).
    pub(super) dispatch: Option<[u64; 7]>,
    /// `x-semlb-backend`.
    pub(super) backend: Option<String>,
    /// What went wrong, if anything.
    pub(super) error: Option<String>,
}

impl Outcome {
    /// A 200 stream that reached `[DONE]`.
    pub(super) fn ok(&self) -> bool {
        self.status == 200 && self.done && self.error.is_none()
    }
}

/// Sends `body` (JSON) to `http://addr{path}` and reads the SSE stream to
/// its end; times are measured from `since` (the scheduled arrival).
pub(super) async fn stream_request(
    http: &Client<HttpConnector, Full<Bytes>>,
    addr: &str,
    path: &str,
    body: Bytes,
    since: Instant,
) -> Outcome {
    stream_request_with(http, addr, path, body, &[], since).await
}

/// [`stream_request`] with extra request `headers` (name, value).
pub(super) async fn stream_request_with(
    http: &Client<HttpConnector, Full<Bytes>>,
    addr: &str,
    path: &str,
    body: Bytes,
    headers: &[(&str, String)],
    since: Instant,
) -> Outcome {
    let mut outcome = Outcome::default();
    let run = async {
        let mut request =
            http::Request::post(format!("http://{addr}{path}")).header(http::header::CONTENT_TYPE, "application/json");
        for (name, value) in headers {
            request = request.header(*name, value.as_str());
        }
        let request = request.body(Full::new(body)).map_err(|e| e.to_string())?;
        let response = http.request(request).await.map_err(|e| format!("request: {e}"))?;
        outcome.status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        outcome.dispatch = header("x-semlb-dispatch-ns").and_then(|v| parse_dispatch(&v));
        outcome.backend = header("x-semlb-backend");
        let mut body = response.into_body();
        let mut scan = SseScan::default();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("body: {e}"))?;
            if let Some(data) = frame.data_ref()
                && scan.feed(data)
            {
                outcome.ttft = Some(since.elapsed());
            }
        }
        outcome.done = scan.done;
        Ok::<(), String>(())
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, run).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => outcome.error = Some(e),
        Err(_) => outcome.error = Some(format!("timeout after {REQUEST_TIMEOUT:?}")),
    }
    outcome.latency = since.elapsed();
    if outcome.error.is_none() && outcome.status != 200 {
        outcome.error = Some(format!("HTTP {}", outcome.status));
    } else if outcome.error.is_none() && !outcome.done {
        outcome.error = Some("stream ended without [DONE]".into());
    }
    outcome
}

/// Incremental scanner of a server-sent-event stream: counts `data:`
/// events and notices `data: [DONE]`.
#[derive(Debug, Default)]
pub(super) struct SseScan {
    pending: Vec<u8>,
    /// `data:` events other than `[DONE]` seen so far.
    pub(super) data_events: u32,
    /// `data: [DONE]` was seen.
    pub(super) done: bool,
}

impl SseScan {
    /// Feeds the next bytes of the stream; true when they complete the
    /// first `data:` event that is not `[DONE]` (the time to first token).
    pub(super) fn feed(&mut self, bytes: &[u8]) -> bool {
        let before = self.data_events;
        let searched_from = self.pending.len().saturating_sub(1);
        self.pending.extend(bytes.iter().copied().filter(|b| *b != b'\r'));
        let mut start = 0;
        let mut from = searched_from;
        while let Some(pos) = self.pending[from..].windows(2).position(|w| w == b"\n\n") {
            let end = from + pos;
            for line in self.pending[start..end].split(|b| *b == b'\n') {
                if let Some(data) = line.strip_prefix(b"data:") {
                    if data.trim_ascii() == b"[DONE]" {
                        self.done = true;
                    } else {
                        self.data_events += 1;
                    }
                }
            }
            start = end + 2;
            from = start;
        }
        self.pending.drain(..start);
        before == 0 && self.data_events > 0
    }
}

/// The stages of `x-semlb-dispatch-ns`, in order.
pub(super) const DISPATCH_STAGES: [&str; 7] = ["read", "parse", "tokenize", "hash", "cache", "route", "total"];

/// Parses `read=…,parse=…,tokenize=…,hash=…,cache=…,route=…,total=…`
/// (nanoseconds); `None` unless every stage is there.
pub(super) fn parse_dispatch(value: &str) -> Option<[u64; 7]> {
    let mut out = [None; 7];
    for part in value.split(',') {
        let (k, v) = part.trim().split_once('=')?;
        let i = DISPATCH_STAGES.iter().position(|s| *s == k)?;
        out[i] = Some(v.parse().ok()?);
    }
    let mut values = [0; 7];
    for (dst, src) in values.iter_mut().zip(out) {
        *dst = src?;
    }
    Some(values)
}

/// Values at p50, p90, p99 of `values` (in their unit).
pub(super) fn p50_90_99(values: &[f64]) -> [f64; 3] {
    let mut v = values.to_vec();
    output::sort(&mut v);
    [0.5, 0.9, 0.99].map(|q| output::quantile(&v, q))
}

/// `ms` milliseconds as table text.
pub(super) fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

// ---------------------------------------------------------------------------
// The workload.

/// A dialogue's user turns and the dataset's answers to them (shared with
/// the replay's `hh-rlhf` workload).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Dialogue {
    /// `(user, assistant)` pairs; the last answer may be empty.
    pub(super) turns: Vec<(String, String)>,
}

/// Splits an HH-RLHF transcript (`\n\nHuman: …\n\nAssistant: …`) into turns.
pub(super) fn parse_dialogue(text: &str) -> Dialogue {
    let mut turns: Vec<(String, String)> = Vec::new();
    for part in text.split("\n\nHuman:").map(str::trim).filter(|p| !p.is_empty()) {
        let (user, answer) = part.split_once("\n\nAssistant:").unwrap_or((part, ""));
        // A later "Assistant:" inside the same human part stays in the answer.
        turns.push((user.trim().to_owned(), answer.trim().to_owned()));
    }
    turns.retain(|(u, _)| !u.is_empty());
    Dialogue { turns }
}

/// The dialogues of `<data>/prompts/hh-rlhf-helpful-base-test.jsonl`, or a
/// synthetic set; the second value says which.
fn load_dialogues(common: &Common) -> (Vec<Dialogue>, String) {
    let path = common.data_dir().map(|d| d.join(super::dispatch_path::PROMPTS_FILE));
    if let Some(path) = &path
        && let Ok(dialogues) = read_dialogues(path)
        && !dialogues.is_empty()
    {
        return (dialogues, path.display().to_string());
    }
    let synthetic = (0..500)
        .map(|i| Dialogue {
            turns: (0..3)
                .map(|t| {
                    (
                        format!(
                            "Conversation {i}, question {t}: {}",
                            "tell me more about it. ".repeat(8 + t * 3)
                        ),
                        "Here is an answer that goes on for a while. ".repeat(10),
                    )
                })
                .collect(),
        })
        .collect();
    (synthetic, "synthetic (no HH-RLHF file found)".into())
}

/// The dialogues (with at least one turn) of an HH-RLHF JSONL file: the
/// `chosen` transcript of every line that has one.
pub(super) fn read_dialogues(path: &Path) -> Result<Vec<Dialogue>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["chosen"].as_str().map(parse_dialogue))
        .filter(|d| !d.turns.is_empty())
        .collect())
}

/// A conversation in progress.
#[derive(Debug, Clone)]
struct Conversation {
    dialogue: usize,
    /// The turn to send next.
    turn: usize,
    /// How many times the dataset was cycled before it started (keeps
    /// repeated conversations distinct).
    pass: usize,
}

/// The conversations: those waiting for their next turn, and where the
/// next new one starts.
#[derive(Debug)]
struct Pool {
    dialogues: Arc<Vec<Dialogue>>,
    ready: VecDeque<Conversation>,
    next: usize,
}

impl Pool {
    fn new(dialogues: Arc<Vec<Dialogue>>) -> Self {
        Self {
            dialogues,
            ready: VecDeque::new(),
            next: 0,
        }
    }

    /// The conversation to send a turn of: one whose previous turn has
    /// completed, else a new one.
    fn take(&mut self) -> Conversation {
        if let Some(c) = self.ready.pop_front() {
            return c;
        }
        let n = self.dialogues.len();
        let c = Conversation {
            dialogue: self.next % n,
            turn: 0,
            pass: self.next / n,
        };
        self.next += 1;
        c
    }

    /// `c`'s turn was answered: it may go on.
    fn answered(&mut self, mut c: Conversation) {
        c.turn += 1;
        if c.turn < self.dialogues[c.dialogue].turns.len() {
            self.ready.push_back(c);
        }
    }

    /// The request body of `c`'s current turn.
    fn body(&self, c: &Conversation, max_tokens: u32) -> Bytes {
        let d = &self.dialogues[c.dialogue];
        let mut messages = Vec::with_capacity(2 * c.turn + 1);
        for (i, (user, answer)) in d.turns[..=c.turn].iter().enumerate() {
            let user = if i == 0 && c.pass > 0 {
                format!("(session {}) {user}", c.pass)
            } else {
                user.clone()
            };
            messages.push(json!({"role": "user", "content": user}));
            if i < c.turn {
                messages.push(json!({"role": "assistant", "content": answer}));
            }
        }
        Bytes::from(
            json!({
                "model": "semlb-sim",
                "messages": messages,
                "max_tokens": max_tokens,
                "ignore_eos": true,
                "temperature": 0,
                "stream": true,
            })
            .to_string(),
        )
    }
}

/// One phase's outcomes and its duration.
#[derive(Debug, Default)]
struct PhaseRun {
    /// Requests sent (open loop: scheduled).
    sent: usize,
    outcomes: Vec<Outcome>,
    /// From the first arrival to the last completion.
    wall: Duration,
}

const CHAT: &str = "/v1/chat/completions";

/// Open loop: `rate` arrivals per second for `secs`.
async fn open_loop(
    http: Client<HttpConnector, Full<Bytes>>,
    addr: String,
    pool: Arc<Mutex<Pool>>,
    args: EndToEndArgs,
) -> PhaseRun {
    let mut rng = Rng::from_seed(args.seed);
    let start = Instant::now();
    let mut at = 0.0f64;
    let mut tasks = Vec::new();
    loop {
        at += match args.arrivals {
            Arrivals::Poisson => -rng.unit().ln() / args.rate,
            Arrivals::Fixed => 1.0 / args.rate,
        };
        if at >= args.secs {
            break;
        }
        let due = start + Duration::from_secs_f64(at);
        tokio::time::sleep_until(due.into()).await;
        let (conversation, body) = {
            let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
            let c = p.take();
            let body = p.body(&c, args.max_tokens);
            (c, body)
        };
        let (http, addr, pool) = (http.clone(), addr.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            let outcome = stream_request(&http, &addr, CHAT, body, due).await;
            if outcome.ok() {
                pool.lock().unwrap_or_else(|e| e.into_inner()).answered(conversation);
            }
            outcome
        }));
    }
    let sent = tasks.len();
    let mut outcomes = Vec::with_capacity(sent);
    for t in tasks {
        if let Ok(o) = t.await {
            outcomes.push(o);
        }
    }
    PhaseRun {
        sent,
        outcomes,
        wall: start.elapsed(),
    }
}

/// Closed loop: `concurrency` clients for `secs`.
async fn closed_loop(
    http: Client<HttpConnector, Full<Bytes>>,
    addr: String,
    pool: Arc<Mutex<Pool>>,
    args: EndToEndArgs,
) -> PhaseRun {
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(args.saturation_secs);
    let clients: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (http, addr, pool) = (http.clone(), addr.clone(), pool.clone());
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                while Instant::now() < stop {
                    let (conversation, body) = {
                        let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
                        let c = p.take();
                        let body = p.body(&c, args.max_tokens);
                        (c, body)
                    };
                    let outcome = stream_request(&http, &addr, CHAT, body, Instant::now()).await;
                    if outcome.ok() {
                        pool.lock().unwrap_or_else(|e| e.into_inner()).answered(conversation);
                    }
                    outcomes.push(outcome);
                }
                outcomes
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for c in clients {
        if let Ok(o) = c.await {
            outcomes.extend(o);
        }
    }
    PhaseRun {
        sent: outcomes.len(),
        outcomes,
        wall: start.elapsed(),
    }
}

/// The figures of one phase.
#[derive(Debug, Clone, Default)]
struct PhaseStats {
    sent: usize,
    ok: usize,
    errors: usize,
    req_per_s: f64,
    ttft_ms: Vec<f64>,
    latency_ms: Vec<f64>,
    dispatch_us: Vec<f64>,
    /// Response-cache lookup + prefix match and policy (µs).
    store_us: Vec<f64>,
    first_error: Option<String>,
}

impl PhaseStats {
    fn of(run: &PhaseRun) -> Self {
        let ok: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.ok()).collect();
        let stage = |i: usize| -> Vec<f64> {
            ok.iter()
                .filter_map(|o| o.dispatch)
                .map(|d| d[i] as f64 / 1e3)
                .collect()
        };
        Self {
            sent: run.sent,
            ok: ok.len(),
            errors: run.sent - ok.len(),
            req_per_s: ok.len() as f64 / run.wall.as_secs_f64().max(1e-9),
            ttft_ms: ok
                .iter()
                .filter_map(|o| o.ttft)
                .map(|d| d.as_secs_f64() * 1e3)
                .collect(),
            latency_ms: ok.iter().map(|o| o.latency.as_secs_f64() * 1e3).collect(),
            dispatch_us: stage(6),
            store_us: ok
                .iter()
                .filter_map(|o| o.dispatch)
                .map(|d| (d[4] + d[5]) as f64 / 1e3)
                .collect(),
            first_error: run.outcomes.iter().find_map(|o| o.error.clone()),
        }
    }

    /// The table figures, in [`HEADER`] order after the store column.
    fn figures(&self) -> Vec<f64> {
        let t = p50_90_99(&self.ttft_ms);
        let l = p50_90_99(&self.latency_ms);
        let d = p50_90_99(&self.dispatch_us);
        let s = p50_90_99(&self.store_us);
        vec![
            self.req_per_s,
            t[0],
            t[1],
            t[2],
            l[0],
            l[1],
            l[2],
            d[0],
            d[2],
            s[0],
            self.errors as f64,
        ]
    }

    fn json(&self) -> Value {
        let q = |v: &[f64]| {
            let [p50, p90, p99] = p50_90_99(v);
            json!({"p50": p50, "p90": p90, "p99": p99})
        };
        json!({
            "sent": self.sent,
            "completed": self.ok,
            "errors": self.errors,
            "first_error": self.first_error,
            "requests_per_s": self.req_per_s,
            "ttft_ms": q(&self.ttft_ms),
            "latency_ms": q(&self.latency_ms),
            "dispatch_total_us": q(&self.dispatch_us),
            "dispatch_cache_route_us": q(&self.store_us),
        })
    }
}

const HEADER: [&str; 12] = [
    "store",
    "req/s",
    "TTFT p50 ms",
    "p90",
    "p99",
    "latency p50 ms",
    "p90",
    "p99",
    "dispatch p50 µs",
    "p99",
    "cache+route p50 µs",
    "errors",
];

fn row(name: &str, f: &[f64]) -> Vec<String> {
    let mut out = vec![name.to_owned()];
    for (i, v) in f.iter().enumerate() {
        out.push(match i {
            0 => format!("{v:.1}"),
            10 => format!("{v:.0}"),
            _ => ms(*v),
        });
    }
    out
}

/// Both phases on one store.
struct StoreRun {
    name: &'static str,
    fixed: PhaseStats,
    saturation: Option<PhaseStats>,
}

/// Runs both phases against a fresh cluster on `store`; `None` when the
/// gateway does not know the store's flags.
fn run_store(
    args: &EndToEndArgs,
    name: &'static str,
    store: Store,
    dialogues: &Arc<Vec<Dialogue>>,
    client: &LoadClient,
    bar: &indicatif::ProgressBar,
) -> Result<Option<StoreRun>> {
    bar.set_message(format!("e2e {name}: starting"));
    let engines = start_engines(args.engines, args.time_scale)?;
    let spec = GatewaySpec {
        dispatchers: args.dispatchers,
        policy: None,
        store,
        shm_size: "64MiB".into(),
        tag: format!("e2e-{name}"),
        config: None,
    };
    let gateway = match start_gateway(&spec, &engines) {
        Ok(g) => g,
        Err(GatewayError::UnknownFlag(text)) => {
            bar.suspend(|| {
                eprintln!(
                    "semlb bench e2e: skipping {name}: this `semlb serve` does not accept its flags yet ({})",
                    text.lines()
                        .find(|l| l.contains("unexpected argument"))
                        .unwrap_or("")
                        .trim()
                );
            });
            return Ok(None);
        }
        Err(GatewayError::Other(e)) => return Err(e.context(format!("starting the gateway on {name}"))),
    };
    let addr = gateway.addr().to_owned();
    // One request first, so that connections and caches exist.
    let pool = Arc::new(Mutex::new(Pool::new(dialogues.clone())));
    {
        let body = pool.lock().unwrap_or_else(|e| e.into_inner()).body(
            &Conversation {
                dialogue: 0,
                turn: 0,
                pass: usize::MAX / 2,
            },
            args.max_tokens,
        );
        let warm = client
            .runtime
            .block_on(stream_request(&client.http, &addr, CHAT, body, Instant::now()));
        if !warm.ok() {
            bail!(
                "{name}: the warm-up request failed: {}{}",
                warm.error.unwrap_or_default(),
                gateway.proc.stderr_tail()
            );
        }
    }
    let ticker = |what: String, secs: f64| {
        bar.set_message(what);
        let bar = bar.clone();
        let base = bar.position();
        client.runtime.spawn(async move {
            let t0 = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let done = (t0.elapsed().as_secs_f64().min(secs)) as u64;
                bar.set_position(base + done);
            }
        })
    };
    let phase_start = bar.position();
    let tick = ticker(format!("e2e {name}: {} req/s", args.rate), args.secs);
    let fixed = client
        .runtime
        .block_on(open_loop(client.http.clone(), addr.clone(), pool.clone(), args.clone()));
    tick.abort();
    bar.set_position(phase_start + args.secs.ceil() as u64);
    let saturation = if args.concurrency > 0 && args.saturation_secs > 0.0 {
        let tick = ticker(
            format!("e2e {name}: {} clients", args.concurrency),
            args.saturation_secs,
        );
        let run = client
            .runtime
            .block_on(closed_loop(client.http.clone(), addr, pool, args.clone()));
        tick.abort();
        Some(PhaseStats::of(&run))
    } else {
        None
    };
    drop(gateway);
    drop(engines);
    Ok(Some(StoreRun {
        name,
        fixed: PhaseStats::of(&fixed),
        saturation,
    }))
}

/// Deletes every key under `namespace` (a user's Redis stays clean).
fn delete_namespace(url: &str, namespace: &str) -> Result<()> {
    use redis::Commands;
    let client = redis::Client::open(url)?;
    let mut con = client.get_connection_with_timeout(Duration::from_secs(2))?;
    let keys: Vec<String> = con.scan_match::<_, String>(format!("{namespace}:*"))?.collect();
    for chunk in keys.chunks(1000) {
        let _: () = con.del(chunk)?;
    }
    Ok(())
}

/// Runs the report.
pub fn run(args: &EndToEndArgs) -> Result<()> {
    if args.engines == 0 || args.dispatchers == 0 {
        bail!("--engines and --dispatchers must be at least 1");
    }
    if !(args.rate > 0.0 && args.secs > 0.0) {
        bail!("--rate and --secs must be positive");
    }
    let (dialogues, source) = load_dialogues(&args.common);
    let dialogues = Arc::new(dialogues);
    let redis = BenchRedis::for_run(&args.common)?;
    let client = LoadClient::new()?;
    let mut stores: Vec<(&'static str, Store)> = vec![("shm", Store::Shm)];
    let namespace = unique_name("e2e");
    if let Some(r) = &redis {
        stores.push((
            "redis",
            Store::Redis {
                url: r.url().to_owned(),
                namespace: namespace.clone(),
            },
        ));
    }
    let per_store = args.secs.ceil() as u64
        + if args.concurrency > 0 {
            args.saturation_secs.ceil() as u64
        } else {
            0
        };
    let bar = output::progress(per_store * stores.len() as u64, "e2e");
    let mut runs = Vec::new();
    for (i, (name, store)) in stores.into_iter().enumerate() {
        bar.set_position(per_store * i as u64);
        let is_redis = matches!(store, Store::Redis { .. });
        let result = run_store(args, name, store, &dialogues, &client, &bar);
        if is_redis && let Some(r) = &redis {
            let _ = delete_namespace(r.url(), &namespace);
        }
        if let Some(run) = result? {
            runs.push(run);
        }
    }
    bar.finish_and_clear();
    drop(redis);

    // Table and JSON.
    let mut table = Table::new(HEADER);
    let mut phases_json = serde_json::Map::new();
    let phase_rows = |table: &mut Table, title: &str, pick: &dyn Fn(&StoreRun) -> Option<&PhaseStats>| {
        let rows: Vec<(&str, Vec<f64>)> = runs
            .iter()
            .filter_map(|r| pick(r).map(|p| (r.name, p.figures())))
            .collect();
        for (name, f) in &rows {
            table.row(row(&format!("{title} {name}"), f));
        }
        if let [(_, shm), (_, redis)] = rows.as_slice() {
            let ratios: Vec<f64> = shm.iter().zip(redis).map(|(s, r)| ratio(*r, *s)).collect();
            let mut cells = vec![format!("{title} redis/shm")];
            cells.extend(ratios.iter().take(10).map(|r| format!("{r:.2}x")));
            cells.push(String::new());
            table.row(cells);
            Some(ratios)
        } else {
            None
        }
    };
    let fixed_ratios = phase_rows(&mut table, "fixed", &|r| Some(&r.fixed));
    let saturation_ratios = phase_rows(&mut table, "saturation", &|r| r.saturation.as_ref());
    for r in &runs {
        phases_json.insert(
            r.name.to_owned(),
            json!({
                "fixed_rate": r.fixed.json(),
                "saturation": r.saturation.as_ref().map(PhaseStats::json),
            }),
        );
    }
    let ratio_json = |ratios: Option<Vec<f64>>| {
        ratios.map(|r| {
            let names = [
                "requests_per_s",
                "ttft_p50",
                "ttft_p90",
                "ttft_p99",
                "latency_p50",
                "latency_p90",
                "latency_p99",
                "dispatch_p50",
                "dispatch_p99",
                "cache_route_p50",
            ];
            names
                .iter()
                .zip(r)
                .map(|(n, v)| ((*n).to_owned(), json!(v)))
                .collect::<serde_json::Map<_, _>>()
        })
    };
    let title = format!(
        "semlb bench e2e: gateway ({} dispatchers) in front of {} simulated engines (time scale {}), \
         streaming chat turns of {} ({} output tokens); fixed: {} {} req/s for {} s; saturation: {} clients for {} s",
        args.dispatchers,
        args.engines,
        args.time_scale,
        source,
        args.max_tokens,
        match args.arrivals {
            Arrivals::Poisson => "Poisson",
            Arrivals::Fixed => "fixed-interval",
        },
        args.rate,
        args.secs,
        args.concurrency,
        args.saturation_secs
    );
    output::print_table(&title, &table);
    for r in &runs {
        for (phase, p) in [("fixed", Some(&r.fixed)), ("saturation", r.saturation.as_ref())] {
            if let Some(p) = p
                && let Some(e) = &p.first_error
            {
                println!("{} {phase}: {} errors, first: {e}", r.name, p.errors);
            }
        }
    }
    if args.common.no_redis {
        println!("(redis skipped: --no-redis)");
    }
    let value = json!({
        "report": "e2e",
        "engines": args.engines,
        "dispatchers": args.dispatchers,
        "time_scale": args.time_scale,
        "max_tokens": args.max_tokens,
        "workload": source,
        "fixed_rate": {"rate": args.rate, "secs": args.secs, "arrivals": format!("{:?}", args.arrivals).to_lowercase()},
        "saturation": {"concurrency": args.concurrency, "secs": args.saturation_secs},
        "stores": phases_json,
        "ratios_redis_over_shm": {
            "fixed_rate": ratio_json(fixed_ratios),
            "saturation": ratio_json(saturation_ratios),
        },
    });
    let json_path = output::write_json(&args.common.out, "e2e", &value)?;
    let svg_path = args.common.out.join("e2e.svg");
    write_svg(&svg_path, &runs)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { f64::NAN } else { a / b }
}

fn write_svg(path: &Path, runs: &[StoreRun]) -> Result<()> {
    let panel = |title: &str, x_label: &str, pick: &dyn Fn(&PhaseStats) -> &Vec<f64>| Panel {
        title: title.to_owned(),
        x_label: x_label.to_owned(),
        log_x: true,
        series: runs
            .iter()
            .map(|r| Series {
                label: r.name.to_owned(),
                values: pick(&r.fixed).clone(),
            })
            .collect(),
    };
    plot::cdf_svg(
        path,
        &[
            panel("TTFT (fixed rate)", "ms", &|p| &p.ttft_ms),
            panel("end-to-end latency (fixed rate)", "ms", &|p| &p.latency_ms),
            panel("dispatch time (fixed rate)", "µs", &|p| &p.dispatch_us),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_scan_finds_the_first_event_and_done_across_splits() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut s = SseScan::default();
            let first_a = s.feed(&stream[..cut]);
            let first_b = s.feed(&stream[cut..]);
            // The first event completes at byte 15 (after "\n\n").
            assert_eq!(first_a, cut >= 15, "cut {cut}");
            assert_eq!(first_b, cut < 15, "cut {cut}");
            assert_eq!((s.data_events, s.done), (2, true), "cut {cut}");
        }
        let mut s = SseScan::default();
        assert!(!s.feed(b"data: [DONE]\r\n\r\n"));
        assert!(s.done && s.data_events == 0);
        let mut s = SseScan::default();
        assert!(!s.feed(b": comment\n\n"));
        assert!(s.feed(b"event: x\ndata: {}\n\n"));
        assert!(!s.feed(b"data: {}\n\n"));
    }

    #[test]
    fn dispatch_header_parses_every_stage() {
        let v = "read=1,parse=2,tokenize=3,hash=4,cache=5,route=6,total=21";
        assert_eq!(parse_dispatch(v), Some([1, 2, 3, 4, 5, 6, 21]));
        assert_eq!(parse_dispatch("read=1,parse=2"), None);
        assert_eq!(
            parse_dispatch("read=x,parse=2,tokenize=3,hash=4,cache=5,route=6,total=21"),
            None
        );
    }

    #[test]
    fn dialogues_split_into_turns() {
        let d = parse_dialogue("\n\nHuman: Hi?\n\nAssistant: Hello.\n\nHuman: How are you?\n\nAssistant: Fine.");
        assert_eq!(
            d.turns,
            vec![
                ("Hi?".to_owned(), "Hello.".to_owned()),
                ("How are you?".to_owned(), "Fine.".to_owned())
            ]
        );
        assert_eq!(parse_dialogue("\n\nHuman: Only a question").turns.len(), 1);
    }

    #[test]
    fn turns_build_on_the_history_and_conversations_continue_after_answers() {
        let d = parse_dialogue("\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant: D");
        let mut pool = Pool::new(Arc::new(vec![d]));
        let c = pool.take();
        let first: Value = serde_json::from_slice(&pool.body(&c, 8)).unwrap();
        assert_eq!(first["messages"].as_array().unwrap().len(), 1);
        assert_eq!(first["stream"], true);
        pool.answered(c);
        let c = pool.take();
        assert_eq!(c.turn, 1);
        let second: Value = serde_json::from_slice(&pool.body(&c, 8)).unwrap();
        let m = second["messages"].as_array().unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(
            (m[1]["content"].as_str(), m[2]["content"].as_str()),
            (Some("B"), Some("C"))
        );
        pool.answered(c);
        // Finished: a new pass of the dataset, distinct from the first.
        let c = pool.take();
        assert_eq!((c.turn, c.pass), (0, 1));
        let again: Value = serde_json::from_slice(&pool.body(&c, 8)).unwrap();
        assert_ne!(again["messages"][0], first["messages"][0]);
    }

    #[test]
    fn splitmix_is_deterministic_and_unit_is_in_range() {
        let (mut a, mut b) = (Rng::from_seed(7), Rng::from_seed(7));
        for _ in 0..1000 {
            let u = a.unit();
            assert!(u > 0.0 && u <= 1.0);
            assert_eq!(u, b.unit());
        }
    }
}
