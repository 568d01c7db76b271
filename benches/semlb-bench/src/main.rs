//! # semlb-bench
//!
//! `semlb-bench` (also run as `semlb bench`, which execs this binary from
//! its own directory): the measurements behind the book's results pages
//! (`docs/results/`), run on this machine with real processes, a real tokenizer, real
//! HTTP and a private `redis-server`. It is a crate of its own so that the
//! gateway binary does not link the plotting and progress-bar crates
//! (`plotters`, `indicatif`) it needs.
//!
//! | report | module | what it measures |
//! | --- | --- | --- |
//! | `dispatch` | [`dispatch_path`] | the dispatch path per stage (tokenize, response-cache lookup, longest-prefix match, table update) on shm, Redis (one round trip) and Redis (naive), p50/p99 and ratios (the sLLM paper's Figure 7) |
//! | `scaling` | [`scaling`] | dispatch decisions per second with 1, 2, 4 processes per store (the paper's Figure 8); its load processes are this binary again (`__bench-worker`) |
//! | `e2e` | [`end_to_end`] | the whole gateway in front of simulated engines under open-loop load, shm vs Redis |
//! | `tokenizer` | [`tokenizer`] | HF `tokenizers` against the native engine: µs per token on short, 2K- and 8K-token texts, and per request on multi-turn chats with and without the segment cache |
//! | `replay` | [`replay`] | every routing policy and the peer routers (SMG, vllm-router, SGLang's router, installed into private virtual environments) on the same workloads ([`workload`]: the Mooncake trace, HH-RLHF chats, hot-prefix agent sessions, closed-loop agents, a hot-prefix burst, and closed-loop chats — on four shared system prompts, on one, and on one engine scaled out at run time — on four engine sets: with and without `/metrics`, streamed and not): throughput, TTFT, SLO attainment, goodput from a rate sweep, prefix hits, load imbalance, the burst's spread, the scale-out's take-up, every row against `least_load` and `cache_aware` against the best peer |
//! | `llama` | [`replay::real_engine`] | `cache_aware`, `round_robin`, `consistent_hash` and `least_load` in front of real `llama-server` engines (SmolLM2-135M on CPU) and in front of the simulator calibrated to them, on small closed-loop chats: throughput, TTFT, the engines' cached-token share |
//! | `epp` | [`epp`], [`epp_floor`] | the endpoint picker's decision (`--epp-listen`, Envoy's ext_proc): round trip p50/p99 and dispatcher CPU per decision on a short and a 2 000-token chat, beside the HTTP proxy's dispatcher CPU per request and an ext_proc server that only answers (the floor) |
//! | `proxy` | [`proxy`] | the gateway's cost as a proxy against nginx in front of the same engine (front pinned to its own core): req/s, latency and added latency, CPU µs per request |
//! | `state` | [`state`] | what keeping the routing state is worth: the first 60 s after a restart with the segment kept (hot restart) and not, and two gateway hosts on one Redis sharing a namespace or not: cached share of prompt tokens, TTFT p50/p90 |
//! | `tenants` | [`tenants`] | the noisy neighbour: a quiet tenant's TTFT beside a flooding one, with engine queues, the gateway queue oldest first, and the gateway queue with fair share |
//! | `regions` | [`regions`] | two regions whose peaks do not coincide: each alone, pooled by overflow, SkyLB-style forwarding between peer gateways (goodput, TTFT, SLO attainment) |
//! | `pd` | [`pd`] | disaggregated prefill and decode against aggregated serving at equal engine count, on simulated engines in simulated time: long prompts with long answers over a load sweep (TTFT, TPOT, goodput at a TTFT and TPOT objective, share split and bypassed), and multi-turn conversations (cache-aware against random pairing, bypassed later turns against aggregated serving) |
//! | `churn` | [`churn`] | engines SIGKILLed and restarted under a streamed load of long answers: streams completed, goodput, TTFT and wasted prefill and decode, with stream resumption on and off and beside a peer router |
//! | `all` | here | every report in turn (but `state`, `tenants`, `regions`, `pd` and `churn`) |
//!
//! The gateway processes it measures are the `semlb` binary next to this
//! one ([`semlb_exe`]): `cargo build --release -p semlb -p semlb-bench`
//! builds both into `target/release/`.
//!
//! The reports that drive the gateway as agents do share one streaming
//! client ([`sse_client`]: TTFT and usage of an SSE answer).
//!
//! Every report prints a table on stdout ([`output`]: also the progress bar
//! on stderr) and writes `<out>/<report>.json` and, where it has
//! distributions, `<out>/<report>.svg` ([`plot`]). The Redis a report
//! measures is a private `redis-server` or the user's ([`redis_server`]).
//! Benchmarks measure; they assert nothing about speed. Errors travel as
//! `anyhow::Error` to [`main`], which prints them.

pub mod churn;
pub mod dispatch_path;
pub mod end_to_end;
pub mod epp;
pub mod epp_floor;
pub mod output;
pub mod pd;
pub mod plot;
pub mod proxy;
pub mod redis_server;
pub mod regions;
pub mod replay;
pub mod scaling;
pub mod sse_client;
pub mod state;
pub mod tenants;
pub mod tokenizer;
pub mod workload;

use std::path::PathBuf;

use std::io::Write;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

