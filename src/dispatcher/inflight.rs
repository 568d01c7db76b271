//! A request's place in the in-flight and pending counts: begun when a
//! server is chosen, ended exactly once when its answer ends, fails or is
//! dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shm_layout::{ServerRef, Timing};

use super::Dispatcher;
use crate::routing::Reason;

/// Counts one request as in flight to a server in the store (the shm
/// ledger, and on Redis the published counts) while it lives, and as
/// pending until [`first_token`](Self::first_token); dropping it ends the
/// request (exactly once). Both events wake the dispatcher's gateway queue:
/// a server may have room now.
#[derive(Debug)]
pub(super) struct InflightGuard {
    dispatcher: Arc<Dispatcher>,
    server: ServerRef,
    tokens: u64,
    started: bool,
    /// When it was counted (sent).
    sent: Instant,
    /// Requests in flight to the server through this host once it was
    /// counted, itself included.
    inflight_at_send: u32,
    /// From sending to the answer's first byte.
    first_byte: Option<Duration>,
    /// The `cost` policy's tuner arm the request was routed with: its TTFT
    /// is reported to the policy when the answer ends.
    arm: Option<u8>,
}

impl InflightGuard {
    /// Begins a request of `tokens` prompt tokens to `server`; `None` if the
    /// registration is stale.
    pub fn begin(dispatcher: &Arc<Dispatcher>, server: ServerRef, tokens: u64) -> Option<Self> {
        if !dispatcher.store().begin_request(server, tokens) {
            return None;
        }
        let inflight = dispatcher.segment().tables().servers.inflight(server).0;
        Some(Self {
            dispatcher: dispatcher.clone(),
            server,
            tokens,
            started: false,
            sent: Instant::now(),
            inflight_at_send: u32::try_from(inflight).unwrap_or(u32::MAX),
            first_byte: None,
            arm: None,
        })
    }

    /// How long the request has taken so far, for the completion record
    /// (the response processes learn the server's admission limit from
    /// it: [`crate::routing::capacity`]); `streamed`: the answer is an event stream,
    /// so its first byte is its first token.
    pub fn timing(&self, streamed: bool) -> Timing {
        let us = |d: Duration| u32::try_from(d.as_micros()).unwrap_or(u32::MAX - 1);
        Timing {
            latency_us: us(self.sent.elapsed()),
            first_byte_us: self.first_byte.filter(|_| streamed).map(us),
            inflight_at_send: self.inflight_at_send,
        }
    }

    /// The request was routed for `reason`: remembers the tuner arm a
    /// [`Reason::Cost`] names.
    pub fn routed_for(&mut self, reason: Reason) {
        if let Reason::Cost { arm } = reason {
            self.arm = arm;
        }
    }

    /// The tuner arm the request was routed with, if any.
    pub fn arm(&self) -> Option<u8> {
        self.arm
    }

    /// The server this request went to.
    pub fn server(&self) -> ServerRef {
        self.server
    }

    /// The answer's first token arrived: no longer pending (once).
    pub fn first_token(&mut self) {
        if !self.started {
            self.started = true;
            self.first_byte = Some(self.sent.elapsed());
            self.dispatcher.store().first_token(self.server, self.tokens);
            self.dispatcher.wake_queue();
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.dispatcher
            .store()
            .end_request(self.server, self.tokens, self.started);
        self.dispatcher.wake_queue();
    }
}
