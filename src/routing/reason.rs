//! [`Reason`]: why a policy (or the proxy) chose a server, as logs, the
//! `x-semlb-route` header and the policies' tests name it.

use std::fmt;

use super::weight_bandit;

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
    /// Its session key: its place on the hash ring (`consistent_hash`),
    /// or its session's engine ([`affinity`](super::affinity)).
    Session,
    /// The engine that stored the response the request continues
    /// ([`affinity`](super::affinity)).
    StoredResponse,
    /// One of the request's two hash candidates (1 or 2), for its cache
    /// match of `blocks` blocks.
    HashCandidate {
        /// Which candidate.
        candidate: u8,
        /// Blocks it holds.
        blocks: u32,
    },
    /// The other hash candidate: the better-matching one would break the
    /// TTFT SLO.
    Slo,
    /// Moved off a full hash candidate to the other one, whose estimated
    /// TTFT is lower.
    Rebalanced,
    /// The best combined score, in thousandths.
    Scored {
        /// Score × 1000.
        permille: u16,
    },
    /// The engine whose stream broke with an error event, asked first to
    /// continue the answer: it is alive, and its cache holds the prompt
    /// and the text so far ([`crate::dispatcher`]'s resumption).
    SameEngine,
    /// The lowest cost, at the weight of the tuner's `arm`
    /// ([`weight_bandit::weight_of`]; `None` when the weight is fixed, or
    /// when the request is in the washout of an epoch that switched arms).
    Cost {
        /// The arm whose weight routed the request: its answer's TTFT is
        /// that arm's evidence ([`Policy::observe`](super::Policy::observe)).
        arm: Option<u8>,
    },
}

impl Reason {
    /// Its name in logs and the `x-semlb-route` header.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Prefix { .. } => "prefix",
            Self::LeastLoad => "least_load",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
            Self::Session => "session",
            Self::StoredResponse => "stored_response",
            Self::SameEngine => "same_engine",
            Self::HashCandidate { .. } => "hash_candidate",
            Self::Slo => "slo",
            Self::Rebalanced => "rebalanced",
            Self::Scored { .. } => "scored",
            Self::Cost { .. } => "cost",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Prefix { blocks } => write!(f, "prefix match of {blocks} blocks"),
            Self::LeastLoad => f.write_str("least load"),
            Self::RoundRobin => f.write_str("round robin"),
            Self::Random => f.write_str("random"),
            Self::Session => f.write_str("its session key"),
            Self::StoredResponse => f.write_str("the engine that stored the response it continues"),
            Self::SameEngine => f.write_str("the engine that streamed the answer so far, after its error event"),
            Self::HashCandidate { candidate, blocks } => {
                write!(f, "hash candidate {candidate} with {blocks} blocks cached")
            }
            Self::Slo => f.write_str("the other hash candidate: the better match would break the TTFT SLO"),
            Self::Rebalanced => f.write_str("rebalanced off a full hash candidate"),
            Self::Scored { permille } => write!(f, "best weighted score {}.{:03}", permille / 1000, permille % 1000),
            Self::Cost { arm: None } => f.write_str("lowest cost"),
            Self::Cost { arm: Some(arm) } => {
                write!(f, "lowest cost at weight {}", weight_bandit::weight_of(arm))
            }
        }
    }
}
