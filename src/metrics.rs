//! The gateway's Prometheus metrics: which counter lives in which word of
//! a process's stats block, the recording helpers, and the text rendering
//! of `GET /metrics`.
//!
//! # Where the numbers live
//!
//! Counters and histograms are words of the segment's stats region
//! ([`shm_layout::Stats`]): every process adds to the block of its own
//! registry slot ([`Metrics::new`] with its `Identity.slot`), lock-free and
//! uncontended, and `/metrics`, served by any dispatcher, sums the blocks of
//! all processes ([`Snapshot::collect`]), so every scrape shows the whole
//! gateway whichever dispatcher answers it. Blocks are never reset: a
//! restarted process adds to what its predecessor counted, and counters
//! stay monotonic. Gauges (server load and health, table occupancy,
//! restarts) are read from the segment at scrape time.
//!
//! A histogram is `bounds + 1` words of per-bucket counts (the last is
//! `+Inf`) and one word of the sum in fixed units (microseconds for
//! seconds, millionths for ratios); the rendering makes the buckets
//! cumulative and derives `_count` from them, so `_count` always equals the
//! `+Inf` bucket even while requests are recorded concurrently.
//!
//! # Families
//!
//! | family | type | labels |
//! | --- | --- | --- |
//! | `semlb_requests_total` | counter | `endpoint` (completions, chat_completions, models, health, other), `code` (200, 400, 404, 405, 413, 429, 500, 502, 503, 504 exactly, else the class: 1xx … 5xx) |
//! | `semlb_upstream_requests_total` | counter | `server` (address), `outcome` (ok, error) |
//! | `semlb_response_cache_total` | counter | `result` (hit, miss, bypass) |
//! | `semlb_retries_total` | counter | – |
//! | `semlb_completion_records_total` | counter | `result` (pushed, dropped) |
//! | `semlb_store_degraded_lookups_total` | counter | – |
//! | `semlb_responder_*_total` | counter | records, blocks, responses stored, write-back failures and drops |
//! | `semlb_prefix_table_evictions_total` | counter | prefix entries evicted from full buckets by write-backs |
//! | `semlb_ttft_seconds` | histogram | – |
//! | `semlb_request_duration_seconds` | histogram | – |
//! | `semlb_dispatch_seconds` | histogram | `stage` (tokenize, lookup, route, total) |
//! | `semlb_prefix_match_ratio` | histogram | – |
//! | `semlb_server_inflight_requests`, `semlb_server_up`, `semlb_server_state`, `semlb_server_waiting_requests`, `semlb_server_running_requests`, `semlb_server_kv_cache_usage_ratio` | gauge | `server` (and `state`) |
//! | `semlb_prefix_table_entries`, `semlb_prefix_table_capacity`, `semlb_response_cache_records` | gauge | – |
//! | `semlb_completion_ring_dropped_total`, `semlb_process_restarts_total` | counter | – / `role` |

use std::fmt::Write as _;

use shm_layout::{LoadFigures, Role, STAT_WORDS, ServerState, Stats, Tables};

use crate::responder::ResponderStats;

/// The `endpoint` label of `semlb_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointLabel {
    /// `POST /v1/completions`.
    Completions = 0,
    /// `POST /v1/chat/completions`.
    ChatCompletions = 1,
    /// `GET /v1/models`.
    Models = 2,
    /// `GET /health`.
    Health = 3,
    /// Everything else (other `/v1/*`, `/metrics`, unknown paths).
    Other = 4,
}

impl EndpointLabel {
    /// The endpoint of a request path.
    pub fn of_path(path: &str) -> Self {
        match path {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            "/v1/models" => Self::Models,
            "/health" => Self::Health,
            _ => Self::Other,
        }
    }
}

const ENDPOINTS: [&str; 5] = ["completions", "chat_completions", "models", "health", "other"];
/// Status codes counted exactly; others go to their class.
const EXACT_CODES: [u16; 10] = [200, 400, 404, 405, 413, 429, 500, 502, 503, 504];
const CODE_LABELS: [&str; 15] = [
    "200", "400", "404", "405", "413", "429", "500", "502", "503", "504", "1xx", "2xx", "3xx", "4xx", "5xx",
];

