//! A blocking HTTP/1.1 client on one keep-alive connection, as agents'
//! clients are: the next request goes on the same connection the instant
//! the previous answer ends, and a new connection is made only when the
//! server said `connection: close` (or closed it after an answer). A
//! request that fails on a connection is not retried: the caller sees it.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// One answer, read to the end.
#[derive(Debug)]
pub struct Answer {
    /// Its status.
    pub status: u16,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its whole body.
    pub body: Bytes,
}

/// A client of one server on one keep-alive connection at a time.
pub struct KeepAlive {
    runtime: tokio::runtime::Runtime,
    addr: SocketAddr,
    sender: Option<SendRequest<Full<Bytes>>>,
    /// Connections made so far.
    pub connections: usize,
}

impl KeepAlive {
    /// A client of `addr` (`host:port`); it connects on the first request.
    pub fn new(addr: &str) -> KeepAlive {
        KeepAlive {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime"),
            addr: addr.parse().expect("a socket address"),
            sender: None,
            connections: 0,
        }
    }

    /// POSTs `body` (JSON) to `path` with `headers` and reads the answer.
    pub fn post(&mut self, path: &str, body: &str, headers: &[(&str, &str)]) -> Result<Answer, String> {
        let KeepAlive {
            runtime,
            addr,
            sender,
            connections,
        } = self;
        runtime.block_on(async {
            if sender.as_ref().is_none_or(SendRequest::is_closed) {
                let stream = TcpStream::connect(*addr).await.map_err(|e| format!("connect: {e}"))?;
                let _ = stream.set_nodelay(true);
                let (s, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("handshake: {e}"))?;
                tokio::spawn(async move {
                    let _ = connection.await;
                });
                *sender = Some(s);
                *connections += 1;
            }
            let s = sender.as_mut().expect("connected");
            s.ready().await.map_err(|e| format!("connection not ready: {e}"))?;
            let mut request = Request::post(path)
                .header("host", addr.to_string())
                .header("content-type", "application/json");
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            let request = request
                .body(Full::new(Bytes::from(body.to_owned())))
                .map_err(|e| e.to_string())?;
            let response = s.send_request(request).await.map_err(|e| format!("send: {e}"))?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| format!("body: {e}"))?.to_bytes();
            let close = parts
                .headers
                .get(http::header::CONNECTION)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            if close {
                *sender = None;
            }
            Ok(Answer {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        })
    }
}
