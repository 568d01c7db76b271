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
//! missing from `hash_ids` come from ids no other request uses. The output
//! length is `output_length` (capped by `--max-output`); prompts longer
//! than the context keep their first `32 768 − output` tokens. The trace
//! has no session ids.
//!
//! The first 600 s hold ~1 800 requests (~3 req/s) and offer ~34 000
//! prompt tokens/s, of which ~23 000 still need prefill with perfect prefix
//! reuse: ~58 % of the 40 000 tokens/s of four engines, and the working set
//! (millions of tokens) far exceeds their KV caches.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::{Request, Workload, WorkloadKind, fit_to_context, random_tokens};
use semlb_test_support::Rng;

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

/// The prompt of `r`: its blocks' tokens, cut to `len` (blocks missing
/// from `hash_ids` come from ids no other request uses).
fn prompt_tokens(r: &TraceRecord, len: u32, seed: u64, request: usize) -> Vec<u32> {
    let len = len as usize;
    let mut out = Vec::with_capacity(len);
    let mut i = 0;
    while out.len() < len {
        let id = r
            .hash_ids
            .get(i)
            .copied()
            .unwrap_or(u64::MAX - (request as u64) * 1024 - i as u64);
        let block = block_tokens(id, seed);
        let take = (len - out.len()).min(block.len());
        out.extend_from_slice(&block[..take]);
        i += 1;
    }
    out
}

/// The trace at `path`: its first `duration_s` trace seconds (at most
/// `limit` requests), outputs capped at `max_output`, block tokens salted
/// with `seed`.
pub fn load(path: &Path, duration_s: f64, limit: Option<usize>, max_output: u32, seed: u64) -> Result<Workload> {
    let records = load_trace(path, duration_s, limit)?;
    let t0 = records[0].timestamp;
    let mut truncated = 0;
    let requests = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (prompt_len, output_tokens, cut) = fit_to_context(r.input_length, r.output_length, max_output);
            truncated += usize::from(cut);
            Request {
                at_s: (r.timestamp - t0) as f64 / 1000.0,
                prompt: prompt_tokens(r, prompt_len, seed, i),
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
    fn a_trace_file_becomes_timed_requests_deterministically() {
        let dir = std::env::temp_dir().join(format!("semlb-mooncake-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 1500, \"input_length\": 40000, \"output_length\": 4000, \"hash_ids\": [0, 2]}\n\
             {\"timestamp\": 9000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}\n",
        )
        .unwrap();
        let w = load(&path, 5.0, None, 2048, 0).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(w.requests.len(), 2);
        assert_eq!((w.requests[0].at_s, w.requests[1].at_s), (0.0, 0.5));
        assert_eq!(w.requests[0].prompt.len(), 600);
        assert_eq!(w.requests[1].prompt.len(), 32_768 - 2048);
        assert_eq!(w.requests[1].output_tokens, 2048);
        assert_eq!(w.requests[0].prompt[..512], w.requests[1].prompt[..512]);
        assert_eq!((w.truncated, w.has_sessions()), (1, false));
    }
}
