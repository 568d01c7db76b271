//! The gateway queue: where a request waits while every server its policy
//! would use is full (policies whose [`Policy::holds_requests`] is true:
//! `selective_push`, `dual_map`).
//!
//! # Shape
//!
//! One queue per dispatcher process, with global accounting: the
//! load a queued request is judged by is the segment's (every dispatcher's
//! in-flight and pending counts, and the scraped engine figures), so a
//! server freed by any dispatcher is seen by all. The queue's capacity
//! (`[policy.queue] capacity`) is shared out evenly: each of `N`
//! dispatchers holds at most `ceil(capacity / N)` requests. One more is
//! answered 503 with `Retry-After`.
//!
//! # Pump
//!
//! While requests wait, one task per dispatcher (the pump) looks at them,
//! oldest first, whenever something may have changed: a request of this
//! dispatcher got its first token or ended (the [`InflightGuard`] wakes
//! the queue), a request was queued, or `recheck_ms` passed (servers freed
//! by other dispatchers, new scrapes). Each look reads the candidates once
//! from the segment and asks the policy again for every waiting request
//! with its own prompt and prefix match; a request the policy now routes
//! is counted in flight on the spot (its guard is begun by the pump, so the
//! next request in line sees the load it adds) and handed to its task. The
//! pump ends when the queue is empty.
//!
//! **In order, none overtaking.** While requests wait, a new request of
//! this dispatcher joins the queue instead of being routed on arrival,
//! and each look offers the waiting requests to their policies in the
//! queue's order ([`crate::tenancy::fair_share`]): interactive before batch (a
//! batch request waiting `batch_max_delay_ms` first of all), and within a
//! class the tenant that has received the least service first, oldest
//! request first within a tenant (`fair_share = false`: oldest first).
//! One waiting for a full candidate does not hold up the ones behind it
//! that can go elsewhere.
//!
//! **Choosing and counting.** A policy reads the load, then the request is
//! counted; between the two, another dispatcher may fill the same server.
//! So a holding policy's choice is checked again once the request is
//! counted ([`Policy::admits`](crate::routing::Policy::admits)); if the
//! server went over the policy's limit, the request is uncounted and keeps
//! waiting. Within a dispatcher, the pump makes the choices one at a time.
//!
//! A queued request whose client went away (its task was dropped, so its
//! reply channel is closed) is dropped at the next look, counted as
//! abandoned; one that waited `max_wait_ms` is answered 503.
//!
//! In Redis mode the queue also reads the segment, not Redis: the local
//! in-flight and pending counts and the scraped figures, which is what the
//! holding policies judge fullness by.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shm_layout::{PrefixMatch, ServerRef};
use tokio::sync::{Notify, oneshot};

use super::Dispatcher;
use super::inflight::InflightGuard;
use crate::metrics::QueueOutcome;
use crate::pools::Pool;
use crate::routing::{Candidate, Choice, QueueParams, RouteInput};
use crate::routing::{Leg, Members};
use crate::tenancy::fair_share::{FairQueue, Order, Share};

/// A request routed out of the queue: the choice, already counted in flight.
#[derive(Debug)]
pub(super) struct Admitted {
    pub choice: Choice,
    pub guard: InflightGuard,
}

/// Why a request left the queue without a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QueueExit {
    /// The queue was full.
    Full,
    /// It waited `max_wait_ms`.
    Timeout,
}

/// What a queued request is routed by.
#[derive(Debug)]
pub(super) struct Waiting {
    pub chain: Vec<u64>,
    pub prompt_tokens: u32,
    pub session: Option<u64>,
    pub prefix: PrefixMatch,
    /// Its shared header, in blocks ([`crate::routing::RouteInput::header_blocks`]).
    pub header_blocks: u32,
    pub exclude: Vec<ServerRef>,
    /// Its model pool: the servers it may go to and the policy that
    /// routes it.
    pub pool: Arc<Pool>,
    /// Whether the policy has been asked about it already (then every look
    /// from the queue is a [repeat](crate::routing::RouteInput::repeat)).
    pub seen: bool,
    /// Its tenant, class and cost, which order the queue.
    pub share: Share,
    /// When it joined the queue ([`crate::routing::RouteInput::waited_ms`]).
    pub queued_at: Instant,
}

#[derive(Debug)]
struct Waiter {
    request: Waiting,
    reply: oneshot::Sender<Result<Admitted, QueueExit>>,
}

#[derive(Debug, Default)]
struct State {
    waiters: FairQueue<Waiter>,
    pump_running: bool,
    /// How fast the queue drains ([`GatewayQueue::expected_wait`]).
    drain: DrainRate,
}

/// Weight of a new interval in the drain rate's moving average.
const DRAIN_WEIGHT: f64 = 0.2;

