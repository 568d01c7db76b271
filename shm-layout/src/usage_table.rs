//! Usage per tenant and per model: what `semlb status` and `/metrics`
//! show of each (requests, tokens, rate-limited requests, time queued),
//! counted by every dispatcher into one shared table.
//!
//! ```text
//! UsageEntry (128 B, 64-aligned), [`crate::USAGE_SLOTS`] of them
//! ┌ key u64 ┬ meta u64 (kind, name length) ┬ name 56 B ┬ counters 7 × u64 ┐
//! ```
//!
//! | field | meaning |
//! | --- | --- |
//! | `key` | 0: free; else the keyed hash of (kind, name) with bit 63 clear once the entry is ready, set while its claimer writes the name |
//! | `meta` | kind (byte 0: [`UsageKind`]) and the name's length (byte 1) |
//! | `name` | the name's bytes (at most [`USAGE_NAME_BYTES`]; a longer one is cut on a character boundary and ends in `~` and 8 hex digits of a hash of the whole name, so long names never merge) |
//! | `counters` | [`UsageCounter`] order; plain sums, only ever added to |
//!
//! An entry is claimed by one compare-and-swap of `key` from 0 to the key
//! with bit 63 set; the claimer writes `meta` and `name`, then stores the
//! key with bit 63 clear (`Release`). Writers find a key's entry by linear
//! probing from its home slot; an entry still being claimed is passed over
//! (a claimer killed there leaves one slot unused, never a wrong count).
//! Readers take only ready entries whose key is the hash of what they hold
//! (a flipped bit in the key, kind or name makes the entry invisible; in a
//! counter, a wrong sum) and add up entries of one (kind, name), so two
//! entries of one name (one claimed while the other was being written)
//! count once. The table never forgets: it is for the tenants and models of
//! a deployment (a few hundred), and a full table drops new names' counts
//! ([`UsageTable::add`] says so).

use crate::sync::{AtomicU64, Ordering};

/// Bytes of a name kept.
pub const USAGE_NAME_BYTES: usize = 56;
/// Counters per entry.
pub const USAGE_COUNTERS: usize = 7;
/// Bit 63 of `key`: the entry is being claimed.
const CLAIMING: u64 = 1 << 63;

/// Whose usage an entry counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum UsageKind {
    /// A tenant's (keys file).
    Tenant = 1,
    /// A model pool's.
    Model = 2,
    /// Gauges one process keeps for a name (requests in flight per tenant:
    /// `semlb`'s concurrency limits), only ever changed by that process,
    /// zeroed by its supervisor when it dies ([`UsageTable::zero`]).
    Gauge = 3,
}

impl UsageKind {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(UsageKind::Tenant),
            2 => Some(UsageKind::Model),
            3 => Some(UsageKind::Gauge),
            _ => None,
        }
    }
}

/// What a counter counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum UsageCounter {
    /// Inference requests let in (past authentication and rate limits).
    Requests = 0,
    /// Their prompt tokens (the gateway's count).
    PromptTokens = 1,
    /// Their answers' output tokens.
    OutputTokens = 2,
    /// Requests refused by a rate limit (429).
    RateLimited = 3,
    /// Requests that waited in the gateway queue.
    Queued = 4,
    /// Microseconds they waited there, summed.
    QueueMicros = 5,
    /// Requests answered from the response cache.
    CacheHits = 6,
}

/// One entry.
#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct UsageEntry {
    key: AtomicU64,
    meta: AtomicU64,
    name: [AtomicU64; USAGE_NAME_BYTES / 8],
    counters: [AtomicU64; USAGE_COUNTERS],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<UsageEntry>() as u64 == crate::plan::USAGE_ENTRY_BYTES);

