//! `semlb bench replay`: every routing policy on the same workloads and
//! engines, with TTFT objectives and goodput.
//!
//! # Workloads
//!
//! `--workloads` (default all five, see [`workload`](super::workload)):
//!
//! | workload | requests | sessions | default speedup | default duration | default TTFT SLO |
//! | --- | --- | --- | --- | --- | --- |
//! | `mooncake` | the Mooncake conversation trace ([`mooncake`]): ~3 req/s, ~12 000-token prompts sharing 512-token blocks, ~58 % of the prefill capacity with perfect reuse | no | 20 | 600 s | 10 s |
//! | `hh-rlhf` | HH-RLHF chats ([`hh_rlhf`]): 90 conversations/s (`--hh-rlhf-rate`), ~220 req/s of ~100-token prompts, ~55 % of the prefill capacity without reuse | yes | 1 | 20 s | 1 s |
//! | `hot-prefix` | agent sessions on six hot system prompts ([`hot_prefix`]): 4.5 sessions/s (`--hot-prefix-rate`), ~16 req/s of ~5 900-token prompts, ~70 % of the prefill capacity with the system prompts cached | yes | 4 | 120 s | 2 s |
//! | `agents` | closed-loop agent sessions of 5–20 chat calls on four shared system prompts ([`agents`]), each call sent the instant the previous answer ends: 1.5 sessions/s (`--agents-rate`), ~19 calls/s, 18 % of the prefill capacity when every session stays on one engine, 235 % when none does | yes | 2 | 60 s | 1 s |
//! | `chat` | closed-loop multi-turn chats on four shared system prompts ([`chat`]): 400 conversations of 2–6 turns (`--chat-conversations`) sent by 16 clients (`--chat-clients`), each sending its next turn the instant its answer ends and starting a new conversation when one ends; no session ids; run on each of four engine sets ([`ChatSet`], `--chat-sets`) | no header (the same-engine share is still computed) | 10 | its conversations | 1 s |
//!
//! Every request but the `agents` and `chat` calls (chat requests whose
//! history holds the engine's real answers, `temperature` 1, `ignore_eos`,
//! `max_tokens` = the call's output; see [`agents`], [`chat`]) is a streaming
//! `/v1/completions` request whose `prompt` is
//! the array of token ids (the gateway and the simulator take token-id
//! prompts as they are), with `max_tokens` = its output length (capped by
//! `--max-output`), `ignore_eos` (the engine generates exactly that many
//! tokens) and `temperature` 1 (never answered from the response cache);
//! requests of a session carry `x-session-id: <session>`, which
//! session-affine policies route on. `mooncake` needs `<data>/traces/` (or
//! `--trace`), `hh-rlhf` `<data>/prompts/` and, for Qwen3 token ids,
//! `<data>/tokenizers/` (else the bundled phi-2 tokenizer); without them
//! those workloads are skipped with a message. `--duration S` and
//! `--limit N` shorten every workload (the first S trace seconds of the
//! trace, or a window of S trace seconds of the generated workloads; the
//! first N requests).
//!
//! The TTFT objectives: 10 s for `mooncake`, whose ~12 000-token prompts
//! take 1.2 s of prefill on an idle engine even without queueing
//! (long-document chat, where a few seconds to the first token is usual);
//! 1 s for `hh-rlhf`, an interactive chat whose prompts prefill in ~10 ms,
//! so only queueing can miss it; 2 s for `hot-prefix`, agent steps whose
//! uncached part (~700 tokens, ~0.1 s) is small when the shared prefix is
//! reused but whose 2 000–6 000-token system prompt alone takes up to 0.6 s
//! when it is not. `--ttft-slo S` sets one objective for all.
//!
//! # The `chat` workload's engine sets
//!
//! `chat` is the robustness check: a closed loop has no offered rate, so
//! what a policy loses by holding requests it should have sent, or by
//! piling conversations on one engine, shows directly as fewer requests
//! per second than `least_load` serves on the same engines. It runs on
//! four engine sets, each a table of its own (`chat/<set>`): engines with
//! `/metrics` or without (`semlb __sim --no-metrics`, as llama.cpp without
//! `--metrics`), clients that stream or not (a non-streamed answer is read
//! whole: its TTFT is its latency, the first token the client sees). Its
//! goodput column reads "closed loop" and it has no sweep (×1 only).
//!
//! # Time
//!
//! `--speedup X` (default per workload, above) divides the arrival times by
//! X and runs the simulated engines with `--time-scale 1/X` (the real
//! duration of one simulated second), so the load relative to engine
//! capacity is the workload's while the run takes 1/X of the time.
//! Latencies are reported in *trace time*: measured wall-clock times × X
//! (the gateway's own overhead is scaled too; at X = 20 a 1 ms dispatch
//! shows as 20 ms, small against the objectives). The gateway gets a
//! configuration file whose time-based parameters are scaled by X as well
//! ([`gateway_config`]). Arrivals are open-loop: each request is sent at its
//! scheduled time whatever the completions, and its times are measured from
//! that schedule (no coordinated omission).
//!
//! Every output token is one SSE event through the gateway and the load
//! generator, which share this 2-core machine with the engines, so X is
//! chosen per workload to keep the real event rate at m = 1 around 10 000–
//! 20 000 per second: `mooncake` offers ~1 000 output tokens per trace
//! second (X = 20), `hh-rlhf` ~13 000 (X = 1), `hot-prefix` ~2 800 (X = 4).
//! The report warns when the generator falls more than 50 ms (p99) behind
//! its schedule, i.e. when the machine rather than the engines limited a
//! run (most likely at the sweep's highest multipliers).
//!
//! # Runs, SLO attainment and goodput
//!
//! Each policy of [`PolicyKind::ALL`] (or `--policies a,b`) is a row;
//! `--compare-learning` adds a `policy/write-back-only` row per policy,
//! the gateway with `learn_at_dispatch = false` (learning left to the
//! response processes, as before learning at dispatch existed), and
//! `--compare-feedback` a `policy/no-feedback` row, with
//! `learn_from_reports = false` (engines' reports counted, not acted on);
//! `--kv-tokens N` gives the engines a KV cache of N tokens, small enough
//! to evict often; `--compare-prefix-sources` adds `policy/precise` and
//! `policy/precise-no-feedback`, whose engines publish their KV cache
//! events and whose gateway follows them with `[policy.prefix] source =
//! "precise"` (`confirm_window_secs = 1`), with and without the
//! `cached_tokens` feedback;
//! `selective_push` gives two more: `selective_push/unstarted` (its strict
//! mode) and `selective_push/max8`, its fixed-cap mode (`max_outstanding`
//! requests in flight per engine, `--max-outstanding 8`; 0 drops the row),
//! the baseline the SkyLB paper compares selective pushing with;
//! `--cost-weights 0.0625,1,16` adds a `cost/w=X` row per weight, `cost`
//! with that weight fixed (what its tuner chooses among). Each row is run on each
//! workload at the rate multipliers of `--sweep` (default `0.5,1,1.5,2`; 1
//! is always included): multiplier m divides the arrival times by m too
//! (m × the offered rate; think and tool times shrink with it) while the
//! engines keep their time scale. Every run has fresh engines and a fresh
//! gateway (new shm segment), so every cache starts cold.
//!
//! SLO attainment is the share of *all* requests sent (errors and requests
//! unfinished `--drain-secs` real seconds after the last arrival count as
//! misses) whose TTFT is at most the objective. Goodput is the highest
//! offered rate (requests per trace second) whose run reaches 90 %
//! attainment; "< r" (0 in the JSON, with `goodput_below_lowest_rate`)
//! when even the lowest multiplier r misses. Attainment falls as the rate
//! rises, so the sweep is a search: m = 1 first, then upwards while runs
//! reach 90 % (stopping at the first miss), or downwards until one does;
//! multipliers the search does not need are not run (listed in the JSON as
//! `not_run`).
//!
//! The table of a workload (one per workload on stdout), per policy, from
//! the m = 1 run: completed requests per trace second (from the first
//! arrival to the last completion); TTFT p50/p90/p99; SLO attainment; then
//! the sweep's goodput and the attainment at each multiplier run; the
//! engines' aggregate prefix-cache hit rate (Σ
//! `vllm:prefix_cache_hits_total` / Σ `vllm:prefix_cache_queries_total`
//! over the engines, in tokens, read from their `/metrics` at the end);
//! load imbalance as the coefficient of variation (population standard
//! deviation / mean) across engines of their **prefill busy time**, i.e.
//! uncached prompt tokens (`prompt_tokens − prefix_cache_hits`) divided by
//! the common prefill rate, and of requests served
//! (`vllm:request_success_total`); for workloads with sessions, the share
//! of a session's answered requests sent to the engine that answered its
//! previous one (`same engine`); the prediction accuracy (of the prompt
//! tokens the routing predicted the chosen engine held, the share it
//! reported cached: the gateway's `semlb_prefix_confirmed_tokens_total` /
//! `semlb_prefix_predicted_tokens_total`, with the shortfalls, demotions
//! and forgotten servers in the JSON); errors.
//!
//! # Run time
//!
//! A run takes its workload's duration / (X × m) plus the tail of its last
//! requests (up to ~20 trace seconds for `hh-rlhf`'s longest answers) and
//! ~4 s of start-up and shut-down. At m = 1 that is 20–30 s of sending for
//! each workload (600 s / 20, 20 s / 1, 120 s / 4). A policy that reaches
//! 90 % at ×1 and ×1.5 but not ×2 runs 1 + 0.67 + 0.5 of that; one that
//! misses at ×1 runs ×1 and ×0.5 (3 units): 80–100 s per policy and
//! workload (`agents`: ~45 s per run, its 30 s of sending plus the last
//! sessions' tails; `chat`: ~9 s per run, about 6 minutes for its four
//! engine sets). The default command (9 policies × 5 workloads, default
//! sweep) thus takes roughly 75–85 minutes; `bench all` includes it.
//! `--sweep 1` runs each policy once per workload (~1.5 minutes per policy,
//! ~12 minutes for 8); `--policies` and `--workloads` pick fewer; and
//! `--duration S` shortens every workload to S trace seconds (mind the
//! speedups: `--duration 60` is 3 s of sending for `mooncake`, 60 s for
//! `hh-rlhf`, 15 s for `hot-prefix`).
//!
//! After the tables, a **summary** gives each row's throughput as a share
//! of `least_load`'s on every workload and engine set: requests per second
//! for `chat`, goodput for the others; the best is marked `*`, and a share
//! under 90 % `!`.
//!
//! Output: the tables on stdout, `<out>/replay.json` (every run, sweep
//! points included, with the engines' counters and the gateway
//! configuration), `<out>/replay.svg` (CDFs of TTFT per policy at m = 1,
//! one panel per workload) and `<out>/replay-<workload>-slo.svg` (SLO
//! attainment against the offered rate, one line per policy; none for
//! `chat`).