/// The `code` label index of an HTTP status.
fn code_index(status: u16) -> usize {
    match EXACT_CODES.iter().position(|c| *c == status) {
        Some(i) => i,
        None => EXACT_CODES.len() + usize::from((status / 100).clamp(1, 5) - 1),
    }
}

/// Server slots with upstream counters (the server table's size).
const SERVERS: usize = shm_layout::plan::SERVER_SLOTS as usize;

// The index map: word offsets in a process's stats block.
const REQUESTS: usize = 0;
const UPSTREAM: usize = REQUESTS + ENDPOINTS.len() * CODE_LABELS.len();
const CACHE: usize = UPSTREAM + SERVERS * 2;
const RETRIES: usize = CACHE + 3;
const RECORDS: usize = RETRIES + 1;
const DEGRADED: usize = RECORDS + 2;
const RESPONDER: usize = DEGRADED + 1;
const RESPONDER_COUNTERS: usize = 6;
const HISTOGRAMS: usize = RESPONDER + RESPONDER_COUNTERS;

/// Latency buckets of TTFT and request duration, seconds.
const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Buckets of the dispatch stages, seconds (10 µs .. 1 s).
const DISPATCH_BOUNDS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
/// Buckets of the prefix match ratio.
const RATIO_BOUNDS: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// One histogram: where its words are and how values are bucketed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Histogram {
    base: usize,
    bounds: &'static [f64],
    /// Sum units per 1.0 of value.
    scale: f64,
}

impl Histogram {
    const fn words(bounds: &[f64]) -> usize {
        bounds.len() + 2
    }

    /// The word of the bucket `value` falls in (`le` is inclusive).
    fn bucket(&self, value: f64) -> usize {
        self.base
            + self
                .bounds
                .iter()
                .position(|b| value <= *b)
                .unwrap_or(self.bounds.len())
    }

    fn sum_word(&self) -> usize {
        self.base + self.bounds.len() + 1
    }
}

/// `semlb_ttft_seconds`.
pub const TTFT: Histogram = Histogram {
    base: HISTOGRAMS,
    bounds: LATENCY_BOUNDS,
    scale: 1e6,
};
/// `semlb_request_duration_seconds`.
pub const DURATION: Histogram = Histogram {
    base: TTFT.base + Histogram::words(LATENCY_BOUNDS),
    bounds: LATENCY_BOUNDS,
    scale: 1e6,
};
const DISPATCH_BASE: usize = DURATION.base + Histogram::words(LATENCY_BOUNDS);

/// A stage of `semlb_dispatch_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Tokenizing the routing text.
    Tokenize = 0,
    /// The store lookup (response cache, prefix match, load).
    Lookup = 1,
    /// The policy's choice, up to the hand-off to the upstream client.
    Route = 2,
    /// From the request's headers to the upstream hand-off (or the cached answer).
    Total = 3,
}

const STAGES: [&str; 4] = ["tokenize", "lookup", "route", "total"];

impl Stage {
    /// Its histogram.
    pub const fn histogram(self) -> Histogram {
        Histogram {
            base: DISPATCH_BASE + self as usize * Histogram::words(DISPATCH_BOUNDS),
            bounds: DISPATCH_BOUNDS,
            // Nanoseconds: dispatch stages are microseconds long.
            scale: 1e9,
        }
    }
}

/// `semlb_prefix_match_ratio`.
pub const PREFIX_RATIO: Histogram = Histogram {
    base: DISPATCH_BASE + STAGES.len() * Histogram::words(DISPATCH_BOUNDS),
    bounds: RATIO_BOUNDS,
    scale: 1e6,
};
/// Gateway-queue counters: requests entered, then one per outcome.
const QUEUE: usize = PREFIX_RATIO.base + Histogram::words(RATIO_BOUNDS);
const QUEUE_OUTCOMES: [&str; 4] = ["routed", "abandoned", "timeout", "full"];
/// `semlb_queue_wait_seconds`.
pub const QUEUE_WAIT: Histogram = Histogram {
    base: QUEUE + 1 + QUEUE_OUTCOMES.len(),
    bounds: LATENCY_BOUNDS,
    scale: 1e6,
};
/// Text segments of prompts, by where their ids came from.
const SEGMENTS: usize = QUEUE_WAIT.base + Histogram::words(LATENCY_BOUNDS);
const SEGMENT_SOURCES: [&str; 3] = ["local_cache", "shared_store", "tokenized"];
const END: usize = SEGMENTS + SEGMENT_SOURCES.len();
const _: () = assert!(END <= STAT_WORDS, "the metrics outgrew a stats block");

