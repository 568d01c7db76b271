//! The text form of the token-id workloads (`--prompt-form text`, the
//! replay's default): the same requests, with a `prompt` string the
//! engines tokenize into the token-id form's prompt length and shared
//! prefixes (exactly, for the synthetic pieces; see [`Fidelity`]).
//!
//! Real clients send text, and some routers take nothing else (`smg` and
//! `sglang-router` refuse a token-id `prompt`), so every row of a replay
//! is sent the text form unless `--prompt-form tokens` is given.
//!
//! # Chunks
//!
//! A token-id prompt is made of pieces of synthetic token ids (the
//! Mooncake trace's 512-token blocks, `hot-prefix`'s system prompts, user
//! parts, answers and tool results). Each piece of `n` tokens becomes a
//! *chunk*: the text of `n` items drawn from a generator seeded by the
//! piece ([`TextGen::chunk`]), where an item is one word or one line break:
//! lines of 6–20 words, each ended by `"\n"`, the last line taking what is
//! left, so that a chunk of two tokens or more starts with a word and ends
//! with `"\n"`. The words are those of [`WORDS`] that the engines'
//! tokenizer turns into exactly one token both at a line's start (`word`)
//! and after a space (` word`) ([`TextGen::new`]); a line break after a
//! word and a word after a line break are split apart by the pre-tokenizer
//! of byte-level BPE tokenizers (GPT-2's, phi-2's and Qwen3's), and BPE
//! merges never cross that split, so a chunk is `n` tokens, and chunks put
//! end to end tokenize to their tokens put end to end: a prompt sharing its
//! first pieces with another shares their tokens exactly. A prompt cut in
//! the middle of a piece (the Mooncake trace's last, partial block) ends
//! with the chunk's first items ([`TextGen::chunk_prefix`]), whose tokens
//! are the first tokens of the whole chunk.
//!
//! That reasoning is checked, not assumed: [`Fidelity::measure`] tokenizes
//! every text prompt with the engines' tokenizer and compares it with the
//! token-id form (length, and the 16-token blocks each prompt shares with
//! an earlier one); the replay prints it and puts it in the JSON.
//!
//! The engines of the replay (`semlb __sim` without `--tokenizer`) and its
//! gateway tokenize with the bundled phi-2 tokenizer, so the chunks are
//! built for it ([`engine_tokenizer`]).

use std::collections::HashSet;
use std::sync::Arc;

use semlb_test_support::{Rng, mix};
use semlb_tokenizer::Tokenizer;

use super::Request;

/// The words chunks are made of, before [`TextGen::new`] keeps those that
/// are one token each.
pub const WORDS: [&str; 158] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "out", "up", "into", "than", "them", "some", "could", "time", "these", "two", "may", "then", "do", "first", "any",
    "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did", "many",
    "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because",
    "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still",
    "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day",
    "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since",
    "against", "go", "came", "right", "used", "take", "three", "cache", "query", "table", "server", "engine", "token",
    "block", "route", "index", "stream", "result", "field", "record", "buffer", "window", "policy", "request",
    "answer", "session", "prefix",
];

/// The tokenizer the replay's engines and gateway tokenize text with: the
/// bundled phi-2 one (`semlb __sim` and `semlb serve` are started without
/// a tokenizer of their own).
pub fn engine_tokenizer() -> Tokenizer {
    Tokenizer::bundled()
}

/// Words per line of a chunk.
const LINE_WORDS: (u64, u64) = (6, 20);

/// A prompt as text: pieces sent end to end (shared between the requests
/// of a session or the prompts of a trace, so that a workload holds each
/// piece once).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TextPrompt(pub Vec<Arc<str>>);

impl TextPrompt {
    /// The whole text.
    pub fn text(&self) -> String {
        let mut s = String::with_capacity(self.len());
        for p in &self.0 {
            s.push_str(p);
        }
        s
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.iter().map(|p| p.len()).sum()
    }

    /// True when it has no text.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// It, then `piece`.
    pub fn push(&mut self, piece: impl Into<Arc<str>>) {
        self.0.push(piece.into());
    }
}

