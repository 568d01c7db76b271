//! A model's tokenizer and chat template read out of its GGUF file, the
//! file llama.cpp serves: the same vocabulary, merges, special tokens and
//! template the engine uses, with no `tokenizer.json` to find.
//!
//! # What is read
//!
//! A GGUF file (version 2 or 3, little-endian) starts with a header and a
//! list of typed key–value pairs, then the tensors. Only the pairs are
//! read; the tensors are never touched:
//!
//! ```text
//!  "GGUF" | version: u32 | tensor_count: u64 | kv_count: u64 | kv_count × (key, type: u32, value) | tensors…
//!  key, string = len: u64 | bytes      array = item type: u32 | len: u64 | items
//! ```
//!
//! | key | use |
//! | --- | --- |
//! | `tokenizer.ggml.model` | must be `gpt2` (byte-level BPE) |
//! | `tokenizer.ggml.pre` | llama.cpp's pre-tokenizer name, mapped to the HF pre-tokenizer it stands for (table below) |
//! | `tokenizer.ggml.tokens` | the vocabulary, id = index, in HF's byte-level form (`Ġthe`) |
//! | `tokenizer.ggml.token_type` | 3 (control) and 4 (user-defined) are added tokens, matched in text as a whole; control ones are special |
//! | `tokenizer.ggml.merges` | the BPE merges, `"a b"`, in rank order |
//! | `tokenizer.ggml.bos_token_id`, `tokenizer.ggml.eos_token_id` | the template's `bos_token` and `eos_token` |
//! | `tokenizer.chat_template` | the Jinja chat template |
//!
//! The pairs become the `tokenizer.json` that `convert_hf_to_gguf.py` read
//! them from ([`GgufVocab::tokenizer_json`]), loaded as any other
//! ([`crate::Tokenizer::from_json`]): the native engine where it
//! reproduces the pre-tokenizer, else HF `tokenizers`.
//!
//! | `tokenizer.ggml.pre` | HF pre-tokenizer |
//! | --- | --- |
//! | `default`, `gpt-2`, `gpt2` | `ByteLevel` (GPT-2's regex) |
//! | `smollm`, `starcoder`, `refact`, `codeshell` | `Digits` (each digit apart), then `ByteLevel` |
//! | `qwen2` | Qwen2's `Split` regex, then `ByteLevel` without its regex |
//! | `llama-bpe`, `llama3` | Llama 3's `Split` regex, then `ByteLevel` without its regex |
//!
//! Any other model or pre-tokenizer is refused with an error naming it: a
//! guess would give ids the engine does not compute. Sizes are bounded
//! (strings, arrays, pairs), so a damaged or hostile file is an error, not
//! an allocation of its claimed size.

use std::io::Read;
use std::path::Path;

use serde_json::{Value, json};

use crate::native::pretokenize::Dialect;

/// The four bytes a GGUF file starts with.
pub const MAGIC: &[u8; 4] = b"GGUF";

/// Longest string accepted (a chat template is a few KiB).
const MAX_STRING: u64 = 16 << 20;
/// Most items in one array (vocabularies reach about 260 K).
const MAX_ARRAY: u64 = 16 << 20;
/// Most key–value pairs.
const MAX_PAIRS: u64 = 1 << 16;

/// Why a GGUF file's tokenizer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Reading failed (or the file ended early).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Not a GGUF file, or a version this reader does not know.
    #[error("not a GGUF file of version 2 or 3 ({0})")]
    NotGguf(String),
    /// A value is malformed or larger than the bounds.
    #[error("malformed metadata: {0}")]
    Malformed(String),
    /// A key the tokenizer needs is missing or of the wrong type.
    #[error("no {0} in its metadata")]
    Missing(&'static str),
    /// A tokenizer this reader does not reproduce.
    #[error("{0}")]
    Unsupported(String),
}

/// The tokenizer metadata of a GGUF file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`.
    pub model: String,
    /// `tokenizer.ggml.pre`, if present.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (empty if absent: all normal).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// llama.cpp's token type of a control token (special, e.g. `<|im_start|>`).
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// llama.cpp's token type of a user-defined added token.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Whether `bytes` (a file's first bytes) start like a GGUF file.
pub fn is_gguf(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

/// Whether the file at `path` is a GGUF file (false if it cannot be read).
pub fn is_gguf_file(path: &Path) -> bool {
    let mut head = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| is_gguf(&head))
}

