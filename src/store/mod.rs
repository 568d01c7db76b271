//! Where the routing state lives: one interface, two implementations.
//!
//! The routing state is what dispatchers read on the request path and
//! response processes write after it: the prefix table (block hash →
//! servers), the response cache (exact request → answer) and the servers'
//! in-flight counters. It lives either in the host's shared-memory segment
//! ([`shm::ShmStore`], the default) or in Redis ([`redis::RedisRouting`],
//! `--store redis`), which lets several gateway hosts share it and is the
//! sLLM paper's baseline.
//!
//! | side | trait | shm | Redis |
//! | --- | --- | --- | --- |
//! | dispatcher, request path | [`RoutingStore`] | [`shm::ShmStore`]: lock-free reads of the segment | [`redis::RedisRouting`]: one pipelined round trip (response `GET`, longest-prefix script, in-flight sum script) |
//! | response process, off the path | [`WriteBack`] | [`shm::ShmWriteBack`]: inserts into the segment | [`redis::RedisWriteBack`]: one pipeline per batch of records, kept and retried during an outage |
//!
//! | module | concern |
//! | --- | --- |
//! | [`local`] | what this host's segment knows whichever store holds the shared tables: candidates, in-flight ledgers, the limit table |
//! | [`shm`] | the shared-memory store |
//! | [`redis`] | the Redis store. The dispatcher's [`redis::RedisRouting`]: `mod.rs` (connection, the trait), `lookup.rs`, `learn.rs`, `publish.rs` (in-flight counts), `limits.rs`, `health.rs` (outages), `clocks.rs`; the response process's [`redis::RedisWriteBack`]: `write_back.rs`; the synchronous client [`redis::client`] and its data model: `client.rs` (its pipelines), `connection.rs` (round trips), `prefix_entries.rs`, `responses.rs`, `inflight.rs`, `error.rs`, `scripts.rs`; connecting: [`redis::credentials`], [`redis::url`], [`redis::server_id`] |
//! | [`segments`] | the tokenizer's token segments every process shares, in the segment's segment log |
//!
//! The routing policies ([`crate::routing`]) never see the store: a
//! [`RoutingStore::lookup`] gives them the same [`Lookup`] from either.
//! The server table (addresses, registrations, health) stays in shared
//! memory in both modes: it is this host's configuration. So do the
//! per-process in-flight ledgers, which are reclaimed when a process dies;
//! in Redis mode the counts are also published to Redis so every host sees
//! every host's load, and a lookup takes the larger of the two. Both
//! stores, the gateway queue and the route step read the host's servers
//! and ledgers through [`local::LocalState`].
//!
//! # Learning at dispatch
//!
//! A response process writes what a finished answer teaches, but the next
//! turn of a conversation is often routed before that. So a dispatcher
//! also writes, the moment it sends a prompt to a server
//! ([`RoutingStore::record_route`]): the prompt's chain for that server and
//! the prompt's end key ([`crate::prefix::continuation`]), after the request is
//! counted in flight there, so a request that sees the entries sees the
//! load too and a burst sharing a new prefix meets the policy's load
//! rules. An attempt that fails or is refused takes back what it added
//! ([`RoutingStore::forget_route`]), so it does not look warm. The shm
//! store writes the segment directly; the Redis store sends the same
//! insert script as the write-back, without waiting for it. A lookup asked
//! with an [`EndProbe`] also reports the servers whose earlier prompt this
//! one continues ([`Lookup::continued`]). When an answer ends, the
//! dispatcher refreshes its prompt's deepest entry
//! ([`RoutingStore::touch_route`]): a server's horizon, raised when its
//! engine reports an eviction ([`WriteBack::demote_before`]), then cannot
//! set aside a conversation that was running meanwhile.
//!
//! # Rate limits
//!
//! The buckets of [`crate::tenancy::rate_limit`] live in the segment's limit table
//! with the shm store ([`RoutingStore::take_limits`]: one CAS per bucket),
//! and in Redis with the Redis store (one script round trip taking every
//! bucket of a request at once, timed by Redis's clock, so every host of
//! the namespace charges the same buckets). During a Redis outage the
//! limits fall back to the segment's table: per host, not per namespace.
//!
//! # Failures
//!
//! A lookup never fails. When Redis cannot be reached or does not answer
//! within its timeout, the lookup answers from what this host knows — no
//! prefix match, no cached response, the local in-flight counts — so
//! routing falls back to load-only choices, and [`Lookup::degraded`] says
//! so. The outage is logged once and counted ([`StoreStats`]); while it
//! lasts, Redis is probed again every `store.redis.retry_ms` rather than on
//! every request, and the first answer ends it.

