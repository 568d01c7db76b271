//! The `mooncake` workload: the Mooncake conversation trace.
//!
//! `<data>/traces/conversation_trace.jsonl` (`--trace` overrides), the
//! FAST'25 Mooncake release: one request per line, `{"timestamp": ms,
//! "input_length": n, "output_length": m, "hash_ids": [...]}`, where each
//! hash id names one 512-token block of the prompt and equal ids mean equal
//! prefixes. No text is released, so each block id becomes 512 token ids
//! drawn from a generator seeded by the id ([`block_tokens`]): equal ids
//! give equal tokens, so requests sharing blocks share real prefixes, which
//! the gateway (16-token block hashes of the token ids) and the engines'
//! prefix caches see. The last block is cut to `input_length`; blocks
//! missing from `hash_ids` come from ids no other request uses.
//!
//! In the text form ([`text`](super::text), the replay's default) each
//! block id becomes instead a chunk of text of 512 tokens with the
//! engines' tokenizer, seeded by the id ([`block_text`]), and the last
//! block the first tokens of its chunk: equal ids give equal text, whose
//! tokens are equal too, so the prompts share the same prefixes, and a
//! prompt is `input_length` tokens. Each chunk is built once per replay
//! (the first 600 s use ~35 000 distinct ids). The output
//! length is `output_length` (capped by `--max-output`); prompts longer
//! than the context keep their first `32 768 − output` tokens. The trace
//! has no session ids.
//!
//! The first 600 s hold ~1 800 requests (~3 req/s) and offer ~34 000
//! prompt tokens/s, of which ~23 000 still need prefill with perfect prefix
//! reuse: ~58 % of the 40 000 tokens/s of four engines, and the working set
//! (millions of tokens) far exceeds their KV caches.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::text::{TextGen, TextPrompt};
use super::{Request, Workload, WorkloadKind, fit_to_context, random_tokens};
use semlb_test_support::{Rng, mix};

/// The trace, relative to the data directory.
pub const TRACE_FILE: &str = "traces/conversation_trace.jsonl";

/// Tokens per trace block (the Mooncake release's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One line of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, milliseconds from the trace's start.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Answer length in tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block; equal ids, equal prefixes.
    pub hash_ids: Vec<u64>,
}

/// Parses one trace line.
pub fn parse_trace_line(line: &str) -> Result<TraceRecord> {
    serde_json::from_str(line)
        .with_context(|| format!("not a trace record: {}", line.chars().take(120).collect::<String>()))
}

/// The trace's records up to `duration_s` (trace seconds) and `limit`, in
/// arrival order.
fn load_trace(path: &Path, duration_s: f64, limit: Option<usize>) -> Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the trace {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let r = parse_trace_line(line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        if r.timestamp as f64 > duration_s * 1000.0 || limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        out.push(r);
    }
    if out.is_empty() {
        bail!("no trace records selected from {}", path.display());
    }
    // Arrival order (the file is sorted; make sure).
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
}

/// The 512 token ids of trace block `id` (deterministic in `id` and `seed`).
pub fn block_tokens(id: u64, seed: u64) -> Vec<u32> {
    let mut rng = Rng::from_seed(id.wrapping_mul(0xA24B_AED4_963E_E407) ^ seed.rotate_left(32) ^ 0x5EED);
    random_tokens(&mut rng, TRACE_BLOCK_TOKENS)
}

/// The seed of trace block `id`'s text chunk.
fn block_seed(id: u64, seed: u64) -> u64 {
    mix(id ^ mix(seed ^ 0x4D4F_4F4E_4341_4B45))
}

/// The text of trace block `id`: 512 tokens with the tokenizer `text` was
/// built for (deterministic in `id` and `seed`).
pub fn block_text(text: &TextGen, id: u64, seed: u64) -> String {
    text.chunk(block_seed(id, seed), TRACE_BLOCK_TOKENS)
}

/// The id of `r`'s block `i` (request `request` of the trace): from
/// `hash_ids`, else one no other request uses.
fn block_id(r: &TraceRecord, i: usize, request: usize) -> u64 {
    r.hash_ids
        .get(i)
        .copied()
        .unwrap_or(u64::MAX - (request as u64) * 1024 - i as u64)
}

