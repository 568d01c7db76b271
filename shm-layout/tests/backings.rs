//! Conformance tests of every table, each body run against both backings:
//! a heap segment ([`Segment::heap`]) and a real POSIX shm segment
//! ([`Segment::create`], removed by a guard). Passing on both proves the two
//! backings give the same format and the same table semantics: the prefix
//! table (insert, refresh, lookup, remove, longest-prefix match, bounded
//! eviction), the response log (put, get, replace, size limit, lapping), the
//! server table (registration life cycle, generations, liveness, in-flight
//! accounting and crash reclaim, load figures), the process registry
//! (claim, attach, heartbeat, exit, stale incarnations) and the completion
//! rings (FIFO, wrap-around, full rings, independence, owner), including a
//! completion record's encode → push → pop → decode round trip, and the
//! stats region (per-process blocks, sums, kept across a reopen).

mod shm_support;

use shm_layout::LoadFigures;
use shm_layout::completion_ring::PushError;
use shm_layout::plan::RegionKind;
use shm_layout::prefix_table::PrefixEntry;
use shm_layout::registry::{ProcessState, Role};
use shm_layout::server_table::{RegisterError, ServerRef, ServerState, ServerTag};
use shm_layout::{
    Completion, CompletionRecord, InsertOutcome, LAYOUT_VERSION, MAGIC, Pop, PutError, ResponseKey, STATE_READY,
    Segment, Stamp,
};
use shm_support::{backing, both, small_plan};

/// Golden-ratio multiplier: `i * PHI` spreads consecutive `i` over the key space.
const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

fn spread(i: u64) -> u64 {
    (i + 1).wrapping_mul(PHI)
}

fn servers_of(e: &PrefixEntry) -> Vec<ServerTag> {
    e.servers.iter().collect()
}

#[test]
fn header_matches_the_plan_on_both_backings() {
    let plan = small_plan();
    both("header", &plan, |seg| {
        let h = seg.header();
        assert_eq!(h.magic, MAGIC);
        assert_eq!(h.layout_version, LAYOUT_VERSION);
        assert_eq!(h.state, STATE_READY);
        assert_eq!(h.segment_bytes, plan.segment_bytes());
        assert_eq!(h.regions, *plan.regions());
        assert_eq!(h.creator_pid, u64::from(std::process::id()));
        assert_eq!(h.checksum(), h.header_checksum);
        assert_eq!(seg.len() as u64, plan.segment_bytes());
        assert!(!seg.is_empty());
        assert_eq!(seg.raw_words().len() * 8, seg.len());
        let t = seg.tables();
        assert_eq!(t.ring_count() as u64, plan.region(RegionKind::Rings).count);
        assert_eq!(t.prefix.capacity(), plan.prefix_slots());
        assert_eq!(
            t.responses.max_value() as u64,
            plan.region(RegionKind::ResponseLog).param
        );
        assert!(
            seg.clock().now_ms() < 60_000,
            "{}: a new segment's clock starts near 0",
            backing(seg)
        );
    });
}

