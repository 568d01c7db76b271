//! `semlb bench state`: what keeping the routing state is worth, as
//! clients see it (issue 18's two benchmarks).
//!
//! - **restart**: a gateway in front of simulated engines serves
//!   closed-loop multi-turn chats (each conversation on its own ~1 500-token
//!   system prompt, streamed, the next turn sent the instant the answer
//!   ends); after a warm-up it is stopped with SIGTERM and started again on
//!   the same segment name and port, once with `keep_segment = true` (hot
//!   restart: the new supervisor adopts the tables) and once with `false`.
//!   The clients carry on with their conversations. Reported for the first
//!   60 s after the restart (and the 30 s before it): the share of prompt
//!   tokens the engines found cached (`usage.prompt_tokens_details.cached_tokens`
//!   over `prompt_tokens`), TTFT p50/p90, requests, and the requests the
//!   restart's gap refused.
//! - **hosts**: two gateways (two supervisors and segments) on one private
//!   `redis-server`, the same engines; every turn goes to one of the two
//!   at random (as an L4 balancer in front of gateway hosts would send
//!   it), once with both on one namespace (they share what they learn),
//!   once on two (they do not), and once with no Redis at all, each host
//!   on its own segment, following the engines' KV cache events with
//!   `[policy.prefix] source = "precise"` (each host sees what the engines
//!   hold, whichever host sent it: issue 20). Reported: cached share and
//!   TTFT p50/p90.
//!
//! Both use the same engines and client load in each mode, one mode after
//! the other. Times are wall-clock (the engines run at `--time-scale`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::Common;
use crate::output::{Table, print_table, write_json};
use crate::sse_client::{Answers, Sampled, stream};
use semlb_test_support::TempFile;
use semlb_test_support::process::{Proc, ProcBuilder, Stderr};
use semlb_test_support::rng::Rng;

/// `semlb bench state`.
#[derive(Debug, Clone, Args)]
pub struct StateArgs {
    /// Output directory and Redis options.
    #[command(flatten)]
    pub common: Common,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Conversations in flight at once (closed loop).
    #[arg(long, default_value_t = 24)]
    pub clients: usize,
    /// Turns per conversation before the client starts another.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// The engines' `--time-scale` (real seconds per simulated second).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Seconds of load before the restart.
    #[arg(long, default_value_t = 30)]
    pub warm_secs: u64,
    /// Seconds measured after the restart (and per `hosts` mode).
    #[arg(long, default_value_t = 60)]
    pub window_secs: u64,
    /// Which parts: `restart`, `hosts` (both by default).
    #[arg(long, value_delimiter = ',', default_value = "restart,hosts")]
    pub parts: Vec<String>,
}

/// One answered (or refused) request.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Which conversation it is a turn of.
    conversation: usize,
    /// When it was sent, since the run's start.
    at: Duration,
    /// Time to the first content chunk (`None`: it failed).
    ttft: Option<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl Sampled for Sample {
    fn ttft(&self) -> Option<Duration> {
        self.ttft
    }
    fn tokens(&self) -> (u64, u64) {
        (self.prompt_tokens, self.cached_tokens)
    }
}

/// Figures of the samples sent in one window.
#[derive(Debug, Default)]
struct Figures {
    requests: usize,
    failed: usize,
    cached_share: f64,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
}

impl Figures {
    fn of(samples: &[Sample], from: Duration, to: Duration) -> Figures {
        let window = Answers::of(samples.iter().filter(|s| s.at >= from && s.at < to));
        Figures {
            requests: window.answered(),
            failed: window.failed(),
            cached_share: window.cached_share(),
            ttft_p50_ms: window.ttft_ms(0.5),
            ttft_p90_ms: window.ttft_ms(0.9),
        }
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.requests,
            "failed": self.failed,
            "cached_share": self.cached_share,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p90_ms": self.ttft_p90_ms,
        })
    }

    fn cells(&self, what: &str) -> Vec<String> {
        vec![
            what.to_owned(),
            self.requests.to_string(),
            self.failed.to_string(),
            format!("{:.1} %", 100.0 * self.cached_share),
            format!("{:.0}", self.ttft_p50_ms),
            format!("{:.0}", self.ttft_p90_ms),
        ]
    }
}

