//! `semlb bench scaling`: dispatch decisions per second with 1, 2, 4, …
//! processes on each store (the sLLM paper's Figure 8 on semlb's code).
//!
//! # What a decision is
//!
//! What a dispatcher does with a request once its prompt is tokenized and
//! hashed, and what a response process does afterwards, in one loop:
//!
//! 1. response-cache lookup of the request's key;
//! 2. longest-prefix match of the prompt's block chain;
//! 3. picking a server with the default routing policy (`cache_aware`,
//!    [`semlb::routing::build`] of the default [`PolicyConfig`]) over the
//!    live servers ([`semlb::routing::live_candidates`] of a server table
//!    with four fake servers);
//! 4. one request in ten: the write-back (insert the prompt + answer chain
//!    for the chosen server, put the response).
//!
//! On shm every step reads or writes the one segment the parent created
//! (256 MiB, unique name, removed at the end, also on errors). On Redis,
//! steps 1, 2 and 4 are [`semlb::store::redis::client::RedisStore`] calls (one
//! round trip each for the cache and, with `redis-1rt`, the match;
//! `redis-naive` matches with one round trip per block; the write-back is
//! two); step 3 turns the Redis match into a [`PrefixMatch`]
//! ([`redis_match`]) and asks the same policy, over the same four fake
//! servers in a process-local server table. Load counters are not read
//! from Redis (the gateway's Redis mode pipelines that with the match):
//! the Redis figures are a best case for Redis.
//!
//! # How
//!
//! The parent loads the same dialogues as `semlb bench dispatch` (HH-RLHF
//! turns, Qwen3 tokenizer; synthetic ones and phi-2 without a data
//! directory), tokenizes and hashes them once (not timed), writes the chains
//! to a temporary JSON file, and pre-warms the shm prefix table and a Redis
//! namespace of its own with every prompt + answer chain, so matches hit.
//! For each store and process count it starts real processes
//! (`semlb-bench __bench-worker`, this binary), which open the segment or connect
//! to Redis, load the chains, print `ready` and block on stdin; when all
//! are ready the parent writes `go` to each, they run for `--secs`, and
//! each prints one JSON line of counts ([`WorkerReport`]). No sleeps: the
//! pipes are the barrier. Decisions per second of a point are the sum of
//! the workers' own rates. Each worker walks the requests in order from its
//! own starting point.
//!
//! With more processes than cores the processes share cores (the report
//! says so); the Redis rows also share the cores with `redis-server`.
//!
//! ```sh
//! semlb bench scaling                              # 1, 2, 4 processes, 3 s per point
//! semlb bench scaling --processes 1,2 --secs 1 --no-redis
//! ```
//!
//! Output: a table of store × processes (decisions/s, speedup over one
//! process, share routed by prefix) and the shm/Redis ratios,
//! `<out>/scaling.json`, and `<out>/scaling.svg` (decisions/s over processes
//! per store, log y).
//!
//! | file | what |
//! | --- | --- |
//! | here | the flags, the chains, the pre-warm, the points in turn, the tables and files |
//! | [`points`] | one point: its workers started, released together, and read |
//! | [`worker`] | a load process and its decisions on shm or Redis |

mod points;
mod worker;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use semlb::prefix::blocks::BlockHasher;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shm_layout::{ResponseKey, ServerRef};

pub use worker::{WRITEBACK_EVERY, redis_match, run_worker};

use super::Common;
use super::dispatch_path::{
    FAKE_SERVERS, RedisNamespace, ShmGuard, Workload, connect_store, cores, full_chain, hasher, load_workload, machine,
    redis_meta, response_key, unique_suffix,
};
use super::output::{self, Table};
use super::plot::{self, Line};
use super::redis_server::BenchRedis;
use points::{Target, TempFile, run_points};
use worker::now_ms;

/// The stores a decision can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum Store {
    /// The shared-memory segment.
    #[value(name = "shm")]
    #[serde(rename = "shm")]
    Shm,
    /// Redis, longest-prefix match in one round trip (server-side script).
    #[value(name = "redis-1rt")]
    #[serde(rename = "redis-1rt")]
    Redis1rt,
    /// Redis, one round trip per block (the paper's baseline).
    #[value(name = "redis-naive")]
    #[serde(rename = "redis-naive")]
    RedisNaive,
}

