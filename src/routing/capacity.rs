//! Learning how many requests each engine runs at once: the **admission
//! limit** the holding policies use when an engine's queue cannot be
//! scraped.
//!
//! `selective_push` and `dual_map` send a request only to a server that is
//! not *full*. With fresh engine metrics, full means the engine has
//! requests waiting (its scraped queue, corrected between scrapes: see
//! [`crate::routing`]). Without them (llama.cpp without `--metrics`,
//! SGLang without `--enable-metrics`, most OpenAI-compatible servers, or a
//! scrape gone stale), the gateway only knows what it sent. It then
//! estimates the engine's queue from the requests in flight and the
//! server's admission limit `L`, so that a server is full with `L` in
//! flight (plus the policy's `max_pending`; see
//! [`crate::routing::Candidate::pending_estimate`]). `L` starts at
//! [`INITIAL_LIMIT`] and is learned online from what each finished request
//! shows, the way an adaptive concurrency limit does (Netflix's
//! concurrency-limits, its `Gradient2` rule).
//!
//! # Signals
//!
//! A response process reads each completion record's [`Timing`] (sent by
//! the dispatcher) with the engine's report, and takes one [`Sample`]:
//!
//! | answer | signal | value |
//! | --- | --- | --- |
//! | streamed | time to first token | the gateway's own measure, from send to the first byte |
//! | not streamed, the engine reports its decode time (llama.cpp's `timings.predicted_ms`) | time to first token | latency − decode time |
//! | not streamed, no such report (vLLM, SGLang, most servers) | time per output token | latency ÷ (output tokens + 1) |
//!
//! Queueing in the engine shows in every one of them: a request that waits
//! behind others is late for its first token, and so for every token
//! after it. Each kind of signal keeps its own averages, so a mix of
//! streamed and non-streamed clients does not compare unlike figures.
//!
//! # Rule
//!
//! Per server and signal, a **baseline** tracks how fast a request is
//! when it does not queue: a low percentile of the samples (it steps 5 %
//! down on a sample below it and 0.1 % up on one above, so it settles
//! where about 2 % fall below it). An average would follow the slow
//! requests of a queue and creep up under it, which is how `Gradient2`'s
//! long average drifts under sustained queueing; this baseline rises by
//! only 10 % over a hundred requests that all queue, while the limit
//! falls. The
//! **present** tracks the recent median the same way (10 % steps up or
//! down), so a few very long requests among many short ones do not read
//! as a queue, while a queue that holds most requests back does. Then,
//! per sample:
//!
//! * `gradient = clamp(tolerance × baseline ÷ present, 0.5, 1)`: 1 while
//!   the present is within [`tolerance`] (4 for TTFT, 1.5 per token) of the
//!   baseline, less as requests slow down;
//! * `L ← (1 − s)·L + s·(L·gradient + a)` with smoothing `s = 0.2`, where
//!   the allowance `a` is `√L` at gradient 1 and 0 below: an engine that
//!   keeps up lets `L` grow by `0.2·√L` per request (`Gradient2`'s queue
//!   allowance), one whose requests slow down loses up to a tenth per
//!   request. (`Gradient2` adds its allowance whatever the gradient, which
//!   balances a gradient below 1: it settles with requests queued in the
//!   engine, twice the baseline here, where the point of holding at the
//!   gateway is to keep them out of it);
//! * unless the request was sent while fewer than `L/2` were in flight
//!   (the limit did not bind, so the sample says nothing about it).
//!
//! **Warming up.** A server's first [`WARMUP`] samples of a signal only
//! set its baseline, to the fastest of them, and judge no sample
//! unslowed: the very first answers are the least telling (a cold engine
//! or gateway, and a burst whose requests reach the engine in another
//! order than the gateway counted them, so that one sent as the sixth in
//! flight may be served first), and one of them taken as the baseline
//! would let queued requests pass as unslowed, with the floor below
//! raised by them for a whole window.
//!
//! **Never below what the engine overlaps.** A request that was sent with
//! `k` requests in flight (itself included) and was clearly not queued
//! (within half the tolerance of the baseline: 2.5× for TTFT, 1.25× per
//! token; a request queued behind others waits for a whole service time)
//! shows that the engine runs `k` at once. `L` never falls below the
//! largest such `k` seen in the last [`FLOOR_WINDOW`] to 2 ×
//! [`FLOOR_WINDOW`] samples. This is what keeps the limit up on an engine
//! whose requests vary so much in size that the present runs far above
//! the baseline without any queue: the fast ones keep showing the
//! concurrency it sustains.
//!
//! **An engine that says.** llama.cpp's `llama-server` runs at most its
//! `--parallel` slots at once and reports them (`/props` `total_slots`).
//! The health checker reads that once per registration
//! ([`crate::health`]); for such a server the policies take the reported
//! number as `L` and nothing is learned.
//!
//! `L` lives in the server's slot of the shm server table
//! ([`shm_layout::ServerTable::adjust_admission_limit`]): each response
//! process adjusts it atomically from the samples it reads, and every
//! dispatcher's policy reads it. It belongs to one registration: a server
//! re-registered starts again from [`INITIAL_LIMIT`]. `semlb status` and
//! the admin API show it, and `semlb_admission_limit{server}` exports it.

