//! The step between an attempt's routing decision and its send, for a
//! pool with prefill engines: whether the request is split, the prefill
//! leg, and the decode leg's body ([`super::super::disagg`] has the
//! protocols).
//!
//! The decode engine is the attempt's own choice (the policy over the
//! engines that decode). vLLM: a request is served by it alone when it
//! asks for several sequences, when it holds all but
//! `pd.bypass_uncached_tokens` of the prompt, when no prefill engine is
//! up, or when the prefill leg failed on two engines or handed nothing
//! over. SGLang: a decode engine cannot serve a request alone, so such a
//! request is routed whole to an aggregated engine (role `both`,
//! [`Leg::Whole`]), or refused when the pool has none. Else the prefill
//! engine is chosen by the pool's policy over the prefill engines (where
//! the prompt is warm, under its load rule), and:
//!
//! - vLLM: the prefill leg runs first, under `pd.prefill_timeout_secs`;
//!   its `kv_transfer_params` go into the decode leg's body (kept for a
//!   retry of the decode leg on another engine);
//! - SGLang: the prefill leg runs beside the decode leg, with the same
//!   rendezvous; it lives as long as the decode leg's answer is relayed
//!   (a client that leaves ends both), and its failure ends the decode
//!   leg (which waits for it): before the answer began, the request is
//!   split again on another prefill engine.
//!
//! A failed prefill leg counts against its engine's health, never the
//! decode engine's. The prompt is learned on the prefill engine (without
//! its end: that engine never holds the answer), and forgotten if its
//! SGLang leg fails.

use http_body_util::BodyExt;
use serde_json::{Map, Value};

use super::*;
use crate::config::PdProtocol;
use crate::dispatcher::disagg::{self, Companion, LegFailed, sglang::Rendezvous, vllm};
use crate::metrics::{PD_PREFILL, PdFailure, PdPath as Path};
use crate::routing::Leg;
use shm_layout::ServerRole;

/// Most bytes of a prefill answer read (one token and its parameters).
const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// Prefill engines one request is tried on.
const PREFILL_TRIES: usize = 2;

/// What the split of a request left for its attempts.
#[derive(Default)]
pub(super) struct PdState {
    /// How it was served, once decided (`None`: not a pool with prefill
    /// engines, or not decided yet).
    pub path: Option<Path>,
    /// The `x-semlb-prefill` value: the prefill engine, or `bypass`.
    pub prefill: Option<String>,
    /// vLLM: what the prefill handed over.
    params: Option<Map<String, Value>>,
    /// SGLang: the prefill leg in flight (ended when dropped).
    pub leg: Option<Companion>,
    /// Prefill engines that failed this request.
    pub failed: Vec<ServerRef>,
    /// Whether the request's pool has a prefill engine up (asked once,
    /// at its first routing).
    pool_splits: Option<bool>,
    /// When the attempt's decode leg went out (`None`: the attempt is not
    /// a split request's decode leg).
    pub decode_sent: Option<Instant>,
    /// SGLang: it goes to an aggregated engine whole (its pool has decode
    /// engines and no prefill engine could take its prefill leg).
    pub whole: bool,
}

/// A prefill leg that did not give what the decode leg needs.
enum LegFailure {
    /// No answer, or a 5xx: counts against the engine, another may do.
    Engine(Failure),
    /// An answer without parameters (a prefill that ended on a stop).
    NothingHandedOver,
}

