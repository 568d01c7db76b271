//! The workloads `semlb bench replay` sends: lists of timed requests,
//! completions with a prompt or chat calls.
//!
//! A [`Workload`] is a list of [`Request`]s in arrival order: an arrival
//! time in *trace seconds* (the replay divides it by its speedup and by a
//! sweep's rate multiplier), the prompt's token ids and, in the text form
//! ([`PromptForm::Text`], see [`text`]), its text, the number of tokens
//! to generate, and an optional session id (sent as `x-session-id`, which
//! session-affine policies such as `consistent_hash` route on, except by
//! `chat`'s clients: [`WorkloadKind::sends_session_ids`]).
//!
//! | workload | module | what |
//! | --- | --- | --- |
//! | `mooncake` | [`mooncake`] | the FAST'25 Mooncake conversation trace (long, partly shared prompts; no sessions) |
//! | `hh-rlhf` | [`hh_rlhf`] | Anthropic HH-RLHF dialogues as Poisson-arriving multi-turn chats (short prompts, one session per conversation) |
//! | `hot-prefix` | [`hot_prefix`] | a generated agent workload: six long system prompts with Zipf popularity, multi-step sessions |
//! | `agents` | [`agents`] | closed-loop agent sessions of chat calls, each sent the instant the previous answer ends, on four shared system prompts |
//! | `chat` | [`chat`] | closed-loop multi-turn chats on four shared system prompts, a fixed number of clients (16) each starting its next conversation when one ends |
//! | `shared-prompt` | [`chat`] ([`chat::ChatShape::shared_prompt`]) | the same closed loop on **one** system prompt: 50 conversations of 6–14 turns, 16 clients (one application, one system prompt: the shape that collapses cache-aware routers onto one engine) |
//! | `burst` | [`burst`] | a hot-prefix burst: background chat sessions on four system prompts, then 48 new sessions on one brand-new ~2 000-token system prompt within 0.1 trace seconds, each a few turns |
//! | `scale-out` | [`chat`] ([`chat::ChatShape::shared_prompt`]) | the `shared-prompt` closed loop starting on **one** engine; the others are added at run time once a quarter of its requests are done |
//!
//! The multi-turn generators schedule turn k+1 open-loop, at turn k's
//! arrival plus its *expected* duration on an idle engine
//! ([`expected_turn_s`]: its new tokens' prefill plus one decode step per
//! output token) plus an exponential think time. A slow answer therefore
//! does not delay the next turn (as in the Mooncake trace, whose arrival
//! times were recorded, not reacted to), so every policy is offered the same
//! requests at the same times; the schedule is a function of the seed only.
//! The `agents`, `chat`, `shared-prompt`, `burst` and `scale-out`
//! workloads are the exceptions, by design: their calls are chat requests
//! that carry the engine's earlier answers, sent when the previous call
//! ends ([`Request::chat`]); `agents` and `burst` start their sessions at
//! scheduled times, the closed loops (`chat`, `shared-prompt`,
//! `scale-out`) have no schedule at all (their clients start a
//! conversation when the last one ends).

pub mod agent_api;
pub mod agents;
pub mod burst;
pub mod chat;
pub mod hh_rlhf;
pub mod hot_prefix;
pub mod mooncake;
pub mod text;

use std::fmt;

use clap::ValueEnum;
use semlb_workers::config::EngineConfig;

use semlb_test_support::Rng;

use self::agent_api::AgentsApi;
use self::text::{Fidelity, TextPrompt};

/// The header a request's session id is sent in.
pub const SESSION_HEADER: &str = "x-session-id";

/// The simulator's context limit (`max_model_len` of `semlb __sim`).
pub const MAX_MODEL_LEN: u32 = 32_768;

/// Synthetic token ids are drawn below this (inside the simulator's
/// vocabulary).
pub const VOCAB: u64 = 50_000;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Arrival time, trace seconds from the workload's start.
    pub at_s: f64,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The prompt as text, sent instead of the ids in the text form
    /// ([`PromptForm::Text`]; `None` in the token-id form and for chat
    /// calls).
    pub text: Option<TextPrompt>,
    /// Tokens to generate (`max_tokens` with `ignore_eos`).
    pub output_tokens: u32,
    /// The session (conversation, agent run) it belongs to, if the
    /// workload has sessions.
    pub session: Option<u64>,
    /// A call of a closed-loop session (`agents`, `chat`): a chat request
    /// built from the session's messages when the previous call ends; its
    /// `prompt` is then empty.
    pub chat: Option<ChatCall>,
}

