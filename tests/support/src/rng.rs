//! splitmix64: deterministic, well-spread randomness, so a failing run can
//! be replayed from its seed. The one copy of the constant for the tests,
//! benches and reports.

/// splitmix64's increment (2^64 divided by the golden ratio).
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's finaliser after one increment: a well-spread 64-bit
/// function of `x` (`mix(i)` for `i = 0, 1, …` are well-spread keys).
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(GAMMA);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A splitmix64 generator: `Rng(state)` gives `mix(state + GAMMA)`,
/// `mix(state + 2 GAMMA)`, …
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The textbook splitmix64 stream of `seed` (its first value is the
    /// finaliser of `seed + GAMMA`).
    pub fn from_seed(seed: u64) -> Rng {
        Rng(seed.wrapping_sub(GAMMA))
    }

    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }

    /// Uniform-ish in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform-ish in `0..n`, as an index.
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True once in `n` calls on average.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `from_seed` is the textbook stream (seed 0 starts 0xe220a8397b1dcdaf),
    /// and `Rng(s)` is that stream one step on.
    #[test]
    fn from_seed_is_textbook_splitmix64_and_rng_is_one_step_on() {
        assert_eq!(Rng::from_seed(0).next(), 0xe220_a839_7b1d_cdaf);
        let (mut a, mut b) = (Rng(7), Rng::from_seed(7u64.wrapping_add(GAMMA)));
        for _ in 0..100 {
            assert_eq!(a.next(), b.next());
        }
        assert_eq!(mix(0), Rng::from_seed(0).next());
    }
}
