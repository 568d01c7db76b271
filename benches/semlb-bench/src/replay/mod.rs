//! `semlb bench replay`: every routing policy, and the peer routers a
//! user would pick instead (SMG, vllm-router, SGLang's router), on the same
//! workloads and engines, with TTFT objectives and goodput.
//!
//! # Workloads
//!
//! `--workloads` (default all eight, see [`workload`](super::workload)):
//!
//! | workload | requests | sessions | default speedup | default duration | default TTFT SLO |
//! | --- | --- | --- | --- | --- | --- |
//! | `mooncake` | the Mooncake conversation trace ([`mooncake`]): ~3 req/s, ~12 000-token prompts sharing 512-token blocks, ~58 % of the prefill capacity with perfect reuse | no | 20 | 600 s | 10 s |
//! | `hh-rlhf` | HH-RLHF chats ([`hh_rlhf`]): 90 conversations/s (`--hh-rlhf-rate`), ~220 req/s of ~100-token prompts, ~55 % of the prefill capacity without reuse | yes | 1 | 20 s | 1 s |
//! | `hot-prefix` | agent sessions on six hot system prompts ([`hot_prefix`]): 4.5 sessions/s (`--hot-prefix-rate`), ~16 req/s of ~5 900-token prompts, ~70 % of the prefill capacity with the system prompts cached | yes | 4 | 120 s | 2 s |
//! | `agents` | closed-loop agent sessions of 5–20 chat calls on four shared system prompts ([`agents`]), each call sent the instant the previous answer ends: 1.5 sessions/s (`--agents-rate`), ~19 calls/s, 18 % of the prefill capacity when every session stays on one engine, 235 % when none does; over chat completions, or as tool-calling loops over chat completions, the Responses API or the Messages API (`--agents-api`, below) | yes | 2 | 60 s | 1 s |
//! | `chat` | closed-loop multi-turn chats on four shared system prompts ([`chat`]): 400 conversations of 2–6 turns (`--chat-conversations`) sent by 16 clients (`--chat-clients`), each sending its next turn the instant its answer ends and starting a new conversation when one ends; no session ids; run on each of four engine sets ([`ChatSet`], `--chat-sets`) | no header (the same-engine share is still computed) | 10 | its conversations | 1 s |
//! | `shared-prompt` | the `chat` closed loop on **one** ~900-token system prompt: 50 conversations of 6–14 turns (`--shared-prompt-conversations`), 16 clients; on the engine sets | no header | 10 | its conversations | 1 s |
//! | `burst` | a hot-prefix burst ([`burst`]): background chat sessions on four system prompts (2 sessions/s, `--burst-background-rate`), then 48 sessions (`--burst-sessions`) on one brand-new ~2 000-token system prompt within 0.1 trace seconds at 40 % of the duration, 3–5 turns each, every call sent when the previous answer ends | yes | 4 | 40 s | 2 s |
//! | `scale-out` | the `shared-prompt` closed loop starting on **one** engine; the other `--engines` − 1 are added at run time once a quarter of its requests are answered; on the engine sets | no header | 10 | its conversations | 1 s |
//!
//! Every request but the chat calls of `agents`, `chat`, `shared-prompt`,
//! `burst` and `scale-out` (chat requests whose
//! history holds the engine's real answers, `temperature` 1, `ignore_eos`,
//! `max_tokens` = the call's output; see [`agents`], [`chat`]) is a streaming
//! `/v1/completions` request whose `prompt` is text (`--prompt-form text`,
//! the default, sent to every row alike: real clients send text, and
//! `smg` and `sglang-router` take nothing else): `hh-rlhf`'s dialogues
//! themselves, and for the synthetic token ids of `mooncake` and
//! `hot-prefix` chunks of text as many tokens long with the engines'
//! tokenizer, equal pieces equal text, built so that their tokens are the
//! token-id form's lengths and shared prefixes ([`text`]; the replay
//! measures it when it loads the workload, prints one line and puts it in
//! the JSON as `text_fidelity`). `--prompt-form tokens` sends the array of
//! token ids instead (the gateway and the simulator take token-id prompts
//! as they are). Either way with `max_tokens` = its output length (capped by
//! `--max-output`), `ignore_eos` (the engine generates exactly that many
//! tokens) and `temperature` 1 (never answered from the response cache);
//! requests of a session carry `x-session-id: <session>`, which
//! session-affine policies route on. `mooncake` needs `<data>/traces/` (or
//! `--trace`), `hh-rlhf` `<data>/prompts/` and, for Qwen3 token ids,
//! `<data>/tokenizers/` (else the bundled phi-2 tokenizer; the engines
//! tokenize text with phi-2 either way); without them
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
//! # The closed loops' engine sets
//!
//! `chat`, `shared-prompt` and `scale-out` run on the engine sets of
//! `--chat-sets`, each a table of its own; what follows is `chat`'s
//! reason for them.
//!
//! # Agents over the Responses and Messages APIs
//!
//! `--agents-api chat,chat-tools,responses,messages` (default `chat`)
//! runs the `agents` workload once per API listed, each a table of its
//! own (`agents`, `agents/chat-tools`, `agents/responses`,
//! `agents/messages`): the same sessions, schedule and seed, only the wire
//! API differs, so the API is a flag of the workload rather than a
//! workload of its own (as the engine sets are for `chat`). `chat` is the
//! plain workload (chat completions without tools, tool results sent as
//! user messages). The other three are a tool-calling agent loop
//! ([`agent_api`](super::workload::agent_api)): every call carries three
//! function tools and the whole conversation (Responses: `store: false`,
//! no `previous_response_id`), streamed; the engine answers a call whose
//! last message is not a tool result with a tool call (as long as the
//! template renders it), which the next call sends back with its result
//! (the workload's tool-result text), and a tool result with text
//! (`max_tokens` of the call, `ignore_eos`), after which the next call
//! sends the workload's next message as a user message. TTFT is the time
//! to the first output event (chat's first chunk,
//! `response.output_text.delta` / `response.function_call_arguments.delta`,
//! `content_block_delta`), and the table's `usage cached` column is Σ
//! cached / Σ prompt tokens as each API's usage reports them (chat
//! `prompt_tokens_details.cached_tokens` / `prompt_tokens`, Responses
//! `input_tokens_details.cached_tokens` / `input_tokens`, Messages
//! `cache_read_input_tokens` / (`input_tokens` +
//! `cache_read_input_tokens`)), beside the engines' own prefix hit rate.
//! Goodput, SLO attainment and the rest are as for every workload. A peer
//! is sent one such call per API before its first run; a peer that does
//! not answer it with the engine's stream has its rows on that API
//! skipped, with the answer it gave.
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
//! # Peer routers
//!
//! `--peers smg,vllm-router,sglang-router` (default: all three; `--peers
//! none` or an empty list: none) adds a row per peer router after semlb's,
//! on the same fresh engines and the same requests, through the same load
//! generator: `smg` 1.13.0, `vllm-router` 0.1.17 and `sglang-router` 0.3.2
//! from PyPI, installed by the bench into private virtual environments
//! (`--peers-dir`, default `target/bench-peers/`), each started with its
//! own defaults and `--policy cache_aware`; see [`peers`] for the command
//! lines, the core budget and how each adds a worker. Before its first run
//! each peer is started once in front of one engine and sent one text
//! completion, one token-id completion and one chat call: a peer that
//! cannot be installed or started is skipped with one line saying why,
//! and one that refuses a workload's kind of request (`smg` and
//! `sglang-router` refuse token-id prompts, so with `--prompt-form tokens`
//! they have no figures on `mooncake`, `hh-rlhf` and `hot-prefix`) has a
//! row marked `†` saying so instead of figures. A peer's
//! row has no prediction column (a counter of semlb's gateway). Which
//! engine answered a request is read from the answer's id, the same way for
//! every front (the simulator's ids carry a per-process salt).
//!
//! # The workloads that break routers
//!
//! `shared-prompt` (one system prompt, 16 in flight, 4 engines) is the
//! one a router that follows the longest prefix alone collapses onto one
//! engine; `burst` the one where a new hot prefix arrives 48 times at once;
//! `scale-out` the one where engines appear while the load runs, and the
//! engine sets the ones with and without engine metrics. After the table of
//! `burst` and `scale-out` comes one of their own figures ([`phases`]):
//!
//! * `burst`: of the burst's requests (its new system prompt), the TTFT,
//!   the SLO attainment, the share the busiest engine served and the
//!   engines used;
//! * `scale-out`: when the engines were added (trace seconds), how many
//!   adds the front accepted, requests per trace second before and after,
//!   the share of the requests sent after the add that the new engines
//!   served, and the trace seconds until 40 consecutive requests gave the
//!   new engines 75 % of their fair share (3/4 with 4 engines: 56 %).
//!   semlb's engines are added through its admin API (`POST
//!   /admin/servers`, the gateway started with `--admin-listen` and a
//!   token file), the peers' through their own (`POST /workers`, `POST
//!   /add_worker?url=`). The three engines are started with the others and
//!   left idle until they are added.
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
//! and forgotten servers in the JSON); errors. The title says how the
//! prompts were sent. Under the table, the `cost` rows' weight: λ as each
//! dispatcher left it at the end of each run (the gateway's
//! `semlb_cost_weight{dispatcher}`, read with its counters; in the JSON as
//! `cost_weights_at_end`), to show whether the tuner moved from where it
//! starts within the run.
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
//! for a closed loop, goodput for the others; the best is marked `*`, a
//! share under 90 % `!`, the best peer router `^`, a row not run `†`; its
//! last column is `cache_aware`'s throughput as a share of the best
//! peer's. Each peer adds its runs (about as long as a policy's) and ~5 s
//! of installation check and pre-flight per invocation.
//!
//! Output: the tables on stdout, `<out>/replay.json` (every run, sweep
//! points included, with the engines' counters and the gateway
//! configuration), `<out>/replay.svg` (CDFs of TTFT per policy at m = 1,
//! one panel per workload) and `<out>/replay-<workload>-slo.svg` (SLO
//! attainment against the offered rate, one line per policy; none for
//! `chat`).
//!
//! A workload's trace or prompts are loaded, at the setting's size, by
//! [`loading`].

