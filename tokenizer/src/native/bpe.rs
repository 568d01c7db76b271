//! Byte-level BPE: one word's bytes merged into token ids exactly as HF's
//! BPE model merges them.
//!
//! HF's rule (`models/bpe/word.rs`): start from one symbol per byte (the
//! byte's character in GPT-2's byte-to-unicode alphabet, looked up in the
//! vocabulary), then repeatedly merge the adjacent pair with the lowest
//! merge rank, the leftmost one among equal ranks, until no adjacent pair
//! has a merge. HF keeps candidate pairs in a heap ordered by (rank,
//! position); [`Bpe::merge`] does the same for long words and, for short
//! ones, scans the pairs (keeping each pair's rank so only the two pairs
//! around a merge are looked up again), which picks the same pair.
//!
//! With `ignore_merges` (Llama 3), a word that is itself a vocabulary token
//! is that token, merges or not.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use hashbrown::HashMap;

/// The byte → character mapping of GPT-2's byte-level alphabet
/// (`bytes_to_unicode`): printable Latin-1 bytes map to themselves, the
/// others to U+0100 upwards in byte order.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            let cp = next;
            next += 1;
            cp
        };
        table[usize::from(b)] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// The bytes of a vocabulary token written in the byte-level alphabet, or
/// `None` if it has a character outside the alphabet.
pub(crate) fn token_bytes(token: &str, char_bytes: &std::collections::HashMap<char, u8>) -> Option<Vec<u8>> {
    token.chars().map(|c| char_bytes.get(&c).copied()).collect()
}

/// What merging a pair gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Merge {
    /// Its position in the merges list (lower merges first).
    rank: u32,
    /// The merged token.
    id: u32,
}

/// Hashes a pair key (two ids) with one multiply: pair keys are dense
/// small integers, not attacker-chosen strings.
#[derive(Debug, Clone, Copy, Default)]
struct PairHasher(u64);

