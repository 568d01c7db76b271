//! The rate-limit step ([`crate::tenancy::rate_limit`]): a request's buckets (its
//! tenant's and its model pool's) charged through the store before it is
//! routed, with a reservation for its output, 429 when they have no room,
//! and the `x-ratelimit-*` headers of the answer when they do. It also
//! counts the request, let in or refused, for its tenant and model
//! (`super::tenant_usage`). The reservation ([`Reservation`]) is settled
//! once, when the answer ends, or given back whole when it is dropped
//! unsettled (the request got no answer).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Response, StatusCode};

use shm_layout::UsageCounter;

use super::Dispatcher;
use super::http::{Body, json_response};
use super::tenant_usage;
use crate::pools::Pool;
use crate::tenancy::auth::Caller;
use crate::tenancy::rate_limit::{Headroom, Outcome, OutputBuckets, Refusal, RequestBuckets};

/// A request let in by its limits.
#[derive(Debug, Default)]
pub(super) struct Admitted {
    /// The headers its answer carries (`None`: no limits apply).
    pub headroom: Option<Headroom>,
    /// Its output reservation, settled when its answer ends.
    pub output: Option<Reservation>,
}

/// The output a request reserved in its token buckets: settled once by
/// [`settle`](Self::settle) with the tokens its answer produced, or given
/// back whole when dropped unsettled.
#[derive(Debug)]
pub(super) struct Reservation {
    dispatcher: Arc<Dispatcher>,
    buckets: Option<OutputBuckets>,
}

/// A settlement under way in the store ([`Reservation::settle`]).
pub(super) struct Settling(Pin<Box<dyn Future<Output = ()> + Send>>);

impl Settling {
    /// `work` as a settlement to wait for.
    pub fn new(work: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(Box::pin(work))
    }

    /// Both of `a` and `b`, one after the other.
    pub fn both(a: Option<Settling>, b: Option<Settling>) -> Option<Settling> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Self::new(async move {
                a.await;
                b.await;
            })),
            (a, b) => a.or(b),
        }
    }
}

impl Future for Settling {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl std::fmt::Debug for Settling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Settling")
    }
}

impl Reservation {
    /// Settles it for an answer of `tokens` output tokens: the unused part
    /// given back, the excess charged room or not. The answer's end waits
    /// for the future: a client sends its next request the instant it
    /// reads that end, and that request must find the refund (in Redis,
    /// possibly through another dispatcher; given back without waiting,
    /// the next request raced it and was refused the tokens).
    pub fn settle(mut self, tokens: u64) -> Settling {
        let settlement = self.buckets.take().map(|b| b.settle(tokens));
        let dispatcher = self.dispatcher.clone();
        Settling::new(async move {
            if let Some(settlement) = settlement {
                dispatcher.store().settle_limits(&settlement).await;
            }
        })
    }

    /// Settles it without waiting (a relay that did not end well).
    pub fn settle_detached(mut self, tokens: u64) {
        self.settle_once(tokens);
    }

    fn settle_once(&mut self, tokens: u64) {
        if let Some(buckets) = self.buckets.take() {
            let settlement = buckets.settle(tokens);
            let store = self.dispatcher.store();
            store.charge_limits(&settlement.charge);
            store.refund_limits(&settlement.refund);
        }
    }
}

impl Drop for Reservation {
    /// Not settled: the request got no answer.
    fn drop(&mut self) {
        self.settle_once(0);
    }
}

impl Admitted {
    /// Sets its headers on `response`.
    pub fn set_headers(&self, response: &mut Response<Body>) {
        if let Some(h) = &self.headroom {
            h.set_headers(response.headers_mut());
        }
    }
}

/// Charges one request of `prompt_tokens` tokens, reserving `reserve()`
/// tokens of output (asked only when a bucket counts), from `caller` to
/// `pool` to their buckets: admitted, or the 429 to answer.
pub(super) async fn admit(
    dispatcher: &Arc<Dispatcher>,
    caller: Option<&Caller>,
    pool: &Pool,
    prompt_tokens: u64,
    reserve: impl FnOnce() -> u64,
) -> Result<Admitted, Response<Body>> {
    let tenant = caller.map(|c| &*c.tenant);
    let let_in = [(UsageCounter::Requests, 1), (UsageCounter::PromptTokens, prompt_tokens)];
    let buckets = RequestBuckets::new(caller.map_or(&[], |c| &c.limits), pool.limits());
    if buckets.is_empty() {
        tenant_usage::count(dispatcher, tenant, pool.name(), &let_in);
        return Ok(Admitted::default());
    }
    let charges = buckets.admission(prompt_tokens, reserve());
    let verdict = dispatcher.store().take_limits(&charges).await;
    match buckets.outcome(&verdict, &charges) {
        Outcome::Allowed(headroom) => {
            tenant_usage::count(dispatcher, tenant, pool.name(), &let_in);
            Ok(Admitted {
                headroom: Some(headroom),
                output: buckets.output(&charges, prompt_tokens).map(|b| Reservation {
                    dispatcher: dispatcher.clone(),
                    buckets: Some(b),
                }),
            })
        }
        Outcome::Refused(refusal) => {
            tenant_usage::count(dispatcher, tenant, pool.name(), &[(UsageCounter::RateLimited, 1)]);
            tracing::debug!(tenant, model = pool.name(), "rate limited: {}", refusal.message);
            Err(too_many_requests(&refusal))
        }
    }
}

/// OpenAI's 429 for `refusal`.
fn too_many_requests(refusal: &Refusal) -> Response<Body> {
    let body = serde_json::json!({
        "error": {
            "message": refusal.message,
            "type": refusal.unit.name(),
            "param": null,
            "code": "rate_limit_exceeded",
        }
    });
    let mut response = json_response(StatusCode::TOO_MANY_REQUESTS, &body);
    refusal.set_headers(response.headers_mut());
    response
}
