//! The routing state on Redis: the same prefix table, response cache and
//! in-flight counters as the shared-memory segment (`shm-layout`), kept in
//! a Redis server instead, so the gateway can be benchmarked against the
//! sLLM paper's Redis baseline (`--store redis`: [`super`], the store, builds on this module).
//!
//! # Data model
//!
//! Every key starts with the store's namespace `{ns}`, so several
//! deployments (or test runs) can share one Redis without seeing each other.
//!
//! | key | type | content | expiry |
//! | --- | --- | --- | --- |
//! | `{ns}:p:<hash, 16 hex digits>` | HASH | field = server id (hex, [`ServerId`]), value = last-refresh stamp (`now` of the insert) | the store's TTL, renewed by every insert |
//! | `{ns}:r:<key, 32 hex digits>` | STRING | XXH3-64 of the cached response (8 bytes, LE), then its bytes; a value whose checksum fails is a miss | the TTL given to [`RedisStore::put_response`] |
//! | `{ns}:if:<owner>` | HASH | one process's in-flight counts: `req:<id>` = requests, `tok:<id>` = their prompt tokens | the owner's lease ([`INFLIGHT_LEASE`]), renewed by every publication |
//! | `{ns}:written` | STRING | completion records written back so far (all response processes; for operators and tests) | none |
//! | `{ns}:horizon` | HASH | field = server id, value = its horizon (Unix ms): its fields stamped before it are not matched ([`RedisStore::raise_horizon`]) | [`HORIZON_SPAN`], renewed by every raise |
//! | `{ns}:seed` | STRING | the namespace's chain seed, 16 hex digits: every host roots its block chains in it | none |
//! | `{ns}:rl:<key, 16 hex digits>` | STRING | a rate-limit bucket's `tat` (Redis time, µs; `super::limits`) | when the bucket is full again |
//! | `{ns}:owners` | ZSET | member = owner (a process: host, pid, random), score = its lease's end (Redis time, ms) | a day after the last publication |
//!
//! In-flight counts are kept per process and published whole (absolute
//! values, not increments), so a publication that is lost or repeated
//! changes nothing for long, and a process that dies (SIGKILL, host lost)
//! stops counting when its lease ends instead of leaving its requests
//! counted forever. Readers sum the hashes of the owners whose lease has
//! not ended, in one script.
//!
//! A prefix entry keeps at most [`LANES`] servers, like a shm slot: the
//! insert script evicts the stalest field (smallest stamp, the smaller id
//! on equal stamps) when a fourth server arrives. This is done on insert, in
//! a Lua script, so the entry is never seen with more than three servers
//! and readers need no filtering. (The shm table breaks stamp ties by
//! refresh order instead; with a millisecond `now` ties are rare, and the
//! only effect is which of two equally old servers is forgotten.)
//!
//! # Semantics
//!
//! The same as [`shm_layout::PrefixTable`]: block `i`'s hash covers blocks
//! `0..=i`, so a server's match is the deepest block of the chain it is
//! listed for, scanning until the first block the table knows nothing
//! about. Two differences, both on the reading side: no liveness filter
//! here (the caller filters the returned servers), and every server seen is
//! reported, not just the deepest eight ([`shm_layout::MATCH_CAPACITY`]).
//! Results are sorted by server id.
//!
//! Servers are named by [`ServerId`]s, stable ids of their addresses, not by
//! the slots they have in one host's segment: every gateway host sharing a
//! namespace names a backend alike, whatever order it lists them in.
//!
//! # Round trips (what each operation costs)
//!
//! A round trip (request out, reply back) is the unit of cost on Redis: on
//! loopback it is tens of microseconds, on a network hundreds, against a
//! few hundred nanoseconds for a whole shm lookup. [`RedisStore::round_trips`]
//! counts them.
//!
//! | operation | round trips | why |
//! | --- | --- | --- |
//! | [`RedisStore::insert_chain`] | 1 | one `EVALSHA` whose script runs `HSET` + cap + `PEXPIRE` for every block of the chain |
//! | [`RedisStore::longest_prefix_match`] | 1 | one `EVALSHA` whose script walks the chain keys in order and stops at the first missing one |
//! | [`RedisStore::longest_prefix_match_naive`] | matched blocks + 1 (at most the chain length) | the paper's baseline: one `HGETALL` per block until the first miss; each depends on the previous answer |
//! | [`RedisStore::get_response`] / [`RedisStore::put_response`] | 1 | `GET` / `SET … PX` |
//! | [`RedisStore::write_back`] | 1 | a pipeline: one insert `EVALSHA` per record, one `SET … PX` per cached response |
//! | [`RedisStore::begin_request`] / [`RedisStore::end_request`] | 1 | one `EVALSHA` publishing this process's counts (`DEL`, `HSET`, `PEXPIRE`, `ZADD`) |
//! | [`RedisStore::inflight`] / [`RedisStore::inflight_load`] | 1 | one `EVALSHA` summing the live owners' hashes |
//!
//! A script runs atomically (no other command interleaves), but Redis does
//! not roll back: if one key of a chain holds a foreign type, the blocks
//! before it are recorded and the call returns an error.
//!
//! Scripts are loaded (`SCRIPT LOAD`) once per connection, when it is
//! opened; a `NOSCRIPT` reply (the server restarted or ran `SCRIPT FLUSH`)
//! costs two more round trips: reload, retry. The prefix and publication
//! scripts touch only keys passed in `KEYS`; the in-flight sum reads the
//! owner hashes it finds in the owner set, so it needs a single Redis (or a
//! hash tag on the namespace); this module does not use cluster mode.
//!
//! # Failures
//!
//! Connecting, reading and writing all have a timeout
//! ([`DEFAULT_TIMEOUT`] unless [`RedisStore::connect_with_timeout`] says
//! otherwise), so an outage is a quick [`StoreError`], never a hang. After
//! an I/O error, a timeout or an unparsable reply the connection is dropped
//! (it may still carry a stale reply); the next call opens a new one, so the
//! store recovers by itself when Redis comes back. An error reply (`ERR`,
//! `WRONGTYPE`, `NOSCRIPT`) keeps the connection. Nothing here panics on a
//! Redis error or an unexpected reply.

