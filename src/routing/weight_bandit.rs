//! The online tuner of the [`cost`](super::cost) policy's weight between
//! cache and load: a slow bandit over a grid of weights, rewarded by the
//! time to first token each request sees.
//!
//! # Arms
//!
//! [`ARMS`] weights, a factor of 2 apart: `2^-4, 2^-3, …, 2^4` (1/16 to
//! 16). A grid rather than a gradient step: a routing decision flips only
//! when the weight crosses the point where two servers' costs are equal,
//! so near either end of the range small changes of the weight change no
//! decision, and a local step would see no difference and never leave a
//! bad start. Every arm is tried now and then, whatever the leader.
//!
//! # Rule
//!
//! * **Draw.** Each request routed draws its arm: the *leader* (the arm
//!   whose requests had the lowest mean log TTFT), or, with probability
//!   `explore`, any other arm, uniformly. The draw is per request and random, so every
//!   arm sees the same mix of prompts and moments and the comparison is
//!   fair.
//! * **Reward.** When the answer ends, its time to first token is a
//!   sample of its arm: the first byte of a stream, or the whole latency
//!   of a non-streamed answer (its decode time is the same, on average,
//!   for every arm). The statistic is `ln(TTFT)`: TTFTs are heavy-tailed,
//!   and what the comparison should see is a ratio (arm A's requests wait
//!   half as long), not a few seconds of one outlier.
//! * **Memory.** Each arm keeps a count, a sum and a sum of squares of its
//!   samples, and every sample decays all arms by `1 − 1/`[`MEMORY`], so
//!   old evidence fades (a half-life of ~0.7 × `MEMORY` samples) and the
//!   leader follows a workload that changes.
//! * **Leader.** An arm with at least [`MIN_SAMPLES`] (decayed) samples
//!   takes over when its mean is below the leader's by more than
//!   [`LEAD_MARGIN`] standard errors of the difference: a challenger must be clearly
//!   better, so the leader does not flap between two arms that are as
//!   good as each other.
//!
//! The tuner is per dispatcher, lock-free on the routing path (the leader
//! is one atomic), and takes a mutex only to add a sample.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

use super::random::Random;

/// Arms of the grid.
pub const ARMS: usize = 9;
/// The arm of weight 1 (the grid is `2^(arm − UNIT_ARM)`).
pub const UNIT_ARM: u8 = 4;
/// Samples after which an old sample counts `1/e` as much as a new one.
pub const MEMORY: f64 = 4000.0;
/// Decayed samples an arm needs before it may lead.
pub const MIN_SAMPLES: f64 = 12.0;
/// Standard errors of the difference by which a challenger's mean must be
/// below the leader's to take over.
pub const LEAD_MARGIN: f64 = 2.5;

/// The weight of `arm`.
pub fn weight_of(arm: u8) -> f64 {
    (f64::from(arm) - f64::from(UNIT_ARM)).exp2()
}

/// The arm whose weight is nearest `weight` (in ratio).
pub fn arm_near(weight: f64) -> u8 {
    let k = weight.max(f64::MIN_POSITIVE).log2().round() + f64::from(UNIT_ARM);
    k.clamp(0.0, (ARMS - 1) as f64) as u8
}

/// One arm's decayed samples of `ln(TTFT in µs)`.
#[derive(Debug, Clone, Copy, Default)]
struct ArmStats {
    n: f64,
    sum: f64,
    sum_sq: f64,
}

impl ArmStats {
    fn mean(&self) -> f64 {
        self.sum / self.n
    }

    /// The variance of the mean (of a sample's variance / n), with a floor
    /// so that a few equal samples are not taken as certain.
    fn mean_variance(&self) -> f64 {
        let var = (self.sum_sq / self.n - self.mean().powi(2)).max(0.01);
        var / self.n
    }
}

/// The tuner (see the [module docs](self)).
#[derive(Debug)]
pub struct WeightBandit {
    leader: AtomicU8,
    explore: f64,
    arms: Mutex<[ArmStats; ARMS]>,
    rng: Random,
}

impl WeightBandit {
    /// A tuner whose leader starts at the arm nearest `initial_weight`, and
    /// which tries another arm for a share `explore` of the requests.
    pub fn new(initial_weight: f64, explore: f64) -> Self {
        Self::with_rng(initial_weight, explore, Random::new())
    }

    /// The same, drawing from `rng`.
    fn with_rng(initial_weight: f64, explore: f64, rng: Random) -> Self {
        Self {
            leader: AtomicU8::new(arm_near(initial_weight)),
            explore,
            arms: Mutex::new([ArmStats::default(); ARMS]),
            rng,
        }
    }

    /// The leading arm.
    pub fn leader(&self) -> u8 {
        self.leader.load(Ordering::Relaxed)
    }

    /// The arm a request is routed with (see the rule).
    pub fn draw(&self) -> u8 {
        let leader = self.leader();
        if self.rng.unit() >= self.explore {
            return leader;
        }
        // Any other arm, uniformly.
        let other = self.rng.below(ARMS - 1) as u8;
        if other >= leader { other + 1 } else { other }
    }

