//! The token segments every process of a gateway shares: the second level
//! of the tokenizer's segment cache, in the shm segment's segment log
//! ([`shm_layout::Tables::segments`]).
//!
//! A dispatcher's tokenizer looks a text segment up in its own cache, then
//! here; what it has to tokenize, it keeps in both. Response processes
//! store the segments of every answer they read, as the answer will appear
//! in the conversation's next prompt ([`crate::responder`]), so the next
//! turn finds its previous answer already tokenized, whichever dispatcher
//! it reaches. Keys are the tokenizer's (seeded with a fingerprint of its
//! file); a value is the ids as little-endian `u32`s. The log is the same
//! lock-free keyed log as the response cache: a reader only ever gets bytes
//! whose checksum verified, and anything else is a miss.

use std::cell::RefCell;
use std::sync::Arc;

use semlb_tokenizer::SharedSegments;
use shm_layout::{ResponseKey, Segment};

/// The shm segment log as a [`SharedSegments`] store.
#[derive(Debug, Clone)]
pub struct ShmSegmentStore {
    segment: Arc<Segment>,
}

impl ShmSegmentStore {
    /// The store of `segment`.
    pub fn new(segment: Arc<Segment>) -> Self {
        Self { segment }
    }
}

thread_local! {
    /// A reusable buffer for one value's bytes.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl SharedSegments for ShmSegmentStore {
    fn get(&self, key: u128, out: &mut Vec<u32>) -> bool {
        SCRATCH.with_borrow_mut(|buf| {
            let tables = self.segment.tables();
            let Some(bytes) = tables.segments.get_into(ResponseKey(key), buf) else {
                return false;
            };
            if !bytes.len().is_multiple_of(4) {
                return false;
            }
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))),
            );
            true
        })
    }

    fn put(&self, key: u128, ids: &[u32]) {
        SCRATCH.with_borrow_mut(|buf| {
            buf.clear();
            buf.extend(ids.iter().flat_map(|id| id.to_le_bytes()));
            // Too large for the log: the local cache keeps it, nothing else.
            let _ = self.segment.tables().segments.put(ResponseKey(key), buf);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use semlb_tokenizer::Tokenizer;
    use shm_layout::LayoutPlan;

    #[test]
    fn ids_round_trip_and_oversized_values_are_left_out() {
        let segment = Arc::new(Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap()));
        let store = ShmSegmentStore::new(segment.clone());
        let mut out = vec![7];
        assert!(!store.get(1, &mut out));
        store.put(1, &[0, 1, u32::MAX, 151_645]);
        assert!(store.get(1, &mut out));
        assert_eq!(out, [7, 0, 1, u32::MAX, 151_645], "appended");
        let max_ids = segment.tables().segments.max_value() / 4;
        store.put(2, &vec![3; max_ids + 1]);
        assert!(!store.get(2, &mut out));
        // A value of another length than a whole number of ids is a miss.
        segment.tables().segments.put(ResponseKey(3), &[1, 2, 3]).unwrap();
        assert!(!store.get(3, &mut out));
    }

    #[test]
    fn two_processes_share_what_one_tokenized() {
        let segment = Arc::new(Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap()));
        let text = "A line long enough to be a segment of its own.\nAnd a second one, also long enough.";
        let first = Tokenizer::bundled()
            .with_segment_cache(0)
            .with_shared_segments(Arc::new(ShmSegmentStore::new(segment.clone())));
        let second = Tokenizer::bundled()
            .with_segment_cache(1 << 20)
            .with_shared_segments(Arc::new(ShmSegmentStore::new(segment.clone())));
        let ids = first.encode(text);
        assert_eq!(second.encode(text), ids);
        assert_eq!(second.segment_cache_stats().shared_hits, 2);
        assert_eq!(ids, Tokenizer::bundled().encode_uncached(text));
    }
}