mod chat_set;
mod counters;
mod drive;
mod gateway_config;
pub mod real_engine;
mod report;
mod sessions;
mod stats;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Result, bail};
use clap::Args;
use semlb::routing::PolicyKind;
use semlb_tokenizer::Tokenizer;
use serde_json::{Value, json};

pub use self::chat_set::ChatSet;
use self::drive::{RunSpec, run_once};
use self::report::{
    Point, PolicyReport, WorkloadReport, print_report, print_summary, report_json, report_name, write_plots,
};
use self::stats::{GOODPUT_ATTAINMENT, RunStats};
use super::Common;
use super::dispatch_path::{PROMPTS_FILE, TOKENIZER_FILE};
use super::end_to_end::{LoadClient, read_dialogues};
use super::output;
use super::workload::agents::{self, AgentsParams};
use super::workload::chat::{self, ChatParams};
use super::workload::hh_rlhf::{self, HhRlhfParams};
use super::workload::hot_prefix::{self, HotPrefixParams};
use super::workload::{Workload, WorkloadKind, mooncake};

/// `semlb bench replay` flags.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// Workloads to replay, comma-separated [default: all: mooncake,hh-rlhf,hot-prefix,agents].
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_enum)]
    pub workloads: Vec<WorkloadKind>,
    /// The Mooncake trace [default: <data>/traces/conversation_trace.jsonl].
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Simulated engines behind the gateway (4 to 8 is the intended range).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub engines: usize,
    /// `selective_push` is also replayed in its fixed-cap mode
    /// (`max_outstanding` requests in flight per engine) with this cap,
    /// as the SkyLB paper compares; 0 skips that row.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub max_outstanding: u64,
    /// Routing policies to replay with, comma-separated [default: all].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Compress arrival times by this factor and run the engines that much
    /// faster (`--time-scale 1/X`) [default: mooncake 20, hh-rlhf 1,
    /// hot-prefix 4].
    #[arg(long, value_name = "X")]
    pub speedup: Option<f64>,
    /// Trace seconds of each workload (the first S of the trace, or a
    /// steady-state window of the generated ones) [default: mooncake 600,
    /// hh-rlhf 20, hot-prefix 120].
    #[arg(long, value_name = "S")]
    pub duration: Option<f64>,
    /// Send at most the first N requests of each workload.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// TTFT objective, trace seconds [default: mooncake 10, hh-rlhf 1,
    /// hot-prefix 2].
    #[arg(long, value_name = "S")]
    pub ttft_slo: Option<f64>,
    /// Rate multipliers of the goodput sweep, comma-separated (1 is always
    /// run; `--sweep 1`: no sweep).
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_values_t = [0.5, 1.0, 1.5, 2.0])]
    pub sweep: Vec<f64>,
    /// New `hh-rlhf` conversations per trace second.
    #[arg(long, value_name = "R", default_value_t = 90.0)]
    pub hh_rlhf_rate: f64,
    /// New `hot-prefix` sessions per trace second.
    #[arg(long, value_name = "R", default_value_t = 4.5)]
    pub hot_prefix_rate: f64,
    /// New `agents` sessions per trace second.
    #[arg(long, value_name = "R", default_value_t = 1.5)]
    pub agents_rate: f64,
    /// Also replay each policy with `learn_at_dispatch = false` (a
    /// `policy/write-back-only` row).
    #[arg(long)]
    pub compare_learning: bool,
    /// Also replay each policy with `learn_from_reports = false` (a
    /// `policy/no-feedback` row).
    #[arg(long)]
    pub compare_feedback: bool,
    /// Also replay each policy with the engines publishing their KV cache
    /// events and `[policy.prefix] source = "precise"`, with the
    /// `cached_tokens` feedback (`policy/precise`) and without it
    /// (`policy/precise-no-feedback`).
    #[arg(long)]
    pub compare_prefix_sources: bool,
    /// Also replay `cost` with each of these weights fixed (`tune = false`,
    /// a `cost/w=X` row each), comma-separated: what the tuner chooses
    /// among.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub cost_weights: Vec<f64>,
    /// The engines' KV cache in tokens (the simulator's
    /// `--kv-capacity-tokens`; small values make them evict often)
    /// [default: the simulator's, 400 000].
    #[arg(long, value_name = "TOKENS")]
    pub kv_tokens: Option<u64>,
    /// Cap on a request's output tokens.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub max_output: u32,
    /// Dispatcher processes of the gateway.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dispatchers: usize,
    /// Real seconds to wait after the last arrival for requests to finish
    /// (the rest count as errors).
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    pub drain_secs: f64,
    /// Seed of the generated workloads and of the trace's block tokens.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Engine sets the `chat` workload runs on, comma-separated [default:
    /// all: stream,plain,no-metrics-stream,no-metrics-plain].
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_enum)]
    pub chat_sets: Vec<ChatSet>,
    /// Conversations of the `chat` workload.
    #[arg(long, value_name = "N", default_value_t = 400)]
    pub chat_conversations: usize,
    /// Clients of the `chat` workload (its requests in flight).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub chat_clients: usize,
}

