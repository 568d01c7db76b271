//! `semlb status`: a live view of a running gateway, read from its shm
//! segment (like `top`): servers with their state, requests in flight,
//! scraped engine load, share of the traffic and prediction accuracy (of
//! the prompt tokens the routing expected it to hold, the share its engine
//! reported cached: `PREDICTED`); the response cache's hit
//! rate; the tables' fill; the rate of answered requests; the processes
//! with their heartbeats and restarts. Shares and hit rates come from the
//! stats region ([`semlb::metrics`]) and count since the segment was
//! created. `--once` prints one
//! snapshot and exits, for scripts; `--iterations N` stops after N frames.
//!
//! It attaches to the segment and only reads (the tables' read paths never
//! write or wait), so it can run beside a live gateway as often as wanted.
//! Rates are the difference between two frames: answered requests per
//! second is the completion records pushed per second (one per complete
//! 2xx answer from an engine; answers from the response cache are not
//! counted). On a terminal each frame replaces the previous one; otherwise
//! frames follow each other.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use semlb::routing::capacity::Admission;
use shm_layout::Segment;

use semlb::metrics::{
    CacheResult, PredictionTotals, QueueTotals, affinity_totals, cache_total, prediction_total, queue_total,
    upstream_total,
};

use crate::cli::StatusArgs;
use crate::commands::report::{Report, percent};

/// Gateway-wide counters a frame shows, from the stats region.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// Response-cache hits, misses, bypasses.
    pub cache: [u64; 3],
    /// Per server slot (as in the report's server list): upstream attempts
    /// answered in full and failed.
    pub upstream: Vec<(u16, u64, u64)>,
    /// Per server slot: prompt tokens the routing predicted it held, and of
    /// those, the tokens its engine reported cached.
    pub prediction: Vec<(u16, u64, u64)>,
    /// The gateway queues.
    pub queue: QueueTotals,
    /// Affinity decisions, in [`semlb::metrics::AffinityOutcome`] order.
    pub affinity: [u64; 5],
}

impl Totals {
    /// The totals in `counters` (the stats words summed over processes) for
    /// the servers of `report`.
    pub fn of(counters: &[u64], report: &Report) -> Self {
        Self {
            cache: [CacheResult::Hit, CacheResult::Miss, CacheResult::Bypass].map(|r| cache_total(counters, r)),
            upstream: report
                .servers
                .iter()
                .map(|s| {
                    let (ok, failed) = upstream_total(counters, s.server.slot);
                    (s.server.slot, ok, failed)
                })
                .collect(),
            prediction: report
                .servers
                .iter()
                .map(|s| {
                    let PredictionTotals {
                        predicted, confirmed, ..
                    } = prediction_total(counters, s.server.slot);
                    (s.server.slot, predicted, confirmed)
                })
                .collect(),
            queue: queue_total(counters),
            affinity: affinity_totals(counters),
        }
    }
}

/// Runs `semlb status`.
pub fn run(args: &StatusArgs, out: &mut impl Write) -> Result<()> {
    let segment = Segment::open(&args.shm_name)
        .with_context(|| format!("cannot attach to the gateway's segment {:?}", args.shm_name))?;
    let terminal = std::io::stdout().is_terminal();
    let frames = if args.once { Some(1) } else { args.iterations };
    let mut previous: Option<(Instant, u64)> = None;
    let mut shown = 0u64;
    loop {
        let report = Report::of(&segment);
        let now = Instant::now();
        let rate = previous.map(|(at, pushed)| {
            let secs = now.duration_since(at).as_secs_f64().max(1e-3);
            report.rings.pushed.saturating_sub(pushed) as f64 / secs
        });
        previous = Some((now, report.rings.pushed));
        let now_ms = segment.clock().now_ms();
        // The counters alone: a `Snapshot` would scan the prefix table a
        // second time (the report already counted it).
        let totals = Totals::of(&segment.tables().stats.sum_all(), &report);
        let text = render(&report, &totals, now_ms, rate);
        if terminal && !args.once {
            // Home and clear, then the frame.
            write!(out, "\x1b[H\x1b[2J{text}")?;
        } else {
            writeln!(out, "{text}")?;
        }
        out.flush()?;
        shown += 1;
        if frames.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs_f64(args.interval.clamp(0.05, 3600.0)));
    }
}

/// `ms` ago as `0.4 s`, `12 s`, `3 min`, `never` for 0 stamps.
fn ago(now_ms: u64, at_ms: u64) -> String {
    if at_ms == 0 {
        return "never".into();
    }
    let secs = now_ms.saturating_sub(at_ms) as f64 / 1000.0;
    if secs < 10.0 {
        format!("{secs:.1} s")
    } else if secs < 120.0 {
        format!("{secs:.0} s")
    } else {
        format!("{:.0} min", secs / 60.0)
    }
}

