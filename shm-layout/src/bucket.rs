//! The 64-byte, 4-way bucket both hash tables are made of, and the slot
//! encoding that makes a slot self-validating.
//!
//! A slot is one 128-bit atomic: `value` in the high half, and in the low
//! half `key ^ mix64(value ^ seed)`. Writers replace a whole slot with one
//! compare-and-swap, so a reader never sees half of one entry and half of
//! another; and because the key half is bound to the value half by the keyed
//! fingerprint, a slot whose bits were flipped (by a stray write, or a bug)
//! no longer matches its key and reads as a miss instead of wrong data.
//! An all-zero slot is empty; the tables never store a zero value.

use crate::mix::mix64;
use crate::sync::{AtomicU128, Ordering};

/// Slots per bucket.
pub const WAYS: usize = 4;

/// Four slots on one cache line.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Bucket {
    pub(crate) slots: [AtomicU128; WAYS],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Bucket>() == 64);
#[cfg(not(loom))]
const _: () = assert!(std::mem::align_of::<Bucket>() == 64);

impl Bucket {
    /// An empty bucket (heap tests and loom models; shm buckets start zeroed).
    #[cfg_attr(not(loom), allow(dead_code))]
    pub(crate) fn new() -> Self {
        Self {
            slots: std::array::from_fn(|_| AtomicU128::new(0)),
        }
    }

    /// Asks the CPU to start fetching this bucket's cache line, so that a
    /// chain of lookups overlaps its memory latencies instead of paying them
    /// one after another.
    #[inline(always)]
    pub(crate) fn prefetch(&self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetching is a hint with no architectural effect; any
        // address is allowed, and this one is a live reference.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((self as *const Self).cast());
        }
    }

    /// Loads all four slots.
    #[inline]
    pub(crate) fn load(&self) -> [u128; WAYS] {
        std::array::from_fn(|i| self.slots[i].load(Ordering::Acquire))
    }

    /// Replaces slot `i` if it still holds `old`.
    #[inline]
    pub(crate) fn cas(&self, i: usize, old: u128, new: u128) -> bool {
        self.slots[i]
            .compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// Packs and unpacks slots for one segment seed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotCodec {
    seed: u64,
}

impl SlotCodec {
    pub(crate) const fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// The slot for `key` and a non-zero `value`.
    #[inline]
    pub(crate) fn pack(&self, key: u64, value: u64) -> u128 {
        debug_assert_ne!(value, 0, "a zero value would read as an empty slot");
        (u128::from(value) << 64) | u128::from(key ^ mix64(value ^ self.seed))
    }

    /// The `(key, value)` of a non-empty slot.
    #[inline]
    pub(crate) fn unpack(&self, slot: u128) -> Option<(u64, u64)> {
        if slot == 0 {
            return None;
        }
        let value = (slot >> 64) as u64;
        Some(((slot as u64) ^ mix64(value ^ self.seed), value))
    }

    /// The value of `slot` if it holds `key`.
    #[inline]
    pub(crate) fn value_for(&self, slot: u128, key: u64) -> Option<u64> {
        let value = (slot >> 64) as u64;
        (slot != 0 && (slot as u64) ^ mix64(value ^ self.seed) == key).then_some(value)
    }
}

/// Which of `n` buckets holds `key` (multiply-shift: uses the high bits, no
/// power-of-two restriction on `n`).
#[inline]
pub(crate) fn bucket_index(key: u64, n: usize) -> usize {
    ((u128::from(key) * n as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trips_and_bit_flips_break_the_match() {
        let c = SlotCodec::new(0xdead_beef);
        let slot = c.pack(42, 7);
        assert_eq!(c.unpack(slot), Some((42, 7)));
        assert_eq!(c.value_for(slot, 42), Some(7));
        assert_eq!(c.value_for(slot, 43), None);
        for bit in 0..128 {
            let flipped = slot ^ (1u128 << bit);
            assert_eq!(c.value_for(flipped, 42), None, "bit {bit}");
        }
        assert_eq!(c.unpack(0), None);
    }

    #[test]
    fn bucket_index_stays_in_range() {
        for n in [1usize, 3, 1000, 65_537] {
            for k in [0u64, 1, u64::MAX, 0x8000_0000_0000_0000] {
                assert!(bucket_index(k, n) < n);
            }
        }
    }
}