impl ReplayArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            workloads: Vec::new(),
            trace: None,
            engines: 4,
            policies: Vec::new(),
            max_outstanding: 8,
            speedup: None,
            duration: None,
            limit: None,
            ttft_slo: None,
            sweep: vec![0.5, 1.0, 1.5, 2.0],
            hh_rlhf_rate: 90.0,
            hot_prefix_rate: 4.5,
            agents_rate: 1.5,
            compare_learning: false,
            compare_feedback: false,
            compare_prefix_sources: false,
            cost_weights: Vec::new(),
            kv_tokens: None,
            max_output: 2048,
            dispatchers: 2,
            drain_secs: 30.0,
            seed: 0,
            chat_sets: Vec::new(),
            chat_conversations: 400,
            chat_clients: 16,
        }
    }

    /// The speedup, duration and TTFT objective of `kind`.
    fn setting(&self, kind: WorkloadKind) -> Setting {
        let (speedup, duration_s, ttft_slo_s) = match kind {
            WorkloadKind::Mooncake => (20.0, 600.0, 10.0),
            WorkloadKind::HhRlhf => (1.0, 20.0, 1.0),
            WorkloadKind::HotPrefix => (4.0, 120.0, 2.0),
            WorkloadKind::Agents => (2.0, 60.0, 1.0),
            // A closed loop has no duration: its conversations set it.
            WorkloadKind::Chat => (10.0, 0.0, 1.0),
        };
        Setting {
            speedup: self.speedup.unwrap_or(speedup),
            duration_s: self.duration.unwrap_or(duration_s),
            ttft_slo_s: self.ttft_slo.unwrap_or(ttft_slo_s),
        }
    }
}