pub mod local;
pub mod redis;
pub mod segments;
pub mod shm;

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use shm_layout::{Completion, PrefixMatch, ResponseKey, ServerRef, Stamp};

use crate::config::StoreKind;
use crate::prefix::continuation::EndProbe;
use crate::routing::Candidate;
use crate::routing::{Leg, Members};
use crate::tenancy::rate_limit::{Charge, Settlement, Verdict};

/// What a dispatcher asks the store for one routing decision.
#[derive(Debug, Clone, Copy)]
pub struct LookupRequest<'a> {
    /// The response-cache key to read, if the request may be answered from
    /// the cache.
    pub response_key: Option<ResponseKey>,
    /// The prompt's block chain (empty: no prefix lookup).
    pub chain: &'a [u64],
    /// Servers not to consider (they failed this request already).
    pub exclude: &'a [ServerRef],
    /// The servers that may be candidates: the request's model pool
    /// ([`Members::all`] for any server).
    pub members: &'a Members,
    /// The part of the request they are for: servers of other roles are
    /// no candidates ([`Leg`]).
    pub leg: Leg,
    /// Scraped load figures older than this (segment milliseconds) are
    /// left out of the candidates (`health.stale_after_ms`, see
    /// [`crate::health::fresh_load`]); `u64::MAX` keeps any scraped figures.
    pub stale_after_ms: u64,
    /// Look for the servers whose earlier prompt this one continues
    /// (a prompt that carries an earlier answer).
    pub continuation: Option<EndProbe<'a>>,
    /// `Some(window)`: the precise prefix source, with the gateway's own
    /// entries for an engine whose events it follows counting `window`
    /// seconds ([`crate::prefix::precise`]); `None`: the estimate.
    pub precise: Option<u16>,
    /// An affinity key ([`crate::routing::affinity`]) whose servers to read
    /// in the same round trip, where the store has round trips.
    pub affinity: Option<u64>,
}

/// What the store knows for one routing decision.
#[derive(Debug, Clone, Default)]
pub struct Lookup {
    /// A fresh cached answer under the requested key.
    pub response: Option<Bytes>,
    /// Which candidates hold how many leading blocks of the chain, as the
    /// table lists them.
    pub prefix: PrefixMatch,
    /// The candidates whose earlier prompt this one continues, credited
    /// with the blocks of the answer they generated after it (not in the
    /// table yet: see [`crate::prefix::continuation`]).
    pub continued: PrefixMatch,
    /// The live servers of the pool, minus the excluded ones, with their load (scraped
    /// figures only when fresh, else zeros).
    pub candidates: Vec<Candidate>,
    /// The store could not be asked: the answer is this host's fallback
    /// (no prefix, no cached response, local load only).
    pub degraded: bool,
    /// The candidates the request's affinity key lists, when read with
    /// the lookup (`None`: not read; [`RoutingStore::holders`] reads them).
    pub affine: Option<Vec<ServerRef>>,
}

impl Lookup {
    /// A lookup holding `local`'s live candidates for `request`, with no
    /// match yet: what every store's lookup starts from.
    pub(crate) fn of_candidates(local: &local::LocalState, request: &LookupRequest<'_>) -> Self {
        let mut lookup = Lookup::default();
        local.candidates(
            request.exclude,
            request.members,
            request.leg,
            request.stale_after_ms,
            &mut lookup.candidates,
        );
        lookup
    }

    /// The match a policy routes on: the table's, raised by the credit of
    /// continued conversations.
    pub fn routing_prefix(&self) -> PrefixMatch {
        let mut prefix = self.prefix;
        for (server, blocks) in self.continued.iter() {
            prefix.add(server, blocks);
        }
        prefix
    }
}

/// Counters of a store (all stores have them; shm's stay zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Lookups answered by the store.
    pub lookups: u64,
    /// Lookups answered by the fallback (store unreachable or slow).
    pub degraded_lookups: u64,
    /// Store operations that failed (errors and timeouts).
    pub failures: u64,
    /// Outages seen (a transition from answering to failing).
    pub outages: u64,
    /// Load publications sent (Redis: this process's in-flight counts).
    pub publishes: u64,
}

/// What one [`WriteBack::write`] did (a response process adds it to its
/// own counters, `crate::responder::ResponderStats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteStats {
    /// Records applied.
    pub records: u64,
    /// Block hashes inserted or refreshed.
    pub blocks: u64,
    /// Responses stored.
    pub responses_stored: u64,
    /// Responses refused by the store (larger than its limit).
    pub responses_too_large: u64,
    /// Write-backs that failed (the store was unreachable; records kept).
    pub writeback_failures: u64,
    /// Records given up because the backlog kept during an outage was full.
    pub writeback_dropped: u64,
    /// Prefix entries evicted from full buckets by the inserts (shm store).
    pub evictions: u64,
}

