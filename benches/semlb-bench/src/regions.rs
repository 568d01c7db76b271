//! `semlb bench regions`: two regions whose peaks do not coincide (issue
//! 21's benchmark, a compressed version of SkyLB's setup).
//!
//! Each region is a gateway (`selective_push`, `max_outstanding` = the
//! engines' `--max-num-seqs`, so requests wait at the gateway rather than
//! in an engine) in front of its own simulated engines in real time. Each
//! gets open-loop Poisson arrivals of conversations at a rate that follows
//! a compressed day: `base + peak × max(0, sin)` over `--period-secs`,
//! region B half a period behind A, so one region is overloaded while the
//! other is quiet, then the reverse. A conversation opens with a document
//! of about `--context-words` words of its own and has `--turns` streamed
//! turns, each sent the instant the last answer ends (as agents do), each
//! carrying the whole conversation so far: a turn served where the last
//! one was finds its prefix cached, one served elsewhere prefills it all.
//! Four runs on fresh processes with the same arrival times:
//!
//! | mode | what it is |
//! | --- | --- |
//! | `alone` | no peers: each region serves its own load |
//! | `overflow` | peers, `forward_after_ms = 0`, no affinity: a request that finds every local server full goes to the peer with room at once |
//! | `skylb-no-affinity` | peers, `forward_after_ms = --forward-after-ms`: only when the local queue would hold it longer, ranked by free servers less round trip; no affinity |
//! | `skylb` | as `skylb-no-affinity`, and a conversation forwarded to a peer keeps going there while warm and the peer has room (`affinity_secs = 300`) |
//!
//! Every request to a peer, load polls included, first waits `--delay-ms`
//! (the inter-region delay, `[[peer]] delay_ms`).
//!
//! Reported per mode and region of arrival: requests (turns), failures,
//! TTFT p50/p99, SLO attainment (TTFT within `--slo-ms`), goodput (answers
//! within the SLO per second), the cached share of later turns' prompts
//! (as the engines' usage reports it) and how many the region forwarded.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use serde_json::{Value, json};

use crate::Common;
use crate::output::{Table, print_table, write_json};
use crate::sse_client::{Answers, Sampled, stream};
use semlb_test_support::rng::Rng;
use semlb_test_support::{TempDir, TempFile};

