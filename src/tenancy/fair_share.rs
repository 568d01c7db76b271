//! The order in which the gateway queue lets waiting requests go:
//! priority classes, and among the tenants of a class a token-weighted
//! fair share in the manner of the virtual token counter (VTC) of Sheng et
//! al., "Fairness in Serving Large Language Models" (OSDI '24).
//!
//! # Classes
//!
//! A tenant is `interactive` (the default) or `batch` (`[[tenant]]
//! priority` in the keys file); a request may lower its own class with
//! `x-semlb-priority: batch`, never raise it. Waiting interactive requests
//! go before waiting batch ones, with a starvation bound: a batch request
//! that has waited `batch_max_delay_ms` goes before both (so an
//! interactive request is held back only by batch requests that have
//! waited that long, and a batch request waits at most that long plus
//! until a server frees).
//!
//! # Fair share (VTC)
//!
//! Every tenant has a **virtual counter**: the service it has received, in
//! weighted tokens (`prompt + 2 × output`, the paper's weights for input
//! and output tokens, divided by the tenant's `weight`). Among the waiting
//! requests of a class, the next to go is the oldest of the tenant with
//! the lowest counter, and its cost is added at once, with the output it
//! asked for (`max_tokens`, else 256, at most 4096) standing in for the
//! output it will get; when the answer ends, the counter is settled with
//! the output tokens it really got ([`FairQueue::settle`]), so a tenant
//! asking for far more than it uses is not held back for it, and one whose
//! answers run long pays for them. A tenant
//! that starts waiting after an idle spell has its counter lifted to the
//! lowest counter of the tenants waiting, so it cannot bank service while
//! idle and then crowd the others out. The result: a tenant sending a
//! steady trickle is served at its own pace while another floods the
//! servers, and two flooders share the servers' time by their weights.
//!
//! Requests routed without waiting are charged too (when the policy holds
//! requests), so the counters say what each tenant received while the
//! servers had room.
//!
//! Each dispatcher process keeps its own counters and orders its own
//! queue: a freed server goes to whichever dispatcher's queue sees it
//! first (its own request ended, or its next look), so with `N`
//! dispatchers a trickle's request waits for at most about `N` freed
//! servers instead of behind every queued request. With `fair_share =
//! false` a class is served oldest first.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A request's class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Waits ahead of batch requests.
    #[default]
    Interactive,
    /// Waits behind interactive requests, up to the starvation bound.
    Batch,
}

impl Priority {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }

    /// The class a request asking for `asked` (a header value) gets when
    /// its tenant's is `self`: lower only.
    pub fn lowered_by(self, asked: Option<&[u8]>) -> Self {
        match asked {
            Some(v) if v.eq_ignore_ascii_case(b"batch") => Priority::Batch,
            _ => self,
        }
    }
}

/// The header a request lowers its class with.
pub const PRIORITY_HEADER: &str = "x-semlb-priority";

/// Output tokens assumed for a request that does not say how many it
/// wants (`max_tokens`), and the most any request is charged for.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;
/// Most output tokens a request is charged for up front.
pub const MAX_CHARGED_OUTPUT: u64 = 4096;

/// Who is waiting, and what letting it go costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Its tenant (a hash of its name).
    pub tenant: u64,
    /// Its class.
    pub priority: Priority,
    /// Its tenant's weight (at least 1).
    pub weight: u32,
    /// Its cost in tokens: `prompt + 2 × output`.
    pub cost: u64,
    /// The output tokens its cost counts (settled when the answer ends).
    pub output: u64,
}

impl Share {
    /// A request of `tenant` in class `priority` with `weight`, of
    /// `prompt` tokens asking for `output` output tokens (`None`:
    /// [`DEFAULT_OUTPUT_TOKENS`]; counted up to [`MAX_CHARGED_OUTPUT`]).
    pub fn new(tenant: u64, priority: Priority, weight: u32, prompt: u64, output: Option<u64>) -> Self {
        let output = output.unwrap_or(DEFAULT_OUTPUT_TOKENS).min(MAX_CHARGED_OUTPUT);
        Self {
            tenant,
            priority,
            weight,
            cost: prompt.saturating_add(2 * output),
            output,
        }
    }