/// What the response cache did for an inference request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheResult {
    /// Answered from the cache.
    Hit = 0,
    /// Looked up (or refreshed) and may be stored.
    Miss = 1,
    /// The cache was not involved.
    Bypass = 2,
}

/// How a request left the gateway queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueOutcome {
    /// A server took it.
    Routed = 0,
    /// Its client went away while it waited.
    Abandoned = 1,
    /// It waited `max_wait_ms`.
    Timeout = 2,
    /// The queue was full: it never entered.
    Full = 3,
}

/// The gateway queues' counters, summed over processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueTotals {
    /// Requests that entered a queue.
    pub entered: u64,
    /// Left it for a server.
    pub routed: u64,
    /// Left it because their client went away.
    pub abandoned: u64,
    /// Left it after `max_wait_ms`.
    pub timeout: u64,
    /// Refused: the queue was full.
    pub full: u64,
}

impl QueueTotals {
    /// Requests waiting now: entered less left. A dispatcher killed with
    /// requests queued leaves them counted until the segment is recreated.
    pub fn depth(&self) -> u64 {
        self.entered.saturating_sub(self.routed + self.abandoned + self.timeout)
    }
}

/// The gateway queues' totals in `counters` (every stats word summed over
/// processes).
pub fn queue_total(counters: &[u64]) -> QueueTotals {
    let at = |k: usize| counters.get(QUEUE + k).copied().unwrap_or(0);
    QueueTotals {
        entered: at(0),
        routed: at(1 + QueueOutcome::Routed as usize),
        abandoned: at(1 + QueueOutcome::Abandoned as usize),
        timeout: at(1 + QueueOutcome::Timeout as usize),
        full: at(1 + QueueOutcome::Full as usize),
    }
}

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
        self.add(REQUESTS + endpoint as usize * CODE_LABELS.len() + code_index(status), 1);
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

    /// One completion record pushed into the ring, or dropped.
    pub fn record(&self, pushed: bool) {
        self.add(RECORDS + usize::from(!pushed), 1);
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
                    n += self.get(REQUESTS + e * CODE_LABELS.len() + c);
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
}

/// Completion records the response processes have applied, all together
/// (`semlb_responder_records_total`), read without a whole [`Snapshot`].
pub fn responder_records(tables: &Tables<'_>) -> u64 {
    tables.stats.sum(RESPONDER)
}

/// Everything one scrape renders: the counters summed over all processes
/// and the gauges read from the segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Every stats word summed over all process blocks ([`STAT_WORDS`] long).
    pub counters: Vec<u64>,
    /// The registered servers.
    pub servers: Vec<ServerGauges>,
    /// Occupied prefix-table slots.
    pub prefix_entries: u64,
    /// Prefix-table slots.
    pub prefix_capacity: u64,
    /// Records written to the response log.
    pub response_records: u64,
    /// Completion records dropped by the rings (full or too large).
    pub ring_dropped: u64,
    /// Restarts per role (dispatcher, responder).
    pub restarts: [u64; 2],
}

