//! The response cache: exact request hash → response bytes, in an
//! append-only ring log with a self-validating index.
//!
//! ```text
//! control (256 B): tail (own line) · records · refused · index misses
//! index:  64-byte buckets of 4 slots; slot = (pos + 1) | fold(key) ^ mix64((pos + 1) ^ seed)
//! log:    a byte ring of `cap` bytes addressed by an ever-growing logical
//!         position; record at logical `pos` lives at `pos % cap`:
//!
//!   word 0   word 1   word 2   word 3   word 4      word 5 ..
//! ┌────────┬────────┬────────┬────────┬──────────┬──────────────────┐
//! │ pos+1  │ key.lo │ key.hi │  len   │ checksum │ value, len bytes │
//! └────────┴────────┴────────┴────────┴──────────┴──────────────────┘
//!   written last (Release): the commit; `pos + 1` so zeroed memory never commits
//! ```
//!
//! Writing: reserve `[pos, pos + size)` by compare-and-swap on `tail` (a
//! record never straddles the ring's end: the gap is skipped), fence, write
//! words 1..,  then word 0, then point the index at `pos`. A writer killed
//! half-way leaves dead space that no index slot points at.
//!
//! Reading: index → `pos`; copy the record out; fence; re-read `tail`. The
//! copy is accepted only if no reservation has lapped `pos` since
//! (`tail - pos <= cap`), word 0 equals `pos + 1`, the key is the one asked for,
//! the length is sane, and the keyed checksum matches. Anything else is a
//! miss: readers never wait and never return bytes they have not verified.
//! The oldest records are overwritten first; values above `max_value` bytes
//! are refused with [`PutError::TooLarge`], never truncated.

use crate::bucket::{Bucket, SlotCodec, WAYS, bucket_index};
use crate::mix::{Checksum, mix64};
use crate::sync::{AtomicU64, Ordering, fence};
use crate::words::{load_bytes, store_bytes, words_for};

const HEADER_WORDS: usize = 5;
const HEADER_BYTES: u64 = (HEADER_WORDS * 8) as u64;
const MAX_ATTEMPTS: usize = 16;

/// The 128-bit key of an exact request: a hash over model, prompt,
/// generation parameters and tenant, so equal keys mean interchangeable
/// responses and different tenants never share one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResponseKey(pub u128);

impl ResponseKey {
    fn lo(self) -> u64 {
        self.0 as u64
    }
    fn hi(self) -> u64 {
        (self.0 >> 64) as u64
    }
    /// The 64 bits the index works with: both halves mixed, so a key that
    /// varies in only one half, or only in a few low bits (keys made by
    /// hand rather than by a hash), still spreads over the buckets (bucket
    /// choice uses the high bits).
    fn folded(self) -> u64 {
        mix64(self.lo() ^ mix64(self.hi() ^ 0x9e37_79b9_7f4a_7c15))
    }
}

/// Why a value was not stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PutError {
    /// Larger than the configured share of the log.
    #[error("response of {len} bytes exceeds the cache's limit of {max} bytes")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct LogControl {
    tail: AtomicU64,
    _line0: [u64; 7],
    records: AtomicU64,
    refused: AtomicU64,
    unindexed: AtomicU64,
    _line1: [u64; 5],
    _rest: [u64; 16],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<LogControl>() as u64 == crate::plan::LOG_CONTROL_BYTES);

#[cfg(test)]
impl LogControl {
    pub(crate) fn new() -> Self {
        Self {
            tail: AtomicU64::new(0),
            _line0: [0; 7],
            records: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            unindexed: AtomicU64::new(0),
            _line1: [0; 5],
            _rest: [0; 16],
        }
    }
}

/// Counters of the response log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseLogStats {
    /// Logical end of the log: total bytes ever reserved.
    pub tail: u64,
    /// Ring capacity in bytes.
    pub capacity: u64,
    /// Largest value accepted.
    pub max_value: u64,
    /// Records written.
    pub records: u64,
    /// Values refused as too large.
    pub refused: u64,
    /// Records written whose index update lost every race (unreachable).
    pub unindexed: u64,
}

/// The response cache over its control block, index and log.
#[derive(Debug, Clone, Copy)]
pub struct ResponseLog<'a> {
    control: &'a LogControl,
    index: &'a [Bucket],
    log: &'a [AtomicU64],
    max_value: usize,
    codec: SlotCodec,
    checksum: Checksum,
}

impl<'a> ResponseLog<'a> {
    pub(crate) fn new(
        control: &'a LogControl,
        index: &'a [Bucket],
        log: &'a [AtomicU64],
        max_value: usize,
        seed: [u64; 4],
    ) -> Self {
        assert!(!index.is_empty() && max_value <= log.len() * 8 / 2);
        Self {
            control,
            index,
            log,
            max_value,
            codec: SlotCodec::new(seed[1]),
            checksum: Checksum::new(seed),
        }
    }