impl Attempts<'_> {
    /// Whether the request may be split: an inference request of a pool
    /// with a prefill engine up (asked once per request).
    pub(super) fn splits(&mut self) -> bool {
        if let Some(splits) = self.pd.pool_splits {
            return splits;
        }
        let splits = match (&self.ctx, &self.outbound.pool) {
            (Some(_), Some(pool)) => disagg::has_up(
                &self.dispatcher.segment().tables().servers,
                pool.members(),
                ServerRole::Prefill,
            ),
            _ => false,
        };
        self.pd.pool_splits = Some(splits);
        splits
    }

    /// What the attempt's server is chosen for: the request (or its decode
    /// leg), or, for an inference request of an SGLang pool that cannot be
    /// split while the pool has decode engines up, an aggregated engine
    /// (an SGLang decode engine cannot serve a request alone).
    pub(super) fn leg(&mut self) -> Leg {
        if self.pd.whole {
            return Leg::Whole;
        }
        if self.dispatcher.config().pd.protocol != PdProtocol::Sglang || self.ctx.is_none() || self.splits() {
            return Leg::Request;
        }
        let decodes = self.outbound.pool.as_ref().is_some_and(|pool| {
            disagg::has_up(
                &self.dispatcher.segment().tables().servers,
                pool.members(),
                ServerRole::Decode,
            )
        });
        self.pd.whole = decodes;
        if decodes { Leg::Whole } else { Leg::Request }
    }

    /// The decode leg's body for an attempt on `decode` (whose table
    /// entries hold `predicted` of the prompt's blocks), `body` being what
    /// it would get unsplit; the prefill leg is run or started here.
    /// `Err`: `decode` cannot serve it (an SGLang decode engine, and no
    /// prefill engine could take the prefill leg): route it again, whole.
    pub(super) async fn disaggregate(&mut self, decode: ServerRef, predicted: u32, body: Bytes) -> Result<Bytes, Next> {
        let dispatcher = self.dispatcher;
        let protocol = dispatcher.config().pd.protocol;
        self.pd.decode_sent = None;
        // A retry of the decode leg: vLLM's parameters name the prefill
        // engine's blocks, which any decode engine may pull.
        if let Some(params) = &self.pd.params {
            self.pd.decode_sent = Some(Instant::now());
            return Ok(vllm::decode_body(&body, params));
        }
        if self.pd.whole {
            // An earlier attempt's prefill engine (failed) is not named.
            self.pd.prefill = None;
            return Ok(body);
        }
        if matches!(self.pd.path, Some(Path::Bypass | Path::DecodeOnly)) || !self.splits() {
            return Ok(body);
        }
        let Some(c) = self.ctx.as_ref() else { return Ok(body) };
        let sglang = protocol == PdProtocol::Sglang;
        // An SGLang engine of role `both` is an aggregated one (SGLang's
        // `null` mode): it serves the request whole, and it is not split.
        if sglang && dispatcher.segment().tables().servers.role_of(decode) == ServerRole::Both {
            self.pd.prefill = None;
            return Ok(body);
        }
        let block = c.hasher.block_size() as u64;
        let uncached = (c.prompt_tokens.len() as u64).saturating_sub(u64::from(predicted) * block);
        // vLLM's handoff has one consumer; SGLang numbers the rooms of
        // the `n` sequences itself (the room, plus 1 for each next one,
        // on both engines alike).
        if !sglang && c.choices > 1 {
            return Ok(self.decided(Path::DecodeOnly, None, body));
        }
        if !sglang && uncached <= u64::from(dispatcher.config().pd.bypass_uncached_tokens) {
            return Ok(self.decided(Path::Bypass, Some("bypass".into()), body));
        }
        disagg::request_id(&mut self.outbound.headers);
        while self.pd.failed.len() < PREFILL_TRIES {
            let Some(prefill) = self.choose_prefill().await else {
                break;
            };
            match protocol {
                PdProtocol::VllmNixl => match self.vllm_prefill(&prefill).await {
                    Ok(params) => {
                        let decode = vllm::decode_body(&body, &params);
                        self.pd.params = Some(params);
                        return Ok(self.decided(Path::Split, Some(prefill.address), decode));
                    }
                    Err(LegFailure::NothingHandedOver) => break,
                    Err(LegFailure::Engine(failure)) => self.prefill_failed(&prefill, &failure),
                },
                PdProtocol::Sglang => {
                    let port = dispatcher
                        .segment()
                        .tables()
                        .servers
                        .disaggregation(prefill.server)
                        .bootstrap_port
                        .unwrap_or(crate::config::disaggregation::DEFAULT_BOOTSTRAP_PORT);
                    let rendezvous = Rendezvous::at(&prefill.address, port);
                    let Some(decode) = rendezvous.body(&body) else { break };
                    if !self.start_sglang_prefill(&prefill, &rendezvous) {
                        break;
                    }
                    return Ok(self.decided(Path::Split, Some(prefill.address), decode));
                }
            }
        }
        if sglang {
            // Its decode engine would wait for a prefill that never comes.
            self.pd.whole = true;
            tracing::debug!(
                decode = decode.slot,
                "no prefill engine could take the prefill leg: an SGLang decode engine cannot serve the request alone"
            );
            return Err(Next::Retry);
        }
        Ok(self.decided(Path::DecodeOnly, None, body))
    }

    /// Records how the request is served (counted once: a request split
    /// again after its prefill leg failed is not counted twice), and
    /// returns `body`.
    fn decided(&mut self, path: Path, prefill: Option<String>, body: Bytes) -> Bytes {
        if path == Path::Split {
            self.pd.decode_sent = Some(Instant::now());
        }
        if self.pd.path.replace(path).is_none() {
            self.dispatcher.metrics().pd_request(path);
        }
        self.pd.prefill = prefill;
        body
    }

    /// The SGLang prefill leg that went with the attempt on `decode`
    /// failed (`failed`) before the decode leg's answer began: the decode
    /// leg is ended (it waits for that partner), the prefill engine
    /// avoided, and the request split again. Not a failure of `decode`.
    pub(super) fn prefill_leg_failed(&mut self, decode: ServerRef, recorded: Option<u32>, failed: LegFailed) -> Next {
        if let Some(held) = recorded {
            self.forget_route(decode, held);
        }
        self.pd.leg = None;
        tracing::debug!(
            prefill = %failed.failure,
            "the prefill leg failed ({}): its decode leg is ended, and the request split again",
            failed.failure
        );
        self.pd.failed.push(failed.server);
        self.last_failure = Some(failed.failure);
        if self.attempt <= self.dispatcher.config().limits.retries {
            Next::Retry
        } else {
            Next::Answer(self.bad_gateway())
        }
    }

    /// A prefill engine for the request: the pool's policy over the
    /// prefill engines that did not fail it (`None`: none is up, or the
    /// policy would hold the request).
    async fn choose_prefill(&mut self) -> Option<Chosen> {
        let c = self.ctx.as_ref()?;
        let route = RouteRequest {
            chain: &c.chain,
            prompt_tokens: u32::try_from(c.prompt_tokens.len()).unwrap_or(u32::MAX),
            template_blocks: c.template_blocks,
            session: c.session,
            // A prefill engine stores nothing the request continues.
            affinity: None,
            inference: true,
            pool: self.outbound.pool.as_ref(),
            continuation: None,
            share: None,
            leg: Leg::Prefill,
            split: false,
        };
        match choose(self.dispatcher, route, &self.pd.failed, None).await {
            // A holding policy counted it already: the leg counts itself.
            Routed::Chosen(chosen, _guard) => Some(chosen),
            Routed::Wait { .. } | Routed::NoServer | Routed::Unstored => None,
        }
    }

    /// The prefill leg's request to `prefill`: with the tenant's salt
    /// where its engine takes one; SGLang's with `rendezvous`, vLLM's
    /// asking for a remote decode.
    fn prefill_request(&self, prefill: &Chosen, rendezvous: Option<&Rendezvous>) -> Option<Request<Full<Bytes>>> {
        let uri = format!("{}{}", prefill.address, self.outbound.path_and_query)
            .parse::<Uri>()
            .ok()?;
        let base = self.body_to(prefill.server);
        let body = match rendezvous {
            Some(r) => r.body(&base)?,
            None => vllm::prefill_body(&base)?,
        };
        Some(self.outbound.request(uri, body))
    }

    /// vLLM's prefill leg on `prefill`: its answer's parameters.
    async fn vllm_prefill(&mut self, prefill: &Chosen) -> Result<Map<String, Value>, LegFailure> {
        let dispatcher = self.dispatcher;
        let address = prefill.address.clone();
        let Some(request) = self.prefill_request(prefill, None) else {
            return Err(LegFailure::Engine(Failure::BadAddress {
                address,
                detail: "not a URI with the request's path".into(),
            }));
        };
        let Some(mut guard) = InflightGuard::begin(dispatcher, prefill.server, self.prefill_tokens(prefill.predicted))
        else {
            return Err(LegFailure::Engine(Failure::Reregistered { address }));
        };
        let timeout = dispatcher.config().pd.prefill_timeout();
        let deadline = (tokio::time::Instant::now() + timeout).min(self.deadline);
        let started = Instant::now();
        let answer = tokio::time::timeout_at(deadline, async {
            let response = send_leg(dispatcher, request, &address).await?;
            guard.first_token();
            if !response.status().is_success() {
                return Err(Failure::Status {
                    address: address.clone(),
                    status: response.status(),
                });
            }
            let body = http_body_util::Limited::new(response.into_body(), MAX_PREFILL_ANSWER)
                .collect()
                .await
                .map_err(|e| Failure::Connect {
                    address: address.clone(),
                    detail: e.to_string(),
                })?;
            Ok(body.to_bytes())
        })
        .await
        .unwrap_or_else(|_| {
            Err(Failure::Timeout {
                address: address.clone(),
                secs: timeout.as_secs(),
            })
        });
        drop(guard);
        dispatcher.metrics().observe_duration(PD_PREFILL, started.elapsed());
        let answer = answer.map_err(LegFailure::Engine)?;
        let Some(params) = vllm::params_of(&answer) else {
            dispatcher.metrics().pd_handoff_failure(PdFailure::NoParams);
            tracing::debug!(
                prefill = %address,
                "the prefill engine {address} handed nothing over (it stopped at its one token): decode alone"
            );
            return Err(LegFailure::NothingHandedOver);
        };
        self.learn_prefill(prefill);
        Ok(params)
    }

    /// SGLang's prefill leg on `prefill`, started beside the decode leg
    /// (`false`: it could not be): it reads its answer to the end (the
    /// engine aborts a leg whose client left), ends with the decode leg's
    /// answer, and tells the decode leg when it failed.
    fn start_sglang_prefill(&mut self, prefill: &Chosen, rendezvous: &Rendezvous) -> bool {
        let dispatcher = self.dispatcher.clone();
        let Some(request) = self.prefill_request(prefill, Some(rendezvous)) else {
            return false;
        };
        let Some(mut guard) = InflightGuard::begin(&dispatcher, prefill.server, self.prefill_tokens(prefill.predicted))
        else {
            return false;
        };
        // Learned as it starts (a concurrent request with the same prefix
        // then finds it there), forgotten if it fails.
        let learned = self.learn_prefill(prefill).map(<[u64]>::to_vec);
        let (server, address) = (prefill.server, prefill.address.clone());
        let timeout = dispatcher.config().pd.prefill_timeout();
        let (tell, failed) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let leg = async {
                let response = send_leg(&dispatcher, request, &address).await?;
                guard.first_token();
                let status = response.status();
                let mut body = response.into_body();
                while let Some(frame) = body.frame().await {
                    frame.map_err(|e| Failure::Connect {
                        address: address.clone(),
                        detail: e.to_string(),
                    })?;
                }
                if status.is_server_error() {
                    return Err(Failure::Status {
                        address: address.clone(),
                        status,
                    });
                }
                Ok(())
            };
            let outcome = tokio::time::timeout(timeout, leg).await.unwrap_or_else(|_| {
                Err(Failure::Timeout {
                    address: address.clone(),
                    secs: timeout.as_secs(),
                })
            });
            drop(guard);
            dispatcher.metrics().observe_duration(PD_PREFILL, started.elapsed());
            if let Err(failure) = outcome {
                dispatcher.metrics().pd_handoff_failure(PdFailure::PrefillFailed);
                passive_failure(&dispatcher, server, &address, &failure);
                if let Some(blocks) = learned {
                    dispatcher.store().forget_route(server, &blocks, None);
                }
                // The decode leg may have ended already: nobody to tell.
                let _ = tell.send(LegFailed { server, failure });
            }
        });
        self.pd.leg = Some(Companion::new(task.abort_handle(), failed));
        true
    }

    /// The prefill leg on `prefill` failed: its engine is avoided for this
    /// request, and the failure counts against it alone.
    fn prefill_failed(&mut self, prefill: &Chosen, failure: &Failure) {
        self.dispatcher.metrics().pd_handoff_failure(PdFailure::PrefillFailed);
        tracing::debug!(
            prefill = %prefill.address,
            error = %failure,
            "the prefill leg on {} failed: {failure}",
            prefill.address
        );
        passive_failure(self.dispatcher, prefill.server, &prefill.address, failure);
        self.pd.failed.push(prefill.server);
    }

    /// The prefill engine computed (or is computing) the prompt: its table
    /// entries say so, without the prompt's end (it never holds the
    /// answer). The blocks recorded, if any.
    fn learn_prefill(&self, prefill: &Chosen) -> Option<&[u64]> {
        let c = self
            .ctx
            .as_ref()
            .filter(|c| c.learn && self.dispatcher.config().learn_at_dispatch)?;
        let blocks = c.unlisted(prefill.held);
        self.dispatcher.store().record_route(prefill.server, blocks, None);
        Some(blocks)
    }
}

/// Sends a prefill leg to the engine at `address`: its answer's head, or
/// the failure to reach it.
async fn send_leg(
    dispatcher: &Dispatcher,
    request: Request<Full<Bytes>>,
    address: &str,
) -> Result<Response<hyper::body::Incoming>, Failure> {
    dispatcher
        .client()
        .request(request)
        .await
        .map_err(|e| Failure::Connect {
            address: address.to_owned(),
            detail: crate::error_chain(&e),
        })
}
