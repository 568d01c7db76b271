//! An async HTTP/1.1 client for tests that run a server in their own
//! process (the dispatcher on a tokio runtime, the simulator's HTTP front):
//! one request on a fresh connection, its body read to the end, within a
//! deadline that names what timed out.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

/// `f`'s output, or a panic naming `what` after `patience`.
pub async fn within<F: Future>(what: &str, patience: Duration, f: F) -> F::Output {
    tokio::time::timeout(patience, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A response read to the end.
#[derive(Debug)]
pub struct Reply {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its whole body.
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Header `name` (panics when it is missing or not text).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("no {name} header ({})", self.status))
            .to_str()
            .expect("ASCII header")
    }

    /// The body as text (panics when it is not UTF-8).
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("UTF-8 body")
    }
}

/// Sends one request on a fresh connection to `addr` and returns the
/// response head (the caller reads the body, or drops it to leave).
/// A non-empty `body` is sent as JSON.
pub async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response<Incoming> {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    if !body.is_empty() {
        request = request.header("content-type", "application/json");
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(Bytes::from(body.to_owned()))).expect("request");
    sender.send_request(request).await.expect("send request")
}

/// One request, its answer read to the end, all within `patience`.
pub async fn call(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    patience: Duration,
) -> Reply {
    within(path, patience, async {
        let (parts, body) = send(addr, method, path, headers, body).await.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    })
    .await
}
