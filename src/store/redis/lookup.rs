//! A dispatcher's lookup ([`RoutingStore::lookup`](crate::store::RoutingStore::lookup)):
//! the one-round-trip pipeline (cached response, in-flight sum, longest
//! prefix), the naive walk of `lookup = "naive"`, the end-key probes of a
//! prompt that continues an earlier answer, and the answer mapped onto
//! this host's candidates, or this host's fallback during an outage.

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use shm_layout::{PrefixMatch, ServerRef, Stamp};

use super::RedisRouting;
use super::client::{self, DispatchLookup, ServerId, StoreError, lookup_pipeline, parse_lookup};
use super::clocks::{segment_stamp, unix_ms};
use super::server_id;
use crate::config::RedisLookup;
use crate::prefix::continuation::EndProbe;
use crate::prefix::precise;
use crate::routing::Candidate;
use crate::store::{Lookup, LookupRequest};

impl RedisRouting {
    /// What [`RoutingStore::lookup`](crate::store::RoutingStore::lookup)
    /// answers (see the module docs).
    pub(super) async fn look_up(&self, request: LookupRequest<'_>) -> Lookup {
        let mut lookup = Lookup::of_candidates(&self.local, &request);
        let Some(fetched) = self.guarded("lookup", self.fetch(request)).await else {
            self.degraded.fetch_add(1, Relaxed);
            self.health.degraded_in_outage.fetch_add(1, Relaxed);
            lookup.degraded = true;
            // What the engines confirmed is this host's: it still routes.
            if request.precise.is_some() {
                let segment = self.local.segment();
                let now = Stamp((segment.clock().now_ms() / 1000) as u16);
                lookup.prefix = precise::confirmed_match(&segment.tables(), now, request.chain, request.exclude);
            }
            return lookup;
        };
        self.lookups.fetch_add(1, Relaxed);
        lookup.response = fetched.response.map(Bytes::from);
        lookup.affine = fetched.holders.map(|fields| self.listed(&fields, &lookup.candidates));
        let candidates = &mut lookup.candidates;
        let servers = self.local.segment().tables().servers;
        // Redis names servers by id; this host's candidates by slot.
        let ids: Vec<Option<ServerId>> = candidates.iter().map(|c| servers.id_of(c.server.slot)).collect();
        let (segment_now, unix_now) = (self.local.segment().clock().now_ms(), unix_ms());
        for (id, depth) in fetched.prefix {
            if let Some(i) = ids.iter().position(|c| *c == Some(id)) {
                let c = &candidates[i];
                let refreshed = fetched
                    .refreshed
                    .binary_search_by_key(&id, |(s, _)| *s)
                    .ok()
                    .and_then(|i| segment_stamp(fetched.refreshed[i].1, segment_now, unix_now));
                lookup.prefix.add_refreshed(c.server.tag(), depth, refreshed);
            }
        }
        if let Some(window) = request.precise {
            // The engines' confirmed blocks are this host's (its
            // response processes follow every engine's events).
            let tables = self.local.segment().tables();
            let now = Stamp((segment_now / 1000) as u16);
            let recent = precise::recent_only(&lookup.prefix, &tables.servers, now, window);
            lookup.prefix = precise::merge(
                recent,
                &precise::confirmed_match(&tables, now, request.chain, request.exclude),
            );
        }
        if let Some(probe) = request.continuation.filter(|_| !lookup.prefix.is_empty()) {
            lookup.continued = self.continued(&probe, &lookup.prefix).await;
        }
        for load in fetched.loads {
            if let Some(i) = ids.iter().position(|c| *c == Some(load.server)) {
                let c = &mut candidates[i];
                c.inflight = c.inflight.max(load.requests.max(0) as u64);
                c.inflight_tokens = c.inflight_tokens.max(load.tokens.max(0) as u64);
            }
        }
        lookup
    }