/// How one workload is run.
#[derive(Debug, Clone, Copy)]
struct Setting {
    speedup: f64,
    duration_s: f64,
    ttft_slo_s: f64,
}

/// The multipliers of `--sweep`: positive, sorted, deduplicated, with 1.
fn sweep_multipliers(sweep: &[f64]) -> Result<Vec<f64>> {
    if let Some(bad) = sweep.iter().find(|m| !(m.is_finite() && **m > 0.0)) {
        bail!("--sweep {bad}: rate multipliers must be positive numbers");
    }
    let mut out: Vec<f64> = sweep.iter().copied().chain([1.0]).collect();
    out.sort_by(f64::total_cmp);
    out.dedup();
    Ok(out)
}

/// The indices of `multipliers` (sorted, holding 1) a sweep runs, in
/// order, given `passes(i)`: 1 first, then upwards while runs pass, or
/// downwards until one passes.
fn sweep_order(multipliers: &[f64], mut passes: impl FnMut(usize) -> Result<bool>) -> Result<Vec<usize>> {
    let one = multipliers.iter().position(|m| *m == 1.0).unwrap_or(0);
    let mut ran = vec![one];
    if passes(one)? {
        for i in one + 1..multipliers.len() {
            ran.push(i);
            if !passes(i)? {
                break;
            }
        }
    } else {
        for i in (0..one).rev() {
            ran.push(i);
            if passes(i)? {
                break;
            }
        }
    }
    Ok(ran)
}

