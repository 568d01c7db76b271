//! Rate limits every process charges: one token bucket per key (a tenant's
//! requests per minute, a model's tokens per minute, ...), each one
//! self-validating 128-bit slot changed by one compare-and-swap.
//!
//! # The bucket: GCRA
//!
//! A limit of `L` units per period `P` is kept as the generic cell rate
//! algorithm keeps it: one number, the *theoretical arrival time* `tat`,
//! the time at which the bucket would be full again. A unit costs
//! `T = P / L`; the bucket holds a whole period's worth (`τ = P`, a burst of
//! `L`). Charging `n` units at time `now`:
//!
//! ```text
//! tat' = max(tat, now) + n·T
//! allowed  iff  tat' − now ≤ τ          (else: retry after tat' − now − τ)
//! remaining = ⌊(τ − (tat' − now)) / T⌋,  full again at tat'
//! ```
//!
//! So a bucket is one `u64`, and every charge is one CAS of its slot: no
//! multi-word state a killed process could leave half-written, nothing to
//! reclaim after a crash (a charge either happened or did not), and no
//! lock. Times are nanoseconds of the segment's clock
//! ([`crate::SegmentClock::now_ns`]), which every process shares.
//!
//! # Slots
//!
//! The region is 64-byte buckets of four 128-bit slots, as the prefix table
//! ([`crate::bucket`]): `tat` in the high half, and the key bound to it by
//! the segment-keyed fingerprint in the low half. A key lives in one of the
//! eight slots of its home bucket and the next. A slot whose `tat` has
//! passed is a full bucket, the same as no slot: it is reused first. With
//! all eight slots live, a take for a key that has none is refused until
//! the nearest of them is full again (`Taken::Limited`, its retry the
//! wait): replacing a live bucket would start its key again from full,
//! and keys evicting each other would be given many times their limits.
//! Charges and refunds after the fact (debt, a reservation given back)
//! still replace the live slot nearest to full.
//!
//! A slot with flipped bits no longer matches its key and reads as absent:
//! that key starts again from a full bucket (the limit fails open for at
//! most one period; it never blocks a caller for good). A `tat` further
//! ahead than any charge can put it (`now + (1 + DEBT_PERIODS)·τ`) is
//! treated the same way.
//!
//! # Debt
//!
//! Output tokens are charged when an answer ends, room or not
//! ([`LimitTable::charge`]): a bucket may go into debt, up to
//! [`DEBT_PERIODS`] periods beyond empty (an hour of a per-minute limit),
//! and every take waits it out. The cap only bounds how long one bucket
//! can be shut; with output reserved at admission (`semlb`'s rate limits)
//! a bucket goes into debt only by what answers produced beyond their
//! reservations.

use crate::bucket::{Bucket, SlotCodec, WAYS, bucket_index};
use crate::sync::Ordering;

/// Buckets probed for a key: its home bucket and the next.
const PROBE_BUCKETS: usize = 2;

/// Periods a bucket may be charged beyond empty ([`LimitTable::charge`]).
pub const DEBT_PERIODS: u64 = 60;

/// How far ahead of `now_ns` a believable `tat` of `quota` may be: a
/// bucket empty and [`DEBT_PERIODS`] periods in debt.
fn horizon(quota: Quota, now_ns: u64) -> u64 {
    now_ns.saturating_add(quota.period_ns.saturating_mul(DEBT_PERIODS + 1))
}

/// A limit: `limit` units per `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Units per period (at least 1).
    pub limit: u64,
    /// The period, in nanoseconds (at least 1).
    pub period_ns: u64,
}

impl Quota {
    /// `limit` units per minute.
    pub const fn per_minute(limit: u64) -> Self {
        Self {
            limit,
            period_ns: 60_000_000_000,
        }
    }

    /// The cost of `n` units, in nanoseconds of bucket (`n · P / L`,
    /// rounded up; saturating).
    fn cost(self, n: u64) -> u64 {
        let limit = u128::from(self.limit.max(1));
        let ns = (u128::from(n) * u128::from(self.period_ns)).div_ceil(limit);
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// The bucket that will be full again in `ahead` ns (what a store
    /// keeping `tat` elsewhere reports).
    pub fn state(self, ahead: u64) -> BucketState {
        BucketState {
            remaining: self.remaining(ahead),
            reset_ns: ahead,
        }
    }

    /// The units a bucket holds when it will be full again in `ahead` ns.
    fn remaining(self, ahead: u64) -> u64 {
        let room = self.period_ns.saturating_sub(ahead);
        u64::try_from(u128::from(room) * u128::from(self.limit) / u128::from(self.period_ns.max(1))).unwrap_or(0)
    }
}

/// What a bucket says now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    /// Units it could still give.
    pub remaining: u64,
    /// Nanoseconds until it is full again.
    pub reset_ns: u64,
}

