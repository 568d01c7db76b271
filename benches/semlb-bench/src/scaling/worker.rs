//! A load process of `semlb bench scaling` (`semlb-bench __bench-worker`):
//! it loads the parent's chains, opens the shm segment or connects to
//! Redis, prints `ready`, waits for `go`, makes dispatch decisions for
//! `--secs` and prints one [`WorkerReport`] line. A Redis match is routed
//! as the shm one is ([`redis_match`]).

use std::io::{BufRead, Write};
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use semlb::routing::{self, Candidate, Policy, PolicyConfig, Reason, RouteInput};
use semlb::store::redis::client::{RedisStore, WriteItem};
use shm_layout::{LayoutPlan, PrefixMatch, ResponseKey, Segment, ServerRef};

use super::{ChainFile, Store, WorkerArgs, WorkerReport, parse_key};
use crate::dispatch_path::{FAKE_SERVERS, REDIS_TTL, connect_store, prefault, register_fake_servers};

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
        Store::Shm => shm_worker(args, &requests, policy.as_ref(), &mut report)?,
        Store::Redis1rt | Store::RedisNaive => redis_worker(args, &requests, policy.as_ref(), &mut report)?,
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&report)?)?;
    out.flush()?;
    Ok(())
}

/// What one decision came to.
struct Decision {
    /// The response cache held the request's answer.
    cache_hit: bool,
    /// The policy routed it for its prefix.
    prefix: bool,
}

/// Makes decisions with `decide` on `requests` in turn, from this
/// worker's starting point, `batch` between looks at the clock, until
/// `--secs` have passed, and counts them into `report`: every
/// [`WRITEBACK_EVERY`]-th decision is told to write back.
fn decide_for(
    args: &WorkerArgs,
    requests: &[Request],
    batch: usize,
    report: &mut WorkerReport,
    mut decide: impl FnMut(&Request, bool) -> Result<Decision>,
) -> Result<()> {
    let start = Instant::now();
    let mut i = args.worker * requests.len() / args.workers.max(1);
    loop {
        for _ in 0..batch {
            let write_back = report.decisions.is_multiple_of(WRITEBACK_EVERY);
            let d = decide(&requests[i % requests.len()], write_back)?;
            report.cache_hits += u64::from(d.cache_hit);
            report.prefix_routed += u64::from(d.prefix);
            report.writebacks += u64::from(write_back);
            report.decisions += 1;
            i += 1;
        }
        if start.elapsed().as_secs_f64() >= args.secs {
            break;
        }
    }
    report.secs = start.elapsed().as_secs_f64();
    Ok(())
}

/// What the policy is asked for request `r` with match `m` over
/// `candidates`.
fn route_input<'a>(r: &'a Request, m: &'a PrefixMatch, candidates: &'a [Candidate]) -> RouteInput<'a> {
    let tokens = (r.prompt.len() * semlb::prefix::blocks::DEFAULT_BLOCK_SIZE) as u32;
    RouteInput::new(
        &r.prompt,
        tokens,
        semlb::prefix::blocks::DEFAULT_BLOCK_SIZE as u32,
        m,
        candidates,
    )
}

/// A worker on the shm segment `--shm-name`: every step on its tables.
fn shm_worker(args: &WorkerArgs, requests: &[Request], policy: &dyn Policy, report: &mut WorkerReport) -> Result<()> {
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
    decide_for(args, requests, 64, report, |r, write_back| {
        let cache_hit = t.responses.get_into(r.key, &mut buf).is_some();
        let m = t.prefix.longest_prefix_match(&r.prompt, |s| t.servers.is_live(s));
        routing::live_candidates(&t, &mut candidates);
        let Some(choice) = policy.choose(&route_input(r, &m, &candidates)) else {
            bail!("no live server in the segment")
        };
        if write_back {
            t.prefix.insert_chain(&r.full, choice.server, clock.stamp());
            semlb::response_cache::encode_entry(clock.now_ms(), &r.answer, &mut entry);
            let _ = t.responses.put(r.key, &entry);
        }
        Ok(Decision {
            cache_hit,
            prefix: matches!(choice.reason, Reason::Prefix { .. }),
        })
    })
}

/// A worker on Redis (`--redis-url`, `--namespace`): the gateway's
/// pipelined lookup and a response process's write-back, routed over four
/// fake servers in a process-local table.
fn redis_worker(args: &WorkerArgs, requests: &[Request], policy: &dyn Policy, report: &mut WorkerReport) -> Result<()> {
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
    decide_for(args, requests, 16, report, |r, write_back| {
        // What the gateway's Redis store reads for a decision:
        // response, in-flight figures and prefix in one pipeline.
        let found = store.dispatch_lookup(Some(r.key.0), &r.prompt, naive)?;
        routing::live_candidates(&lt, &mut candidates);
        let m = redis_match(&found.prefix, &candidates);
        let choice = policy
            .choose(&route_input(r, &m, &candidates))
            .context("no live server")?;
        if write_back {
            // A response process's write-back: one pipeline.
            let item = WriteItem {
                server: u64::from(choice.server.slot),
                blocks: &r.full,
                response: Some((r.key.0, &r.answer, REDIS_TTL)),
            };
            store.write_back(&[item], 1, now_ms())?;
        }
        Ok(Decision {
            cache_hit: found.response.is_some(),
            prefix: matches!(choice.reason, Reason::Prefix { .. }),
        })
    })?;
    report.round_trips = store.round_trips() - rt0;
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

/// Milliseconds since the Unix epoch.
pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

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
