//! The workload `semlb bench dispatch` and `semlb bench scaling` replay:
//! HH-RLHF dialogues turn by turn (or synthetic ones without a data
//! directory), the tokenizer they are encoded with, and the block-hash
//! chains and response-cache keys a request is looked up by.

use anyhow::{Context, Result, bail};
use semlb::prefix::blocks::BlockHasher;
use semlb_tokenizer::Tokenizer;
use serde_json::Value;
use shm_layout::ResponseKey;

use crate::Common;

/// The prompts file, relative to the data directory.
pub const PROMPTS_FILE: &str = "prompts/hh-rlhf-helpful-base-test.jsonl";
/// The tokenizer, relative to the data directory.
pub const TOKENIZER_FILE: &str = "tokenizers/qwen3-tokenizer.json";
/// The model name block-hash chains are rooted at (any fixed name will do).
pub const MODEL: &str = "semlb-bench";

/// One request of a replayed dialogue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// The dialogue up to and including the k-th `\n\nAssistant:`.
    pub prompt: String,
    /// The assistant's reply that follows (the "generated" answer).
    pub answer: String,
}

const HUMAN: &str = "\n\nHuman:";
const ASSISTANT: &str = "\n\nAssistant:";

/// The requests of one HH-RLHF dialogue (`\n\nHuman: … \n\nAssistant: …`
/// alternating): the k-th is the text up to the k-th `Assistant:` with the
/// reply after it as the answer.
pub fn dialogue_turns(dialogue: &str) -> Vec<Turn> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = dialogue[from..].find(ASSISTANT) {
        let end = from + at + ASSISTANT.len();
        let reply_end = dialogue[end..].find(HUMAN).map_or(dialogue.len(), |i| end + i);
        out.push(Turn {
            prompt: dialogue[..end].to_owned(),
            answer: dialogue[end..reply_end].to_owned(),
        });
        from = reply_end;
    }
    out
}

/// `count` requests of synthetic four-turn dialogues with growing prefixes
/// (when there is no data directory).
pub fn synthetic_turns(count: usize) -> Vec<Turn> {
    let mut out = Vec::with_capacity(count);
    let mut c = 0;
    while out.len() < count {
        let mut prompt = format!("{HUMAN} conversation {c}: how do prefix caches help LLM serving?");
        for t in 0..4 {
            prompt.push_str(ASSISTANT);
            let answer = format!(" turn {t}: {}", "cached prefixes save prefill time. ".repeat(8));
            out.push(Turn {
                prompt: prompt.clone(),
                answer: answer.clone(),
            });
            prompt.push_str(&answer);
            prompt.push_str(&format!("{HUMAN} and then, in case {t}?"));
        }
        c += 1;
    }
    out.truncate(count);
    out
}

/// The requests a report replays and the tokenizer it uses.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The requests, dialogue after dialogue, turns in order.
    pub turns: Vec<Turn>,
    /// Where they come from (a path, or "synthetic …").
    pub source: String,
    /// True when there was no data directory (synthetic dialogues, bundled tokenizer).
    pub synthetic: bool,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// Its name and origin.
    pub tokenizer_name: String,
}

/// At most `limit` requests: from the data directory when there is one
/// (an error if its prompts or tokenizer are missing), else synthetic ones
/// with the bundled phi-2 tokenizer.
pub fn load_workload(common: &Common, limit: usize) -> Result<Workload> {
    let Some(data) = common.data_dir() else {
        return Ok(Workload {
            turns: synthetic_turns(limit),
            source: "synthetic four-turn dialogues (no data directory: pass --data or set SEMLB_BENCH_DATA)".into(),
            synthetic: true,
            tokenizer: Tokenizer::bundled(),
            tokenizer_name: "phi-2 (bundled; no data directory)".into(),
        });
    };
    let prompts = data.join(PROMPTS_FILE);
    let text = std::fs::read_to_string(&prompts).with_context(|| {
        format!(
            "cannot read the prompts {} (data directory {})",
            prompts.display(),
            data.display()
        )
    })?;
    let mut turns = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON object", prompts.display(), n + 1))?;
        let Some(dialogue) = v["chosen"].as_str() else {
            bail!("{}:{}: no \"chosen\" string", prompts.display(), n + 1);
        };
        turns.extend(dialogue_turns(dialogue));
        if turns.len() >= limit {
            break;
        }
    }
    turns.truncate(limit);
    if turns.is_empty() && limit > 0 {
        bail!("{} holds no dialogue turns", prompts.display());
    }
    let tok_path = data.join(TOKENIZER_FILE);
    let tokenizer =
        Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))?;
    Ok(Workload {
        turns,
        source: prompts.display().to_string(),
        synthetic: false,
        tokenizer,
        tokenizer_name: format!("qwen3 ({})", tok_path.display()),
    })
}

