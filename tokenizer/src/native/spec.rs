//! What a `tokenizer.json` asks for, and whether the native engine
//! reproduces it exactly.
//!
//! The native engine takes byte-level BPE models with:
//!
//! | part | accepted |
//! | --- | --- |
//! | `normalizer` | `null`, `NFC` |
//! | `pre_tokenizer` | `ByteLevel` with GPT-2's regex (`use_regex` true, no prefix space); or `Sequence[Split(Qwen2 or Llama 3 regex, Isolated), ByteLevel(no regex, no prefix space)]` |
//! | `model` | `BPE` with every byte in the vocabulary, no dropout, no subword prefix or suffix, no byte fallback; `ignore_merges` either way |
//! | `post_processor` | `null`, `ByteLevel`, `TemplateProcessing` or a `Sequence` of them (they only add special tokens, which the gateway never asks for) |
//! | `decoder` | `ByteLevel` |
//! | `truncation`, `padding` | `null` |
//!
//! Anything else is a reason, which the caller reports when it falls back
//! to HF `tokenizers`.

use std::collections::HashMap;

use serde_json::Value;

use super::added::AddedTokenSpec;
use super::normalize::Normalizer;
use super::pretokenize::Dialect;

/// A tokenizer the native engine reproduces.
#[derive(Debug)]
pub(crate) struct NativeSpec {
    pub normalizer: Normalizer,
    pub dialect: Dialect,
    pub added: Vec<AddedTokenSpec>,
    pub vocab: HashMap<String, u32>,
    pub merges: Vec<(String, String)>,
    pub ignore_merges: bool,
}

/// Why a file is not for the native engine (shown at startup), or why it
/// is not a tokenizer at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotNative {
    /// A valid tokenizer the native engine does not reproduce: HF's job.
    Unsupported(String),
    /// A file HF would refuse too.
    Invalid(String),
}

fn unsupported(reason: impl Into<String>) -> NotNative {
    NotNative::Unsupported(reason.into())
}

fn kind(v: &Value) -> Option<&str> {
    v.get("type").and_then(Value::as_str)
}

/// Reads `json` (a parsed tokenizer.json) for the native engine; the
/// vocabulary, merges and added tokens are moved out of it.
pub(crate) fn read(json: &mut Value) -> Result<NativeSpec, NotNative> {
    let Some(root) = json.as_object_mut() else {
        return Err(NotNative::Invalid("not a JSON object".into()));
    };
    if let Some(version) = root.get("version")
        && version.as_str() != Some("1.0")
    {
        return Err(NotNative::Invalid(format!("unknown tokenizer version {version}")));
    }
    for key in ["truncation", "padding"] {
        if root.get(key).is_some_and(|v| !v.is_null()) {
            return Err(unsupported(format!("{key} is configured")));
        }
    }
    let normalizer = match root.get("normalizer") {
        None | Some(Value::Null) => Normalizer::Identity,
        Some(n) if kind(n) == Some("NFC") => Normalizer::Nfc,
        Some(n) => return Err(unsupported(format!("normalizer {}", kind(n).unwrap_or("?")))),
    };
    let dialect = pre_tokenizer(root.get("pre_tokenizer").unwrap_or(&Value::Null))?;
    match root.get("post_processor") {
        None | Some(Value::Null) => {}
        Some(p) if only_adds_special_tokens(p) => {}
        Some(p) => return Err(unsupported(format!("post-processor {}", kind(p).unwrap_or("?")))),
    }
    match root.get("decoder").map(kind) {
        Some(Some("ByteLevel")) => {}
        other => return Err(unsupported(format!("decoder {}", other.flatten().unwrap_or("none")))),
    }
    let model = root
        .get_mut("model")
        .ok_or_else(|| NotNative::Invalid("no model".into()))?;
    if kind(model) != Some("BPE") {
        return Err(unsupported(format!("model {}", kind(model).unwrap_or("?"))));
    }
    match model.get("dropout") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_f64() == Some(0.0) => {}
        Some(_) => return Err(unsupported("BPE dropout")),
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        match model.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(_) => return Err(unsupported(format!("BPE {key}"))),
        }
    }
    if model.get("byte_fallback").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("BPE byte_fallback"));
    }
    let ignore_merges = model.get("ignore_merges").and_then(Value::as_bool).unwrap_or(false);
    let vocab: HashMap<String, u32> = match model.get_mut("vocab").map(Value::take) {
        Some(v) => serde_json::from_value(v).map_err(|e| NotNative::Invalid(format!("vocab: {e}")))?,
        None => return Err(NotNative::Invalid("BPE without a vocab".into())),
    };
    let merges = merges(model.get_mut("merges").map(Value::take).unwrap_or(Value::Null))?;
    let added = match root.get_mut("added_tokens").map(Value::take) {
        None | Some(Value::Null) => Vec::new(),
        Some(list) => serde_json::from_value(list).map_err(|e| NotNative::Invalid(format!("added_tokens: {e}")))?,
    };
    Ok(NativeSpec {
        normalizer,
        dialect,
        added,
        vocab,
        merges,
        ignore_merges,
    })
}

