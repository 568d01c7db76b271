//! The recording side: [`Metrics`], one process's block of the stats
//! region, and the totals read back from summed counters.

use super::*;

/// The recording side: one process's block of the stats region.
#[derive(Debug, Clone, Copy)]
pub struct Metrics<'a> {
    stats: Stats<'a>,
    process: u16,
}

impl<'a> Metrics<'a> {
    /// Records into `process`'s block (its registry slot).
    pub fn new(stats: Stats<'a>, process: u16) -> Self {
        Self { stats, process }
    }

    fn add(&self, index: usize, delta: u64) {
        self.stats.add(self.process, index, delta);
    }

    fn get(&self, index: usize) -> u64 {
        self.stats.get(self.process, index)
    }

    /// One answered request.
    pub fn request(&self, endpoint: EndpointLabel, status: u16) {
        self.add(request_word(endpoint as usize, code_index(status)), 1);
    }

    /// One upstream attempt to the server in `slot`: answered in full (`ok`)
    /// or failed (connection error, 5xx head, body cut or timed out).
    pub fn upstream(&self, slot: u16, ok: bool) {
        if usize::from(slot) < SERVERS {
            self.add(UPSTREAM + usize::from(slot) * 2 + usize::from(!ok), 1);
        }
    }

    /// What the response cache did.
    pub fn cache(&self, result: CacheResult) {
        self.add(CACHE + result as usize, 1);
    }

    /// One upstream attempt after the first of a request.
    pub fn retry(&self) {
        self.add(RETRIES, 1);
    }

    /// A request resent on a new connection because the pooled one it went
    /// out on had been closed by the server (see
    /// [`crate::dispatcher::failure::is_stale_connection`]).
    pub fn stale_connection(&self) {
        self.add(STALE_CONNECTIONS, 1);
    }

    /// One completion record pushed into the ring, or dropped.
    pub fn record(&self, pushed: bool) {
        self.add(RECORDS + usize::from(!pushed), 1);
    }

    /// A prompt recorded for its server at dispatch (`blocks` written).
    pub fn learned_at_dispatch(&self, blocks: usize) {
        self.add(LEARN_RECORDED, 1);
        self.add(LEARN_BLOCKS, blocks as u64);
    }

    /// A prompt recorded at dispatch taken back: its attempt failed or was
    /// refused.
    pub fn unlearned_at_dispatch(&self) {
        self.add(LEARN_TAKEN_BACK, 1);
    }

    /// A request routed to a server credited with the earlier answer its
    /// prompt carries ([`crate::prefix::continuation`]).
    pub fn continued(&self) {
        self.add(CONTINUED, 1);
    }

    /// A response process's comparison of a prediction with what the
    /// engine reported (counted per server).
    pub fn prediction(&self, o: &Observation) {
        let slot = usize::from(o.slot);
        if slot < SERVERS {
            let base = PREDICTION + slot * PREDICTION_WORDS;
            self.add(base, o.predicted);
            self.add(base + 1, o.cached.min(o.predicted));
            self.add(base + 2, u64::from(o.short));
            self.add(base + 3, u64::from(o.demoted));
        }
    }

    /// A server's prefix entries were forgotten: its engine lost its cache.
    pub fn forgotten(&self) {
        self.add(FORGOTTEN, 1);
    }

    /// KV cache events applied ([`Applied`]).
    pub fn kv_events(&self, applied: &Applied) {
        let counts = [
            applied.batches,
            applied.stored,
            applied.removed,
            applied.skipped,
            applied.cleared,
        ];
        for (i, n) in counts.into_iter().enumerate() {
            if n > 0 {
                self.add(KV_EVENTS + i, n);
            }
        }
    }

    /// A gap in an engine's event stream, and whether its replay filled it.
    pub fn kv_event_gap(&self, replayed: bool) {
        self.add(KV_EVENTS + 5, 1);
        if replayed {
            self.add(KV_EVENTS + 6, 1);
        }
    }

    /// An affinity made a routing decision.
    pub fn affinity(&self, outcome: AffinityOutcome) {
        self.add(AFFINITY + outcome as usize, 1);
    }

