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
//! The shared pieces of the workload (dialogue replay, tokenizer choice,
//! throw-away shm segment and Redis namespace, run metadata) are public here
//! and reused by [`super::scaling`].

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use semlb::prefix::blocks::BlockHasher;
use semlb::store::redis::client::{RedisStore, WriteItem};
use semlb_tokenizer::Tokenizer;
use serde_json::{Value, json};
use shm_layout::{LayoutPlan, ResponseKey, Segment, ServerRef};

use super::Common;
use super::output::{self, Table};
use super::plot::{self, Panel, Series};
use super::redis_server::BenchRedis;

/// The prompts file, relative to the data directory.
pub const PROMPTS_FILE: &str = "prompts/hh-rlhf-helpful-base-test.jsonl";
/// The tokenizer, relative to the data directory.
pub const TOKENIZER_FILE: &str = "tokenizers/qwen3-tokenizer.json";
/// The model name block-hash chains are rooted at (any fixed name will do).
pub const MODEL: &str = "semlb-bench";
/// Size of the throw-away shm segments.
pub const SEGMENT_BYTES: u64 = 256 << 20;
/// Fake inference servers registered in the segments.
pub const FAKE_SERVERS: usize = 4;
/// TTL of the prefix entries and responses written to Redis.
pub const REDIS_TTL: Duration = Duration::from_secs(3600);
/// Connect, read and write timeout of the benchmark's Redis connections.
pub const REDIS_TIMEOUT: Duration = Duration::from_secs(5);

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

// ---------------------------------------------------------------------------
// The workload, shared with the scaling report.

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

// ---------------------------------------------------------------------------
// Throw-away state: a shm segment and a Redis namespace.

/// A uniquely named POSIX shm segment, removed when dropped (also on errors).
#[derive(Debug)]
pub struct ShmGuard {
    segment: Segment,
    name: String,
}

impl ShmGuard {
    /// Creates `semlb-bench-<tag>-<pid>-<time>` of [`SEGMENT_BYTES`] with
    /// [`FAKE_SERVERS`] registered servers.
    pub fn create(tag: &str) -> Result<(Self, Vec<ServerRef>)> {
        let name = format!("semlb-bench-{tag}-{}", unique_suffix());
        let plan = LayoutPlan::for_size(SEGMENT_BYTES).context("cannot plan the bench segment")?;
        let segment = Segment::create(&name, &plan).with_context(|| {
            format!(
                "cannot create the shm segment {name} ({} MiB in /dev/shm)",
                SEGMENT_BYTES >> 20
            )
        })?;
        let guard = Self { segment, name };
        prefault(&guard.segment);
        let servers = register_fake_servers(&guard.segment)?;
        Ok((guard, servers))
    }

    /// The segment.
    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    /// Its name (for other processes to open it).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ShmGuard {
    fn drop(&mut self) {
        let _ = Segment::remove(&self.name);
    }
}

/// Maps every page of `segment` into this process (one read per page), so
/// the first touches of a fresh segment do not count as lookup time: a
/// serving dispatcher's pages are mapped long before.
pub fn prefault(segment: &Segment) -> u64 {
    let mut sum = 0u64;
    for w in segment.raw_words().iter().step_by(4096 / 8) {
        sum = sum.wrapping_add(w.load(std::sync::atomic::Ordering::Relaxed));
    }
    std::hint::black_box(sum)
}

/// Registers [`FAKE_SERVERS`] servers (slots 0, 1, …) in `segment`.
pub fn register_fake_servers(segment: &Segment) -> Result<Vec<ServerRef>> {
    let t = segment.tables();
    (0..FAKE_SERVERS)
        .map(|i| {
            t.servers
                .register(
                    i as u64 + 1,
                    &format!("http://127.0.0.1:{}", 18000 + i),
                    segment.clock().now_ms(),
                )
                .map_err(|e| anyhow!("cannot register fake server {i}: {e}"))
        })
        .collect()
}

/// `<pid>-<nanoseconds since the epoch, hex>`: unique per run on a host.
pub fn unique_suffix() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{:x}", std::process::id(), nanos & 0xffff_ffff_ffff)
}

/// A Redis namespace unique to this run, whose keys are deleted on drop.
#[derive(Debug)]
pub struct RedisNamespace {
    url: String,
    namespace: String,
}

