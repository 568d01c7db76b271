//! `semlb::store::redis::client` against a real, private `redis-server`.
//!
//! Each test starts its own `redis-server` on a free loopback port (no
//! persistence) and kills it when done, so nothing depends on a Redis
//! already running. Without `redis-server` on the PATH every test prints
//! `SKIPPED: redis-server not installed` and returns; CI installs it
//! (`.ci/run`), so there they really run.
//!
//! The parity tests apply one random sequence of chain inserts to a shm
//! heap segment and to Redis and check that both give the same entries
//! and longest-prefix matches: the Redis store has the shm semantics. The
//! second one goes through the store interface the gateway uses
//! (`semlb::store`: the response processes' write-back, the dispatchers'
//! lookup and in-flight accounting) and compares the routing decisions.

use std::time::{Duration, Instant};

use std::sync::Arc;

use semlb::config::RedisConfig;
use semlb::prefix::blocks::BlockHasher;
use semlb::prefix::continuation::EndProbe;
use semlb::routing::{self, PolicyConfig, PolicyKind, RouteInput};
use semlb::store::WriteStats;
use semlb::store::redis::client::{InflightLoad, LANES, RedisStore, StoreError};
use semlb::store::redis::{RedisRouting, RedisWriteBack};
use semlb::store::shm::{ShmStore, ShmWriteBack};
use semlb::store::{Lookup, LookupRequest, RoutingStore, WriteBack};
use shm_layout::{Completion, LayoutPlan, ResponseKey, Segment, ServerRef, Stamp};

use semlb_test_support as support;
use support::redis::RedisServer;
use support::{Rng, mix};

macro_rules! redis_or_skip {
    () => {
        match RedisServer::start() {
            Some(s) => s,
            None => return,
        }
    };
}

const TTL: Duration = Duration::from_secs(600);

fn store(server: &RedisServer, ns: &str) -> RedisStore {
    RedisStore::connect(&server.url(), ns, TTL).expect("connect")
}

fn chain(tag: u64, len: u64) -> Vec<u64> {
    (0..len).map(|i| mix(tag << 20 | i)).collect()
}

#[test]
fn longest_prefix_match_counts_leading_blocks_and_costs_one_round_trip() {
    let server = redis_or_skip!();
    let mut s = store(&server, "t");
    let c = chain(1, 10);
    let rt = s.round_trips();
    s.insert_chain(&c[..7], 1, 1).unwrap();
    assert_eq!(s.round_trips() - rt, 1, "insert_chain is one round trip");
    s.insert_chain(&c[..3], 2, 2).unwrap();

    let rt = s.round_trips();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(1, 7), (2, 3)]);
    assert_eq!(s.round_trips() - rt, 1, "the script is one round trip");
    let rt = s.round_trips();
    assert_eq!(s.longest_prefix_match_naive(&c).unwrap(), vec![(1, 7), (2, 3)]);
    assert_eq!(s.round_trips() - rt, 8, "naive: 7 hits and the miss that ends the scan");

    assert_eq!(s.lookup(c[0]).unwrap(), vec![(2, 2), (1, 1)], "most recent first");
    assert_eq!(s.lookup(c[5]).unwrap(), vec![(1, 1)]);
    assert_eq!(s.lookup(c[8]).unwrap(), vec![]);
    assert!(s.longest_prefix_match(&chain(2, 5)).unwrap().is_empty());
    assert!(s.longest_prefix_match(&[]).unwrap().is_empty());
    assert!(s.longest_prefix_match_naive(&[]).unwrap().is_empty());
    // Only the leading known blocks count: a chain whose first block is
    // unknown matches nothing even if later blocks are known.
    let holed = [mix(999), c[1], c[2]];
    assert!(s.longest_prefix_match(&holed).unwrap().is_empty());
    assert!(s.longest_prefix_match_naive(&holed).unwrap().is_empty());
}

/// A server's horizon sets aside its fields stamped before it, in the
/// match script, and only its own; the match reports each server's stamp
/// at its deepest counted entry; a horizon only moves forward.
#[test]
fn a_horizon_sets_a_servers_older_fields_aside() {
    let server = redis_or_skip!();
    let mut s = store(&server, "horizon");
    let c = chain(400, 6);
    s.insert_chain(&c, 1, 100).unwrap();
    s.insert_chain(&c, 2, 100).unwrap();
    s.insert_chain(&c[..3], 1, 300).unwrap();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(1, 6), (2, 6)]);
    assert!(s.raise_horizon(1, 200).unwrap());
    assert!(!s.raise_horizon(1, 150).unwrap(), "a horizon only moves forward");
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(1, 3), (2, 6)]);
    let lookup = s.dispatch_lookup(None, &c, false).unwrap();
    assert_eq!(lookup.prefix, vec![(1, 3), (2, 6)]);
    assert_eq!(lookup.refreshed, vec![(1, 300), (2, 100)]);
    assert!(s.raise_horizon(1, 400).unwrap());
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(2, 6)]);
    // The paper's naive walk is the baseline: it reads no horizon.
    assert_eq!(s.longest_prefix_match_naive(&c).unwrap(), vec![(1, 6), (2, 6)]);
    // A refresh since brings the server back.
    s.insert_chain(&c, 1, 500).unwrap();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(1, 6), (2, 6)]);
}

