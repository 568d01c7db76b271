//! A response process's writes into Redis ([`RedisWriteBack`]): a batch
//! of completion records as one pipeline, and during an outage a bounded
//! backlog (`write_backlog` records, at most [`MAX_BACKLOG_BYTES`]; the
//! oldest give way, counted) written on the first call after `retry_ms`
//! that reaches Redis.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shm_layout::{Completion, Segment, ServerRef, Stamp};

use super::client::{RedisStore, StoreError, WriteItem};
use super::clocks::{unix_at, unix_ms};
use super::credentials;
use super::server_id::registered;
use crate::config::{RedisConfig, StoreKind};
use crate::store::{WriteBack, WriteStats, answer_blocks};

/// Records per write-back pipeline (bounds one round trip's size).
const WRITE_CHUNK: usize = 256;

/// Most bytes of records (blocks and response bodies) a response process
/// keeps during an outage, whatever `write_backlog` allows: cached
/// responses may be megabytes each.
pub const MAX_BACKLOG_BYTES: usize = 64 << 20;

/// The memory a kept record holds.
fn record_bytes(record: &Completion) -> usize {
    8 * (record.prompt_blocks.len() + record.full_blocks.len()) + record.response.len() + 64
}

/// A response process's writes into Redis (see the module docs).
#[derive(Debug)]
pub struct RedisWriteBack {
    /// The host's segment: its server table names the servers' ids.
    segment: Arc<Segment>,
    config: RedisConfig,
    response_ttl: Duration,
    store: Option<RedisStore>,
    backlog: VecDeque<Completion>,
    backlog_bytes: usize,
    retry_at: Option<Instant>,
    down_since: Option<Instant>,
    label: String,
}

impl RedisWriteBack {
    /// Writes with `config` what records of `segment`'s servers teach,
    /// caching responses for `response_ttl`; `label` names the process in
    /// messages. Connects on the first write.
    pub fn new(segment: Arc<Segment>, config: &RedisConfig, response_ttl: Duration, label: impl Into<String>) -> Self {
        Self {
            segment,
            config: config.clone(),
            response_ttl,
            store: None,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            retry_at: None,
            down_since: None,
            label: label.into(),
        }
    }

    /// Records waiting for Redis.
    pub fn backlog(&self) -> usize {
        self.backlog.len()
    }

    fn store(&mut self) -> Result<&mut RedisStore, StoreError> {
        if self.store.is_none() {
            let c = &self.config;
            self.store = Some(RedisStore::with_client(
                credentials::client(c)?,
                &c.namespace,
                c.prefix_ttl(),
                c.timeout(),
            )?);
        }
        Ok(self.store.as_mut().expect("just set"))
    }

    /// Writes the backlog's first `n` records in one pipeline.
    fn flush(&mut self, n: usize) -> Result<(), StoreError> {
        let ttl = self.response_ttl;
        self.store()?;
        // Disjoint fields: the items borrow the backlog, the write needs the store.
        let Self {
            store,
            backlog,
            segment,
            ..
        } = self;
        let store = store.as_mut().expect("connected just above");
        let mut items = Vec::with_capacity(2 * n);
        for r in backlog.iter().take(n) {
            // A server retired since: what it learned is of no use.
            let Some(server) = r.server.and_then(|s| registered(segment, s)) else {
                continue;
            };
            items.push(WriteItem {
                server,
                blocks: &r.prompt_blocks,
                response: None,
            });
            items.push(WriteItem {
                server,
                blocks: answer_blocks(r),
                response: r.response_key.map(|k| (k.0, r.response.as_slice(), ttl)),
            });
        }
        store.write_back(&items, n.min(backlog.len()) as u64, unix_ms())
    }
}

impl WriteBack for RedisWriteBack {
    fn kind(&self) -> StoreKind {
        StoreKind::Redis
    }