impl RedisNamespace {
    /// `semlb-bench-<tag>-<pid>-<time>` on `url`.
    pub fn new(url: &str, tag: &str) -> Self {
        Self {
            url: url.to_owned(),
            namespace: format!("semlb-bench-{tag}-{}", unique_suffix()),
        }
    }

    /// The namespace (a key prefix; sub-namespaces are `<ns>:<name>`).
    pub fn name(&self) -> &str {
        &self.namespace
    }

    /// A store under `<ns>:<sub>`.
    pub fn store(&self, sub: &str) -> Result<RedisStore> {
        connect_store(&self.url, &format!("{}:{sub}", self.namespace))
    }

    /// Deletes every key of the namespace (SCAN + DEL); returns how many.
    pub fn clear(&self) -> Result<u64> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut conn = client.get_connection_with_timeout(REDIS_TIMEOUT)?;
        let pattern = format!("{}:*", self.namespace);
        let mut cursor: u64 = 0;
        let mut deleted = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query(&mut conn)?;
            if !keys.is_empty() {
                deleted += redis::cmd("DEL").arg(&keys).query::<u64>(&mut conn)?;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }
}

impl Drop for RedisNamespace {
    fn drop(&mut self) {
        if let Err(e) = self.clear() {
            eprintln!("warning: could not delete Redis namespace {}: {e:#}", self.namespace);
        }
    }
}

/// A [`RedisStore`] on `url` under `namespace`, with the benchmark's TTL
/// and timeout.
pub fn connect_store(url: &str, namespace: &str) -> Result<RedisStore> {
    RedisStore::connect_with_timeout(url, namespace, REDIS_TTL, REDIS_TIMEOUT)
        .with_context(|| format!("cannot connect to Redis at {url}"))
}

/// The `redis_version` of `INFO server` at `url`.
pub fn redis_version(url: &str) -> Result<String> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_connection_with_timeout(REDIS_TIMEOUT)?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    info_field(&info, "redis_version").ok_or_else(|| anyhow!("INFO server has no redis_version"))
}

/// The value of `field` in an `INFO` reply (`field:value` lines).
pub fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

// ---------------------------------------------------------------------------
// Run metadata.