    /// The same request once charged: it orders as before and costs
    /// nothing more (a retry on another server).
    pub fn charged(self) -> Self {
        Self {
            cost: 0,
            output: 0,
            ..self
        }
    }

    /// `tokens` as its tenant's counter counts them (per unit of weight,
    /// in thousandths).
    fn weighted(&self, tokens: u64) -> u64 {
        tokens.saturating_mul(1000) / u64::from(self.weight.max(1))
    }
}

/// Counters of at most this many tenants are kept; past it, the idle
/// tenants' are forgotten.
const MAX_TENANTS: usize = 4096;

/// One tenant's waiting requests of one class, oldest first.
#[derive(Debug)]
struct Lane<T> {
    tenant: u64,
    priority: Priority,
    items: VecDeque<(Instant, Share, T)>,
}

/// The ordering of a dispatcher's waiting requests (see the module docs).
#[derive(Debug)]
pub struct FairQueue<T> {
    lanes: Vec<Lane<T>>,
    counters: HashMap<u64, u64>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            lanes: Vec::new(),
            counters: HashMap::new(),
            len: 0,
        }
    }
}

/// How a look orders the waiting requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Order {
    /// Among tenants of a class, the lowest counter first (else the
    /// oldest request first).
    pub fair_share: bool,
    /// A batch request waiting this long goes first.
    pub batch_max_delay: Duration,
}

impl<T> FairQueue<T> {
    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// When the longest-waiting request arrived (`None`: none waits).
    pub fn oldest(&self) -> Option<Instant> {
        self.lanes.iter().filter_map(|l| l.items.front().map(|i| i.0)).min()
    }

    /// `tenant`'s counter.
    pub fn counter(&self, tenant: u64) -> u64 {
        self.counters.get(&tenant).copied().unwrap_or(0)
    }

    fn waiting(&self, tenant: u64) -> bool {
        self.lanes.iter().any(|l| l.tenant == tenant)
    }

    /// Adds `item`, waiting since `since`; a tenant that was not waiting
    /// has its counter lifted to the lowest of those waiting.
    pub fn push(&mut self, share: Share, since: Instant, item: T) {
        if !self.waiting(share.tenant) {
            let floor = self.lanes.iter().map(|l| self.counter(l.tenant)).min();
            if let Some(floor) = floor {
                let c = self.counters.entry(share.tenant).or_insert(0);
                *c = (*c).max(floor);
            }
        }
        let lane = match self
            .lanes
            .iter()
            .position(|l| l.tenant == share.tenant && l.priority == share.priority)
        {
            Some(i) => i,
            None => {
                self.lanes.push(Lane {
                    tenant: share.tenant,
                    priority: share.priority,
                    items: VecDeque::new(),
                });
                self.lanes.len() - 1
            }
        };
        self.lanes[lane].items.push_back((since, share, item));
        self.len += 1;
    }

    /// Counts a request of `share` served without waiting.
    pub fn charge(&mut self, share: &Share) {
        if self.counters.len() >= MAX_TENANTS && !self.counters.contains_key(&share.tenant) {
            let lanes = &self.lanes;
            self.counters.retain(|t, _| lanes.iter().any(|l| l.tenant == *t));
        }
        let c = self.counters.entry(share.tenant).or_insert(0);
        *c = c.saturating_add(share.weighted(share.cost));
    }

    /// Settles the charge of a request of `share` (charged already) whose
    /// answer had `output` tokens: its tenant's counter counts those
    /// instead of the output it was charged for.
    pub fn settle(&mut self, share: &Share, output: u64) {
        if let Some(c) = self.counters.get_mut(&share.tenant) {
            *c = c
                .saturating_add(share.weighted(2 * output))
                .saturating_sub(share.weighted(2 * share.output));
        }
    }

