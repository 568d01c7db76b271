//! The gateway's Prometheus metrics: which counter lives in which word of
//! a process's stats block (this module), the recording helpers
//! (`record.rs`: [`Metrics`]), and the text rendering of `GET /metrics`
//! (`render.rs`: [`Snapshot`]).
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
//! | `semlb_upstream_stale_connections_total` | counter | – |
//! | `semlb_completion_records_total` | counter | `result` (pushed, dropped) |
//! | `semlb_store_degraded_lookups_total` | counter | – |
//! | `semlb_responder_*_total` | counter | records, blocks, responses stored, write-back failures and drops |
//! | `semlb_prefix_table_evictions_total` | counter | prefix entries evicted from full buckets by write-backs |
//! | `semlb_kv_event_*_total` | counter | the engines' KV cache events applied: batches, blocks stored and removed, events skipped, caches cleared, gaps, gaps replayed |
//! | `semlb_kv_event_lag_seconds` | histogram | from a batch's engine timestamp to its application |
//! | `semlb_ttft_seconds` | histogram | – |
//! | `semlb_request_duration_seconds` | histogram | – |
//! | `semlb_dispatch_seconds` | histogram | `stage` (tokenize, lookup, route, total) |
//! | `semlb_prefix_match_ratio` | histogram | – |
//! | `semlb_server_inflight_requests`, `semlb_server_up`, `semlb_server_state`, `semlb_server_waiting_requests`, `semlb_server_running_requests`, `semlb_server_kv_cache_usage_ratio` | gauge | `server` (and `state`) |
//! | `semlb_server_admission_limit` | gauge | `server` |
//! | `semlb_cost_weight` (policy `cost` only) | gauge | `dispatcher` (registry slot) |
//! | `semlb_prefix_table_entries` (estimated from a sample of the buckets until it has seen [`OCCUPANCY_SAMPLE_ENTRIES`] entries: a scrape reads 0.25 MiB of a table filled beyond a few per cent, and counts a table under about 1 % full exactly with one scan), `semlb_prefix_table_capacity`, `semlb_response_cache_records` | gauge | – |
//! | `semlb_completion_ring_dropped_total`, `semlb_process_restarts_total` | counter | – / `role` |

use std::fmt::Write as _;

use shm_layout::{LoadFigures, ProcessState, Role, STAT_WORDS, ServerState, Stats, Tables, UsageRow};

pub mod counts;
mod record;
mod render;
#[cfg(test)]
mod tests;

pub use counts::{Applied, Observation, ResponderStats};
pub use record::{
    Metrics, PredictionTotals, ServerGauges, cache_total, prediction_total, responder_records, upstream_total,
};
pub use render::Snapshot;

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
    /// `POST /v1/responses`.
    Responses = 5,
    /// `POST /v1/messages`.
    Messages = 6,
}

impl EndpointLabel {
    /// The endpoint of a request path.
    pub fn of_path(path: &str) -> Self {
        match path {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            "/v1/models" => Self::Models,
            "/health" => Self::Health,
            "/v1/responses" => Self::Responses,
            "/v1/messages" => Self::Messages,
            _ => Self::Other,
        }
    }
}

const ENDPOINTS: [&str; 7] = [
    "completions",
    "chat_completions",
    "models",
    "health",
    "other",
    "responses",
    "messages",
];
/// Endpoints of the first layout, counted from word [`REQUESTS`]; those
/// after them (added later) from [`MORE_REQUESTS`], at the block's end,
/// so that no older word moved (processes of two versions side by side
/// during an upgrade share the stats region).
const FIRST_ENDPOINTS: usize = 5;

/// The word counting requests to endpoint `e` answered with status label
/// `c`.
const fn request_word(e: usize, c: usize) -> usize {
    if e < FIRST_ENDPOINTS {
        REQUESTS + e * CODE_LABELS.len() + c
    } else {
        MORE_REQUESTS + (e - FIRST_ENDPOINTS) * CODE_LABELS.len() + c
    }
}
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
const UPSTREAM: usize = REQUESTS + FIRST_ENDPOINTS * CODE_LABELS.len();
const CACHE: usize = UPSTREAM + SERVERS * 2;
const RETRIES: usize = CACHE + 3;
const RECORDS: usize = RETRIES + 1;
const DEGRADED: usize = RECORDS + 2;
const STALE_CONNECTIONS: usize = DEGRADED + 1;
const RESPONDER: usize = STALE_CONNECTIONS + 1;
const RESPONDER_COUNTERS: usize = 6;
const HISTOGRAMS: usize = RESPONDER + RESPONDER_COUNTERS;

