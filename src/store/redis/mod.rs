//! The routing state in Redis (`--store redis`): what a good Redis user
//! does, on the [`client`] data model.
//!
//! Hosts on one namespace share it: chains are rooted in the namespace's
//! seed (`{ns}:seed`, `namespace_seed`) and servers are named by stable
//! ids of their addresses ([`client::ServerId`], mapped to this host's
//! slots through its server table), so a prefix learned on one host
//! routes on another.
//!
//! How a process connects (URL, password from a file or the environment,
//! TLS with a private CA) is [`credentials`]; [`url`] keeps passwords out
//! of logs and command lines; [`server_id`] names servers.
//!
//! # Dispatcher side: [`RedisRouting`]
//!
//! - One multiplexed connection per dispatcher process (requests from all
//!   of its connections are pipelined on it), opened lazily, replaced after
//!   any failure. Scripts are loaded when it opens.
//! - A lookup is **one round trip**: a pipeline of the response `GET` (when
//!   the request may be answered from the cache), the in-flight sum script
//!   and the longest-prefix script. With `lookup = "naive"` the prefix is
//!   then walked one `HGETALL` per block, as the sLLM paper's baseline.
//!   A prompt that carries an earlier answer and matches some server costs
//!   one more round trip: the `HKEYS` of its end-key probes
//!   ([`crate::prefix::continuation`]).
//! - Learning at dispatch ([`RoutingStore::record_route`]) sends the
//!   write-back's insert script for the prompt's chain and end key on the
//!   same connection without waiting for the reply; taking it back is an
//!   `HDEL` per key. Both are skipped during an outage.
//! - In-flight counts are never written on the request path: begin and end
//!   update this process's counters in memory (and the host's shm ledger),
//!   and a background task publishes the counters whole, coalescing every
//!   change made during the previous publication's round trip, and every
//!   third of the lease when nothing changes.
//! - Every operation has the `timeout_ms` deadline. A failure or a timeout
//!   starts an outage: logged once, counted, and from then on lookups answer
//!   from this host alone (no prefix, no cached answer, local load) without
//!   waiting, while one request every `retry_ms` probes Redis; the first
//!   answer ends the outage (logged with its length and the requests routed
//!   on load only).
//!
//! # Response-process side: [`RedisWriteBack`]
//!
//! A batch of completion records becomes one pipeline
//! ([`RedisStore::write_back`]). When Redis cannot be reached the records
//! stay in a bounded backlog (`write_backlog` records and at most
//! [`MAX_BACKLOG_BYTES`]; the oldest give way, counted) and are written on
//! the first call after `retry_ms` that reaches it.
//!
//! # Files
//!
//! | file | concern |
//! | --- | --- |
//! | `mod.rs` | [`RedisRouting`]: its connection (scripts loaded, the namespace's chain seed read), its round trips, the [`RoutingStore`] calls |
//! | `lookup.rs` | a dispatcher's lookup: the one-round-trip pipeline, the naive walk, the end-key probes, the answer on this host's candidates or its fallback |
//! | `learn.rs` | learning at dispatch: inserts and `HDEL`s sent without waiting |
//! | `publish.rs` | this process's in-flight counts: counted in memory, published whole by a background task |
//! | `limits.rs` | rate-limit buckets: the limit script's pipeline and verdict, take, charge and refund |
//! | `health.rs` | outages: an operation's deadline, the outage a failure starts, the probe that ends it |
//! | `clocks.rs` | Unix milliseconds (Redis's stamps) and the segment's clock, converted |
//! | `write_back.rs` | [`RedisWriteBack`]: a response process's pipelines and its backlog during an outage |
//! | [`client`] | the data model; [`client::RedisStore`], the synchronous client, and its one-round-trip pipelines (a lookup, a write-back) |
//! | `connection.rs` | the [`client::RedisStore`]: opening it, its keys, its round trips (counted; a connection out of step dropped) |
//! | `prefix_entries.rs` | prefix entries and horizons: insert, read, longest-prefix match (script and naive), forget a server |
//! | `responses.rs` | cached responses, sealed with a checksum |
//! | `inflight.rs` | in-flight counters: publication under a lease, the sum over live owners |
//! | `error.rs` | [`client::StoreError`]: why an operation failed |
//! | `scripts.rs` | the Lua scripts |
//! | [`credentials`] | URL, password, TLS: how a process connects |
//! | [`url`] | passwords kept out of logs and command lines |
//! | [`server_id`] | servers named by stable ids of their addresses |