use std::time::Duration;

use redis::{Cmd, Connection, ErrorKind, FromRedisValue, RedisError, Script, Value};

pub(crate) use super::scripts::{INSERT_SCRIPT, LPM_SCRIPT, PUBLISH_SCRIPT, RAISE_SCRIPT, SUM_SCRIPT};
pub use super::server_id::ServerId;
use super::server_id::{id_field, parse_id};

/// Servers remembered per prefix entry (as in the shm table).
pub const LANES: usize = shm_layout::prefix_table::LANES;

/// Connect, read and write timeout of [`RedisStore::connect`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);

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

/// Records that `server` holds `depth` (1-based) leading blocks, keeping
/// the deepest depth per server.
fn record(found: &mut Vec<(ServerId, u32)>, server: ServerId, depth: u32) {
    match found.iter_mut().find(|(s, _)| *s == server) {
        Some(e) => e.1 = e.1.max(depth),
        None => found.push((server, depth)),
    }
}

/// How long a server's horizon is kept ([`shm_layout::HORIZON_SPAN_S`]).
pub const HORIZON_SPAN: Duration = Duration::from_secs(shm_layout::HORIZON_SPAN_S);

/// How long a process's published in-flight counts stay counted without
/// being published again (a dispatcher republishes every third of it).
pub const INFLIGHT_LEASE: Duration = Duration::from_secs(15);

/// A unique name for this process as an in-flight owner: host, pid and a
/// random part (a restarted process with a reused pid is another owner).
pub fn owner_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let random = seahash::hash(&[nanos.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat());
    format!(
        "{}:{}:{:08x}",
        if host.is_empty() { "host" } else { host },
        std::process::id(),
        random as u32
    )
}

/// The publication arguments of `counts` (server → requests, tokens):
/// owner, lease, then `req:<id>`, n, `tok:<id>`, n per server.
pub(crate) fn publish_args(owner: &str, counts: impl IntoIterator<Item = (ServerId, i64, i64)>) -> Vec<String> {
    let mut args = vec![owner.to_owned(), millis(INFLIGHT_LEASE).to_string()];
    for (server, requests, tokens) in counts {
        let id = id_field(server);
        args.extend([
            format!("req:{id}"),
            requests.to_string(),
            format!("tok:{id}"),
            tokens.to_string(),
        ]);
    }
    args
}

/// Parses a [`SUM_SCRIPT`] reply into per-server figures sorted by id.
pub(crate) fn parse_inflight(reply: &Value) -> Result<Vec<InflightLoad>, String> {
    let flat: Vec<(String, i64)> = FromRedisValue::from_redis_value(reply).map_err(|e| e.to_string())?;
    let mut out: Vec<InflightLoad> = Vec::new();
    for (field, n) in flat {
        let (kind, server) = field
            .split_once(':')
            .and_then(|(kind, id)| parse_id(id).map(|s| (kind, s)))
            .ok_or_else(|| format!("counter field {field:?}"))?;
        let i = match out.iter().position(|l| l.server == server) {
            Some(i) => i,
            None => {
                out.push(InflightLoad {
                    server,
                    requests: 0,
                    tokens: 0,
                });
                out.len() - 1
            }
        };
        match kind {
            "req" => out[i].requests = n,
            "tok" => out[i].tokens = n,
            _ => return Err(format!("counter field {field:?}")),
        }
    }
    out.sort_unstable_by_key(|l| l.server);
    Ok(out)
}

