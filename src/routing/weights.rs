//! Engines of unequal capacity (`[[backend]] weight`, an endpoints file's
//! `weight`, the admin API's): each registration carries its weight
//! ([`shm_layout::EngineSettings::weight`]), read into
//! [`Candidate::weight`], and every rule that compares loads compares
//! them per unit of weight ([`Candidate::per_weight`]), in fixed point
//! ([`LOAD_UNIT`]) so that with every weight 1 each comparison is the one
//! on the loads themselves. The in-turn and random policies draw
//! [`by_weight`]. The hash rings' arcs are not weighted (a key keeps its
//! place on the ring); their load bound is (`load_bound`).

use super::Candidate;

/// A load per unit of weight is counted in these: the load of one request
/// on a server of weight 1. Divisible by every weight up to 16, so small
/// weights compare exactly.
pub const LOAD_UNIT: u64 = 720_720;

impl Candidate {
    /// `load` (requests, tokens) of this server per unit of its weight, in
    /// [`LOAD_UNIT`]s: what the balancing rules compare, so a server of
    /// weight 2 is as busy with 4 requests as one of weight 1 with 2 (and
    /// with every weight 1, the loads themselves, scaled).
    #[inline]
    pub fn per_weight(&self, load: u64) -> u64 {
        load.saturating_mul(LOAD_UNIT) / u64::from(self.weight.max(1))
    }

    /// Requests in flight per unit of weight ([`Self::per_weight`]).
    #[inline]
    pub fn weighted_inflight(&self) -> u64 {
        self.per_weight(self.inflight)
    }
}

/// The candidate that `draw` (below the candidates' total weight) lands
/// on when each takes as many consecutive draws as its weight: with every
/// weight 1, `candidates[draw]`. `None` when `candidates` is empty.
pub(crate) fn by_weight(candidates: &[Candidate], draw: u64) -> Option<&Candidate> {
    let mut left = draw;
    for c in candidates {
        let w = u64::from(c.weight.max(1));
        if left < w {
            return Some(c);
        }
        left -= w;
    }
    candidates.last()
}

/// The candidates' total weight.
pub(crate) fn total_weight(candidates: &[Candidate]) -> u64 {
    candidates.iter().map(|c| u64::from(c.weight.max(1))).sum()
}