/// Prefix-table buckets a scrape reads per pass to estimate the table's
/// fill ([`shm_layout::PrefixTable::occupancy_estimate`])...
pub const OCCUPANCY_SAMPLE_BUCKETS: usize = 4096;
/// ... until it has seen this many entries (a relative error of about 2 %),
/// or read the whole table (exact).
pub const OCCUPANCY_SAMPLE_ENTRIES: u64 = 2048;

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
/// Learning at dispatch: prompts recorded for their server, prompts taken
/// back (the attempt failed or was refused), blocks recorded, routing
/// decisions made on a continued conversation's credit.
const LEARN: usize = SEGMENTS + SEGMENT_SOURCES.len();
const LEARN_RECORDED: usize = LEARN;
const LEARN_TAKEN_BACK: usize = LEARN + 1;
const LEARN_BLOCKS: usize = LEARN + 2;
const CONTINUED: usize = LEARN + 3;
/// Per server slot, what the routing predicted against what the engine
/// reported: predicted prompt tokens, of those found cached, requests with
/// a clear shortfall, times its older entries were set aside (four words
/// per slot).
const PREDICTION: usize = LEARN + 4;
const PREDICTION_WORDS: usize = 4;
/// Times a server's prefix entries were forgotten (its cache was lost).
const FORGOTTEN: usize = PREDICTION + SERVERS * PREDICTION_WORDS;
/// The engines' KV cache events applied by the response processes
/// ([`crate::kv_events`]): batches, blocks stored, blocks removed, stored
/// events skipped, caches cleared, gaps seen, gaps a replay filled.
const KV_EVENTS: usize = FORGOTTEN + 1;
const KV_EVENT_COUNTERS: [(&str, &str); 7] = [
    (
        "semlb_kv_event_batches_total",
        "KV event batches applied to the confirmed prefix table.",
    ),
    (
        "semlb_kv_event_blocks_stored_total",
        "Blocks engines said they stored, inserted as confirmed.",
    ),
    (
        "semlb_kv_event_blocks_removed_total",
        "Blocks engines said they evicted, removed from the confirmed table.",
    ),
    (
        "semlb_kv_event_skipped_total",
        "BlockStored events not applied (another block size, a parent never seen, extra keys, an unknown adapter or KV cache group).",
    ),
    (
        "semlb_kv_event_cleared_total",
        "AllBlocksCleared events and engine restarts: a server's confirmed entries all removed.",
    ),
    (
        "semlb_kv_event_gaps_total",
        "Sequence gaps seen in an engine's event stream (events lost).",
    ),
    (
        "semlb_kv_event_gaps_replayed_total",
        "Gaps the engine's replay socket filled.",
    ),
];
/// Buckets of the KV event lag (seconds): sub-millisecond on one host.
const KV_LAG_BOUNDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];
/// From an engine's batch timestamp (its wall clock: on another host, the
/// two clocks' offset is in it) to its application to the table.
pub const KV_EVENT_LAG: Histogram = Histogram {
    base: KV_EVENTS + KV_EVENT_COUNTERS.len(),
    bounds: KV_LAG_BOUNDS,
    scale: 1e6,
};
/// Peer gateways ([`crate::peers`]): requests forwarded, forwards that
/// failed (the request then queued here), requests received forwarded.
const PEERS: usize = KV_EVENT_LAG.base + Histogram::words(KV_LAG_BOUNDS);
const PEER_COUNTERS: [(&str, &str); 4] = [
    (
        "semlb_peer_forwarded_total",
        "Requests forwarded to a peer gateway (every local server full, the local queue's expected wait too long).",
    ),
    (
        "semlb_peer_forward_failures_total",
        "Forwards a peer did not take (unreachable, or a 5xx head): the request went to the local queue.",
    ),
    (
        "semlb_peer_received_total",
        "Requests a peer gateway forwarded here (never forwarded again).",
    ),
    (
        "semlb_peer_load_served_total",
        "Load summaries served to peer gateways (GET /semlb/peer/load with the peering token).",
    ),
];
/// What happened with a peer gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerEvent {
    /// A request was forwarded to a peer.
    Forwarded = 0,
    /// A forward failed; the request queued locally.
    ForwardFailed = 1,
    /// A request arrived forwarded by a peer.
    Received = 2,
    /// A peer read this gateway's load summary.
    LoadServed = 3,
}
/// Disaggregated prefill and decode: requests of pools with prefill
/// engines by how they were served, the prefill legs that gave the decode
/// leg nothing, and both legs' durations.
const PD: usize = PEERS + PEER_COUNTERS.len();
/// How a request of a pool with prefill engines was served
/// (`semlb_pd_requests_total{path}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdPath {
    /// A prefill leg and a decode leg.
    Split = 0,
    /// Its decode engine held the prompt: no prefill leg.
    Bypass = 1,
    /// Its decode engine alone for another reason: several choices asked
    /// for, no prefill engine up, the prefill failed or handed nothing over.
    DecodeOnly = 2,
}
const PD_PATHS: [&str; 3] = ["split", "bypass", "decode_only"];
/// Why a prefill leg gave its decode leg nothing
/// (`semlb_pd_handoff_failures_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdFailure {
    /// No answer, a 5xx or the prefill timeout.
    PrefillFailed = 0,
    /// A vLLM prefill answer without `kv_transfer_params` (it stopped at
    /// its one token).
    NoParams = 1,
}
const PD_FAILURES: [&str; 2] = ["prefill_failed", "no_params"];
/// The prefill legs, from sending to their answer's end (vLLM) or their
/// end beside the decode leg (SGLang).
pub const PD_PREFILL: Histogram = Histogram {
    base: PD + PD_PATHS.len() + PD_FAILURES.len(),
    bounds: LATENCY_BOUNDS,
    scale: 1e6,
};
/// The decode legs of split requests, from sending to their answer's end.
pub const PD_DECODE: Histogram = Histogram {
    base: PD_PREFILL.base + Histogram::words(LATENCY_BOUNDS),
    bounds: LATENCY_BOUNDS,
    scale: 1e6,
};
/// Requests to the endpoints added after the first layout
/// ([`request_word`]).
const MORE_REQUESTS: usize = PD_DECODE.base + Histogram::words(LATENCY_BOUNDS);
/// Routing decisions an affinity made ([`crate::routing::affinity`]), by
/// kind and outcome (`semlb_affinity_routes_total`).
const AFFINITY: usize = MORE_REQUESTS + (ENDPOINTS.len() - FIRST_ENDPOINTS) * CODE_LABELS.len();
const AFFINITY_OUTCOMES: [(&str, &str); 5] = [
    ("session", "kept"),
    ("session", "moved"),
    ("session", "new"),
    ("stored_response", "continued"),
    ("stored_response", "not_found"),
];
/// What an affinity made of a routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityOutcome {
    /// A session's turn stayed on its engine.
    SessionKept = 0,
    /// A session's turn moved off its engine (full, or no longer a
    /// candidate) and its session follows it.
    SessionMoved = 1,
    /// A session's first turn (or one whose engine is gone).
    SessionNew = 2,
    /// A stored response continued on an engine that stored it.
    StoredContinued = 3,
    /// No live engine stored the response: 404, or sent whole.
    StoredNotFound = 4,
}