/// The text form of [`prompt_tokens`]: the blocks' chunks (each built once,
/// kept in `chunks`), the last one cut to its first tokens.
fn prompt_text(
    r: &TraceRecord,
    len: u32,
    seed: u64,
    request: usize,
    text: &TextGen,
    chunks: &mut HashMap<u64, Arc<str>>,
) -> TextPrompt {
    let len = len as usize;
    let mut out = TextPrompt::default();
    for i in 0..len.div_ceil(TRACE_BLOCK_TOKENS) {
        let id = block_id(r, i, request);
        let take = (len - i * TRACE_BLOCK_TOKENS).min(TRACE_BLOCK_TOKENS);
        if take == TRACE_BLOCK_TOKENS {
            let chunk = chunks.entry(id).or_insert_with(|| block_text(text, id, seed).into());
            out.push(chunk.clone());
        } else {
            out.push(text.chunk_prefix(block_seed(id, seed), TRACE_BLOCK_TOKENS, take));
        }
    }
    out
}

/// The prompt of `r`: its blocks' tokens, cut to `len` (blocks missing
/// from `hash_ids` come from ids no other request uses).
fn prompt_tokens(r: &TraceRecord, len: u32, seed: u64, request: usize) -> Vec<u32> {
    let len = len as usize;
    let mut out = Vec::with_capacity(len);
    let mut i = 0;
    while out.len() < len {
        let id = block_id(r, i, request);
        let block = block_tokens(id, seed);
        let take = (len - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
        i += 1;
    }
    out
}

/// The trace at `path`: its first `duration_s` trace seconds (at most
/// `limit` requests), outputs capped at `max_output`, block tokens salted
/// with `seed`; with `text`, in the text form too.
pub fn load(
    path: &Path,
    duration_s: f64,
    limit: Option<usize>,
    max_output: u32,
    seed: u64,
    text: Option<&TextGen>,
) -> Result<Workload> {
    let records = load_trace(path, duration_s, limit)?;
    let t0 = records[0].timestamp;
    let mut truncated = 0;
    let mut chunks = HashMap::new();
    let requests = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (prompt_len, output_tokens, cut) = fit_to_context(r.input_length, r.output_length, max_output);
            truncated += usize::from(cut);
            Request {
                at_s: (r.timestamp - t0) as f64 / 1000.0,
                prompt: prompt_tokens(r, prompt_len, seed, i),
                text: text.map(|t| prompt_text(r, prompt_len, seed, i, t, &mut chunks)),
                output_tokens,
                session: None,
                chat: None,
            }
        })
        .collect();
    Ok(Workload::new(
        WorkloadKind::Mooncake,
        requests,
        path.display().to_string(),
        truncated,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::VOCAB;

    #[test]
    fn trace_lines_parse() {
        let r = parse_trace_line(r#"{"timestamp": 27, "input_length": 700, "output_length": 3, "hash_ids": [0, 46]}"#)
            .unwrap();
        assert_eq!(
            r,
            TraceRecord {
                timestamp: 27,
                input_length: 700,
                output_length: 3,
                hash_ids: vec![0, 46]
            }
        );
        assert!(parse_trace_line(r#"{"timestamp": 1}"#).is_err());
        assert!(parse_trace_line("not json").is_err());
    }

    #[test]
    fn equal_block_ids_give_equal_tokens_and_different_ids_differ() {
        let a = block_tokens(42, 0);
        assert_eq!(a.len(), TRACE_BLOCK_TOKENS);
        assert_eq!(a, block_tokens(42, 0));
        assert_ne!(a, block_tokens(43, 0));
        assert_ne!(a, block_tokens(42, 1));
        assert!(a.iter().all(|t| u64::from(*t) < VOCAB));
        // Two requests sharing their first block share its 512 tokens.
        let r1 = TraceRecord {
            timestamp: 0,
            input_length: 700,
            output_length: 5,
            hash_ids: vec![0, 1],
        };
        let r2 = TraceRecord {
            hash_ids: vec![0, 2],
            ..r1.clone()
        };
        let (p1, p2) = (prompt_tokens(&r1, 700, 0, 0), prompt_tokens(&r2, 700, 0, 1));
        assert_eq!((p1.len(), p2.len()), (700, 700));
        assert_eq!(p1[..512], p2[..512]);
        assert_ne!(p1[512..], p2[512..]);
        assert_eq!(p1[512..], block_tokens(1, 0)[..188]);
    }

    #[test]
    fn block_text_is_deterministic_and_shared_ids_share_their_text() {
        let (tok, seed) = (semlb_tokenizer::Tokenizer::bundled(), 5);
        let text = TextGen::new(&tok);
        let a = block_text(&text, 42, seed);
        assert_eq!(a, block_text(&text, 42, seed));
        assert_ne!(a, block_text(&text, 43, seed));
        assert_ne!(a, block_text(&text, 42, seed + 1));
        assert_eq!(tok.encode(&a).len(), TRACE_BLOCK_TOKENS);
        let record = |hash_ids: Vec<u64>, input_length| TraceRecord {
            timestamp: 0,
            input_length,
            output_length: 5,
            hash_ids,
        };
        let mut chunks = HashMap::new();
        let mut prompt = |r: &TraceRecord, i| prompt_text(r, r.input_length, seed, i, &text, &mut chunks).text();
        // [a, b, c] starts with exactly the text of [a, b].
        let ab = prompt(&record(vec![1, 2], 1024), 0);
        let abc = prompt(&record(vec![1, 2, 3], 1500), 1);
        assert_eq!(ab, block_text(&text, 1, seed) + &block_text(&text, 2, seed));
        assert!(abc.starts_with(&ab));
        // As many tokens as the trace says, the shared ones equal.
        let (ab_ids, abc_ids) = (tok.encode(&ab), tok.encode(&abc));
        assert_eq!((ab_ids.len(), abc_ids.len()), (1024, 1500));
        assert_eq!(abc_ids[..1024], ab_ids[..]);
        // A partial last block is the first tokens of its whole block.
        let abcd = tok.encode(&prompt(&record(vec![1, 2, 3, 4], 2048), 2));
        assert_eq!(abcd[..1500], abc_ids[..]);
        // Blocks the trace does not name are the request's own.
        let short = prompt(&record(vec![1], 1100), 3);
        assert!(short.starts_with(&block_text(&text, 1, seed)));
        assert_eq!(tok.encode(&short).len(), 1100);
        assert!(!prompt(&record(vec![1], 1100), 4).ends_with(&short[short.len() - 200..]));
    }

    #[test]
    fn a_trace_file_becomes_timed_requests_deterministically() {
        let dir = std::env::temp_dir().join(format!("semlb-mooncake-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.jsonl");
        let trace = "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 1500, \"input_length\": 40000, \"output_length\": 4000, \"hash_ids\": [0, 2]}\n\
             {\"timestamp\": 9000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}\n";
        std::fs::write(&path, trace).unwrap();
        let w = load(&path, 5.0, None, 2048, 0, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(w.requests.len(), 2);
        assert_eq!((w.requests[0].at_s, w.requests[1].at_s), (0.0, 0.5));
        assert_eq!(w.requests[0].prompt.len(), 600);
        assert_eq!(w.requests[1].prompt.len(), 32_768 - 2048);
        assert_eq!(w.requests[1].output_tokens, 2048);
        assert_eq!(w.requests[0].prompt[..512], w.requests[1].prompt[..512]);
        assert_eq!((w.truncated, w.has_sessions()), (1, false));
        assert!(w.requests.iter().all(|r| r.text.is_none()));
        // The text form: the same requests, with text as long as their ids.
        let tok = semlb_tokenizer::Tokenizer::bundled();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, trace).unwrap();
        let t = load(&path, 5.0, None, 2048, 0, Some(&TextGen::new(&tok))).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        for (a, b) in w.requests.iter().zip(&t.requests) {
            assert_eq!(
                (a.at_s, &a.prompt, a.output_tokens),
                (b.at_s, &b.prompt, b.output_tokens)
            );
            assert_eq!(tok.encode(&b.text.as_ref().unwrap().text()).len(), a.prompt.len());
        }
        assert_eq!(t.prompt_form(), Some(crate::workload::PromptForm::Text));
        assert_eq!(w.prompt_form(), Some(crate::workload::PromptForm::Tokens));
    }
}
