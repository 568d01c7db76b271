//! The native engine: byte-level BPE that gives exactly HF `tokenizers`'
//! ids, an order of magnitude faster.
//!
//! HF's pipeline for `encode(text, add_special_tokens = false)`, and where
//! each step lives here:
//!
//! 1. added tokens matched on the raw text ([`added`], first pass);
//! 2. each piece between them normalized ([`normalize`]);
//! 3. added tokens matched on the normalized pieces ([`added`], second pass);
//! 4. each remaining piece cut into words by the pre-tokenizer regex
//!    ([`pretokenize`], with Oniguruma's character classes from
//!    [`unicode_classes`]);
//! 5. each word's bytes merged by the BPE model ([`bpe`]).
//!
//! The engine adds two caches (see [`Caches`]): a *word cache* (a word's
//! ids; HF has one too) and a *segment cache*: the ids of a whole piece of
//! text, so that text seen before (the earlier turns of a conversation, a
//! shared system prompt) is not tokenized again. Steps 2–5 are a function
//! of the piece's bytes alone, so a piece's ids can be reused wherever the
//! same bytes are a piece again. Pieces are the text between the added
//! tokens of step 1 (a ChatML prompt such as Qwen's is cut at every
//! `<|im_start|>` and `<|im_end|>`, so each message is a piece), further
//! cut after a newline where that provably changes no word
//! ([`pretokenize::Dialect::cut_after_newline_is_exact`]; NFC cannot
//! compose across a newline, and the cut is not made when a second-pass
//! added token could span it), which also serves templates without special
//! tokens between messages.
//!
//! [`spec`] decides which `tokenizer.json` files this engine takes.

pub(crate) mod added;
pub(crate) mod bpe;
pub(crate) mod normalize;
pub(crate) mod pretokenize;
pub(crate) mod spec;
pub(crate) mod unicode_classes;
pub(crate) mod word_cache;

use std::hash::BuildHasherDefault;

use crate::cache::{Cost, GenerationalMap};
use added::{AddedVocabulary, Piece};
use bpe::Bpe;
use normalize::Normalizer;
use pretokenize::Dialect;
use spec::NativeSpec;
use word_cache::{WordCache, WordIds, WordKey};

use crate::SharedSegments;
use unicode_classes::{SPACE, class_of};

/// Pieces shorter than this are tokenized without the segment cache (a
/// lookup costs about as much as tokenizing them).
const SEGMENT_MIN_BYTES: usize = 24;

/// Words longer than this are not kept in the word cache (they rarely
/// repeat, and the segment cache holds the text they are part of).
const WORD_CACHE_MAX_BYTES: usize = 64;

/// Bytes of the word cache.
const WORD_CACHE_BYTES: usize = 8 << 20;

/// A loaded native tokenizer.
#[derive(Debug)]
pub(crate) struct NativeTokenizer {
    added: AddedVocabulary,
    normalizer: Normalizer,
    dialect: Dialect,
    bpe: Bpe,
    /// Each id's bytes as HF's ByteLevel decoder writes them.
    decode_table: Vec<Option<Box<[u8]>>>,
    /// Ids, added tokens included.
    vocab_size: usize,
    /// Whether pieces may be cut after newlines.
    cut_lines: bool,
    /// Seeds segment keys: a hash of the tokenizer file.
    fingerprint: u64,
}

/// Why a tokenizer.json that looked native cannot be built (HF refuses it
/// too, or it is not byte-level after all).
pub(crate) use bpe::BpeError;