/// One call of a closed-loop chat session: what the request adds to the
/// session's messages.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatCall {
    /// The session's system prompt (index into [`Workload::systems`]).
    pub system: usize,
    /// Which call of its session (0: the first).
    pub step: u32,
    /// The message it adds after the previous answer (the first call's
    /// after the system prompt).
    pub message: String,
    /// Estimated prompt tokens (for the offered load).
    pub prompt_tokens: u32,
}

impl ChatCall {
    /// Call `step` of a session on system prompt `system`, adding
    /// `message`, of about `prompt_tokens` prompt tokens.
    pub fn new(system: usize, step: u32, message: String, prompt_tokens: u32) -> Self {
        ChatCall {
            system,
            step,
            message,
            prompt_tokens,
        }
    }
}

impl Request {
    /// A call of a closed-loop session: `call` of `session`, sent at `at_s`
    /// (trace seconds; 0 where its client sends it), `output_tokens` long.
    pub fn chat_call(at_s: f64, session: u64, output_tokens: u32, call: ChatCall) -> Request {
        Request {
            at_s,
            prompt: Vec::new(),
            text: None,
            output_tokens,
            session: Some(session),
            chat: Some(call),
        }
    }

    /// Its prompt's tokens (estimated for a chat call).
    pub fn prompt_tokens(&self) -> usize {
        self.chat
            .as_ref()
            .map_or(self.prompt.len(), |a| a.prompt_tokens as usize)
    }
}

/// A workload's requests, in arrival order, and where they come from.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Which workload.
    pub kind: WorkloadKind,
    /// The requests, sorted by arrival time.
    pub requests: Vec<Request>,
    /// Where the requests come from (a path, or the generator's parameters).
    pub source: String,
    /// Prompts cut to fit the context.
    pub truncated: usize,
    /// The system prompts chat calls name ([`ChatCall::system`]).
    pub systems: Vec<String>,
    /// The system prompt whose calls are reported on their own (the
    /// `burst` workload's new one).
    pub burst_system: Option<usize>,
    /// How close the text form comes to the token-id form, measured with
    /// the engines' tokenizer (text form only).
    pub fidelity: Option<Fidelity>,
    /// The API its sessions speak (`agents`: `--agents-api`; chat
    /// completions for the others).
    pub api: AgentsApi,
}

impl Workload {
    /// A workload of `requests` (sorted here by arrival time, stably).
    pub fn new(kind: WorkloadKind, mut requests: Vec<Request>, source: String, truncated: usize) -> Self {
        requests.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        Self {
            kind,
            requests,
            source,
            truncated,
            systems: Vec::new(),
            burst_system: None,
            fidelity: None,
            api: AgentsApi::Chat,
        }
    }

    /// How its prompts are sent: `None` for chat calls, else text when its
    /// requests carry their text.
    pub fn prompt_form(&self) -> Option<PromptForm> {
        if self.kind.chat_calls() {
            None
        } else if self.requests.first().is_some_and(|r| r.text.is_some()) {
            Some(PromptForm::Text)
        } else {
            Some(PromptForm::Tokens)
        }
    }

    /// From the first arrival to the last, trace seconds.
    pub fn span_s(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.at_s - a.at_s,
            _ => 0.0,
        }
    }

    /// Requests per trace second over [`span_s`](Self::span_s).
    pub fn offered_rate(&self) -> f64 {
        self.requests.len() as f64 / self.span_s().max(1e-9)
    }

    /// Prompt tokens per trace second over [`span_s`](Self::span_s).
    pub fn offered_prompt_tokens_per_s(&self) -> f64 {
        self.requests.iter().map(|r| r.prompt_tokens() as f64).sum::<f64>() / self.span_s().max(1e-9)
    }

    /// Its name in reports: the workload's, with the API of an `agents`
    /// workload that does not speak plain chat (`agents/responses`).
    pub fn name(&self) -> String {
        if self.api == AgentsApi::Chat {
            self.kind.to_string()
        } else {
            format!("{}/{}", self.kind, self.api.name())
        }
    }

    /// True when the requests carry session ids.
    pub fn has_sessions(&self) -> bool {
        self.requests.iter().any(|r| r.session.is_some())
    }
}

