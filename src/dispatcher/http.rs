//! HTTP plumbing shared by the dispatcher's handlers: the response body
//! type, OpenAI-style error responses, and which headers cross the proxy.
//!
//! Errors the gateway produces itself have OpenAI's body,
//! `{"error": {"message", "type", "param", "code"}}`, with `type`
//! `invalid_request_error` for 4xx and `server_error` for 5xx.

use std::convert::Infallible;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use crate::dispatcher::failure::Failure;
use crate::openai::body::Json;

/// Error type of response bodies.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body: a full buffer, a relayed upstream body, or a replay.
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Header naming where an inference answer came from: a server address or `cache`.
pub(crate) const BACKEND_HEADER: &str = "x-semlb-backend";
/// Header naming a split request's prefill engine, or `bypass` for a
/// request of a pool with prefill engines that went to decode alone.
pub(crate) const PREFILL_HEADER: &str = "x-semlb-prefill";
/// Header telling what the response cache did: `hit`, `miss` or `bypass`.
pub(crate) const CACHE_HEADER: &str = "x-semlb-cache";
/// Header carrying where an inference request's dispatch time went
/// (`timing::DispatchTiming`).
pub(crate) const DISPATCH_HEADER: &str = "x-semlb-dispatch-ns";
/// Header naming why the server was chosen ([`crate::routing::Reason::name`]).
pub(crate) const ROUTE_HEADER: &str = "x-semlb-route";
/// Header carrying the milliseconds a request waited in the gateway queue
/// (absent when it did not wait).
pub(crate) const QUEUE_HEADER: &str = "x-semlb-queue-ms";

/// The prefix of the gateway's diagnostic answer headers
/// (`x-semlb-backend`, `-cache`, `-dispatch-ns`, `-route`, `-queue-ms`, a
/// peer's `-peer`), which authenticated callers get only with
/// `auth.debug_headers` (the config's
/// [`AuthConfig::debug_headers`](crate::config::AuthConfig::debug_headers));
/// an upstream's headers under it are withheld alike.
pub const DIAGNOSTIC_PREFIX: &str = "x-semlb-";

/// Removes every [`DIAGNOSTIC_PREFIX`] header from `headers`.
pub(crate) fn remove_diagnostics(headers: &mut HeaderMap) {
    let names: Vec<_> = headers
        .keys()
        .filter(|k| k.as_str().starts_with(DIAGNOSTIC_PREFIX))
        .cloned()
        .collect();
    for name in names {
        headers.remove(name);
    }
}

/// A body of `bytes`.
pub(crate) fn full_body(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// A response with `status`, a content type and a full body.
pub(crate) fn full_response(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A JSON response.
pub(crate) fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    full_response(status, "application/json", value.to_string())
}

/// An OpenAI-style error response.
pub(crate) fn error_response(status: StatusCode, message: impl Into<String>, code: Option<&str>) -> Response<Body> {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = serde_json::json!({
        "error": {
            "message": message.into(),
            "type": kind,
            "param": null,
            "code": code,
        }
    });
    json_response(status, &body)
}

/// 413 for a request body over the limit of `max` bytes.
pub(crate) fn body_too_large(max: usize) -> Response<Body> {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is larger than the limit of {max} bytes"),
        Some("payload_too_large"),
    )
}

/// Reads a request body of at most `max` bytes within `within` (413
/// beyond, from `Content-Length` or while reading; 408 when it takes
/// longer; 400 when it cannot be read).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Incoming,
    max: usize,
    within: std::time::Duration,
    budget: &BodyBudget,
) -> Result<(Bytes, BodyPermit), Response<Body>> {
    let too_large = || body_too_large(max);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    // Its place in the dispatcher's budget of bodies in flight: what it
    // declares now, what a chunked body brings as it comes.
    let mut permit = budget.take(declared.unwrap_or(0)).ok_or_else(|| budget.busy())?;
    let read = async {
        let mut body = Limited::new(body, max);
        let mut buf = bytes::BytesMut::with_capacity(declared.unwrap_or(0) as usize);
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else { continue };
            if !budget.extend(&mut permit, (buf.len() + data.len()) as u64) {
                return Ok(None);
            }
            buf.extend_from_slice(&data);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Some(buf.freeze()))
    };
    let read = match tokio::time::timeout(within, read).await {
        Ok(Ok(None)) => return Err(budget.busy()),
        Ok(Ok(Some(bytes))) => Ok(Ok(bytes)),
        Ok(Err(e)) => Ok(Err(e)),
        Err(elapsed) => Err(elapsed),
    };
    let Ok(read) = read else {
        // The client's: nothing to count against an engine.
        return Err(error_response(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", within.as_secs()),
            Some("request_timeout"),
        ));
    };
    match read {
        Ok(bytes) => Ok((bytes, permit)),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => {
            // The client's side failed: nothing to count against an engine.
            let failure = Failure::ClientBody { detail: e.to_string() };
            tracing::debug!(origin = failure.origin().name(), error = %failure, "{failure}");
            Err(error_response(StatusCode::BAD_REQUEST, failure.to_string(), None))
        }
    }
}

