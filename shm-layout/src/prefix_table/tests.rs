//! The prefix table's unit tests: inserts, refreshes and evictions, removal
//! and flushes (also while writers and readers run), and longest-prefix
//! matches with and without age limits.

use super::*;
use crate::bucket::Bucket;
use crate::server_table::{ServerRef, ServerTag};

fn table(buckets: usize) -> (Vec<Bucket>, u64) {
    ((0..buckets).map(|_| Bucket::new()).collect(), 0x5eed)
}

fn srv(slot: u16, generation: u32) -> ServerRef {
    ServerRef { slot, generation }
}

#[test]
fn the_occupancy_estimate_follows_the_fill_and_is_exact_when_sparse() {
    let (b, seed) = table(1 << 12);
    let t = PrefixTable::new(&b, seed);
    assert_eq!(t.occupancy_estimate(256, 512), 0);
    // A few entries: the whole table is read, the count is exact.
    for k in 1..=13u64 {
        t.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), srv(1, 1), Stamp(1));
    }
    assert_eq!(t.occupancy_estimate(256, 512), 13);
    let mut k = 13u64;
    for fill in [0.1, 0.5, 0.9] {
        let target = (t.capacity() as f64 * fill) as u64;
        while t.occupancy() < target {
            for _ in 0..256 {
                k += 1;
                t.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), srv(1, 1), Stamp(1));
            }
        }
        let (exact, estimate) = (t.occupancy() as f64, t.occupancy_estimate(256, 512) as f64);
        assert!(
            (estimate - exact).abs() <= exact * 0.05,
            "fill {fill}: {estimate} for {exact}"
        );
    }
}

#[test]
fn insert_then_lookup_and_refresh_moves_to_front() {
    let (b, seed) = table(16);
    let t = PrefixTable::new(&b, seed);
    assert_eq!(t.lookup(7), None);
    assert_eq!(t.insert(7, srv(1, 1), Stamp(10)), InsertOutcome::Inserted);
    assert_eq!(t.insert(7, srv(2, 1), Stamp(11)), InsertOutcome::Refreshed);
    assert_eq!(t.insert(7, srv(2, 1), Stamp(11)), InsertOutcome::Unchanged);
    let e = t.lookup(7).unwrap();
    let got: Vec<u16> = e.servers.iter().map(|s| s.slot()).collect();
    assert_eq!(got, vec![2, 1]);
    assert_eq!(e.stamp, Stamp(11));
    t.insert(7, srv(3, 1), Stamp(12));
    t.insert(7, srv(4, 1), Stamp(13));
    let got: Vec<u16> = t.lookup(7).unwrap().servers.iter().map(|s| s.slot()).collect();
    assert_eq!(got, vec![4, 3, 2], "least recent server falls off");
}

#[test]
fn a_new_generation_replaces_the_old_lane() {
    let (b, seed) = table(4);
    let t = PrefixTable::new(&b, seed);
    t.insert(9, srv(5, 1), Stamp(0));
    t.insert(9, srv(5, 2), Stamp(0));
    let e = t.lookup(9).unwrap();
    assert_eq!(e.servers.len(), 1);
    assert!(e.servers.contains(srv(5, 2).tag()));
    assert!(!e.servers.contains(srv(5, 1).tag()));
}

#[test]
fn full_bucket_evicts_the_stalest() {
    let (b, seed) = table(1);
    let t = PrefixTable::new(&b, seed);
    for (k, s) in [(1u64, 5u16), (2, 1), (3, 9), (4, 7)] {
        assert_eq!(t.insert(k, srv(0, 0), Stamp(s)), InsertOutcome::Inserted);
    }
    assert_eq!(t.insert(5, srv(0, 0), Stamp(10)), InsertOutcome::Evicted);
    assert_eq!(t.lookup(2), None, "stamp 1 was the stalest");
    assert!(t.lookup(1).is_some() && t.lookup(5).is_some());
    assert_eq!(t.occupancy(), 4);
}

