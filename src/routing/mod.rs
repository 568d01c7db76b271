//! Routing policies: which inference server gets a request.
//!
//! A dispatcher gathers the live servers as [`Candidate`]s (slot,
//! generation, requests in flight through every dispatcher, last scraped
//! engine load) from the shm server table, looks the prompt's block chain up
//! in the prefix table ([`shm_layout::PrefixMatch`]), and asks its
//! [`Policy`] for a [`Choice`]. Every policy is one module implementing the
//! one trait; adding a policy touches no other policy.
//!
//! | policy | module | idea |
//! | --- | --- | --- |
//! | `cache_aware` (default) | [`cache_aware`] | SGLang's router: longest prefix match past the shared header above a threshold unless that server is overloaded (thresholds scaled to its capacity, [`balance`]); else least load |
//! | `least_load` | [`least_load`] | fewest requests in flight |
//! | `round_robin` | [`round_robin`] | in turn |
//! | `random` | [`random`] | uniformly at random |
//! | `selective_push` | [`selective_push`] | SkyLB: send only to servers with no pending requests, else hold the request in the gateway queue (a conversation's own engine waited for up to `cache_wait_ms`) |
//! | `consistent_hash` | [`consistent_hash`] | SkyLB-CH / vllm-router: a session key on a ring of virtual nodes, with bounded load |
//! | `dual_map` | [`dual_map`] | DualMap: two hash candidates per adaptive-length prefix, cache match unless a TTFT SLO breaks, hotspot rebalancing |
//! | `weighted_scorers` | [`weighted_scorers`] | llm-d: weighted prefix, queue, KV-cache and load scores; max or weighted random pick |
//! | `cost` | [`cost`] | Dynamo's cost: uncached prompt tokens + λ × work queued at the server, λ tuned online from TTFT ([`weight_bandit`]) |
//!
//! Before a policy chooses, a request's [`affinity`] applies: a Responses
//! request continuing a stored response goes only to the engine that
//! stored it, and an agent session's engine is credited with its whole
//! prompt (kept there while the load rule allows).
//!
//! A pool's policy is a [`swappable::SwappablePolicy`]: a reload replaces it
//! while requests are being routed. Servers of unequal capacity carry a
//! weight, and loads are compared per unit of it ([`weights`]).
//!
//! # Shared headers
//!
//! The prefix-aware policies route on [`RouteInput::useful_blocks`], not
//! on the raw match: a match that does not go past the prompt's *shared
//! header* (a prefix many different prompts diverge right after, such as
//! one application's system prompt, detected per dispatcher by
//! [`shared_header`]) counts as none. Every conversation of an
//! application matches its system prompt on whichever engine first
//! computed it; followed, that match sends all of them there. Seen as no
//! evidence, a new conversation goes by load and its engine computes the
//! header once, while its later turns match past the header and stay.
//! `[policy.prefix] shared_headers = false` turns this off.
//!
//! # Holding requests at the gateway
//!
//! A policy whose [`Policy::holds_requests`] is true may answer `None` while
//! there are candidates: every server it would use is *full* right now. The
//! dispatcher then keeps the request in its gateway queue
//! (`crate::dispatcher::queue`) and asks again, with fresh load, whenever a
//! server's request starts or ends, telling it how long the request has
//! waited ([`RouteInput::waited_ms`]). Other policies answer `None` only when
//! there is no candidate at all.
//!
//! # Pending requests
//!
//! [`Candidate::pending_estimate`] is what SkyLB calls a server's pending
//! requests (queued, not yet running), from both sources the gateway has:
//! the engine's scraped `waiting` gauge, and the gateway's own accounting
//! between scrapes. The gateway counts a request *pending* from the moment
//! it is sent until its first token arrives ([`Candidate::pending`]); the
//! scraper stores that count with the figures it scrapes
//! (`pending_at_scrape`). Then:
//!
//! * the last fresh scrape saw requests waiting: `estimate = max(0,
//!   waiting + pending − pending_at_scrape)`, what was waiting then, plus
//!   what the gateway sent since, minus what it saw start since: the queue
//!   is tracked down request by request as it drains, and up as the
//!   gateway adds to it;
//! * it saw requests waiting, and since then as many requests as were
//!   waiting, and every one the gateway had pending then, started
//!   ([`Candidate::started_since_scrape`]; the engine's queue is first
//!   come, first served, so those were ahead of anything sent later):
//!   0, as if it had seen none. A continuous-batching engine reports the
//!   requests that arrived during a step as waiting until the step ends,
//!   so a scrape of a busy engine with room in its batch often sees a few;
//!   counted until the next scrape (a second by default), they held an
//!   engine that was taking everything at one request in flight per first
//!   token: `dual_map` met the TTFT objective for 39–50 % of `hh-rlhf`'s
//!   requests at ×1.5 where `cache_aware` met it for 100 % (issue 38);
//! * it saw none: 0. The engine had room in its batch, so what the gateway
//!   sends until the next scrape is taken to be batched at the engine's
//!   next step. (Counting those as pending would let an engine admit one
//!   request per step: a request sent now has no first token until the
//!   step after next even on an idle engine, so short prompts at a high
//!   rate would starve a free engine.)
//! * no fresh scrape (an engine without metrics, or a stale one): from
//!   the requests in flight and the server's learned **admission limit**
//!   `L` ([`Candidate::admission`], [`crate::routing::capacity`]), `estimate =
//!   max(0, inflight − L + 1)`. The gateway cannot see the engine's
//!   queue, so it estimates how many requests the engine runs at once
//!   from the latencies it measures. A server at its limit counts one
//!   pending: a holding policy at `max_pending = 0` then keeps at most `L`
//!   in flight there, and the requests it sends do not queue in the
//!   engine, so their latencies keep showing what the engine runs
//!   unqueued (one more would always wait, and the limit would learn from
//!   nothing but queued requests). The gateway's own pending count cannot
//!   stand in for the engine's queue: a non-streamed answer shows its
//!   first byte only when complete, so every such request would count as
//!   pending to its end and an engine would look full with one.
//! * the engine reported how many requests it runs at once (llama.cpp's
//!   slots, [`Candidate::admission_reported`]): `L` is that number, and
//!   the estimate is never below `max(0, inflight − L + 1)`, fresh scrape
//!   or not. Such an engine defers every request beyond its slots, so
//!   what the gateway sends past them between two scrapes that saw no
//!   queue is queued all the same.