/// `semlb bench regions`.
#[derive(Debug, Clone, Args)]
pub struct RegionsArgs {
    /// Output directory.
    #[command(flatten)]
    pub common: Common,
    /// Simulated engines per region.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Sequences each engine runs at once (`--max-num-seqs`).
    #[arg(long, default_value_t = 4)]
    pub max_num_seqs: usize,
    /// Conversations starting per second in a region's quiet hours.
    #[arg(long, default_value_t = 0.7)]
    pub base_rps: f64,
    /// Conversations starting per second added at a region's peak.
    #[arg(long, default_value_t = 4.0)]
    pub peak_rps: f64,
    /// Turns of a conversation.
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Words of the document a conversation opens with.
    #[arg(long, default_value_t = 1500)]
    pub context_words: usize,
    /// Seconds of one compressed day (the run is one day).
    #[arg(long, default_value_t = 40)]
    pub period_secs: u64,
    /// Output tokens of every request.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: u64,
    /// Latency added before every request to a peer (ms).
    #[arg(long, default_value_t = 25)]
    pub delay_ms: u64,
    /// `forward_after_ms` of the `skylb` mode.
    #[arg(long, default_value_t = 300)]
    pub forward_after_ms: u64,
    /// The TTFT objective (ms).
    #[arg(long, default_value_t = 1000)]
    pub slo_ms: u64,
    /// Seed of the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// A mode: whether regions peer, and their `forward_after_ms` and
/// `affinity_secs`.
struct Mode {
    name: &'static str,
    peers: bool,
    forward_after_ms: u64,
    affinity_secs: u64,
}

/// The modes, in the order run.
fn modes(args: &RegionsArgs) -> [Mode; 4] {
    let mode = |name, peers, forward_after_ms, affinity_secs| Mode {
        name,
        peers,
        forward_after_ms,
        affinity_secs,
    };
    [
        mode("alone", false, 0, 0),
        mode("overflow", true, 0, 0),
        mode("skylb-no-affinity", true, args.forward_after_ms, 0),
        mode("skylb", true, args.forward_after_ms, 300),
    ]
}

const TOKEN: &str = "bench-regions-token-0123456789abcdef";

/// One request as its client saw it.
#[derive(Debug, Clone, Copy)]
struct Sample {
    region: usize,
    /// Its turn in its conversation (0: the first).
    turn: usize,
    ttft: Option<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Runs the report.
pub fn run(args: &RegionsArgs) -> Result<()> {
    let arrivals = [arrivals(args, 0), arrivals(args, 1)];
    let mut table = Table::new([
        "mode",
        "region",
        "requests",
        "failed",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "SLO att.",
        "goodput/s",
        "later turns cached",
        "later TTFT p50",
        "forwarded",
    ]);
    let mut report = serde_json::Map::new();
    let dir = TempDir::new("bench-regions");
    let token = dir.0.join("peer.token");
    std::fs::write(&token, format!("{TOKEN}\n"))?;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600))?;
    let token = token.display().to_string();
    for mode in modes(args) {
        let seqs = args.max_num_seqs.to_string();
        let engines = [
            crate::state::start_sims(args.engines, "1", &["--max-num-seqs", &seqs])?,
            crate::state::start_sims(args.engines, "1", &["--max-num-seqs", &seqs])?,
        ];
        // Each region's address is known once it runs; a peer's is given to
        // the other at its start, so B starts first with A's port reserved.
        let ports = [free_port()?, free_port()?];
        let mut gateways = Vec::new();
        for r in 0..2 {
            let peer = mode.peers.then(|| (ports[1 - r], REGION[1 - r]));
            let config = config(args, r, peer, &mode, &token);
            let config = TempFile::try_new("bench-regions", &config)?;
            let shm = semlb_test_support::process::unique("bench-regions", REGION[r]);
            // One dispatcher a region (`state::serve` waits for its health;
            // its peer need not be up: polls retry).
            let listen = format!("127.0.0.1:{}", ports[r]);
            let gateway = crate::state::serve(&shm, &listen, &engines[r], &config, &["--dispatchers", "1"])?;
            gateways.push((gateway, shm, config));
        }
        let addrs: Vec<SocketAddr> = gateways
            .iter()
            .map(|(g, _, _)| g.addr.parse())
            .collect::<Result<_, _>>()?;
        let samples = load(args, &addrs, &arrivals);
        let forwarded: Vec<f64> = gateways.iter().map(|(g, _, _)| forwarded_count(&g.addr)).collect();
        for (mut g, shm, _) in gateways {
            g.stop();
            let _ = shm_layout::Segment::remove(&shm);
        }
        let mut figures = serde_json::Map::new();
        for (r, name) in [(Some(0), "A"), (Some(1), "B"), (None, "both")] {
            let f = Figures::of(&samples, r, args);
            let fwd = r.map_or(forwarded.iter().sum(), |r| forwarded[r]);
            table.row(vec![
                mode.name.to_owned(),
                name.to_owned(),
                f.requests.to_string(),
                f.failed.to_string(),
                format!("{:.0}", f.p50),
                format!("{:.0}", f.p99),
                format!("{:.1} %", 100.0 * f.attainment),
                format!("{:.2}", f.goodput),
                format!("{:.1} %", 100.0 * f.later_cached),
                format!("{:.0}", f.later_p50),
                format!("{fwd:.0}"),
            ]);
            let mut j = f.json();
            j["forwarded"] = json!(fwd);
            figures.insert(name.to_owned(), j);
        }
        report.insert(mode.name.to_owned(), Value::Object(figures));
    }
    print_table(
        &format!(
            "regions: two regions of {} engines × {} sequences, {}–{} conversations/s each ({} turns, a {}-word document) over a {} s day, B half a day behind A; {} ms to the peer; SLO TTFT ≤ {} ms",
            args.engines,
            args.max_num_seqs,
            args.base_rps,
            args.base_rps + args.peak_rps,
            args.turns,
            args.context_words,
            args.period_secs,
            args.delay_ms,
            args.slo_ms
        ),
        &table,
    );
    let path = write_json(&args.common.out, "regions", &Value::Object(report))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

const REGION: [&str; 2] = ["a", "b"];

/// Region `r`'s configuration, with its peer `(port, name)` if any.
fn config(args: &RegionsArgs, r: usize, peer: Option<(u16, &str)>, mode: &Mode, token: &str) -> String {
    let mut c = format!(
        "[policy]\nkind = \"selective_push\"\n[policy.selective_push]\nmode = \"max_outstanding\"\nmax_outstanding = {}\n\
         [peering]\nregion = \"{}\"\ntoken_file = \"{token}\"\npoll_ms = 100\nmax_age_ms = 1000\nforward_after_ms = {}\naffinity_secs = {}\n",
        args.max_num_seqs, REGION[r], mode.forward_after_ms, mode.affinity_secs
    );
    if let Some((port, name)) = peer {
        c.push_str(&format!(
            "[[peer]]\nurl = \"http://127.0.0.1:{port}\"\nregion = \"{name}\"\ntoken_file = \"{token}\"\ndelay_ms = {}\n",
            args.delay_ms
        ));
    }
    c
}

/// A free loopback port (bound, then released).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `semlb_peer_forwarded_total` of the gateway at `addr`.
fn forwarded_count(addr: &str) -> f64 {
    semlb_test_support::http::http(addr, "GET", "/metrics", None, &[])
        .ok()
        .and_then(|r| {
            semlb_test_support::gateway::sample(&String::from_utf8_lossy(&r.body), "semlb_peer_forwarded_total")
        })
        .unwrap_or(0.0)
}

/// Region `r`'s arrival times: a Poisson process of rate
/// `base + peak × max(0, sin(2π t / period − π r))`, by thinning.
fn arrivals(args: &RegionsArgs, r: usize) -> Vec<Duration> {
    let mut rng = Rng::from_seed(args.seed ^ (0x5eed_0000 + r as u64));
    let period = args.period_secs as f64;
    let max_rate = args.base_rps + args.peak_rps;
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        let u = rng.unit().max(1e-12);
        t += -u.ln() / max_rate;
        if t >= period {
            return out;
        }
        let phase = 2.0 * std::f64::consts::PI * t / period - std::f64::consts::PI * r as f64;
        let rate = args.base_rps + args.peak_rps * phase.sin().max(0.0);
        if rng.unit() * max_rate < rate {
            out.push(Duration::from_secs_f64(t));
        }
    }
}

