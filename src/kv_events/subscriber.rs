//! Subscriptions to the engines' KV cache events, run by the response
//! processes: one task per backend with `kv_events` set, in the response
//! process `j` of `m` that follows the backends `j, j + m, ...` of the
//! configuration's list, and one per engine registered at run time
//! (discovery, the admin API) whose registration carries a KV events port
//! on its host, in the response process `j` that follows the server-table
//! slots `j, j + m, ...` ([`registered_targets`]).
//!
//! One subscription ([`follow`]):
//!
//! 1. waits for the backend's registration in the server table, and reads
//!    the chain roots its blocks hash from ([`chain_roots`]: the `[[model]]`
//!    pools that list it, else the models its `/v1/models` serves);
//! 2. connects a SUB socket to the engine's endpoint (and a DEALER to its
//!    replay endpoint, if it has one), forgets what the table held for the
//!    server, and asks for a replay from sequence 0: a replay that starts
//!    at 0 (or is empty: nothing published yet) makes the table
//!    [`KvEventsSync::Complete`]; otherwise it stays `Partial` until the
//!    engine clears its cache or restarts;
//! 3. applies each batch in sequence ([`Follower`]); a gap is filled from
//!    the replay socket when it can be, and otherwise leaves the table
//!    `Partial`; a sequence starting over at 0 is a restarted engine
//!    (empty cache: the server's entries go, the table is complete);
//! 4. starts over at 1. when the engine's connection drops, or the
//!    backend's registration changes (it was removed, or re-registered).
//!
//! The server table's KV-events word says at every moment how far the
//! confirmed table follows the engine (`None` while no subscription runs),
//! which is what the precise prefix source reads ([`super::precise`]).

use std::sync::Arc;
use std::time::Duration;

use super::engine_blocks::Skip;
use super::follower::{Applied, ChainRoots, Follower, Sequence, Step};
use super::wire::{EventBatch, WireError, decode_batch, split_message};
use super::zmtp::{Connection, SocketType, ZmtpError};
use crate::config::{BackendConfig, ServeConfig};
use crate::metrics::{KV_EVENT_LAG, Metrics};
use crate::prefix::blocks::BlockHasher;
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use shm_layout::{KvEventsSync, Segment, ServerRef, ServerState, Tables};

/// How long a connection, or a replay's answer, may take.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// The pause before a subscription starts over.
const RETRY: Duration = Duration::from_millis(500);
/// How often a subscription checks that its server is still registered.
const CHECK: Duration = Duration::from_millis(500);
/// The sequence number a replay ends with (-1 as 8 big-endian bytes).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// One backend's events to follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The backend's URL as the server table has it.
    pub url: String,
    /// The engine's PUB endpoint.
    pub events: String,
    /// Its replay (ROUTER) endpoint.
    pub replay: Option<String>,
    /// The roots its blocks hash from, if the configuration names them
    /// (`[[model]]` pools); else read from the engine's `/v1/models`.
    pub roots: Option<ChainRoots>,
}

/// The backends response process `index` of `responders` follows in
/// `config`, with the chain roots its `[[model]]` pools give (the seed:
/// `seed`).
pub fn targets(config: &ServeConfig, index: usize, responders: usize, seed: u64) -> Vec<Target> {
    config
        .backends
        .iter()
        .enumerate()
        .filter(|(i, _)| i % responders.max(1) == index)
        .filter_map(|(_, b)| {
            Some(Target {
                url: b.server_address().ok()?,
                events: b.kv_events.clone()?,
                replay: b.kv_events_replay.clone(),
                roots: configured_roots(config, b, seed),
            })
        })
        .collect()
}

