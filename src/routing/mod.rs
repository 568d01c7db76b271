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
//! | `cache_aware` (default) | [`cache_aware`] | SGLang's router: longest prefix match above a threshold unless the load is imbalanced; else least load |
//! | `least_load` | [`least_load`] | fewest requests in flight |
//! | `round_robin` | [`round_robin`] | in turn |
//! | `random` | [`random`] | uniformly at random |

pub mod cache_aware;
pub mod least_load;
pub mod random;
pub mod round_robin;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use shm_layout::{LoadFigures, PrefixMatch, ServerRef, ServerState, Tables};

pub use cache_aware::CacheAwareParams;

/// One server a request may go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The registration (slot and generation).
    pub server: ServerRef,
    /// Requests in flight to it through the gateway (all dispatchers).
    pub inflight: u64,
    /// Prompt tokens of those requests.
    pub inflight_tokens: u64,
    /// Its last scraped engine load (zeros until scraped).
    pub load: LoadFigures,
}

/// What a policy sees for one request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    /// Full blocks in the prompt's chain (the denominator of the match ratio).
    pub prompt_blocks: u32,
    /// Which servers hold how many leading blocks (only live servers).
    pub prefix: &'a PrefixMatch,
    /// The servers that may take the request; never empty when a policy is asked.
    pub candidates: &'a [Candidate],
}

/// Why a server was chosen (logged, counted, and shown in debug headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds `blocks` leading blocks of the prompt.
    Prefix {
        /// Blocks matched.
        blocks: u32,
    },
    /// It had the least load.
    LeastLoad,
    /// Its turn.
    RoundRobin,
    /// Drawn at random.
    Random,
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

    /// Chooses a server, or `None` when there are no candidates.
    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice>;
}

/// Fills `out` with the servers in state `Up`, with their shared load.
pub fn live_candidates(tables: &Tables<'_>, out: &mut Vec<Candidate>) {
    out.clear();
    let servers = &tables.servers;
    for slot in 0..servers.capacity() as u16 {
        if let Some((server, ServerState::Up)) = servers.current(slot) {
            let (inflight, inflight_tokens) = servers.inflight(server);
            out.push(Candidate {
                server,
                inflight,
                inflight_tokens,
                load: servers.load(server),
            });
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
}

impl PolicyKind {
    /// Every policy, in documentation order.
    pub const ALL: [Self; 4] = [Self::CacheAware, Self::LeastLoad, Self::RoundRobin, Self::Random];

    /// The name in configuration, on the command line and in metrics (the
    /// built policy's [`Policy::name`]).
    pub const fn name(self) -> &'static str {
        match self {
            Self::CacheAware => "cache_aware",
            Self::LeastLoad => "least_load",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!("unknown routing policy {s:?}: expected one of cache_aware, least_load, round_robin, random")
        })
    }
}

/// Routing configuration: the policy and its parameters. Every field has a
/// default, so an empty table is the default configuration; unknown fields
/// are errors.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// The policy: `cache_aware` (default), `least_load`, `round_robin` or
    /// `random`.
    pub kind: PolicyKind,
    /// Thresholds of the `cache_aware` policy (SGLang's defaults: 0.5, 32,
    /// 1.1). Validated whatever `kind` is, so a typo does not wait for the
    /// day the policy is switched.
    pub cache_aware: CacheAwareParams,
}

impl PolicyConfig {
    /// Checks every parameter. The error names the field (relative to this
    /// table, e.g. `cache_aware.cache_threshold`), its value and the reason.
    pub fn validate(&self) -> Result<(), String> {
        self.cache_aware.validate().map_err(|e| format!("cache_aware.{e}"))
    }
}

/// The policy `config` describes, ready to route (validate `config` first).
pub fn build(config: &PolicyConfig) -> Box<dyn Policy> {
    match config.kind {
        PolicyKind::CacheAware => Box::new(cache_aware::CacheAware::new(config.cache_aware)),
        PolicyKind::LeastLoad => Box::new(least_load::LeastLoad::new()),
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::new()),
        PolicyKind::Random => Box::new(random::Random::new()),
    }
}
