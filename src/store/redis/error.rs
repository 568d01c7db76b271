//! Why a Redis store operation failed: [`StoreError`], for the
//! synchronous client ([`super::client`]) and the gateway's stores
//! ([`super::RedisRouting`], [`super::RedisWriteBack`]) alike. An outage is
//! a quick error, never a hang: see the client's failure rules.

use std::time::Duration;

use redis::RedisError;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The URL could not be parsed.
    #[error("invalid Redis URL {url:?}: {source}")]
    Url {
        /// The URL given.
        url: String,
        /// What was wrong with it.
        #[source]
        source: RedisError,
    },
    /// The credentials or certificates configured could not be read.
    #[error("Redis: {detail}")]
    Setup {
        /// What could not be read, and why.
        detail: String,
    },
    /// No connection could be opened (refused, unreachable, handshake or
    /// script loading failed).
    #[error("cannot connect to Redis: {0}")]
    Connect(#[source] RedisError),
    /// Redis did not answer within the timeout.
    #[error("Redis {op} timed out after {timeout:?}")]
    Timeout {
        /// The store operation.
        op: &'static str,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// A command failed (connection lost, or an error reply).
    #[error("Redis {op} failed: {source}")]
    Command {
        /// The store operation.
        op: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// Redis answered with something this module never writes.
    #[error("Redis {op} returned an unexpected reply: {detail}")]
    Protocol {
        /// The store operation.
        op: &'static str,
        /// What was unexpected.
        detail: String,
    },
}

impl StoreError {
    /// Whether Redis was only slow: the deadline passed (the store's own,
    /// or the client's response timeout) with the connection still good.
    pub fn is_timeout(&self) -> bool {
        match self {
            Self::Timeout { .. } => true,
            Self::Command { source, .. } => source.is_timeout(),
            _ => false,
        }
    }
}
