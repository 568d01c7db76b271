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

pub mod client;
pub mod credentials;
mod limits;
mod scripts;
pub mod server_id;
pub mod url;

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, Value};
use shm_layout::plan::SERVER_SLOTS;
use shm_layout::{Completion, PrefixMatch, Segment, ServerRef, Stamp};

use super::local::LocalState;
use super::{Lookup, LookupRequest, RoutingStore, StoreFuture, StoreStats, WriteBack, WriteStats, answer_blocks};
use crate::config::{RedisConfig, RedisLookup, StoreKind};
use crate::prefix::continuation::EndProbe;
use crate::prefix::precise;
use crate::tenancy::rate_limit::{Charge, Verdict};
use client::{
    DispatchLookup, INFLIGHT_LEASE, INSERT_SCRIPT, LANES, LPM_SCRIPT, PUBLISH_SCRIPT, RedisStore, SUM_SCRIPT, ServerId,
    StoreError, WriteItem, lookup_pipeline, owner_id, parse_lookup, publish_args,
};
use limits::{LIMIT_SCRIPT, Mode, limit_pipeline, parse_verdict};

/// Milliseconds since the Unix epoch: the prefix stamps written to Redis
/// (shared by every host, unlike a segment's clock).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A Redis prefix stamp (Unix ms) as the segment's prefix [`Stamp`] (whole
/// seconds since the segment was created, rounded down), given the two
/// clocks' readings now; `None` for a stamp from before the segment (a
/// horizon there would be later than the stamp).
fn segment_stamp(stamp_ms: u64, segment_now_ms: u64, unix_now_ms: u64) -> Option<Stamp> {
    let segment_ms = segment_now_ms.checked_sub(unix_now_ms.saturating_sub(stamp_ms))?;
    Some(Stamp((segment_ms / 1000) as u16))
}

/// Segment second `at_s` as Unix ms, given the two clocks' readings now
/// (never later than the Unix time of any stamp in that second).
fn unix_at(at_s: u32, segment_now_ms: u64, unix_now_ms: u64) -> u64 {
    unix_now_ms.saturating_sub(segment_now_ms.saturating_sub(u64::from(at_s) * 1000))
}

/// Whether Redis is answering, and when to try again if not.
#[derive(Debug)]
struct Health {
    /// Start of this process's clock for the fields below.
    epoch: Instant,
    /// In an outage.
    down: AtomicBool,
    /// When the outage began (ms since `epoch`).
    down_since_ms: AtomicU64,
    /// Earliest next probe during an outage (ms since `epoch`).
    next_probe_ms: AtomicU64,
    /// A probe is under way.
    probing: AtomicBool,
    /// Lookups answered by the fallback in the current outage.
    degraded_in_outage: AtomicU64,
}

impl Health {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            down: AtomicBool::new(false),
            down_since_ms: AtomicU64::new(0),
            next_probe_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            degraded_in_outage: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether to ask Redis now: always when up; during an outage, one
    /// caller per retry interval (it must report with `done_probing`).
    fn may_ask(&self) -> Attempt {
        if !self.down.load(Relaxed) {
            return Attempt::Normal;
        }
        if self.now_ms() >= self.next_probe_ms.load(Relaxed) && !self.probing.swap(true, Relaxed) {
            return Attempt::Probe;
        }
        Attempt::Skip
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Normal,
    Probe,
    Skip,
}

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

    /// The Redis part of a lookup: response, longest-prefix pairs, loads.
    async fn fetch(&self, request: LookupRequest<'_>) -> Result<DispatchLookup, StoreError> {
        const OP: &str = "lookup";
        let names = &self.names;
        let scripted = self.config.lookup == RedisLookup::Script;
        let pipe = lookup_pipeline(
            &names.namespace,
            &names.lpm,
            &names.sum,
            request.response_key.map(|k| k.0),
            request.chain,
            scripted,
        );
        let replies = self.query(OP, &pipe).await?;
        let mut lookup = parse_lookup(replies, request.response_key.is_some())
            .map_err(|detail| StoreError::Protocol { op: OP, detail })?;
        if !scripted && !request.chain.is_empty() {
            lookup.prefix = self.naive_match(request.chain).await?;
        }
        Ok(lookup)
    }