mod args;
mod chat_set;
pub(crate) mod counters;
mod drive;
mod gateway_config;
mod loading;
pub(crate) mod peers;
mod phases;
pub mod real_engine;
mod report;
mod sessions;
mod stats;
mod variant;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use semlb::routing::PolicyKind;
use serde_json::{Value, json};

pub use self::args::ReplayArgs;
use self::args::Setting;
pub use self::chat_set::ChatSet;
use self::drive::{FrontSpec, RunSpec, run_once};
use self::loading::load_workload;
pub use self::peers::Peer;
use self::peers::{Install, Peers, Support};
use self::report::{
    Point, PolicyReport, WorkloadReport, print_report, print_summary, report_json, report_name, write_plots,
};
use self::stats::{GOODPUT_ATTAINMENT, RunStats};
use super::end_to_end::{LoadClient, start_engines};
use super::output;
use super::workload::agent_api::AgentsApi;
use super::workload::{PromptForm, Workload, WorkloadKind};

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

/// What a row's front is: semlb's gateway with a policy, or a peer
/// router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArmFront {
    /// semlb with this routing policy.
    Policy(PolicyKind),
    /// A peer router.
    Peer(Peer),
}

/// What one row of a table replays: a policy, with extra configuration
/// for a variant of it, or a peer router.
#[derive(Debug, Clone)]
struct Arm {
    front: ArmFront,
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
            front: ArmFront::Policy(kind),
            label: kind.name().to_owned(),
            config: String::new(),
            top: String::new(),
            kv_events: false,
        }];
        if compare_learning {
            arms.push(Arm {
                front: ArmFront::Policy(kind),
                label: format!("{kind}/write-back-only"),
                config: String::new(),
                top: "learn_at_dispatch = false\n".to_owned(),
                kv_events: false,
            });
        }
        if compare_feedback {
            arms.push(Arm {
                front: ArmFront::Policy(kind),
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
                    front: ArmFront::Policy(kind),
                    label: format!("{kind}/{label}"),
                    config: precise.clone(),
                    top: top.to_owned(),
                    kv_events: true,
                });
            }
        }
        if kind == PolicyKind::SelectivePush {
            arms.push(Arm {
                front: ArmFront::Policy(kind),
                label: format!("{kind}/unstarted"),
                config: "\n[policy.selective_push]\nmode = \"unstarted\"\n".to_owned(),
                top: String::new(),
                kv_events: false,
            });
        }
        if kind == PolicyKind::Cost {
            arms.extend(args.cost_weights.iter().map(|w| Arm {
                front: ArmFront::Policy(kind),
                label: format!("{kind}/w={w}"),
                config: format!("\n[policy.cost]\ntune = false\ninitial_weight = {w:?}\n"),
                top: String::new(),
                kv_events: false,
            }));
        }
        if kind == PolicyKind::SelectivePush && max_outstanding > 0 {
            arms.push(Arm {
                front: ArmFront::Policy(kind),
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

    /// The row of peer router `peer`.
    fn peer(peer: Peer) -> Arm {
        Arm {
            front: ArmFront::Peer(peer),
            label: peer.name().to_owned(),
            config: String::new(),
            top: String::new(),
            kv_events: false,
        }
    }

    /// What kind of row it is: the policy's name, or `peer`.
    fn kind_name(&self) -> &'static str {
        match self.front {
            ArmFront::Policy(kind) => kind.name(),
            ArmFront::Peer(_) => "peer",
        }
    }

    /// Whether it is a peer router's row.
    fn is_peer(&self) -> bool {
        matches!(self.front, ArmFront::Peer(_))
    }
}

/// Why peer `peer`'s row is not run on `workload`, if it is not: it is
/// not installed or did not start (`support` has no entry), or it refuses
/// the workload's kind of request.
fn peer_skip(peer: Peer, workload: &Workload, peers: &HashMap<Peer, (Install, Support)>) -> Option<String> {
    let Some((_, support)) = peers.get(&peer) else {
        return Some("not installed or did not start (see above)".to_owned());
    };
    let (refused, what) = match (workload.prompt_form(), workload.api) {
        (Some(PromptForm::Tokens), _) => (&support.token_ids, "token-id prompts"),
        (Some(PromptForm::Text), _) => (&support.text, "text prompts"),
        (None, AgentsApi::Chat) => (&support.chat, "chat calls"),
        (None, AgentsApi::ChatTools) => (&support.chat_tools, "chat calls with tools"),
        (None, AgentsApi::Responses) => (&support.responses, "Responses API calls (POST /v1/responses)"),
        (None, AgentsApi::Messages) => (&support.messages, "Messages API calls (POST /v1/messages)"),
    };
    refused.as_ref().err().map(|e| format!("refuses {what}: {e}"))
}

/// Every row's sweep on `workload` (on engine set `set` for a closed
/// loop, which is run at ×1 only: it has no rate to multiply).
#[allow(clippy::too_many_arguments)]
fn run_workload(
    args: &ReplayArgs,
    workload: Arc<Workload>,
    set: Option<ChatSet>,
    setting: Setting,
    policies: &[PolicyKind],
    peers: &(Vec<Peer>, HashMap<Peer, (Install, Support)>),
    multipliers: &[f64],
    client: &LoadClient,
) -> Result<WorkloadReport> {
    let closed_loop = workload.kind.closed_loop();
    let multipliers = if closed_loop { &[1.0][..] } else { multipliers };
    let config = gateway_config::gateway_config(setting.speedup, setting.ttft_slo_s);
    let n = workload.requests.len() as u64;
    let sessions: Vec<Option<u64>> = workload.requests.iter().map(|r| r.session).collect();
    let bar = output::progress(0, &report_name(&workload, set));
    let base_rate = (!closed_loop).then(|| workload.offered_rate());
    // A scale-out run adds the engines once a quarter of its requests are
    // answered.
    let scale_out_at = (workload.kind == WorkloadKind::ScaleOut).then(|| workload.requests.len().div_ceil(4));
    let variants = args
        .variants
        .iter()
        .map(|v| {
            Ok(Arm {
                front: ArmFront::Policy(v.policy),
                label: v.label.clone(),
                config: format!("\n{}", v.config_text()?),
                top: String::new(),
                kv_events: false,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let arms: Vec<Arm> = policies
        .iter()
        .flat_map(|&k| Arm::of(k, args))
        .chain(variants)
        .chain(peers.0.iter().map(|&p| Arm::peer(p)))
        .collect();
    let mut reports = Vec::with_capacity(arms.len());
    for arm in arms {
        let mut points = Vec::new();
        let front = match arm.front {
            ArmFront::Policy(policy) => FrontSpec::Semlb {
                policy,
                config: gateway_config::merged(&format!("{}{config}", arm.top), &arm.config)
                    .with_context(|| format!("the configuration of row {}", arm.label))?,
                kv_events: arm.kv_events,
            },
            ArmFront::Peer(peer) => match peer_skip(peer, &workload, &peers.1) {
                Some(why) => {
                    reports.push(PolicyReport {
                        arm,
                        points,
                        not_run: multipliers.to_vec(),
                        skipped: Some(why),
                    });
                    continue;
                }
                None => FrontSpec::Peer(peers.1[&peer].0.clone()),
            },
        };
        let mut failed = None;
        let order = sweep_order(multipliers, |i| {
            bar.inc_length(n);
            let spec = RunSpec {
                front: front.clone(),
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
                scale_out_at,
            };
            let run = match run_once(&spec, &workload, client, &bar) {
                Ok(run) => run,
                // A peer that fails to start loses its row, not the report.
                Err(e) if arm.is_peer() => {
                    failed = Some(format!("{e:#}"));
                    return Ok(false);
                }
                Err(e) => return Err(e),
            };
            let stats = RunStats::of(&run, &sessions, setting.speedup, setting.ttft_slo_s);
            let pass = stats.attainment >= GOODPUT_ATTAINMENT;
            points.push(Point {
                multiplier: multipliers[i],
                offered: base_rate.map(|r| r * multipliers[i]),
                burst: phases::burst_stats(&workload, &run, setting.speedup, setting.ttft_slo_s),
                scale_out: phases::scale_out_stats(&run, args.engines, setting.speedup),
                run,
                stats,
            });
            Ok(pass && failed.is_none())
        })?;
        if let Some(e) = &failed {
            bar.suspend(|| println!("{}: {} failed: {e}", report_name(&workload, set), arm.label));
        }
        points.sort_by(|a, b| a.multiplier.total_cmp(&b.multiplier));
        let not_run = (0..multipliers.len())
            .filter(|&i| !order.contains(&i) || !points.iter().any(|p| p.multiplier == multipliers[i]))
            .map(|i| multipliers[i])
            .collect();
        let skipped = points.is_empty().then(|| failed.unwrap_or_else(|| "no run".to_owned()));
        reports.push(PolicyReport {
            arm,
            points,
            not_run,
            skipped,
        });
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

/// The peers of `--peers`, each installed in `<dir>/<name>/venv` and
/// checked in front of one engine ([`peers::preflight`]); a line for
/// each, saying why one is left out.
fn prepare_peers(args: &ReplayArgs) -> Result<Peers> {
    let list = peers::parse_peers(args.peers.as_deref())?;
    let mut out = Peers::default();
    if list.is_empty() {
        return Ok(out);
    }
    let dir = match &args.peers_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .and_then(|p| p.parent())
            .map_or_else(|| PathBuf::from("target"), PathBuf::from)
            .join("bench-peers"),
    };
    for peer in list {
        let (package, version) = peer.package();
        let ready = match peers::install(peer, &dir) {
            Err(e) => Err(format!("cannot install {package}=={version}: {e}")),
            Ok(install) => {
                let engine = start_engines(1, 0.1, None, true, false)?;
                let url = format!("http://{}", engine[0].addr);
                match peers::preflight(&install, &url) {
                    Err(e) => Err(format!("{e}")),
                    Ok(support) => {
                        let verdict = |r: &Result<(), String>| {
                            r.as_ref()
                                .map_or_else(|e| format!("refused ({e})"), |()| "taken".to_owned())
                        };
                        println!(
                            "peer {peer}: {package} {version} in {} ({}); text prompts: {}; token-id prompts: {}; \
                             chat calls: {}; chat calls with tools: {}; Responses calls: {}; Messages calls: {}",
                            install.venv.display(),
                            if install.reused { "reused" } else { "installed" },
                            verdict(&support.text),
                            verdict(&support.token_ids),
                            verdict(&support.chat),
                            verdict(&support.chat_tools),
                            verdict(&support.responses),
                            verdict(&support.messages),
                        );
                        Ok((install, support))
                    }
                }
            }
        };
        if let Err(why) = &ready {
            println!("skipping the {peer} rows: {why}");
        }
        out.rows.push((peer, ready));
    }
    Ok(out)
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
    if args.chat_conversations == 0 || args.chat_clients == 0 || args.shared_prompt_conversations == 0 {
        bail!("--chat-conversations, --chat-clients and --shared-prompt-conversations must be at least 1");
    }
    if !(args.burst_background_rate > 0.0 && args.burst_background_rate.is_finite()) {
        bail!("--burst-background-rate must be a positive number");
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
    let prepared = prepare_peers(args)?;
    let peers = (
        prepared.rows.iter().map(|(p, _)| *p).collect::<Vec<Peer>>(),
        prepared.ready(),
    );
    let client = LoadClient::new()?;
    let mut reports = Vec::new();
    for kind in kinds {
        if kind == WorkloadKind::ScaleOut && args.engines < 2 {
            println!("skipping scale-out: it adds engines to the first one, so it needs --engines 2 or more");
            continue;
        }
        let setting = args.setting(kind);
        let Some(workload) = load_workload(args, kind, &setting)? else {
            continue;
        };
        // An `agents` workload once per API of `--agents-api`.
        let apis = if kind == WorkloadKind::Agents {
            let mut apis = args.agents_api.clone();
            apis.dedup();
            apis
        } else {
            vec![AgentsApi::Chat]
        };
        for api in apis {
            let mut workload = workload.clone();
            workload.api = api;
            let workload = Arc::new(workload);
            let sets = if kind.closed_loop() {
                &chat_sets[..]
            } else {
                &[None][..]
            };
            for &set in sets {
                let report = run_workload(
                    args,
                    workload.clone(),
                    set,
                    setting,
                    &policies,
                    &peers,
                    &multipliers,
                    &client,
                )?;
                print_report(args, &report, &multipliers);
                reports.push(report);
            }
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
        "prompt_form": args.prompt_form.name(),
        "seed": args.seed,
        "drain_secs": args.drain_secs,
        "goodput_attainment": GOODPUT_ATTAINMENT,
        "peers": prepared.rows.iter().map(|(peer, ready)| {
            let (package, version) = peer.package();
            match ready {
                Ok((install, support)) => json!({
                    "peer": peer.name(),
                    "package": package,
                    "version": version,
                    "venv": install.venv,
                    "command_in_front_of_one_engine": support.command,
                    "takes_text_prompts": support.text.is_ok(),
                    "text_prompts_refused_with": support.text.as_ref().err(),
                    "takes_token_id_prompts": support.token_ids.is_ok(),
                    "token_id_prompts_refused_with": support.token_ids.as_ref().err(),
                    "takes_chat_calls": support.chat.is_ok(),
                    "chat_calls_refused_with": support.chat.as_ref().err(),
                    "takes_chat_calls_with_tools": support.chat_tools.is_ok(),
                    "chat_calls_with_tools_refused_with": support.chat_tools.as_ref().err(),
                    "takes_responses_calls": support.responses.is_ok(),
                    "responses_calls_refused_with": support.responses.as_ref().err(),
                    "takes_messages_calls": support.messages.is_ok(),
                    "messages_calls_refused_with": support.messages.as_ref().err(),
                }),
                Err(why) => json!({"peer": peer.name(), "package": package, "version": version, "skipped": why}),
            }
        }).collect::<Vec<Value>>(),
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
    use crate::workload::chat;

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
    fn a_peer_row_is_skipped_on_requests_its_router_refuses() {
        use crate::workload::chat::{ChatParams, ChatShape};
        let support = |token_ids: Result<(), String>| Support {
            text: Ok(()),
            token_ids,
            chat: Ok(()),
            chat_tools: Ok(()),
            responses: Ok(()),
            messages: Err("HTTP 404".into()),
            command: Vec::new(),
        };
        let install = |peer| Install {
            peer,
            venv: PathBuf::from("/v"),
            reused: true,
        };
        let ready: HashMap<Peer, (Install, Support)> = [
            (Peer::Smg, (install(Peer::Smg), support(Err("HTTP 400".into())))),
            (Peer::VllmRouter, (install(Peer::VllmRouter), support(Ok(())))),
        ]
        .into();
        let token_ids = Workload::new(WorkloadKind::HotPrefix, Vec::new(), String::new(), 0);
        let chat = chat::build(&ChatParams {
            conversations: 2,
            max_output: 64,
            seed: 0,
            shape: ChatShape::default(),
        });
        assert_eq!(
            peer_skip(Peer::Smg, &token_ids, &ready).as_deref(),
            Some("refuses token-id prompts: HTTP 400")
        );
        assert_eq!(peer_skip(Peer::Smg, &chat, &ready), None);
        let mut messages = chat.clone();
        messages.api = AgentsApi::Messages;
        assert_eq!(
            peer_skip(Peer::VllmRouter, &messages, &ready).as_deref(),
            Some("refuses Messages API calls (POST /v1/messages): HTTP 404")
        );
        assert_eq!(peer_skip(Peer::VllmRouter, &token_ids, &ready), None);
        assert!(peer_skip(Peer::SglangRouter, &chat, &ready).is_some_and(|w| w.contains("not installed")));
    }
}