/// One frame of the view.
pub fn render(r: &Report, totals: &Totals, now_ms: u64, answered_per_sec: Option<f64>) -> String {
    let mut out = String::new();
    let w = &mut out;
    summary(w, r, totals, now_ms, answered_per_sec);
    servers(w, r, totals, now_ms);
    processes(w, r, now_ms);
    usage(w, r);
    out
}

/// The head: uptime, answers, the cache, the queue, the tables.
fn summary(w: &mut String, r: &Report, totals: &Totals, now_ms: u64, answered_per_sec: Option<f64>) {
    let up = now_ms as f64 / 1000.0;
    let _ = writeln!(
        w,
        "semlb status  {}  up {}  segment {}",
        r.name,
        if up < 120.0 {
            format!("{up:.0} s")
        } else if up < 7200.0 {
            format!("{:.0} min", up / 60.0)
        } else {
            format!("{:.1} h", up / 3600.0)
        },
        semlb::config::size::ByteSize(r.header.segment_bytes)
    );
    let _ = writeln!(
        w,
        "answered       {}   (engine answers written back; {} total)",
        answered_per_sec.map_or_else(|| "- req/s".to_owned(), |v| format!("{v:.1} req/s")),
        r.rings.pushed
    );
    let [hits, misses, bypasses] = totals.cache;
    let _ = writeln!(
        w,
        "cache          {} hit rate ({hits} hits, {misses} misses, {bypasses} not cacheable)",
        percent(hits, hits + misses, 1)
    );
    let q = totals.queue;
    let _ = writeln!(
        w,
        "gateway queue  {} waiting ({} routed after waiting, {} abandoned, {} timed out, {} refused: full)",
        q.depth(),
        q.routed,
        q.abandoned,
        q.timeout,
        q.full
    );
    let [kept, moved, new, continued, not_found] = totals.affinity;
    let _ = writeln!(
        w,
        "sessions       {kept} turns kept on their engine, {moved} moved (engine full), {new} new; stored responses {continued} continued, {not_found} not found"
    );
    let _ = writeln!(w, "prefix table   {}", r.prefix.show(" of ", "entries", 1));
    let _ = writeln!(
        w,
        "responses      {} cached, {} refused (too large); index {}",
        r.responses.records,
        r.responses.refused,
        r.response_index.share(1)
    );
    let _ = writeln!(
        w,
        "write-back     {} dropped (ring full), {} bytes waiting",
        r.rings.dropped, r.rings.used
    );
}

/// One line per server: its state, load, share and prediction.
fn servers(w: &mut String, r: &Report, totals: &Totals, now_ms: u64) {
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "{:<4} {:<28} {:<9} {:<7} {:>9} {:>10} {:>8} {:>8} {:>7} {:>9} {:>7} {:>7} {:>9} {:>6}",
        "SLOT",
        "SERVER",
        "STATE",
        "ROLE",
        "IN FLIGHT",
        "TOKENS",
        "WAITING",
        "RUNNING",
        "KV",
        "SCRAPED",
        "SHARE",
        "FAILED",
        "PREDICTED",
        "LIMIT"
    );
    let all: u64 = totals.upstream.iter().map(|(_, ok, failed)| ok + failed).sum();
    for s in &r.servers {
        let (ok, failed) = totals
            .upstream
            .iter()
            .find(|(slot, _, _)| *slot == s.server.slot)
            .map_or((0, 0), |(_, ok, failed)| (*ok, *failed));
        let (predicted, confirmed) = totals
            .prediction
            .iter()
            .find(|(slot, _, _)| *slot == s.server.slot)
            .map_or((0, 0), |(_, p, c)| (*p, *c));
        let scraped = s.load.scraped_at_ms != 0;
        let dash = |v: String| if scraped { v } else { "-".to_owned() };
        let _ = writeln!(
            w,
            "{:<4} {:<28} {:<9} {:<7} {:>9} {:>10} {:>8} {:>8} {:>7} {:>9} {:>7} {:>7} {:>9} {:>6}",
            s.server.slot,
            s.address,
            s.state.name(),
            s.disaggregation.role.name(),
            s.inflight_requests,
            s.inflight_tokens,
            dash(s.load.waiting.to_string()),
            dash(s.load.running.to_string()),
            dash(
                s.load
                    .kv_usage()
                    .map_or("n/a".to_owned(), |kv| format!("{:.1}%", kv * 100.0))
            ),
            ago(now_ms, s.load.scraped_at_ms),
            percent(ok + failed, all, 1),
            failed,
            percent(confirmed, predicted, 1),
            match Admission::of(s.engine_slots, s.admission_limit) {
                Admission::Reported(slots) => format!("{slots} slots"),
                Admission::Learned(l) => format!("{l:.1}"),
                Admission::Initial => "-".to_owned(),
            }
        );
    }
}

