//! The routing decision of one attempt: the store's lookup, the policy's
//! choice (least load for requests that are not inference), the check a
//! holding policy makes once the request is counted, and the passive
//! health check that the attempts' outcomes feed.

use std::sync::Arc;

use shm_layout::{ServerRef, Stamp};

use super::Dispatcher;
use super::inflight::InflightGuard;
use crate::dispatcher::failure::Failure;
use crate::metrics::AffinityOutcome;
use crate::pools::Pool;
use crate::prefix::continuation::EndProbe;
use crate::routing::affinity::{self, Affinity};
use crate::routing::{Leg, Members};
use crate::routing::{Policy, Reason, RouteInput};
use crate::store::{Lookup, LookupRequest};
use crate::tenancy::fair_share::Share;

/// What a routing decision is about.
#[derive(Debug, Clone, Copy)]
pub(super) struct RouteRequest<'a> {
    /// The prompt's block chain (empty for a non-inference request).
    pub chain: &'a [u64],
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Leading blocks that are the chat template's own text, the same for
    /// every conversation (counted as shared header: [`RouteInput::header_blocks`]).
    pub template_blocks: u32,
    /// The hashed session key.
    pub session: Option<u64>,
    /// Where it wants to go (a stored response's engine, its session's).
    pub affinity: Option<Affinity>,
    /// An inference request (routed by its pool's policy; others by least
    /// load).
    pub inference: bool,
    /// The model pool it is for (`None`: a request without a model, which
    /// any server may take).
    pub pool: Option<&'a Arc<Pool>>,
    /// What a lookup needs to find the conversation this prompt continues.
    pub continuation: Option<EndProbe<'a>>,
    /// Its tenant, class and cost in the gateway queue (inference only).
    pub share: Option<Share>,
    /// The part of the request the server is chosen for (its prefill
    /// leg goes to prefill engines).
    pub leg: Leg,
    /// Its pool has prefill engines: its decode engine is chosen by load,
    /// the prompt it holds breaking ties ([`crate::routing::decode_leg`]),
    /// not by the pool's policy.
    pub split: bool,
}

/// The outcome of [`choose`].
pub(super) enum Routed {
    /// It continues a stored response no live server holds.
    Unstored,
    /// Send it there (already counted in flight when the policy holds
    /// requests: choosing and counting are then confirmed together).
    Chosen(Chosen, Option<InflightGuard>),
    /// Every server the policy would use is full: queue it (the lookup's
    /// prefix match goes with it).
    Wait {
        /// The lookup the request was routed with.
        lookup: Lookup,
        /// The prompt's shared header, in blocks (see
        /// [`RouteInput::header_blocks`]).
        header_blocks: u32,
        /// Whether the policy was asked (else the request joined a
        /// non-empty queue unasked, and its first look from the queue is
        /// its first look at all).
        asked: bool,
        /// The pool whose policy holds it (and routes it from the queue).
        pool: Arc<Pool>,
    },
    /// No server is available.
    NoServer,
}

/// A routing decision of [`choose`].
#[derive(Debug)]
pub(super) struct Chosen {
    pub server: ServerRef,
    /// Its base URL.
    pub address: String,
    /// Why the policy chose it.
    pub reason: Reason,
    /// How many servers it was chosen from.
    pub candidates: usize,
    /// Whether the store's lookup failed (no prefix, local load only).
    pub degraded: bool,
    /// Leading blocks of the prompt the table listed the server for (what
    /// learning at dispatch need not write, and must not take back).
    pub held: u32,
    /// Leading blocks the server was expected to hold: `held`, raised by a
    /// continued conversation's credit.
    pub predicted: u32,
    /// When the server last refreshed the deepest block listed for it
    /// ([`shm_layout::PrefixMatch::refreshed`]): the horizon an engine's
    /// report of a shortfall sets ([`crate::responder`]). `None` when the
    /// table cannot tell, or when the server had requests pending (sent,
    /// no first token yet): their prompts, learned at dispatch, may not be
    /// computed yet, so a shortfall would be no sign of an eviction.
    pub refreshed: Option<Stamp>,
}

impl Chosen {
    /// `server` at `address`, chosen for `reason` on `lookup`'s answer.
    pub fn new(server: ServerRef, address: String, reason: Reason, lookup: &Lookup) -> Self {
        let tag = server.tag();
        let quiet = lookup.candidates.iter().any(|c| c.server == server && c.pending == 0);
        Self {
            server,
            address,
            reason,
            candidates: lookup.candidates.len(),
            degraded: lookup.degraded,
            held: lookup.prefix.blocks_for(tag),
            predicted: lookup.routing_prefix().blocks_for(tag),
            refreshed: lookup.prefix.refreshed(tag).filter(|_| quiet),
        }
    }
}

