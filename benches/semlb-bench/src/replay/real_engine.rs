//! `semlb bench llama`: routing policies in front of a real engine,
//! llama.cpp's `llama-server` with SmolLM2-135M on CPU (as
//! `workers/recipes/llama-cpp/get.sh` builds and fetches them), beside the
//! simulator calibrated to it, on the same closed-loop chat workload.
//!
//! # Workload
//!
//! The `chat` workload's generator ([`chat`]) at the size one CPU thread
//! per engine serves in a minute or two: `--conversations` (default 40)
//! conversations of 2–5 turns on four system prompts of 150–300 words
//! (about 200–400 tokens with SmolLM2's tokenizer), questions of 8–24
//! words, answers of 8–24 tokens (`ignore_eos`, `temperature` 1, so never
//! from the response cache), sent by `--clients` (default 4) clients that
//! each send the next turn the instant the answer ends, streamed (or not,
//! `--plain`). No session header: most chat clients send none.
//!
//! # Engines
//!
//! `--engines` (default 2) `llama-server` processes, each with
//! `--threads` (default 1) CPU threads and `--slots` (default 2) parallel
//! slots sharing `--context` (default 8 192) tokens, started fresh for
//! every run (every cache starts cold). Then, unless `--no-sim`, the same
//! runs on as many `semlb __sim` engines **calibrated to the real one**
//! before the first run ([`Calibration`]): its prefill rate and its decode
//! step with one and two sequences, from the `timings` a fresh
//! `llama-server` reports for an uncached prompt and for two at once;
//! `--max-num-seqs` = the slots (the `semlb-sim` binary next to `semlb`:
//! `cargo build --release -p semlb -p semlb-bench -p semlb-workers`) and `--metrics-flavor llamacpp`, so the
//! gateway reads the same series from both. The simulator keeps its
//! default KV capacity (400 000 tokens): `llama-server` keeps prompt
//! states beyond its slots in host memory (`--cache-ram`, 8 GiB by
//! default, some 350 000 tokens of SmolLM2's KV), far more than this
//! workload holds. The two tables side by side show whether the simulator, which
//! every other report uses, ranks the policies as the real engine does.
//!
//! # Figures (per engine kind and policy)
//!
//! Completed requests per second and output tokens per second (from the
//! first request to the last completion); TTFT p50/p90/p99 as the client
//! sees it; the engines' own cached-token share (Σ
//! `llamacpp:prompt_tokens_cached_total` / Σ (that + `prompt_tokens_total`,
//! which excludes cached tokens), read from every engine's `/metrics` at
//! the end); the share of a conversation's turns answered by the engine
//! that answered its previous turn (from `x-semlb-backend`); requests per
//! engine; errors. A benchmark measures: nothing here asserts a speed.
//!
//! # Rows
//!
//! One per `--policies` entry, plus one per `--variant LABEL=POLICY@FILE`
//! (a policy with a gateway configuration of its own, e.g. other
//! thresholds), each also with llama.cpp's slot pinning if `--pin-slots`
//! says so: every request of a conversation carries `id_slot` =
//! the conversation's number modulo `--slots` (`both`: every row with and
//! without). `--repeats N` runs every row N times, interleaved (each
//! round runs every row once), so the machine's drift spreads over all of
//! them, and adds a table of each row's mean and range.
//!
//! Output: the tables on stdout and `<out>/llama.json` (every run, the
//! calibration, the engine's version and options).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use semlb::routing::PolicyKind;
use semlb_test_support::gateway::Gateway;
use semlb_test_support::llama::{LlamaInstall, LlamaOptions, LlamaServer};
use semlb_test_support::process::{Proc, ProcBuilder, Stderr};
use serde_json::{Value, json};

use super::counters::metric_sum;
use super::sessions::{self, Sender, Start};
use crate::Common;
use crate::end_to_end::{LoadClient, Outcome, unique_name};
use crate::output::{self, Table};
use crate::workload::Workload;
use crate::workload::chat::{self, ChatParams, ChatShape};

