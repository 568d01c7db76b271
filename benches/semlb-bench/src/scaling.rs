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

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use semlb::routing::{self, Candidate, PolicyConfig, Reason, RouteInput};
use semlb::store::redis::client::{RedisStore, WriteItem};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shm_layout::{LayoutPlan, PrefixMatch, ResponseKey, Segment, ServerRef};

use super::Common;
use super::dispatch_path::{
    FAKE_SERVERS, REDIS_TTL, RedisNamespace, ShmGuard, connect_store, cores, full_chain, hasher, load_workload,
    machine, prefault, redis_version, register_fake_servers, response_key, unique_suffix,
};
use super::output::{self, Table};
use super::plot::{self, Line};
use super::redis_server::BenchRedis;

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

// ---------------------------------------------------------------------------
// Routing on a Redis match.

/// A Redis match (`(slot, blocks)` pairs) as the [`PrefixMatch`] a
/// policy takes: each pair counts for the candidate in that slot (pairs of
/// slots without a live candidate are left out, as the shm match leaves out
/// servers that are not live).
pub fn redis_match(pairs: &[(u64, u32)], candidates: &[Candidate]) -> PrefixMatch {
    let mut m = PrefixMatch::default();
    for &(id, blocks) in pairs {
        // The fake servers' ids are their slots.
        if let Some(c) = candidates.iter().find(|c| u64::from(c.server.slot) == id) {
            m.add(c.server.tag(), blocks);
        }
    }
    m
}

// ---------------------------------------------------------------------------
// The parent.

/// Temporary file removed when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Running workers, killed if still running when dropped (on errors).
struct Workers {
    children: Vec<Child>,
    stdins: Vec<ChildStdin>,
    stdouts: Vec<BufReader<ChildStdout>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

impl Workers {
    /// The stderr of worker `i`, after it exited (for error messages).
    fn stderr_of(&mut self, i: usize) -> String {
        let c = &mut self.children[i];
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
        let mut s = String::new();
        if let Some(e) = c.stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s.trim().to_owned()
    }

    /// Reads worker `i`'s next stdout line.
    fn line(&mut self, i: usize, what: &str) -> Result<String> {
        let mut line = String::new();
        let n = self.stdouts[i]
            .read_line(&mut line)
            .with_context(|| format!("worker {i}: reading {what}"))?;
        if n == 0 {
            let err = self.stderr_of(i);
            bail!(
                "worker {i} exited before {what}: {}",
                if err.is_empty() { "no message" } else { &err }
            );
        }
        Ok(line)
    }
}

/// Where the workers of a point find their store.
struct Target<'a> {
    shm_name: &'a str,
    redis: Option<(&'a str, &'a str)>,
}

fn run_point(store: Store, procs: usize, secs: f64, chains: &Path, target: &Target<'_>) -> Result<Vec<WorkerReport>> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let mut workers = Workers {
        children: Vec::new(),
        stdins: Vec::new(),
        stdouts: Vec::new(),
    };
    for i in 0..procs {
        let mut cmd = Command::new(&exe);
        cmd.arg("__bench-worker")
            .args(["--store", store.name()])
            .arg("--chains")
            .arg(chains)
            .args(["--secs", &secs.to_string()])
            .args(["--worker", &i.to_string(), "--workers", &procs.to_string()]);
        match store {
            Store::Shm => {
                cmd.args(["--shm-name", target.shm_name]);
            }
            Store::Redis1rt | Store::RedisNaive => {
                let (url, ns) = target.redis.ok_or_else(|| anyhow!("no Redis for {}", store.name()))?;
                cmd.args(["--redis-url", url, "--namespace", ns]);
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {} __bench-worker", exe.display()))?;
        workers.stdins.push(child.stdin.take().context("worker stdin")?);
        workers
            .stdouts
            .push(BufReader::new(child.stdout.take().context("worker stdout")?));
        workers.children.push(child);
    }
    for i in 0..procs {
        let line = workers.line(i, "ready")?;
        if line.trim() != "ready" {
            bail!("worker {i} said {:?} instead of ready", line.trim());
        }
    }
    for (i, stdin) in workers.stdins.iter_mut().enumerate() {
        stdin
            .write_all(b"go\n")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("cannot start worker {i}"))?;
    }
    let mut reports = Vec::with_capacity(procs);
    for i in 0..procs {
        let line = workers.line(i, "its report")?;
        reports.push(parse_report(&line)?);
    }
    for i in 0..procs {
        let status = workers.children[i].wait()?;
        if !status.success() {
            let err = workers.stderr_of(i);
            bail!("worker {i} exited with {status}: {err}");
        }
    }
    Ok(reports)
}

