//! The routing state in the host's shared-memory segment (the default
//! store): every read is a lock-free lookup in [`shm_layout::Tables`], with
//! no system call and no round trip. A server's prefix entries older than
//! its horizon (its engine was seen to evict them:
//! [`shm_layout::ServerTable::raise_horizon`]) are not matched.

use std::sync::Arc;

use bytes::Bytes;
use shm_layout::{Completion, PrefixMatch, Segment, ServerRef, Stamp, Tables};

use super::local::LocalState;
use super::{Lookup, LookupRequest, RoutingStore, StoreFuture, StoreStats, WriteBack, WriteStats, answer_blocks};
use crate::config::StoreKind;
use crate::prefix::precise;
use crate::response_cache::{encode_entry, fresh_body};
use crate::routing::Candidate;

/// A dispatcher's view of the segment's tables.
#[derive(Debug)]
pub struct ShmStore {
    /// The host's candidates and this dispatcher's ledger row.
    local: LocalState,
    /// Cached responses older than this are misses.
    response_ttl_ms: u64,
}

impl ShmStore {
    /// The store of the dispatcher in registry slot `process`, serving cached
    /// responses for `response_ttl_ms`.
    pub fn new(segment: Arc<Segment>, process: u16, response_ttl_ms: u64) -> Self {
        Self {
            local: LocalState::new(segment, process),
            response_ttl_ms,
        }
    }

    /// The lookup, synchronously (the shm store never waits): the host's
    /// candidates ([`LocalState::candidates`]), the segment's response
    /// cache under the request's key and the prefix table's longest match
    /// of its chain among them.
    pub fn lookup_now(&self, request: LookupRequest<'_>) -> Lookup {
        let segment = self.local.segment();
        let tables = segment.tables();
        let mut lookup = Lookup::of_candidates(&self.local, &request);
        if let Some(key) = request.response_key {
            let mut buf = Vec::new();
            if let Some(entry) = tables.responses.get_into(key, &mut buf) {
                lookup.response =
                    fresh_body(entry, segment.clock().now_ms(), self.response_ttl_ms).map(Bytes::copy_from_slice);
            }
        }
        if !request.chain.is_empty() {
            lookup.prefix = prefix_match(
                &tables,
                segment.clock().now_ms(),
                request.chain,
                request.exclude,
                request.precise,
            );
        }
        if let Some(probe) = request.continuation.filter(|_| !lookup.prefix.is_empty()) {
            let mut probes = Vec::new();
            probe.probes(&lookup.prefix, &mut probes);
            lookup.continued = probe.credit(&lookup.prefix, &probes, |i, server| {
                tables
                    .prefix
                    .lookup(probes[i].key)
                    .is_some_and(|e| e.servers.contains(server))
            });
        }
        lookup
    }
}

/// The longest match of `chain` in `tables`' prefix table at segment time
/// `now_ms`, among the live servers not in `exclude`, each server's entries
/// older than its horizon set aside: the shm store's prefix lookup. With
/// `precise` (the confirm window, seconds), servers whose engines' events
/// are followed are matched as [`precise`] says.
pub fn prefix_match(
    tables: &Tables<'_>,
    now_ms: u64,
    chain: &[u64],
    exclude: &[ServerRef],
    precise: Option<u16>,
) -> PrefixMatch {
    let now_s = now_ms / 1000;
    let now = Stamp(now_s as u16);
    let estimate = tables.prefix.longest_prefix_match_within(chain, now, |t| {
        precise::estimate_max_age(&tables.servers, t, now_s, precise).filter(|_| !exclude.iter().any(|s| s.tag() == t))
    });
    match precise {
        Some(_) => precise::merge(estimate, &precise::confirmed_match(tables, now, chain, exclude)),
        None => estimate,
    }
}

impl RoutingStore for ShmStore {
    fn kind(&self) -> StoreKind {
        StoreKind::Shm
    }

    fn lookup<'a>(&'a self, request: LookupRequest<'a>) -> StoreFuture<'a, Lookup> {
        Box::pin(std::future::ready(self.lookup_now(request)))
    }

    fn begin_request(&self, server: ServerRef, prompt_tokens: u64) -> bool {
        self.local.begin(server, prompt_tokens)
    }

