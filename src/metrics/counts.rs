//! The plain counts the processes hand to [`super::Metrics`]: what a
//! response process did ([`ResponderStats`]), one comparison of a
//! prediction with an engine's report ([`Observation`]), what applying KV
//! cache events did ([`Applied`]). They are defined here, below the
//! subsystems that produce them (`responder`, `kv_events`, which re-export
//! them), so that `metrics` names nothing above it.

/// One comparison of a prediction with what the engine reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    /// The server's slot.
    pub slot: u16,
    /// Prompt tokens the routing expected it to hold.
    pub predicted: u64,
    /// Prompt tokens its engine reported cached.
    pub cached: u64,
    /// Clearly fewer than predicted.
    pub short: bool,
    /// The server's older entries were set aside (its horizon raised).
    pub demoted: bool,
}

/// What one response process has done (exported as metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResponderStats {
    /// Records applied.
    pub records: u64,
    /// Block hashes inserted or refreshed.
    pub blocks: u64,
    /// Responses stored in the response log.
    pub responses_stored: u64,
    /// Responses refused by the log (larger than its limit).
    pub responses_too_large: u64,
    /// Records whose server registration is no longer current.
    pub stale_server: u64,
    /// Records that did not decode.
    pub undecodable: u64,
    /// Abandoned reservations skipped.
    pub recovered: u64,
    /// Write-backs that failed (the store was unreachable; records kept).
    pub writeback_failures: u64,
    /// Records given up because the backlog kept during an outage was full.
    pub writeback_dropped: u64,
    /// Prefix entries evicted from full buckets by the inserts (shm store).
    pub evictions: u64,
    /// Answers tokenized to extend a prompt's chain.
    pub answers_tokenized: u64,
    /// Answer tokens hashed into chains.
    pub answer_tokens: u64,
    /// Answers whose text could not be read (the prompt is still learned).
    pub unreadable_answers: u64,
    /// Records whose engine reported its cached prompt tokens.
    pub observed: u64,
    /// Times a server was forgotten in every prefix entry (lost cache).
    pub forgotten_servers: u64,
    /// Times a server's horizon was raised (entries older than an
    /// eviction its engine showed set aside).
    pub demotions: u64,
    /// Requests whose timing adjusted their server's admission limit
    /// ([`crate::routing::capacity`]).
    pub capacity_samples: u64,
}

/// What applying some events did (counted into the response process's
/// metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Batches applied.
    pub batches: u64,
    /// Blocks inserted as confirmed.
    pub stored: u64,
    /// Blocks whose confirmed entry lost the server.
    pub removed: u64,
    /// Stored events not applied (see the module docs for why).
    pub skipped: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
}

impl std::ops::AddAssign for Applied {
    fn add_assign(&mut self, o: Self) {
        self.batches += o.batches;
        self.stored += o.stored;
        self.removed += o.removed;
        self.skipped += o.skipped;
        self.cleared += o.cleared;
    }
}