/// Builds chunks: text of a given number of tokens for one tokenizer,
/// deterministic in a seed.
#[derive(Debug, Clone)]
pub struct TextGen {
    /// The words of [`WORDS`] that are one token at a line's start and
    /// after a space.
    words: Vec<&'static str>,
}

impl TextGen {
    /// The generator for `tokenizer`: keeps the words of [`WORDS`] it turns
    /// into one token both as `word` and as ` word`, and checks that a line
    /// break is one token.
    ///
    /// # Panics
    ///
    /// When fewer than 32 words are left or `"\n"` is not one token: a
    /// tokenizer unlike byte-level BPE, for which chunks cannot be counted
    /// out word by word.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let words: Vec<&'static str> = WORDS
            .iter()
            .copied()
            .filter(|w| tokenizer.encode(w).len() == 1 && tokenizer.encode(&format!(" {w}")).len() == 1)
            .collect();
        assert!(
            words.len() >= 32 && tokenizer.encode("\n").len() == 1,
            "the tokenizer ({} single-token words of {}) cannot count text out word by word",
            words.len(),
            WORDS.len()
        );
        Self { words }
    }

    /// The words it draws from.
    pub fn words(&self) -> &[&'static str] {
        &self.words
    }

    /// The chunk of `tokens` tokens of `seed`: lines of 6–20 words, each
    /// ended by a line break (one token each). Two tokens or more: it
    /// starts with a word and ends with `"\n"`; one token: one word; none:
    /// empty.
    pub fn chunk(&self, seed: u64, tokens: usize) -> String {
        self.chunk_prefix(seed, tokens, tokens)
    }

    /// The first `take` tokens (items) of [`chunk`](Self::chunk)`(seed,
    /// tokens)`: a prefix of its text, whose tokens are its first `take`
    /// tokens.
    pub fn chunk_prefix(&self, seed: u64, tokens: usize, take: usize) -> String {
        let take = take.min(tokens);
        let mut out = String::with_capacity(take * 7);
        if tokens == 1 {
            if take == 1 {
                out.push_str(self.word(&mut Rng::from_seed(mix(seed ^ 0x7E47))));
            }
            return out;
        }
        let mut rng = Rng::from_seed(mix(seed ^ 0x7E47));
        let (mut remaining, mut emitted) = (tokens, 0);
        while remaining > 0 && emitted < take {
            let mut line = (LINE_WORDS.0 + rng.below(LINE_WORDS.1 - LINE_WORDS.0 + 1)) as usize;
            // The last line takes the rest rather than leave a short one.
            if remaining <= line + 1 + LINE_WORDS.0 as usize {
                line = remaining - 1;
            }
            for i in 0..line {
                if emitted == take {
                    return out;
                }
                if i > 0 {
                    out.push(' ');
                }
                out.push_str(self.word(&mut rng));
                emitted += 1;
            }
            if emitted == take {
                return out;
            }
            out.push('\n');
            emitted += 1;
            remaining -= line + 1;
        }
        out
    }

    fn word(&self, rng: &mut Rng) -> &'static str {
        self.words[rng.index(self.words.len())]
    }
}

/// How close the text form of a workload comes to its token-id form,
/// measured with the engines' tokenizer ([`Fidelity::measure`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fidelity {
    /// Requests compared (those with a text prompt).
    pub requests: usize,
    /// Σ prompt tokens of the token-id form.
    pub id_tokens: u64,
    /// Σ tokens of the text prompts.
    pub text_tokens: u64,
    /// Σ |text tokens − token ids| per request.
    pub abs_error: u64,
    /// The largest |text tokens − token ids| of a request.
    pub max_abs_error: u64,
    /// Requests whose text is exactly as many tokens as their ids.
    pub exact: usize,
    /// Σ tokens of the leading 16-token blocks each token-id prompt shares
    /// with an earlier one (what a prefix cache could reuse).
    pub shared_ids: u64,
    /// The same for the text prompts' tokens.
    pub shared_text: u64,
}

