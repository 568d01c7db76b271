//! The measuring of `semlb bench dispatch`: every request tokenized and
//! hashed once ([`prepare`]), then replayed in order on each store, shm
//! first and then Redis in each [`RedisMode`] ([`measure`]), with each
//! stage of each request timed apart.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use semlb::prefix::blocks::BlockHasher;
use semlb::store::redis::client::{RedisStore, WriteItem};
use serde_json::Value;
use shm_layout::{ResponseKey, ServerRef};

use super::{DispatchArgs, FAKE_SERVERS, REDIS_TTL, RedisNamespace, ShmGuard, Workload, full_chain, response_key};
use crate::redis_server::BenchRedis;

/// One request, prepared once: its chains and key, and the time its
/// tokenization and hashing took.
pub(super) struct Prepared {
    chain: Vec<u64>,
    full: Vec<u64>,
    key: ResponseKey,
    answer: Vec<u8>,
    /// Prompt tokens.
    pub(super) tokens: usize,
    /// Time the tokenization took, µs.
    pub(super) tokenize_us: f64,
    /// Time the hashing took, µs.
    pub(super) hash_us: f64,
}

impl Prepared {
    /// Blocks of the prompt's chain.
    pub(super) fn prompt_blocks(&self) -> usize {
        self.chain.len()
    }

    /// Blocks of the prompt + answer chain.
    pub(super) fn full_blocks(&self) -> usize {
        self.full.len()
    }
}

/// Per-request stage latencies (µs) of one store.
#[derive(Debug, Default)]
pub(super) struct Stages {
    /// The response-cache lookup.
    pub(super) cache: Vec<f64>,
    /// The longest-prefix match.
    pub(super) lpm: Vec<f64>,
    /// The write-back.
    pub(super) update: Vec<f64>,
    /// Redis round trips of the recorded requests.
    pub(super) round_trips: u64,
    /// Cache lookup and match were one pipelined round trip, timed together
    /// in `lpm` (`cache` holds zeros).
    pub(super) fused: bool,
}

impl Stages {
    /// Records request `i`'s stage times, unless it is one of the first
    /// `warmup`.
    fn record(&mut self, i: usize, warmup: usize, cache: Duration, lpm: Duration, update: Duration) {
        if i >= warmup {
            self.cache.push(us(cache));
            self.lpm.push(us(lpm));
            self.update.push(us(update));
        }
    }
}

