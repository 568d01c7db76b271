//! When a server a prompt's cache points to is too busy to follow it: the
//! balance rule the prefix-aware policies share, measured against what
//! each engine can take.
//!
//! A server `w` is **overloaded** when
//! `load(w) − min > abs(w) && load(w) > rel × min`, with `load` the
//! requests in flight through the gateway ([`Candidate::inflight`]) per
//! unit of the server's weight ([`Candidate::per_weight`]; `abs` counts
//! requests per unit of weight too),
//! `min` the least load over the candidates, `rel` a ratio (SGLang's 1.1)
//! and `abs(w)` an eighth of the requests `w`'s engine runs at once,
//! rounded up, at most a cap (SGLang's 32, which is an eighth of vLLM's
//! 256 sequences) and at least 1 where the engine reported the number
//! (llama.cpp's slots: two-slot engines are balanced at a spread of 1),
//! else at least [`UNREPORTED_FLOOR`]. What an engine runs at once is
//! [`Candidate::admission`]: the number it reported, else the admission
//! limit the gateway learns ([`crate::routing::capacity`]), else
//! [`crate::routing::capacity::INITIAL_LIMIT`]. A learned limit is a lower bound
//! until requests queue (it starts at 8 and grows only while it binds),
//! and a client's next turn often arrives before its last answer is
//! uncounted, so a spread of 2 on an engine that said nothing is noise:
//! at 1, back-to-back conversations over three engines moved.
//!
//! An absolute 32 alone is out of reach of a small fleet: four engines
//! with sixteen clients never differ by 32, so affinity always won
//! (issue 38). Scaled to capacity, the conversations of an engine that
//! carries several more than the idlest move to it, which is also how
//! engines added at runtime next to a loaded one get their share of the
//! conversations that started before them.
//!
//! `cache_aware` applies it with its own thresholds
//! ([`super::CacheAwareParams`]), the winner's absolute threshold raised
//! by what its cache is worth to the request ([`Balance::overloaded_with`]:
//! its `saved_tokens_per_spread`); the other prefix-aware policies with
//! [`Balance::DEFAULT`]: `weighted_scorers` (an overloaded server's prefix
//! score is 0), `selective_push` (an overloaded server is not the prefix
//! choice) and `dual_map` (an overloaded conversation engine is not kept
//! over the hash candidates). `cost` and `consistent_hash` have their own
//! bound on load ([`super::load_bound`]).

use super::{Candidate, LOAD_UNIT};

/// Requests an engine runs at once per request of absolute load spread
/// (SGLang's 32 of vLLM's 256 sequences).
pub const CAPACITY_PER_ABS_THRESHOLD: u32 = 8;

/// The least absolute threshold of an engine that did not report what it
/// runs at once (see the [module docs](self)).
pub const UNREPORTED_FLOOR: u32 = 2;

/// The thresholds of the balance rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balance {
    /// The absolute threshold, or its cap when `scale_to_capacity`.
    pub abs: u64,
    /// The relative threshold (>= 1).
    pub rel: f64,
    /// Scale the absolute threshold to the server's capacity.
    pub scale_to_capacity: bool,
}

impl Balance {
    /// SGLang's library thresholds (32, 1.1), scaled to capacity.
    pub const DEFAULT: Self = Self {
        abs: 32,
        rel: 1.1,
        scale_to_capacity: true,
    };

    /// The absolute threshold of server `c`: `abs`, capped at
    /// `⌈admission / 8⌉` (at least 1 for a reported number, else
    /// [`UNREPORTED_FLOOR`]) when `scale_to_capacity`.
    #[inline]
    pub fn abs_threshold(&self, c: &Candidate) -> u64 {
        if self.scale_to_capacity {
            let floor = if c.admission_reported { 1 } else { UNREPORTED_FLOOR };
            let scaled = u64::from(c.admission.div_ceil(CAPACITY_PER_ABS_THRESHOLD).max(floor));
            self.abs.min(scaled)
        } else {
            self.abs
        }
    }

    /// Whether `load` is out of balance with `min`: above it by more than
    /// `abs` AND more than `rel` times it.
    #[inline]
    pub fn beyond(&self, load: u64, min: u64, abs: u64) -> bool {
        load.saturating_sub(min) > abs && load as f64 > self.rel * min as f64
    }

    /// Whether `c` is overloaded against `least`, the least busy candidate
    /// ([`least_busy`]; `None`: no other load to compare with, a load of
    /// 0). The absolute threshold is the smaller of `c`'s and `least`'s:
    /// a learned admission limit only grows while requests queue, so an
    /// engine that was loaded alone has learned more than engines added
    /// next to it, and judged by its own yardstick alone it would keep
    /// conversations the new engines should take.
    #[inline]
    pub fn overloaded(&self, c: &Candidate, least: Option<&Candidate>) -> bool {
        self.overloaded_with(c, least, 0)
    }