    fn forget_server(&mut self, server: ServerRef) -> u64 {
        let Some(id) = registered(&self.segment, server) else {
            return 0;
        };
        match self.store().and_then(|s| s.forget_server(id)) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(process = %self.label, error = %e, "could not forget server slot {} in Redis: {e}", server.slot);
                0
            }
        }
    }

    fn demote_before(&mut self, server: ServerRef, at_s: u32, now_ms: u64) -> bool {
        let at_ms = unix_at(at_s, now_ms, unix_ms());
        let Some(id) = registered(&self.segment, server) else {
            return false;
        };
        match self.store().and_then(|s| s.raise_horizon(id, at_ms)) {
            Ok(moved) => moved,
            Err(e) => {
                tracing::warn!(process = %self.label, error = %e, "could not raise the horizon of server slot {} in Redis: {e}", server.slot);
                false
            }
        }
    }

    fn write(&mut self, batch: &[Completion], _now: Stamp, _now_ms: u64, stats: &mut WriteStats) {
        for record in batch {
            self.backlog_bytes += record_bytes(record);
            self.backlog.push_back(record.clone());
            // Keep the newest: the oldest give way beyond either bound (the
            // record just added stays, so a write always has something).
            while self.backlog.len() > 1
                && (self.backlog.len() > self.config.write_backlog.max(1) || self.backlog_bytes > MAX_BACKLOG_BYTES)
            {
                if let Some(old) = self.backlog.pop_front() {
                    self.backlog_bytes -= record_bytes(&old);
                    stats.writeback_dropped += 1;
                }
            }
        }
        if self.backlog.is_empty() || self.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        while !self.backlog.is_empty() {
            let n = self.backlog.len().min(WRITE_CHUNK);
            match self.flush(n) {
                Ok(()) => {
                    for r in self.backlog.drain(..n) {
                        self.backlog_bytes -= record_bytes(&r);
                        stats.records += 1;
                        stats.blocks += (r.prompt_blocks.len() + answer_blocks(&r).len()) as u64;
                        stats.responses_stored += u64::from(r.response_key.is_some());
                    }
                    if let Some(since) = self.down_since.take() {
                        let secs = since.elapsed().as_secs_f64();
                        tracing::info!(
                            process = %self.label,
                            redis = %credentials::redacted(&self.config.url),
                            outage_secs = secs,
                            "Redis at {} answers again after {secs:.1} s; the backlog is written",
                            credentials::redacted(&self.config.url)
                        );
                    }
                    self.retry_at = None;
                }
                Err(e) => {
                    stats.writeback_failures += 1;
                    self.store = None;
                    self.retry_at = Some(Instant::now() + self.config.retry());
                    if self.down_since.is_none() {
                        self.down_since = Some(Instant::now());
                        tracing::warn!(
                            process = %self.label,
                            redis = %credentials::redacted(&self.config.url),
                            error = %e,
                            "Redis at {} is unavailable ({e}); keeping up to {} records to write later",
                            credentials::redacted(&self.config.url),
                            self.config.write_backlog
                        );
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use shm_layout::ResponseKey;

    use super::*;

    fn record(i: u64, response_bytes: usize) -> Completion {
        Completion {
            server: Some(ServerRef { slot: 1, generation: 1 }),
            prompt_tokens: 32,
            output_tokens: 16,
            prompt_blocks: vec![i, i + 1],
            full_blocks: vec![i, i + 1, i + 2],
            continuation: None,
            response_key: (response_bytes > 0).then_some(ResponseKey(u128::from(i))),
            response: vec![b'x'; response_bytes],
            prediction: None,
            timing: None,
        }
    }

    /// A write-back towards a closed port: every write fails at once.
    fn unreachable(backlog: usize) -> RedisWriteBack {
        let config = RedisConfig {
            url: "redis://127.0.0.1:1/".into(),
            write_backlog: backlog,
            retry_ms: 10,
            ..RedisConfig::default()
        };
        let segment = Arc::new(Segment::heap(&shm_layout::LayoutPlan::for_size(8 << 20).unwrap()));
        RedisWriteBack::new(segment, &config, Duration::from_secs(60), "test")
    }

    #[test]
    fn an_unreachable_redis_keeps_the_newest_records_up_to_the_bound() {
        let mut w = unreachable(5);
        let mut stats = WriteStats::default();
        for i in 0..12 {
            w.write(&[record(i * 10, 0)], Stamp(0), 0, &mut stats);
        }
        assert_eq!(w.backlog(), 5);
        assert_eq!(stats.writeback_dropped, 7);
        assert_eq!(stats.records, 0, "nothing was written");
        assert!(stats.writeback_failures >= 1);
        let kept: Vec<u64> = w.backlog.iter().map(|r| r.prompt_blocks[0]).collect();
        assert_eq!(kept, vec![70, 80, 90, 100, 110], "the oldest gave way");
    }

    #[test]
    fn large_responses_are_bounded_by_bytes_too() {
        let mut w = unreachable(1_000_000);
        let mut stats = WriteStats::default();
        let big = 4 << 20;
        for i in 0..40 {
            w.write(&[record(i, big)], Stamp(0), 0, &mut stats);
        }
        assert!(w.backlog_bytes <= MAX_BACKLOG_BYTES, "{} bytes kept", w.backlog_bytes);
        assert_eq!(w.backlog() as u64 + stats.writeback_dropped, 40);
        assert!(w.backlog() >= MAX_BACKLOG_BYTES / (big + 100) - 1);
        let total: usize = w.backlog.iter().map(record_bytes).sum();
        assert_eq!(total, w.backlog_bytes, "the byte count follows the records");
    }
}