/// A server whose engine lost its cache is forgotten in every entry of
/// the namespace (thousands of keys: the scan goes in batches); the other
/// servers and other namespaces keep theirs.
#[test]
fn a_forgotten_server_leaves_every_entry_of_its_namespace() {
    let server = redis_or_skip!();
    let mut s = store(&server, "forget");
    let mut other = store(&server, "forget-other");
    let shared = chain(300, 2500);
    s.insert_chain(&shared, 1, 10).unwrap();
    s.insert_chain(&shared[..1000], 2, 11).unwrap();
    other.insert_chain(&shared[..10], 1, 12).unwrap();
    assert_eq!(s.forget_server(1).unwrap(), 2500);
    assert_eq!(s.longest_prefix_match(&shared).unwrap(), vec![(2, 1000)]);
    assert_eq!(server.count("forget:p:*"), 1000, "entries left with no server are gone");
    assert_eq!(other.longest_prefix_match(&shared).unwrap(), vec![(1, 10)]);
    assert_eq!(s.forget_server(1).unwrap(), 0);
}

#[test]
fn the_deepest_listing_counts_and_the_scan_stops_at_the_first_miss() {
    let server = redis_or_skip!();
    let mut s = store(&server, "t");
    let system = chain(100, 4);
    // Six servers each cache the system prompt plus their own conversation.
    let chains: Vec<Vec<u64>> = (0..6u64)
        .map(|k| system.iter().copied().chain(chain(200 + k, 5)).collect())
        .collect();
    for (k, c) in chains.iter().enumerate() {
        s.insert_chain(c, k as u64, 10 + k as u64).unwrap();
    }
    // The system blocks list only the three most recent servers...
    let sys: Vec<u64> = s.lookup(system[0]).unwrap().iter().map(|e| e.0).collect();
    assert_eq!(sys, vec![5, 4, 3]);
    // ...yet server 0's own conversation still matches in full.
    let m = s.longest_prefix_match(&chains[0]).unwrap();
    assert_eq!(m, vec![(0, 9), (3, 4), (4, 4), (5, 4)]);
    assert_eq!(s.longest_prefix_match_naive(&chains[0]).unwrap(), m);
    // A hole ends the scan: nothing deeper is trusted.
    let mut raw = server.raw();
    let _: () = redis::cmd("DEL")
        .arg(s.prefix_key(chains[0][6]))
        .query(&mut raw)
        .unwrap();
    let m = s.longest_prefix_match(&chains[0]).unwrap();
    assert_eq!(m, vec![(0, 6), (3, 4), (4, 4), (5, 4)]);
    assert_eq!(s.longest_prefix_match_naive(&chains[0]).unwrap(), m);
}

#[test]
fn an_entry_keeps_at_most_three_servers_evicting_the_stalest() {
    let server = redis_or_skip!();
    let mut s = store(&server, "t");
    let k = mix(7);
    for (slot, now) in [(1u16, 10u64), (2, 11), (3, 12)] {
        s.insert(k, u64::from(slot), now).unwrap();
    }
    assert_eq!(s.lookup(k).unwrap(), vec![(3, 12), (2, 11), (1, 10)]);
    // Refreshing a listed server evicts nobody.
    s.insert(k, 1, 13).unwrap();
    assert_eq!(s.lookup(k).unwrap(), vec![(1, 13), (3, 12), (2, 11)]);
    // A fourth server evicts the stalest (2).
    s.insert(k, 4, 14).unwrap();
    assert_eq!(s.lookup(k).unwrap(), vec![(4, 14), (1, 13), (3, 12)]);
    for now in 15..40 {
        s.insert(k, now % 7, now).unwrap();
        assert_eq!(s.lookup(k).unwrap().len(), LANES);
    }
    let mut raw = server.raw();
    let len: usize = redis::cmd("HLEN").arg(s.prefix_key(k)).query(&mut raw).unwrap();
    assert_eq!(len, LANES);
}

#[test]
fn naive_and_scripted_matches_agree_on_random_chains() {
    let server = redis_or_skip!();
    let mut s = store(&server, "t");
    let mut rng = Rng(42);
    let families: Vec<Vec<u64>> = (0..12).map(|f| chain(1000 + f, 24)).collect();
    for now in 1..=300u64 {
        let f = &families[rng.below(12) as usize];
        let len = 1 + rng.below(24) as usize;
        s.insert_chain(&f[..len], rng.below(10), now).unwrap();
    }
    for q in 0..200u64 {
        let f = &families[rng.below(12) as usize];
        let len = rng.below(25) as usize;
        let mut c = f[..len].to_vec();
        // Some queries diverge from the family after a while.
        if q % 3 == 0 {
            c.extend(chain(5000 + q, 3));
        }
        let rt = s.round_trips();
        let scripted = s.longest_prefix_match(&c).unwrap();
        assert!(s.round_trips() - rt <= 1);
        let naive = s.longest_prefix_match_naive(&c).unwrap();
        assert_eq!(scripted, naive, "query {q}: {c:x?}");
    }
}