impl GgufVocab {
    /// Reads the tokenizer metadata of the GGUF file at `path`.
    pub fn read_file(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path)?;
        Self::read(std::io::BufReader::with_capacity(1 << 20, file))
    }

    /// Reads the tokenizer metadata from a GGUF stream (its header and
    /// key–value pairs; the stream is left at the tensor infos).
    pub fn read(mut r: impl Read) -> Result<Self, GgufError> {
        let mut magic = [0u8; 4];
        r.read_exact(&mut magic)?;
        if !is_gguf(&magic) {
            return Err(GgufError::NotGguf(format!("it starts with {magic:02x?}")));
        }
        let version = read_u32(&mut r)?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::NotGguf(format!("version {version}")));
        }
        let _tensors = read_u64(&mut r)?;
        let pairs = read_u64(&mut r)?;
        if pairs > MAX_PAIRS {
            return Err(GgufError::Malformed(format!("{pairs} key-value pairs")));
        }
        let mut vocab = GgufVocab::default();
        for _ in 0..pairs {
            let key = read_string(&mut r)?;
            let kind = read_u32(&mut r)?;
            match key.as_str() {
                "tokenizer.ggml.model" => vocab.model = expect_string(&mut r, kind, "tokenizer.ggml.model")?,
                "tokenizer.ggml.pre" => vocab.pre = Some(expect_string(&mut r, kind, "tokenizer.ggml.pre")?),
                "tokenizer.chat_template" => {
                    vocab.chat_template = Some(expect_string(&mut r, kind, "tokenizer.chat_template")?);
                }
                "tokenizer.ggml.tokens" => vocab.tokens = expect_strings(&mut r, kind, "tokenizer.ggml.tokens")?,
                "tokenizer.ggml.merges" => vocab.merges = expect_strings(&mut r, kind, "tokenizer.ggml.merges")?,
                "tokenizer.ggml.token_type" => {
                    vocab.token_types = expect_i32s(&mut r, kind, "tokenizer.ggml.token_type")?;
                }
                "tokenizer.ggml.bos_token_id" => vocab.bos_id = Some(expect_id(&mut r, kind, "bos_token_id")?),
                "tokenizer.ggml.eos_token_id" => vocab.eos_id = Some(expect_id(&mut r, kind, "eos_token_id")?),
                _ => skip_value(&mut r, kind)?,
            }
        }
        if vocab.model.is_empty() {
            return Err(GgufError::Missing("tokenizer.ggml.model"));
        }
        if vocab.tokens.is_empty() {
            return Err(GgufError::Missing("tokenizer.ggml.tokens"));
        }
        if !vocab.token_types.is_empty() && vocab.token_types.len() != vocab.tokens.len() {
            return Err(GgufError::Malformed(format!(
                "{} token types for {} tokens",
                vocab.token_types.len(),
                vocab.tokens.len()
            )));
        }
        Ok(vocab)
    }

    /// The token of `id`, if in the vocabulary.
    pub fn token(&self, id: Option<u32>) -> Option<&str> {
        self.tokens.get(usize::try_from(id?).ok()?).map(String::as_str)
    }

    /// The HF `tokenizer.json` these pairs were converted from (see the
    /// module docs for the pre-tokenizers it knows).
    pub fn tokenizer_json(&self) -> Result<Value, GgufError> {
        if self.model != "gpt2" {
            return Err(GgufError::Unsupported(format!(
                "tokenizer model `{}` (only `gpt2`, byte-level BPE, is read from a GGUF; give the model's tokenizer.json instead)",
                self.model
            )));
        }
        let pre = self.pre.as_deref().unwrap_or("default");
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
        let pre_tokenizer = match pre {
            "default" | "gpt-2" | "gpt2" => byte_level(true),
            "smollm" | "starcoder" | "refact" | "codeshell" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            "qwen2" => {
                json!({"type": "Sequence", "pretokenizers": [split(Dialect::Qwen2.pattern()), byte_level(false)]})
            }
            "llama-bpe" | "llama3" => {
                json!({"type": "Sequence", "pretokenizers": [split(Dialect::Llama3.pattern()), byte_level(false)]})
            }
            other => {
                return Err(GgufError::Unsupported(format!(
                    "pre-tokenizer `{other}` (read from a GGUF: default, gpt2, smollm, starcoder, refact, codeshell, qwen2, llama-bpe; give the model's tokenizer.json instead)"
                )));
            }
        };
        let vocab: serde_json::Map<String, Value> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(id, token)| (token.clone(), json!(id)))
            .collect();
        if vocab.len() != self.tokens.len() {
            return Err(GgufError::Malformed("the vocabulary lists a token twice".into()));
        }
        let added: Vec<Value> = self
            .token_types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(id, t)| {
                json!({
                    "id": id,
                    "content": self.tokens[id],
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": *t == TOKEN_TYPE_CONTROL,
                })
            })
            .collect();
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": self.merges,
            },
        }))
    }
}

