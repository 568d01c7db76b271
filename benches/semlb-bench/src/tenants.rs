//! `semlb bench tenants`: the noisy neighbour (issue 19's fair-share
//! benchmark).
//!
//! Simulated engines in real time, each running `--max-num-seqs`
//! sequences at once, are saturated by a **noisy** tenant
//! (`--noisy` closed-loop clients, each sending its next streamed request
//! the instant the last one ends) while a **quiet** tenant sends one
//! request every `--quiet-every-ms` (each after the last has ended). The
//! tenants are told apart by their `api-key`. Three gateways, one after
//! the other on fresh engines, with the same load:
//!
//! | mode | what it is |
//! | --- | --- |
//! | `engine queues` | `cache_aware` (the default): no gateway queue, every request goes to an engine at once and waits in its queue, first come first served |
//! | `gateway queue, oldest first` | `selective_push` (`max_outstanding` = the engines' sequence slots) with `fair_share = false`: requests wait at the gateway, oldest first |
//! | `gateway queue, fair share` | the same with `fair_share = true` ([`semlb::tenancy::fair_share`]) |
//!
//! Reported per mode and tenant, over the window after a warm-up: requests
//! answered and TTFT p50/p90/p99 as the client saw them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde_json::{Value, json};

use crate::Common;
use crate::output::{Table, print_table, write_json};
use crate::sse_client::{Answers, Sampled, stream};
use semlb_test_support::TempFile;
use semlb_test_support::gateway::Gateway;
use semlb_test_support::process::{Proc, ProcBuilder, Stderr};

/// `semlb bench tenants`.
#[derive(Debug, Clone, Args)]
pub struct TenantsArgs {
    /// Output directory.
    #[command(flatten)]
    pub common: Common,
    /// Simulated engines.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Sequences each engine runs at once (`--max-num-seqs`; the rest
    /// wait in its queue): small, so the noisy tenant saturates them.
    #[arg(long, default_value_t = 4)]
    pub max_num_seqs: usize,
    /// Dispatcher processes of the gateway.
    #[arg(long, default_value_t = 2)]
    pub dispatchers: usize,
    /// The noisy tenant's closed-loop clients.
    #[arg(long, default_value_t = 32)]
    pub noisy: usize,
    /// The quiet tenant's pace: one request every this many ms.
    #[arg(long, default_value_t = 500)]
    pub quiet_every_ms: u64,
    /// Output tokens of every request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u64,
    /// Seconds of load before the window.
    #[arg(long, default_value_t = 5)]
    pub warm_secs: u64,
    /// Seconds measured per mode.
    #[arg(long, default_value_t = 30)]
    pub window_secs: u64,
}

/// The modes: (name, configuration); the holding ones push to an engine
/// only while it has a free sequence slot (`max_outstanding` = its
/// `--max-num-seqs`), so requests wait at the gateway, not in an engine.
fn modes(args: &TenantsArgs) -> [(&'static str, String); 3] {
    let push = |fair: bool| {
        format!(
            "[policy]\nkind = \"selective_push\"\n[policy.selective_push]\nmode = \"max_outstanding\"\nmax_outstanding = {}\n[policy.queue]\nfair_share = {fair}\n",
            args.max_num_seqs
        )
    };
    [
        ("engine queues", "[policy]\nkind = \"cache_aware\"\n".to_owned()),
        ("gateway queue, oldest first", push(false)),
        ("gateway queue, fair share", push(true)),
    ]
}

/// One answered (or failed) request of a tenant.
#[derive(Debug, Clone, Copy)]
struct Sample {
    quiet: bool,
    at: Duration,
    ttft: Option<Duration>,
}

/// Runs the report.
pub fn run(args: &TenantsArgs) -> Result<()> {
    let mut table = Table::new([
        "mode",
        "tenant",
        "requests",
        "failed",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TTFT p99 ms",
    ]);
    let mut report = serde_json::Map::new();
    for (mode, config) in modes(args) {
        let engines = start_engines(args)?;
        let config = TempFile::try_new("bench-tenants", &config)?;
        let shm = semlb_test_support::process::unique("bench-tenants", "gw");
        let mut gateway = serve(args, &shm, &engines, &config)?;
        let addr: SocketAddr = gateway.addr.parse()?;
        let samples = load(args, addr);
        gateway.stop();
        let _ = shm_layout::Segment::remove(&shm);
        let from = Duration::from_secs(args.warm_secs);
        let mut figures = serde_json::Map::new();
        for (quiet, tenant) in [(true, "quiet"), (false, "noisy")] {
            let f = Figures::of(&samples, quiet, from);
            table.row(vec![
                mode.to_owned(),
                tenant.to_owned(),
                f.requests.to_string(),
                f.failed.to_string(),
                format!("{:.0}", f.p50),
                format!("{:.0}", f.p90),
                format!("{:.0}", f.p99),
            ]);
            figures.insert(tenant.to_owned(), f.json());
        }
        report.insert(mode.replace([' ', ','], "_"), Value::Object(figures));
    }
    print_table(
        &format!(
            "tenants: one quiet tenant (a request every {} ms) beside {} noisy clients, {} engines of {} sequences, {} dispatchers",
            args.quiet_every_ms, args.noisy, args.engines, args.max_num_seqs, args.dispatchers
        ),
        &table,
    );
    let path = write_json(&args.common.out, "tenants", &Value::Object(report))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

impl Sampled for Sample {
    fn ttft(&self) -> Option<Duration> {
        self.ttft
    }
}

/// Figures of one tenant's samples sent from `from` on.
struct Figures {
    requests: usize,
    failed: usize,
    p50: f64,
    p90: f64,
    p99: f64,
}

impl Figures {
    fn of(samples: &[Sample], quiet: bool, from: Duration) -> Self {
        let mine = Answers::of(samples.iter().filter(|s| s.quiet == quiet && s.at >= from));
        Figures {
            requests: mine.answered(),
            failed: mine.failed(),
            p50: mine.ttft_ms(0.5),
            p90: mine.ttft_ms(0.9),
            p99: mine.ttft_ms(0.99),
        }
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.requests,
            "failed": self.failed,
            "ttft_p50_ms": self.p50,
            "ttft_p90_ms": self.p90,
            "ttft_p99_ms": self.p99,
        })
    }
}