use shm_layout::{ServerRef, ServerTable, Timing};

/// A server's admission limit before anything was learned of it: high
/// enough that a gateway that has not learned yet does not starve an
/// engine (the cost of too high a limit is only what a policy that does
/// not hold pays: requests queue in the engine).
pub const INITIAL_LIMIT: u32 = 8;

/// The lowest limit learned.
pub const MIN_LIMIT: f32 = 1.0;

/// The highest limit learned.
pub const MAX_LIMIT: f32 = 4096.0;

/// How much slower than the baseline the present may be before the limit
/// shrinks, and a sample before it counts as slowed, per signal.
///
/// * Time to first token: 4. Without a queue it varies several-fold with
///   the uncached part of the prompt (a cached conversation's next turn
///   against a new long prompt), and a request queued behind a busy batch
///   waits for a whole answer, usually tens of times its TTFT.
/// * Time per output token: 1.5. It varies less (every token costs a
///   decode step), and one answer's wait in a queue doubles it.
pub const fn tolerance(signal: Signal) -> f64 {
    match signal {
        Signal::Ttft => 4.0,
        Signal::PerToken => 1.5,
    }
}

/// Samples over which a server's overlap floor is kept (see the module
/// docs).
pub const FLOOR_WINDOW: u32 = 512;

/// Samples of a signal that only set a server's baseline (see the module
/// docs).
pub const WARMUP: u32 = 16;

/// Weight of the new target in each step.
const SMOOTHING: f64 = 0.2;

/// The baseline's relative step down, per sample below it.
const BASE_DOWN: f64 = 0.05;

/// The baseline's relative step up, per sample above it: a fiftieth of
/// the step down, so it settles where about 2 % of the samples fall below
/// it, and rises by only 10 % over a hundred samples that all queue.
const BASE_UP: f64 = 0.001;

/// The present's relative step per sample (it tracks the recent median).
const PRESENT_STEP: f64 = 0.1;

/// Which measure a sample is (each kind has its own averages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Time to first token.
    Ttft = 0,
    /// Latency per output token.
    PerToken = 1,
}

/// One finished request, as the limit learns from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Which measure.
    pub signal: Signal,
    /// Its value, in milliseconds.
    pub ms: f64,
    /// Requests in flight to the server when it was sent, itself included.
    pub inflight: u32,
}

impl Sample {
    /// The sample of a request that took `timing`, generated
    /// `output_tokens` tokens (0: unknown) and whose engine reported
    /// `decode_us` of generation after its first token (see the table in
    /// the module docs); `None` when neither signal can be read.
    pub fn of(timing: &Timing, output_tokens: u32, decode_us: Option<u64>) -> Option<Self> {
        let ms = |us: u64| us as f64 / 1000.0;
        let latency = u64::from(timing.latency_us);
        let (signal, value) = match (timing.first_byte_us, decode_us) {
            (Some(first), _) => (Signal::Ttft, ms(u64::from(first))),
            (None, Some(decode)) => (Signal::Ttft, ms(latency.saturating_sub(decode))),
            (None, None) if output_tokens > 0 => (Signal::PerToken, ms(latency) / (f64::from(output_tokens) + 1.0)),
            (None, None) => return None,
        };
        Some(Self {
            signal,
            ms: value,
            inflight: timing.inflight_at_send.max(1),
        })
    }
}