    fn cap(&self) -> u64 {
        (self.log.len() * 8) as u64
    }

    /// Largest value [`Self::put`] accepts.
    pub fn max_value(&self) -> usize {
        self.max_value
    }

    /// Stores `value` under `key`, replacing an older value of the same key.
    pub fn put(&self, key: ResponseKey, value: &[u8]) -> Result<(), PutError> {
        if value.len() > self.max_value {
            self.control.refused.fetch_add(1, Ordering::Relaxed);
            return Err(PutError::TooLarge {
                len: value.len(),
                max: self.max_value,
            });
        }
        let size = HEADER_BYTES + (words_for(value.len()) * 8) as u64;
        let cap = self.cap();
        let pos = loop {
            let t = self.control.tail.load(Ordering::Relaxed);
            let gap = if t % cap + size > cap { cap - t % cap } else { 0 };
            let start = t + gap;
            if self
                .control
                .tail
                .compare_exchange_weak(t, start + size, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                break start;
            }
        };
        // Pairs with the reader's acquire fence: a reader that sees any word
        // written below also sees the reservation above, and so knows it
        // was lapped.
        fence(Ordering::Release);
        let at = ((pos % cap) / 8) as usize;
        let w = &self.log[at..at + size as usize / 8];
        let len = value.len() as u64;
        w[1].store(key.lo(), Ordering::Relaxed);
        w[2].store(key.hi(), Ordering::Relaxed);
        w[3].store(len, Ordering::Relaxed);
        store_bytes(&w[HEADER_WORDS..], value);
        w[4].store(
            self.checksum.of(&[pos, key.lo(), key.hi(), len], value),
            Ordering::Relaxed,
        );
        w[0].store(pos + 1, Ordering::Release);
        self.control.records.fetch_add(1, Ordering::Relaxed);
        if !self.index_insert(key, pos) {
            self.control.unindexed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn index_insert(&self, key: ResponseKey, pos: u64) -> bool {
        let bucket = &self.index[bucket_index(key.folded(), self.index.len())];
        let new = self.codec.pack(key.folded(), pos + 1);
        for _ in 0..MAX_ATTEMPTS {
            let slots = bucket.load();
            let tail = self.control.tail.load(Ordering::Relaxed);
            let same = slots
                .iter()
                .position(|s| self.codec.value_for(*s, key.folded()).is_some());
            if let Some(i) = same
                && (slots[i] >> 64) as u64 > pos + 1
            {
                // A newer record of this key is indexed already.
                return true;
            }
            // Same key, else empty, else the oldest position (lapped ones
            // first; a position beyond the tail is garbage and goes first).
            let victim = same.or_else(|| slots.iter().position(|s| *s == 0)).unwrap_or_else(|| {
                (0..WAYS)
                    .min_by_key(|i| {
                        let p = (slots[*i] >> 64) as u64;
                        if p > tail { 0 } else { p }
                    })
                    .unwrap_or(0)
            });
            if bucket.cas(victim, slots[victim], new) {
                return true;
            }
        }
        false
    }

    /// The value stored under `key`, copied into `out`; `None` on a miss.
    /// Never waits.
    pub fn get_into<'b>(&self, key: ResponseKey, out: &'b mut Vec<u8>) -> Option<&'b [u8]> {
        let bucket = &self.index[bucket_index(key.folded(), self.index.len())];
        let pos = bucket
            .load()
            .into_iter()
            .filter_map(|s| self.codec.value_for(s, key.folded()))
            .max()?
            .checked_sub(1)?;
        let cap = self.cap();
        let tail = self.control.tail.load(Ordering::Acquire);
        if pos % 8 != 0 || pos > tail || tail - pos > cap || pos % cap + HEADER_BYTES > cap {
            return None;
        }
        let at = ((pos % cap) / 8) as usize;
        if self.log[at].load(Ordering::Acquire) != pos + 1 {
            return None;
        }
        let (lo, hi, len, sum) = (
            self.log[at + 1].load(Ordering::Relaxed),
            self.log[at + 2].load(Ordering::Relaxed),
            self.log[at + 3].load(Ordering::Relaxed),
            self.log[at + 4].load(Ordering::Relaxed),
        );
        let size = HEADER_BYTES + words_for(len as usize) as u64 * 8;
        if lo != key.lo()
            || hi != key.hi()
            || len > self.max_value as u64
            || pos % cap + size > cap
            || tail - pos < size
        {
            return None;
        }
        load_bytes(&self.log[at + HEADER_WORDS..], len as usize, out);
        fence(Ordering::Acquire);
        if self.control.tail.load(Ordering::Relaxed) - pos > cap {
            return None;
        }
        (self.checksum.of(&[pos, lo, hi, len], out) == sum).then_some(out.as_slice())
    }

