//! In-flight counters (`{ns}:if:<owner>`, `{ns}:owners`): a process's
//! requests and prompt tokens per server, published whole under a lease,
//! and the sum over every live owner.

use std::time::Duration;

use redis::{FromRedisValue, Value};

use super::connection::{RedisStore, ScriptId, millis};
use super::error::{ReplyError, StoreError};
use super::server_id::{ServerId, id_field, parse_id};

/// How long a process's published in-flight counts stay counted without
/// being published again (a dispatcher republishes every third of it).
pub const INFLIGHT_LEASE: Duration = Duration::from_secs(15);

/// The publication arguments of `counts` (server → requests, tokens):
/// owner, lease, then `req:<id>`, n, `tok:<id>`, n per server.
pub(crate) fn publish_args(owner: &str, counts: impl IntoIterator<Item = (ServerId, i64, i64)>) -> Vec<String> {
    let mut args = vec![owner.to_owned(), millis(INFLIGHT_LEASE).to_string()];
    for (server, requests, tokens) in counts {
        let id = id_field(server);
        args.extend([
            format!("req:{id}"),
            requests.to_string(),
            format!("tok:{id}"),
            tokens.to_string(),
        ]);
    }
    args
}

/// Parses a [`SUM_SCRIPT`](super::scripts::SUM_SCRIPT) reply into per-server figures sorted by id.
pub(crate) fn parse_inflight(reply: &Value) -> Result<Vec<InflightLoad>, ReplyError> {
    let flat: Vec<(String, i64)> =
        FromRedisValue::from_redis_value(reply).map_err(|e| ReplyError::Conversion(e.to_string()))?;
    let mut out: Vec<InflightLoad> = Vec::new();
    for (field, n) in flat {
        let (kind, server) = field
            .split_once(':')
            .and_then(|(kind, id)| parse_id(id).map(|s| (kind, s)))
            .ok_or_else(|| ReplyError::CounterField(field.clone()))?;
        let i = match out.iter().position(|l| l.server == server) {
            Some(i) => i,
            None => {
                out.push(InflightLoad {
                    server,
                    requests: 0,
                    tokens: 0,
                });
                out.len() - 1
            }
        };
        match kind {
            "req" => out[i].requests = n,
            "tok" => out[i].tokens = n,
            _ => return Err(ReplyError::CounterField(field)),
        }
    }
    out.sort_unstable_by_key(|l| l.server);
    Ok(out)
}

/// One server's in-flight figures, as [`RedisStore::inflight_load`] reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InflightLoad {
    /// The server.
    pub server: ServerId,
    /// Requests in flight.
    pub requests: i64,
    /// Prompt tokens of those requests.
    pub tokens: i64,
}

impl RedisStore {
    /// Adds to this store's in-flight counts of `server` and publishes
    /// them all; returns this store's requests in flight to it.
    fn add_inflight(
        &mut self,
        op: &'static str,
        server: ServerId,
        requests: i64,
        tokens: i64,
    ) -> Result<i64, StoreError> {
        let i = match self.counts.iter().position(|c| c.0 == server) {
            Some(i) => i,
            None => {
                self.counts.push((server, 0, 0));
                self.counts.len() - 1
            }
        };
        self.counts[i].1 += requests;
        self.counts[i].2 += tokens;
        let mine = self.counts[i].1;
        let keys = [format!("{}{}", self.inflight_prefix(), self.owner), self.owners_key()];
        let args = publish_args(
            &self.owner,
            self.counts.iter().copied().filter(|&(_, r, t)| r != 0 || t != 0),
        );
        self.eval(op, ScriptId::Publish, &keys, &args).map(|_| mine)
    }

    /// Counts a request of `prompt_tokens` tokens as in flight on
    /// `server` and publishes this store's counts; returns this store's
    /// requests in flight to that server. One round trip.
    pub fn begin_request(&mut self, server: ServerId, prompt_tokens: u32) -> Result<i64, StoreError> {
        self.add_inflight("begin_request", server, 1, i64::from(prompt_tokens))
    }

    /// Undoes [`RedisStore::begin_request`] when the request finishes. One
    /// round trip. (Counts are not clamped: an unmatched end shows as a
    /// negative count.)
    pub fn end_request(&mut self, server: ServerId, prompt_tokens: u32) -> Result<i64, StoreError> {
        self.add_inflight("end_request", server, -1, -i64::from(prompt_tokens))
    }

    /// In-flight requests per server over every live owner, sorted by id
    /// (servers never counted are absent). One round trip.
    pub fn inflight(&mut self) -> Result<Vec<(ServerId, i64)>, StoreError> {
        Ok(self
            .inflight_load()?
            .into_iter()
            .map(|l| (l.server, l.requests))
            .collect())
    }

    /// In-flight requests and prompt tokens per server over every live
    /// owner, sorted by id. One round trip.
    pub fn inflight_load(&mut self) -> Result<Vec<InflightLoad>, StoreError> {
        const OP: &str = "inflight";
        let reply = self.eval(OP, ScriptId::Sum, &[self.owners_key()], &[self.inflight_prefix()])?;
        parse_inflight(&reply).map_err(|detail| StoreError::Protocol { op: OP, detail })
    }
}
