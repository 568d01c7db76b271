//! Learning at dispatch ([`RoutingStore::record_route`](crate::store::RoutingStore::record_route)
//! and the calls after it): the insert script of a prompt's chain and end
//! key for the server it was sent to, the refresh of its deepest entry when
//! the answer ends, the `HDEL`s that take it back, all sent on the shared
//! connection without waiting for the reply, and skipped during an outage.

use std::sync::atomic::Ordering::Relaxed;

use shm_layout::ServerRef;

use super::RedisRouting;
use super::client::{LANES, ServerId};
use super::clocks::unix_ms;
use super::server_id;

impl RedisRouting {
    /// Sends `pipe` on the open connection without waiting for its replies
    /// (dispatch-time learning: the completion record's write-back repeats
    /// the prompt's chain, so a lost write costs only time). Skipped while
    /// Redis is down or before the first lookup has connected.
    pub(super) fn send_detached(&self, pipe: redis::Pipeline) {
        if self.health.down.load(Relaxed) {
            return;
        }
        let Some(mut conn) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        let timeout = self.config.timeout();
        // Also called as a response body is dropped, which may be after
        // the runtime has gone: then there is nothing to send it on.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(timeout, pipe.query_async::<()>(&mut conn)).await;
            });
        }
    }

    /// `server`'s id in Redis, if it is still registered.
    fn id_of(&self, server: ServerRef) -> Option<ServerId> {
        server_id::registered(self.local.segment(), server)
    }

    /// Records `server` for `keys` now, without waiting (one insert script).
    pub(super) fn insert_detached<'k>(&self, server: ServerRef, keys: impl Iterator<Item = &'k u64> + Clone) {
        if let Some(pipe) = self.insert_pipeline(server, keys) {
            self.send_detached(pipe);
        }
    }

    /// Records `server` for `key`, done when Redis has it (or failed: an
    /// outage, which the lookups then see too).
    pub(super) async fn insert_now(&self, server: ServerRef, key: u64) {
        const OP: &str = "affinity record";
        if let Some(pipe) = self.insert_pipeline(server, [&key].into_iter()) {
            self.guarded(OP, self.query(OP, &pipe)).await;
        }
    }

    /// The insert script's call recording `server` for `keys` (`None`:
    /// the server is no longer registered).
    fn insert_pipeline<'k>(
        &self,
        server: ServerRef,
        keys: impl Iterator<Item = &'k u64> + Clone,
    ) -> Option<redis::Pipeline> {
        let names = &self.names;
        let id = self.id_of(server)?;
        let mut pipe = redis::pipe();
        let cmd = pipe.cmd("EVALSHA").arg(&names.insert).arg(keys.clone().count());
        for hash in keys {
            cmd.arg(names.prefix_key(*hash));
        }
        cmd.arg(server_id::id_field(id))
            .arg(unix_ms())
            .arg(self.config.prefix_ttl().as_millis() as u64)
            .arg(LANES)
            .ignore();
        Some(pipe)
    }

    /// Takes `server` out of the entries of `blocks` and `end_key`,
    /// without waiting (an `HDEL` per key).
    pub(super) fn remove_detached(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>) {
        let Some(id) = self.id_of(server) else { return };
        let mut pipe = redis::pipe();
        for hash in blocks.iter().chain(end_key.as_ref()) {
            pipe.cmd("HDEL")
                .arg(self.names.prefix_key(*hash))
                .arg(server_id::id_field(id))
                .ignore();
        }
        self.send_detached(pipe);
    }
}
