//! One engine followed through its events: the batches applied, in
//! sequence, to the segment's confirmed prefix table
//! ([`shm_layout::Tables::confirmed`]) under that engine's server, and how
//! far the table follows the engine ([`KvEventsSync`]).
//!
//! | event | the confirmed table |
//! | --- | --- |
//! | `BlockStored` | the blocks' gateway hashes ([`super::engine_blocks`]) inserted for the server, deepest first, as a write-back does |
//! | `BlockRemoved` | each mapped block's entry loses the server |
//! | `AllBlocksCleared` | every entry of the server goes; the table is complete again (an empty cache is known exactly) |
//!
//! The sequence numbers say whether anything was lost ([`Sequence`]): the
//! next one is applied; an older one is a duplicate (a replay overlapping
//! the live stream), except a 0 after others, which is the engine's
//! publisher starting over (a restarted engine: its cache is empty); a
//! later one leaves a gap, which the subscriber fills from the engine's
//! replay or, failing that, marks the table [`KvEventsSync::Partial`].
//!
//! What this module decides and does not apply: events of another KV
//! cache group than the first (a hybrid model's sliding-window layers: a
//! prefix is reusable when the full-attention group holds it), blocks with
//! extra keys (salted or multimodal: their hash is not their tokens'), and
//! blocks of a model or adapter the gateway has no chain root for.

pub use crate::metrics::counts::Applied;
use std::collections::HashMap;

use shm_layout::{KvEventsSync, ServerRef, Stamp, Tables};

use super::engine_blocks::{EngineBlocks, Skip};
use super::wire::{EventBatch, KvEvent};
use crate::prefix::blocks::BlockHasher;

/// Most blocks mapped for one engine (about 100 MB of map): an engine
/// whose removals were lost would otherwise grow it without bound. Past
/// it the map starts over and the table is [`KvEventsSync::Partial`].
pub const MAX_MAPPED_BLOCKS: usize = 2_000_000;

/// What a sequence number means for the stream ([`Sequence::see`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The next batch: apply it.
    Next,
    /// Seen already (a replay overlapping the live stream): skip it.
    Duplicate,
    /// Batches `from..to` were lost before this one.
    Gap {
        /// The first one missing.
        from: u64,
        /// This one.
        to: u64,
    },
    /// Sequence 0 after later ones: the engine's publisher started over.
    Restarted,
}

/// The next sequence number expected from one publisher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sequence {
    next: Option<u64>,
}

impl Sequence {
    /// Where `seq` stands; the caller then applies it (or not) and calls
    /// [`applied`](Self::applied).
    pub fn see(&self, seq: u64) -> Step {
        match self.next {
            None => Step::Next,
            Some(next) if seq == next => Step::Next,
            Some(next) if seq > next => Step::Gap { from: next, to: seq },
            Some(_) if seq == 0 => Step::Restarted,
            Some(_) => Step::Duplicate,
        }
    }

    /// `seq` was applied (or given up on): the next one expected follows it.
    pub fn applied(&mut self, seq: u64) {
        self.next = Some(seq + 1);
    }

    /// The next one expected, if any was seen.
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Nothing seen yet (a new subscription).
    pub fn forget(&mut self) {
        self.next = None;
    }

    /// The next one expected is `next` (a replay said what came before).
    pub fn expect(&mut self, next: u64) {
        self.next = Some(next);
    }
}

/// The chain roots an engine's blocks are hashed from, by the model they
/// belong to: the base model's, and each LoRA adapter's by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChainRoots {
    /// The base model's blocks (events naming no adapter).
    pub base: Option<BlockHasher>,
    /// An adapter's blocks, by its name.
    pub adapters: HashMap<String, BlockHasher>,
}

impl ChainRoots {
    fn for_adapter(&self, lora_name: Option<&str>) -> Option<&BlockHasher> {
        match lora_name {
            None => self.base.as_ref(),
            Some(name) => self.adapters.get(name),
        }
    }
}

