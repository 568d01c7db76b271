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
//! * **Epochs.** Requests are routed in epochs of `epoch_requests` (default
//!   [`EPOCH_REQUESTS`]) requests of this dispatcher, and every request of
//!   an epoch uses the epoch's arm: the *leader* (the arm whose requests
//!   had the lowest mean log TTFT), or, for a share `explore` of the
//!   epochs, any other arm, uniformly. Per epoch, not per request,
//!   because requests interfere: a request that moves a conversation
//!   makes its engine recompute a document, and the requests batched
//!   with it wait through that prefill whatever their own weight. With a
//!   weight per request that cost lands on every arm alike and no arm
//!   looks worse; with a weight per epoch it lands, mostly, on the arm
//!   that caused it (a *switchback* experiment). Measured with the
//!   process test of `tests/cost.rs` that `tests/cost_tuner.rs` replaced:
//!   conversations on their own documents, two engines,
//!   weight 16 against the rest: per request, the same share of slow
//!   first tokens on every arm (35–45 %); per epoch of 32, 42–47 % at
//!   weight 16 against 22–34 % at the others.
//! * **Washout.** An epoch whose arm differs from the last epoch's is
//!   longer by half: its first `epoch_requests / 2` requests are routed
//!   with its arm but their TTFTs are not counted, and `epoch_requests`
//!   are after them. The first ones share the engines with the last
//!   epoch's requests still in flight, and with the recomputes its moves
//!   caused, so what they wait
//!   is partly the last arm's doing (the *carryover* that switchback
//!   experiments drop as a burn-in). Exploring epochs nearly always follow
//!   the leader's, so without the washout each explored arm carries some
//!   of the leader's cost, and the leader some of theirs: the gap between
//!   them shrinks. An epoch that continues the last one's arm is measured
//!   whole. (Lengthened rather than cut: an explored epoch brings as much
//!   evidence as before, and costs half as many requests again.)
//!   Measured in the unit tests (a world whose harm lingers for 16
//!   requests, epochs of 32): weight 16 adds 2 to `ln(TTFT)` once its
//!   harm has built up; the tuner sees a gap of 1.98 with the washout,
//!   1.61 without.
//! * **Reward.** When the answer ends, its time to first token is a
//!   sample of its arm: the first byte of a stream, or the whole latency
//!   of a non-streamed answer (its decode time is the same, on average,
//!   for every arm). The statistic is `ln(TTFT)`: TTFTs are heavy-tailed,
//!   and what the comparison should see is a ratio (arm A's requests wait
//!   half as long), not a few seconds of one outlier.
//! * **Batches.** An epoch's requests share their moment, so their samples
//!   are not independent evidence. Each arm's samples are averaged in
//!   batches of `epoch_requests` as they arrive, and the batch means are
//!   the samples the comparison counts (the method of batch means).
//! * **Memory.** Each arm keeps a count, a sum and a sum of squares of its
//!   batch means, and every batch decays all arms by `1 − 1/`[`MEMORY`], so
//!   old evidence fades (a half-life of ~0.7 × `MEMORY` batches) and the
//!   leader follows a workload that changes.
//! * **Leader.** An arm with at least [`MIN_BATCHES`] (decayed) batches
//!   takes over when its mean is below the leader's by more than
//!   [`LEAD_MARGIN`] standard errors of the difference: a challenger must
//!   be clearly better, so the leader does not flap between two arms that
//!   are as good as each other.
//!
//! With `explore` 0.1 and epochs of 32 another arm gets one epoch in 80,
//! so taking the lead from a start that is wrong everywhere near it takes
//! some 10 000 to 20 000 requests of a dispatcher (see the unit tests); at
//! the `cost` policy's default `explore` of 0.05, twice that. Exploring
//! costs: an epoch at a weight far from the right one moves (or piles up)
//! conversations, and the recomputes outlast it (on the `hot-prefix`
//! replay at twice its rate, 87 % of requests met the TTFT objective with
//! 0.1 against 99 % with 0.05 and 100 % with the weight fixed). The tuner
//! is for steady traffic, and `initial_weight` is the operator's prior.
//!
//! The tuner is per dispatcher, lock-free on the routing path (the epoch's
//! arm and the leader are atomics), and takes a mutex only to add a
//! sample.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use super::random::Random;

/// Arms of the grid.
pub const ARMS: usize = 9;
/// The arm of weight 1 (the grid is `2^(arm − UNIT_ARM)`).
pub const UNIT_ARM: u8 = 4;
/// In [`WeightBandit`]'s `epoch`: its arm differs from the last epoch's
/// (it starts with a washout).
const SWITCHED: u8 = 0x80;
/// Requests of an epoch (and of a batch), by default.
pub const EPOCH_REQUESTS: u32 = 32;
/// Batches after which an old batch counts `1/e` as much as a new one.
pub const MEMORY: f64 = 400.0;
/// Decayed batches an arm needs before it may lead.
pub const MIN_BATCHES: f64 = 3.0;
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

