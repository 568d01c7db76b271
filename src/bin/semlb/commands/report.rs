//! A snapshot of one segment (header, regions, table statistics, servers,
//! processes) and its two renderings: text for people, JSON for scripts.
//! `semlb shm inspect` prints it, and so does `semlb demo` at its end.
//!
//! The snapshot is taken with the tables' own read paths, which never wait
//! and never write, so inspecting a live segment is harmless.

use std::fmt::Write as _;

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use serde_json::{Value, json};
use shm_layout::{
    HeaderInfo, LAYOUT_VERSION, MAGIC, ProcessInfo, RegionKind, ResponseLogStats, RingStats, STATE_READY, Segment,
    ServerInfo, UsageRow,
};

use semlb::config::size::ByteSize;

/// Everything `semlb shm inspect` shows, copied out of a segment.
#[derive(Debug, Clone)]
pub struct Report {
    /// The shm name, with its leading `/`.
    pub name: String,
    /// The header as validated on open.
    pub header: HeaderInfo,
    /// Whether the creator's pid names a live process.
    pub creator_alive: Liveness,
    /// The prefix table's slots.
    pub prefix: Fill,
    /// The confirmed-prefix table's slots (the engines' KV events).
    pub confirmed: Fill,
    /// Response-log counters.
    pub responses: ResponseLogStats,
    /// The response index's slots.
    pub response_index: Fill,
    /// Segment-store counters (token segments, [`semlb::store::segments`]).
    pub segments: ResponseLogStats,
    /// Occupied segment-index slots.
    pub segment_index_occupancy: u64,
    /// Rate-limit buckets not full now, and slots any bucket holds.
    pub limits: (usize, usize),
    /// Rate-limit slots.
    pub limit_capacity: usize,
    /// Usage per tenant and model.
    pub usage: Vec<UsageRow>,
    /// Registered servers.
    pub servers: Vec<ServerInfo>,
    /// Registry slots ever used.
    pub processes: Vec<(ProcessInfo, Liveness)>,
    /// Number of completion rings.
    pub ring_count: usize,
    /// Counters summed over every completion ring.
    pub rings: RingStats,
}

/// Whether a pid names a live process, as `kill(pid, 0)` tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// The process exists (possibly owned by another user).
    Alive,
    /// No such process.
    Dead,
    /// The pid is 0 or out of range: nothing to ask about.
    Unknown,
}

impl Liveness {
    /// Asks the kernel about `pid` without sending a signal.
    pub fn of(pid: u64) -> Self {
        // Pid 0 and negative pids would address process groups.
        let Some(pid) = i32::try_from(pid).ok().filter(|p| *p > 0) else {
            return Self::Unknown;
        };
        match kill(Pid::from_raw(pid), None) {
            Ok(()) | Err(Errno::EPERM) => Self::Alive,
            Err(Errno::ESRCH) => Self::Dead,
            Err(_) => Self::Unknown,
        }
    }

    /// `alive`, `dead` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Alive => "alive",
            Self::Dead => "not running",
            Self::Unknown => "unknown",
        }
    }

    fn as_json(self) -> Value {
        match self {
            Self::Alive => Value::Bool(true),
            Self::Dead => Value::Bool(false),
            Self::Unknown => Value::Null,
        }
    }
}

impl Report {
    /// Copies everything out of `segment`.
    pub fn of(segment: &Segment) -> Self {
        let header = segment.header().clone();
        let tables = segment.tables();
        let rings = (0..tables.ring_count())
            .map(|i| tables.ring(i).stats())
            .fold(RingStats::default(), |a, s| RingStats {
                pushed: a.pushed + s.pushed,
                dropped: a.dropped + s.dropped,
                skipped: a.skipped + s.skipped,
                corrupt: a.corrupt + s.corrupt,
                used: a.used + s.used,
                capacity: a.capacity + s.capacity,
            });
        Self {
            name: segment.name().unwrap_or("(heap)").to_owned(),
            creator_alive: Liveness::of(header.creator_pid),
            prefix: Fill::new(tables.prefix.occupancy(), tables.prefix.capacity()),
            confirmed: Fill::new(tables.confirmed.occupancy(), tables.confirmed.capacity()),
            responses: tables.responses.stats(),
            response_index: Fill::new(tables.responses.index_occupancy(), tables.responses.index_capacity()),
            segments: tables.segments.stats(),
            segment_index_occupancy: tables.segments.index_occupancy(),
            limits: tables.limits.occupancy(segment.clock().now_ns()),
            limit_capacity: tables.limits.capacity(),
            // The processes' gauges (requests in flight per tenant) are
            // not usage.
            usage: tables
                .usage
                .rows()
                .into_iter()
                .filter(|r| r.kind != shm_layout::UsageKind::Gauge)
                .collect(),
            servers: tables.servers.servers().collect(),
            processes: tables
                .registry
                .processes()
                .map(|p| (p, Liveness::of(u64::from(p.pid))))
                .collect(),
            ring_count: tables.ring_count(),
            rings,
            header,
        }
    }