/// The engines registered at run time (by discovery or the admin API,
/// not in the configuration) whose registration carries a KV events port
/// ([`shm_layout::EngineSettings::kv_events_port`], on the engine's own
/// host) that response process `index` of `responders` follows (those in
/// slots `index, index + responders, ...`), with the chain roots of the
/// pool their registration names.
pub fn registered_targets(
    tables: &Tables<'_>,
    config: &ServeConfig,
    index: usize,
    responders: usize,
    seed: u64,
) -> Vec<Target> {
    let configured: Vec<String> = config.backends.iter().filter_map(|b| b.server_address().ok()).collect();
    tables
        .servers
        .servers()
        .filter(|s| usize::from(s.server.slot) % responders.max(1) == index && !configured.contains(&s.address))
        .filter_map(|s| {
            let settings = tables.servers.settings(s.server);
            let port = settings.kv_events_port?;
            let url: crate::config::BackendUrl = s.address.parse().ok()?;
            let host = url.bracketed_host();
            let pool = tables.servers.pool_of(s.server);
            let roots = if pool.is_none() {
                configured_roots(config, &BackendConfig::new(s.address.clone()), seed)
            } else {
                roots_of(config, seed, |m| {
                    shm_layout::PoolTag::of(m.base.as_deref().unwrap_or(&m.name)) == pool
                })
            };
            Some(Target {
                url: s.address.clone(),
                events: format!("tcp://{host}:{port}"),
                replay: settings.kv_replay_port.map(|p| format!("tcp://{host}:{p}")),
                roots,
            })
        })
        .collect()
}

/// The chain roots of `backend`'s blocks from the `[[model]]` pools that
/// list it (by name or URL): the base model's pool and its adapters'.
/// `None` without `[[model]]` tables (the implicit pool roots a request's
/// chain at whatever model it names: the engine's own names are asked).
fn configured_roots(config: &ServeConfig, backend: &BackendConfig, seed: u64) -> Option<ChainRoots> {
    let url = backend.server_address().ok()?;
    let lists_it = |names: &[String]| {
        names
            .iter()
            .any(|n| *n == backend.display_name() || *n == backend.url || *n == url)
    };
    roots_of(config, seed, |m| lists_it(&m.backends))
}

/// The chain roots of the `[[model]]` pools `serves` takes: the base
/// model's and its adapters'. `None` without `[[model]]` tables.
fn roots_of(
    config: &ServeConfig,
    seed: u64,
    serves: impl Fn(&crate::config::ModelConfig) -> bool,
) -> Option<ChainRoots> {
    if config.models.is_empty() {
        return None;
    }
    // An adapter's blocks are its base model's size.
    let block_size = |m: &crate::config::ModelConfig| {
        let base = m
            .base
            .as_ref()
            .and_then(|b| config.models.iter().find(|x| x.name == *b));
        base.unwrap_or(m).block_size.unwrap_or(config.block_size)
    };
    let mut roots = ChainRoots::default();
    for model in config.models.iter().filter(|m| serves(m)) {
        let hasher = BlockHasher::new(BlockHasher::root_for(&model.name, seed), block_size(model));
        match &model.base {
            None if roots.base.is_none() => roots.base = Some(hasher),
            None => {}
            Some(_) => {
                roots.adapters.insert(model.name.clone(), hasher);
            }
        }
    }
    Some(roots)
}

/// The chain roots of an engine in the implicit pool, from its
/// `/v1/models` (vLLM's, SGLang's and the simulator's: adapters are the
/// entries with a `parent`): a request names the engine's model, so its
/// chain is rooted at that name.
fn served_roots(body: &[u8], block_size: usize, seed: u64) -> Option<ChainRoots> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let mut roots = ChainRoots::default();
    for m in v.get("data")?.as_array()? {
        let Some(id) = m.get("id").and_then(|i| i.as_str()) else {
            continue;
        };
        let hasher = BlockHasher::new(BlockHasher::root_for(id, seed), block_size);
        match m.get("parent").filter(|p| !p.is_null()) {
            None if roots.base.is_none() => roots.base = Some(hasher),
            None => {}
            Some(_) => {
                roots.adapters.insert(id.to_owned(), hasher);
            }
        }
    }
    roots.base.is_some().then_some(roots)
}

/// Where a subscription gets what it needs besides its target.
#[derive(Clone)]
pub struct Context {
    /// The segment whose confirmed table it writes.
    pub segment: Arc<Segment>,
    /// Its process's registry slot (its metrics block).
    pub slot: u16,
    /// The implicit pool's block size (`block_size`).
    pub block_size: usize,
    /// The chain seed: the segment's, or the Redis namespace's.
    pub seed: u64,
}

/// The current registration of the server at `url`, if it is up or
/// draining... or down: a down engine's events still say what it holds.
fn registration(tables: &Tables<'_>, url: &str) -> Option<ServerRef> {
    tables
        .servers
        .servers()
        .find(|s| s.address == url && s.state != ServerState::Configuring)
        .map(|s| s.server)
}

