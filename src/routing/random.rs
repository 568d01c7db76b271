//! `random`: a candidate drawn uniformly at random (in proportion to the
//! servers' weights, `[[backend]] weight`).
//!
//! # Rule
//!
//! Each request draws one 64-bit number from a SplitMix64 generator and maps
//! it onto `0..candidates.len()` with a multiply-shift (Lemire's method; the
//! bias is below `n / 2^64`, nothing for at most a few hundred servers).
//! Prefix matches and load are ignored, as in SGLang's `random` policy.
//!
//! SplitMix64 (Steele, Lea & Flood, 2014) suits a lock-free shared policy:
//! its state advances by a constant, so one `fetch_add` on an `AtomicU64`
//! gives every caller its own state, and the output is that state through a
//! bijective mixer. No extra crate, no lock, no allocation. It is not a
//! cryptographic generator, and needs not be: the draw only spreads load.
//!
//! [`Random::new`] seeds from the wall clock and the process id, so the
//! dispatcher processes of one gateway draw different sequences;
//! [`Random::with_seed`] makes the sequence reproducible (tests, simulation).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Choice, Policy, Reason, RouteInput};

/// SplitMix64's state increment (2^64 / φ, odd).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a bijective 64-bit mixer.
#[inline]
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sends each request to a candidate drawn uniformly at random.
#[derive(Debug)]
pub struct Random {
    /// SplitMix64 state.
    state: AtomicU64,
}

impl Default for Random {
    fn default() -> Self {
        Self::new()
    }
}

impl Random {
    /// A generator seeded from the wall clock and the process id.
    pub fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self::with_seed(nanos ^ mix(u64::from(std::process::id())))
    }

    /// A generator whose draws are determined by `seed`.
    pub fn with_seed(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// The next 64-bit draw.
    #[inline]
    pub(crate) fn next_u64(&self) -> u64 {
        mix(self.state.fetch_add(GAMMA, Ordering::Relaxed).wrapping_add(GAMMA))
    }

    /// A draw in `0..n` (`n > 0`).
    #[inline]
    pub(crate) fn below(&self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A draw in `[0, 1)` (53 bits).
    #[inline]
    pub(crate) fn unit(&self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        if input.candidates.is_empty() {
            return None;
        }
        let total = super::total_weight(input.candidates);
        let draw = ((u128::from(self.next_u64()) * u128::from(total)) >> 64) as u64;
        Some(Choice {
            server: super::by_weight(input.candidates, draw)?.server,
            reason: Reason::Random,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand, input};
    use shm_layout::PrefixMatch;

    #[test]
    fn matches_the_splitmix64_reference() {
        // First outputs of the reference splitmix64.c seeded with 1234567.
        let r = Random::with_seed(1234567);
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, [6457827717110365317, 3203168211198807973, 9817491932198370423]);
    }

    #[test]
    fn empty_candidates_choose_nothing() {
        assert_eq!(
            Random::with_seed(7).choose(&input(0, &PrefixMatch::default(), &[])),
            None
        );
    }

    #[test]
    fn uniform_over_many_draws() {
        let f = Fixture::new(4);
        let cands: Vec<_> = f.s.iter().map(|s| cand(*s, 0, 0)).collect();
        let m = PrefixMatch::default();
        for seed in [0, 1, 42, u64::MAX] {
            let p = Random::with_seed(seed);
            let mut counts = [0u32; 4];
            for _ in 0..10_000 {
                let c = p.choose(&input(4, &m, &cands)).unwrap();
                assert_eq!(c.reason, Reason::Random);
                counts[f.s.iter().position(|s| *s == c.server).unwrap()] += 1;
            }
            for n in counts {
                assert!((1_500..=3_500).contains(&n), "seed {seed}: {counts:?}");
            }
        }
        // The clock-seeded default is uniform too.
        let p = Random::new();
        let mut counts = [0u32; 4];
        for _ in 0..10_000 {
            let s = p.choose(&input(4, &m, &cands)).unwrap().server;
            counts[f.s.iter().position(|x| *x == s).unwrap()] += 1;
        }
        assert!(counts.iter().all(|n| (1_500..=3_500).contains(n)), "{counts:?}");
    }

    #[test]
    fn deterministic_with_a_seed() {
        let f = Fixture::new(5);
        let cands: Vec<_> = f.s.iter().map(|s| cand(*s, 0, 0)).collect();
        let m = PrefixMatch::default();
        let draw = |seed| {
            let p = Random::with_seed(seed);
            (0..64)
                .map(|_| p.choose(&input(4, &m, &cands)).unwrap().server)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(99), draw(99));
        assert_ne!(draw(99), draw(100));
    }

    #[test]
    fn below_stays_in_range() {
        let r = Random::with_seed(3);
        for n in 1..=130 {
            for _ in 0..50 {
                assert!(r.below(n) < n);
            }
        }
        // The extremes of the multiply-shift.
        assert_eq!(((u128::from(u64::MAX) * 7) >> 64) as usize, 6);
    }
}