pub mod affinity;
pub mod balance;
pub mod cache_aware;
pub mod capacity;
pub mod consistent_hash;
pub mod cost;
pub mod decode_leg;
pub mod dual_map;
pub mod least_load;
mod load_bound;
mod members;
pub mod random;
mod reason;
mod ring;
pub mod round_robin;
pub mod selective_push;
pub mod shared_header;
pub mod swappable;

pub use members::{Leg, Members};
pub use reason::Reason;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
pub mod weight_bandit;
pub mod weighted_scorers;
pub mod weights;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use shm_layout::{LoadFigures, PrefixMatch, ServerRef, ServerState, ServerTable, Tables};

pub use cache_aware::CacheAwareParams;
pub use consistent_hash::ConsistentHashParams;
pub use cost::CostParams;
pub use dual_map::DualMapParams;
pub use selective_push::{PushMode, SelectivePushParams};
pub use weighted_scorers::{Pick, WeightedScorersParams};
pub use weights::LOAD_UNIT;
pub(crate) use weights::{by_weight, total_weight};

/// One server a request may go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The registration (slot and generation).
    pub server: ServerRef,
    /// Requests in flight to it through the gateway (all dispatchers).
    pub inflight: u64,
    /// Their prefill work: the prompt tokens the server was not predicted
    /// to hold when each was sent ([`uncached_tokens`]). (Whole prompt
    /// tokens before issue 38: a conversation's next turn, mostly cached,
    /// counted as its whole history, so an engine busy with cached
    /// conversations looked as loaded as one prefilling long new prompts.)
    pub inflight_tokens: u64,
    /// Of those, the requests without a first token yet (queued or in
    /// prefill at the engine), counted by this host's dispatchers.
    pub pending: u64,
    /// Prefill work of the pending requests (as `inflight_tokens`).
    pub pending_tokens: u64,
    /// Its last scraped engine load (zeros until scraped, or when stale).
    pub load: LoadFigures,
    /// Requests its engine runs at once: the number its engine reported
    /// (`admission_reported`), else the learned admission limit, or
    /// [`crate::routing::capacity::INITIAL_LIMIT`] before one is learned (see
    /// [`crate::routing::capacity`]).
    pub admission: u32,
    /// `admission` is the engine's own word (llama.cpp's slots, which it
    /// never exceeds), not an estimate.
    pub admission_reported: bool,
    /// Requests to it that stopped being pending (first token, or ended
    /// without one) since `load` was scraped: how far the queue the scrape
    /// saw has drained ([`Self::pending_estimate`]).
    pub started_since_scrape: u64,
    /// Its capacity relative to the other servers' (`[[backend]] weight`,
    /// at least 1): loads are compared per unit of weight
    /// ([`Self::per_weight`]).
    pub weight: u32,
}