/// The command line of `semlb-bench` (and of `semlb bench`).
#[derive(Debug, Parser)]
#[command(
    name = "semlb-bench",
    version,
    about = "semlb's benchmarks: the dispatch path, scaling, end to end, trace replay, proxy overhead; shm vs Redis"
)]
pub struct Cli {
    /// The report to run.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// `semlb-bench …` (`semlb bench …`).
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The dispatch path per stage on shm and Redis.
    Dispatch(dispatch_path::DispatchArgs),
    /// Dispatch decisions per second with 1, 2, 4 processes per store.
    Scaling(scaling::ScalingArgs),
    /// The gateway end to end under open-loop load, shm vs Redis.
    #[command(name = "e2e")]
    EndToEnd(end_to_end::EndToEndArgs),
    /// Every routing policy on the same workloads: TTFT, SLO attainment, goodput.
    Replay(replay::ReplayArgs),
    /// Routing policies in front of real llama.cpp engines (SmolLM2 on
    /// CPU), beside the simulator calibrated to them.
    Llama(replay::real_engine::LlamaArgs),
    /// The tokenizer: HF against the native engine, per token and per
    /// multi-turn request with and without the segment cache.
    Tokenizer(tokenizer::TokenizerArgs),
    /// semlb against nginx in front of the same engine: latency, CPU per request.
    Proxy(proxy::ProxyArgs),
    /// The endpoint picker's decision cost (Envoy's ext_proc) beside the
    /// HTTP proxy's per request.
    Epp(epp::EppArgs),
    /// What keeping the routing state is worth: a restart with and
    /// without the segment kept, two gateway hosts sharing Redis or not.
    State(state::StateArgs),
    /// The noisy neighbour: a quiet tenant's TTFT beside a flooding one,
    /// engine queues vs the gateway queue oldest first vs fair share.
    Tenants(tenants::TenantsArgs),
    /// Two regions whose peaks do not coincide: each alone, pooled by
    /// overflow, SkyLB-style forwarding between peer gateways.
    Regions(regions::RegionsArgs),
    /// Engines killed under a streamed load: answers completed with
    /// stream resumption on and off, beside a peer router.
    Churn(churn::ChurnArgs),
    /// Disaggregated prefill and decode against aggregated serving:
    /// goodput under interference, pairing and bypass on conversations.
    Pd(pd::PdArgs),
    /// Every report with its default settings.
    All(Common),
    /// A load process of `scaling` (not for direct use).
    #[command(name = "__bench-worker", hide = true)]
    BenchWorker(scaling::WorkerArgs),
    /// The ext_proc floor of `epp`: answers only (not for direct use).
    #[command(name = "__null-ext-proc", hide = true)]
    NullExtProc(epp_floor::NullArgs),
}

/// Flags every report takes.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// Directory for the JSON and SVG outputs (created if missing).
    #[arg(long, value_name = "DIR", default_value = "target/semlb-bench")]
    pub out: PathBuf,
    /// Use this Redis instead of starting a private `redis-server`
    /// (the benchmark writes under its own namespace and deletes it).
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
    /// The `redis-server` binary to start a private instance with.
    #[arg(long, value_name = "PATH", default_value = "redis-server")]
    pub redis_server: PathBuf,
    /// Skip every Redis measurement (shm only).
    #[arg(long)]
    pub no_redis: bool,
    /// Data directory with prompts/, tokenizers/ and traces/ [default:
    /// ../shared/data next to the working directory, when present].
    #[arg(long, value_name = "DIR", env = "SEMLB_BENCH_DATA")]
    pub data: Option<PathBuf>,
}

impl Common {
    /// The data directory, if any.
    pub fn data_dir(&self) -> Option<PathBuf> {
        if let Some(d) = &self.data {
            return Some(d.clone());
        }
        ["../shared/data", "../../shared/data"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_dir())
    }
}

/// The `semlb` binary next to this executable: the gateway and the
/// simulated engines (`semlb __sim`) the reports start.
pub fn semlb_exe() -> Result<std::path::PathBuf> {
    Ok(semlb_test_support::process::semlb_exe()?)
}

/// Runs a `semlb-bench` command.
pub fn run(command: &BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Dispatch(args) => dispatch_path::run(args),
        BenchCommand::Scaling(args) => scaling::run(args),
        BenchCommand::EndToEnd(args) => end_to_end::run(args),
        BenchCommand::Replay(args) => replay::run(args),
        BenchCommand::Llama(args) => replay::real_engine::run(args),
        BenchCommand::Tokenizer(args) => tokenizer::run(args),
        BenchCommand::Proxy(args) => proxy::run(args),
        BenchCommand::Epp(args) => epp::run(args),
        BenchCommand::State(args) => state::run(args),
        BenchCommand::Tenants(args) => tenants::run(args),
        BenchCommand::Regions(args) => regions::run(args),
        BenchCommand::Pd(args) => pd::run(args),
        BenchCommand::Churn(args) => churn::run(args),
        BenchCommand::BenchWorker(args) => scaling::run_worker(args),
        BenchCommand::NullExtProc(args) => epp_floor::run(args),
        BenchCommand::All(common) => {
            tokenizer::run(&tokenizer::TokenizerArgs::with(common.clone()))?;
            dispatch_path::run(&dispatch_path::DispatchArgs::with(common.clone()))?;
            scaling::run(&scaling::ScalingArgs::with(common.clone()))?;
            end_to_end::run(&end_to_end::EndToEndArgs::with(common.clone()))?;
            replay::run(&replay::ReplayArgs::with(common.clone()))?;
            // Last: it watches SIGINT itself from its start on.
            proxy::run(&proxy::ProxyArgs::with(common.clone()))
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
