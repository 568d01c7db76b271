//! The routing state on Redis: the same prefix table, response cache and
//! in-flight counters as the shared-memory segment (`shm-layout`), kept in
//! a Redis server instead, so the gateway can be benchmarked against the
//! sLLM paper's Redis baseline (`--store redis`: [`super`], the store, builds on this module).
//!
//! This file holds the data model (below) and the two pipelines that span
//! it, [`RedisStore::dispatch_lookup`] and [`RedisStore::write_back`]. The
//! store's connection and round trips (`connection.rs`), its prefix
//! entries (`prefix_entries.rs`), cached responses (`responses.rs`),
//! in-flight counters (`inflight.rs`) and errors (`error.rs`) are files of
//! their own beside it ([`super`]'s tour lists them), re-exported here.
//!
//! # Data model
//!
//! Every key starts with the store's namespace `{ns}`, so several
//! deployments (or test runs) can share one Redis without seeing each other.
//!
//! | key | type | content | expiry |
//! | --- | --- | --- | --- |
//! | `{ns}:p:<hash, 16 hex digits>` | HASH | field = server id (hex, [`ServerId`]), value = last-refresh stamp (`now` of the insert) | the store's TTL, renewed by every insert |
//! | `{ns}:r:<key, 32 hex digits>` | STRING | XXH3-64 of the cached response (8 bytes, LE), then its bytes; a value whose checksum fails is a miss | the TTL given to [`RedisStore::put_response`] |
//! | `{ns}:if:<owner>` | HASH | one process's in-flight counts: `req:<id>` = requests, `tok:<id>` = their prompt tokens | the owner's lease ([`INFLIGHT_LEASE`]), renewed by every publication |
//! | `{ns}:written` | STRING | completion records written back so far (all response processes; for operators and tests) | none |
//! | `{ns}:horizon` | HASH | field = server id, value = its horizon (Unix ms): its fields stamped before it are not matched ([`RedisStore::raise_horizon`]) | [`HORIZON_SPAN`], renewed by every raise |
//! | `{ns}:seed` | STRING | the namespace's chain seed, 16 hex digits: every host roots its block chains in it | none |
//! | `{ns}:rl:<key, 16 hex digits>` | STRING | a rate-limit bucket's `tat` (Redis time, µs; `super::limits`) | when the bucket is full again |
//! | `{ns}:owners` | ZSET | member = owner (a process: host, pid, random), score = its lease's end (Redis time, ms) | a day after the last publication |
//!
//! In-flight counts are kept per process and published whole (absolute
//! values, not increments), so a publication that is lost or repeated
//! changes nothing for long, and a process that dies (SIGKILL, host lost)
//! stops counting when its lease ends instead of leaving its requests
//! counted forever. Readers sum the hashes of the owners whose lease has
//! not ended, in one script.
//!
//! A prefix entry keeps at most [`LANES`] servers, like a shm slot: the
//! insert script evicts the stalest field (smallest stamp, the smaller id
//! on equal stamps) when a fourth server arrives. This is done on insert, in
//! a Lua script, so the entry is never seen with more than three servers
//! and readers need no filtering. (The shm table breaks stamp ties by
//! refresh order instead; with a millisecond `now` ties are rare, and the
//! only effect is which of two equally old servers is forgotten.)
//!
//! # Semantics
//!
//! The same as [`shm_layout::PrefixTable`]: block `i`'s hash covers blocks
//! `0..=i`, so a server's match is the deepest block of the chain it is
//! listed for, scanning until the first block the table knows nothing
//! about. Two differences, both on the reading side: no liveness filter
//! here (the caller filters the returned servers), and every server seen is
//! reported, not just the deepest eight ([`shm_layout::MATCH_CAPACITY`]).
//! Results are sorted by server id.
//!
//! Servers are named by [`ServerId`]s, stable ids of their addresses, not by
//! the slots they have in one host's segment: every gateway host sharing a
//! namespace names a backend alike, whatever order it lists them in.
//!
//! # Round trips (what each operation costs)
//!
//! A round trip (request out, reply back) is the unit of cost on Redis: on
//! loopback it is tens of microseconds, on a network hundreds, against a
//! few hundred nanoseconds for a whole shm lookup. [`RedisStore::round_trips`]
//! counts them.
//!
//! | operation | round trips | why |
//! | --- | --- | --- |
//! | [`RedisStore::insert_chain`] | 1 | one `EVALSHA` whose script runs `HSET` + cap + `PEXPIRE` for every block of the chain |
//! | [`RedisStore::longest_prefix_match`] | 1 | one `EVALSHA` whose script walks the chain keys in order and stops at the first missing one |
//! | [`RedisStore::longest_prefix_match_naive`] | matched blocks + 1 (at most the chain length) | the paper's baseline: one `HGETALL` per block until the first miss; each depends on the previous answer |
//! | [`RedisStore::get_response`] / [`RedisStore::put_response`] | 1 | `GET` / `SET … PX` |
//! | [`RedisStore::write_back`] | 1 | a pipeline: one insert `EVALSHA` per record, one `SET … PX` per cached response |
//! | [`RedisStore::begin_request`] / [`RedisStore::end_request`] | 1 | one `EVALSHA` publishing this process's counts (`DEL`, `HSET`, `PEXPIRE`, `ZADD`) |
//! | [`RedisStore::inflight`] / [`RedisStore::inflight_load`] | 1 | one `EVALSHA` summing the live owners' hashes |
//!
//! A script runs atomically (no other command interleaves), but Redis does
//! not roll back: if one key of a chain holds a foreign type, the blocks
//! before it are recorded and the call returns an error.
//!
//! Scripts are loaded (`SCRIPT LOAD`) once per connection, when it is
//! opened; a `NOSCRIPT` reply (the server restarted or ran `SCRIPT FLUSH`)
//! costs two more round trips: reload, retry. The prefix and publication
//! scripts touch only keys passed in `KEYS`; the in-flight sum reads the
//! owner hashes it finds in the owner set, so it needs a single Redis (or a
//! hash tag on the namespace); this module does not use cluster mode.
//!
//! # Failures
//!
//! Connecting, reading and writing all have a timeout
//! ([`DEFAULT_TIMEOUT`] unless [`RedisStore::connect_with_timeout`] says
//! otherwise), so an outage is a quick [`StoreError`], never a hang. After
//! an I/O error, a timeout or an unparsable reply the connection is dropped
//! (it may still carry a stale reply); the next call opens a new one, so the
//! store recovers by itself when Redis comes back. An error reply (`ERR`,
//! `WRONGTYPE`, `NOSCRIPT`) keeps the connection. Nothing here panics on a
//! Redis error or an unexpected reply.

