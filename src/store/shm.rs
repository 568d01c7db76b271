//! The routing state in the host's shared-memory segment (the default
//! store): every read is a lock-free lookup in [`shm_layout::Tables`], with
//! no system call and no round trip.

use std::sync::Arc;

use bytes::Bytes;
use shm_layout::{Completion, Segment, ServerRef, Stamp, Tables};

use super::{Lookup, LookupRequest, RoutingStore, StoreFuture, StoreKind, StoreStats, WriteBack, answer_blocks};
use crate::health::fresh_load;
use crate::responder::ResponderStats;
use crate::response_cache::{encode_entry, fresh_body};
use crate::routing::live_candidates;

/// A dispatcher's view of the segment's tables.
#[derive(Debug)]
pub struct ShmStore {
    segment: Arc<Segment>,
    /// The dispatcher's registry slot: its row in the in-flight ledger.
    process: u16,
    /// Cached responses older than this are misses.
    response_ttl_ms: u64,
}

impl ShmStore {
    /// The store of the dispatcher in registry slot `process`, serving cached
    /// responses for `response_ttl_ms`.
    pub fn new(segment: Arc<Segment>, process: u16, response_ttl_ms: u64) -> Self {
        Self {
            segment,
            process,
            response_ttl_ms,
        }
    }

    /// The lookup, synchronously (the shm store never waits).
    pub fn lookup_now(&self, request: LookupRequest<'_>) -> Lookup {
        local_lookup(&self.segment, request, Some(self.response_ttl_ms))
    }
}

/// A lookup from the segment alone: candidates with the host's in-flight
/// counts and their fresh scraped load, the prefix match of the segment's
/// table, and (with a TTL) the segment's response cache. The shm store's
/// whole answer, and the part of a Redis lookup that shared memory provides.
///
/// Scraped figures older than `request.stale_after_ms` are zeroed here
/// ([`fresh_load`]): this is where every store builds the candidates a
/// policy sees, and where the segment's clock is at hand (see
/// [`crate::health`]).
pub(crate) fn local_lookup(segment: &Segment, request: LookupRequest<'_>, response_ttl_ms: Option<u64>) -> Lookup {
    let tables = segment.tables();
    let mut lookup = Lookup::default();
    live_candidates(&tables, &mut lookup.candidates);
    lookup.candidates.retain(|c| !request.exclude.contains(&c.server));
    let now_ms = segment.clock().now_ms();
    for c in &mut lookup.candidates {
        c.load = fresh_load(c.load, now_ms, request.stale_after_ms).unwrap_or_default();
    }
    if let (Some(ttl), Some(key)) = (response_ttl_ms, request.response_key) {
        let mut buf = Vec::new();
        if let Some(entry) = tables.responses.get_into(key, &mut buf) {
            lookup.response = fresh_body(entry, segment.clock().now_ms(), ttl).map(Bytes::copy_from_slice);
        }
    }
    if response_ttl_ms.is_some() && !request.chain.is_empty() {
        let servers = &tables.servers;
        let exclude = request.exclude;
        lookup.prefix = tables.prefix.longest_prefix_match(request.chain, |t| {
            servers.is_live(t) && !exclude.iter().any(|s| s.tag() == t)
        });
    }
    lookup
}

/// Counts a request in the segment's in-flight ledger row `process`.
pub(crate) fn ledger_begin(segment: &Segment, process: u16, server: ServerRef, prompt_tokens: u64) -> bool {
    segment.tables().servers.begin_request(process, server, prompt_tokens)
}

/// Marks a request counted with [`ledger_begin`] started (first token).
pub(crate) fn ledger_first_token(segment: &Segment, process: u16, server: ServerRef, prompt_tokens: u64) {
    segment.tables().servers.first_token(process, server, prompt_tokens);
}

/// Ends a request counted with [`ledger_begin`]; `started`: whether
/// [`ledger_first_token`] was called for it.
pub(crate) fn ledger_end(segment: &Segment, process: u16, server: ServerRef, prompt_tokens: u64, started: bool) {
    segment
        .tables()
        .servers
        .end_request(process, server, prompt_tokens, started);
}

impl RoutingStore for ShmStore {
    fn kind(&self) -> StoreKind {
        StoreKind::Shm
    }

    fn lookup<'a>(&'a self, request: LookupRequest<'a>) -> StoreFuture<'a, Lookup> {
        Box::pin(std::future::ready(self.lookup_now(request)))
    }

    fn begin_request(&self, server: ServerRef, prompt_tokens: u64) -> bool {
        ledger_begin(&self.segment, self.process, server, prompt_tokens)
    }

    fn first_token(&self, server: ServerRef, prompt_tokens: u64) {
        ledger_first_token(&self.segment, self.process, server, prompt_tokens);
    }

    fn end_request(&self, server: ServerRef, prompt_tokens: u64, started: bool) {
        ledger_end(&self.segment, self.process, server, prompt_tokens, started);
    }

    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }
}

/// A response process's writes into the segment's tables.
#[derive(Debug)]
pub struct ShmWriteBack<'a> {
    tables: Tables<'a>,
    entry: Vec<u8>,
}

impl<'a> ShmWriteBack<'a> {
    /// Writes into `tables`.
    pub fn new(tables: Tables<'a>) -> Self {
        Self {
            tables,
            entry: Vec::new(),
        }
    }
}

impl WriteBack for ShmWriteBack<'_> {
    fn kind(&self) -> StoreKind {
        StoreKind::Shm
    }

    fn write(&mut self, batch: &[Completion], now: Stamp, now_ms: u64, stats: &mut ResponderStats) {
        let prefix = &self.tables.prefix;
        for record in batch {
            let Some(server) = record.server else { continue };
            let answer = answer_blocks(record);
            let evicted =
                prefix.insert_chain(&record.prompt_blocks, server, now) + prefix.insert_chain(answer, server, now);
            stats.evictions += evicted as u64;
            stats.blocks += (record.prompt_blocks.len() + answer.len()) as u64;
            if let Some(key) = record.response_key {
                encode_entry(now_ms, &record.response, &mut self.entry);
                match self.tables.responses.put(key, &self.entry) {
                    Ok(()) => stats.responses_stored += 1,
                    Err(_) => stats.responses_too_large += 1,
                }
            }
            stats.records += 1;
        }
    }
}