impl Store {
    /// Its name on the command line and in outputs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Shm => "shm",
            Self::Redis1rt => "redis-1rt",
            Self::RedisNaive => "redis-naive",
        }
    }
}

/// `semlb bench scaling` flags.
#[derive(Debug, Clone, Args)]
pub struct ScalingArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// Process counts to measure, comma-separated.
    #[arg(long, value_name = "N,…", value_delimiter = ',', default_value = "1,2,4")]
    pub processes: Vec<usize>,
    /// Seconds each point runs.
    #[arg(long, value_name = "SECS", default_value_t = 3.0)]
    pub secs: f64,
    /// Requests (dialogue turns) the workers cycle through.
    #[arg(long, value_name = "N", default_value_t = 3000)]
    pub requests: usize,
    /// Tokens per block of the hash chain.
    #[arg(long, value_name = "TOKENS", default_value_t = semlb::prefix::blocks::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Stores to measure, comma-separated (Redis ones are skipped with --no-redis).
    #[arg(
        long,
        value_name = "STORE,…",
        value_delimiter = ',',
        default_value = "shm,redis-1rt,redis-naive"
    )]
    pub stores: Vec<Store>,
}

impl ScalingArgs {
    /// The defaults, with `common`.
    pub fn with(common: Common) -> Self {
        Self {
            common,
            processes: vec![1, 2, 4],
            secs: 3.0,
            requests: 3000,
            block_size: semlb::prefix::blocks::DEFAULT_BLOCK_SIZE,
            stores: vec![Store::Shm, Store::Redis1rt, Store::RedisNaive],
        }
    }
}

/// `semlb-bench __bench-worker` flags (set by `semlb bench scaling`).
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// The store to run decisions on.
    #[arg(long, value_enum)]
    pub store: Store,
    /// The JSON file of pre-computed requests ([`ChainFile`]).
    #[arg(long, value_name = "PATH")]
    pub chains: PathBuf,
    /// Seconds to run after `go`.
    #[arg(long, value_name = "SECS")]
    pub secs: f64,
    /// This worker's index (its starting request).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub worker: usize,
    /// Number of workers of this point.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub workers: usize,
    /// The shm segment to open (store `shm`).
    #[arg(long, value_name = "NAME")]
    pub shm_name: Option<String>,
    /// The Redis URL (Redis stores).
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
    /// The Redis namespace (Redis stores).
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
}

/// One pre-computed request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainRecord {
    /// The prompt's block chain.
    pub prompt: Vec<u64>,
    /// The prompt + answer chain (starts with `prompt`).
    pub full: Vec<u64>,
    /// The response-cache key, 32 hex digits.
    pub key: String,
    /// Bytes of the answer (the response a write-back stores is this many bytes).
    pub answer_bytes: usize,
}

/// What the parent hands its workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainFile {
    /// The requests.
    pub requests: Vec<ChainRecord>,
}

/// A worker's result: its one line of JSON on stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Worker index.
    pub worker: usize,
    /// Decisions made.
    pub decisions: u64,
    /// Seconds they took (from `go` to the last decision).
    pub secs: f64,
    /// Decisions routed to a server for its prefix.
    pub prefix_routed: u64,
    /// Response-cache hits.
    pub cache_hits: u64,
    /// Write-backs made.
    pub writebacks: u64,
    /// Redis round trips (0 on shm).
    pub round_trips: u64,
}

impl WorkerReport {
    /// Decisions per second.
    pub fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.decisions as f64 / self.secs
        } else {
            0.0
        }
    }
}

/// Parses a worker's result line.
pub fn parse_report(line: &str) -> Result<WorkerReport> {
    serde_json::from_str(line.trim()).with_context(|| format!("bad worker report {:?}", line.trim()))
}

/// Parses a 32-hex-digit response key.
pub fn parse_key(hex: &str) -> Result<ResponseKey> {
    u128::from_str_radix(hex, 16)
        .map(ResponseKey)
        .with_context(|| format!("bad response key {hex:?}"))
}

