//! A consistent-hash ring of virtual nodes over the server table's slots,
//! shared by [`super::consistent_hash`] and [`super::dual_map`].
//!
//! Every slot of the server table (not only the live ones) has
//! `virtual_nodes` points on the ring, at `mix(seed, slot, i)`. A key goes
//! to the first point at or after its hash, clockwise, whose slot is a
//! candidate the caller accepts. Because the points of a slot never move,
//! a server going down or coming up moves only the keys of its own arcs
//! (Karger et al., 1997), and nothing is rebuilt when the set of live
//! servers changes: the walk skips what is not a candidate. A slot's
//! points belong to whichever backend holds the slot (the supervisor
//! registers `[[backend]]`s in order, so a fixed configuration keeps its
//! slots).
//!
//! Cost: the ring is built once per policy (`128 × virtual_nodes` points,
//! sorted); a lookup is a binary search plus a walk whose expected length
//! is `128 / live servers` points.

use shm_layout::SERVER_SLOTS;

use super::Candidate;
use super::random::mix;

/// A ring of virtual nodes over every server slot.
#[derive(Debug)]
pub(crate) struct HashRing {
    /// (position, slot), sorted by position.
    points: Vec<(u64, u16)>,
}

impl HashRing {
    /// A ring with `virtual_nodes` points per slot, placed by `seed`
    /// (rings with different seeds are independent).
    pub(crate) fn new(virtual_nodes: u32, seed: u64) -> Self {
        let mut points = Vec::with_capacity(SERVER_SLOTS as usize * virtual_nodes as usize);
        for slot in 0..SERVER_SLOTS as u16 {
            for i in 0..u64::from(virtual_nodes) {
                let position = mix(mix(seed ^ (u64::from(slot) << 32) ^ i).wrapping_add(seed));
                points.push((position, slot));
            }
        }
        points.sort_unstable();
        Self { points }
    }

    /// The first candidate clockwise from (the mixed) `key` that `accept` takes, or
    /// `None` when it takes none.
    pub(crate) fn walk<'c>(
        &self,
        key: u64,
        candidates: &'c [Candidate],
        accept: impl Fn(&Candidate) -> bool,
    ) -> Option<&'c Candidate> {
        if candidates.is_empty() || self.points.is_empty() {
            return None;
        }
        // Keys may be poorly spread (small session ids): mix them first.
        let key = mix(key);
        let start = self.points.partition_point(|&(p, _)| p < key);
        let n = self.points.len();
        // Each slot is judged once: a set of the slots seen (128 bits).
        let mut seen = [0u64; (SERVER_SLOTS as usize).div_ceil(64)];
        let mut unseen = candidates.len();
        for k in 0..n {
            let slot = self.points[(start + k) % n].1;
            let (word, bit) = (usize::from(slot) / 64, 1u64 << (slot % 64));
            if seen[word] & bit != 0 {
                continue;
            }
            seen[word] |= bit;
            if let Some(c) = candidates.iter().find(|c| c.server.slot == slot) {
                if accept(c) {
                    return Some(c);
                }
                unseen -= 1;
                if unseen == 0 {
                    return None;
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::test_support::{Fixture, cand};

    #[test]
    fn keys_stay_put_when_another_server_goes_and_move_only_off_a_gone_server() {
        let f = Fixture::new(5);
        let all: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let without_2: Vec<Candidate> = all.iter().copied().filter(|c| c.server != f.s[2]).collect();
        let ring = HashRing::new(100, 7);
        let mut moved = 0;
        let mut counts = [0usize; 5];
        for key in 0..2000u64 {
            let key = mix(key);
            let before = ring.walk(key, &all, |_| true).unwrap().server;
            let after = ring.walk(key, &without_2, |_| true).unwrap().server;
            counts[usize::from(before.slot)] += 1;
            if before == f.s[2] {
                moved += 1;
                assert_ne!(after, f.s[2]);
            } else {
                assert_eq!(before, after, "only the gone server's keys move");
            }
        }
        assert_eq!(moved, counts[2]);
        for c in counts {
            assert!((200..=600).contains(&c), "100 virtual nodes spread keys: {counts:?}");
        }
    }

    #[test]
    fn walk_skips_what_is_not_accepted_and_gives_up_when_nothing_is() {
        let f = Fixture::new(3);
        let all: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let ring = HashRing::new(10, 1);
        let first = ring.walk(42, &all, |_| true).unwrap().server;
        let second = ring.walk(42, &all, |c| c.server != first).unwrap().server;
        assert_ne!(first, second);
        assert!(ring.walk(42, &all, |_| false).is_none());
        assert!(ring.walk(42, &[], |_| true).is_none());
    }

    #[test]
    fn different_seeds_give_independent_rings() {
        let f = Fixture::new(4);
        let all: Vec<Candidate> = f.s.iter().map(|&s| cand(s, 0, 0)).collect();
        let (a, b) = (HashRing::new(50, 1), HashRing::new(50, 2));
        let same = (0..1000u64)
            .filter(|&k| {
                a.walk(mix(k), &all, |_| true).unwrap().server == b.walk(mix(k), &all, |_| true).unwrap().server
            })
            .count();
        assert!((100..=400).contains(&same), "about 1 in 4 agree by chance: {same}");
    }
}