    /// The report as text, one section per table.
    pub fn text(&self) -> String {
        let h = &self.header;
        let mut out = String::new();
        // Writing to a String cannot fail; `let _` keeps the code flat.
        let w = &mut out;
        let _ = writeln!(w, "segment {}", self.name);
        let _ = writeln!(
            w,
            "  magic           {}",
            if h.magic == MAGIC { "ok (SEMLBSHM)" } else { "BAD" }
        );
        let _ = writeln!(
            w,
            "  layout version  {} (this semlb: {LAYOUT_VERSION})",
            h.layout_version
        );
        let _ = writeln!(
            w,
            "  size            {} bytes ({})",
            h.segment_bytes,
            ByteSize(h.segment_bytes)
        );
        let _ = writeln!(w, "  state           {}", state_name(h.state));
        let _ = writeln!(
            w,
            "  created         {} (unix ms {})",
            utc_from_unix_ms(h.created_unix_ms),
            h.created_unix_ms
        );
        let _ = writeln!(
            w,
            "  creator pid     {} ({})",
            h.creator_pid,
            self.creator_alive.as_str()
        );
        let _ = writeln!(w);
        let _ = writeln!(
            w,
            "regions           {:>12} {:>12} {:>10} {:>10}",
            "offset", "bytes", "count", "param"
        );
        for kind in RegionKind::ALL {
            let r = h.region(kind);
            let _ = writeln!(
                w,
                "  {:<16}{:>12} {:>12} {:>10} {:>10}",
                kind.name(),
                r.offset,
                r.bytes,
                r.count,
                r.param
            );
        }
        let _ = writeln!(w);
        let _ = writeln!(w, "prefix table      {}", self.prefix.show(" / ", "slots", 2));
        let _ = writeln!(w, "confirmed         {}", self.confirmed.show(" / ", "slots", 2));
        let _ = writeln!(
            w,
            "rate limits       {} buckets in use ({} slots held) / {} slots",
            self.limits.0, self.limits.1, self.limit_capacity
        );
        let r = &self.responses;
        let _ = writeln!(
            w,
            "response cache    {} records, {} refused, {} unindexed; log {} written of {} (max value {}); index {} / {} slots",
            r.records,
            r.refused,
            r.unindexed,
            ByteSize(r.tail),
            ByteSize(r.capacity),
            ByteSize(r.max_value),
            self.response_index.used,
            self.response_index.capacity
        );
        let s = &self.segments;
        let _ = writeln!(
            w,
            "segment store     {} records (token segments), {} refused; log {} written of {}; {} indexed",
            s.records,
            s.refused,
            ByteSize(s.tail),
            ByteSize(s.capacity),
            self.segment_index_occupancy
        );
        let g = &self.rings;
        let _ = writeln!(
            w,
            "completion rings  {} rings of {}: {} pushed, {} dropped, {} skipped, {} corrupt, {} bytes in use",
            self.ring_count,
            ByteSize(g.capacity / self.ring_count.max(1) as u64),
            g.pushed,
            g.dropped,
            g.skipped,
            g.corrupt,
            g.used
        );
        let _ = writeln!(w);
        let _ = writeln!(w, "servers           {}", self.servers.len());
        for s in &self.servers {
            let _ = writeln!(
                w,
                "  slot {:<3} gen {:<3} {:<9} {:<7} id {:<6} {:<28} in flight {} req / {} tok; waiting {} running {} kv {}",
                s.server.slot,
                s.server.generation,
                s.state.name(),
                s.disaggregation.role.name(),
                s.id,
                s.address,
                s.inflight_requests,
                s.inflight_tokens,
                s.load.waiting,
                s.load.running,
                kv_usage(&s.load)
            );
        }
        let _ = writeln!(w, "processes         {}", self.processes.len());
        for (p, alive) in &self.processes {
            let _ = writeln!(
                w,
                "  slot {:<3} inc {:<3} {:<10} {:<8} pid {} ({}), started {} ms, heartbeat {} ms, restarts {}",
                p.slot,
                p.incarnation,
                p.role.map_or("?", shm_layout::Role::name),
                p.state.name(),
                p.pid,
                alive.as_str(),
                p.started_ms,
                p.heartbeat_ms,
                p.restarts
            );
        }
        out
    }