/// The store's answer for one decision (counted when degraded).
pub(super) async fn lookup(dispatcher: &Dispatcher, request: LookupRequest<'_>) -> Lookup {
    let lookup = dispatcher.store().lookup(request).await;
    if lookup.degraded {
        dispatcher.metrics().degraded_lookup();
    }
    lookup
}

/// A server for `route`, avoiding `exclude`, with its address and why.
/// `first` is the store's answer for this request if one was already made
/// (the first attempt).
///
/// With a policy that [holds requests](crate::routing::Policy::holds_requests):
/// a request arriving while others wait in this dispatcher's queue joins
/// them (the queue then orders them: [`crate::tenancy::fair_share`]), and a chosen server is
/// counted at once and checked again with the policy
/// ([`admits`](crate::routing::Policy::admits)): if another dispatcher
/// filled it meanwhile, the request is uncounted and queued.
pub(super) async fn choose(
    dispatcher: &Arc<Dispatcher>,
    route: RouteRequest<'_>,
    exclude: &[ServerRef],
    first: Option<Lookup>,
) -> Routed {
    let RouteRequest {
        chain,
        prompt_tokens,
        template_blocks,
        session,
        affinity,
        inference,
        continuation,
        pool,
        share,
        leg,
        split,
    } = route;
    let members = pool.map_or(Members::all(), |p| p.members());
    let stale_after_ms = dispatcher.config().health.stale_after_ms;
    let mut lookup = match first {
        Some(l) => l,
        None => {
            let request = LookupRequest {
                response_key: None,
                chain: if inference { chain } else { &[] },
                exclude,
                members,
                leg,
                stale_after_ms,
                continuation: continuation.filter(|_| inference),
                precise: pool.and_then(|p| p.precise()),
                affinity: affinity.filter(|_| inference).map(Affinity::key),
            };
            self::lookup(dispatcher, request).await
        }
    };
    let chain_blocks = u32::try_from(chain.len()).unwrap_or(u32::MAX);
    let placed = Placed::of(dispatcher, affinity.filter(|_| inference), chain_blocks, &mut lookup).await;
    let held = &placed.held;
    if let affinity::Applied::Missing | affinity::Applied::Pinned = placed.applied {
        return stored_response(dispatcher, placed.applied, lookup);
    }
    // Requests that are not inference go to the least loaded server; a
    // pool whose policy holds requests holds them too (they wait in the
    // gateway queue when its servers are full).
    let pool_policy: Option<Arc<dyn Policy>> = pool.map(|p| p.policy().current_arc());
    let policy = pool_policy.clone().filter(|_| inference);
    let prefix = lookup.routing_prefix();
    let header_blocks = match pool {
        Some(pool) if inference && pool.shared_headers() => {
            let observed = dispatcher
                .shared_headers()
                .observe_match(chain, held, !exclude.is_empty());
            observed.max(template_blocks)
        }
        _ => 0,
    };
    // The pool whose policy holds requests, if it does.
    let holder = pool.filter(|_| pool_policy.as_ref().is_some_and(|p| p.holds_requests()));
    if let Some(pool) = holder
        && !lookup.candidates.is_empty()
        && dispatcher.queued() > 0
    {
        return Routed::Wait {
            lookup,
            header_blocks,
            asked: false,
            pool: pool.clone(),
        };
    }
    loop {
        if lookup.candidates.is_empty() {
            return Routed::NoServer;
        }
        let input = RouteInput {
            prompt_blocks: u32::try_from(chain.len()).unwrap_or(u32::MAX),
            chain,
            prompt_tokens,
            block_tokens: pool.map_or(1, |p| p.block_tokens()),
            session,
            session_engine: placed.session_engine,
            repeat: !exclude.is_empty(),
            waited_ms: 0,
            prefix: &prefix,
            header_blocks,
            candidates: &lookup.candidates,
        };
        let decision = match &policy {
            Some(_) if split && leg == Leg::Request => crate::routing::decode_leg::choose(&input),
            Some(policy) => policy.choose(&input),
            None => dispatcher.least_load().choose(&input),
        };
        let Some(choice) = decision else {
            return match holder {
                Some(pool) => Routed::Wait {
                    lookup,
                    header_blocks,
                    asked: true,
                    pool: pool.clone(),
                },
                None => Routed::NoServer,
            };
        };
        if inference && exclude.is_empty() {
            // The first choice of the request: how much of its prompt it has.
            let tag = choice.server.tag();
            dispatcher.metrics().prefix_match(held.blocks_for(tag), chain.len());
            if lookup.continued.blocks_for(tag) > lookup.prefix.blocks_for(tag) {
                dispatcher.metrics().continued();
            }
        }
        let server = choice.server;
        let reason = placed.follow(dispatcher, server, choice.reason);
        let Some(info) = dispatcher.registration(server) else {
            // Re-registered or unreadable meanwhile: ask again without it.
            lookup.candidates.retain(|c| c.server != server);
            continue;
        };
        let guard = if let Some(pool) = holder {
            let work =
                crate::routing::uncached_tokens(prompt_tokens, prefix.blocks_for(server.tag()), pool.block_tokens());
            let Some(guard) = InflightGuard::begin(dispatcher, server, work) else {
                lookup.candidates.retain(|c| c.server != server);
                continue;
            };
            let counted = dispatcher.local().candidate(server, stale_after_ms);
            if pool_policy.as_ref().is_some_and(|p| !p.admits(&counted)) {
                drop(guard);
                return Routed::Wait {
                    lookup,
                    header_blocks,
                    asked: true,
                    pool: pool.clone(),
                };
            }
            // Service its tenant received without waiting.
            if let Some(share) = &share {
                dispatcher.queue().charge(share);
            }
            Some(guard)
        } else {
            None
        };
        return Routed::Chosen(Chosen::new(server, info.address, reason, &lookup), guard);
    }
}