impl std::hash::Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("pair keys are hashed as u64")
    }
    fn write_u64(&mut self, key: u64) {
        self.0 = (key ^ (key >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PairMap = HashMap<u64, Merge, std::hash::BuildHasherDefault<PairHasher>>;

/// Words longer than this (in bytes) are merged with the heap.
const SCAN_MAX: usize = 48;

/// A byte-level BPE model.
#[derive(Debug)]
pub(crate) struct Bpe {
    /// The token of each single byte.
    byte_ids: [u32; 256],
    /// (left, right) → merge.
    merges: PairMap,
    /// With `ignore_merges`: the words that are vocabulary tokens.
    whole_words: Option<HashMap<Box<[u8]>, u32, foldhash::fast::RandomState>>,
}

/// Why a vocabulary and merges list do not make a byte-level BPE model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BpeError {
    /// A byte's character is not in the vocabulary.
    #[error("byte {0:#04x} has no token in the vocabulary (not a byte-level BPE)")]
    MissingByte(u8),
    /// A merge names a token that is not in the vocabulary (HF refuses
    /// such a file too).
    #[error("merge {rank} ({left:?} {right:?}) uses a token that is not in the vocabulary")]
    MergeOutOfVocabulary {
        /// Its rank.
        rank: usize,
        /// Its left part.
        left: String,
        /// Its right part.
        right: String,
    },
}

impl Bpe {
    /// The model of `vocab` (token → id, in the byte-level alphabet) and
    /// `merges` (in rank order).
    pub(crate) fn new(
        vocab: &std::collections::HashMap<String, u32>,
        merges: &[(String, String)],
        ignore_merges: bool,
    ) -> Result<Self, BpeError> {
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        let mut buf = [0u8; 4];
        for (b, c) in chars.iter().enumerate() {
            let id = vocab
                .get(&*c.encode_utf8(&mut buf))
                .ok_or(BpeError::MissingByte(b as u8))?;
            byte_ids[b] = *id;
        }
        let mut map = PairMap::with_capacity_and_hasher(merges.len(), Default::default());
        let mut joined = String::new();
        for (rank, (left, right)) in merges.iter().enumerate() {
            let missing = || BpeError::MergeOutOfVocabulary {
                rank,
                left: left.clone(),
                right: right.clone(),
            };
            let l = *vocab.get(left).ok_or_else(missing)?;
            let r = *vocab.get(right).ok_or_else(missing)?;
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let id = *vocab.get(&joined).ok_or_else(missing)?;
            // A later duplicate wins, as in HF's map.
            map.insert(pair(l, r), Merge { rank: rank as u32, id });
        }
        let whole_words = ignore_merges.then(|| {
            let char_bytes = chars.iter().enumerate().map(|(b, c)| (*c, b as u8)).collect();
            vocab
                .iter()
                .filter_map(|(token, id)| Some((token_bytes(token, &char_bytes)?.into_boxed_slice(), *id)))
                .collect()
        });
        Ok(Self {
            byte_ids,
            merges: map,
            whole_words,
        })
    }

    /// Appends the tokens of `word` (its raw bytes) to `out`.
    pub(crate) fn merge(&self, word: &[u8], out: &mut Vec<u32>) {
        if let Some(whole) = &self.whole_words
            && let Some(id) = whole.get(word)
        {
            out.push(*id);
            return;
        }
        match word.len() {
            0 => {}
            1 => out.push(self.byte_ids[usize::from(word[0])]),
            n if n <= SCAN_MAX => self.merge_by_scan(word, out),
            _ => self.merge_by_heap(word, out),
        }
    }

    fn lookup(&self, left: u32, right: u32) -> Option<Merge> {
        self.merges.get(&pair(left, right)).copied()
    }

    /// Short words: scan the pairs' ranks for the lowest (leftmost on ties).
    fn merge_by_scan(&self, word: &[u8], out: &mut Vec<u32>) {
        let mut symbols = [0u32; SCAN_MAX];
        let mut ranks = [None::<Merge>; SCAN_MAX];
        let mut n = word.len();
        for (s, b) in symbols.iter_mut().zip(word) {
            *s = self.byte_ids[usize::from(*b)];
        }
        for i in 0..n - 1 {
            ranks[i] = self.lookup(symbols[i], symbols[i + 1]);
        }
        loop {
            let mut best: Option<(usize, Merge)> = None;
            for (i, m) in ranks[..n - 1].iter().enumerate() {
                if let Some(m) = m
                    && best.is_none_or(|(_, b)| m.rank < b.rank)
                {
                    best = Some((i, *m));
                }
            }
            let Some((i, m)) = best else { break };
            symbols[i] = m.id;
            symbols.copy_within(i + 2..n, i + 1);
            ranks.copy_within(i + 2..n, i + 1);
            n -= 1;
            if i > 0 {
                ranks[i - 1] = self.lookup(symbols[i - 1], symbols[i]);
            }
            if i + 1 < n {
                ranks[i] = self.lookup(symbols[i], symbols[i + 1]);
            } else {
                ranks[i] = None;
            }
        }
        out.extend_from_slice(&symbols[..n]);
    }

    /// Long words: HF's heap of (rank, position) candidates over a linked
    /// list of symbols, stale candidates skipped when popped.
    fn merge_by_heap(&self, word: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        #[derive(Clone, Copy)]
        struct Symbol {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        let n = word.len();
        let mut symbols: Vec<Symbol> = word
            .iter()
            .enumerate()
            .map(|(i, b)| Symbol {
                id: self.byte_ids[usize::from(*b)],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        // (rank, position, merged id), lowest rank then lowest position first.
        let mut heap: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some(m) = self.lookup(symbols[i].id, symbols[i + 1].id) {
                heap.push(Reverse((m.rank, i, m.id)));
            }
        }
        while let Some(Reverse((_, pos, id))) = heap.pop() {
            let left = symbols[pos];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next];
            // A stale candidate: the pair at `pos` has changed since.
            if self.lookup(left.id, right.id).is_none_or(|m| m.id != id) {
                continue;
            }
            symbols[pos].id = id;
            symbols[pos].next = right.next;
            symbols[left.next].alive = false;
            if right.next != NONE {
                symbols[right.next].prev = pos;
            }
            let current = symbols[pos];
            if current.prev != NONE
                && let Some(m) = self.lookup(symbols[current.prev].id, current.id)
            {
                heap.push(Reverse((m.rank, current.prev, m.id)));
            }
            if current.next != NONE
                && let Some(m) = self.lookup(current.id, symbols[current.next].id)
            {
                heap.push(Reverse((m.rank, pos, m.id)));
            }
        }
        out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }
}

/// The key of a pair of ids.
#[inline]
fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small vocabulary over the bytes plus merged tokens.
    fn toy(merges: &[(&str, &str)], ignore_merges: bool) -> Bpe {
        let mut vocab: std::collections::HashMap<String, u32> = byte_chars()
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let mut owned = Vec::new();
        for (l, r) in merges {
            let joined = format!("{l}{r}");
            let next = vocab.len() as u32;
            vocab.entry(joined).or_insert(next);
            owned.push((l.to_string(), r.to_string()));
        }
        Bpe::new(&vocab, &owned, ignore_merges).unwrap()
    }

    fn ids(bpe: &Bpe, word: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.merge(word.as_bytes(), &mut out);
        out
    }

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let chars = byte_chars();
        assert_eq!(chars[b'a' as usize], 'a');
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[0], 'Ā');
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn lowest_rank_first_leftmost_on_ties() {
        // "aaa": (a,a) merges the left pair first → [aa, a].
        let bpe = toy(&[("a", "a")], false);
        assert_eq!(ids(&bpe, "aaa"), [256, u32::from(b'a')]);
        // Rank decides, not position: (b,c) before (a,b).
        let bpe = toy(&[("b", "c"), ("a", "b")], false);
        assert_eq!(ids(&bpe, "abc"), [u32::from(b'a'), 256]);
        // Without a merge for (a, bc), "abc" stays two tokens even though
        // "abc" could be reached another way.
        let bpe = toy(&[("b", "c"), ("a", "b"), ("ab", "c")], false);
        assert_eq!(ids(&bpe, "abc"), [u32::from(b'a'), 256]);
        // ignore_merges: a whole-word token wins.
        let bpe = toy(&[("b", "c"), ("a", "b"), ("ab", "c")], true);
        assert_eq!(ids(&bpe, "abc"), [258]);
    }

    #[test]
    fn bad_models_are_refused() {
        let vocab: std::collections::HashMap<String, u32> = [("a".to_string(), 0)].into();
        assert!(matches!(Bpe::new(&vocab, &[], false), Err(BpeError::MissingByte(0))));
        let mut vocab: std::collections::HashMap<String, u32> = byte_chars()
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        vocab.insert("zz".into(), 999);
        let merges = [("z".to_string(), "q".to_string())];
        assert!(matches!(
            Bpe::new(&vocab, &merges, false),
            Err(BpeError::MergeOutOfVocabulary { rank: 0, .. })
        ));
    }

    proptest! {
        /// The scan and the heap pick the same merges.
        #[test]
        fn scan_and_heap_agree(word in prop::collection::vec(prop::sample::select(b"abcab ".to_vec()), 2..SCAN_MAX)) {
            let bpe = toy(&[("a", "b"), ("b", "c"), ("ab", "c"), ("c", "a"), ("a", "a"), ("ca", "b"), ("Ġ", "a"), ("ab", "ab")], false);
            let mut scan = Vec::new();
            bpe.merge_by_scan(&word, &mut scan);
            let mut heap = Vec::new();
            bpe.merge_by_heap(&word, &mut heap);
            prop_assert_eq!(scan, heap);
        }
    }
}