/// Words documents are made of.
const WORDS: [&str; 32] = [
    "harbour",
    "ledger",
    "invoice",
    "turbine",
    "glacier",
    "orchard",
    "pipeline",
    "quarterly",
    "freight",
    "meadow",
    "contract",
    "sensor",
    "voltage",
    "granite",
    "lantern",
    "shipment",
    "clause",
    "forecast",
    "reservoir",
    "bridge",
    "tenant",
    "audit",
    "compressor",
    "vineyard",
    "signal",
    "warranty",
    "corridor",
    "battery",
    "estuary",
    "payroll",
    "beacon",
    "terminal",
];

/// Conversation `id`'s opening: a document of `words` words of its own.
fn document(id: u64, words: usize) -> String {
    let mut rng = Rng::from_seed(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd0c);
    let mut text = format!("Document {id}. ");
    for i in 0..words {
        text.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        text.push_str(if i % 12 == 11 { ". " } else { " " });
    }
    text.push_str("\nSummarise this document.");
    text
}

/// Starts every conversation of both regions at its region's gateway at
/// its time (open loop), each turn sent the instant the last answer ends;
/// every turn's sample.
fn load(args: &RegionsArgs, addrs: &[SocketAddr], arrivals: &[Vec<Duration>; 2]) -> Vec<Sample> {
    let runtime = crate::sse_client::runtime();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let (max_tokens, turns, words) = (args.max_tokens, args.turns, args.context_words);
    runtime.block_on(async {
        let start = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for (r, times) in arrivals.iter().enumerate() {
            for (i, at) in times.iter().enumerate() {
                let (addr, samples, at) = (addrs[r], samples.clone(), *at);
                let id = (r as u64) << 32 | i as u64;
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(start + at).await;
                    let mut messages = vec![json!({"role": "user", "content": document(id, words)})];
                    for turn in 0..turns {
                        let body = json!({
                            "model": "semlb-sim",
                            "messages": messages,
                            "stream": true,
                            "stream_options": {"include_usage": true},
                            "max_tokens": max_tokens,
                            "ignore_eos": true,
                            "temperature": 0.8,
                        });
                        let answer = stream(addr, &body, &[]).await.ok();
                        let sample = Sample {
                            region: r,
                            turn,
                            ttft: answer.as_ref().map(|a| a.ttft),
                            prompt_tokens: answer.as_ref().map_or(0, |a| a.prompt_tokens),
                            cached_tokens: answer.as_ref().map_or(0, |a| a.cached_tokens),
                        };
                        samples.lock().unwrap_or_else(|p| p.into_inner()).push(sample);
                        let Some(answer) = answer else { break };
                        messages.push(json!({"role": "assistant", "content": answer.text}));
                        messages.push(json!({"role": "user", "content": format!("Now point {} of it, in more detail.", turn + 1)}));
                    }
                }));
            }
        }
        for t in tasks {
            let _ = t.await;
        }
    });
    samples.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