/// What a request's affinity made of its lookup ([`affinity::apply`]).
struct Placed {
    /// The affinity applied (`None`: none, or not an inference request).
    affinity: Option<Affinity>,
    /// What the engines hold, before a session's credit: what the shared
    /// headers are learned from and the match metrics count.
    held: shm_layout::PrefixMatch,
    /// The servers its key lists.
    affine: Vec<ServerRef>,
    applied: affinity::Applied,
    /// The session's engine, credited with the whole prompt.
    session_engine: Option<shm_layout::ServerTag>,
}

impl Placed {
    /// Applies `affinity` to `lookup`, for a prompt of `chain_blocks`
    /// blocks: a stored response's engines become the only candidates, a
    /// session's engine is credited with the whole prompt.
    async fn of(dispatcher: &Dispatcher, affinity: Option<Affinity>, chain_blocks: u32, lookup: &mut Lookup) -> Self {
        let affine = match (affinity, lookup.affine.take()) {
            (Some(_), Some(read)) => read,
            (Some(a), None) => dispatcher.store().holders(a.key(), &lookup.candidates).await,
            (None, _) => Vec::new(),
        };
        let tags: Vec<_> = affine.iter().map(|s| s.tag()).collect();
        let held = lookup.routing_prefix();
        let applied = affinity::apply(
            affinity,
            &tags,
            &mut lookup.candidates,
            &mut lookup.prefix,
            chain_blocks,
        );
        let session_engine = (applied == affinity::Applied::Credited)
            .then(|| {
                lookup
                    .candidates
                    .iter()
                    .map(|c| c.server.tag())
                    .find(|t| tags.contains(t))
            })
            .flatten();
        Self {
            affinity,
            held,
            affine,
            applied,
            session_engine,
        }
    }

    /// A session sent to `server` follows it there ([`follow_session`]);
    /// the reason of the choice, `Session` when the key's credit kept it
    /// on its engine.
    fn follow(&self, dispatcher: &Dispatcher, server: ServerRef, reason: Reason) -> Reason {
        let Some(Affinity::Session(key)) = self.affinity else {
            return reason;
        };
        follow_session(dispatcher, key, server, &self.affine);
        let outcome = if self.affine.is_empty() {
            AffinityOutcome::SessionNew
        } else if self.affine.contains(&server) {
            AffinityOutcome::SessionKept
        } else {
            AffinityOutcome::SessionMoved
        };
        dispatcher.metrics().affinity(outcome);
        // The key is a salted hash: no client's session value in the logs.
        tracing::debug!(session = %format_args!("{key:016x}"), server = server.slot, ?outcome, "agent session routed");
        let credited = matches!(reason, Reason::Prefix { blocks } if blocks > self.held.blocks_for(server.tag()));
        if self.affine.contains(&server) && credited {
            Reason::Session
        } else {
            reason
        }
    }
}