/// The block size the shared prefixes are counted in (the engines' KV
/// block, and the gateway's).
pub const FIDELITY_BLOCK: usize = 16;

impl Fidelity {
    /// Tokenizes every text prompt of `requests` (in arrival order) with
    /// `tokenizer` and compares it with its token ids.
    pub fn measure(requests: &[Request], tokenizer: &Tokenizer) -> Self {
        let mut f = Fidelity::default();
        let (mut seen_ids, mut seen_text) = (HashSet::new(), HashSet::new());
        let mut tokens = Vec::new();
        for r in requests {
            let Some(text) = &r.text else { continue };
            tokens.clear();
            // The whole prompt at once: the pieces' joins are what is
            // measured.
            tokenizer.encode_into(&text.text(), &mut tokens);
            let (a, b) = (r.prompt.len() as u64, tokens.len() as u64);
            let err = a.abs_diff(b);
            f.requests += 1;
            f.id_tokens += a;
            f.text_tokens += b;
            f.abs_error += err;
            f.max_abs_error = f.max_abs_error.max(err);
            f.exact += usize::from(err == 0);
            f.shared_ids += shared_blocks(&r.prompt, &mut seen_ids);
            f.shared_text += shared_blocks(&tokens, &mut seen_text);
        }
        f
    }

    /// The share of the token-id form's shared-prefix tokens the text form
    /// keeps (`None` when the token-id form shares none).
    pub fn shared_kept(&self) -> Option<f64> {
        (self.shared_ids > 0).then(|| self.shared_text as f64 / self.shared_ids as f64)
    }

    /// Mean |error| per request, as a share of the mean prompt.
    pub fn relative_error(&self) -> f64 {
        self.abs_error as f64 / (self.id_tokens as f64).max(1.0)
    }

    /// One line saying it.
    pub fn describe(&self) -> String {
        format!(
            "{} text prompts: {} tokens against {} token ids (|error| {:.3} % of the tokens, at most {} in a \
             prompt; {} prompts exact); shared-prefix tokens (16-token blocks shared with an earlier prompt) kept: {}",
            self.requests,
            self.text_tokens,
            self.id_tokens,
            100.0 * self.relative_error(),
            self.max_abs_error,
            self.exact,
            self.shared_kept().map_or_else(
                || "none to keep".to_owned(),
                |k| format!("{:.2} % ({} of {})", 100.0 * k, self.shared_text, self.shared_ids)
            ),
        )
    }

    /// Its JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "requests": self.requests,
            "id_tokens": self.id_tokens,
            "text_tokens": self.text_tokens,
            "abs_error_tokens": self.abs_error,
            "relative_abs_error": self.relative_error(),
            "max_abs_error_tokens": self.max_abs_error,
            "exact_prompts": self.exact,
            "shared_prefix_block_tokens": FIDELITY_BLOCK,
            "shared_prefix_tokens_ids": self.shared_ids,
            "shared_prefix_tokens_text": self.shared_text,
            "shared_prefix_kept": self.shared_kept(),
        })
    }
}