/// `semlb bench llama` flags.
#[derive(Debug, Clone, Args)]
pub struct LlamaArgs {
    /// Common flags (`--out`, `--data`; no Redis is used).
    #[command(flatten)]
    pub common: Common,
    /// `llama-server` [default: $LLAMA_SERVER, else get.sh's cache under target/llama-cpp].
    #[arg(long, value_name = "PATH")]
    pub llama_server: Option<PathBuf>,
    /// The GGUF model, also the gateway's tokenizer [default: $LLAMA_MODEL, else get.sh's cache].
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Engines behind the gateway.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub engines: usize,
    /// CPU threads of each engine (`-t`).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub threads: u32,
    /// Parallel slots of each engine (`-np`).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub slots: u32,
    /// Context tokens of each engine, shared by its slots (`-c`).
    #[arg(long, value_name = "TOKENS", default_value_t = 8192)]
    pub context: u32,
    /// Routing policies, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "cache_aware,round_robin,consistent_hash,least_load"
    )]
    pub policies: Vec<PolicyKind>,
    /// Conversations.
    #[arg(long, value_name = "N", default_value_t = 40)]
    pub conversations: usize,
    /// Clients (requests in flight).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub clients: usize,
    /// Clients that do not stream (a non-streamed answer's TTFT is its latency).
    #[arg(long)]
    pub plain: bool,
    /// Dispatcher processes of the gateway.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub dispatchers: usize,
    /// A gateway configuration file (TOML) for every run, e.g. a policy's
    /// parameters.
    #[arg(long, value_name = "FILE")]
    pub gateway_config: Option<PathBuf>,
    /// Skip the calibrated simulator's runs.
    #[arg(long)]
    pub no_sim: bool,
    /// Seed of the workload.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Real seconds the last conversations may take once all have started.
    #[arg(long, value_name = "S", default_value_t = 120.0)]
    pub drain_secs: f64,
    /// Runs of every row, interleaved; with more than one, a table of each
    /// row's mean and range follows.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeats: usize,
    /// Another row: POLICY with the gateway configuration FILE (TOML,
    /// appended to --gateway-config's), named LABEL. Repeatable.
    #[arg(long = "variant", value_name = "LABEL=POLICY[@FILE]", value_parser = super::variant::parse_variant)]
    pub variants: Vec<super::variant::Variant>,
    /// llama.cpp's slot pinning: each conversation's requests carry
    /// `id_slot` = its number modulo --slots (`on`), or not (`off`), or
    /// every row both ways (`both`).
    #[arg(long, value_enum, default_value_t = PinSlots::Off)]
    pub pin_slots: PinSlots,
}

/// Whether conversations are pinned to an engine slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PinSlots {
    /// Never: the engine picks the slot.
    Off,
    /// Always.
    On,
    /// Every row both ways.
    Both,
}

/// One row of the report: what a run is.
#[derive(Debug, Clone)]
struct Arm {
    label: String,
    policy: PolicyKind,
    /// Gateway configuration of its own (TOML), after --gateway-config's.
    config: String,
    /// Conversations pinned to slots.
    pin: bool,
}

impl Arm {
    /// The rows `args` asks for, in order.
    fn all(args: &LlamaArgs) -> Result<Vec<Self>> {
        let mut arms: Vec<Self> = args
            .policies
            .iter()
            .map(|&policy| Self {
                label: policy.name().to_owned(),
                policy,
                config: String::new(),
                pin: false,
            })
            .collect();
        for v in &args.variants {
            arms.push(Self {
                label: v.label.clone(),
                policy: v.policy,
                config: v.config_text()?,
                pin: false,
            });
        }
        Ok(match args.pin_slots {
            PinSlots::Off => arms,
            PinSlots::On => arms.into_iter().map(Self::pinned).collect(),
            PinSlots::Both => arms.into_iter().flat_map(|a| [a.clone(), a.pinned()]).collect(),
        })
    }

    fn pinned(self) -> Self {
        Self {
            label: format!("{} +id_slot", self.label),
            pin: true,
            ..self
        }
    }
}

