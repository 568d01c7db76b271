//! Bounded load (Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing
//! with Bounded Loads", 2018): a server may take a request only while that
//! keeps it at or under `ceil((1 + ε) × (requests in flight + 1) / servers)`
//! (a server of weight `w`: `ceil((1 + ε) × (requests in flight + 1) × w /
//! the servers' weights)`, its weighted share).
//!
//! A policy that prefers a server for its cache or its session
//! (`consistent_hash`, `cost`) skips the servers over the bound, so no
//! preference, however strong, piles the traffic on one engine: a server
//! carries at most `1 + ε` times its share. The least loaded server is
//! always under the bound, even with `ε = 0`: with `t` in flight over `n`
//! servers it carries at most `floor(t / n)`, and the bound is at least
//! one more.

use super::{Candidate, InvalidParam, in_range_f64};

/// The most requests in flight a server of weight 1 may reach by taking
/// one more (a server of weight `w`: `w` times as many, its share).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LoadBound(f64);

impl LoadBound {
    /// The bound over `candidates` (not empty) with slack `epsilon`.
    pub(crate) fn over(candidates: &[Candidate], epsilon: f64) -> Self {
        let total: u64 = candidates.iter().map(|c| c.inflight).sum();
        let weights: u64 = candidates.iter().map(|c| u64::from(c.weight.max(1))).sum();
        let share = (total + 1) as f64 / weights.max(1) as f64;
        Self((1.0 + epsilon) * share)
    }

    /// Checks a policy's `load_epsilon` (0 to 100).
    pub(crate) fn check_epsilon(epsilon: f64) -> Result<(), InvalidParam> {
        in_range_f64("load_epsilon", epsilon, 0.0, 100.0, "slack over the average load")
    }

    /// Whether `c` may take one more request.
    pub(crate) fn admits(self, c: &Candidate) -> bool {
        c.inflight < (self.0 * f64::from(c.weight.max(1))).ceil() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand};

    #[test]
    fn a_server_takes_at_most_one_plus_epsilon_times_its_share() {
        let f = Fixture::new(3);
        // 10 + 1 + 1 in flight, one more: ceil(1.25 × 13 / 3) = 6.
        let cands = [cand(f.s[0], 10, 0), cand(f.s[1], 1, 0), cand(f.s[2], 1, 0)];
        let bound = LoadBound::over(&cands, 0.25);
        assert_eq!(bound, LoadBound((1.0 + 0.25) * (13.0 / 3.0)));
        assert!(!bound.admits(&cands[0]));
        assert!(bound.admits(&cands[1]));
        // Five in flight may take a sixth; six may not.
        assert!(bound.admits(&cand(f.s[0], 5, 0)));
        assert!(!bound.admits(&cand(f.s[0], 6, 0)));
    }

    #[test]
    fn a_server_of_weight_w_takes_w_shares() {
        let f = Fixture::new(3);
        let weighted = |i: usize, inflight: u64, weight: u32| Candidate {
            weight,
            ..cand(f.s[i], inflight, 0)
        };
        // 11 in flight, one more, weights 1 + 2 + 1: a share of 3 per unit.
        let cands = [weighted(0, 3, 1), weighted(1, 5, 2), weighted(2, 3, 1)];
        let bound = LoadBound::over(&cands, 0.0);
        assert!(!bound.admits(&cands[0]), "3 of a bound of 3");
        assert!(bound.admits(&cands[1]), "5 of a bound of 6");
        assert!(!bound.admits(&weighted(1, 6, 2)));
    }

    #[test]
    fn the_least_loaded_server_is_always_under_the_bound() {
        let f = Fixture::new(3);
        for loads in [[0, 0, 0], [2, 2, 2], [1, 2, 2], [7, 0, 9], [5, 5, 6]] {
            let cands = loads.map(|n| cand(f.s[0], n, 0));
            let bound = LoadBound::over(&cands, 0.0);
            let least = cands.iter().min_by_key(|c| c.inflight).unwrap();
            assert!(bound.admits(least), "{loads:?}");
        }
        // No slack: 1 and 2 in flight, one more: ceil(4 / 2) = 2.
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 2, 0)];
        let bound = LoadBound::over(&cands, 0.0);
        assert!(bound.admits(&cands[0]) && !bound.admits(&cands[1]));
    }
}
