//! Tokenizers synthesized by editing the JSON of the real files (or, for
//! the fallback cases, written from scratch), so both sides load the same
//! bytes.
//!
//! | variant | from | what it exercises |
//! | --- | --- | --- |
//! | [`llama3_style`] | Qwen3 | Llama-3's pre-tokenizer regex (`\p{N}{1,3}`), no normalizer, `ignore_merges`, a BOS post-processor |
//! | [`ignore_merges`] | phi-2, Llama-3-style | whole-word vocabulary hits before BPE (first merges pruned so the flag matters) |
//! | [`phi2_added_vocabulary`] | phi-2 | added tokens with `lstrip`, `rstrip`, `single_word`, `normalized`, overlapping contents, a content already in the vocabulary |
//! | [`qwen3_normalized_added`] | Qwen3 | `normalized: true` added tokens matched after NFC |
//! | [`must_fall_back`] | phi-2, scratch | forms the native engine must leave to HF |
//! | [`either_engine`] | phi-2 | forms either engine may take, as long as the ids are HF's |

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::{Value, json};

use super::corpus::{LLAMA3_SPECIALS, VARIANT_ADDED_TOKENS};

/// Llama-3's pre-tokenizer regex (as in Meta-Llama-3's tokenizer.json).
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The bundled phi-2 tokenizer.json.
pub fn phi2_path() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/phi2-tokenizer.json")
}

/// The bundled phi-2, parsed once.
pub fn phi2() -> &'static Value {
    static JSON: OnceLock<Value> = OnceLock::new();
    JSON.get_or_init(|| read_json(&phi2_path()))
}

/// Qwen3's tokenizer.json, parsed once, or `None` (with a `SKIPPED:` line
/// at every call, so each test that skips says so).
pub fn qwen3() -> Option<&'static Value> {
    static JSON: OnceLock<Option<Value>> = OnceLock::new();
    let json = JSON.get_or_init(|| {
        semlb_tokenizer::test_data::tokenizers_dir()
            .map(|dir| dir.join("qwen3-tokenizer.json"))
            .filter(|p| p.is_file())
            .map(|p| read_json(&p))
    });
    if json.is_none() {
        println!(
            "SKIPPED: tokenizer file qwen3-tokenizer.json is absent (shared/data/tokenizers or SEMLB_TOKENIZERS_DIR)"
        );
    }
    json.as_ref()
}

fn read_json(path: &std::path::Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// An `added_tokens` entry.
pub fn added_token(id: u64, content: &str, special: bool) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": special,
    })
}

/// The next free id after the vocabulary and the added tokens.
fn next_id(tokenizer: &Value) -> u64 {
    let vocab_max = tokenizer["model"]["vocab"]
        .as_object()
        .expect("model.vocab is an object")
        .values()
        .filter_map(Value::as_u64)
        .max()
        .unwrap_or(0);
    let added_max = tokenizer["added_tokens"]
        .as_array()
        .expect("added_tokens is a list")
        .iter()
        .filter_map(|t| t["id"].as_u64())
        .max()
        .unwrap_or(0);
    vocab_max.max(added_max) + 1
}

fn added_tokens_mut(tokenizer: &mut Value) -> &mut Vec<Value> {
    tokenizer["added_tokens"]
        .as_array_mut()
        .expect("added_tokens is a list")
}

/// Qwen3's vocabulary, merges and added tokens with Llama-3's
/// pre-tokenizer, no normalizer, `ignore_merges: true`, Llama-3's special
/// tokens appended (`<|begin_of_text|>` first) and Llama-3's post-processor
/// (ByteLevel, then a template that adds `<|begin_of_text|>`, which
/// `encode(.., add_special_tokens = false)` must not add). The shape is
/// that of Meta-Llama-3-8B's tokenizer.json.
pub fn llama3_style(qwen3: &Value) -> Value {
    let mut t = qwen3.clone();
    let first = next_id(&t);
    let added = added_tokens_mut(&mut t);
    for (i, content) in LLAMA3_SPECIALS.iter().enumerate() {
        added.push(added_token(first + i as u64, content, true));
    }
    let bos = LLAMA3_SPECIALS[0];
    t["normalizer"] = Value::Null;
    t["pre_tokenizer"] = json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]
    });
    t["post_processor"] = json!({
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}
                ],
                "pair": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": bos, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}}
                ],
                "special_tokens": {bos: {"id": bos, "ids": [first], "tokens": [bos]}}
            }
        ]
    });
    t["decoder"] = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    t["model"]["ignore_merges"] = json!(true);
    t["model"]["continuing_subword_prefix"] = Value::Null;
    t["model"]["end_of_word_suffix"] = Value::Null;
    t
}

