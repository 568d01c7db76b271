//! Configuration of `semlb serve`: a TOML file, command-line flags over it,
//! and validation.
//!
//! # Sources and precedence
//!
//! Defaults < the file < flags. [`ServeConfig::load`] reads the file (no
//! file: the defaults), [`ServeConfig::apply`] puts the flags
//! ([`ServeOverrides`]) over it, and [`ServeConfig::validate`] checks the
//! result; [`ServeConfig::resolve`] does all three. `--backend` replaces the
//! file's whole `[[backend]]` list rather than adding to it, so a command
//! line always says exactly which servers are used.
//!
//! Every table rejects keys it does not know, so a misspelt key is an error
//! rather than a silently ignored setting; parse errors come from the TOML
//! parser and name the key, the line and the column, with the line quoted.
//! Relative `tokenizer` and `chat_template` paths in a file are relative to
//! the file's directory (a service's working directory is usually `/`);
//! relative paths given as flags are relative to the working directory, as
//! usual. `systemd/semlb.toml` is a commented example with every key.
//!
//! # Keys
//!
//! | key | type | default | meaning |
//! | --- | --- | --- | --- |
//! | `listen` | `"ip:port"` | `"0.0.0.0:8080"` | where the dispatchers accept OpenAI-compatible HTTP |
//! | `dispatchers` | integer | CPU cores, at most 64 | dispatcher processes (1 to 64: one completion ring each) |
//! | `responders` | integer | `1` | response (write-back) processes (1 to `dispatchers`) |
//! | `shm_name` | string | `"semlb"` | shared-memory segment name (`/dev/shm/NAME`) |
//! | `shm_size` | size | `"256MiB"` | segment size, 8 MiB to 1 TiB (see [`crate::size`]) |
//! | `tokenizer` | path | bundled tokenizer | a Hugging Face `tokenizer.json` |
//! | `chat_template` | path | the tokenizer's, else none | a Hugging Face `tokenizer_config.json` with a `chat_template` |
//! | `block_size` | integer | `16` | tokens per prefix block: the engines' KV block size (1 to 1024) |
//! | `segment_cache_size` | size | `"32MiB"` | per dispatcher: token ids of text segments already seen (earlier turns, shared system prompts), so they are not tokenized again; `0` turns it off (at most 16 GiB) |
//! | `drain_timeout_secs` | integer | `30` | on SIGTERM, how long requests in flight may still run |
//! | `[[backend]]` | table, repeated | none (required) | one inference server each, at most 128 |
//! | `backend.url` | string | required | `http://host:port`, no path |
//! | `backend.name` | string | `host:port` | name in logs and metrics (`A-Z a-z 0-9 . _ : -`, at most 64 bytes) |
//! | `backend.metrics_flavor` | `auto`, `vllm`, `sglang`, `llamacpp` | `auto` | how its `/metrics` is read; `auto` tells from the metric names |
//! | `[policy]` | table | | the routing policy, [`crate::routing::PolicyConfig`] |
//! | `policy.kind` | `cache_aware`, `least_load`, `round_robin`, `random`, `selective_push`, `consistent_hash`, `dual_map`, `weighted_scorers` | `cache_aware` | which policy ([`crate::routing`]) |
//! | `[policy.queue]` | table | | the gateway queue of `selective_push` and `dual_map` ([`crate::routing::QueueParams`]) |
//! | `policy.queue.capacity` | integer | `1024` | requests waiting at the gateway, all dispatchers together (1 to 1 000 000); one more gets 503 with `Retry-After` |
//! | `policy.queue.max_wait_ms` | integer | `60000` | a request waiting longer gets 503 (1 ms to 1 hour) |
//! | `policy.queue.recheck_ms` | integer | `5` | how often queued requests are looked at again without a local signal (1 to 1000) |
//! | `[policy.cache_aware]` | table | | thresholds of the `cache_aware` policy, checked whatever the kind ([`crate::routing::cache_aware::CacheAwareParams`]) |
//! | `policy.cache_aware.cache_threshold` | float | `0.5` | share of the prompt's blocks (0 to 1) a server must hold, strictly more than, to get the request for its cache |
//! | `policy.cache_aware.balance_abs_threshold` | integer | `32` | load is imbalanced only if the busiest server has more than this many requests in flight above the least busy ... |
//! | `policy.cache_aware.balance_rel_threshold` | float | `1.1` | ... and more than this multiple (at least 1) of its load; then the least loaded server gets the request |
//! | `[policy.selective_push]` | table | | SkyLB's selective pushing ([`crate::routing::selective_push`]) |
//! | `policy.selective_push.mode` | `pending`, `unstarted`, `max_outstanding` | `pending` | when a server is full: estimated pending requests (scraped queue, tracked by the gateway) above `max_pending`; or requests without a first token above `max_pending` (strict); or `max_outstanding` requests in flight |
//! | `policy.selective_push.max_pending` | integer | `0` | pending requests (sent, no first token; scraped `waiting` corrected by the gateway's accounting) a server may have and still take more |
//! | `policy.selective_push.max_outstanding` | integer | `32` | requests in flight that make a server full in mode `max_outstanding` (1 to 1 000 000) |
//! | `[policy.consistent_hash]` | table | | session-key consistent hashing ([`crate::routing::consistent_hash`]) |
//! | `policy.consistent_hash.key_headers` | array of strings | `["x-session-id", "x-user-id"]` | headers carrying the session key, tried in order |
//! | `policy.consistent_hash.user_field` | boolean | `true` | then the body's `user` field |
//! | `policy.consistent_hash.fallback_prefix_blocks` | integer | `8` | without a key: hash this many leading blocks of the prompt |
//! | `policy.consistent_hash.virtual_nodes` | integer | `100` | points per server on the ring (1 to 10 000) |
//! | `policy.consistent_hash.bounded_load` | boolean | `true` | skip servers above `(1 + load_epsilon)` × the average load |
//! | `policy.consistent_hash.load_epsilon` | float | `0.25` | the bound's slack (0 to 100) |
//! | `[policy.dual_map]` | table | | two-choice prefix mapping ([`crate::routing::dual_map`]) |
//! | `policy.dual_map.min_prefix_blocks` | integer | `4` | shortest hashed prefix, in blocks, and the step by which a hot one is extended |
//! | `policy.dual_map.max_prefix_blocks` | integer | `4096` | longest hashed prefix, in blocks (at least `min_prefix_blocks`) |
//! | `policy.dual_map.hot_share` | float | `0.0` | share of recent requests above which a prefix is hot and the hash extends past it; 0 = `1 / servers` |
//! | `policy.dual_map.window` | integer | `1024` | requests between halvings of the hotness counts |
//! | `policy.dual_map.ttft_slo_ms` | integer | `2000` | the TTFT objective: a better cache match that would break it yields to the other candidate |
//! | `policy.dual_map.prefill_tokens_per_sec` | float | `10000` | the engines' prefill speed, for the TTFT estimate |
//! | `policy.dual_map.max_pending` | integer | `0` | a candidate is full above this many pending requests (then rebalance or wait) |
//! | `policy.dual_map.virtual_nodes` | integer | `100` | points per server on each of the two rings |
//! | `[policy.weighted_scorers]` | table | | llm-d-style weighted scoring ([`crate::routing::weighted_scorers`]) |
//! | `policy.weighted_scorers.prefix_weight` | float | `2` | weight of the prefix-match score |
//! | `policy.weighted_scorers.queue_weight` | float | `1` | weight of the queue (pending) score |
//! | `policy.weighted_scorers.kv_cache_weight` | float | `1` | weight of the KV-cache usage score |
//! | `policy.weighted_scorers.load_weight` | float | `1` | weight of the in-flight load score |
//! | `policy.weighted_scorers.pick` | `max`, `weighted_random` | `max` | the best score, or a draw weighted by score |
//! | `[response_cache]` | table | | the exact-response cache |
//! | `response_cache.enabled` | bool | `true` | answer repeated deterministic requests from the cache |
//! | `response_cache.ttl_secs` | integer | `300` | how long a cached response is served (1 s to 1 year) |
//! | `response_cache.scope` | `tenant`, `global` | `tenant` | who shares cached responses: callers with the same API key, or everyone |
//! | `response_cache.max_value_fraction` | float | `0.125` | largest share of the response log one response may take, in (0, 0.5] |
//! | `response_cache.cache_nondeterministic` | bool | `false` | also cache requests that sample (`temperature` > 0, no `seed`) |
//! | `[store]` | table | | where the routing state lives ([`crate::store`]) |
//! | `store.kind` | `shm`, `redis` | `shm` | the host's shared-memory segment, or a Redis server (shared by every host using it) |
//! | `[store.redis]` | table | | the Redis store, used when `kind = "redis"` (checked whatever the kind) |
//! | `store.redis.url` | string | `"redis://127.0.0.1:6379/"` | `redis://[user:password@]host:port[/db]` |
//! | `store.redis.namespace` | string | `"semlb"` | prefix of every key (`A-Z a-z 0-9 . _ : -`, at most 64 bytes): deployments sharing a Redis must differ |
//! | `store.redis.prefix_ttl_secs` | integer | `3600` | a prefix entry expires this long after its last refresh (1 s to 1 year) |
//! | `store.redis.timeout_ms` | integer | `100` | connect and reply deadline; slower is an outage (1 ms to 60 s) |
//! | `store.redis.retry_ms` | integer | `1000` | during an outage, how often Redis is probed again (10 ms to 60 s) |
//! | `store.redis.lookup` | `script`, `naive` | `script` | longest-prefix lookup in one round trip, or one per block (the paper's baseline, for comparison) |
//! | `store.redis.write_backlog` | integer | `10000` | completion records a response process keeps to write once Redis is back (0 to 1 M) |
//! | `[limits]` | table | | request limits |
//! | `limits.max_body_bytes` | size | `"16MiB"` | largest request body accepted (larger: 413) |
//! | `limits.request_timeout_secs` | integer | `600` | whole-request deadline towards a backend (1 s to 1 day) |
//! | `limits.connect_timeout_ms` | integer | `2000` | TCP connect deadline to a backend (at most the request timeout) |
//! | `limits.retries` | integer | `2` | other backends tried when one cannot be reached, before any byte was answered (0 to 10) |
//! | `[health]` | table | | health checks and load scraping of the backends ([`crate::health`]) |
//! | `health.path` | string | `"/health"` | path of the active health check (`GET`; any 2xx is healthy) |
//! | `health.interval_ms` | integer | `2000` | time between health checks of a server, also while it is down (10 ms to 1 hour) |
//! | `health.timeout_ms` | integer | `1000` | deadline of one health check or scrape (1 ms to `interval_ms`) |
//! | `health.unhealthy_threshold` | integer | `3` | consecutive failures (checks, or requests when `passive`) that take a server out (1 to 100) |
//! | `health.healthy_threshold` | integer | `2` | consecutive successful checks that bring a server that is down back (1 to 100) |
//! | `health.scrape_interval_ms` | integer | `1000` | time between reads of a server's Prometheus `/metrics` (10 ms to 1 hour) |
//! | `health.stale_after_ms` | integer | `5000` | scraped load figures older than this are ignored (`scrape_interval_ms` to 1 day) |
//! | `health.passive` | bool | `true` | count failed requests (connection errors, 5xx, cut bodies) towards `unhealthy_threshold` |
//! | `[admin]` | table | | the admin API (`semlb serve`'s supervisor serves it) |
//! | `admin.listen` | `"ip:port"` | not set: no admin API | where the admin API accepts HTTP; keep it on loopback or a management network |
//! | `admin.token` | string | not set | the bearer token every admin request must send (16 to 4096 visible ASCII characters); required with `listen`, or `token_file` |
//! | `admin.token_file` | path | not set | a file holding the token instead (trailing whitespace ignored); it must not be readable by others (`chmod 0600`) |
//!
//! Sizes are strings such as `"256MiB"`, `"1.5GiB"` or `"100MB"`, or an
//! integer number of bytes.
//!
//! # Flags
//!
//! [`ServeOverrides`] has one field per flag: `--listen`, `--dispatchers`,
//! `--responders`, `--shm-name`, `--shm-size`, `--backend URL`
//! (repeatable), `--tokenizer`, `--chat-template`, `--block-size`,
//! `--policy`, `--store`, `--redis-url`, `--redis-namespace`,
//! `--redis-lookup`, `--admin-listen` and `--admin-token-file` (which
//! replaces a file's `admin.token`).

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use shm_layout::plan::{
    DEFAULT_MAX_RESPONSE_FRACTION, MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES, PROCESS_SLOTS, RING_COUNT, SERVER_SLOTS,
};
use shm_layout::server_table::MAX_ADDRESS_BYTES;