/// One arm's decayed batch means of `ln(TTFT in µs)`.
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

    /// The variance of the mean (of a batch mean's variance / n), with a
    /// floor so that a few equal batches are not taken as certain.
    fn mean_variance(&self) -> f64 {
        let var = (self.sum_sq / self.n - self.mean().powi(2)).max(0.01);
        var / self.n
    }
}

/// What the tuner has learnt: each arm's batches and its open batch
/// (samples so far, their sum).
#[derive(Debug, Default)]
struct Evidence {
    arms: [ArmStats; ARMS],
    open: [(u32, f64); ARMS],
}

/// The arm a request is routed with ([`WeightBandit::draw`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    /// The arm of the request's epoch.
    pub arm: u8,
    /// Whether its TTFT is the arm's evidence: false in the washout of an
    /// epoch that switched arms.
    pub measured: bool,
}

/// The tuner (see the [module docs](self)).
#[derive(Debug)]
pub struct WeightBandit {
    leader: AtomicU8,
    /// The epoch in force: the draw it started at (above the low byte) and
    /// its arm, with [`SWITCHED`] when it differs from the last epoch's (in
    /// the low byte). One word, so a draw reads them together.
    epoch: AtomicU64,
    /// Requests drawn so far.
    drawn: AtomicU64,
    /// Requests of an epoch that are measured.
    epoch_requests: u32,
    /// Requests at the start of a switched epoch that are not measured.
    washout: u32,
    explore: f64,
    evidence: Mutex<Evidence>,
    rng: Random,
}

impl WeightBandit {
    /// A tuner whose leader starts at the arm nearest `initial_weight`, and
    /// which routes a share `explore` of its epochs of `epoch_requests`
    /// requests with another arm.
    pub fn new(initial_weight: f64, explore: f64, epoch_requests: u32) -> Self {
        Self::with_rng(initial_weight, explore, epoch_requests, Random::new())
    }

    /// The same, drawing from `rng`.
    pub(super) fn with_rng(initial_weight: f64, explore: f64, epoch_requests: u32, rng: Random) -> Self {
        let start = arm_near(initial_weight);
        let epoch_requests = epoch_requests.max(1);
        Self {
            leader: AtomicU8::new(start),
            epoch: AtomicU64::new(u64::from(start)),
            drawn: AtomicU64::new(0),
            epoch_requests,
            washout: epoch_requests / 2,
            explore,
            evidence: Mutex::new(Evidence::default()),
            rng,
        }
    }

    /// The leading arm.
    pub fn leader(&self) -> u8 {
        self.leader.load(Ordering::Relaxed)
    }

    /// The arm a request is routed with: its epoch's, and whether it is
    /// measured (see the rule).
    pub fn draw(&self) -> Draw {
        let i = self.drawn.fetch_add(1, Ordering::Relaxed);
        let mut epoch = self.epoch.load(Ordering::Acquire);
        loop {
            let (start, arm, switched) = (epoch >> 8, epoch as u8 & !SWITCHED, epoch as u8 & SWITCHED != 0);
            let washout = if switched { u64::from(self.washout) } else { 0 };
            let end = start + washout + u64::from(self.epoch_requests);
            if i < end {
                // (A draw that read its epoch late, `i < start`, is
                // routed with its arm, not measured.)
                return Draw {
                    arm,
                    measured: i >= start + washout,
                };
            }
            // Past the epoch's end: the next epoch starts there, opened by
            // whichever draw past it gets here first (not only the draw
            // numbered `end`, which may be slow to come).
            let next = self.next_arm(arm);
            match self
                .epoch
                .compare_exchange(epoch, end << 8 | u64::from(next), Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => epoch = end << 8 | u64::from(next),
                Err(seen) => epoch = seen,
            }
        }
    }

    /// The arm of the epoch after one of `last`, with [`SWITCHED`] if it
    /// differs: the leader, or for a share `explore` another arm.
    fn next_arm(&self, last: u8) -> u8 {
        let leader = self.leader();
        let next = if self.rng.unit() >= self.explore {
            leader
        } else {
            // Any other arm, uniformly.
            let other = self.rng.below(ARMS - 1) as u8;
            if other >= leader { other + 1 } else { other }
        };
        if next != last && self.washout > 0 {
            next | SWITCHED
        } else {
            next
        }
    }

