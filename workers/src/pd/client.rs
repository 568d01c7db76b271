//! The side channels' client: one JSON `POST` over a fresh HTTP/1.1
//! connection (hyper), for a decode simulator talking to its prefill
//! partner (NIXL's side channel, SGLang's bootstrap server). No pooling:
//! a leg makes two or three calls.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

/// How long connecting may take (real time); the exchange itself is
/// bounded by the caller.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a side-channel call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    /// No connection to the peer.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The HTTP exchange failed (the peer closed the connection, ...).
    #[error("the exchange with {addr} failed: {source}")]
    Http {
        /// `host:port`.
        addr: String,
        /// The cause.
        source: hyper::Error,
    },
    /// The request could not be built (a host that is no valid authority).
    #[error("cannot address {addr}: {source}")]
    Address {
        /// `host:port`.
        addr: String,
        /// The cause.
        source: http::Error,
    },
}

/// A peer's answer: its status and JSON body (`null` when the body is
/// not JSON).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The body.
    pub body: Value,
}

/// `host` without the brackets of an IPv6 literal (`[::1]` → `::1`).
fn unbracketed(host: &str) -> &str {
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

/// `host:port` for messages and the `Host` header (IPv6 in brackets).
pub fn authority(host: &str, port: u16) -> String {
    let host = unbracketed(host);
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `POST`s `body` to `path` at `host:port` and reads the answer.
pub async fn post_json(host: &str, port: u16, path: &str, body: &Value) -> Result<Reply, SideChannelError> {
    let addr = authority(host, port);
    let connect = TcpStream::connect((unbracketed(host), port));
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(source)) => return Err(SideChannelError::Connect { addr, source }),
        Err(_) => {
            let source = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
            return Err(SideChannelError::Connect { addr, source });
        }
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|source| SideChannelError::Http {
            addr: addr.clone(),
            source,
        })?;
    // Dropping the sender (at the end of this call) ends the connection.
    tokio::spawn(connection);
    let request = Request::post(path)
        .header(http::header::HOST, &addr)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|source| SideChannelError::Address {
            addr: addr.clone(),
            source,
        })?;
    let http = |source| SideChannelError::Http {
        addr: addr.clone(),
        source,
    };
    let response = sender.send_request(request).await.map_err(http)?;
    let status = response.status();
    let bytes = response.into_body().collect().await.map_err(http)?.to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok(Reply { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_bracket_ipv6() {
        assert_eq!(authority("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(authority("::1", 80), "[::1]:80");
        assert_eq!(authority("[::1]", 80), "[::1]:80");
        assert_eq!(authority("prefill-0", 8998), "prefill-0:8998");
    }

    #[tokio::test]
    async fn an_unreachable_peer_is_an_error() {
        // A port nobody listens on: bind, note, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let err = post_json("127.0.0.1", port, "/x", &Value::Null).await.unwrap_err();
        assert!(matches!(err, SideChannelError::Connect { .. }), "{err}");
    }
}
