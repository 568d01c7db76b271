//! The word cache: a pre-tokenized word's bytes → its ids, held inline.
//!
//! Nearly every word is at most [`INLINE_WORD_BYTES`] bytes and merges into
//! at most [`INLINE_IDS`] tokens, so both are kept in the table's bucket: a
//! hit reads one bucket and follows no pointer (the cache is read once per
//! word of every prompt, and outside the CPU's caches each pointer followed
//! is a memory round trip). Longer words and id lists are boxed.

use crate::cache::{CacheKey, Cost, GenerationalMap};

/// Longest word kept inline.
const INLINE_WORD_BYTES: usize = 22;

/// Most ids kept inline.
const INLINE_IDS: usize = 3;

/// The word cache (see the module docs).
pub(crate) type WordCache = GenerationalMap<WordKey, WordIds, foldhash::fast::RandomState>;

/// A word's bytes, inline when short.
pub(crate) type WordKey = InlineSlice<u8, INLINE_WORD_BYTES>;

/// A word's ids, inline when few.
pub(crate) type WordIds = InlineSlice<u32, INLINE_IDS>;

/// A slice of up to `N` items held inline, boxed when longer.
#[derive(Debug)]
pub(crate) enum InlineSlice<T, const N: usize> {
    /// Up to `N` items.
    Inline { len: u8, items: [T; N] },
    /// More.
    Boxed(Box<[T]>),
}

impl<T: Copy + Default, const N: usize> InlineSlice<T, N> {
    /// A copy of `items`.
    pub(crate) fn new(items: &[T]) -> Self {
        if items.len() <= N {
            let mut inline = [T::default(); N];
            inline[..items.len()].copy_from_slice(items);
            InlineSlice::Inline {
                len: items.len() as u8,
                items: inline,
            }
        } else {
            InlineSlice::Boxed(items.into())
        }
    }

    /// The items.
    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            InlineSlice::Inline { len, items } => &items[..usize::from(*len)],
            InlineSlice::Boxed(b) => b,
        }
    }
}

impl CacheKey for WordKey {
    type Borrowed = [u8];
    fn borrowed(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Cost for WordIds {
    fn cost(&self) -> usize {
        // The bucket (key and value inline, control byte, load-factor
        // slack) and what is boxed. A boxed key is over 22 bytes and at
        // most the cache's 64-byte limit: counted as 64.
        let bucket = 2 * std::mem::size_of::<(WordKey, WordIds)>();
        match self {
            InlineSlice::Inline { .. } => bucket,
            InlineSlice::Boxed(b) => bucket + b.len() * 4 + 64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_ids_round_trip_inline_and_boxed() {
        for word in [&b""[..], b"a", b" hello", &[b'x'; 22], &[b'y'; 23], &[b'z'; 64]] {
            assert_eq!(WordKey::new(word).borrowed(), word);
        }
        assert!(matches!(WordKey::new(&[b'x'; 22]), InlineSlice::Inline { .. }));
        assert!(matches!(WordKey::new(&[b'x'; 23]), InlineSlice::Boxed(_)));
        for ids in [&[][..], &[1], &[1, 2, 3], &[1, 2, 3, 4], &[7; 40]] {
            assert_eq!(WordIds::new(ids).as_slice(), ids);
        }
        assert!(matches!(WordIds::new(&[1, 2, 3]), InlineSlice::Inline { .. }));
    }

    #[test]
    fn entries_are_small() {
        assert!(std::mem::size_of::<(WordKey, WordIds)>() <= 48);
    }

    #[test]
    fn a_cache_finds_what_it_holds() {
        let mut cache = WordCache::new(1 << 20, Default::default());
        for (i, word) in ["the", " quick", " brown", &"long".repeat(10)].iter().enumerate() {
            let ids: Vec<u32> = (0..=i as u32 * 2).collect();
            cache.insert(
                cache.hash(word.as_bytes()),
                WordKey::new(word.as_bytes()),
                WordIds::new(&ids),
            );
        }
        let word = " brown".as_bytes();
        assert_eq!(
            cache.get(cache.hash(word), word).map(WordIds::as_slice),
            Some(&[0, 1, 2, 3, 4][..])
        );
        let word = "long".repeat(10);
        assert_eq!(
            cache
                .get(cache.hash(word.as_bytes()), word.as_bytes())
                .map(|v| v.as_slice().len()),
            Some(7)
        );
        assert!(cache.get(cache.hash(b" fox"), b" fox").is_none());
    }
}