    /// One `HGETALL` round trip per block until the first missing one.
    async fn naive_match(&self, chain: &[u64]) -> Result<Vec<(ServerId, u32)>, StoreError> {
        const OP: &str = "lookup (naive)";
        let chain = &chain[..chain.len().min(client::MAX_LOOKUP_BLOCKS)];
        let mut conn = self.connection().await?;
        let mut found: Vec<(ServerId, u32)> = Vec::new();
        for (i, hash) in chain.iter().enumerate() {
            let fields: Vec<(String, String)> = redis::cmd("HGETALL")
                .arg(format!("{}:p:{hash:016x}", self.names.namespace))
                .query_async(&mut conn)
                .await
                .map_err(|source| StoreError::Command { op: OP, source })?;
            if fields.is_empty() {
                break;
            }
            for server in fields.iter().filter_map(|(s, _)| u64::from_str_radix(s, 16).ok()) {
                match found.iter_mut().find(|(s, _)| *s == server) {
                    Some(e) => e.1 = i as u32 + 1,
                    None => found.push((server, i as u32 + 1)),
                }
            }
        }
        Ok(found)
    }

    /// Publishes this process's in-flight counts (absolute values).
    async fn publish(&self) -> Result<(), StoreError> {
        let servers = self.local.segment().tables().servers;
        let counts = self.counts.iter().enumerate().filter_map(|(slot, (r, t))| {
            let (r, t) = (r.load(Relaxed), t.load(Relaxed));
            // A server retired meanwhile has no id: nothing left to publish.
            let id = servers.id_of(slot as u16)?;
            (r != 0 || t != 0).then_some((id, r, t))
        });
        let names = &self.names;
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA")
            .arg(&names.publish)
            .arg(2)
            .arg(&names.own_hash)
            .arg(&names.owners)
            .arg(publish_args(&names.owner, counts));
        self.query("publish", &pipe).await.map(drop)
    }

    /// The deadline of an operation: `connect_timeout_ms` until this process
    /// has connected once (the first connection's TLS handshake, `AUTH`,
    /// scripts and seed may take longer than a reply), then `timeout_ms`.
    fn deadline(&self) -> Duration {
        if self.chain_seed.get().is_some() {
            self.config.timeout()
        } else {
            self.config.connect_timeout()
        }
    }

