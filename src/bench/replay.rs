//! `semlb bench replay`: the Mooncake conversation trace through the
//! gateway, once per routing policy.
//!
//! # The trace
//!
//! `<data>/traces/conversation_trace.jsonl` (`--trace` overrides), the
//! FAST'25 Mooncake release: one request per line, `{"timestamp": ms,
//! "input_length": n, "output_length": m, "hash_ids": [...]}`, where each
//! hash id names one 512-token block of the prompt and equal ids mean equal
//! prefixes. No text is released, so each block id becomes 512 token ids
//! drawn from a generator seeded by the id ([`block_tokens`]): equal ids
//! give equal tokens, so requests sharing blocks share real prefixes, which
//! the gateway (16-token block hashes of the token ids) and the engines'
//! prefix caches see. The last block is cut to `input_length`.
//!
//! # Requests
//!
//! Each record becomes a streaming `/v1/completions` request whose `prompt`
//! is the array of token ids (the gateway and the simulator take token-id
//! prompts as they are), with `max_tokens` = `output_length` (capped by
//! `--max-output`) and `ignore_eos`, so the engine generates exactly that
//! many tokens, and `temperature` 1 (never answered from the response
//! cache). The simulator's context limit is 32 768 tokens; longer requests
//! keep their first `32 768 − output` prompt tokens (counted as
//! `truncated`).
//!
//! # Time
//!
//! `--speedup X` divides the trace's arrival times by X and runs the
//! simulated engines with `--time-scale 1/X` (the real duration of one
//! simulated second), so the load relative to engine capacity is the
//! trace's while the run takes 1/X of the time. Latencies are reported in
//! *trace time*: measured wall-clock times × X (the gateway's own overhead
//! is scaled too; at X = 10 a 1 ms dispatch shows as 10 ms, small against
//! TTFTs of seconds). `--duration S` (trace seconds) or `--limit N`
//! (requests) take a prefix of the trace. Arrivals are open-loop: each
//! request is sent at its scheduled time whatever the completions, and its
//! times are measured from that schedule.
//!
//! The defaults (4 engines, the first 900 s of the trace, X = 10) give
//! ~2 700 requests and about 1.5 minutes per policy. The engines are the
//! simulator's A100-80GB / 8B-model defaults: 10 000 prefill tokens/s and
//! 400 000 KV tokens each. The trace offers ~34 000 prompt tokens/s, of
//! which ~23 000 would still need prefill with perfect prefix reuse, against
//! 40 000 tokens/s of prefill capacity in four engines: a routing policy
//! that loses prefix hits pushes the engines towards saturation, and the
//! working set (millions of tokens) far exceeds their KV caches.
//!
//! # Per policy
//!
//! Every policy of [`PolicyKind::ALL`] (or `--policies a,b`) gets fresh
//! engines and a fresh gateway (new shm segment), so every cache starts
//! cold. Reported: completed requests and output tokens per trace second
//! (from the first arrival to the last completion); TTFT p50/p90/p99;
//! end-to-end latency p50/p99; the engines' aggregate prefix-cache hit rate
//! (Σ `vllm:prefix_cache_hits_total` / Σ `vllm:prefix_cache_queries_total`
//! over the engines, in tokens, read from their `/metrics` at the end);
//! load imbalance as the coefficient of variation (population standard
//! deviation / mean) across engines of their **prefill busy time**, i.e.
//! uncached prompt tokens (`prompt_tokens − prefix_cache_hits`) divided by
//! the common prefill rate, which dominates an engine's busy time for this
//! trace (12 000-token prompts, 340-token answers); the CV of requests
//! served (`vllm:request_success_total`) is in the JSON too; errors
//! (non-200, broken streams, requests still running `--drain-secs` after
//! the last arrival).
//!
//! Output: a table on stdout, `<out>/replay.json`, `<out>/replay.svg`
//! (CDFs of TTFT and latency per policy).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use semlb::routing::PolicyKind;
use serde::Deserialize;
use serde_json::{Value, json};

use super::Common;
use super::end_to_end::{
    Gateway, GatewayError, GatewaySpec, LoadClient, Outcome, SplitMix, Store, ms, p50_90_99, start_engines,
    stream_request,
};
use super::output::{self, Table};
use super::plot::{self, Panel, Series};

/// Tokens per trace block (the Mooncake release's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// The simulator's context limit (`max_model_len` of `semlb __sim`).
const MAX_MODEL_LEN: u32 = 32_768;

