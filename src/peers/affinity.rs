//! Affinity across regions: a conversation forwarded to a peer gateway
//! keeps going there while its prefix is warm there.
//!
//! When a gateway forwards a request, it records the prompt's block chain
//! for that peer in its own prefix table, in a keyspace of its own (each
//! key mixed with [`KEYSPACE`], so a peer's entries never meet a local
//! server's). The next turn of the conversation carries the same prefix
//! and more; its lookup walks the same mixed chain, and finds the peer with
//! as many blocks as the last turn's prompt had. When that is deeper than
//! any local server's match, the turn goes to the peer even if a local
//! server has room (while the peer's summary shows room), as SkyLB keeps a
//! prefix in the region whose trie holds it.
//!
//! How long is "warm there": an entry counts while it is at most
//! `peering.affinity_secs` old (refreshed by every turn forwarded) and no
//! older than the peer says its engines keep entries (its summary's
//! [`warm_s`](super::summary::LoadSummary::warm_s): the shortest time
//! since any of its engines was seen to evict). So an entry outlives
//! neither the gateway's bound nor the peer's own evictions.
//!
//! The entries live in the segment's prefix table in both stores (in Redis
//! mode too: which peer a conversation went to is this host's knowledge,
//! as the peer book is), refreshed and evicted like any other entry. A
//! peer is a [`ServerRef`] whose slot is its index in the peer list and
//! whose generation is a hash of its address, so a reordered `[[peer]]`
//! list after a reload or a restart does not send a conversation to the
//! wrong region.

use shm_layout::{PrefixTable, ServerRef, ServerTag, Stamp};

use crate::routing::random::mix;

/// Mixed into every key of a peer's chain ("peerprfx").
pub const KEYSPACE: u64 = 0x7065_6572_7072_6678;

/// `chain` in the peers' keyspace.
pub fn peer_chain(chain: &[u64]) -> Vec<u64> {
    chain.iter().map(|k| mix(k ^ KEYSPACE)).collect()
}

/// How the peer at `index` of the peer list, at `address`, appears in
/// the prefix table.
pub fn peer_ref(index: usize, address: &str) -> ServerRef {
    ServerRef {
        slot: u16::try_from(index).unwrap_or(u16::MAX),
        generation: (seahash::hash(address.as_bytes()) & 0xffff_ffff) as u32,
    }
}

/// The peer a prompt continues, as the table knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerMatch {
    /// The peer's index in the book.
    pub index: usize,
    /// Leading blocks of the prompt last sent to it.
    pub blocks: u32,
}

/// Records that the prompt with `chain` (already in the peers' keyspace,
/// [`peer_chain`]) was forwarded to `peer` at `now`.
pub fn record(table: &PrefixTable<'_>, chain: &[u64], peer: ServerRef, now: Stamp) {
    table.insert_chain(chain, peer, now);
}

/// The peer holding the most leading blocks of `chain` (in the peers'
/// keyspace) at `now`, counting a peer's entries only while they are at
/// most `max_age(peer)` seconds old (`None`: the peer does not count).
pub fn matched(
    table: &PrefixTable<'_>,
    chain: &[u64],
    now: Stamp,
    peers: &[(ServerRef, Option<u16>)],
) -> Option<PeerMatch> {
    if chain.is_empty() || peers.iter().all(|(_, age)| age.is_none()) {
        return None;
    }
    let max_age = |tag: ServerTag| peers.iter().find(|(p, _)| p.tag() == tag).and_then(|(_, age)| *age);
    let (tag, blocks) = table.longest_prefix_match_within(chain, now, max_age).best()?;
    Some(PeerMatch {
        index: usize::from(tag.slot()),
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use shm_layout::{LayoutPlan, Segment};

    use super::*;

    fn peer(index: usize) -> ServerRef {
        peer_ref(index, &format!("http://10.1.0.{index}:8080"))
    }

    fn chain(seed: u64, len: u64) -> Vec<u64> {
        (1..=len)
            .map(|i| (seed << 32 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect()
    }

    #[test]
    fn a_continued_prompt_finds_the_peer_its_last_turn_went_to_while_young_enough() {
        let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let t = seg.tables();
        let (b, c) = (peer(0), peer(1));
        let now = Stamp(1000);
        let turn1 = chain(7, 6);
        record(&t.prefix, &peer_chain(&turn1), b, now);
        let mut turn2 = turn1.clone();
        turn2.extend(chain(8, 4));
        let turn2 = peer_chain(&turn2);
        let peers = [(b, Some(60)), (c, Some(60))];
        assert_eq!(
            matched(&t.prefix, &turn2, now, &peers),
            Some(PeerMatch { index: 0, blocks: 6 })
        );
        // Older than the peer's window: gone.
        assert_eq!(matched(&t.prefix, &turn2, Stamp(1061), &peers), None);
        // A peer that does not count (no fresh summary), or none at all.
        assert_eq!(matched(&t.prefix, &turn2, now, &[(b, None), (c, Some(60))]), None);
        assert_eq!(matched(&t.prefix, &turn2, now, &[]), None);
        // The local keyspace does not see it, nor the peers' the local one.
        let live = |_| true;
        assert!(t.prefix.longest_prefix_match(&turn1, live).is_empty());
        let local = t.servers.register(1, "http://a", 0).unwrap();
        t.prefix.insert_chain(&chain(9, 3), local, now);
        assert_eq!(matched(&t.prefix, &peer_chain(&chain(9, 3)), now, &peers), None);
    }

    #[test]
    fn a_peer_list_reordered_does_not_inherit_another_peers_conversations() {
        let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let t = seg.tables();
        let now = Stamp(5);
        let turn = peer_chain(&chain(3, 4));
        record(&t.prefix, &turn, peer(0), now);
        // After a reload index 0 is another address.
        let other = peer_ref(0, "http://10.9.9.9:8080");
        assert_eq!(matched(&t.prefix, &turn, now, &[(other, Some(60))]), None);
        assert!(matched(&t.prefix, &turn, now, &[(peer(0), Some(60))]).is_some());
    }
}
