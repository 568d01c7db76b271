//! Step 2 of an attempt: the request sent to the chosen server and its
//! head awaited under the deadline (a stale pooled connection tried again
//! once on a new one), what a failure counts against, and the attempt's
//! log line.

use super::*;

/// The HTTP client's error.
type ClientError = hyper_util::client::legacy::Error;

/// What ended the wait for a head (or a split request's first data),
/// other than what was waited for.
enum Waited {
    /// The request's deadline.
    Deadline,
    /// A split request's SGLang prefill leg failed.
    PartnerFailed(crate::dispatcher::disagg::LegFailed),
    /// The answer broke before its first data.
    Broken(String),
}

impl Attempts<'_> {
    /// Step 2: sends the request to `chosen` and waits for the head until
    /// `deadline`; a head that is not a failure is the answer.
    pub(super) async fn send(
        &mut self,
        chosen: Chosen,
        admitted: Option<InflightGuard>,
        deadline: Pin<&mut Sleep>,
    ) -> Result<Head, Next> {
        let dispatcher = self.dispatcher;
        let Some(guard) = self.commit(&chosen, admitted) else {
            return Err(Next::Retry);
        };
        let Chosen {
            server,
            address,
            reason,
            candidates,
            degraded,
            held,
            predicted,
            ..
        } = chosen;
        let uri = match format!("{address}{}", self.outbound.path_and_query).parse::<Uri>() {
            Ok(u) => u,
            Err(e) => {
                let detail = e.to_string();
                self.failed_on(server, Failure::BadAddress { address, detail });
                return Err(Next::Retry);
            }
        };
        self.log_attempt(&address, reason, candidates, degraded);
        // Counted in flight there (the guard): now the server is known to
        // be sent this prompt.
        let recorded = self.record_route(server, held).then_some(held);
        let body = self.body_to(server);
        let body = match self.disaggregate(server, predicted, body).await {
            Ok(body) => body,
            Err(next) => {
                if let Some(held) = recorded {
                    self.forget_route(server, held);
                }
                return Err(next);
            }
        };
        let mut deadline = deadline;
        let result = self.head(&uri, &body, &address, deadline.as_mut()).await;
        let result = match result {
            Err(Waited::PartnerFailed(failed)) => return Err(self.prefill_leg_failed(server, recorded, failed)),
            // Only the wait for a first data frame ends so.
            Err(Waited::Deadline | Waited::Broken(_)) => Err(()),
            Ok(head) => Ok(head),
        };
        // A decode leg that failed because its prefill leg did is not the
        // decode engine's failure.
        if matches!(&result, Ok(Ok(r)) if r.status().is_server_error())
            && let Some(failed) = self.pd.leg.as_mut().and_then(|leg| leg.try_failed())
        {
            return Err(self.prefill_leg_failed(server, recorded, failed));
        }
        let failure = match result {
            Ok(Ok(response)) if !response.status().is_server_error() => {
                match self.first_of_decode_stream(response, deadline.as_mut()).await {
                    Ok((response, first)) => {
                        if response.status().is_success() {
                            self.count_5xx_against_their_servers();
                        }
                        return Ok(Head {
                            response: response.map(UpstreamBody::Engine),
                            server,
                            address,
                            guard,
                            recorded,
                            first,
                        });
                    }
                    Err(Waited::PartnerFailed(failed)) => return Err(self.prefill_leg_failed(server, recorded, failed)),
                    Err(Waited::Deadline) => Failure::Timeout {
                        address: address.clone(),
                        secs: dispatcher.config().limits.request_timeout_secs,
                    },
                    Err(Waited::Broken(detail)) => Failure::Connect {
                        address: address.clone(),
                        detail,
                    },
                }
            }
            Ok(Ok(r)) => Failure::Status {
                address: address.clone(),
                status: r.status(),
            },
            Ok(Err(e)) => Failure::Connect {
                address: address.clone(),
                detail: crate::error_chain(&e),
            },
            Err(()) => Failure::Timeout {
                address: address.clone(),
                secs: dispatcher.config().limits.request_timeout_secs,
            },
        };
        dispatcher.metrics().upstream(server.slot, false);
        if let Some(held) = recorded {
            self.forget_route(server, held);
        }
        // Passive health check: a connection error now; a 5xx head once
        // another server answered the request (it may be about the request).
        if let Failure::Status { .. } = failure {
            self.answered_5xx.push((server, address.clone(), failure.clone()));
        } else {
            passive_failure(dispatcher, server, &address, &failure);
        }
        if let Failure::Timeout { .. } = failure {
            return Err(Next::Answer(error_response(
                StatusCode::GATEWAY_TIMEOUT,
                failure.to_string(),
                Some("upstream_timeout"),
            )));
        }
        // Two servers answered it with a 5xx: the request is the likelier
        // cause, and the others would only be asked the same.
        let retryable = failure.retryable() && self.answered_5xx.len() < MAX_5XX_ANSWERS;
        self.failed_on(server, failure);
        if retryable && self.attempt <= dispatcher.config().limits.retries {
            Err(Next::Retry)
        } else {
            Err(Next::Answer(self.bad_gateway()))
        }
    }

    /// The attempt goes to `chosen`: what it was chosen for and expected
    /// to hold is remembered, and the request is counted in flight there
    /// (`admitted`: counted already by the decision). `None`: the server's
    /// registration is stale (it is avoided: try again).
    pub(super) fn commit(&mut self, chosen: &Chosen, admitted: Option<InflightGuard>) -> Option<InflightGuard> {
        let dispatcher = self.dispatcher;
        self.last_reason = Some(chosen.reason);
        self.last_prediction = Prediction {
            block_size: self
                .ctx
                .as_ref()
                .map_or(0, |c| u32::try_from(c.hasher.block_size()).unwrap_or(u32::MAX)),
            predicted_blocks: chosen.predicted,
            listed_blocks: chosen.held,
            refreshed: chosen.refreshed,
            cached_tokens: None,
        };
        if self.attempt > 0 {
            dispatcher.metrics().retry();
        }
        self.attempt += 1;
        let mut guard = match admitted {
            Some(g) => g,
            None => match InflightGuard::begin(dispatcher, chosen.server, self.prefill_tokens(chosen.predicted)) {
                Some(g) => g,
                None => {
                    let address = chosen.address.clone();
                    self.failed_on(chosen.server, Failure::Reregistered { address });
                    return None;
                }
            },
        };
        guard.routed_for(chosen.reason);
        Some(guard)
    }

    /// The head of the answer to the request (`body` to `uri`, the server
    /// at `address`), or what ended the wait first: the deadline, or a
    /// split request's SGLang prefill leg failing (the decode leg waits for
    /// a partner that is gone). A connection the server had closed is
    /// tried again once per request on a new one (not a failure of the
    /// server).
    async fn head(
        &mut self,
        uri: &Uri,
        body: &Bytes,
        address: &str,
        mut deadline: Pin<&mut Sleep>,
    ) -> Result<Result<Response<hyper::body::Incoming>, ClientError>, Waited> {
        let dispatcher = self.dispatcher;
        let mut client = dispatcher.client();
        loop {
            let result = tokio::select! {
                biased;
                failed = crate::dispatcher::disagg::failed(&mut self.pd.leg) => Err(Waited::PartnerFailed(failed)),
                head = client.request(self.outbound.request(uri.clone(), body.clone())) => Ok(head),
                () = deadline.as_mut() => Err(Waited::Deadline),
            };
            match &result {
                Ok(Err(e)) if !self.resent_stale && crate::dispatcher::failure::is_stale_connection(e) => {
                    self.resent_stale = true;
                    // Never a pooled one: the pool may hold another
                    // connection the server is closing.
                    client = dispatcher.fresh_client();
                    dispatcher.metrics().stale_connection();
                    tracing::debug!(
                        backend = %address,
                        error = %crate::error_chain(e),
                        "{address} had closed the connection the request went out on; sending it again"
                    );
                }
                _ => return result,
            }
        }
    }

    /// A split request's SGLang decode leg that streams sends its head at
    /// once and its first data only after the prefill leg handed over: that
    /// data is waited for here, so that a prefill leg failing before it is
    /// still tried again elsewhere rather than cutting a begun answer.
    /// Every other answer is returned as it is.
    async fn first_of_decode_stream(
        &mut self,
        response: Response<hyper::body::Incoming>,
        mut deadline: Pin<&mut Sleep>,
    ) -> Result<(Response<hyper::body::Incoming>, Option<Bytes>), Waited> {
        if self.pd.leg.is_none() || !response.status().is_success() || !is_event_stream(response.headers()) {
            return Ok((response, None));
        }
        let (parts, mut body) = response.into_parts();
        let frame = tokio::select! {
            biased;
            failed = crate::dispatcher::disagg::failed(&mut self.pd.leg) => return Err(Waited::PartnerFailed(failed)),
            frame = http_body_util::BodyExt::frame(&mut body) => frame,
            () = deadline.as_mut() => return Err(Waited::Deadline),
        };
        let first = match frame {
            Some(Ok(frame)) => frame.into_data().ok(),
            Some(Err(e)) => return Err(Waited::Broken(crate::error_chain(&e))),
            None => None,
        };
        // Handed over: a later failure of the prefill leg no longer matters.
        if first.is_some()
            && let Some(leg) = self.pd.leg.as_mut()
        {
            leg.handed_over();
        }
        Ok((Response::from_parts(parts, body), first))
    }

    /// Another server answered the request with a 2xx: the 5xx heads the
    /// earlier ones gave were theirs, and count against their health.
    pub(super) fn count_5xx_against_their_servers(&mut self) {
        for (server, address, failure) in self.answered_5xx.drain(..) {
            passive_failure(self.dispatcher, server, &address, &failure);
        }
    }

    /// Learning at dispatch: records the prompt's chain (past the `held`
    /// blocks the server was listed for already) and end key for `server`,
    /// which counts the request in flight already (see [`crate::store`]).
    /// False for a request that is not inference, or when
    /// `learn_at_dispatch` is off.
    pub(super) fn record_route(&self, server: ServerRef, held: u32) -> bool {
        let Some(c) = self
            .ctx
            .as_ref()
            .filter(|c| c.learn && self.dispatcher.config().learn_at_dispatch)
        else {
            return false;
        };
        let blocks = c.unlisted(held);
        self.dispatcher.store().record_route(server, blocks, Some(c.end_key));
        self.dispatcher.metrics().learned_at_dispatch(blocks.len());
        true
    }

    /// The body to send `server`: with the tenant's `cache_salt` when its
    /// engine takes one (its registration says).
    pub(super) fn body_to(&self, server: ServerRef) -> Bytes {
        let salted = self.outbound.cache_salt.is_some() && self.dispatcher.takes_cache_salt(server);
        self.outbound.body_for(salted)
    }

    /// Takes back [`record_route`](Self::record_route): the attempt failed
    /// or was refused, so the server must not look warm for the prompt.
    pub(super) fn forget_route(&self, server: ServerRef, held: u32) {
        let Some(c) = &self.ctx else { return };
        self.dispatcher
            .store()
            .forget_route(server, c.unlisted(held), Some(c.end_key));
        self.dispatcher.metrics().unlearned_at_dispatch();
    }

    /// Records the dispatch time of the first attempt and logs the routing
    /// decision (one event per attempt: a retry adds one; nothing is
    /// computed unless debug is enabled).
    pub(super) fn log_attempt(&mut self, address: &str, reason: Reason, candidates: usize, degraded: bool) {
        let Some(c) = &self.ctx else { return };
        // Dispatch ends here for the first attempt: the request goes upstream.
        let sent = (self.attempt == 1).then(|| c.timing.start.elapsed().as_nanos() as u64);
        if let Some(sent) = sent {
            c.timing.observe(self.dispatcher, true, sent);
            self.dispatch_ns = Some(sent);
        }
        tracing::debug!(
            endpoint = c.endpoint.path(),
            model = %c.model,
            prompt_tokens = c.prompt_tokens.len(),
            blocks = c.chain.len(),
            cache = c.cache,
            policy = self.policy_name(),
            server = %address,
            reason = reason.name(),
            matched_blocks = match reason {
                Reason::Prefix { blocks } => blocks,
                _ => 0,
            },
            candidates,
            degraded,
            // The affinity key (a session's, a stored response's), hashed
            // with the tenant's salt: the same for every turn of a session.
            session = c.affinity.map(|a| format!("{:016x}", a.key())),
            stored_response = c.previous_response_id.as_deref(),
            attempt = self.attempt,
            dispatch_ns = sent.unwrap_or_else(|| c.timing.start.elapsed().as_nanos() as u64),
            "{} routed to {address}: {}",
            c.endpoint.path(),
            reason
        );
    }
}