/// The interval between departures from a queue while it is not empty
/// (a moving average): how long each request ahead of a newcomer holds it
/// up.
#[derive(Debug, Default)]
struct DrainRate {
    /// When the queue last became non-empty (`None` while empty).
    busy_since: Option<Instant>,
    /// The last departure while busy.
    last: Option<Instant>,
    /// The moving average.
    interval: Option<Duration>,
}

impl DrainRate {
    fn entered(&mut self, now: Instant) {
        if self.busy_since.is_none() {
            self.busy_since = Some(now);
            self.last = None;
        }
    }

    /// One departure (`now`); several at one look each count (the later
    /// ones after 0).
    fn departed(&mut self, now: Instant) {
        let Some(from) = self.last.or(self.busy_since) else {
            return;
        };
        let gap = now.saturating_duration_since(from);
        self.interval = Some(match self.interval {
            Some(old) => old.mul_f64(1.0 - DRAIN_WEIGHT) + gap.mul_f64(DRAIN_WEIGHT),
            None => gap,
        });
        self.last = Some(now);
    }

    fn emptied(&mut self) {
        self.busy_since = None;
        self.last = None;
    }
}

/// A dispatcher's gateway queue.
#[derive(Debug)]
pub(super) struct GatewayQueue {
    state: Mutex<State>,
    wake: Notify,
    params: Mutex<QueueParams>,
    /// Dispatcher processes sharing the capacity.
    dispatchers: u64,
}

