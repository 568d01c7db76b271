//! The read path: one key's entry ([`PrefixTable::lookup`]) and the
//! longest-prefix match of a chain ([`PrefixTable::longest_prefix_match`]),
//! with the [`PrefixMatch`] it reports: per server, the leading blocks it
//! holds.

use super::entry::{PrefixEntry, Stamp, unpack_value};
use super::{PREFETCH_AHEAD, PrefixTable};
use crate::server_table::ServerTag;

/// Servers a [`PrefixMatch`] reports at most.
pub const MATCH_CAPACITY: usize = 8;

/// One server of a [`PrefixMatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Held {
    lane: u16,
    blocks: u32,
    refreshed: Option<Stamp>,
}

/// For each server the table knows to hold part of a chain: how many
/// leading blocks of it the server holds, and when the server itself last
/// refreshed the deepest of them (when the table can tell).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    entries: [Held; MATCH_CAPACITY],
    len: usize,
}

impl PrefixMatch {
    /// `(server, leading blocks held)` pairs, in the order first seen.
    pub fn iter(&self) -> impl Iterator<Item = (ServerTag, u32)> + '_ {
        self.entries[..self.len]
            .iter()
            .filter_map(|h| ServerTag::from_lane(h.lane).map(|t| (t, h.blocks)))
    }

    /// The server with the most leading blocks (the first seen on ties).
    pub fn best(&self) -> Option<(ServerTag, u32)> {
        self.iter().fold(None, |best, (t, n)| match best {
            Some((_, m)) if m >= n => best,
            _ => Some((t, n)),
        })
    }

    /// Blocks held by `tag`, 0 if none.
    pub fn blocks_for(&self, tag: ServerTag) -> u32 {
        self.iter().find(|(t, _)| *t == tag).map_or(0, |(_, n)| n)
    }

    /// When `tag` last refreshed the deepest entry it is listed in: that
    /// entry's stamp, known only when `tag` was the entry's most recent
    /// server (an entry's stamp is its latest refresh by any server).
    /// For a match made elsewhere, what [`add_refreshed`](Self::add_refreshed)
    /// said (`None` after [`add`](Self::add)).
    pub fn refreshed(&self, tag: ServerTag) -> Option<Stamp> {
        self.entries[..self.len]
            .iter()
            .find(|h| h.lane == tag.lane())
            .and_then(|h| h.refreshed)
    }

    /// True when no live server holds any block of the chain.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records that `server` holds `depth` leading blocks (for matches made
    /// elsewhere, e.g. on Redis): the deepest depth per server is kept, and
    /// when [`MATCH_CAPACITY`] servers are listed the one with the fewest
    /// blocks gives way to a deeper one.
    pub fn add(&mut self, server: ServerTag, depth: u32) {
        self.record(server.lane(), depth, None);
    }

    /// [`add`](Self::add), with when the server refreshed its deepest
    /// entry, when the other store can tell.
    pub fn add_refreshed(&mut self, server: ServerTag, depth: u32, refreshed: Option<Stamp>) {
        self.record(server.lane(), depth, refreshed);
    }

    /// Records that `lane` holds `depth` leading blocks, the deepest of
    /// them refreshed by it at `refreshed`. When full, the server with the
    /// fewest blocks (the first of them) gives way to a deeper one.
    fn record(&mut self, lane: u16, depth: u32, refreshed: Option<Stamp>) {
        let held = Held {
            lane,
            blocks: depth,
            refreshed,
        };
        if let Some(e) = self.entries[..self.len].iter_mut().find(|h| h.lane == lane) {
            if depth > e.blocks {
                *e = held;
            }
        } else if self.len < MATCH_CAPACITY {
            self.entries[self.len] = held;
            self.len += 1;
        } else if let Some(e) = self
            .entries
            .iter_mut()
            .min_by_key(|h| h.blocks)
            .filter(|h| h.blocks < depth)
        {
            *e = held;
        }
    }
}

