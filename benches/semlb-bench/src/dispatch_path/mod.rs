//! `semlb bench dispatch`: the dispatch path of one request, stage by
//! stage, on shared memory and on Redis (the sLLM paper's Figure 7 on
//! semlb's own code).
//!
//! # Workload
//!
//! Real multi-turn dialogues (Anthropic HH-RLHF, helpful-base test split:
//! `<data>/prompts/hh-rlhf-helpful-base-test.jsonl`) replayed turn by turn,
//! so prefixes repeat as in a chat service: the k-th request of a dialogue
//! is its text up to the k-th human turn (ending in `Assistant:`), and the
//! assistant's reply is what the engine "generated". Prompts are tokenized
//! with Qwen3's tokenizer (`<data>/tokenizers/qwen3-tokenizer.json`).
//! Without a data directory the report falls back to the phi-2 tokenizer
//! bundled in the binary and synthetic four-turn dialogues, and says so.
//!
//! # Stages
//!
//! Per request, timed one by one with a monotonic clock:
//!
//! | stage | what | where |
//! | --- | --- | --- |
//! | tokenize | the prompt text to token ids | every store (done once) |
//! | hash | token ids to the chain of block hashes ([`semlb::prefix::blocks::BlockHasher`]) | every store (done once) |
//! | cache | the response-cache lookup of the prompt's key | per store |
//! | match | the longest-prefix match of the chain | per store |
//! | update | the write-back a response process makes: insert the prompt + answer chain (which starts with the prompt's chain) for the chosen server, and put the response | per store |
//!
//! The stores:
//!
//! * `shm`: a throw-away POSIX shm segment (256 MiB, unique name, removed at
//!   the end), the tables the gateway uses;
//! * `redis-1rt`: [`semlb::store::redis::client::RedisStore`], whose longest-prefix
//!   match is one round trip (a server-side script walks the chain);
//! * `redis-naive`: the same store matching the way the paper's baseline
//!   does, one `HGETALL` round trip per block until the first miss;
//! * `redis-pipelined`: the cache lookup, the in-flight figures and the
//!   match in one pipeline ([`RedisStore::dispatch_lookup`]), as the gateway
//!   does with `--store redis`; its match column holds both.
//!
//! On every Redis row the update is one pipeline
//! ([`RedisStore::write_back`]), as a response process sends it.
//!
//! Redis is a private loopback `redis-server` ([`super::redis_server`]) or
//! `--redis-url`; the report writes under a namespace of its own and deletes
//! it at the end. Each store replays the same requests in order, one store
//! after the other, after `--warmup` requests that are not recorded. The
//! server a write-back is for is the best match's, else the next of four
//! fake servers in turn.
//!
//! # Output
//!
//! A table of p50/p99 per stage and store, the totals without and with
//! tokenization, and the Redis/shm ratios of both; `<out>/dispatch.json`
//! with every figure and the run's metadata; `<out>/dispatch.svg`, CDFs of
//! the per-request totals (log x, µs).
//!
//! ```sh
//! semlb bench dispatch                       # 3000 requests after 100 warm-up ones
//! semlb bench dispatch --requests 300 --no-redis
//! ```
//!
//! | file | what |
//! | --- | --- |
//! | here | the flags and the run, step by step |
//! | [`workload`] | the dialogues replayed, the tokenizer, chains and keys |
//! | [`stores`] | the throw-away shm segment and Redis namespace, Redis metadata |
//! | [`machine`] | the run's date, cores, CPU and OS |
//! | [`passes`] | tokenizing and hashing once, then timing each store's pass |
//! | [`report`] | the tables, `dispatch.json` and `dispatch.svg` |
//!
//! The shared pieces of the workload (dialogue replay, tokenizer choice,
//! throw-away shm segment and Redis namespace, run metadata) are public here
//! and reused by [`super::scaling`].
//!
//! [`RedisStore::dispatch_lookup`]: semlb::store::redis::client::RedisStore::dispatch_lookup
//! [`RedisStore::write_back`]: semlb::store::redis::client::RedisStore::write_back

mod machine;
mod passes;
mod report;
mod stores;
mod workload;

use anyhow::{Result, bail};
use clap::Args;

pub use machine::{cores, iso_utc, machine};
pub use stores::{
    FAKE_SERVERS, REDIS_TIMEOUT, REDIS_TTL, RedisNamespace, SEGMENT_BYTES, ShmGuard, connect_store, info_field,
    prefault, redis_meta, redis_version, register_fake_servers, unique_suffix,
};
pub use workload::{
    MODEL, PROMPTS_FILE, TOKENIZER_FILE, Turn, Workload, dialogue_turns, full_chain, hasher, load_workload,
    response_key, synthetic_turns,
};

use crate::Common;
use crate::output;
use crate::redis_server::BenchRedis;

/// `semlb bench dispatch` flags.
#[derive(Debug, Clone, Args)]
pub struct DispatchArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// Requests (dialogue turns) measured per store.
    #[arg(long, value_name = "N", default_value_t = 3000)]
    pub requests: usize,
    /// Tokens per block of the hash chain.
    #[arg(long, value_name = "TOKENS", default_value_t = semlb::prefix::blocks::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Requests run through every store before measuring (not recorded).
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub warmup: usize,
}

impl DispatchArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            requests: 3000,
            block_size: semlb::prefix::blocks::DEFAULT_BLOCK_SIZE,
            warmup: 100,
        }
    }
}

/// Runs the report: the requests tokenized and hashed once, replayed on
/// each store, then the tables and files.
pub fn run(args: &DispatchArgs) -> Result<()> {
    if args.requests == 0 {
        bail!("--requests must be at least 1");
    }
    let hasher = hasher(args.block_size)?;
    let workload = load_workload(&args.common, args.warmup + args.requests)?;
    let total = workload.turns.len();
    let warmup = args.warmup.min(total.saturating_sub(1));
    let measured = total - warmup;
    if measured < args.requests {
        eprintln!(
            "note: {} holds {total} turns; measuring {measured} after {warmup} warm-up",
            workload.source
        );
    }
    let redis = BenchRedis::for_run(&args.common)?;
    let stores = 1 + if redis.is_some() { 2 } else { 0 };
    let bar = output::progress((total * (1 + stores)) as u64, "dispatch: tokenize");
    let prepared = passes::prepare(&workload, &hasher, &bar);
    let passes = passes::measure(args, redis, &prepared, warmup, &bar)?;
    report::write(args, &workload, &prepared[warmup..], passes)
}