/// The workloads of `--workloads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// The Mooncake conversation trace.
    Mooncake,
    /// HH-RLHF multi-turn chats.
    HhRlhf,
    /// Generated agent sessions on a few hot system prompts.
    HotPrefix,
    /// Closed-loop agent sessions of chat calls.
    Agents,
    /// Closed-loop multi-turn chats, a fixed number of clients.
    Chat,
    /// Closed-loop multi-turn chats that all open with one system prompt.
    SharedPrompt,
    /// Background chat sessions, then a burst of new sessions on one new
    /// long system prompt.
    Burst,
    /// The `shared-prompt` closed loop, from one engine to `--engines`
    /// engines added at run time.
    ScaleOut,
}

impl WorkloadKind {
    /// Every workload, in report order.
    pub const ALL: [Self; 8] = [
        Self::Mooncake,
        Self::HhRlhf,
        Self::HotPrefix,
        Self::Agents,
        Self::Chat,
        Self::SharedPrompt,
        Self::Burst,
        Self::ScaleOut,
    ];

    /// Its name on the command line and in outputs.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Mooncake => "mooncake",
            Self::HhRlhf => "hh-rlhf",
            Self::HotPrefix => "hot-prefix",
            Self::Agents => "agents",
            Self::Chat => "chat",
            Self::SharedPrompt => "shared-prompt",
            Self::Burst => "burst",
            Self::ScaleOut => "scale-out",
        }
    }

    /// True for a workload sent by a fixed number of clients, each
    /// sending its next request when its answer ends: it has no offered
    /// rate, only the throughput the policy reaches.
    pub const fn closed_loop(self) -> bool {
        matches!(self, Self::Chat | Self::SharedPrompt | Self::ScaleOut)
    }

    /// True for a workload of chat calls built from a session's messages
    /// as it goes ([`Request::chat`]).
    pub const fn chat_calls(self) -> bool {
        matches!(
            self,
            Self::Agents | Self::Chat | Self::SharedPrompt | Self::Burst | Self::ScaleOut
        )
    }

    /// True when its requests carry their session id in
    /// [`SESSION_HEADER`]. `chat`'s, `shared-prompt`'s and `scale-out`'s
    /// do not, as most chat clients send none: `consistent_hash` then keys
    /// on a conversation's opening.
    pub const fn sends_session_ids(self) -> bool {
        !matches!(self, Self::Chat | Self::SharedPrompt | Self::ScaleOut)
    }

    /// True when its requests are completions (`prompt` a text or an array
    /// of token ids, [`PromptForm`]), not chat calls.
    pub const fn completions(self) -> bool {
        !self.chat_calls()
    }
}

/// How the completions workloads' prompts are sent (`--prompt-form`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum PromptForm {
    /// A string: the text form ([`text`]).
    #[default]
    Text,
    /// An array of token ids.
    Tokens,
}

impl PromptForm {
    /// Its name on the command line and in outputs.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Tokens => "tokens",
        }
    }

    /// What a request's prompt is, in words.
    pub const fn describe(self) -> &'static str {
        match self {
            Self::Text => "prompts as text",
            Self::Tokens => "prompts as arrays of token ids",
        }
    }
}

impl fmt::Display for PromptForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The prompt and output lengths a request of `prompt` and `output` tokens
/// is sent with so that both fit the context: `(prompt, output,
/// truncated)`; the prompt keeps its first tokens.
pub fn fit_to_context(prompt: u32, output: u32, max_output: u32) -> (u32, u32, bool) {
    let output = output.clamp(1, max_output.max(1));
    let room = MAX_MODEL_LEN - output.min(MAX_MODEL_LEN - 1);
    let fitted = prompt.clamp(1, room);
    (fitted, output, fitted < prompt)
}

/// The requests of a generated workload inside the measured window
/// `0..duration_s`.
pub(super) struct Window {
    /// The requests so far.
    pub requests: Vec<Request>,
    /// Trace seconds measured.
    duration_s: f64,
    /// Output cap.
    max_output: u32,
    /// Requests whose prompt was cut to the context.
    pub truncated: usize,
}

impl Window {
    /// An empty window of `duration_s` trace seconds, outputs capped at
    /// `max_output`.
    pub(super) fn new(duration_s: f64, max_output: u32) -> Self {
        Self {
            requests: Vec::new(),
            duration_s,
            max_output,
            truncated: 0,
        }
    }