/// Prefill tokens a request decoding at a server counts as work queued
/// ahead of a new one, by default ([`Candidate::queued_work`]): one step
/// of the engine's batch.
pub const RUNNING_REQUEST_TOKENS: u64 = 16;

impl Candidate {
    /// Work queued at this server ahead of a new request of
    /// `prompt_tokens`, in prefill tokens: the pending requests' prefill
    /// work, the requests its engine shows queued beyond those at their
    /// mean size (`prompt_tokens` when none is pending), and
    /// `running_request_tokens` for each request past its first token.
    /// `cost` weighs it against a server's uncached tokens; `cache_aware`
    /// falls back to its least.
    #[inline]
    pub fn queued_work(&self, prompt_tokens: u64, running_request_tokens: u64) -> u64 {
        let mean_pending = self.pending_tokens.checked_div(self.pending).unwrap_or(prompt_tokens);
        let beyond = self.pending_estimate().saturating_sub(self.pending);
        let running = self.inflight.saturating_sub(self.pending);
        self.pending_tokens + beyond * mean_pending + running * running_request_tokens
    }

    /// Requests estimated to be queued at the engine now (see the
    /// [module docs](self#pending-requests)).
    #[inline]
    pub fn pending_estimate(&self) -> u64 {
        let beyond_admission = (self.inflight + 1).saturating_sub(u64::from(self.admission));
        let scraped = match (self.load.scraped_at_ms, self.load.waiting) {
            (0, _) => return beyond_admission,
            (_, 0) => 0,
            // Every request pending at the scrape, and as many as were
            // waiting, have started since: the queue it saw has drained.
            (_, waiting) if self.started_since_scrape >= u64::from(waiting.max(self.load.pending_at_scrape)) => 0,
            (_, waiting) => (u64::from(waiting) + self.pending).saturating_sub(u64::from(self.load.pending_at_scrape)),
        };
        if self.admission_reported {
            scraped.max(beyond_admission)
        } else {
            scraped
        }
    }
}