    /// The report as one JSON object.
    pub fn json(&self) -> Value {
        let h = &self.header;
        let regions: Vec<Value> = RegionKind::ALL
            .iter()
            .map(|kind| {
                let r = h.region(*kind);
                json!({"name": kind.name(), "offset": r.offset, "bytes": r.bytes, "count": r.count, "param": r.param})
            })
            .collect();
        let servers: Vec<Value> = self
            .servers
            .iter()
            .map(|s| {
                json!({
                    "slot": s.server.slot,
                    "generation": s.server.generation,
                    "state": s.state.name(),
                    "role": s.disaggregation.role.name(),
                    "bootstrap_port": s.disaggregation.bootstrap_port,
                    "id": s.id,
                    "address": s.address,
                    "registered_ms": s.registered_ms,
                    "horizon_s": s.horizon_s,
                    "admission_limit": s.admission_limit,
                    "inflight_requests": s.inflight_requests,
                    "inflight_tokens": s.inflight_tokens,
                    "load": {
                        "waiting": s.load.waiting,
                        "running": s.load.running,
                        "kv_usage_permyriad": s.load.kv_usage_permyriad,
                        "scraped_at_ms": s.load.scraped_at_ms,
                    },
                })
            })
            .collect();
        let processes: Vec<Value> = self
            .processes
            .iter()
            .map(|(p, alive)| {
                json!({
                    "slot": p.slot,
                    "incarnation": p.incarnation,
                    "role": p.role.map(shm_layout::Role::name),
                    "state": p.state.name(),
                    "pid": p.pid,
                    "pid_alive": alive.as_json(),
                    "started_ms": p.started_ms,
                    "heartbeat_ms": p.heartbeat_ms,
                    "restarts": p.restarts,
                    "tuned": p.tuned,
                })
            })
            .collect();
        let r = &self.responses;
        let g = &self.rings;
        json!({
            "name": self.name,
            "header": {
                "magic_ok": h.magic == MAGIC,
                "layout_version": h.layout_version,
                "segment_bytes": h.segment_bytes,
                "state": state_name(h.state),
                "created_unix_ms": h.created_unix_ms,
                "created_utc": utc_from_unix_ms(h.created_unix_ms),
                "creator_pid": h.creator_pid,
                "creator_alive": self.creator_alive.as_json(),
            },
            "regions": regions,
            "prefix_table": {"occupancy": self.prefix.used, "capacity": self.prefix.capacity},
            "confirmed_prefixes": {"occupancy": self.confirmed.used, "capacity": self.confirmed.capacity},
            "rate_limits": {"in_use": self.limits.0, "held": self.limits.1, "capacity": self.limit_capacity},
            "usage": self.usage.iter().map(usage_json).collect::<Vec<_>>(),
            "response_cache": {
                "records": r.records,
                "refused": r.refused,
                "unindexed": r.unindexed,
                "log_tail": r.tail,
                "log_capacity": r.capacity,
                "max_value": r.max_value,
                "index_occupancy": self.response_index.used,
                "index_capacity": self.response_index.capacity,
            },
            "segment_store": {
                "records": self.segments.records,
                "refused": self.segments.refused,
                "log_tail": self.segments.tail,
                "log_capacity": self.segments.capacity,
                "index_occupancy": self.segment_index_occupancy,
            },
            "completion_rings": {
                "count": self.ring_count,
                "pushed": g.pushed,
                "dropped": g.dropped,
                "skipped": g.skipped,
                "corrupt": g.corrupt,
                "used": g.used,
                "capacity": g.capacity,
            },
            "servers": servers,
            "processes": processes,
        })
    }
}

fn state_name(state: u64) -> &'static str {
    if state == STATE_READY { "ready" } else { "initialising" }
}

fn kv_usage(load: &shm_layout::LoadFigures) -> String {
    load.kv_usage()
        .map_or_else(|| "not reported".to_owned(), |kv| format!("{:.2} %", kv * 100.0))
}

/// Slots of a table in use, of how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fill {
    /// Slots in use.
    pub used: u64,
    /// Slots in all.
    pub capacity: u64,
}

impl Fill {
    /// `used` of `capacity`.
    pub fn new(used: u64, capacity: u64) -> Self {
        Self { used, capacity }
    }