/// The response-cache key of a prompt (xxh3-128 of its text; the gateway
/// hashes the canonical request body, which costs the same).
pub fn response_key(prompt: &str) -> ResponseKey {
    ResponseKey(xxhash_rust::xxh3::xxh3_128(prompt.as_bytes()))
}

/// A block hasher for the benchmark's chains.
pub fn hasher(block_size: usize) -> Result<BlockHasher> {
    if block_size == 0 || block_size > 1024 {
        bail!("--block-size {block_size}: must be between 1 and 1024 tokens");
    }
    Ok(BlockHasher::new(BlockHasher::root_for(MODEL, 7), block_size))
}

/// Full chain of prompt + answer, continuing `prompt_chain`.
pub fn full_chain(
    hasher: &BlockHasher,
    prompt_tokens: &[u32],
    answer_tokens: &[u32],
    prompt_chain: &[u64],
) -> Vec<u64> {
    let mut all = Vec::with_capacity(prompt_tokens.len() + answer_tokens.len());
    all.extend_from_slice(prompt_tokens);
    all.extend_from_slice(answer_tokens);
    let mut chain = prompt_chain.to_vec();
    hasher.extend(&all, &mut chain);
    chain
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch_path::unique_suffix;

    #[test]
    fn dialogues_split_into_growing_turns() {
        let d = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine, thanks";
        let turns = dialogue_turns(d);
        assert_eq!(
            turns,
            vec![
                Turn {
                    prompt: "\n\nHuman: hi\n\nAssistant:".into(),
                    answer: " hello".into(),
                },
                Turn {
                    prompt: "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant:".into(),
                    answer: " fine, thanks".into(),
                },
            ]
        );
        // Each prompt extends the previous prompt + answer.
        assert!(
            turns[1]
                .prompt
                .starts_with(&(turns[0].prompt.clone() + &turns[0].answer))
        );
        assert!(dialogue_turns("\n\nHuman: no reply yet").is_empty());
        let trailing = dialogue_turns("\n\nHuman: q\n\nAssistant:");
        assert_eq!(trailing.len(), 1);
        assert_eq!(trailing[0].answer, "");
    }

    #[test]
    fn synthetic_turns_have_the_count_asked_and_repeat_prefixes() {
        let t = synthetic_turns(10);
        assert_eq!(t.len(), 10);
        assert!(t[1].prompt.starts_with(&t[0].prompt));
        assert!(synthetic_turns(0).is_empty());
    }

    #[test]
    fn full_chains_extend_prompt_chains() {
        let h = hasher(16).unwrap();
        let prompt: Vec<u32> = (0..40).collect();
        let answer: Vec<u32> = (100..150).collect();
        let mut chain = Vec::new();
        h.chain(&prompt, &mut chain);
        let full = full_chain(&h, &prompt, &answer, &chain);
        assert_eq!(chain.len(), 2);
        assert_eq!(full.len(), 5);
        assert_eq!(full[..2], chain[..]);
        assert!(hasher(0).is_err());
    }

    #[test]
    fn missing_data_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("semlb-bench-nodata-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let common = Common {
            out: dir.clone(),
            redis_url: None,
            redis_server: "redis-server".into(),
            no_redis: true,
            data: Some(dir.clone()),
        };
        let err = load_workload(&common, 10).unwrap_err();
        assert!(format!("{err:#}").contains(PROMPTS_FILE), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
