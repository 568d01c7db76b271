//! The dispatch path per stage on each store: shared memory, Redis with one
//! round trip per match (a server-side script), and Redis the naive way
//! (one round trip per block, the sLLM paper's baseline): issue 5's first
//! report, the paper's Figure 7 on our own code.
//!
//! Real multi-turn dialogues (Anthropic HH-RLHF, ../shared/data/prompts)
//! are replayed turn by turn, so prefixes repeat as in a chat service: the
//! k-th request of a dialogue is its text up to the k-th human turn, and the
//! assistant's reply is what the engine "generated". Each request is
//! tokenized (Qwen3 when ../shared has it, else the bundled phi-2), hashed
//! into 16-token blocks, and then, per store: response-cache lookup,
//! longest-prefix match, and the table update a response process makes
//! (prompt + answer chain). The Redis server is a private `redis-server`
//! on a free loopback port, started and stopped here; without the binary
//! the Redis rows are skipped.
//!
//! `cargo bench --bench stores` (`SEMLB_STORES_REQUESTS`, default 3000). It
//! prints p50/p99 per stage and the ratios; it asserts nothing.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use semlb::blocks::BlockHasher;
use semlb::redis_store::RedisStore;
use semlb_workers::tokenize::Tokenizer;
use shm_layout::{LayoutPlan, ResponseKey, Segment, ServerRef, Stamp};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data");

struct Redis(Child, u16);

impl Redis {
    fn start() -> Option<Redis> {
        let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .spawn()
            .ok()?;
        let redis = Redis(child, port);
        let deadline = Instant::now() + Duration::from_secs(10);
        while RedisStore::connect(&redis.url(), "probe", Duration::from_secs(60)).is_err() {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::yield_now();
        }
        Some(redis)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.1)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (prompt, answer) requests: every dialogue replayed turn by turn.
fn requests(limit: usize) -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(Path::new(SHARED).join("prompts/hh-rlhf-helpful-base-test.jsonl")).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(d) = v["chosen"].as_str() else { continue };
        let mut from = 0;
        while let Some(at) = d[from..].find("\n\nAssistant:") {
            let end = from + at + "\n\nAssistant:".len();
            let reply_end = d[end..].find("\n\nHuman:").map_or(d.len(), |i| end + i);
            out.push((d[..end].to_owned(), d[end..reply_end].to_owned()));
            from = reply_end;
            if out.len() >= limit {
                return out;
            }
        }
    }
    if out.is_empty() {
        // Without ../shared: synthetic conversations with growing prefixes.
        for c in 0..limit / 4 {
            let mut prompt = format!("\n\nHuman: conversation {c}: how do caches help LLM serving?");
            for t in 0..4 {
                prompt.push_str("\n\nAssistant:");
                let answer = format!(" turn {t}: {}", "cached prefixes save prefill time. ".repeat(8));
                out.push((prompt.clone(), answer.clone()));
                prompt.push_str(&answer);
                prompt.push_str(&format!("\n\nHuman: and then {t}?"));
            }
        }
    }
    out
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Per-stage latencies (µs) of one store.
#[derive(Default)]
struct Stages {
    cache: Vec<f64>,
    lpm: Vec<f64>,
    update: Vec<f64>,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let limit: usize = std::env::var("SEMLB_STORES_REQUESTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    let (tok_name, tokenizer) = match Tokenizer::from_file(&Path::new(SHARED).join("tokenizers/qwen3-tokenizer.json")) {
        Ok(t) => ("qwen3", t),
        Err(_) => ("phi2 (bundled)", Tokenizer::bundled()),
    };
    let reqs = requests(limit);
    let hasher = BlockHasher::new(BlockHasher::root_for("bench", 7), 16);

    // Tokenize and hash once per request (the same for every store).
    let mut tokenize = Vec::with_capacity(reqs.len());
    let mut hash = Vec::with_capacity(reqs.len());
    let mut work = Vec::with_capacity(reqs.len());
    for (prompt, answer) in &reqs {
        let t0 = Instant::now();
        let tokens = tokenizer.encode(prompt);
        tokenize.push(us(t0.elapsed()));
        let t1 = Instant::now();
        let mut chain = Vec::new();
        hasher.chain(&tokens, &mut chain);
        hash.push(us(t1.elapsed()));
        let mut full = tokens.clone();
        full.extend(tokenizer.encode(answer));
        let mut full_chain = chain.clone();
        hasher.extend(&full, &mut full_chain);
        let key = ResponseKey(xxhash_rust::xxh3::xxh3_128(prompt.as_bytes()));
        work.push((chain, full_chain, key, tokens.len()));
    }
    let mean_tokens = work.iter().map(|w| w.3).sum::<usize>() as f64 / work.len() as f64;
    println!(
        "stores: {} requests (dialogue turns replayed in order), mean prompt {mean_tokens:.0} tokens, tokenizer {tok_name}",
        work.len()
    );

