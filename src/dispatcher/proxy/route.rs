//! Step 1 of an attempt: the server it goes to. The routing decision
//! ([`crate::dispatcher::pick::choose`]), a peer gateway when one is warmer or
//! this region has no server, or a wait in the gateway queue when every
//! server the policy would use is full.

use super::*;

impl Attempts<'_> {
    /// Step 1: the server of this attempt, with its in-flight guard when the
    /// decision counted the request already.
    pub(super) async fn route(&mut self) -> Result<(Chosen, Option<InflightGuard>), Next> {
        let dispatcher = self.dispatcher;
        let split = self.splits() && dispatcher.config().pd.decode_by == crate::config::DecodeBy::Load;
        let leg = self.leg();
        let chain = self.ctx.as_ref().map_or(&[][..], |c| &c.chain[..]);
        let route = RouteRequest {
            chain,
            prompt_tokens: u32::try_from(self.prompt_tokens()).unwrap_or(u32::MAX),
            template_blocks: self.ctx.as_ref().map_or(0, |c| c.template_blocks),
            session: self.ctx.as_ref().and_then(|c| c.session),
            affinity: self.ctx.as_ref().and_then(|c| c.affinity),
            inference: self.ctx.is_some(),
            pool: self.outbound.pool.as_ref(),
            continuation: self.ctx.as_ref().map(|c| EndProbe {
                tokens: &c.prompt_tokens,
                chain,
                hasher: c.hasher,
                answer_tokens: c.answer_tokens,
            }),
            share: match &self.ctx {
                Some(c) => c.share.map(|s| if c.charged { s.charged() } else { s }),
                None => self
                    .outbound
                    .share
                    .map(|s| if self.share_charged { s.charged() } else { s }),
            },
            leg,
            split,
        };
        if let Some(answer) = self.to_warm_peer().await {
            return Err(Next::Answer(answer));
        }
        // Taken only now: the warm-peer check reads it. It is the
        // request's (engines that decode): another leg looks up anew.
        let first_lookup = self.first_lookup.take().filter(|_| leg == crate::routing::Leg::Request);
        let routed = match choose(dispatcher, route, &self.failed, first_lookup).await {
            Routed::Chosen(chosen, guard) => Ok((chosen, guard)),
            Routed::Wait {
                lookup,
                header_blocks,
                asked,
                pool,
            } => {
                if let Some(answer) = self.to_peer().await {
                    return Err(Next::Answer(answer));
                }
                let waiting = Waiting {
                    chain: chain.to_vec(),
                    prompt_tokens: route.prompt_tokens,
                    session: route.session,
                    prefix: lookup.routing_prefix(),
                    header_blocks,
                    exclude: self.failed.clone(),
                    pool,
                    seen: asked || !self.failed.is_empty(),
                    queued_at: Instant::now(),
                    share: route.share.unwrap_or(Share::new(
                        0,
                        Priority::Interactive,
                        1,
                        route.prompt_tokens.into(),
                        Some(0),
                    )),
                };
                self.wait(waiting, &lookup).await
            }
            Routed::NoServer => Err(Next::Answer(self.no_server())),
            Routed::Unstored => return self.unstored().await,
        };
        // Routed: its tenant was charged (a retry is not charged again).
        if routed.is_ok() {
            match &mut self.ctx {
                Some(c) => c.charged = true,
                None => self.share_charged = true,
            }
        }
        routed
    }

    /// Step 1, for a request continuing a stored response that no live
    /// engine holds (its engine is gone, the key was evicted, or it was
    /// never stored through this gateway): one that carries its whole
    /// conversation is routed as a new one, sent without
    /// `previous_response_id`; any other is answered 404, as the engine
    /// would answer an id it does not know.
    async fn unstored(&mut self) -> Result<(Chosen, Option<InflightGuard>), Next> {
        let Some(ctx) = self.ctx.as_mut().filter(|c| c.affinity.is_some()) else {
            return Err(Next::Answer(self.no_server()));
        };
        ctx.affinity = None;
        if !ctx.carries_history {
            let id = ctx.previous_response_id.take().unwrap_or_default();
            return Err(Next::Answer(error_response(
                StatusCode::NOT_FOUND,
                format!(
                    "Response with id '{id}' not found: no engine of this gateway holds it (its engine may have restarted or left)."
                ),
                Some("response_not_found"),
            )));
        }
        self.outbound.body = crate::dispatcher::http::with_field(&self.outbound.body, "previous_response_id", "null");
        Box::pin(self.route()).await
    }

    /// Step 1, when every server the policy would use is full and the
    /// local queue's expected wait is long: a peer gateway's answer, if one
    /// with room takes the request (see [`crate::peers`]). `None`: it
    /// waits here (no peer, no peer with room, or the peer failed: then it
    /// is not asked again until its next summary).
    pub(super) async fn to_peer(&self) -> Option<Response<Body>> {
        let dispatcher = self.dispatcher;
        let peering = dispatcher.peering();
        let (book, copy) = (peering.book.clone()?, self.outbound.peer.as_ref()?);
        if self.tried_peer.swap(true, Ordering::Relaxed) {
            return None;
        }
        let now = Instant::now();
        let wait = dispatcher.queue().expected_wait(now);
        let forward = book.choose(&copy.model, wait, now)?;
        let why = format!("every local server is full (the local queue's expected wait: {wait:?})");
        self.forward(book, forward, copy, why, peering.config.affinity_secs)
            .await
    }

    /// Step 1, on the first decision, before any local server is asked: the
    /// answer of the peer gateway this request's conversation went to, if
    /// its prompt is still warm there (deeper than at any local server) and
    /// the peer has room ([`crate::peers::affinity`]). `None`: it is routed
    /// here.
    pub(super) async fn to_warm_peer(&self) -> Option<Response<Body>> {
        let dispatcher = self.dispatcher;
        let (copy, ctx, lookup) = (
            self.outbound.peer.as_ref()?,
            self.ctx.as_ref()?,
            self.first_lookup.as_ref()?,
        );
        let peering = dispatcher.peering();
        let (book, affinity_secs) = (peering.book.clone()?, peering.config.affinity_secs);
        if affinity_secs == 0 || ctx.chain.is_empty() || self.tried_peer.load(Ordering::Relaxed) {
            return None;
        }
        let now = Instant::now();
        let segment = dispatcher.segment();
        let warm = affinity::matched(
            &segment.tables().prefix,
            &affinity::peer_chain(&ctx.chain),
            segment.clock().stamp(),
            &book.warm_ages(affinity_secs, now),
        )?;
        let local = lookup.routing_prefix().best().map_or(0, |(_, blocks)| blocks);
        if warm.blocks <= local {
            return None;
        }
        let forward = book.choose_warm(warm.index, &copy.model, now)?;
        self.tried_peer.store(true, Ordering::Relaxed);
        let why = format!(
            "its conversation is warm there ({} blocks of the prompt, {local} at the best local server)",
            warm.blocks
        );
        self.forward(book, forward, copy, why, affinity_secs).await
    }

    /// Sends the request to the peer `forward` (of `book`) names: its
    /// answer, recorded as the peer its prompt's conversation went to when
    /// `affinity_secs` is not 0; `None` if it failed (the peer is not asked
    /// again until its next summary).
    pub(super) async fn forward(
        &self,
        book: Arc<PeerBook>,
        forward: Forward,
        copy: &PeerCopy,
        why: String,
        affinity_secs: u64,
    ) -> Option<Response<Body>> {
        let dispatcher = self.dispatcher;
        let peer = forward.peer.clone();
        let start = self.ctx.as_ref().map(|c| c.timing.start);
        let sent = peer_forward::send(
            dispatcher,
            peer_forward::ForwardGuard::new(book.clone(), forward),
            &self.outbound.method,
            &self.outbound.path_and_query,
            copy,
            self.deadline,
            start,
        )
        .await;
        match sent {
            Ok(answer) => {
                tracing::debug!(
                    peer = %peer.address,
                    region = %peer.region,
                    "forwarded to {} ({}): {why}",
                    peer.region,
                    peer.address
                );
                // Only an answer makes the conversation warm there (not a
                // refusal: a 4xx of the peer's keys or limits).
                if let Some(ctx) = self.ctx.as_ref().filter(|c| !c.chain.is_empty())
                    && affinity_secs > 0
                    && answer.status().is_success()
                {
                    let segment = dispatcher.segment();
                    affinity::record(
                        &segment.tables().prefix,
                        &affinity::peer_chain(&ctx.chain),
                        affinity::peer_ref(peer.index, &peer.address),
                        segment.clock().stamp(),
                    );
                }
                Some(answer)
            }
            Err(failure) => {
                book.failed(peer.index);
                // (The forward ended with `send`: its guard is dropped.)
                dispatcher.metrics().peer(PeerEvent::ForwardFailed);
                tracing::warn!(
                    peer = %peer.address,
                    region = %peer.region,
                    "forwarding to peer gateway {} ({}) failed, the request is served here: {failure}",
                    peer.region,
                    peer.address
                );
                None
            }
        }
    }

    /// Step 1, when every server the policy would use is full: the wait
    /// in the gateway queue until one has room.
    pub(super) async fn wait(
        &mut self,
        waiting: Waiting,
        lookup: &Lookup,
    ) -> Result<(Chosen, Option<InflightGuard>), Next> {
        let dispatcher = self.dispatcher;
        let since = Instant::now();
        let admitted = match wait_in_queue(dispatcher, waiting).await {
            Ok(a) => a,
            Err(QueueExit::Full) => {
                dispatcher.metrics().queue_left(QueueOutcome::Full, Duration::ZERO);
                return Err(Next::Answer(unavailable(
                    "every inference server is busy and the gateway queue is full; retry later",
                    "queue_full",
                )));
            }
            Err(QueueExit::Timeout) => {
                return Err(Next::Answer(unavailable(
                    format!(
                        "no inference server became free within {} ms while the request waited in the gateway queue",
                        since.elapsed().as_millis()
                    ),
                    "queue_timeout",
                )));
            }
        };
        let waited = since.elapsed();
        self.queued_ms = Some(self.queued_ms.unwrap_or(0) + waited.as_millis() as u64);
        tenant_usage::count(
            dispatcher,
            self.ctx.as_ref().and_then(|c| c.tenant.as_deref()),
            self.outbound.pool.as_ref().and_then(|p| p.name()),
            &[
                (UsageCounter::Queued, 1),
                (UsageCounter::QueueMicros, waited.as_micros() as u64),
            ],
        );
        let server = admitted.guard.server();
        let Some(info) = dispatcher.registration(server) else {
            let address = format!("the server in slot {}", server.slot);
            self.failed_on(server, Failure::Reregistered { address });
            return Err(Next::Retry);
        };
        let chosen = Chosen::new(server, info.address, admitted.choice.reason, lookup);
        Ok((chosen, Some(admitted.guard)))
    }

    /// No server to route to: 503 on the first attempt, else 502 with the
    /// last failure.
    pub(super) fn no_server(&self) -> Response<Body> {
        if let Some(c) = &self.ctx {
            tracing::debug!(
                endpoint = c.endpoint.path(),
                model = %c.model,
                prompt_tokens = self.prompt_tokens(),
                blocks = c.chain.len(),
                cache = c.cache,
                policy = self.policy_name(),
                attempt = self.attempt + 1,
                "{} not routed: no inference server is available",
                c.endpoint.path()
            );
        }
        if self.pd.whole && self.pd.failed.is_empty() {
            unavailable(
                "no prefill engine is up in this pool, and an SGLang decode engine cannot serve a request alone \
                 (the pool has no engine of role `both` up)",
                "no_server_available",
            )
        } else if self.attempt == 0 {
            unavailable("no inference server is available", "no_server_available")
        } else {
            self.bad_gateway()
        }
    }
}