    /// The share in use, with `decimals` places (`-` of an empty table).
    pub fn share(&self, decimals: usize) -> String {
        percent(self.used, self.capacity, decimals)
    }

    /// `12{between}64 {unit} (18.75 %)`: both counts and the share.
    pub fn show(&self, between: &str, unit: &str, decimals: usize) -> String {
        format!(
            "{}{between}{} {unit} ({})",
            self.used,
            self.capacity,
            self.share(decimals)
        )
    }
}

/// `part` of `whole` as a percentage with `decimals` places (`-` of nothing).
pub fn percent(part: u64, whole: u64, decimals: usize) -> String {
    if whole == 0 {
        return "-".into();
    }
    format!("{:.decimals$} %", part as f64 * 100.0 / whole as f64)
}

/// The UTC time `ms` milliseconds after the Unix epoch, as `format` writes
/// it (chrono's `strftime` syntax).
fn utc(ms: u64, format: &str) -> String {
    let at = i64::try_from(ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .unwrap_or_default();
    at.format(format).to_string()
}

/// `2025-01-31 12:34:56.789 UTC` from milliseconds since the Unix epoch.
pub fn utc_from_unix_ms(ms: u64) -> String {
    utc(ms, "%Y-%m-%d %H:%M:%S%.3f UTC")
}

/// `2025-01-31T12:34:56Z` (RFC 3339) from seconds since the Unix epoch.
pub fn rfc3339_from_unix_secs(secs: u64) -> String {
    utc(secs.saturating_mul(1000), "%Y-%m-%dT%H:%M:%SZ")
}

/// One usage row as `semlb shm inspect --json` and `semlb status --json`
/// write it.
fn usage_json(r: &UsageRow) -> serde_json::Value {
    use shm_layout::UsageCounter as C;
    serde_json::json!({
        "kind": match r.kind {
            shm_layout::UsageKind::Tenant => "tenant",
            shm_layout::UsageKind::Model => "model",
            shm_layout::UsageKind::Gauge => "gauge",
        },
        "name": r.name,
        "requests": r.get(C::Requests),
        "rate_limited": r.get(C::RateLimited),
        "cache_hits": r.get(C::CacheHits),
        "prompt_tokens": r.get(C::PromptTokens),
        "output_tokens": r.get(C::OutputTokens),
        "queued": r.get(C::Queued),
        "queue_seconds": r.get(C::QueueMicros) as f64 / 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::LayoutPlan;

    #[test]
    fn formats_utc_dates() {
        assert_eq!(utc_from_unix_ms(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(utc_from_unix_ms(951_782_400_000), "2000-02-29 00:00:00.000 UTC");
        assert_eq!(utc_from_unix_ms(1_709_251_199_999), "2024-02-29 23:59:59.999 UTC");
        assert_eq!(utc_from_unix_ms(4_102_444_800_123), "2100-01-01 00:00:00.123 UTC");
    }

    #[test]
    fn pid_liveness() {
        assert_eq!(Liveness::of(u64::from(std::process::id())), Liveness::Alive);
        assert_eq!(Liveness::of(0), Liveness::Unknown);
        assert_eq!(Liveness::of(u64::from(u32::MAX)), Liveness::Unknown);
        // Above the kernel's pid_max limit (2^22), so never a process.
        assert_eq!(Liveness::of(1 << 23), Liveness::Dead);
    }

    #[test]
    fn reports_a_fresh_segment() {
        let seg = Segment::heap(&LayoutPlan::for_size(16 << 20).unwrap());
        let server = seg
            .tables()
            .servers
            .register(7, "http://127.0.0.1:8000", seg.clock().now_ms())
            .unwrap();
        seg.tables()
            .prefix
            .insert_chain(&[1, 2, 3], server, seg.clock().stamp());
        let report = Report::of(&seg);
        assert_eq!(report.prefix.used, 3);
        assert_eq!(report.creator_alive, Liveness::Alive);
        let text = report.text();
        for needle in [
            "state           ready",
            "magic           ok",
            "prefix table      3 /",
            "http://127.0.0.1:8000",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
        for kind in RegionKind::ALL {
            assert!(text.contains(kind.name()), "{kind:?} missing from\n{text}");
        }
        let json = report.json();
        assert_eq!(json["header"]["state"], "ready");
        assert_eq!(json["prefix_table"]["occupancy"], 3);
        assert_eq!(json["servers"][0]["address"], "http://127.0.0.1:8000");
        assert_eq!(json["regions"].as_array().map(Vec::len), Some(RegionKind::ALL.len()));
    }
}
