//! Why a Redis store operation failed: [`StoreError`], for the
//! synchronous client ([`super::client`]) and the gateway's stores
//! ([`super::RedisRouting`], [`super::RedisWriteBack`]) alike. An outage is
//! a quick error, never a hang: see the client's failure rules. A reply
//! this module never writes is a [`ReplyError`].

use std::time::Duration;

use redis::{RedisError, Value};

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
        detail: ReplyError,
    },
}

/// What was unexpected in a Redis reply (the detail of
/// [`StoreError::Protocol`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplyError {
    /// A pipeline answered fewer replies than it sent commands.
    #[error("short pipeline reply")]
    ShortPipeline,
    /// A reply that does not convert to what was asked (the client's
    /// message).
    #[error("{0}")]
    Conversion(String),
    /// The response `GET` answered neither nil nor bytes.
    #[error("GET returned {0:?}")]
    Get(Value),
    /// The affinity key's `HKEYS` answered something other than a list of
    /// fields.
    #[error("HKEYS returned {0:?}")]
    Holders(Value),
    /// An in-flight counter field that is not `req:<id>` or `tok:<id>`.
    #[error("counter field {0:?}")]
    CounterField(String),
    /// A prefix entry's field that is not a server id, or whose stamp is
    /// not a number.
    #[error("prefix entry field {field:?} = {stamp:?}")]
    EntryField {
        /// The field.
        field: String,
        /// Its value.
        stamp: String,
    },
    /// The longest-prefix script's reply is not an array.
    #[error("reply {0:?} is not an array")]
    NotArray(Value),
    /// The longest-prefix script's reply is not `id, depth, stamp` triples.
    #[error("reply length {0} is not a multiple of 3")]
    NotTriples(usize),
    /// A triple of the longest-prefix script's reply that does not parse.
    #[error("triple {0:?}")]
    Triple(Vec<Value>),
    /// The limit script's reply is not an array.
    #[error("the limit script answered {0:?}")]
    LimitReply(Vec<Value>),
    /// The limit script's reply has no integer at this index.
    #[error("the limit script's reply has {0:?} at {1}")]
    LimitValue(Option<Value>, usize),
    /// The limit script named a key by a negative index.
    #[error("a negative key index")]
    NegativeIndex,
    /// The limit script named a key (1-based) it was not given.
    #[error("key index {index} of {keys}")]
    KeyIndex {
        /// The index it named.
        index: usize,
        /// The keys it was given.
        keys: usize,
    },
    /// The limit script's status and length do not go together.
    #[error("the limit script answered {status} with {values} values")]
    LimitStatus {
        /// Its status (0, -1 or -2 when well formed).
        status: i64,
        /// The values in its reply.
        values: usize,
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