pub mod client;
mod clocks;
mod connection;
pub mod credentials;
mod error;
mod health;
mod inflight;
mod learn;
mod limits;
mod lookup;
mod prefix_entries;
mod publish;
mod responses;
mod scripts;
pub mod server_id;
pub mod url;
mod write_back;

use std::sync::atomic::AtomicI64;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, Value};
use shm_layout::plan::SERVER_SLOTS;
use shm_layout::{Segment, ServerRef};

use super::local::LocalState;
use super::{Lookup, LookupRequest, RoutingStore, StoreFuture, StoreStats};
use crate::config::{RedisConfig, StoreKind};
use crate::routing::Candidate;
use crate::tenancy::rate_limit::{Charge, Settlement, Verdict};
use client::{StoreError, owner_id};
use clocks::unix_ms;
use health::Health;
use limits::{LIMIT_SCRIPT, Mode};
use publish::publish_loop;
use scripts::{INSERT_SCRIPT, LPM_SCRIPT, PUBLISH_SCRIPT, SUM_SCRIPT};
pub use write_back::{MAX_BACKLOG_BYTES, RedisWriteBack};

/// The keys and script hashes a dispatcher uses.
#[derive(Debug)]
struct Names {
    namespace: String,
    owners: String,
    own_hash: String,
    owner: String,
    lpm: String,
    sum: String,
    publish: String,
    insert: String,
    limit: String,
}

impl Names {
    /// A prefix entry's key.
    fn prefix_key(&self, hash: u64) -> String {
        format!("{}:p:{hash:016x}", self.namespace)
    }
}

/// A dispatcher's Redis store (see the module docs).
#[derive(Debug)]
pub struct RedisRouting {
    /// The host's candidates and this dispatcher's ledger row.
    local: LocalState,
    config: RedisConfig,
    client: redis::Client,
    conn: Mutex<Option<MultiplexedConnection>>,
    /// Held while a connection is opened, so that the tasks finding none
    /// (a burst of lookups at start or after an outage, and the publishing
    /// task) wait for one connection instead of each opening its own.
    connecting: tokio::sync::Mutex<()>,
    names: Names,
    health: Health,
    /// This process's requests and prompt tokens in flight per server slot.
    counts: Box<[(AtomicI64, AtomicI64)]>,
    /// Set when `counts` changed since the last publication.
    dirty: tokio::sync::Notify,
    lookups: AtomicU64,
    degraded: AtomicU64,
    failures: AtomicU64,
    outages: AtomicU64,
    publishes: AtomicU64,
    /// Who this process is in messages (`dispatcher 3`).
    label: String,
    /// The namespace's chain seed ([`namespace_seed`]), once read.
    chain_seed: std::sync::OnceLock<u64>,
}

/// The seed every block chain of the namespace is rooted in: created once
/// (`SET {ns}:seed <candidate> NX`, no expiry) by the first process of any
/// host that connects, and read by every other, so that every gateway host
/// sharing the namespace hashes a prompt to the same chain. `candidate` is
/// this process's random proposal. One round trip.
async fn namespace_seed(conn: &mut MultiplexedConnection, namespace: &str, candidate: u64) -> redis::RedisResult<u64> {
    let key = format!("{namespace}:seed");
    let (_, seed): (Value, String) = redis::pipe()
        .cmd("SET")
        .arg(&key)
        .arg(format!("{candidate:016x}"))
        .arg("NX")
        .cmd("GET")
        .arg(&key)
        .query_async(conn)
        .await?;
    u64::from_str_radix(&seed, 16).map_err(|_| {
        redis::RedisError::from((
            ErrorKind::TypeError,
            "the namespace seed is not 16 hex digits",
            format!("{key} = {seed:?}"),
        ))
    })
}