    /// A request routed with `arm` saw its first token after `ttft_us`.
    pub fn observe(&self, arm: u8, ttft_us: u32) {
        let i = usize::from(arm);
        if i >= ARMS {
            return;
        }
        let x = f64::from(ttft_us.max(1)).ln();
        let mut arms = self.arms.lock().unwrap_or_else(|e| e.into_inner());
        let keep = 1.0 - 1.0 / MEMORY;
        for a in arms.iter_mut() {
            a.n *= keep;
            a.sum *= keep;
            a.sum_sq *= keep;
        }
        arms[i].n += 1.0;
        arms[i].sum += x;
        arms[i].sum_sq += x * x;
        let leader = usize::from(self.leader());
        let (l, a) = (arms[leader], arms[i]);
        if i == leader || l.n < MIN_SAMPLES || a.n < MIN_SAMPLES {
            return;
        }
        if l.mean() - a.mean() > LEAD_MARGIN * (l.mean_variance() + a.mean_variance()).sqrt() {
            self.leader.store(arm, Ordering::Relaxed);
        }
    }

    /// Every arm with samples, for tests and diagnostics: `(arm, geometric
    /// mean TTFT in µs, decayed samples)`.
    pub fn snapshot(&self) -> Vec<(u8, f64, f64)> {
        let arms = self.arms.lock().unwrap_or_else(|e| e.into_inner());
        (0..ARMS as u8)
            .zip(arms.iter())
            .filter(|(_, a)| a.n > 0.0)
            .map(|(k, a)| (k, a.mean().exp(), a.n))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_runs_from_a_sixteenth_to_sixteen() {
        assert_eq!(weight_of(0), 1.0 / 16.0);
        assert_eq!(weight_of(UNIT_ARM), 1.0);
        assert_eq!(weight_of(ARMS as u8 - 1), 16.0);
        assert_eq!(arm_near(1.0), UNIT_ARM);
        assert_eq!(arm_near(3.0), UNIT_ARM + 2, "3 is nearer 4 than 2 in ratio");
        assert_eq!(arm_near(1000.0), ARMS as u8 - 1);
        assert_eq!(arm_near(0.0), 0);
    }

    /// A tuner whose draws follow `seed`.
    fn seeded(initial_weight: f64, seed: u64) -> WeightBandit {
        WeightBandit::with_rng(initial_weight, 0.1, Random::with_seed(seed))
    }

    /// A simulated world where arm `k`'s requests wait `ttft(k)` µs, with
    /// multiplicative noise of up to e^±1 (drawn from `seed`); returns how
    /// often the leader changed.
    fn run(bandit: &WeightBandit, seed: u64, requests: usize, ttft: impl Fn(u8) -> f64) -> usize {
        let noise = Random::with_seed(seed ^ 0xabcd);
        let mut changes = 0;
        for _ in 0..requests {
            let before = bandit.leader();
            let arm = bandit.draw();
            let jitter = (noise.unit() * 2.0 - 1.0).exp();
            bandit.observe(arm, (ttft(arm) * jitter) as u32);
            changes += usize::from(bandit.leader() != before);
        }
        changes
    }

    #[test]
    fn the_leader_moves_to_the_arm_with_the_lowest_ttft_even_from_a_flat_start() {
        // The best weight is 4 (arm 6); arms 0..=3 are all equally bad
        // (flat: no local gradient from a start at 1/16).
        for seed in 0..10 {
            let bandit = seeded(1.0 / 16.0, seed);
            assert_eq!(bandit.leader(), 0);
            run(&bandit, seed, 4000, |k| match k {
                0..=3 => 200_000.0,
                4 => 100_000.0,
                5 => 60_000.0,
                6 => 40_000.0,
                _ => 70_000.0,
            });
            assert_eq!(bandit.leader(), 6, "seed {seed}: {:?}", bandit.snapshot());
        }
    }

    #[test]
    fn equally_good_arms_rarely_take_the_lead_from_each_other() {
        // Noise alone sometimes clears the margin (the comparison is
        // repeated at every sample); it must stay rare.
        let changes: usize = (0..20)
            .map(|seed| run(&seeded(1.0, seed), seed, 4000, |_| 50_000.0))
            .sum();
        assert!(changes <= 20, "{changes} changes of leader in 20 runs of 4000 requests");
    }

    #[test]
    fn the_leader_follows_a_workload_that_changes() {
        for seed in 0..10 {
            let bandit = seeded(1.0, seed);
            run(&bandit, seed, 3000, |k| if k <= 2 { 30_000.0 } else { 90_000.0 });
            assert!(bandit.leader() <= 2, "seed {seed}: {:?}", bandit.snapshot());
            run(&bandit, seed + 100, 6000, |k| if k >= 6 { 30_000.0 } else { 90_000.0 });
            assert!(bandit.leader() >= 6, "seed {seed}: {:?}", bandit.snapshot());
        }
    }

    #[test]
    fn out_of_range_arms_are_ignored() {
        let bandit = WeightBandit::new(1.0, 0.1);
        bandit.observe(ARMS as u8, 1);
        assert!(bandit.snapshot().is_empty());
    }
}