    /// Runs `op` under the deadline with the outage bookkeeping; `None` when
    /// Redis is not to be asked now or failed.
    async fn guarded<T>(&self, name: &'static str, op: impl Future<Output = Result<T, StoreError>>) -> Option<T> {
        let attempt = self.health.may_ask();
        if attempt == Attempt::Skip {
            return None;
        }
        let deadline = self.deadline();
        let result = match tokio::time::timeout(deadline, op).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout {
                op: name,
                timeout: deadline,
            }),
        };
        let out = match result {
            Ok(v) => {
                self.up();
                Some(v)
            }
            Err(e) => {
                self.down(&e);
                None
            }
        };
        if attempt == Attempt::Probe {
            self.health.probing.store(false, Relaxed);
        }
        out
    }

    /// The servers of `prefix` whose earlier prompt this one continues:
    /// one more round trip (an `HKEYS` per probe), made only for prompts
    /// that carry an earlier answer and match some server. Nothing is
    /// credited when it fails.
    async fn continued(&self, probe: &EndProbe<'_>, prefix: &PrefixMatch) -> PrefixMatch {
        let mut probes = Vec::new();
        probe.probes(prefix, &mut probes);
        if probes.is_empty() {
            return PrefixMatch::default();
        }
        let mut pipe = redis::pipe();
        for p in &probes {
            pipe.cmd("HKEYS").arg(self.names.prefix_key(p.key));
        }
        let Some(replies) = self.guarded("continuation", self.query("continuation", &pipe)).await else {
            return PrefixMatch::default();
        };
        let listed: Vec<Vec<String>> = replies
            .iter()
            .map(|r| redis::FromRedisValue::from_redis_value(r).unwrap_or_default())
            .collect();
        let servers = self.local.segment().tables().servers;
        probe.credit(prefix, &probes, |i, server| {
            let id = servers.id_of(server.slot()).map(server_id::id_field);
            listed
                .get(i)
                .is_some_and(|fields| id.is_some_and(|id| fields.contains(&id)))
        })
    }

    /// Sends `pipe` on the open connection without waiting for its replies
    /// (dispatch-time learning: the completion record's write-back repeats
    /// the prompt's chain, so a lost write costs only time). Skipped while
    /// Redis is down or before the first lookup has connected.
    fn send_detached(&self, pipe: redis::Pipeline) {
        if self.health.down.load(Relaxed) {
            return;
        }
        let Some(mut conn) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        let timeout = self.config.timeout();
        // Also called as a response body is dropped, which may be after
        // the runtime has gone: then there is nothing to send it on.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(timeout, pipe.query_async::<()>(&mut conn)).await;
            });
        }
    }

    fn up(&self) {
        let h = &self.health;
        if h.down.swap(false, Relaxed) {
            let secs = (h.now_ms() - h.down_since_ms.load(Relaxed)) as f64 / 1e3;
            let degraded = h.degraded_in_outage.swap(0, Relaxed);
            tracing::info!(
                process = %self.label,
                redis = %credentials::redacted(&self.config.url),
                outage_secs = secs,
                degraded,
                "Redis at {} answers again after {secs:.1} s; {degraded} requests were routed on load only",
                credentials::redacted(&self.config.url)
            );
            self.dirty.notify_one();
        }
    }

    fn down(&self, error: &StoreError) {
        self.failures.fetch_add(1, Relaxed);
        // A slow reply does not make the connection bad: the multiplexed
        // connection every task of the process shares is kept (its late
        // reply is dropped); any other failure drops it.
        if !error.is_timeout() {
            *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        let h = &self.health;
        let now = h.now_ms();
        h.next_probe_ms.store(now + self.config.retry_ms, Relaxed);
        if !h.down.swap(true, Relaxed) {
            h.down_since_ms.store(now, Relaxed);
            self.outages.fetch_add(1, Relaxed);
            tracing::warn!(
                process = %self.label,
                redis = %credentials::redacted(&self.config.url),
                error = %error,
                "Redis at {} is unavailable ({error}); routing on load only, probing every {} ms",
                credentials::redacted(&self.config.url),
                self.config.retry_ms
            );
        }
    }

    fn count(&self, server: ServerRef, requests: i64, tokens: i64) {
        if let Some((r, t)) = self.counts.get(usize::from(server.slot)) {
            r.fetch_add(requests, Relaxed);
            t.fetch_add(tokens, Relaxed);
            self.dirty.notify_one();
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

/// Publishes a store's counts when they change (coalescing the changes made
/// during the previous round trip) and every third of the lease. Runs as
/// long as the process's runtime.
async fn publish_loop(store: Arc<RedisRouting>) {
    let mut tick = tokio::time::interval(INFLIGHT_LEASE / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = store.dirty.notified() => {}
            _ = tick.tick() => {}
        }
        // During an outage this is skipped between probes; the counts are
        // absolute, so the next publication after it catches up.
        if store.guarded("publish", store.publish()).await.is_some() {
            store.publishes.fetch_add(1, Relaxed);
        }
    }
}

/// `server`'s id in Redis: the id of its registration in `segment`, if
/// it is still registered (a stable id of its address, the same on every
/// host: [`crate::store::server_id`]).
fn server_id(segment: &Segment, server: ServerRef) -> Option<ServerId> {
    let servers = segment.tables().servers;
    let id = servers.id_of(server.slot)?;
    servers
        .current(server.slot)
        .is_some_and(|(s, _)| s == server)
        .then_some(id)
}

impl RedisRouting {
    /// `server`'s id in Redis, if it is still registered.
    /// Charges or gives back `charges` without waiting: in Redis, or in
    /// this host's table while Redis is down.
    fn settle_limits(&self, mode: Mode, charges: &[Charge]) {
        if charges.is_empty() {
            return;
        }
        if self.health.down.load(Relaxed) || self.conn.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            match mode {
                Mode::Refund => self.local.refund_limits(charges),
                _ => self.local.charge_limits(charges),
            }
            return;
        }
        self.send_detached(limit_pipeline(&self.names.namespace, &self.names.limit, mode, charges));
    }

    fn id_of(&self, server: ServerRef) -> Option<ServerId> {
        server_id(self.local.segment(), server)
    }

    /// Records `server` for `keys` now, without waiting (one insert script).
    fn insert_detached<'k>(&self, server: ServerRef, keys: impl Iterator<Item = &'k u64> + Clone) {
        let names = &self.names;
        let mut pipe = redis::pipe();
        let cmd = pipe.cmd("EVALSHA").arg(&names.insert).arg(keys.clone().count());
        for hash in keys {
            cmd.arg(names.prefix_key(*hash));
        }
        let Some(id) = self.id_of(server) else { return };
        cmd.arg(server_id::id_field(id))
            .arg(unix_ms())
            .arg(self.config.prefix_ttl().as_millis() as u64)
            .arg(LANES)
            .ignore();
        self.send_detached(pipe);
    }
}

