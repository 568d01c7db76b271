//! The stats region: plain `u64` counters, one block per process.
//!
//! ```text
//! StatBlock (STAT_WORDS × 8 B = 8 KiB, 64-aligned), one per registry slot
//! ┌ word 0 · word 1 · … · word STAT_WORDS-1      (what a word means is the user's index map)
//! ```
//!
//! The region is generic: it knows nothing of what the words count. A
//! process adds to the block of its own registry slot ([`Stats::add`]: one
//! `Relaxed` `fetch_add`, never contended because no other process writes
//! that block), and whoever exports metrics sums a word over every block
//! ([`Stats::sum`]). The index map (which word is which counter or
//! histogram bucket) belongs to the application (`semlb::metrics`).
//!
//! **Monotonic across restarts.** A block belongs to a registry *slot*,
//! not to an incarnation: nothing ever resets it, so a restarted process
//! (the supervisor claims the same slot again) keeps adding to the totals
//! its predecessor left, and every sum only grows, as Prometheus counters
//! must. A process killed at any instruction leaves at most the increments
//! it had not made yet; there is nothing to repair.
//!
//! A flipped bit makes a counter wrong, never a table: no other region
//! reads these words. Sums wrap on overflow (`u64`, never reached in
//! practice).

use crate::plan::STAT_WORDS;
use crate::sync::{AtomicU64, Ordering};

/// One process's counters.
#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct StatBlock {
    words: [AtomicU64; STAT_WORDS],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<StatBlock>() as u64 == crate::plan::STAT_BLOCK_BYTES);
#[cfg(not(loom))]
const _: () = assert!(crate::plan::STAT_BLOCK_BYTES == 8 * STAT_WORDS as u64);

#[cfg(test)]
impl StatBlock {
    pub(crate) fn new() -> Self {
        Self {
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// The stats region over its blocks (one per process registry slot).
#[derive(Debug, Clone, Copy)]
pub struct Stats<'a> {
    blocks: &'a [StatBlock],
}

impl<'a> Stats<'a> {
    pub(crate) fn new(blocks: &'a [StatBlock]) -> Self {
        Self { blocks }
    }

    /// Number of blocks (process slots).
    pub fn processes(&self) -> usize {
        self.blocks.len()
    }

    /// Counters per block ([`STAT_WORDS`]).
    pub const fn words(&self) -> usize {
        STAT_WORDS
    }

    /// Adds `delta` to counter `index` of `process`'s block. A process slot
    /// or index out of range is ignored (debug builds assert): metrics must
    /// never take a process down.
    #[inline]
    pub fn add(&self, process: u16, index: usize, delta: u64) {
        debug_assert!(index < STAT_WORDS, "stat index {index} out of {STAT_WORDS}");
        if let Some(w) = self.blocks.get(usize::from(process)).and_then(|b| b.words.get(index)) {
            w.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Counter `index` of `process`'s block (0 out of range).
    pub fn get(&self, process: u16, index: usize) -> u64 {
        self.blocks
            .get(usize::from(process))
            .and_then(|b| b.words.get(index))
            .map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// Counter `index` summed over every block (wrapping; 0 out of range).
    pub fn sum(&self, index: usize) -> u64 {
        if index >= STAT_WORDS {
            return 0;
        }
        self.blocks
            .iter()
            .fold(0u64, |acc, b| acc.wrapping_add(b.words[index].load(Ordering::Relaxed)))
    }

    /// Every counter summed over every block, in index order: one pass over
    /// the region (what a metrics scrape wants).
    pub fn sum_all(&self) -> Vec<u64> {
        let mut out = vec![0u64; STAT_WORDS];
        for b in self.blocks {
            for (acc, w) in out.iter_mut().zip(&b.words) {
                *acc = acc.wrapping_add(w.load(Ordering::Relaxed));
            }
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn blocks(n: usize) -> Vec<StatBlock> {
        (0..n).map(|_| StatBlock::new()).collect()
    }

    #[test]
    fn add_get_and_sum() {
        let b = blocks(4);
        let s = Stats::new(&b);
        assert_eq!((s.processes(), s.words()), (4, STAT_WORDS));
        s.add(0, 7, 2);
        s.add(3, 7, 5);
        s.add(3, STAT_WORDS - 1, 1);
        assert_eq!((s.get(0, 7), s.get(3, 7), s.get(1, 7)), (2, 5, 0));
        assert_eq!(s.sum(7), 7);
        assert_eq!(s.sum(STAT_WORDS - 1), 1);
        let all = s.sum_all();
        assert_eq!(all.len(), STAT_WORDS);
        assert_eq!((all[7], all[STAT_WORDS - 1], all.iter().sum::<u64>()), (7, 1, 8));
    }

    #[test]
    #[cfg(not(debug_assertions))]
    fn out_of_range_is_ignored() {
        let b = blocks(2);
        let s = Stats::new(&b);
        s.add(9, 1, 1);
        s.add(0, STAT_WORDS, 1);
        assert_eq!(s.sum_all().iter().sum::<u64>(), 0);
        assert_eq!((s.get(9, 1), s.get(0, STAT_WORDS), s.sum(STAT_WORDS)), (0, 0, 0));
    }

    #[test]
    fn unknown_process_is_ignored() {
        let b = blocks(2);
        let s = Stats::new(&b);
        s.add(9, 1, 1);
        assert_eq!((s.get(9, 1), s.sum(1)), (0, 0));
    }

    #[test]
    fn concurrent_adds_from_many_threads_all_count() {
        let b = blocks(8);
        let s = Stats::new(&b);
        std::thread::scope(|scope| {
            for p in 0..8u16 {
                scope.spawn(move || {
                    for i in 0..10_000 {
                        s.add(p, i % 3, 1);
                    }
                });
            }
        });
        assert_eq!(s.sum(0) + s.sum(1) + s.sum(2), 80_000);
        assert_eq!(s.get(5, 0), 3334);
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    use super::*;

    /// Two processes adding to their own blocks while a third sums: the
    /// sum only ever grows and ends exact.
    #[test]
    fn sums_are_monotonic_and_exact() {
        loom::model(|| {
            let blocks: &'static [StatBlock] = Box::leak((0..2).map(|_| StatBlock::new()).collect::<Vec<_>>().into());
            let s = Stats::new(blocks);
            let writers: Vec<_> = (0..2u16)
                .map(|p| {
                    loom::thread::spawn(move || {
                        s.add(p, 0, 1);
                        s.add(p, 0, 2);
                    })
                })
                .collect();
            let a = s.sum(0);
            let b = s.sum(0);
            assert!(b >= a && b <= 6);
            for w in writers {
                w.join().unwrap();
            }
            assert_eq!(s.sum(0), 6);
        });
    }
}
