//! The throw-away stores a report measures: a uniquely named POSIX shm
//! segment with fake servers registered, and a Redis namespace of the
//! run's own, both removed at the end (also on errors); and the Redis
//! connections and the Redis metadata of a report.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use semlb::store::redis::client::RedisStore;
use serde_json::{Value, json};
use shm_layout::{LayoutPlan, Segment, ServerRef};

/// Size of the throw-away shm segments.
pub const SEGMENT_BYTES: u64 = 256 << 20;
/// Fake inference servers registered in the segments.
pub const FAKE_SERVERS: usize = 4;
/// TTL of the prefix entries and responses written to Redis.
pub const REDIS_TTL: Duration = Duration::from_secs(3600);
/// Connect, read and write timeout of the benchmark's Redis connections.
pub const REDIS_TIMEOUT: Duration = Duration::from_secs(5);

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

/// The `redis` object of a report's JSON: the server's version, its URL,
/// whether it is a private one, and the run's namespace on it.
pub fn redis_meta(url: &str, private_server: bool, namespace: &RedisNamespace) -> Value {
    json!({
        "version": redis_version(url).unwrap_or_else(|e| format!("unknown ({e})")),
        "url": url,
        "private_server": private_server,
        "namespace": namespace.name(),
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_fields_are_found() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(info_field(info, "redis_version").as_deref(), Some("7.0.15"));
        assert_eq!(info_field(info, "redis_mode"), None);
    }
}