#[test]
fn prefix_insert_refresh_lookup_remove() {
    both("prefix-basic", &small_plan(), |seg| {
        let p = seg.tables().prefix;
        let srv = |slot, generation| ServerRef { slot, generation };
        let (a, b, c, d) = (srv(0, 1), srv(1, 1), srv(2, 1), srv(3, 1));
        let key = spread(42);

        assert_eq!(p.lookup(key), None);
        assert_eq!(p.occupancy(), 0);
        assert_eq!(p.insert(key, a, Stamp(10)), InsertOutcome::Inserted);
        assert_eq!(p.insert(key, a, Stamp(10)), InsertOutcome::Unchanged);
        assert_eq!(
            p.insert(key, a, Stamp(11)),
            InsertOutcome::Refreshed,
            "a new stamp is a refresh"
        );
        assert_eq!(p.insert(key, b, Stamp(12)), InsertOutcome::Refreshed);
        let e = p.lookup(key).unwrap();
        assert_eq!(servers_of(&e), vec![b.tag(), a.tag()], "most recent first");
        assert_eq!(e.stamp, Stamp(12));

        // Refreshing an existing server moves it to the front.
        assert_eq!(p.insert(key, a, Stamp(13)), InsertOutcome::Refreshed);
        assert_eq!(servers_of(&p.lookup(key).unwrap()), vec![a.tag(), b.tag()]);

        // At most three lanes: the least recent falls off.
        p.insert(key, c, Stamp(14));
        p.insert(key, d, Stamp(15));
        let e = p.lookup(key).unwrap();
        assert_eq!(servers_of(&e), vec![d.tag(), c.tag(), a.tag()]);
        assert_eq!((e.servers.len(), e.servers.is_empty()), (3, false));
        assert!(!e.servers.contains(b.tag()));

        // A new generation of slot 2 replaces the old lane instead of adding one.
        let c2 = srv(2, 2);
        p.insert(key, c2, Stamp(16));
        let e = p.lookup(key).unwrap();
        assert_eq!(servers_of(&e), vec![c2.tag(), d.tag(), a.tag()]);
        assert!(!e.servers.contains(c.tag()));

        // Other keys are independent.
        assert_eq!(p.lookup(spread(43)), None);
        p.insert(spread(43), b, Stamp(16));
        assert_eq!(p.occupancy(), 2);

        // Remove drops one server at a time, the entry with its last server;
        // only the exact generation counts.
        assert!(!p.remove(key, c.tag()), "stale generation is not there");
        assert!(!p.remove(key, b.tag()), "b fell off");
        assert!(p.remove(key, d.tag()));
        assert_eq!(servers_of(&p.lookup(key).unwrap()), vec![c2.tag(), a.tag()]);
        assert!(p.remove(key, c2.tag()));
        assert!(p.remove(key, a.tag()));
        assert_eq!(p.lookup(key), None);
        assert!(!p.remove(key, a.tag()));
        assert_eq!(p.occupancy(), 1);
        let entries: Vec<(u64, PrefixEntry)> = p.entries().collect();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].0, spread(43));
        assert_eq!(servers_of(&entries[0].1), vec![b.tag()]);
    });
}

#[test]
fn prefix_longest_match_follows_chains_and_the_live_filter() {
    both("prefix-lpm", &small_plan(), |seg| {
        let t = seg.tables();
        let (p, servers) = (t.prefix, t.servers);
        let now = seg.clock().stamp();
        let a = servers.register(1, "http://a:8000", 0).unwrap();
        let b = servers.register(2, "http://b:8000", 0).unwrap();
        let c = servers.register(3, "http://c:8000", 0).unwrap();
        let chain: Vec<u64> = (1000..1012).map(spread).collect();
        let live = |s: ServerTag| servers.is_live(s);

        assert!(p.longest_prefix_match(&chain, live).is_empty());
        assert!(p.longest_prefix_match(&[], live).is_empty());

        p.insert_chain(&chain[..9], a, now);
        p.insert_chain(&chain[..4], b, now);
        p.insert_chain(&chain[6..8], b, now); // b listed again deeper: its deepest listing counts
        p.insert_chain(&chain[10..], c, now); // beyond a block the table lacks: never reached
        let m = p.longest_prefix_match(&chain, live);
        assert_eq!(m.blocks_for(a.tag()), 9);
        assert_eq!(m.blocks_for(b.tag()), 8);
        assert_eq!(m.blocks_for(c.tag()), 0);
        assert_eq!(m.best(), Some((a.tag(), 9)));
        assert_eq!(m.iter().count(), 2);

        // A shorter chain caps the count.
        assert_eq!(p.longest_prefix_match(&chain[..3], live).blocks_for(a.tag()), 3);

        // A server that is down (or retired, or re-registered) does not count.
        assert!(servers.set_state(a, ServerState::Down));
        let m = p.longest_prefix_match(&chain, live);
        assert_eq!(m.best(), Some((b.tag(), 8)));
        assert_eq!(m.blocks_for(a.tag()), 0);
        assert!(servers.set_state(a, ServerState::Up));
        assert!(servers.retire(a));
        let a2 = servers.register(4, "http://a2:8000", 0).unwrap();
        assert_eq!(a2.slot, a.slot, "the freed slot is reused");
        assert_eq!(
            p.longest_prefix_match(&chain, live).blocks_for(a.tag()),
            0,
            "the old generation's affinity is not inherited"
        );
        assert_eq!(p.longest_prefix_match(&chain, live).blocks_for(a2.tag()), 0);

        // A block the table no longer knows ends the scan: while the (stale)
        // lane of `a` keeps the entry of block 2, `b` still matches 8 deep.
        assert!(p.remove(chain[2], b.tag()));
        assert_eq!(p.longest_prefix_match(&chain, live).best(), Some((b.tag(), 8)));
        assert!(p.remove(chain[2], a.tag()));
        assert_eq!(p.longest_prefix_match(&chain, live).best(), Some((b.tag(), 2)));
    });
}

