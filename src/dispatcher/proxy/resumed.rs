//! A broken stream's next attempt ([`super::super::resume`]): the
//! continuation sent as any request is, routed by load among the engines
//! of its pool that have not failed the answer, with the request's
//! retries, until an answer head.

use super::*;
use crate::dispatcher::resume::{Attempt, ResumedHead, Targets};
use crate::store::Lookup;

/// Sends `body` (the continuation of `request`) to `targets.first` while
/// it is registered and up, else (or once it failed) to an engine of its
/// pool not in `targets.exclude`, until `deadline`: its 2xx head, or why
/// none came.
pub(in crate::dispatcher) fn send(
    dispatcher: Arc<Dispatcher>,
    request: &Continuation,
    body: Bytes,
    targets: Targets,
    deadline: tokio::time::Instant,
) -> Attempt {
    let outbound = Outbound {
        method: Method::POST,
        path_and_query: request.path_and_query.clone(),
        headers: request.headers.clone(),
        body,
        pool: request.pool.clone(),
        cache_salt: request.cache_salt.clone(),
        peer: None,
        metered: None,
        share: None,
    };
    Attempt(Box::pin(async move {
        let mut timer = Box::pin(tokio::time::sleep_until(deadline));
        let mut attempts = Attempts::new(&dispatcher, outbound, None, deadline);
        attempts.failed = targets.exclude;
        attempts.known_prompt_tokens = targets.prompt_tokens;
        let mut first = targets
            .first
            .and_then(|server| dispatcher.registration(server))
            .filter(|info| info.state == shm_layout::ServerState::Up);
        loop {
            let (chosen, admitted) = match first.take() {
                Some(info) => (
                    Chosen::new(info.server, info.address, Reason::SameEngine, &Lookup::default()),
                    None,
                ),
                None => match attempts.route().await {
                    Ok(routed) => routed,
                    Err(Next::Retry) => continue,
                    Err(Next::Answer(answer)) => return Err(attempts.why_none(answer.status())),
                },
            };
            let head = match attempts.send(chosen, admitted, timer.as_mut()).await {
                Ok(head) => head,
                Err(Next::Retry) => continue,
                Err(Next::Answer(answer)) => return Err(attempts.why_none(answer.status())),
            };
            let status = head.response.status();
            let (_, body) = head.response.into_parts();
            return match body {
                UpstreamBody::Engine(body) if status.is_success() => Ok(ResumedHead {
                    body,
                    server: head.server,
                    address: head.address,
                    guard: head.guard,
                }),
                _ => Err(format!("{} answered the continuation {status}", head.address)),
            };
        }
    }))
}

impl Attempts<'_> {
    /// Why no engine took a continuation (the gateway would have answered
    /// `status`).
    fn why_none(&self, status: StatusCode) -> String {
        match &self.last_failure {
            Some(failure) => format!("{failure} ({} engines failed the answer)", self.failed.len()),
            None => format!("no other engine is available ({status})"),
        }
    }
}