/// The request bodies a dispatcher holds at once, in KiB
/// (`limits.max_inflight_body_bytes`): a request whose body would go past
/// it gets 503 `server_busy` with `Retry-After: 1` (a client flood of large
/// bodies cannot grow a dispatcher without bound: 4 096 connections × a
/// 16 MiB body × the JSON tree's amplification was the bound before).
#[derive(Debug)]
pub(crate) struct BodyBudget {
    kib: std::sync::Arc<tokio::sync::Semaphore>,
}

/// A body's place in the [`BodyBudget`], given back when dropped (when
/// the request's handling ends).
#[derive(Debug)]
pub(crate) struct BodyPermit(Option<tokio::sync::OwnedSemaphorePermit>);

impl BodyBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Self {
        let kib = usize::try_from(bytes.div_ceil(1024))
            .unwrap_or(usize::MAX)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        Self {
            kib: std::sync::Arc::new(tokio::sync::Semaphore::new(kib)),
        }
    }

    fn kib(bytes: u64) -> u32 {
        u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
    }

    /// A permit for `bytes` (`None`: the budget has not that much left).
    fn take(&self, bytes: u64) -> Option<BodyPermit> {
        match Self::kib(bytes) {
            0 => Some(BodyPermit(None)),
            n => self
                .kib
                .clone()
                .try_acquire_many_owned(n)
                .ok()
                .map(|p| BodyPermit(Some(p))),
        }
    }

    /// Grows `permit` to cover `bytes`; false if the budget has not the
    /// room.
    fn extend(&self, permit: &mut BodyPermit, bytes: u64) -> bool {
        let held = permit.0.as_ref().map_or(0, |p| p.num_permits() as u32);
        let need = Self::kib(bytes);
        if need <= held {
            return true;
        }
        match self.kib.clone().try_acquire_many_owned(need - held) {
            Ok(more) => {
                match permit.0.as_mut() {
                    Some(p) => p.merge(more),
                    None => permit.0 = Some(more),
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Holds `bytes` in `permit` (taken first when `None`); false if the
    /// budget has not the room (a body buffered as it comes: the endpoint
    /// picker's).
    pub(crate) fn hold(&self, permit: &mut Option<BodyPermit>, bytes: u64) -> bool {
        match permit {
            Some(p) => self.extend(p, bytes),
            None => {
                *permit = self.take(bytes);
                permit.is_some()
            }
        }
    }

    /// The 503 of a body past the budget.
    pub(crate) fn busy(&self) -> Response<Body> {
        let mut r = error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "the gateway holds as many request bodies as it may (limits.max_inflight_body_bytes); retry shortly",
            Some("server_busy"),
        );
        set_static_header(r.headers_mut(), "retry-after", "1");
        r
    }
}

/// Sets header `name` to a constant `value` (no check at run time: the
/// values are the gateway's own, valid header text).
pub(crate) fn set_static_header(headers: &mut HeaderMap, name: &'static str, value: &'static str) {
    headers.insert(HeaderName::from_static(name), HeaderValue::from_static(value));
}

/// Sets header `name` to `value` (left out if `value` is not a valid
/// header value).
pub(crate) fn set_header(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        headers.insert(HeaderName::from_static(name), value);
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and the ones the proxy sets itself:
/// never copied across.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// The client's headers to send upstream: end-to-end headers except `Host`
/// and `Content-Length` (the client sets them for the upstream request) and
/// `Accept-Encoding` (the dispatcher reads the answer, so it must not be
/// compressed), plus any header the `Connection` header lists.
pub(crate) fn upstream_request_headers(from: &HeaderMap) -> HeaderMap {
    let listed = connection_listed(from);
    let mut out = HeaderMap::with_capacity(from.len());
    for (name, value) in from {
        if is_hop_by_hop(name)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == header::ACCEPT_ENCODING
            || name == crate::peers::TOKEN_HEADER
            || name == crate::peers::TENANT_HEADER
            || listed.iter().any(|l| l == name.as_str())
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// [`upstream_request_headers`], without the client's API keys when the
/// gateway checked them (`authenticated`): they are the gateway's keys,
/// not the engines'.
pub(crate) fn upstream_headers(from: &HeaderMap, authenticated: bool) -> HeaderMap {
    let mut out = upstream_request_headers(from);
    if authenticated {
        for name in crate::response_cache::API_KEY_HEADERS {
            out.remove(name);
        }
    }
    out
}

/// The upstream response headers to send to the client (end-to-end only;
/// `Content-Length` is left to the relayed body's exact size).
pub(crate) fn client_response_headers(from: &HeaderMap, to: &mut HeaderMap) {
    let listed = connection_listed(from);
    for (name, value) in from {
        if is_hop_by_hop(name) || name == header::CONTENT_LENGTH || listed.iter().any(|l| l == name.as_str()) {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
}

fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// `body` (a JSON object) with its top-level `field` set to the string
/// `value` (see [`with_field`]).
pub(crate) fn with_string_field(body: &Bytes, field: &str, value: &str) -> Bytes {
    with_field(body, field, &serde_json::to_string(value).expect("a string serializes"))
}

/// `body` (a JSON object) with its top-level `field` set to `raw` (JSON
/// text), the rest in the client's order: the body is not written again
/// through a map that would sort the keys of its objects (tool parameters
/// among them, which the engine renders into the prompt in the order
/// given). Without such a member, it is added at the object's end and
/// every other byte stays as the client sent it; with one (its key
/// escaped or not, given once or more), the body is written again from
/// its parsed tree in document order without it, so nothing of the
/// client's value reaches the engine. A body that is not an object comes
/// back as it was.
pub(crate) fn with_field(body: &Bytes, field: &str, raw: &str) -> Bytes {
    let trimmed = body.trim_ascii();
    let (Some(b'{'), Some(b'}')) = (trimmed.first(), trimmed.last()) else {
        return body.clone();
    };
    let name = serde_json::to_string(field).expect("a string serializes");
    // Only `\uXXXX` writes a key's letter as something else.
    let may_have =
        memchr::memmem::find(body, field.as_bytes()).is_some() || memchr::memmem::find(body, br"\u").is_some();
    if may_have
        && let Ok(Json::Object(mut object)) = Json::parse(body)
        && object.get(field).is_some()
    {
        object.remove(field);
        let mut out = String::with_capacity(body.len() + raw.len());
        object.write_compact(&mut out);
        out.pop();
        if !object.is_empty() {
            out.push(',');
        }
        out.push_str(&name);
        out.push(':');
        out.push_str(raw);
        out.push('}');
        return Bytes::from(out);
    }
    let close = body.len() - 1 - body.iter().rev().position(|b| *b == b'}').unwrap_or(0);
    let empty = trimmed[1..trimmed.len() - 1].trim_ascii().is_empty();
    let mut out = Vec::with_capacity(body.len() + name.len() + raw.len() + 2);
    out.extend_from_slice(&body[..close]);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(name.as_bytes());
    out.push(b':');
    out.extend_from_slice(raw.as_bytes());
    out.extend_from_slice(&body[close..]);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_do_not_cross() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-private"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert(header::HOST, HeaderValue::from_static("gw"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let out = upstream_request_headers(&h);
        let names: Vec<&str> = out.keys().map(HeaderName::as_str).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(out.contains_key(header::AUTHORIZATION) && out.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn a_field_is_added_without_reordering_the_body() {
        let body = Bytes::from_static(br#" {"prompt":"a","tools":[{"p":{"z":1,"a":2.5e-7}}]} "#);
        let out = with_string_field(&body, "model", "b\"c");
        assert_eq!(
            &out[..],
            br#" {"prompt":"a","tools":[{"p":{"z":1,"a":2.5e-7}}],"model":"b\"c"} "#
        );
        // A member the body has is written again without it, in order.
        let body = Bytes::from_static(br#"{"model":"a","tools":[{"p":{"z":1,"a":2}}],"mod\u0065l":"x"}"#);
        let out = with_string_field(&body, "model", "b");
        assert_eq!(&out[..], br#"{"tools":[{"p":{"z":1,"a":2}}],"model":"b"}"#);
        assert_eq!(
            &with_field(&Bytes::from_static(b"{ }"), "x", "null")[..],
            br#"{ "x":null}"#
        );
        assert_eq!(&with_field(&Bytes::from_static(b"[1]"), "x", "null")[..], b"[1]");
    }

    #[test]
    fn errors_have_the_openai_shape() {
        let r = error_response(StatusCode::BAD_GATEWAY, "down", None);
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
    }
}
