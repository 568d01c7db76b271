//! `cache_aware` (the default): SGLang's cache-aware routing on semlb's
//! shared tables.
//!
//! SGLang's router (`sgl-model-gateway`, `policies/cache_aware.rs`) keeps a
//! radix tree of the text it sent to each worker and routes a request to the
//! worker whose tree matches most of it, unless the load is out of balance.
//! semlb has the same information without a tree: the shm prefix table says,
//! per live server, how many leading token blocks of the prompt it holds
//! ([`shm_layout::PrefixMatch`]), and the server table counts the requests
//! in flight to each server through every dispatcher.
//!
//! # Rule
//!
//! With `load` = [`Candidate::inflight`], `min`/`max` the least/greatest
//! load over the candidates, and
//! `overloaded(x) = x - min > balance_abs_threshold && x > balance_rel_threshold × min`:
//!
//! 1. **Imbalanced system** — `overloaded(max)`, both conditions, as SGLang
//!    checks them: least load ([`Reason::LeastLoad`]). The absolute
//!    threshold is scaled to engines that said how many requests they run
//!    at once (see [Engine slots](#engine-slots)).
//! 2. **Prompt shorter than one block** (`prompt_blocks == 0`): nothing to
//!    match; least load.
//! 3. **Prefix winner**: the candidate holding the most leading blocks.
//!    Entries of the match for servers that are not candidates (gone down,
//!    draining, re-registered since the lookup) are ignored; among
//!    candidates with equally many blocks the less loaded wins (fewer
//!    in-flight requests, then tokens), then the one the match lists first
//!    (the most recently refreshed). If its ratio
//!    `blocks / prompt_blocks > cache_threshold` (strictly, as in SGLang)
//!    and it is not `overloaded` itself, it gets the request
//!    ([`Reason::Prefix`]).
//! 4. Otherwise least load.
//!
//! Least load is [`super::least_load`]'s rule: fewest in-flight requests,
//! then fewest in-flight prompt tokens, then in turn among exact ties (a
//! counter), so idle servers share a burst. SGLang's current gateway also
//! sends cache misses to the least-loaded worker, breaking ties at random
//! (its first router sent them to the worker with the smallest tree).
//!
//! The winner's own overload check (step 3) is the per-server guard the
//! design asks for. With the thresholds shared with step 1 it never fires on
//! its own: `overloaded` grows with its argument and the winner's load is at
//! most `max`, so an overloaded winner implies an imbalanced system, which
//! step 1 already routed by load. It costs one comparison and keeps the
//! winner guarded should the two checks ever be given separate thresholds.
//!
//! # Load
//!
//! Load is the gateway-wide count of requests in flight, not the scraped
//! engine figures ([`Candidate::load`]: `waiting`, `running`). The count is
//! exact and current — every dispatcher increments it in shm before
//! proxying and decrements it when the response ends, so a burst shows up
//! request by request — while scraped figures are one scrape interval old
//! (zero before the first scrape) and would let a burst pile onto the
//! server that looked idle at the last scrape. It is also what SGLang
//! balances on (`Worker::load()`, the router's own in-flight count). What
//! the count misses is load from clients that bypass the gateway.
//!
//! # Engine slots
//!
//! SGLang's absolute threshold of 32 requests is sized for engines that run
//! hundreds of sequences at once (vLLM's default `max_num_seqs` is 256: 32
//! is an eighth of it). An engine that said how many requests it runs at
//! once ([`Candidate::admission_reported`]: llama.cpp's slots, from
//! `/props`) is full long before that: two-slot engines never differ by 32
//! requests in flight, so the system never counts as imbalanced and
//! conversations pile up on whichever engine first held their system
//! prompt (measured with two llama.cpp engines: 27 % fewer requests per
//! second than `least_load`, 1.8× its TTFT p90). So with
//! `scale_to_engine_slots` (the default), when some candidates reported
//! their slots, the absolute threshold is at most an eighth of the fewest
//! reported slots, rounded up: 1 for engines of up to 8 slots, 4 for 32,
//! and `balance_abs_threshold` unchanged from 256 slots on. Limits the
//! gateway only learned are estimates and scale nothing.
//!
//! # Parameters
//!
//! [`CacheAwareParams`] defaults are those of SGLang's library
//! `CacheAwareConfig::default()`: `cache_threshold = 0.5`,
//! `balance_abs_threshold = 32`, `balance_rel_threshold = 1.1`. (SGLang's
//! command line defaults differ: `--cache-threshold 0.3
//! --balance-abs-threshold 64 --balance-rel-threshold 1.5`.)
//!
//! Choosing never allocates: a handful of passes over the candidates and
//! the (at most 8) match entries, and at most one atomic add.