impl GatewayQueue {
    /// An empty queue; `dispatchers` share `params.capacity`.
    pub fn new(params: QueueParams, dispatchers: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            params: Mutex::new(params),
            dispatchers: (dispatchers as u64).max(1),
        }
    }

    /// Replaces the parameters (a configuration reload).
    pub fn set_params(&self, params: QueueParams) {
        *self.params.lock().unwrap_or_else(|e| e.into_inner()) = params;
        self.wake.notify_one();
    }

    fn params(&self) -> QueueParams {
        *self.params.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This dispatcher's share of the capacity.
    fn share(&self) -> usize {
        usize::try_from(self.params().capacity.div_ceil(self.dispatchers)).unwrap_or(usize::MAX)
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.lock().waiters.len()
    }

    /// How long a request queued now would wait: the requests ahead of it,
    /// and itself, times the interval between departures, or the oldest
    /// waiter's wait so far if that is longer (a queue that has not drained
    /// lately). `None` while unknown: the queue is empty and has never
    /// drained.
    pub fn expected_wait(&self, now: Instant) -> Option<Duration> {
        let state = self.lock();
        let ahead = u32::try_from(state.waiters.len() + 1).unwrap_or(u32::MAX);
        let by_rate = state.drain.interval.map(|i| i.saturating_mul(ahead));
        let oldest = state.waiters.oldest().map(|t| now.saturating_duration_since(t));
        by_rate.max(oldest)
    }

    /// Counts a request of `share` routed without waiting (its tenant's
    /// service, for the fair share).
    pub fn charge(&self, share: &Share) {
        self.lock().waiters.charge(share);
    }

    /// Settles the charge of a request of `share` whose answer had
    /// `output` tokens ([`crate::tenancy::fair_share::FairQueue::settle`]).
    pub fn settle(&self, share: &Share, output: u64) {
        self.lock().waiters.settle(share, output);
    }

    /// Something that may free a server happened (a request started or
    /// ended): look at the queue again.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Queues `request` in `dispatcher`'s queue until its policy routes it, it
/// waits too long, or the queue is full.
pub(super) async fn wait_in_queue(dispatcher: &Arc<Dispatcher>, request: Waiting) -> Result<Admitted, QueueExit> {
    let queue = dispatcher.queue();
    let (tx, rx) = oneshot::channel();
    {
        let mut state = queue.lock();
        if state.waiters.len() >= queue.share() {
            return Err(QueueExit::Full);
        }
        let share = request.share;
        let now = Instant::now();
        state.drain.entered(now);
        state.waiters.push(share, now, Waiter { request, reply: tx });
        if !state.pump_running {
            state.pump_running = true;
            tokio::spawn(pump(dispatcher.clone()));
        }
    }
    dispatcher.metrics().queue_entered();
    queue.wake();
    // The pump answers every waiter; a vanished pump (a panic) is a timeout.
    let exit = queue.params().max_wait_ms.saturating_add(1000);
    match tokio::time::timeout(Duration::from_millis(exit), rx).await {
        Ok(Ok(answer)) => answer,
        _ => Err(QueueExit::Timeout),
    }
}

/// Looks at the queue whenever woken or every `recheck_ms`, until it is empty.
async fn pump(dispatcher: Arc<Dispatcher>) {
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut kept: Vec<Candidate> = Vec::new();
    loop {
        let queue = dispatcher.queue();
        let params = queue.params();
        let stale_after_ms = dispatcher.config().health.stale_after_ms;
        dispatcher
            .local()
            .candidates(&[], Members::all(), Leg::Request, stale_after_ms, &mut candidates);
        {
            let mut state = queue.lock();
            let max_wait = Duration::from_millis(params.max_wait_ms);
            let gone = state
                .waiters
                .remove_where(|w, waited| w.reply.is_closed() || waited >= max_wait);
            for (w, waited) in gone {
                if w.reply.is_closed() {
                    dispatcher.metrics().queue_left(QueueOutcome::Abandoned, waited);
                } else {
                    dispatcher.metrics().queue_left(QueueOutcome::Timeout, waited);
                    let _ = w.reply.send(Err(QueueExit::Timeout));
                }
            }
            let order = Order {
                fair_share: params.fair_share,
                batch_max_delay: Duration::from_millis(params.batch_max_delay_ms),
            };
            let routed = state.waiters.look(order, |w| {
                route_waiting(&dispatcher, &mut w.request, &mut candidates, &mut kept)
            });
            let now = Instant::now();
            for _ in &routed {
                state.drain.departed(now);
            }
            for (w, admitted, waited) in routed {
                // A client gone meanwhile drops the guard: the count is undone.
                let outcome = match w.reply.send(Ok(admitted)) {
                    Ok(()) => QueueOutcome::Routed,
                    Err(_) => QueueOutcome::Abandoned,
                };
                dispatcher.metrics().queue_left(outcome, waited);
            }
            if state.waiters.is_empty() {
                state.drain.emptied();
                state.pump_running = false;
                return;
            }
        }
        let recheck = Duration::from_millis(params.recheck_ms);
        tokio::select! {
            () = queue.wake.notified() => {}
            () = tokio::time::sleep(recheck) => {}
        }
    }
}

/// Asks `r`'s policy again with `candidates` (this look's, updated with
/// what it routes): the server it may go to now, counted in flight, or
/// `None` while every server it may use is full.
fn route_waiting(
    dispatcher: &Arc<Dispatcher>,
    r: &mut Waiting,
    candidates: &mut Vec<Candidate>,
    kept: &mut Vec<Candidate>,
) -> Option<Admitted> {
    let stale_after_ms = dispatcher.config().health.stale_after_ms;
    let policy = r.pool.policy().current_arc();
    loop {
        let members = r.pool.members();
        let eligible: &[Candidate] = if r.exclude.is_empty() && members.is_every() {
            candidates
        } else {
            let servers = &dispatcher.segment().tables().servers;
            kept.clear();
            kept.extend(
                candidates
                    .iter()
                    .filter(|c| !r.exclude.contains(&c.server) && members.admits(servers.membership(c.server.slot))),
            );
            kept
        };
        let input = RouteInput {
            prompt_blocks: u32::try_from(r.chain.len()).unwrap_or(u32::MAX),
            chain: &r.chain,
            prompt_tokens: r.prompt_tokens,
            block_tokens: r.pool.block_tokens(),
            session: r.session,
            session_engine: None,
            repeat: r.seen,
            waited_ms: u64::try_from(r.queued_at.elapsed().as_millis()).unwrap_or(u64::MAX),
            prefix: &r.prefix,
            header_blocks: r.header_blocks,
            candidates: eligible,
        };
        let decision = policy.choose(&input);
        r.seen = true;
        let choice = decision?;
        // Its prefill work there: the prompt less what that server holds.
        let tokens = crate::routing::uncached_tokens(
            r.prompt_tokens,
            r.prefix.blocks_for(choice.server.tag()),
            r.pool.block_tokens(),
        );
        let Some(guard) = InflightGuard::begin(dispatcher, choice.server, tokens) else {
            // Re-registered since the read: not a candidate any more.
            candidates.retain(|c| c.server != choice.server);
            continue;
        };
        let counted = dispatcher.local().candidate(choice.server, stale_after_ms);
        if !policy.admits(&counted) {
            // Another dispatcher filled it since the read: it stays full
            // for this look.
            drop(guard);
            if let Some(c) = candidates.iter_mut().find(|c| c.server == choice.server) {
                *c = counted;
            }
            return None;
        }
        // The next request in line sees the load this one adds.
        if let Some(c) = candidates.iter_mut().find(|c| c.server == choice.server) {
            c.inflight += 1;
            c.inflight_tokens += tokens;
            c.pending += 1;
            c.pending_tokens += tokens;
        }
        return Some(Admitted { choice, guard });
    }
}