/// The outcome of [`LimitTable::take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// Charged; the bucket after the charge.
    Allowed(BucketState),
    /// Not charged: the bucket has not room for them now; it will in
    /// `retry_after_ns`.
    Limited {
        /// The bucket as it is.
        state: BucketState,
        /// When `n` units will fit.
        retry_after_ns: u64,
    },
    /// Not charged: more units than the bucket ever holds.
    TooLarge,
}

/// The shared table of rate-limit buckets.
#[derive(Debug, Clone, Copy)]
pub struct LimitTable<'a> {
    buckets: &'a [Bucket],
    codec: SlotCodec,
}

impl<'a> LimitTable<'a> {
    /// The table over `buckets` (zeroed: empty), fingerprints keyed by
    /// `seed`.
    pub(crate) fn new(buckets: &'a [Bucket], seed: u64) -> Self {
        Self {
            buckets,
            codec: SlotCodec::new(seed),
        }
    }

    /// Slots in the table.
    pub fn capacity(&self) -> usize {
        self.buckets.len() * WAYS
    }

    /// Charges `n` units to `key`'s bucket under `quota` at `now_ns` if it
    /// has room for them (`n = 0` only reads it).
    pub fn take(&self, key: u64, quota: Quota, n: u64, now_ns: u64) -> Taken {
        let period = quota.period_ns;
        if n > quota.limit {
            return Taken::TooLarge;
        }
        let mut verdict = Taken::TooLarge;
        let full = self.update_or_wait(key, quota, now_ns, false, |tat| {
            let start = tat.max(now_ns);
            let new = start.saturating_add(quota.cost(n));
            let ahead = new - now_ns;
            if ahead <= period {
                verdict = Taken::Allowed(BucketState {
                    remaining: quota.remaining(ahead),
                    reset_ns: ahead,
                });
                Some(new)
            } else {
                let ahead_now = start - now_ns;
                verdict = Taken::Limited {
                    state: BucketState {
                        remaining: quota.remaining(ahead_now),
                        reset_ns: ahead_now,
                    },
                    retry_after_ns: ahead - period,
                };
                None
            }
        });
        // Its window is full of other live buckets: it waits for the
        // nearest to be full again, rather than taking that key's slot
        // (which would start that key again from a full bucket).
        if let Some(wait) = full {
            return Taken::Limited {
                state: BucketState {
                    remaining: 0,
                    reset_ns: wait,
                },
                retry_after_ns: wait.max(1),
            };
        }
        verdict
    }

    /// Charges `n` units to `key`'s bucket whether it has room or not (the
    /// output tokens of an answer already given): the bucket may go into
    /// debt, up to [`DEBT_PERIODS`] periods beyond empty, and the next
    /// takes wait it out. Returns the bucket after the charge.
    pub fn charge(&self, key: u64, quota: Quota, n: u64, now_ns: u64) -> BucketState {
        let mut state = BucketState {
            remaining: 0,
            reset_ns: 0,
        };
        let cap = horizon(quota, now_ns) - now_ns;
        self.update(key, quota, now_ns, |tat| {
            let new = tat.max(now_ns).saturating_add(quota.cost(n));
            let ahead = (new - now_ns).min(cap);
            state = BucketState {
                remaining: quota.remaining(ahead),
                reset_ns: ahead,
            };
            Some(now_ns + ahead)
        });
        state
    }

    /// Gives back `n` units a [`take`](Self::take) charged (a request
    /// refused by another of its limits): `tat` moves back by their cost,
    /// never before `now_ns` (a bucket is never fuller than full). An
    /// absent or full bucket is left as it is.
    pub fn refund(&self, key: u64, quota: Quota, n: u64, now_ns: u64) {
        self.update(key, quota, now_ns, |tat| {
            (tat > now_ns).then(|| tat.saturating_sub(quota.cost(n)).max(now_ns))
        });
    }