#[cfg(test)]
impl UsageEntry {
    pub(crate) fn new() -> Self {
        Self {
            key: AtomicU64::new(0),
            meta: AtomicU64::new(0),
            name: std::array::from_fn(|_| AtomicU64::new(0)),
            counters: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// One (kind, name)'s counts, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    /// Whose.
    pub kind: UsageKind,
    /// The name (cut to [`USAGE_NAME_BYTES`]).
    pub name: String,
    /// The counters, in [`UsageCounter`] order.
    pub counters: [u64; USAGE_COUNTERS],
}

impl UsageRow {
    /// One counter.
    pub fn get(&self, counter: UsageCounter) -> u64 {
        self.counters[counter as usize]
    }
}

/// The shared usage table.
#[derive(Debug, Clone, Copy)]
pub struct UsageTable<'a> {
    entries: &'a [UsageEntry],
    seed: u64,
}

/// `name` as an entry holds it: itself when it fits in
/// [`USAGE_NAME_BYTES`]; else cut on a character boundary to leave room
/// for `~` and 8 hex digits of a hash of the whole name, so two long names
/// that share their first bytes never count as one.
fn cut(name: &str) -> std::borrow::Cow<'_, str> {
    if name.len() <= USAGE_NAME_BYTES {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut end = USAGE_NAME_BYTES - 9;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let digest = xxhash_rust::xxh3::xxh3_64(name.as_bytes()) as u32;
    std::borrow::Cow::Owned(format!("{}~{digest:08x}", &name[..end]))
}

impl<'a> UsageTable<'a> {
    /// The table over `entries` (zeroed: empty), keys hashed with `seed`.
    pub(crate) fn new(entries: &'a [UsageEntry], seed: u64) -> Self {
        Self { entries, seed }
    }

    /// Entries in the table.
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// The key of (`kind`, `name`): never 0, bit 63 clear.
    fn key(&self, kind: UsageKind, name: &str) -> u64 {
        let mut bytes = Vec::with_capacity(1 + name.len());
        bytes.push(kind as u8);
        bytes.extend_from_slice(name.as_bytes());
        (xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, self.seed) & !CLAIMING).max(1)
    }

    /// Adds each `(counter, delta)` to (`kind`, `name`)'s entry, claiming
    /// one if it has none; false if the table is full (nothing counted).
    pub fn add(&self, kind: UsageKind, name: &str, deltas: &[(UsageCounter, u64)]) -> bool {
        let Some(entry) = self.entry(kind, &cut(name)) else {
            return false;
        };
        for (counter, delta) in deltas {
            entry.counters[*counter as usize].fetch_add(*delta, Ordering::Relaxed);
        }
        true
    }

    /// (`kind`, `name`)'s `counter`, summed over its ready entries; 0
    /// when it has none. Never claims an entry.
    pub fn get(&self, kind: UsageKind, name: &str, counter: UsageCounter) -> u64 {
        let name = cut(name);
        let n = self.entries.len();
        if n == 0 {
            return 0;
        }
        let key = self.key(kind, &name);
        let home = (key % n as u64) as usize;
        let mut sum = 0u64;
        for p in 0..n {
            let entry = &self.entries[(home + p) % n];
            match entry.key.load(Ordering::Acquire) {
                0 => break,
                seen if seen == key => {
                    sum = sum.wrapping_add(entry.counters[counter as usize].load(Ordering::Relaxed));
                }
                _ => {}
            }
        }
        sum
    }

    /// Subtracts `delta` from (`kind`, `name`)'s `counter` (a gauge going
    /// down), if it has an entry.
    pub fn sub(&self, kind: UsageKind, name: &str, counter: UsageCounter, delta: u64) {
        let name = cut(name);
        let n = self.entries.len();
        if n == 0 {
            return;
        }
        let key = self.key(kind, &name);
        let home = (key % n as u64) as usize;
        for p in 0..n {
            let entry = &self.entries[(home + p) % n];
            match entry.key.load(Ordering::Acquire) {
                0 => return,
                seen if seen == key => {
                    entry.counters[counter as usize].fetch_sub(delta, Ordering::Relaxed);
                    return;
                }
                _ => {}
            }
        }
    }

    /// Zeroes `counter` of every ready entry of `kind` whose name `which`
    /// picks (the gauges of a process that died); returns how many were
    /// not zero.
    pub fn zero(&self, kind: UsageKind, counter: UsageCounter, which: impl Fn(&str) -> bool) -> usize {
        let mut zeroed = 0;
        for row in self.rows().into_iter().filter(|r| r.kind == kind && which(&r.name)) {
            let key = self.key(kind, &row.name);
            for entry in self.entries.iter().filter(|e| e.key.load(Ordering::Acquire) == key) {
                if entry.counters[counter as usize].swap(0, Ordering::Relaxed) != 0 {
                    zeroed += 1;
                }
            }
        }
        zeroed
    }