#[test]
fn prefix_eviction_keeps_occupancy_bounded_and_recent_keys() {
    both("prefix-evict", &small_plan(), |seg| {
        let p = seg.tables().prefix;
        let cap = p.capacity();
        let n = cap + cap / 2; // half again as many keys as slots
        let server = ServerRef { slot: 3, generation: 1 };
        let mut evicted = 0u64;
        for i in 0..n {
            // Stamps grow (without wrapping) over the run, so "stalest" is "oldest".
            let stamp = Stamp((i * 60_000 / n) as u16);
            match p.insert(spread(i), server, stamp) {
                InsertOutcome::Inserted => {}
                InsertOutcome::Evicted => evicted += 1,
                other => panic!("{}: insert {i}: {other:?}", backing(seg)),
            }
        }
        let occupancy = p.occupancy();
        assert!(occupancy <= cap, "{}: {occupancy} > {cap}", backing(seg));
        assert!(
            occupancy * 100 >= cap * 95,
            "{}: only {occupancy} of {cap} used",
            backing(seg)
        );
        assert_eq!(
            evicted + occupancy,
            n,
            "every insert beyond the free slots evicts one entry"
        );

        // Every decodable entry is a key that was inserted, with its server.
        let inverse = inverse_mod_2_64(PHI);
        let mut entries = 0;
        for (key, e) in p.entries() {
            let i = key.wrapping_mul(inverse).wrapping_sub(1);
            assert!(i < n, "{}: entry for a key never inserted: {key:#x}", backing(seg));
            assert_eq!(servers_of(&e), vec![server.tag()]);
            entries += 1;
        }
        assert_eq!(entries, occupancy);

        // The most recent keys survive: the last insert always, and (keys
        // sharing a bucket are far apart in the sequence) nearly all of the
        // last thousand.
        assert!(p.lookup(spread(n - 1)).is_some());
        let recent = (n - 1000..n).filter(|i| p.lookup(spread(*i)).is_some()).count();
        assert!(
            recent >= 990,
            "{}: only {recent} of the last 1000 keys survive",
            backing(seg)
        );
        let oldest = (0..1000).filter(|i| p.lookup(spread(*i)).is_some()).count();
        assert!(
            oldest < recent,
            "{}: old keys ({oldest}) outlive new ones ({recent})",
            backing(seg)
        );
    });
}

/// The multiplicative inverse of an odd `a` modulo 2^64 (Newton's iteration).
fn inverse_mod_2_64(a: u64) -> u64 {
    let mut x = a; // correct to 3 bits for odd a
    for _ in 0..5 {
        x = x.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(x)));
    }
    assert_eq!(a.wrapping_mul(x), 1);
    x
}