#[test]
fn insert_chain_counts_what_it_evicts() {
    let (b, seed) = table(1);
    let t = PrefixTable::new(&b, seed);
    assert_eq!(t.insert_chain(&[1, 2, 3], srv(0, 0), Stamp(1)), 0);
    assert_eq!(
        t.insert_chain(&[1, 4], srv(0, 0), Stamp(2)),
        0,
        "a refresh and a free slot"
    );
    assert_eq!(
        t.insert_chain(&[5, 6, 1], srv(0, 0), Stamp(3)),
        2,
        "one bucket of four: 5 and 6 evict"
    );
}

#[test]
fn stalest_is_judged_with_wrapping_stamps() {
    let (b, seed) = table(1);
    let t = PrefixTable::new(&b, seed);
    // now = 3 after a wrap: 65530 is 9 s old, 1 is 2 s old.
    for (k, s) in [(1u64, 65_530u16), (2, 1), (3, 2), (4, 3)] {
        t.insert(k, srv(0, 0), Stamp(s));
    }
    t.insert(5, srv(0, 0), Stamp(3));
    assert_eq!(t.lookup(1), None);
}

#[test]
fn remove_drops_a_server_then_the_entry() {
    let (b, seed) = table(4);
    let t = PrefixTable::new(&b, seed);
    t.insert(1, srv(1, 0), Stamp(0));
    t.insert(1, srv(2, 0), Stamp(0));
    assert!(t.remove(1, srv(1, 0).tag()));
    assert!(!t.remove(1, srv(1, 0).tag()));
    assert_eq!(t.lookup(1).unwrap().servers.len(), 1);
    assert!(t.remove(1, srv(2, 0).tag()));
    assert_eq!(t.lookup(1), None);
    assert_eq!(t.occupancy(), 0);
}

#[test]
fn clear_empties_the_table_and_counts_what_it_removed() {
    let (b, seed) = table(16);
    let t = PrefixTable::new(&b, seed);
    assert_eq!(t.clear(), 0);
    for k in 0..40u64 {
        t.insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), srv(1, 0), Stamp(0));
    }
    let before = t.occupancy();
    assert!(before > 0);
    assert_eq!(t.clear(), before);
    assert_eq!(t.occupancy(), 0);
    assert_eq!(t.lookup(0x9e37_79b9_7f4a_7c15), None);
    // The table works as before afterwards.
    assert_eq!(t.insert(7, srv(2, 0), Stamp(1)), InsertOutcome::Inserted);
    assert!(t.lookup(7).is_some());
}

#[test]
fn remove_server_forgets_one_server_everywhere_and_keeps_the_others() {
    let (b, seed) = table(64);
    let t = PrefixTable::new(&b, seed);
    let key = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for k in 0..60u64 {
        t.insert(key(k), srv(1, 0), Stamp(3));
        if k % 2 == 0 {
            t.insert(key(k), srv(2, 0), Stamp(4));
        }
    }
    let listed = |tag: ServerTag| t.entries().filter(|(_, e)| e.servers.contains(tag)).count() as u64;
    let (ones, twos, before) = (listed(srv(1, 0).tag()), listed(srv(2, 0).tag()), t.occupancy());
    assert_eq!(t.remove_server(srv(1, 0).tag()), ones);
    assert_eq!(listed(srv(1, 0).tag()), 0);
    assert_eq!(listed(srv(2, 0).tag()), twos, "the other server keeps its entries");
    // Entries that listed only server 1 are gone; shared ones keep server 2
    // and their stamp.
    assert_eq!(t.occupancy(), twos);
    assert!(before > twos);
    assert_eq!(
        t.lookup(key(0)).map(|e| (e.servers.len(), e.stamp)),
        Some((1, Stamp(4)))
    );
    assert_eq!(t.remove_server(srv(1, 0).tag()), 0);
}