/// Follows `target`'s engine until the task is dropped (see the module
/// docs). Its server's KV-events word is cleared when it stops.
pub async fn follow(target: Target, ctx: Context) {
    let _clear = ClearOnDrop {
        segment: ctx.segment.clone(),
        url: target.url.clone(),
    };
    let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut last_error = String::new();
    loop {
        match subscribe(&target, &ctx, &client).await {
            Ok(()) => last_error.clear(),
            Err(e) => {
                // Said once while the same reason lasts.
                let e = e.to_string();
                if e != last_error {
                    tracing::warn!(backend = %target.url, events = %target.events, "KV events of {}: {e}; retrying", target.url);
                    last_error = e;
                }
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Clears the server's KV-events word when its subscription task ends.
struct ClearOnDrop {
    segment: Arc<Segment>,
    url: String,
}

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        let tables = self.segment.tables();
        if let Some(server) = registration(&tables, &self.url) {
            tables.servers.set_kv_events(server, None);
        }
    }
}

/// One subscription, from connecting to its end: `Ok` when the
/// registration changed, an error when the engine cannot be followed now.
async fn subscribe(
    target: &Target,
    ctx: &Context,
    client: &Client<HttpConnector, Empty<Bytes>>,
) -> Result<(), FollowError> {
    let tables = ctx.segment.tables();
    let server = registration(&tables, &target.url).ok_or(FollowError::NotRegistered)?;
    let roots = match &target.roots {
        Some(roots) => roots.clone(),
        None => {
            let url = format!("{}/v1/models", target.url);
            let (status, body) = crate::health::checker::get(client, &url, 1 << 20, IO_TIMEOUT)
                .await
                .map_err(FollowError::Models)?;
            if !status.is_success() {
                return Err(FollowError::Answered { url, status });
            }
            served_roots(&body, ctx.block_size, ctx.seed).ok_or(FollowError::NoModel(url))?
        }
    };
    let mut sub = connect(&target.events, SocketType::Sub).await?;
    sub.subscribe(b"").await.map_err(FollowError::Subscribe)?;
    let mut replay = match &target.replay {
        Some(at) => Some(connect(at, SocketType::Dealer).await?),
        None => None,
    };
    let mut stream = Stream {
        told_block_size: false,
        follower: Follower::new(server, roots),
        sequence: Sequence::default(),
        tables: &tables,
        metrics: Metrics::new(tables.stats, ctx.slot),
        segment: &ctx.segment,
    };
    stream.follower.reset(&tables, KvEventsSync::Partial);
    // What the engine published before: from its start, if it still has it.
    if let Some(dealer) = &mut replay {
        match fetch_replay(dealer, 0).await {
            Ok(batches) => {
                // From the engine's first batch (or none yet: the first
                // live one must then be 0), the table is the engine's cache.
                if batches.first().is_none_or(|(seq, _)| *seq == 0) {
                    stream.follower.reset(&tables, KvEventsSync::Complete);
                    stream.sequence.expect(0);
                }
                for (seq, payload) in batches {
                    stream.replayed(seq, &payload).await;
                }
            }
            Err(e) => tracing::warn!(backend = %target.url, "KV events of {}: no replay ({e})", target.url),
        }
    }
    stream.publish();
    tracing::info!(
        backend = %target.url,
        events = %target.events,
        sync = stream.follower.sync().name(),
        "following the KV events of {} ({})",
        target.url,
        stream.follower.sync().name()
    );
    let mut check = tokio::time::interval(CHECK);
    loop {
        tokio::select! {
            message = sub.recv() => {
                // A closed or broken connection: the engine stopped or
                // restarted; start over.
                let frames = message.map_err(FollowError::Stopped)?;
                let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
                let Ok((seq, payload)) = split_message(&parts) else { continue };
                if stream.live(seq, payload, replay.as_mut()).await == Replay::Broken {
                    // Its answers may still come: a later replay would
                    // read them. Gaps from now on leave the table partial.
                    replay = None;
                }
            }
            _ = check.tick() => {
                if registration(&tables, &target.url) != Some(server) {
                    tables.servers.set_kv_events(server, None);
                    return Ok(());
                }
            }
        }
    }
}

async fn connect(endpoint: &str, kind: SocketType) -> Result<Connection, FollowError> {
    match tokio::time::timeout(IO_TIMEOUT, Connection::connect(endpoint, kind)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(error)) => Err(FollowError::Connect {
            endpoint: endpoint.to_owned(),
            error,
        }),
        Err(_) => Err(FollowError::ConnectTimeout {
            endpoint: endpoint.to_owned(),
        }),
    }
}

/// Why an engine's events cannot be followed now (logged once while it
/// lasts; the subscription is tried again).
#[derive(Debug, thiserror::Error)]
enum FollowError {
    #[error("not registered (yet)")]
    NotRegistered,
    #[error("reading its models: {0}")]
    Models(crate::health::checker::CheckError),
    #[error("{url} answered {status}")]
    Answered { url: String, status: http::StatusCode },
    #[error("{0} lists no model")]
    NoModel(String),
    #[error("cannot connect to {endpoint}: {error}")]
    Connect { endpoint: String, error: ZmtpError },
    #[error("cannot connect to {endpoint} within {} s", IO_TIMEOUT.as_secs())]
    ConnectTimeout { endpoint: String },
    #[error("subscribing: {0}")]
    Subscribe(ZmtpError),
    #[error("the engine's events stopped: {0}")]
    Stopped(ZmtpError),
}

/// Why a replay of an engine's past batches failed (the table then stays
/// partial until a full replay or the engine's restart).
#[derive(Debug, thiserror::Error)]
enum ReplayError {
    #[error("asking a replay: {0}")]
    Ask(ZmtpError),
    #[error("the replay did not end in time")]
    Timeout,
    #[error("reading the replay: {0}")]
    Read(ZmtpError),
    #[error("a replay message of fewer than 2 frames")]
    ShortMessage,
    #[error("a replay sequence of other than 8 bytes")]
    BadSequence,
    #[error("a replay of over {MAX_REPLAY_BATCHES} batches or {} MiB", MAX_REPLAY_BYTES >> 20)]
    TooLong,
}

/// Payloads larger than this are decoded on the blocking pool: one
/// engine's large batch does not hold up the others' subscriptions on the
/// response process's event thread.
const BLOCKING_DECODE_BYTES: usize = 256 << 10;

/// Most bytes of batches one replay collects (an engine's ring holds a few
/// thousand batches of kilobytes); a longer replay is refused, and the
/// table stays partial.
const MAX_REPLAY_BYTES: usize = 64 << 20;

/// Most batches one replay collects.
const MAX_REPLAY_BATCHES: usize = 1 << 16;

/// `payload` decoded, on the blocking pool when large.
async fn decode(payload: &[u8]) -> Result<EventBatch, WireError> {
    if payload.len() <= BLOCKING_DECODE_BYTES {
        return decode_batch(payload);
    }
    let owned = payload.to_vec();
    tokio::task::spawn_blocking(move || decode_batch(&owned))
        .await
        .unwrap_or_else(|e| Err(WireError::Msgpack(format!("the decoding task failed: {e}"))))
}

/// The batches the engine's replay socket still has from `from` on (at
/// most [`MAX_REPLAY_BATCHES`] of [`MAX_REPLAY_BYTES`] in all).
async fn fetch_replay(dealer: &mut Connection, from: u64) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    dealer
        .send(&[b"", &from.to_be_bytes()])
        .await
        .map_err(ReplayError::Ask)?;
    let mut batches = Vec::new();
    let mut bytes = 0;
    loop {
        let frames = tokio::time::timeout(IO_TIMEOUT, dealer.recv())
            .await
            .map_err(|_| ReplayError::Timeout)?
            .map_err(ReplayError::Read)?;
        // [""] seq payload (vLLM), or [""] topic seq payload.
        let [.., seq, payload] = frames.as_slice() else {
            return Err(ReplayError::ShortMessage);
        };
        if seq.as_ref() == END_SEQ {
            return Ok(batches);
        }
        let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| ReplayError::BadSequence)?;
        bytes += payload.len();
        if bytes > MAX_REPLAY_BYTES || batches.len() >= MAX_REPLAY_BATCHES {
            return Err(ReplayError::TooLong);
        }
        batches.push((u64::from_be_bytes(seq), payload.clone()));
    }
}