    /// Removes every request `gone` says is gone (its client left, it
    /// waited too long), with how long it waited.
    pub fn remove_where(&mut self, mut gone: impl FnMut(&T, Duration) -> bool) -> Vec<(T, Duration)> {
        let mut out = Vec::new();
        for lane in &mut self.lanes {
            let mut i = 0;
            while i < lane.items.len() {
                let waited = lane.items[i].0.elapsed();
                if gone(&lane.items[i].2, waited) {
                    if let Some((_, _, item)) = lane.items.remove(i) {
                        out.push((item, waited));
                    }
                } else {
                    i += 1;
                }
            }
        }
        self.len -= out.len();
        self.lanes.retain(|l| !l.items.is_empty());
        out
    }

    /// One look: offers the waiting requests to `route` in order (see the
    /// module docs), each at most once; a request it routes (`Some`) leaves
    /// the queue, its tenant charged at once (so the next pick sees it).
    /// Returns them with what `route` gave and how long they waited.
    pub fn look<R>(&mut self, order: Order, mut route: impl FnMut(&mut T) -> Option<R>) -> Vec<(T, R, Duration)> {
        let now = Instant::now();
        // The next untried request of each lane.
        let mut next = vec![0usize; self.lanes.len()];
        let mut out = Vec::new();
        loop {
            let pick = (0..self.lanes.len())
                .filter(|&l| next[l] < self.lanes[l].items.len())
                .min_by_key(|&l| {
                    let lane = &self.lanes[l];
                    let (since, _, _) = &lane.items[next[l]];
                    let waited = now.saturating_duration_since(*since);
                    let rank = match lane.priority {
                        Priority::Batch if waited >= order.batch_max_delay => 0,
                        Priority::Interactive => 1,
                        Priority::Batch => 2,
                    };
                    let counter = if order.fair_share { self.counter(lane.tenant) } else { 0 };
                    (rank, counter, *since)
                });
            let Some(l) = pick else { break };
            let i = next[l];
            let Some(result) = route(&mut self.lanes[l].items[i].2) else {
                next[l] += 1;
                continue;
            };
            let Some((since, share, item)) = self.lanes[l].items.remove(i) else {
                break;
            };
            self.len -= 1;
            self.charge(&share);
            out.push((item, result, now.saturating_duration_since(since)));
        }
        self.lanes.retain(|l| !l.items.is_empty());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(tenant: u64, priority: Priority, cost: u64) -> Share {
        Share {
            tenant,
            priority,
            weight: 1,
            cost,
            output: 0,
        }
    }

    #[test]
    fn a_charge_is_settled_with_the_output_the_answer_had() {
        let mut q = FairQueue::<u32>::default();
        // 100 prompt tokens asking for 256 (the default): 612 charged.
        let asked = Share::new(1, Priority::Interactive, 1, 100, None);
        assert_eq!((asked.cost, asked.output), (612, 256));
        q.charge(&asked);
        assert_eq!(q.counter(1), 612_000);
        q.settle(&asked, 10);
        assert_eq!(q.counter(1), 120_000, "100 + 2 × 10");
        // Weighted, and an answer longer than asked for (a cap ignored).
        let heavy = Share::new(2, Priority::Interactive, 4, 100, Some(50));
        q.charge(&heavy);
        q.settle(&heavy, 150);
        assert_eq!(q.counter(2), (100 + 2 * 150) * 1000 / 4);
        // A retry costs nothing more; settling a tenant with no counter
        // (forgotten) does nothing.
        q.charge(&heavy.charged());
        assert_eq!(q.counter(2), 100_000);
        q.settle(&Share::new(3, Priority::Batch, 1, 0, Some(8)), 0);
        assert_eq!(q.counter(3), 0);
    }

    const ORDER: Order = Order {
        fair_share: true,
        batch_max_delay: Duration::from_secs(3600),
    };

    /// The order of one look that routes `capacity` requests.
    fn served(q: &mut FairQueue<u32>, order: Order, capacity: usize) -> Vec<u32> {
        let mut left = capacity;
        q.look(order, |_| {
            (left > 0).then(|| {
                left -= 1;
            })
        })
        .into_iter()
        .map(|(item, (), _)| item)
        .collect()
    }

    #[test]
    fn a_trickle_goes_ahead_of_a_flood_and_fifo_does_not() {
        for fair_share in [true, false] {
            let mut q = FairQueue::default();
            let t0 = Instant::now();
            // The flooder has been served ten requests already.
            for _ in 0..10 {
                q.charge(&share(1, Priority::Interactive, 100));
            }
            for i in 0..8 {
                q.push(share(1, Priority::Interactive, 100), t0, i);
            }
            q.push(share(2, Priority::Interactive, 100), t0 + Duration::from_millis(1), 100);
            let order = Order { fair_share, ..ORDER };
            let first = served(&mut q, order, 2);
            if fair_share {
                // Lifted to the flooder's counter when it started waiting:
                // one of the flooder's (older), then the trickle's.
                assert_eq!(first, [0, 100], "the trickle second, though it came last");
            } else {
                assert_eq!(first, [0, 1], "oldest first");
            }
            assert_eq!(q.len(), 7);
        }
    }

    #[test]
    fn flooders_alternate_by_weight() {
        let mut q = FairQueue::default();
        let t0 = Instant::now();
        for i in 0..6 {
            q.push(share(1, Priority::Interactive, 100), t0, i);
            q.push(
                Share {
                    weight: 2,
                    ..share(2, Priority::Interactive, 100)
                },
                t0,
                10 + i,
            );
        }
        let order = served(&mut q, ORDER, 6);
        let heavy = order.iter().filter(|i| **i >= 10).count();
        assert_eq!(heavy, 4, "twice the weight, twice the requests: {order:?}");
    }

    #[test]
    fn an_idle_tenant_banks_nothing() {
        let mut q = FairQueue::default();
        let t0 = Instant::now();
        for _ in 0..50 {
            q.charge(&share(1, Priority::Interactive, 100));
        }
        q.push(share(1, Priority::Interactive, 100), t0, 1);
        // Tenant 2 was idle at counter 0: lifted to tenant 1's counter.
        q.push(share(2, Priority::Interactive, 100), t0, 2);
        assert_eq!(q.counter(2), q.counter(1));
        for i in 0..3 {
            q.push(share(2, Priority::Interactive, 100), t0, 20 + i);
        }
        // Equal counters: the older request, then they alternate.
        assert_eq!(served(&mut q, ORDER, 3), [1, 2, 20]);
    }

    #[test]
    fn interactive_goes_before_batch_until_batch_has_waited_its_bound() {
        let mut q = FairQueue::default();
        let old = Instant::now() - Duration::from_secs(10);
        q.push(share(1, Priority::Batch, 1), old, 1);
        q.push(share(2, Priority::Interactive, 1000), Instant::now(), 2);
        let patient = Order {
            batch_max_delay: Duration::from_secs(60),
            ..ORDER
        };
        assert_eq!(served(&mut q, patient, 1), [2], "interactive first");
        q.push(share(2, Priority::Interactive, 1000), Instant::now(), 3);
        let bound = Order {
            batch_max_delay: Duration::from_secs(5),
            ..ORDER
        };
        assert_eq!(served(&mut q, bound, 1), [1], "the batch request waited past its bound");
        assert_eq!(Priority::Interactive.lowered_by(Some(b"BATCH")), Priority::Batch);
        assert_eq!(Priority::Batch.lowered_by(Some(b"interactive")), Priority::Batch);
    }

    #[test]
    fn a_request_that_cannot_go_does_not_hold_up_the_others_and_gone_ones_leave() {
        let mut q = FairQueue::default();
        let t0 = Instant::now();
        for i in 0..4 {
            q.push(share(1, Priority::Interactive, 1), t0, i);
        }
        // Odd items have room, even ones do not.
        let went: Vec<u32> = q
            .look(ORDER, |i| (*i % 2 == 1).then_some(()))
            .into_iter()
            .map(|(i, (), _)| i)
            .collect();
        assert_eq!(went, [1, 3]);
        let gone = q.remove_where(|i, _| *i == 0);
        assert_eq!(gone.len(), 1);
        assert_eq!(q.len(), 1);
        assert_eq!(served(&mut q, ORDER, 5), [2]);
        assert!(q.is_empty());
    }
}
