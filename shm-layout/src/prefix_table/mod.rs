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
//! inheriting the old server's affinity: [`ServerTag::gen_tag`](crate::ServerTag::gen_tag) must match
//! the server table's current generation for the lane to count as live.
//!
//! The slot's value and its packing are in `entry`, the read path
//! (lookup, longest-prefix match) in `lookup`, the write path (insert,
//! the stalest slot a full bucket gives up, chains) in `insert`, removals
//! and flushes in `remove`, whole-table counts and iteration in `scan`.

mod entry;
mod insert;
mod lookup;
mod remove;
mod scan;
#[cfg(all(test, not(loom)))]
mod tests;

use crate::bucket::{Bucket, SlotCodec, WAYS, bucket_index};

pub use crate::bucket::WAYS as PREFIX_WAYS;
pub use entry::{PrefixEntry, ServerSet, Stamp};
pub use insert::InsertOutcome;
pub use lookup::{MATCH_CAPACITY, PrefixMatch};

/// Servers remembered per prefix.
pub const LANES: usize = 3;

/// Buckets a longest-prefix match fetches ahead of the one it reads.
const PREFETCH_AHEAD: usize = 8;

/// Attempts a writer makes before reporting contention.
const MAX_ATTEMPTS: usize = 16;

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
}