use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};

use super::least_load::least_loaded;
use super::{Candidate, Choice, InvalidParam, Policy, Reason, RouteInput, best_prefix};

/// Tuning of the [`CacheAware`] policy (SGLang's `CacheAwareConfig`
/// thresholds; see the [module docs](self) for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareParams {
    /// Fraction of the prompt's blocks (0.0–1.0) the best-matching server
    /// must hold, strictly more than, to get the request for its cache.
    /// 0.0 = any matched block counts; 1.0 = never route by prefix.
    /// Default 0.5 (SGLang's library default; its CLI uses 0.3).
    pub cache_threshold: f64,
    /// Absolute load spread: the system is imbalanced only if the busiest
    /// server has more than this many requests in flight above the least
    /// busy one. Default 32 (SGLang's library default; its CLI uses 64).
    pub balance_abs_threshold: u64,
    /// Relative load spread (>= 1.0): the system is imbalanced only if the
    /// busiest server also has more than this multiple of the least busy
    /// one's requests in flight. Default 1.1 (SGLang's library default; its
    /// CLI uses 1.5).
    pub balance_rel_threshold: f64,
    /// Where engines reported how many requests they run at once, cap
    /// `balance_abs_threshold` at an eighth of the fewest reported (at
    /// least 1; see the [module docs](self#engine-slots)). Default true.
    pub scale_to_engine_slots: bool,
}

/// Engine slots per request of absolute load spread when the threshold is
/// scaled (SGLang's 32 of vLLM's 256 sequences).
pub const SLOTS_PER_ABS_THRESHOLD: u32 = 8;

impl Default for CacheAwareParams {
    fn default() -> Self {
        Self {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.1,
            scale_to_engine_slots: true,
        }
    }
}

impl CacheAwareParams {
    /// Checks the ranges; the error names the field, its value and the
    /// reason (`cache_threshold = 1.5: must be ...`).
    pub fn validate(&self) -> Result<(), InvalidParam> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(InvalidParam::new(
                "cache_threshold",
                self.cache_threshold,
                "must be between 0.0 and 1.0 (the fraction of the prompt's blocks a server must hold)",
            ));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 1.0) {
            return Err(InvalidParam::new(
                "balance_rel_threshold",
                self.balance_rel_threshold,
                "must be a finite number >= 1.0 (a ratio of the busiest to the least busy server's load)",
            ));
        }
        Ok(())
    }

    /// The absolute threshold among `candidates`: `balance_abs_threshold`,
    /// capped at `⌈slots / 8⌉` (at least 1) for the fewest slots a
    /// candidate's engine reported, when `scale_to_engine_slots`.
    #[inline]
    pub fn abs_threshold(&self, candidates: &[Candidate]) -> u64 {
        let fewest_slots = candidates
            .iter()
            .filter(|c| c.admission_reported)
            .map(|c| c.admission)
            .min();
        match fewest_slots {
            Some(slots) if self.scale_to_engine_slots => {
                let scaled = u64::from(slots.div_ceil(SLOTS_PER_ABS_THRESHOLD).max(1));
                self.balance_abs_threshold.min(scaled)
            }
            _ => self.balance_abs_threshold,
        }
    }

    /// Whether `load` is out of balance with `min`: above it by more than
    /// `abs` (see [`abs_threshold`](Self::abs_threshold)) AND more than
    /// `balance_rel_threshold` times it.
    #[inline]
    pub fn overloaded(&self, load: u64, min: u64, abs: u64) -> bool {
        load.saturating_sub(min) > abs && load as f64 > self.balance_rel_threshold * min as f64
    }
}

