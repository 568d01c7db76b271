//! This process's in-flight counts in Redis: begin and end count in memory
//! ([`RedisRouting::count`]), and a background task publishes the counts
//! whole (absolute values under the owner's lease), coalescing the changes
//! made during the previous publication's round trip, and every third of
//! the lease when nothing changes.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use shm_layout::ServerRef;

use super::RedisRouting;
use super::client::{INFLIGHT_LEASE, StoreError, publish_args};

impl RedisRouting {
    /// Publishes this process's in-flight counts (absolute values).
    async fn publish(&self) -> Result<(), StoreError> {
        let servers = self.local.segment().tables().servers;
        let counts = self.counts.iter().enumerate().filter_map(|(slot, (r, t))| {
            let (r, t) = (r.load(Relaxed), t.load(Relaxed));
            // A server retired meanwhile has no id: nothing left to publish.
            let id = servers.id_of(slot as u16)?;
            (r != 0 || t != 0).then_some((id, r, t))
        });
        let names = &self.names;
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA")
            .arg(&names.publish)
            .arg(2)
            .arg(&names.own_hash)
            .arg(&names.owners)
            .arg(publish_args(&names.owner, counts));
        self.query("publish", &pipe).await.map(drop)
    }

    /// Adds to this process's counts of `server` and wakes the publisher.
    pub(super) fn count(&self, server: ServerRef, requests: i64, tokens: i64) {
        if let Some((r, t)) = self.counts.get(usize::from(server.slot)) {
            r.fetch_add(requests, Relaxed);
            t.fetch_add(tokens, Relaxed);
            self.dirty.notify_one();
        }
    }
}

/// Publishes a store's counts when they change (coalescing the changes made
/// during the previous round trip) and every third of the lease. Runs as
/// long as the process's runtime.
pub(super) async fn publish_loop(store: Arc<RedisRouting>) {
    let mut tick = tokio::time::interval(INFLIGHT_LEASE / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = store.dirty.notified() => {}
            _ = tick.tick() => {}
        }
        // During an outage this is skipped between probes; the counts are
        // absolute, so the next publication after it catches up.
        if store.guarded("publish", store.publish()).await.is_some() {
            store.publishes.fetch_add(1, Relaxed);
        }
    }
}
