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
#[derive(Debug)]
pub(crate) enum WordKey {
    /// Up to [`INLINE_WORD_BYTES`] bytes.
    Inline { len: u8, bytes: [u8; INLINE_WORD_BYTES] },
    /// Longer.
    Boxed(Box<[u8]>),
}

impl WordKey {
    /// The key of `word`.
    pub(crate) fn new(word: &[u8]) -> Self {
        if word.len() <= INLINE_WORD_BYTES {
            let mut bytes = [0; INLINE_WORD_BYTES];
            bytes[..word.len()].copy_from_slice(word);
            WordKey::Inline {
                len: word.len() as u8,
                bytes,
            }
        } else {
            WordKey::Boxed(word.into())
        }
    }
}

impl CacheKey for WordKey {
    type Borrowed = [u8];
    fn borrowed(&self) -> &[u8] {
        match self {
            WordKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            WordKey::Boxed(b) => b,
        }
    }
}

/// A word's ids, inline when few.
#[derive(Debug)]
pub(crate) enum WordIds {
    /// Up to [`INLINE_IDS`] ids.
    Inline { len: u8, ids: [u32; INLINE_IDS] },
    /// More.
    Boxed(Box<[u32]>),
}

impl WordIds {
    /// The value for `ids`.
    pub(crate) fn new(ids: &[u32]) -> Self {
        if ids.len() <= INLINE_IDS {
            let mut inline = [0; INLINE_IDS];
            inline[..ids.len()].copy_from_slice(ids);
            WordIds::Inline {
                len: ids.len() as u8,
                ids: inline,
            }
        } else {
            WordIds::Boxed(ids.into())
        }
    }

    /// The ids.
    pub(crate) fn ids(&self) -> &[u32] {
        match self {
            WordIds::Inline { len, ids } => &ids[..usize::from(*len)],
            WordIds::Boxed(b) => b,
        }
    }
}

impl Cost for WordIds {
    fn cost(&self) -> usize {
        // The bucket (key and value inline, control byte, load-factor
        // slack) and what is boxed. A boxed key is over 22 bytes and at
        // most the cache's 64-byte limit: counted as 64.
        let bucket = 2 * std::mem::size_of::<(WordKey, WordIds)>();
        match self {
            WordIds::Inline { .. } => bucket,
            WordIds::Boxed(b) => bucket + b.len() * 4 + 64,
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
        assert!(matches!(WordKey::new(&[b'x'; 22]), WordKey::Inline { .. }));
        assert!(matches!(WordKey::new(&[b'x'; 23]), WordKey::Boxed(_)));
        for ids in [&[][..], &[1], &[1, 2, 3], &[1, 2, 3, 4], &[7; 40]] {
            assert_eq!(WordIds::new(ids).ids(), ids);
        }
        assert!(matches!(WordIds::new(&[1, 2, 3]), WordIds::Inline { .. }));
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
            cache.get(cache.hash(word), word).map(WordIds::ids),
            Some(&[0, 1, 2, 3, 4][..])
        );
        let word = "long".repeat(10);
        assert_eq!(
            cache
                .get(cache.hash(word.as_bytes()), word.as_bytes())
                .map(|v| v.ids().len()),
            Some(7)
        );
        assert!(cache.get(cache.hash(b" fox"), b" fox").is_none());
    }
}
