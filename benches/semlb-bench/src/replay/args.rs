//! The flags of `semlb bench replay` ([`ReplayArgs`]) and how each
//! workload is run by default ([`Setting`]).

use std::path::PathBuf;

use clap::Args;
use semlb::routing::PolicyKind;

use super::chat_set::ChatSet;
use crate::Common;
use crate::workload::agent_api::AgentsApi;
use crate::workload::burst;
use crate::workload::{PromptForm, WorkloadKind};

/// `semlb bench replay` flags.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// Workloads to replay, comma-separated [default: all:
    /// mooncake,hh-rlhf,hot-prefix,agents,chat,shared-prompt,burst,scale-out].
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
    /// How the completions of mooncake, hh-rlhf and hot-prefix carry
    /// their prompt, to every row alike: `text` (a string the engines
    /// tokenize into the trace's lengths and shared prefixes) or `tokens`
    /// (an array of token ids, which smg and sglang-router refuse).
    #[arg(long, value_name = "FORM", value_enum, default_value_t = PromptForm::Text)]
    pub prompt_form: PromptForm,
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
    /// The APIs the `agents` sessions speak, comma-separated, a table
    /// each (`agents`, `agents/chat-tools`, `agents/responses`,
    /// `agents/messages`): `chat` (chat completions without tools, the
    /// plain workload), or a tool-calling loop over `chat-tools` (chat
    /// completions), `responses` (OpenAI's Responses API) or `messages`
    /// (Anthropic's Messages API).
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_enum, default_value = "chat")]
    pub agents_api: Vec<AgentsApi>,
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
    /// Another row: POLICY with the gateway configuration FILE (TOML,
    /// merged into the run's: its keys replace the run's, table by table,
    /// so `[policy.dual_map] max_pending = 4` keeps the run's scaled
    /// `ttft_slo_ms`), named LABEL. Repeatable.
    #[arg(long = "variant", value_name = "LABEL=POLICY[@FILE]", value_parser = super::variant::parse_variant)]
    pub variants: Vec<super::variant::Variant>,
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
    /// Clients of the `chat` and `shared-prompt` workloads (their
    /// requests in flight).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub chat_clients: usize,
    /// Conversations of the `shared-prompt` and `scale-out` workloads.
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub shared_prompt_conversations: usize,
    /// Sessions of the `burst` workload's burst.
    #[arg(long, value_name = "N", default_value_t = burst::BURST_SESSIONS)]
    pub burst_sessions: usize,
    /// Background sessions of the `burst` workload per trace second.
    #[arg(long, value_name = "R", default_value_t = 2.0)]
    pub burst_background_rate: f64,
    /// Peer routers replayed as rows next to semlb's policies,
    /// comma-separated; `none` or an empty list: none [default: all:
    /// smg,vllm-router,sglang-router].
    #[arg(long, value_name = "LIST", value_delimiter = ',', num_args = 0..)]
    pub peers: Option<Vec<String>>,
    /// Where the peers' private virtual environments are installed
    /// [default: bench-peers/ in the target directory this binary runs
    /// from].
    #[arg(long, value_name = "DIR")]
    pub peers_dir: Option<PathBuf>,
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
            prompt_form: PromptForm::Text,
            ttft_slo: None,
            sweep: vec![0.5, 1.0, 1.5, 2.0],
            hh_rlhf_rate: 90.0,
            hot_prefix_rate: 4.5,
            agents_rate: 1.5,
            agents_api: vec![AgentsApi::Chat],
            compare_learning: false,
            compare_feedback: false,
            compare_prefix_sources: false,
            cost_weights: Vec::new(),
            variants: Vec::new(),
            kv_tokens: None,
            max_output: 2048,
            dispatchers: 2,
            drain_secs: 30.0,
            seed: 0,
            chat_sets: Vec::new(),
            chat_conversations: 400,
            chat_clients: 16,
            shared_prompt_conversations: 50,
            burst_sessions: burst::BURST_SESSIONS,
            burst_background_rate: 2.0,
            peers: None,
            peers_dir: None,
        }
    }

    /// The speedup, duration and TTFT objective of `kind`.
    pub(super) fn setting(&self, kind: WorkloadKind) -> Setting {
        let (speedup, duration_s, ttft_slo_s) = match kind {
            WorkloadKind::Mooncake => (20.0, 600.0, 10.0),
            WorkloadKind::HhRlhf => (1.0, 20.0, 1.0),
            WorkloadKind::HotPrefix => (4.0, 120.0, 2.0),
            WorkloadKind::Agents => (2.0, 60.0, 1.0),
            WorkloadKind::Burst => (4.0, 40.0, 2.0),
            // A closed loop has no duration: its conversations set it.
            WorkloadKind::Chat | WorkloadKind::SharedPrompt | WorkloadKind::ScaleOut => (10.0, 0.0, 1.0),
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
pub(super) struct Setting {
    pub(super) speedup: f64,
    pub(super) duration_s: f64,
    pub(super) ttft_slo_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let s = args.setting(WorkloadKind::Burst);
        assert_eq!((s.speedup, s.duration_s, s.ttft_slo_s), (4.0, 40.0, 2.0));
        let s = args.setting(WorkloadKind::ScaleOut);
        assert_eq!((s.speedup, s.ttft_slo_s), (10.0, 1.0));
        args.speedup = Some(5.0);
        args.ttft_slo = Some(3.0);
        let s = args.setting(WorkloadKind::HotPrefix);
        assert_eq!((s.speedup, s.duration_s, s.ttft_slo_s), (5.0, 120.0, 3.0));
    }
}