/// Token ids are drawn below this (inside the simulator's vocabulary).
const VOCAB: u64 = 50_000;

/// `semlb bench replay` flags.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// The trace [default: <data>/traces/conversation_trace.jsonl].
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Simulated engines behind the gateway (4 to 8 is the intended range).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub engines: usize,
    /// Routing policies to replay with, comma-separated [default: all].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Compress arrival times by this factor and run the engines that much
    /// faster (`--time-scale 1/X`).
    #[arg(long, value_name = "X", default_value_t = 10.0)]
    pub speedup: f64,
    /// Replay the trace's first S seconds (trace time).
    #[arg(long, value_name = "S", default_value_t = 900.0)]
    pub duration: f64,
    /// Replay at most the first N requests (applied with --duration).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Cap on a request's output tokens.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub max_output: u32,
    /// Dispatcher processes of the gateway.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dispatchers: usize,
    /// Real seconds to wait after the last arrival for requests to finish
    /// (the rest count as errors).
    #[arg(long, value_name = "S", default_value_t = 120.0)]
    pub drain_secs: f64,
    /// Salt of the block-id → token-id mapping.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
}

impl ReplayArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            trace: None,
            engines: 4,
            policies: Vec::new(),
            speedup: 10.0,
            duration: 900.0,
            limit: None,
            max_output: 2048,
            dispatchers: 2,
            drain_secs: 120.0,
            seed: 0,
        }
    }
}

/// One line of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, milliseconds from the trace's start.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Answer length in tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block; equal ids, equal prefixes.
    pub hash_ids: Vec<u64>,
}

/// Parses one trace line.
pub fn parse_trace_line(line: &str) -> Result<TraceRecord> {
    serde_json::from_str(line)
        .with_context(|| format!("not a trace record: {}", line.chars().take(120).collect::<String>()))
}

/// The trace's records up to `duration_s` (trace seconds) and `limit`.
fn load_trace(path: &Path, duration_s: f64, limit: Option<usize>) -> Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the trace {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let r = parse_trace_line(line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        if r.timestamp as f64 > duration_s * 1000.0 || limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        out.push(r);
    }
    if out.is_empty() {
        bail!("no trace records selected from {}", path.display());
    }
    Ok(out)
}

/// The 512 token ids of trace block `id` (deterministic in `id` and `seed`).
pub fn block_tokens(id: u64, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix(id.wrapping_mul(0xA24B_AED4_963E_E407) ^ seed.rotate_left(32) ^ 0x5EED);
    (0..TRACE_BLOCK_TOKENS)
        .map(|_| (rng.next_u64() % VOCAB) as u32)
        .collect()
}

/// What one record is sent as.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shaped {
    prompt_tokens: u32,
    output_tokens: u32,
    truncated: bool,
}

/// The prompt and output lengths `r` is sent with.
fn shape(r: &TraceRecord, max_output: u32) -> Shaped {
    let output_tokens = r.output_length.clamp(1, max_output.max(1));
    let room = MAX_MODEL_LEN - output_tokens.min(MAX_MODEL_LEN - 1);
    let prompt_tokens = r.input_length.clamp(1, room);
    Shaped {
        prompt_tokens,
        output_tokens,
        truncated: prompt_tokens < r.input_length,
    }
}