/// What one process has seen of one server registration.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    generation: u32,
    /// Per [`Signal`]: (baseline, present), once sampled.
    averages: [Option<(f64, f64)>; 2],
    /// Per [`Signal`]: samples taken, up to [`WARMUP`].
    taken: [u32; 2],
    /// The overlap floor: the largest unslowed concurrency in the current
    /// window, and in the previous one.
    floor: (u32, u32),
    /// Samples in the current floor window.
    window: u32,
}

impl Seen {
    /// Takes `sample` into the baseline and the present; returns the
    /// gradient and whether the sample was clearly not queued (within half
    /// the [`tolerance`] of the baseline: `1 + (tolerance − 1) / 2`; never
    /// while warming up).
    fn average(&mut self, sample: &Sample) -> (f64, bool) {
        let x = sample.ms.max(1e-3);
        let taken = &mut self.taken[sample.signal as usize];
        let warm = *taken >= WARMUP;
        *taken = (*taken + 1).min(WARMUP);
        let (base, short) = self.averages[sample.signal as usize].get_or_insert((x, x));
        *base = if !warm {
            base.min(x)
        } else if x <= *base {
            *base * (-BASE_DOWN).exp()
        } else {
            *base * BASE_UP.exp()
        };
        *short *= if x > *short {
            PRESENT_STEP.exp()
        } else {
            (-PRESENT_STEP).exp()
        };
        let tolerance = tolerance(sample.signal);
        let gradient = (tolerance * *base / *short).clamp(0.5, 1.0);
        (gradient, warm && x <= (1.0 + (tolerance - 1.0) / 2.0) * *base)
    }

    /// Raises the overlap floor with an unslowed sample's concurrency and
    /// turns the window; returns the floor.
    fn floor(&mut self, unslowed: Option<u32>) -> u32 {
        if let Some(k) = unslowed {
            self.floor.0 = self.floor.0.max(k);
        }
        self.window += 1;
        if self.window >= FLOOR_WINDOW {
            self.floor = (0, self.floor.0);
            self.window = 0;
        }
        self.floor.0.max(self.floor.1)
    }
}

/// The next limit after `limit`, for a sample with `gradient` sent with
/// `inflight` requests in flight, never below `floor` (see the module
/// docs).
pub fn next_limit(limit: f64, gradient: f64, inflight: u32, floor: u32, unslowed: bool) -> f64 {
    let floor = f64::from(floor).max(f64::from(MIN_LIMIT));
    if f64::from(inflight) < limit / 2.0 {
        return limit.max(floor);
    }
    // Sent at the limit and not slowed: the limit is not too high.
    let gradient = if unslowed && f64::from(inflight) >= limit.round() {
        1.0
    } else {
        gradient
    };
    let allowance = if gradient >= 1.0 { limit.sqrt() } else { 0.0 };
    let target = limit * gradient + allowance;
    ((1.0 - SMOOTHING) * limit + SMOOTHING * target).clamp(floor, f64::from(MAX_LIMIT))
}

/// One response process's learning of every server's admission limit.
#[derive(Debug)]
pub struct CapacityLearner {
    /// Per server slot.
    seen: Vec<Seen>,
}

impl Default for CapacityLearner {
    fn default() -> Self {
        Self::new()
    }
}

impl CapacityLearner {
    /// Nothing seen yet.
    pub fn new() -> Self {
        Self {
            seen: vec![Seen::default(); shm_layout::SERVER_SLOTS as usize],
        }
    }

    /// Learns from `sample` of `server` and adjusts its limit in `servers`;
    /// returns the limit now stored (`None` if `server` is no longer
    /// current).
    pub fn observe(&mut self, servers: &ServerTable<'_>, server: ServerRef, sample: &Sample) -> Option<f32> {
        let seen = self.seen.get_mut(usize::from(server.slot))?;
        if seen.generation != server.generation {
            *seen = Seen {
                generation: server.generation,
                ..Seen::default()
            };
        }
        let (gradient, unslowed) = seen.average(sample);
        let floor = seen.floor(unslowed.then_some(sample.inflight));
        servers.adjust_admission_limit(server, |old| {
            let limit = old.map_or(f64::from(INITIAL_LIMIT), f64::from);
            next_limit(limit, gradient, sample.inflight, floor, unslowed) as f32
        })
    }
}