    /// A stream broke after its first byte (`why`) and `outcome` became of it.
    pub fn stream_break(&self, why: StreamBreak, outcome: ResumeOutcome) {
        self.add(RESUMPTIONS + why as usize * RESUME_OUTCOMES.len() + outcome as usize, 1);
    }

    /// Something happened with a peer gateway.
    pub fn peer(&self, event: PeerEvent) {
        self.add(PEERS + event as usize, 1);
    }

    /// A request of a pool with prefill engines was served by `path`.
    pub fn pd_request(&self, path: PdPath) {
        self.add(PD + path as usize, 1);
    }

    /// A prefill leg gave its decode leg nothing.
    pub fn pd_handoff_failure(&self, why: PdFailure) {
        self.add(PD + PD_PATHS.len() + why as usize, 1);
    }

    /// One store lookup answered by the fallback.
    pub fn degraded_lookup(&self) {
        self.add(DEGRADED, 1);
    }

    /// Adds what a tokenizer's segment cache did since `before` (its
    /// counters are cumulative).
    pub fn segments(&self, before: &semlb_tokenizer::SegmentCacheStats, now: &semlb_tokenizer::SegmentCacheStats) {
        let deltas = [
            now.hits.saturating_sub(before.hits),
            now.shared_hits.saturating_sub(before.shared_hits),
            now.misses.saturating_sub(before.misses),
        ];
        for (i, delta) in deltas.into_iter().enumerate() {
            if delta > 0 {
                self.add(SEGMENTS + i, delta);
            }
        }
    }

    /// Adds what a responder did since `before` (its counters are cumulative).
    pub fn responder(&self, before: &ResponderStats, now: &ResponderStats) {
        let d = |a: u64, b: u64| b.saturating_sub(a);
        let deltas = [
            d(before.records, now.records),
            d(before.blocks, now.blocks),
            d(before.responses_stored, now.responses_stored),
            d(before.writeback_failures, now.writeback_failures),
            d(before.writeback_dropped, now.writeback_dropped),
            d(before.evictions, now.evictions),
        ];
        for (i, delta) in deltas.into_iter().enumerate() {
            if delta > 0 {
                self.add(RESPONDER + i, delta);
            }
        }
    }

    /// One observation of `value` (seconds, or a ratio).
    pub fn observe(&self, h: Histogram, value: f64) {
        let value = if value.is_finite() { value.max(0.0) } else { 0.0 };
        self.add(h.bucket(value), 1);
        self.add(h.sum_word(), (value * h.scale).round() as u64);
    }

    /// One observation of a duration.
    pub fn observe_duration(&self, h: Histogram, d: std::time::Duration) {
        self.observe(h, d.as_secs_f64());
    }

    /// A request entered the gateway queue.
    pub fn queue_entered(&self) {
        self.add(QUEUE, 1);
    }

    /// A request left the gateway queue after `waited` (or was refused:
    /// [`QueueOutcome::Full`], no wait recorded).
    pub fn queue_left(&self, outcome: QueueOutcome, waited: std::time::Duration) {
        self.add(QUEUE + 1 + outcome as usize, 1);
        if outcome != QueueOutcome::Full {
            self.observe_duration(QUEUE_WAIT, waited);
        }
    }

    /// Requests waiting in every dispatcher's gateway queue now (a few
    /// words summed over the processes, not the whole region).
    pub fn queue_depth(&self) -> u64 {
        QueueTotals::read(|i| self.stats.sum(i)).depth()
    }

    /// At a dispatcher's start: requests its block still counts as queued
    /// were its predecessor's in this slot, killed with them waiting; they
    /// are counted abandoned, so the depth is right again.
    pub fn settle_queue(&self) {
        let stranded = QueueTotals::read(|i| self.get(i)).depth();
        if stranded > 0 {
            self.add(QUEUE + 1 + QueueOutcome::Abandoned as usize, stranded);
        }
    }