/// The dialect of a pre-tokenizer the native engine reproduces.
fn pre_tokenizer(p: &Value) -> Result<Dialect, NotNative> {
    let byte_level = |b: &Value, regex: bool| {
        kind(b) == Some("ByteLevel")
            && b.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
            && b.get("use_regex").and_then(Value::as_bool).unwrap_or(true) == regex
    };
    if byte_level(p, true) {
        return Ok(Dialect::Gpt2);
    }
    if kind(p) == Some("Sequence")
        && let Some([split, bytes]) = p.get("pretokenizers").and_then(Value::as_array).map(Vec::as_slice)
        && kind(split) == Some("Split")
        && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
        && split.get("invert").and_then(Value::as_bool) == Some(false)
        && byte_level(bytes, false)
        && let Some(pattern) = split
            .get("pattern")
            .and_then(|p| p.get("Regex"))
            .and_then(Value::as_str)
    {
        return Dialect::of_split_pattern(pattern)
            .ok_or_else(|| unsupported(format!("pre-tokenizer regex {pattern:?}")));
    }
    Err(unsupported(format!("pre-tokenizer {}", kind(p).unwrap_or("none"))))
}

/// Whether a post-processor only adds special tokens (a no-op when the
/// gateway encodes without them).
fn only_adds_special_tokens(p: &Value) -> bool {
    match kind(p) {
        Some("ByteLevel" | "TemplateProcessing") => true,
        Some("Sequence") => p
            .get("processors")
            .and_then(Value::as_array)
            .is_some_and(|list| list.iter().all(only_adds_special_tokens)),
        _ => false,
    }
}

/// The merges list: `"left right"` strings (older files) or `[left, right]`
/// pairs (newer ones).
fn merges(list: Value) -> Result<Vec<(String, String)>, NotNative> {
    let Value::Array(list) = list else {
        return Err(NotNative::Invalid("BPE without merges".into()));
    };
    list.into_iter()
        .enumerate()
        .map(|(rank, m)| match m {
            Value::String(s) => {
                let mut parts = s.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(l), Some(r), None) => Ok((l.to_owned(), r.to_owned())),
                    _ => Err(NotNative::Invalid(format!(
                        "merge {} is not two tokens: {s:?}",
                        rank + 1
                    ))),
                }
            }
            Value::Array(pair) => match <[Value; 2]>::try_from(pair) {
                Ok([Value::String(l), Value::String(r)]) => Ok((l, r)),
                _ => Err(NotNative::Invalid(format!("merge {} is not two tokens", rank + 1))),
            },
            _ => Err(NotNative::Invalid(format!("merge {} is not two tokens", rank + 1))),
        })
        .collect()
}