    /// (`kind`, `name`)'s ready entry, or a new one.
    fn entry(&self, kind: UsageKind, name: &str) -> Option<&'a UsageEntry> {
        let n = self.entries.len();
        if n == 0 {
            return None;
        }
        let key = self.key(kind, name);
        let home = (key % n as u64) as usize;
        for p in 0..n {
            let entry = &self.entries[(home + p) % n];
            let mut seen = entry.key.load(Ordering::Acquire);
            if seen == 0 {
                match entry
                    .key
                    .compare_exchange(0, key | CLAIMING, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => {
                        entry
                            .meta
                            .store(u64::from(kind as u8) | (name.len() as u64) << 8, Ordering::Relaxed);
                        let mut words = [0u8; USAGE_NAME_BYTES];
                        words[..name.len()].copy_from_slice(name.as_bytes());
                        for (w, chunk) in entry.name.iter().zip(words.chunks_exact(8)) {
                            w.store(
                                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                                Ordering::Relaxed,
                            );
                        }
                        entry.key.store(key, Ordering::Release);
                        return Some(entry);
                    }
                    Err(now) => seen = now,
                }
            }
            if seen == key {
                return Some(entry);
            }
        }
        None
    }

    /// Every (kind, name) counted, each once (entries of one name summed),
    /// sorted by kind and name.
    pub fn rows(&self) -> Vec<UsageRow> {
        let mut rows: Vec<UsageRow> = Vec::new();
        for entry in self.entries {
            let key = entry.key.load(Ordering::Acquire);
            if key == 0 || key & CLAIMING != 0 {
                continue;
            }
            let meta = entry.meta.load(Ordering::Relaxed);
            let (Some(kind), len) = (UsageKind::from_byte(meta as u8), (meta >> 8) as usize) else {
                continue;
            };
            if len > USAGE_NAME_BYTES {
                continue;
            }
            let bytes: Vec<u8> = entry
                .name
                .iter()
                .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
                .take(len)
                .collect();
            let Ok(name) = String::from_utf8(bytes) else { continue };
            if self.key(kind, &name) != key {
                continue;
            }
            let counters: [u64; USAGE_COUNTERS] = std::array::from_fn(|i| entry.counters[i].load(Ordering::Relaxed));
            match rows.iter_mut().find(|r| r.kind == kind && r.name == name) {
                Some(row) => {
                    for (sum, c) in row.counters.iter_mut().zip(counters) {
                        *sum = sum.wrapping_add(c);
                    }
                }
                None => rows.push(UsageRow { kind, name, counters }),
            }
        }
        rows.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
        rows
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn table(n: usize) -> Vec<UsageEntry> {
        (0..n).map(|_| UsageEntry::new()).collect()
    }

    #[test]
    fn counts_add_up_per_name_and_kind() {
        let e = table(16);
        let t = UsageTable::new(&e, 9);
        assert!(t.add(
            UsageKind::Tenant,
            "acme",
            &[(UsageCounter::Requests, 1), (UsageCounter::PromptTokens, 30)]
        ));
        assert!(t.add(UsageKind::Tenant, "acme", &[(UsageCounter::Requests, 1)]));
        assert!(t.add(UsageKind::Model, "acme", &[(UsageCounter::OutputTokens, 5)]));
        let long = "é".repeat(40);
        assert!(t.add(UsageKind::Model, &long, &[(UsageCounter::RateLimited, 2)]));
        let rows = t.rows();
        assert_eq!(rows.len(), 3, "{rows:?}");
        assert_eq!(rows[0].name, "acme");
        assert_eq!(
            (
                rows[0].get(UsageCounter::Requests),
                rows[0].get(UsageCounter::PromptTokens)
            ),
            (2, 30)
        );
        assert_eq!(
            (rows[1].kind, rows[1].get(UsageCounter::OutputTokens)),
            (UsageKind::Model, 5)
        );
        assert!(
            rows[2].name.starts_with(&"é".repeat(23)),
            "cut on a character boundary: {}",
            rows[2].name
        );
        assert!(rows[2].name.len() <= USAGE_NAME_BYTES && rows[2].name.contains('~'));
        assert_eq!(rows[2].get(UsageCounter::RateLimited), 2);
        // Two long names that share their first 56 bytes stay apart.
        let (a, b) = (format!("{}-alpha", "t".repeat(60)), format!("{}-beta", "t".repeat(60)));
        assert!(t.add(UsageKind::Tenant, &a, &[(UsageCounter::Requests, 1)]));
        assert!(t.add(UsageKind::Tenant, &b, &[(UsageCounter::Requests, 1)]));
        assert_eq!(t.rows().len(), 5, "two entries, not one");
    }

    #[test]
    fn gauges_go_up_and_down_and_a_dead_processs_are_zeroed() {
        let e = table(16);
        let t = UsageTable::new(&e, 5);
        let up = |name: &str| assert!(t.add(UsageKind::Gauge, name, &[(UsageCounter::Requests, 1)]));
        up("1:acme");
        up("1:acme");
        up("2:acme");
        assert_eq!(t.get(UsageKind::Gauge, "1:acme", UsageCounter::Requests), 2);
        assert_eq!(t.get(UsageKind::Gauge, "2:acme", UsageCounter::Requests), 1);
        assert_eq!(
            t.get(UsageKind::Gauge, "3:acme", UsageCounter::Requests),
            0,
            "none: no entry claimed"
        );
        assert_eq!(
            t.get(UsageKind::Tenant, "1:acme", UsageCounter::Requests),
            0,
            "kinds apart"
        );
        t.sub(UsageKind::Gauge, "1:acme", UsageCounter::Requests, 1);
        assert_eq!(t.get(UsageKind::Gauge, "1:acme", UsageCounter::Requests), 1);
        assert_eq!(
            t.zero(UsageKind::Gauge, UsageCounter::Requests, |n| n.starts_with("2:")),
            1
        );
        assert_eq!(t.get(UsageKind::Gauge, "2:acme", UsageCounter::Requests), 0);
        assert_eq!(
            t.get(UsageKind::Gauge, "1:acme", UsageCounter::Requests),
            1,
            "another process's kept"
        );
    }

    #[test]
    fn a_full_table_says_so_and_damaged_or_unfinished_entries_are_not_read() {
        let e = table(2);
        let t = UsageTable::new(&e, 1);
        assert!(t.add(UsageKind::Tenant, "a", &[(UsageCounter::Requests, 1)]));
        assert!(t.add(UsageKind::Tenant, "b", &[(UsageCounter::Requests, 1)]));
        assert!(!t.add(UsageKind::Tenant, "c", &[(UsageCounter::Requests, 1)]));
        assert!(
            t.add(UsageKind::Tenant, "a", &[(UsageCounter::Requests, 1)]),
            "known names still count"
        );
        // A flipped bit in a name: that entry is no longer read.
        let i = e
            .iter()
            .position(|x| x.name[0].load(Ordering::Relaxed) & 0xff == u64::from(b'a'))
            .unwrap();
        e[i].name[0].fetch_xor(1 << 3, Ordering::Relaxed);
        assert_eq!(t.rows().iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["b"]);
        // One left mid-claim (its claimer killed) is passed over.
        let e = table(4);
        let t = UsageTable::new(&e, 1);
        let key = t.key(UsageKind::Model, "m");
        e[(key % 4) as usize].key.store(key | CLAIMING, Ordering::Relaxed);
        assert!(t.add(UsageKind::Model, "m", &[(UsageCounter::Requests, 3)]));
        assert_eq!(t.rows()[0].get(UsageCounter::Requests), 3);
    }

    #[test]
    fn threads_count_every_add_once() {
        let e = table(64);
        let t = UsageTable::new(&e, 5);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for i in 0..1000u64 {
                        let name = format!("tenant-{}", i % 8);
                        assert!(t.add(UsageKind::Tenant, &name, &[(UsageCounter::Requests, 1)]));
                    }
                });
            }
        });
        let rows = t.rows();
        assert_eq!(rows.len(), 8);
        assert!(rows.iter().all(|r| r.get(UsageCounter::Requests) == 500), "{rows:?}");
    }
}