    // Shared memory.
    let seg = Segment::heap(&LayoutPlan::for_size(256 << 20).unwrap());
    let t = seg.tables();
    let servers: Vec<ServerRef> = (0..4)
        .map(|i| t.servers.register(i, &format!("s{i}"), 0).unwrap())
        .collect();
    let mut shm = Stages::default();
    let mut buf = Vec::new();
    for (i, (chain, full, key, _)) in work.iter().enumerate() {
        let t0 = Instant::now();
        std::hint::black_box(t.responses.get_into(*key, &mut buf).is_some());
        shm.cache.push(us(t0.elapsed()));
        let t1 = Instant::now();
        let m = t.prefix.longest_prefix_match(chain, |s| t.servers.is_live(s));
        shm.lpm.push(us(t1.elapsed()));
        let server = m
            .best()
            .map_or(servers[i % 4], |(tag, _)| servers[usize::from(tag.slot())]);
        let t2 = Instant::now();
        t.prefix.insert_chain(full, server, Stamp(1));
        shm.update.push(us(t2.elapsed()));
    }

    // Redis, one round trip per match, and naive.
    let redis = Redis::start();
    let mut rows: Vec<(&str, Stages)> = vec![("shm", shm)];
    match &redis {
        None => println!("(redis-server not installed: Redis rows skipped)"),
        Some(r) => {
            for naive in [false, true] {
                let ns = if naive { "naive" } else { "script" };
                let mut store = RedisStore::connect(&r.url(), ns, Duration::from_secs(3600)).expect("redis");
                let mut st = Stages::default();
                for (i, (chain, full, key, _)) in work.iter().enumerate() {
                    let t0 = Instant::now();
                    std::hint::black_box(store.get_response(key.0).expect("get"));
                    st.cache.push(us(t0.elapsed()));
                    let t1 = Instant::now();
                    let m = if naive {
                        store.longest_prefix_match_naive(chain)
                    } else {
                        store.longest_prefix_match(chain)
                    }
                    .expect("match");
                    st.lpm.push(us(t1.elapsed()));
                    let slot = m.iter().max_by_key(|(_, b)| *b).map_or((i % 4) as u16, |(s, _)| *s);
                    let t2 = Instant::now();
                    store.insert_chain(full, slot, i as u64).expect("insert");
                    st.update.push(us(t2.elapsed()));
                }
                rows.push((if naive { "redis-naive" } else { "redis-1rt" }, st));
            }
        }
    }

    let (tok50, tok99) = (pct(&mut tokenize, 0.5), pct(&mut tokenize, 0.99));
    let (hash50, hash99) = (pct(&mut hash, 0.5), pct(&mut hash, 0.99));
    println!(
        "{:<12} {:>9} {:>9}   (µs; the same for every store)",
        "stage", "p50", "p99"
    );
    println!("{:<12} {tok50:>9.1} {tok99:>9.1}", "tokenize");
    println!("{:<12} {hash50:>9.1} {hash99:>9.1}", "hash");
    println!();
    println!(
        "{:<12} {:>16} {:>16} {:>16} {:>16} {:>12}",
        "store", "cache p50/p99", "match p50/p99", "update p50/p99", "no-tok p50/p99", "+tok p50"
    );
    let mut totals = Vec::new();
    for (name, st) in rows.iter_mut() {
        let mut no_tok: Vec<f64> = (0..st.cache.len())
            .map(|i| hash[i] + st.cache[i] + st.lpm[i] + st.update[i])
            .collect();
        let mut with_tok: Vec<f64> = (0..st.cache.len()).map(|i| tokenize[i] + no_tok[i]).collect();
        let line = format!(
            "{:<12} {:>7.1}/{:>8.1} {:>7.1}/{:>8.1} {:>7.1}/{:>8.1} {:>7.1}/{:>8.1} {:>12.1}",
            name,
            pct(&mut st.cache, 0.5),
            pct(&mut st.cache, 0.99),
            pct(&mut st.lpm, 0.5),
            pct(&mut st.lpm, 0.99),
            pct(&mut st.update, 0.5),
            pct(&mut st.update, 0.99),
            pct(&mut no_tok, 0.5),
            pct(&mut no_tok, 0.99),
            pct(&mut with_tok, 0.5),
        );
        println!("{line}");
        totals.push((name.to_string(), pct(&mut no_tok, 0.5), pct(&mut with_tok, 0.5)));
    }
    if totals.len() == 3 {
        let (s, r, n) = (&totals[0], &totals[1], &totals[2]);
        println!();
        println!(
            "Redis/shm latency ratio (p50): without tokenization {:.1}x (1 round trip), {:.1}x (naive); with tokenization {:.2}x, {:.2}x",
            r.1 / s.1,
            n.1 / s.1,
            r.2 / s.2,
            n.2 / s.2
        );
    }
}
