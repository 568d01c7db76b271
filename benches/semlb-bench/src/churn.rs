//! `semlb bench churn`: engines that die under a streamed load (issue
//! 44's benchmark).
//!
//! `--engines` simulated engines in real time (`semlb __sim`, scaled by
//! `--time-scale`) serve `--clients` closed-loop clients, each streaming
//! long answers (`--max-tokens`, `ignore_eos`) and sending its next
//! request the instant the last one ends. Every `--period-secs` one engine
//! (in turn) is killed with a real `SIGKILL`, mid-answer, and started again
//! on the same port `--down-secs` later with an empty cache, as an engine
//! lost to an out-of-memory kill or a driver reset comes back. Each front
//! runs on fresh engines with the same schedule:
//!
//! | front | what it is |
//! | --- | --- |
//! | `semlb, resumption on` | the default policy with `[resume] enabled = true` (the default): a stream cut by the kill continues on another engine ([`semlb::dispatcher::resume`]) |
//! | `semlb, resumption off` | the same with `[resume] enabled = false`: a cut stream ends with an error event |
//! | a peer router (`--peers`, default `smg`) | installed as `semlb bench replay` installs it, its own defaults |
//!
//! Reported per front, as the clients saw it: streams sent, completed (a
//! 200, every token asked for, `data: [DONE]` last and no error event)
//! and how the others failed; goodput (output tokens of completed answers
//! per second); TTFT p50/p99 of the completed ones. From the engines'
//! own counters (`/metrics`, read just before each kill and at the end):
//! the prompt tokens they prefilled (not found in their prefix cache) and
//! the tokens they generated beyond what the completed answers needed
//! (wasted prefill and wasted decode: cut answers, and a continuation's
//! second prefill of the prompt and the text already sent). For semlb,
//! the resumptions its `/metrics` counted. A failed stream is not sent
//! again by the client (a real client would, paying its prefill once
//! more): the table counts what the front delivered.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use nix::sys::signal::{Signal, kill};
use serde_json::{Value, json};

use crate::Common;
use crate::output::{Table, print_table, write_json};
use crate::replay::Peer;
use crate::replay::counters::{metric_samples, metric_sum};
use crate::replay::peers::{PeerProc, install};
use crate::sse_client::{Answer, stream};
use semlb_test_support::TempFile;
use semlb_test_support::process::{Proc, ProcBuilder};

/// `semlb bench churn`.
#[derive(Debug, Clone, Args)]
pub struct ChurnArgs {
    /// Output directory.
    #[command(flatten)]
    pub common: Common,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// One engine is killed every this many seconds (each in turn).
    #[arg(long, default_value_t = 20)]
    pub period_secs: u64,
    /// A killed engine starts again this many seconds later.
    #[arg(long, default_value_t = 5)]
    pub down_secs: u64,
    /// Seconds of load per front.
    #[arg(long, default_value_t = 180)]
    pub secs: u64,
    /// Closed-loop streaming clients.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// Output tokens of every answer.
    #[arg(long, default_value_t = 400)]
    pub max_tokens: u64,
    /// The simulated engines' time scale (`semlb __sim --time-scale`):
    /// 0.5 runs a 10 ms decode step in 5 ms.
    #[arg(long, default_value = "0.5")]
    pub time_scale: String,
    /// Peer routers beside semlb (comma-separated; `none` for none).
    #[arg(long, value_delimiter = ',', default_value = "smg")]
    pub peers: Vec<String>,
    /// Where the peer routers' virtual environments are [default:
    /// target/bench-peers].
    #[arg(long, value_name = "DIR")]
    pub peers_dir: Option<std::path::PathBuf>,
    /// Dispatcher processes of the gateway.
    #[arg(long, default_value_t = 2)]
    pub dispatchers: usize,
}

/// A front the load runs through.
#[derive(Debug, Clone, Copy)]
enum Front {
    /// semlb, resumption on or off.
    Semlb { resume: bool },
    /// A peer router.
    Peer(Peer),
}

impl Front {
    fn name(self) -> String {
        match self {
            Self::Semlb { resume: true } => "semlb, resumption on".to_owned(),
            Self::Semlb { resume: false } => "semlb, resumption off".to_owned(),
            Self::Peer(p) => p.name().to_owned(),
        }
    }
}