impl RoutingStore for RedisRouting {
    fn kind(&self) -> StoreKind {
        StoreKind::Redis
    }

    fn lookup<'a>(&'a self, request: LookupRequest<'a>) -> StoreFuture<'a, Lookup> {
        Box::pin(async move {
            let mut lookup = Lookup::default();
            self.local.candidates(
                request.exclude,
                request.members,
                request.stale_after_ms,
                &mut lookup.candidates,
            );
            let Some(fetched) = self.guarded("lookup", self.fetch(request)).await else {
                self.degraded.fetch_add(1, Relaxed);
                self.health.degraded_in_outage.fetch_add(1, Relaxed);
                lookup.degraded = true;
                // What the engines confirmed is this host's: it still routes.
                if request.precise.is_some() {
                    let segment = self.local.segment();
                    let now = Stamp((segment.clock().now_ms() / 1000) as u16);
                    lookup.prefix = precise::confirmed_match(&segment.tables(), now, request.chain, request.exclude);
                }
                return lookup;
            };
            self.lookups.fetch_add(1, Relaxed);
            lookup.response = fetched.response.map(Bytes::from);
            let candidates = &mut lookup.candidates;
            let servers = self.local.segment().tables().servers;
            // Redis names servers by id; this host's candidates by slot.
            let ids: Vec<Option<ServerId>> = candidates.iter().map(|c| servers.id_of(c.server.slot)).collect();
            let (segment_now, unix_now) = (self.local.segment().clock().now_ms(), unix_ms());
            for (id, depth) in fetched.prefix {
                if let Some(i) = ids.iter().position(|c| *c == Some(id)) {
                    let c = &candidates[i];
                    let refreshed = fetched
                        .refreshed
                        .binary_search_by_key(&id, |(s, _)| *s)
                        .ok()
                        .and_then(|i| segment_stamp(fetched.refreshed[i].1, segment_now, unix_now));
                    lookup.prefix.add_refreshed(c.server.tag(), depth, refreshed);
                }
            }
            if let Some(window) = request.precise {
                // The engines' confirmed blocks are this host's (its
                // response processes follow every engine's events).
                let tables = self.local.segment().tables();
                let now = Stamp((segment_now / 1000) as u16);
                let recent = precise::recent_only(&lookup.prefix, &tables.servers, now, window);
                lookup.prefix = precise::merge(
                    recent,
                    &precise::confirmed_match(&tables, now, request.chain, request.exclude),
                );
            }
            if let Some(probe) = request.continuation.filter(|_| !lookup.prefix.is_empty()) {
                lookup.continued = self.continued(&probe, &lookup.prefix).await;
            }
            for load in fetched.loads {
                if let Some(i) = ids.iter().position(|c| *c == Some(load.server)) {
                    let c = &mut candidates[i];
                    c.inflight = c.inflight.max(load.requests.max(0) as u64);
                    c.inflight_tokens = c.inflight_tokens.max(load.tokens.max(0) as u64);
                }
            }
            lookup
        })
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

    fn record_route(&self, server: ServerRef, blocks: &[u64], end_key: u64) {
        self.insert_detached(server, blocks.iter().chain([&end_key]));
    }

    fn touch_route(&self, server: ServerRef, last: u64) {
        self.insert_detached(server, [&last].into_iter());
    }

    fn forget_route(&self, server: ServerRef, blocks: &[u64], end_key: u64) {
        let Some(id) = self.id_of(server) else { return };
        let mut pipe = redis::pipe();
        for hash in blocks.iter().chain([&end_key]) {
            pipe.cmd("HDEL")
                .arg(self.names.prefix_key(*hash))
                .arg(server_id::id_field(id))
                .ignore();
        }
        self.send_detached(pipe);
    }

    fn take_limits<'a>(&'a self, charges: &'a [Charge]) -> StoreFuture<'a, Verdict> {
        Box::pin(async move {
            const OP: &str = "rate limit";
            let pipe = limit_pipeline(&self.names.namespace, &self.names.limit, Mode::Take, charges);
            let asked = async {
                let replies = self.query(OP, &pipe).await?;
                parse_verdict(&replies, charges).map_err(|detail| StoreError::Protocol { op: OP, detail })
            };
            // Redis unreachable or slow: this host's table limits alone.
            match self.guarded(OP, asked).await {
                Some(verdict) => verdict,
                None => self.local.take_limits(charges),
            }
        })
    }

    fn charge_limits(&self, charges: &[Charge]) {
        self.settle_limits(Mode::Charge, charges);
    }

    fn refund_limits(&self, charges: &[Charge]) {
        self.settle_limits(Mode::Refund, charges);
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

/// Records per write-back pipeline (bounds one round trip's size).
const WRITE_CHUNK: usize = 256;

/// Most bytes of records (blocks and response bodies) a response process
/// keeps during an outage, whatever `write_backlog` allows: cached
/// responses may be megabytes each.
pub const MAX_BACKLOG_BYTES: usize = 64 << 20;

/// The memory a kept record holds.
fn record_bytes(record: &Completion) -> usize {
    8 * (record.prompt_blocks.len() + record.full_blocks.len()) + record.response.len() + 64
}

/// A response process's writes into Redis (see the module docs).
#[derive(Debug)]
pub struct RedisWriteBack {
    /// The host's segment: its server table names the servers' ids.
    segment: Arc<Segment>,
    config: RedisConfig,
    response_ttl: Duration,
    store: Option<RedisStore>,
    backlog: VecDeque<Completion>,
    backlog_bytes: usize,
    retry_at: Option<Instant>,
    down_since: Option<Instant>,
    label: String,
}

impl RedisWriteBack {
    /// Writes with `config` what records of `segment`'s servers teach,
    /// caching responses for `response_ttl`; `label` names the process in
    /// messages. Connects on the first write.
    pub fn new(segment: Arc<Segment>, config: &RedisConfig, response_ttl: Duration, label: impl Into<String>) -> Self {
        Self {
            segment,
            config: config.clone(),
            response_ttl,
            store: None,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            retry_at: None,
            down_since: None,
            label: label.into(),
        }
    }

    /// Records waiting for Redis.
    pub fn backlog(&self) -> usize {
        self.backlog.len()
    }

    fn store(&mut self) -> Result<&mut RedisStore, StoreError> {
        if self.store.is_none() {
            let c = &self.config;
            self.store = Some(RedisStore::with_client(
                credentials::client(c)?,
                &c.namespace,
                c.prefix_ttl(),
                c.timeout(),
            )?);
        }
        Ok(self.store.as_mut().expect("just set"))
    }

    /// Writes the backlog's first `n` records in one pipeline.
    fn flush(&mut self, n: usize) -> Result<(), StoreError> {
        let ttl = self.response_ttl;
        self.store()?;
        // Disjoint fields: the items borrow the backlog, the write needs the store.
        let Self {
            store,
            backlog,
            segment,
            ..
        } = self;
        let store = store.as_mut().expect("connected just above");
        let mut items = Vec::with_capacity(2 * n);
        for r in backlog.iter().take(n) {
            // A server retired since: what it learned is of no use.
            let Some(server) = r.server.and_then(|s| server_id(segment, s)) else {
                continue;
            };
            items.push(WriteItem {
                server,
                blocks: &r.prompt_blocks,
                response: None,
            });
            items.push(WriteItem {
                server,
                blocks: answer_blocks(r),
                response: r.response_key.map(|k| (k.0, r.response.as_slice(), ttl)),
            });
        }
        store.write_back(&items, n.min(backlog.len()) as u64, unix_ms())
    }
}

impl WriteBack for RedisWriteBack {
    fn kind(&self) -> StoreKind {
        StoreKind::Redis
    }

    fn forget_server(&mut self, server: ServerRef) -> u64 {
        let Some(id) = server_id(&self.segment, server) else {
            return 0;
        };
        match self.store().and_then(|s| s.forget_server(id)) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(process = %self.label, error = %e, "could not forget server slot {} in Redis: {e}", server.slot);
                0
            }
        }
    }

    fn demote_before(&mut self, server: ServerRef, at_s: u32, now_ms: u64) -> bool {
        let at_ms = unix_at(at_s, now_ms, unix_ms());
        let Some(id) = server_id(&self.segment, server) else {
            return false;
        };
        match self.store().and_then(|s| s.raise_horizon(id, at_ms)) {
            Ok(moved) => moved,
            Err(e) => {
                tracing::warn!(process = %self.label, error = %e, "could not raise the horizon of server slot {} in Redis: {e}", server.slot);
                false
            }
        }
    }

    fn write(&mut self, batch: &[Completion], _now: Stamp, _now_ms: u64, stats: &mut WriteStats) {
        for record in batch {
            self.backlog_bytes += record_bytes(record);
            self.backlog.push_back(record.clone());
            // Keep the newest: the oldest give way beyond either bound (the
            // record just added stays, so a write always has something).
            while self.backlog.len() > 1
                && (self.backlog.len() > self.config.write_backlog.max(1) || self.backlog_bytes > MAX_BACKLOG_BYTES)
            {
                if let Some(old) = self.backlog.pop_front() {
                    self.backlog_bytes -= record_bytes(&old);
                    stats.writeback_dropped += 1;
                }
            }
        }
        if self.backlog.is_empty() || self.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        while !self.backlog.is_empty() {
            let n = self.backlog.len().min(WRITE_CHUNK);
            match self.flush(n) {
                Ok(()) => {
                    for r in self.backlog.drain(..n) {
                        self.backlog_bytes -= record_bytes(&r);
                        stats.records += 1;
                        stats.blocks += (r.prompt_blocks.len() + answer_blocks(&r).len()) as u64;
                        stats.responses_stored += u64::from(r.response_key.is_some());
                    }
                    if let Some(since) = self.down_since.take() {
                        let secs = since.elapsed().as_secs_f64();
                        tracing::info!(
                            process = %self.label,
                            redis = %credentials::redacted(&self.config.url),
                            outage_secs = secs,
                            "Redis at {} answers again after {secs:.1} s; the backlog is written",
                            credentials::redacted(&self.config.url)
                        );
                    }
                    self.retry_at = None;
                }
                Err(e) => {
                    stats.writeback_failures += 1;
                    self.store = None;
                    self.retry_at = Some(Instant::now() + self.config.retry());
                    if self.down_since.is_none() {
                        self.down_since = Some(Instant::now());
                        tracing::warn!(
                            process = %self.label,
                            redis = %credentials::redacted(&self.config.url),
                            error = %e,
                            "Redis at {} is unavailable ({e}); keeping up to {} records to write later",
                            credentials::redacted(&self.config.url),
                            self.config.write_backlog
                        );
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use shm_layout::ResponseKey;

    use super::*;

    fn record(i: u64, response_bytes: usize) -> Completion {
        Completion {
            server: Some(ServerRef { slot: 1, generation: 1 }),
            prompt_tokens: 32,
            output_tokens: 16,
            prompt_blocks: vec![i, i + 1],
            full_blocks: vec![i, i + 1, i + 2],
            continuation: None,
            response_key: (response_bytes > 0).then_some(ResponseKey(u128::from(i))),
            response: vec![b'x'; response_bytes],
            prediction: None,
            timing: None,
        }
    }

    /// Redis stamps (Unix ms) and segment seconds convert both ways
    /// without ever putting a horizon after the stamp it came from.
    #[test]
    fn stamps_convert_between_the_clocks_conservatively() {
        // The segment was created at Unix 1_000_000 ms; it is now 75.5 s old.
        let (segment_now, unix_now) = (75_500, 1_075_500);
        assert_eq!(segment_stamp(1_070_999, segment_now, unix_now), Some(Stamp(70)));
        assert_eq!(segment_stamp(1_000_000, segment_now, unix_now), Some(Stamp(0)));
        assert_eq!(
            segment_stamp(999_999, segment_now, unix_now),
            None,
            "older than the segment"
        );
        assert_eq!(unix_at(70, segment_now, unix_now), 1_070_000);
        for stamp in [1_000_000, 1_000_999, 1_070_999, 1_075_500] {
            let s = segment_stamp(stamp, segment_now, unix_now).unwrap();
            assert!(unix_at(u32::from(s.0), segment_now, unix_now) <= stamp);
        }
    }

    /// A write-back towards a closed port: every write fails at once.
    fn unreachable(backlog: usize) -> RedisWriteBack {
        let config = RedisConfig {
            url: "redis://127.0.0.1:1/".into(),
            write_backlog: backlog,
            retry_ms: 10,
            ..RedisConfig::default()
        };
        let segment = Arc::new(Segment::heap(&shm_layout::LayoutPlan::for_size(8 << 20).unwrap()));
        RedisWriteBack::new(segment, &config, Duration::from_secs(60), "test")
    }

    #[test]
    fn an_unreachable_redis_keeps_the_newest_records_up_to_the_bound() {
        let mut w = unreachable(5);
        let mut stats = WriteStats::default();
        for i in 0..12 {
            w.write(&[record(i * 10, 0)], Stamp(0), 0, &mut stats);
        }
        assert_eq!(w.backlog(), 5);
        assert_eq!(stats.writeback_dropped, 7);
        assert_eq!(stats.records, 0, "nothing was written");
        assert!(stats.writeback_failures >= 1);
        let kept: Vec<u64> = w.backlog.iter().map(|r| r.prompt_blocks[0]).collect();
        assert_eq!(kept, vec![70, 80, 90, 100, 110], "the oldest gave way");
    }

    #[test]
    fn large_responses_are_bounded_by_bytes_too() {
        let mut w = unreachable(1_000_000);
        let mut stats = WriteStats::default();
        let big = 4 << 20;
        for i in 0..40 {
            w.write(&[record(i, big)], Stamp(0), 0, &mut stats);
        }
        assert!(w.backlog_bytes <= MAX_BACKLOG_BYTES, "{} bytes kept", w.backlog_bytes);
        assert_eq!(w.backlog() as u64 + stats.writeback_dropped, 40);
        assert!(w.backlog() >= MAX_BACKLOG_BYTES / (big + 100) - 1);
        let total: usize = w.backlog.iter().map(record_bytes).sum();
        assert_eq!(total, w.backlog_bytes, "the byte count follows the records");
    }
}