/// What a policy sees for one request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    /// Full blocks in the prompt's chain (the denominator of the match ratio).
    pub prompt_blocks: u32,
    /// The prompt's block chain: `chain[i]` hashes blocks `0..=i`, so each
    /// entry names a whole prefix (`prompt_blocks` entries).
    pub chain: &'a [u64],
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// The request's session key, hashed, when the policy asked for one
    /// ([`Policy::session_source`]) and the request has it.
    pub session: Option<u64>,
    /// The engine its agent session is on, credited in `prefix` with the
    /// whole prompt ([`affinity`]): `cache_aware` judges it overloaded at
    /// half its capacity rather than an eighth.
    pub session_engine: Option<shm_layout::ServerTag>,
    /// The same request asked about again (a retry, or another look from
    /// the gateway queue): a policy that learns from the traffic it routes
    /// (`dual_map`'s hotness counts) must not count it twice.
    pub repeat: bool,
    /// How long the request has waited in the gateway queue, in
    /// milliseconds (0 when it has not waited).
    pub waited_ms: u64,
    /// Which servers hold how many leading blocks (only live servers).
    pub prefix: &'a PrefixMatch,
    /// Leading blocks of the prompt that are a shared header (a prefix
    /// many different prompts open with, [`shared_header`]); 0 when its
    /// match is its own. A match of at most this many blocks is weak
    /// evidence: [`useful_blocks`](Self::useful_blocks) counts it as none.
    pub header_blocks: u32,
    /// The servers that may take the request; never empty when a policy is asked.
    pub candidates: &'a [Candidate],
}

impl<'a> RouteInput<'a> {
    /// The input for a prompt of `prompt_tokens` tokens whose block chain
    /// (blocks of `block_tokens`) is `chain`, without a session key.
    pub fn new(
        chain: &'a [u64],
        prompt_tokens: u32,
        block_tokens: u32,
        prefix: &'a PrefixMatch,
        candidates: &'a [Candidate],
    ) -> Self {
        Self {
            prompt_blocks: u32::try_from(chain.len()).unwrap_or(u32::MAX),
            chain,
            prompt_tokens,
            block_tokens,
            session: None,
            session_engine: None,
            repeat: false,
            waited_ms: 0,
            prefix,
            header_blocks: 0,
            candidates,
        }
    }

    /// Leading blocks of the prompt the server `tag` holds that say where
    /// the prompt belongs: its match, or 0 when the match does not go past
    /// the prompt's shared header ([`header_blocks`](Self::header_blocks)).
    /// The prefix-aware policies route on this, so a prompt whose match is
    /// only a system prompt goes by load.
    #[inline]
    pub fn useful_blocks(&self, tag: shm_layout::ServerTag) -> u32 {
        let blocks = self.prefix.blocks_for(tag);
        if blocks > self.header_blocks { blocks } else { 0 }
    }
}

/// Where a policy takes a request's session key from (see
/// [`Policy::session_source`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SessionSource {
    /// Request headers, tried in order (lower case).
    pub headers: Vec<String>,
    /// Then the body's `user` field.
    pub user_field: bool,
    /// Then a chat's opening ([`crate::openai::prompt::opening`]).
    pub opening: bool,
}

/// A policy's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The server.
    pub server: ServerRef,
    /// Why.
    pub reason: Reason,
}

/// A routing policy. Implementations are cheap to call and never allocate
/// on the request path.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The name used in configuration and metrics.
    fn name(&self) -> &'static str;

    /// Chooses a server. `None` when there are no candidates or, for a
    /// policy that [holds requests](Self::holds_requests), when every server
    /// it would use is full.
    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice>;

    /// Whether `None` with candidates means "wait in the gateway queue"
    /// (default: false).
    fn holds_requests(&self) -> bool {
        false
    }

    /// For a policy that holds requests: whether the server it chose still
    /// takes the request, read again right after the request was counted
    /// on it (`counted` includes it). Choosing and counting are two steps,
    /// and another dispatcher may have sent a request to the same server in
    /// between; `false` (the server went over the policy's limit) makes the
    /// dispatcher uncount the request and queue it instead. Default: true.
    fn admits(&self, counted: &Candidate) -> bool {
        let _ = counted;
        true
    }

    /// Where the request's session key comes from, if the policy uses one
    /// (default: none, and [`RouteInput::session`] stays `None`).
    fn session_source(&self) -> Option<&SessionSource> {
        None
    }

    /// A request this policy routed for [`Reason::Cost`] with `arm` saw its
    /// first token after `ttft_us` (the whole answer's latency when it was
    /// not streamed). Default: ignored.
    fn observe(&self, arm: u8, ttft_us: u32) {
        let _ = (arm, ttft_us);
    }

    /// The value the policy tunes online, published for `/metrics` and
    /// `semlb status` (default: none).
    fn tuned_weight(&self) -> Option<f64> {
        None
    }
}

