//! The step between an attempt's routing decision and its send, for a
//! pool with prefill engines: whether the request is split, the prefill
//! leg, and the decode leg's body ([`super::super::disagg`] has the
//! protocols).
//!
//! The decode engine is the attempt's own choice (the policy over the
//! engines that decode). A request is served by it alone when it asks
//! for several choices, when it holds all but `pd.bypass_uncached_tokens`
//! of the prompt (vLLM only: an SGLang decode engine always meets a
//! prefill partner), when no prefill engine is up, or when the prefill
//! leg failed on two engines or (vLLM) handed nothing over. Else the
//! prefill engine is chosen by the pool's policy over the prefill engines
//! (where the prompt is warm, under its load rule), and:
//!
//! - vLLM: the prefill leg runs first, under `pd.prefill_timeout_secs`;
//!   its `kv_transfer_params` go into the decode leg's body (kept for a
//!   retry of the decode leg on another engine);
//! - SGLang: the prefill leg runs beside the decode leg, with the same
//!   rendezvous; it lives as long as the decode leg's answer is relayed
//!   (a client that leaves ends both).
//!
//! A failed prefill leg counts against its engine's health, never the
//! decode engine's. The prompt is learned on the prefill engine (without
//! its end: that engine never holds the answer) once its leg succeeded.

use http_body_util::BodyExt;
use serde_json::{Map, Value};

use super::*;
use crate::config::PdProtocol;
use crate::dispatcher::disagg::{self, Companion, sglang::Rendezvous, vllm};
use crate::metrics::{PD_PREFILL, PdFailure, PdPath as Path};
use crate::routing::Leg;

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
    failed: Vec<ServerRef>,
    /// Whether the request's pool has a prefill engine up (asked once,
    /// at its first routing).
    pool_splits: Option<bool>,
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
            (Some(_), Some(pool)) => disagg::has_prefill(&self.dispatcher.segment().tables().servers, pool.members()),
            _ => false,
        };
        self.pd.pool_splits = Some(splits);
        splits
    }

    /// The decode leg's body for an attempt on `decode` (whose table
    /// entries hold `predicted` of the prompt's blocks), `body` being what
    /// it would get unsplit; the prefill leg is run or started here.
    pub(super) async fn disaggregate(&mut self, predicted: u32, body: Bytes) -> Bytes {
        let dispatcher = self.dispatcher;
        let protocol = dispatcher.config().pd.protocol;
        // A retry of the decode leg: vLLM's parameters name the prefill
        // engine's blocks, which any decode engine may pull.
        if let Some(params) = &self.pd.params {
            return vllm::decode_body(&body, params);
        }
        if matches!(self.pd.path, Some(Path::Bypass | Path::DecodeOnly)) || !self.splits() {
            return body;
        }
        let Some(c) = self.ctx.as_ref() else { return body };
        let block = c.hasher.block_size() as u64;
        let uncached = (c.prompt_tokens.len() as u64).saturating_sub(u64::from(predicted) * block);
        if vllm::many_choices(&body) {
            return self.decided(Path::DecodeOnly, None, body);
        }
        if protocol == PdProtocol::VllmNixl && uncached <= u64::from(dispatcher.config().pd.bypass_uncached_tokens) {
            return self.decided(Path::Bypass, Some("bypass".into()), body);
        }
        disagg::request_id(&mut self.outbound.headers);
        for _ in 0..PREFILL_TRIES {
            let Some(prefill) = self.choose_prefill().await else {
                break;
            };
            match protocol {
                PdProtocol::VllmNixl => match self.vllm_prefill(&prefill).await {
                    Ok(params) => {
                        let decode = vllm::decode_body(&body, &params);
                        self.pd.params = Some(params);
                        return self.decided(Path::Split, Some(prefill.address), decode);
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
                    self.start_sglang_prefill(&prefill, &rendezvous);
                    return self.decided(Path::Split, Some(prefill.address), decode);
                }
            }
        }
        self.decided(Path::DecodeOnly, None, body)
    }

    /// Records how the request is served, and returns `body`.
    fn decided(&mut self, path: Path, prefill: Option<String>, body: Bytes) -> Bytes {
        self.pd.path = Some(path);
        self.pd.prefill = prefill;
        self.dispatcher.metrics().pd_request(path);
        body
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
            Routed::Wait { .. } | Routed::NoServer => None,
        }
    }

    /// The prefill leg's request to `prefill`: with the tenant's salt
    /// where its engine takes one; SGLang's with `rendezvous`, vLLM's
    /// asking for a remote decode.
    fn prefill_request(&self, prefill: &Chosen, rendezvous: Option<&Rendezvous>) -> Option<Request<Full<Bytes>>> {
        let uri = format!("{}{}", prefill.address, self.outbound.path_and_query)
            .parse::<Uri>()
            .ok()?;
        let salted = self.outbound.cache_salt.is_some() && self.dispatcher.takes_cache_salt(&prefill.address);
        let base = self.outbound.body_for(salted);
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

    /// SGLang's prefill leg on `prefill`, started beside the decode leg:
    /// it reads its answer to the end (the engine aborts a leg whose
    /// client left), and ends with the decode leg's answer.
    fn start_sglang_prefill(&mut self, prefill: &Chosen, rendezvous: &Rendezvous) {
        let dispatcher = self.dispatcher.clone();
        let Some(request) = self.prefill_request(prefill, Some(rendezvous)) else {
            return;
        };
        let Some(mut guard) = InflightGuard::begin(&dispatcher, prefill.server, self.prefill_tokens(prefill.predicted))
        else {
            return;
        };
        self.learn_prefill(prefill);
        let (server, address) = (prefill.server, prefill.address.clone());
        let timeout = dispatcher.config().pd.prefill_timeout();
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
            }
        });
        self.pd.leg = Some(Companion::new(task.abort_handle()));
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
    /// entries say so, without the prompt's end (it never holds the answer).
    fn learn_prefill(&self, prefill: &Chosen) {
        let Some(c) = self
            .ctx
            .as_ref()
            .filter(|c| c.learn && self.dispatcher.config().learn_at_dispatch)
        else {
            return;
        };
        self.dispatcher
            .store()
            .record_route(prefill.server, c.unlisted(prefill.held), None);
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