use std::time::Duration;

use redis::{ErrorKind, RedisError, Value};

use super::connection::millis;
pub use super::connection::{DEFAULT_TIMEOUT, RedisStore, owner_id};
pub use super::error::{ReplyError, StoreError};
pub use super::inflight::{INFLIGHT_LEASE, InflightLoad};
pub(crate) use super::inflight::{parse_inflight, publish_args};
pub(crate) use super::prefix_entries::parse_lpm;
pub use super::prefix_entries::{HORIZON_SPAN, LANES};
pub(crate) use super::responses::{sealed, unsealed};
pub use super::server_id::ServerId;
use super::server_id::id_field;

/// What a dispatcher's lookup reads from Redis ([`RedisStore::dispatch_lookup`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DispatchLookup {
    /// The cached response, if one was asked for and is present.
    pub response: Option<Vec<u8>>,
    /// `(server, leading blocks held)` per server, sorted by server.
    pub prefix: Vec<(ServerId, u32)>,
    /// `(server, stamp)`: when each server of [`prefix`](Self::prefix) last
    /// refreshed its deepest entry (Unix ms; empty for a naive match).
    pub refreshed: Vec<(ServerId, u64)>,
    /// In-flight figures per server over every live owner, sorted by server.
    pub loads: Vec<InflightLoad>,
    /// The servers an affinity key lists (their id fields), if one was
    /// asked for.
    pub holders: Option<Vec<String>>,
}