/// One random sequence of chain inserts, applied to a shm heap segment and
/// to Redis: same entries (servers in recency order) and same longest
/// prefix matches.
#[test]
fn parity_with_the_shm_prefix_table() {
    let server = redis_or_skip!();
    let mut s = store(&server, "parity");
    let seg = Segment::heap(&LayoutPlan::for_size(64 << 20).unwrap());
    let t = seg.tables();
    let servers: Vec<ServerRef> = (0..6)
        .map(|i| {
            t.servers
                .register(i, &format!("http://127.0.0.1:{}", 8000 + i), 0)
                .unwrap()
        })
        .collect();
    for (i, r) in servers.iter().enumerate() {
        assert_eq!(usize::from(r.slot), i, "slots are handed out in order");
    }

    let mut rng = Rng(7);
    let shared = chain(1, 6);
    // Families: a shared system prompt then their own blocks, or all their own.
    let families: Vec<Vec<u64>> = (0..10u64)
        .map(|f| {
            let own = chain(100 + f, 20);
            if f % 2 == 0 {
                shared.iter().copied().chain(own).collect()
            } else {
                own
            }
        })
        .collect();
    let mut keys = std::collections::HashSet::new();
    // `now` is strictly increasing (and below 2^16, the shm stamp's range),
    // so both tables agree on which server is stalest.
    for now in 1..=400u64 {
        let f = &families[rng.below(10) as usize];
        let len = 1 + rng.below(f.len() as u64) as usize;
        let srv = servers[rng.below(6) as usize];
        t.prefix.insert_chain(&f[..len], srv, Stamp(now as u16));
        s.insert_chain(&f[..len], u64::from(srv.slot), now).unwrap();
        keys.extend(f[..len].iter().copied());
    }
    assert_eq!(t.prefix.occupancy(), keys.len() as u64, "the shm table evicted nothing");

    for k in &keys {
        let shm: Vec<u16> = t.prefix.lookup(*k).unwrap().servers.iter().map(|x| x.slot()).collect();
        let redis: Vec<u16> = s.lookup(*k).unwrap().iter().map(|e| e.0 as u16).collect();
        assert_eq!(shm, redis, "entry {k:x}");
    }
    let mut queries: Vec<Vec<u64>> = families.clone();
    for q in 0..100u64 {
        let f = &families[rng.below(10) as usize];
        let mut c = f[..rng.below(f.len() as u64 + 1) as usize].to_vec();
        if q % 2 == 0 {
            c.extend(chain(9000 + q, 2));
        }
        queries.push(c);
    }
    for c in &queries {
        let m = t.prefix.longest_prefix_match(c, |_| true);
        assert!(
            m.iter().count() < shm_layout::MATCH_CAPACITY,
            "the shm match did not overflow"
        );
        let mut shm: Vec<(u64, u32)> = m.iter().map(|(tag, n)| (u64::from(tag.slot()), n)).collect();
        shm.sort_unstable();
        assert_eq!(s.longest_prefix_match(c).unwrap(), shm, "chain {c:x?}");
        assert_eq!(s.longest_prefix_match_naive(c).unwrap(), shm, "chain {c:x?} (naive)");
    }
}

/// A completion record for the write-back stores.
fn completion(server: ServerRef, prompt: &[u64], full: &[u64], response: Option<(u128, &[u8])>) -> Completion {
    Completion {
        server: Some(server),
        prompt_tokens: 16 * prompt.len() as u32,
        output_tokens: 16 * (full.len() - prompt.len().min(full.len())) as u32,
        prompt_blocks: prompt.to_vec(),
        full_blocks: full.to_vec(),
        continuation: None,
        response_key: response.map(|(k, _)| ResponseKey(k)),
        response: response.map(|(_, b)| b.to_vec()).unwrap_or_default(),
        prediction: None,
        timing: None,
    }
}

/// Both dispatcher-side stores over one heap segment with three servers
/// (a prefix entry holds three, so neither store evicts and their
/// different clocks, segment stamps and Unix ms, cannot matter), Redis's
/// under `namespace`.
struct Stores {
    runtime: tokio::runtime::Runtime,
    seg: Arc<Segment>,
    servers: Vec<ServerRef>,
    config: RedisConfig,
    shm: ShmStore,
    redis: Arc<RedisRouting>,
}

impl Stores {
    fn new(server: &RedisServer, namespace: &str) -> Stores {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let seg = Arc::new(Segment::heap(&LayoutPlan::for_size(64 << 20).unwrap()));
        let t = seg.tables();
        let servers: Vec<ServerRef> = (0..3)
            .map(|i| {
                t.servers
                    .register(i, &format!("http://127.0.0.1:{}", 9000 + i), 0)
                    .unwrap()
            })
            .collect();
        let config = RedisConfig {
            url: server.url(),
            namespace: namespace.into(),
            ..RedisConfig::default()
        };
        let shm = ShmStore::new(seg.clone(), 1, 600_000);
        let redis = runtime.block_on(async { RedisRouting::start(seg.clone(), 2, &config, "test").unwrap() });
        Stores {
            runtime,
            seg,
            servers,
            config,
            shm,
            redis,
        }
    }
}

/// The connections Redis has accepted since it started.
fn connections_received(c: &mut redis::Connection) -> u64 {
    let stats: String = redis::cmd("INFO").arg("stats").query(c).unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_connections_received")
}