impl NativeTokenizer {
    /// The engine of `spec`.
    pub(crate) fn new(spec: NativeSpec, fingerprint: u64) -> Result<Self, BpeError> {
        let bpe = Bpe::new(&spec.vocab, &spec.merges, spec.ignore_merges)?;
        let normalizer = spec.normalizer;
        let added = AddedVocabulary::new(
            &spec.added,
            |c| spec.vocab.get(c).copied(),
            spec.vocab.len(),
            |c| normalizer.apply(c).into_owned(),
        );
        // HF's ByteLevel decoder: a token's characters mapped back to bytes
        // when all are in the byte alphabet, else its UTF-8 as it is; added
        // tokens are decoded from their content.
        let chars = bpe::byte_chars();
        let char_bytes: std::collections::HashMap<char, u8> =
            chars.iter().enumerate().map(|(b, c)| (*c, b as u8)).collect();
        let decoded = |token: &str| -> Box<[u8]> {
            bpe::token_bytes(token, &char_bytes)
                .unwrap_or_else(|| token.as_bytes().to_vec())
                .into_boxed_slice()
        };
        let max_id = spec
            .vocab
            .values()
            .copied()
            .chain(added.contents().map(|(_, id)| id))
            .max()
            .unwrap_or(0);
        let mut decode_table = vec![None; max_id as usize + 1];
        for (token, id) in &spec.vocab {
            decode_table[*id as usize] = Some(decoded(token));
        }
        for (content, id) in added.contents() {
            decode_table[id as usize] = Some(decoded(content));
        }
        // HF counts distinct contents of the vocabulary and added tokens.
        let vocab_size = spec.vocab.len() + added.contents().filter(|(c, _)| !spec.vocab.contains_key(*c)).count();
        let cut_lines = !added.normalized_spans_newlines();
        Ok(Self {
            vocab_size,
            added,
            normalizer,
            dialect: spec.dialect,
            bpe,
            decode_table,
            cut_lines,
            fingerprint,
        })
    }