    /// Adds the turn of `session` arriving `at` with `history` as its
    /// prompt (and `text`, its text form) and `output` tokens to generate,
    /// fitted to the context, if `at` falls in the window; returns the
    /// output tokens it is sent with. A prompt cut to the context keeps its
    /// whole text (the generators' prompts are far shorter).
    pub(super) fn turn(
        &mut self,
        at: f64,
        history: &[u32],
        text: Option<&TextPrompt>,
        output: u32,
        session: u64,
    ) -> u32 {
        let (prompt_len, output_tokens, cut) = fit_to_context(history.len() as u32, output, self.max_output);
        if (0.0..self.duration_s).contains(&at) {
            self.truncated += usize::from(cut);
            self.requests.push(Request {
                at_s: at,
                prompt: history[..prompt_len as usize].to_vec(),
                text: text.cloned(),
                output_tokens,
                session: Some(session),
                chat: None,
            });
        }
        output_tokens
    }
}

/// An exponential sample of mean `mean` (a Poisson process's gap).
pub(super) fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -rng.unit().ln() * mean
}

/// Tokens per word of the generated text with the bundled tokenizer (for
/// estimates only).
const TOKENS_PER_WORD: f64 = 1.3;

/// The words generated text is made of.
const WORDS: [&str; 32] = [
    "cache", "query", "table", "server", "engine", "token", "block", "route", "latency", "budget", "index", "stream",
    "result", "schema", "field", "record", "buffer", "window", "policy", "metric", "request", "answer", "session",
    "prefix", "shard", "replica", "queue", "batch", "limit", "error", "retry", "value",
];

/// `n` words of generated text drawn from `rng` (a line break every 12).
pub(super) fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(if i % 12 == 0 { '\n' } else { ' ' });
        }
        s.push_str(WORDS[(rng.next() % WORDS.len() as u64) as usize]);
    }
    s
}

/// The estimated tokens of `words` generated words.
pub(super) fn tokens(words: usize) -> u32 {
    (words as f64 * TOKENS_PER_WORD) as u32
}

/// `n` token ids drawn from `rng`.
pub(super) fn random_tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next() % VOCAB) as u32).collect()
}

/// Uniform integer in `lo..=hi`.
pub(super) fn uniform(rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    lo + (rng.next() % u64::from(hi - lo + 1)) as u32
}

/// The simulated seconds a turn takes on an idle engine: prefill of its
/// `new_tokens` uncached prompt tokens, then one decode step (of a batch of
/// one) per output token.
pub fn expected_turn_s(new_tokens: usize, output_tokens: u32) -> f64 {
    let engine = EngineConfig::default();
    engine.prefill_time(new_tokens as u64).as_secs_f64()
        + f64::from(output_tokens) * engine.decode_step_time(1).as_secs_f64()
}

/// The engines' simulated prefill rate (tokens per second of uncached
/// prompt), the capacity the workloads' loads are stated against.
pub fn engine_prefill_tokens_per_s() -> f64 {
    EngineConfig::default().prefill_tokens_per_s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_cut_to_the_context() {
        assert_eq!(fit_to_context(40_000, 3_000, 2048), (32_768 - 2048, 2048, true));
        assert_eq!(fit_to_context(100, 0, 2048), (100, 1, false));
    }

    #[test]
    fn workloads_sort_and_measure_their_rate() {
        let r = |at_s: f64| Request {
            at_s,
            prompt: vec![1; 10],
            text: None,
            output_tokens: 1,
            session: None,
            chat: None,
        };
        let w = Workload::new(WorkloadKind::HotPrefix, vec![r(2.0), r(0.0), r(1.0)], String::new(), 0);
        assert_eq!(w.requests.iter().map(|r| r.at_s).collect::<Vec<_>>(), [0.0, 1.0, 2.0]);
        assert_eq!(
            (w.span_s(), w.offered_rate(), w.offered_prompt_tokens_per_s()),
            (2.0, 1.5, 15.0)
        );
        assert!(!w.has_sessions());
    }

    #[test]
    fn turns_take_prefill_and_decode_time() {
        // 10 000 tokens of prefill = 1 s; 100 decode steps of one sequence
        // at 10.08 ms.
        assert!((expected_turn_s(10_000, 100) - (1.0 + 1.008)).abs() < 1e-9);
        assert_eq!(engine_prefill_tokens_per_s(), 10_000.0);
    }
}