/// The candidate holding the most leading blocks of the prompt among those
/// `keep` accepts, with that count: ties go to the less loaded (fewer
/// in-flight requests, then tokens), then to the one the match lists first
/// (the most recently refreshed). Entries for servers that are not
/// candidates are ignored, and so are matches that do not go past the
/// prompt's shared header ([`RouteInput::useful_blocks`]). `None` when no
/// kept candidate holds a useful block.
pub(crate) fn best_prefix<'c>(
    input: &RouteInput<'c>,
    keep: impl Fn(&Candidate) -> bool,
) -> Option<(&'c Candidate, u32)> {
    let mut best: Option<(&'c Candidate, u32)> = None;
    for (tag, blocks) in input.prefix.iter() {
        if blocks <= input.header_blocks {
            continue;
        }
        let Some(c) = input.candidates.iter().find(|c| c.server.tag() == tag) else {
            continue;
        };
        if !keep(c) {
            continue;
        }
        let better = match best {
            None => true,
            Some((b, n)) => blocks > n || (blocks == n && least_load::load_key(c) < least_load::load_key(b)),
        };
        if better {
            best = Some((c, blocks));
        }
    }
    best
}

/// The prefill work a request of `prompt_tokens` tokens brings to a server
/// that holds `cached_blocks` of its leading blocks of `block_tokens`:
/// what the gateway counts in flight and pending for it
/// ([`Candidate::inflight_tokens`], [`Candidate::pending_tokens`]).
#[inline]
pub fn uncached_tokens(prompt_tokens: u32, cached_blocks: u32, block_tokens: u32) -> u64 {
    u64::from(prompt_tokens).saturating_sub(u64::from(cached_blocks) * u64::from(block_tokens))
}

/// `server` as the table has it now: its in-flight and pending counts and
/// its last scraped load (however old).
pub fn candidate(servers: &ServerTable<'_>, server: ServerRef) -> Candidate {
    let ((inflight, inflight_tokens), (pending, pending_tokens)) = servers.inflight_and_pending(server);
    let admission =
        crate::routing::capacity::Admission::of(servers.engine_slots(server), servers.admission_limit(server));
    Candidate {
        server,
        inflight,
        inflight_tokens,
        pending,
        pending_tokens,
        load: servers.load(server),
        admission: admission.limit(),
        admission_reported: matches!(admission, crate::routing::capacity::Admission::Reported(_)),
        started_since_scrape: servers.started_since_scrape(server),
        weight: u32::from(servers.weight(server)),
    }
}

/// Fills `out` with the servers in state `Up`, with their shared load.
pub fn live_candidates(tables: &Tables<'_>, out: &mut Vec<Candidate>) {
    out.clear();
    let servers = &tables.servers;
    for slot in 0..servers.capacity() as u16 {
        if let Some((server, ServerState::Up)) = servers.current(slot) {
            out.push(candidate(servers, server));
        }
    }
}

/// Which routing policy a gateway uses (`kind` in [`PolicyConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// [`cache_aware::CacheAware`]: longest prefix match above a threshold
    /// unless load is imbalanced; else least load.
    #[default]
    CacheAware,
    /// [`least_load::LeastLoad`]: fewest requests in flight.
    LeastLoad,
    /// [`round_robin::RoundRobin`]: in turn.
    RoundRobin,
    /// [`random::Random`]: uniformly at random.
    Random,
    /// [`selective_push::SelectivePush`]: only to servers that are not
    /// full, else wait in the gateway queue (SkyLB).
    SelectivePush,
    /// [`consistent_hash::ConsistentHash`]: a session key on a hash ring
    /// with bounded load.
    ConsistentHash,
    /// [`dual_map::DualMap`]: two hash candidates per prefix (DualMap).
    DualMap,
    /// [`weighted_scorers::WeightedScorers`]: weighted scores (llm-d).
    WeightedScorers,
    /// [`cost::Cost`]: uncached prefill plus weighted queued work, the
    /// weight tuned online.
    Cost,
}