    /// The prefix match of the chosen server: `matched` of `total` blocks
    /// (nothing recorded for a prompt without a full block).
    pub fn prefix_match(&self, matched: u32, total: usize) {
        if total > 0 {
            self.observe(PREFIX_RATIO, (f64::from(matched) / total as f64).min(1.0));
        }
    }

    /// This process's requests with a status in `class` (1..=5) or, with
    /// `None`, all of them.
    pub fn requests(&self, class: Option<u16>) -> u64 {
        let mut n = 0;
        for e in 0..ENDPOINTS.len() {
            for (c, label) in CODE_LABELS.iter().enumerate() {
                if class.is_none_or(|k| label.as_bytes()[0] == b'0' + k as u8) {
                    n += self.get(request_word(e, c));
                }
            }
        }
        n
    }

    /// This process's count of a response-cache result.
    pub fn cache_count(&self, result: CacheResult) -> u64 {
        self.get(CACHE + result as usize)
    }

    /// This process's retries.
    pub fn retries(&self) -> u64 {
        self.get(RETRIES)
    }

    /// This process's requests resent after a stale pooled connection.
    pub fn stale_connections(&self) -> u64 {
        self.get(STALE_CONNECTIONS)
    }

    /// This process's failed upstream attempts, all servers.
    pub fn upstream_errors(&self) -> u64 {
        (0..SERVERS).map(|s| self.get(UPSTREAM + s * 2 + 1)).sum()
    }

    /// This process's completion records pushed (`true`) or dropped.
    pub fn records(&self, pushed: bool) -> u64 {
        self.get(RECORDS + usize::from(!pushed))
    }
}

/// Upstream attempts to the server in `slot` in `counters` (the stats
/// words summed over processes, `Stats::sum_all`): (answered in full, failed).
pub fn upstream_total(counters: &[u64], slot: u16) -> (u64, u64) {
    if usize::from(slot) >= SERVERS {
        return (0, 0);
    }
    let at = UPSTREAM + usize::from(slot) * 2;
    let get = |i: usize| counters.get(i).copied().unwrap_or(0);
    (get(at), get(at + 1))
}

/// What the routing predicted of one server against what its engine
/// reported, summed over processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PredictionTotals {
    /// Prompt tokens predicted cached.
    pub predicted: u64,
    /// Of those, confirmed by the engine.
    pub confirmed: u64,
    /// Requests with a clear shortfall.
    pub shortfalls: u64,
    /// Times its older entries were set aside.
    pub demotions: u64,
}

/// The prediction figures of server `slot` in `counters` (summed stats
/// words).
pub fn prediction_total(counters: &[u64], slot: u16) -> PredictionTotals {
    if usize::from(slot) >= SERVERS {
        return PredictionTotals::default();
    }
    let at = PREDICTION + usize::from(slot) * PREDICTION_WORDS;
    let get = |i: usize| counters.get(i).copied().unwrap_or(0);
    PredictionTotals {
        predicted: get(at),
        confirmed: get(at + 1),
        shortfalls: get(at + 2),
        demotions: get(at + 3),
    }
}

/// A response-cache result's count in `counters` (summed stats words).
pub fn cache_total(counters: &[u64], result: CacheResult) -> u64 {
    counters.get(CACHE + result as usize).copied().unwrap_or(0)
}

/// A server as `/metrics` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerGauges {
    /// Server-table slot.
    pub slot: u16,
    /// Its address (the `server` label).
    pub address: String,
    /// Its state.
    pub state: ServerState,
    /// Requests in flight to it, from every dispatcher.
    pub inflight: u64,
    /// Its scraped load, when fresh.
    pub load: Option<LoadFigures>,
    /// The admission limit the holding policies use for it: its engine's
    /// reported slots, else learned ([`crate::routing::capacity`]), or the initial
    /// one.
    pub admission_limit: f64,
}

/// Completion records the response processes have applied, all together
/// (`semlb_responder_records_total`), read without a whole [`Snapshot`].
pub fn responder_records(tables: &Tables<'_>) -> u64 {
    tables.stats.sum(RESPONDER)
}