/// A future a [`RoutingStore`] returns.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The request-path side of a store: what a dispatcher reads and the
/// in-flight accounting it keeps.
pub trait RoutingStore: Send + Sync + fmt::Debug {
    /// Which store this is.
    fn kind(&self) -> StoreKind;

    /// The response-cache entry, the prefix match and the candidates'
    /// load for one decision. Never fails (see the module docs).
    fn lookup<'a>(&'a self, request: LookupRequest<'a>) -> StoreFuture<'a, Lookup>;

    /// Counts a request of `prompt_tokens` tokens in flight to `server`;
    /// false if the registration is stale (then nothing is counted).
    fn begin_request(&self, server: ServerRef, prompt_tokens: u64) -> bool;

    /// A request [`begin_request`](Self::begin_request) counted got its
    /// first token: no longer pending (host-local accounting, in the shm
    /// ledger, in both stores).
    fn first_token(&self, server: ServerRef, prompt_tokens: u64);

    /// Ends a request [`begin_request`](Self::begin_request) counted;
    /// `started`: whether [`first_token`](Self::first_token) was called.
    fn end_request(&self, server: ServerRef, prompt_tokens: u64, started: bool);

    /// A prompt was sent to `server`: records `blocks` (its chain, less
    /// the leading blocks the server was already listed for) and its
    /// `end_key` (`None` for a prefill leg: the engine will not hold the
    /// answer, which a conversation's next turn continues) for it, at once on shm, without waiting on Redis. Call it
    /// once the request is counted in flight (see the module docs).
    fn record_route(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>);

    /// Records an affinity key ([`crate::routing::affinity`]: a stored
    /// response's) for `server`, done when the store holds it: the client's
    /// continuation, sent the instant the answer ends, through any
    /// dispatcher of any host, must find it.
    fn record_affinity<'a>(&'a self, server: ServerRef, key: u64) -> StoreFuture<'a, ()> {
        self.record_route(server, &[key], None);
        Box::pin(std::future::ready(()))
    }

    /// Takes back a [`record_route`](Self::record_route) whose attempt
    /// failed or was refused.
    fn forget_route(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>);

    /// The servers of `among` that an affinity key lists (a stored
    /// response's engine, a session's: [`crate::routing::affinity`]),
    /// written with [`record_route`](Self::record_route). Empty when the
    /// store cannot be asked.
    fn holders<'a>(&'a self, key: u64, among: &'a [Candidate]) -> StoreFuture<'a, Vec<ServerRef>>;

    /// An answer from `server` to a prompt whose chain ends in block
    /// `last` has just ended: the engine holds the prompt now. Refreshes
    /// that entry, so that a horizon raised while the request ran (on
    /// evidence older than its answer) does not set the conversation aside
    /// before the response process refreshes the whole chain: a match
    /// counts a server's deepest entry it accepts.
    fn touch_route(&self, server: ServerRef, last: u64);

    /// Takes a request's rate-limit `charges`, all or none
    /// ([`crate::tenancy::rate_limit`]); the segment's limit table unless the store
    /// keeps its own.
    fn take_limits<'a>(&'a self, charges: &'a [Charge]) -> StoreFuture<'a, Verdict> {
        Box::pin(std::future::ready(self.local().take_limits(charges)))
    }

    /// Settles an answer's output reservation (charges beyond it, room or
    /// not, and the refund of what it did not use): done when the store
    /// holds them, so that the client's next request, sent the instant the
    /// answer ends, is limited by what this one really used.
    fn settle_limits<'a>(&'a self, settlement: &'a Settlement) -> StoreFuture<'a, ()> {
        self.charge_limits(&settlement.charge);
        self.refund_limits(&settlement.refund);
        Box::pin(std::future::ready(()))
    }

    /// Charges `charges` room or not (an answer's output tokens), without
    /// waiting.
    fn charge_limits(&self, charges: &[Charge]) {
        self.local().charge_limits(charges);
    }

    /// Gives `charges` back (the unused part of an output reservation),
    /// without waiting.
    fn refund_limits(&self, charges: &[Charge]) {
        self.local().refund_limits(charges);
    }

    /// Its counters.
    fn stats(&self) -> StoreStats;

    /// The host-local state it counts requests in and reads candidates
    /// from (the gateway queue and a holding policy's check read it too).
    fn local(&self) -> &local::LocalState;

    /// The seed block chains are rooted in when it is not the segment's
    /// own: with Redis, the namespace's, which every gateway host sharing
    /// it reads (`None` until it is known, and for shared memory).
    fn chain_seed(&self) -> Option<u64> {
        None
    }

    /// [`RoutingStore::chain_seed`], reading it first if it is not known
    /// yet and the store may be asked (within its timeout; `None` during
    /// an outage). The first requests after a start wait for it, so that
    /// they are hashed like every later one.
    fn await_chain_seed(&self) -> StoreFuture<'_, Option<u64>> {
        Box::pin(std::future::ready(self.chain_seed()))
    }
}