impl Snapshot {
    /// Reads a snapshot from the segment's tables. Scraped load older than
    /// `stale_after_ms` (segment milliseconds before `now_ms`) is left out.
    /// Counting the prefix table's entries scans it (run it off the reactor).
    pub fn collect(tables: &Tables<'_>, now_ms: u64, stale_after_ms: u64) -> Self {
        let servers = tables
            .servers
            .servers()
            .filter(|s| s.state != ServerState::Configuring)
            .map(|s| ServerGauges {
                slot: s.server.slot,
                address: s.address,
                state: s.state,
                inflight: s.inflight_requests,
                load: crate::health::fresh_load(s.load, now_ms, stale_after_ms),
            })
            .collect();
        let mut restarts = [0; 2];
        for p in tables.registry.processes() {
            match p.role {
                Some(Role::Dispatcher) => restarts[0] += p.restarts,
                Some(Role::Responder) => restarts[1] += p.restarts,
                _ => {}
            }
        }
        Self {
            counters: tables.stats.sum_all(),
            servers,
            prefix_entries: tables.prefix.occupancy(),
            prefix_capacity: tables.prefix.capacity(),
            response_records: tables.responses.stats().records,
            ring_dropped: (0..tables.ring_count()).map(|i| tables.ring(i).stats().dropped).sum(),
            restarts,
        }
    }

    fn counter(&self, index: usize) -> u64 {
        self.counters.get(index).copied().unwrap_or(0)
    }

    /// Requests in the gateway queues: entered less left (routed,
    /// abandoned, timed out). A dispatcher killed with requests queued
    /// leaves them counted until the gateway restarts.
    pub fn queue_depth(&self) -> u64 {
        queue_total(&self.counters).depth()
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 << 10);
        let o = &mut out;

        family(
            o,
            "semlb_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
        );
        for (e, endpoint) in ENDPOINTS.iter().enumerate() {
            for (c, code) in CODE_LABELS.iter().enumerate() {
                let n = self.counter(REQUESTS + e * CODE_LABELS.len() + c);
                if n > 0 {
                    sample(o, "semlb_requests_total", &[("endpoint", endpoint), ("code", code)], n);
                }
            }
        }

        family(
            o,
            "semlb_upstream_requests_total",
            "counter",
            "Upstream attempts per server: answered in full (ok) or failed (error).",
        );
        for s in &self.servers {
            for (k, outcome) in ["ok", "error"].into_iter().enumerate() {
                let n = self.counter(UPSTREAM + usize::from(s.slot) * 2 + k);
                sample(
                    o,
                    "semlb_upstream_requests_total",
                    &[("server", &s.address), ("outcome", outcome)],
                    n,
                );
            }
        }

        family(
            o,
            "semlb_response_cache_total",
            "counter",
            "Inference requests by what the response cache did.",
        );
        for (k, result) in ["hit", "miss", "bypass"].into_iter().enumerate() {
            sample(
                o,
                "semlb_response_cache_total",
                &[("result", result)],
                self.counter(CACHE + k),
            );
        }
        family(
            o,
            "semlb_retries_total",
            "counter",
            "Upstream attempts after the first of a request.",
        );
        sample(o, "semlb_retries_total", &[], self.counter(RETRIES));
        family(
            o,
            "semlb_completion_records_total",
            "counter",
            "Completion records pushed to a responder, or dropped.",
        );
        for (k, result) in ["pushed", "dropped"].into_iter().enumerate() {
            sample(
                o,
                "semlb_completion_records_total",
                &[("result", result)],
                self.counter(RECORDS + k),
            );
        }
        family(
            o,
            "semlb_store_degraded_lookups_total",
            "counter",
            "Routing lookups answered without the store (unreachable or slow).",
        );
        sample(o, "semlb_store_degraded_lookups_total", &[], self.counter(DEGRADED));
        let responder = [
            (
                "semlb_responder_records_total",
                "Completion records applied by responders.",
            ),
            (
                "semlb_responder_blocks_total",
                "Prefix blocks inserted or refreshed by responders.",
            ),
            (
                "semlb_responder_responses_stored_total",
                "Responses stored in the response cache.",
            ),
            (
                "semlb_responder_writeback_failures_total",
                "Write-backs that failed (store unreachable).",
            ),
            (
                "semlb_responder_writeback_dropped_total",
                "Records given up after an outage's backlog filled.",
            ),
            (
                "semlb_prefix_table_evictions_total",
                "Prefix entries evicted from full buckets to make room.",
            ),
        ];
        for (i, (name, help)) in responder.into_iter().enumerate() {
            family(o, name, "counter", help);
            sample(o, name, &[], self.counter(RESPONDER + i));
        }

