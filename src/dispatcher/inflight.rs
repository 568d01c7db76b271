//! A request's place in the in-flight and pending counts: begun when a
//! server is chosen, ended exactly once when its answer ends, fails or is
//! dropped.

use std::sync::Arc;

use shm_layout::ServerRef;

use super::Dispatcher;

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
}

impl InflightGuard {
    /// Begins a request of `tokens` prompt tokens to `server`; `None` if the
    /// registration is stale.
    pub fn begin(dispatcher: &Arc<Dispatcher>, server: ServerRef, tokens: u64) -> Option<Self> {
        dispatcher.store().begin_request(server, tokens).then(|| Self {
            dispatcher: dispatcher.clone(),
            server,
            tokens,
            started: false,
        })
    }

    /// The server this request went to.
    pub fn server(&self) -> ServerRef {
        self.server
    }

    /// The answer's first token arrived: no longer pending (once).
    pub fn first_token(&mut self) {
        if !self.started {
            self.started = true;
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