/// The conversations' sizes: the `chat` workload scaled to a CPU engine.
fn shape() -> ChatShape {
    ChatShape {
        system_prompt_words: vec![150, 300, 200, 250],
        turns: (2, 5),
        question_words: (8, 24),
        output: (8, 24),
    }
}

/// What a fresh `llama-server` measured: the simulator's speeds.
#[derive(Debug, Clone, Copy)]
struct Calibration {
    /// Prompt tokens per second of an uncached prompt.
    prefill_tokens_per_s: f64,
    /// Milliseconds per output token with one sequence decoding.
    decode_ms_one: f64,
    /// Milliseconds per output token of each of two sequences decoding at once.
    decode_ms_two: f64,
}

impl Calibration {
    /// The simulator's decode step: base and per-sequence milliseconds
    /// (step = base + per_seq × sequences) through the two measurements.
    fn decode_step(&self) -> (f64, f64) {
        let per_seq = (self.decode_ms_two - self.decode_ms_one).max(0.0);
        ((self.decode_ms_one - per_seq).max(0.1), per_seq)
    }

    /// Measures `engine` (fresh, idle): one uncached prompt, then two
    /// other uncached prompts at once.
    fn measure(engine: &str, workload: &Workload) -> Result<Self> {
        let ask = |system: usize| -> Result<(f64, f64, f64)> {
            let body = json!({
                "model": "calibration",
                "messages": [
                    {"role": "system", "content": workload.systems[system]},
                    {"role": "user", "content": "Say something long."},
                ],
                "max_tokens": 32,
                "ignore_eos": true,
                "temperature": 1.0,
            });
            let r = semlb_test_support::http::http(engine, "POST", "/v1/chat/completions", Some(&body), &[])
                .map_err(|e| anyhow::anyhow!("calibration request: {e}"))?;
            let answer = String::from_utf8_lossy(&r.body);
            if r.status != 200 {
                bail!("calibration request answered {}: {answer}", r.status);
            }
            let v: Value = serde_json::from_str(&answer).with_context(|| format!("calibration answer {answer}"))?;
            let t = &v["timings"];
            let num = |k: &str| t[k].as_f64().with_context(|| format!("no timings.{k} in the answer"));
            Ok((num("prompt_n")?, num("prompt_ms")?, num("predicted_per_token_ms")?))
        };
        let (prompt_n, prompt_ms, decode_ms_one) = ask(0)?;
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| ask(1));
            let b = s.spawn(|| ask(2));
            (a.join(), b.join())
        });
        let (a, b) = (
            a.map_err(|_| anyhow::anyhow!("panic"))??,
            b.map_err(|_| anyhow::anyhow!("panic"))??,
        );
        Ok(Self {
            prefill_tokens_per_s: prompt_n / (prompt_ms / 1e3),
            decode_ms_one,
            decode_ms_two: (a.2 + b.2) / 2.0,
        })
    }

    fn json(&self) -> Value {
        let (base, per_seq) = self.decode_step();
        json!({
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_ms_per_token_one_sequence": self.decode_ms_one,
            "decode_ms_per_token_two_sequences": self.decode_ms_two,
            "sim_decode_step_base_ms": base,
            "sim_decode_step_per_seq_ms": per_seq,
        })
    }
}

/// Which engines a run is in front of.
#[derive(Debug, Clone, Copy)]
enum EngineKind {
    /// `llama-server`.
    Llama,
    /// `semlb __sim` calibrated to it.
    Sim(Calibration),
}

impl EngineKind {
    fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama.cpp",
            Self::Sim(_) => "simulator (calibrated)",
        }
    }
}

/// The engines of one run, stopped when dropped.
enum Engines {
    Llama(Vec<LlamaServer>),
    Sim(Vec<Proc>),
}

impl Engines {
    fn addrs(&self) -> Vec<String> {
        match self {
            Self::Llama(v) => v.iter().map(|e| e.addr.clone()).collect(),
            Self::Sim(v) => v.iter().map(|e| e.addr.clone()).collect(),
        }
    }
}