/// A session routed to `server`: its key lists `server` alone from now on
/// (taken off `before`, the engines it listed), so its next turn follows
/// it rather than going back.
fn follow_session(dispatcher: &Dispatcher, key: u64, server: ServerRef, before: &[ServerRef]) {
    let store = dispatcher.store();
    for old in before.iter().filter(|s| **s != server) {
        store.forget_route(*old, &[key], None);
    }
    store.record_route(server, &[key], None);
}

/// The route of a request that continues a stored response: to an engine
/// that stored it ([`pinned`]), or [`Routed::Unstored`] when none did
/// (`Missing`), counted either way.
fn stored_response(dispatcher: &Arc<Dispatcher>, applied: affinity::Applied, lookup: Lookup) -> Routed {
    let routed = match applied {
        affinity::Applied::Pinned => pinned(dispatcher, lookup),
        _ => Routed::Unstored,
    };
    dispatcher.metrics().affinity(match routed {
        Routed::Unstored => AffinityOutcome::StoredNotFound,
        _ => AffinityOutcome::StoredContinued,
    });
    routed
}

/// The choice for a request that continues a stored response, among the
/// live engines that stored it (`lookup`'s candidates): the least loaded.
/// It is never held in the gateway queue: no other engine can answer it.
fn pinned(dispatcher: &Arc<Dispatcher>, mut lookup: Lookup) -> Routed {
    while let Some(server) = lookup
        .candidates
        .iter()
        .min_by_key(|c| c.weighted_inflight())
        .map(|c| c.server)
    {
        match dispatcher.registration(server) {
            Some(info) => {
                return Routed::Chosen(Chosen::new(server, info.address, Reason::StoredResponse, &lookup), None);
            }
            None => lookup.candidates.retain(|c| c.server != server),
        }
    }
    Routed::Unstored
}

/// Passive health check (see [`crate::health`]): a request to `server`
/// failed. An engine's failure counts; at `health.unhealthy_threshold`
/// of them in a row through this dispatcher, the server is set `Down` in
/// the server table, for every dispatcher at once (the supervisor's
/// checker re-admits it). Failures of the client or the gateway do not
/// count against the engine.
pub(super) fn passive_failure(dispatcher: &Dispatcher, server: ServerRef, address: &str, failure: &Failure) {
    tracing::debug!(
        backend = %address,
        origin = failure.origin().name(),
        retryable = failure.retryable(),
        error = %failure,
        "a request to {address} failed: {failure}"
    );
    if !failure.counts_against_engine() {
        return;
    }
    if dispatcher.passive_health().failure(server)
        && crate::health::eject(&dispatcher.segment().tables().servers, server)
    {
        let threshold = dispatcher.config().health.unhealthy_threshold;
        tracing::warn!(
            backend = %address,
            failures = threshold,
            origin = failure.origin().name(),
            error = %failure,
            "backend {address} is down: {threshold} requests in a row failed (last: {failure})"
        );
    }
}

/// Passive health check: a request to `server` was answered in full.
pub(super) fn passive_success(dispatcher: &Dispatcher, server: ServerRef) {
    dispatcher.passive_health().success(server);
}

#[cfg(test)]
mod tests {
    use shm_layout::{LayoutPlan, Segment};

    use super::*;
    use crate::routing::Candidate;

    /// The stamp an eviction report would set goes with the choice only
    /// when the server had nothing pending: a pending request's prompt,
    /// learned at dispatch, may not be computed yet.
    #[test]
    fn the_horizon_stamp_goes_only_with_a_quiet_server() {
        let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let t = seg.tables();
        let server = t.servers.register(1, "http://a", 0).unwrap();
        let chain = [11u64, 12, 13];
        t.prefix.insert_chain(&chain, server, Stamp(7));
        let candidate = |pending| Candidate {
            server,
            inflight: pending,
            inflight_tokens: 0,
            pending,
            pending_tokens: 0,
            load: Default::default(),
            admission: crate::routing::capacity::INITIAL_LIMIT,
            admission_reported: false,
            started_since_scrape: 0,
            weight: 1,
        };
        let chosen = |pending| {
            let lookup = Lookup {
                prefix: t.prefix.longest_prefix_match(&chain, |_| true),
                candidates: vec![candidate(pending)],
                ..Lookup::default()
            };
            Chosen::new(server, "http://a".into(), Reason::Prefix { blocks: 3 }, &lookup)
        };
        let quiet = chosen(0);
        assert_eq!((quiet.held, quiet.predicted, quiet.refreshed), (3, 3, Some(Stamp(7))));
        let busy = chosen(1);
        assert_eq!((busy.held, busy.refreshed), (3, None));
    }
}