use crate::routing::{PolicyConfig, PolicyKind};
use crate::size::ByteSize;
use crate::store::{RedisLookup, StoreKind};

/// Default `listen` address.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED), 8080);
/// Default `shm_name`.
pub const DEFAULT_SHM_NAME: &str = "semlb";
/// Default `shm_size`: 256 MiB (about 7.85 M prefix slots and a 118 MiB
/// response log; see [`shm_layout::plan`]).
pub const DEFAULT_SHM_SIZE: ByteSize = ByteSize(256 << 20);
/// Default `block_size`, in tokens (see [`ServeConfig::block_size`]).
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Largest `block_size` accepted.
pub const MAX_BLOCK_SIZE: usize = 1024;
/// Default `segment_cache_size` (see [`ServeConfig::segment_cache_size`]).
pub const DEFAULT_SEGMENT_CACHE_SIZE: ByteSize = ByteSize(32 << 20);
/// Largest `segment_cache_size` accepted.
pub const MAX_SEGMENT_CACHE_SIZE: ByteSize = ByteSize(16 << 30);
/// Most dispatchers: one completion ring each ([`RING_COUNT`]).
pub const MAX_DISPATCHERS: usize = RING_COUNT as usize;
/// Most backends: the server table's slots ([`SERVER_SLOTS`]).
pub const MAX_BACKENDS: usize = SERVER_SLOTS as usize;
/// Longest backend `name`, in bytes.
pub const MAX_BACKEND_NAME_BYTES: usize = 64;
/// Longest `response_cache.ttl_secs`: one year.
pub const MAX_TTL_SECS: u64 = 365 * 24 * 3600;
/// Longest `limits.request_timeout_secs` and `drain_timeout_secs`: one day.
pub const MAX_TIMEOUT_SECS: u64 = 24 * 3600;
/// Most `limits.retries`.
pub const MAX_RETRIES: u32 = 10;
/// Shortest admin bearer token, in bytes.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;
/// Longest admin bearer token, in bytes.
pub const MAX_ADMIN_TOKEN_BYTES: usize = 4096;

/// Why a configuration could not be loaded or is not usable. Every message
/// names the file or the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not fit the schema (unknown key,
    /// wrong type, bad size...).
    #[error("invalid configuration file {}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML parser's message: what is wrong, with the line and
        /// column, the line quoted and the key marked.
        message: String,
    },
    /// A value is out of range or inconsistent with another.
    #[error("invalid configuration: {field} = {value}: {reason}")]
    Invalid {
        /// The key as written in the file, with its table
        /// (`limits.retries`; `backend[1].url` counts the `[[backend]]`
        /// tables from 0).
        field: String,
        /// The offending value, as TOML would write it.
        value: String,
        /// Why it is refused.
        reason: String,
    },
}

impl ConfigError {
    fn invalid(field: impl Into<String>, value: impl fmt::Display, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// The whole configuration of `semlb serve`. See the [module docs](self) for
/// a table of the keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Address the dispatchers accept HTTP on (they share it with
    /// `SO_REUSEPORT`). An IP address and a port; port 0 picks a free one.
    #[serde(deserialize_with = "socket_addr")]
    pub listen: SocketAddr,
    /// Number of dispatcher processes. Default: the number of CPU cores
    /// (`std::thread::available_parallelism`), at most [`MAX_DISPATCHERS`].
    pub dispatchers: usize,
    /// Number of response (write-back) processes; each drains the
    /// completion rings of one or more dispatchers. Default 1.
    pub responders: usize,
    /// Name of the shared-memory segment (`/dev/shm/NAME`), as for
    /// `semlb shm --shm-name`. Default `semlb`.
    pub shm_name: String,
    /// Size of the shared-memory segment. Default 256 MiB.
    pub shm_size: ByteSize,
    /// A Hugging Face `tokenizer.json` to count prompt tokens with; `None`
    /// uses the tokenizer bundled with semlb. It should be the served
    /// model's, so that blocks fall where the engines' blocks fall.
    pub tokenizer: Option<PathBuf>,
    /// A Hugging Face `tokenizer_config.json` whose `chat_template` renders
    /// chat messages into the prompt text; `None` uses the tokenizer's
    /// own, if it has one.
    pub chat_template: Option<PathBuf>,
    /// Tokens per prefix block. Default 16: vLLM's default KV-cache block
    /// size on GPUs, which is the granularity at which its automatic prefix
    /// caching hashes and reuses a prompt's KV cache. SGLang's radix cache
    /// is token-granular (its `--page-size` resolves to 1 unless an
    /// attention backend needs larger pages), so any block size lines up
    /// with it and 16 costs it nothing. Hashing prompts at the engine's
    /// block size makes the gateway's blocks line up with what the engine
    /// can reuse: `n` matching blocks in the prefix table are `n` blocks the
    /// engine can skip recomputing, with no partial block counted that the
    /// engine would recompute anyway. Set it to the engines' `--block-size`
    /// (vLLM) or `--page-size` (SGLang) when they use another one.
    pub block_size: usize,
    /// Bytes each dispatcher may keep of token ids of text segments it has
    /// tokenized (the text between special tokens, cut at line boundaries
    /// where that changes no token), so that the earlier turns of a
    /// conversation and shared system prompts are not tokenized again.
    /// Default 32 MiB; 0 turns it off. Read when a dispatcher starts.
    pub segment_cache_size: ByteSize,
    /// The inference servers (`[[backend]]` tables in the file). Required:
    /// there is no default.
    #[serde(rename = "backend")]
    pub backends: Vec<BackendConfig>,
    /// The routing policy and its parameters (`[policy]`).
    pub policy: PolicyConfig,
    /// The exact-response cache (`[response_cache]`).
    pub response_cache: ResponseCacheConfig,
    /// Request limits (`[limits]`).
    pub limits: LimitsConfig,
    /// Where the routing state lives.
    pub store: StoreConfig,
    /// Health checks and load scraping of the backends (`[health]`).
    pub health: HealthConfig,
    /// The admin API (`[admin]`); off unless `admin.listen` is set.
    pub admin: AdminConfig,
    /// On SIGTERM the dispatchers stop accepting and let requests in flight
    /// finish for up to this many seconds before the supervisor stops them.
    /// Default 30.
    pub drain_timeout_secs: u64,
}

/// One inference server (a `[[backend]]` table).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Its base URL: `http://host:port`, where host is a name, an IPv4
    /// address or a bracketed IPv6 address. The port is required (engines
    /// listen on 8000, 30000 or 8080, never on 80 by default), and there is
    /// no path: the client's path (`/v1/...`) is forwarded as it is.
    pub url: String,
    /// Its name in logs and metrics; default `host:port`.
    #[serde(default)]
    pub name: Option<String>,
    /// How its `/metrics` is read. Default `auto`.
    #[serde(default)]
    pub metrics_flavor: MetricsFlavor,
}

impl BackendConfig {
    /// A backend with this URL, no name and `metrics_flavor = "auto"`
    /// (what `--backend URL` gives).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: None,
            metrics_flavor: MetricsFlavor::Auto,
        }
    }

    /// Its URL taken apart; errors say what is wrong with it.
    pub fn parsed_url(&self) -> Result<BackendUrl, String> {
        self.url.parse()
    }

    /// Whether [`name`](Self::name), if given, is a valid name: 1 to
    /// [`MAX_BACKEND_NAME_BYTES`] letters, digits or `. _ : -`. The error
    /// is the reason only.
    pub fn check_name(&self) -> Result<(), String> {
        let Some(name) = &self.name else { return Ok(()) };
        let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
        if name.is_empty() || name.len() > MAX_BACKEND_NAME_BYTES || !name.chars().all(ok_char) {
            return Err(format!(
                "must be 1 to {MAX_BACKEND_NAME_BYTES} letters, digits or . _ : - (it is a metrics label)"
            ));
        }
        Ok(())
    }

    /// Its name: `name` if given, else the URL's `host:port` (the URL as
    /// written if it does not parse).
    pub fn display_name(&self) -> String {
        match (&self.name, self.parsed_url()) {
            (Some(name), _) => name.clone(),
            (None, Ok(url)) => url.authority(),
            (None, Err(_)) => self.url.clone(),
        }
    }
}

/// Which metrics an engine exposes on `/metrics`, for the load figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsFlavor {
    /// Tell from the metric names (`vllm:`, `sglang:`, `llamacpp:`).
    #[default]
    Auto,
    /// vLLM (`vllm:num_requests_running`, ...).
    Vllm,
    /// SGLang (`sglang:num_running_reqs`, ...).
    Sglang,
    /// llama.cpp's `llama-server --metrics` (`llamacpp:requests_processing`, ...).
    Llamacpp,
}

/// A backend URL taken apart: `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BackendUrl {
    /// Host name in lower case, or an IP address as Rust prints it
    /// (an IPv6 address without its brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl BackendUrl {
    /// `host:port`, with an IPv6 host in brackets: what to connect to and
    /// the `Host` header.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority())
    }
}

/// Whether `host` is a DNS name: dot-separated labels of letters, digits,
/// `-` and `_` (container names), 1 to 63 bytes each, not starting or ending
/// with `-`; 253 bytes in all at most.
fn is_host_name(host: &str) -> bool {
    host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

impl FromStr for BackendUrl {
    type Err = String;

    /// Parses `http://host:port` (an optional trailing `/` is allowed).
    /// The error is the reason only; the caller names the field and value.
    fn from_str(url: &str) -> Result<Self, String> {
        if url.len() > MAX_ADDRESS_BYTES {
            return Err(format!(
                "it is longer than {MAX_ADDRESS_BYTES} bytes (the server table's address limit)"
            ));
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err("expected http://host:port".into());
        };
        if !scheme.eq_ignore_ascii_case("http") {
            return Err(format!(
                "the scheme must be http, not {scheme:?} (semlb speaks plain HTTP to inference servers)"
            ));
        }
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        if !tail.is_empty() && tail != "/" {
            return Err(format!(
                "it must not have a path, query or fragment (found {tail:?}): the client's path is forwarded as it is"
            ));
        }
        if authority.contains('@') {
            return Err("it must not contain user information (user@)".into());
        }
        let bracketed = authority.starts_with('[');
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let Some((ip, port)) = inner.split_once(']') else {
                return Err("an IPv6 address must be closed with ']'".into());
            };
            let ip: Ipv6Addr = ip.parse().map_err(|_| format!("{ip:?} is not an IPv6 address"))?;
            match port.strip_prefix(':') {
                Some(port) => (ip.to_string(), Some(port)),
                None if port.is_empty() => (ip.to_string(), None),
                None => return Err(format!("expected ':port' after the IPv6 address, found {port:?}")),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host.to_ascii_lowercase(), Some(port)),
                None => (authority.to_ascii_lowercase(), None),
            }
        };
        if host.is_empty() {
            return Err("the host is missing".into());
        }
        if !bracketed && host.contains(':') {
            return Err("an IPv6 address must be in brackets: http://[::1]:8000".into());
        }
        if !bracketed && host.parse::<Ipv4Addr>().is_err() && !is_host_name(&host) {
            return Err(format!("{host:?} is not a host name or IP address"));
        }
        let Some(port) = port.filter(|p| !p.is_empty()) else {
            return Err("the port is missing (expected http://host:port)".into());
        };
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("port {port:?} is not a number"));
        }
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("port {port} is not in 1..=65535"))?;
        Ok(Self { host, port })
    }
}