/// `(server, leading blocks held)` per server.
type Depths = Vec<(ServerId, u32)>;
/// `(server, stamp)` per server.
type Stamps = Vec<(ServerId, u64)>;

/// Parses a [`LPM_SCRIPT`] reply into `(server, depth)` pairs and
/// `(server, stamp of its deepest field)` pairs, both sorted by server.
pub(crate) fn parse_lpm(reply: &Value) -> Result<(Depths, Stamps), String> {
    let Value::Array(flat) = reply else {
        return Err(format!("reply {reply:?} is not an array"));
    };
    if !flat.len().is_multiple_of(3) {
        return Err(format!("reply length {} is not a multiple of 3", flat.len()));
    }
    let mut found = Vec::with_capacity(flat.len() / 3);
    let mut stamps = Vec::with_capacity(flat.len() / 3);
    for triple in flat.chunks_exact(3) {
        let id = String::from_redis_value(&triple[0]).ok();
        match (
            id.as_deref().and_then(parse_id),
            i64::from_redis_value(&triple[1])
                .ok()
                .and_then(|d| u32::try_from(d).ok()),
            i64::from_redis_value(&triple[2])
                .ok()
                .and_then(|s| u64::try_from(s).ok()),
        ) {
            (Some(server), Some(depth), Some(stamp)) if depth >= 1 => {
                record(&mut found, server, depth);
                stamps.push((server, stamp));
            }
            _ => return Err(format!("triple {triple:?}")),
        }
    }
    found.sort_unstable();
    stamps.sort_unstable();
    stamps.dedup_by_key(|(server, _)| *server);
    Ok((found, stamps))
}

/// What a dispatcher's lookup reads from Redis ([`RedisStore::dispatch_lookup`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DispatchLookup {
    /// The cached response, if one was asked for and is present.
    pub response: Option<Vec<u8>>,
    /// `(server, leading blocks held)` per server, sorted by server.
    pub prefix: Vec<(ServerId, u32)>,
    /// `(server, stamp)`: when each server of [`prefix`](Self::prefix) last
    /// refreshed its deepest entry (Unix ms; empty for a naive match).
    pub refreshed: Vec<(ServerId, u64)>,
    /// In-flight figures per server over every live owner, sorted by server.
    pub loads: Vec<InflightLoad>,
}

/// The one-round-trip pipeline of a dispatcher's lookup: `GET` of the
/// response (when `response_key` is given), the in-flight sum script, and
/// (when `scripted` and the chain is not empty) the longest-prefix script.
pub(crate) fn lookup_pipeline(
    namespace: &str,
    lpm_hash: &str,
    sum_hash: &str,
    response_key: Option<u128>,
    chain: &[u64],
    scripted: bool,
) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    if let Some(key) = response_key {
        pipe.cmd("GET").arg(format!("{namespace}:r:{key:032x}"));
    }
    pipe.cmd("EVALSHA")
        .arg(sum_hash)
        .arg(1)
        .arg(format!("{namespace}:owners"))
        .arg(format!("{namespace}:if:"));
    let chain = &chain[..chain.len().min(MAX_LOOKUP_BLOCKS)];
    if scripted && !chain.is_empty() {
        let cmd = pipe
            .cmd("EVALSHA")
            .arg(lpm_hash)
            .arg(chain.len() + 1)
            .arg(format!("{namespace}:horizon"));
        for hash in chain {
            cmd.arg(format!("{namespace}:p:{hash:016x}"));
        }
    }
    pipe
}

/// Parses the replies of a [`lookup_pipeline`] (the prefix stays empty
/// when it was not scripted).
pub(crate) fn parse_lookup(replies: Vec<Value>, asked_response: bool) -> Result<DispatchLookup, String> {
    let mut replies = replies.into_iter();
    let mut next = || replies.next().ok_or_else(|| "short pipeline reply".to_owned());
    let response = if asked_response {
        match next()? {
            Value::Nil => None,
            Value::BulkString(b) => unsealed(b),
            other => return Err(format!("GET returned {other:?}")),
        }
    } else {
        None
    };
    let loads = parse_inflight(&next()?)?;
    let (prefix, refreshed) = match replies.next() {
        Some(reply) => parse_lpm(&reply)?,
        None => Default::default(),
    };
    Ok(DispatchLookup {
        response,
        prefix,
        refreshed,
        loads,
    })
}

/// Bytes of the checksum a cached response carries in Redis.
const CHECKSUM_BYTES: usize = 8;