impl PolicyKind {
    /// Every policy, in documentation order.
    pub const ALL: [Self; 9] = [
        Self::CacheAware,
        Self::LeastLoad,
        Self::RoundRobin,
        Self::Random,
        Self::SelectivePush,
        Self::ConsistentHash,
        Self::DualMap,
        Self::WeightedScorers,
        Self::Cost,
    ];

    /// The name in configuration, on the command line and in metrics (the
    /// built policy's [`Policy::name`]).
    pub const fn name(self) -> &'static str {
        match self {
            Self::CacheAware => "cache_aware",
            Self::LeastLoad => "least_load",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
            Self::SelectivePush => "selective_push",
            Self::ConsistentHash => "consistent_hash",
            Self::DualMap => "dual_map",
            Self::WeightedScorers => "weighted_scorers",
            Self::Cost => "cost",
        }
    }
}

impl PolicyKind {
    /// One line on what the policy does, for `semlb serve --help`.
    pub const fn summary(self) -> &'static str {
        match self {
            Self::CacheAware => {
                "the engine holding the longest cached prefix, unless load is imbalanced; else the least loaded (SGLang's router; the default)"
            }
            Self::LeastLoad => "the engine with the fewest requests in flight",
            Self::RoundRobin => "the engines in turn",
            Self::Random => "an engine uniformly at random",
            Self::SelectivePush => {
                "only to engines that are not full, else the request waits in the gateway queue (SkyLB)"
            }
            Self::ConsistentHash => "a session key on a hash ring with bounded load",
            Self::DualMap => "two hash candidates per prefix, the one likelier to meet the TTFT objective (DualMap)",
            Self::WeightedScorers => "weighted scores of prefix, queue, KV-cache use and load (llm-d's scorers)",
            Self::Cost => "the least uncached prefill plus weighted queued work, the weight tuned online",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that names no [`PolicyKind`]; it holds the name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing policy {0:?}: expected one of {names}", names = PolicyKind::ALL.map(PolicyKind::name).join(", "))]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// Routing configuration: the policy and its parameters. Every field has a
/// default, so an empty table is the default configuration; unknown fields
/// are errors.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// The policy (see [`PolicyKind`]; default `cache_aware`).
    pub kind: PolicyKind,
    /// The gateway queue of the policies that hold requests.
    pub queue: QueueParams,
    /// Thresholds of the `cache_aware` policy (SGLang's defaults: 0.5, 32,
    /// 1.1). Every policy's table is validated whatever `kind` is, so a
    /// typo does not wait for the day the policy is switched.
    pub cache_aware: CacheAwareParams,
    /// The `selective_push` policy.
    pub selective_push: SelectivePushParams,
    /// The `consistent_hash` policy.
    pub consistent_hash: ConsistentHashParams,
    /// The `dual_map` policy.
    pub dual_map: DualMapParams,
    /// The `weighted_scorers` policy.
    pub weighted_scorers: WeightedScorersParams,
    /// The `cost` policy.
    pub cost: CostParams,
    /// Where the prefix-aware policies' prefix matches come from.
    pub prefix: PrefixParams,
}

impl PolicyConfig {
    /// Checks every parameter. The error names the field (relative to this
    /// table, e.g. `cache_aware.cache_threshold`), its value and the reason.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        self.queue.validate().map_err(|e| e.within("queue"))?;
        self.cache_aware.validate().map_err(|e| e.within("cache_aware"))?;
        self.selective_push.validate().map_err(|e| e.within("selective_push"))?;
        self.consistent_hash
            .validate()
            .map_err(|e| e.within("consistent_hash"))?;
        self.dual_map.validate().map_err(|e| e.within("dual_map"))?;
        self.weighted_scorers
            .validate()
            .map_err(|e| e.within("weighted_scorers"))?;
        self.cost.validate().map_err(|e| e.within("cost"))?;
        self.prefix.validate().map_err(|e| e.within("prefix"))
    }
}