/// Who may be answered with a cached response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheScope {
    /// Callers with the same API key (the key is hashed into the cache key;
    /// requests without a key share one tenant).
    #[default]
    Tenant,
    /// Every caller: a cached answer to one tenant may be returned to
    /// another. Only for deployments with a single trust domain.
    Global,
}

/// The exact-response cache (`[response_cache]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponseCacheConfig {
    /// Answer repeated requests from the cache. Default true.
    pub enabled: bool,
    /// Seconds a cached response is served; older entries are misses.
    /// Default 300.
    pub ttl_secs: u64,
    /// Who shares cached responses. Default `tenant`.
    pub scope: CacheScope,
    /// Largest share of the shared-memory response log one response may
    /// take; larger responses are not cached. In (0, 0.5]; default 0.125.
    pub max_value_fraction: f64,
    /// Also cache requests whose output is sampled (`temperature` > 0 and
    /// no `seed`), so repeats get the first sample instead of a new one.
    /// Default false.
    pub cache_nondeterministic: bool,
}

impl Default for ResponseCacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            ttl_secs: 300,
            scope: CacheScope::Tenant,
            max_value_fraction: DEFAULT_MAX_RESPONSE_FRACTION,
            cache_nondeterministic: false,
        }
    }
}

impl ResponseCacheConfig {
    /// [`ttl_secs`](Self::ttl_secs) as a duration.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }
}

/// Where the routing state lives (`[store]`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `shm` (default) or `redis`.
    pub kind: StoreKind,
    /// The Redis store's settings.
    pub redis: RedisConfig,
}

/// The Redis store (`[store.redis]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]`.
    pub url: String,
    /// Prefix of every key.
    pub namespace: String,
    /// Seconds a prefix entry lives after its last refresh.
    pub prefix_ttl_secs: u64,
    /// Connect and reply deadline, in ms.
    pub timeout_ms: u64,
    /// Probe interval during an outage, in ms.
    pub retry_ms: u64,
    /// How the longest prefix is looked up.
    pub lookup: RedisLookup,
    /// Completion records a response process keeps during an outage.
    pub write_backlog: usize,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/".to_owned(),
            namespace: "semlb".to_owned(),
            prefix_ttl_secs: 3600,
            timeout_ms: 100,
            retry_ms: 1000,
            lookup: RedisLookup::Script,
            write_backlog: 10_000,
        }
    }
}

impl RedisConfig {
    /// [`prefix_ttl_secs`](Self::prefix_ttl_secs) as a duration.
    pub fn prefix_ttl(&self) -> Duration {
        Duration::from_secs(self.prefix_ttl_secs)
    }

    /// [`timeout_ms`](Self::timeout_ms) as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// [`retry_ms`](Self::retry_ms) as a duration.
    pub fn retry(&self) -> Duration {
        Duration::from_millis(self.retry_ms)
    }
}

/// Request limits (`[limits]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted; larger requests get 413. Default 16 MiB.
    pub max_body_bytes: ByteSize,
    /// Deadline of a whole request towards a backend, streaming included.
    /// Default 600 s (long generations take minutes).
    pub request_timeout_secs: u64,
    /// Deadline of the TCP connect to a backend. Default 2000 ms.
    pub connect_timeout_ms: u64,
    /// How many other backends are tried when one cannot be reached or
    /// fails before answering anything (never after a byte of the response
    /// was sent). Default 2.
    pub retries: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: ByteSize(16 << 20),
            request_timeout_secs: 600,
            connect_timeout_ms: 2000,
            retries: 2,
        }
    }
}

impl LimitsConfig {
    /// [`request_timeout_secs`](Self::request_timeout_secs) as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_secs)
    }

    /// [`connect_timeout_ms`](Self::connect_timeout_ms) as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
}

/// Longest `health.interval_ms` and `health.scrape_interval_ms`: one hour.
pub const MAX_HEALTH_INTERVAL_MS: u64 = 3600 * 1000;
/// Most `health.unhealthy_threshold` and `health.healthy_threshold`.
pub const MAX_HEALTH_THRESHOLD: u32 = 100;
/// Longest `health.path`, in bytes.
pub const MAX_HEALTH_PATH_BYTES: usize = 1024;

/// Health checks and load scraping of the backends (`[health]`; see
/// [`crate::health`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Path (and optional query) of the active check, `GET <backend><path>`;
    /// any 2xx answer within the timeout is a success. Default `/health`
    /// (vLLM, SGLang and llama.cpp all answer it).
    pub path: String,
    /// Milliseconds between two checks of a server, up or down. Default 2000.
    pub interval_ms: u64,
    /// Deadline of one check or one scrape, in ms; at most `interval_ms`,
    /// so a server has one check in flight at a time. Default 1000.
    pub timeout_ms: u64,
    /// Consecutive failures that take a server out of rotation (`Down`):
    /// failed checks, and with [`passive`](Self::passive) failed requests of
    /// one dispatcher. Default 3.
    pub unhealthy_threshold: u32,
    /// Consecutive successful checks that bring a `Down` server back `Up`.
    /// Default 2.
    pub healthy_threshold: u32,
    /// Milliseconds between two reads of a server's `/metrics`. Default 1000.
    pub scrape_interval_ms: u64,
    /// Scraped load figures older than this many ms are ignored by routing.
    /// At least `scrape_interval_ms`. Default 5000.
    pub stale_after_ms: u64,
    /// Passive checks: dispatchers count connection errors, 5xx answers and
    /// cut bodies towards `unhealthy_threshold`. Default true.
    pub passive: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            path: "/health".to_owned(),
            interval_ms: 2000,
            timeout_ms: 1000,
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            scrape_interval_ms: 1000,
            stale_after_ms: 5000,
            passive: true,
        }
    }
}

impl HealthConfig {
    /// [`interval_ms`](Self::interval_ms) as a duration.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// [`timeout_ms`](Self::timeout_ms) as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// [`scrape_interval_ms`](Self::scrape_interval_ms) as a duration.
    pub fn scrape_interval(&self) -> Duration {
        Duration::from_millis(self.scrape_interval_ms)
    }
}

/// The admin API (`[admin]`): an HTTP listener of the supervisor, separate
/// from the gateway's, where operators list, add, drain and remove
/// backends and flush the shared tables. Every request must carry
/// `Authorization: Bearer <token>`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Where the admin API listens; `None` (the default): no admin API.
    #[serde(deserialize_with = "optional_socket_addr")]
    pub listen: Option<SocketAddr>,
    /// The bearer token, written in the file. Required with `listen`
    /// unless [`token_file`](Self::token_file) is set; not both.
    pub token: Option<String>,
    /// A file holding the bearer token (trailing whitespace ignored). It
    /// must not be world-readable; that is checked when the supervisor
    /// starts ([`AdminConfig::read_token`]).
    pub token_file: Option<PathBuf>,
}

impl AdminConfig {
    /// The bearer token: [`token`](Self::token), or the contents of
    /// [`token_file`](Self::token_file) (which must exist, not be readable
    /// by others, and hold a valid token). `None` when neither is set.
    /// Errors name the key.
    pub fn read_token(&self) -> Result<Option<String>, ConfigError> {
        if let Some(token) = &self.token {
            return Ok(Some(token.clone()));
        }
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let shown = quoted(&path.display().to_string());
        let invalid = |reason: String| ConfigError::invalid("admin.token_file", &shown, reason);
        let meta = std::fs::metadata(path).map_err(|e| invalid(format!("cannot read it: {e}")))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o007 != 0 {
                return Err(invalid(format!(
                    "it is readable by every user (mode {mode:04o}); the token guards the admin API: chmod o-rwx it (0600 or 0640)"
                )));
            }
        }
        if !meta.is_file() {
            return Err(invalid("it is not a regular file".into()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| invalid(format!("cannot read it: {e}")))?;
        let token = text.trim_end().to_owned();
        check_admin_token(&token).map_err(|reason| invalid(format!("its contents: {reason}")))?;
        Ok(Some(token))
    }
}

/// Whether `token` is usable as a bearer token; the reason if not.
fn check_admin_token(token: &str) -> Result<(), String> {
    if !(MIN_ADMIN_TOKEN_BYTES..=MAX_ADMIN_TOKEN_BYTES).contains(&token.len()) {
        return Err(format!(
            "a token must be {MIN_ADMIN_TOKEN_BYTES} to {MAX_ADMIN_TOKEN_BYTES} characters long (e.g. `openssl rand -hex 32`)"
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a token must be visible ASCII characters only (no spaces)".into());
    }
    Ok(())
}

/// The default number of dispatchers: one per CPU core, at most
/// [`MAX_DISPATCHERS`].
pub fn default_dispatchers() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(MAX_DISPATCHERS)
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            dispatchers: default_dispatchers(),
            responders: 1,
            shm_name: DEFAULT_SHM_NAME.to_owned(),
            shm_size: DEFAULT_SHM_SIZE,
            tokenizer: None,
            chat_template: None,
            block_size: DEFAULT_BLOCK_SIZE,
            segment_cache_size: DEFAULT_SEGMENT_CACHE_SIZE,
            backends: Vec::new(),
            policy: PolicyConfig::default(),
            response_cache: ResponseCacheConfig::default(),
            limits: LimitsConfig::default(),
            store: StoreConfig::default(),
            health: HealthConfig::default(),
            admin: AdminConfig::default(),
            drain_timeout_secs: 30,
        }
    }
}

/// Command-line flags of `semlb serve` that override the file; `None` (or
/// an absent flag) keeps the file's value.
#[derive(Debug, Clone, Default)]
pub struct ServeOverrides {
    /// `--listen ADDR`.
    pub listen: Option<SocketAddr>,
    /// `--dispatchers N`.
    pub dispatchers: Option<usize>,
    /// `--responders N`.
    pub responders: Option<usize>,
    /// `--shm-name NAME`.
    pub shm_name: Option<String>,
    /// `--shm-size SIZE`.
    pub shm_size: Option<ByteSize>,
    /// `--backend URL`, repeatable: when given, these replace the file's
    /// `[[backend]]` list (with no names and `metrics_flavor = "auto"`).
    pub backends: Option<Vec<String>>,
    /// `--tokenizer PATH`.
    pub tokenizer: Option<PathBuf>,
    /// `--chat-template PATH`.
    pub chat_template: Option<PathBuf>,
    /// `--block-size N`.
    pub block_size: Option<usize>,
    /// `--policy KIND`: the policy kind; its parameters stay the file's.
    pub policy: Option<PolicyKind>,
    /// `--store KIND`.
    pub store: Option<StoreKind>,
    /// `--redis-url URL`.
    pub redis_url: Option<String>,
    /// `--redis-namespace NS`.
    pub redis_namespace: Option<String>,
    /// `--redis-lookup script|naive`.
    pub redis_lookup: Option<RedisLookup>,
    /// `--admin-listen ADDR`.
    pub admin_listen: Option<SocketAddr>,
    /// `--admin-token-file PATH`: replaces the file's `admin.token` and
    /// `admin.token_file`.
    pub admin_token_file: Option<PathBuf>,
}