/// The limit a policy uses for a server: the learned one (rounded, at
/// least 1), else [`INITIAL_LIMIT`].
pub fn effective_limit(learned: Option<f32>) -> u32 {
    learned.map_or(INITIAL_LIMIT, |l| l.round().clamp(MIN_LIMIT, MAX_LIMIT) as u32)
}

/// Where a server's admission limit comes from: the one place that
/// decides between its engine's word and what was learned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// Its engine said how many it runs at once (llama.cpp's slots).
    Reported(u32),
    /// Learned from the latencies ([`CapacityLearner`]).
    Learned(f32),
    /// Nothing yet: [`INITIAL_LIMIT`].
    Initial,
}

impl Admission {
    /// The engine's slots if it said, else the learned limit, if any.
    pub fn of(engine_slots: Option<u32>, learned: Option<f32>) -> Self {
        match (engine_slots, learned) {
            (Some(slots), _) => Self::Reported(slots),
            (None, Some(l)) => Self::Learned(l),
            (None, None) => Self::Initial,
        }
    }

    /// The limit as a policy uses it (whole requests, at least 1).
    pub fn limit(self) -> u32 {
        match self {
            Self::Reported(slots) => slots,
            Self::Learned(l) => effective_limit(Some(l)),
            Self::Initial => INITIAL_LIMIT,
        }
    }

