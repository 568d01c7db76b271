//! Prefix entries (`{ns}:p:<hash>`, and the servers' horizons in
//! `{ns}:horizon`): inserting a chain for a server, reading an entry, the
//! longest-prefix match (the script's, in one round trip, and the sLLM
//! paper's baseline, one round trip per block), raising a horizon and
//! forgetting a server.

use std::time::Duration;

use redis::{FromRedisValue, RedisError, Value};

use super::connection::{RedisStore, ScriptId, millis};
use super::error::{ReplyError, StoreError};
use super::scripts::RAISE_SCRIPT;
use super::server_id::{ServerId, id_field, parse_id};

/// Servers remembered per prefix entry (as in the shm table).
pub const LANES: usize = shm_layout::prefix_table::LANES;

/// Records that `server` holds `depth` (1-based) leading blocks, keeping
/// the deepest depth per server.
fn record(found: &mut Vec<(ServerId, u32)>, server: ServerId, depth: u32) {
    match found.iter_mut().find(|(s, _)| *s == server) {
        Some(e) => e.1 = e.1.max(depth),
        None => found.push((server, depth)),
    }
}

/// How long a server's horizon is kept ([`shm_layout::HORIZON_SPAN_S`]).
pub const HORIZON_SPAN: Duration = Duration::from_secs(shm_layout::HORIZON_SPAN_S);

/// `(server, leading blocks held)` per server.
type Depths = Vec<(ServerId, u32)>;
/// `(server, stamp)` per server.
type Stamps = Vec<(ServerId, u64)>;

/// Parses a [`LPM_SCRIPT`](super::scripts::LPM_SCRIPT) reply into `(server, depth)` pairs and
/// `(server, stamp of its deepest field)` pairs, both sorted by server.
pub(crate) fn parse_lpm(reply: &Value) -> Result<(Depths, Stamps), ReplyError> {
    let Value::Array(flat) = reply else {
        return Err(ReplyError::NotArray(reply.clone()));
    };
    if !flat.len().is_multiple_of(3) {
        return Err(ReplyError::NotTriples(flat.len()));
    }
    let mut found = Vec::with_capacity(flat.len() / 3);
    let mut stamps = Vec::with_capacity(flat.len() / 3);
    for triple in flat.chunks_exact(3) {
        let id = String::from_redis_value(&triple[0]).ok();
        match (
            id.as_deref().and_then(parse_id),
            i64::from_redis_value(&triple[1])
                .ok()
                .and_then(|d| u32::try_from(d).ok()),
            i64::from_redis_value(&triple[2])
                .ok()
                .and_then(|s| u64::try_from(s).ok()),
        ) {
            (Some(server), Some(depth), Some(stamp)) if depth >= 1 => {
                record(&mut found, server, depth);
                stamps.push((server, stamp));
            }
            _ => return Err(ReplyError::Triple(triple.to_vec())),
        }
    }
    found.sort_unstable();
    stamps.sort_unstable();
    stamps.dedup_by_key(|(server, _)| *server);
    Ok((found, stamps))
}

impl RedisStore {
    /// Records that `server` holds every prefix of `chain`, as of `now`
    /// (any increasing clock; milliseconds keep ties rare), and renews the
    /// entries' TTL. One round trip.
    pub fn insert_chain(&mut self, chain: &[u64], server: ServerId, now: u64) -> Result<(), StoreError> {
        if chain.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = chain.iter().map(|h| self.prefix_key(*h)).collect();
        let args = [
            id_field(server),
            now.to_string(),
            millis(self.ttl).to_string(),
            LANES.to_string(),
        ];
        self.eval("insert_chain", ScriptId::Insert, &keys, &args).map(drop)
    }

    /// Records that `server` holds the prefix `hash` (a one-block
    /// [`RedisStore::insert_chain`]).
    pub fn insert(&mut self, hash: u64, server: ServerId, now: u64) -> Result<(), StoreError> {
        self.insert_chain(&[hash], server, now)
    }