/// The id `llama3_style` gives `<|begin_of_text|>`.
pub fn llama3_bos_id(qwen3: &Value) -> u32 {
    next_id(qwen3) as u32
}

/// The same tokenizer with `model.ignore_merges: true` and its first
/// `pruned` merges removed. The merge-built vocabulary of GPT-2 and Qwen
/// makes `ignore_merges` alone change nothing (every token is what BPE
/// makes of its own text); without the first merges (`Ġ t`, `h e`, ...),
/// a pre-token that is a vocabulary token (` the`) gets its id directly,
/// while other pre-tokens go through BPE without those merges, so the flag
/// decides the ids of most English words.
pub fn ignore_merges(tokenizer: &Value, pruned: usize) -> Value {
    let mut t = tokenizer.clone();
    t["model"]["ignore_merges"] = json!(true);
    let merges = t["model"]["merges"].as_array_mut().expect("model.merges is a list");
    merges.drain(..pruned.min(merges.len()));
    t
}

/// [`ignore_merges`] with the flag off again: the same pruned merges, BPE
/// for every pre-token (what the flag is compared against).
pub fn pruned_merges(tokenizer: &Value, pruned: usize) -> Value {
    let mut t = ignore_merges(tokenizer, pruned);
    t["model"]["ignore_merges"] = json!(false);
    t
}

/// phi-2 with added tokens that use every added-vocabulary rule of HF:
///
/// | content | special | normalized | lstrip | rstrip | single_word |
/// | --- | --- | --- | --- | --- | --- |
/// | `<\|tool\|>` | yes | no | yes | yes | no |
/// | `<mask>` | yes | no | yes | no | no |
/// | `<\|tool\|>x` | yes | no | no | no | no (overlaps `<\|tool\|>`) |
/// | `hello` | no | no | no | no | yes (already GPT-2 token 31373) |
/// | `[SEP]` | no | yes | no | yes | no |
/// | `café` | no | yes | no | no | no |
/// | `naïve` | no | no | yes | yes | yes |
/// | ` ·` | no | yes | no | no | no (starts with a space) |
pub fn phi2_added_vocabulary(phi2: &Value) -> Value {
    let mut t = phi2.clone();
    let first = next_id(&t);
    // (content, special, normalized, lstrip, rstrip, single_word)
    let rules: [(&str, bool, bool, bool, bool, bool); 8] = [
        ("<|tool|>", true, false, true, true, false),
        ("<mask>", true, false, true, false, false),
        ("<|tool|>x", true, false, false, false, false),
        ("hello", false, false, false, false, true),
        ("[SEP]", false, true, false, true, false),
        ("café", false, true, false, false, false),
        ("naïve", false, false, true, true, true),
        (" ·", false, true, false, false, false),
    ];
    let added = added_tokens_mut(&mut t);
    let mut id = first;
    for (content, special, normalized, lstrip, rstrip, single_word) in rules {
        assert!(VARIANT_ADDED_TOKENS.contains(&content), "{content:?} is in the corpus");
        // HF gives a content already in the vocabulary the vocabulary's id.
        let this_id = if content == "hello" { 31373 } else { id };
        if this_id == id {
            id += 1;
        }
        added.push(json!({
            "id": this_id,
            "content": content,
            "single_word": single_word,
            "lstrip": lstrip,
            "rstrip": rstrip,
            "normalized": normalized,
            "special": special,
        }));
    }
    t
}