/// Runs the report.
pub fn run(args: &ScalingArgs) -> Result<()> {
    if args.processes.is_empty() || args.processes.contains(&0) {
        bail!("--processes: give one or more counts of at least 1, e.g. 1,2,4");
    }
    if !(args.secs.is_finite() && args.secs > 0.0) {
        bail!("--secs {}: must be a positive number of seconds", args.secs);
    }
    if args.requests == 0 {
        bail!("--requests must be at least 1");
    }
    let hasher = hasher(args.block_size)?;
    let workload = load_workload(&args.common, args.requests)?;
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
    let points = stores.len() * args.processes.len();
    let n = workload.turns.len();
    let bar = output::progress((n + points) as u64, "scaling: tokenize");

    // Chains, computed once (not timed).
    let mut records = Vec::with_capacity(n);
    for turn in &workload.turns {
        let tokens = workload.tokenizer.encode(&turn.prompt);
        let mut chain = Vec::new();
        hasher.chain(&tokens, &mut chain);
        let answer = workload.tokenizer.encode(&turn.answer);
        let full = full_chain(&hasher, &tokens, &answer, &chain);
        records.push(ChainRecord {
            prompt: chain,
            full,
            key: format!("{:032x}", response_key(&turn.prompt).0),
            answer_bytes: turn.answer.len(),
        });
        bar.inc(1);
    }
    let mean_blocks = records.iter().map(|r| r.prompt.len()).sum::<usize>() as f64 / n as f64;
    let chains = TempFile(std::env::temp_dir().join(format!("semlb-bench-scaling-{}.json", unique_suffix())));
    let file = ChainFile { requests: records };
    std::fs::write(&chains.0, serde_json::to_vec(&file)?)
        .with_context(|| format!("cannot write {}", chains.0.display()))?;

    // Pre-warm: every prompt + answer chain, spread over the fake servers.
    bar.set_message("scaling: pre-warm");
    let (shm, servers) = ShmGuard::create("scaling")?;
    {
        let t = shm.segment().tables();
        let stamp = shm.segment().clock().stamp();
        for (i, r) in file.requests.iter().enumerate() {
            t.prefix.insert_chain(&r.full, servers[i % servers.len()], stamp);
        }
    }
    let mut redis_meta = Value::Null;
    let namespace = match &redis {
        Some(r) => {
            let ns = RedisNamespace::new(r.url(), "scaling");
            let mut store = connect_store(r.url(), ns.name())?;
            for (i, rec) in file.requests.iter().enumerate() {
                store
                    .insert_chain(&rec.full, (i % FAKE_SERVERS) as u64, now_ms())
                    .context("pre-warming Redis")?;
            }
            redis_meta = json!({
                "version": redis_version(r.url()).unwrap_or_else(|e| format!("unknown ({e})")),
                "url": r.url(),
                "private_server": args.common.redis_url.is_none(),
                "namespace": ns.name(),
            });
            Some(ns)
        }
        None => None,
    };

    // The points.
    let target = Target {
        shm_name: shm.name(),
        redis: redis
            .as_ref()
            .zip(namespace.as_ref())
            .map(|(r, ns)| (r.url(), ns.name())),
    };
    let mut results: Vec<(Store, usize, Vec<WorkerReport>)> = Vec::new();
    for &store in &stores {
        for &procs in &args.processes {
            bar.set_message(format!("scaling: {} ×{procs}", store.name()));
            let reports = run_point(store, procs, args.secs, &chains.0, &target)
                .with_context(|| format!("{} with {procs} processes", store.name()))?;
            results.push((store, procs, reports));
            bar.inc(1);
        }
    }
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
    let rate_of = |store: Store, procs: usize| -> Option<f64> {
        results
            .iter()
            .find(|(s, p, _)| *s == store && *p == procs)
            .map(|(_, _, r)| r.iter().map(WorkerReport::rate).sum())
    };
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
    for &store in &stores {
        let mut line = Line {
            label: store.name().to_owned(),
            points: Vec::new(),
        };
        let base = rate_of(store, base_procs).unwrap_or(0.0);
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
    let mut ratios = Vec::new();
    if stores.contains(&Store::Shm) && stores.len() > 1 {
        let others: Vec<Store> = stores.iter().copied().filter(|s| *s != Store::Shm).collect();
        let mut header = vec!["processes".to_owned()];
        header.extend(others.iter().map(|s| format!("shm / {}", s.name())));
        let mut rt = Table::new(header);
        for &procs in &args.processes {
            let shm_rate = rate_of(Store::Shm, procs).unwrap_or(0.0);
            let mut row = vec![procs.to_string()];
            for &o in &others {
                let r = rate_of(o, procs).filter(|r| *r > 0.0).map_or(0.0, |r| shm_rate / r);
                row.push(format!("{r:.0}x"));
                ratios.push(json!({"processes": procs, "store": o.name(), "shm_over_store": r}));
            }
            rt.row(row);
        }
        output::print_table("Throughput ratios, shm over Redis", &rt);
    }
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
        &format!("dispatch decisions per second ({cores} cores)"),
        "processes",
        "decisions/s (log)",
        true,
        &lines,
    )?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

// ---------------------------------------------------------------------------
// The worker.

/// One decision in this many includes a write-back.
pub const WRITEBACK_EVERY: u64 = 10;

/// A request as a worker uses it.
struct Request {
    prompt: Vec<u64>,
    full: Vec<u64>,
    key: ResponseKey,
    answer: Vec<u8>,
}

fn load_requests(path: &Path) -> Result<Vec<Request>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file: ChainFile =
        serde_json::from_slice(&bytes).with_context(|| format!("bad chain file {}", path.display()))?;
    let requests = file
        .requests
        .into_iter()
        .map(|r| {
            Ok(Request {
                key: parse_key(&r.key)?,
                answer: vec![b'a'; r.answer_bytes],
                prompt: r.prompt,
                full: r.full,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if requests.is_empty() {
        bail!("{} holds no requests", path.display());
    }
    Ok(requests)
}

/// Runs one load process: prepare, print `ready`, wait for a line on
/// stdin, make decisions for `--secs`, print a [`WorkerReport`].
pub fn run_worker(args: &WorkerArgs) -> Result<()> {
    let requests = load_requests(&args.chains)?;
    let policy = routing::build(&PolicyConfig::default());
    let start_at = args.worker * requests.len() / args.workers.max(1);
    let mut report = WorkerReport {
        worker: args.worker,
        decisions: 0,
        secs: 0.0,
        prefix_routed: 0,
        cache_hits: 0,
        writebacks: 0,
        round_trips: 0,
    };
    match args.store {
        Store::Shm => {
            let name = args
                .shm_name
                .as_deref()
                .context("--shm-name is required for store shm")?;
            let seg = Segment::open(name).with_context(|| format!("cannot open shm segment {name}"))?;
            prefault(&seg);
            let t = seg.tables();
            let clock = seg.clock();
            let mut candidates = Vec::new();
            let mut buf = Vec::new();
            let mut entry = Vec::new();
            wait_for_go()?;
            let start = Instant::now();
            let mut i = start_at;
            loop {
                for _ in 0..64 {
                    let r = &requests[i % requests.len()];
                    if t.responses.get_into(r.key, &mut buf).is_some() {
                        report.cache_hits += 1;
                    }
                    let m = t.prefix.longest_prefix_match(&r.prompt, |s| t.servers.is_live(s));
                    routing::live_candidates(&t, &mut candidates);
                    let tokens = (r.prompt.len() * semlb::prefix::blocks::DEFAULT_BLOCK_SIZE) as u32;
                    let choice = policy.choose(&RouteInput::new(
                        &r.prompt,
                        tokens,
                        semlb::prefix::blocks::DEFAULT_BLOCK_SIZE as u32,
                        &m,
                        &candidates,
                    ));
                    let Some(choice) = choice else {
                        bail!("no live server in the segment")
                    };
                    if matches!(choice.reason, Reason::Prefix { .. }) {
                        report.prefix_routed += 1;
                    }
                    if report.decisions.is_multiple_of(WRITEBACK_EVERY) {
                        t.prefix.insert_chain(&r.full, choice.server, clock.stamp());
                        semlb::response_cache::encode_entry(clock.now_ms(), &r.answer, &mut entry);
                        let _ = t.responses.put(r.key, &entry);
                        report.writebacks += 1;
                    }
                    report.decisions += 1;
                    i += 1;
                }
                if start.elapsed().as_secs_f64() >= args.secs {
                    break;
                }
            }
            report.secs = start.elapsed().as_secs_f64();
        }
        Store::Redis1rt | Store::RedisNaive => {
            let url = args
                .redis_url
                .as_deref()
                .context("--redis-url is required for Redis stores")?;
            let ns = args
                .namespace
                .as_deref()
                .context("--namespace is required for Redis stores")?;
            let mut store: RedisStore = connect_store(url, ns)?;
            // The candidates: four fake servers in a process-local table.
            let local = Segment::heap(&LayoutPlan::for_size(8 << 20).context("cannot plan a local table")?);
            let servers: Vec<ServerRef> = register_fake_servers(&local)?;
            debug_assert_eq!(servers.len(), FAKE_SERVERS);
            let lt = local.tables();
            let mut candidates = Vec::new();
            let naive = args.store == Store::RedisNaive;
            let rt0 = store.round_trips();
            wait_for_go()?;
            let start = Instant::now();
            let mut i = start_at;
            loop {
                for _ in 0..16 {
                    let r = &requests[i % requests.len()];
                    // What the gateway's Redis store reads for a decision:
                    // response, in-flight figures and prefix in one pipeline.
                    let found = store.dispatch_lookup(Some(r.key.0), &r.prompt, naive)?;
                    if found.response.is_some() {
                        report.cache_hits += 1;
                    }
                    routing::live_candidates(&lt, &mut candidates);
                    let m = redis_match(&found.prefix, &candidates);
                    let tokens = (r.prompt.len() * semlb::prefix::blocks::DEFAULT_BLOCK_SIZE) as u32;
                    let choice = policy
                        .choose(&RouteInput::new(
                            &r.prompt,
                            tokens,
                            semlb::prefix::blocks::DEFAULT_BLOCK_SIZE as u32,
                            &m,
                            &candidates,
                        ))
                        .context("no live server")?;
                    if matches!(choice.reason, Reason::Prefix { .. }) {
                        report.prefix_routed += 1;
                    }
                    if report.decisions.is_multiple_of(WRITEBACK_EVERY) {
                        // A response process's write-back: one pipeline.
                        let item = WriteItem {
                            server: u64::from(choice.server.slot),
                            blocks: &r.full,
                            response: Some((r.key.0, &r.answer, REDIS_TTL)),
                        };
                        store.write_back(&[item], 1, now_ms())?;
                        report.writebacks += 1;
                    }
                    report.decisions += 1;
                    i += 1;
                }
                if start.elapsed().as_secs_f64() >= args.secs {
                    break;
                }
            }
            report.secs = start.elapsed().as_secs_f64();
            report.round_trips = store.round_trips() - rt0;
        }
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&report)?)?;
    out.flush()?;
    Ok(())
}

/// Says `ready` and blocks until the parent writes a line.
fn wait_for_go() -> Result<()> {
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "ready")?;
        out.flush()?;
    }
    let mut line = String::new();
    let n = std::io::stdin().lock().read_line(&mut line).context("waiting for go")?;
    if n == 0 || line.trim() != "go" {
        bail!("expected go on stdin, got {:?}", line.trim());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::LayoutPlan;

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

    #[test]
    fn redis_matches_route_like_shm_matches() {
        let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let servers = register_fake_servers(&seg).unwrap();
        let t = seg.tables();
        let policy = routing::build(&PolicyConfig::default());
        let chain: Vec<u64> = (1..=10u64)
            .map(|i| i.wrapping_mul(semlb_test_support::rng::GAMMA))
            .collect();
        // Server 2 holds 8 of 10 blocks, server 1 holds 3.
        t.prefix.insert_chain(&chain[..3], servers[1], shm_layout::Stamp(1));
        t.prefix.insert_chain(&chain[..8], servers[2], shm_layout::Stamp(1));
        let mut cands = Vec::new();
        routing::live_candidates(&t, &mut cands);
        let shm = t.prefix.longest_prefix_match(&chain, |s| t.servers.is_live(s));
        // What RedisStore::longest_prefix_match returns for it, plus a slot
        // with no live server.
        let redis = redis_match(&[(1, 3), (2, 8), (9, 10)], &cands);
        assert_eq!(redis.best(), shm.best());
        assert_eq!(redis.blocks_for(servers[1].tag()), 3);
        for prompt_blocks in [10usize, 20, 0] {
            let chain = vec![1u64; prompt_blocks];
            let choose = |m: &PrefixMatch| {
                policy
                    .choose(&RouteInput::new(&chain, prompt_blocks as u32 * 16, 16, m, &cands))
                    .unwrap()
                    .reason
            };
            assert_eq!(choose(&redis), choose(&shm), "{prompt_blocks} blocks");
        }
        assert!(redis_match(&[], &cands).is_empty());
    }
}