// GGUF value types.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

fn read_u32(r: &mut impl Read) -> Result<u32, GgufError> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> Result<u64, GgufError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_string(r: &mut impl Read) -> Result<String, GgufError> {
    let len = read_u64(r)?;
    if len > MAX_STRING {
        return Err(GgufError::Malformed(format!("a string of {len} bytes")));
    }
    let mut bytes = vec![0u8; len as usize];
    r.read_exact(&mut bytes)?;
    String::from_utf8(bytes).map_err(|_| GgufError::Malformed("a string that is not UTF-8".into()))
}

/// Bytes of one scalar of `kind`; `None` for strings and arrays.
fn scalar_size(kind: u32) -> Option<u64> {
    match kind {
        T_U8 | T_I8 | T_BOOL => Some(1),
        T_U16 | T_I16 => Some(2),
        T_U32 | T_I32 | T_F32 => Some(4),
        T_U64 | T_I64 | T_F64 => Some(8),
        _ => None,
    }
}

fn skip_bytes(r: &mut impl Read, n: u64) -> Result<(), GgufError> {
    let skipped = std::io::copy(&mut r.take(n), &mut std::io::sink())?;
    if skipped < n {
        return Err(GgufError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(())
}

fn skip_value(r: &mut impl Read, kind: u32) -> Result<(), GgufError> {
    if let Some(size) = scalar_size(kind) {
        return skip_bytes(r, size);
    }
    match kind {
        T_STRING => read_string(r).map(drop),
        T_ARRAY => {
            let item = read_u32(r)?;
            let len = read_array_len(r)?;
            match scalar_size(item) {
                Some(size) => skip_bytes(r, size * len),
                None => (0..len).try_for_each(|_| skip_value(r, item)),
            }
        }
        other => Err(GgufError::Malformed(format!("value type {other}"))),
    }
}

fn read_array_len(r: &mut impl Read) -> Result<u64, GgufError> {
    let len = read_u64(r)?;
    if len > MAX_ARRAY {
        return Err(GgufError::Malformed(format!("an array of {len} items")));
    }
    Ok(len)
}

fn expect_string(r: &mut impl Read, kind: u32, key: &'static str) -> Result<String, GgufError> {
    if kind != T_STRING {
        skip_value(r, kind)?;
        return Err(GgufError::Missing(key));
    }
    read_string(r)
}

/// The header of an array of `item` values, or `None` (value skipped) if
/// `kind` is not such an array.
fn array_of(r: &mut impl Read, kind: u32, item: &[u32]) -> Result<Option<(u32, u64)>, GgufError> {
    if kind != T_ARRAY {
        skip_value(r, kind)?;
        return Ok(None);
    }
    let t = read_u32(r)?;
    let len = read_array_len(r)?;
    if !item.contains(&t) {
        match scalar_size(t) {
            Some(size) => skip_bytes(r, size * len)?,
            None => (0..len).try_for_each(|_| skip_value(r, t))?,
        }
        return Ok(None);
    }
    Ok(Some((t, len)))
}

fn expect_strings(r: &mut impl Read, kind: u32, key: &'static str) -> Result<Vec<String>, GgufError> {
    let (_, len) = array_of(r, kind, &[T_STRING])?.ok_or(GgufError::Missing(key))?;
    (0..len).map(|_| read_string(r)).collect()
}

fn expect_i32s(r: &mut impl Read, kind: u32, key: &'static str) -> Result<Vec<i32>, GgufError> {
    let (_, len) = array_of(r, kind, &[T_I32, T_U32])?.ok_or(GgufError::Missing(key))?;
    (0..len).map(|_| read_u32(r).map(|v| v as i32)).collect()
}

fn expect_id(r: &mut impl Read, kind: u32, key: &'static str) -> Result<u32, GgufError> {
    match kind {
        T_U32 | T_I32 => read_u32(r),
        T_U64 | T_I64 => {
            read_u64(r).and_then(|v| u32::try_from(v).map_err(|_| GgufError::Malformed(format!("{key} {v}"))))
        }
        other => {
            skip_value(r, other)?;
            Err(GgufError::Missing(key))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes GGUF files for tests (the format of the module docs).
    #[derive(Default)]
    pub(crate) struct Writer {
        pairs: Vec<u8>,
        count: u64,
    }

    impl Writer {
        fn key(&mut self, key: &str, kind: u32) -> &mut Self {
            self.count += 1;
            self.raw_string(key);
            self.pairs.extend(kind.to_le_bytes());
            self
        }

        fn raw_string(&mut self, s: &str) {
            self.pairs.extend((s.len() as u64).to_le_bytes());
            self.pairs.extend(s.as_bytes());
        }

        pub(crate) fn string(mut self, key: &str, value: &str) -> Self {
            self.key(key, T_STRING).raw_string(value);
            self
        }

        pub(crate) fn u32(mut self, key: &str, value: u32) -> Self {
            self.key(key, T_U32).pairs.extend(value.to_le_bytes());
            self
        }

        pub(crate) fn f32s(mut self, key: &str, values: &[f32]) -> Self {
            self.key(key, T_ARRAY).pairs.extend(T_F32.to_le_bytes());
            self.pairs.extend((values.len() as u64).to_le_bytes());
            for v in values {
                self.pairs.extend(v.to_le_bytes());
            }
            self
        }

        pub(crate) fn i32s(mut self, key: &str, values: &[i32]) -> Self {
            self.key(key, T_ARRAY).pairs.extend(T_I32.to_le_bytes());
            self.pairs.extend((values.len() as u64).to_le_bytes());
            for v in values {
                self.pairs.extend(v.to_le_bytes());
            }
            self
        }

        pub(crate) fn strings(mut self, key: &str, values: &[&str]) -> Self {
            self.key(key, T_ARRAY).pairs.extend(T_STRING.to_le_bytes());
            self.pairs.extend((values.len() as u64).to_le_bytes());
            for v in values {
                self.raw_string(v);
            }
            self
        }

        pub(crate) fn bytes(&self) -> Vec<u8> {
            let mut out = MAGIC.to_vec();
            out.extend(3u32.to_le_bytes());
            out.extend(0u64.to_le_bytes());
            out.extend(self.count.to_le_bytes());
            out.extend(&self.pairs);
            out
        }
    }

    /// A tiny byte-level BPE: the 256 byte tokens, two merges, a control
    /// token.
    pub(crate) fn tiny(pre: &str) -> Writer {
        let bytes = byte_tokens();
        let mut tokens: Vec<&str> = bytes.iter().map(String::as_str).collect();
        tokens.extend(["Ġt", "Ġth", "<|im_start|>"]);
        let mut types = vec![1; tokens.len()];
        *types.last_mut().unwrap() = TOKEN_TYPE_CONTROL;
        Writer::default()
            .string("general.architecture", "llama")
            .f32s("tokenizer.ggml.scores", &vec![0.0; tokens.len()])
            .string("tokenizer.ggml.model", "gpt2")
            .string("tokenizer.ggml.pre", pre)
            .strings("tokenizer.ggml.tokens", &tokens)
            .i32s("tokenizer.ggml.token_type", &types)
            .strings("tokenizer.ggml.merges", &["Ġ t", "Ġt h"])
            .u32("tokenizer.ggml.eos_token_id", 258)
            .string(
                "tokenizer.chat_template",
                "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
            )
    }

    /// GPT-2's byte-to-unicode map, in byte order.
    fn byte_tokens() -> Vec<String> {
        let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let mut n = 0;
        (0u32..256)
            .map(|b| {
                let c = if printable(b) {
                    b
                } else {
                    n += 1;
                    255 + n
                };
                char::from_u32(c).unwrap().to_string()
            })
            .collect()
    }

    #[test]
    fn the_tokenizer_pairs_are_read_and_others_skipped() {
        let v = GgufVocab::read(&tiny("smollm").bytes()[..]).unwrap();
        assert_eq!(v.model, "gpt2");
        assert_eq!(v.pre.as_deref(), Some("smollm"));
        assert_eq!(v.tokens.len(), 259);
        assert_eq!(v.tokens[256], "Ġt");
        assert_eq!(v.merges, ["Ġ t", "Ġt h"]);
        assert_eq!(v.token(v.eos_id), Some("<|im_start|>"));
        assert_eq!(v.bos_id, None);
        assert!(v.chat_template.unwrap().starts_with("{% for"));
    }

    #[test]
    fn damaged_files_are_errors_not_panics_or_huge_allocations() {
        let good = tiny("gpt2").bytes();
        // Every truncation is an error.
        for cut in [0, 3, 4, 10, 24, 40, good.len() / 2, good.len() - 1] {
            assert!(GgufVocab::read(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(matches!(
            GgufVocab::read(&b"GGML\x03\0\0\0"[..]),
            Err(GgufError::NotGguf(_))
        ));
        let mut v9 = good.clone();
        v9[4] = 9;
        assert!(matches!(GgufVocab::read(&v9[..]), Err(GgufError::NotGguf(_))));
        // A claimed string of 2^60 bytes: refused before allocating.
        let mut huge = good[..24].to_vec();
        huge.extend((1u64 << 60).to_le_bytes());
        assert!(matches!(GgufVocab::read(&huge[..]), Err(GgufError::Malformed(_))));
        // No tokens.
        let none = Writer::default().string("tokenizer.ggml.model", "gpt2").bytes();
        assert!(matches!(
            GgufVocab::read(&none[..]),
            Err(GgufError::Missing("tokenizer.ggml.tokens"))
        ));
    }

    #[test]
    fn only_known_models_and_pre_tokenizers_are_converted() {
        let v = GgufVocab::read(&tiny("exotic").bytes()[..]).unwrap();
        let e = v.tokenizer_json().unwrap_err().to_string();
        assert!(e.contains("pre-tokenizer `exotic`"), "{e}");
        let mut llama = GgufVocab::read(&tiny("gpt2").bytes()[..]).unwrap();
        llama.model = "llama".into();
        let e = llama.tokenizer_json().unwrap_err().to_string();
        assert!(e.contains("tokenizer model `llama`"), "{e}");
    }

    /// The bundled tokenizer.json (GPT-2's vocabulary) written as
    /// `convert_hf_to_gguf.py` writes a GGUF, read back: the same ids on a
    /// corpus of prose, code, digits, whitespace runs, non-Latin text and
    /// special tokens.
    #[test]
    fn a_tokenizer_json_written_as_gguf_and_read_back_gives_the_same_ids() {
        let hf: Value = serde_json::from_slice(crate::BUNDLED_JSON).unwrap();
        let vocab = hf["model"]["vocab"].as_object().unwrap();
        let mut tokens = vec![String::new(); vocab.len()];
        for (token, id) in vocab {
            tokens[id.as_u64().unwrap() as usize] = token.clone();
        }
        let mut types = vec![1; tokens.len()];
        for added in hf["added_tokens"].as_array().unwrap() {
            let id = added["id"].as_u64().unwrap() as usize;
            if id >= tokens.len() {
                tokens.resize(id + 1, String::new());
                types.resize(id + 1, 1);
            }
            tokens[id] = added["content"].as_str().unwrap().to_owned();
            types[id] = if added["special"] == true {
                TOKEN_TYPE_CONTROL
            } else {
                TOKEN_TYPE_USER_DEFINED
            };
        }
        let merges: Vec<String> = hf["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| match m {
                Value::String(s) => s.clone(),
                pair => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
            })
            .collect();
        let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
        let merge_refs: Vec<&str> = merges.iter().map(String::as_str).collect();
        let file = Writer::default()
            .string("tokenizer.ggml.model", "gpt2")
            .string("tokenizer.ggml.pre", "gpt-2")
            .strings("tokenizer.ggml.tokens", &token_refs)
            .i32s("tokenizer.ggml.token_type", &types)
            .strings("tokenizer.ggml.merges", &merge_refs)
            .bytes();
        let dir = std::env::temp_dir().join(format!("semlb-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("phi2.gguf");
        std::fs::write(&path, file).unwrap();
        let from_gguf = crate::Tokenizer::from_file(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let bundled = crate::Tokenizer::bundled();
        assert_eq!(from_gguf.engine(), bundled.engine(), "the native engine takes it too");
        for text in [
            "Hello, world! The year 2026 has 365 days.",
            "fn main() {\n    println!(\"{}\", 1_000_000);\n}\n\n\n",
            "  leading   and trailing spaces   ",
            "Ünïcödé, 日本語のテキスト, русский текст, emoji 🦀🦀.",
            "<|endoftext|>special tokens<|endoftext|> in text",
            "it's we're they'll I'd you've",
        ] {
            assert_eq!(from_gguf.encode(text), bundled.encode(text), "{text:?}");
        }
    }

    #[test]
    fn the_converted_json_has_the_vocab_merges_and_added_tokens() {
        let v = GgufVocab::read(&tiny("smollm").bytes()[..]).unwrap();
        let j = v.tokenizer_json().unwrap();
        assert_eq!(j["model"]["vocab"]["Ġth"], 257);
        assert_eq!(j["model"]["merges"][1], "Ġt h");
        assert_eq!(j["added_tokens"][0]["content"], "<|im_start|>");
        assert_eq!(j["added_tokens"][0]["special"], true);
        assert_eq!(j["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
    }
}