/// What one row of a table replays: a policy, with extra configuration
/// for a variant of it.
#[derive(Debug, Clone)]
struct Arm {
    kind: PolicyKind,
    /// The row's name: the policy's, or `policy/variant`.
    label: String,
    /// TOML appended to the run's gateway configuration.
    config: String,
    /// Top-level keys put before it (a key after a table header would
    /// belong to that table).
    top: String,
    /// The engines publish KV cache events and the gateway follows them.
    kv_events: bool,
}

impl Arm {
    /// The rows `kind` gives: the policy with its defaults and, for
    /// `selective_push`, its strict `unstarted` mode and (with
    /// `max_outstanding > 0`) its fixed-cap mode (the SkyLB paper's
    /// comparison).
    fn of(kind: PolicyKind, args: &ReplayArgs) -> Vec<Arm> {
        let ReplayArgs {
            max_outstanding,
            compare_learning,
            compare_feedback,
            ..
        } = *args;
        let mut arms = vec![Arm {
            kind,
            label: kind.name().to_owned(),
            config: String::new(),
            top: String::new(),
            kv_events: false,
        }];
        if compare_learning {
            arms.push(Arm {
                kind,
                label: format!("{kind}/write-back-only"),
                config: String::new(),
                top: "learn_at_dispatch = false\n".to_owned(),
                kv_events: false,
            });
        }
        if compare_feedback {
            arms.push(Arm {
                kind,
                label: format!("{kind}/no-feedback"),
                config: String::new(),
                top: "learn_from_reports = false\n".to_owned(),
                kv_events: false,
            });
        }
        if args.compare_prefix_sources {
            // The engines' events, followed from their start: the confirm
            // window is real seconds (the gateway's floor, 1 s, at speedups
            // above 2).
            let precise = "\n[policy.prefix]\nsource = \"precise\"\nconfirm_window_secs = 1\n".to_owned();
            for (label, top) in [("precise", ""), ("precise-no-feedback", "learn_from_reports = false\n")] {
                arms.push(Arm {
                    kind,
                    label: format!("{kind}/{label}"),
                    config: precise.clone(),
                    top: top.to_owned(),
                    kv_events: true,
                });
            }
        }
        if kind == PolicyKind::SelectivePush {
            arms.push(Arm {
                kind,
                label: format!("{kind}/unstarted"),
                config: "\n[policy.selective_push]\nmode = \"unstarted\"\n".to_owned(),
                top: String::new(),
                kv_events: false,
            });
        }
        if kind == PolicyKind::Cost {
            arms.extend(args.cost_weights.iter().map(|w| Arm {
                kind,
                label: format!("{kind}/w={w}"),
                config: format!("\n[policy.cost]\ntune = false\ninitial_weight = {w:?}\n"),
                top: String::new(),
                kv_events: false,
            }));
        }
        if kind == PolicyKind::SelectivePush && max_outstanding > 0 {
            arms.push(Arm {
                kind,
                label: format!("{kind}/max{max_outstanding}"),
                config: format!(
                    "\n[policy.selective_push]\nmode = \"max_outstanding\"\nmax_outstanding = {max_outstanding}\n"
                ),
                top: String::new(),
                kv_events: false,
            });
        }
        arms
    }
}