/// One subscription's state while it runs.
struct Stream<'a> {
    /// Whether a block-size mismatch was logged.
    told_block_size: bool,
    follower: Follower,
    sequence: Sequence,
    tables: &'a Tables<'a>,
    metrics: Metrics<'a>,
    segment: &'a Segment,
}

impl Stream<'_> {
    /// Says in the server table how far the table follows the engine.
    fn publish(&self) {
        self.tables
            .servers
            .set_kv_events(self.follower.server(), Some(self.follower.sync()));
    }

    fn apply(&mut self, decoded: Result<EventBatch, WireError>) -> Option<f64> {
        let batch = match decoded {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!("an undecodable KV event batch: {e}");
                self.follower.lost_events();
                return None;
            }
        };
        let done: Applied = self.follower.apply(&batch, self.tables, self.segment.clock().stamp());
        self.metrics.kv_events(&done);
        match self.follower.take_skip() {
            // A configuration error, not a lost event: said once, loudly.
            Some(skip @ Skip::BlockSize { engine, gateway }) if !self.told_block_size => {
                self.told_block_size = true;
                tracing::warn!(
                    server = self.follower.server().slot,
                    engine_block_size = engine,
                    gateway_block_size = gateway,
                    "KV events of server {}: {skip}; none of its blocks can match a prompt's chain: set the gateway's block_size (or the model's) to {engine}, as the engine's --block-size",
                    self.follower.server().slot
                );
            }
            Some(skip) => tracing::debug!(server = self.follower.server().slot, "a KV event not applied: {skip}"),
            None => {}
        }
        Some(batch.ts)
    }

    /// A batch from the replay socket (in order, possibly overlapping).
    async fn replayed(&mut self, seq: u64, payload: &[u8]) {
        match self.sequence.see(seq) {
            Step::Next | Step::Gap { .. } => {}
            Step::Duplicate | Step::Restarted => return,
        }
        self.apply(decode(payload).await);
        self.sequence.applied(seq);
    }

    /// A batch from the live stream; says whether the replay connection
    /// failed.
    async fn live(&mut self, seq: u64, payload: &[u8], replay: Option<&mut Connection>) -> Replay {
        let before = self.follower.sync();
        let mut state = Replay::Usable;
        match self.sequence.see(seq) {
            Step::Duplicate => return state,
            Step::Next if self.sequence.next().is_none() && seq != 0 => {
                // Joined a running stream without its history.
                self.follower.lost_events();
            }
            Step::Next if self.sequence.next().is_none() => {
                // The first batch the engine ever published.
                self.follower.reset(self.tables, KvEventsSync::Complete);
            }
            Step::Next => {}
            Step::Restarted => self.follower.reset(self.tables, KvEventsSync::Complete),
            Step::Gap { from, to } => {
                let filled = match replay {
                    Some(dealer) => match fetch_replay(dealer, from).await {
                        Ok(batches) => {
                            for (s, p) in batches.into_iter().filter(|(s, _)| *s < to) {
                                self.replayed(s, &p).await;
                            }
                            self.sequence.next() == Some(to)
                        }
                        Err(e) => {
                            tracing::warn!(
                                server = self.follower.server().slot,
                                "KV events of server {}: the replay failed ({e}); gaps will leave its table partial",
                                self.follower.server().slot
                            );
                            state = Replay::Broken;
                            false
                        }
                    },
                    None => false,
                };
                self.metrics.kv_event_gap(filled);
                if !filled {
                    self.follower.lost_events();
                }
            }
        }
        if let Some(ts) = self.apply(decode(payload).await) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.observe(KV_EVENT_LAG, now - ts);
        }
        self.sequence.applied(seq);
        if self.follower.sync() != before {
            tracing::info!(
                server = self.follower.server().slot,
                "the confirmed prefixes of server {} are {} now",
                self.follower.server().slot,
                self.follower.sync().name()
            );
        }
        self.publish();
        state
    }
}