        self.histogram(
            o,
            "semlb_ttft_seconds",
            "Time from a request's arrival to the first byte of the upstream answer relayed to the client.",
            &[TTFT],
            &[],
        );
        self.histogram(
            o,
            "semlb_request_duration_seconds",
            "Inference requests end to end, until the answer's last byte.",
            &[DURATION],
            &[],
        );
        let stages = [Stage::Tokenize, Stage::Lookup, Stage::Route, Stage::Total];
        self.histogram(
            o,
            "semlb_dispatch_seconds",
            "Time the dispatcher spends deciding, by stage.",
            &stages.map(Stage::histogram),
            &STAGES,
        );
        self.histogram(
            o,
            "semlb_prefix_match_ratio",
            "Share of the prompt's blocks the chosen server has cached.",
            &[PREFIX_RATIO],
            &[],
        );

        family(
            o,
            "semlb_queue_requests_total",
            "counter",
            "Requests that waited in the gateway queue, by how they left it (full: refused at entry).",
        );
        for (k, outcome) in QUEUE_OUTCOMES.into_iter().enumerate() {
            sample(
                o,
                "semlb_queue_requests_total",
                &[("outcome", outcome)],
                self.counter(QUEUE + 1 + k),
            );
        }
        family(
            o,
            "semlb_queue_depth",
            "gauge",
            "Requests waiting in the gateway queues now (all dispatchers).",
        );
        sample(o, "semlb_queue_depth", &[], self.queue_depth());
        self.histogram(
            o,
            "semlb_queue_wait_seconds",
            "Time requests waited in the gateway queue.",
            &[QUEUE_WAIT],
            &[],
        );

        family(
            o,
            "semlb_tokenizer_segments_total",
            "counter",
            "Text segments of prompts, by where their token ids came from: the dispatcher's own cache, the store shared by every process, or tokenized.",
        );
        for (k, source) in SEGMENT_SOURCES.into_iter().enumerate() {
            sample(
                o,
                "semlb_tokenizer_segments_total",
                &[("source", source)],
                self.counter(SEGMENTS + k),
            );
        }

        family(
            o,
            "semlb_server_inflight_requests",
            "gauge",
            "Requests in flight to a server.",
        );
        for s in &self.servers {
            sample(
                o,
                "semlb_server_inflight_requests",
                &[("server", &s.address)],
                s.inflight,
            );
        }
        family(
            o,
            "semlb_server_up",
            "gauge",
            "1 if the server takes requests (state up).",
        );
        for s in &self.servers {
            let up = u64::from(s.state == ServerState::Up);
            sample(o, "semlb_server_up", &[("server", &s.address)], up);
        }
        family(
            o,
            "semlb_server_state",
            "gauge",
            "The server's state: 1 for the current one.",
        );
        for s in &self.servers {
            for state in [ServerState::Up, ServerState::Draining, ServerState::Down] {
                let v = u64::from(s.state == state);
                sample(
                    o,
                    "semlb_server_state",
                    &[("server", &s.address), ("state", state.name())],
                    v,
                );
            }
        }
        let load = [
            (
                "semlb_server_waiting_requests",
                "Requests waiting in the server's queue (scraped).",
            ),
            (
                "semlb_server_running_requests",
                "Requests the server is running (scraped).",
            ),
        ];
        for (k, (name, help)) in load.into_iter().enumerate() {
            family(o, name, "gauge", help);
            for s in &self.servers {
                if let Some(l) = s.load {
                    let v = if k == 0 { l.waiting } else { l.running };
                    sample(o, name, &[("server", &s.address)], u64::from(v));
                }
            }
        }
        family(
            o,
            "semlb_server_kv_cache_usage_ratio",
            "gauge",
            "The server's KV-cache usage, 0 to 1 (scraped; absent when stale).",
        );
        for s in &self.servers {
            if let Some(l) = s.load {
                let labels = [("server", s.address.as_str())];
                sample_f(
                    o,
                    "semlb_server_kv_cache_usage_ratio",
                    &labels,
                    f64::from(l.kv_usage_permyriad) / 1e4,
                );
            }
        }