/// A lookup of nothing: the loads only.
fn empty_lookup() -> LookupRequest<'static> {
    LookupRequest {
        members: semlb::routing::Members::all(),
        leg: semlb::routing::Leg::Request,
        response_key: None,
        chain: &[],
        exclude: &[],
        stale_after_ms: u64::MAX,
        continuation: None,
        precise: None,
        affinity: None,
    }
}

/// Sixteen lookups at once on a store that has not connected yet (a
/// dispatcher's first burst, or the one after an outage), with its
/// publishing task: one connection is opened and shared, not one each.
#[test]
fn a_burst_of_first_lookups_opens_one_connection() {
    let server = redis_or_skip!();
    let mut info = server.raw();
    let before = connections_received(&mut info);
    let Stores { runtime, redis, .. } = Stores::new(&server, "burst");
    runtime.block_on(async {
        let lookups = (0..16).map(|_| redis.lookup(empty_lookup()));
        let answers = futures_util::future::join_all(lookups).await;
        assert!(answers.iter().all(|a| !a.degraded), "all answered");
        // The publishing task has run too: it publishes on its first tick.
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis.stats().publishes == 0 {
            assert!(Instant::now() < deadline, "never published");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    assert_eq!(connections_received(&mut info), before + 1, "one shared connection");
}

/// It failed in 1 of 2 full runs and 1 of 3 runs alone on 2026-11-28
/// (`no new connection`: 7 against 6) and was quarantined; the cause was
/// not the slow reply but the start: the first lookup and the publishing
/// task both found no connection and each opened one, and when the
/// second was accepted after `before` was read, it counted as new. Fixed
/// by opening one connection at a time
/// (`a_burst_of_first_lookups_opens_one_connection`); 16 of 16 runs
/// beside two busy loops passed after, 1 of 8 failed before.
#[test]
fn a_slow_redis_reply_degrades_a_lookup_but_keeps_the_shared_connection() {
    let server = redis_or_skip!();
    let Stores { runtime, redis, .. } = Stores::new(&server, "slow");
    let empty = empty_lookup();
    let (mut info, mut busy, mut ping) = (server.raw(), server.raw(), server.raw());
    runtime.block_on(async {
        assert!(!redis.lookup(empty).await.degraded, "connected");
        let before = connections_received(&mut info);
        // Redis busy for 400 ms (a script spinning on TIME): the lookup's
        // 100 ms deadline passes while it waits.
        let spin = std::thread::spawn(move || {
            redis::cmd("EVAL")
                .arg("local t0 = redis.call('TIME') local s = t0[1] * 1000000 + t0[2] while true do local t = redis.call('TIME') if t[1] * 1000000 + t[2] - s > 400000 then break end end return 1")
                .arg(0)
                .query::<i64>(&mut busy)
        });
        // Busy once a PING goes unanswered.
        ping.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        while redis::cmd("PING").query::<String>(&mut ping).is_ok() {}
        assert!(redis.lookup(empty).await.degraded, "the deadline passed");
        spin.join().unwrap().unwrap();
        // After the retry interval it is asked again, on the same connection.
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis.lookup(empty).await.degraded {
            assert!(Instant::now() < deadline, "Redis never asked again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(connections_received(&mut info), before, "no new connection");
    });
}

#[test]
fn both_stores_give_the_same_routing_decisions() {
    let server = redis_or_skip!();
    let Stores {
        runtime,
        seg,
        servers,
        config: redis_config,
        shm,
        redis,
    } = Stores::new(&server, "decisions");
    let t = seg.tables();
    let mut shm_sink = ShmWriteBack::new(t);
    let mut redis_sink = RedisWriteBack::new(seg.clone(), &redis_config, Duration::from_secs(600), "test");

    // Conversations: a shared system prompt for some, then their own
    // blocks; each record warms its prompt and its prompt + answer.
    let mut rng = Rng(11);
    let shared = chain(1, 4);
    let families: Vec<Vec<u64>> = (0..12u64)
        .map(|f| {
            let own = chain(200 + f, 24);
            if f % 3 == 0 {
                shared.iter().copied().chain(own).collect()
            } else {
                own
            }
        })
        .collect();
    let mut records = Vec::new();
    for i in 0..120u64 {
        let f = &families[rng.below(12) as usize];
        let full = 2 + rng.below(f.len() as u64 - 1) as usize;
        let prompt = 1 + rng.below(full as u64 - 1) as usize;
        let body = format!("{{\"answer\":{i}}}");
        let response = (i % 4 == 0).then(|| (u128::from(i) + 1, body.into_bytes()));
        records.push(completion(
            servers[rng.below(3) as usize],
            &f[..prompt],
            &f[..full],
            response.as_ref().map(|(k, b)| (*k, b.as_slice())),
        ));
    }
    let mut shm_stats = WriteStats::default();
    let mut redis_stats = WriteStats::default();
    for (i, batch) in records.chunks(7).enumerate() {
        let now_ms = seg.clock().now_ms();
        shm_sink.write(batch, Stamp(i as u16 + 1), now_ms, &mut shm_stats);
        redis_sink.write(batch, Stamp(i as u16 + 1), now_ms, &mut redis_stats);
    }
    assert_eq!(redis_sink.backlog(), 0, "every record was written");
    assert_eq!(shm_stats, redis_stats, "both stores count the same work");

    // Load: requests in flight through both stores alike.
    let tokens = [300u64, 20, 4000];
    for (n, srv) in servers.iter().enumerate() {
        for _ in 0..n * 3 {
            assert!(shm.begin_request(*srv, tokens[n]));
            assert!(redis.begin_request(*srv, tokens[n]));
        }
    }
    let policies: Vec<_> = [PolicyKind::CacheAware, PolicyKind::LeastLoad]
        .iter()
        .map(|kind| {
            let config = PolicyConfig {
                kind: *kind,
                ..PolicyConfig::default()
            };
            (routing::build(&config), config)
        })
        .collect();
    let mut queries: Vec<(Vec<u64>, Option<u128>)> = Vec::new();
    for q in 0..150u64 {
        let f = &families[rng.below(12) as usize];
        let mut c = f[..rng.below(f.len() as u64 + 1) as usize].to_vec();
        if q % 2 == 0 {
            c.extend(chain(9000 + q, 3));
        }
        queries.push((c, Some(u128::from(q % 40) + 1)));
    }
    let summary = |l: &Lookup| {
        let mut prefix: Vec<(u16, u32)> = l.prefix.iter().map(|(tag, n)| (tag.slot(), n)).collect();
        prefix.sort_unstable();
        let load: Vec<(u16, u64, u64)> = l
            .candidates
            .iter()
            .map(|c| (c.server.slot, c.inflight, c.inflight_tokens))
            .collect();
        (l.response.clone(), prefix, load, l.degraded)
    };
    runtime.block_on(async {
        // The in-flight counts reach Redis with the next publication.
        let deadline = Instant::now() + Duration::from_secs(10);
        let empty = empty_lookup();
        while summary(&redis.lookup(empty).await).2 != summary(&shm.lookup(empty).await).2 {
            assert!(Instant::now() < deadline, "Redis never saw the in-flight counts");
            tokio::task::yield_now().await;
        }
        let mut decided = 0;
        for (chain, key) in &queries {
            for exclude in [&[][..], &servers[..1]] {
                let request = LookupRequest {
                    members: semlb::routing::Members::all(),
                    leg: semlb::routing::Leg::Request,
                    response_key: key.map(ResponseKey),
                    chain,
                    exclude,
                    stale_after_ms: u64::MAX,
                    continuation: None,
                    precise: None,
                    affinity: None,
                };
                let (a, b) = (shm.lookup(request).await, redis.lookup(request).await);
                assert_eq!(summary(&a), summary(&b), "chain {chain:x?} excluding {exclude:?}");
                for (policy, config) in &policies {
                    let choose = |l: &Lookup| {
                        let tokens = chain.len() as u32 * 16;
                        policy.choose(&RouteInput::new(chain, tokens, 16, &l.prefix, &l.candidates))
                    };
                    assert_eq!(choose(&a), choose(&b), "{:?} on chain {chain:x?}", config.kind);
                    decided += 1;
                }
            }
        }
        assert_eq!(decided, 600);
    });
    let hits = queries.iter().filter(|(_, k)| k.is_some_and(|k| k % 4 == 1)).count();
    assert!(hits > 0, "some lookups hit the response cache");
    assert_eq!(redis.stats().degraded_lookups, 0);
}

/// Learning at dispatch, through both stores: a prompt recorded for its
/// server is matched at once (Redis: once its detached write lands), a
/// next turn that carries the answer is credited with it on that server
/// only, and taking the record back leaves nothing.
#[test]
fn both_stores_learn_at_dispatch_credit_continuations_and_take_back() {
    let server = redis_or_skip!();
    let Stores {
        runtime,
        servers,
        shm,
        redis,
        ..
    } = Stores::new(&server, "dispatch-learning");
    let hasher = BlockHasher::new(BlockHasher::root_for("m", 5), 16);
    // Turn 1: 40 tokens; turn 2 adds a 128-token answer and 20 more; a
    // stranger shares turn 1's first two blocks only.
    let first: Vec<u32> = (0..40).collect();
    let mut second = first.clone();
    second.extend(1000..1128);
    second.extend(5000..5020);
    let mut stranger = first[..32].to_vec();
    stranger.extend(7000..7150);
    let chain_of = |tokens: &[u32]| {
        let mut c = Vec::new();
        hasher.chain(tokens, &mut c);
        c
    };
    let (c1, c2, c3) = (chain_of(&first), chain_of(&second), chain_of(&stranger));
    let end1 = hasher.prompt_end_key(&first, &c1);
    let request = |tokens: &'static [u32], chain: &'static [u64]| LookupRequest {
        members: semlb::routing::Members::all(),
        leg: semlb::routing::Leg::Request,
        response_key: None,
        chain,
        exclude: &[],
        stale_after_ms: u64::MAX,
        continuation: Some(EndProbe {
            tokens,
            chain,
            hasher,
            answer_tokens: 128,
        }),
        precise: None,
        affinity: None,
    };
    let (second, c2): (&'static [u32], &'static [u64]) = (second.leak(), c2.leak());
    let (stranger, c3): (&'static [u32], &'static [u64]) = (stranger.leak(), c3.leak());
    type Depths = Vec<(u16, u32)>;
    let view = |l: &Lookup| -> (Depths, Depths) {
        let sorted = |m: shm_layout::PrefixMatch| {
            let mut v: Vec<(u16, u32)> = m.iter().map(|(tag, n)| (tag.slot(), n)).collect();
            v.sort_unstable();
            v
        };
        (sorted(l.prefix), sorted(l.continued))
    };
    runtime.block_on(async {
        // The first lookup opens the Redis connection detached writes use.
        assert_eq!(view(&redis.lookup(request(second, c2)).await), (vec![], vec![]));
        for store in [&shm as &dyn RoutingStore, &*redis] {
            store.record_route(servers[1], &c1, Some(end1));
        }
        // Credited: 40 + 128 = 168 tokens reach into 11 blocks (the 11th in
        // part; see `EndProbe::credited_blocks`).
        let expected = (vec![(1, 2)], vec![(1, 11)]);
        assert_eq!(view(&shm.lookup(request(second, c2)).await), expected);
        let deadline = Instant::now() + Duration::from_secs(10);
        while view(&redis.lookup(request(second, c2)).await) != expected {
            assert!(Instant::now() < deadline, "Redis never showed the dispatch-time record");
            tokio::task::yield_now().await;
        }
        // A prompt sharing the blocks but not the end is not a continuation.
        for store in [&shm as &dyn RoutingStore, &*redis] {
            assert_eq!(view(&store.lookup(request(stranger, c3)).await), (vec![(1, 2)], vec![]));
        }
        for store in [&shm as &dyn RoutingStore, &*redis] {
            store.forget_route(servers[1], &c1, Some(end1));
        }
        assert_eq!(view(&shm.lookup(request(second, c2)).await), (vec![], vec![]));
        while view(&redis.lookup(request(second, c2)).await) != (vec![], vec![]) {
            assert!(Instant::now() < deadline, "Redis kept the record taken back");
            tokio::task::yield_now().await;
        }
    });
    assert_eq!(redis.stats().degraded_lookups, 0);
}

/// An affinity key (a stored response's, a session's) read with the
/// lookup, in its one round trip: the servers it lists among the
/// candidates, the same as `holders` reads them apart, in both stores; an
/// unknown key lists none; a lookup that asks for none reads none.
#[test]
fn a_lookup_reads_an_affinity_keys_servers_in_its_round_trip() {
    let server = redis_or_skip!();
    let Stores {
        runtime,
        servers,
        shm,
        redis,
        ..
    } = Stores::new(&server, "affinity-read");
    let (key, unknown) = (0x5e55_1011_u64, 0x0dd_u64);
    let request = |affinity| LookupRequest {
        affinity,
        ..empty_lookup()
    };
    let slots = |v: &[ServerRef]| -> Vec<u16> {
        let mut s: Vec<u16> = v.iter().map(|s| s.slot).collect();
        s.sort_unstable();
        s
    };
    runtime.block_on(async {
        // Opens the connection detached writes use.
        assert_eq!(redis.lookup(request(None)).await.affine, None);
        for store in [&shm as &dyn RoutingStore, &*redis] {
            store.record_route(servers[2], &[key], None);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let read = redis.lookup(request(Some(key))).await;
            let affine = read.affine.expect("Redis reads the key with the lookup");
            if slots(&affine) == vec![2] {
                assert_eq!(slots(&redis.holders(key, &read.candidates).await), vec![2]);
                break;
            }
            assert!(Instant::now() < deadline, "Redis never listed the key's server");
            tokio::task::yield_now().await;
        }
        let read = redis.lookup(request(Some(unknown))).await;
        assert_eq!(read.affine, Some(Vec::new()), "an unknown key lists nobody");
        // The segment's store reads the key apart (no round trip to save).
        let read = shm.lookup(request(Some(key))).await;
        assert_eq!(read.affine, None);
        assert_eq!(slots(&shm.holders(key, &read.candidates).await), vec![2]);
    });
    assert_eq!(redis.stats().degraded_lookups, 0);
}

fn poll_until(deadline: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !done() {
        assert!(Instant::now() < end, "{what}: not within {deadline:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn prefix_entries_expire_and_inserts_renew_the_ttl() {
    let server = redis_or_skip!();
    let mut raw = server.raw();
    let mut s = RedisStore::connect(&server.url(), "ttl", Duration::from_secs(4)).unwrap();
    let c = chain(3, 3);
    s.insert_chain(&c, 1, 1).unwrap();
    let pttl = |raw: &mut redis::Connection, k: &str| -> i64 { redis::cmd("PTTL").arg(k).query(raw).unwrap() };
    let key = s.prefix_key(c[0]);
    let first = pttl(&mut raw, &key);
    assert!(first > 0 && first <= 4000, "{first}");
    std::thread::sleep(Duration::from_millis(300));
    let before = pttl(&mut raw, &key);
    s.insert_chain(&c[..1], 2, 2).unwrap();
    let after = pttl(&mut raw, &key);
    assert!(after > before, "insert renews the TTL: {before} → {after}");

    let mut short = RedisStore::connect(&server.url(), "short", Duration::from_millis(150)).unwrap();
    short.insert_chain(&c, 1, 1).unwrap();
    assert_eq!(short.longest_prefix_match(&c).unwrap(), vec![(1, 3)]);
    poll_until(Duration::from_secs(5), "prefix entries expire", || {
        short.longest_prefix_match(&c).unwrap().is_empty()
    });
}

#[test]
fn namespaces_isolate() {
    let server = redis_or_skip!();
    let mut a = store(&server, "a");
    let mut b = store(&server, "b");
    let c = chain(4, 4);
    a.insert_chain(&c, 1, 1).unwrap();
    a.put_response(9, b"from a", TTL).unwrap();
    a.begin_request(1, 10).unwrap();
    assert_eq!(a.longest_prefix_match(&c).unwrap(), vec![(1, 4)]);
    assert!(b.longest_prefix_match(&c).unwrap().is_empty());
    assert!(b.lookup(c[0]).unwrap().is_empty());
    assert_eq!(b.get_response(9).unwrap(), None);
    assert_eq!(b.inflight().unwrap(), vec![]);
    b.insert_chain(&c[..2], 2, 2).unwrap();
    assert_eq!(a.longest_prefix_match(&c).unwrap(), vec![(1, 4)]);
    assert_eq!(b.longest_prefix_match(&c).unwrap(), vec![(2, 2)]);
    assert_eq!(a.get_response(9).unwrap().as_deref(), Some(&b"from a"[..]));
    // Every key lives under its namespace.
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut server.raw()).unwrap();
    assert!(
        keys.iter().all(|k| k.starts_with("a:") || k.starts_with("b:")),
        "{keys:?}"
    );
}

#[test]
fn a_cached_response_changed_in_redis_is_a_miss() {
    let server = redis_or_skip!();
    let mut s = store(&server, "sealed");
    s.put_response(7, b"{\"answer\":\"forty-two\"}", TTL).unwrap();
    assert_eq!(
        s.get_response(7).unwrap().as_deref(),
        Some(&b"{\"answer\":\"forty-two\"}"[..])
    );
    // Another writer of the namespace (or a bit flip) changes one byte.
    let mut raw = server.raw();
    let _: usize = redis::cmd("SETRANGE")
        .arg(s.response_key(7))
        .arg(12)
        .arg("X")
        .query(&mut raw)
        .unwrap();
    assert_eq!(s.get_response(7).unwrap(), None, "not trusted");
    // And a value that is not ours at all.
    let _: () = redis::cmd("SET")
        .arg(s.response_key(8))
        .arg("plain")
        .query(&mut raw)
        .unwrap();
    assert_eq!(s.get_response(8).unwrap(), None);
}

#[test]
fn responses_round_trip_and_expire() {
    let server = redis_or_skip!();
    let mut s = store(&server, "r");
    let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let key = u128::MAX - 5;
    assert_eq!(s.get_response(key).unwrap(), None);
    let rt = s.round_trips();
    s.put_response(key, &big, TTL).unwrap();
    assert_eq!(s.get_response(key).unwrap(), Some(big));
    assert_eq!(s.round_trips() - rt, 2);
    s.put_response(1, b"", TTL).unwrap();
    assert_eq!(s.get_response(1).unwrap(), Some(vec![]));
    s.put_response(2, b"\0binary\xff", TTL).unwrap();
    assert_eq!(s.get_response(2).unwrap().as_deref(), Some(&b"\0binary\xff"[..]));
    // Overwrite, then expire.
    s.put_response(2, b"short-lived", Duration::from_millis(100)).unwrap();
    assert_eq!(s.get_response(2).unwrap().as_deref(), Some(&b"short-lived"[..]));
    poll_until(Duration::from_secs(5), "response expires", || {
        s.get_response(2).unwrap().is_none()
    });
    assert!(s.get_response(1).unwrap().is_some());
}

#[test]
fn inflight_counters() {
    let server = redis_or_skip!();
    let mut s = store(&server, "c");
    assert_eq!(s.inflight().unwrap(), vec![]);
    let rt = s.round_trips();
    assert_eq!(s.begin_request(1, 100).unwrap(), 1);
    assert_eq!(s.round_trips() - rt, 1);
    assert_eq!(s.begin_request(1, 50).unwrap(), 2);
    assert_eq!(s.begin_request(7, 5).unwrap(), 1);
    assert_eq!(s.inflight().unwrap(), vec![(1, 2), (7, 1)]);
    assert_eq!(
        s.inflight_load().unwrap(),
        vec![
            InflightLoad {
                server: 1,
                requests: 2,
                tokens: 150
            },
            InflightLoad {
                server: 7,
                requests: 1,
                tokens: 5
            },
        ]
    );
    let rt = s.round_trips();
    assert_eq!(s.end_request(1, 100).unwrap(), 1);
    assert_eq!(s.round_trips() - rt, 1);
    assert_eq!(s.end_request(7, 5).unwrap(), 0);
    assert_eq!(
        s.inflight().unwrap(),
        vec![(1, 1)],
        "a server with nothing in flight is not listed"
    );
    assert_eq!(s.inflight_load().unwrap()[0].tokens, 50);
    // Two stores (two gateway processes) are summed.
    let mut other = store(&server, "c");
    assert_eq!(other.begin_request(1, 1).unwrap(), 1, "its own count");
    assert_eq!(s.inflight().unwrap(), vec![(1, 2)]);
    // A process that stops publishing stops counting when its lease ends:
    // end it now, as if the lease had run out (the owner set's score).
    let _: () = redis::cmd("ZADD")
        .arg("c:owners")
        .arg(0)
        .arg(other.owner())
        .query(&mut server.raw())
        .unwrap();
    assert_eq!(
        s.inflight().unwrap(),
        vec![(1, 1)],
        "the dead owner's request no longer counts"
    );
}

#[test]
fn a_flushed_script_cache_is_reloaded() {
    let server = redis_or_skip!();
    let mut s = store(&server, "n");
    let c = chain(5, 3);
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.raw()).unwrap();
    let rt = s.round_trips();
    assert_eq!(s.connects(), 1);
    s.insert_chain(&c, 3, 1).unwrap();
    assert_eq!(s.round_trips() - rt, 3, "EVALSHA → NOSCRIPT, SCRIPT LOAD, EVALSHA");
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.raw()).unwrap();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(3, 3)]);
    let rt = s.round_trips();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(3, 3)]);
    assert_eq!(s.round_trips() - rt, 1, "loaded again: one round trip");
    assert_eq!(s.connects(), 1, "NOSCRIPT keeps the connection");
    // So does any other error reply.
    let _: () = redis::cmd("SET")
        .arg(s.prefix_key(c[0]))
        .arg("not a hash")
        .query(&mut server.raw())
        .unwrap();
    let e = s.longest_prefix_match(&c).unwrap_err();
    assert!(matches!(e, StoreError::Command { .. }), "{e}");
    assert!(s.is_connected());
    assert!(s.insert_chain(&c, 3, 2).is_err(), "WRONGTYPE inside the script");
    assert!(s.lookup(c[0]).is_err());
    assert_eq!(s.longest_prefix_match(&c[1..]).unwrap(), vec![(3, 2)]);
    assert_eq!(s.connects(), 1);
}