/// A cached response as Redis stores it: an XXH3-64 of the body, then the
/// body, so that a value changed in Redis (by another writer of the
/// namespace, a bit flip, a truncation) is found out on read.
pub(crate) fn sealed(body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(CHECKSUM_BYTES + body.len());
    v.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(body).to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// The body of a [`sealed`] value whose checksum holds; `None` otherwise
/// (a miss: the entry is not trusted).
pub(crate) fn unsealed(mut value: Vec<u8>) -> Option<Vec<u8>> {
    let sum: [u8; CHECKSUM_BYTES] = value.get(..CHECKSUM_BYTES)?.try_into().ok()?;
    if u64::from_le_bytes(sum) != xxhash_rust::xxh3::xxh3_64(&value[CHECKSUM_BYTES..]) {
        return None;
    }
    value.drain(..CHECKSUM_BYTES);
    Some(value)
}

/// Most blocks of a chain a lookup sends to Redis: the leading blocks route
/// a request, and a longer chain (a prompt of millions of tokens) would
/// make one script call block Redis for every host. 4096 blocks are 65 536
/// tokens at the default block size.
pub const MAX_LOOKUP_BLOCKS: usize = 4096;

/// One record of a [`RedisStore::write_back`] batch.
#[derive(Debug, Clone, Copy)]
pub struct WriteItem<'a> {
    /// The server that holds the blocks.
    pub server: ServerId,
    /// Block hashes to insert (or refresh) for it.
    pub blocks: &'a [u64],
    /// A response to cache: key, body, TTL.
    pub response: Option<(u128, &'a [u8], Duration)>,
}

/// The routing state in one Redis server, under one namespace.
///
/// One connection, used synchronously; open one store per thread.
pub struct RedisStore {
    client: redis::Client,
    conn: Option<Connection>,
    namespace: String,
    ttl: Duration,
    timeout: Duration,
    insert: Script,
    lpm: Script,
    publish: Script,
    sum: Script,
    owner: String,
    /// This process's in-flight counts: (server, requests, tokens).
    counts: Vec<(ServerId, i64, i64)>,
    round_trips: u64,
    connects: u64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("namespace", &self.namespace)
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .field("connected", &self.conn.is_some())
            .field("round_trips", &self.round_trips)
            .field("connects", &self.connects)
            .finish()
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port/db`), with prefix entries
    /// expiring `ttl` after their last insert (at least 1 ms) and
    /// [`DEFAULT_TIMEOUT`] on connect, read and write.
    pub fn connect(url: &str, namespace: &str, ttl: Duration) -> Result<Self, StoreError> {
        Self::connect_with_timeout(url, namespace, ttl, DEFAULT_TIMEOUT)
    }

    /// [`RedisStore::connect`] with another timeout (at least 1 ms).
    pub fn connect_with_timeout(
        url: &str,
        namespace: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|source| StoreError::Url {
            url: super::url::redacted(url),
            source,
        })?;
        Self::with_client(client, namespace, ttl, timeout)
    }

    /// [`RedisStore::connect_with_timeout`] through `client` (made with
    /// credentials and certificates: [`super::credentials::client`]).
    pub fn with_client(
        client: redis::Client,
        namespace: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let mut store = Self {
            client,
            conn: None,
            namespace: namespace.to_owned(),
            ttl,
            timeout: timeout.max(Duration::from_millis(1)),
            insert: Script::new(INSERT_SCRIPT),
            lpm: Script::new(LPM_SCRIPT),
            publish: Script::new(PUBLISH_SCRIPT),
            sum: Script::new(SUM_SCRIPT),
            owner: owner_id(),
            counts: Vec::new(),
            round_trips: 0,
            connects: 0,
        };
        store.connection()?;
        Ok(store)
    }

    /// The namespace every key starts with.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Round trips made so far (commands or pipelines sent and answered,
    /// script reloads included; connection handshakes not).
    pub fn round_trips(&self) -> u64 {
        self.round_trips
    }

    /// Connections opened so far (1 after [`RedisStore::connect`]; one more
    /// per recovery from a failure).
    pub fn connects(&self) -> u64 {
        self.connects
    }

    /// Whether a connection is open (false after an error, until the next
    /// call reconnects).
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// The key of prefix entry `hash`.
    pub fn prefix_key(&self, hash: u64) -> String {
        format!("{}:p:{hash:016x}", self.namespace)
    }

    /// The key of cached response `key`.
    pub fn response_key(&self, key: u128) -> String {
        format!("{}:r:{key:032x}", self.namespace)
    }

    /// The key of the owner set (in-flight publishers and their leases).
    pub fn owners_key(&self) -> String {
        format!("{}:owners", self.namespace)
    }

    /// The key prefix of the owners' in-flight hashes (`<prefix><owner>`).
    pub fn inflight_prefix(&self) -> String {
        format!("{}:if:", self.namespace)
    }

    /// The key of the records-written counter.
    pub fn written_key(&self) -> String {
        format!("{}:written", self.namespace)
    }

    /// This store's name as an in-flight owner.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The open connection, opening one (and loading the scripts) if none is.
    fn connection(&mut self) -> Result<&mut Connection, StoreError> {
        let conn = match self.conn.take() {
            Some(conn) => conn,
            None => {
                let mut conn = self
                    .client
                    .get_connection_with_timeout(self.timeout)
                    .map_err(StoreError::Connect)?;
                conn.set_read_timeout(Some(self.timeout))
                    .and_then(|()| conn.set_write_timeout(Some(self.timeout)))
                    .map_err(StoreError::Connect)?;
                for script in [&self.insert, &self.lpm, &self.publish, &self.sum] {
                    script.load(&mut conn).map_err(StoreError::Connect)?;
                }
                self.connects += 1;
                conn
            }
        };
        Ok(self.conn.insert(conn))
    }

    fn fail(&mut self, op: &'static str, source: RedisError) -> StoreError {
        // An error reply leaves the connection in step; anything else (I/O,
        // timeout, unparsable reply) may leave a stale reply in flight:
        // never reuse such a connection.
        let in_step = matches!(
            source.kind(),
            ErrorKind::ResponseError
                | ErrorKind::ExtensionError
                | ErrorKind::NoScriptError
                | ErrorKind::TypeError
                | ErrorKind::ExecAbortError
                | ErrorKind::BusyLoadingError
                | ErrorKind::ReadOnly
        ) && !source.is_io_error()
            && !source.is_timeout();
        if !in_step {
            self.conn = None;
        }
        if source.is_timeout() {
            StoreError::Timeout {
                op,
                timeout: self.timeout,
            }
        } else {
            StoreError::Command { op, source }
        }
    }

    /// Sends `cmd` (one round trip) and converts the reply.
    fn query<T: FromRedisValue>(&mut self, op: &'static str, cmd: &Cmd) -> Result<T, StoreError> {
        let conn = self.connection()?;
        let reply = cmd.query(conn);
        self.round_trips += 1;
        reply.map_err(|e| self.fail(op, e))
    }

    fn script(&self, which: ScriptId) -> &Script {
        match which {
            ScriptId::Insert => &self.insert,
            ScriptId::Lpm => &self.lpm,
            ScriptId::Publish => &self.publish,
            ScriptId::Sum => &self.sum,
        }
    }

    /// Runs `script` over `keys` with `args`: one `EVALSHA`, plus a reload
    /// and a retry on `NOSCRIPT`.
    fn eval(
        &mut self,
        op: &'static str,
        which: ScriptId,
        keys: &[String],
        args: &[String],
    ) -> Result<Value, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script(which).get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        match self.query::<Value>(op, &cmd) {
            Err(StoreError::Command { source, .. }) if source.kind() == ErrorKind::NoScriptError => {
                // Rare (server restart, SCRIPT FLUSH): the clone is fine here.
                let script = self.script(which).clone();
                let conn = self.connection()?;
                let loaded = script.load(conn);
                self.round_trips += 1;
                loaded.map_err(|e| self.fail(op, e))?;
                self.query(op, &cmd)
            }
            other => other,
        }
    }

    /// Records that `server` holds every prefix of `chain`, as of `now`
    /// (any increasing clock; milliseconds keep ties rare), and renews the
    /// entries' TTL. One round trip.
    pub fn insert_chain(&mut self, chain: &[u64], server: ServerId, now: u64) -> Result<(), StoreError> {
        if chain.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = chain.iter().map(|h| self.prefix_key(*h)).collect();
        let args = [
            id_field(server),
            now.to_string(),
            millis(self.ttl).to_string(),
            LANES.to_string(),
        ];
        self.eval("insert_chain", ScriptId::Insert, &keys, &args).map(drop)
    }

    /// Records that `server` holds the prefix `hash` (a one-block
    /// [`RedisStore::insert_chain`]).
    pub fn insert(&mut self, hash: u64, server: ServerId, now: u64) -> Result<(), StoreError> {
        self.insert_chain(&[hash], server, now)
    }

    /// The servers of entry `hash` with their stamps, most recent first
    /// (equal stamps: smaller id first). Empty if there is no entry.
    pub fn lookup(&mut self, hash: u64) -> Result<Vec<(ServerId, u64)>, StoreError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(self.prefix_key(hash));
        let fields: Vec<(String, String)> = self.query("lookup", &cmd)?;
        let mut out = Vec::with_capacity(fields.len());
        for (field, stamp) in fields {
            match (parse_id(&field), stamp.parse::<u64>()) {
                (Some(server), Ok(stamp)) => out.push((server, stamp)),
                _ => {
                    return Err(StoreError::Protocol {
                        op: "lookup",
                        detail: format!("prefix entry field {field:?} = {stamp:?}"),
                    });
                }
            }
        }
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        Ok(out)
    }

    /// Longest-prefix match: for every server listed in the leading known
    /// blocks of `chain`, `(server, leading blocks held)`, sorted by server.
    /// One round trip (a server-side script walks the chain).
    pub fn longest_prefix_match(&mut self, chain: &[u64]) -> Result<Vec<(ServerId, u32)>, StoreError> {
        const OP: &str = "longest_prefix_match";
        if chain.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = std::iter::once(format!("{}:horizon", self.namespace))
            .chain(chain.iter().map(|h| self.prefix_key(*h)))
            .collect();
        let reply = self.eval(OP, ScriptId::Lpm, &keys, &[])?;
        parse_lpm(&reply)
            .map(|(found, _)| found)
            .map_err(|detail| StoreError::Protocol { op: OP, detail })
    }

    /// Sets `server`'s horizon to `at_ms` (Unix ms) if that is later
    /// than the one it has: its fields stamped before it are not matched
    /// any more (its engine was seen to evict them; see
    /// [`crate::responder`]). Returns whether it moved. The naive match
    /// (the paper's baseline) does not read horizons.
    pub fn raise_horizon(&mut self, server: ServerId, at_ms: u64) -> Result<bool, StoreError> {
        const OP: &str = "raise_horizon";
        let key = format!("{}:horizon", self.namespace);
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(RAISE_SCRIPT)
            .arg(1)
            .arg(key)
            .arg(id_field(server))
            .arg(at_ms)
            .arg(millis(HORIZON_SPAN));
        let moved: i64 = self.query(OP, &cmd)?;
        Ok(moved == 1)
    }

    /// [`RedisStore::longest_prefix_match`] the way the sLLM paper's
    /// baseline does it: one `HGETALL` round trip per block, until the
    /// first missing block. Same result.
    pub fn longest_prefix_match_naive(&mut self, chain: &[u64]) -> Result<Vec<(ServerId, u32)>, StoreError> {
        const OP: &str = "longest_prefix_match_naive";
        let mut found = Vec::new();
        for (i, hash) in chain.iter().enumerate() {
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(self.prefix_key(*hash));
            let fields: Vec<(String, String)> = self.query(OP, &cmd)?;
            if fields.is_empty() {
                break;
            }
            for (field, _) in fields {
                // Skip what this module never writes, like the script does.
                if let Some(server) = parse_id(&field) {
                    record(&mut found, server, i as u32 + 1);
                }
            }
        }
        found.sort_unstable();
        Ok(found)
    }

    /// Forgets `server` in every prefix entry of the namespace
    /// (its engine lost its cache); returns how many listed it. A `SCAN`
    /// of the prefix keys, 1 000 at a time, each batch's `HDEL`s in one
    /// pipeline: a rare operation, not one for the request path.
    pub fn forget_server(&mut self, server: ServerId) -> Result<u64, StoreError> {
        const OP: &str = "forget_server";
        let pattern = format!("{}:p:*", self.namespace);
        let mut cursor = 0u64;
        let mut removed = 0u64;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000);
            let (next, keys): (u64, Vec<String>) = self.query(OP, &scan)?;
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("HDEL").arg(key).arg(id_field(server));
                }
                let conn = self.connection()?;
                let counts: Result<Vec<u64>, RedisError> = pipe.query(conn);
                self.round_trips += 1;
                removed += counts.map_err(|e| self.fail(OP, e))?.iter().sum::<u64>();
            }
            if next == 0 {
                return Ok(removed);
            }
            cursor = next;
        }
    }

    /// The cached response for `key`, if present and not expired. One round trip.
    pub fn get_response(&mut self, key: u128) -> Result<Option<Vec<u8>>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.response_key(key));
        let value: Option<Vec<u8>> = self.query("get_response", &cmd)?;
        Ok(value.and_then(unsealed))
    }

    /// Caches `value` under `key` for `ttl` (at least 1 ms). One round trip.
    pub fn put_response(&mut self, key: u128, value: &[u8], ttl: Duration) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.response_key(key))
            .arg(sealed(value))
            .arg("PX")
            .arg(millis(ttl));
        self.query::<()>("put_response", &cmd)
    }

    /// Everything a dispatcher reads for one decision, in one round trip
    /// (the gateway's lookup, [`crate::store::redis::RedisRouting`], sends
    /// the same pipeline): the response under `response_key`, the in-flight
    /// figures and the longest-prefix match of `chain`. With `naive`, the
    /// match is then walked one round trip per block instead.
    pub fn dispatch_lookup(
        &mut self,
        response_key: Option<u128>,
        chain: &[u64],
        naive: bool,
    ) -> Result<DispatchLookup, StoreError> {
        const OP: &str = "dispatch_lookup";
        let pipe = lookup_pipeline(
            &self.namespace,
            self.lpm.get_hash(),
            self.sum.get_hash(),
            response_key,
            chain,
            !naive,
        );
        let mut sent = 0;
        let replies: Vec<Value> = loop {
            let conn = self.connection()?;
            let reply = pipe.query(conn);
            self.round_trips += 1;
            sent += 1;
            match reply {
                Err(e) if sent == 1 && e.kind() == ErrorKind::NoScriptError => {
                    for script in [self.lpm.clone(), self.sum.clone()] {
                        let conn = self.connection()?;
                        let loaded = script.load(conn);
                        self.round_trips += 1;
                        loaded.map_err(|e| self.fail(OP, e))?;
                    }
                }
                other => break other.map_err(|e| self.fail(OP, e))?,
            }
        };
        let mut lookup =
            parse_lookup(replies, response_key.is_some()).map_err(|detail| StoreError::Protocol { op: OP, detail })?;
        if naive {
            lookup.prefix = self.longest_prefix_match_naive(chain)?;
        }
        Ok(lookup)
    }

    /// Writes a batch of learned records in one round trip: a pipeline of
    /// one insert script per record (its blocks for its server, at `now`)
    /// and one `SET … PX` per cached response, then `INCRBY {ns}:written
    /// records` (the completion records the items come from). A `NOSCRIPT`
    /// reply reloads the script and sends the batch again (inserts are
    /// idempotent; the counter is bumped by the last command, so only once).
    pub fn write_back(&mut self, items: &[WriteItem<'_>], records: u64, now: u64) -> Result<(), StoreError> {
        const OP: &str = "write_back";
        if items.is_empty() && records == 0 {
            return Ok(());
        }
        let ttl = millis(self.ttl).to_string();
        let lanes = LANES.to_string();
        let now = now.to_string();
        // Redis runs every command of a pipeline even when one fails, so a
        // resend after `NOSCRIPT` must not bump the counter again.
        let build = |count: u64| {
            let mut pipe = redis::pipe();
            for item in items {
                if !item.blocks.is_empty() {
                    let cmd = pipe.cmd("EVALSHA").arg(self.insert.get_hash()).arg(item.blocks.len());
                    for hash in item.blocks {
                        cmd.arg(self.prefix_key(*hash));
                    }
                    cmd.arg(id_field(item.server)).arg(&now).arg(&ttl).arg(&lanes).ignore();
                }
                if let Some((key, body, ttl)) = item.response {
                    pipe.cmd("SET")
                        .arg(self.response_key(key))
                        .arg(sealed(body))
                        .arg("PX")
                        .arg(millis(ttl))
                        .ignore();
                }
            }
            if count > 0 {
                pipe.cmd("INCRBY").arg(self.written_key()).arg(count).ignore();
            }
            pipe
        };
        let (pipe, resend) = (build(records), build(0));
        let conn = self.connection()?;
        let reply: Result<(), RedisError> = pipe.query(conn);
        self.round_trips += 1;
        match reply {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                let script = self.insert.clone();
                let conn = self.connection()?;
                let loaded = script.load(conn);
                self.round_trips += 1;
                loaded.map_err(|e| self.fail(OP, e))?;
                let conn = self.connection()?;
                let reply: Result<(), RedisError> = resend.query(conn);
                self.round_trips += 1;
                reply.map_err(|e| self.fail(OP, e))
            }
            Err(e) => Err(self.fail(OP, e)),
        }
    }

    /// Adds to this store's in-flight counts of `server` and publishes
    /// them all; returns this store's requests in flight to it.
    fn add_inflight(
        &mut self,
        op: &'static str,
        server: ServerId,
        requests: i64,
        tokens: i64,
    ) -> Result<i64, StoreError> {
        let i = match self.counts.iter().position(|c| c.0 == server) {
            Some(i) => i,
            None => {
                self.counts.push((server, 0, 0));
                self.counts.len() - 1
            }
        };
        self.counts[i].1 += requests;
        self.counts[i].2 += tokens;
        let mine = self.counts[i].1;
        let keys = [format!("{}{}", self.inflight_prefix(), self.owner), self.owners_key()];
        let args = publish_args(
            &self.owner,
            self.counts.iter().copied().filter(|&(_, r, t)| r != 0 || t != 0),
        );
        self.eval(op, ScriptId::Publish, &keys, &args).map(|_| mine)
    }

    /// Counts a request of `prompt_tokens` tokens as in flight on
    /// `server` and publishes this store's counts; returns this store's
    /// requests in flight to that server. One round trip.
    pub fn begin_request(&mut self, server: ServerId, prompt_tokens: u32) -> Result<i64, StoreError> {
        self.add_inflight("begin_request", server, 1, i64::from(prompt_tokens))
    }

    /// Undoes [`RedisStore::begin_request`] when the request finishes. One
    /// round trip. (Counts are not clamped: an unmatched end shows as a
    /// negative count.)
    pub fn end_request(&mut self, server: ServerId, prompt_tokens: u32) -> Result<i64, StoreError> {
        self.add_inflight("end_request", server, -1, -i64::from(prompt_tokens))
    }

    /// In-flight requests per server over every live owner, sorted by id
    /// (servers never counted are absent). One round trip.
    pub fn inflight(&mut self) -> Result<Vec<(ServerId, i64)>, StoreError> {
        Ok(self
            .inflight_load()?
            .into_iter()
            .map(|l| (l.server, l.requests))
            .collect())
    }

    /// In-flight requests and prompt tokens per server over every live
    /// owner, sorted by id. One round trip.
    pub fn inflight_load(&mut self) -> Result<Vec<InflightLoad>, StoreError> {
        const OP: &str = "inflight";
        let reply = self.eval(OP, ScriptId::Sum, &[self.owners_key()], &[self.inflight_prefix()])?;
        parse_inflight(&reply).map_err(|detail| StoreError::Protocol { op: OP, detail })
    }
}

#[derive(Debug, Clone, Copy)]
enum ScriptId {
    Insert,
    Lpm,
    Publish,
    Sum,
}

/// One server's in-flight figures, as [`RedisStore::inflight_load`] reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InflightLoad {
    /// The server.
    pub server: ServerId,
    /// Requests in flight.
    pub requests: i64,
    /// Prompt tokens of those requests.
    pub tokens: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_namespace_and_fixed_width_hex() {
        let store = RedisStore {
            client: redis::Client::open("redis://127.0.0.1:1").unwrap(),
            conn: None,
            namespace: "ns".into(),
            ttl: Duration::from_secs(1),
            timeout: DEFAULT_TIMEOUT,
            insert: Script::new(INSERT_SCRIPT),
            lpm: Script::new(LPM_SCRIPT),
            publish: Script::new(PUBLISH_SCRIPT),
            sum: Script::new(SUM_SCRIPT),
            owner: owner_id(),
            counts: Vec::new(),
            round_trips: 0,
            connects: 0,
        };
        assert_eq!(store.prefix_key(0xab), "ns:p:00000000000000ab");
        assert_eq!(store.response_key(1), format!("ns:r:{}1", "0".repeat(31)));
        assert_eq!(store.owners_key(), "ns:owners");
        assert_eq!(store.inflight_prefix(), "ns:if:");
        assert_ne!(owner_id(), owner_id(), "owners are unique");
    }

    #[test]
    fn a_lookup_sends_at_most_the_leading_blocks() {
        let keys_sent = |blocks: usize| {
            let chain: Vec<u64> = (0..blocks as u64).collect();
            let pipe = lookup_pipeline("ns", "lpm", "sum", None, &chain, true);
            let lpm = pipe.cmd_iter().nth(1).expect("the prefix script");
            lpm.args_iter()
                .filter(|a| matches!(a, redis::Arg::Simple(k) if k.starts_with(b"ns:p:")))
                .count()
        };
        assert_eq!(keys_sent(10), 10);
        assert_eq!(keys_sent(MAX_LOOKUP_BLOCKS), MAX_LOOKUP_BLOCKS);
        assert_eq!(keys_sent(MAX_LOOKUP_BLOCKS * 100), MAX_LOOKUP_BLOCKS);
    }

    #[test]
    fn a_sealed_response_reads_back_and_a_changed_one_does_not() {
        let body = br#"{"id":"cmpl-1","choices":[]}"#;
        let v = sealed(body);
        assert_eq!(unsealed(v.clone()).as_deref(), Some(&body[..]));
        for i in 0..v.len() {
            let mut flipped = v.clone();
            flipped[i] ^= 0x10;
            assert_eq!(unsealed(flipped), None, "a flip at byte {i}");
        }
        assert_eq!(unsealed(v[..v.len() - 1].to_vec()), None, "truncated");
        assert_eq!(unsealed(body[..7].to_vec()), None, "shorter than a checksum");
        assert_eq!(unsealed(sealed(b"")), Some(Vec::new()));
    }

    #[test]
    fn record_keeps_the_deepest_depth() {
        let mut m = Vec::new();
        record(&mut m, 3, 1);
        record(&mut m, 3, 4);
        record(&mut m, 1, 2);
        assert_eq!(m, vec![(3, 4), (1, 2)]);
    }

    #[test]
    fn connect_to_a_closed_port_is_a_quick_error() {
        let t = std::time::Instant::now();
        let err = RedisStore::connect("redis://127.0.0.1:1", "ns", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, StoreError::Connect(_)), "{err}");
        assert!(t.elapsed() < Duration::from_secs(2));
        let err = RedisStore::connect("not a url", "ns", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, StoreError::Url { .. }), "{err}");
    }
}