/// The prompt of `r`: its blocks' tokens, cut to `len` (blocks missing
/// from `hash_ids` come from ids no other request uses).
fn prompt_tokens(r: &TraceRecord, len: u32, seed: u64, request: usize) -> Vec<u32> {
    let len = len as usize;
    let mut out = Vec::with_capacity(len);
    let mut i = 0;
    while out.len() < len {
        let id = r
            .hash_ids
            .get(i)
            .copied()
            .unwrap_or(u64::MAX - (request as u64) * 1024 - i as u64);
        let block = block_tokens(id, seed);
        let take = (len - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
        i += 1;
    }
    out
}

/// The JSON body of a completion request with `tokens` as its prompt.
fn completion_body(tokens: &[u32], max_tokens: u32) -> Bytes {
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

/// Population coefficient of variation (std / mean); 0 for fewer than two
/// values or a zero mean.
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

/// The sum of the samples of metric `name` (exact name, any labels) in a
/// Prometheus text exposition; `None` when there is none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || !line.starts_with(name) {
            continue;
        }
        let rest = &line[name.len()..];
        let value = if rest.starts_with('{') {
            rest.rfind('}').map(|i| &rest[i + 1..])
        } else if rest.starts_with(' ') {
            Some(rest)
        } else {
            None // a longer name with this prefix
        };
        // "value [timestamp]"
        if let Some(v) = value
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// One engine's counters at the end of a run.
#[derive(Debug, Clone, Default)]
struct EngineCounters {
    hits: f64,
    queries: f64,
    prompt_tokens: f64,
    generation_tokens: f64,
    requests: f64,
}

impl EngineCounters {
    fn parse(text: &str) -> Self {
        let m = |n| metric_sum(text, n).unwrap_or(0.0);
        Self {
            hits: m("vllm:prefix_cache_hits_total"),
            queries: m("vllm:prefix_cache_queries_total"),
            prompt_tokens: m("vllm:prompt_tokens_total"),
            generation_tokens: m("vllm:generation_tokens_total"),
            requests: m("vllm:request_success_total"),
        }
    }

    /// Prompt tokens the engine had to prefill.
    fn uncached(&self) -> f64 {
        (self.prompt_tokens - self.hits).max(0.0)
    }
}

/// One policy's results.
#[derive(Debug)]
struct PolicyRun {
    policy: PolicyKind,
    outcomes: Vec<(Outcome, u32)>,
    /// Real seconds from the first arrival to the last completion.
    wall_s: f64,
    engines: Vec<EngineCounters>,
    /// Send lag of the generator (real ms behind schedule): p99, max.
    lag_ms: [f64; 2],
}

/// The figures of a [`PolicyRun`], in trace time.
#[derive(Debug, Default)]
struct PolicyStats {
    ok: usize,
    errors: usize,
    req_per_s: f64,
    out_tok_per_s: f64,
    ttft_s: Vec<f64>,
    latency_s: Vec<f64>,
    hit_rate: f64,
    cv_prefill: f64,
    cv_requests: f64,
    first_error: Option<String>,
}

impl PolicyStats {
    fn of(run: &PolicyRun, speedup: f64) -> Self {
        let ok: Vec<&(Outcome, u32)> = run.outcomes.iter().filter(|(o, _)| o.ok()).collect();
        let trace_s = run.wall_s * speedup;
        let (hits, queries) = run
            .engines
            .iter()
            .fold((0.0, 0.0), |(h, q), e| (h + e.hits, q + e.queries));
        Self {
            ok: ok.len(),
            errors: run.outcomes.len() - ok.len(),
            req_per_s: ok.len() as f64 / trace_s.max(1e-9),
            out_tok_per_s: ok.iter().map(|(_, n)| f64::from(*n)).sum::<f64>() / trace_s.max(1e-9),
            ttft_s: ok
                .iter()
                .filter_map(|(o, _)| o.ttft)
                .map(|d| d.as_secs_f64() * speedup)
                .collect(),
            latency_s: ok.iter().map(|(o, _)| o.latency.as_secs_f64() * speedup).collect(),
            hit_rate: if queries > 0.0 { hits / queries } else { 0.0 },
            cv_prefill: coefficient_of_variation(&run.engines.iter().map(EngineCounters::uncached).collect::<Vec<_>>()),
            cv_requests: coefficient_of_variation(&run.engines.iter().map(|e| e.requests).collect::<Vec<_>>()),
            first_error: run.outcomes.iter().find_map(|(o, _)| o.error.clone()),
        }
    }
}

/// Replays `records` against fresh engines and a fresh gateway with `policy`.
fn run_policy(
    args: &ReplayArgs,
    policy: PolicyKind,
    records: &Arc<Vec<TraceRecord>>,
    client: &LoadClient,
    bar: &indicatif::ProgressBar,
) -> Result<PolicyRun> {
    bar.set_message(format!("replay {policy}: starting"));
    let engines = start_engines(args.engines, 1.0 / args.speedup)?;
    let spec = GatewaySpec {
        dispatchers: args.dispatchers,
        policy: Some(policy),
        store: Store::Shm,
        shm_size: "256MiB".into(),
        tag: format!("replay-{policy}"),
    };
    let gateway = match Gateway::start(&spec, &engines, client) {
        Ok(g) => g,
        Err(GatewayError::UnknownFlag(e)) => bail!("starting the gateway with --policy {policy}: {e}"),
        Err(GatewayError::Other(e)) => return Err(e.context(format!("starting the gateway with --policy {policy}"))),
    };
    bar.set_message(format!("replay {policy}"));
    let addr = gateway.addr().to_owned();
    let (speedup, seed, max_output) = (args.speedup, args.seed, args.max_output);
    let drain = Duration::from_secs_f64(args.drain_secs.max(0.0));
    let records = records.clone();
    let http = client.http.clone();
    let progress = bar.clone();
    let (outcomes, wall_s, lag_ms) = client.runtime.block_on(async move {
        let t0 = records[0].timestamp;
        let start = Instant::now() + Duration::from_millis(50);
        // Bodies are built ahead on a thread of their own, so that bursts of
        // simultaneous arrivals are not delayed by building them.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(Shaped, Bytes)>(64);
        let ahead = records.clone();
        std::thread::spawn(move || {
            for (i, r) in ahead.iter().enumerate() {
                let shaped = shape(r, max_output);
                let body = completion_body(&prompt_tokens(r, shaped.prompt_tokens, seed, i), shaped.output_tokens);
                if tx.blocking_send((shaped, body)).is_err() {
                    return;
                }
            }
        });
        let mut tasks = Vec::with_capacity(records.len());
        let mut lags = Vec::with_capacity(records.len());
        for r in records.iter() {
            let Some((shaped, body)) = rx.recv().await else {
                break;
            };
            let due = start + Duration::from_secs_f64((r.timestamp - t0) as f64 / 1000.0 / speedup);
            tokio::time::sleep_until(due.into()).await;
            lags.push(due.elapsed().as_secs_f64() * 1e3);
            let (http, addr, progress) = (http.clone(), addr.clone(), progress.clone());
            tasks.push(tokio::spawn(async move {
                let o = stream_request(&http, &addr, "/v1/completions", body, due).await;
                progress.inc(1);
                (o, shaped.output_tokens)
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
        // Outcomes are in record order: arrival + latency is a completion.
        let wall = outcomes
            .iter()
            .zip(records.iter())
            .filter(|((o, _), _)| o.ok())
            .map(|((o, _), r)| (r.timestamp - t0) as f64 / 1000.0 / speedup + o.latency.as_secs_f64())
            .fold(0.0, f64::max);
        let mut l = lags;
        output::sort(&mut l);
        (
            outcomes,
            wall,
            [output::quantile(&l, 0.99), l.last().copied().unwrap_or(0.0)],
        )
    });
    // The engines' counters, straight from each engine.
    let mut counters = Vec::with_capacity(engines.len());
    for e in &engines {
        let (status, text) = client
            .get(&e.addr, "/metrics")
            .with_context(|| format!("reading /metrics of {}", e.addr))?;
        if status != 200 {
            bail!("GET /metrics of {} answered {status}", e.addr);
        }
        counters.push(EngineCounters::parse(&text));
    }
    drop(gateway);
    drop(engines);
    Ok(PolicyRun {
        policy,
        outcomes,
        wall_s,
        engines: counters,
        lag_ms,
    })
}

/// Runs the report.
pub fn run(args: &ReplayArgs) -> Result<()> {
    if args.engines == 0 || args.dispatchers == 0 {
        bail!("--engines and --dispatchers must be at least 1");
    }
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!("--speedup must be a positive number");
    }
    let path = match &args.trace {
        Some(p) => p.clone(),
        None => args
            .common
            .data_dir()
            .map(|d| d.join("traces/conversation_trace.jsonl"))
            .context("no trace: pass --trace PATH or --data DIR (with traces/conversation_trace.jsonl)")?,
    };
    let mut records = load_trace(&path, args.duration, args.limit)?;
    // Arrival order (the file is sorted; make sure).
    records.sort_by_key(|r| r.timestamp);
    let truncated = records.iter().filter(|r| shape(r, args.max_output).truncated).count();
    let records = Arc::new(records);
    let policies: Vec<PolicyKind> = if args.policies.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policies.clone()
    };
    let client = LoadClient::new()?;
    let bar = output::progress((records.len() * policies.len()) as u64, "replay");
    let mut runs = Vec::new();
    for policy in &policies {
        runs.push(run_policy(args, *policy, &records, &client, &bar)?);
    }
    bar.finish_and_clear();

    let span_s = (records[records.len() - 1].timestamp - records[0].timestamp) as f64 / 1000.0;
    let offered = records.len() as f64 / span_s.max(1e-9);
    let mut table = Table::new([
        "policy",
        "req/s",
        "out tok/s",
        "TTFT p50 s",
        "p90",
        "p99",
        "latency p50 s",
        "p99",
        "prefix hit rate",
        "prefill CV",
        "requests CV",
        "errors",
    ]);
    let mut policies_json = Vec::new();
    let mut stats = Vec::new();
    for r in &runs {
        let s = PolicyStats::of(r, args.speedup);
        let t = p50_90_99(&s.ttft_s);
        let l = p50_90_99(&s.latency_s);
        let sec = ms;
        table.row([
            r.policy.to_string(),
            format!("{:.2}", s.req_per_s),
            format!("{:.0}", s.out_tok_per_s),
            sec(t[0]),
            sec(t[1]),
            sec(t[2]),
            sec(l[0]),
            sec(l[2]),
            format!("{:.1}%", s.hit_rate * 100.0),
            format!("{:.3}", s.cv_prefill),
            format!("{:.3}", s.cv_requests),
            s.errors.to_string(),
        ]);
        policies_json.push(json!({
            "policy": r.policy.name(),
            "completed": s.ok,
            "errors": s.errors,
            "first_error": s.first_error,
            "requests_per_s": s.req_per_s,
            "output_tokens_per_s": s.out_tok_per_s,
            "ttft_s": {"p50": t[0], "p90": t[1], "p99": t[2]},
            "latency_s": {"p50": l[0], "p90": l[1], "p99": l[2]},
            "prefix_cache_hit_rate": s.hit_rate,
            "imbalance_cv_prefill_busy": s.cv_prefill,
            "imbalance_cv_requests": s.cv_requests,
            "wall_s": r.wall_s,
            "generator_lag_ms": {"p99": r.lag_ms[0], "max": r.lag_ms[1]},
            "engines": r.engines.iter().map(|e| json!({
                "requests": e.requests,
                "prompt_tokens": e.prompt_tokens,
                "prefix_cache_hits": e.hits,
                "prefix_cache_queries": e.queries,
                "uncached_prompt_tokens": e.uncached(),
                "generation_tokens": e.generation_tokens,
            })).collect::<Vec<Value>>(),
        }));
        stats.push(s);
    }
    let title = format!(
        "semlb bench replay: {} requests ({:.0} s of trace, {:.2} req/s offered) from {}, \
         {} simulated engines, speedup {}x (times in trace seconds); {} prompts truncated to fit {} tokens",
        records.len(),
        span_s,
        offered,
        path.display(),
        args.engines,
        args.speedup,
        truncated,
        MAX_MODEL_LEN
    );
    output::print_table(&title, &table);
    println!(
        "req/s and out tok/s per trace second; prefix hit rate: Σ hits / Σ queries (tokens) over the engines; \
         prefill CV: coefficient of variation across engines of uncached prompt tokens (prefill busy time); \
         requests CV: of requests served."
    );
    for (r, s) in runs.iter().zip(&stats) {
        if let Some(e) = &s.first_error {
            println!("{}: {} errors, first: {e}", r.policy, s.errors);
        }
        if r.lag_ms[0] > 50.0 {
            println!(
                "{}: the load generator fell behind its schedule (p99 {:.0} ms, max {:.0} ms real)",
                r.policy, r.lag_ms[0], r.lag_ms[1]
            );
        }
    }
    let value = json!({
        "report": "replay",
        "trace": path.display().to_string(),
        "requests": records.len(),
        "trace_span_s": span_s,
        "offered_requests_per_s": offered,
        "truncated_prompts": truncated,
        "engines": args.engines,
        "dispatchers": args.dispatchers,
        "speedup": args.speedup,
        "engine_time_scale": 1.0 / args.speedup,
        "max_output": args.max_output,
        "times": "trace seconds (measured wall-clock x speedup)",
        "policies": policies_json,
    });
    let json_path = output::write_json(&args.common.out, "replay", &value)?;
    let svg_path = args.common.out.join("replay.svg");
    let panel = |title: &str, pick: &dyn Fn(&PolicyStats) -> &Vec<f64>| Panel {
        title: title.to_owned(),
        x_label: "seconds (trace time)".into(),
        log_x: true,
        series: runs
            .iter()
            .zip(&stats)
            .map(|(r, s)| Series {
                label: r.policy.to_string(),
                values: pick(s).clone(),
            })
            .collect(),
    };
    plot::cdf_svg(
        &svg_path,
        &[
            panel("TTFT per routing policy", &|s| &s.ttft_s),
            panel("end-to-end latency per routing policy", &|s| &s.latency_s),
        ],
    )?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_lines_parse() {
        let r = parse_trace_line(r#"{"timestamp": 27, "input_length": 700, "output_length": 3, "hash_ids": [0, 46]}"#)
            .unwrap();
        assert_eq!(
            r,
            TraceRecord {
                timestamp: 27,
                input_length: 700,
                output_length: 3,
                hash_ids: vec![0, 46]
            }
        );
        assert!(parse_trace_line(r#"{"timestamp": 1}"#).is_err());
        assert!(parse_trace_line("not json").is_err());
    }

    #[test]
    fn equal_block_ids_give_equal_tokens_and_different_ids_differ() {
        let a = block_tokens(42, 0);
        assert_eq!(a.len(), TRACE_BLOCK_TOKENS);
        assert_eq!(a, block_tokens(42, 0));
        assert_ne!(a, block_tokens(43, 0));
        assert_ne!(a, block_tokens(42, 1));
        assert!(a.iter().all(|t| u64::from(*t) < VOCAB));
        // Two requests sharing their first block share its 512 tokens.
        let r1 = TraceRecord {
            timestamp: 0,
            input_length: 700,
            output_length: 5,
            hash_ids: vec![0, 1],
        };
        let r2 = TraceRecord {
            hash_ids: vec![0, 2],
            ..r1.clone()
        };
        let (p1, p2) = (prompt_tokens(&r1, 700, 0, 0), prompt_tokens(&r2, 700, 0, 1));
        assert_eq!((p1.len(), p2.len()), (700, 700));
        assert_eq!(p1[..512], p2[..512]);
        assert_ne!(p1[512..], p2[512..]);
        assert_eq!(p1[512..], block_tokens(1, 0)[..188]);
    }

    #[test]
    fn long_requests_are_cut_to_the_context() {
        let r = TraceRecord {
            timestamp: 0,
            input_length: 40_000,
            output_length: 3_000,
            hash_ids: (0..79).collect(),
        };
        let s = shape(&r, 2048);
        assert_eq!(
            (s.prompt_tokens, s.output_tokens, s.truncated),
            (32_768 - 2048, 2048, true)
        );
        let short = TraceRecord {
            input_length: 100,
            output_length: 0,
            hash_ids: vec![1],
            ..r
        };
        let s = shape(&short, 2048);
        assert_eq!((s.prompt_tokens, s.output_tokens, s.truncated), (100, 1, false));
    }

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

    #[test]
    fn coefficient_of_variation_is_std_over_mean() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), 0.0);
        assert!((coefficient_of_variation(&[1.0, 3.0]) - 0.5).abs() < 1e-12);
        assert!((coefficient_of_variation(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) - 0.4).abs() < 1e-12);
        assert_eq!(coefficient_of_variation(&[3.0]), 0.0);
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), 0.0);
    }

    #[test]
    fn metrics_text_sums_one_name_over_labels() {
        let text = "# HELP vllm:prefix_cache_hits Prefix cache hits.\n\
                    # TYPE vllm:prefix_cache_hits counter\n\
                    vllm:prefix_cache_hits_total{model_name=\"semlb-sim\"} 640.0\n\
                    vllm:prefix_cache_hits_total{model_name=\"other\",x=\"a}b\"} 10\n\
                    vllm:prefix_cache_queries_total{model_name=\"semlb-sim\"} 1000.0\n\
                    vllm:request_success_total 5 1700000000\n";
        assert_eq!(metric_sum(text, "vllm:prefix_cache_hits_total"), Some(650.0));
        assert_eq!(metric_sum(text, "vllm:prefix_cache_queries_total"), Some(1000.0));
        assert_eq!(metric_sum(text, "vllm:request_success_total"), Some(5.0));
        assert_eq!(metric_sum(text, "vllm:prefix_cache"), None);
        assert_eq!(metric_sum(text, "vllm:missing_total"), None);
        let c = EngineCounters::parse(text);
        assert_eq!((c.hits, c.queries, c.uncached()), (650.0, 1000.0, 0.0));
    }
}
