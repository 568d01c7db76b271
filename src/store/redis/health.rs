//! Whether Redis is answering ([`Health`]): an operation's deadline, the
//! outage it starts when it fails or times out (logged once, counted),
//! and the one probe per `retry_ms` that ends it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::{Duration, Instant};

use super::RedisRouting;
use super::client::StoreError;
use super::credentials;

/// Whether Redis is answering, and when to try again if not.
#[derive(Debug)]
pub(super) struct Health {
    /// Start of this process's clock for the fields below.
    epoch: Instant,
    /// In an outage.
    pub(super) down: AtomicBool,
    /// When the outage began (ms since `epoch`).
    down_since_ms: AtomicU64,
    /// Earliest next probe during an outage (ms since `epoch`).
    next_probe_ms: AtomicU64,
    /// A probe is under way.
    probing: AtomicBool,
    /// Lookups answered by the fallback in the current outage.
    pub(super) degraded_in_outage: AtomicU64,
}

impl Health {
    pub(super) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            down: AtomicBool::new(false),
            down_since_ms: AtomicU64::new(0),
            next_probe_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            degraded_in_outage: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether to ask Redis now: always when up; during an outage, one
    /// caller per retry interval (it must report with `done_probing`).
    fn may_ask(&self) -> Attempt {
        if !self.down.load(Relaxed) {
            return Attempt::Normal;
        }
        if self.now_ms() >= self.next_probe_ms.load(Relaxed) && !self.probing.swap(true, Relaxed) {
            return Attempt::Probe;
        }
        Attempt::Skip
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Normal,
    Probe,
    Skip,
}

impl RedisRouting {
    /// The deadline of an operation: `connect_timeout_ms` until this process
    /// has connected once (the first connection's TLS handshake, `AUTH`,
    /// scripts and seed may take longer than a reply), then `timeout_ms`.
    pub(super) fn deadline(&self) -> Duration {
        if self.chain_seed.get().is_some() {
            self.config.timeout()
        } else {
            self.config.connect_timeout()
        }
    }

    /// Runs `op` under the deadline with the outage bookkeeping; `None` when
    /// Redis is not to be asked now or failed.
    pub(super) async fn guarded<T>(
        &self,
        name: &'static str,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        let attempt = self.health.may_ask();
        if attempt == Attempt::Skip {
            return None;
        }
        let deadline = self.deadline();
        let result = match tokio::time::timeout(deadline, op).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout {
                op: name,
                timeout: deadline,
            }),
        };
        let out = match result {
            Ok(v) => {
                self.up();
                Some(v)
            }
            Err(e) => {
                self.down(&e);
                None
            }
        };
        if attempt == Attempt::Probe {
            self.health.probing.store(false, Relaxed);
        }
        out
    }

    fn up(&self) {
        let h = &self.health;
        if h.down.swap(false, Relaxed) {
            let secs = (h.now_ms() - h.down_since_ms.load(Relaxed)) as f64 / 1e3;
            let degraded = h.degraded_in_outage.swap(0, Relaxed);
            tracing::info!(
                process = %self.label,
                redis = %credentials::redacted(&self.config.url),
                outage_secs = secs,
                degraded,
                "Redis at {} answers again after {secs:.1} s; {degraded} requests were routed on load only",
                credentials::redacted(&self.config.url)
            );
            self.dirty.notify_one();
        }
    }

    fn down(&self, error: &StoreError) {
        self.failures.fetch_add(1, Relaxed);
        // A slow reply does not make the connection bad: the multiplexed
        // connection every task of the process shares is kept (its late
        // reply is dropped); any other failure drops it.
        if !error.is_timeout() {
            *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        let h = &self.health;
        let now = h.now_ms();
        h.next_probe_ms.store(now + self.config.retry_ms, Relaxed);
        if !h.down.swap(true, Relaxed) {
            h.down_since_ms.store(now, Relaxed);
            self.outages.fetch_add(1, Relaxed);
            tracing::warn!(
                process = %self.label,
                redis = %credentials::redacted(&self.config.url),
                error = %error,
                "Redis at {} is unavailable ({error}); routing on load only, probing every {} ms",
                credentials::redacted(&self.config.url),
                self.config.retry_ms
            );
        }
    }
}