#[test]
fn response_put_get_replace() {
    both("resp-basic", &small_plan(), |seg| {
        let log = seg.tables().responses;
        let k1 = ResponseKey(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
        let k2 = ResponseKey(7);
        assert_eq!(log.get(k1), None);
        log.put(k1, b"first").unwrap();
        log.put(k2, b"").unwrap();
        assert_eq!(log.get(k1).as_deref(), Some(&b"first"[..]), "{}", backing(seg));
        assert_eq!(log.get(k2).as_deref(), Some(&b""[..]), "an empty value is a hit");
        log.put(k1, b"second, and longer than the first").unwrap();
        assert_eq!(log.get(k1).as_deref(), Some(&b"second, and longer than the first"[..]));
        log.put(k1, b"3rd").unwrap();
        let mut buf = vec![0xaa; 100];
        assert_eq!(
            log.get_into(k1, &mut buf),
            Some(&b"3rd"[..]),
            "get_into clears the buffer"
        );
        // Same low half, other high half: another key, a miss (not k1's value).
        assert_eq!(log.get(ResponseKey(k1.0 ^ (1 << 100))), None);
        assert_eq!(log.get(ResponseKey(k1.0 ^ 1)), None);

        let s = log.stats();
        assert_eq!((s.records, s.refused, s.unindexed), (4, 0, 0));
        assert_eq!(s.capacity, seg.header().region(RegionKind::ResponseLog).count);
        assert!(s.tail > 0 && s.tail < s.capacity);
        assert_eq!(log.index_occupancy(), 2, "a replaced value reuses its index slot");
    });
}

/// The segment store is a second keyed log in regions of its own: the
/// same operations, and nothing written to one is read from the other.
#[test]
fn the_segment_log_is_its_own_keyed_log() {
    both("segments", &small_plan(), |seg| {
        let t = seg.tables();
        let key = ResponseKey(0x5e6_0000_0000_0000_0000_0000_0000_0042);
        t.segments.put(key, &[1, 0, 0, 0, 2, 0, 0, 0]).unwrap();
        assert_eq!(t.segments.get(key).as_deref(), Some(&[1u8, 0, 0, 0, 2, 0, 0, 0][..]));
        assert_eq!(
            t.responses.get(key),
            None,
            "{}: a segment is not a response",
            backing(seg)
        );
        t.responses.put(key, b"a response").unwrap();
        assert_eq!(t.segments.get(key).as_deref(), Some(&[1u8, 0, 0, 0, 2, 0, 0, 0][..]));
        assert_eq!(t.responses.get(key).as_deref(), Some(&b"a response"[..]));
        let plan = seg.header();
        assert_eq!(t.segments.stats().capacity, plan.region(RegionKind::SegmentLog).count);
        assert_eq!(t.segments.max_value() as u64, plan.region(RegionKind::SegmentLog).param);
        // Flushing one leaves the other.
        assert_eq!(t.responses.clear(), 1);
        assert_eq!(t.segments.get(key).as_deref().map(<[u8]>::len), Some(8));
    });
}

#[test]
fn response_values_over_the_limit_are_refused_not_truncated() {
    both("resp-large", &small_plan(), |seg| {
        let log = seg.tables().responses;
        let max = log.max_value();
        assert!(max > 0);
        let big: Vec<u8> = (0..max).map(|i| (i % 251) as u8).collect();
        log.put(ResponseKey(1), &big).unwrap();
        assert_eq!(log.get(ResponseKey(1)).as_deref(), Some(&big[..]));
        let too_big = vec![1u8; max + 1];
        assert_eq!(
            log.put(ResponseKey(2), &too_big),
            Err(PutError::TooLarge { len: max + 1, max })
        );
        assert_eq!(log.get(ResponseKey(2)), None);
        // A refused replacement leaves the old value in place.
        assert_eq!(
            log.put(ResponseKey(1), &too_big),
            Err(PutError::TooLarge { len: max + 1, max })
        );
        assert_eq!(log.get(ResponseKey(1)).as_deref(), Some(&big[..]));
        assert_eq!(log.stats().refused, 2);
        assert_eq!(log.stats().records, 1);
    });
}

#[test]
fn response_log_laps_oldest_first() {
    both("resp-lap", &small_plan(), |seg| {
        let log = seg.tables().responses;
        let cap = log.stats().capacity;
        let len = (cap / 10) as usize; // ~10 records fit
        let value = |k: u64| -> Vec<u8> {
            let mut v = vec![k as u8; len];
            v[..8].copy_from_slice(&k.to_le_bytes());
            v
        };
        let n = 35u64;
        for k in 0..n {
            log.put(ResponseKey(u128::from(spread(k))), &value(k)).unwrap();
        }
        let present: Vec<u64> = (0..n)
            .filter(|k| match log.get(ResponseKey(u128::from(spread(*k)))) {
                Some(v) => {
                    assert_eq!(v, value(*k), "{}: key {k} returned another value", backing(seg));
                    true
                }
                None => false,
            })
            .collect();
        let m = present.len() as u64;
        assert!(m >= 1, "{}: the latest record must survive", backing(seg));
        assert_eq!(
            present,
            (n - m..n).collect::<Vec<_>>(),
            "{}: survivors are the newest",
            backing(seg)
        );
        let record = 40 + len.div_ceil(8) as u64 * 8; // header words + value, in words
        assert!(
            m * record <= cap,
            "{}: {m} records of {record} B in {cap} B",
            backing(seg)
        );
        assert!(m + 1 >= cap / record, "{}: only {m} records survive", backing(seg));
        let s = log.stats();
        assert_eq!(s.records, n);
        assert!(s.tail > 3 * cap);
    });
}

#[test]
fn server_table_life_cycle() {
    both("servers", &small_plan(), |seg| {
        let t = seg.tables().servers;
        let now = seg.clock().now_ms();
        assert_eq!(t.capacity(), 128);
        assert_eq!(t.servers().count(), 0);
        assert_eq!(t.current(0), None);
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(9999), None, "out-of-range slots are misses");

        let a = t.register(0xa, "http://10.0.0.1:8000", now).unwrap();
        let b = t.register(0xb, "http://10.0.0.2:8000", now + 1).unwrap();
        assert_eq!((a.slot, a.generation), (0, 1));
        assert_eq!((b.slot, b.generation), (1, 1));
        let info = t.get(a.slot).unwrap();
        assert_eq!(info.server, a);
        assert_eq!(info.state, ServerState::Up);
        assert_eq!(info.id, 0xa);
        assert_eq!(info.address, "http://10.0.0.1:8000");
        assert_eq!(info.registered_ms, now);
        assert_eq!((info.inflight_requests, info.inflight_tokens), (0, 0));
        assert_eq!(info.load, LoadFigures::default());
        assert_eq!(t.current(b.slot), Some((b, ServerState::Up)));
        assert!(t.is_live(a.tag()) && t.is_live(b.tag()));

        // States: only Up is live; Free/Configuring are not settable.
        for (state, live) in [
            (ServerState::Draining, false),
            (ServerState::Down, false),
            (ServerState::Up, true),
        ] {
            assert!(t.set_state(a, state));
            assert_eq!(t.get(a.slot).unwrap().state, state);
            assert_eq!(t.is_live(a.tag()), live, "{state:?}");
        }
        assert!(!t.set_state(a, ServerState::Free));
        assert!(!t.set_state(a, ServerState::Configuring));

        // In-flight accounting per process, and reclaim of a dead process.
        assert!(t.begin_request(3, a, 100));
        assert!(t.begin_request(3, a, 20));
        assert!(t.begin_request(7, a, 5));
        assert!(t.begin_request(7, b, 1));
        assert_eq!(t.inflight(a), (3, 125));
        assert_eq!(t.inflight_of(3, a), (2, 120));
        assert_eq!(t.inflight_of(7, a), (1, 5));
        assert_eq!(t.get(a.slot).unwrap().inflight_requests, 3);
        t.end_request(3, a, 20, false);
        assert_eq!(t.inflight(a), (2, 105));
        t.reclaim_process(7); // process 7 died with one request to a and one to b
        assert_eq!(t.inflight(a), (1, 100));
        assert_eq!(t.inflight(b), (0, 0));
        assert_eq!(t.inflight_of(7, a), (0, 0));
        t.reclaim_process(7);
        assert_eq!(t.inflight(a), (1, 100), "reclaim is idempotent");

        // Load figures.
        let f = LoadFigures {
            waiting: 4,
            running: 12,
            kv_usage_permyriad: 8_750,
            scraped_at_ms: now + 5,
            pending_at_scrape: 2,
        };
        assert!(t.store_load(a, f));
        assert_eq!(t.load(a), f);
        assert_eq!(t.get(a.slot).unwrap().load, f);
        let huge = LoadFigures { waiting: u32::MAX, ..f };
        assert!(t.store_load(a, huge));
        assert_eq!(t.load(a).waiting, (1 << 24) - 1, "saturates");

        // Retire and reuse: the generation bumps and the old ref goes stale.
        assert!(t.retire(a));
        assert!(!t.retire(a), "already retired");
        assert_eq!(t.get(a.slot), None);
        assert_eq!(t.current(a.slot), None);
        assert!(!t.is_live(a.tag()));
        let a2 = t.register(0xa2, "http://10.0.0.3:8000", now + 9).unwrap();
        assert_eq!((a2.slot, a2.generation), (a.slot, a.generation + 1));
        assert_ne!(a2.tag(), a.tag());
        assert!(t.is_live(a2.tag()) && !t.is_live(a.tag()));
        assert_eq!(t.inflight(a2), (0, 0), "a reused slot starts from zero");
        assert_eq!(t.inflight_of(3, a2), (0, 0));
        assert_eq!(t.load(a2), LoadFigures::default());
        assert_eq!(t.get(a2.slot).unwrap().address, "http://10.0.0.3:8000");
        assert!(!t.set_state(a, ServerState::Down), "stale ref refused");
        assert!(!t.retire(a));
        assert!(!t.begin_request(3, a, 1));
        t.end_request(3, a, 100, false); // ignored: stale
        assert_eq!(t.inflight(a2), (0, 0));
        assert!(!t.store_load(a, f));
        assert_eq!(t.servers().count(), 2);

        // Limits.
        let long = "x".repeat(257);
        assert_eq!(t.register(1, &long, 0), Err(RegisterError::AddressTooLong { len: 257 }));
        let full = "y".repeat(256);
        for i in 2..128u64 {
            t.register(i, &full, 0).unwrap();
        }
        assert_eq!(t.register(0, "z", 0), Err(RegisterError::Full));
        assert_eq!(t.servers().count(), 128);
        assert_eq!(t.get(127).unwrap().address, full);
    });
}