/// The workload `kind`, or `None` (with a message) when its data is missing.
fn load_workload(args: &ReplayArgs, kind: WorkloadKind, setting: &Setting) -> Result<Option<Workload>> {
    let data = args.common.data_dir();
    let mut workload = match kind {
        WorkloadKind::Mooncake => {
            let Some(path) = args
                .trace
                .clone()
                .or_else(|| data.as_ref().map(|d| d.join(mooncake::TRACE_FILE)))
            else {
                println!(
                    "skipping mooncake: no trace (pass --trace PATH or --data DIR with {})",
                    mooncake::TRACE_FILE
                );
                return Ok(None);
            };
            mooncake::load(&path, setting.duration_s, args.limit, args.max_output, args.seed)?
        }
        WorkloadKind::HhRlhf => {
            let Some(path) = data.as_ref().map(|d| d.join(PROMPTS_FILE)).filter(|p| p.is_file()) else {
                println!("skipping hh-rlhf: no dialogues (pass --data DIR with {PROMPTS_FILE})");
                return Ok(None);
            };
            let dialogues = read_dialogues(&path)?;
            if dialogues.is_empty() {
                bail!("{} holds no dialogues", path.display());
            }
            let tokenizer = match data.as_ref().map(|d| d.join(TOKENIZER_FILE)).filter(|p| p.is_file()) {
                Some(p) => Tokenizer::from_file(&p)
                    .map_err(|e| anyhow::anyhow!("cannot load the tokenizer {}: {e}", p.display()))?,
                None => Tokenizer::bundled(),
            };
            let params = HhRlhfParams {
                conversations_per_s: args.hh_rlhf_rate,
                duration_s: setting.duration_s,
                max_output: args.max_output,
                seed: args.seed,
            };
            hh_rlhf::build(&dialogues, &tokenizer, &params, &path.display().to_string())
        }
        WorkloadKind::HotPrefix => hot_prefix::build(&HotPrefixParams {
            sessions_per_s: args.hot_prefix_rate,
            duration_s: setting.duration_s,
            max_output: args.max_output,
            seed: args.seed,
        }),
        WorkloadKind::Agents => agents::build(&AgentsParams {
            sessions_per_s: args.agents_rate,
            duration_s: setting.duration_s,
            max_output: args.max_output,
            seed: args.seed,
        }),
        WorkloadKind::Chat => chat::build(&ChatParams {
            conversations: args.chat_conversations,
            max_output: args.max_output,
            seed: args.seed,
            shape: chat::ChatShape::default(),
        }),
    };
    if let Some(n) = args.limit {
        workload.requests.truncate(n);
    }
    if workload.requests.is_empty() {
        bail!("{kind}: no requests (raise --duration or the rate)");
    }
    Ok(Some(workload))
}