/// The one-round-trip pipeline of a dispatcher's lookup: `GET` of the
/// response (when `response_key` is given), `HKEYS` of the affinity key
/// (when `affinity` is given: a stored response's or a session's, see
/// [`crate::routing::affinity`]), the in-flight sum script, and
/// (when `scripted` and the chain is not empty) the longest-prefix script.
pub(crate) fn lookup_pipeline(
    namespace: &str,
    lpm_hash: &str,
    sum_hash: &str,
    response_key: Option<u128>,
    affinity: Option<u64>,
    chain: &[u64],
    scripted: bool,
) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    if let Some(key) = response_key {
        pipe.cmd("GET").arg(format!("{namespace}:r:{key:032x}"));
    }
    if let Some(key) = affinity {
        pipe.cmd("HKEYS").arg(format!("{namespace}:p:{key:016x}"));
    }
    pipe.cmd("EVALSHA")
        .arg(sum_hash)
        .arg(1)
        .arg(format!("{namespace}:owners"))
        .arg(format!("{namespace}:if:"));
    let chain = &chain[..chain.len().min(MAX_LOOKUP_BLOCKS)];
    if scripted && !chain.is_empty() {
        let cmd = pipe
            .cmd("EVALSHA")
            .arg(lpm_hash)
            .arg(chain.len() + 1)
            .arg(format!("{namespace}:horizon"));
        for hash in chain {
            cmd.arg(format!("{namespace}:p:{hash:016x}"));
        }
    }
    pipe
}

/// Parses the replies of a [`lookup_pipeline`] (the prefix stays empty
/// when it was not scripted).
pub(crate) fn parse_lookup(
    replies: Vec<Value>,
    asked_response: bool,
    asked_affinity: bool,
) -> Result<DispatchLookup, ReplyError> {
    let mut replies = replies.into_iter();
    let mut next = || replies.next().ok_or(ReplyError::ShortPipeline);
    let response = if asked_response {
        match next()? {
            Value::Nil => None,
            Value::BulkString(b) => unsealed(b),
            other => return Err(ReplyError::Get(other)),
        }
    } else {
        None
    };
    let holders = if asked_affinity {
        let reply = next()?;
        match redis::FromRedisValue::from_redis_value(&reply) {
            Ok(fields) => Some(fields),
            Err(_) => return Err(ReplyError::Holders(reply)),
        }
    } else {
        None
    };
    let loads = parse_inflight(&next()?)?;
    let (prefix, refreshed) = match replies.next() {
        Some(reply) => parse_lpm(&reply)?,
        None => Default::default(),
    };
    Ok(DispatchLookup {
        response,
        prefix,
        refreshed,
        loads,
        holders,
    })
}

/// Most blocks of a chain a lookup sends to Redis: the leading blocks route
/// a request, and a longer chain (a prompt of millions of tokens) would
/// make one script call block Redis for every host. 4096 blocks are 65 536
/// tokens at the default block size.
pub const MAX_LOOKUP_BLOCKS: usize = 4096;

/// One record of a [`RedisStore::write_back`] batch.
#[derive(Debug, Clone, Copy)]
pub struct WriteItem<'a> {
    /// The server that holds the blocks.
    pub server: ServerId,
    /// Block hashes to insert (or refresh) for it.
    pub blocks: &'a [u64],
    /// A response to cache: key, body, TTL.
    pub response: Option<(u128, &'a [u8], Duration)>,
}