/// Qwen3 (NFC normalizer) with `normalized: true` added tokens whose NFC
/// form differs from other spellings: `café` (matches `cafe\u{301}`), `Å`
/// (matches U+212B ANGSTROM SIGN), `ﬁ` (NFC keeps the ligature), and a
/// `normalized: false` `naïve` that only matches the precomposed spelling.
pub fn qwen3_normalized_added(qwen3: &Value) -> Value {
    let mut t = qwen3.clone();
    let first = next_id(&t);
    let added = added_tokens_mut(&mut t);
    for (i, (content, normalized)) in [("café", true), ("Å", true), ("ﬁ", true), ("naïve", false)]
        .into_iter()
        .enumerate()
    {
        assert!(VARIANT_ADDED_TOKENS.contains(&content), "{content:?} is in the corpus");
        let mut token = added_token(first + i as u64, content, false);
        token["normalized"] = json!(normalized);
        added.push(token);
    }
    t
}

/// Tokenizers the native engine must leave to HF (byte-level BPE with
/// something it does not reproduce, or another model altogether).
pub fn must_fall_back(phi2: &Value) -> Vec<(&'static str, Value)> {
    let mut cases = Vec::new();

    let mut t = phi2.clone();
    t["normalizer"] = json!({"type": "Lowercase"});
    cases.push(("phi-2 + Lowercase normalizer", t));

    let mut t = phi2.clone();
    t["normalizer"] = json!({"type": "NFKC"});
    cases.push(("phi-2 + NFKC normalizer", t));

    let mut t = phi2.clone();
    t["model"]["byte_fallback"] = json!(true);
    cases.push(("phi-2 + byte_fallback", t));

    cases.push(("BPE with continuing_subword_prefix ##", subword_prefix_bpe()));

    let mut t = phi2.clone();
    t["model"]["end_of_word_suffix"] = json!("</w>");
    cases.push(("phi-2 + end_of_word_suffix </w>", t));

    // A Split regex that is none of the known dialects (digits in pairs).
    let mut t = phi2.clone();
    t["pre_tokenizer"] = json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}{1,2}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]
    });
    cases.push(("phi-2 + unknown Split regex", t));

    // Whitespace pre-tokenizer: a different splitter altogether.
    let mut t = phi2.clone();
    t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]});
    cases.push(("phi-2 + WhitespaceSplit then ByteLevel", t));

    cases.push((
        "SentencePiece-style BPE (Metaspace, byte_fallback)",
        sentencepiece_metaspace(),
    ));
    cases.push(("SentencePiece-style BPE (Llama-2 normalizer)", sentencepiece_llama2()));
    cases.push(("WordPiece (BERT)", wordpiece_bert()));
    cases
}

/// BPE dropout: random merges, so ids are not reproducible even by HF.
pub fn with_dropout(phi2: &Value) -> Value {
    let mut t = phi2.clone();
    t["model"]["dropout"] = json!(0.3);
    t
}

/// Forms either engine may take; the ids must be HF's whichever does.
pub fn either_engine(phi2: &Value) -> Vec<(&'static str, Value)> {
    let mut cases = Vec::new();

    let mut t = phi2.clone();
    t["pre_tokenizer"]["add_prefix_space"] = json!(true);
    cases.push(("phi-2 + add_prefix_space", t));

    let mut t = phi2.clone();
    t["normalizer"] = json!({"type": "NFC"});
    cases.push(("phi-2 + NFC normalizer", t));

    let mut t = phi2.clone();
    t["truncation"] = json!({"direction": "Right", "max_length": 7, "strategy": "LongestFirst", "stride": 0});
    cases.push(("phi-2 + truncation to 7 ids", t));

    let mut t = phi2.clone();
    t["padding"] = json!({
        "strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": null,
        "pad_id": 50256, "pad_type_id": 0, "pad_token": "<|endoftext|>"
    });
    cases.push(("phi-2 + padding to 12 ids", t));

    // HF ignores the ids written in `added_tokens`: it gives each token the
    // vocabulary's id or the next free one, in list order.
    let mut t = phi2.clone();
    for (i, content) in ["<|tool|>", "<mask>"].into_iter().enumerate() {
        added_tokens_mut(&mut t).push(added_token(60_000 + 7 * i as u64, content, true));
    }
    cases.push(("phi-2 + added tokens whose JSON ids HF does not use", t));

    let mut t = phi2.clone();
    t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [t["pre_tokenizer"].clone()]});
    cases.push(("phi-2 + ByteLevel wrapped in a Sequence", t));

    cases
}

/// Byte tokens `<0x00>`..`<0xFF>`, as SentencePiece writes them.
fn byte_tokens() -> impl Iterator<Item = String> {
    (0..=255u8).map(|b| format!("<0x{b:02X}>"))
}

