//! One replay run: fresh engines and a fresh front in front of them —
//! semlb's gateway with a routing policy, or a peer router
//! ([`peers`](super::peers)) — a workload sent open-loop at a rate
//! multiplier (or by its sessions), and the engines' counters at the end.
//!
//! The front is a [`Front`]: how it starts, where it listens, how an
//! engine is added to it at run time (`scale-out`: semlb through its admin
//! API, `POST /admin/servers`, a peer through its own), and the counters
//! only semlb has (prediction accuracy; `None` for a peer). Everything
//! else (the engines, the sending, the engines' counters) is the same for
//! every row.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use semlb::routing::PolicyKind;
use semlb_test_support::gateway::Gateway;
use semlb_test_support::http::http_bytes;
use semlb_test_support::process::Proc;

use super::counters::{EngineCounters, GatewayCounters};
use super::peers::{Install, PeerProc};
use super::sessions::{self, Sender, Start};
use crate::end_to_end::{
    GatewayError, GatewaySpec, LoadClient, Outcome, Store, request_with, start_engines, start_gateway,
};
use crate::output;
use crate::workload::{Request, SESSION_HEADER, Workload};

/// Request bodies built before the clock starts, and at most this many
/// built ahead of the schedule afterwards.
const PRIMED: usize = 64;

/// The admin token of a `scale-out` run's gateway.
const ADMIN_TOKEN: &str = "semlb-bench-replay-admin-token";

/// Which front a run starts.
#[derive(Debug, Clone)]
pub(super) enum FrontSpec {
    /// semlb's gateway (`semlb serve`).
    Semlb {
        /// The routing policy.
        policy: PolicyKind,
        /// The gateway's configuration file text.
        config: String,
        /// The engines publish their KV cache events and the gateway
        /// follows them (a `policy/precise` row).
        kv_events: bool,
    },
    /// A peer router, installed.
    Peer(Install),
}

/// What one run does.
#[derive(Debug, Clone)]
pub(super) struct RunSpec {
    /// The front.
    pub(super) front: FrontSpec,
    /// The row it is reported as (the policy, a variant of it, or a peer).
    pub(super) label: String,
    /// Simulated engines.
    pub(super) engines: usize,
    /// Dispatcher processes of semlb's gateway.
    pub(super) dispatchers: usize,
    /// The engines' KV cache, tokens (`None`: the simulator's default).
    pub(super) kv_tokens: Option<u64>,
    /// Whether the engines serve `/metrics`.
    pub(super) metrics: bool,
    /// Whether chat sessions' answers are streamed (token-id completions
    /// always are).
    pub(super) stream: bool,
    /// Clients of a closed-loop workload.
    pub(super) clients: usize,
    /// Engines run this much faster than simulated time; arrivals are
    /// compressed as much.
    pub(super) speedup: f64,
    /// Arrivals are further compressed by this factor (offered rate × m).
    pub(super) multiplier: f64,
    /// Real seconds to wait after the last arrival.
    pub(super) drain_secs: f64,
    /// `scale-out`: the front starts with the first engine only and the
    /// others are added once this many calls are answered.
    pub(super) scale_out_at: Option<usize>,
}

impl RunSpec {
    /// Whether the engines publish their KV cache events.
    fn kv_events(&self) -> bool {
        matches!(self.front, FrontSpec::Semlb { kv_events: true, .. })
    }
}

/// One engine added at run time, and how its front answered.
#[derive(Debug, Clone)]
pub(super) struct Added {
    /// The engine (`http://host:port`).
    pub(super) url: String,
    /// The front's answer: HTTP status, or the error.
    pub(super) answer: Result<u16, String>,
    /// How long the request took, ms.
    pub(super) ms: f64,
}

/// What a `scale-out` run did.
#[derive(Debug, Clone, Default)]
pub(super) struct ScaleOut {
    /// Real seconds from the start to the first add request (`None`: the
    /// run ended before enough calls were answered).
    pub(super) at_s: Option<f64>,
    /// Each add.
    pub(super) added: Vec<Added>,
}