    /// Convenience for [`Self::get_into`] with a fresh buffer.
    pub fn get(&self, key: ResponseKey) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        self.get_into(key, &mut out)?;
        Some(out)
    }

    /// Empties the cache (the admin API's response flush): every index
    /// slot is compare-and-swapped to empty, so the records they pointed at
    /// can no longer be found and every later lookup of their keys misses
    /// (the log bytes stay until the ring overwrites them, unreachable).
    /// Returns how many entries were removed: index slots that pointed at a
    /// record still in the ring (a lapped record was a miss already).
    ///
    /// Lock-free and safe while dispatchers read and write: a lookup that
    /// loaded its index slot before the flush reached it may still return
    /// that (verified) value, and records put while the flush runs may
    /// survive it (their index slot is installed after it went by, or the
    /// slot changed between its load and its swap and is left as it is).
    /// The counters (`records`, `tail`, ...) are not reset.
    pub fn clear(&self) -> u64 {
        let cap = self.cap();
        let mut removed = 0;
        for bucket in self.index {
            let slots = bucket.load();
            for (i, slot) in slots.iter().enumerate() {
                if *slot == 0 || !bucket.cas(i, *slot, 0) {
                    continue;
                }
                let tail = self.control.tail.load(Ordering::Relaxed);
                let pos = ((*slot >> 64) as u64).wrapping_sub(1);
                if pos < tail && tail - pos <= cap {
                    removed += 1;
                }
            }
        }
        removed
    }

    /// Empties the cache and erases what it held (the admin API's response
    /// flush): [`clear`](Self::clear), then one reservation of the whole
    /// ring laps every record written before it (a reader that copied one
    /// sees it lapped and misses), then every byte of the ring is zeroed,
    /// so no cached answer stays in the segment's memory (or its file in
    /// `/dev/shm`). A record a writer reserves while the ring is zeroed may
    /// lose bytes: its checksum then fails and it reads as a miss. Returns
    /// [`clear`](Self::clear)'s count.
    pub fn erase(&self) -> u64 {
        let removed = self.clear();
        self.control.tail.fetch_add(self.cap(), Ordering::AcqRel);
        fence(Ordering::Release);
        for word in self.log {
            word.store(0, Ordering::Relaxed);
        }
        removed
    }

    /// Bytes of the ring that are not zero (0 right after [`erase`](Self::erase)).
    pub fn occupied_bytes(&self) -> u64 {
        self.log.iter().filter(|w| w.load(Ordering::Relaxed) != 0).count() as u64 * 8
    }

    /// Counters.
    pub fn stats(&self) -> ResponseLogStats {
        ResponseLogStats {
            tail: self.control.tail.load(Ordering::Relaxed),
            capacity: self.cap(),
            max_value: self.max_value as u64,
            records: self.control.records.load(Ordering::Relaxed),
            refused: self.control.refused.load(Ordering::Relaxed),
            unindexed: self.control.unindexed.load(Ordering::Relaxed),
        }
    }

    /// Index slots.
    pub fn index_capacity(&self) -> u64 {
        (self.index.len() * WAYS) as u64
    }

    /// Index slots in use (a full scan, for inspection).
    pub fn index_occupancy(&self) -> u64 {
        self.index
            .iter()
            .map(|b| b.load().iter().filter(|s| **s != 0).count() as u64)
            .sum()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Parts {
        control: LogControl,
        index: Vec<Bucket>,
        log: Vec<AtomicU64>,
    }

    fn parts(index_buckets: usize, log_words: usize) -> Parts {
        Parts {
            control: LogControl::new(),
            index: (0..index_buckets).map(|_| Bucket::new()).collect(),
            log: (0..log_words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn log(p: &Parts) -> ResponseLog<'_> {
        ResponseLog::new(&p.control, &p.index, &p.log, p.log.len() * 8 / 4, [1, 2, 3, 4])
    }

    #[test]
    fn put_get_and_replace() {
        let p = parts(8, 512);
        let l = log(&p);
        assert_eq!(l.get(ResponseKey(1)), None);
        l.put(ResponseKey(1), b"first").unwrap();
        l.put(ResponseKey(2), b"").unwrap();
        assert_eq!(l.get(ResponseKey(1)).as_deref(), Some(&b"first"[..]));
        assert_eq!(l.get(ResponseKey(2)).as_deref(), Some(&b""[..]));
        l.put(ResponseKey(1), b"second, longer").unwrap();
        assert_eq!(l.get(ResponseKey(1)).as_deref(), Some(&b"second, longer"[..]));
        // Same low half, other high half: a different key, a miss.
        assert_eq!(l.get(ResponseKey(1 | 1 << 64)), None);
    }

    #[test]
    fn oldest_records_are_overwritten_and_read_as_misses() {
        let p = parts(64, 128); // 1 KiB ring
        let l = log(&p);
        let value = [7u8; 100];
        for k in 0..40u128 {
            l.put(ResponseKey(k), &value).unwrap();
        }
        assert_eq!(l.get(ResponseKey(0)), None, "lapped");
        assert_eq!(l.get(ResponseKey(39)).as_deref(), Some(&value[..]));
        let live = (0..40u128).filter(|k| l.get(ResponseKey(*k)).is_some()).count();
        assert!(live > 0 && live < 10, "{live} records survive in 1 KiB");
    }

    #[test]
    fn too_large_values_are_refused_not_truncated() {
        let p = parts(8, 128);
        let l = log(&p);
        let max = l.max_value();
        assert!(l.put(ResponseKey(1), &vec![0; max]).is_ok());
        assert_eq!(
            l.put(ResponseKey(2), &vec![0; max + 1]),
            Err(PutError::TooLarge { len: max + 1, max })
        );
        assert_eq!(l.get(ResponseKey(2)), None);
        assert_eq!(l.stats().refused, 1);
    }

    #[test]
    fn erase_leaves_no_byte_of_any_value_and_the_log_keeps_working() {
        let p = parts(64, 4096);
        let l = log(&p);
        for i in 0..20u128 {
            l.put(ResponseKey(i), format!("secret answer {i}").as_bytes()).unwrap();
        }
        assert!(l.erase() > 0);
        assert_eq!(l.occupied_bytes(), 0, "every byte zeroed");
        assert!((0..20u128).all(|i| l.get(ResponseKey(i)).is_none()));
        l.put(ResponseKey(7), b"again").unwrap();
        assert_eq!(l.get(ResponseKey(7)).as_deref(), Some(&b"again"[..]));
    }

    #[test]
    fn clear_makes_every_entry_miss_and_the_log_keeps_working() {
        let p = parts(16, 1024);
        let l = log(&p);
        assert_eq!(l.clear(), 0);
        for k in 0..10u128 {
            l.put(ResponseKey(k), b"value").unwrap();
        }
        assert_eq!(l.index_occupancy(), 10);
        assert_eq!(l.clear(), 10);
        assert_eq!(l.index_occupancy(), 0);
        for k in 0..10u128 {
            assert_eq!(l.get(ResponseKey(k)), None, "key {k} survived the flush");
        }
        assert_eq!(l.stats().records, 10, "counters are kept");
        l.put(ResponseKey(3), b"again").unwrap();
        assert_eq!(l.get(ResponseKey(3)).as_deref(), Some(&b"again"[..]));
    }

    #[test]
    fn clear_does_not_count_lapped_records() {
        let p = parts(64, 128); // 1 KiB ring
        let l = log(&p);
        for k in 0..40u128 {
            l.put(ResponseKey(k), &[7u8; 100]).unwrap();
        }
        let live = (0..40u128).filter(|k| l.get(ResponseKey(*k)).is_some()).count() as u64;
        assert_eq!(l.clear(), live);
        assert_eq!(l.index_occupancy(), 0);
    }

    #[test]
    fn clear_is_safe_while_writers_and_readers_run() {
        use std::sync::atomic::AtomicBool;
        let p = parts(32, 4096);
        let l = log(&p);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for w in 0..2u128 {
                let stop = &stop;
                s.spawn(move || {
                    let mut k = w;
                    while !stop.load(Ordering::Relaxed) {
                        l.put(ResponseKey(k % 64), &(k % 64).to_le_bytes()).unwrap();
                        k += 2;
                    }
                });
            }
            let stop = &stop;
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for k in 0..64u128 {
                        // A hit is always the value written for that key.
                        if let Some(v) = l.get(ResponseKey(k)) {
                            assert_eq!(v, k.to_le_bytes());
                        }
                    }
                }
            });
            for _ in 0..200 {
                l.clear();
            }
            stop.store(true, Ordering::Relaxed);
        });
        l.clear();
        assert!((0..64u128).all(|k| l.get(ResponseKey(k)).is_none()));
    }

    #[test]
    fn a_half_written_record_is_a_miss() {
        let p = parts(8, 512);
        let l = log(&p);
        l.put(ResponseKey(5), b"complete value").unwrap();
        // Simulate a writer killed before its commit word: clear word 0.
        p.log[0].store(0, Ordering::Relaxed);
        assert_eq!(l.get(ResponseKey(5)), None);
    }

    #[test]
    fn corrupt_payload_fails_the_checksum() {
        let p = parts(8, 512);
        let l = log(&p);
        l.put(ResponseKey(5), b"complete value").unwrap();
        p.log[HEADER_WORDS].fetch_xor(1 << 9, Ordering::Relaxed);
        assert_eq!(l.get(ResponseKey(5)), None);
    }
}
