//! Why a proxied request failed, and where the failure came from.
//!
//! Every failure the dispatcher meets on a request's way through says
//! which side caused it, as pingora classifies its errors:
//!
//! | [`Origin`] | who | examples | counts against the engine ([passive health](crate::health::PassiveHealth)) |
//! | --- | --- | --- | --- |
//! | `Client` | the downstream client | a body that cannot be read; the request's deadline spent (no head in time, or a body still streaming) | no |
//! | `Engine` | the upstream inference server | refused or reset connection, 5xx head, body cut | yes (a 5xx only once another server answered the same request) |
//! | `Gateway` | semlb itself | a server re-registered while routing, an address that is not a URI | no |
//!
//! The request's deadline (`limits.request_timeout_secs`) is the client's:
//! what outlives it is a long generation the client asked for (a huge
//! `max_tokens`, streamed or not) at least as often as a stuck engine, and
//! a stuck engine fails its active health checks. A 5xx head may be about
//! the request rather than the engine, so the proxy counts it only when
//! another server then answered the same request with a 2xx, and it stops
//! retrying once two servers answered it with a 5xx; a client that leaves
//! counts against nobody.
//!
//! and whether trying another server may help ([`Failure::retryable`]): a
//! failure before anything reached the client may be retried elsewhere; a
//! spent deadline or a body already relayed in part may not. The proxy
//! loop retries on it, passive health counts only engine failures, and the
//! logs carry both (`origin`, `retryable` fields).

use std::fmt;

use http::StatusCode;

/// Which side of the gateway a failure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The downstream client (its request or its connection).
    Client,
    /// The upstream inference server.
    Engine,
    /// The gateway itself.
    Gateway,
}

impl Origin {
    /// The name in logs: `client`, `engine`, `gateway`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Engine => "engine",
            Self::Gateway => "gateway",
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One failure of a proxied request (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The client's request body could not be read.
    #[error("could not read the request body: {detail}")]
    ClientBody {
        /// The reader's error.
        detail: String,
    },
    /// No connection to the server, or it broke before a head came.
    #[error("{address}: {detail}")]
    Connect {
        /// The server's base URL.
        address: String,
        /// The HTTP client's error and its causes.
        detail: String,
    },
    /// The server answered with a 5xx head.
    #[error("{address} answered {status}")]
    Status {
        /// The server's base URL.
        address: String,
        /// Its status.
        status: StatusCode,
    },
    /// No head came within the request's deadline.
    #[error("{address} did not answer within {secs} s")]
    Timeout {
        /// The server's base URL.
        address: String,
        /// The request timeout.
        secs: u64,
    },
    /// The answer's body was cut while being relayed.
    #[error("{address}: the answer's body was cut")]
    Body {
        /// The server's base URL.
        address: String,
    },
    /// The answer's body was still coming when the request's deadline
    /// passed.
    #[error("{address}: the answer outlived the request's deadline")]
    Deadline {
        /// The server's base URL.
        address: String,
    },
    /// The server was re-registered (removed, replaced) while the request
    /// was routed or waited.
    #[error("{address} was re-registered")]
    Reregistered {
        /// The server's base URL (`?` when it is no longer known).
        address: String,
    },
    /// The server's address does not make a request URI.
    #[error("{address}: bad address: {detail}")]
    BadAddress {
        /// The server's base URL.
        address: String,
        /// The URI parser's error.
        detail: String,
    },
}

impl Failure {
    /// Which side it came from.
    pub const fn origin(&self) -> Origin {
        match self {
            Self::ClientBody { .. } | Self::Timeout { .. } | Self::Deadline { .. } => Origin::Client,
            Self::Connect { .. } | Self::Status { .. } | Self::Body { .. } => Origin::Engine,
            Self::Reregistered { .. } | Self::BadAddress { .. } => Origin::Gateway,
        }
    }