#[test]
fn registry_life_cycle_and_stale_incarnations() {
    both("registry", &small_plan(), |seg| {
        let r = seg.tables().registry;
        assert_eq!(r.capacity(), 128);
        assert_eq!(r.processes().count(), 0);
        let slot = r.find_free().unwrap();
        assert_eq!(slot, 0);
        let info = r.get(slot).unwrap();
        assert_eq!((info.state, info.role, info.incarnation), (ProcessState::Free, None, 0));

        let inc = r.claim(slot, Role::Responder, 100);
        assert_eq!(inc, 1);
        assert!(r.is_alive(slot, inc));
        let info = r.get(slot).unwrap();
        assert_eq!(
            (info.state, info.role, info.pid, info.started_ms, info.restarts),
            (ProcessState::Starting, Some(Role::Responder), 0, 100, 0)
        );
        assert_eq!(r.find_free(), Some(1), "a starting slot is taken");

        assert!(!r.attach(slot, inc + 1, 77, 101), "wrong incarnation");
        assert!(r.attach(slot, inc, 4242, 105));
        assert!(!r.attach(slot, inc, 4243, 106), "attach happens once");
        assert!(r.heartbeat(slot, inc, 200));
        assert!(r.heartbeat(slot, inc, 150), "an older heartbeat is accepted ...");
        let info = r.get(slot).unwrap();
        assert_eq!(info.heartbeat_ms, 200, "... but never moves time back");
        assert_eq!((info.pid, info.state), (4242, ProcessState::Running));
        assert_eq!(r.processes().count(), 1);

        assert!(r.mark_exited(slot, inc));
        assert!(!r.mark_exited(slot, inc));
        assert!(!r.is_alive(slot, inc));
        assert_eq!(r.get(slot).unwrap().state, ProcessState::Exited);
        assert_eq!(r.find_free(), Some(slot), "an exited slot is free again");

        // A new incarnation: late writes of the old one are ignored.
        let inc2 = r.claim(slot, Role::Dispatcher, 300);
        assert_eq!(inc2, inc + 1);
        let info = r.get(slot).unwrap();
        assert_eq!((info.restarts, info.role, info.pid), (1, Some(Role::Dispatcher), 0));
        assert!(!r.heartbeat(slot, inc, 999));
        assert!(!r.attach(slot, inc, 1, 999));
        assert!(!r.mark_exited(slot, inc));
        assert!(!r.is_alive(slot, inc));
        assert!(r.is_alive(slot, inc2));
        assert_eq!(r.get(slot).unwrap().heartbeat_ms, 300);

        // Other slots are independent.
        let other = r.find_free().unwrap();
        assert_ne!(other, slot);
        let oinc = r.claim(other, Role::Tool, 400);
        assert_eq!(oinc, 1);
        assert!(r.attach(other, oinc, 99, 401));
        assert_eq!(r.processes().count(), 2);
        assert!(r.is_alive(slot, inc2));
    });
}