    /// The Redis part of a lookup: response, longest-prefix pairs, loads.
    async fn fetch(&self, request: LookupRequest<'_>) -> Result<DispatchLookup, StoreError> {
        const OP: &str = "lookup";
        let names = &self.names;
        let scripted = self.config.lookup == RedisLookup::Script;
        let pipe = lookup_pipeline(
            &names.namespace,
            &names.lpm,
            &names.sum,
            request.response_key.map(|k| k.0),
            request.affinity,
            request.chain,
            scripted,
        );
        let replies = self.query(OP, &pipe).await?;
        let mut lookup = parse_lookup(replies, request.response_key.is_some(), request.affinity.is_some())
            .map_err(|detail| StoreError::Protocol { op: OP, detail })?;
        if !scripted && !request.chain.is_empty() {
            lookup.prefix = self.naive_match(request.chain).await?;
        }
        Ok(lookup)
    }

    /// One `HGETALL` round trip per block until the first missing one.
    async fn naive_match(&self, chain: &[u64]) -> Result<Vec<(ServerId, u32)>, StoreError> {
        const OP: &str = "lookup (naive)";
        let chain = &chain[..chain.len().min(client::MAX_LOOKUP_BLOCKS)];
        let mut conn = self.connection().await?;
        let mut found: Vec<(ServerId, u32)> = Vec::new();
        for (i, hash) in chain.iter().enumerate() {
            let fields: Vec<(String, String)> = redis::cmd("HGETALL")
                .arg(format!("{}:p:{hash:016x}", self.names.namespace))
                .query_async(&mut conn)
                .await
                .map_err(|source| StoreError::Command { op: OP, source })?;
            if fields.is_empty() {
                break;
            }
            for server in fields.iter().filter_map(|(s, _)| u64::from_str_radix(s, 16).ok()) {
                match found.iter_mut().find(|(s, _)| *s == server) {
                    Some(e) => e.1 = i as u32 + 1,
                    None => found.push((server, i as u32 + 1)),
                }
            }
        }
        Ok(found)
    }

    /// The candidates of `among` that the prefix-table key `key` lists (an
    /// affinity key): one `HKEYS` round trip; none when it fails.
    pub(super) async fn listed_for(&self, key: u64, among: &[Candidate]) -> Vec<ServerRef> {
        let mut pipe = redis::pipe();
        pipe.cmd("HKEYS").arg(self.names.prefix_key(key));
        let Some(replies) = self.guarded("affinity", self.query("affinity", &pipe)).await else {
            return Vec::new();
        };
        let fields: Vec<String> = replies
            .first()
            .map(|r| redis::FromRedisValue::from_redis_value(r).unwrap_or_default())
            .unwrap_or_default();
        self.listed(&fields, among)
    }

    /// The candidates of `among` whose id `fields` (a prefix entry's
    /// fields) name.
    fn listed(&self, fields: &[String], among: &[Candidate]) -> Vec<ServerRef> {
        let servers = self.local.segment().tables().servers;
        among
            .iter()
            .filter(|c| {
                servers
                    .id_of(c.server.slot)
                    .map(server_id::id_field)
                    .is_some_and(|id| fields.contains(&id))
            })
            .map(|c| c.server)
            .collect()
    }

    /// The servers of `prefix` whose earlier prompt this one continues:
    /// one more round trip (an `HKEYS` per probe), made only for prompts
    /// that carry an earlier answer and match some server. Nothing is
    /// credited when it fails.
    async fn continued(&self, probe: &EndProbe<'_>, prefix: &PrefixMatch) -> PrefixMatch {
        let mut probes = Vec::new();
        probe.probes(prefix, &mut probes);
        if probes.is_empty() {
            return PrefixMatch::default();
        }
        let mut pipe = redis::pipe();
        for p in &probes {
            pipe.cmd("HKEYS").arg(self.names.prefix_key(p.key));
        }
        let Some(replies) = self.guarded("continuation", self.query("continuation", &pipe)).await else {
            return PrefixMatch::default();
        };
        let listed: Vec<Vec<String>> = replies
            .iter()
            .map(|r| redis::FromRedisValue::from_redis_value(r).unwrap_or_default())
            .collect();
        let servers = self.local.segment().tables().servers;
        probe.credit(prefix, &probes, |i, server| {
            let id = servers.id_of(server.slot()).map(server_id::id_field);
            listed
                .get(i)
                .is_some_and(|fields| id.is_some_and(|id| fields.contains(&id)))
        })
    }
}