fn header() -> Table {
    Table::new([
        "run",
        "requests",
        "failed",
        "cached share",
        "TTFT p50 ms",
        "TTFT p90 ms",
    ])
}

/// Runs the parts asked for.
pub fn run(args: &StateArgs) -> Result<()> {
    let mut report = serde_json::Map::new();
    if args.parts.iter().any(|p| p == "restart") {
        report.insert("restart".into(), restart(args)?);
    }
    if args.parts.iter().any(|p| p == "hosts") {
        if args.common.no_redis {
            eprintln!("hosts: skipped (--no-redis)");
        } else {
            report.insert("hosts".into(), hosts(args)?);
        }
    }
    let path = write_json(&args.common.out, "state", &Value::Object(report))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Fresh simulated engines: every mode starts with empty KV caches.
fn start_engines(args: &StateArgs) -> Result<Vec<Proc>> {
    start_sims(args.engines, &args.time_scale.to_string(), &[])
}

/// `n` fresh simulated engines at `time_scale`, with `extra` arguments of
/// `semlb __sim`.
pub(crate) fn start_sims(n: usize, time_scale: &str, extra: &[&str]) -> Result<Vec<Proc>> {
    (0..n)
        .map(|_| {
            let mut argv = vec!["__sim", "--listen", "127.0.0.1:0", "--time-scale", time_scale];
            argv.extend_from_slice(extra);
            ProcBuilder::new(argv).try_start().map_err(anyhow::Error::from)
        })
        .collect()
}

/// `semlb serve` on segment `shm` and `listen`, in front of `engines`,
/// with `config` (TOML) and `extra` flags, once it answers `/health`.
pub(crate) fn serve(shm: &str, listen: &str, engines: &[Proc], config: &TempFile, extra: &[&str]) -> Result<Proc> {
    let mut args: Vec<String> = ["serve", "--listen", listen, "--shm-name", shm, "--shm-size", "256MiB"]
        .map(str::to_owned)
        .into();
    // Two dispatchers unless `extra` says how many.
    if !extra.contains(&"--dispatchers") {
        args.extend(["--dispatchers", "2"].map(str::to_owned));
    }
    args.extend(["--responders", "1", "--config", config.path()].map(str::to_owned));
    for e in engines {
        args.extend(["--backend".to_owned(), format!("http://{}", e.addr)]);
    }
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let proc = ProcBuilder::new(&args).stderr(Stderr::Tail(40)).try_start()?;
    wait_health(&proc.addr)?;
    Ok(proc)
}

/// Waits until `GET /health` answers 200.
pub(crate) fn wait_health(addr: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !semlb_test_support::http::http(addr, "GET", "/health", None, &[]).is_ok_and(|r| r.status == 200) {
        if Instant::now() > deadline {
            bail!("the gateway at {addr} did not become ready");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn restart(args: &StateArgs) -> Result<Value> {
    let mut table = header();
    let mut out = serde_json::Map::new();
    for keep in [true, false] {
        let engines = &start_engines(args)?;
        let mode = if keep { "hot restart" } else { "cold restart" };
        let shm = semlb_test_support::process::unique("bench-state", if keep { "hot" } else { "cold" });
        let port = semlb_test_support::redis::free_port();
        let listen = format!("127.0.0.1:{port}");
        let config = TempFile::try_new("bench-state", &format!("keep_segment = {keep}\n"))?;
        let mut gateway = serve(&shm, &listen, engines, &config, &[])?;
        let addrs = vec![listen.parse::<SocketAddr>()?];
        let load = Load::start(args, addrs, 1);
        std::thread::sleep(Duration::from_secs(args.warm_secs));
        let stopped_at = load.elapsed();
        gateway.stop();
        gateway = serve(&shm, &listen, engines, &config, &[])?;
        let ready_at = load.elapsed();
        std::thread::sleep(Duration::from_secs(args.window_secs));
        let samples = load.finish();
        gateway.stop();
        let _ = shm_layout::Segment::remove(&shm);
        let before = Figures::of(&samples, stopped_at.saturating_sub(Duration::from_secs(30)), stopped_at);
        let gap = Figures::of(&samples, stopped_at, ready_at);
        let after = Figures::of(&samples, ready_at, ready_at + Duration::from_secs(args.window_secs));
        // The turns that cross the restart: each conversation's first turn
        // answered after it (of conversations begun before it).
        let begun: std::collections::HashSet<usize> = samples
            .iter()
            .filter(|s| s.at < stopped_at)
            .map(|s| s.conversation)
            .collect();
        let mut seen = std::collections::HashSet::new();
        let crossing: Vec<Sample> = samples
            .iter()
            .filter(|s| s.at >= stopped_at && s.ttft.is_some() && begun.contains(&s.conversation))
            .filter(|s| seen.insert(s.conversation))
            .copied()
            .collect();
        let crossing = Figures::of(&crossing, Duration::ZERO, Duration::MAX);
        table.row(before.cells(&format!("{mode}: 30 s before")));
        table.row(after.cells(&format!("{mode}: {} s after", args.window_secs)));
        table.row(crossing.cells(&format!("{mode}: first turn after, per conversation")));
        out.insert(
            mode.replace(' ', "_"),
            json!({
                "before": before.json(),
                "after": after.json(),
                "first_turn_after": crossing.json(),
                "restart_gap_ms": (ready_at - stopped_at).as_secs_f64() * 1e3,
                "sent_during_gap": gap.requests + gap.failed,
            }),
        );
    }
    print_table("state: a restart, with and without keeping the segment", &table);
    Ok(Value::Object(out))
}

/// The engines' KV events, published as vLLM's `--kv-events-config` says.
const KV_EVENTS: [&str; 2] = [
    "--kv-events-config",
    r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#,
];

/// How the two hosts of `hosts` know where prefixes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostsMode {
    /// One Redis namespace: they share what they learn.
    Shared,
    /// A namespace each: each knows only what it sent.
    Apart,
    /// No Redis, a segment each, both following the engines' KV events.
    Precise,
}

impl HostsMode {
    fn label(self) -> &'static str {
        match self {
            Self::Shared => "one namespace",
            Self::Apart => "two namespaces",
            Self::Precise => "no Redis, KV events (precise)",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Apart => "apart",
            Self::Precise => "precise",
        }
    }
}

/// A configuration listing `engines` with their KV event endpoints, the
/// precise prefix source on.
fn precise_config(engines: &[Proc]) -> Result<String> {
    let mut text = "[policy.prefix]\nsource = \"precise\"\n".to_owned();
    for e in engines {
        let table = semlb_test_support::gateway::kv_backend_table(e)
            .with_context(|| format!("engine {} publishes no KV events", e.addr))?;
        text.push_str(&table);
    }
    Ok(text)
}

fn hosts(args: &StateArgs) -> Result<Value> {
    let redis = crate::redis_server::BenchRedis::for_run(&args.common)?
        .context("hosts needs a Redis (redis-server, or --redis-url)")?;
    let mut table = header();
    let mut out = serde_json::Map::new();
    for mode in [HostsMode::Shared, HostsMode::Apart, HostsMode::Precise] {
        let events = mode == HostsMode::Precise;
        let engines = &start_sims(
            args.engines,
            &args.time_scale.to_string(),
            if events { &KV_EVENTS } else { &[] },
        )?;
        let config = TempFile::try_new(
            "bench-state",
            &if events {
                precise_config(engines)?
            } else {
                String::new()
            },
        )?;
        let run = semlb_test_support::process::unique("bench-hosts", mode.tag());
        let gateways: Vec<Proc> = ["a", "b"]
            .iter()
            .map(|host| {
                let namespace = match mode {
                    HostsMode::Shared => run.clone(),
                    _ => format!("{run}-{host}"),
                };
                let shm = format!("{run}-{host}");
                let redis_flags = [
                    "--store",
                    "redis",
                    "--redis-url",
                    redis.url(),
                    "--redis-namespace",
                    &namespace,
                ];
                // The precise hosts list the engines in their configuration.
                let (backends, extra): (&[Proc], &[&str]) = if events { (&[], &[]) } else { (engines, &redis_flags) };
                serve(&shm, "127.0.0.1:0", backends, &config, extra)
            })
            .collect::<Result<_>>()?;
        let mode = mode.label();
        let addrs = gateways
            .iter()
            .map(|g| g.addr.parse::<SocketAddr>())
            .collect::<Result<Vec<_>, _>>()?;
        let load = Load::start(args, addrs, 2);
        std::thread::sleep(Duration::from_secs(args.window_secs));
        let samples = load.finish();
        let figures = Figures::of(&samples, Duration::ZERO, Duration::MAX);
        table.row(figures.cells(mode));
        out.insert(mode.replace(' ', "_"), figures.json());
        for (mut g, host) in gateways.into_iter().zip(["a", "b"]) {
            g.stop();
            let _ = shm_layout::Segment::remove(&format!("{run}-{host}"));
        }
    }
    print_table("state: two gateway hosts, every turn to either", &table);
    Ok(Value::Object(out))
}

/// The closed-loop clients, on a runtime of their own.
struct Load {
    runtime: tokio::runtime::Runtime,
    started: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// `args.clients` conversations at once, each turn to one of `addrs`
    /// (chosen at random when there are `spread` of them).
    fn start(args: &StateArgs, addrs: Vec<SocketAddr>, spread: usize) -> Load {
        let runtime = crate::sse_client::runtime();
        let started = Instant::now();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..args.clients)
            .map(|client| {
                let (addrs, stop, samples, turns) = (addrs.clone(), stop.clone(), samples.clone(), args.turns);
                runtime.spawn(async move {
                    let mut rng = Rng::from_seed(client as u64 + 1);
                    let mut conversation = client;
                    // The clients' first conversations have random lengths:
                    // their later ones then start and end at different
                    // times (with equal turns they would all stay in step).
                    let mut length = 1 + rng.index(turns);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        converse(&addrs, spread, &mut rng, conversation, length, started, &stop, &samples).await;
                        conversation += 1000;
                        length = turns;
                    }
                })
            })
            .collect();
        Load {
            runtime,
            started,
            stop,
            samples,
            tasks,
        }
    }

    fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Stops the clients (their requests in flight finish) and returns
    /// every sample.
    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let Load {
            runtime,
            samples,
            tasks,
            ..
        } = self;
        runtime.block_on(async {
            for t in tasks {
                let _ = t.await;
            }
        });
        let mut all = samples.lock().unwrap_or_else(|p| p.into_inner()).clone();
        all.sort_by_key(|s| s.at);
        all
    }
}