/// Tokens of the leading [`FIDELITY_BLOCK`]-token blocks of `tokens` whose
/// chained hashes are in `seen`; then adds all of its blocks' hashes.
fn shared_blocks(tokens: &[u32], seen: &mut HashSet<u64>) -> u64 {
    let mut hash = 0u64;
    let mut shared = 0;
    let mut matching = true;
    for block in tokens.chunks_exact(FIDELITY_BLOCK) {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        hash = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, hash);
        if matching && seen.contains(&hash) {
            shared += FIDELITY_BLOCK as u64;
        } else {
            matching = false;
            seen.insert(hash);
        }
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_gen() -> (TextGen, Tokenizer) {
        let tok = Tokenizer::bundled();
        (TextGen::new(&tok), tok)
    }

    #[test]
    fn the_bundled_tokenizer_keeps_most_words() {
        let (g, tok) = text_gen();
        assert!(g.words().len() >= 120, "{}", g.words().len());
        assert!(g.words().iter().all(|w| tok.encode(&format!(" {w}")).len() == 1));
    }

    #[test]
    fn chunks_are_deterministic_and_differ_between_seeds() {
        let (g, _) = text_gen();
        let a = g.chunk(7, 512);
        assert_eq!(a, g.chunk(7, 512));
        assert_eq!(a, TextGen::new(&Tokenizer::bundled()).chunk(7, 512));
        assert_ne!(a, g.chunk(8, 512));
        assert!(a.starts_with(|c: char| c.is_ascii_lowercase()) && a.ends_with('\n'));
        assert!(!a.contains("\n\n") && !a.contains("  ") && !a.contains("\n "));
    }

    #[test]
    fn chunks_are_as_many_tokens_as_asked() {
        let (g, tok) = text_gen();
        for n in [0, 1, 2, 3, 7, 8, 27, 28, 100, 512, 4000] {
            for seed in 0..20 {
                assert_eq!(tok.encode(&g.chunk(seed, n)).len(), n, "{n} tokens, seed {seed}");
            }
        }
    }

    #[test]
    fn a_chunks_prefix_is_its_first_tokens() {
        let (g, tok) = text_gen();
        let whole = g.chunk(3, 512);
        let ids = tok.encode(&whole);
        for take in [0, 1, 5, 17, 255, 511, 512, 600] {
            let prefix = g.chunk_prefix(3, 512, take);
            assert!(whole.starts_with(&prefix), "{take}");
            assert_eq!(tok.encode(&prefix), ids[..take.min(512)], "{take}");
        }
    }

    #[test]
    fn chunks_end_to_end_tokenize_to_their_tokens_end_to_end() {
        let (g, tok) = text_gen();
        let pieces: Vec<String> = (0..6).map(|i| g.chunk(100 + i, 40 + 97 * i as usize)).collect();
        let whole = tok.encode(&pieces.concat());
        let joined: Vec<u32> = pieces.iter().flat_map(|p| tok.encode(p)).collect();
        assert_eq!(whole, joined);
        // And a cut last piece.
        let cut = g.chunk_prefix(200, 512, 301);
        assert_eq!(
            tok.encode(&(pieces.concat() + &cut)),
            [joined, tok.encode(&cut)].concat()
        );
    }

    #[test]
    fn fidelity_counts_lengths_and_shared_blocks() {
        let (g, tok) = text_gen();
        let (a, b, c) = (g.chunk(1, 64), g.chunk(2, 64), g.chunk(3, 40));
        let request = |pieces: &[&String], ids: Vec<u32>| Request {
            at_s: 0.0,
            prompt: ids,
            text: Some(TextPrompt(pieces.iter().map(|p| Arc::from(p.as_str())).collect())),
            output_tokens: 1,
            session: None,
            chat: None,
        };
        let ids = |n: u32, from: u32| (from..from + n).collect::<Vec<u32>>();
        let requests = [
            request(&[&a, &b], ids(128, 0)),
            // Shares the first 64 tokens (4 blocks) with the first; 104 ids
            // against 104 tokens.
            request(&[&a, &c], [ids(64, 0), ids(40, 1000)].concat()),
            // One token off.
            request(&[&c], ids(41, 5000)),
        ];
        let f = Fidelity::measure(&requests, &tok);
        assert_eq!((f.requests, f.id_tokens, f.text_tokens), (3, 273, 272));
        assert_eq!((f.abs_error, f.max_abs_error, f.exact), (1, 1, 2));
        assert_eq!((f.shared_ids, f.shared_text), (64, 64));
        assert_eq!(f.shared_kept(), Some(1.0));
        assert!(f.describe().contains("100.00 % (64 of 64)"), "{}", f.describe());
        assert_eq!(f.json()["shared_prefix_kept"], 1.0);
        let p = &requests[0].text.as_ref().unwrap();
        assert_eq!((p.text(), p.len()), (format!("{a}{b}"), a.len() + b.len()));
    }
}