/// How one stream ended, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// 200, every token, `[DONE]`, no error event.
    Completed,
    /// An error event came (whatever followed).
    ErrorEvent,
    /// The stream ended without `[DONE]`, or the connection broke.
    Cut,
    /// `[DONE]` came, but with fewer tokens than asked for.
    Short,
    /// No 200 (or no token at all).
    Refused,
}

/// One stream.
#[derive(Debug, Clone, Copy)]
struct Sample {
    outcome: Outcome,
    ttft: Option<Duration>,
    completion_tokens: u64,
    /// Prompt tokens not found cached, as the answer's usage says.
    prefilled: u64,
}

/// The engines' counters, summed.
#[derive(Debug, Clone, Copy, Default)]
struct EngineWork {
    /// Prompt tokens prefilled (processed, not found cached).
    prefilled: f64,
    /// Tokens generated.
    generated: f64,
}

/// The simulated engines of one front's run.
struct Fleet {
    engines: Vec<Proc>,
    ports: Vec<u16>,
    time_scale: String,
    /// What the killed engines had done before they died.
    work: EngineWork,
}

impl Fleet {
    fn start(n: usize, time_scale: &str) -> Result<Self> {
        let engines = crate::state::start_sims(n, time_scale, &[])?;
        let ports = engines
            .iter()
            .map(|e| {
                e.addr
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .context("engine port")
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            engines,
            ports,
            time_scale: time_scale.to_owned(),
            work: EngineWork::default(),
        })
    }

    fn urls(&self) -> Vec<String> {
        self.engines.iter().map(|e| format!("http://{}", e.addr)).collect()
    }

    /// Reads engine `i`'s counters, then kills it with SIGKILL.
    fn kill(&mut self, i: usize) {
        self.add_counters(i);
        let _ = kill(self.engines[i].pid(), Signal::SIGKILL);
        let _ = self.engines[i].child.wait();
    }