/// Whether a subscription's replay connection still serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replay {
    /// It answered, or was not asked.
    Usable,
    /// A replay failed: its connection is given up.
    Broken,
}

/// What a response process's subscriptions need to run ([`run`]).
pub struct Followers {
    /// The segment and the process's registry slot.
    pub segment: Arc<Segment>,
    /// The process's registry slot.
    pub slot: u16,
    /// It is response process `index` of `responders`.
    pub index: usize,
    /// How many there are.
    pub responders: usize,
    /// The configuration as it is now (read again after each reload the
    /// supervisor publishes); `None` when it does not resolve.
    pub resolve: Box<dyn Fn() -> Option<ServeConfig> + Send>,
}

/// Runs the subscriptions of one response process until `stop` is set:
/// those its configuration gives it ([`targets`]), started, stopped and
/// restarted as reloads change them. Blocks; run it on a thread of its own.
pub fn run(followers: Followers, stop: &std::sync::atomic::AtomicBool) -> std::io::Result<()> {
    use std::sync::atomic::Ordering;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let tables = followers.segment.tables();
        let mut running: Vec<(Target, tokio::task::JoinHandle<()>)> = Vec::new();
        let mut revision = None;
        let mut current: Option<(ServeConfig, u64)> = None;
        let mut tick = tokio::time::interval(CHECK);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let now = tables.registry.get(shm_layout::SUPERVISOR_SLOT).map(|p| p.revision);
            if revision != Some(now)
                && let Some(config) = (followers.resolve)()
                && let Some(seed) = crate::store::chain_seed_for(&config, &followers.segment).await
            {
                revision = Some(now);
                current = Some((config, seed));
            }
            // Engines registered at run time come and go between reloads:
            // the server table is looked at every time.
            let Some((config, seed)) = &current else { continue };
            let seed = *seed;
            let mut wanted = targets(config, followers.index, followers.responders, seed);
            wanted.extend(registered_targets(
                &tables,
                config,
                followers.index,
                followers.responders,
                seed,
            ));
            running.retain(|(t, task)| {
                let keep = wanted.contains(t) && !task.is_finished();
                if !keep {
                    task.abort();
                }
                keep
            });
            for target in wanted {
                if running.iter().any(|(t, _)| *t == target) {
                    continue;
                }
                let ctx = Context {
                    segment: followers.segment.clone(),
                    slot: followers.slot,
                    block_size: config.block_size,
                    seed,
                };
                let task = tokio::spawn(follow(target.clone(), ctx));
                running.push((target, task));
            }
        }
        for (_, task) in running {
            task.abort();
            // Its guard clears the server's KV-events word when it drops.
            let _ = task.await;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn roots_come_from_the_pools_that_list_the_backend_or_from_the_engine() {
        let models = br#"{"object":"list","data":[
            {"id":"Qwen/Qwen3-8B","object":"model","parent":null},
            {"id":"sql","object":"model","parent":"Qwen/Qwen3-8B"}]}"#;
        let r = served_roots(models, 16, 7).unwrap();
        assert_eq!(
            r.base,
            Some(BlockHasher::new(BlockHasher::root_for("Qwen/Qwen3-8B", 7), 16))
        );
        assert_eq!(r.adapters["sql"], BlockHasher::new(BlockHasher::root_for("sql", 7), 16));
        assert_eq!(served_roots(br#"{"data":[]}"#, 16, 7), None);

        let mut config = ServeConfig {
            backends: vec![
                BackendConfig {
                    kv_events: Some("tcp://a:5557".into()),
                    ..BackendConfig::new("http://a:8000")
                },
                BackendConfig::new("http://b:8000"),
                BackendConfig {
                    kv_events: Some("tcp://c:5557".into()),
                    kv_events_replay: Some("tcp://c:5558".into()),
                    ..BackendConfig::new("http://c:8000")
                },
            ],
            ..ServeConfig::default()
        };
        let all = targets(&config, 0, 1, 7);
        assert_eq!(
            all.iter()
                .map(|t| (t.url.as_str(), t.replay.is_some()))
                .collect::<Vec<_>>(),
            [("http://a:8000", false), ("http://c:8000", true)]
        );
        assert!(
            all.iter().all(|t| t.roots.is_none()),
            "the implicit pool asks the engines"
        );
        // Two response processes share the backends by position.
        assert_eq!(targets(&config, 1, 2, 7), []);
        assert_eq!(targets(&config, 0, 2, 7).len(), 2);
        config.models = vec![
            ModelConfig {
                block_size: Some(32),
                ..ModelConfig::new("big", &["http://a:8000"])
            },
            ModelConfig {
                base: Some("big".into()),
                ..ModelConfig::new("big-sql", &["http://a:8000"])
            },
        ];
        let roots = targets(&config, 0, 1, 7)[0].roots.clone().unwrap();
        assert_eq!(roots.base, Some(BlockHasher::new(BlockHasher::root_for("big", 7), 32)));
        assert_eq!(
            roots.adapters["big-sql"],
            BlockHasher::new(BlockHasher::root_for("big-sql", 7), 32),
            "an adapter's blocks are its base's size"
        );
    }
}
