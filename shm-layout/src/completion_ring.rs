//! Completion rings: bounded byte rings through which a dispatcher hands
//! finished-request records to a response process.
//!
//! One ring per dispatcher slot; any thread of that dispatcher may push
//! (multi-producer), and the responder that owns the ring pops (consumers
//! claim records by compare-and-swap on `head`, so a restarted responder
//! overlapping its predecessor cannot double-process). Pushing never
//! blocks: a full ring drops the record and counts the drop.
//!
//! ```text
//! control (256 B): tail (own line) · head (own line) · owner (slot,
//!                  incarnation, tail when it took over) · counters
//! record at logical pos (32-byte aligned, never straddling the ring end):
//!   word 0    word 1     word 2            word 3     word 4 ..
//! ┌────────┬──────────┬─────────────────┬──────────┬─────────────────┐
//! │ commit │ reserved │ kind:2 | len:30 │ checksum │ payload, len B  │
//! │ =pos+1 │ = pos+1  │                 │ (keyed)  │                 │
//! └────────┴──────────┴─────────────────┴──────────┴─────────────────┘
//! ```
//!
//! A producer reserves space by compare-and-swap on `tail`, writes word 2
//! then word 1 (so the record's length is known as soon as possible), the
//! payload and checksum, and commits by storing word 0 last (`Release`).
//! (Words 0 and 1 hold `pos + 1` so that zeroed memory never looks
//! committed.) The consumer reads word 0: equal to `head + 1` means committed. A record
//! that is reserved but not committed is [`Pop::Pending`]; if its producer
//! is gone (it reserved before the current owner took the ring over, or
//! the registry says the owner is dead), [`CompletionRing::recover`] steps
//! over it using words 1-2, or, if even those were never written, drops
//! everything up to `tail`. No state is ever locked by a process.

use crate::mix::Checksum;
use crate::sync::{AtomicU64, AtomicU128, Ordering, fence};
use crate::words::{load_bytes, store_bytes};

const HEADER_WORDS: usize = 4;
const HEADER_BYTES: u64 = (HEADER_WORDS * 8) as u64;
const ALIGN: u64 = 32;
const KIND_RECORD: u64 = 1;
const KIND_PAD: u64 = 2;
const LEN_MASK: u64 = (1 << 30) - 1;

#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct RingControl {
    tail: AtomicU64,
    _line0: [u64; 7],
    head: AtomicU64,
    _line1: [u64; 7],
    /// `from:64 | incarnation:32 | slot:16`: the producer, and the tail when
    /// it took the ring over (every reservation below `from` is an earlier
    /// incarnation's).
    owner: AtomicU128,
    pushed: AtomicU64,
    dropped: AtomicU64,
    skipped: AtomicU64,
    corrupt: AtomicU64,
    _line2: [u64; 2],
    _line3: [u64; 8],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<RingControl>() as u64 == crate::plan::RING_CONTROL_BYTES);
#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(RingControl, owner) == 128);

#[cfg(test)]
impl RingControl {
    pub(crate) fn new() -> Self {
        Self {
            tail: AtomicU64::new(0),
            _line0: [0; 7],
            head: AtomicU64::new(0),
            _line1: [0; 7],
            owner: AtomicU128::new(0),
            pushed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            _line2: [0; 2],
            _line3: [0; 8],
        }
    }
}

/// Why a record was not pushed (it was dropped and counted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// No room until the responder catches up.
    #[error("completion ring full")]
    Full,
    /// Larger than a quarter of the ring.
    #[error("completion record of {len} bytes exceeds the ring's limit of {max}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// What [`CompletionRing::pop`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pop {
    /// A record was copied into the buffer.
    Record,
    /// Nothing to read.
    Empty,
    /// The next record is reserved but not committed yet (its producer is
    /// still writing it, or died doing so).
    Pending,
}

/// Counters of one ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RingStats {
    /// Records committed.
    pub pushed: u64,
    /// Records dropped because the ring was full or the record too large.
    pub dropped: u64,
    /// Abandoned reservations skipped.
    pub skipped: u64,
    /// Records that failed validation and were discarded.
    pub corrupt: u64,
    /// Bytes reserved and not yet consumed.
    pub used: u64,
    /// Ring capacity in bytes.
    pub capacity: u64,
}