#[test]
fn stats_blocks_are_per_process_and_summed() {
    both("stats", &small_plan(), |seg| {
        let s = seg.tables().stats;
        assert_eq!((s.processes(), s.words()), (128, shm_layout::STAT_WORDS));
        for p in 0..128u16 {
            s.add(p, 0, 1);
            s.add(p, 5, u64::from(p));
        }
        s.add(127, shm_layout::STAT_WORDS - 1, 3);
        assert_eq!(s.sum(0), 128);
        assert_eq!(s.sum(5), (0..128).sum::<u64>());
        assert_eq!((s.get(9, 5), s.get(127, shm_layout::STAT_WORDS - 1)), (9, 3));
        // The region is its own: no other table moved.
        let t = seg.tables();
        assert_eq!(t.prefix.occupancy(), 0);
        assert_eq!(t.registry.processes().count(), 0);
        assert_eq!(t.responses.stats().records, 0);
        // A second view (as another process opening the segment) sees the same counts.
        let again = seg.tables().stats;
        assert_eq!(again.sum_all()[5], s.sum(5));
    });
}

#[test]
fn ring_is_fifo_across_wraps() {
    both("ring-fifo", &small_plan(), |seg| {
        let ring = seg.tables().ring(0);
        let cap = ring.stats().capacity;
        let mut out = Vec::new();
        assert_eq!(ring.pop(&mut out), Pop::Empty);
        let mut total = 0u64;
        let mut n = 0u32;
        let record = |i: u32| -> Vec<u8> { (0..(i * 37) % 700).map(|b| (b ^ i) as u8).collect() };
        // Push three, pop three, with varying sizes, until the ring wrapped
        // several times.
        while total < 5 * cap {
            for j in 0..3 {
                let rec = record(n + j);
                total += rec.len() as u64;
                ring.push(&rec).unwrap();
            }
            for j in 0..3 {
                assert_eq!(ring.pop(&mut out), Pop::Record, "{}", backing(seg));
                assert_eq!(out, record(n + j), "{}: record {}", backing(seg), n + j);
            }
            n += 3;
        }
        assert_eq!(ring.pop(&mut out), Pop::Empty);
        let s = ring.stats();
        assert_eq!(
            (s.pushed, s.dropped, s.skipped, s.corrupt, s.used),
            (u64::from(n), 0, 0, 0, 0)
        );
    });
}