    /// A request routed with `arm` saw its first token after `ttft_us`.
    pub fn observe(&self, arm: u8, ttft_us: u32) {
        let i = usize::from(arm);
        if i >= ARMS {
            return;
        }
        let x = f64::from(ttft_us.max(1)).ln();
        let mut guard = self.evidence.lock().unwrap_or_else(|e| e.into_inner());
        let evidence = &mut *guard;
        let open = &mut evidence.open[i];
        open.0 += 1;
        open.1 += x;
        if open.0 < self.epoch_requests {
            return;
        }
        let batch = open.1 / f64::from(open.0);
        *open = (0, 0.0);
        let keep = 1.0 - 1.0 / MEMORY;
        for a in evidence.arms.iter_mut() {
            a.n *= keep;
            a.sum *= keep;
            a.sum_sq *= keep;
        }
        let arms = &mut evidence.arms;
        arms[i].n += 1.0;
        arms[i].sum += batch;
        arms[i].sum_sq += batch * batch;
        let leader = usize::from(self.leader());
        let (l, a) = (arms[leader], arms[i]);
        if i == leader || l.n < MIN_BATCHES || a.n < MIN_BATCHES {
            return;
        }
        if l.mean() - a.mean() > LEAD_MARGIN * (l.mean_variance() + a.mean_variance()).sqrt() {
            self.leader.store(arm, Ordering::Relaxed);
        }
    }

