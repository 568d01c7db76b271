//! Per-tenant concurrency limits (`max_concurrent_requests` in the keys
//! file's `[[tenant]]`): a tenant's requests in flight on this gateway
//! host, across every dispatcher, its streams included until they end.
//!
//! Each dispatcher counts its own requests of a tenant in a gauge of the
//! segment's usage table named `<registry slot>:<tenant>`
//! ([`shm_layout::UsageKind::Gauge`]), which only it changes; the
//! supervisor zeroes a dispatcher's gauges when it dies (its requests died
//! with it). A request first counts itself, then sums the tenant's gauges
//! over every dispatcher slot: past the limit it uncounts itself and gets
//! 429. Counting first makes the limit strict: two requests racing on two
//! dispatchers may both be refused, never both let in past it. The count
//! ends when the answer's body ends or is dropped (`Counted` rides on
//! it). A usage table too full to hold a new gauge lets requests in
//! uncounted (the table holds 1 024 names; logged by its `add`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use shm_layout::{Role, UsageCounter, UsageKind};

use super::Dispatcher;
use super::http::{Body, BoxError, json_response, set_static_header};
use crate::tenancy::auth::Caller;

/// The name of the gauge of `tenant`'s requests in flight through the
/// dispatcher in registry slot `slot`.
pub fn gauge_name(slot: u16, tenant: &str) -> String {
    format!("{slot}:{tenant}")
}

/// Whether `name` is a gauge of the dispatcher in registry slot `slot`
/// (what the supervisor zeroes when it dies).
pub fn gauge_of(slot: u16, name: &str) -> bool {
    name.strip_prefix(&slot.to_string())
        .is_some_and(|rest| rest.starts_with(':'))
}

/// One request counted in its tenant's gauge until dropped.
#[derive(Debug)]
pub(super) struct Counted {
    dispatcher: Arc<Dispatcher>,
    gauge: String,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.dispatcher
            .segment()
            .tables()
            .usage
            .sub(UsageKind::Gauge, &self.gauge, UsageCounter::Requests, 1);
    }
}

/// Counts a request of `caller` against its tenant's concurrency limit:
/// `None` when it has none, the count while it runs, or the 429 to answer.
pub(super) fn begin(
    dispatcher: &Arc<Dispatcher>,
    caller: Option<&Caller>,
) -> Result<Option<Counted>, Box<Response<Body>>> {
    let Some((caller, limit)) = caller.and_then(|c| c.max_concurrent.map(|limit| (c, limit))) else {
        return Ok(None);
    };
    let tables = dispatcher.segment().tables();
    let gauge = gauge_name(dispatcher.identity.slot, &caller.tenant);
    if !tables
        .usage
        .add(UsageKind::Gauge, &gauge, &[(UsageCounter::Requests, 1)])
    {
        return Ok(None);
    }
    let counted = Counted {
        dispatcher: dispatcher.clone(),
        gauge,
    };
    let in_flight: u64 = tables
        .registry
        .processes()
        .filter(|p| p.role == Some(Role::Dispatcher))
        .map(|p| {
            tables.usage.get(
                UsageKind::Gauge,
                &gauge_name(p.slot, &caller.tenant),
                UsageCounter::Requests,
            )
        })
        .fold(0u64, u64::wrapping_add);
    if in_flight <= limit {
        return Ok(Some(counted));
    }
    drop(counted);
    let body = serde_json::json!({
        "error": {
            "message": format!(
                "Too many concurrent requests for tenant '{}': its limit is {limit} in flight at once. Please try again when one ends.",
                caller.tenant
            ),
            "type": "requests",
            "param": null,
            "code": "concurrency_limit_exceeded",
        }
    });
    let mut r = json_response(StatusCode::TOO_MANY_REQUESTS, &body);
    set_static_header(r.headers_mut(), "retry-after", "1");
    Err(Box::new(r))
}

/// `response` with `counted` held until its body ends or is dropped.
pub(super) fn hold(response: Response<Body>, counted: Option<Counted>) -> Response<Body> {
    match counted {
        None => response,
        Some(counted) => response.map(|inner| {
            Holding {
                inner,
                _counted: counted,
            }
            .boxed_unsync()
        }),
    }
}

/// A response body that holds its request's count.
struct Holding {
    inner: Body,
    _counted: Counted,
}

impl HttpBody for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slots_gauges_are_told_apart() {
        assert_eq!(gauge_name(3, "acme"), "3:acme");
        assert!(gauge_of(3, "3:acme") && gauge_of(3, "3:a:b"));
        assert!(!gauge_of(3, "13:acme") && !gauge_of(1, "13:acme") && !gauge_of(3, "3acme"));
    }
}