    /// The servers of entry `hash` with their stamps, most recent first
    /// (equal stamps: smaller id first). Empty if there is no entry.
    pub fn lookup(&mut self, hash: u64) -> Result<Vec<(ServerId, u64)>, StoreError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(self.prefix_key(hash));
        let fields: Vec<(String, String)> = self.query("lookup", &cmd)?;
        let mut out = Vec::with_capacity(fields.len());
        for (field, stamp) in fields {
            match (parse_id(&field), stamp.parse::<u64>()) {
                (Some(server), Ok(stamp)) => out.push((server, stamp)),
                _ => {
                    return Err(StoreError::Protocol {
                        op: "lookup",
                        detail: ReplyError::EntryField { field, stamp },
                    });
                }
            }
        }
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        Ok(out)
    }

    /// Longest-prefix match: for every server listed in the leading known
    /// blocks of `chain`, `(server, leading blocks held)`, sorted by server.
    /// One round trip (a server-side script walks the chain).
    pub fn longest_prefix_match(&mut self, chain: &[u64]) -> Result<Vec<(ServerId, u32)>, StoreError> {
        const OP: &str = "longest_prefix_match";
        if chain.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = std::iter::once(format!("{}:horizon", self.namespace))
            .chain(chain.iter().map(|h| self.prefix_key(*h)))
            .collect();
        let reply = self.eval(OP, ScriptId::Lpm, &keys, &[])?;
        parse_lpm(&reply)
            .map(|(found, _)| found)
            .map_err(|detail| StoreError::Protocol { op: OP, detail })
    }

    /// Sets `server`'s horizon to `at_ms` (Unix ms) if that is later
    /// than the one it has: its fields stamped before it are not matched
    /// any more (its engine was seen to evict them; see
    /// [`crate::responder`]). Returns whether it moved. The naive match
    /// (the paper's baseline) does not read horizons.
    pub fn raise_horizon(&mut self, server: ServerId, at_ms: u64) -> Result<bool, StoreError> {
        const OP: &str = "raise_horizon";
        let key = format!("{}:horizon", self.namespace);
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(RAISE_SCRIPT)
            .arg(1)
            .arg(key)
            .arg(id_field(server))
            .arg(at_ms)
            .arg(millis(HORIZON_SPAN));
        let moved: i64 = self.query(OP, &cmd)?;
        Ok(moved == 1)
    }

    /// [`RedisStore::longest_prefix_match`] the way the sLLM paper's
    /// baseline does it: one `HGETALL` round trip per block, until the
    /// first missing block. Same result.
    pub fn longest_prefix_match_naive(&mut self, chain: &[u64]) -> Result<Vec<(ServerId, u32)>, StoreError> {
        const OP: &str = "longest_prefix_match_naive";
        let mut found = Vec::new();
        for (i, hash) in chain.iter().enumerate() {
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(self.prefix_key(*hash));
            let fields: Vec<(String, String)> = self.query(OP, &cmd)?;
            if fields.is_empty() {
                break;
            }
            for (field, _) in fields {
                // Skip what this module never writes, like the script does.
                if let Some(server) = parse_id(&field) {
                    record(&mut found, server, i as u32 + 1);
                }
            }
        }
        found.sort_unstable();
        Ok(found)
    }

    /// Forgets `server` in every prefix entry of the namespace
    /// (its engine lost its cache); returns how many listed it. A `SCAN`
    /// of the prefix keys, 1 000 at a time, each batch's `HDEL`s in one
    /// pipeline: a rare operation, not one for the request path.
    pub fn forget_server(&mut self, server: ServerId) -> Result<u64, StoreError> {
        const OP: &str = "forget_server";
        let pattern = format!("{}:p:*", self.namespace);
        let mut cursor = 0u64;
        let mut removed = 0u64;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000);
            let (next, keys): (u64, Vec<String>) = self.query(OP, &scan)?;
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("HDEL").arg(key).arg(id_field(server));
                }
                let conn = self.connection()?;
                let counts: Result<Vec<u64>, RedisError> = pipe.query(conn);
                self.round_trips += 1;
                removed += counts.map_err(|e| self.fail(OP, e))?.iter().sum::<u64>();
            }
            if next == 0 {
                return Ok(removed);
            }
            cursor = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keeps_the_deepest_depth() {
        let mut m = Vec::new();
        record(&mut m, 3, 1);
        record(&mut m, 3, 4);
        record(&mut m, 1, 2);
        assert_eq!(m, vec![(3, 4), (1, 2)]);
    }
}
