//! The attempts of a request that another proxy sends (the endpoint
//! picker's, [`crate::dispatcher::epp`]): step 1 as for every request
//! ([`Attempts::route`]: the policy, the gateway queue, no server), the
//! request counted in flight and learned at dispatch as step 2 does, and,
//! in a pool with prefill engines, its prefill leg run or started as step
//! 2 does ([`pd`](super::pd): the body that proxy sends is then the decode
//! leg's); then the answer that proxy streams back is relayed through the
//! same [`Relay`] (learning, usage, charges, in-flight count, an SGLang
//! prefill leg kept as long as the answer).

use super::*;

/// A request routed for another proxy: the server chosen, counted in
/// flight to it until its answer ends (or this is dropped).
pub(in crate::dispatcher) struct Picked<'d> {
    attempts: Attempts<'d>,
    server: ServerRef,
    /// The server's base URL.
    address: String,
    guard: InflightGuard,
    /// The blocks the server was already listed for, when the prompt was
    /// recorded for it at dispatch.
    recorded: Option<u32>,
    /// The body to send it (the decode leg's, for a split request).
    body: Bytes,
}

/// Routes an inference request for another proxy, avoiding the servers
/// of `avoid`: the server picked (counted in flight, the prompt learned
/// at dispatch), or the gateway's answer (no server: 503; the gateway
/// queue full or timed out: 503 with `Retry-After`).
pub(in crate::dispatcher) async fn pick<'d>(
    dispatcher: &'d Arc<Dispatcher>,
    outbound: Outbound,
    mut ctx: Option<InferenceCtx>,
    avoid: Vec<ServerRef>,
) -> Result<Picked<'d>, Response<Body>> {
    let deadline = tokio::time::Instant::now() + dispatcher.config().limits.request_timeout();
    // The lookup made with the request looked at every server: with some
    // to avoid, the decision looks up again without them.
    if let Some(c) = ctx.as_mut().filter(|_| !avoid.is_empty()) {
        c.lookup = None;
    }
    let mut attempts = Attempts::new(dispatcher, outbound, ctx, deadline);
    attempts.failed = avoid;
    loop {
        let (chosen, admitted) = match attempts.route().await {
            Ok(routed) => routed,
            Err(Next::Retry) => continue,
            Err(Next::Answer(r)) => return Err(attempts.finish(r)),
        };
        let Some(guard) = attempts.commit(&chosen, admitted) else {
            continue;
        };
        attempts.log_attempt(&chosen.address, chosen.reason, chosen.candidates, chosen.degraded);
        let recorded = attempts.record_route(chosen.server, chosen.held).then_some(chosen.held);
        let body = attempts.body_to(chosen.server);
        let body = match attempts.disaggregate(chosen.server, chosen.predicted, body).await {
            Ok(body) => body,
            Err(next) => {
                if let Some(held) = recorded {
                    attempts.forget_route(chosen.server, held);
                }
                match next {
                    Next::Answer(r) => return Err(attempts.finish(r)),
                    Next::Retry => continue,
                }
            }
        };
        return Ok(Picked {
            attempts,
            server: chosen.server,
            address: chosen.address,
            guard,
            recorded,
            body,
        });
    }
}

impl Picked<'_> {
    /// The server picked.
    pub fn server(&self) -> ServerRef {
        self.server
    }

    /// Its base URL.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The body to send it: with the tenant's `cache_salt` when its
    /// engine takes one; a split request's decode leg (vLLM: with the
    /// prefill's `kv_transfer_params`; SGLang: with the rendezvous).
    pub fn body(&self) -> Bytes {
        self.body.clone()
    }

    /// Whether `server` serves the same leg as the pick (its role): a
    /// fallback of a decode leg is a decode engine, never a prefill one.
    pub fn same_leg(&self, server: ServerRef) -> bool {
        let servers = &self.attempts.dispatcher.segment().tables().servers;
        servers.role_of(server) == servers.role_of(self.server)
    }

    /// Whether the server `key` says (its id and pool) serves the
    /// request's pool.
    pub fn admits(&self, key: Option<shm_layout::MemberKey>) -> bool {
        self.attempts
            .outbound
            .pool
            .as_ref()
            .is_none_or(|p| p.members().admits(key))
    }

    /// The engine's answer head came (`status`, `headers`): the relay of
    /// its body, which the returned sender feeds chunk by chunk (dropping
    /// the sender ends the body: the answer ended). The relay learns from
    /// a 2xx answer, charges its output and ends the in-flight count when
    /// the body ends or the relay is dropped.
    pub fn answer(
        mut self,
        status: StatusCode,
        headers: HeaderMap,
    ) -> (Response<Body>, tokio::sync::mpsc::UnboundedSender<Bytes>) {
        let (feed, body) = super::super::relay::fed();
        let mut response = Response::new(body);
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        if status.is_success() {
            self.attempts.count_5xx_against_their_servers();
        }
        let head = Head {
            response,
            server: self.server,
            address: self.address,
            guard: self.guard,
            recorded: self.recorded,
            first: None,
        };
        let deadline = Box::pin(tokio::time::sleep_until(self.attempts.deadline));
        let relayed = self.attempts.relay(head, deadline);
        (self.attempts.finish(relayed), feed)
    }
}
