//! Criterion benches of the shm tables' single operations, on a real
//! 256 MiB POSIX shm segment populated so the prefix table is far larger
//! than the CPU caches (as in production). `_cold` variants draw from all
//! 1 M entries (most reads miss the caches); the others from a 64 K-entry
//! hot set. Operations: prefix lookup hit and miss, insert (one block,
//! and a chain of 64 new ones), longest-prefix match over a 64-block
//! chain, response-cache get and put of 4 KiB, a completion-ring
//! push and pop, and the in-flight accounting of one request (begin, first
//! token, end; alone and with another thread doing the same to the same
//! server) and the reads a routing decision makes of it, and a rate-limit
//! check (a tenant's requests and tokens buckets). Reads run before the insert benches, which evict the
//! populated entries as a full table does.
//!
//! `cargo bench --bench tables`. Figures are reported in issue notes as
//! medians; nothing here asserts a speed.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use shm_layout::{Pop, Quota, ResponseKey, Stamp, Taken};

use semlb_test_support::segment::{BenchSegment, chain, key, populate, servers};

const CHAINS: u64 = 16_384;
const CHAIN_LEN: usize = 64;

fn prefix(c: &mut Criterion) {
    let bench = BenchSegment::create("prefix", 256 << 20);
    let seg = &bench.segment;
    let srv = servers(seg, 8);
    populate(seg, &srv, CHAINS, CHAIN_LEN); // 1 M entries, ~27% of the slots
    let t = seg.tables();
    let hits: Vec<u64> = (0..1 << 16)
        .map(|i| chain(key(i) % CHAINS, CHAIN_LEN)[(i % 64) as usize])
        .collect();
    let misses: Vec<u64> = (0..1 << 16).map(|i| key(i + (1 << 40))).collect();
    let chains: Vec<Vec<u64>> = (0..1024).map(|i| chain(key(i) % CHAINS, CHAIN_LEN)).collect();
    // Cold: every populated entry, in random order, so most bucket reads
    // miss the CPU caches (1 M entries spread over a 120 MiB table).
    let cold_hits: Vec<u64> = (0..1u64 << 20)
        .map(|i| chain(key(i) % CHAINS, CHAIN_LEN)[(key(i) >> 58) as usize])
        .collect();
    let cold_chains: Vec<Vec<u64>> = (0..CHAINS).map(|i| chain(key(i) % CHAINS, CHAIN_LEN)).collect();
    let mut g = c.benchmark_group("prefix");
    let mut i = 0usize;
    g.bench_function("lookup_hit", |b| {
        b.iter(|| {
            i = (i + 1) & 0xffff;
            black_box(t.prefix.lookup(hits[i]))
        })
    });
    let mut j = 0usize;
    g.bench_function("lookup_hit_cold", |b| {
        b.iter(|| {
            j = (j + 1) & ((1 << 20) - 1);
            black_box(t.prefix.lookup(cold_hits[j]))
        })
    });
    g.bench_function("lookup_miss", |b| {
        b.iter(|| {
            i = (i + 1) & 0xffff;
            black_box(t.prefix.lookup(misses[i]))
        })
    });
    g.bench_function("longest_prefix_match_64", |b| {
        b.iter(|| {
            i = (i + 1) & 1023;
            black_box(t.prefix.longest_prefix_match(&chains[i], |s| t.servers.is_live(s)))
        })
    });
    g.bench_function("longest_prefix_match_64_cold", |b| {
        b.iter(|| {
            j = (j + 1) % cold_chains.len();
            black_box(t.prefix.longest_prefix_match(&cold_chains[j], |s| t.servers.is_live(s)))
        })
    });
    g.bench_function("longest_prefix_match_64_miss", |b| {
        b.iter(|| {
            i = (i + 1) & 0xffff;
            black_box(
                t.prefix
                    .longest_prefix_match(&misses[i..(i + 64).min(misses.len())], |s| t.servers.is_live(s)),
            )
        })
    });
    let mut n = 0u64;
    g.bench_function("insert_refresh", |b| {
        b.iter(|| {
            n += 1;
            let k = hits[(n & 0xffff) as usize];
            black_box(t.prefix.insert(k, srv[(n % 8) as usize], Stamp((n >> 16) as u16)))
        })
    });
    g.bench_function("insert_new", |b| {
        b.iter(|| {
            n += 1;
            black_box(t.prefix.insert(key(n | 1 << 50), srv[(n % 8) as usize], Stamp(2)))
        })
    });
    // A write-back's chain of 64 new blocks (written deepest first).
    let mut fresh = Vec::with_capacity(64);
    g.bench_function("insert_chain_64_new", |b| {
        b.iter(|| {
            n += 1;
            fresh.clear();
            fresh.extend((0..64).map(|d| key(n << 6 | d | 1 << 51)));
            black_box(t.prefix.insert_chain(&fresh, srv[(n % 8) as usize], Stamp(2)))
        })
    });
    g.finish();
}