impl Sampled for Sample {
    fn ttft(&self) -> Option<Duration> {
        self.ttft
    }
    fn tokens(&self) -> (u64, u64) {
        (self.prompt_tokens, self.cached_tokens)
    }
}

/// Figures of the samples of region `r` (`None`: both).
struct Figures {
    requests: usize,
    failed: usize,
    p50: f64,
    p99: f64,
    attainment: f64,
    goodput: f64,
    /// Cached share of the prompt tokens of turns after the first.
    later_cached: f64,
    /// TTFT p50 of turns after the first (ms).
    later_p50: f64,
}

impl Figures {
    fn of(samples: &[Sample], r: Option<usize>, args: &RegionsArgs) -> Self {
        let mine: Vec<&Sample> = samples.iter().filter(|s| r.is_none_or(|r| s.region == r)).collect();
        let all = Answers::of(mine.iter().copied());
        let later = Answers::of(mine.iter().copied().filter(|s| s.turn > 0));
        let good = all.within_ms(args.slo_ms as f64);
        Figures {
            requests: all.sent,
            failed: all.failed(),
            p50: all.ttft_ms(0.5),
            p99: all.ttft_ms(0.99),
            attainment: good as f64 / all.sent.max(1) as f64,
            goodput: good as f64 / args.period_secs as f64,
            later_cached: later.cached_tokens as f64 / later.prompt_tokens.max(1) as f64,
            later_p50: later.ttft_ms(0.5),
        }
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.requests,
            "failed": self.failed,
            "ttft_p50_ms": self.p50,
            "ttft_p99_ms": self.p99,
            "slo_attainment": self.attainment,
            "goodput_per_s": self.goodput,
            "later_turns_cached": self.later_cached,
            "later_turns_ttft_p50_ms": self.later_p50,
        })
    }
}