    /// Every arm with batches, for tests and diagnostics: `(arm, geometric
    /// mean TTFT in µs, decayed batches)`.
    pub fn snapshot(&self) -> Vec<(u8, f64, f64)> {
        let evidence = self.evidence.lock().unwrap_or_else(|e| e.into_inner());
        (0..ARMS as u8)
            .zip(evidence.arms.iter())
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

    /// A tuner exploring 0.1 of its epochs (twice the `cost` policy's
    /// default, to keep the tests short), epochs of 32, whose draws follow
    /// `seed`.
    fn seeded(initial_weight: f64, seed: u64) -> WeightBandit {
        WeightBandit::with_rng(initial_weight, 0.1, EPOCH_REQUESTS, Random::with_seed(seed))
    }

    /// A simulated world where arm `k`'s requests wait `ttft(k)` µs, with
    /// multiplicative noise of up to e^±1 (drawn from `seed`); returns how
    /// often the leader changed.
    fn run(bandit: &WeightBandit, seed: u64, requests: usize, ttft: impl Fn(u8) -> f64) -> usize {
        let noise = Random::with_seed(seed ^ 0xabcd);
        let mut changes = 0;
        for _ in 0..requests {
            let before = bandit.leader();
            let Draw { arm, measured } = bandit.draw();
            let jitter = (noise.unit() * 2.0 - 1.0).exp();
            if measured {
                bandit.observe(arm, (ttft(arm) * jitter) as u32);
            }
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
            run(&bandit, seed, 40_000, |k| match k {
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
        // repeated at every batch); it must stay rare.
        let changes: usize = (0..20)
            .map(|seed| run(&seeded(1.0, seed), seed, 40_000, |_| 50_000.0))
            .sum();
        assert!(
            changes <= 20,
            "{changes} changes of leader in 20 runs of 40 000 requests"
        );
    }

    #[test]
    fn the_leader_follows_a_workload_that_changes() {
        for seed in 0..10 {
            let bandit = seeded(1.0, seed);
            run(&bandit, seed, 30_000, |k| if k <= 2 { 30_000.0 } else { 90_000.0 });
            assert!(bandit.leader() <= 2, "seed {seed}: {:?}", bandit.snapshot());
            run(
                &bandit,
                seed + 100,
                60_000,
                |k| if k >= 6 { 30_000.0 } else { 90_000.0 },
            );
            assert!(bandit.leader() >= 6, "seed {seed}: {:?}", bandit.snapshot());
        }
    }

    /// A world where requests interfere: what a request waits depends on
    /// the weights of the 16 requests before it, not its own (a move's
    /// recompute delays the requests batched with it). Weights 8 and 16
    /// hurt; the tuner starts at 16. `washout`: whether the start of a
    /// switched epoch is left out.
    fn interfering(epoch_requests: u32, washout: bool, seed: u64) -> WeightBandit {
        let mut bandit = WeightBandit::with_rng(16.0, 0.5, epoch_requests, Random::with_seed(seed));
        if !washout {
            bandit.washout = 0;
        }
        let noise = Random::with_seed(seed ^ 0xabcd);
        let mut recent = std::collections::VecDeque::from([0.0; 16]);
        for _ in 0..4000 {
            let Draw { arm, measured } = bandit.draw();
            recent.pop_front();
            recent.push_back(match arm {
                8 => 1.0,
                7 => 0.5,
                _ => 0.0,
            });
            let harm = recent.iter().sum::<f64>() / 16.0;
            let jitter = (noise.unit() * 2.0 - 1.0).exp();
            if measured {
                bandit.observe(arm, (20_000.0 * (2.0 * harm).exp() * jitter) as u32);
            }
        }
        bandit
    }

    /// How much worse weight 16's requests looked than those of weights
    /// 1/16 to 2, in `ln(TTFT)`.
    fn gap(bandit: &WeightBandit) -> f64 {
        let means = bandit.snapshot();
        let mean_of = |k: u8| means.iter().find(|m| m.0 == k).map_or(f64::NAN, |m| m.1.ln());
        let others = (0..=5).map(mean_of).sum::<f64>() / 6.0;
        mean_of(8) - others
    }

    #[test]
    fn epochs_see_the_cost_a_weight_puts_on_the_requests_after_it() {
        for seed in 0..10 {
            let by_epoch = interfering(EPOCH_REQUESTS, true, seed);
            assert!(by_epoch.leader() < 7, "seed {seed}: {:?}", by_epoch.snapshot());
            // Per request, every arm shares the harm alike: weight 16
            // looks hardly worse than the others.
            let by_request = interfering(1, true, seed);
            let (epoch_gap, request_gap) = (gap(&by_epoch), gap(&by_request));
            assert!(
                epoch_gap > 0.5 && request_gap < epoch_gap / 3.0,
                "seed {seed}: gap {epoch_gap:.2} by epoch, {request_gap:.2} by request"
            );
        }
    }

    #[test]
    fn an_epoch_that_switches_arms_starts_with_a_washout() {
        // Exploring every epoch: each is another arm than the leader (which
        // stays put without evidence), now and then the same as the last.
        let bandit = WeightBandit::with_rng(1.0, 1.0, 8, Random::with_seed(3));
        let draws: Vec<Draw> = (0..2000).map(|_| bandit.draw()).collect();
        // Runs of one arm: the leader's first epoch, measured whole, then
        // switched epochs of 4 + 8 requests, each perhaps followed by more
        // of the same arm, measured whole.
        let runs: Vec<&[Draw]> = draws.chunk_by(|a, b| a.arm == b.arm).collect();
        assert!(runs[0].iter().all(|d| d.arm == UNIT_ARM && d.measured));
        assert_eq!(runs[0].len(), 8);
        let mut merged = 0;
        for (r, run) in runs.iter().enumerate().skip(1).take(runs.len() - 2) {
            let measured: Vec<bool> = run.iter().map(|d| d.measured).collect();
            assert_eq!(measured[..4], [false; 4], "run {r}");
            assert!(measured[4..].iter().all(|m| *m), "run {r}");
            assert_eq!((run.len() - 12) % 8, 0, "run {r}: {} requests", run.len());
            merged += usize::from(run.len() > 12);
        }
        assert!(merged > 0, "no epoch continued the last one's arm");
        // Never exploring: the leader's epochs follow each other, measured
        // whole.
        let steady = WeightBandit::with_rng(1.0, 0.0, 8, Random::with_seed(3));
        assert!((0..80).map(|_| steady.draw()).all(|d| d.arm == UNIT_ARM && d.measured));
    }

    #[test]
    fn epochs_go_on_under_concurrent_draws() {
        // Eight threads drawing at once; then one, which must still see
        // epochs open and switch (an epoch whose opening draw was slow
        // is opened by the next one past its end).
        let bandit = WeightBandit::with_rng(1.0, 1.0, 8, Random::with_seed(5));
        let measured = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        measured.fetch_add(u64::from(bandit.draw().measured), Ordering::Relaxed);
                    }
                });
            }
        });
        // Epochs of 4 + 8 (8 counted), or 8 when an arm repeats: at least
        // two thirds counted.
        let measured = measured.into_inner();
        assert!(measured >= 80_000 * 2 / 3, "{measured} of 80 000 draws counted");
        let after: Vec<Draw> = (0..120).map(|_| bandit.draw()).collect();
        assert!(after.chunk_by(|a, b| a.arm == b.arm).count() > 3, "{after:?}");
    }

    #[test]
    fn the_washout_widens_the_gap_the_last_arms_carryover_hides() {
        // Without it, an explored epoch right after one of weight 16 (the
        // leader) measures its start, where weight 16's harm lingers, and
        // weight 16's epochs after an explored one measure their start,
        // where it has not built up yet.
        let (mut with, mut without) = (0.0, 0.0);
        for seed in 0..10 {
            with += gap(&interfering(EPOCH_REQUESTS, true, seed));
            without += gap(&interfering(EPOCH_REQUESTS, false, seed));
        }
        // Weight 16's harm, built up, is 2 in ln(TTFT).
        let (with, without) = (with / 10.0, without / 10.0);
        assert!(
            with > 1.9 && without < 0.9 * with,
            "mean gap {with:.2} with the washout, {without:.2} without"
        );
    }

    #[test]
    fn out_of_range_arms_are_ignored() {
        let bandit = WeightBandit::new(1.0, 0.1, EPOCH_REQUESTS);
        bandit.observe(ARMS as u8, 1);
        assert!(bandit.snapshot().is_empty());
    }
}