/// Fresh simulated engines in real time, `--max-num-seqs` each.
fn start_engines(args: &TenantsArgs) -> Result<Vec<Proc>> {
    let seqs = args.max_num_seqs.to_string();
    crate::state::start_sims(args.engines, "1", &["--max-num-seqs", &seqs])
}

/// `semlb serve` on segment `shm` in front of `engines` with `config`.
fn serve(args: &TenantsArgs, shm: &str, engines: &[Proc], config: &TempFile) -> Result<Proc> {
    let argv = Gateway::builder()
        .shm_size("64MiB")
        .dispatchers(args.dispatchers)
        .backends(&engines.iter().collect::<Vec<_>>())
        .args(&["--config", config.path()])
        .serve_args(shm);
    let proc = ProcBuilder::new(&argv).stderr(Stderr::Tail(40)).try_start()?;
    crate::state::wait_health(&proc.addr)?;
    Ok(proc)
}

/// Both tenants' clients for `warm_secs + window_secs`; every sample.
fn load(args: &TenantsArgs, addr: SocketAddr) -> Vec<Sample> {
    let runtime = crate::sse_client::runtime();
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let max_tokens = args.max_tokens;
    let request = move |quiet: bool, i: usize| {
        let who = if quiet { "quiet" } else { "noisy" };
        json!({
            "model": "semlb-sim",
            "messages": [{"role": "user", "content": format!("{who} request {i}: summarise the quarterly report of team {}.", i % 97)}],
            "stream": true,
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "temperature": 0.8,
        })
    };
    let record = |samples: &Arc<Mutex<Vec<Sample>>>, quiet: bool, at: Duration, ttft: Option<Duration>| {
        samples
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Sample { quiet, at, ttft });
    };
    let mut tasks = Vec::new();
    for client in 0..args.noisy {
        let (stop, samples) = (stop.clone(), samples.clone());
        tasks.push(runtime.spawn(async move {
            let mut i = client * 100_000;
            while !stop.load(Relaxed) {
                let at = started.elapsed();
                let answer = stream(addr, &request(false, i), &[("api-key", "noisy-team")]).await;
                record(&samples, false, at, answer.as_ref().ok().map(|a| a.ttft));
                if answer.is_err() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                i += 1;
            }
        }));
    }
    let every = Duration::from_millis(args.quiet_every_ms);
    let (quiet_stop, quiet_samples) = (stop.clone(), samples.clone());
    tasks.push(runtime.spawn(async move {
        let mut i = 0;
        while !quiet_stop.load(Relaxed) {
            let at = started.elapsed();
            let answer = stream(addr, &request(true, i), &[("api-key", "quiet-team")]).await;
            record(&quiet_samples, true, at, answer.as_ref().ok().map(|a| a.ttft));
            tokio::time::sleep(every.saturating_sub(started.elapsed() - at)).await;
            i += 1;
        }
    }));
    std::thread::sleep(Duration::from_secs(args.warm_secs + args.window_secs));
    stop.store(true, Relaxed);
    runtime.block_on(async {
        for t in tasks {
            let _ = t.await;
        }
    });
    samples.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