fn responses(c: &mut Criterion) {
    let bench = BenchSegment::create("responses", 256 << 20);
    let t = bench.segment.tables();
    let value: Vec<u8> = (0..4096u32).map(|i| (i * 31) as u8).collect();
    let keys: Vec<ResponseKey> = (0..4096u64)
        .map(|i| ResponseKey(u128::from(key(i)) << 64 | u128::from(i)))
        .collect();
    for k in &keys {
        t.responses.put(*k, &value).unwrap();
    }
    let mut g = c.benchmark_group("responses");
    let mut buf = Vec::with_capacity(8192);
    let mut i = 0usize;
    g.bench_function("get_4k_hit", |b| {
        b.iter(|| {
            i = (i + 1) & 4095;
            black_box(t.responses.get_into(keys[i], &mut buf).map(|v| v.len()))
        })
    });
    g.bench_function("get_miss", |b| {
        b.iter(|| {
            i = (i + 1) & 4095;
            black_box(
                t.responses
                    .get_into(ResponseKey(keys[i].0 ^ 1 << 127), &mut buf)
                    .is_some(),
            )
        })
    });
    g.bench_function("put_4k", |b| {
        b.iter(|| {
            i = (i + 1) & 4095;
            black_box(t.responses.put(keys[i], &value))
        })
    });
    g.finish();
}

fn rings(c: &mut Criterion) {
    let bench = BenchSegment::create("rings", 64 << 20);
    let t = bench.segment.tables();
    let ring = t.ring(0);
    let record = vec![7u8; 600]; // ~64 block hashes and a little metadata
    let mut buf = Vec::with_capacity(1024);
    c.bench_function("ring/push_pop_600B", |b| {
        b.iter(|| {
            ring.push(&record).unwrap();
            assert_eq!(ring.pop(&mut buf), Pop::Record);
        })
    });
}

fn inflight(c: &mut Criterion) {
    let bench = BenchSegment::create("inflight", 64 << 20);
    let t = bench.segment.tables();
    let srv = servers(&bench.segment, 8);
    let mut g = c.benchmark_group("inflight");
    let request = |process: u16, server| {
        assert!(t.servers.begin_request(process, server, 1000));
        t.servers.first_token(process, server, 1000);
        t.servers.end_request(process, server, 1000, true);
    };
    g.bench_function("begin_first_end", |b| b.iter(|| request(1, black_box(srv[0]))));
    g.bench_function("read_8_servers", |b| {
        b.iter(|| {
            srv.iter()
                .map(|s| {
                    let ((requests, _), (_, pending_tokens)) = t.servers.inflight_and_pending(*s);
                    requests + pending_tokens
                })
                .sum::<u64>()
        })
    });
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                request(2, srv[0]);
            }
        });
        g.bench_function("begin_first_end_contended", |b| {
            b.iter(|| request(1, black_box(srv[0])))
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    g.finish();
}

/// A rate-limit check as a request makes it: requests and tokens of its
/// tenant (two takes), alone and with another thread charging the same
/// tenant; and a check among 10 000 live tenants (the keys spread over the
/// table).
fn limits(c: &mut Criterion) {
    let bench = BenchSegment::create("limits", 64 << 20);
    let t = bench.segment.tables();
    let clock = bench.segment.clock();
    // Large enough never to run out while measured.
    let requests = Quota::per_minute(u64::MAX / (1 << 40));
    let tokens = Quota::per_minute(u64::MAX / (1 << 30));
    let check = |tenant: u64| {
        let now = clock.now_ns();
        let a = t.limits.take(tenant, requests, 1, now);
        let b = t.limits.take(tenant ^ 1, tokens, 2000, now);
        matches!((a, b), (Taken::Allowed(_), Taken::Allowed(_)))
    };
    let mut g = c.benchmark_group("limits");
    g.bench_function("check_requests_and_tokens", |b| b.iter(|| check(black_box(42 << 1))));
    for tenant in 0..10_000u64 {
        check(tenant << 1);
    }
    let mut n = 0u64;
    g.bench_function("check_among_10k_tenants", |b| {
        b.iter(|| {
            n = (n + 7919) % 10_000;
            check(black_box(n << 1))
        })
    });
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                check(42 << 1);
            }
        });
        g.bench_function("check_contended", |b| b.iter(|| check(black_box(42 << 1))));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    g.finish();
}

criterion_group!(benches, prefix, responses, rings, inflight, limits);
criterion_main!(benches);