#[test]
fn full_ring_drops_and_counts() {
    both("ring-full", &small_plan(), |seg| {
        let ring = seg.tables().ring(1);
        let cap = ring.stats().capacity;
        assert_eq!(ring.max_record() as u64, cap / 4 - 32);
        let rec = [5u8; 1000];
        let mut pushed = 0u64;
        while ring.push(&rec).is_ok() {
            pushed += 1;
        }
        let size = 1024 + 32; // 1000 bytes + 32-byte header, rounded to 32
        assert_eq!(pushed, cap / size, "{}: a full ring holds what fits", backing(seg));
        assert_eq!(ring.push(&rec), Err(PushError::Full));
        let s = ring.stats();
        assert_eq!((s.pushed, s.dropped), (pushed, 2));
        assert!(s.used <= cap);

        let mut out = Vec::new();
        assert_eq!(ring.pop(&mut out), Pop::Record);
        assert_eq!(out, rec);
        ring.push(&rec).expect("room again after a pop");

        let max = ring.max_record();
        assert_eq!(
            ring.push(&vec![0; max + 1]),
            Err(PushError::TooLarge { len: max + 1, max })
        );
        assert_eq!(ring.stats().dropped, 3);
        // Drain: everything accepted comes out, in order, intact.
        let mut popped = 0;
        while ring.pop(&mut out) == Pop::Record {
            assert_eq!(out, rec);
            popped += 1;
        }
        assert_eq!(popped, pushed);
        let big = vec![9u8; max];
        ring.push(&big).expect("the largest record fits an empty ring");
        assert_eq!(ring.pop(&mut out), Pop::Record);
        assert_eq!(out, big);
    });
}