impl RedisStore {
    /// Everything a dispatcher reads for one decision, in one round trip
    /// (the gateway's lookup, [`crate::store::redis::RedisRouting`], sends
    /// the same pipeline): the response under `response_key`, the in-flight
    /// figures and the longest-prefix match of `chain`. With `naive`, the
    /// match is then walked one round trip per block instead.
    pub fn dispatch_lookup(
        &mut self,
        response_key: Option<u128>,
        chain: &[u64],
        naive: bool,
    ) -> Result<DispatchLookup, StoreError> {
        const OP: &str = "dispatch_lookup";
        let pipe = lookup_pipeline(
            &self.namespace,
            self.lpm.get_hash(),
            self.sum.get_hash(),
            response_key,
            None,
            chain,
            !naive,
        );
        let mut sent = 0;
        let replies: Vec<Value> = loop {
            let conn = self.connection()?;
            let reply = pipe.query(conn);
            self.round_trips += 1;
            sent += 1;
            match reply {
                Err(e) if sent == 1 && e.kind() == ErrorKind::NoScriptError => {
                    for script in [self.lpm.clone(), self.sum.clone()] {
                        let conn = self.connection()?;
                        let loaded = script.load(conn);
                        self.round_trips += 1;
                        loaded.map_err(|e| self.fail(OP, e))?;
                    }
                }
                other => break other.map_err(|e| self.fail(OP, e))?,
            }
        };
        let mut lookup = parse_lookup(replies, response_key.is_some(), false)
            .map_err(|detail| StoreError::Protocol { op: OP, detail })?;
        if naive {
            lookup.prefix = self.longest_prefix_match_naive(chain)?;
        }
        Ok(lookup)
    }

    /// Writes a batch of learned records in one round trip: a pipeline of
    /// one insert script per record (its blocks for its server, at `now`)
    /// and one `SET … PX` per cached response, then `INCRBY {ns}:written
    /// records` (the completion records the items come from). A `NOSCRIPT`
    /// reply reloads the script and sends the batch again (inserts are
    /// idempotent; the counter is bumped by the last command, so only once).
    pub fn write_back(&mut self, items: &[WriteItem<'_>], records: u64, now: u64) -> Result<(), StoreError> {
        const OP: &str = "write_back";
        if items.is_empty() && records == 0 {
            return Ok(());
        }
        let ttl = millis(self.ttl).to_string();
        let lanes = LANES.to_string();
        let now = now.to_string();
        // Redis runs every command of a pipeline even when one fails, so a
        // resend after `NOSCRIPT` must not bump the counter again.
        let build = |count: u64| {
            let mut pipe = redis::pipe();
            for item in items {
                if !item.blocks.is_empty() {
                    let cmd = pipe.cmd("EVALSHA").arg(self.insert.get_hash()).arg(item.blocks.len());
                    for hash in item.blocks {
                        cmd.arg(self.prefix_key(*hash));
                    }
                    cmd.arg(id_field(item.server)).arg(&now).arg(&ttl).arg(&lanes).ignore();
                }
                if let Some((key, body, ttl)) = item.response {
                    pipe.cmd("SET")
                        .arg(self.response_key(key))
                        .arg(sealed(body))
                        .arg("PX")
                        .arg(millis(ttl))
                        .ignore();
                }
            }
            if count > 0 {
                pipe.cmd("INCRBY").arg(self.written_key()).arg(count).ignore();
            }
            pipe
        };
        let (pipe, resend) = (build(records), build(0));
        let conn = self.connection()?;
        let reply: Result<(), RedisError> = pipe.query(conn);
        self.round_trips += 1;
        match reply {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                let script = self.insert.clone();
                let conn = self.connection()?;
                let loaded = script.load(conn);
                self.round_trips += 1;
                loaded.map_err(|e| self.fail(OP, e))?;
                let conn = self.connection()?;
                let reply: Result<(), RedisError> = resend.query(conn);
                self.round_trips += 1;
                reply.map_err(|e| self.fail(OP, e))
            }
            Err(e) => Err(self.fail(OP, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_sends_at_most_the_leading_blocks() {
        let keys_sent = |blocks: usize| {
            let chain: Vec<u64> = (0..blocks as u64).collect();
            let pipe = lookup_pipeline("ns", "lpm", "sum", None, None, &chain, true);
            let lpm = pipe.cmd_iter().nth(1).expect("the prefix script");
            lpm.args_iter()
                .filter(|a| matches!(a, redis::Arg::Simple(k) if k.starts_with(b"ns:p:")))
                .count()
        };
        assert_eq!(keys_sent(10), 10);
        assert_eq!(keys_sent(MAX_LOOKUP_BLOCKS), MAX_LOOKUP_BLOCKS);
        assert_eq!(keys_sent(MAX_LOOKUP_BLOCKS * 100), MAX_LOOKUP_BLOCKS);
    }
}
