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
//! The processes are `semlb-test-support`'s
//! ([`Proc`](semlb_test_support::process::Proc), and the gateway by
//! [`start_gateway`]); they and the HTTP helpers here ([`LoadClient`],
//! [`SseScan`], ...) are shared with [`super::replay`].
//!
//! | module | what it holds |
//! | --- | --- |
//! | [`cluster`] | the engines and the gateway, on shm or Redis |
//! | [`client`] | the HTTP load client, one streamed request and its [`Outcome`] |
//! | [`dialogue`] | the HH-RLHF conversations |
//! | [`load`] | the open-loop and closed-loop phases |
//! | [`stats`] | the figures of a phase and of a store |
//! | [`report`] | the table, `e2e.json` and `e2e.svg` |
//! | here | the flags and the run: each store in turn, both phases |

mod client;
mod cluster;
mod dialogue;
mod load;
mod report;
mod stats;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};

pub(crate) use self::client::parse_dispatch;
pub(crate) use self::client::{LoadClient, Outcome, SseScan, request_with};
pub(crate) use self::cluster::{GatewayError, GatewaySpec, Store, start_engines, start_gateway, unique_name};
use self::dialogue::load_dialogues;
#[cfg(test)]
pub(crate) use self::dialogue::parse_dialogue;
pub(crate) use self::dialogue::{Dialogue, read_dialogues};
use self::load::{Pool, closed_loop, open_loop};
use self::stats::{PhaseStats, StoreRun};
pub(crate) use self::stats::{ms, p50_90_99};
use super::Common;
use super::output;
use super::redis_server::BenchRedis;

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
    let engines = start_engines(args.engines, args.time_scale, None, true, false)?;
    let spec = GatewaySpec {
        dispatchers: args.dispatchers,
        policy: None,
        store,
        shm_size: "64MiB".into(),
        tag: format!("e2e-{name}"),
        config: None,
        kv_events: false,
        admin_token: None,
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
        let warm = client
            .runtime
            .block_on(load::warm_up(&client.http, &addr, &pool, args.max_tokens));
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

    report::write(args, &source, &runs)
}