    /// `key`'s bucket now, unchanged.
    pub fn peek(&self, key: u64, quota: Quota, now_ns: u64) -> BucketState {
        let tat = self.find(key, quota, now_ns).map_or(now_ns, |(_, _, tat)| tat);
        let ahead = tat.saturating_sub(now_ns);
        BucketState {
            remaining: quota.remaining(ahead),
            reset_ns: ahead,
        }
    }

    /// Live buckets (not full) at `now_ns`, and slots in use by any.
    pub fn occupancy(&self, now_ns: u64) -> (usize, usize) {
        let mut live = 0;
        let mut used = 0;
        for b in self.buckets {
            for slot in b.load() {
                if let Some((_, tat)) = self.codec.unpack(slot) {
                    used += 1;
                    live += usize::from(tat > now_ns);
                }
            }
        }
        (live, used)
    }

    /// Empties the table (the admin's reset); returns the slots cleared.
    pub fn clear(&self) -> usize {
        let mut cleared = 0;
        for b in self.buckets {
            for i in 0..WAYS {
                if b.slots[i].swap_zero() != 0 {
                    cleared += 1;
                }
            }
        }
        cleared
    }

    /// The slot holding `key` with a believable `tat`: (bucket, way, tat).
    fn find(&self, key: u64, quota: Quota, now_ns: u64) -> Option<(usize, usize, u64)> {
        let n = self.buckets.len();
        let home = bucket_index(key, n);
        let horizon = horizon(quota, now_ns);
        (0..PROBE_BUCKETS.min(n)).find_map(|p| {
            let b = (home + p) % n;
            let slots = self.buckets[b].load();
            (0..WAYS).find_map(|w| {
                self.codec
                    .value_for(slots[w], key)
                    .filter(|tat| *tat <= horizon)
                    .map(|tat| (b, w, tat))
            })
        })
    }

    /// Applies `next` (old `tat`, or `now_ns` for a new or full bucket →
    /// the new `tat`, or `None` to leave it) to `key`'s bucket with a CAS,
    /// again on a lost race.
    fn update(&self, key: u64, quota: Quota, now_ns: u64, next: impl FnMut(u64) -> Option<u64>) {
        self.update_or_wait(key, quota, now_ns, true, next);
    }

    /// [`update`](Self::update); without `evict`, a key without a slot
    /// whose window holds only other live buckets takes none: `Some(ns)`,
    /// how long until the nearest of them is full again (and reusable).
    fn update_or_wait(
        &self,
        key: u64,
        quota: Quota,
        now_ns: u64,
        evict: bool,
        mut next: impl FnMut(u64) -> Option<u64>,
    ) -> Option<u64> {
        let n = self.buckets.len();
        if n == 0 {
            return None;
        }
        let home = bucket_index(key, n);
        loop {
            // Its own slot, else the first free or full one, else the live
            // one nearest to full.
            let mut own = None;
            let mut free = None;
            let mut nearest: Option<(usize, usize, u128, u64)> = None;
            let horizon = horizon(quota, now_ns);
            'probe: for p in 0..PROBE_BUCKETS.min(n) {
                let b = (home + p) % n;
                let slots = self.buckets[b].load();
                for (w, &slot) in slots.iter().enumerate() {
                    if let Some(tat) = self.codec.value_for(slot, key).filter(|t| *t <= horizon) {
                        own = Some((b, w, slot, tat));
                        break 'probe;
                    }
                    match self.codec.unpack(slot) {
                        None => free = free.or(Some((b, w, slot))),
                        Some((_, tat)) if tat <= now_ns => free = free.or(Some((b, w, slot))),
                        Some((_, tat)) => {
                            if nearest.is_none_or(|(_, _, _, t)| tat < t) {
                                nearest = Some((b, w, slot, tat));
                            }
                        }
                    }
                }
            }
            let (b, w, old, tat) = match (own, free, nearest) {
                (Some(own), _, _) => own,
                (None, Some((b, w, slot)), _) => (b, w, slot, now_ns),
                (None, None, Some((_, _, _, tat))) if !evict => return Some(tat - now_ns),
                (None, None, Some((b, w, slot, _))) => (b, w, slot, now_ns),
                (None, None, None) => return None,
            };
            let new = next(tat)?;
            // A zero tat would read as an empty slot: time starts at 1 ns.
            if self.buckets[b].cas(w, old, self.codec.pack(key, new.max(1))) {
                return None;
            }
        }
    }
}