    /// Ids, added tokens included.
    pub(crate) fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// HF's `decode(ids, skip_special_tokens = false)` with a ByteLevel
    /// decoder: unknown ids are left out, invalid UTF-8 becomes U+FFFD.
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for id in ids {
            if let Some(Some(b)) = self.decode_table.get(*id as usize) {
                bytes.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Appends the ids of `text` to `out`, using `caches` and the `shared`
    /// segment store if given, its segments keyed apart by `salt` (0: the
    /// common keys).
    pub(crate) fn encode(
        &self,
        text: &str,
        mut caches: Option<&mut Caches>,
        shared: Option<&dyn SharedSegments>,
        salt: u64,
        out: &mut Vec<u32>,
    ) {
        self.added.split_raw(text, |piece| match piece {
            Piece::Added(id, _) => out.push(id),
            Piece::Text(text) => self.encode_piece(text, caches.as_deref_mut(), shared, salt, out),
        });
    }

    /// The key a segment's ids are kept under: its XXH3-128 seeded with
    /// the tokenizer's fingerprint, so tokenizers never share entries.
    pub(crate) fn segment_key(&self, segment: &str) -> u128 {
        self.salted_segment_key(segment, 0)
    }

    /// [`segment_key`](Self::segment_key) under `salt` (0: none): the
    /// entries of one salt are never found under another.
    fn salted_segment_key(&self, segment: &str, salt: u64) -> u128 {
        let seed = match salt {
            0 => self.fingerprint,
            salt => xxhash_rust::xxh3::xxh3_64_with_seed(&salt.to_le_bytes(), self.fingerprint),
        };
        xxhash_rust::xxh3::xxh3_128_with_seed(segment.as_bytes(), seed)
    }

    /// Calls `segment` with each segment of `text`: an added token, or a
    /// piece of text the segment cache keeps on its own.
    pub(crate) fn segments<'a>(&self, text: &'a str, mut segment: impl FnMut(Piece<'a>)) {
        self.added.split_raw(text, |piece| match piece {
            Piece::Added(id, text) => segment(Piece::Added(id, text)),
            Piece::Text(text) => self.chunks(text, |chunk| segment(Piece::Text(chunk))),
        });
    }

    /// A piece between first-pass added tokens, segment by segment: from
    /// the local segment cache, else from the shared store, else tokenized
    /// (and then kept in both).
    fn encode_piece(
        &self,
        text: &str,
        mut caches: Option<&mut Caches>,
        shared: Option<&dyn SharedSegments>,
        salt: u64,
        out: &mut Vec<u32>,
    ) {
        let local = caches.as_ref().is_some_and(|c| c.segments.is_some());
        if !local && shared.is_none() {
            return self.encode_uncached(text, caches.map(|c| &mut c.words), out);
        }
        self.chunks(text, |chunk| {
            if chunk.len() < SEGMENT_MIN_BYTES {
                return self.encode_uncached(chunk, caches.as_deref_mut().map(|c| &mut c.words), out);
            }
            let key = self.salted_segment_key(chunk, salt);
            if let Some(c) = caches.as_deref_mut()
                && let Some(ids) = c.segments.as_mut().and_then(|s| s.get(s.hash(&key), &key))
            {
                out.extend_from_slice(&ids.0);
                c.hits += 1;
                return;
            }
            let start = out.len();
            if let Some(store) = shared {
                if store.get(key, out) {
                    if let Some(c) = caches.as_deref_mut() {
                        c.shared_hits += 1;
                        if let Some(segments) = c.segments.as_mut() {
                            segments.insert(segments.hash(&key), key, Ids(out[start..].into()));
                        }
                    }
                    return;
                }
                out.truncate(start);
            }
            self.encode_uncached(chunk, caches.as_deref_mut().map(|c| &mut c.words), out);
            if let Some(c) = caches.as_deref_mut() {
                c.misses += 1;
                if let Some(segments) = c.segments.as_mut() {
                    segments.insert(segments.hash(&key), key, Ids(out[start..].into()));
                }
            }
            if let Some(store) = shared {
                store.put(key, &out[start..]);
            }
        });
    }

    /// Calls `chunk` with the parts of a first-pass piece that may be
    /// tokenized on their own (see the module docs): cut at every newline
    /// where that is exact. Where a cut is made depends only on the
    /// characters around it, so the same text is cut the same way wherever
    /// it appears, and a conversation's earlier turns come back as the same
    /// segments in its next prompt.
    fn chunks<'a>(&self, text: &'a str, mut chunk: impl FnMut(&'a str)) {
        if !self.cut_lines {
            return chunk(text);
        }
        let bytes = text.as_bytes();
        let mut start = 0;
        for newline in memchr::memchr_iter(b'\n', bytes) {
            let at = newline + 1;
            if at >= bytes.len() {
                break;
            }
            let Some(next) = text[at..].chars().next() else { break };
            if class_of(next) & SPACE != 0 {
                continue;
            }
            let before = text[start..newline].chars().next_back();
            if self.dialect.cut_after_newline_is_exact(before) {
                chunk(&text[start..at]);
                start = at;
            }
        }
        chunk(&text[start..]);
    }

    /// Steps 2–5 on `text`, with the word cache if given.
    fn encode_uncached(&self, text: &str, mut words: Option<&mut WordCache>, out: &mut Vec<u32>) {
        let normalized = self.normalizer.apply(text);
        self.added.split_normalized(&normalized, |piece| match piece {
            Piece::Added(id, _) => out.push(id),
            Piece::Text(text) => pretokenize::words(self.dialect, text, |word| {
                self.encode_word(word.as_bytes(), words.as_deref_mut(), out)
            }),
        });
    }

    fn encode_word(&self, word: &[u8], words: Option<&mut WordCache>, out: &mut Vec<u32>) {
        let Some(cache) = words.filter(|_| word.len() > 1 && word.len() <= WORD_CACHE_MAX_BYTES) else {
            return self.bpe.merge(word, out);
        };
        let hash = cache.hash(word);
        if let Some(ids) = cache.get(hash, word) {
            out.extend_from_slice(ids.as_slice());
            return;
        }
        let start = out.len();
        self.bpe.merge(word, out);
        cache.insert(hash, WordKey::new(word), WordIds::new(&out[start..]));
    }
}

/// Token ids in a cache.
#[derive(Debug)]
pub(crate) struct Ids(Box<[u32]>);

impl Cost for Ids {
    fn cost(&self) -> usize {
        // The ids, the 16-byte digest key and the map's bucket (segment
        // cache; the word cache has its own values).
        self.0.len() * 4 + 48
    }
}

/// Hashes keys that are already uniform hashes (segment digests).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DigestHasher(u64);

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, key: u128) {
        self.0 = key as u64;
    }
}

/// The segment cache: XXH3-128 of a segment's bytes → its ids.
pub(crate) type SegmentCache = GenerationalMap<u128, Ids, BuildHasherDefault<DigestHasher>>;

/// One tokenizer's caches (see the module docs).
#[derive(Debug)]
pub(crate) struct Caches {
    pub(crate) words: WordCache,
    pub(crate) segments: Option<SegmentCache>,
    /// Segments answered from the cache.
    pub(crate) hits: u64,
    /// Segments answered from the shared store.
    pub(crate) shared_hits: u64,
    /// Segments tokenized.
    pub(crate) misses: u64,
}

impl Caches {
    /// Caches with a segment cache of `segment_bytes` (0: none).
    pub(crate) fn new(segment_bytes: usize) -> Self {
        Self {
            words: GenerationalMap::new(WORD_CACHE_BYTES, foldhash::fast::RandomState::default()),
            segments: (segment_bytes > 0).then(|| GenerationalMap::new(segment_bytes, Default::default())),
            hits: 0,
            shared_hits: 0,
            misses: 0,
        }
    }
}