/// A small SentencePiece-style BPE vocabulary: `<unk> <s> </s>`, the byte
/// tokens, `▁`, letters, digits, and whole words built by merges.
fn sentencepiece_model() -> Value {
    let mut vocab = serde_json::Map::new();
    let push = |token: String, vocab: &mut serde_json::Map<String, Value>| {
        if !vocab.contains_key(&token) {
            let id = vocab.len();
            vocab.insert(token, json!(id));
        }
    };
    for s in ["<unk>", "<s>", "</s>"] {
        push(s.into(), &mut vocab);
    }
    for b in byte_tokens() {
        push(b, &mut vocab);
    }
    push("▁".into(), &mut vocab);
    for c in ('a'..='z').chain('A'..='Z').chain('0'..='9').chain(".,!?'".chars()) {
        push(c.to_string(), &mut vocab);
    }
    let mut merges: Vec<Value> = Vec::new();
    for word in [
        "the", "and", "hello", "world", "ing", "tion", "load", "balancer", "token", "is", "a",
    ] {
        let chars: Vec<String> = std::iter::once("▁".to_string())
            .chain(word.chars().map(String::from))
            .collect();
        let mut left = chars[0].clone();
        for right in &chars[1..] {
            let merged = format!("{left}{right}");
            if !vocab.contains_key(&merged) {
                merges.push(json!([left, right]));
                push(merged.clone(), &mut vocab);
            }
            left = merged;
        }
    }
    json!({
        "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
        "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
        "vocab": vocab, "merges": merges
    })
}

fn sentencepiece_added() -> Value {
    json!([
        added_token(0, "<unk>", true),
        added_token(1, "<s>", true),
        added_token(2, "</s>", true)
    ])
}

/// SentencePiece-style BPE with a Metaspace pre-tokenizer (the newer form).
fn sentencepiece_metaspace() -> Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": sentencepiece_added(),
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "post_processor": null,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "model": sentencepiece_model()
    })
}

/// SentencePiece-style BPE with Llama-2's normalizer (prepend `▁`, spaces
/// to `▁`) and no pre-tokenizer.
fn sentencepiece_llama2() -> Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": sentencepiece_added(),
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": sentencepiece_model()
    })
}

/// A small BERT-style WordPiece tokenizer.
fn wordpiece_bert() -> Value {
    let mut vocab = serde_json::Map::new();
    let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];
    let mut tokens: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    for c in ('a'..='z').chain('0'..='9').chain(".,!?'()-".chars()) {
        tokens.push(c.to_string());
        tokens.push(format!("##{c}"));
    }
    for w in [
        "the", "and", "hello", "world", "load", "##ing", "##s", "token", "##izer", "中", "文",
    ] {
        tokens.push(w.to_string());
    }
    for (id, t) in tokens.into_iter().enumerate() {
        vocab.insert(t, json!(id));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": specials.iter().enumerate().map(|(i, s)| added_token(i as u64, s, true)).collect::<Vec<_>>(),
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {
                "[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}
            }
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}
    })
}

/// A small BPE with `continuing_subword_prefix: "##"` (word-internal
/// pieces spelled `##x`) after a whitespace pre-tokenizer. (phi-2 with the
/// prefix set makes HF panic while loading: it cuts `##` off merges whose
/// right part is shorter.)
fn subword_prefix_bpe() -> Value {
    let mut vocab = serde_json::Map::new();
    let mut tokens = vec!["[UNK]".to_string()];
    for c in ('a'..='z').chain('0'..='9') {
        tokens.push(c.to_string());
        tokens.push(format!("##{c}"));
    }
    let merges = [
        ["t", "##h"],
        ["th", "##e"],
        ["h", "##e"],
        ["##l", "##l"],
        ["he", "##ll"],
        ["hell", "##o"],
    ];
    for [a, b] in merges {
        tokens.push(format!("{a}{}", &b[2..]));
    }
    tokens.sort();
    tokens.dedup();
    for (id, t) in tokens.into_iter().enumerate() {
        vocab.insert(t, json!(id));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added_token(vocab["[UNK]"].as_u64().unwrap(), "[UNK]", true)],
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "BPEDecoder", "suffix": "</w>"},
        "model": {"type": "BPE", "dropout": null, "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    })
}