    /// The limit as exported, a learned one unrounded.
    pub fn value(self) -> f64 {
        match self {
            Self::Reported(slots) => f64::from(slots),
            Self::Learned(l) => f64::from(l),
            Self::Initial => f64::from(INITIAL_LIMIT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::{LayoutPlan, Segment};

    fn timing(latency_ms: u32, first_byte_ms: Option<u32>, inflight: u32) -> Timing {
        Timing {
            latency_us: latency_ms * 1000,
            first_byte_us: first_byte_ms.map(|m| m * 1000),
            inflight_at_send: inflight,
        }
    }

    #[test]
    fn a_sample_reads_the_best_signal_the_answer_has() {
        let streamed = Sample::of(&timing(900, Some(40), 3), 20, None).unwrap();
        assert_eq!(
            (streamed.signal, streamed.ms, streamed.inflight),
            (Signal::Ttft, 40.0, 3)
        );
        let llama = Sample::of(&timing(900, None, 2), 20, Some(850_000)).unwrap();
        assert_eq!((llama.signal, llama.ms), (Signal::Ttft, 50.0));
        let plain = Sample::of(&timing(900, None, 0), 29, None).unwrap();
        assert_eq!((plain.signal, plain.ms, plain.inflight), (Signal::PerToken, 30.0, 1));
        assert_eq!(Sample::of(&timing(900, None, 1), 0, None), None);
    }

    #[test]
    fn the_step_grows_when_the_limit_binds_shrinks_when_slowed_and_keeps_the_floor() {
        // Bound and keeping up: grows by 0.2·√L.
        assert!((next_limit(16.0, 1.0, 16, 0, false) - 16.8).abs() < 1e-9);
        // Not bound (fewer than L/2 in flight): unchanged.
        assert_eq!(next_limit(16.0, 1.0, 7, 0, false), 16.0);
        assert_eq!(next_limit(16.0, 0.5, 7, 0, false), 16.0);
        // Slowed: shrinks by a tenth at gradient 0.5, by 5 % at 0.75,
        // down to 1.
        assert!((next_limit(16.0, 0.5, 16, 0, false) - 14.4).abs() < 1e-9);
        assert!((next_limit(4.0, 0.5, 4, 0, false) - 3.6).abs() < 1e-9);
        assert!((next_limit(4.0, 0.75, 4, 0, false) - 3.8).abs() < 1e-9);
        // Never below what the engine was seen to overlap, nor 1.
        assert_eq!(next_limit(4.0, 0.5, 4, 6, false), 6.0);
        assert_eq!(next_limit(1.0, 0.5, 1, 0, false), 1.0);
        // A request sent at the limit came back unslowed: the limit may
        // go up, whatever the present says.
        assert!((next_limit(16.0, 0.5, 16, 0, true) - 16.8).abs() < 1e-9);
        assert!((next_limit(16.0, 0.5, 15, 0, true) - 14.4).abs() < 1e-9);
        assert_eq!(
            next_limit(f64::from(MAX_LIMIT), 1.0, 5000, 0, true),
            f64::from(MAX_LIMIT)
        );
        assert_eq!(effective_limit(None), INITIAL_LIMIT);
        assert_eq!((effective_limit(Some(5.4)), effective_limit(Some(0.2))), (5, 1));
    }

    /// An engine that runs `overlap` requests at once and queues the rest,
    /// fed `inflight` at a time (the first requests of the burst go out
    /// one after the other, as a gateway that starts sends them). Its TTFT
    /// is 20 ms while `inflight ≤ overlap` and grows by a whole service
    /// time (200 ms) per request queued; its latency per output token is
    /// 10 ms, plus as much again per request queued. Each sample is scaled
    /// by the next of `jitters` (requests of different sizes). The
    /// samples of `prelude` come first.
    fn converge(signal: Signal, overlap: u32, inflight: u32, jitters: &[f64], prelude: &[Sample]) -> f32 {
        let segment = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let tables = segment.tables();
        let server = tables.servers.register(1, "http://engine", 0).unwrap();
        let mut learner = CapacityLearner::new();
        let mut limit = INITIAL_LIMIT as f32;
        for sample in prelude {
            limit = learner.observe(&tables.servers, server, sample).unwrap();
        }
        for i in 0..2000 {
            // The gateway keeps up to the limit in flight (and the load
            // offered).
            let k = inflight.min(effective_limit(Some(limit))).min(i as u32 + 1);
            let queued = f64::from(k.saturating_sub(overlap));
            let ms = match signal {
                Signal::Ttft => 20.0 + 200.0 * queued,
                Signal::PerToken => 10.0 * (1.0 + queued),
            } * jitters[i % jitters.len()];
            let sample = Sample {
                signal,
                ms,
                inflight: k,
            };
            limit = learner.observe(&tables.servers, server, &sample).unwrap();
        }
        limit
    }

    #[test]
    fn the_limit_rises_to_an_engine_that_keeps_up_and_settles_near_one_that_queues() {
        // Requests of similar sizes, and of very different ones (cached
        // prompts and long new ones: the mean runs far above the baseline
        // with no queue at all, yet the fast ones show what the engine
        // sustains).
        const MILD: [f64; 4] = [0.8, 1.0, 1.3, 0.9];
        const WILD: [f64; 7] = [0.7, 9.0, 1.0, 4.0, 0.8, 12.0, 2.0];
        for (signal, jitters) in [
            (Signal::Ttft, &MILD[..]),
            (Signal::Ttft, &WILD),
            (Signal::PerToken, &MILD),
        ] {
            let case = format!("{signal:?}, jitters {jitters:?}");
            // A batching engine that never queues at this load: the
            // limit climbs past the initial one, to what is offered.
            let batching = converge(signal, 256, 64, jitters, &[]);
            assert!(batching >= 60.0, "{case}: learned {batching} for a batching engine");
            // An engine that runs 4 at once: the limit settles near 4,
            // not far above (requests would queue in it) nor below
            // (throughput would be lost).
            let four = converge(signal, 4, 64, jitters, &[]);
            assert!((3.5..=6.0).contains(&four), "{case}: learned {four} for 4 at once");
            // A serial engine: near 1.
            let serial = converge(signal, 1, 64, jitters, &[]);
            assert!(
                (1.0..=2.5).contains(&serial),
                "{case}: learned {serial} for a serial engine"
            );
        }
    }

    #[test]
    fn the_first_answers_set_the_baseline_and_raise_no_floor() {
        // A cold start on an engine that runs 2 at once: the burst's
        // first answers are slow, and one sent as the sixth in flight
        // reached the engine first and came back as fast as any (as it
        // does when two dispatchers race). Neither may hold the limit up.
        let cold = |ms, inflight| Sample {
            signal: Signal::PerToken,
            ms,
            inflight,
        };
        let burst = [cold(30.0, 1), cold(10.0, 6), cold(25.0, 2), cold(28.0, 3)];
        let learned = converge(Signal::PerToken, 2, 10, &[1.0], &burst);
        assert!((2.0..=3.0).contains(&learned), "learned {learned} for 2 at once");
    }
}
