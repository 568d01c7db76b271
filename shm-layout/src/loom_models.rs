//! Loom models of the compare-and-swap and commit protocols.
//!
//! Loom runs each model under every interleaving its memory model allows
//! (within its bounds), with the crate's atomics swapped for loom's through
//! `sync`. Run them with
//! `RUSTFLAGS="--cfg loom" cargo test -p shm-layout --release --lib loom`
//! (`.ci/run` does). They check, for every interleaving:
//!
//! * prefix slots: two writers refreshing one key never lose each other's
//!   server, and a concurrent reader sees either no entry or a well-formed one;
//!   an insert that evicts races a refresh of the victim without a torn slot;
//! * response records: a reader racing a writer (and a lapping writer) gets
//!   a miss or exactly one of the values ever written for that key;
//! * ring records: a consumer racing a producer gets `Empty`/`Pending` or
//!   exactly the record pushed, and never the same record twice.
//! * rate limits: two takers of a bucket's last unit: exactly one gets it.

use loom::sync::Arc;
use loom::thread;

use crate::bucket::Bucket;
use crate::completion_ring::{CompletionRing, Pop, RingControl};
use crate::prefix_table::{PrefixTable, Stamp};
use crate::response_log::{LogControl, ResponseKey, ResponseLog};
use crate::server_table::ServerRef;
use crate::sync::AtomicU64;

fn srv(slot: u16) -> ServerRef {
    ServerRef { slot, generation: 1 }
}

/// Every model runs under a preemption bound of 3 (loom's recommended
/// setting: bugs need few preemptions), which keeps the suite to seconds.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

#[test]
fn loom_prefix_concurrent_refreshes_keep_both_servers() {
    model(|| {
        let buckets: Arc<Vec<Bucket>> = Arc::new((0..1).map(|_| Bucket::new()).collect());
        let t = PrefixTable::new(&buckets, 7);
        t.insert(42, srv(0), Stamp(1));
        let b = buckets.clone();
        let writer = thread::spawn(move || {
            PrefixTable::new(&b, 7).insert(42, srv(1), Stamp(2));
        });
        if let Some(e) = t.lookup(42) {
            assert!(e.servers.iter().all(|s| s.slot() <= 1), "{e:?}");
            assert!(!e.servers.is_empty());
        }
        t.insert(42, srv(2), Stamp(2));
        writer.join().unwrap();
        let e = t.lookup(42).expect("entry survives");
        let slots: Vec<u16> = e.servers.iter().map(|s| s.slot()).collect();
        assert!(slots.contains(&1) && slots.contains(&2), "lost update: {slots:?}");
        assert_eq!(slots.len(), 3);
    });
}

#[test]
fn loom_prefix_eviction_races_refresh() {
    model(|| {
        // One bucket, full of four keys; a writer inserts a fifth key (evicting
        // the stalest, key 1) while another refreshes key 1.
        let buckets: Arc<Vec<Bucket>> = Arc::new((0..1).map(|_| Bucket::new()).collect());
        let t = PrefixTable::new(&buckets, 9);
        for (k, s) in [(1u64, 1u16), (2, 5), (3, 5), (4, 5)] {
            t.insert(k, srv(0), Stamp(s));
        }
        let b = buckets.clone();
        let evictor = thread::spawn(move || {
            PrefixTable::new(&b, 9).insert(5, srv(1), Stamp(6));
        });
        t.insert(1, srv(2), Stamp(6));
        evictor.join().unwrap();
        assert!(t.lookup(5).is_some(), "the new key is in");
        for k in 1..=5u64 {
            if let Some(e) = t.lookup(k) {
                let want: &[u16] = match k {
                    1 => &[2, 0],
                    5 => &[1],
                    _ => &[0],
                };
                let got: Vec<u16> = e.servers.iter().map(|s| s.slot()).collect();
                assert!(got == want || (k == 1 && got == [2]), "key {k}: {got:?}");
            }
        }
        assert_eq!(t.occupancy(), 4);
    });
}

type LogParts = (LogControl, Vec<Bucket>, Vec<AtomicU64>);

