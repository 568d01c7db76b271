//! The rate-limit step ([`crate::rate_limit`]): a request's buckets (its
//! tenant's and its model pool's) charged through the store before it is
//! routed, 429 when they have no room, and the `x-ratelimit-*` headers of
//! the answer when they do. It also counts the request, let in or
//! refused, for its tenant and model (`super::accounting`).

use http::{Response, StatusCode};

use shm_layout::UsageCounter;

use super::Dispatcher;
use super::accounting;
use super::http::{Body, json_response};
use crate::auth::Caller;
use crate::pools::Pool;
use crate::rate_limit::{Headroom, Outcome, OutputBuckets, Refusal, RequestBuckets};

/// A request let in by its limits.
#[derive(Debug, Default)]
pub(super) struct Admitted {
    /// The headers its answer carries (`None`: no limits apply).
    pub headroom: Option<Headroom>,
    /// Where its output tokens go when its answer ends.
    pub output: Option<OutputBuckets>,
}

impl Admitted {
    /// Sets its headers on `response`.
    pub fn set_headers(&self, response: &mut Response<Body>) {
        if let Some(h) = &self.headroom {
            h.set_headers(response.headers_mut());
        }
    }
}

/// Charges one request of `prompt_tokens` tokens from `caller` to `pool`
/// to their buckets: admitted, or the 429 to answer.
pub(super) async fn admit(
    dispatcher: &Dispatcher,
    caller: Option<&Caller>,
    pool: &Pool,
    prompt_tokens: u64,
) -> Result<Admitted, Response<Body>> {
    let tenant = caller.map(|c| &*c.tenant);
    let let_in = [(UsageCounter::Requests, 1), (UsageCounter::PromptTokens, prompt_tokens)];
    let buckets = RequestBuckets::new(caller.map_or(&[], |c| &c.limits), pool.limits());
    if buckets.is_empty() {
        accounting::count(dispatcher, tenant, pool.name(), &let_in);
        return Ok(Admitted::default());
    }
    let charges = buckets.admission(prompt_tokens);
    let verdict = dispatcher.store().take_limits(&charges).await;
    match buckets.outcome(&verdict, prompt_tokens) {
        Outcome::Allowed(headroom) => {
            accounting::count(dispatcher, tenant, pool.name(), &let_in);
            Ok(Admitted {
                headroom: Some(headroom),
                output: buckets.output(),
            })
        }
        Outcome::Refused(refusal) => {
            accounting::count(dispatcher, tenant, pool.name(), &[(UsageCounter::RateLimited, 1)]);
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
