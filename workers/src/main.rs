//! `semlb-sim`: a simulated OpenAI-compatible inference engine that behaves
//! like vLLM where routing matters (prefix KV cache, continuous batching,
//! vLLM metrics), for tests and benchmarks without GPUs.
//!
//! This file only turns flags into an [`EngineConfig`], a [`FaultConfig`],
//! a [`PdConfig`] and a [`Sim`], binds the listener (and an SGLang prefill
//! engine's bootstrap port), prints `semlb-sim listening on http://ADDR`
//! (the bound address, so `--listen 127.0.0.1:0` works for scripts; KV
//! event endpoints and the bootstrap address come first when there are
//! any: `semlb-sim kv events on tcp://A replay tcp://B; bootstrap on
//! HOST:PORT; listening on http://ADDR`) and runs [`serve`] until
//! SIGTERM or SIGINT (graceful: in-flight requests finish; a second signal
//! exits at once with status 130) or until `--exit-after` fires (exit
//! status 0). Every flag is documented in `workers/README.md`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use semlb_workers::config::EngineConfig;
use semlb_workers::engine::Engine;
use semlb_workers::faults::{FaultConfig, StreamFaultArgs};
use semlb_workers::kv_events;
use semlb_workers::metrics::MetricsFlavor;
use semlb_workers::pd::{Pd, PdConfig};
use semlb_workers::server::{Sim, serve};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// A simulated OpenAI-compatible inference server (vLLM-like prefix KV
/// cache, continuous batching and metrics) for tests and benchmarks
/// without GPUs.
#[derive(Debug, Parser)]
#[command(name = "semlb-sim", version)]
struct Args {
    /// Address to listen on (port 0: any free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:8000", value_name = "ADDR")]
    listen: String,
    /// Served model name (`/v1/models`, the `model` field, metric labels).
    #[arg(long, default_value_t = defaults().model_name, value_name = "NAME")]
    model: String,
    /// A LoRA adapter it also serves (repeatable), as vLLM's
    /// `--lora-modules NAME=PATH`: requests may name it, `/v1/models` lists
    /// it, and its prompts are cached apart from the base model's.
    #[arg(long = "lora", value_name = "NAME")]
    lora_adapters: Vec<String>,
    /// HF tokenizer.json, or a GGUF model file, to tokenize prompts with
    /// [default: the bundled Phi-2/GPT-2 tokenizer].
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// HF tokenizer_config.json (or GGUF model file) whose chat template
    /// renders chat messages [default: a GGUF `--tokenizer`'s own, else the
    /// canonical template].
    #[arg(long, value_name = "PATH")]
    chat_template: Option<PathBuf>,

    /// Tokens per KV block.
    #[arg(long, default_value_t = defaults().block_size, value_name = "TOKENS")]
    block_size: u32,
    /// KV cache capacity in tokens (rounded down to whole blocks).
    #[arg(long, default_value_t = defaults().kv_capacity_tokens, value_name = "TOKENS")]
    kv_capacity_tokens: u64,
    /// Most sequences in the running batch.
    #[arg(long, default_value_t = defaults().max_num_seqs, value_name = "N")]
    max_num_seqs: u32,
    /// Longest prompt + output accepted, in tokens.
    #[arg(long, default_value_t = defaults().max_model_len, value_name = "TOKENS")]
    max_model_len: u32,
    /// Simulated prefill speed for uncached prompt tokens.
    #[arg(long, default_value_t = defaults().prefill_tokens_per_s, value_name = "TOKENS_PER_S")]
    prefill_tokens_per_s: f64,
    /// Simulated duration of one decode step with an empty batch.
    #[arg(long, default_value_t = defaults().decode_step_base_ms, value_name = "MS")]
    decode_step_base_ms: f64,
    /// Extra duration of one decode step per running sequence.
    #[arg(long, default_value_t = defaults().decode_step_per_seq_ms, value_name = "MS")]
    decode_step_per_seq_ms: f64,
    /// Output length when neither max_tokens nor x-semlb-output-tokens gives one.
    #[arg(long, default_value_t = defaults().default_output_tokens, value_name = "TOKENS")]
    default_output_tokens: u32,
    /// Real duration of one simulated second (1 = real time, 0.01 = 100x faster).
    #[arg(long, default_value_t = defaults().time_scale, value_name = "FACTOR")]
    time_scale: f64,

    /// Fraction of inference requests answered 500 before reaching the engine.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    fail_rate: f64,
    /// Fraction of inference responses cut mid-way (after the first SSE chunk, or after the headers).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    reset_rate: f64,
    /// Real milliseconds added before every response.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    delay_ms: u64,
    /// After N inference requests, read every request and never answer.
    #[arg(long, value_name = "N")]
    hang_after: Option<u64>,
    /// Stop gracefully and exit with status 0 once N inference requests have completed.
    #[arg(long, value_name = "N")]
    exit_after: Option<u64>,
    /// Seed of the fault-injection decisions.
    #[arg(long, default_value_t = 0, value_name = "N")]
    seed: u64,
    /// Streamed answers broken mid-way.
    #[command(flatten)]
    stream_faults: StreamFaultArgs,

    /// Metric names on /metrics: vllm, sglang, both, llamacpp (llama.cpp's
    /// unlabelled series, no KV gauge), or none (/metrics answers 404, as
    /// on an engine started without metrics).
    #[arg(long, default_value = "vllm", value_name = "FLAVOR")]
    metrics_flavor: MetricsFlavor,

    /// Answer llama.cpp's GET /props (total_slots = --max-num-seqs), as
    /// llama-server does with or without --metrics [default: with
    /// --metrics-flavor llamacpp].
    #[arg(long)]
    props: bool,