/// SGLang-style cache-aware routing: the server holding the longest prefix
/// of the prompt, unless load is out of balance.
#[derive(Debug)]
pub struct CacheAware {
    params: CacheAwareParams,
    /// Rotates among servers tied for least load.
    turn: AtomicU64,
}

impl CacheAware {
    /// A policy with `params` (check them with [`CacheAwareParams::validate`]
    /// first; out-of-range values do not panic but make little sense).
    pub fn new(params: CacheAwareParams) -> Self {
        Self {
            params,
            turn: AtomicU64::new(0),
        }
    }

    /// Its parameters.
    pub fn params(&self) -> &CacheAwareParams {
        &self.params
    }

    fn least_load(&self, candidates: &[Candidate]) -> Option<Choice> {
        least_loaded(candidates, &self.turn).map(|c| Choice {
            server: c.server,
            reason: Reason::LeastLoad,
        })
    }
}

impl Default for CacheAware {
    fn default() -> Self {
        Self::new(CacheAwareParams::default())
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        let candidates = input.candidates;
        let (min, max) = candidates
            .iter()
            .fold((u64::MAX, 0), |(lo, hi), c| (lo.min(c.inflight), hi.max(c.inflight)));
        let abs = self.params.abs_threshold(candidates);
        if candidates.is_empty() || self.params.overloaded(max, min, abs) || input.prompt_blocks == 0 {
            return self.least_load(candidates);
        }
        if let Some((winner, blocks)) = best_prefix(input, |_| true) {
            let ratio = f64::from(blocks) / f64::from(input.prompt_blocks);
            if ratio > self.params.cache_threshold && !self.params.overloaded(winner.inflight, min, abs) {
                return Some(Choice {
                    server: winner.server,
                    reason: Reason::Prefix { blocks },
                });
            }
        }
        self.least_load(candidates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand, choice, input};
    use shm_layout::PrefixMatch;

    fn params(cache_threshold: f64, abs: u64, rel: f64) -> CacheAwareParams {
        CacheAwareParams {
            cache_threshold,
            balance_abs_threshold: abs,
            balance_rel_threshold: rel,
            scale_to_engine_slots: true,
        }
    }

    fn prefix(blocks: u32) -> Reason {
        Reason::Prefix { blocks }
    }

    #[test]
    fn defaults_are_sglangs_library_defaults() {
        let p = CacheAwareParams::default();
        assert_eq!(
            (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold),
            (0.5, 32, 1.1)
        );
        assert!(p.scale_to_engine_slots);
        assert_eq!(p.validate(), Ok(()));
        assert_eq!(CacheAware::default().params(), &p);
    }

    #[test]
    fn empty_candidates_choose_nothing() {
        let f = Fixture::new(1);
        let chain = Fixture::chain(1, 4);
        f.hold(0, &chain);
        let m = f.matched(&chain);
        assert_eq!(CacheAware::default().choose(&input(4, &m, &[])), None);
    }

    #[test]
    fn prefix_above_threshold_wins_over_lower_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(1, 10);
        f.hold(1, &chain[..6]);
        let m = f.matched(&chain);
        // s[1] is the busiest, but within the balance thresholds.
        let cands = [cand(f.s[0], 2, 0), cand(f.s[1], 9, 0), cand(f.s[2], 4, 0)];
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], prefix(6)));
    }

    #[test]
    fn prefix_below_threshold_goes_to_least_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(2, 10);
        f.hold(1, &chain[..4]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 2, 0), cand(f.s[1], 1, 0), cand(f.s[2], 0, 0)];
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[2], Reason::LeastLoad));
    }

    #[test]
    fn prefix_exactly_at_threshold_is_not_enough() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(3, 10);
        f.hold(0, &chain[..5]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 0, 0)];
        let p = CacheAware::default();
        // 5 / 10 == 0.5: not strictly above.
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[1], Reason::LeastLoad)
        );
        // One more block is.
        f.hold(0, &chain[..6]);
        let m = f.matched(&chain);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(6)));
    }

    #[test]
    fn threshold_extremes() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(4, 10);
        f.hold(0, &chain[..1]);
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 1, 0), cand(f.s[1], 0, 0)];
        // 0.0: any matched block routes by prefix.
        let zero = CacheAware::new(params(0.0, 32, 1.1));
        assert_eq!(zero.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(1)));
        // 1.0: even a full match does not.
        f.hold(0, &chain);
        let m = f.matched(&chain);
        let one = CacheAware::new(params(1.0, 32, 1.1));
        assert_eq!(one.choose(&input(10, &m, &cands)).unwrap().reason, Reason::LeastLoad);
        assert_eq!(
            CacheAware::default().choose(&input(10, &m, &cands)).unwrap().reason,
            prefix(10)
        );
    }

    #[test]
    fn deepest_match_among_several_servers_wins() {
        let f = Fixture::new(4);
        let chain = Fixture::chain(5, 12);
        f.hold(0, &chain[..3]);
        f.hold(2, &chain[..11]);
        f.hold(3, &chain[..8]);
        let m = f.matched(&chain);
        let cands: Vec<_> = f.s.iter().map(|s| cand(*s, 0, 0)).collect();
        let c = CacheAware::default().choose(&input(12, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[2], prefix(11)));
    }

    #[test]
    fn equal_matches_prefer_the_less_loaded_holder() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(6, 8);
        f.hold(0, &chain);
        f.hold(1, &chain);
        let m = f.matched(&chain);
        assert_eq!(m.iter().count(), 2);
        let p = CacheAware::default();
        let cands = [cand(f.s[0], 5, 0), cand(f.s[1], 3, 0), cand(f.s[2], 0, 0)];
        assert_eq!(p.choose(&input(8, &m, &cands)).unwrap(), choice(f.s[1], prefix(8)));
        let cands = [cand(f.s[0], 3, 10), cand(f.s[1], 3, 20), cand(f.s[2], 0, 0)];
        assert_eq!(p.choose(&input(8, &m, &cands)).unwrap(), choice(f.s[0], prefix(8)));
    }

    #[test]
    fn imbalance_needs_both_conditions() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(7, 10);
        f.hold(0, &chain);
        let m = f.matched(&chain);
        // Thresholds abs 10, rel 2.0. The prefix holder s[0] is the busiest.
        let p = CacheAware::new(params(0.5, 10, 2.0));
        let route = |loads: [u64; 3]| {
            let cands: Vec<_> = (0..3).map(|i| cand(f.s[i], loads[i], 0)).collect();
            p.choose(&input(10, &m, &cands)).unwrap()
        };
        // Absolute spread 50 > 10, but 150 <= 2.0 × 100: balanced, prefix.
        assert_eq!(route([150, 100, 120]), choice(f.s[0], prefix(10)));
        // 8 > 2.0 × 1, but spread 7 <= 10: balanced, prefix.
        assert_eq!(route([8, 1, 3]), choice(f.s[0], prefix(10)));
        // Both: 30 - 5 > 10 and 30 > 10: least load.
        assert_eq!(route([30, 5, 12]), choice(f.s[1], Reason::LeastLoad));
        // Exactly at the thresholds is balanced (both are strict).
        // Spread exactly 10:
        assert_eq!(route([20, 10, 10]), choice(f.s[0], prefix(10)));
        // spread 11 > 10 but exactly 2.0 × 11:
        assert_eq!(route([22, 11, 15]), choice(f.s[0], prefix(10)));
        // one more request tips both.
        assert_eq!(route([23, 11, 15]), choice(f.s[1], Reason::LeastLoad));
        assert_eq!(route([11, 0, 5]), choice(f.s[1], Reason::LeastLoad));
        assert_eq!(route([10, 0, 5]), choice(f.s[0], prefix(10)));
    }

    #[test]
    fn imbalance_is_judged_on_all_candidates_not_just_the_winner() {
        // SGLang's rule: any imbalance routes by load, even when the
        // prefix winner itself is lightly loaded.
        let f = Fixture::new(3);
        let chain = Fixture::chain(8, 10);
        f.hold(1, &chain);
        let m = f.matched(&chain);
        let p = CacheAware::new(params(0.5, 10, 2.0));
        let cands = [cand(f.s[0], 40, 0), cand(f.s[1], 3, 0), cand(f.s[2], 2, 0)];
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[2], Reason::LeastLoad)
        );
    }

    #[test]
    fn overloaded_winner_goes_to_least_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(9, 10);
        f.hold(2, &chain);
        let m = f.matched(&chain);
        let p = CacheAware::new(params(0.5, 4, 1.5));
        // The winner is 6 above the least loaded and 2× it: overloaded.
        assert!(p.params().overloaded(12, 6, 4));
        let cands = [cand(f.s[0], 6, 0), cand(f.s[1], 7, 0), cand(f.s[2], 12, 0)];
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[0], Reason::LeastLoad)
        );
        // One request fewer and it is within the absolute threshold.
        assert!(!p.params().overloaded(10, 6, 4));
        let cands = [cand(f.s[0], 6, 0), cand(f.s[1], 7, 0), cand(f.s[2], 10, 0)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[2], prefix(10)));
        // Above by more than abs but not rel × min: not overloaded.
        let p = CacheAware::new(params(0.5, 4, 3.0));
        let cands = [cand(f.s[0], 6, 0), cand(f.s[1], 7, 0), cand(f.s[2], 17, 0)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[2], prefix(10)));
    }

    #[test]
    fn engines_that_reported_few_slots_are_balanced_at_a_threshold_scaled_to_them() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(10, 10);
        f.hold(0, &chain);
        let m = f.matched(&chain);
        let slots = |c: Candidate, n: u32| Candidate {
            admission: n,
            admission_reported: true,
            ..c
        };
        let p = CacheAware::default();
        // Two-slot engines: the threshold is 1, so the holder 2 above the
        // other (and above 1.1 × it) is overloaded.
        let cands = [slots(cand(f.s[0], 3, 0), 2), slots(cand(f.s[1], 1, 0), 2)];
        assert_eq!(p.params().abs_threshold(&cands), 1);
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[1], Reason::LeastLoad)
        );
        // 1 above is within it.
        let cands = [slots(cand(f.s[0], 2, 0), 2), slots(cand(f.s[1], 1, 0), 2)];
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(10)));
        // The same loads without reported slots: SGLang's 32 keeps the cache.
        let cands = [cand(f.s[0], 3, 0), cand(f.s[1], 1, 0)];
        assert_eq!(p.params().abs_threshold(&cands), 32);
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(10)));
        // Nor when scaling is off.
        let off = CacheAware::new(CacheAwareParams {
            scale_to_engine_slots: false,
            ..CacheAwareParams::default()
        });
        let cands = [slots(cand(f.s[0], 3, 0), 2), slots(cand(f.s[1], 1, 0), 2)];
        assert_eq!(off.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[0], prefix(10)));
        // An eighth of the fewest slots, rounded up; never above the
        // configured threshold; a learned limit scales nothing.
        for (fewest, other, abs) in [
            (1, 64, 1),
            (8, 8, 1),
            (9, 512, 2),
            (32, 256, 4),
            (256, 300, 32),
            (4096, 4096, 32),
        ] {
            let cands = [slots(cand(f.s[0], 0, 0), other), slots(cand(f.s[1], 0, 0), fewest)];
            assert_eq!(p.params().abs_threshold(&cands), abs, "{fewest} slots");
        }
        let learned = Candidate {
            admission: 2,
            ..cand(f.s[0], 0, 0)
        };
        assert_eq!(p.params().abs_threshold(&[learned]), 32);
    }

    #[test]
    fn overloaded_winner_implies_imbalanced_system() {
        // Documented property: with shared thresholds, the winner's check
        // can only fire when the system check does.
        let p = params(0.5, 7, 1.3);
        for min in 0..40u64 {
            for winner in min..80 {
                for max in winner..90 {
                    if p.overloaded(winner, min, 7) {
                        assert!(p.overloaded(max, min, 7), "min {min} winner {winner} max {max}");
                    }
                }
            }
        }
    }

    #[test]
    fn ties_in_least_load_rotate() {
        let f = Fixture::new(4);
        let p = CacheAware::default();
        let m = PrefixMatch::default();
        let cands: Vec<_> = f.s.iter().map(|s| cand(*s, 0, 0)).collect();
        let mut counts = [0; 4];
        for _ in 0..40 {
            let c = p.choose(&input(3, &m, &cands)).unwrap();
            assert_eq!(c.reason, Reason::LeastLoad);
            counts[f.s.iter().position(|s| *s == c.server).unwrap()] += 1;
        }
        assert_eq!(counts, [10; 4]);
        // Tokens break a tie in requests before the rotation does.
        let cands = [
            cand(f.s[0], 1, 50),
            cand(f.s[1], 1, 40),
            cand(f.s[2], 1, 60),
            cand(f.s[3], 2, 0),
        ];
        for _ in 0..4 {
            assert_eq!(p.choose(&input(3, &m, &cands)).unwrap().server, f.s[1]);
        }
    }

    #[test]
    fn short_prompt_uses_least_load() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(10, 2);
        f.hold(0, &chain);
        // A (stale) match against a zero-block prompt must not route by prefix
        // nor divide by zero.
        let m = f.matched(&chain);
        let cands = [cand(f.s[0], 3, 0), cand(f.s[1], 1, 0)];
        let c = CacheAware::new(params(0.0, 32, 1.1))
            .choose(&input(0, &m, &cands))
            .unwrap();
        assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
    }

    #[test]
    fn no_match_uses_least_load() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(11, 6);
        f.hold(0, &Fixture::chain(12, 6));
        let m = f.matched(&chain);
        assert!(m.is_empty());
        let cands = [cand(f.s[0], 3, 0), cand(f.s[1], 2, 0), cand(f.s[2], 5, 0)];
        let c = CacheAware::default().choose(&input(6, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
    }

    #[test]
    fn entries_for_servers_not_among_the_candidates_are_ignored() {
        let f = Fixture::new(3);
        let chain = Fixture::chain(13, 10);
        f.hold(0, &chain); // deepest, but not a candidate (went down after the lookup)
        f.hold(1, &chain[..7]);
        let m = f.matched(&chain);
        assert_eq!(m.best(), Some((f.s[0].tag(), 10)));
        let cands = [cand(f.s[1], 2, 0), cand(f.s[2], 0, 0)];
        let p = CacheAware::default();
        assert_eq!(p.choose(&input(10, &m, &cands)).unwrap(), choice(f.s[1], prefix(7)));
        // With only the absent server holding enough, least load.
        let cands = [cand(f.s[2], 0, 0)];
        assert_eq!(
            p.choose(&input(10, &m, &cands)).unwrap(),
            choice(f.s[2], Reason::LeastLoad)
        );
    }

    #[test]
    fn a_re_registered_slot_does_not_inherit_the_match() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(14, 10);
        f.hold(0, &chain);
        // Match computed while the old registration was live...
        let m = f.matched(&chain);
        // ...then the slot is retired and re-registered (new generation).
        let t = f.seg.tables();
        assert!(t.servers.retire(f.s[0]));
        let again = t.servers.register(99, "http://again", 0).unwrap();
        assert_eq!(again.slot, f.s[0].slot);
        assert_ne!(again.tag(), f.s[0].tag());
        let cands = [cand(again, 5, 0), cand(f.s[1], 0, 0)];
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], Reason::LeastLoad));
        // A fresh lookup filters the dead lane out altogether.
        assert!(f.matched(&chain).is_empty());
    }

    #[test]
    fn down_servers_drop_out_of_the_live_match() {
        let f = Fixture::new(2);
        let chain = Fixture::chain(15, 10);
        f.hold(0, &chain);
        f.hold(1, &chain[..6]);
        let t = f.seg.tables();
        assert!(t.servers.set_state(f.s[0], shm_layout::ServerState::Down));
        let m = f.matched(&chain);
        let mut cands = Vec::new();
        crate::routing::live_candidates(&t, &mut cands);
        assert_eq!(cands.iter().map(|c| c.server).collect::<Vec<_>>(), [f.s[1]]);
        let c = CacheAware::default().choose(&input(10, &m, &cands)).unwrap();
        assert_eq!(c, choice(f.s[1], prefix(6)));
    }
}