/// One engine's events applied to the confirmed table (see the module docs).
#[derive(Debug)]
pub struct Follower {
    server: ServerRef,
    roots: ChainRoots,
    blocks: EngineBlocks,
    sync: KvEventsSync,
    /// Why the last stored event was skipped, for one log line per kind.
    last_skip: Option<Skip>,
}

impl Follower {
    /// Follows `server`'s engine, hashing its blocks from `roots`. Until
    /// the stream is known from a known state, the table is partial.
    pub fn new(server: ServerRef, roots: ChainRoots) -> Self {
        Self {
            server,
            roots,
            blocks: EngineBlocks::new(),
            sync: KvEventsSync::Partial,
            last_skip: None,
        }
    }

    /// The registration followed.
    pub fn server(&self) -> ServerRef {
        self.server
    }

    /// How far the table follows the engine.
    pub fn sync(&self) -> KvEventsSync {
        self.sync
    }

    /// Blocks of the engine mapped now.
    pub fn mapped(&self) -> usize {
        self.blocks.len()
    }

    /// The chain roots changed (a reload): blocks mapped so far keep their
    /// hashes; new ones take the new roots.
    pub fn set_roots(&mut self, roots: ChainRoots) {
        self.roots = roots;
    }

    /// Forgets everything of the engine: its confirmed entries and the
    /// mapping. `sync`: what the table is then (complete when the engine's
    /// cache is known to be empty: cleared, or a publisher starting at 0).
    /// A full scan of the confirmed table.
    pub fn reset(&mut self, tables: &Tables<'_>, sync: KvEventsSync) {
        tables.confirmed.remove_server(self.server.tag());
        self.blocks.clear();
        self.sync = sync;
    }

    /// Marks the table partial (events were lost); what it holds stays.
    pub fn lost_events(&mut self) {
        self.sync = KvEventsSync::Partial;
    }

    /// The last reason a stored event was skipped, taken (for a log line).
    pub fn take_skip(&mut self) -> Option<Skip> {
        self.last_skip.take()
    }