/// What one run measured.
struct Run {
    outcomes: Vec<(Outcome, u32)>,
    wall_s: f64,
    /// Per engine: prompt tokens prefilled (cached excluded), cached.
    engine_tokens: Vec<(f64, f64)>,
    addrs: Vec<String>,
    /// Requests the gateway resent on a new connection because the engine
    /// had closed the pooled one (`semlb_upstream_stale_connections_total`).
    resent: f64,
}

/// Runs the report.
pub fn run(args: &LlamaArgs) -> Result<()> {
    let located = LlamaInstall::located();
    let install = LlamaInstall {
        server: args.llama_server.clone().unwrap_or(located.server),
        model: args.model.clone().unwrap_or(located.model),
    };
    if !install.is_there() {
        bail!(
            "no llama.cpp engine at {} and {}: run workers/recipes/llama-cpp/get.sh (or pass --llama-server and --model)",
            install.server.display(),
            install.model.display()
        );
    }
    if args.engines == 0 || args.clients == 0 || args.conversations == 0 {
        bail!("--engines, --clients and --conversations must be at least 1");
    }
    let options = LlamaOptions {
        threads: args.threads,
        slots: args.slots,
        context: args.context,
    };
    let version = std::process::Command::new(&install.server)
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&[o.stdout, o.stderr].concat())
                .trim()
                .to_owned()
        })
        .unwrap_or_default();
    let workload = Arc::new(chat::build(&ChatParams {
        conversations: args.conversations,
        max_output: 2048,
        seed: args.seed,
        shape: shape(),
    }));
    let client = LoadClient::new()?;
    let mut kinds = vec![EngineKind::Llama];
    let mut calibration = None;
    if !args.no_sim {
        let engine = LlamaServer::try_start_with(&install, &options).map_err(anyhow::Error::msg)?;
        let c = Calibration::measure(&engine.addr, &workload)?;
        eprintln!(
            "calibration: prefill {:.0} tokens/s, decode {:.1} ms/token (one sequence), {:.1} ms/token (two)",
            c.prefill_tokens_per_s, c.decode_ms_one, c.decode_ms_two
        );
        calibration = Some(c);
        kinds.push(EngineKind::Sim(c));
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let arms = Arm::all(args)?;
    let mut runs_json = Vec::new();
    for kind in kinds {
        let mut table = Table::new([
            "policy",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "p90",
            "p99",
            "engines' cached",
            "same engine",
            "per engine",
            "errors",
            "resent",
        ]);
        let mut all: Vec<Vec<Figures>> = vec![Vec::new(); arms.len()];
        for round in 0..args.repeats {
            for (arm, figures_of_arm) in arms.iter().zip(&mut all) {
                let label = if args.repeats > 1 {
                    format!("{} #{}", arm.label, round + 1)
                } else {
                    arm.label.clone()
                };
                let bar = output::progress(workload.requests.len() as u64, &format!("{} {label}", kind.name()));
                let run = run_once(args, kind, arm, &install, &options, &workload, &client, &bar)?;
                bar.finish_and_clear();
                let figures = Figures::of(&run, &workload);
                if !figures.error_kinds.is_empty() {
                    eprintln!("{} {label}: failed calls {:?}", kind.name(), figures.error_kinds);
                }
                table.row(figures.cells(&label));
                runs_json.push(json!({
                    "engines": kind.name(),
                    "row": arm.label,
                    "policy": arm.policy.name(),
                    "config": arm.config,
                    "id_slot": arm.pin,
                    "round": round + 1,
                    "figures": figures.json(),
                    "engine_tokens": run.engine_tokens.iter().map(|(p, c)| json!({"prefilled": p, "cached": c})).collect::<Vec<_>>(),
                }));
                figures_of_arm.push(figures);
            }
        }
        let title = format!(
            "{} engines: {} × {} thread(s), {} slots, {} context tokens; {} conversations, {} clients, {}",
            kind.name(),
            args.engines,
            args.threads,
            args.slots,
            args.context,
            args.conversations,
            args.clients,
            if args.plain { "not streamed" } else { "streamed" }
        );
        output::print_table(&title, &table);
        if args.repeats > 1 {
            let mut summary = Table::new([
                "row",
                "runs",
                "req/s mean",
                "range",
                "TTFT p50 mean",
                "p90 mean",
                "engines' cached",
                "same engine",
            ]);
            for (arm, figures) in arms.iter().zip(&all) {
                summary.row(Figures::summary(&arm.label, figures));
            }
            output::print_table(&format!("{title}: mean of {} runs", args.repeats), &summary);
        }
    }
    let path = output::write_json(
        &args.common.out,
        "llama",
        &json!({
            "engine": {"server": install.server, "model": install.model, "version": version,
                       "threads": args.threads, "slots": args.slots, "context": args.context},
            "gateway_config": args.gateway_config,
            "workload": {"source": workload.source, "requests": workload.requests.len(), "clients": args.clients,
                         "stream": !args.plain, "dispatchers": args.dispatchers},
            "calibration": calibration.map(|c| c.json()),
            "runs": runs_json,
        }),
    )?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Starts `kind`'s engines and a gateway with `policy`, sends the
/// workload, and reads the engines' counters.
#[allow(clippy::too_many_arguments)]
fn run_once(
    args: &LlamaArgs,
    kind: EngineKind,
    arm: &Arm,
    install: &LlamaInstall,
    options: &LlamaOptions,
    workload: &Arc<Workload>,
    client: &LoadClient,
    bar: &indicatif::ProgressBar,
) -> Result<Run> {
    let engines = match kind {
        EngineKind::Llama => Engines::Llama(
            (0..args.engines)
                .map(|_| LlamaServer::try_start_with(install, options).map_err(anyhow::Error::msg))
                .collect::<Result<_>>()?,
        ),
        EngineKind::Sim(c) => Engines::Sim(start_sims(args.engines, &c, install, options)?),
    };
    let addrs = engines.addrs();
    let prefill = match kind {
        EngineKind::Sim(c) => c.prefill_tokens_per_s,
        EngineKind::Llama => 0.0,
    };
    let mut builder = Gateway::builder()
        .shm(&unique_name("llama"))
        .tag("llama")
        .shm_size("64MiB")
        .dispatchers(args.dispatchers)
        .policy(arm.policy.name())
        .stderr(Stderr::Tail(40))
        .within(Duration::from_secs(60))
        .args(&["--tokenizer".to_owned(), install.model.display().to_string()]);
    let mut config = match &args.gateway_config {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        None => String::new(),
    };
    config += "\n";
    config += &arm.config;
    if prefill > 0.0 && !config.contains("[policy.dual_map]") {
        config += &format!(
            "\n[policy.dual_map]\nprefill_tokens_per_sec = {}\n",
            prefill.round() as u64
        );
    }
    if !config.trim().is_empty() {
        builder = builder.config(&config);
    }
    for a in &addrs {
        builder = builder.backend(a);
    }
    let gateway = builder
        .try_start()
        .with_context(|| format!("starting the gateway for {}", arm.label))?;
    let sender = Sender {
        http: client.http.clone(),
        addr: gateway.addr().to_owned(),
        stream: !args.plain,
        progress: bar.clone(),
        pin_slots: arm.pin.then_some(args.slots),
        answered: None,
    };
    let drain = Duration::from_secs_f64(args.drain_secs.max(0.0));
    let sessions::Sent { outcomes, wall_s, .. } = client.runtime.block_on(sessions::send(
        workload.clone(),
        sender,
        Start::Clients(args.clients),
        |_| 0.0,
        drain,
    ));
    let mut engine_tokens = Vec::with_capacity(addrs.len());
    for a in &addrs {
        let (status, text) = client
            .get(a, "/metrics")
            .with_context(|| format!("reading /metrics of {a}"))?;
        if status != 200 {
            bail!("GET /metrics of {a} answered {status}");
        }
        let m = |n| metric_sum(&text, n).unwrap_or(0.0);
        engine_tokens.push((
            m("llamacpp:prompt_tokens_total"),
            m("llamacpp:prompt_tokens_cached_total"),
        ));
    }
    let resent = metric_sum(&gateway.metrics(), "semlb_upstream_stale_connections_total").unwrap_or(0.0);
    drop(gateway);
    drop(engines);
    Ok(Run {
        outcomes,
        wall_s,
        engine_tokens,
        addrs,
        resent,
    })
}

/// `n` simulated engines with `c`'s speeds, `options`' slots,
/// the model's tokenizer and chat template, and llama.cpp's metrics.
fn start_sims(n: usize, c: &Calibration, install: &LlamaInstall, options: &LlamaOptions) -> Result<Vec<Proc>> {
    let (base, per_seq) = c.decode_step();
    // The simulator's own binary (every flag), next to `semlb`.
    let sim = crate::semlb_exe()?.with_file_name("semlb-sim");
    if !sim.is_file() {
        bail!(
            "no {} (cargo build --release -p semlb-workers builds it)",
            sim.display()
        );
    }
    (0..n)
        .map(|i| {
            let args: Vec<String> = [
                "--listen",
                "127.0.0.1:0",
                "--time-scale",
                "1",
                "--metrics-flavor",
                "llamacpp",
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .chain([
                "--tokenizer".to_owned(),
                install.model.display().to_string(),
                "--prefill-tokens-per-s".into(),
                format!("{:.1}", c.prefill_tokens_per_s),
                "--decode-step-base-ms".into(),
                format!("{base:.3}"),
                "--decode-step-per-seq-ms".into(),
                format!("{per_seq:.3}"),
                "--max-num-seqs".into(),
                options.slots.to_string(),
            ])
            .collect();
            Ok(ProcBuilder::new(args)
                .program(&sim)
                .what(format!("simulated engine {i}"))
                .stderr(Stderr::Tail(40))
                .within(Duration::from_secs(30))
                .try_start()?)
        })
        .collect()
}

/// One run's figures.
#[derive(Debug, Clone)]
struct Figures {
    completed: usize,
    errors: usize,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    ttft_ms: [f64; 3],
    cached_share: f64,
    same_engine: f64,
    per_engine: Vec<usize>,
    /// Failed calls by status and error.
    error_kinds: std::collections::BTreeMap<String, usize>,
    /// Requests resent after a stale connection.
    resent: f64,
}

impl Figures {
    fn of(run: &Run, workload: &Workload) -> Self {
        let ok: Vec<(usize, &Outcome, u32)> = run
            .outcomes
            .iter()
            .enumerate()
            .filter(|(_, (o, _))| o.ok())
            .map(|(i, (o, t))| (i, o, *t))
            .collect();
        let mut ttft: Vec<f64> = ok
            .iter()
            .filter_map(|(_, o, _)| o.ttft)
            .map(|t| t.as_secs_f64() * 1e3)
            .collect();
        output::sort(&mut ttft);
        let wall = run.wall_s.max(1e-9);
        let (prefilled, cached) = run
            .engine_tokens
            .iter()
            .fold((0.0, 0.0), |(p, c), (ep, ec)| (p + ep, c + ec));
        // Per engine, and whether each turn went where its previous one did.
        let backend_of = |i: usize| run.outcomes[i].0.backend.clone().filter(|_| run.outcomes[i].0.ok());
        let per_engine = run
            .addrs
            .iter()
            .map(|a| {
                ok.iter()
                    .filter(|(_, o, _)| {
                        o.backend
                            .as_deref()
                            .is_some_and(|b| b.strip_prefix("http://").unwrap_or(b) == a)
                    })
                    .count()
            })
            .collect();
        let (mut same, mut follow_ups) = (0usize, 0usize);
        for (i, r) in workload.requests.iter().enumerate().skip(1) {
            let previous = &workload.requests[i - 1];
            if r.chat.as_ref().is_some_and(|c| c.step > 0)
                && previous.session == r.session
                && let (Some(a), Some(b)) = (backend_of(i - 1), backend_of(i))
            {
                follow_ups += 1;
                same += usize::from(a == b);
            }
        }
        let mut error_kinds = std::collections::BTreeMap::new();
        for (o, _) in run.outcomes.iter().filter(|(o, _)| !o.ok()) {
            let kind = format!("{} {}", o.status, o.error.as_deref().unwrap_or("no [DONE]"));
            *error_kinds.entry(kind).or_insert(0) += 1;
        }
        Self {
            completed: ok.len(),
            errors: run.outcomes.len() - ok.len(),
            requests_per_s: ok.len() as f64 / wall,
            output_tokens_per_s: ok.iter().map(|(_, _, t)| f64::from(*t)).sum::<f64>() / wall,
            ttft_ms: [0.5, 0.9, 0.99].map(|q| output::quantile(&ttft, q)),
            cached_share: cached / (prefilled + cached).max(1.0),
            same_engine: same as f64 / follow_ups.max(1) as f64,
            per_engine,
            error_kinds,
            resent: run.resent,
        }
    }

    fn cells(&self, label: &str) -> Vec<String> {
        let ms = |v: f64| format!("{v:.0} ms");
        vec![
            label.to_owned(),
            format!("{:.2}", self.requests_per_s),
            format!("{:.1}", self.output_tokens_per_s),
            ms(self.ttft_ms[0]),
            ms(self.ttft_ms[1]),
            ms(self.ttft_ms[2]),
            format!("{:.1} %", self.cached_share * 100.0),
            format!("{:.0} %", self.same_engine * 100.0),
            self.per_engine
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" / "),
            self.errors.to_string(),
            format!("{:.0}", self.resent),
        ]
    }

    /// A row of the repeats' summary: `runs`' means, and the req/s range.
    fn summary(label: &str, runs: &[Figures]) -> Vec<String> {
        let n = runs.len().max(1) as f64;
        let mean = |f: fn(&Figures) -> f64| runs.iter().map(f).sum::<f64>() / n;
        let rates = runs.iter().map(|f| f.requests_per_s);
        let (lo, hi) = rates.fold((f64::INFINITY, 0.0f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
        vec![
            label.to_owned(),
            runs.len().to_string(),
            format!("{:.2}", mean(|f| f.requests_per_s)),
            format!("{lo:.2}–{hi:.2}"),
            format!("{:.0} ms", mean(|f| f.ttft_ms[0])),
            format!("{:.0} ms", mean(|f| f.ttft_ms[1])),
            format!("{:.1} %", mean(|f| f.cached_share) * 100.0),
            format!("{:.0} %", mean(|f| f.same_engine) * 100.0),
        ]
    }

    fn json(&self) -> Value {
        json!({
            "completed": self.completed,
            "errors": self.errors,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_ms": {"p50": self.ttft_ms[0], "p90": self.ttft_ms[1], "p99": self.ttft_ms[2]},
            "engines_cached_share": self.cached_share,
            "same_engine_share": self.same_engine,
            "requests_per_engine": self.per_engine,
            "errors_by_kind": self.error_kinds,
            "resent_after_stale_connection": self.resent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_step_goes_through_both_measurements() {
        let c = Calibration {
            prefill_tokens_per_s: 500.0,
            decode_ms_one: 12.0,
            decode_ms_two: 15.0,
        };
        let (base, per_seq) = c.decode_step();
        assert_eq!((base + per_seq, base + 2.0 * per_seq), (12.0, 15.0));
        // Two sequences measured faster than one (noise): no negative step.
        let noisy = Calibration {
            decode_ms_two: 11.0,
            ..c
        };
        assert_eq!(noisy.decode_step(), (12.0, 0.0));
    }

    #[test]
    fn the_workload_is_small_conversations_on_shared_system_prompts() {
        let w = chat::build(&ChatParams {
            conversations: 40,
            max_output: 2048,
            seed: 0,
            shape: shape(),
        });
        let turns = w.requests.len() as f64 / 40.0;
        assert!((2.0..=5.0).contains(&turns), "{turns}");
        assert_eq!(w.systems.len(), 4);
        assert!(w.requests.iter().all(|r| (8..=24).contains(&r.output_tokens)));
    }
}