/// Remembers each server's age limit during one match, so each server is
/// asked once.
struct AgeMemo<F> {
    max_age: F,
    seen: [(u16, Option<u16>); 2 * MATCH_CAPACITY],
    len: usize,
}

impl<F: Fn(ServerTag) -> Option<u16>> AgeMemo<F> {
    fn max_age(&mut self, tag: ServerTag) -> Option<u16> {
        if let Some((_, v)) = self.seen[..self.len].iter().find(|(l, _)| *l == tag.lane()) {
            return *v;
        }
        let v = (self.max_age)(tag);
        if self.len < self.seen.len() {
            self.seen[self.len] = (tag.lane(), v);
            self.len += 1;
        }
        v
    }
}

impl PrefixTable<'_> {
    /// The entry for `key`, if any. Never waits, never allocates.
    #[inline]
    pub fn lookup(&self, key: u64) -> Option<PrefixEntry> {
        let bucket = self.bucket(key);
        bucket
            .load()
            .into_iter()
            .find_map(|slot| self.codec.value_for(slot, key))
            .map(unpack_value)
    }

    /// Longest-prefix match: for each server `live` accepts, how many
    /// leading blocks of `chain` it holds.
    ///
    /// Block `i`'s hash covers blocks `0..=i`, and engines cache prefixes,
    /// so a server recorded for block `i` holds the whole prefix up to it:
    /// its match is the deepest block it is recorded for. (Only 3 servers
    /// fit in one entry, so a shared system prompt cached on many servers
    /// lists just the most recent three; the deeper, conversation-specific
    /// blocks still name the server that holds them.) The scan stops at the
    /// first block the table knows nothing about, so a miss costs one bucket
    /// read. At most [`MATCH_CAPACITY`] servers are reported, the deepest
    /// ones. Never allocates.
    pub fn longest_prefix_match(&self, chain: &[u64], live: impl Fn(ServerTag) -> bool) -> PrefixMatch {
        self.longest_prefix_match_within(chain, Stamp(0), |t| live(t).then_some(u16::MAX))
    }

    /// [`longest_prefix_match`](Self::longest_prefix_match) counting, for
    /// each server, only entries refreshed at most `max_age(server)`
    /// seconds before `now` (`None`: the server is not live; `u16::MAX`:
    /// every entry). An entry's stamp is its latest refresh by any of its
    /// servers, never older than a listed server's own: an entry set aside
    /// for a server is one the server did not refresh within its limit
    /// (one it did may still count, when another server refreshed it
    /// since). This is how a server's entries from before its engine
    /// evicted them are set aside ([`crate::ServerTable::entry_max_age`]).
    pub fn longest_prefix_match_within(
        &self,
        chain: &[u64],
        now: Stamp,
        max_age: impl Fn(ServerTag) -> Option<u16>,
    ) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        let mut memo = AgeMemo {
            max_age,
            seen: [(0, None); 2 * MATCH_CAPACITY],
            len: 0,
        };
        // Keep PREFETCH_AHEAD bucket fetches in flight: the lookups of a
        // chain are independent, so their cache misses can overlap.
        for key in chain.iter().skip(1).take(PREFETCH_AHEAD) {
            self.bucket(*key).prefetch();
        }
        for (depth, key) in chain.iter().enumerate() {
            if let Some(ahead) = chain.get(depth + 1 + PREFETCH_AHEAD) {
                self.bucket(*ahead).prefetch();
            }
            let Some(entry) = self.lookup(*key) else { break };
            let age = entry.stamp.age(now);
            for (lane, tag) in entry.servers.iter().enumerate() {
                if memo.max_age(tag).is_some_and(|max| age <= max) {
                    let refreshed = (lane == 0).then_some(entry.stamp);
                    m.record(tag.lane(), depth as u32 + 1, refreshed);
                }
            }
        }
        m
    }
}