/// Every policy's sweep on `workload` (on engine set `set` for `chat`;
/// a closed loop is run at ×1 only: it has no rate to multiply).
fn run_workload(
    args: &ReplayArgs,
    workload: Arc<Workload>,
    set: Option<ChatSet>,
    setting: Setting,
    policies: &[PolicyKind],
    multipliers: &[f64],
    client: &LoadClient,
) -> Result<WorkloadReport> {
    let closed_loop = workload.kind.closed_loop();
    let multipliers = if closed_loop { &[1.0][..] } else { multipliers };
    let config = gateway_config::gateway_config(setting.speedup, setting.ttft_slo_s);
    let n = workload.requests.len() as u64;
    let sessions: Vec<Option<u64>> = workload.requests.iter().map(|r| r.session).collect();
    let bar = output::progress(0, &report_name(workload.kind, set));
    let base_rate = (!closed_loop).then(|| workload.offered_rate());
    let arms: Vec<Arm> = policies.iter().flat_map(|&k| Arm::of(k, args)).collect();
    let mut reports = Vec::with_capacity(arms.len());
    for arm in arms {
        let mut points = Vec::new();
        let order = sweep_order(multipliers, |i| {
            bar.inc_length(n);
            let spec = RunSpec {
                policy: arm.kind,
                label: arm.label.clone(),
                engines: args.engines,
                dispatchers: args.dispatchers,
                kv_tokens: args.kv_tokens,
                metrics: set.is_none_or(ChatSet::metrics),
                stream: set.is_none_or(ChatSet::stream),
                clients: args.chat_clients,
                speedup: setting.speedup,
                multiplier: multipliers[i],
                drain_secs: args.drain_secs,
                config: format!("{}{config}{}", arm.top, arm.config),
                kv_events: arm.kv_events,
            };
            let run = run_once(&spec, &workload, client, &bar)?;
            let stats = RunStats::of(&run, &sessions, setting.speedup, setting.ttft_slo_s);
            let pass = stats.attainment >= GOODPUT_ATTAINMENT;
            points.push(Point {
                multiplier: multipliers[i],
                offered: base_rate.map(|r| r * multipliers[i]),
                run,
                stats,
            });
            Ok(pass)
        })?;
        points.sort_by(|a, b| a.multiplier.total_cmp(&b.multiplier));
        let not_run = (0..multipliers.len())
            .filter(|i| !order.contains(i))
            .map(|i| multipliers[i])
            .collect();
        reports.push(PolicyReport { arm, points, not_run });
    }
    bar.finish_and_clear();
    Ok(WorkloadReport {
        workload,
        set,
        setting,
        config,
        policies: reports,
    })
}

