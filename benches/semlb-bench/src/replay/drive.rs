//! One replay run: fresh engines and a fresh gateway, a workload sent
//! open-loop at a rate multiplier (or by its closed-loop sessions), and
//! the engines' counters at the end.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use semlb::routing::PolicyKind;
use semlb_test_support::gateway::Gateway;
use semlb_test_support::process::Proc;

use super::counters::{EngineCounters, GatewayCounters};
use super::sessions::{self, Sender, Start};
use crate::end_to_end::{
    GatewayError, GatewaySpec, LoadClient, Outcome, Store, request_with, start_engines, start_gateway,
};
use crate::output;
use crate::workload::{Request, SESSION_HEADER, Workload, WorkloadKind};

/// Request bodies built before the clock starts, and at most this many
/// built ahead of the schedule afterwards.
const PRIMED: usize = 64;

/// What one run does.
#[derive(Debug, Clone)]
pub(super) struct RunSpec {
    /// The routing policy.
    pub(super) policy: PolicyKind,
    /// The row it is reported as (the policy, or a variant of it).
    pub(super) label: String,
    /// Simulated engines.
    pub(super) engines: usize,
    /// Dispatcher processes.
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
    /// The gateway's configuration file text.
    pub(super) config: String,
    /// The engines publish their KV cache events and the gateway follows
    /// them (a `policy/precise` row).
    pub(super) kv_events: bool,
}

/// What one run measured.
#[derive(Debug)]
pub(super) struct RunResult {
    /// Per request, in arrival order: the outcome and its output tokens.
    pub(super) outcomes: Vec<(Outcome, u32)>,
    /// Real seconds from the first arrival to the last completion.
    pub(super) wall_s: f64,
    /// Every engine's counters at the end.
    pub(super) engines: Vec<EngineCounters>,
    /// The gateway's prediction counters at the end.
    pub(super) gateway: GatewayCounters,
    /// Send lag of the generator (real ms behind schedule): p99, max.
    pub(super) lag_ms: [f64; 2],
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

/// Sends `workload` through a fresh gateway with `spec.policy` in front of
/// fresh engines.
pub(super) fn run_once(
    spec: &RunSpec,
    workload: &Arc<Workload>,
    client: &LoadClient,
    bar: &indicatif::ProgressBar,
) -> Result<RunResult> {
    let (policy, what) = (
        spec.policy,
        format!("{} {} ×{}", workload.kind, spec.label, spec.multiplier),
    );
    bar.set_message(format!("{what}: starting"));
    let engines = start_engines(
        spec.engines,
        1.0 / spec.speedup,
        spec.kv_tokens,
        spec.metrics,
        spec.kv_events,
    )?;
    let gateway_spec = GatewaySpec {
        dispatchers: spec.dispatchers,
        policy: Some(policy),
        store: Store::Shm,
        shm_size: "256MiB".into(),
        tag: format!("replay-{policy}"),
        config: Some(spec.config.clone()),
        kv_events: spec.kv_events,
    };
    let gateway = match start_gateway(&gateway_spec, &engines) {
        Ok(g) => g,
        Err(GatewayError::UnknownFlag(e)) => bail!("starting the gateway with --policy {policy}: {e}"),
        Err(GatewayError::Other(e)) => return Err(e.context(format!("starting the gateway with --policy {policy}"))),
    };
    bar.set_message(what);
    let addr = gateway.addr().to_owned();
    let scale = spec.speedup * spec.multiplier;
    let drain = Duration::from_secs_f64(spec.drain_secs.max(0.0));
    let workload = workload.clone();
    let http = client.http.clone();
    let progress = bar.clone();
    let t0 = workload.requests.first().map_or(0.0, |r| r.at_s);
    let real_s = move |at_s: f64| (at_s - t0) / scale;
    if matches!(workload.kind, WorkloadKind::Agents | WorkloadKind::Chat) {
        let start = if workload.kind.closed_loop() {
            Start::Clients(spec.clients)
        } else {
            Start::Scheduled
        };
        let sender = Sender {
            http,
            addr,
            stream: spec.stream,
            progress,
            pin_slots: None,
        };
        let sent = client
            .runtime
            .block_on(sessions::send(workload, sender, start, real_s, drain));
        return finish(client, engines, gateway, sent);
    }
    let (outcomes, wall_s, lag_ms) = client.runtime.block_on(async move {
        // Bodies are built ahead on a thread of their own, so that bursts of
        // simultaneous arrivals are not delayed by building them; the first
        // ones before the clock starts (traces start with a burst).
        let body = |r: &Request| completion_body(&r.prompt, r.output_tokens);
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
        let deadline = tokio::time::Instant::now() + drain;
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
        // Outcomes are in arrival order: arrival + latency is a completion.
        let wall = outcomes
            .iter()
            .zip(&workload.requests)
            .filter(|((o, _), _)| o.ok())
            .map(|((o, _), r)| real_s(r.at_s) + o.latency.as_secs_f64())
            .fold(0.0, f64::max);
        let mut l = lags;
        output::sort(&mut l);
        (
            outcomes,
            wall,
            [output::quantile(&l, 0.99), l.last().copied().unwrap_or(0.0)],
        )
    });
    finish(client, engines, gateway, (outcomes, wall_s, lag_ms))
}

/// How long [`finish`] waits for the response processes to have read the
/// last answers.
const SETTLE: Duration = Duration::from_secs(3);

/// The run's result: what was sent, every engine's counters and the
/// gateway's, read before the gateway and the engines are stopped.
fn finish(
    client: &LoadClient,
    engines: Vec<Proc>,
    gateway: Gateway,
    (outcomes, wall_s, lag_ms): sessions::Sent,
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
    // The response processes count the last answers a moment after they
    // end: read until two reads a tenth of a second apart agree.
    let until = Instant::now() + SETTLE;
    let mut gateway_counters = GatewayCounters::parse(&gateway.metrics());
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let again = GatewayCounters::parse(&gateway.metrics());
        let settled = again.records == gateway_counters.records;
        gateway_counters = again;
        if settled || Instant::now() >= until {
            break;
        }
    }
    drop(gateway);
    drop(engines);
    Ok(RunResult {
        outcomes,
        wall_s,
        engines: counters,
        gateway: gateway_counters,
        lag_ms,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn bodies_are_token_id_completions() {
        let v: Value = serde_json::from_slice(&completion_body(&[5, 6, 7], 9)).unwrap();
        assert_eq!(v["prompt"], json!([5, 6, 7]));
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(
            (v["stream"].as_bool(), v["ignore_eos"].as_bool()),
            (Some(true), Some(true))
        );
    }
}
