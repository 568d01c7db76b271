//! `least_load`: the server with the fewest requests in flight.
//!
//! # Rule
//!
//! Load is [`Candidate::inflight`] (per unit of the server's weight,
//! [`Candidate::per_weight`]): the requests in flight to the server
//! through every dispatcher of the gateway, read from the shm server table
//! at routing time. It is exact and current (a dispatcher counts a request
//! before proxying it and uncounts it when the response ends), unlike the
//! engine figures a scraper stores in [`Candidate::load`], which are up to
//! one scrape interval old and zero until the first scrape. SGLang's router
//! balances on the same quantity: the requests it has in flight to each
//! worker.
//!
//! Ties are broken by
//!
//! 1. fewest in-flight requests,
//! 2. then the least prefill work in flight ([`Candidate::inflight_tokens`],
//!    the uncached prompt tokens: a server busy with one long new prompt
//!    is busier than one with a short one, or with a conversation's next
//!    turn whose history it holds),
//! 3. then in turn: a per-policy counter picks among the servers still tied,
//!    so equal servers share the requests instead of the first slot taking
//!    every one of them (which is what a plain `min_by_key` would do when
//!    all servers are idle, e.g. under a burst that arrives before any
//!    in-flight count moves).
//!
//! The same rule is the fallback of [`super::cache_aware`]. Choosing never
//! allocates: two passes over the candidates and at most one atomic add.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Candidate, Choice, Policy, Reason, RouteInput};

/// The load key least-load ordering compares: in-flight requests, then
/// in-flight prompt tokens, each per unit of the server's weight.
#[inline]
pub(crate) fn load_key(c: &Candidate) -> (u64, u64) {
    (c.weighted_inflight(), c.per_weight(c.inflight_tokens))
}

/// The least-loaded candidate (see the [module docs](self) for the
/// tie-break); `turn` is the rotating counter among equals. `None` only
/// when `candidates` is empty.
pub(crate) fn least_loaded<'c>(candidates: &'c [Candidate], turn: &AtomicU64) -> Option<&'c Candidate> {
    least_loaded_where(candidates, |_| true, turn)
}

/// [`least_loaded`] among the candidates `keep` accepts; `None` when it
/// accepts none.
pub(crate) fn least_loaded_where<'c>(
    candidates: &'c [Candidate],
    keep: impl Fn(&Candidate) -> bool,
    turn: &AtomicU64,
) -> Option<&'c Candidate> {
    least_by(candidates, load_key, keep, turn)
}

/// The candidate `keep` accepts with the smallest `key`, in turn among
/// equals (`turn` rotates); `None` when `keep` accepts none.
pub(crate) fn least_by<'c, K: Ord + Copy>(
    candidates: &'c [Candidate],
    key: impl Fn(&Candidate) -> K,
    keep: impl Fn(&Candidate) -> bool,
    turn: &AtomicU64,
) -> Option<&'c Candidate> {
    // Pass 1: the smallest key and how many candidates share it.
    let mut min = None;
    let mut ties = 0u64;
    for c in candidates.iter().filter(|c| keep(c)) {
        let k = key(c);
        match min {
            Some(m) if k > m => {}
            Some(m) if k == m => ties += 1,
            _ => {
                min = Some(k);
                ties = 1;
            }
        }
    }
    let min = min?;
    // Pass 2: the n-th of the tied candidates, n rotating.
    let n = if ties > 1 {
        turn.fetch_add(1, Ordering::Relaxed) % ties
    } else {
        0
    };
    candidates.iter().filter(|c| keep(c) && key(c) == min).nth(n as usize)
}

/// Sends each request to the server with the fewest requests in flight.
#[derive(Debug, Default)]
pub struct LeastLoad {
    /// Rotates among servers tied for least load.
    turn: AtomicU64,
}

impl LeastLoad {
    /// A new policy (its tie-break rotation starts at the first tied server).
    pub fn new() -> Self {
        Self::default()
    }
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        least_loaded(input.candidates, &self.turn).map(|c| Choice {
            server: c.server,
            reason: Reason::LeastLoad,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand, choice, input};
    use shm_layout::PrefixMatch;

    #[test]
    fn empty_candidates_choose_nothing() {
        let p = LeastLoad::new();
        assert_eq!(p.choose(&input(0, &PrefixMatch::default(), &[])), None);
    }

    #[test]
    fn fewest_inflight_wins() {
        let f = Fixture::new(3);
        let cands = [cand(f.s[0], 5, 10), cand(f.s[1], 2, 900), cand(f.s[2], 7, 0)];
        let p = LeastLoad::new();
        for _ in 0..5 {
            let c = p.choose(&input(4, &PrefixMatch::default(), &cands)).unwrap();
            assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
        }
    }

    #[test]
    fn equal_inflight_breaks_on_tokens() {
        let f = Fixture::new(3);
        let cands = [cand(f.s[0], 2, 300), cand(f.s[1], 2, 100), cand(f.s[2], 2, 200)];
        let p = LeastLoad::new();
        for _ in 0..5 {
            assert_eq!(
                p.choose(&input(4, &PrefixMatch::default(), &cands)).unwrap().server,
                f.s[1]
            );
        }
    }

    #[test]
    fn full_ties_rotate_over_the_tied_servers_only() {
        let f = Fixture::new(4);
        // s[2] is busier; the other three are tied.
        let cands = [
            cand(f.s[0], 1, 8),
            cand(f.s[1], 1, 8),
            cand(f.s[2], 2, 8),
            cand(f.s[3], 1, 8),
        ];
        let p = LeastLoad::new();
        let mut counts = [0usize; 4];
        for _ in 0..30 {
            let s = p.choose(&input(4, &PrefixMatch::default(), &cands)).unwrap().server;
            counts[f.s.iter().position(|x| *x == s).unwrap()] += 1;
        }
        assert_eq!(counts, [10, 10, 0, 10]);
    }

    #[test]
    fn single_candidate_does_not_touch_the_counter() {
        let f = Fixture::new(1);
        let p = LeastLoad::new();
        let cands = [cand(f.s[0], 3, 3)];
        assert_eq!(
            p.choose(&input(1, &PrefixMatch::default(), &cands)).unwrap().server,
            f.s[0]
        );
        assert_eq!(p.turn.load(Ordering::Relaxed), 0);
    }
}