    /// [`overloaded`](Self::overloaded) with the absolute threshold raised
    /// by `extra` requests, up to `abs` (what keeping the request there is
    /// worth: `cache_aware`'s `saved_tokens_per_spread`).
    #[inline]
    pub fn overloaded_with(&self, c: &Candidate, least: Option<&Candidate>, extra: u64) -> bool {
        let own = self.abs_threshold(c);
        // Never above `abs`, which caps every scaled threshold too.
        let scaled = least.map_or(own, |l| own.min(self.abs_threshold(l)));
        let abs = scaled.saturating_add(extra).min(self.abs);
        self.beyond(
            c.weighted_inflight(),
            least.map_or(0, Candidate::weighted_inflight),
            abs.saturating_mul(LOAD_UNIT),
        )
    }
}

/// The candidate with the fewest requests in flight per unit of weight
/// (the first of equals; `None` when empty).
#[inline]
pub fn least_busy(candidates: &[Candidate]) -> Option<&Candidate> {
    candidates.iter().min_by_key(|c| c.weighted_inflight())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand};

    /// A candidate for `server`, whose engine runs `admission` requests at
    /// once (learned, not reported), with `inflight` in flight.
    fn engine(server: shm_layout::ServerRef, admission: u32, inflight: u64) -> Candidate {
        Candidate {
            admission,
            ..cand(server, inflight, 0)
        }
    }

    #[test]
    fn the_threshold_is_an_eighth_of_capacity_within_one_and_the_cap() {
        let f = Fixture::new(1);
        let at = |n: u32| Candidate {
            admission: n,
            ..cand(f.s[0], 0, 0)
        };
        let reported = |n: u32| Candidate {
            admission_reported: true,
            started_since_scrape: 0,
            ..at(n)
        };
        for (n, abs) in [(1, 1), (2, 1), (8, 1), (9, 2), (16, 2), (40, 5), (256, 32), (4096, 32)] {
            assert_eq!(Balance::DEFAULT.abs_threshold(&reported(n)), abs, "{n}");
        }
        // Learned or assumed: at least 2.
        for (n, abs) in [(1, 2), (8, 2), (16, 2), (24, 3), (40, 5), (4096, 32)] {
            assert_eq!(Balance::DEFAULT.abs_threshold(&at(n)), abs, "{n}");
        }
        let fixed = Balance {
            scale_to_capacity: false,
            ..Balance::DEFAULT
        };
        assert_eq!(fixed.abs_threshold(&at(2)), 32);
    }

    #[test]
    fn overloaded_needs_both_thresholds() {
        let f = Fixture::new(1);
        let at = |inflight: u64| engine(f.s[0], 16, inflight);
        let b = Balance::DEFAULT;
        // abs 2: 3 above is over it, 2 is not.
        assert!(b.overloaded(&at(7), Some(&at(4))));
        assert!(!b.overloaded(&at(6), Some(&at(4))));
        // An engine of 256 sequences: 32 above.
        let big = |inflight: u64| Candidate {
            admission: 256,
            ..at(inflight)
        };
        assert!(!b.overloaded(&big(322), Some(&big(290))));
        assert!(b.overloaded(&big(330), Some(&big(290))));
        // 3 above 37 is over abs 2, but not 1.1 × 37.
        assert!(!b.overloaded(&at(40), Some(&at(37))));
        assert!(b.overloaded(&at(3), Some(&at(0))));
        assert!(b.overloaded(&at(3), None));
        assert_eq!(least_busy(&[at(5), at(2), at(9)]).map(|c| c.inflight), Some(2));
        assert_eq!(least_busy(&[]), None);
    }

    #[test]
    fn the_smaller_threshold_of_the_two_engines_counts() {
        let f = Fixture::new(2);
        // An engine that learned 64 at once (abs 8) next to a new one
        // still at the initial 8 (abs 2): 3 above it is too many.
        let old = |inflight: u64| engine(f.s[0], 64, inflight);
        let new = |inflight: u64| engine(f.s[1], 8, inflight);
        let b = Balance::DEFAULT;
        assert!(b.overloaded(&old(10), Some(&new(7))));
        assert!(!b.overloaded(&old(9), Some(&new(7))));
        // Two engines that both learned 64: 8 above is within.
        assert!(!b.overloaded(&old(15), Some(&old(7))));
    }

    #[test]
    fn what_keeping_is_worth_raises_the_threshold_up_to_the_cap() {
        let f = Fixture::new(1);
        let at = |inflight: u64| engine(f.s[0], 16, inflight);
        let b = Balance::DEFAULT;
        // abs 2, raised by 3: 5 above is within, 6 is not.
        assert!(b.overloaded(&at(9), Some(&at(4))));
        assert!(!b.overloaded_with(&at(9), Some(&at(4)), 3));
        assert!(b.overloaded_with(&at(10), Some(&at(4)), 3));
        // Never above the configured cap.
        let capped = Balance { abs: 4, ..b };
        assert!(capped.overloaded_with(&at(9), Some(&at(4)), 100));
        assert!(!capped.overloaded_with(&at(8), Some(&at(4)), 100));
    }
}