/// What one run measured.
#[derive(Debug)]
pub(super) struct RunResult {
    /// Per request, in arrival order: the outcome and its output tokens.
    pub(super) outcomes: Vec<(Outcome, u32)>,
    /// Per request: real seconds from the start to its end (`None`: never
    /// sent, or unfinished).
    pub(super) finished_s: Vec<Option<f64>>,
    /// Real seconds from the first arrival to the last completion.
    pub(super) wall_s: f64,
    /// Every engine's counters at the end.
    pub(super) engines: Vec<EngineCounters>,
    /// The gateway's prediction counters at the end (`None` for a peer).
    pub(super) gateway: Option<GatewayCounters>,
    /// Send lag of the generator (real ms behind schedule): p99, max.
    pub(super) lag_ms: [f64; 2],
    /// The peer's command line (`None` for semlb's gateway).
    pub(super) command: Option<Vec<String>>,
    /// What a `scale-out` run did.
    pub(super) scale_out: Option<ScaleOut>,
}

/// A request that adds an engine to a front at run time.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct AddRequest {
    /// Where it goes (`host:port`).
    pub(super) addr: String,
    /// `POST`.
    pub(super) method: &'static str,
    /// Path and query.
    pub(super) path: String,
    /// Extra header fields.
    pub(super) headers: Vec<(String, String)>,
    /// JSON body.
    pub(super) body: Option<String>,
}

impl AddRequest {
    /// Sends it (blocking): the status, or the error.
    fn send(&self) -> Result<u16, String> {
        let headers: Vec<(&str, &str)> = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        http_bytes(
            &self.addr,
            self.method,
            &self.path,
            self.body.as_deref().map(str::as_bytes),
            &headers,
        )
        .map(|r| r.status)
    }
}

/// semlb's admin request adding `url`, on the admin API at `admin`.
pub(super) fn admin_add_request(admin: &str, token: &str, url: &str) -> AddRequest {
    AddRequest {
        addr: admin.to_owned(),
        method: "POST",
        path: "/admin/servers".to_owned(),
        headers: vec![("Authorization".to_owned(), format!("Bearer {token}"))],
        body: Some(serde_json::json!({ "url": url }).to_string()),
    }
}

/// A running front.
enum Front {
    /// semlb's gateway.
    Gateway(Box<Gateway>),
    /// A peer router.
    Peer(PeerProc),
}

impl Front {
    /// Starts `spec`'s front in front of `engines`.
    fn start(spec: &RunSpec, engines: &[Proc]) -> Result<Front> {
        match &spec.front {
            FrontSpec::Semlb {
                policy,
                config,
                kv_events,
            } => {
                let policy = *policy;
                let gateway_spec = GatewaySpec {
                    dispatchers: spec.dispatchers,
                    policy: Some(policy),
                    store: Store::Shm,
                    shm_size: "256MiB".into(),
                    tag: format!("replay-{policy}"),
                    config: Some(config.clone()),
                    kv_events: *kv_events,
                    admin_token: spec.scale_out_at.map(|_| ADMIN_TOKEN.to_owned()),
                };
                match start_gateway(&gateway_spec, engines) {
                    Ok(g) => Ok(Front::Gateway(Box::new(g))),
                    Err(GatewayError::UnknownFlag(e)) => bail!("starting the gateway with --policy {policy}: {e}"),
                    Err(GatewayError::Other(e)) => {
                        Err(e.context(format!("starting the gateway with --policy {policy}")))
                    }
                }
            }
            FrontSpec::Peer(install) => {
                let urls: Vec<String> = engines.iter().map(|e| format!("http://{}", e.addr)).collect();
                Ok(Front::Peer(PeerProc::start(install, &urls).map_err(|e| anyhow!(e))?))
            }
        }
    }

    /// Where clients send requests.
    fn addr(&self) -> &str {
        match self {
            Front::Gateway(g) => g.addr(),
            Front::Peer(p) => &p.addr,
        }
    }

    /// The request adding engine `url` at run time.
    fn add_request(&self, url: &str) -> AddRequest {
        match self {
            Front::Gateway(g) => admin_add_request(g.admin_addr(), ADMIN_TOKEN, url),
            Front::Peer(p) => {
                let (method, path, body) = p.peer.add_worker(url);
                AddRequest {
                    addr: p.addr.clone(),
                    method,
                    path,
                    headers: Vec::new(),
                    body,
                }
            }
        }
    }