/// One completion ring.
#[derive(Debug, Clone, Copy)]
pub struct CompletionRing<'a> {
    control: &'a RingControl,
    data: &'a [AtomicU64],
    checksum: Checksum,
}

fn record_size(len: u64) -> u64 {
    (HEADER_BYTES + len).div_ceil(ALIGN) * ALIGN
}

impl<'a> CompletionRing<'a> {
    pub(crate) fn new(control: &'a RingControl, data: &'a [AtomicU64], seed: [u64; 4]) -> Self {
        let cap = data.len() as u64 * 8;
        assert!(
            cap.is_power_of_two() && cap >= 4 * ALIGN,
            "ring capacity must be a power of two"
        );
        Self {
            control,
            data,
            checksum: Checksum::new([seed[2], seed[3], seed[0], seed[1]]),
        }
    }

    fn cap(&self) -> u64 {
        self.data.len() as u64 * 8
    }

    /// Largest record accepted.
    pub fn max_record(&self) -> usize {
        (self.cap() / 4 - HEADER_BYTES) as usize
    }

    fn words(&self, pos: u64) -> &'a [AtomicU64] {
        &self.data[((pos % self.cap()) / 8) as usize..]
    }

    /// Makes `(slot, incarnation)` (a registry slot and incarnation) the
    /// ring's producer. A producer calls it once, before its first push;
    /// every reservation made before it belongs to an earlier incarnation,
    /// which is dead, so [`Self::recover`] may skip it.
    pub fn set_owner(&self, slot: u16, incarnation: u32) {
        let from = self.control.tail.load(Ordering::Acquire);
        let word = (u128::from(from) << 64) | (u128::from(incarnation) << 16) | u128::from(slot);
        self.control.owner.store(word, Ordering::Release);
    }

    /// `(registry slot, incarnation)` of the producer.
    pub fn owner(&self) -> (u16, u32) {
        let o = self.control.owner.load(Ordering::Acquire);
        (o as u16, (o >> 16) as u32)
    }

    /// Appends a record. Never blocks; a full ring drops it and counts the drop.
    pub fn push(&self, payload: &[u8]) -> Result<(), PushError> {
        let c = self.control;
        if payload.len() > self.max_record() {
            c.dropped.fetch_add(1, Ordering::Relaxed);
            return Err(PushError::TooLarge {
                len: payload.len(),
                max: self.max_record(),
            });
        }
        let size = record_size(payload.len() as u64);
        let cap = self.cap();
        let (t, gap) = loop {
            // Head first: head never passes tail, so `h <= t` below.
            let h = c.head.load(Ordering::Acquire);
            let t = c.tail.load(Ordering::Acquire);
            let gap = if t % cap + size > cap { cap - t % cap } else { 0 };
            // `saturating_sub`: a head corrupted past the tail must not panic.
            if (t + gap + size).saturating_sub(h) > cap {
                c.dropped.fetch_add(1, Ordering::Relaxed);
                return Err(PushError::Full);
            }
            if c.tail
                .compare_exchange_weak(t, t + gap + size, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                break (t, gap);
            }
        };
        fence(Ordering::Release);
        if gap > 0 {
            let w = self.words(t);
            w[2].store(KIND_PAD << 30, Ordering::Relaxed);
            w[1].store(t + 1, Ordering::Release);
            w[0].store(t + 1, Ordering::Release);
        }
        let pos = t + gap;
        let w = self.words(pos);
        let meta = (KIND_RECORD << 30) | payload.len() as u64;
        w[2].store(meta, Ordering::Relaxed);
        w[1].store(pos + 1, Ordering::Release);
        store_bytes(&w[HEADER_WORDS..], payload);
        w[3].store(self.checksum.of(&[pos, meta], payload), Ordering::Relaxed);
        w[0].store(pos + 1, Ordering::Release);
        c.pushed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Takes the next record into `out`.
    pub fn pop(&self, out: &mut Vec<u8>) -> Pop {
        let c = self.control;
        let cap = self.cap();
        loop {
            let h = c.head.load(Ordering::Acquire);
            let t = c.tail.load(Ordering::Acquire);
            if h >= t {
                return Pop::Empty;
            }
            if !h.is_multiple_of(ALIGN) {
                // Only corruption misaligns the head: drop what is pending.
                self.discard_to(h, t);
                continue;
            }
            let w = self.words(h);
            if w[0].load(Ordering::Acquire) != h + 1 {
                return Pop::Pending;
            }
            let meta = w[2].load(Ordering::Relaxed);
            let len = meta & LEN_MASK;
            let size = match meta >> 30 {
                KIND_PAD => cap - h % cap,
                KIND_RECORD if h % cap + record_size(len) <= cap && len as usize <= self.max_record() => {
                    record_size(len)
                }
                _ => {
                    self.discard_to(h, t);
                    continue;
                }
            };
            if meta >> 30 == KIND_RECORD {
                load_bytes(&w[HEADER_WORDS..], len as usize, out);
                if self.checksum.of(&[h, meta], out) != w[3].load(Ordering::Relaxed) {
                    self.discard_to(h, t);
                    continue;
                }
            }
            if c.head
                .compare_exchange(h, h + size, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                && meta >> 30 == KIND_RECORD
            {
                return Pop::Record;
            }
        }
    }

    /// A record that fails validation cannot be trusted for its length:
    /// drop everything up to `t`.
    fn discard_to(&self, h: u64, t: u64) {
        if self
            .control
            .head
            .compare_exchange(h, t, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.control.corrupt.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Steps over the record at the head if it is reserved but not
    /// committed and its producer is gone: either it was reserved before
    /// the current owner took the ring over ([`Self::set_owner`]), or the
    /// owner is no longer alive according to `is_alive(slot, incarnation)`
    /// (the registry's [`crate::Registry::is_alive`]). Call it when
    /// [`Self::pop`] returns [`Pop::Pending`]. Returns whether it skipped.
    ///
    /// It skips one record if the reservation wrote its length, else
    /// everything up to the tail (the producer died in the few instructions
    /// between reserving and writing the length).
    pub fn recover(&self, is_alive: impl Fn(u16, u32) -> bool) -> bool {
        let c = self.control;
        let cap = self.cap();
        let h = c.head.load(Ordering::Acquire);
        let t = c.tail.load(Ordering::Acquire);
        if h >= t {
            return false;
        }
        if !h.is_multiple_of(ALIGN) {
            self.discard_to(h, t);
            return true;
        }
        let w = self.words(h);
        if w[0].load(Ordering::Acquire) == h + 1 {
            return false;
        }
        let owner = c.owner.load(Ordering::Acquire);
        let (slot, incarnation, from) = (owner as u16, (owner >> 16) as u32, (owner >> 64) as u64);
        if h >= from && is_alive(slot, incarnation) {
            return false;
        }
        let next = if w[1].load(Ordering::Acquire) == h + 1 {
            let meta = w[2].load(Ordering::Relaxed);
            match meta >> 30 {
                KIND_PAD => h + (cap - h % cap),
                KIND_RECORD if h % cap + record_size(meta & LEN_MASK) <= cap => h + record_size(meta & LEN_MASK),
                _ => t,
            }
        } else {
            t
        };
        let skipped = c
            .head
            .compare_exchange(h, next.min(t), Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        if skipped {
            c.skipped.fetch_add(1, Ordering::Relaxed);
        }
        skipped
    }

    /// Counters.
    pub fn stats(&self) -> RingStats {
        let c = self.control;
        let h = c.head.load(Ordering::Relaxed);
        let t = c.tail.load(Ordering::Relaxed);
        RingStats {
            pushed: c.pushed.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            used: t.saturating_sub(h),
            capacity: self.cap(),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn parts(words: usize) -> (RingControl, Vec<AtomicU64>) {
        (RingControl::new(), (0..words).map(|_| AtomicU64::new(0)).collect())
    }

    #[test]
    fn fifo_across_many_wraps() {
        let (c, d) = parts(512); // 4 KiB
        let r = CompletionRing::new(&c, &d, [9; 4]);
        let mut out = Vec::new();
        for i in 0..2000u32 {
            let rec: Vec<u8> = (0..(i % 200)).map(|b| (b ^ i) as u8).collect();
            r.push(&rec).unwrap();
            assert_eq!(r.pop(&mut out), Pop::Record);
            assert_eq!(out, rec);
        }
        assert_eq!(r.pop(&mut out), Pop::Empty);
        assert_eq!(r.stats().pushed, 2000);
    }

    #[test]
    fn full_ring_drops_and_counts() {
        let (c, d) = parts(512);
        let r = CompletionRing::new(&c, &d, [9; 4]);
        let rec = [1u8; 200];
        let mut pushed = 0;
        while r.push(&rec).is_ok() {
            pushed += 1;
        }
        assert_eq!(r.push(&rec), Err(PushError::Full));
        assert_eq!(r.stats().dropped, 2);
        assert!(pushed >= 4096 / 256 - 1);
        let mut out = Vec::new();
        assert_eq!(r.pop(&mut out), Pop::Record);
        assert!(r.push(&rec).is_ok(), "room again after a pop");
        assert_eq!(r.push(&[0; 2000]), Err(PushError::TooLarge { len: 2000, max: 992 }));
    }

    #[test]
    fn abandoned_reservation_is_pending_then_skipped() {
        let (c, d) = parts(512);
        let r = CompletionRing::new(&c, &d, [9; 4]);
        r.push(b"before").unwrap();
        r.push(b"dead producer").unwrap();
        r.push(b"after").unwrap();
        // The second producer died before its commit word.
        let second = record_size(6);
        d[(second / 8) as usize].store(0, Ordering::Relaxed);
        let mut out = Vec::new();
        assert_eq!(r.pop(&mut out), Pop::Record);
        assert_eq!(out, b"before");
        assert_eq!(r.pop(&mut out), Pop::Pending);
        assert!(!r.recover(|_, _| true), "a live owner's reservation is waited for");
        assert!(r.recover(|_, _| false));
        assert_eq!(r.pop(&mut out), Pop::Record);
        assert_eq!(out, b"after", "the record after the hole survives");
        assert_eq!(r.stats().skipped, 1);
    }

    #[test]
    fn reservation_without_a_length_skips_to_tail() {
        let (c, d) = parts(512);
        let r = CompletionRing::new(&c, &d, [9; 4]);
        r.push(b"lost").unwrap();
        d[0].store(0, Ordering::Relaxed);
        d[1].store(0, Ordering::Relaxed);
        let mut out = Vec::new();
        assert_eq!(r.pop(&mut out), Pop::Pending);
        assert!(r.recover(|_, _| false));
        assert_eq!(r.pop(&mut out), Pop::Empty);
    }

    #[test]
    fn a_new_owner_lets_the_dead_incarnations_reservation_go() {
        let (c, d) = parts(512);
        let r = CompletionRing::new(&c, &d, [9; 4]);
        r.set_owner(1, 1);
        r.push(b"torn").unwrap();
        d[0].store(0, Ordering::Relaxed); // killed before its commit
        r.set_owner(1, 2); // restarted into the same registry slot
        r.push(b"after restart").unwrap();
        let mut out = Vec::new();
        assert_eq!(r.pop(&mut out), Pop::Pending);
        assert_eq!(r.owner(), (1, 2));
        assert!(r.recover(|_, _| true), "reserved before the live owner took over");
        assert_eq!(r.pop(&mut out), Pop::Record);
        assert_eq!(out, b"after restart");
    }

    #[test]
    fn corrupt_payload_is_discarded() {
        let (c, d) = parts(512);
        let r = CompletionRing::new(&c, &d, [9; 4]);
        r.push(b"payload!").unwrap();
        d[HEADER_WORDS].fetch_xor(4, Ordering::Relaxed);
        let mut out = Vec::new();
        assert_eq!(r.pop(&mut out), Pop::Empty);
        assert_eq!(r.stats().corrupt, 1);
    }
}