    /// Publish KV cache events as vLLM does, configured by vLLM's own JSON:
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    /// "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}` (port 0: a free
    /// one; the bound endpoints are printed).
    #[arg(long, value_name = "JSON")]
    kv_events_config: Option<String>,

    /// Disaggregated prefill/decode.
    #[command(flatten)]
    pd: PdConfig,
}

/// The library's defaults, so the flags' defaults cannot drift from them.
fn defaults() -> EngineConfig {
    EngineConfig::default()
}

impl Args {
    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            model_name: self.model.clone(),
            lora_adapters: self.lora_adapters.clone(),
            block_size: self.block_size,
            kv_capacity_tokens: self.kv_capacity_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            decode_step_base_ms: self.decode_step_base_ms,
            decode_step_per_seq_ms: self.decode_step_per_seq_ms,
            default_output_tokens: self.default_output_tokens,
            time_scale: self.time_scale,
        }
    }

    fn fault_config(&self) -> FaultConfig {
        FaultConfig {
            fail_rate: self.fail_rate,
            reset_rate: self.reset_rate,
            delay: Duration::from_millis(self.delay_ms),
            hang_after: self.hang_after,
            exit_after: self.exit_after,
            seed: self.seed,
            stream_fault: self.stream_faults.fault(),
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT; a second one exits the
/// process at once with status 130.
async fn stop_signal(mut term: Signal, mut int: Signal) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    eprintln!("semlb-sim: stopping (finishing in-flight requests; signal again to exit now)");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        std::process::exit(130);
    });
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Starts the simulator and serves until a signal or `--exit-after`.
async fn run(args: Args) -> Result<()> {
    // First, so that a signal during start-up also stops gracefully.
    let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let config = args.engine_config();
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid engine configuration: {e}"))?;
    let faults = args.fault_config();
    faults
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid fault configuration: {e}"))?;
    let tokenizer = match &args.tokenizer {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::bundled(),
    };
    let template = ChatTemplate::resolve(args.chat_template.as_deref(), args.tokenizer.as_deref())?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let time_scale = config.time_scale;
    let engine = Engine::start(config);
    let pd = Pd::start(args.pd.clone(), addr.ip(), time_scale)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let published = kv_events::publish(args.kv_events_config.as_deref(), || engine.kv_events())
        .await
        .map_err(|e| anyhow::anyhow!("--kv-events-config: {e}"))?;
    // SGLang's `/model_info` names the tokenizer file, absolute so that a
    // router started elsewhere can load it too.
    let tokenizer_path = args.tokenizer.as_ref().map(|p| {
        std::path::absolute(p)
            .unwrap_or_else(|_| p.clone())
            .display()
            .to_string()
    });
    let bootstrap = pd.describe();
    let sim = Sim::new(engine, tokenizer, template, faults, args.metrics_flavor)
        .with_tokenizer_path(tokenizer_path)
        .with_pd(pd);
    let props = args.props || args.metrics_flavor == MetricsFlavor::Llamacpp;
    let sim = Arc::new(sim.with_props(props));

    let mut stdout = std::io::stdout().lock();
    let events = published.as_ref().map(kv_events::Bound::describe).unwrap_or_default();
    writeln!(stdout, "semlb-sim {events}{bootstrap}listening on http://{addr}").context("writing to stdout")?;
    stdout.flush().context("writing to stdout")?;
    drop(stdout);

    serve(listener, sim.clone(), stop_signal(term, int))
        .await
        .context("serving")?;
    if sim.exit_requested() {
        eprintln!(
            "semlb-sim: exiting after {} completed requests (--exit-after)",
            sim.faults().completed()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn defaults_match_the_library() {
        let args = Args::try_parse_from(["semlb-sim"]).unwrap();
        assert_eq!(args.engine_config(), EngineConfig::default());
        assert_eq!(args.fault_config(), FaultConfig::default());
        assert_eq!(args.pd, PdConfig::default());
        assert_eq!(args.metrics_flavor, MetricsFlavor::Vllm);
        assert_eq!(args.listen, "127.0.0.1:8000");
    }

    #[test]
    fn flags_parse() {
        use semlb_workers::pd::{PdProtocol, Role};
        let args = Args::try_parse_from([
            "semlb-sim",
            "--listen",
            "127.0.0.1:0",
            "--model",
            "m",
            "--block-size",
            "32",
            "--time-scale",
            "0.01",
            "--fail-rate",
            "0.5",
            "--hang-after",
            "3",
            "--delay-ms",
            "7",
            "--metrics-flavor",
            "both",
        ])
        .unwrap();
        assert_eq!(args.engine_config().block_size, 32);
        assert_eq!(args.engine_config().model_name, "m");
        assert_eq!(args.fault_config().hang_after, Some(3));
        assert_eq!(args.fault_config().delay, Duration::from_millis(7));
        assert_eq!(args.metrics_flavor, MetricsFlavor::Both);
        assert!(Args::try_parse_from(["semlb-sim", "--metrics-flavor", "tgi"]).is_err());
        let pd = Args::try_parse_from([
            "semlb-sim",
            "--role",
            "prefill",
            "--pd-protocol",
            "sglang",
            "--bootstrap-port",
            "0",
            "--waiting-timeout-s",
            "0.5",
        ])
        .unwrap()
        .pd;
        assert_eq!(
            (pd.role, pd.protocol, pd.bootstrap_port),
            (Role::Prefill, PdProtocol::Sglang, 0)
        );
        assert_eq!(pd.waiting_timeout_s, 0.5);
        assert!(Args::try_parse_from(["semlb-sim", "--role", "mixed"]).is_err());
    }
}