/// The namespace's chain seed ([`namespace_seed`]) on a connection of its
/// own, within `config`'s connect deadline: for a process that hashes
/// chains without a [`RedisRouting`] (the KV event subscribers of the
/// response processes). `candidate` is proposed if there is none yet.
pub async fn chain_seed_of(config: &RedisConfig, candidate: u64) -> Result<u64, StoreError> {
    let client = credentials::client(config)?;
    let settings = AsyncConnectionConfig::new()
        .set_connection_timeout(config.connect_timeout())
        .set_response_timeout(config.connect_timeout());
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&settings)
        .await
        .map_err(StoreError::Connect)?;
    namespace_seed(&mut conn, &config.namespace, candidate)
        .await
        .map_err(StoreError::Connect)
}

impl RedisRouting {
    /// The store of the dispatcher in registry slot `process`, and its
    /// publishing task (spawned on the current tokio runtime). Does not
    /// connect: the first lookup does, so a gateway starts while Redis is
    /// down (and routes on load until it is up). `label` names the process
    /// in log events (their `process` field: `dispatcher 2`).
    pub fn start(
        segment: Arc<Segment>,
        process: u16,
        config: &RedisConfig,
        label: impl Into<String>,
    ) -> Result<Arc<Self>, StoreError> {
        let client = credentials::client(config)?;
        let ns = &config.namespace;
        let owner = owner_id();
        let hash = |code: &str| redis::Script::new(code).get_hash().to_owned();
        let names = Names {
            namespace: ns.clone(),
            owners: format!("{ns}:owners"),
            own_hash: format!("{ns}:if:{owner}"),
            owner,
            lpm: hash(LPM_SCRIPT),
            sum: hash(SUM_SCRIPT),
            publish: hash(PUBLISH_SCRIPT),
            insert: hash(INSERT_SCRIPT),
            limit: hash(LIMIT_SCRIPT),
        };
        let store = Arc::new(Self {
            local: LocalState::new(segment, process),
            config: config.clone(),
            client,
            conn: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            names,
            health: Health::new(),
            counts: (0..SERVER_SLOTS)
                .map(|_| (AtomicI64::new(0), AtomicI64::new(0)))
                .collect(),
            dirty: tokio::sync::Notify::new(),
            lookups: AtomicU64::new(0),
            degraded: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            outages: AtomicU64::new(0),
            publishes: AtomicU64::new(0),
            label: label.into(),
            chain_seed: std::sync::OnceLock::new(),
        });
        tokio::spawn(publish_loop(store.clone()));
        Ok(store)
    }

    /// The open connection, or a new one with the scripts loaded.
    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        let open = || self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(conn) = open() {
            return Ok(conn);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(conn) = open() {
            return Ok(conn);
        }
        let settings = AsyncConnectionConfig::new()
            .set_connection_timeout(self.deadline())
            .set_response_timeout(self.config.timeout());
        let mut conn = self
            .client
            .get_multiplexed_async_connection_with_config(&settings)
            .await
            .map_err(StoreError::Connect)?;
        load_scripts(&mut conn).await.map_err(StoreError::Connect)?;
        if self.chain_seed.get().is_none() {
            let candidate = self.local.segment().header().seed[1] ^ unix_ms().rotate_left(17);
            let seed = namespace_seed(&mut conn, &self.names.namespace, candidate)
                .await
                .map_err(StoreError::Connect)?;
            let _ = self.chain_seed.set(seed);
        }
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
        Ok(conn)
    }