/// Runs the report: the chains computed once and written for the
/// workers, the stores pre-warmed, every point run, then the tables and
/// files.
pub fn run(args: &ScalingArgs) -> Result<()> {
    check(args)?;
    let hasher = hasher(args.block_size)?;
    let workload = load_workload(&args.common, args.requests)?;
    let (stores, redis) = stores_to_measure(args)?;
    let points = stores.len() * args.processes.len();
    let n = workload.turns.len();
    let bar = output::progress((n + points) as u64, "scaling: tokenize");
    let (chains, file) = write_chains(&workload, &hasher, &bar)?;
    let mean_blocks = file.requests.iter().map(|r| r.prompt.len()).sum::<usize>() as f64 / n as f64;

    // Pre-warm: every prompt + answer chain, spread over the fake servers.
    bar.set_message("scaling: pre-warm");
    let (shm, servers) = ShmGuard::create("scaling")?;
    prewarm_shm(&shm, &servers, &file);
    let namespace = match &redis {
        Some(r) => Some(prewarm_redis(r, &file)?),
        None => None,
    };
    let redis_meta = match redis.as_ref().zip(namespace.as_ref()) {
        Some((r, ns)) => redis_meta(r.url(), args.common.redis_url.is_none(), ns),
        None => Value::Null,
    };

    // The points.
    let target = Target {
        shm_name: shm.name(),
        redis: redis
            .as_ref()
            .zip(namespace.as_ref())
            .map(|(r, ns)| (r.url(), ns.name())),
    };
    let results = run_points(args, &stores, &chains.0, &target, &bar)?;
    bar.finish_and_clear();
    let deleted = match &namespace {
        Some(ns) => Some(
            ns.clear()
                .with_context(|| format!("cannot delete Redis namespace {}", ns.name()))?,
        ),
        None => None,
    };
    drop(namespace);
    drop(redis);
    drop(shm);
    drop(chains);

    // Figures.
    print_settings(args, &workload, mean_blocks, &redis_meta);
    let (json_points, lines) = points_table(args, &stores, &results);
    let ratios = ratios(args, &stores, &results);
    let report = json!({
        "report": "scaling",
        "machine": machine(),
        "workload": {
            "prompts": workload.source,
            "synthetic": workload.synthetic,
            "tokenizer": workload.tokenizer_name,
            "requests": n,
            "block_size": args.block_size,
            "mean_prompt_blocks": mean_blocks,
            "secs_per_point": args.secs,
            "processes": args.processes,
            "writeback_every": WRITEBACK_EVERY,
            "policy": "cache_aware (default parameters)",
            "fake_servers": FAKE_SERVERS,
        },
        "redis": redis_meta,
        "redis_keys_deleted": deleted,
        "points": json_points,
        "ratios_shm_over_redis": ratios,
    });
    let json_path = output::write_json(&args.common.out, "scaling", &report)?;
    let svg_path = args.common.out.join("scaling.svg");
    plot::line_svg(
        &svg_path,
        &format!("dispatch decisions per second ({} cores)", cores()),
        "processes",
        "decisions/s (log)",
        true,
        &lines,
    )?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

/// Refuses flags that make no run: no process count or a zero one, a
/// run time that is not a positive number, no requests.
fn check(args: &ScalingArgs) -> Result<()> {
    if args.processes.is_empty() || args.processes.contains(&0) {
        bail!("--processes: give one or more counts of at least 1, e.g. 1,2,4");
    }
    if !(args.secs.is_finite() && args.secs > 0.0) {
        bail!("--secs {}: must be a positive number of seconds", args.secs);
    }
    if args.requests == 0 {
        bail!("--requests must be at least 1");
    }
    Ok(())
}

/// The stores asked for, each once in the order given, and the Redis
/// the Redis ones run on: without one (`--no-redis`, or none asked for)
/// shm alone.
fn stores_to_measure(args: &ScalingArgs) -> Result<(Vec<Store>, Option<BenchRedis>)> {
    let mut stores: Vec<Store> = Vec::new();
    for s in &args.stores {
        if !stores.contains(s) {
            stores.push(*s);
        }
    }
    let wants_redis = stores.iter().any(|s| *s != Store::Shm);
    let redis = if wants_redis {
        BenchRedis::for_run(&args.common)?
    } else {
        None
    };
    if redis.is_none() {
        stores.retain(|s| *s == Store::Shm);
    }
    Ok((stores, redis))
}

/// Computes every request's chains and key once (not timed) and writes
/// them to a temporary file for the workers.
fn write_chains(
    workload: &Workload,
    hasher: &BlockHasher,
    bar: &indicatif::ProgressBar,
) -> Result<(TempFile, ChainFile)> {
    let mut records = Vec::with_capacity(workload.turns.len());
    for turn in &workload.turns {
        let tokens = workload.tokenizer.encode(&turn.prompt);
        let mut chain = Vec::new();
        hasher.chain(&tokens, &mut chain);
        let answer = workload.tokenizer.encode(&turn.answer);
        let full = full_chain(hasher, &tokens, &answer, &chain);
        records.push(ChainRecord {
            prompt: chain,
            full,
            key: format!("{:032x}", response_key(&turn.prompt).0),
            answer_bytes: turn.answer.len(),
        });
        bar.inc(1);
    }
    let chains = TempFile(std::env::temp_dir().join(format!("semlb-bench-scaling-{}.json", unique_suffix())));
    let file = ChainFile { requests: records };
    std::fs::write(&chains.0, serde_json::to_vec(&file)?)
        .with_context(|| format!("cannot write {}", chains.0.display()))?;
    Ok((chains, file))
}

/// Inserts every prompt + answer chain into the shm prefix table, spread
/// over the fake servers.
fn prewarm_shm(shm: &ShmGuard, servers: &[ServerRef], file: &ChainFile) {
    let t = shm.segment().tables();
    let stamp = shm.segment().clock().stamp();
    for (i, r) in file.requests.iter().enumerate() {
        t.prefix.insert_chain(&r.full, servers[i % servers.len()], stamp);
    }
}

/// A namespace of the run's own on `redis`, with every prompt + answer
/// chain inserted, spread over the fake servers.
fn prewarm_redis(redis: &BenchRedis, file: &ChainFile) -> Result<RedisNamespace> {
    let ns = RedisNamespace::new(redis.url(), "scaling");
    let mut store = connect_store(redis.url(), ns.name())?;
    for (i, rec) in file.requests.iter().enumerate() {
        store
            .insert_chain(&rec.full, (i % FAKE_SERVERS) as u64, now_ms())
            .context("pre-warming Redis")?;
    }
    Ok(ns)
}

/// Prints what was measured, with which tokenizer, on how many cores and
/// which Redis.
fn print_settings(args: &ScalingArgs, workload: &Workload, mean_blocks: f64, redis_meta: &Value) {
    let n = workload.turns.len();
    let cores = cores();
    println!(
        "\nsemlb bench scaling: {n} requests (mean prompt {mean_blocks:.1} blocks of {}), {} s per point, {cores} cores",
        args.block_size, args.secs
    );
    println!("prompts: {}", workload.source);
    println!("tokenizer: {}", workload.tokenizer_name);
    if workload.synthetic {
        println!("NOTE: no data directory: synthetic dialogues and the bundled phi-2 tokenizer");
    }
    if redis_meta.is_null() {
        println!("Redis: skipped (--no-redis or not asked for): Redis rows and ratios left out");
    } else {
        println!(
            "Redis: {} (version {}); its server shares the {cores} cores with the workers",
            redis_meta["url"].as_str().unwrap_or(""),
            redis_meta["version"].as_str().unwrap_or("?")
        );
    }
    if args.processes.iter().any(|p| *p > cores) {
        println!("NOTE: points with more processes than the {cores} cores oversubscribe them");
    }
}

/// Decisions per second of `store` with `procs` processes: the sum of
/// its workers' rates (`None`: not measured).
fn rate_of(results: &[(Store, usize, Vec<WorkerReport>)], store: Store, procs: usize) -> Option<f64> {
    results
        .iter()
        .find(|(s, p, _)| *s == store && *p == procs)
        .map(|(_, _, r)| r.iter().map(WorkerReport::rate).sum())
}

/// Prints the table of points (store × processes) and returns them as
/// JSON, and each store's decisions/s over processes as a plot line.
fn points_table(
    args: &ScalingArgs,
    stores: &[Store],
    results: &[(Store, usize, Vec<WorkerReport>)],
) -> (Vec<Value>, Vec<Line>) {
    let cores = cores();
    let base_procs = args.processes[0];
    let mut table = Table::new([
        "store",
        "processes",
        "decisions/s",
        "per process",
        "speedup",
        "prefix-routed",
        "cache hits",
        "RT/decision",
    ]);
    let mut json_points = Vec::new();
    let mut lines = Vec::new();
    for &store in stores {
        let mut line = Line {
            label: store.name().to_owned(),
            points: Vec::new(),
        };
        let base = rate_of(results, store, base_procs).unwrap_or(0.0);
        for (_, procs, reports) in results.iter().filter(|(s, _, _)| *s == store) {
            let rate: f64 = reports.iter().map(WorkerReport::rate).sum();
            let decisions: u64 = reports.iter().map(|r| r.decisions).sum();
            let prefix: u64 = reports.iter().map(|r| r.prefix_routed).sum();
            let hits: u64 = reports.iter().map(|r| r.cache_hits).sum();
            let rts: u64 = reports.iter().map(|r| r.round_trips).sum();
            let share = |x: u64| {
                if decisions > 0 {
                    x as f64 / decisions as f64
                } else {
                    0.0
                }
            };
            let speedup = if base > 0.0 { rate / base } else { 0.0 };
            let over = if *procs > cores { " *" } else { "" };
            table.row([
                store.name().to_owned(),
                format!("{procs}{over}"),
                format!("{rate:.0}"),
                format!("{:.0}", rate / *procs as f64),
                format!("{speedup:.2}x"),
                format!("{:.1}%", 100.0 * share(prefix)),
                format!("{:.1}%", 100.0 * share(hits)),
                if store == Store::Shm {
                    "0".into()
                } else {
                    format!("{:.2}", share(rts))
                },
            ]);
            line.points.push((*procs as f64, rate));
            json_points.push(json!({
                "store": store.name(),
                "processes": procs,
                "oversubscribed": *procs > cores,
                "decisions_per_sec": rate,
                "per_process": rate / *procs as f64,
                "speedup": speedup,
                "prefix_routed_share": share(prefix),
                "cache_hit_share": share(hits),
                "round_trips_per_decision": share(rts),
                "workers": reports,
            }));
        }
        lines.push(line);
    }
    output::print_table(
        &format!(
            "Dispatch decisions per second (speedup over {base_procs} process(es); * = more processes than cores)"
        ),
        &table,
    );
    (json_points, lines)
}

/// Prints shm's decisions/s over each Redis store's, per process count
/// (with shm and another store measured), and returns them as JSON.
fn ratios(args: &ScalingArgs, stores: &[Store], results: &[(Store, usize, Vec<WorkerReport>)]) -> Vec<Value> {
    let mut ratios = Vec::new();
    if stores.contains(&Store::Shm) && stores.len() > 1 {
        let others: Vec<Store> = stores.iter().copied().filter(|s| *s != Store::Shm).collect();
        let mut header = vec!["processes".to_owned()];
        header.extend(others.iter().map(|s| format!("shm / {}", s.name())));
        let mut rt = Table::new(header);
        for &procs in &args.processes {
            let shm_rate = rate_of(results, Store::Shm, procs).unwrap_or(0.0);
            let mut row = vec![procs.to_string()];
            for &o in &others {
                let r = rate_of(results, o, procs)
                    .filter(|r| *r > 0.0)
                    .map_or(0.0, |r| shm_rate / r);
                row.push(format!("{r:.0}x"));
                ratios.push(json!({"processes": procs, "store": o.name(), "shm_over_store": r}));
            }
            rt.row(row);
        }
        output::print_table("Throughput ratios, shm over Redis", &rt);
    }
    ratios
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_reports_round_trip_through_json() {
        let r = WorkerReport {
            worker: 1,
            decisions: 3_000_000,
            secs: 1.5,
            prefix_routed: 2_900_000,
            cache_hits: 10,
            writebacks: 300_000,
            round_trips: 0,
        };
        let line = serde_json::to_string(&r).unwrap() + "\n";
        assert_eq!(parse_report(&line).unwrap(), r);
        assert_eq!(r.rate(), 2_000_000.0);
        assert!(parse_report("ready").is_err());
        assert!(parse_report("{\"worker\": 1}").is_err());
    }

    #[test]
    fn keys_survive_hex() {
        let k = response_key("hello");
        assert_eq!(parse_key(&format!("{:032x}", k.0)).unwrap(), k);
        assert!(parse_key("xyz").is_err());
    }
}