    /// Whether another server may still answer the request: nothing was
    /// sent to the client yet and the deadline is not spent.
    pub const fn retryable(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Status { .. } | Self::Reregistered { .. } | Self::BadAddress { .. } => true,
            Self::ClientBody { .. } | Self::Timeout { .. } | Self::Body { .. } | Self::Deadline { .. } => false,
        }
    }

    /// Whether it counts against the server's passive health: the engine
    /// failed.
    pub const fn counts_against_engine(&self) -> bool {
        matches!(self.origin(), Origin::Engine)
    }
}

/// Whether an upstream request's error says the connection it went out on
/// was closed by the server before any byte of an answer: hyper's
/// "connection closed before message completed", or a reset or broken
/// pipe, anywhere in the error's source chain.
///
/// This is how a pooled keep-alive connection fails when the server closed
/// it just as the request was written: `llama-server` closes its
/// connection after every streamed answer without saying
/// `Connection: close`, and an agent's next turn, sent the instant the
/// stream ends, goes out on it; servers also close connections idle longer
/// than their keep-alive timeout (5 s for uvicorn and cpp-httplib) while the
/// gateway still holds them. The server never saw the request, so the proxy
/// sends it again on a new connection to the same server, once, and it does
/// not count against the server's health (Envoy's `reset-before-request`
/// retry; nginx retries a failed cached upstream connection likewise).
pub fn is_stale_connection(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(err) = source {
        if let Some(h) = err.downcast_ref::<hyper::Error>()
            && h.is_incomplete_message()
        {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            )
        {
            return true;
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Failure> {
        let address = "http://10.0.0.1:8000".to_owned();
        vec![
            Failure::ClientBody { detail: "reset".into() },
            Failure::Connect {
                address: address.clone(),
                detail: "connection refused".into(),
            },
            Failure::Status {
                address: address.clone(),
                status: StatusCode::SERVICE_UNAVAILABLE,
            },
            Failure::Timeout {
                address: address.clone(),
                secs: 30,
            },
            Failure::Body {
                address: address.clone(),
            },
            Failure::Deadline {
                address: address.clone(),
            },
            Failure::Reregistered {
                address: address.clone(),
            },
            Failure::BadAddress {
                address,
                detail: "invalid authority".into(),
            },
        ]
    }

    #[test]
    fn a_reset_in_the_source_chain_is_a_stale_connection_and_a_refusal_is_not() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (SendRequest)")]
        struct Outer(#[source] std::io::Error);
        use std::io::{Error, ErrorKind};
        for kind in [
            ErrorKind::ConnectionReset,
            ErrorKind::BrokenPipe,
            ErrorKind::ConnectionAborted,
        ] {
            assert!(is_stale_connection(&Outer(Error::from(kind))), "{kind:?}");
        }
        for kind in [ErrorKind::ConnectionRefused, ErrorKind::TimedOut, ErrorKind::Other] {
            assert!(!is_stale_connection(&Outer(Error::from(kind))), "{kind:?}");
        }
    }

    #[test]
    fn only_engine_failures_count_against_the_engine() {
        for f in all() {
            assert_eq!(f.counts_against_engine(), f.origin() == Origin::Engine, "{f}");
        }
        let engine: Vec<String> = all()
            .into_iter()
            .filter(Failure::counts_against_engine)
            .map(|f| f.to_string())
            .collect();
        assert_eq!(
            engine,
            [
                "http://10.0.0.1:8000: connection refused",
                "http://10.0.0.1:8000 answered 503 Service Unavailable",
                "http://10.0.0.1:8000: the answer's body was cut",
            ],
            "the request's deadline is the client's"
        );
    }

    #[test]
    fn failures_after_the_head_or_the_deadline_are_not_retried() {
        let retryable: Vec<String> = all()
            .into_iter()
            .filter(Failure::retryable)
            .map(|f| f.to_string())
            .collect();
        assert_eq!(
            retryable,
            [
                "http://10.0.0.1:8000: connection refused",
                "http://10.0.0.1:8000 answered 503 Service Unavailable",
                "http://10.0.0.1:8000 was re-registered",
                "http://10.0.0.1:8000: bad address: invalid authority",
            ]
        );
    }
}