    fn first_token(&self, server: ServerRef, prompt_tokens: u64) {
        self.local.first_token(server, prompt_tokens);
    }

    fn end_request(&self, server: ServerRef, prompt_tokens: u64, started: bool) {
        self.local.end(server, prompt_tokens, started);
    }

    fn record_route(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>) {
        let segment = self.local.segment();
        let prefix = segment.tables().prefix;
        let now = segment.clock().stamp();
        prefix.insert_chain(blocks, server, now);
        if let Some(end_key) = end_key {
            prefix.insert(end_key, server, now);
        }
    }

    fn touch_route(&self, server: ServerRef, last: u64) {
        let segment = self.local.segment();
        segment.tables().prefix.insert(last, server, segment.clock().stamp());
    }

    fn forget_route(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>) {
        let prefix = self.local.segment().tables().prefix;
        for key in blocks.iter().chain(end_key.as_ref()) {
            prefix.remove(*key, server.tag());
        }
    }

    fn holders<'a>(&'a self, key: u64, among: &'a [Candidate]) -> StoreFuture<'a, Vec<ServerRef>> {
        let listed = self.local.segment().tables().prefix.lookup(key).map(|e| e.servers);
        let holders = match listed {
            Some(servers) => among
                .iter()
                .filter(|c| servers.contains(c.server.tag()))
                .map(|c| c.server)
                .collect(),
            None => Vec::new(),
        };
        Box::pin(std::future::ready(holders))
    }

    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }

    fn local(&self) -> &LocalState {
        &self.local
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

    fn forget_server(&mut self, server: ServerRef) -> u64 {
        self.tables.prefix.remove_server(server.tag())
    }

    fn demote_before(&mut self, server: ServerRef, at_s: u32, _now_ms: u64) -> bool {
        self.tables.servers.raise_horizon(server, at_s)
    }

    fn write(&mut self, batch: &[Completion], now: Stamp, now_ms: u64, stats: &mut WriteStats) {
        let prefix = &self.tables.prefix;
        for record in batch {
            let Some(server) = record.server else { continue };
            let answer = answer_blocks(record);
            // The answer first: with the prompt's blocks unlisted too (not
            // learned at dispatch), the whole chain appears at once when its
            // first block lands ([`shm_layout::PrefixTable::insert_chain`]).
            let evicted =
                prefix.insert_chain(answer, server, now) + prefix.insert_chain(&record.prompt_blocks, server, now);
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

#[cfg(test)]
mod tests {
    use shm_layout::LayoutPlan;

    use super::*;

    /// A server's entries older than its horizon are not matched, until an
    /// answer that ended since refreshes the conversation's deepest entry.
    #[test]
    fn a_horizon_sets_older_entries_aside_and_an_ended_answer_brings_one_back() {
        let seg = Arc::new(Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap()));
        let t = seg.tables();
        let (a, b) = (
            t.servers.register(1, "http://a", 0).unwrap(),
            t.servers.register(2, "http://b", 0).unwrap(),
        );
        let store = ShmStore::new(seg.clone(), 1, 600_000);
        let chain: Vec<u64> = (31..36u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        let now_s = seg.clock().now_ms() / 1000;
        // Refreshed a second before the horizon, on both servers.
        let before = Stamp((now_s as u16).wrapping_sub(1));
        t.prefix.insert_chain(&chain, b, before);
        t.prefix.insert_chain(&chain, a, before);
        let matched = |store: &ShmStore| {
            let m = store
                .lookup_now(LookupRequest {
                    members: crate::routing::Members::all(),
                    leg: crate::routing::Leg::Request,
                    response_key: None,
                    chain: &chain,
                    exclude: &[],
                    stale_after_ms: u64::MAX,
                    continuation: None,
                    precise: None,
                    affinity: None,
                })
                .prefix;
            (m.blocks_for(a.tag()), m.blocks_for(b.tag()))
        };
        assert_eq!(matched(&store), (5, 5));
        assert!(t.servers.raise_horizon(a, now_s as u32));
        assert_eq!(matched(&store), (0, 5), "only the demoted server's entries go");
        store.touch_route(a, chain[4]);
        assert_eq!(matched(&store), (5, 5), "its deepest entry is fresh again");
    }
}
