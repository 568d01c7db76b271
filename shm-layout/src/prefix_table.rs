//! The prefix table: which inference servers hold the KV cache of which
//! token-block prefix.
//!
//! Key: the 64-bit hash of a token-block prefix chain (block `i`'s hash
//! covers blocks `0..=i`). Value: up to [`LANES`] servers, most recently
//! refreshed first, and a 16-bit recency [`Stamp`]. Each entry is one
//! self-validating 128-bit slot (see `bucket`), 4 slots to a 64-byte
//! bucket; a key lives in the bucket its hash selects.
//!
//! ```text
//!  value (high 64 bits)                               key half (low 64 bits)
//! ┌──────────┬──────────┬──────────┬──────────┐      ┌───────────────────────────┐
//! │ stamp:16 │ lane2:16 │ lane1:16 │ lane0:16 │      │ key ^ mix64(value ^ seed) │
//! └──────────┴──────────┴──────────┴──────────┘      └───────────────────────────┘
//!   lane = generation tag:6 | (server slot + 1):10, 0 = empty; lane0 = most recent
//! ```
//!
//! * Readers load a bucket (one cache line) and never wait or retry.
//! * Writers read the bucket, compute the new slot and install it with one
//!   compare-and-swap; on a lost race they re-read (bounded attempts, then
//!   they give up and report [`InsertOutcome::Contended`]: the table is a
//!   cache, a lost refresh costs nothing but a little affinity).
//! * When a bucket is full the stalest entry (largest `now - stamp`,
//!   wrapping) is replaced, so memory is fixed and the table never grows.
//! * A process killed at any instruction either installed its slot or did
//!   not: there is no lock and no multi-step update to leave half done.
//! * A chain is written deepest block first and a match walks it from the
//!   first block, stopping at the first missing one, so a match never sees
//!   part of a chain being written ([`PrefixTable::insert_chain`]).
//!
//! The generation tag in each lane stops a reused server slot from
//! inheriting the old server's affinity: [`ServerTag::gen_tag`] must match
//! the server table's current generation for the lane to count as live.

use crate::bucket::{Bucket, SlotCodec, WAYS, bucket_index};
use crate::server_table::{ServerRef, ServerTag};

pub use crate::bucket::WAYS as PREFIX_WAYS;

/// Servers remembered per prefix.
pub const LANES: usize = 3;

/// Buckets a longest-prefix match fetches ahead of the one it reads.
const PREFETCH_AHEAD: usize = 8;

/// Attempts a writer makes before reporting contention.
const MAX_ATTEMPTS: usize = 16;

/// A coarse recency stamp: seconds since the segment was created, modulo
/// 2^16. Compared with wrapping arithmetic, so ages up to 18 hours order
/// correctly; an older entry may look fresh, which only affects which entry
/// a full bucket evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Stamp(pub u16);

impl Stamp {
    /// How long ago `self` was, seen from `now`.
    #[inline]
    pub fn age(self, now: Stamp) -> u16 {
        now.0.wrapping_sub(self.0)
    }
}

/// The servers of one entry, most recently refreshed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerSet {
    lanes: [u16; LANES],
}

impl ServerSet {
    fn from_value(value: u64) -> Self {
        Self {
            lanes: std::array::from_fn(|i| (value >> (16 * i)) as u16),
        }
    }

    fn bits(self) -> u64 {
        self.lanes
            .iter()
            .enumerate()
            .map(|(i, l)| u64::from(*l) << (16 * i))
            .sum()
    }

    /// The servers, most recent first.
    pub fn iter(&self) -> impl Iterator<Item = ServerTag> + '_ {
        self.lanes.iter().filter_map(|l| ServerTag::from_lane(*l))
    }

    /// Number of servers.
    pub fn len(&self) -> usize {
        self.lanes.iter().filter(|l| **l != 0).count()
    }

    /// True if no server is recorded.
    pub fn is_empty(&self) -> bool {
        self.lanes[0] == 0
    }

    /// Whether `tag` (same slot and generation) is in the set.
    pub fn contains(&self, tag: ServerTag) -> bool {
        self.lanes.contains(&tag.lane())
    }

    /// `tag` moved (or added) to the front; other lanes of the same server
    /// slot (older generations) dropped; the least recent falls off if full.
    fn with_front(self, tag: ServerTag) -> Self {
        let mut lanes = [0u16; LANES];
        lanes[0] = tag.lane();
        let mut n = 1;
        for l in self.lanes {
            match ServerTag::from_lane(l) {
                Some(t) if t.slot() != tag.slot() && n < LANES => {
                    lanes[n] = l;
                    n += 1;
                }
                _ => {}
            }
        }
        Self { lanes }
    }

    /// The set without any lane of `tag`'s server slot.
    fn without(self, tag: ServerTag) -> Self {
        let mut lanes = [0u16; LANES];
        for (dst, l) in lanes
            .iter_mut()
            .zip(self.lanes.iter().filter(|l| **l != 0 && **l != tag.lane()))
        {
            *dst = *l;
        }
        Self { lanes }
    }
}

