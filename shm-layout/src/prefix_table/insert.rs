//! The write path: recording that a server holds a prefix ([`PrefixTable::insert`],
//! one compare-and-swap), choosing the slot a full bucket gives up (the
//! stalest), and writing a whole chain deepest block first
//! ([`PrefixTable::insert_chain`]).

use super::entry::{ServerSet, Stamp, pack_value, unpack_value};
use super::{MAX_ATTEMPTS, PREFETCH_AHEAD, PrefixTable};
use crate::bucket::WAYS;
use crate::server_table::ServerRef;

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    /// A new entry in an empty slot.
    Inserted,
    /// A new entry that evicted the stalest entry of a full bucket.
    Evicted,
    /// The key was present; the server moved to the front and the stamp renewed.
    Refreshed,
    /// Nothing changed: the server was already first and the stamp current.
    Unchanged,
    /// Lost the compare-and-swap race 16 times in a row.
    Contended,
}

impl PrefixTable<'_> {
    /// Records that `server` holds the prefix `key`, as of `now`.
    pub fn insert(&self, key: u64, server: ServerRef, now: Stamp) -> InsertOutcome {
        let tag = server.tag();
        let bucket = self.bucket(key);
        for _ in 0..MAX_ATTEMPTS {
            let slots = bucket.load();
            if let Some((i, value)) = slots
                .iter()
                .enumerate()
                .find_map(|(i, s)| self.codec.value_for(*s, key).map(|v| (i, v)))
            {
                let entry = unpack_value(value);
                let new = pack_value(entry.servers.with_front(tag), now);
                if new == value {
                    return InsertOutcome::Unchanged;
                }
                if bucket.cas(i, slots[i], self.codec.pack(key, new)) {
                    return InsertOutcome::Refreshed;
                }
                continue;
            }
            let victim = self.victim(&slots, now);
            let fresh = pack_value(ServerSet::default().with_front(tag), now);
            if bucket.cas(victim, slots[victim], self.codec.pack(key, fresh)) {
                return if slots[victim] == 0 {
                    InsertOutcome::Inserted
                } else {
                    InsertOutcome::Evicted
                };
            }
        }
        InsertOutcome::Contended
    }

    /// The slot to overwrite: the first empty one, else the stalest.
    fn victim(&self, slots: &[u128; WAYS], now: Stamp) -> usize {
        if let Some(i) = slots.iter().position(|s| *s == 0) {
            return i;
        }
        (0..WAYS)
            .max_by_key(|i| unpack_value((slots[*i] >> 64) as u64).stamp.age(now))
            .unwrap_or(0)
    }

    /// Records `server` for every hash of `chain` (a responder's write-back,
    /// a dispatcher's record at dispatch). Returns how many other entries
    /// were evicted to make room (a full table's churn, exported as a
    /// metric).
    ///
    /// The chain is written **deepest block first**. A longest-prefix match
    /// walks from the first block and stops at the first one missing, so a
    /// match running meanwhile sees the chain's new blocks all at once (when
    /// the shallowest of them lands) or not yet, never a part of them. A
    /// part would be a false, shallow prefix: a conversation whose answer
    /// was being written back matched only some of its blocks, too few to
    /// stay, and moved to another engine. (A block some other server lists
    /// already does not stop the walk, so the match may count this server
    /// at a deeper block a moment before the shallower ones land: never
    /// more than it holds once the call returns.)
    pub fn insert_chain(&self, chain: &[u64], server: ServerRef, now: Stamp) -> usize {
        for key in chain.iter().rev().take(PREFETCH_AHEAD) {
            self.bucket(*key).prefetch();
        }
        let mut evicted = 0;
        for (i, key) in chain.iter().enumerate().rev() {
            if let Some(ahead) = i.checked_sub(PREFETCH_AHEAD).map(|j| chain[j]) {
                self.bucket(ahead).prefetch();
            }
            evicted += usize::from(self.insert(*key, server, now) == InsertOutcome::Evicted);
        }
        evicted
    }
}
