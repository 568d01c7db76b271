//! The decode engine of a request in a pool with prefill engines: by
//! load, with the prompt the engine already holds as the tie-breaker.
//!
//! # Rule
//!
//! 1. The candidates (engines that decode) whose requests in flight are
//!    within [`LOAD_SLACK`] of the least loaded one's: a decode engine's
//!    work is its running requests, and one much busier than another is
//!    not chosen for its cache.
//! 2. Among them, the one holding the most leading blocks of the prompt
//!    (past the shared header): a vLLM decode engine pulls only the blocks
//!    it lacks, and one that holds all but `pd.bypass_uncached_tokens` of
//!    the prompt takes the request without a prefill leg (a conversation's
//!    next turn, on the engine that decoded the last one).
//! 3. Then least load ([`super::least_load::load_key`]), then in turn.
//!
//! A pool's own policy chooses its prefill engines (where the prompt is
//! warm, under its load rule); this rule replaces it for the decode side
//! only.

use std::cmp::Reverse;
use std::sync::atomic::AtomicU64;

use super::least_load::{least_by, load_key};
use super::{Candidate, Choice, LOAD_UNIT, Reason, RouteInput};

/// Requests in flight by which a decode engine may exceed the least
/// loaded one and still be chosen for the prompt it holds.
pub const LOAD_SLACK: u64 = 2;

/// Rotates among decode engines tied on every count.
static TURN: AtomicU64 = AtomicU64::new(0);

/// The decode engine for `input` (see the [module docs](self)); `None`
/// only without candidates.
pub fn choose(input: &RouteInput<'_>) -> Option<Choice> {
    let least = input.candidates.iter().map(Candidate::weighted_inflight).min()?;
    let chosen = least_by(
        input.candidates,
        |c| (Reverse(input.useful_blocks(c.server.tag())), load_key(c)),
        |c| c.weighted_inflight() <= least + LOAD_SLACK * LOAD_UNIT,
        &TURN,
    )?;
    let blocks = input.useful_blocks(chosen.server.tag());
    Some(Choice {
        server: chosen.server,
        reason: if blocks > 0 {
            Reason::Prefix { blocks }
        } else {
            Reason::LeastLoad
        },
    })
}

#[cfg(test)]
mod tests {
    use shm_layout::PrefixMatch;

    use super::*;
    use crate::routing::test_support::{Fixture, cand, input};

    #[test]
    fn the_engine_holding_the_prompt_wins_within_the_slack() {
        let f = Fixture::new(3);
        let mut prefix = PrefixMatch::default();
        prefix.add(f.s[2].tag(), 6);
        // s[2] holds the prompt, two more requests than the least loaded.
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 2, 0), cand(f.s[2], 3, 0)];
        let c = choose(&input(8, &prefix, &cands)).unwrap();
        assert_eq!((c.server, c.reason), (f.s[2], Reason::Prefix { blocks: 6 }));
        // Three more: past the slack, load decides.
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 2, 0), cand(f.s[2], 4, 0)];
        let c = choose(&input(8, &prefix, &cands)).unwrap();
        assert_eq!((c.server, c.reason), (f.s[0], Reason::LeastLoad));
    }

    #[test]
    fn without_a_prefix_the_least_loaded_wins_and_ties_rotate() {
        let f = Fixture::new(3);
        let prefix = PrefixMatch::default();
        let cands = [cand(f.s[0], 2, 50), cand(f.s[1], 2, 10), cand(f.s[2], 2, 10)];
        let mut seen = std::collections::HashSet::new();
        for _ in 0..6 {
            let c = choose(&input(8, &prefix, &cands)).unwrap();
            assert_ne!(c.server, f.s[0], "fewer prompt tokens in flight elsewhere");
            seen.insert(c.server);
        }
        assert_eq!(seen.len(), 2);
        assert!(choose(&input(8, &prefix, &[])).is_none());
    }
}