fn log(p: &LogParts) -> ResponseLog<'_> {
    ResponseLog::new(&p.0, &p.1, &p.2, 16, [1, 2, 3, 4])
}

fn log_parts(words: usize) -> LogParts {
    (
        LogControl::new(),
        (0..1).map(|_| Bucket::new()).collect(),
        (0..words).map(|_| AtomicU64::new(0)).collect(),
    )
}

#[test]
fn loom_response_reader_racing_writers() {
    model(|| {
        // A 128-byte log: two 8-byte records (48 B each) fit, a third laps the first.
        let parts = Arc::new(log_parts(16));
        log(&parts).put(ResponseKey(1), b"value-1a").unwrap();
        let p = parts.clone();
        let writer = thread::spawn(move || {
            let l = log(&p);
            l.put(ResponseKey(1), b"value-1b").unwrap();
            l.put(ResponseKey(2), b"value-2a").unwrap();
        });
        let mut out = Vec::new();
        if let Some(v) = log(&parts).get_into(ResponseKey(1), &mut out) {
            assert!(v == b"value-1a" || v == b"value-1b", "{v:?}");
        }
        writer.join().unwrap();
        let l = log(&parts);
        if let Some(v) = l.get(ResponseKey(1)) {
            assert_eq!(v, b"value-1b", "never an older value once the newer is indexed");
        }
        assert_eq!(l.get(ResponseKey(2)).as_deref(), Some(&b"value-2a"[..]));
    });
}

#[test]
fn loom_ring_consumer_racing_producer() {
    model(|| {
        let parts: Arc<(RingControl, Vec<AtomicU64>)> =
            Arc::new((RingControl::new(), (0..512).map(|_| AtomicU64::new(0)).collect()));
        // Touch the ring before spawning: without a shared access ahead of
        // the spawn, loom explored only one schedule of this model (checked
        // by mutation: a consumer that trusts the reservation word instead
        // of the commit word is caught only in this form).
        CompletionRing::new(&parts.0, &parts.1, [5; 4])
            .push(b"rec-zero")
            .unwrap();
        let p = parts.clone();
        let producer = thread::spawn(move || {
            let r = CompletionRing::new(&p.0, &p.1, [5; 4]);
            r.push(b"rec-one").unwrap();
            r.push(b"rec-two").unwrap();
        });
        let r = CompletionRing::new(&parts.0, &parts.1, [5; 4]);
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for _ in 0..2 {
            if r.pop(&mut out) == Pop::Record {
                seen.push(out.clone());
            }
        }
        producer.join().unwrap();
        while r.pop(&mut out) == Pop::Record {
            seen.push(out.clone());
        }
        assert_eq!(
            seen,
            vec![b"rec-zero".to_vec(), b"rec-one".to_vec(), b"rec-two".to_vec()]
        );
    });
}

#[test]
fn loom_limits_two_takers_of_the_last_unit() {
    use crate::limit_table::{LimitTable, Quota, Taken};
    // A bucket of 2 units per minute with one left: two processes take one
    // each; in every interleaving exactly one gets it, and the bucket ends
    // empty (no charge lost, none doubled).
    model(|| {
        let buckets: Arc<Vec<Bucket>> = Arc::new((0..2).map(|_| Bucket::new()).collect());
        let q = Quota::per_minute(2);
        let now = 1_000;
        assert!(matches!(
            LimitTable::new(&buckets, 9).take(7, q, 1, now),
            Taken::Allowed(_)
        ));
        let b = buckets.clone();
        let other = thread::spawn(move || matches!(LimitTable::new(&b, 9).take(7, q, 1, now), Taken::Allowed(_)));
        let mine = matches!(LimitTable::new(&buckets, 9).take(7, q, 1, now), Taken::Allowed(_));
        let theirs = other.join().unwrap();
        assert!(mine ^ theirs, "exactly one of the two: {mine} {theirs}");
        assert_eq!(LimitTable::new(&buckets, 9).peek(7, q, now).remaining, 0);
    });
}