/// The affinity counters in `counters` (every stats word summed over
/// processes), in [`AffinityOutcome`] order.
pub fn affinity_totals(counters: &[u64]) -> [u64; 5] {
    std::array::from_fn(|k| counters.get(AFFINITY + k).copied().unwrap_or(0))
}
/// Chat streams broken after their first byte, by why and what became
/// of them (`semlb_stream_resumptions_total`, [`crate::dispatcher`]'s
/// resumption).
const RESUMPTIONS: usize = AFFINITY + AFFINITY_OUTCOMES.len();
const RESUME_REASONS: [&str; 4] = ["cut", "error_event", "stall", "drain"];
const RESUME_OUTCOMES: [&str; 4] = ["resumed", "failed", "not_resumed", "whole"];

/// Why a stream broke after its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamBreak {
    /// The connection was reset or closed, or the body ended without its
    /// `data: [DONE]`.
    Cut = 0,
    /// The engine sent an error event.
    ErrorEvent = 1,
    /// Nothing came for `resume.stall_ms`.
    Stall = 2,
    /// Its engine was drained (the admin API, a reload, discovery) and
    /// retired at the drain deadline with the stream still running: the
    /// stream moves, though the engine did not fail.
    Drain = 3,
}

impl StreamBreak {
    /// Its name (the metric's `reason`, and in logs).
    pub fn name(self) -> &'static str {
        RESUME_REASONS[self as usize]
    }
}

/// What became of a broken stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeOutcome {
    /// Another engine took it up and the answer went on.
    Resumed = 0,
    /// No engine took up the continuation: the client got an error event.
    Failed = 1,
    /// It could not be resumed (see `docs/operating/resumption.md`): the
    /// client got an error event.
    NotResumed = 2,
    /// The answer had finished; only its `data: [DONE]` was missing.
    Whole = 3,
}

const END: usize = RESUMPTIONS + RESUME_REASONS.len() * RESUME_OUTCOMES.len();
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
    /// requests queued leaves them counted until its successor starts
    /// ([`Metrics::settle_queue`]).
    pub fn depth(&self) -> u64 {
        self.entered.saturating_sub(self.routed + self.abandoned + self.timeout)
    }
}

/// The gateway queues' totals in `counters` (every stats word summed over
/// processes).
pub fn queue_total(counters: &[u64]) -> QueueTotals {
    QueueTotals::read(|i| counters.get(i).copied().unwrap_or(0))
}

impl QueueTotals {
    /// The queue's counters, each read by `word` (its stats index).
    fn read(word: impl Fn(usize) -> u64) -> Self {
        let at = |k: usize| word(QUEUE + k);
        Self {
            entered: at(0),
            routed: at(1 + QueueOutcome::Routed as usize),
            abandoned: at(1 + QueueOutcome::Abandoned as usize),
            timeout: at(1 + QueueOutcome::Timeout as usize),
            full: at(1 + QueueOutcome::Full as usize),
        }
    }
}