/// Asserts `f` fails, quickly (a hang detector, not a latency target).
fn fails_fast<T: std::fmt::Debug>(what: &str, f: impl FnOnce() -> Result<T, StoreError>) -> StoreError {
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(2), "{what} took {took:?}");
    match r {
        Ok(v) => panic!("{what} succeeded without Redis: {v:?}"),
        Err(e) => e,
    }
}

#[test]
fn an_outage_is_a_quick_error_and_the_store_recovers_by_itself() {
    let server = redis_or_skip!();
    let port = server.port;
    let mut s = store(&server, "o");
    let c = chain(6, 4);
    s.insert_chain(&c, 1, 1).unwrap();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(1, 4)]);

    assert_eq!(s.connects(), 1);
    drop(server);
    let e = fails_fast("insert_chain", || s.insert_chain(&c, 1, 2));
    eprintln!("outage: {e}");
    assert!(!s.is_connected());
    for _ in 0..3 {
        fails_fast("longest_prefix_match", || s.longest_prefix_match(&c));
        fails_fast("longest_prefix_match_naive", || s.longest_prefix_match_naive(&c));
        fails_fast("get_response", || s.get_response(1));
        fails_fast("put_response", || s.put_response(1, b"x", TTL));
        fails_fast("begin_request", || s.begin_request(1, 1));
        fails_fast("inflight", || s.inflight());
        let e = fails_fast("lookup", || s.lookup(c[0]));
        assert!(
            matches!(e, StoreError::Connect(_)),
            "reconnect attempts fail to connect: {e}"
        );
    }

    // Redis comes back (empty: no persistence) on the same port.
    let server = RedisServer::start_on(port);
    assert!(s.longest_prefix_match(&c).unwrap().is_empty(), "recovered by itself");
    assert_eq!(s.connects(), 2);
    s.insert_chain(&c, 2, 3).unwrap();
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(2, 4)]);
    assert_eq!(s.begin_request(2, 1).unwrap(), 1);

    // Restarted again with no call in between: the stale connection fails
    // once (quickly), the next call reconnects.
    drop(server);
    let _server = RedisServer::start_on(port);
    let first = s.longest_prefix_match(&c);
    if let Err(e) = &first {
        eprintln!("first call on the stale connection: {e}");
    }
    assert!(s.longest_prefix_match(&c).unwrap().is_empty());
}

#[test]
fn a_frozen_server_is_a_timeout_not_a_hang() {
    use nix::sys::signal::Signal;
    let server = redis_or_skip!();
    let mut s = store(&server, "f");
    let c = chain(8, 4);
    s.insert_chain(&c, 1, 1).unwrap();
    server.signal(Signal::SIGSTOP);
    let e = fails_fast("longest_prefix_match on a stopped server", || {
        s.longest_prefix_match(&c)
    });
    assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    // Reconnecting to a stopped server: the kernel accepts, Redis never
    // answers the handshake; still bounded.
    fails_fast("reconnect to a stopped server", || s.get_response(1));
    server.signal(Signal::SIGCONT);
    assert_eq!(s.longest_prefix_match(&c).unwrap(), vec![(1, 4)]);
}
