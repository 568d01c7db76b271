//! Criterion benches of one routing decision's reads on each store, through
//! the interfaces the gateway uses: [`ShmStore::lookup_now`] (the shm
//! store's whole lookup: response cache, prefix match, candidates with
//! load) against [`RedisStore::dispatch_lookup`] (the same reads from a
//! private loopback `redis-server`: one pipeline, or the naive walk of one
//! round trip per block), and a response process's write-back of one record
//! on each; and a request's rate-limit check on each
//! ([`RoutingStore::take_limits`]: three buckets, a tenant's requests and
//! tokens and its model's tokens, through the async interface the
//! dispatcher awaits; on Redis one script round trip). The tables hold 4 096 warmed 16-block conversations over four
//! servers; lookups draw from them, so prefixes match. Without
//! `redis-server` the Redis benches are skipped with a message.
//!
//! `cargo bench --bench stores`. The full report with percentiles,
//! tokenization, scaling and the gateway end to end is `semlb bench`;
//! nothing here asserts a speed.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use semlb::store::WriteBack;
use semlb::store::WriteStats;
use semlb::store::redis::RedisRouting;
use semlb::store::redis::client::{RedisStore, WriteItem};
use semlb::store::shm::{ShmStore, ShmWriteBack};
use semlb::store::{LookupRequest, RoutingStore};
use semlb::tenancy::rate_limit::{RateLimits, RequestBuckets, Scope};
use shm_layout::{Completion, LayoutPlan, ResponseKey, Segment, ServerRef, Stamp};

use semlb_test_support::redis::RedisServer;
use semlb_test_support::segment::{chain, key, servers};

/// Removes the named segment when dropped.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = Segment::remove(&self.0);
    }
}

const CONVERSATIONS: u64 = 4096;
const BLOCKS: usize = 16;

/// Record `n` as Redis writes it back: on one of four servers, its answer
/// cached for ten minutes.
fn write_item(n: usize, r: &Completion) -> WriteItem<'_> {
    WriteItem {
        server: (n % 4) as u64,
        blocks: &r.full_blocks,
        response: r
            .response_key
            .map(|k| (k.0, r.response.as_slice(), Duration::from_secs(600))),
    }
}

fn record(server: ServerRef, i: u64) -> Completion {
    let full = chain(i, BLOCKS);
    Completion {
        server: Some(server),
        prompt_tokens: 200,
        output_tokens: 56,
        prompt_blocks: full[..BLOCKS - 4].to_vec(),
        full_blocks: full,
        continuation: None,
        response_key: Some(ResponseKey(u128::from(key(i)))),
        response: vec![b'a'; 1024],
        prediction: None,
        timing: None,
    }
}

fn stores(c: &mut Criterion) {
    let name = format!("semlb-bench-stores-{}", std::process::id());
    let _ = Segment::remove(&name);
    let plan = LayoutPlan::for_size(64 << 20).expect("plan");
    let segment = Arc::new(Segment::create(&name, &plan).expect("create bench segment"));
    let _removed = Removed(name);
    let srv = servers(&segment, 4);
    let shm = ShmStore::new(segment.clone(), 1, 600_000);
    let records: Vec<Completion> = (0..CONVERSATIONS).map(|i| record(srv[(i % 4) as usize], i)).collect();
    let mut sink = ShmWriteBack::new(segment.tables());
    let mut stats = WriteStats::default();
    sink.write(&records, Stamp(1), segment.clock().now_ms(), &mut stats);
    let chains: Vec<Vec<u64>> = (0..CONVERSATIONS).map(|i| chain(i, BLOCKS)).collect();

    let mut g = c.benchmark_group("decision_reads");
    let mut candidates = Vec::new();
    g.bench_function("shm_candidates_only", |b| {
        b.iter(|| {
            semlb::routing::live_candidates(&segment.tables(), &mut candidates);
            black_box(candidates.len())
        })
    });
    let mut i = 0usize;
    g.bench_function("shm", |b| {
        b.iter(|| {
            i = (i + 1) % chains.len();
            black_box(shm.lookup_now(LookupRequest {
                members: semlb::routing::Members::all(),
                leg: semlb::routing::Leg::Request,
                response_key: records[i].response_key,
                chain: &chains[i],
                exclude: &[],
                stale_after_ms: u64::MAX,
                continuation: None,
                precise: None,
                affinity: None,
            }))
        })
    });
    let redis = RedisServer::start();
    let mut store = redis.as_ref().map(|r| {
        let mut s = RedisStore::connect(&r.url(), "bench", Duration::from_secs(3600)).expect("connect");
        for (n, r) in records.iter().enumerate() {
            s.write_back(&[write_item(n, r)], 1, n as u64).expect("warm Redis");
        }
        s
    });
    match &mut store {
        Some(s) => {
            for (name, naive) in [("redis_pipelined", false), ("redis_naive", true)] {
                g.bench_function(name, |b| {
                    b.iter(|| {
                        i = (i + 1) % chains.len();
                        black_box(
                            s.dispatch_lookup(records[i].response_key.map(|k| k.0), &chains[i], naive)
                                .expect("lookup"),
                        )
                    })
                });
            }
        }
        None => eprintln!("stores: redis-server not available: Redis benches skipped"),
    }
    g.finish();

    let mut g = c.benchmark_group("write_back");
    g.bench_function("shm", |b| {
        b.iter(|| {
            i = (i + 1) % records.len();
            sink.write(std::slice::from_ref(&records[i]), Stamp(2), 0, &mut stats);
        })
    });
    if let Some(s) = &mut store {
        g.bench_function("redis", |b| {
            b.iter(|| {
                i = (i + 1) % records.len();
                s.write_back(&[write_item(i, &records[i])], 1, i as u64)
                    .expect("write back")
            })
        });
    }
    g.finish();
    drop(store);

    let mut g = c.benchmark_group("rate_limit");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let roomy = RateLimits {
        requests_per_minute: Some(u64::MAX / 4),
        tokens_per_minute: Some(u64::MAX / 4),
    };
    let tenant = roomy.buckets(Scope::Tenant, "bench-tenant");
    let model = RateLimits {
        requests_per_minute: None,
        ..roomy
    }
    .buckets(Scope::Model, "bench-model");
    let charges = RequestBuckets::new(&tenant, &model).admission(700, 0);
    g.bench_function("shm", |b| {
        b.iter(|| black_box(runtime.block_on(shm.take_limits(&charges))))
    });
    if let Some(r) = &redis {
        let config = semlb::config::RedisConfig {
            url: r.url(),
            namespace: "bench-limits".into(),
            ..Default::default()
        };
        let routing = runtime
            .block_on(async { RedisRouting::start(segment.clone(), 2, &config, "bench") })
            .expect("redis store");
        g.bench_function("redis", |b| {
            b.iter(|| black_box(runtime.block_on(routing.take_limits(&charges))))
        });
        assert_eq!(routing.stats().failures, 0, "every Redis check answered");
    }
    g.finish();
    drop(redis);
}

criterion_group!(benches, stores);
criterion_main!(benches);