impl ServeConfig {
    /// Reads and parses the configuration file at `path`; with no path, the
    /// defaults. Does not validate: flags may still complete it (e.g. with
    /// `--backend`), see [`resolve`](Self::resolve).
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses a configuration read from `path` (used in messages, and as
    /// the base of relative `tokenizer` and `chat_template` paths). Does not
    /// validate.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let mut config: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let base = path.parent().unwrap_or(Path::new(""));
        for file in [
            &mut config.tokenizer,
            &mut config.chat_template,
            &mut config.admin.token_file,
        ]
        .into_iter()
        .flatten()
        {
            if file.is_relative() {
                *file = base.join(&*file);
            }
        }
        Ok(config)
    }

    /// Puts the flags over the configuration.
    pub fn apply(&mut self, overrides: ServeOverrides) {
        let ServeOverrides {
            listen,
            dispatchers,
            responders,
            shm_name,
            shm_size,
            backends,
            tokenizer,
            chat_template,
            block_size,
            policy,
            store,
            redis_url,
            redis_namespace,
            redis_lookup,
            admin_listen,
            admin_token_file,
        } = overrides;
        if let Some(v) = admin_listen {
            self.admin.listen = Some(v);
        }
        if let Some(v) = admin_token_file {
            self.admin.token = None;
            self.admin.token_file = Some(v);
        }
        if let Some(v) = store {
            self.store.kind = v;
        }
        if let Some(v) = redis_url {
            self.store.redis.url = v;
        }
        if let Some(v) = redis_namespace {
            self.store.redis.namespace = v;
        }
        if let Some(v) = redis_lookup {
            self.store.redis.lookup = v;
        }
        if let Some(v) = listen {
            self.listen = v;
        }
        if let Some(v) = dispatchers {
            self.dispatchers = v;
        }
        if let Some(v) = responders {
            self.responders = v;
        }
        if let Some(v) = shm_name {
            self.shm_name = v;
        }
        if let Some(v) = shm_size {
            self.shm_size = v;
        }
        if let Some(urls) = backends {
            self.backends = urls.into_iter().map(BackendConfig::new).collect();
        }
        if let Some(v) = tokenizer {
            self.tokenizer = Some(v);
        }
        if let Some(v) = chat_template {
            self.chat_template = Some(v);
        }
        if let Some(v) = block_size {
            self.block_size = v;
        }
        if let Some(kind) = policy {
            self.policy.kind = kind;
        }
    }

    /// The configuration `semlb serve` runs with: the file (if any), the
    /// flags over it, validated.
    pub fn resolve(path: Option<&Path>, overrides: ServeOverrides) -> Result<Self, ConfigError> {
        let mut config = Self::load(path)?;
        config.apply(overrides);
        config.validate()?;
        Ok(config)
    }

    /// [`drain_timeout_secs`](Self::drain_timeout_secs) as a duration.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }

    /// Checks every value and the relations between them; the first
    /// problem found is returned, naming the key, the value and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        if self.dispatchers == 0 {
            return Err(E::invalid("dispatchers", 0, "must be at least 1"));
        }
        if self.dispatchers > MAX_DISPATCHERS {
            return Err(E::invalid(
                "dispatchers",
                self.dispatchers,
                format!("must be at most {MAX_DISPATCHERS} (the segment has one completion ring per dispatcher)"),
            ));
        }
        if self.responders == 0 {
            return Err(E::invalid("responders", 0, "must be at least 1"));
        }
        if self.responders > self.dispatchers {
            return Err(E::invalid(
                "responders",
                self.responders,
                format!(
                    "must be at most dispatchers = {} (a responder drains at least one dispatcher's ring; more would idle)",
                    self.dispatchers
                ),
            ));
        }
        let processes = self.dispatchers + self.responders + 1;
        if processes > PROCESS_SLOTS as usize {
            return Err(E::invalid(
                "responders",
                self.responders,
                format!(
                    "dispatchers + responders + the supervisor = {processes} processes, more than the segment's {PROCESS_SLOTS} process slots"
                ),
            ));
        }
        if let Err(e) = shm_layout::shm_path(&self.shm_name) {
            return Err(E::invalid("shm_name", quoted(&self.shm_name), e.reason));
        }
        let size = self.shm_size.bytes();
        if !(MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&size) {
            return Err(E::invalid(
                "shm_size",
                quoted(&self.shm_size.to_string()),
                format!(
                    "must be between {} and {}",
                    ByteSize(MIN_SEGMENT_BYTES),
                    ByteSize(MAX_SEGMENT_BYTES)
                ),
            ));
        }
        for (field, path) in [("tokenizer", &self.tokenizer), ("chat_template", &self.chat_template)] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(E::invalid(
                    field,
                    "\"\"",
                    "must not be empty (leave it out for the default)",
                ));
            }
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(E::invalid(
                "block_size",
                self.block_size,
                format!("must be between 1 and {MAX_BLOCK_SIZE} tokens (the engines' KV block size, usually 16)"),
            ));
        }
        if self.segment_cache_size.bytes() > MAX_SEGMENT_CACHE_SIZE.bytes() {
            return Err(E::invalid(
                "segment_cache_size",
                quoted(&self.segment_cache_size.to_string()),
                format!("must be at most {MAX_SEGMENT_CACHE_SIZE} (per dispatcher)"),
            ));
        }
        self.validate_backends()?;
        if let Err(message) = self.policy.validate() {
            // `PolicyConfig` says `key = value: reason` relative to its table.
            let parts = message
                .split_once(" = ")
                .and_then(|(key, rest)| Some((key, rest.split_once(": ")?)));
            return Err(match parts {
                Some((key, (value, reason))) => E::invalid(format!("policy.{key}"), value, reason),
                None => E::invalid("policy.kind", quoted(self.policy.kind.name()), message),
            });
        }
        self.validate_response_cache()?;
        self.validate_limits()?;
        self.validate_store()?;
        self.validate_health()?;
        self.validate_admin()?;
        if self.drain_timeout_secs > MAX_TIMEOUT_SECS {
            return Err(E::invalid(
                "drain_timeout_secs",
                self.drain_timeout_secs,
                format!("must be at most {MAX_TIMEOUT_SECS} (one day)"),
            ));
        }
        Ok(())
    }

    fn validate_store(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let r = &self.store.redis;
        if let Err(e) = redis::Client::open(r.url.as_str()) {
            return Err(E::invalid("store.redis.url", quoted(&r.url), e.to_string()));
        }
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
        if r.namespace.is_empty() || r.namespace.len() > MAX_BACKEND_NAME_BYTES || !r.namespace.chars().all(name_ok) {
            return Err(E::invalid(
                "store.redis.namespace",
                quoted(&r.namespace),
                format!("must be 1 to {MAX_BACKEND_NAME_BYTES} bytes of A-Z a-z 0-9 . _ : -"),
            ));
        }
        if !(1..=MAX_TTL_SECS).contains(&r.prefix_ttl_secs) {
            return Err(E::invalid(
                "store.redis.prefix_ttl_secs",
                r.prefix_ttl_secs,
                format!("must be between 1 and {MAX_TTL_SECS} (one year)"),
            ));
        }
        if !(1..=60_000).contains(&r.timeout_ms) {
            return Err(E::invalid(
                "store.redis.timeout_ms",
                r.timeout_ms,
                "must be between 1 and 60000",
            ));
        }
        if !(10..=60_000).contains(&r.retry_ms) {
            return Err(E::invalid(
                "store.redis.retry_ms",
                r.retry_ms,
                "must be between 10 and 60000",
            ));
        }
        if r.write_backlog > 1_000_000 {
            return Err(E::invalid(
                "store.redis.write_backlog",
                r.write_backlog,
                "must be at most 1000000",
            ));
        }
        Ok(())
    }

    fn validate_health(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let h = &self.health;
        let path_ok = h.path.starts_with('/')
            && h.path.len() <= MAX_HEALTH_PATH_BYTES
            && !h.path.contains('#')
            && h.path.parse::<http::uri::PathAndQuery>().is_ok();
        if !path_ok {
            return Err(E::invalid(
                "health.path",
                quoted(&h.path),
                format!(
                    "must be a URL path starting with '/', such as \"/health\" (at most {MAX_HEALTH_PATH_BYTES} bytes, no spaces or fragment)"
                ),
            ));
        }
        if !(10..=MAX_HEALTH_INTERVAL_MS).contains(&h.interval_ms) {
            return Err(E::invalid(
                "health.interval_ms",
                h.interval_ms,
                format!("must be between 10 and {MAX_HEALTH_INTERVAL_MS} (one hour)"),
            ));
        }
        if h.timeout_ms == 0 || h.timeout_ms > h.interval_ms {
            return Err(E::invalid(
                "health.timeout_ms",
                h.timeout_ms,
                format!(
                    "must be between 1 and health.interval_ms = {} (one check in flight per server at a time)",
                    h.interval_ms
                ),
            ));
        }
        for (field, value) in [
            ("health.unhealthy_threshold", h.unhealthy_threshold),
            ("health.healthy_threshold", h.healthy_threshold),
        ] {
            if !(1..=MAX_HEALTH_THRESHOLD).contains(&value) {
                return Err(E::invalid(
                    field,
                    value,
                    format!("must be between 1 and {MAX_HEALTH_THRESHOLD} (consecutive results)"),
                ));
            }
        }
        if !(10..=MAX_HEALTH_INTERVAL_MS).contains(&h.scrape_interval_ms) {
            return Err(E::invalid(
                "health.scrape_interval_ms",
                h.scrape_interval_ms,
                format!("must be between 10 and {MAX_HEALTH_INTERVAL_MS} (one hour)"),
            ));
        }
        if h.stale_after_ms < h.scrape_interval_ms || h.stale_after_ms > MAX_TIMEOUT_SECS * 1000 {
            return Err(E::invalid(
                "health.stale_after_ms",
                h.stale_after_ms,
                format!(
                    "must be between health.scrape_interval_ms = {} (else every figure is stale before the next scrape) and {} (one day)",
                    h.scrape_interval_ms,
                    MAX_TIMEOUT_SECS * 1000
                ),
            ));
        }
        Ok(())
    }

    fn validate_admin(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let admin = &self.admin;
        if let Some(token) = &admin.token {
            // Never echo the token itself.
            check_admin_token(token).map_err(|reason| E::invalid("admin.token", "\"(hidden)\"", reason))?;
        }
        if let (Some(_), Some(path)) = (&admin.token, &admin.token_file) {
            return Err(E::invalid(
                "admin.token_file",
                quoted(&path.display().to_string()),
                "set admin.token or admin.token_file, not both",
            ));
        }
        if admin.token_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(E::invalid("admin.token_file", "\"\"", "must not be empty"));
        }
        let Some(listen) = admin.listen else {
            return Ok(());
        };
        if admin.token.is_none() && admin.token_file.is_none() {
            return Err(E::invalid(
                "admin.listen",
                quoted(&listen.to_string()),
                "the admin API needs a bearer token: set admin.token or admin.token_file (or --admin-token-file)",
            ));
        }
        let same_ip =
            listen.ip() == self.listen.ip() || listen.ip().is_unspecified() || self.listen.ip().is_unspecified();
        // Port 0 picks a free port for each, so they never collide.
        if listen.port() != 0 && listen.port() == self.listen.port() && same_ip {
            return Err(E::invalid(
                "admin.listen",
                quoted(&listen.to_string()),
                format!(
                    "must differ from listen = {} (the admin API has its own address)",
                    quoted(&self.listen.to_string())
                ),
            ));
        }
        Ok(())
    }

    fn validate_backends(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        if self.backends.is_empty() {
            return Err(E::invalid(
                "backend",
                "[]",
                "at least one backend is needed ([[backend]] url = \"http://host:port\", or --backend URL)",
            ));
        }
        if self.backends.len() > MAX_BACKENDS {
            return Err(E::invalid(
                "backend",
                format!("[{} tables]", self.backends.len()),
                format!("at most {MAX_BACKENDS} backends fit the segment's server table"),
            ));
        }
        let mut urls: HashMap<BackendUrl, usize> = HashMap::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        for (i, backend) in self.backends.iter().enumerate() {
            let url = backend
                .parsed_url()
                .map_err(|reason| E::invalid(format!("backend[{i}].url"), quoted(&backend.url), reason))?;
            if let Some(first) = urls.insert(url, i) {
                return Err(E::invalid(
                    format!("backend[{i}].url"),
                    quoted(&backend.url),
                    format!("the same server as backend[{first}].url"),
                ));
            }
            if let (Some(name), Err(reason)) = (&backend.name, backend.check_name()) {
                return Err(E::invalid(format!("backend[{i}].name"), quoted(name), reason));
            }
            let name = backend.display_name();
            if let Some(first) = names.insert(name.clone(), i) {
                return Err(E::invalid(
                    format!("backend[{i}].name"),
                    quoted(&name),
                    format!("backend[{first}] has that name already; names must be unique"),
                ));
            }
        }
        Ok(())
    }

    fn validate_response_cache(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let cache = &self.response_cache;
        if cache.ttl_secs == 0 || cache.ttl_secs > MAX_TTL_SECS {
            return Err(E::invalid(
                "response_cache.ttl_secs",
                cache.ttl_secs,
                format!("must be between 1 and {MAX_TTL_SECS} (one year); to turn the cache off, set enabled = false"),
            ));
        }
        let f = cache.max_value_fraction;
        if !(f > 0.0 && f <= 0.5) {
            return Err(E::invalid(
                "response_cache.max_value_fraction",
                f,
                "must be greater than 0 and at most 0.5 (a share of the response log)",
            ));
        }
        Ok(())
    }

    fn validate_limits(&self) -> Result<(), ConfigError> {
        use ConfigError as E;

        let limits = &self.limits;
        if limits.max_body_bytes.bytes() == 0 {
            return Err(E::invalid(
                "limits.max_body_bytes",
                quoted(&limits.max_body_bytes.to_string()),
                "must be greater than 0 (every request would be refused)",
            ));
        }
        if limits.request_timeout_secs == 0 || limits.request_timeout_secs > MAX_TIMEOUT_SECS {
            return Err(E::invalid(
                "limits.request_timeout_secs",
                limits.request_timeout_secs,
                format!("must be between 1 and {MAX_TIMEOUT_SECS} (one day)"),
            ));
        }
        if limits.connect_timeout_ms == 0 {
            return Err(E::invalid("limits.connect_timeout_ms", 0, "must be at least 1"));
        }
        if limits.connect_timeout_ms > limits.request_timeout_secs * 1000 {
            return Err(E::invalid(
                "limits.connect_timeout_ms",
                limits.connect_timeout_ms,
                format!(
                    "must be at most limits.request_timeout_secs = {} in milliseconds ({})",
                    limits.request_timeout_secs,
                    limits.request_timeout_secs * 1000
                ),
            ));
        }
        if limits.retries > MAX_RETRIES {
            return Err(E::invalid(
                "limits.retries",
                limits.retries,
                format!("must be at most {MAX_RETRIES} (more retries only multiply the load on failing servers)"),
            ));
        }
        Ok(())
    }
}