/// A system prompt of about 1 500 tokens of its own for conversation `id`.
fn system_prompt(id: usize) -> String {
    let mut text = format!("You are assistant number {id} of the operations team. ");
    for i in 0..60 {
        text.push_str(&format!(
            "Rule {i} of handbook {id}: record every change to cluster {} in the log before applying it. ",
            id * 7 + i
        ));
    }
    text
}

/// One conversation of `turns` turns, each to one of `addrs`; a refused
/// turn is recorded and sent again after 50 ms.
#[allow(clippy::too_many_arguments)]
async fn converse(
    addrs: &[SocketAddr],
    spread: usize,
    rng: &mut Rng,
    id: usize,
    turns: usize,
    started: Instant,
    stop: &std::sync::atomic::AtomicBool,
    samples: &Mutex<Vec<Sample>>,
) {
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt(id)}),
        json!({"role": "user", "content": format!("Conversation {id}: what do I do first?")}),
    ];
    let mut turn = 0;
    while turn < turns && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let addr = addrs[if spread > 1 { rng.index(addrs.len()) } else { 0 }];
        let body = json!({
            "model": "semlb-sim",
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": 48,
            "ignore_eos": true,
        });
        let at = started.elapsed();
        match stream(addr, &body, &[("api-key", "sk-bench")]).await {
            Ok(answer) => {
                samples.lock().unwrap_or_else(|p| p.into_inner()).push(Sample {
                    conversation: id,
                    at,
                    ttft: Some(answer.ttft),
                    prompt_tokens: answer.prompt_tokens,
                    cached_tokens: answer.cached_tokens,
                });
                messages.push(json!({"role": "assistant", "content": answer.text}));
                messages.push(json!({"role": "user", "content": format!("And after step {}?", turn + 1)}));
                turn += 1;
            }
            Err(_) => {
                samples.lock().unwrap_or_else(|p| p.into_inner()).push(Sample {
                    conversation: id,
                    at,
                    ttft: None,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