/// Where a lookup's prefix matches come from (`[policy.prefix] source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixSource {
    /// The gateway's estimate: the prefix table built from what it sent
    /// (corrected by what engines report of cached tokens).
    #[default]
    Estimate,
    /// The engines' own word where a backend publishes KV cache events
    /// (`[[backend]] kv_events`): its confirmed blocks, plus the gateway's
    /// entries for it younger than `confirm_window_secs` (sent, not yet
    /// confirmed); the estimate for the other backends
    /// ([`crate::kv_events`]).
    Precise,
}

/// `[policy.prefix]`: the prefix matches the prefix-aware policies
/// (`cache_aware`, `weighted_scorers`, `dual_map`, `cost`, ...) see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixParams {
    /// `estimate` (default) or `precise`.
    pub source: PrefixSource,
    /// With `precise`: how long the gateway's own entries for an engine
    /// whose events it follows completely still count, in seconds: the
    /// time from sending a prompt to the engine's event for its blocks
    /// (an engine stores a prompt's blocks when it schedules it), so that a
    /// burst sharing a new prefix meets it before the confirmation does.
    /// Default 2; 1 to 60.
    pub confirm_window_secs: u64,
    /// A match that ends at a shared header (a prefix many different
    /// prompts open with, such as a system prompt: [`shared_header`]) is
    /// weak evidence, and the policies route such a prompt by load
    /// ([`RouteInput::useful_blocks`]). `false`: every match counts
    /// (before issue 38). Default true.
    pub shared_headers: bool,
}

impl Default for PrefixParams {
    fn default() -> Self {
        Self {
            source: PrefixSource::Estimate,
            confirm_window_secs: 2,
            shared_headers: true,
        }
    }
}

impl PrefixParams {
    /// Checks the ranges; the error names the field, its value and the reason.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        in_range(
            "confirm_window_secs",
            self.confirm_window_secs,
            1,
            60,
            "seconds the gateway's own entries count before an engine confirms them",
        )
    }
}

/// The gateway queue in which the policies that hold requests
/// (`selective_push`, `dual_map`) keep them while their servers are full.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueParams {
    /// Requests that may wait at the gateway, all dispatchers together
    /// (each dispatcher holds its share, rounded up). One more is refused
    /// with 503 and `Retry-After`. Default 1024; 1 to 1 000 000.
    pub capacity: u64,
    /// A request waiting longer than this is answered 503. Default 60 000
    /// (1 minute); 1 ms to 1 hour.
    pub max_wait_ms: u64,
    /// How often queued requests are looked at again without a local
    /// signal, to see servers freed by other dispatchers or new scrapes.
    /// A request starting or ending through this dispatcher wakes the queue
    /// at once. Default 5; 1 to 1000.
    pub recheck_ms: u64,
    /// Among the waiting requests of a class, the tenant that has received
    /// the least service goes first ([`crate::tenancy::fair_share`]); `false`:
    /// oldest first. Default true.
    pub fair_share: bool,
    /// A batch request that has waited this long goes before interactive
    /// ones (the starvation bound). Default 10 000; 1 ms to 1 hour.
    pub batch_max_delay_ms: u64,
}