#[test]
fn clear_is_safe_while_writers_and_readers_run() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (b, seed) = table(64);
    let t = PrefixTable::new(&b, seed);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for w in 0..2u64 {
            let stop = &stop;
            s.spawn(move || {
                let mut k = w;
                while !stop.load(Ordering::Relaxed) {
                    t.insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), srv(w as u16, 0), Stamp(0));
                    k += 2;
                }
            });
        }
        let stop = &stop;
        s.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // Whatever a reader finds is a whole, valid entry.
                for (_, e) in t.entries() {
                    assert!(!e.servers.is_empty());
                }
            }
        });
        // At least 200 flushes, and on until one removed something: on a
        // busy machine the writers may not have run yet.
        let (mut removed, mut rounds) = (0, 0);
        while rounds < 200 || removed == 0 {
            removed += t.clear();
            rounds += 1;
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
    });
    // With the writers stopped, one more flush leaves nothing behind.
    t.clear();
    assert_eq!(t.occupancy(), 0);
    assert_eq!(t.entries().count(), 0);
}

/// A chain written while a dispatcher matches it appears whole or not
/// at all: a match never sees a partial write (the race that moved a
/// conversation whose answer was being written back, see
/// [`PrefixTable::insert_chain`]), and removing its first block takes it
/// back whole.
#[test]
fn a_chain_being_written_is_matched_whole_or_not_at_all() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const BLOCKS: u64 = 32;
    const ROUNDS: u64 = 4000;
    let chain_of = |round: u64| -> Vec<u64> {
        (0..BLOCKS)
            .map(|i| (round * BLOCKS + i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect()
    };
    let (b, seed) = table(1 << 16);
    let t = PrefixTable::new(&b, seed);
    let (round, done, reading) = (AtomicU64::new(0), AtomicBool::new(false), AtomicBool::new(false));
    let (mut whole, mut none) = (0u64, 0u64);
    std::thread::scope(|s| {
        s.spawn(|| {
            // The writes must overlap the reads: on a busy machine the
            // reader may not be scheduled before 4 000 rounds are over.
            while !reading.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            for r in 1..=ROUNDS {
                round.store(r, Ordering::Release);
                t.insert_chain(&chain_of(r), srv(1, 0), Stamp(0));
                // Taken back from its first block: unpublished at once.
                t.remove(chain_of(r - 1)[0], srv(1, 0).tag());
            }
            done.store(true, Ordering::Release);
        });
        while !done.load(Ordering::Acquire) {
            reading.store(true, Ordering::Release);
            let chain = chain_of(round.load(Ordering::Acquire));
            let depth = t.longest_prefix_match(&chain, |_| true).blocks_for(srv(1, 0).tag());
            match u64::from(depth) {
                0 => none += 1,
                BLOCKS => whole += 1,
                d => panic!("a partial chain matched: {d} of {BLOCKS} blocks"),
            }
        }
    });
    assert!(whole + none > 0, "the reader ran");
}

#[test]
fn longest_prefix_match_counts_leading_blocks_per_server() {
    let (b, seed) = table(64);
    let t = PrefixTable::new(&b, seed);
    // Spread over buckets like real hashes do.
    let chain: Vec<u64> = (100..110u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    t.insert_chain(&chain[..7], srv(1, 0), Stamp(0));
    t.insert_chain(&chain[..3], srv(2, 0), Stamp(0));
    let m = t.longest_prefix_match(&chain, |_| true);
    assert_eq!(m.blocks_for(srv(1, 0).tag()), 7);
    assert_eq!(m.blocks_for(srv(2, 0).tag()), 3);
    assert_eq!(m.best(), Some((srv(1, 0).tag(), 7)));
    let only2 = t.longest_prefix_match(&chain, |s| s.slot() == 2);
    assert_eq!(only2.best(), Some((srv(2, 0).tag(), 3)));
    assert!(t.longest_prefix_match(&[1, 2, 3], |_| true).is_empty());
    assert!(t.longest_prefix_match(&[], |_| true).is_empty());
}

#[test]
fn a_match_within_an_age_sets_older_entries_aside_per_server() {
    let (b, seed) = table(64);
    let t = PrefixTable::new(&b, seed);
    let chain: Vec<u64> = (200..210u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    // Server 1 refreshed 3 blocks at second 10, server 2 the first 2
    // at 15, then server 1 all 6 at 20.
    t.insert_chain(&chain[..3], srv(1, 0), Stamp(10));
    t.insert_chain(&chain[..2], srv(2, 0), Stamp(15));
    t.insert_chain(&chain[..6], srv(1, 0), Stamp(20));
    let now = Stamp(30);
    let all = t.longest_prefix_match_within(&chain, now, |_| Some(u16::MAX));
    assert_eq!(all, t.longest_prefix_match(&chain, |_| true));
    assert_eq!(all.blocks_for(srv(1, 0).tag()), 6);
    assert_eq!(all.refreshed(srv(1, 0).tag()), Some(Stamp(20)));
    // Server 2 is listed behind server 1 in its deepest entry (stamp
    // 20, server 1's refresh): its own refresh time is unknown.
    assert_eq!(all.blocks_for(srv(2, 0).tag()), 2);
    assert_eq!(all.refreshed(srv(2, 0).tag()), None);
    // Entries older than 15 s set aside for server 1 only.
    let limited = t.longest_prefix_match_within(&chain, now, |s| Some(if s.slot() == 1 { 15 } else { u16::MAX }));
    assert_eq!(limited.blocks_for(srv(1, 0).tag()), 6, "its deepest entries are recent");
    let limited = t.longest_prefix_match_within(&chain, now, |s| Some(if s.slot() == 1 { 5 } else { u16::MAX }));
    assert_eq!(limited.blocks_for(srv(1, 0).tag()), 0, "nothing it refreshed in 5 s");
    assert_eq!(
        limited.blocks_for(srv(2, 0).tag()),
        2,
        "the other server keeps its match"
    );
    // A dead server is not reported; the ages wrap like stamps do.
    assert_eq!(
        t.longest_prefix_match_within(&chain, now, |s| (s.slot() == 2).then_some(u16::MAX))
            .best(),
        Some((srv(2, 0).tag(), 2))
    );
    let wrapped = t.longest_prefix_match_within(&chain, Stamp(20u16.wrapping_add(65530)), |_| Some(10));
    assert!(wrapped.is_empty(), "65530 s after the last refresh is older than 10 s");
    t.insert_chain(&chain[..2], srv(2, 0), Stamp(25));
    let m = t.longest_prefix_match(&chain, |_| true);
    assert_eq!(
        m.refreshed(srv(2, 0).tag()),
        Some(Stamp(25)),
        "now its most recent server"
    );
}

#[test]
fn a_shared_prefix_on_many_servers_still_matches_deep_blocks() {
    let (b, seed) = table(256);
    let t = PrefixTable::new(&b, seed);
    let system: Vec<u64> = (0..4u64).map(|i| (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    // Six servers each cache the system prompt plus their own conversation.
    let chains: Vec<Vec<u64>> = (0..6u64)
        .map(|s| {
            let own = (0..5u64).map(|i| ((s + 10) << 32 | i).wrapping_mul(0xbf58_476d_1ce4_e5b9));
            system.iter().copied().chain(own).collect()
        })
        .collect();
    for (s, c) in chains.iter().enumerate() {
        t.insert_chain(c, srv(s as u16, 0), Stamp(0));
    }
    // The system blocks list only the three most recent servers, yet
    // server 0's own conversation still matches in full.
    assert_eq!(t.lookup(system[0]).unwrap().servers.len(), LANES);
    let m = t.longest_prefix_match(&chains[0], |_| true);
    assert_eq!(m.best(), Some((srv(0, 0).tag(), 9)));
    assert_eq!(
        m.blocks_for(srv(5, 0).tag()),
        4,
        "a recent server holds the system prompt"
    );
    // A hole in the table ends the scan: nothing deeper is trusted.
    assert!(t.remove(chains[0][6], srv(0, 0).tag()));
    assert_eq!(
        t.longest_prefix_match(&chains[0], |_| true).blocks_for(srv(0, 0).tag()),
        6
    );
}
