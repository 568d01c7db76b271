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

use crate::failure::Failure;

/// Error type of response bodies.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body: a full buffer, a relayed upstream body, or a replay.
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Header naming where an inference answer came from: a server address or `cache`.
pub(crate) const BACKEND_HEADER: &str = "x-semlb-backend";
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

/// Reads a request body of at most `max` bytes within `within` (413
/// beyond, from `Content-Length` or while reading; 408 when it takes
/// longer; 400 when it cannot be read).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Incoming,
    max: usize,
    within: std::time::Duration,
) -> Result<Bytes, Response<Body>> {
    let too_large = || {
        error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than the limit of {max} bytes"),
            Some("payload_too_large"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let Ok(read) = tokio::time::timeout(within, Limited::new(body, max).collect()).await else {
        // The client's: nothing to count against an engine.
        return Err(error_response(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", within.as_secs()),
            Some("request_timeout"),
        ));
    };
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => {
            // The client's side failed: nothing to count against an engine.
            let failure = Failure::ClientBody { detail: e.to_string() };
            tracing::debug!(origin = failure.origin().name(), error = %failure, "{failure}");
            Err(error_response(StatusCode::BAD_REQUEST, failure.to_string(), None))
        }
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

/// `body` (a JSON object) parsed and written again with its field `field`
/// set to the string `value` (`body` as it is if it is not an object).
pub(crate) fn with_string_field(body: &Bytes, field: &str, value: &str) -> Bytes {
    let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return body.clone();
    };
    object.insert(field.into(), serde_json::Value::String(value.to_owned()));
    Bytes::from(serde_json::to_vec(&object).expect("a JSON value serializes"))
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
    fn errors_have_the_openai_shape() {
        let r = error_response(StatusCode::BAD_GATEWAY, "down", None);
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
    }
}