/// `YYYY-MM-DDThh:mm:ssZ` of `secs` seconds since the Unix epoch.
pub fn iso_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The machine a report ran on: date, cores, CPU model, OS.
pub fn machine() -> Value {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines().find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
    });
    json!({
        "date": iso_utc(secs),
        "cores": cores(),
        "cpu": cpu,
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

/// Cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

// ---------------------------------------------------------------------------
// The report.

/// One request, prepared once: its chains and key, and the time its
/// tokenization and hashing took.
struct Prepared {
    chain: Vec<u64>,
    full: Vec<u64>,
    key: ResponseKey,
    answer: Vec<u8>,
    tokens: usize,
    tokenize_us: f64,
    hash_us: f64,
}

/// Per-request stage latencies (µs) of one store.
#[derive(Debug, Default)]
struct Stages {
    cache: Vec<f64>,
    lpm: Vec<f64>,
    update: Vec<f64>,
    round_trips: u64,
    /// Cache lookup and match were one pipelined round trip, timed together
    /// in `lpm` (`cache` holds zeros).
    fused: bool,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// p50, p99, mean, max of `v` (µs) as JSON.
fn summary(v: &[f64]) -> Value {
    let mut s = v.to_vec();
    output::sort(&mut s);
    let mean = if s.is_empty() {
        0.0
    } else {
        s.iter().sum::<f64>() / s.len() as f64
    };
    json!({
        "p50_us": output::quantile(&s, 0.5),
        "p99_us": output::quantile(&s, 0.99),
        "mean_us": mean,
        "max_us": s.last().copied().unwrap_or(0.0),
    })
}

fn p(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    output::sort(&mut s);
    output::quantile(&s, q)
}

fn fmt_us(us: f64) -> String {
    output::human_ns(us * 1e3)
}

/// Runs the report.
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

    // Tokenize and hash once (the same for every store).
    let mut prepared = Vec::with_capacity(total);
    for turn in &workload.turns {
        let t0 = Instant::now();
        let tokens = workload.tokenizer.encode(&turn.prompt);
        let tokenize_us = us(t0.elapsed());
        let t1 = Instant::now();
        let mut chain = Vec::new();
        hasher.chain(&tokens, &mut chain);
        let hash_us = us(t1.elapsed());
        let answer_tokens = workload.tokenizer.encode(&turn.answer);
        let full = full_chain(&hasher, &tokens, &answer_tokens, &chain);
        prepared.push(Prepared {
            chain,
            full,
            key: response_key(&turn.prompt),
            answer: turn.answer.as_bytes().to_vec(),
            tokens: tokens.len(),
            tokenize_us,
            hash_us,
        });
        bar.inc(1);
    }

    // Shared memory.
    bar.set_message("dispatch: shm");
    let (shm, servers) = ShmGuard::create("dispatch")?;
    let mut rows: Vec<(&str, Stages)> = vec![("shm", run_shm(&shm, &servers, &prepared, warmup, &bar))];

    // Redis.
    let mut redis_meta = Value::Null;
    let mut namespace = None;
    if let Some(r) = &redis {
        let version = redis_version(r.url()).unwrap_or_else(|e| format!("unknown ({e})"));
        let ns = RedisNamespace::new(r.url(), "dispatch");
        redis_meta = json!({
            "version": version,
            "url": r.url(),
            "private_server": args.common.redis_url.is_none(),
            "namespace": ns.name(),
        });
        for (name, mode) in [
            ("redis-1rt", RedisMode::OneTrip),
            ("redis-naive", RedisMode::Naive),
            ("redis-pipelined", RedisMode::Pipelined),
        ] {
            bar.set_message(format!("dispatch: {name}"));
            let mut store = ns.store(name)?;
            let st = run_redis(&mut store, mode, &prepared, warmup, &bar).with_context(|| format!("{name} pass"))?;
            rows.push((name, st));
        }
        namespace = Some(ns);
    }
    bar.finish_and_clear();
    let deleted = match namespace.take() {
        Some(ns) => {
            let n = ns
                .clear()
                .with_context(|| format!("cannot delete Redis namespace {}", ns.name()))?;
            Some(n)
        }
        None => None,
    };
    drop(redis);
    drop(shm);

    // Figures.
    let recorded = &prepared[warmup..];
    let tokenize: Vec<f64> = recorded.iter().map(|r| r.tokenize_us).collect();
    let hash: Vec<f64> = recorded.iter().map(|r| r.hash_us).collect();
    let mean_tokens = recorded.iter().map(|r| r.tokens).sum::<usize>() as f64 / measured as f64;
    let mean_blocks = recorded.iter().map(|r| r.chain.len()).sum::<usize>() as f64 / measured as f64;
    let mean_full_blocks = recorded.iter().map(|r| r.full.len()).sum::<usize>() as f64 / measured as f64;

    println!(
        "\nsemlb bench dispatch: {measured} requests (+{warmup} warm-up), dialogue turns replayed in order; \
         mean prompt {mean_tokens:.0} tokens = {mean_blocks:.1} blocks of {} (prompt + answer {mean_full_blocks:.1} blocks)",
        args.block_size
    );
    println!("prompts: {}", workload.source);
    println!("tokenizer: {}", workload.tokenizer_name);
    if workload.synthetic {
        println!(
            "NOTE: no data directory: synthetic dialogues and the bundled phi-2 tokenizer; figures are not comparable with real prompts"
        );
    }
    println!("machine: {} cores", cores());
    match &redis_meta {
        Value::Null => println!("Redis: skipped (--no-redis): Redis rows and ratios left out"),
        m => println!(
            "Redis: {} {} (version {})",
            if args.common.redis_url.is_some() {
                "given"
            } else {
                "private loopback redis-server"
            },
            m["url"].as_str().unwrap_or(""),
            m["version"].as_str().unwrap_or("?")
        ),
    }

    let mut common_table = Table::new(["stage (every store)", "p50", "p99"]);
    common_table.row([
        "tokenize".to_owned(),
        fmt_us(p(&tokenize, 0.5)),
        fmt_us(p(&tokenize, 0.99)),
    ]);
    common_table.row(["hash".to_owned(), fmt_us(p(&hash, 0.5)), fmt_us(p(&hash, 0.99))]);
    output::print_table("Stages before the tables", &common_table);

    let mut table = Table::new([
        "store",
        "cache p50",
        "cache p99",
        "match p50",
        "match p99",
        "update p50",
        "update p99",
        "total p50",
        "total p99",
        "+tok p50",
        "+tok p99",
        "RT/req",
    ]);
    let mut json_stores = Vec::new();
    let mut totals = Vec::new();
    let mut panels = [
        Panel {
            title: "dispatch without tokenization".into(),
            x_label: "µs per request (hash + cache + match + update)".into(),
            log_x: true,
            series: Vec::new(),
        },
        Panel {
            title: "dispatch with tokenization".into(),
            x_label: "µs per request (tokenize + the above)".into(),
            log_x: true,
            series: Vec::new(),
        },
    ];
    for (name, st) in &rows {
        let no_tok: Vec<f64> = (0..measured)
            .map(|i| hash[i] + st.cache[i] + st.lpm[i] + st.update[i])
            .collect();
        let with_tok: Vec<f64> = (0..measured).map(|i| tokenize[i] + no_tok[i]).collect();
        let rt = st.round_trips as f64 / measured as f64;
        let fused = |v: String| if st.fused { "(in match)".to_owned() } else { v };
        table.row([
            name.to_string(),
            fused(fmt_us(p(&st.cache, 0.5))),
            fused(fmt_us(p(&st.cache, 0.99))),
            fmt_us(p(&st.lpm, 0.5)),
            fmt_us(p(&st.lpm, 0.99)),
            fmt_us(p(&st.update, 0.5)),
            fmt_us(p(&st.update, 0.99)),
            fmt_us(p(&no_tok, 0.5)),
            fmt_us(p(&no_tok, 0.99)),
            fmt_us(p(&with_tok, 0.5)),
            fmt_us(p(&with_tok, 0.99)),
            if *name == "shm" { "0".into() } else { format!("{rt:.1}") },
        ]);
        json_stores.push(json!({
            "store": name,
            "cache": summary(&st.cache),
            "match": summary(&st.lpm),
            "update": summary(&st.update),
            "total_without_tokenization": summary(&no_tok),
            "total_with_tokenization": summary(&with_tok),
            "round_trips_per_request": rt,
        }));
        totals.push((
            name.to_string(),
            [p(&no_tok, 0.5), p(&no_tok, 0.99), p(&with_tok, 0.5), p(&with_tok, 0.99)],
        ));
        panels[0].series.push(Series {
            label: name.to_string(),
            values: no_tok,
        });
        panels[1].series.push(Series {
            label: name.to_string(),
            values: with_tok,
        });
    }
    output::print_table(
        "Per store (total = hash + cache + match + update; +tok adds tokenization; RT = Redis round trips;\n\
         redis-pipelined: cache and match in one pipeline, as `semlb serve --store redis` does)",
        &table,
    );

    let mut ratios = Vec::new();
    if totals.len() > 1 {
        let shm = totals[0].1;
        let mut rt = Table::new(["Redis / shm", "total p50", "total p99", "+tok p50", "+tok p99"]);
        for (name, t) in &totals[1..] {
            let r: Vec<f64> = (0..4).map(|i| if shm[i] > 0.0 { t[i] / shm[i] } else { 0.0 }).collect();
            rt.row([
                name.clone(),
                format!("{:.1}x", r[0]),
                format!("{:.1}x", r[1]),
                format!("{:.2}x", r[2]),
                format!("{:.2}x", r[3]),
            ]);
            ratios.push(json!({
                "store": name,
                "without_tokenization_p50": r[0],
                "without_tokenization_p99": r[1],
                "with_tokenization_p50": r[2],
                "with_tokenization_p99": r[3],
            }));
        }
        output::print_table("Latency ratios, Redis over shm", &rt);
    }

    let report = json!({
        "report": "dispatch",
        "machine": machine(),
        "workload": {
            "prompts": workload.source,
            "synthetic": workload.synthetic,
            "tokenizer": workload.tokenizer_name,
            "requests": measured,
            "warmup": warmup,
            "block_size": args.block_size,
            "mean_prompt_tokens": mean_tokens,
            "mean_prompt_blocks": mean_blocks,
            "mean_full_blocks": mean_full_blocks,
        },
        "redis": redis_meta,
        "redis_keys_deleted": deleted,
        "stages": { "tokenize": summary(&tokenize), "hash": summary(&hash) },
        "stores": json_stores,
        "ratios_redis_over_shm": ratios,
    });
    let json_path = output::write_json(&args.common.out, "dispatch", &report)?;
    let svg_path = args.common.out.join("dispatch.svg");
    plot::cdf_svg(&svg_path, &panels)?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

/// The server a write-back is for: `best` if any, else the i-th in turn.
fn pick(servers: &[ServerRef], best: Option<u16>, i: usize) -> ServerRef {
    best.and_then(|slot| servers.iter().copied().find(|s| s.slot == slot))
        .unwrap_or(servers[i % servers.len()])
}

fn run_shm(
    shm: &ShmGuard,
    servers: &[ServerRef],
    prepared: &[Prepared],
    warmup: usize,
    bar: &indicatif::ProgressBar,
) -> Stages {
    let seg = shm.segment();
    let t = seg.tables();
    let clock = seg.clock();
    let mut st = Stages::default();
    let mut buf = Vec::new();
    let mut entry = Vec::new();
    for (i, r) in prepared.iter().enumerate() {
        let t0 = Instant::now();
        std::hint::black_box(t.responses.get_into(r.key, &mut buf).is_some());
        let cache = t0.elapsed();
        let t1 = Instant::now();
        let m = t.prefix.longest_prefix_match(&r.chain, |s| t.servers.is_live(s));
        let lpm = t1.elapsed();
        let server = pick(servers, m.best().map(|(tag, _)| tag.slot()), i);
        let t2 = Instant::now();
        t.prefix.insert_chain(&r.full, server, clock.stamp());
        semlb::response_cache::encode_entry(clock.now_ms(), &r.answer, &mut entry);
        let _ = std::hint::black_box(t.responses.put(r.key, &entry));
        let update = t2.elapsed();
        if i >= warmup {
            st.cache.push(us(cache));
            st.lpm.push(us(lpm));
            st.update.push(us(update));
        }
        bar.inc(1);
    }
    st
}

/// How a Redis pass reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RedisMode {
    /// Cache `GET`, then the longest-prefix script: a round trip each.
    OneTrip,
    /// Cache `GET`, then one `HGETALL` per block (the paper's baseline).
    Naive,
    /// Cache, load and prefix in one pipeline (the gateway's lookup).
    Pipelined,
}

fn run_redis(
    store: &mut RedisStore,
    mode: RedisMode,
    prepared: &[Prepared],
    warmup: usize,
    bar: &indicatif::ProgressBar,
) -> Result<Stages> {
    let servers: Vec<u16> = (0..FAKE_SERVERS as u16).collect();
    let mut st = Stages::default();
    let mut rt_at_warmup = store.round_trips();
    for (i, r) in prepared.iter().enumerate() {
        if i == warmup {
            rt_at_warmup = store.round_trips();
        }
        let (cache, lpm, m) = if mode == RedisMode::Pipelined {
            let t0 = Instant::now();
            let found = store.dispatch_lookup(Some(r.key.0), &r.chain, false)?;
            (Duration::ZERO, t0.elapsed(), found.prefix)
        } else {
            let t0 = Instant::now();
            std::hint::black_box(store.get_response(r.key.0)?);
            let cache = t0.elapsed();
            let t1 = Instant::now();
            let m = if mode == RedisMode::Naive {
                store.longest_prefix_match_naive(&r.chain)?
            } else {
                store.longest_prefix_match(&r.chain)?
            };
            (cache, t1.elapsed(), m)
        };
        let slot = m
            .iter()
            .max_by_key(|(_, blocks)| *blocks)
            .map_or(servers[i % servers.len()], |(s, _)| *s as u16);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let t2 = Instant::now();
        // A response process's write-back: one pipeline.
        let item = WriteItem {
            server: u64::from(slot),
            blocks: &r.full,
            response: Some((r.key.0, &r.answer, REDIS_TTL)),
        };
        store.write_back(&[item], 1, now)?;
        let update = t2.elapsed();
        if i >= warmup {
            st.cache.push(us(cache));
            st.lpm.push(us(lpm));
            st.update.push(us(update));
        }
        bar.inc(1);
    }
    st.round_trips = store.round_trips() - rt_at_warmup;
    st.fused = mode == RedisMode::Pipelined;
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn dates_are_iso_utc() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso_utc(1_795_000_000), "2026-11-18T11:06:40Z");
    }

    #[test]
    fn info_fields_are_found() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(info_field(info, "redis_version").as_deref(), Some("7.0.15"));
        assert_eq!(info_field(info, "redis_mode"), None);
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