    /// The gateway's prediction counters, once the response processes have
    /// read the last answers (`None` for a peer).
    fn counters(&self) -> Option<GatewayCounters> {
        let Front::Gateway(gateway) = self else {
            return None;
        };
        // The response processes count the last answers a moment after
        // they end: read until two reads a tenth of a second apart agree.
        let until = Instant::now() + SETTLE;
        let mut counters = GatewayCounters::parse(&gateway.metrics());
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let again = GatewayCounters::parse(&gateway.metrics());
            let settled = again.records == counters.records;
            counters = again;
            if settled || Instant::now() >= until {
                return Some(counters);
            }
        }
    }

    /// The peer's command line.
    fn command(&self) -> Option<Vec<String>> {
        match self {
            Front::Gateway(_) => None,
            Front::Peer(p) => Some(p.command.clone()),
        }
    }
}

/// The JSON body of a completion request with `tokens` as its prompt:
/// streamed, exactly `max_tokens` tokens (`ignore_eos`), `temperature` 1 so
/// it is never answered from the response cache.
pub(super) fn completion_body(tokens: &[u32], max_tokens: u32) -> Bytes {
    let mut s = String::with_capacity(tokens.len() * 6 + 160);
    s.push_str(r#"{"model":"semlb-sim","stream":true,"ignore_eos":true,"temperature":1.0,"max_tokens":"#);
    let _ = write!(s, "{max_tokens}");
    s.push_str(r#","prompt":["#);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{t}");
    }
    s.push_str("]}");
    Bytes::from(s)
}

/// The JSON body of a completion request with `prompt` as its prompt
/// text, otherwise as [`completion_body`]'s.
pub(super) fn completion_text_body(prompt: &str, max_tokens: u32) -> Bytes {
    let mut s = String::with_capacity(prompt.len() + prompt.len() / 8 + 160);
    s.push_str(r#"{"model":"semlb-sim","stream":true,"ignore_eos":true,"temperature":1.0,"max_tokens":"#);
    let _ = write!(s, "{max_tokens}");
    s.push_str(r#","prompt":"#);
    s.push_str(&serde_json::to_string(prompt).expect("a string serializes"));
    s.push('}');
    Bytes::from(s)
}

/// The body of completion request `r`: its text in the text form, else
/// its token ids.
fn request_body(r: &Request) -> Bytes {
    match &r.text {
        Some(text) => completion_text_body(&text.text(), r.output_tokens),
        None => completion_body(&r.prompt, r.output_tokens),
    }
}

/// Sends `workload` through `spec`'s fresh front in front of fresh
/// engines.
pub(super) fn run_once(
    spec: &RunSpec,
    workload: &Arc<Workload>,
    client: &LoadClient,
    bar: &indicatif::ProgressBar,
) -> Result<RunResult> {
    let what = format!("{} {} ×{}", workload.kind, spec.label, spec.multiplier);
    bar.set_message(format!("{what}: starting"));
    let engines = start_engines(
        spec.engines,
        1.0 / spec.speedup,
        spec.kv_tokens,
        spec.metrics,
        spec.kv_events(),
    )?;
    // A scale-out run's front starts with the first engine only.
    let routed = if spec.scale_out_at.is_some() { 1 } else { engines.len() };
    let front = Front::start(spec, &engines[..routed])?;
    bar.set_message(what);
    let addr = front.addr().to_owned();
    let scale = spec.speedup * spec.multiplier;
    let drain = Duration::from_secs_f64(spec.drain_secs.max(0.0));
    let workload = workload.clone();
    let http = client.http.clone();
    let progress = bar.clone();
    let t0 = workload.requests.first().map_or(0.0, |r| r.at_s);
    let real_s = move |at_s: f64| (at_s - t0) / scale;
    if workload.kind.chat_calls() {
        let start = if workload.kind.closed_loop() {
            Start::Clients(spec.clients)
        } else {
            Start::Scheduled
        };
        let answered = spec.scale_out_at.map(|_| Arc::new(AtomicUsize::new(0)));
        let adder = spec
            .scale_out_at
            .zip(answered.clone())
            .map(|(at, count)| spawn_adds(client, &front, &engines[routed..], at, count));
        let sender = Sender {
            http,
            addr,
            stream: spec.stream,
            progress,
            pin_slots: None,
            answered,
        };
        let sent = client
            .runtime
            .block_on(sessions::send(workload, sender, start, real_s, drain));
        let scale_out = adder.map(|task| scale_out_of(client, task, sent.t0));
        return finish(client, engines, front, sent, scale_out);
    }
    let sent = client
        .runtime
        .block_on(send_completions(workload, http, addr, progress, real_s, drain));
    finish(client, engines, front, sent, None)
}

/// The adds of the `unrouted` engines to `front`, made once `count` (the
/// calls answered) reaches `at`: the instant they start and each one's
/// answer.
fn spawn_adds(
    client: &LoadClient,
    front: &Front,
    unrouted: &[Proc],
    at: usize,
    count: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<(Instant, Vec<Added>)> {
    let adds: Vec<(String, AddRequest)> = unrouted
        .iter()
        .map(|e| {
            let url = format!("http://{}", e.addr);
            (url.clone(), front.add_request(&url))
        })
        .collect();
    client.runtime.spawn(async move {
        while count.load(Ordering::Relaxed) < at {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let started = Instant::now();
        let added = tokio::task::spawn_blocking(move || {
            adds.into_iter()
                .map(|(url, request)| {
                    let t = Instant::now();
                    let answer = request.send();
                    Added {
                        url,
                        answer,
                        ms: t.elapsed().as_secs_f64() * 1e3,
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        (started, added)
    })
}

/// What a `scale-out` run's adds did, once its calls are sent (`t0`
/// their start): nothing if they had not finished (they are stopped).
fn scale_out_of(client: &LoadClient, task: tokio::task::JoinHandle<(Instant, Vec<Added>)>, t0: Instant) -> ScaleOut {
    if task.is_finished() {
        let (started, added) = client.runtime.block_on(task).unwrap_or_else(|_| (t0, Vec::new()));
        ScaleOut {
            at_s: Some(started.saturating_duration_since(t0).as_secs_f64()),
            added,
        }
    } else {
        task.abort();
        ScaleOut::default()
    }
}

/// Sends a completion workload open-loop: each request at its arrival
/// time (`real_s` of it after the start) to `addr`, then waits at most
/// `drain` for the answers.
async fn send_completions(
    workload: Arc<Workload>,
    http: Client<HttpConnector, Full<Bytes>>,
    addr: String,
    progress: indicatif::ProgressBar,
    real_s: impl Fn(f64) -> f64,
    drain: Duration,
) -> sessions::Sent {
    // Bodies are built ahead on a thread of their own, so that bursts of
    // simultaneous arrivals are not delayed by building them (a text
    // prompt is its pieces joined and escaped: ~70 KB for `mooncake`);
    // the first ones before the clock starts (traces start with a
    // burst).
    let body = request_body;
    let mut primed = workload
        .requests
        .iter()
        .take(PRIMED)
        .map(body)
        .collect::<Vec<_>>()
        .into_iter();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(PRIMED);
    let ahead = workload.clone();
    std::thread::spawn(move || {
        for r in ahead.requests.iter().skip(PRIMED) {
            if tx.blocking_send(body(r)).is_err() {
                return;
            }
        }
    });
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(workload.requests.len());
    let mut lags = Vec::with_capacity(workload.requests.len());
    for r in &workload.requests {
        let Some(body) = (match primed.next() {
            Some(b) => Some(b),
            None => rx.recv().await,
        }) else {
            break;
        };
        let due = start + Duration::from_secs_f64(real_s(r.at_s));
        tokio::time::sleep_until(due.into()).await;
        lags.push(due.elapsed().as_secs_f64() * 1e3);
        let (http, addr, progress) = (http.clone(), addr.clone(), progress.clone());
        let headers: Vec<(&str, String)> = r.session.map(|s| (SESSION_HEADER, s.to_string())).into_iter().collect();
        let output_tokens = r.output_tokens;
        tasks.push(tokio::spawn(async move {
            let o = request_with(&http, &addr, "/v1/completions", body, &headers, due, None).await;
            progress.inc(1);
            (o, output_tokens)
        }));
    }
    let outcomes = collect_outcomes(tasks, tokio::time::Instant::now() + drain, &progress).await;
    // Outcomes are in arrival order: arrival + latency is a completion.
    let finished_s: Vec<Option<f64>> = outcomes
        .iter()
        .zip(&workload.requests)
        .map(|((o, _), r)| o.ok().then(|| real_s(r.at_s) + o.latency.as_secs_f64()))
        .collect();
    let wall_s = finished_s.iter().flatten().copied().fold(0.0, f64::max);
    let mut l = lags;
    output::sort(&mut l);
    sessions::Sent {
        outcomes,
        wall_s,
        lag_ms: [output::quantile(&l, 0.99), l.last().copied().unwrap_or(0.0)],
        finished_s,
        t0: start,
    }
}

/// Each task's outcome and output tokens, in order; a task not done by
/// `deadline` is aborted and counts as unfinished.
async fn collect_outcomes(
    tasks: Vec<tokio::task::JoinHandle<(Outcome, u32)>>,
    deadline: tokio::time::Instant,
    progress: &indicatif::ProgressBar,
) -> Vec<(Outcome, u32)> {
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        let abort = t.abort_handle();
        match tokio::time::timeout_at(deadline, t).await {
            Ok(Ok(o)) => outcomes.push(o),
            Ok(Err(e)) => outcomes.push((
                Outcome {
                    error: Some(format!("task: {e}")),
                    ..Outcome::default()
                },
                0,
            )),
            Err(_) => {
                abort.abort();
                progress.inc(1);
                outcomes.push((
                    Outcome {
                        error: Some("unfinished at the end of the drain time".into()),
                        ..Outcome::default()
                    },
                    0,
                ));
            }
        }
    }
    outcomes
}

/// How long [`Front::counters`] waits for the response processes to have
/// read the last answers.
const SETTLE: Duration = Duration::from_secs(3);

/// The run's result: what was sent, every engine's counters and the
/// gateway's, read before the front and the engines are stopped.
fn finish(
    client: &LoadClient,
    engines: Vec<Proc>,
    front: Front,
    sent: sessions::Sent,
    scale_out: Option<ScaleOut>,
) -> Result<RunResult> {
    // The engines' counters, straight from each engine (from the
    // simulator's own page, which engines without `/metrics` serve too).
    let mut counters = Vec::with_capacity(engines.len());
    for e in &engines {
        let (status, text) = client
            .get(&e.addr, "/sim/metrics")
            .with_context(|| format!("reading /sim/metrics of {}", e.addr))?;
        if status != 200 {
            bail!("GET /sim/metrics of {} answered {status}", e.addr);
        }
        counters.push(EngineCounters::parse(&text));
    }
    let gateway = front.counters();
    let command = front.command();
    drop(front);
    drop(engines);
    Ok(RunResult {
        outcomes: sent.outcomes,
        finished_s: sent.finished_s,
        wall_s: sent.wall_s,
        engines: counters,
        gateway,
        lag_ms: sent.lag_ms,
        command,
        scale_out,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn engines_are_added_to_semlb_through_its_admin_api() {
        let r = admin_add_request("127.0.0.1:7", "t0ken-0123456789ab", "http://127.0.0.1:9");
        assert_eq!(
            (r.addr.as_str(), r.method, r.path.as_str()),
            ("127.0.0.1:7", "POST", "/admin/servers")
        );
        assert_eq!(
            r.headers,
            [("Authorization".to_owned(), "Bearer t0ken-0123456789ab".to_owned())]
        );
        let body: Value = serde_json::from_str(r.body.as_deref().unwrap()).unwrap();
        assert_eq!(body, json!({"url": "http://127.0.0.1:9"}));
        assert!(ADMIN_TOKEN.len() >= semlb::config::MIN_ADMIN_TOKEN_BYTES);
    }

    #[test]
    fn bodies_are_token_id_or_text_completions() {
        let v: Value = serde_json::from_slice(&completion_body(&[5, 6, 7], 9)).unwrap();
        assert_eq!(v["prompt"], json!([5, 6, 7]));
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(
            (v["stream"].as_bool(), v["ignore_eos"].as_bool()),
            (Some(true), Some(true))
        );
        let mut r = Request {
            at_s: 0.0,
            prompt: vec![5, 6],
            text: Some(crate::workload::text::TextPrompt(vec![
                "say \"hi\"\n".into(),
                "then\tstop".into(),
            ])),
            output_tokens: 4,
            session: None,
            chat: None,
        };
        let v: Value = serde_json::from_slice(&request_body(&r)).unwrap();
        assert_eq!(v["prompt"], "say \"hi\"\nthen\tstop");
        assert_eq!(
            (v["max_tokens"].as_u64(), v["temperature"].as_f64()),
            (Some(4), Some(1.0))
        );
        r.text = None;
        let v: Value = serde_json::from_slice(&request_body(&r)).unwrap();
        assert_eq!(v["prompt"], json!([5, 6]));
    }
}