/// The write side of a store: what a response process does with a batch of
/// completion records whose servers are current.
pub trait WriteBack: fmt::Debug {
    /// Which store this is.
    fn kind(&self) -> StoreKind;

    /// Writes `batch` (prefix entries for the prompt and the prompt +
    /// answer chains, cached responses) as of prefix stamp `now` and
    /// segment time `now_ms`, and counts what it did in `stats`. A store
    /// that cannot be reached keeps the records (bounded) and writes them
    /// on a later call.
    fn write(&mut self, batch: &[Completion], now: Stamp, now_ms: u64, stats: &mut WriteStats);

    /// Forgets `server` in every prefix entry: its engine lost its cache
    /// (flushed, restarted). Returns how many entries listed it; 0 when the
    /// store cannot be reached (its entries then age out).
    fn forget_server(&mut self, server: ServerRef) -> u64;

    /// Sets `server`'s prefix entries refreshed before segment second
    /// `at_s` aside (`now_ms`: segment time now): its engine was seen to
    /// have evicted a prefix the server last refreshed then. Returns
    /// whether that set more aside. Both stores keep a per-server
    /// **horizon**: the shm store in the server table
    /// ([`shm_layout::ServerTable::raise_horizon`]), Redis in a hash its
    /// match script reads ([`redis::client::RedisStore::raise_horizon`]).
    fn demote_before(&mut self, server: ServerRef, at_s: u32, now_ms: u64) -> bool;
}

/// The blocks of a record's full chain that its prompt chain does not
/// already cover: the full chain starts with the prompt's full blocks, so
/// only what the answer added needs writing (all of it if they differ).
pub fn answer_blocks(record: &Completion) -> &[u64] {
    let shared = record.prompt_blocks.len().min(record.full_blocks.len());
    let extends = record.full_blocks[..shared] == record.prompt_blocks[..shared];
    &record.full_blocks[if extends { shared } else { 0 }..]
}

/// The seed a dispatcher roots its block chains in: the store's own when
/// it has one ([`RoutingStore::chain_seed`]: Redis's namespace seed, which
/// every host sharing the namespace reads; read first if not yet known),
/// else `own` (the segment's). Callers need not know which store it is.
pub async fn chain_seed_or(store: &dyn RoutingStore, own: u64) -> u64 {
    match store.chain_seed() {
        Some(seed) => seed,
        None if store.kind() == StoreKind::Redis => store.await_chain_seed().await.unwrap_or(own),
        None => own,
    }
}

/// The seed chains are rooted in, as the dispatchers root them, for a
/// process that has no store of its own (the KV-events subscriber): the
/// Redis namespace's with `--store redis` (`None` while Redis cannot be
/// asked), else the segment's.
pub async fn chain_seed_for(config: &crate::config::ServeConfig, segment: &shm_layout::Segment) -> Option<u64> {
    match config.store.kind {
        StoreKind::Shm => Some(segment.header().seed[0]),
        StoreKind::Redis => {
            let candidate = segment.header().seed[1] ^ segment.clock().now_ms().rotate_left(17);
            match redis::chain_seed_of(&config.store.redis, candidate).await {
                Ok(seed) => Some(seed),
                Err(e) => {
                    tracing::warn!("KV events: the namespace's chain seed cannot be read yet: {e}");
                    None
                }
            }
        }
    }
}

/// The stable id of the server at `address` (`http://host:port`, as the
/// supervisor registers it): the same on every gateway host whatever order
/// it lists its backends in, and across restarts. The server table keeps
/// it, and the Redis store names servers by it, so that hosts sharing a
/// namespace share what they learn of each server.
pub fn server_id(address: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(address.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_blocks_skip_the_prompt_only_when_the_chain_extends_it() {
        let record = |prompt: &[u64], full: &[u64]| Completion {
            prompt_blocks: prompt.to_vec(),
            full_blocks: full.to_vec(),
            ..Completion::default()
        };
        assert_eq!(answer_blocks(&record(&[1, 2], &[1, 2, 3])), &[3]);
        assert_eq!(answer_blocks(&record(&[1, 2], &[1, 9, 3])), &[1, 9, 3]);
        assert_eq!(answer_blocks(&record(&[1, 2, 3], &[1, 2])), &[] as &[u64]);
    }
}