        let gauges = [
            (
                "semlb_prefix_table_entries",
                "Occupied prefix-table slots.",
                self.prefix_entries,
            ),
            (
                "semlb_prefix_table_capacity",
                "Prefix-table slots.",
                self.prefix_capacity,
            ),
            (
                "semlb_response_cache_records",
                "Records written to the response cache's log.",
                self.response_records,
            ),
        ];
        for (name, help, v) in gauges {
            family(o, name, "gauge", help);
            sample(o, name, &[], v);
        }
        family(
            o,
            "semlb_completion_ring_dropped_total",
            "counter",
            "Completion records the rings dropped (full, or too large).",
        );
        sample(o, "semlb_completion_ring_dropped_total", &[], self.ring_dropped);
        family(
            o,
            "semlb_process_restarts_total",
            "counter",
            "Child processes restarted, by role.",
        );
        for (k, role) in ["dispatcher", "responder"].into_iter().enumerate() {
            sample(o, "semlb_process_restarts_total", &[("role", role)], self.restarts[k]);
        }
        out
    }

    /// One histogram family; `stages` labels the series with `stage`.
    fn histogram(&self, o: &mut String, name: &str, help: &str, series: &[Histogram], stages: &[&str]) {
        family(o, name, "histogram", help);
        for (i, h) in series.iter().enumerate() {
            let stage = stages.get(i).map(|s| ("stage", *s));
            let mut cumulative = 0;
            let bucket = format!("{name}_bucket");
            for (b, bound) in h
                .bounds
                .iter()
                .map(|b| b.to_string())
                .chain(["+Inf".to_owned()])
                .enumerate()
            {
                cumulative += self.counter(h.base + b);
                let mut labels: Vec<(&str, &str)> = stage.into_iter().collect();
                labels.push(("le", &bound));
                sample(o, &bucket, &labels, cumulative);
            }
            let labels: Vec<(&str, &str)> = stage.into_iter().collect();
            sample_f(
                o,
                &format!("{name}_sum"),
                &labels,
                self.counter(h.sum_word()) as f64 / h.scale,
            );
            sample(o, &format!("{name}_count"), &labels, cumulative);
        }
    }
}

fn family(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

fn labels(o: &mut String, labels: &[(&str, &str)]) {
    if labels.is_empty() {
        return;
    }
    o.push('{');
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        o.push_str(k);
        o.push_str("=\"");
        escape_label(o, v);
        o.push('"');
    }
    o.push('}');
}

/// A label value as the text format wants it: `\`, `"` and newlines escaped.
fn escape_label(o: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
}

fn sample(o: &mut String, name: &str, l: &[(&str, &str)], v: u64) {
    o.push_str(name);
    labels(o, l);
    let _ = writeln!(o, " {v}");
}