    /// Runs `pipe` on the connection; on `NOSCRIPT` reloads the scripts and
    /// runs it once more.
    async fn query(&self, op: &'static str, pipe: &redis::Pipeline) -> Result<Vec<Value>, StoreError> {
        let mut conn = self.connection().await?;
        match pipe.query_async::<Vec<Value>>(&mut conn).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                load_scripts(&mut conn)
                    .await
                    .map_err(|source| StoreError::Command { op, source })?;
                pipe.query_async(&mut conn)
                    .await
                    .map_err(|source| StoreError::Command { op, source })
            }
            other => other.map_err(|source| StoreError::Command { op, source }),
        }
    }
}

async fn load_scripts(conn: &mut MultiplexedConnection) -> Result<(), redis::RedisError> {
    for code in [INSERT_SCRIPT, LPM_SCRIPT, PUBLISH_SCRIPT, SUM_SCRIPT, LIMIT_SCRIPT] {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(code)
            .query_async::<String>(conn)
            .await?;
    }
    Ok(())
}

impl RoutingStore for RedisRouting {
    fn kind(&self) -> StoreKind {
        StoreKind::Redis
    }

    fn lookup<'a>(&'a self, request: LookupRequest<'a>) -> StoreFuture<'a, Lookup> {
        Box::pin(self.look_up(request))
    }

    fn begin_request(&self, server: ServerRef, prompt_tokens: u64) -> bool {
        if !self.local.begin(server, prompt_tokens) {
            return false;
        }
        self.count(server, 1, prompt_tokens as i64);
        true
    }

    fn first_token(&self, server: ServerRef, prompt_tokens: u64) {
        self.local.first_token(server, prompt_tokens);
    }

    fn end_request(&self, server: ServerRef, prompt_tokens: u64, started: bool) {
        self.local.end(server, prompt_tokens, started);
        self.count(server, -1, -(prompt_tokens as i64));
    }

    fn record_route(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>) {
        self.insert_detached(server, blocks.iter().chain(end_key.as_ref()));
    }

    fn record_affinity<'a>(&'a self, server: ServerRef, key: u64) -> StoreFuture<'a, ()> {
        Box::pin(self.insert_now(server, key))
    }

    fn touch_route(&self, server: ServerRef, last: u64) {
        self.insert_detached(server, [&last].into_iter());
    }

    fn forget_route(&self, server: ServerRef, blocks: &[u64], end_key: Option<u64>) {
        self.remove_detached(server, blocks, end_key);
    }

    fn holders<'a>(&'a self, key: u64, among: &'a [Candidate]) -> StoreFuture<'a, Vec<ServerRef>> {
        Box::pin(self.listed_for(key, among))
    }

    fn take_limits<'a>(&'a self, charges: &'a [Charge]) -> StoreFuture<'a, Verdict> {
        Box::pin(self.take(charges))
    }

    fn settle_limits<'a>(&'a self, settlement: &'a Settlement) -> StoreFuture<'a, ()> {
        Box::pin(self.settle(settlement))
    }

    fn charge_limits(&self, charges: &[Charge]) {
        self.settle_detached(Mode::Charge, charges);
    }

    fn refund_limits(&self, charges: &[Charge]) {
        self.settle_detached(Mode::Refund, charges);
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            lookups: self.lookups.load(Relaxed),
            degraded_lookups: self.degraded.load(Relaxed),
            failures: self.failures.load(Relaxed),
            outages: self.outages.load(Relaxed),
            publishes: self.publishes.load(Relaxed),
        }
    }

    fn local(&self) -> &LocalState {
        &self.local
    }

    fn chain_seed(&self) -> Option<u64> {
        self.chain_seed.get().copied()
    }

    fn await_chain_seed(&self) -> StoreFuture<'_, Option<u64>> {
        Box::pin(async move {
            if self.chain_seed.get().is_none() {
                self.guarded("connect", self.connection()).await;
            }
            self.chain_seed.get().copied()
        })
    }
}