#[test]
fn rings_are_independent_and_record_their_owner() {
    both("ring-indep", &small_plan(), |seg| {
        let t = seg.tables();
        assert_eq!(t.ring_count(), 64);
        let (i, j) = (3, 4);
        t.ring(i).push(b"for ring three").unwrap();
        let mut out = Vec::new();
        for r in 0..t.ring_count() {
            if r != i {
                assert_eq!(t.ring(r).pop(&mut out), Pop::Empty, "{}: ring {r}", backing(seg));
                assert_eq!(t.ring(r).stats().pushed, 0);
            }
        }
        t.ring(j).push(b"for ring four").unwrap();
        assert_eq!(t.ring(j).pop(&mut out), Pop::Record);
        assert_eq!(out, b"for ring four");
        assert_eq!(t.ring(i).pop(&mut out), Pop::Record);
        assert_eq!(out, b"for ring three");

        // Filling one ring leaves its neighbours alone.
        while t.ring(i).push(&[1u8; 500]).is_ok() {}
        t.ring(j).push(b"still room").unwrap();
        assert_eq!(t.ring(j).pop(&mut out), Pop::Record);
        assert_eq!(out, b"still room");
        assert_eq!(t.ring(j).stats().dropped, 0);

        assert_eq!(t.ring(i).owner(), (0, 0));
        t.ring(i).set_owner(7, 9);
        t.ring(j).set_owner(127, u32::MAX);
        assert_eq!(t.ring(i).owner(), (7, 9));
        assert_eq!(t.ring(j).owner(), (127, u32::MAX));
        assert_eq!(t.ring(i + 2).owner(), (0, 0));

        let out_of_range = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.ring(t.ring_count());
        }));
        assert!(out_of_range.is_err(), "ring(ring_count()) panics");
    });
}

#[test]
fn completion_record_round_trips_through_a_ring_into_the_tables() {
    both("ring-completion", &small_plan(), |seg| {
        let t = seg.tables();
        let server = t.servers.register(1, "http://gpu-0:8000", 0).unwrap();
        let prompt: Vec<u64> = (500..520).map(spread).collect();
        let full: Vec<u64> = (500..530).map(spread).collect();
        let key = ResponseKey(0xfeed_0000_0000_0000_0000_0000_0000_beef);
        let response = br#"{"choices":[{"text":"hello"}]}"#;
        let record = CompletionRecord {
            server,
            prompt_tokens: 320,
            output_tokens: 160,
            prompt_blocks: &prompt,
            full_blocks: &full,
            continuation: None,
            response: Some((key, response)),
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        record.encode_into(&mut buf);
        assert_eq!(buf.len(), record.encoded_len());
        let bare = CompletionRecord {
            response: None,
            prediction: None,
            timing: None,
            full_blocks: &[],
            ..record
        };
        let mut bare_buf = Vec::new();
        bare.encode_into(&mut bare_buf);

        let ring = t.ring(5);
        ring.push(&buf).unwrap();
        ring.push(&bare_buf).unwrap();

        // The responder side.
        let mut out = Vec::new();
        let mut c = Completion::default();
        assert_eq!(ring.pop(&mut out), Pop::Record);
        c.decode_from(&out).unwrap();
        assert_eq!(c.server, Some(server));
        assert_eq!((c.prompt_tokens, c.output_tokens), (320, 160));
        assert_eq!(c.prompt_blocks, prompt);
        assert_eq!(c.full_blocks, full);
        assert_eq!(c.response_key, Some(key));
        assert_eq!(c.response, response);
        let s = c.server.unwrap();
        t.prefix.insert_chain(&c.full_blocks, s, seg.clock().stamp());
        t.responses.put(c.response_key.unwrap(), &c.response).unwrap();

        assert_eq!(ring.pop(&mut out), Pop::Record);
        c.decode_from(&out).unwrap();
        assert_eq!((c.response_key, c.response.len(), c.full_blocks.len()), (None, 0, 0));
        assert_eq!(c.prompt_blocks, prompt);
        assert_eq!(ring.pop(&mut out), Pop::Empty);

        // The dispatcher side now sees both.
        let m = t.prefix.longest_prefix_match(&full, |tag| t.servers.is_live(tag));
        assert_eq!(m.best(), Some((server.tag(), 30)));
        assert_eq!(t.responses.get(key).as_deref(), Some(&response[..]));
    });
}

#[test]
fn both_runs_the_body_on_each_backing() {
    // Guards the harness itself against running one backing twice.
    let seen = std::cell::RefCell::new(Vec::new());
    both("meta", &small_plan(), |seg: &Segment| {
        seen.borrow_mut().push(backing(seg))
    });
    assert_eq!(*seen.borrow(), ["heap", "shm"]);
}