/// What the passes over the stores measured.
pub(super) struct Passes {
    /// Each store's name and stage latencies, shm first.
    pub(super) rows: Vec<(&'static str, Stages)>,
    /// The report's `redis` object (`null` without Redis).
    pub(super) redis_meta: Value,
    /// Keys of the run's Redis namespace deleted at the end (`None`
    /// without Redis).
    pub(super) deleted: Option<u64>,
}

/// `d` in µs.
fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Tokenizes and hashes every request once (the same for every store),
/// timing both.
pub(super) fn prepare(workload: &Workload, hasher: &BlockHasher, bar: &indicatif::ProgressBar) -> Vec<Prepared> {
    let mut prepared = Vec::with_capacity(workload.turns.len());
    for turn in &workload.turns {
        let t0 = Instant::now();
        let tokens = workload.tokenizer.encode(&turn.prompt);
        let tokenize_us = us(t0.elapsed());
        let t1 = Instant::now();
        let mut chain = Vec::new();
        hasher.chain(&tokens, &mut chain);
        let hash_us = us(t1.elapsed());
        let answer_tokens = workload.tokenizer.encode(&turn.answer);
        let full = full_chain(hasher, &tokens, &answer_tokens, &chain);
        prepared.push(Prepared {
            chain,
            full,
            key: response_key(&turn.prompt),
            answer: turn.answer.as_bytes().to_vec(),
            tokens: tokens.len(),
            tokenize_us,
            hash_us,
        });
        bar.inc(1);
    }
    prepared
}

/// Replays `prepared` on a throw-away shm segment, then (with `redis`) in
/// each [`RedisMode`] in a namespace of the run's own; both stores are
/// removed at the end, `redis` is stopped if private.
pub(super) fn measure(
    args: &DispatchArgs,
    redis: Option<BenchRedis>,
    prepared: &[Prepared],
    warmup: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Passes> {
    bar.set_message("dispatch: shm");
    let (shm, servers) = ShmGuard::create("dispatch")?;
    let mut rows: Vec<(&str, Stages)> = vec![("shm", run_shm(&shm, &servers, prepared, warmup, bar))];
    let mut redis_meta = Value::Null;
    let mut namespace = None;
    if let Some(r) = &redis {
        let ns = RedisNamespace::new(r.url(), "dispatch");
        redis_meta = super::redis_meta(r.url(), args.common.redis_url.is_none(), &ns);
        for (name, mode) in [
            ("redis-1rt", RedisMode::OneTrip),
            ("redis-naive", RedisMode::Naive),
            ("redis-pipelined", RedisMode::Pipelined),
        ] {
            bar.set_message(format!("dispatch: {name}"));
            let mut store = ns.store(name)?;
            let st = run_redis(&mut store, mode, prepared, warmup, bar).with_context(|| format!("{name} pass"))?;
            rows.push((name, st));
        }
        namespace = Some(ns);
    }
    bar.finish_and_clear();
    let deleted = match namespace.take() {
        Some(ns) => {
            let n = ns
                .clear()
                .with_context(|| format!("cannot delete Redis namespace {}", ns.name()))?;
            Some(n)
        }
        None => None,
    };
    drop(redis);
    drop(shm);
    Ok(Passes {
        rows,
        redis_meta,
        deleted,
    })
}

/// The server a write-back is for: `best` if any, else the i-th in turn.
fn pick(servers: &[ServerRef], best: Option<u16>, i: usize) -> ServerRef {
    best.and_then(|slot| servers.iter().copied().find(|s| s.slot == slot))
        .unwrap_or(servers[i % servers.len()])
}

/// The shm pass: each request's cache lookup, match and write-back on
/// the tables of `shm`.
fn run_shm(
    shm: &ShmGuard,
    servers: &[ServerRef],
    prepared: &[Prepared],
    warmup: usize,
    bar: &indicatif::ProgressBar,
) -> Stages {
    let seg = shm.segment();
    let t = seg.tables();
    let clock = seg.clock();
    let mut st = Stages::default();
    let mut buf = Vec::new();
    let mut entry = Vec::new();
    for (i, r) in prepared.iter().enumerate() {
        let t0 = Instant::now();
        std::hint::black_box(t.responses.get_into(r.key, &mut buf).is_some());
        let cache = t0.elapsed();
        let t1 = Instant::now();
        let m = t.prefix.longest_prefix_match(&r.chain, |s| t.servers.is_live(s));
        let lpm = t1.elapsed();
        let server = pick(servers, m.best().map(|(tag, _)| tag.slot()), i);
        let t2 = Instant::now();
        t.prefix.insert_chain(&r.full, server, clock.stamp());
        semlb::response_cache::encode_entry(clock.now_ms(), &r.answer, &mut entry);
        let _ = std::hint::black_box(t.responses.put(r.key, &entry));
        let update = t2.elapsed();
        st.record(i, warmup, cache, lpm, update);
        bar.inc(1);
    }
    st
}

/// How a Redis pass reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RedisMode {
    /// Cache `GET`, then the longest-prefix script: a round trip each.
    OneTrip,
    /// Cache `GET`, then one `HGETALL` per block (the paper's baseline).
    Naive,
    /// Cache, load and prefix in one pipeline (the gateway's lookup).
    Pipelined,
}

/// A Redis pass in `mode` on `store`: each request's cache lookup and
/// match (as `mode` reads), and its write-back in one pipeline.
fn run_redis(
    store: &mut RedisStore,
    mode: RedisMode,
    prepared: &[Prepared],
    warmup: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Stages> {
    let servers: Vec<u16> = (0..FAKE_SERVERS as u16).collect();
    let mut st = Stages::default();
    let mut rt_at_warmup = store.round_trips();
    for (i, r) in prepared.iter().enumerate() {
        if i == warmup {
            rt_at_warmup = store.round_trips();
        }
        let (cache, lpm, m) = if mode == RedisMode::Pipelined {
            let t0 = Instant::now();
            let found = store.dispatch_lookup(Some(r.key.0), &r.chain, false)?;
            (Duration::ZERO, t0.elapsed(), found.prefix)
        } else {
            let t0 = Instant::now();
            std::hint::black_box(store.get_response(r.key.0)?);
            let cache = t0.elapsed();
            let t1 = Instant::now();
            let m = if mode == RedisMode::Naive {
                store.longest_prefix_match_naive(&r.chain)?
            } else {
                store.longest_prefix_match(&r.chain)?
            };
            (cache, t1.elapsed(), m)
        };
        let slot = m
            .iter()
            .max_by_key(|(_, blocks)| *blocks)
            .map_or(servers[i % servers.len()], |(s, _)| *s as u16);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let t2 = Instant::now();
        // A response process's write-back: one pipeline.
        let item = WriteItem {
            server: u64::from(slot),
            blocks: &r.full,
            response: Some((r.key.0, &r.answer, REDIS_TTL)),
        };
        store.write_back(&[item], 1, now)?;
        let update = t2.elapsed();
        st.record(i, warmup, cache, lpm, update);
        bar.inc(1);
    }
    st.round_trips = store.round_trips() - rt_at_warmup;
    st.fused = mode == RedisMode::Pipelined;
    Ok(st)
}
