//! Forgetting: one server of one entry ([`PrefixTable::remove`]), one
//! server everywhere ([`PrefixTable::remove_server`]) and every entry
//! ([`PrefixTable::clear`]), each slot by its own compare-and-swap.

use super::entry::{PrefixEntry, pack_value, unpack_value};
use super::{MAX_ATTEMPTS, PrefixTable};
use crate::bucket::WAYS;
use crate::server_table::ServerTag;

impl PrefixTable<'_> {
    /// Forgets that `server` holds `key` (its KV blocks were evicted). The
    /// entry goes when its last server does. Returns whether it was there.
    pub fn remove(&self, key: u64, server: ServerTag) -> bool {
        let bucket = self.bucket(key);
        for _ in 0..MAX_ATTEMPTS {
            let slots = bucket.load();
            let Some((i, value)) = slots
                .iter()
                .enumerate()
                .find_map(|(i, s)| self.codec.value_for(*s, key).map(|v| (i, v)))
            else {
                return false;
            };
            let entry = unpack_value(value);
            if !entry.servers.contains(server) {
                return false;
            }
            if bucket.cas(i, slots[i], self.slot_without(key, entry, server)) {
                return true;
            }
        }
        false
    }

    /// Empties the table (the admin API's prefix flush); returns how many
    /// entries it removed.
    ///
    /// Lock-free and safe while dispatchers read and responders write: every
    /// occupied slot is compare-and-swapped to empty, one at a time, so a
    /// reader sees each slot either before or after its removal and a
    /// writer's install either lands before the removal (and is removed) or
    /// after it (and survives). It is not a snapshot: entries inserted or
    /// refreshed while the flush runs may survive it (a slot changed between
    /// its load and its swap is left as it is), and a lookup running
    /// concurrently may still find entries not yet reached. Once it returns,
    /// every entry that was in the table when it started and was not
    /// refreshed meanwhile is gone.
    pub fn clear(&self) -> u64 {
        let mut removed = 0;
        for bucket in self.buckets {
            let slots = bucket.load();
            for (i, slot) in slots.iter().enumerate() {
                if *slot != 0 && bucket.cas(i, *slot, 0) {
                    removed += 1;
                }
            }
        }
        removed
    }

    /// Forgets `server` in every entry (its engine lost its cache: flushed
    /// or restarted); returns how many entries listed it. A full scan, like
    /// [`clear`](Self::clear) and with its guarantees: lock-free, each slot
    /// compare-and-swapped on its own (a slot changed meanwhile is read
    /// again, a bounded number of times); an entry whose last server goes
    /// is emptied. Entries written for the server after the scan passed
    /// them survive, as they should: they were learned after the loss.
    pub fn remove_server(&self, server: ServerTag) -> u64 {
        let mut removed = 0;
        for bucket in self.buckets {
            for i in 0..WAYS {
                for _ in 0..MAX_ATTEMPTS {
                    let slot = bucket.load()[i];
                    let Some((key, value)) = self.codec.unpack(slot) else {
                        break;
                    };
                    let entry = unpack_value(value);
                    if !entry.servers.contains(server) {
                        break;
                    }
                    if bucket.cas(i, slot, self.slot_without(key, entry, server)) {
                        removed += 1;
                        break;
                    }
                }
            }
        }
        removed
    }

    /// What replaces `key`'s slot once `server` leaves `entry`: the entry
    /// without it, or an empty slot when it was the last server.
    fn slot_without(&self, key: u64, entry: PrefixEntry, server: ServerTag) -> u128 {
        let rest = entry.servers.without(server);
        if rest.is_empty() {
            0
        } else {
            self.codec.pack(key, pack_value(rest, entry.stamp))
        }
    }
}
