//! `round_robin`: the candidates in turn.
//!
//! # Rule
//!
//! An atomic counter advances by one per request; the request goes to
//! candidate `counter % candidates.len()`. Candidates come in server-table
//! slot order ([`super::live_candidates`]), so with a stable set of servers
//! each one gets every `n`-th request; when a server goes down or comes up
//! the rotation continues over the new list from wherever the counter is.
//!
//! The counter is **per process**: every dispatcher process rotates on its
//! own, starting at the first server. Over many requests each server still
//! gets an equal share from every dispatcher, but the gateway as a whole is
//! not a strict global rotation (two dispatchers may send their next
//! requests to the same server). A shared counter in shm would make it one,
//! at the price of a contended cache line on every request, for a policy
//! that ignores load and cache anyway; SGLang's `round_robin` is likewise a
//! counter local to its router.
//!
//! A server of weight `w` (`[[backend]] weight`) takes `w` turns in a row
//! per round. Prefix matches and load are ignored. Choosing never
//! allocates.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Choice, Policy, Reason, RouteInput};

/// Sends the requests to the candidates in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    /// Requests routed by this policy (in this process), wrapping.
    next: AtomicU64,
}

impl RoundRobin {
    /// A new policy whose first request goes to the first candidate.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        let total = super::total_weight(input.candidates);
        if total == 0 {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % total;
        Some(Choice {
            server: super::by_weight(input.candidates, turn)?.server,
            reason: Reason::RoundRobin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand, choice, input};
    use shm_layout::PrefixMatch;

    #[test]
    fn empty_candidates_choose_nothing_and_do_not_advance() {
        let p = RoundRobin::new();
        assert_eq!(p.choose(&input(0, &PrefixMatch::default(), &[])), None);
        assert_eq!(p.next.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn cycles_through_the_candidates_in_order() {
        let f = Fixture::new(3);
        // Load and prefix are ignored: s[0] is busy and s[2] holds the prompt.
        let chain = Fixture::chain(1, 4);
        f.hold(2, &chain);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 100, 100), cand(f.s[1], 0, 0), cand(f.s[2], 0, 0)];
        let p = RoundRobin::new();
        let got: Vec<_> = (0..7).map(|_| p.choose(&input(4, &m, &cands)).unwrap()).collect();
        let want: Vec<_> = [0, 1, 2, 0, 1, 2, 0]
            .iter()
            .map(|i| choice(f.s[*i], Reason::RoundRobin))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn follows_a_changing_candidate_list() {
        let f = Fixture::new(3);
        let p = RoundRobin::new();
        let all = [cand(f.s[0], 0, 0), cand(f.s[1], 0, 0), cand(f.s[2], 0, 0)];
        let m = PrefixMatch::default();
        assert_eq!(p.choose(&input(1, &m, &all)).unwrap().server, f.s[0]);
        assert_eq!(p.choose(&input(1, &m, &all)).unwrap().server, f.s[1]);
        // s[1] went down: the rotation continues over the two left.
        let two = [all[0], all[2]];
        let got: Vec<_> = (0..4).map(|_| p.choose(&input(1, &m, &two)).unwrap().server).collect();
        assert_eq!(got, [f.s[0], f.s[2], f.s[0], f.s[2]]);
    }

    #[test]
    fn counter_wraps_without_panicking() {
        let f = Fixture::new(3);
        let p = RoundRobin::new();
        p.next.store(u64::MAX, Ordering::Relaxed);
        let cands = [cand(f.s[0], 0, 0), cand(f.s[1], 0, 0), cand(f.s[2], 0, 0)];
        let m = PrefixMatch::default();
        // u64::MAX % 3 == 0, then the counter wraps to 0.
        assert_eq!(p.choose(&input(1, &m, &cands)).unwrap().server, f.s[0]);
        assert_eq!(p.choose(&input(1, &m, &cands)).unwrap().server, f.s[0]);
        assert_eq!(p.choose(&input(1, &m, &cands)).unwrap().server, f.s[1]);
    }
}