impl Default for QueueParams {
    fn default() -> Self {
        Self {
            capacity: 1024,
            max_wait_ms: 60_000,
            recheck_ms: 5,
            fair_share: true,
            batch_max_delay_ms: 10_000,
        }
    }
}

impl QueueParams {
    /// Checks the ranges; the error names the field, its value and the reason.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        in_range(
            "capacity",
            self.capacity,
            1,
            1_000_000,
            "requests waiting at the gateway",
        )?;
        in_range(
            "max_wait_ms",
            self.max_wait_ms,
            1,
            3_600_000,
            "milliseconds a request may wait",
        )?;
        in_range(
            "recheck_ms",
            self.recheck_ms,
            1,
            1000,
            "milliseconds between looks at the queue",
        )?;
        in_range(
            "batch_max_delay_ms",
            self.batch_max_delay_ms,
            1,
            3_600_000,
            "milliseconds a batch request waits behind interactive ones",
        )
    }
}

/// `Ok` when `lo <= value <= hi`, else the error `name = value: must be
/// between lo and hi (what)`.
pub(crate) fn in_range(name: &str, value: u64, lo: u64, hi: u64, what: &str) -> Result<(), InvalidParam> {
    between(name, value, (lo..=hi).contains(&value), (lo, hi), what)
}

/// `Ok` when `value` is finite and `lo <= value <= hi`, else the error
/// `name = value: must be between lo and hi (what)`.
pub(crate) fn in_range_f64(name: &str, value: f64, lo: f64, hi: f64, what: &str) -> Result<(), InvalidParam> {
    between(
        name,
        value,
        value.is_finite() && (lo..=hi).contains(&value),
        (lo, hi),
        what,
    )
}

/// `Ok` when `inside`, else `name = value: must be between lo and hi (what)`.
fn between<T: fmt::Display>(
    name: &str,
    value: T,
    inside: bool,
    (lo, hi): (T, T),
    what: &str,
) -> Result<(), InvalidParam> {
    if inside {
        Ok(())
    } else {
        Err(InvalidParam::new(
            name,
            value,
            format!("must be between {lo} and {hi} ({what})"),
        ))
    }
}

/// A policy parameter that is out of its bounds: which one, its value and
/// why, as the configuration reports it (`ConfigError::Invalid` takes
/// the three fields as they are, with `policy.` before the field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value}: {reason}")]
pub struct InvalidParam {
    /// The key, relative to the table validated (`cache_aware.cache_threshold`).
    pub field: String,
    /// The value, as TOML would write it.
    pub value: String,
    /// Why it is refused.
    pub reason: String,
}

impl InvalidParam {
    /// `field = value` is refused for `reason`.
    pub fn new(field: impl Into<String>, value: impl fmt::Display, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// The same error seen from the enclosing table `table`: `table.field`.
    pub fn within(mut self, table: &str) -> Self {
        self.field = format!("{table}.{}", self.field);
        self
    }
}

/// The policy `config` describes, ready to route (validate `config` first).
pub fn build(config: &PolicyConfig) -> Box<dyn Policy> {
    match config.kind {
        PolicyKind::CacheAware => Box::new(cache_aware::CacheAware::new(config.cache_aware)),
        PolicyKind::LeastLoad => Box::new(least_load::LeastLoad::new()),
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::new()),
        PolicyKind::Random => Box::new(random::Random::new()),
        PolicyKind::SelectivePush => Box::new(selective_push::SelectivePush::new(config.selective_push)),
        PolicyKind::ConsistentHash => Box::new(consistent_hash::ConsistentHash::new(config.consistent_hash.clone())),
        PolicyKind::DualMap => Box::new(dual_map::DualMap::new(config.dual_map)),
        PolicyKind::WeightedScorers => Box::new(weighted_scorers::WeightedScorers::new(config.weighted_scorers)),
        PolicyKind::Cost => Box::new(cost::Cost::new(config.cost)),
    }
}