/// Runs the report.
pub fn run(args: &ReplayArgs) -> Result<()> {
    if args.engines == 0 || args.dispatchers == 0 {
        bail!("--engines and --dispatchers must be at least 1");
    }
    if args.speedup.is_some_and(|x| !(x.is_finite() && x > 0.0)) {
        bail!("--speedup must be a positive number");
    }
    if args.ttft_slo.is_some_and(|s| !(s.is_finite() && s > 0.0)) {
        bail!("--ttft-slo must be a positive number of seconds");
    }
    if !(args.hh_rlhf_rate > 0.0 && args.hot_prefix_rate > 0.0) {
        bail!("--hh-rlhf-rate and --hot-prefix-rate must be positive");
    }
    if args.chat_conversations == 0 || args.chat_clients == 0 {
        bail!("--chat-conversations and --chat-clients must be at least 1");
    }
    let multipliers = sweep_multipliers(&args.sweep)?;
    let kinds: Vec<WorkloadKind> = if args.workloads.is_empty() {
        WorkloadKind::ALL.to_vec()
    } else {
        args.workloads.clone()
    };
    let policies: Vec<PolicyKind> = if args.policies.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policies.clone()
    };
    let chat_sets: Vec<Option<ChatSet>> = if args.chat_sets.is_empty() {
        ChatSet::ALL.map(Some).to_vec()
    } else {
        args.chat_sets.iter().copied().map(Some).collect()
    };
    let client = LoadClient::new()?;
    let mut reports = Vec::new();
    for kind in kinds {
        let setting = args.setting(kind);
        let Some(workload) = load_workload(args, kind, &setting)? else {
            continue;
        };
        let workload = Arc::new(workload);
        let sets = if kind == WorkloadKind::Chat {
            &chat_sets[..]
        } else {
            &[None][..]
        };
        for &set in sets {
            let report = run_workload(args, workload.clone(), set, setting, &policies, &multipliers, &client)?;
            print_report(args, &report, &multipliers);
            reports.push(report);
        }
    }
    if reports.is_empty() {
        bail!("no workload could be run");
    }
    print_summary(&reports);
    let value = json!({
        "report": "replay",
        "engines": args.engines,
        "dispatchers": args.dispatchers,
        "max_output": args.max_output,
        "seed": args.seed,
        "drain_secs": args.drain_secs,
        "goodput_attainment": GOODPUT_ATTAINMENT,
        "times": "trace seconds (measured wall-clock x speedup)",
        "workloads": reports.iter().map(|r| report_json(r, &multipliers)).collect::<Vec<Value>>(),
    });
    let json_path = output::write_json(&args.common.out, "replay", &value)?;
    let svgs = write_plots(args, &reports)?;
    println!(
        "wrote {}, {}",
        json_path.display(),
        svgs.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_always_hold_one_and_reject_nonsense() {
        assert_eq!(sweep_multipliers(&[2.0, 0.5, 2.0]).unwrap(), [0.5, 1.0, 2.0]);
        assert_eq!(sweep_multipliers(&[1.0]).unwrap(), [1.0]);
        assert!(sweep_multipliers(&[0.0]).is_err());
        assert!(sweep_multipliers(&[f64::NAN]).is_err());
    }

    #[test]
    fn the_sweep_goes_up_while_runs_pass_and_down_until_one_does() {
        let m = [0.5, 1.0, 1.5, 2.0, 3.0];
        // Attainment reaches 90 % up to ×1.5.
        let up = sweep_order(&m, |i| Ok(m[i] <= 1.5)).unwrap();
        assert_eq!(up, [1, 2, 3]);
        let all = sweep_order(&m, |_| Ok(true)).unwrap();
        assert_eq!(all, [1, 2, 3, 4]);
        let down = sweep_order(&m, |i| Ok(m[i] <= 0.5)).unwrap();
        assert_eq!(down, [1, 0]);
        let none = sweep_order(&m, |_| Ok(false)).unwrap();
        assert_eq!(none, [1, 0]);
        assert_eq!(sweep_order(&[1.0], |_| Ok(false)).unwrap(), [0]);
    }

    #[test]
    fn defaults_differ_per_workload_and_flags_override_them() {
        let common = Common {
            out: PathBuf::from("x"),
            redis_url: None,
            redis_server: PathBuf::from("redis-server"),
            no_redis: true,
            data: None,
        };
        let mut args = ReplayArgs::with(common);
        let s = args.setting(WorkloadKind::Mooncake);
        assert_eq!((s.speedup, s.duration_s, s.ttft_slo_s), (20.0, 600.0, 10.0));
        let s = args.setting(WorkloadKind::HhRlhf);
        assert_eq!((s.speedup, s.duration_s, s.ttft_slo_s), (1.0, 20.0, 1.0));
        args.speedup = Some(5.0);
        args.ttft_slo = Some(3.0);
        let s = args.setting(WorkloadKind::HotPrefix);
        assert_eq!((s.speedup, s.duration_s, s.ttft_slo_s), (5.0, 120.0, 3.0));
    }
}