/// One entry as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixEntry {
    /// Servers that hold the prefix, most recent first.
    pub servers: ServerSet,
    /// When the entry was last refreshed.
    pub stamp: Stamp,
}

fn pack_value(servers: ServerSet, stamp: Stamp) -> u64 {
    servers.bits() | (u64::from(stamp.0) << 48)
}

fn unpack_value(value: u64) -> PrefixEntry {
    PrefixEntry {
        servers: ServerSet::from_value(value & 0xffff_ffff_ffff),
        stamp: Stamp((value >> 48) as u16),
    }
}

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

/// The prefix table over its buckets (in shared memory or on the heap).
#[derive(Debug, Clone, Copy)]
pub struct PrefixTable<'a> {
    buckets: &'a [Bucket],
    codec: SlotCodec,
}

impl<'a> PrefixTable<'a> {
    /// A table over `buckets`, fingerprinted with `seed`.
    pub(crate) fn new(buckets: &'a [Bucket], seed: u64) -> Self {
        assert!(!buckets.is_empty(), "a prefix table needs at least one bucket");
        Self {
            buckets,
            codec: SlotCodec::new(seed),
        }
    }

    /// Slots in the table.
    pub fn capacity(&self) -> u64 {
        (self.buckets.len() * WAYS) as u64
    }

    #[inline]
    fn bucket(&self, key: u64) -> &'a Bucket {
        &self.buckets[bucket_index(key, self.buckets.len())]
    }

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
            let rest = entry.servers.without(server);
            let new = if rest.is_empty() {
                0
            } else {
                self.codec.pack(key, pack_value(rest, entry.stamp))
            };
            if bucket.cas(i, slots[i], new) {
                return true;
            }
        }
        false
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
                    let rest = entry.servers.without(server);
                    let new = if rest.is_empty() {
                        0
                    } else {
                        self.codec.pack(key, pack_value(rest, entry.stamp))
                    };
                    if bucket.cas(i, slot, new) {
                        removed += 1;
                        break;
                    }
                }
            }
        }
        removed
    }

    /// Occupied slots (a full scan: for `semlb shm inspect` and tests, not
    /// for the request path).
    pub fn occupancy(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.load().iter().filter(|s| **s != 0).count() as u64)
            .sum()
    }

    /// Occupied slots, estimated from a sample of buckets: passes of
    /// `pass` buckets evenly spaced over the table, each pass offset by one
    /// from the last, until `enough` occupied slots were seen or every
    /// bucket was read (then the count is exact). Keys hash uniformly over
    /// the buckets, so the sample's fill is the table's; a table nearly
    /// empty is read further, up to all of it. What `/metrics` shows: a
    /// full scan reads the whole table (125 MiB at the default size) on
    /// every scrape.
    pub fn occupancy_estimate(&self, pass: usize, enough: u64) -> u64 {
        let n = self.buckets.len();
        let stride = (n / pass.max(1)).max(1);
        let (mut seen, mut full) = (0u64, 0u64);
        for offset in 0..stride {
            for b in self.buckets[offset..].iter().step_by(stride) {
                seen += 1;
                full += b.load().iter().filter(|s| **s != 0).count() as u64;
            }
            if full >= enough {
                break;
            }
            if offset == 0 && full.saturating_mul(16) < enough {
                // Nearly empty: one sequential scan reads it faster than
                // strided passes would.
                return self.occupancy();
            }
        }
        if seen as usize >= n {
            return full;
        }
        (full as f64 * n as f64 / seen as f64).round() as u64
    }

    /// Scans every slot and returns the decodable `(key, entry)` pairs
    /// whose servers are well formed. For tests and inspection.
    pub fn entries(&self) -> impl Iterator<Item = (u64, PrefixEntry)> + 'a {
        let codec = self.codec;
        self.buckets.iter().flat_map(move |b| {
            b.load()
                .into_iter()
                .filter_map(move |s| codec.unpack(s).map(|(k, v)| (k, unpack_value(v))))
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
        let (round, done) = (AtomicU64::new(0), AtomicBool::new(false));
        let (mut whole, mut none) = (0u64, 0u64);
        std::thread::scope(|s| {
            s.spawn(|| {
                for r in 1..=ROUNDS {
                    round.store(r, Ordering::Release);
                    t.insert_chain(&chain_of(r), srv(1, 0), Stamp(0));
                    // Taken back from its first block: unpublished at once.
                    t.remove(chain_of(r - 1)[0], srv(1, 0).tag());
                }
                done.store(true, Ordering::Release);
            });
            while !done.load(Ordering::Acquire) {
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
}