fn sample_f(o: &mut String, name: &str, l: &[(&str, &str)], v: f64) {
    o.push_str(name);
    labels(o, l);
    let _ = writeln!(o, " {v}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::{LayoutPlan, Segment};

    fn empty() -> Snapshot {
        Snapshot {
            counters: vec![0; STAT_WORDS],
            servers: Vec::new(),
            prefix_entries: 0,
            prefix_capacity: 0,
            response_records: 0,
            ring_dropped: 0,
            restarts: [0; 2],
        }
    }

    /// The lines of `text` for one family (its HELP, TYPE and samples).
    fn family_of(text: &str, name: &str) -> String {
        text.lines()
            .filter(|l| {
                let l = l.trim_start_matches("# HELP ").trim_start_matches("# TYPE ");
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{', '_']) && !rest.starts_with("_total"))
            })
            .map(|l| format!("{l}\n"))
            .collect()
    }

    #[test]
    fn codes_and_endpoints_map_to_labels() {
        assert_eq!(CODE_LABELS[code_index(200)], "200");
        assert_eq!(CODE_LABELS[code_index(201)], "2xx");
        assert_eq!(CODE_LABELS[code_index(302)], "3xx");
        assert_eq!(CODE_LABELS[code_index(418)], "4xx");
        assert_eq!(CODE_LABELS[code_index(503)], "503");
        assert_eq!(CODE_LABELS[code_index(599)], "5xx");
        assert_eq!(CODE_LABELS[code_index(99)], "1xx");
        assert_eq!(
            EndpointLabel::of_path("/v1/chat/completions"),
            EndpointLabel::ChatCompletions
        );
        assert_eq!(EndpointLabel::of_path("/metrics"), EndpointLabel::Other);
    }

    #[test]
    fn histogram_buckets_are_inclusive_upper_bounds() {
        let h = TTFT;
        assert_eq!(h.bucket(0.0), h.base);
        assert_eq!(h.bucket(0.005), h.base, "le is inclusive");
        assert_eq!(h.bucket(0.0051), h.base + 1);
        assert_eq!(h.bucket(60.0), h.base + 12);
        assert_eq!(h.bucket(61.0), h.base + 13, "+Inf");
        let r = PREFIX_RATIO;
        assert_eq!(r.bucket(0.0), r.base, "no match has its own bucket");
        assert_eq!(r.bucket(0.05), r.base + 1);
        assert_eq!(r.bucket(1.0), r.base + 10);
    }

    #[test]
    fn index_map_regions_do_not_overlap() {
        let stages = [Stage::Tokenize, Stage::Lookup, Stage::Route, Stage::Total].map(Stage::histogram);
        let mut spans = vec![
            (REQUESTS, UPSTREAM),
            (UPSTREAM, CACHE),
            (CACHE, RETRIES),
            (RETRIES, RECORDS),
            (RECORDS, DEGRADED),
            (DEGRADED, RESPONDER),
            (RESPONDER, HISTOGRAMS),
        ];
        for h in [TTFT, DURATION].iter().chain(&stages).chain([&PREFIX_RATIO]) {
            spans.push((h.base, h.sum_word() + 1));
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert!(spans.last().unwrap().1 <= STAT_WORDS);
    }

    #[test]
    fn recording_sums_over_processes() {
        let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let t = seg.tables();
        let (a, b) = (Metrics::new(t.stats, 1), Metrics::new(t.stats, 2));
        a.request(EndpointLabel::Completions, 200);
        b.request(EndpointLabel::Completions, 200);
        b.request(EndpointLabel::Health, 503);
        a.cache(CacheResult::Hit);
        b.observe(TTFT, 0.02);
        a.observe(TTFT, 0.3);
        a.prefix_match(3, 4);
        b.prefix_match(0, 0);
        assert_eq!((a.requests(None), b.requests(None), b.requests(Some(5))), (1, 2, 1));
        let text = Snapshot::collect(&t, 0, 1000).render();
        assert!(
            text.contains("semlb_requests_total{endpoint=\"completions\",code=\"200\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("semlb_response_cache_total{result=\"hit\"} 1\n"));
        assert!(text.contains("semlb_ttft_seconds_bucket{le=\"0.025\"} 1\n"));
        assert!(text.contains("semlb_ttft_seconds_bucket{le=\"0.5\"} 2\n"));
        assert!(text.contains("semlb_ttft_seconds_sum 0.32\n"));
        assert!(text.contains("semlb_ttft_seconds_count 2\n"));
        assert!(text.contains("semlb_prefix_match_ratio_bucket{le=\"0.8\"} 1\n"));
        assert!(text.contains("semlb_prefix_match_ratio_count 1\n"));
    }

    #[test]
    fn renders_exact_text_for_a_fixture() {
        let mut s = empty();
        s.counters[REQUESTS + EndpointLabel::ChatCompletions as usize * CODE_LABELS.len() + code_index(200)] = 3;
        s.counters[UPSTREAM + 2 * 2] = 5;
        s.counters[UPSTREAM + 2 * 2 + 1] = 1;
        s.counters[CACHE] = 2;
        s.counters[RETRIES] = 1;
        s.counters[PREFIX_RATIO.base] = 1;
        s.counters[PREFIX_RATIO.base + 10] = 2;
        s.counters[PREFIX_RATIO.sum_word()] = 2_000_000;
        s.servers.push(ServerGauges {
            slot: 2,
            address: "http://a\"b\\c\n:8000".into(),
            state: ServerState::Draining,
            inflight: 4,
            load: Some(LoadFigures {
                waiting: 1,
                running: 7,
                kv_usage_permyriad: 2500,
                scraped_at_ms: 5,
                pending_at_scrape: 0,
            }),
        });
        s.prefix_entries = 10;
        s.prefix_capacity = 64;
        s.restarts = [1, 0];
        let text = s.render();
        let srv = r#"server="http://a\"b\\c\n:8000""#;
        let want = [
            "# HELP semlb_requests_total HTTP requests answered, by endpoint and status.\n\
             # TYPE semlb_requests_total counter\n\
             semlb_requests_total{endpoint=\"chat_completions\",code=\"200\"} 3\n"
                .to_owned(),
            format!(
                "# HELP semlb_upstream_requests_total Upstream attempts per server: answered in full (ok) or failed (error).\n\
                 # TYPE semlb_upstream_requests_total counter\n\
                 semlb_upstream_requests_total{{{srv},outcome=\"ok\"}} 5\n\
                 semlb_upstream_requests_total{{{srv},outcome=\"error\"}} 1\n"
            ),
            "semlb_response_cache_total{result=\"hit\"} 2\n\
             semlb_response_cache_total{result=\"miss\"} 0\n\
             semlb_response_cache_total{result=\"bypass\"} 0\n\
             # HELP semlb_retries_total Upstream attempts after the first of a request.\n\
             # TYPE semlb_retries_total counter\n\
             semlb_retries_total 1\n"
                .to_owned(),
            "# TYPE semlb_prefix_match_ratio histogram\n\
             semlb_prefix_match_ratio_bucket{le=\"0\"} 1\n\
             semlb_prefix_match_ratio_bucket{le=\"0.1\"} 1\n"
                .to_owned(),
            "semlb_prefix_match_ratio_bucket{le=\"0.9\"} 1\n\
             semlb_prefix_match_ratio_bucket{le=\"1\"} 3\n\
             semlb_prefix_match_ratio_bucket{le=\"+Inf\"} 3\n\
             semlb_prefix_match_ratio_sum 2\n\
             semlb_prefix_match_ratio_count 3\n"
                .to_owned(),
            format!(
                "semlb_server_inflight_requests{{{srv}}} 4\n\
                 # HELP semlb_server_up 1 if the server takes requests (state up).\n\
                 # TYPE semlb_server_up gauge\n\
                 semlb_server_up{{{srv}}} 0\n\
                 # HELP semlb_server_state The server's state: 1 for the current one.\n\
                 # TYPE semlb_server_state gauge\n\
                 semlb_server_state{{{srv},state=\"up\"}} 0\n\
                 semlb_server_state{{{srv},state=\"draining\"}} 1\n\
                 semlb_server_state{{{srv},state=\"down\"}} 0\n"
            ),
            format!("semlb_server_running_requests{{{srv}}} 7\n"),
            format!("semlb_server_kv_cache_usage_ratio{{{srv}}} 0.25\n"),
            "# TYPE semlb_prefix_table_entries gauge\n\
             semlb_prefix_table_entries 10\n\
             # HELP semlb_prefix_table_capacity Prefix-table slots.\n\
             # TYPE semlb_prefix_table_capacity gauge\n\
             semlb_prefix_table_capacity 64\n"
                .to_owned(),
            "semlb_process_restarts_total{role=\"dispatcher\"} 1\n\
             semlb_process_restarts_total{role=\"responder\"} 0\n"
                .to_owned(),
        ];
        for w in &want {
            assert!(text.contains(w.as_str()), "missing:\n{w}\nin:\n{text}");
        }
        // The whole of one small family, exactly.
        assert_eq!(
            family_of(&text, "semlb_store_degraded_lookups_total"),
            "# HELP semlb_store_degraded_lookups_total Routing lookups answered without the store (unreachable or slow).\n\
             # TYPE semlb_store_degraded_lookups_total counter\n\
             semlb_store_degraded_lookups_total 0\n"
        );
        // Every family has HELP and TYPE, once.
        let types = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!(types, helps);
        assert!(types >= 25, "{types} families");
        // A server without fresh load has no load samples.
        s.servers[0].load = None;
        let text = s.render();
        assert!(!text.contains("semlb_server_kv_cache_usage_ratio{"));
        assert!(!text.contains("semlb_server_waiting_requests{"));
    }
}