/// A slot set to zero, returning what it held (for [`LimitTable::clear`]).
trait SwapZero {
    fn swap_zero(&self) -> u128;
}

impl SwapZero for crate::sync::AtomicU128 {
    fn swap_zero(&self) -> u128 {
        let mut current = self.load(Ordering::Acquire);
        while current != 0 {
            match self.compare_exchange(current, 0, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return current,
                Err(seen) => current = seen,
            }
        }
        0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn table(buckets: usize) -> (Vec<Bucket>, u64) {
        ((0..buckets).map(|_| Bucket::new()).collect(), 0x5eed)
    }

    #[test]
    fn a_bucket_gives_its_limit_then_refills_at_its_rate() {
        let (b, seed) = table(64);
        let t = LimitTable::new(&b, seed);
        let q = Quota::per_minute(60); // one a second
        let now = 1000 * SEC;
        for i in 0..60 {
            match t.take(7, q, 1, now) {
                Taken::Allowed(s) => assert_eq!(s.remaining, 59 - i, "take {i}"),
                other => panic!("take {i}: {other:?}"),
            }
        }
        let Taken::Limited { state, retry_after_ns } = t.take(7, q, 1, now) else {
            panic!("the 61st")
        };
        assert_eq!((state.remaining, retry_after_ns, state.reset_ns), (0, SEC, 60 * SEC));
        // Half a second later: still not; a second later: one more.
        assert!(matches!(t.take(7, q, 1, now + SEC / 2), Taken::Limited { .. }));
        assert!(matches!(t.take(7, q, 1, now + SEC), Taken::Allowed(s) if s.remaining == 0));
        // Other keys are their own buckets.
        assert!(matches!(t.take(8, q, 60, now), Taken::Allowed(s) if s.remaining == 0));
        assert_eq!(t.take(9, q, 61, now), Taken::TooLarge);
        // A minute of quiet: full again.
        assert_eq!(t.peek(7, q, now + 61 * SEC).remaining, 60);
        assert!(matches!(t.take(7, q, 60, now + 61 * SEC), Taken::Allowed(_)));
    }

    #[test]
    fn a_refund_gives_back_what_a_take_charged_and_never_more_than_full() {
        let (b, seed) = table(8);
        let t = LimitTable::new(&b, seed);
        let q = Quota::per_minute(100);
        let now = 7 * SEC;
        assert!(matches!(t.take(3, q, 30, now), Taken::Allowed(s) if s.remaining == 70));
        t.refund(3, q, 10, now);
        assert_eq!(t.peek(3, q, now).remaining, 80);
        t.refund(3, q, 500, now);
        assert_eq!(
            t.peek(3, q, now),
            BucketState {
                remaining: 100,
                reset_ns: 0
            }
        );
        // An absent key is not written.
        t.refund(4, q, 5, now);
        assert_eq!(t.occupancy(now).1, 1);
    }

    #[test]
    fn a_charge_after_the_fact_may_go_into_debt_up_to_its_cap() {
        let (b, seed) = table(8);
        let t = LimitTable::new(&b, seed);
        let q = Quota::per_minute(1000);
        let now = 5 * SEC;
        assert!(matches!(t.take(1, q, 900, now), Taken::Allowed(s) if s.remaining == 100));
        let s = t.charge(1, q, 500, now);
        assert_eq!((s.remaining, s.reset_ns), (0, 84 * SEC));
        // 400 tokens of debt: nothing for the next 24 s, then a little.
        let Taken::Limited { retry_after_ns, .. } = t.take(1, q, 1, now) else {
            panic!()
        };
        assert_eq!(retry_after_ns, 24 * SEC + 60_000_000);
        // 30 periods of output beyond the reservations: 30 periods shut.
        let big = t.charge(1, q, 30_000, now);
        assert_eq!(big.reset_ns, 84 * SEC + 1800 * SEC);
        assert!(matches!(t.take(1, q, 1, now + 1800 * SEC), Taken::Limited { .. }));
        assert!(matches!(t.take(1, q, 1, now + 1825 * SEC), Taken::Allowed(_)));
        let huge = t.charge(1, q, u64::MAX, now);
        let cap = (DEBT_PERIODS + 1) * 60 * SEC;
        assert_eq!(huge.reset_ns, cap, "capped at DEBT_PERIODS of debt");
        // Shut until a period before the end of the debt.
        assert!(matches!(t.take(1, q, 1, now + cap - 61 * SEC), Taken::Limited { .. }));
        assert!(matches!(t.take(1, q, 1, now + cap - 59 * SEC), Taken::Allowed(_)));
    }

    #[test]
    fn a_full_window_makes_a_new_key_wait_and_never_restarts_a_live_one() {
        let (b, seed) = table(1);
        let t = LimitTable::new(&b, seed);
        let q = Quota::per_minute(10);
        let now = SEC;
        // One bucket of 4 ways (and no second to probe): keys 1..=4 fill it.
        for k in 1..=4 {
            assert!(matches!(t.take(k, q, k, now), Taken::Allowed(_)));
        }
        assert_eq!(t.occupancy(now), (4, 4));
        // A fifth key waits for the way nearest to full (key 1: 1 unit
        // used, full again in 6 s) instead of taking it.
        let Taken::Limited { retry_after_ns, .. } = t.take(5, q, 1, now) else {
            panic!("a fifth key let in over a live bucket")
        };
        assert_eq!(retry_after_ns, 6 * SEC);
        assert_eq!(t.peek(1, q, now).remaining, 9, "key 1 kept its use");
        assert!(
            matches!(t.take(5, q, 1, now + 6 * SEC), Taken::Allowed(_)),
            "then it has room"
        );
        // Keys that would evict each other are never given more than their
        // limit: nine keys, four ways, ten units each, tried again and again.
        let (b, seed) = table(1);
        let t = LimitTable::new(&b, seed);
        let mut given = [0u64; 9];
        for _ in 0..5 {
            for (k, g) in given.iter_mut().enumerate() {
                while matches!(t.take(100 + k as u64, q, 1, now), Taken::Allowed(_)) {
                    *g += 1;
                }
            }
        }
        assert!(given.iter().all(|g| *g <= 10), "{given:?}");
        // Charges after the fact still find a slot (debt is recorded).
        t.charge(200, q, 3, now);
        assert_eq!(t.peek(200, q, now).remaining, 7);
        let (b, seed) = table(1);
        let t = LimitTable::new(&b, seed);
        for k in 1..=4 {
            assert!(matches!(t.take(k, q, k, now), Taken::Allowed(_)));
        }
        // Once they are full again, any key finds room.
        assert_eq!(t.occupancy(now + 61 * SEC).0, 0);
        assert!(matches!(t.take(6, q, 10, now + 61 * SEC), Taken::Allowed(_)));
        assert_eq!(t.clear(), 4);
        assert_eq!(t.occupancy(now), (0, 0));
    }

    #[test]
    fn flipped_bits_read_as_a_full_bucket_never_a_stuck_one() {
        let (b, seed) = table(16);
        let t = LimitTable::new(&b, seed);
        let q = Quota::per_minute(5);
        let now = SEC;
        assert!(matches!(t.take(3, q, 5, now), Taken::Allowed(_)));
        assert!(matches!(t.take(3, q, 1, now), Taken::Limited { .. }));
        let home = bucket_index(3, b.len());
        for bit in [3u32, 70, 127] {
            let slots = &b[home].slots;
            let (w, v) = (0..WAYS)
                .map(|w| (w, slots[w].load(Ordering::Relaxed)))
                .find(|(_, v)| *v != 0)
                .unwrap();
            slots[w].store(v ^ (1u128 << bit), Ordering::Relaxed);
            assert_eq!(t.peek(3, q, now).remaining, 5, "bit {bit}: fails open");
            slots[w].store(v, Ordering::Relaxed);
        }
        // A tat further ahead than any charge puts it is not believed.
        let far = SlotCodec::new(seed).pack(3, now + (DEBT_PERIODS + 2) * 60 * SEC);
        let w = (0..WAYS)
            .find(|w| b[home].slots[*w].load(Ordering::Relaxed) != 0)
            .unwrap();
        b[home].slots[w].store(far, Ordering::Relaxed);
        assert_eq!(t.peek(3, q, now).remaining, 5);
        assert!(matches!(t.take(3, q, 1, now), Taken::Allowed(_)));
    }

    #[test]
    fn threads_never_get_more_than_the_limit() {
        let (b, seed) = table(4);
        let t = LimitTable::new(&b, seed);
        let q = Quota::per_minute(10_000);
        let allowed = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..5000 {
                        if matches!(t.take(42, q, 1, SEC), Taken::Allowed(_)) {
                            allowed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(allowed.into_inner(), 10_000, "exactly the limit, no more, none lost");
    }
}