/// One line per process: its role, state, heartbeat, restarts.
fn processes(w: &mut String, r: &Report, now_ms: u64) {
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "{:<4} {:<11} {:<9} {:>8} {:>9} {:>10} {:>8} {:>7}",
        "SLOT", "ROLE", "STATE", "PID", "ALIVE", "HEARTBEAT", "RESTARTS", "WEIGHT"
    );
    for (p, alive) in &r.processes {
        let _ = writeln!(
            w,
            "{:<4} {:<11} {:<9} {:>8} {:>9} {:>10} {:>8} {:>7}",
            p.slot,
            p.role.map_or("?", shm_layout::Role::name),
            p.state.name(),
            p.pid,
            alive.as_str(),
            ago(now_ms, p.heartbeat_ms),
            p.restarts,
            // The cost policy's tuned weight.
            p.tuned.map_or_else(|| "-".to_owned(), |v| format!("{v}"))
        );
    }
}

/// Usage per tenant and per model, when any is counted.
fn usage(w: &mut String, r: &Report) {
    if !r.usage.is_empty() {
        use shm_layout::UsageCounter as C;
        let _ = writeln!(w);
        let _ = writeln!(
            w,
            "{:<7} {:<24} {:>9} {:>6} {:>9} {:>12} {:>12} {:>8} {:>10}",
            "USAGE", "NAME", "REQUESTS", "429", "CACHED", "PROMPT TOK", "OUTPUT TOK", "QUEUED", "AVG QUEUE"
        );
        for u in &r.usage {
            let queued = u.get(C::Queued);
            let _ = writeln!(
                w,
                "{:<7} {:<24} {:>9} {:>6} {:>9} {:>12} {:>12} {:>8} {:>10}",
                match u.kind {
                    shm_layout::UsageKind::Tenant => "tenant",
                    shm_layout::UsageKind::Model => "model",
                    shm_layout::UsageKind::Gauge => "gauge",
                },
                u.name,
                u.get(C::Requests),
                u.get(C::RateLimited),
                u.get(C::CacheHits),
                u.get(C::PromptTokens),
                u.get(C::OutputTokens),
                queued,
                u.get(C::QueueMicros)
                    .checked_div(queued)
                    .map_or_else(|| "-".to_owned(), |us| format!("{} ms", us / 1000))
            );
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_shares_read_well() {
        assert_eq!(ago(10_000, 0), "never");
        assert_eq!(ago(10_000, 9_600), "0.4 s");
        assert_eq!(ago(100_000, 50_000), "50 s");
        assert_eq!(ago(1_000_000, 100_000), "15 min");
        assert_eq!(percent(1, 8, 1), "12.5 %");
        assert_eq!(percent(1, 0, 1), "-");
    }

    #[test]
    fn a_frame_lists_servers_and_processes() {
        let seg = Segment::heap(&shm_layout::LayoutPlan::for_size(8 << 20).unwrap());
        let t = seg.tables();
        let a = t.servers.register(1, "http://10.0.0.1:8000", 0).unwrap();
        t.servers.set_state(a, shm_layout::ServerState::Up);
        t.servers.store_load(
            a,
            shm_layout::LoadFigures {
                waiting: 3,
                running: 7,
                kv_usage_permyriad: 8120,
                scraped_at_ms: 900,
                pending_at_scrape: 0,
            },
        );
        assert!(t.servers.begin_request(1, a, 500));
        let inc = t.registry.claim(1, shm_layout::Role::Dispatcher, 0);
        t.registry.attach(1, inc, 4242, 0);
        t.registry.heartbeat(1, inc, 950);
        t.registry.publish_tuned(1, inc, 0.25);
        let report = Report::of(&seg);
        let totals = Totals {
            cache: [3, 1, 4],
            upstream: vec![(a.slot, 6, 2)],
            prediction: vec![(a.slot, 400, 300)],
            queue: QueueTotals {
                entered: 9,
                routed: 5,
                abandoned: 1,
                timeout: 1,
                full: 3,
            },
            affinity: [40, 2, 8, 11, 1],
        };
        let frame = render(&report, &totals, 1_000, Some(12.5));
        assert!(
            frame.contains(
                "gateway queue  2 waiting (5 routed after waiting, 1 abandoned, 1 timed out, 3 refused: full)"
            ),
            "{frame}"
        );
        assert!(
            frame.contains("75.0 % hit rate (3 hits, 1 misses, 4 not cacheable)"),
            "{frame}"
        );
        assert!(frame.contains("12.5 req/s"), "{frame}");
        assert!(
            frame.contains(
                "40 turns kept on their engine, 2 moved (engine full), 8 new; stored responses 11 continued, 1 not found"
            ),
            "{frame}"
        );
        let server = frame.lines().find(|l| l.contains("http://10.0.0.1:8000")).unwrap();
        for cell in [
            "up", " 1 ", "500", " 3 ", " 7 ", "81.2%", "0.1 s", "100.0 %", " 2", "75.0 %",
        ] {
            assert!(server.contains(cell), "{cell:?} missing in {server:?}");
        }
        let process = frame.lines().find(|l| l.contains("4242")).unwrap();
        assert!(
            process.contains("dispatcher") && process.contains("0.1 s") && process.ends_with(" 0.25"),
            "{process:?}"
        );
    }
}