    /// Starts engine `i` again on its port (tried for a few seconds: the
    /// port may still be held a moment).
    fn restart(&mut self, i: usize) -> Result<()> {
        let listen = format!("127.0.0.1:{}", self.ports[i]);
        let argv = ["__sim", "--listen", &listen, "--time-scale", &self.time_scale];
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match ProcBuilder::new(argv).try_start() {
                Ok(p) => {
                    self.engines[i] = p;
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => return Err(e.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    fn add_counters(&mut self, i: usize) {
        let w = engine_work(&self.engines[i].addr);
        self.work.prefilled += w.prefilled;
        self.work.generated += w.generated;
    }

    /// Everything the engines did: the killed ones' and the live ones'.
    fn finish(mut self) -> EngineWork {
        for i in 0..self.engines.len() {
            self.add_counters(i);
        }
        self.work
    }
}

/// `addr`'s `/metrics` (empty if it does not answer).
fn metrics(addr: &str) -> String {
    semlb_test_support::http::http(addr, "GET", "/metrics", None, &[])
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .unwrap_or_default()
}

/// An engine's counters from its `/metrics` (zeros if it does not answer).
fn engine_work(addr: &str) -> EngineWork {
    let text = metrics(addr);
    let value = |name: &str| metric_sum(&text, name).unwrap_or(0.0);
    EngineWork {
        prefilled: value("vllm:prompt_tokens_total") - value("vllm:prefix_cache_hits_total"),
        generated: value("vllm:generation_tokens_total"),
    }
}

/// Runs the report.
pub fn run(args: &ChurnArgs) -> Result<()> {
    let mut fronts = vec![Front::Semlb { resume: true }, Front::Semlb { resume: false }];
    let peers = crate::replay::peers::parse_peers(Some(&args.peers))?;
    let peers_dir = args
        .peers_dir
        .clone()
        .unwrap_or_else(|| std::path::PathBuf::from("target/bench-peers"));
    let mut skipped = Vec::new();
    let mut installs = Vec::new();
    for peer in peers {
        match install(peer, &peers_dir) {
            Ok(i) => {
                installs.push(i);
                fronts.push(Front::Peer(peer));
            }
            Err(e) => skipped.push(format!("{peer}: not run ({e})")),
        }
    }
    let mut table = Table::new([
        "front",
        "streams",
        "completed",
        "completed %",
        "error event",
        "cut",
        "short",
        "refused",
        "goodput tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "wasted prefill tok",
        "wasted decode tok",
        "resumed",
    ]);
    let mut report = serde_json::Map::new();
    for front in fronts {
        eprintln!("churn: {} for {} s", front.name(), args.secs);
        let mut fleet = Fleet::start(args.engines, &args.time_scale)?;
        let (samples, resumed) = match front {
            Front::Semlb { resume } => {
                let config = TempFile::try_new("bench-churn", &format!("[resume]\nenabled = {resume}\n"))?;
                let shm = semlb_test_support::process::unique("bench-churn", if resume { "on" } else { "off" });
                let listen = format!("127.0.0.1:{}", semlb_test_support::redis::free_port());
                let dispatchers = args.dispatchers.to_string();
                let mut gateway =
                    crate::state::serve(&shm, &listen, &fleet.engines, &config, &["--dispatchers", &dispatchers])?;
                let samples = churn(args, &mut fleet, &listen)?;
                let resumed = resumptions(&listen);
                gateway.stop();
                let _ = shm_layout::Segment::remove(&shm);
                (samples, Some(resumed))
            }
            Front::Peer(peer) => {
                let install = installs.iter().find(|i| i.peer == peer).context("installed")?;
                let proc = PeerProc::start(install, &fleet.urls())?;
                let samples = churn(args, &mut fleet, &proc.addr)?;
                drop(proc);
                (samples, None)
            }
        };
        let work = fleet.finish();
        let f = Figures::of(&samples, work, args);
        table.row(f.row(&front.name(), resumed));
        let mut json = f.json();
        json["resumed"] = json!(resumed);
        report.insert(front.name(), json);
    }
    print_table(
        &format!(
            "churn: {} engines, one SIGKILLed every {} s and restarted {} s later; {} clients streaming {}-token answers back to back for {} s",
            args.engines, args.period_secs, args.down_secs, args.clients, args.max_tokens, args.secs
        ),
        &table,
    );
    for line in &skipped {
        println!("{line}");
    }
    let path = write_json(&args.common.out, "churn", &Value::Object(report))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// The load through `addr` for `args.secs`, killing an engine every
/// period and starting it again; every stream's sample.
fn churn(args: &ChurnArgs, fleet: &mut Fleet, addr: &str) -> Result<Vec<Sample>> {
    let addr: std::net::SocketAddr = addr.parse()?;
    let runtime = crate::sse_client::runtime();
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for client in 0..args.clients {
        let (stop, samples, max_tokens) = (stop.clone(), samples.clone(), args.max_tokens);
        tasks.push(runtime.spawn(async move {
            let mut i = 0;
            while !stop.load(Relaxed) {
                let answer = stream(addr, &request(client, i, max_tokens), &[]).await;
                let sample = Sample::of(answer.as_ref().ok(), max_tokens);
                samples.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
                if sample.outcome == Outcome::Refused {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                i += 1;
            }
        }));
    }
    let started = Instant::now();
    let (period, down, secs) = (
        Duration::from_secs(args.period_secs),
        Duration::from_secs(args.down_secs),
        Duration::from_secs(args.secs),
    );
    let mut killed = 0;
    let mut dead: Option<(usize, Instant)> = None;
    while started.elapsed() < secs {
        let next_kill = period * (killed as u32 + 1);
        let next_restart = dead.map(|(_, at)| at + down);
        let now = Instant::now();
        if let Some((i, _)) = dead.filter(|_| next_restart.is_some_and(|t| t <= now)) {
            fleet.restart(i)?;
            dead = None;
        } else if started.elapsed() >= next_kill && next_kill < secs {
            let i = killed % fleet.engines.len();
            fleet.kill(i);
            dead = Some((i, Instant::now()));
            killed += 1;
        } else {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    stop.store(true, Relaxed);
    runtime.block_on(async {
        for t in tasks {
            let _ = t.await;
        }
    });
    if let Some((i, _)) = dead {
        fleet.restart(i)?;
    }
    let samples = samples.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(samples)
}

/// Client `client`'s request `i`: one shared system prompt, a question
/// of its own, a long streamed answer.
fn request(client: usize, i: usize, max_tokens: u64) -> Value {
    json!({
        "model": "semlb-sim",
        "messages": [
            {"role": "system", "content": "You are a careful analyst. Answer in full sentences, with headings, and cite the figures you use."},
            {"role": "user", "content": format!("Client {client}, request {i}: write a long report on the maintenance history of bridge number {}.", client * 1000 + i)},
        ],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

impl Sample {
    fn of(answer: Option<&Answer>, max_tokens: u64) -> Self {
        let Some(a) = answer else {
            return Self {
                outcome: Outcome::Refused,
                ttft: None,
                completion_tokens: 0,
                prefilled: 0,
            };
        };
        let outcome = if a.error_event {
            Outcome::ErrorEvent
        } else if !a.done {
            Outcome::Cut
        } else if a.completion_tokens < max_tokens {
            Outcome::Short
        } else {
            Outcome::Completed
        };
        Self {
            outcome,
            ttft: Some(a.ttft),
            completion_tokens: a.completion_tokens,
            prefilled: a.prompt_tokens.saturating_sub(a.cached_tokens),
        }
    }
}

/// The resumptions semlb's `/metrics` counted (outcome `resumed`).
fn resumptions(addr: &str) -> u64 {
    metric_samples(&metrics(addr), "semlb_stream_resumptions_total")
        .into_iter()
        .filter(|(labels, _)| labels.contains("outcome=\"resumed\""))
        .map(|(_, n)| n)
        .sum::<f64>() as u64
}

/// One front's figures.
struct Figures {
    streams: usize,
    counts: [usize; 5],
    goodput: f64,
    ttft_p50: f64,
    ttft_p99: f64,
    wasted_prefill: f64,
    wasted_decode: f64,
}

const OUTCOMES: [Outcome; 5] = [
    Outcome::Completed,
    Outcome::ErrorEvent,
    Outcome::Cut,
    Outcome::Short,
    Outcome::Refused,
];

impl Figures {
    fn of(samples: &[Sample], work: EngineWork, args: &ChurnArgs) -> Self {
        let counts = OUTCOMES.map(|o| samples.iter().filter(|s| s.outcome == o).count());
        let completed: Vec<&Sample> = samples.iter().filter(|s| s.outcome == Outcome::Completed).collect();
        let mut ttfts: Vec<f64> = completed
            .iter()
            .filter_map(|s| s.ttft)
            .map(|t| t.as_secs_f64() * 1e3)
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let quantile = |q: f64| {
            if ttfts.is_empty() {
                0.0
            } else {
                ttfts[((ttfts.len() - 1) as f64 * q).round() as usize]
            }
        };
        let useful_decode: u64 = completed.iter().map(|s| s.completion_tokens).sum();
        let useful_prefill: u64 = completed.iter().map(|s| s.prefilled).sum();
        Self {
            streams: samples.len(),
            counts,
            goodput: useful_decode as f64 / args.secs as f64,
            ttft_p50: quantile(0.5),
            ttft_p99: quantile(0.99),
            wasted_prefill: (work.prefilled - useful_prefill as f64).max(0.0),
            wasted_decode: (work.generated - useful_decode as f64).max(0.0),
        }
    }

    fn completed_pct(&self) -> f64 {
        if self.streams == 0 {
            0.0
        } else {
            100.0 * self.counts[0] as f64 / self.streams as f64
        }
    }

    fn row(&self, name: &str, resumed: Option<u64>) -> Vec<String> {
        let mut row = vec![
            name.to_owned(),
            self.streams.to_string(),
            self.counts[0].to_string(),
            format!("{:.2}", self.completed_pct()),
        ];
        row.extend(self.counts[1..].iter().map(ToString::to_string));
        row.extend([
            format!("{:.0}", self.goodput),
            format!("{:.0}", self.ttft_p50),
            format!("{:.0}", self.ttft_p99),
            format!("{:.0}", self.wasted_prefill),
            format!("{:.0}", self.wasted_decode),
            resumed.map_or("-".to_owned(), |r| r.to_string()),
        ]);
        row
    }

    fn json(&self) -> Value {
        json!({
            "streams": self.streams,
            "completed": self.counts[0],
            "completed_pct": self.completed_pct(),
            "error_event": self.counts[1],
            "cut": self.counts[2],
            "short": self.counts[3],
            "refused": self.counts[4],
            "goodput_tokens_per_s": self.goodput,
            "ttft_p50_ms": self.ttft_p50,
            "ttft_p99_ms": self.ttft_p99,
            "wasted_prefill_tokens": self.wasted_prefill,
            "wasted_decode_tokens": self.wasted_decode,
        })
    }
}