/// `listen`: a socket address, with a message saying what one looks like.
fn socket_addr<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|_| {
        serde::de::Error::custom(format_args!(
            "invalid address {text:?}: expected an IP address and a port, such as \"0.0.0.0:8080\" or \"[::]:8080\" \
             (host names are not accepted)"
        ))
    })
}

/// `admin.listen`: like [`socket_addr`], present.
fn optional_socket_addr<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<SocketAddr>, D::Error> {
    socket_addr(deserializer).map(Some)
}

/// A string as TOML writes it, for error messages.
fn quoted(s: &str) -> String {
    format!("{s:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../systemd/semlb.toml");
    const EXAMPLE_PATH: &str = "/etc/semlb/semlb.toml";

    fn parse(text: &str) -> Result<ServeConfig, ConfigError> {
        ServeConfig::from_toml(text, Path::new("/etc/semlb/test.toml"))
    }

    fn parse_err(text: &str) -> String {
        match parse(text) {
            Err(e @ ConfigError::Parse { .. }) => e.to_string(),
            other => panic!("expected a parse error for {text:?}, got {other:?}"),
        }
    }

    /// The defaults plus one backend: valid.
    fn valid() -> ServeConfig {
        let mut config = ServeConfig::default();
        config.backends.push(BackendConfig::new("http://127.0.0.1:8000"));
        config
    }

    fn invalid(config: &ServeConfig) -> (String, String, String, String) {
        match config.validate() {
            Err(e @ ConfigError::Invalid { .. }) => {
                let shown = e.to_string();
                let ConfigError::Invalid { field, value, reason } = e else {
                    unreachable!()
                };
                (field, value, reason, shown)
            }
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    /// The example with its commented-out settings (`# key = value`) turned on.
    fn example_uncommented() -> String {
        EXAMPLE
            .lines()
            .map(|line| {
                let body = line.strip_prefix('#').map(str::trim_start);
                match body {
                    Some(body) if is_setting(body) => body,
                    _ => line,
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `key = ...` with a lower-case key: a setting rather than prose.
    fn is_setting(line: &str) -> bool {
        line.split_once(" = ")
            .is_some_and(|(key, _)| !key.is_empty() && key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
    }

    #[test]
    fn defaults() {
        let c = ServeConfig::default();
        assert_eq!(c.listen, "0.0.0.0:8080".parse().unwrap());
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(c.dispatchers, cores.min(64));
        assert!(c.dispatchers >= 1);
        assert_eq!(c.responders, 1);
        assert_eq!(c.shm_name, "semlb");
        assert_eq!(c.shm_size, ByteSize(256 << 20));
        assert_eq!(c.tokenizer, None);
        assert_eq!(c.chat_template, None);
        assert_eq!(c.block_size, 16);
        assert!(c.backends.is_empty());
        assert_eq!(c.policy, PolicyConfig::default());
        assert_eq!(c.policy.kind, PolicyKind::CacheAware);
        assert_eq!(
            c.response_cache,
            ResponseCacheConfig {
                enabled: true,
                ttl_secs: 300,
                scope: CacheScope::Tenant,
                max_value_fraction: 0.125,
                cache_nondeterministic: false,
            }
        );
        assert_eq!(
            c.limits,
            LimitsConfig {
                max_body_bytes: ByteSize(16 << 20),
                request_timeout_secs: 600,
                connect_timeout_ms: 2000,
                retries: 2,
            }
        );
        assert_eq!(
            c.health,
            HealthConfig {
                path: "/health".into(),
                interval_ms: 2000,
                timeout_ms: 1000,
                unhealthy_threshold: 3,
                healthy_threshold: 2,
                scrape_interval_ms: 1000,
                stale_after_ms: 5000,
                passive: true,
            }
        );
        assert_eq!(c.health.interval(), Duration::from_secs(2));
        assert_eq!(c.health.timeout(), Duration::from_secs(1));
        assert_eq!(c.health.scrape_interval(), Duration::from_secs(1));
        assert_eq!(c.drain_timeout_secs, 30);
        assert_eq!(c.drain_timeout(), Duration::from_secs(30));
        assert_eq!(c.limits.request_timeout(), Duration::from_secs(600));
        assert_eq!(c.limits.connect_timeout(), Duration::from_millis(2000));
        assert_eq!(c.response_cache.ttl(), Duration::from_secs(300));

        // An empty file and no file are the defaults too.
        assert_eq!(parse("").unwrap(), c);
        assert_eq!(ServeConfig::load(None).unwrap(), c);
        // The defaults lack only a backend.
        let (field, ..) = invalid(&c);
        assert_eq!(field, "backend");
        valid().validate().unwrap();
    }

    #[test]
    fn example_file_parses_validates_and_shows_the_defaults() {
        let c = ServeConfig::from_toml(EXAMPLE, Path::new(EXAMPLE_PATH)).unwrap();
        c.validate().unwrap();
        // Every value it sets is the default, so it documents them truly.
        let defaults = ServeConfig {
            backends: c.backends.clone(),
            ..ServeConfig::default()
        };
        assert_eq!(c, defaults);
        let flavors: Vec<MetricsFlavor> = c.backends.iter().map(|b| b.metrics_flavor).collect();
        assert_eq!(
            flavors,
            [MetricsFlavor::Vllm, MetricsFlavor::Auto, MetricsFlavor::Llamacpp]
        );
    }

    #[test]
    fn example_file_with_every_commented_setting_enabled_parses() {
        let text = example_uncommented();
        assert_ne!(
            text.trim_end(),
            EXAMPLE.trim_end(),
            "the example should have commented-out settings"
        );
        let mut c = ServeConfig::from_toml(&text, Path::new(EXAMPLE_PATH)).unwrap();
        // admin.token and admin.token_file are alternatives; the example shows both.
        assert!(c.admin.listen.is_some() && c.admin.token.is_some() && c.admin.token_file.is_some());
        c.admin.token = None;
        c.validate().unwrap();
        assert!(c.tokenizer.is_some() && c.chat_template.is_some(), "{c:?}");
        assert!(c.backends.iter().any(|b| b.name.is_some()), "{c:?}");
        // Every key of the schema appears in the example.
        for key in [
            "listen",
            "dispatchers",
            "responders",
            "shm_name",
            "shm_size",
            "tokenizer",
            "chat_template",
            "block_size",
            "segment_cache_size",
            "drain_timeout_secs",
            "[[backend]]",
            "url",
            "name",
            "metrics_flavor",
            "[policy]",
            "kind",
            "[policy.queue]",
            "capacity",
            "max_wait_ms",
            "recheck_ms",
            "[policy.cache_aware]",
            "cache_threshold",
            "balance_abs_threshold",
            "balance_rel_threshold",
            "[policy.selective_push]",
            "mode",
            "max_pending",
            "max_outstanding",
            "[policy.consistent_hash]",
            "key_headers",
            "user_field",
            "fallback_prefix_blocks",
            "virtual_nodes",
            "bounded_load",
            "load_epsilon",
            "[policy.dual_map]",
            "min_prefix_blocks",
            "max_prefix_blocks",
            "hot_share",
            "window",
            "ttft_slo_ms",
            "prefill_tokens_per_sec",
            "[policy.weighted_scorers]",
            "prefix_weight",
            "queue_weight",
            "kv_cache_weight",
            "load_weight",
            "pick",
            "[response_cache]",
            "enabled",
            "ttl_secs",
            "scope",
            "max_value_fraction",
            "cache_nondeterministic",
            "[limits]",
            "max_body_bytes",
            "request_timeout_secs",
            "connect_timeout_ms",
            "retries",
            "[store]",
            "[store.redis]",
            "url",
            "namespace",
            "prefix_ttl_secs",
            "timeout_ms",
            "retry_ms",
            "lookup",
            "write_backlog",
            "[health]",
            "path",
            "interval_ms",
            "timeout_ms",
            "unhealthy_threshold",
            "healthy_threshold",
            "scrape_interval_ms",
            "stale_after_ms",
            "passive",
            "[admin]",
            "listen",
            "token",
            "token_file",
        ] {
            let present = text
                .lines()
                .any(|l| l.trim() == key || l.split_once(" = ").is_some_and(|(k, _)| k.trim() == key));
            assert!(present, "{key} is missing from systemd/semlb.toml");
        }
    }

    #[test]
    fn full_file_parses() {
        let text = r#"
listen = "127.0.0.1:9000"
dispatchers = 4
responders = 2
shm_name = "semlb-test"
shm_size = "1GiB"
tokenizer = "tok/tokenizer.json"
chat_template = "/models/qwen/tokenizer_config.json"
block_size = 32
drain_timeout_secs = 5

[[backend]]
url = "http://10.0.0.1:8000"
name = "gpu-0"
metrics_flavor = "vllm"

[[backend]]
url = "http://[::1]:30000/"
metrics_flavor = "sglang"

[[backend]]
url = "HTTP://Llama.Local:8080"
metrics_flavor = "llamacpp"

[response_cache]
enabled = false
ttl_secs = 60
scope = "global"
max_value_fraction = 0.25
cache_nondeterministic = true

[limits]
max_body_bytes = "1MiB"
request_timeout_secs = 120
connect_timeout_ms = 500
retries = 0
"#;
        let c = parse(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.listen, "127.0.0.1:9000".parse().unwrap());
        assert_eq!((c.dispatchers, c.responders), (4, 2));
        assert_eq!(c.shm_name, "semlb-test");
        assert_eq!(c.shm_size, ByteSize(1 << 30));
        // Relative to the file's directory; absolute paths stay.
        assert_eq!(c.tokenizer, Some(PathBuf::from("/etc/semlb/tok/tokenizer.json")));
        assert_eq!(
            c.chat_template,
            Some(PathBuf::from("/models/qwen/tokenizer_config.json"))
        );
        assert_eq!(c.block_size, 32);
        assert_eq!(c.drain_timeout_secs, 5);
        assert_eq!(
            c.backends[0],
            BackendConfig {
                url: "http://10.0.0.1:8000".into(),
                name: Some("gpu-0".into()),
                metrics_flavor: MetricsFlavor::Vllm,
            }
        );
        let names: Vec<String> = c.backends.iter().map(BackendConfig::display_name).collect();
        assert_eq!(names, ["gpu-0", "[::1]:30000", "llama.local:8080"]);
        let flavors: Vec<MetricsFlavor> = c.backends.iter().map(|b| b.metrics_flavor).collect();
        assert_eq!(
            flavors,
            [MetricsFlavor::Vllm, MetricsFlavor::Sglang, MetricsFlavor::Llamacpp]
        );
        assert_eq!(
            c.response_cache,
            ResponseCacheConfig {
                enabled: false,
                ttl_secs: 60,
                scope: CacheScope::Global,
                max_value_fraction: 0.25,
                cache_nondeterministic: true,
            }
        );
        assert_eq!(
            c.limits,
            LimitsConfig {
                max_body_bytes: ByteSize(1 << 20),
                request_timeout_secs: 120,
                connect_timeout_ms: 500,
                retries: 0,
            }
        );
    }

    #[test]
    fn policy_table() {
        let c = parse("[policy]\nkind = \"round_robin\"\n").unwrap();
        assert_eq!(
            c.policy,
            PolicyConfig {
                kind: PolicyKind::RoundRobin,
                ..PolicyConfig::default()
            }
        );
        let c = parse("[policy.cache_aware]\nbalance_abs_threshold = 64\n").unwrap();
        assert_eq!(c.policy.kind, PolicyKind::CacheAware);
        assert_eq!(c.policy.cache_aware.balance_abs_threshold, 64);
        assert_eq!(c.policy.cache_aware.cache_threshold, 0.5);
        let msg = parse_err("[policy]\nkind = \"fastest\"\n");
        assert!(
            msg.contains("unknown variant `fastest`") && msg.contains("line 2"),
            "{msg}"
        );
    }

    #[test]
    fn the_policies_of_the_field_take_their_tables() {
        let mut c = parse(
            r#"
[[backend]]
url = "http://127.0.0.1:8000"
[policy]
kind = "dual_map"
[policy.queue]
capacity = 8
[policy.selective_push]
mode = "max_outstanding"
max_outstanding = 4
[policy.consistent_hash]
key_headers = ["X-Tenant"]
bounded_load = false
[policy.dual_map]
ttft_slo_ms = 500
prefill_tokens_per_sec = 2e5
[policy.weighted_scorers]
pick = "weighted_random"
kv_cache_weight = 0.0
"#,
        )
        .unwrap();
        c.validate().unwrap();
        let p = &c.policy;
        assert_eq!(p.kind, PolicyKind::DualMap);
        assert_eq!((p.queue.capacity, p.queue.max_wait_ms), (8, 60_000));
        assert_eq!(p.selective_push.mode, crate::routing::PushMode::MaxOutstanding);
        assert_eq!(p.selective_push.max_outstanding, 4);
        assert_eq!(p.consistent_hash.key_headers, ["X-Tenant"]);
        assert!(!p.consistent_hash.bounded_load);
        assert_eq!((p.dual_map.ttft_slo_ms, p.dual_map.prefill_tokens_per_sec), (500, 2e5));
        assert_eq!(p.weighted_scorers.pick, crate::routing::Pick::WeightedRandom);
        // Errors name the key under [policy.…], its value and why.
        c.policy.consistent_hash.key_headers = vec!["bad header".into()];
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("policy.consistent_hash.key_headers") && e.contains("bad header"),
            "{e}"
        );
        c.policy = PolicyConfig::default();
        c.policy.queue.capacity = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("policy.queue.capacity") && e.contains("1 and 1000000"),
            "{e}"
        );
    }

    #[test]
    fn partial_tables_keep_the_other_defaults() {
        let c = parse("[limits]\nretries = 5\n[response_cache]\nscope = \"global\"\n").unwrap();
        assert_eq!(
            c.limits,
            LimitsConfig {
                retries: 5,
                ..LimitsConfig::default()
            }
        );
        assert_eq!(
            c.response_cache,
            ResponseCacheConfig {
                scope: CacheScope::Global,
                ..ResponseCacheConfig::default()
            }
        );
        assert_eq!(c.block_size, DEFAULT_BLOCK_SIZE);
    }

    #[test]
    fn unknown_keys_are_rejected_naming_key_and_line() {
        let cases: &[(&str, &str, usize)] = &[
            ("listen = \"0.0.0.0:1\"\nlisten_addr = \"x\"\n", "listen_addr", 2),
            ("\n\n[limits]\nretries = 1\nmax_retries = 3\n", "max_retries", 5),
            ("[response_cache]\nttl = 5\n", "ttl", 2),
            ("[[backend]]\nurl = \"http://a:1\"\nweight = 2\n", "weight", 3),
            ("[policy]\nthreshhold = 0.5\n", "threshhold", 2),
            ("[policy.cache_aware]\nthreshold = 0.5\n", "threshold", 2),
            ("[health]\ninterval = 5\n", "interval", 2),
            ("[caches]\nenabled = true\n", "caches", 1),
            // The list is `[[backend]]`, not `backends`.
            ("[[backends]]\nurl = \"http://a:1\"\n", "backends", 1),
        ];
        for (text, key, line) in cases {
            let msg = parse_err(text);
            assert!(msg.contains(&format!("unknown field `{key}`")), "{key}: {msg}");
            assert!(msg.contains(&format!("line {line}")), "{key}: {msg}");
            assert!(msg.contains("/etc/semlb/test.toml"), "{msg}");
        }
    }

    #[test]
    fn wrong_types_are_rejected_with_the_line() {
        let cases: &[(&str, usize, &str)] = &[
            ("# comment\n\ndispatchers = \"four\"\n", 3, "invalid type"),
            ("listen = 8080\n", 1, "invalid type"),
            (
                "listen = \"localhost:8080\"\n",
                1,
                "invalid address \"localhost:8080\": expected an IP address and a port",
            ),
            ("responders = -1\n", 1, "-1"),
            ("[response_cache]\nenabled = \"yes\"\n", 2, "invalid type"),
            (
                "[response_cache]\nscope = \"everyone\"\n",
                2,
                "unknown variant `everyone`",
            ),
            (
                "[[backend]]\nurl = \"http://a:1\"\nmetrics_flavor = \"tgi\"\n",
                3,
                "unknown variant `tgi`",
            ),
            ("[[backend]]\nname = \"a\"\n", 1, "missing field `url`"),
            ("backend = \"http://a:1\"\n", 1, "invalid type"),
            ("[limits]\nretries = 1.5\n", 2, "invalid type"),
            ("block_size = 16\nblock_size = 32\n", 2, "duplicate key"),
            ("shm_size = 256MiB\n", 1, "TOML parse error"),
        ];
        for (text, line, what) in cases {
            let msg = parse_err(text);
            assert!(msg.contains(&format!("line {line}")), "{text:?}: {msg}");
            assert!(msg.contains(what), "{text:?}: {msg}");
        }
    }

    #[test]
    fn sizes_parse_from_strings_and_integers() {
        let cases: &[(&str, u64)] = &[
            ("\"256MiB\"", 256 << 20),
            ("\"1.5GiB\"", 3 << 29),
            ("\"100MB\"", 100_000_000),
            ("\"64 m\"", 64 << 20),
            ("\"16777216\"", 16 << 20),
            ("268435456", 256 << 20),
        ];
        for (value, want) in cases {
            let c = parse(&format!("shm_size = {value}\n[limits]\nmax_body_bytes = {value}\n")).unwrap();
            assert_eq!(c.shm_size, ByteSize(*want), "{value}");
            assert_eq!(c.limits.max_body_bytes, ByteSize(*want), "{value}");
        }
        let cases: &[(&str, &[&str])] = &[
            ("\"12XB\"", &["\"12XB\"", "unknown unit \"XB\""]),
            ("\"\"", &["it is empty"]),
            ("\"1.5\"", &["not a whole number of bytes"]),
            ("\"99999999999TiB\"", &["larger than"]),
            ("-5", &["cannot be negative"]),
            ("1.5", &["invalid type"]),
            ("true", &["invalid type"]),
        ];
        for (value, wants) in cases {
            let msg = parse_err(&format!("\n[limits]\nmax_body_bytes = {value}\n"));
            assert!(msg.contains("line 3"), "{value}: {msg}");
            for want in *wants {
                assert!(msg.contains(want), "{value}: {msg}");
            }
        }
    }

    #[test]
    fn unreadable_file_is_a_read_error_naming_it() {
        let path = Path::new("/nonexistent/semlb/semlb.toml");
        let err = ServeConfig::load(Some(path)).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Read { path: p, source } if p == path && source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(err.to_string().contains("/nonexistent/semlb/semlb.toml"), "{err}");
    }

    #[test]
    fn invalid_error_names_field_value_and_reason() {
        let mut c = valid();
        c.dispatchers = 0;
        let err = c.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: dispatchers = 0: must be at least 1"
        );
    }

    #[test]
    fn each_validation_rule() {
        type Mutate = fn(&mut ServeConfig);
        let cases: &[(&str, Mutate, &str, &str, &str)] = &[
            ("dispatchers", |c| c.dispatchers = 0, "dispatchers", "0", "at least 1"),
            ("dispatchers", |c| c.dispatchers = 65, "dispatchers", "65", "at most 64"),
            ("responders", |c| c.responders = 0, "responders", "0", "at least 1"),
            (
                "responders",
                |c| {
                    c.dispatchers = 2;
                    c.responders = 3
                },
                "responders",
                "3",
                "at most dispatchers = 2",
            ),
            (
                "processes",
                |c| {
                    c.dispatchers = 64;
                    c.responders = 64
                },
                "responders",
                "64",
                "129 processes",
            ),
            ("shm_name", |c| c.shm_name = String::new(), "shm_name", "\"\"", "empty"),
            ("shm_name", |c| c.shm_name = "a/b".into(), "shm_name", "\"a/b\"", "'/'"),
            (
                "shm_name",
                |c| c.shm_name = "x".repeat(201),
                "shm_name",
                "xxx",
                "longer than 200",
            ),
            (
                "shm_size",
                |c| c.shm_size = ByteSize(4 << 20),
                "shm_size",
                "\"4 MiB\"",
                "between 8 MiB and 1 TiB",
            ),
            (
                "shm_size",
                |c| c.shm_size = ByteSize(2 << 40),
                "shm_size",
                "\"2 TiB\"",
                "between 8 MiB and 1 TiB",
            ),
            (
                "tokenizer",
                |c| c.tokenizer = Some(PathBuf::new()),
                "tokenizer",
                "\"\"",
                "empty",
            ),
            (
                "chat_template",
                |c| c.chat_template = Some(PathBuf::new()),
                "chat_template",
                "\"\"",
                "empty",
            ),
            (
                "block_size",
                |c| c.block_size = 0,
                "block_size",
                "0",
                "between 1 and 1024",
            ),
            (
                "block_size",
                |c| c.block_size = 1025,
                "block_size",
                "1025",
                "between 1 and 1024",
            ),
            (
                "no backend",
                |c| c.backends.clear(),
                "backend",
                "[]",
                "at least one backend",
            ),
            (
                "too many backends",
                |c| c.backends = (1..=129).map(|p| BackendConfig::new(format!("http://h:{p}"))).collect(),
                "backend",
                "129",
                "at most 128",
            ),
            (
                "bad url",
                |c| c.backends.push(BackendConfig::new("https://h:1")),
                "backend[1].url",
                "\"https://h:1\"",
                "scheme must be http",
            ),
            (
                "duplicate url",
                |c| c.backends.push(BackendConfig::new("http://127.0.0.1:8000/")),
                "backend[1].url",
                "\"http://127.0.0.1:8000/\"",
                "same server as backend[0].url",
            ),
            (
                "duplicate name",
                |c| {
                    c.backends[0].name = Some("gpu".into());
                    c.backends.push(BackendConfig {
                        name: Some("gpu".into()),
                        ..BackendConfig::new("http://b:1")
                    })
                },
                "backend[1].name",
                "\"gpu\"",
                "backend[0] has that name",
            ),
            (
                "name clashing with a default name",
                |c| {
                    c.backends.push(BackendConfig {
                        name: Some("h:2".into()),
                        ..BackendConfig::new("http://h:1")
                    });
                    c.backends.push(BackendConfig::new("http://h:2"))
                },
                "backend[2].name",
                "\"h:2\"",
                "backend[1] has that name",
            ),
            (
                "bad name",
                |c| c.backends[0].name = Some("gpu 0".into()),
                "backend[0].name",
                "\"gpu 0\"",
                "letters, digits",
            ),
            (
                "empty name",
                |c| c.backends[0].name = Some(String::new()),
                "backend[0].name",
                "\"\"",
                "1 to 64",
            ),
            (
                "ttl 0",
                |c| c.response_cache.ttl_secs = 0,
                "response_cache.ttl_secs",
                "0",
                "enabled = false",
            ),
            (
                "ttl huge",
                |c| c.response_cache.ttl_secs = MAX_TTL_SECS + 1,
                "response_cache.ttl_secs",
                "31536001",
                "one year",
            ),
            (
                "fraction 0",
                |c| c.response_cache.max_value_fraction = 0.0,
                "response_cache.max_value_fraction",
                "0",
                "greater than 0",
            ),
            (
                "fraction big",
                |c| c.response_cache.max_value_fraction = 0.75,
                "response_cache.max_value_fraction",
                "0.75",
                "at most 0.5",
            ),
            (
                "fraction NaN",
                |c| c.response_cache.max_value_fraction = f64::NAN,
                "response_cache.max_value_fraction",
                "NaN",
                "at most 0.5",
            ),
            (
                "body 0",
                |c| c.limits.max_body_bytes = ByteSize(0),
                "limits.max_body_bytes",
                "\"0 B\"",
                "greater than 0",
            ),
            (
                "request timeout 0",
                |c| c.limits.request_timeout_secs = 0,
                "limits.request_timeout_secs",
                "0",
                "between 1 and 86400",
            ),
            (
                "request timeout huge",
                |c| c.limits.request_timeout_secs = u64::MAX,
                "limits.request_timeout_secs",
                "18446744073709551615",
                "between 1 and 86400",
            ),
            (
                "connect timeout 0",
                |c| c.limits.connect_timeout_ms = 0,
                "limits.connect_timeout_ms",
                "0",
                "at least 1",
            ),
            (
                "connect timeout over the request timeout",
                |c| {
                    c.limits.request_timeout_secs = 2;
                    c.limits.connect_timeout_ms = 2001
                },
                "limits.connect_timeout_ms",
                "2001",
                "(2000)",
            ),
            (
                "retries",
                |c| c.limits.retries = 11,
                "limits.retries",
                "11",
                "at most 10",
            ),
            (
                "policy threshold",
                |c| c.policy.cache_aware.cache_threshold = 1.5,
                "policy.cache_aware.cache_threshold",
                "1.5",
                "between 0.0 and 1.0",
            ),
            (
                "policy ratio",
                |c| c.policy.cache_aware.balance_rel_threshold = 0.5,
                "policy.cache_aware.balance_rel_threshold",
                "0.5",
                ">= 1.0",
            ),
            (
                "drain timeout",
                |c| c.drain_timeout_secs = MAX_TIMEOUT_SECS + 1,
                "drain_timeout_secs",
                "86401",
                "at most 86400",
            ),
            (
                "redis url",
                |c| c.store.redis.url = "http://cache:6379".into(),
                "store.redis.url",
                "\"http://cache:6379\"",
                "",
            ),
            (
                "redis namespace",
                |c| c.store.redis.namespace = "a b".into(),
                "store.redis.namespace",
                "\"a b\"",
                "A-Z a-z 0-9",
            ),
            (
                "redis ttl",
                |c| c.store.redis.prefix_ttl_secs = 0,
                "store.redis.prefix_ttl_secs",
                "0",
                "between 1 and",
            ),
            (
                "redis timeout",
                |c| c.store.redis.timeout_ms = 0,
                "store.redis.timeout_ms",
                "0",
                "between 1 and 60000",
            ),
            (
                "redis retry",
                |c| c.store.redis.retry_ms = 5,
                "store.redis.retry_ms",
                "5",
                "between 10 and 60000",
            ),
            (
                "health path relative",
                |c| c.health.path = "health".into(),
                "health.path",
                "\"health\"",
                "starting with '/'",
            ),
            (
                "health path with a space",
                |c| c.health.path = "/he alth".into(),
                "health.path",
                "\"/he alth\"",
                "no spaces",
            ),
            (
                "health interval 0",
                |c| c.health.interval_ms = 0,
                "health.interval_ms",
                "0",
                "between 10 and 3600000",
            ),
            (
                "health timeout 0",
                |c| c.health.timeout_ms = 0,
                "health.timeout_ms",
                "0",
                "between 1 and health.interval_ms = 2000",
            ),
            (
                "health timeout over the interval",
                |c| c.health.timeout_ms = 2001,
                "health.timeout_ms",
                "2001",
                "one check in flight",
            ),
            (
                "health unhealthy threshold 0",
                |c| c.health.unhealthy_threshold = 0,
                "health.unhealthy_threshold",
                "0",
                "between 1 and 100",
            ),
            (
                "health healthy threshold big",
                |c| c.health.healthy_threshold = 101,
                "health.healthy_threshold",
                "101",
                "between 1 and 100",
            ),
            (
                "health scrape interval huge",
                |c| c.health.scrape_interval_ms = MAX_HEALTH_INTERVAL_MS + 1,
                "health.scrape_interval_ms",
                "3600001",
                "between 10 and 3600000",
            ),
            (
                "health stale before the next scrape",
                |c| c.health.stale_after_ms = 999,
                "health.stale_after_ms",
                "999",
                "scrape_interval_ms = 1000",
            ),
            (
                "admin without a token",
                |c| c.admin.listen = Some("127.0.0.1:9090".parse().unwrap()),
                "admin.listen",
                "\"127.0.0.1:9090\"",
                "needs a bearer token",
            ),
            (
                "admin on the gateway's address",
                |c| {
                    c.admin.listen = Some(c.listen);
                    c.admin.token = Some("0123456789abcdef".into())
                },
                "admin.listen",
                "\"0.0.0.0:8080\"",
                "must differ from listen",
            ),
            (
                "admin on the gateway's port",
                |c| {
                    c.admin.listen = Some("127.0.0.1:8080".parse().unwrap());
                    c.admin.token = Some("0123456789abcdef".into())
                },
                "admin.listen",
                "\"127.0.0.1:8080\"",
                "must differ from listen",
            ),
            (
                "admin token too short",
                |c| c.admin.token = Some("short".into()),
                "admin.token",
                "hidden",
                "16 to 4096 characters",
            ),
            (
                "admin token with a space",
                |c| c.admin.token = Some("0123456789 abcdef".into()),
                "admin.token",
                "hidden",
                "visible ASCII",
            ),
            (
                "admin token and token file",
                |c| {
                    c.admin.token = Some("0123456789abcdef".into());
                    c.admin.token_file = Some("/etc/semlb/admin.token".into())
                },
                "admin.token_file",
                "admin.token",
                "not both",
            ),
            (
                "admin token file empty",
                |c| c.admin.token_file = Some(PathBuf::new()),
                "admin.token_file",
                "\"\"",
                "must not be empty",
            ),
            (
                "redis backlog",
                |c| c.store.redis.write_backlog = 2_000_000,
                "store.redis.write_backlog",
                "2000000",
                "at most 1000000",
            ),
        ];
        for (name, mutate, field, value, reason) in cases {
            let mut c = valid();
            mutate(&mut c);
            let (f, v, r, shown) = invalid(&c);
            assert_eq!(f, *field, "{name}: {shown}");
            assert!(v.contains(value), "{name}: value {v:?} lacks {value:?}: {shown}");
            assert!(r.contains(reason), "{name}: reason {r:?} lacks {reason:?}: {shown}");
            assert!(shown.contains(&format!("{f} = {v}: {r}")), "{name}: {shown}");
        }
    }

    #[test]
    fn boundary_values_are_accepted() {
        type Mutate = fn(&mut ServeConfig);
        let cases: &[Mutate] = &[
            |c| c.dispatchers = 64,
            |c| {
                c.dispatchers = 64;
                c.responders = 63
            },
            |c| {
                c.dispatchers = 1;
                c.responders = 1
            },
            |c| c.shm_size = ByteSize(MIN_SEGMENT_BYTES),
            |c| c.shm_size = ByteSize(MAX_SEGMENT_BYTES),
            |c| c.shm_name = "/semlb".into(),
            |c| c.block_size = 1,
            |c| c.block_size = MAX_BLOCK_SIZE,
            |c| c.backends = (1..=128).map(|p| BackendConfig::new(format!("http://h:{p}"))).collect(),
            |c| c.response_cache.max_value_fraction = 0.5,
            |c| c.response_cache.ttl_secs = MAX_TTL_SECS,
            |c| c.limits.connect_timeout_ms = c.limits.request_timeout_secs * 1000,
            |c| c.limits.request_timeout_secs = MAX_TIMEOUT_SECS,
            |c| c.limits.retries = MAX_RETRIES,
            |c| c.limits.max_body_bytes = ByteSize(1),
            |c| c.drain_timeout_secs = 0,
            |c| c.listen = "[::]:0".parse().unwrap(),
            |c| c.backends[0].name = Some("gpu-0.rack_1:a".into()),
            |c| c.health.path = "/v1/models?probe=1".into(),
            |c| {
                c.health.interval_ms = 10;
                c.health.timeout_ms = 10;
                c.health.scrape_interval_ms = 10;
                c.health.stale_after_ms = 10
            },
            |c| {
                c.health.unhealthy_threshold = MAX_HEALTH_THRESHOLD;
                c.health.healthy_threshold = 1;
                c.health.passive = false
            },
            |c| c.health.stale_after_ms = MAX_TIMEOUT_SECS * 1000,
        ];
        for (i, mutate) in cases.iter().enumerate() {
            let mut c = valid();
            mutate(&mut c);
            assert!(c.validate().is_ok(), "case {i}: {:?}", c.validate());
        }
    }

    #[test]
    fn valid_sizes_give_a_valid_segment_layout() {
        for size in [MIN_SEGMENT_BYTES, 256 << 20, 3 << 29] {
            for fraction in [f64::MIN_POSITIVE, 0.125, 0.5] {
                let mut c = valid();
                c.shm_size = ByteSize(size);
                c.response_cache.max_value_fraction = fraction;
                c.validate().unwrap();
                let options = shm_layout::PlanOptions {
                    max_response_fraction: fraction,
                };
                shm_layout::LayoutPlan::new(size, options).unwrap();
            }
        }
    }

    #[test]
    fn backend_urls() {
        let good: &[(&str, &str, u16)] = &[
            ("http://127.0.0.1:8000", "127.0.0.1", 8000),
            ("http://127.0.0.1:8000/", "127.0.0.1", 8000),
            ("HTTP://Worker-1.Example.com:30000", "worker-1.example.com", 30000),
            ("http://vllm_0:8000", "vllm_0", 8000),
            ("http://[::1]:8080", "::1", 8080),
            ("http://[fe80:0:0::1]:1", "fe80::1", 1),
            ("http://h:65535", "h", 65535),
        ];
        for (url, host, port) in good {
            let parsed: BackendUrl = url.parse().unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!((parsed.host.as_str(), parsed.port), (*host, *port), "{url}");
        }
        assert_eq!(
            "http://[::1]:8080".parse::<BackendUrl>().unwrap().authority(),
            "[::1]:8080"
        );
        assert_eq!("http://A:1/".parse::<BackendUrl>().unwrap().to_string(), "http://a:1");

        let bad: &[(&str, &str)] = &[
            ("", "expected http://host:port"),
            ("127.0.0.1:8000", "expected http://host:port"),
            ("https://h:443", "scheme must be http, not \"https\""),
            ("grpc://h:1", "scheme must be http"),
            ("http://h", "port is missing"),
            ("http://h:", "port is missing"),
            ("http://h:0", "not in 1..=65535"),
            ("http://h:65536", "not in 1..=65535"),
            ("http://h:+80", "not a number"),
            ("http://h:80x", "not a number"),
            ("http://:8000", "host is missing"),
            ("http://h:1/v1", "path, query or fragment (found \"/v1\")"),
            ("http://h:1?x=1", "path, query or fragment"),
            ("http://h:1#f", "path, query or fragment"),
            ("http://user:pw@h:1", "user information"),
            ("http://::1:8000", "must be in brackets"),
            ("http://[::1:8000", "closed with ']'"),
            ("http://[::g]:8000", "not an IPv6 address"),
            ("http://[::1]8000", "expected ':port'"),
            ("http://[::1]", "port is missing"),
            ("http://bad host:1", "not a host name"),
            ("http://-h:1", "not a host name"),
            ("http://a..b:1", "not a host name"),
        ];
        for (url, want) in bad {
            let err = url.parse::<BackendUrl>().unwrap_err();
            assert!(err.contains(want), "{url}: {err}");
        }
        let long = format!("http://{}:1", "a.".repeat(130));
        assert!(
            long.parse::<BackendUrl>()
                .unwrap_err()
                .contains("longer than 256 bytes")
        );
    }

    #[test]
    fn overrides_win_over_the_file() {
        let mut c = parse(
            r#"
listen = "127.0.0.1:1"
dispatchers = 2
responders = 2
shm_name = "from-file"
shm_size = "64MiB"
tokenizer = "file-tokenizer.json"
chat_template = "file-template.json"
block_size = 32
[[backend]]
url = "http://file:1"
[limits]
retries = 3
[policy]
kind = "least_load"
[policy.cache_aware]
cache_threshold = 0.25
"#,
        )
        .unwrap();
        let policy = c.policy.clone();
        assert_eq!(policy.kind, PolicyKind::LeastLoad);
        assert_eq!(policy.cache_aware.cache_threshold, 0.25);
        c.apply(ServeOverrides {
            listen: Some("127.0.0.1:2".parse().unwrap()),
            dispatchers: Some(8),
            responders: Some(3),
            shm_name: Some("from-flags".into()),
            shm_size: Some("1GiB".parse().unwrap()),
            backends: None,
            tokenizer: Some("flag-tokenizer.json".into()),
            chat_template: Some("flag-template.json".into()),
            block_size: Some(64),
            policy: Some(PolicyKind::RoundRobin),
            store: Some(StoreKind::Redis),
            redis_url: Some("redis://cache:7000/2".into()),
            redis_namespace: Some("blue".into()),
            redis_lookup: Some(RedisLookup::Naive),
            admin_listen: Some("127.0.0.1:9090".parse().unwrap()),
            admin_token_file: Some("flag-token".into()),
        });
        assert_eq!(c.admin.listen, Some("127.0.0.1:9090".parse().unwrap()));
        assert_eq!(c.admin.token_file, Some(PathBuf::from("flag-token")));
        c.validate().unwrap();
        assert_eq!(c.store.kind, StoreKind::Redis);
        assert_eq!(
            (c.store.redis.url.as_str(), c.store.redis.namespace.as_str()),
            ("redis://cache:7000/2", "blue")
        );
        assert_eq!(c.store.redis.lookup, RedisLookup::Naive);
        assert_eq!(c.store.redis.timeout_ms, 100, "the file's other Redis keys stay");
        assert_eq!(c.listen, "127.0.0.1:2".parse().unwrap());
        assert_eq!((c.dispatchers, c.responders), (8, 3));
        assert_eq!(c.shm_name, "from-flags");
        assert_eq!(c.shm_size, ByteSize(1 << 30));
        // Flag paths are taken as given (relative to the working directory).
        assert_eq!(c.tokenizer, Some(PathBuf::from("flag-tokenizer.json")));
        assert_eq!(c.chat_template, Some(PathBuf::from("flag-template.json")));
        assert_eq!(c.block_size, 64);
        assert_eq!(c.policy.kind, PolicyKind::RoundRobin);
        // The file's policy parameters stay.
        assert_eq!(c.policy.cache_aware, policy.cache_aware);
        // Not overridden: the file's.
        assert_eq!(c.backends, [BackendConfig::new("http://file:1")]);
        assert_eq!(c.limits.retries, 3);
    }

    #[test]
    fn absent_overrides_keep_the_file() {
        let text = "dispatchers = 3\nblock_size = 8\ntokenizer = \"t.json\"\n[[backend]]\nurl = \"http://a:1\"\n";
        let mut c = parse(text).unwrap();
        c.apply(ServeOverrides::default());
        assert_eq!(c, parse(text).unwrap());
    }

    #[test]
    fn backend_flags_replace_the_file_list() {
        let mut c = parse(
            "[[backend]]\nurl = \"http://a:1\"\nname = \"a\"\nmetrics_flavor = \"vllm\"\n\
             [[backend]]\nurl = \"http://b:1\"\n",
        )
        .unwrap();
        c.apply(ServeOverrides {
            backends: Some(vec!["http://c:1".into(), "http://a:1".into()]),
            ..ServeOverrides::default()
        });
        assert_eq!(
            c.backends,
            [BackendConfig::new("http://c:1"), BackendConfig::new("http://a:1")]
        );
        c.validate().unwrap();

        // Flags are validated like the file.
        c.apply(ServeOverrides {
            backends: Some(vec!["http://c:1".into(), "http://c:1/".into()]),
            ..ServeOverrides::default()
        });
        let (field, ..) = invalid(&c);
        assert_eq!(field, "backend[1].url");
    }

    #[test]
    fn admin_table_parses_and_the_token_file_is_checked() {
        let c = parse("[admin]\nlisten = \"127.0.0.1:9090\"\ntoken_file = \"admin.token\"\n").unwrap();
        assert_eq!(c.admin.listen, Some("127.0.0.1:9090".parse().unwrap()));
        assert_eq!(c.admin.token_file, Some(PathBuf::from("/etc/semlb/admin.token")));
        assert!(parse_err("[admin]\nlisten = \"localhost:9090\"\n").contains("host names are not accepted"));
        assert!(parse_err("[admin]\nbogus = 1\n").contains("unknown field `bogus`"));
        assert_eq!(AdminConfig::default().read_token().unwrap(), None);
        let inline = AdminConfig {
            token: Some("0123456789abcdef".into()),
            ..AdminConfig::default()
        };
        assert_eq!(inline.read_token().unwrap().as_deref(), Some("0123456789abcdef"));

        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("semlb-admin-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admin.token");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        let from_file = AdminConfig {
            token_file: Some(path.clone()),
            ..AdminConfig::default()
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = from_file.read_token().unwrap_err().to_string();
        assert!(
            err.contains("admin.token_file") && err.contains("readable by every user") && err.contains("0644"),
            "{err}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(from_file.read_token().unwrap().as_deref(), Some("0123456789abcdef0123"));
        std::fs::write(&path, "short\n").unwrap();
        let err = from_file.read_token().unwrap_err().to_string();
        assert!(err.contains("16 to 4096"), "{err}");
        let missing = AdminConfig {
            token_file: Some(dir.join("missing")),
            ..AdminConfig::default()
        };
        assert!(missing.read_token().unwrap_err().to_string().contains("cannot read it"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn resolve_reads_applies_and_validates() {
        let dir = std::env::temp_dir().join(format!("semlb-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("semlb.toml");
        std::fs::write(
            &path,
            "dispatchers = 2\ntokenizer = \"tok.json\"\n[[backend]]\nurl = \"http://a:1\"\n",
        )
        .unwrap();

        let c = ServeConfig::resolve(Some(&path), ServeOverrides::default()).unwrap();
        assert_eq!(c.dispatchers, 2);
        assert_eq!(c.tokenizer, Some(dir.join("tok.json")));

        let flags = ServeOverrides {
            dispatchers: Some(0),
            ..ServeOverrides::default()
        };
        let err = ServeConfig::resolve(Some(&path), flags).unwrap_err();
        assert!(err.to_string().contains("dispatchers = 0: must be at least 1"), "{err}");

        // No file: flags alone make a configuration.
        let flags = ServeOverrides {
            backends: Some(vec!["http://b:2".into()]),
            ..ServeOverrides::default()
        };
        let c = ServeConfig::resolve(None, flags).unwrap();
        assert_eq!(c.backends, [BackendConfig::new("http://b:2")]);
        assert!(ServeConfig::resolve(None, ServeOverrides::default()).is_err());

        std::fs::write(&path, "dispatchers = 2\nbogus = 1\n").unwrap();
        let err = ServeConfig::resolve(Some(&path), ServeOverrides::default()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("unknown field `bogus`"),
            "{msg}"
        );
        assert!(msg.contains("line 2"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