    /// Applies one batch at segment time `now`.
    pub fn apply(&mut self, batch: &EventBatch, tables: &Tables<'_>, now: Stamp) -> Applied {
        let mut done = Applied {
            batches: 1,
            ..Applied::default()
        };
        for event in &batch.events {
            match event {
                KvEvent::Stored(stored) => {
                    if stored.group.is_some_and(|g| g != 0) {
                        done.skipped += 1;
                        continue;
                    }
                    let Some(hasher) = self.roots.for_adapter(stored.lora_name.as_deref()) else {
                        done.skipped += 1;
                        continue;
                    };
                    match self.blocks.stored(stored, hasher) {
                        Ok(ours) => {
                            tables.confirmed.insert_chain(&ours, self.server, now);
                            done.stored += ours.len() as u64;
                        }
                        Err(skip) => {
                            done.skipped += 1;
                            self.last_skip = Some(skip);
                        }
                    }
                }
                KvEvent::Removed(removed) => {
                    if removed.group.is_some_and(|g| g != 0) {
                        continue;
                    }
                    for hash in self.blocks.removed(removed) {
                        done.removed += u64::from(tables.confirmed.remove(hash, self.server.tag()));
                    }
                }
                KvEvent::Cleared => {
                    self.reset(tables, KvEventsSync::Complete);
                    done.cleared += 1;
                }
                KvEvent::Unknown(_) => {}
            }
        }
        if self.blocks.len() > MAX_MAPPED_BLOCKS {
            self.reset(tables, KvEventsSync::Partial);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use shm_layout::{LayoutPlan, Segment};

    use super::*;
    use crate::kv_events::wire::{BlockRemoved, BlockStored, EngineHash};

    fn stored(hashes: &[i128], parent: Option<i128>, tokens: std::ops::Range<u32>) -> KvEvent {
        KvEvent::Stored(BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
            parent: parent.map(EngineHash::Int),
            token_ids: tokens.collect(),
            block_size: 4,
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
            group: None,
            extra_keys: false,
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
        }
    }

    #[test]
    fn sequence_numbers_tell_next_gap_duplicate_and_restart() {
        let mut s = Sequence::default();
        assert_eq!(s.see(7), Step::Next, "the first one seen");
        s.applied(7);
        assert_eq!(s.see(8), Step::Next);
        assert_eq!(s.see(11), Step::Gap { from: 8, to: 11 });
        assert_eq!(s.see(5), Step::Duplicate);
        assert_eq!(s.see(0), Step::Restarted);
        s.forget();
        assert_eq!((s.see(0), s.next()), (Step::Next, None));
    }

    #[test]
    fn stored_removed_and_cleared_follow_the_engine_in_the_confirmed_table() {
        let seg = Segment::heap(&LayoutPlan::for_size(16 << 20).unwrap());
        let t = seg.tables();
        let a = t.servers.register(1, "http://a", 0).unwrap();
        let b = t.servers.register(2, "http://b", 0).unwrap();
        let hasher = BlockHasher::new(99, 4);
        let prompt: Vec<u32> = (0..12).collect();
        let mut chain = Vec::new();
        hasher.chain(&prompt, &mut chain);
        let roots = ChainRoots {
            base: Some(hasher),
            adapters: HashMap::new(),
        };
        let mut follower = Follower::new(a, roots);
        let now = Stamp(5);
        let done = follower.apply(
            &batch(vec![stored(&[1, 2], None, 0..8), stored(&[3], Some(2), 8..12)]),
            &t,
            now,
        );
        assert_eq!((done.stored, done.skipped), (3, 0));
        let live = |tag| t.servers.is_live(tag);
        assert_eq!(
            t.confirmed.longest_prefix_match(&chain, live).best(),
            Some((a.tag(), 3))
        );
        assert!(
            t.prefix.longest_prefix_match(&chain, live).is_empty(),
            "the estimate is apart"
        );
        // Another engine holds the first block too.
        t.confirmed.insert(chain[0], b, now);
        let removed = KvEvent::Removed(BlockRemoved {
            block_hashes: vec![EngineHash::Int(3), EngineHash::Int(2)],
            medium: None,
            group: None,
        });
        assert_eq!(follower.apply(&batch(vec![removed]), &t, now).removed, 2);
        let m = t.confirmed.longest_prefix_match(&chain, live);
        assert_eq!((m.blocks_for(a.tag()), m.blocks_for(b.tag())), (1, 1));
        // A cleared cache: a's entries go, b's stay, and the table is complete.
        assert_eq!(follower.sync(), KvEventsSync::Partial, "not known from the start");
        assert_eq!(follower.apply(&batch(vec![KvEvent::Cleared]), &t, now).cleared, 1);
        let m = t.confirmed.longest_prefix_match(&chain, live);
        assert_eq!((m.blocks_for(a.tag()), m.blocks_for(b.tag())), (0, 1));
        assert_eq!((follower.sync(), follower.mapped()), (KvEventsSync::Complete, 0));
    }

    #[test]
    fn events_it_cannot_place_are_skipped() {
        let seg = Segment::heap(&LayoutPlan::for_size(16 << 20).unwrap());
        let t = seg.tables();
        let a = t.servers.register(1, "http://a", 0).unwrap();
        let mut roots = ChainRoots::default();
        let mut follower = Follower::new(a, roots.clone());
        // No root for the base model: nothing can be placed.
        assert_eq!(
            follower
                .apply(&batch(vec![stored(&[1], None, 0..4)]), &t, Stamp(0))
                .skipped,
            1
        );
        roots.base = Some(BlockHasher::new(1, 4));
        follower.set_roots(roots);
        let mut adapter = stored(&[2], None, 0..4);
        let mut other_group = stored(&[3], None, 0..4);
        if let (KvEvent::Stored(s), KvEvent::Stored(g)) = (&mut adapter, &mut other_group) {
            s.lora_name = Some("unknown-adapter".into());
            g.group = Some(1);
        }
        let done = follower.apply(
            &batch(vec![adapter, other_group, stored(&[4], Some(77), 0..4)]),
            &t,
            Stamp(0),
        );
        assert_eq!((done.stored, done.skipped), (0, 3));
        assert_eq!(follower.take_skip(), Some(Skip::UnknownParent));
        assert_eq!(t.confirmed.occupancy(), 0);
    }
}
