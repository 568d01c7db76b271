//! The optional sections: `[response_cache]`, `[store]` (`[store.redis]`),
//! `[limits]`, `[health]`, `[admin]`, with their defaults.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shm_layout::plan::DEFAULT_MAX_RESPONSE_FRACTION;

use super::{ConfigError, MAX_ADMIN_TOKEN_BYTES, MIN_ADMIN_TOKEN_BYTES, optional_socket_addr, quoted};
use crate::config::size::ByteSize;

/// Who may be answered with a cached response (`response_cache.scope`:
/// `"tenant"` or `"global"`).
pub use crate::response_cache::Scope as CacheScope;

/// Which store holds the routing state (`store.kind`, `--store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// The host's shared-memory segment.
    #[default]
    Shm,
    /// A Redis server (`store.redis.url`).
    Redis,
}

impl StoreKind {
    /// The name in configuration and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Shm => "shm",
            Self::Redis => "redis",
        }
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A store name (`--store`) that names no [`StoreKind`]; it holds the name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown store {0:?}: expected shm or redis")]
pub struct UnknownStore(pub String);

impl FromStr for StoreKind {
    type Err = UnknownStore;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "shm" => Ok(Self::Shm),
            "redis" => Ok(Self::Redis),
            _ => Err(UnknownStore(s.to_owned())),
        }
    }
}

/// How a Redis store finds the longest prefix (`store.redis.lookup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisLookup {
    /// One round trip: a server-side script walks the chain.
    #[default]
    Script,
    /// One round trip per block until the first miss: the sLLM paper's
    /// baseline, kept for comparison.
    Naive,
}

/// A lookup name (`--redis-lookup`) that names no [`RedisLookup`]; it
/// holds the name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown Redis lookup {0:?}: expected script or naive")]
pub struct UnknownRedisLookup(pub String);

impl FromStr for RedisLookup {
    type Err = UnknownRedisLookup;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "script" => Ok(Self::Script),
            "naive" => Ok(Self::Naive),
            _ => Err(UnknownRedisLookup(s.to_owned())),
        }
    }
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

/// Agent sessions (`[sessions]`): where a request's conversation key is
/// read from, for the prefix-aware policies to keep a session on its
/// engine ([`crate::routing::affinity`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionsConfig {
    /// Keep sessions on their engines. Default true.
    pub enabled: bool,
    /// Request headers carrying the key, tried in order (any case).
    /// Default `["x-session-id", "x-session-affinity"]`.
    pub headers: Vec<String>,
    /// Then body fields, tried in order; a dotted name reads a nested
    /// field. Default `["prompt_cache_key", "metadata.user_id",
    /// "safety_identifier", "user"]`.
    pub fields: Vec<String>,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            headers: vec!["x-session-id".into(), "x-session-affinity".into()],
            fields: vec![
                "prompt_cache_key".into(),
                "metadata.user_id".into(),
                "safety_identifier".into(),
                "user".into(),
            ],
        }
    }
}

/// Streams resumed on another engine when theirs breaks mid-answer
/// (`[resume]`, [`crate::dispatcher::resume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResumeConfig {
    /// Resume broken chat streams. Default true.
    pub enabled: bool,
    /// Resumptions of one answer at most. Default 2.
    pub max_attempts: u32,
    /// A stream that sends nothing for this long after its first byte is
    /// broken (0: never). Default 30 000 ms.
    pub stall_ms: u64,
}

impl Default for ResumeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_attempts: 2,
            stall_ms: 30_000,
        }
    }
}

impl ResumeConfig {
    /// Checks the values; `at` is where the table is (`resume`, or a
    /// pool's `model[i].resume`).
    pub(crate) fn validate(&self, at: &str) -> Result<(), super::ConfigError> {
        use super::ConfigError as E;
        let max = super::MAX_RETRIES;
        if self.max_attempts > max {
            return Err(E::invalid(
                format!("{at}.max_attempts"),
                self.max_attempts,
                format!("must be at most {max}"),
            ));
        }
        if (1..100).contains(&self.stall_ms) {
            return Err(E::invalid(
                format!("{at}.stall_ms"),
                self.stall_ms,
                "must be 0 (never) or at least 100 (engines pause between tokens)",
            ));
        }
        Ok(())
    }

    /// [`stall_ms`](Self::stall_ms) as a duration (`None`: never).
    pub fn stall(&self) -> Option<std::time::Duration> {
        (self.stall_ms > 0).then(|| std::time::Duration::from_millis(self.stall_ms))
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
    /// Reply deadline of every operation, in ms (later: an outage).
    pub timeout_ms: u64,
    /// Deadline of a dispatcher's first connection (TCP, TLS, `AUTH`, the
    /// scripts and the namespace's seed), in ms; reconnections during an
    /// outage keep `timeout_ms`.
    pub connect_timeout_ms: u64,
    /// Probe interval during an outage, in ms.
    pub retry_ms: u64,
    /// How the longest prefix is looked up.
    pub lookup: RedisLookup,
    /// Completion records a response process keeps during an outage.
    pub write_backlog: usize,
    /// An ACL user name (Redis 6 and later), if not in the URL.
    pub username: Option<String>,
    /// A file (mode 0600) whose first line is the password, if the URL has
    /// none; else `$SEMLB_REDIS_PASSWORD` ([`crate::store::redis::credentials`]).
    pub password_file: Option<PathBuf>,
    /// A PEM certificate authority a `rediss://` server is checked against
    /// (default: the system's roots).
    pub ca_file: Option<PathBuf>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/".to_owned(),
            namespace: "semlb".to_owned(),
            prefix_ttl_secs: 3600,
            timeout_ms: 100,
            connect_timeout_ms: 1000,
            retry_ms: 1000,
            lookup: RedisLookup::Script,
            write_backlog: 10_000,
            username: None,
            password_file: None,
            ca_file: None,
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

    /// [`connect_timeout_ms`](Self::connect_timeout_ms) as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
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
    /// Answer a request that no live engine's context can take with the
    /// engines' own 400 (`context_length_exceeded`) instead of forwarding
    /// it, once every live engine has said its context
    /// ([`crate::dispatcher::context_limit`]). Default true.
    pub check_context: bool,
    /// Seconds a client may take to send a request's headers, to send its
    /// body, or to read on while an answer waits to be written to it
    /// (nginx's `client_header_timeout`, `client_body_timeout` and
    /// `send_timeout`, as one). Past it: 408 for a body, the connection
    /// closed otherwise, and an answer left unread releases its engine.
    /// Default 30.
    pub client_timeout_secs: u64,
    /// Client connections one dispatcher serves at once; one more is
    /// answered 503 and closed. Default 4096.
    pub max_connections: u32,
    /// Connections one dispatcher serves at once from one client IP
    /// address; one more is answered 503 and closed. 0 (the default): no
    /// such cap (a gateway behind a load balancer sees every client at
    /// the balancer's address).
    pub max_connections_per_ip: u32,
    /// Bytes of request bodies one dispatcher holds at once (read, parsed,
    /// routed); a body past it gets 503 `server_busy` with `Retry-After`.
    /// Default 256 MiB (at least `max_body_bytes`).
    pub max_inflight_body_bytes: ByteSize,
    /// Most messages in a chat request; more: 400 before any is rendered
    /// ([`crate::openai::prompt::RequestLimits`]). Default 4096.
    pub max_messages: u32,
    /// Largest prompt text, a rendered chat or a completions prompt; larger:
    /// 413 before it is tokenized. Default 8 MiB.
    pub max_prompt_bytes: ByteSize,
    /// Output tokens reserved in a request's token buckets
    /// ([`crate::tenancy::rate_limit`]) for each answer it asks for when it sets no
    /// `max_tokens` (at most what the largest live context leaves); the
    /// reservation is settled when the answer ends. Default 4096.
    pub reserve_output_tokens: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: ByteSize(16 << 20),
            request_timeout_secs: 600,
            connect_timeout_ms: 2000,
            retries: 2,
            check_context: true,
            client_timeout_secs: 30,
            max_connections: 4096,
            max_messages: 4096,
            max_prompt_bytes: ByteSize(8 << 20),
            reserve_output_tokens: 4096,
            max_connections_per_ip: 0,
            max_inflight_body_bytes: ByteSize(256 << 20),
        }
    }
}

impl LimitsConfig {
    /// [`request_timeout_secs`](Self::request_timeout_secs) as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_secs)
    }

    /// [`client_timeout_secs`](Self::client_timeout_secs) as a duration.
    pub fn client_timeout(&self) -> Duration {
        Duration::from_secs(self.client_timeout_secs)
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

/// Client authentication (`[auth]`, [`crate::tenancy::auth`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The keys file (`semlb keys` writes it); `None` (the default): no
    /// authentication. Read at start and on every reload.
    pub keys_file: Option<std::path::PathBuf>,
    /// Whether authenticated callers get the gateway's diagnostic headers
    /// (every [`x-semlb-*`](crate::dispatcher::DIAGNOSTIC_PREFIX) answer
    /// header: `x-semlb-backend`, `-route`, `-cache`, `-dispatch-ns`,
    /// `-queue-ms`, a peer's `-peer`).
    /// Default false: they name internal addresses, and tell one tenant
    /// whether another recently sent the same prefix (`x-semlb-route:
    /// prefix`) or line (the tokenize time in `x-semlb-dispatch-ns`).
    /// Without `[auth]` there are no tenants and they are always sent.
    pub debug_headers: bool,
    /// The most of the prefix table's slots, and of the response cache's
    /// entries, one tenant may fill in ten minutes, in percent, when the
    /// keys file names more than one tenant: past it, the tenant's new
    /// prompts are routed but not learned and its answers not cached, so one
    /// tenant cannot evict every other's entries. Default 50; 100: no bound.
    pub tenant_share_percent: u32,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            keys_file: None,
            debug_headers: false,
            tenant_share_percent: 50,
        }
    }
}

/// The endpoint picker (`[epp]`): Envoy's external processing service
/// beside the HTTP front ([`crate::dispatcher::epp`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// The address every dispatcher also accepts gRPC on as the Gateway API
    /// Inference Extension's endpoint picker (`envoy.service.ext_proc.v3`
    /// and `grpc.health.v1`); `None` (the default): no picker.
    #[serde(deserialize_with = "optional_socket_addr")]
    pub listen: Option<SocketAddr>,
}

/// Where `/metrics` is served (`[metrics]`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// A listener of its own for `GET /metrics`, served by the supervisor;
    /// `None` (the default): the gateway's listener serves it.
    #[serde(deserialize_with = "optional_socket_addr")]
    pub listen: Option<SocketAddr>,
    /// A file holding the bearer token a scrape of the gateway's own
    /// listener must present (`Authorization: Bearer`). With `[auth]` and
    /// no `listen`, `/metrics` there is served only to it (404 without a
    /// token file: tenants' names and usage, engine addresses are not for
    /// clients). Read when a dispatcher starts and on reload.
    pub token_file: Option<std::path::PathBuf>,
}

impl MetricsConfig {
    /// The token a scrape must present, read from its file (`None`: no
    /// file set).
    pub fn read_token(&self) -> Result<Option<String>, ConfigError> {
        self.token_file
            .as_ref()
            .map(|p| read_token_file("metrics.token_file", p))
            .transpose()
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
    /// A file holding the bearer token (trailing whitespace ignored). Only
    /// its owner may read it (0600 or 0400); that is checked when the
    /// supervisor starts ([`AdminConfig::read_token`]).
    pub token_file: Option<PathBuf>,
    /// Where the admin API keeps the model pools it changed
    /// ([`super::ModelChanges`]); `None` (the default): pools change by
    /// reload only, and the admin API's pool changes answer 409.
    pub models_file: Option<PathBuf>,
}

impl AdminConfig {
    /// The bearer token: [`token`](Self::token), or the contents of
    /// [`token_file`](Self::token_file). `None` when neither is set. Errors
    /// name the key.
    ///
    /// A token guards the admin API, so only its owner may read where it is
    /// written: the token file, or, for an inline token, `config_file` (the
    /// file it was read from), must give no permission to group or others
    /// (0600 or 0400). The file is opened once and its mode read from the
    /// open handle (`fstat`), so what is checked is what is read.
    pub fn read_token(&self, config_file: Option<&std::path::Path>) -> Result<Option<String>, ConfigError> {
        if let Some(token) = &self.token {
            if let Some(path) = config_file {
                let shown = quoted(&path.display().to_string());
                let invalid = |reason: String| ConfigError::invalid("admin.token", "\"(hidden)\"", reason);
                read_private(path).map_err(|reason| {
                    invalid(format!(
                        "it is written in {shown}, where {reason}; or keep it in admin.token_file"
                    ))
                })?;
            }
            return Ok(Some(token.clone()));
        }
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let shown = quoted(&path.display().to_string());
        let invalid = |reason: String| ConfigError::invalid("admin.token_file", &shown, reason);
        let text = read_private(path).map_err(|reason| invalid(reason.to_string()))?;
        let token = text.trim_end().to_owned();
        check_admin_token(&token).map_err(|reason| invalid(format!("its contents: {reason}")))?;
        Ok(Some(token))
    }
}

/// Why a file that holds a secret is refused: the reason only (the caller
/// names the key and the file).
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrivateFileError {
    /// It cannot be opened or read.
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    /// It is not a regular file.
    #[error("it is not a regular file")]
    NotAFile,
    /// Its group or every user may read it (`mode`: its permission bits).
    #[error(
        "it is readable by {} (mode {mode:04o}); it holds a secret: chmod 600 it",
        if .mode & 0o007 != 0 { "every user" } else { "its group" }
    )]
    Readable {
        /// Its permission bits.
        mode: u32,
    },
}

/// The text of `path`, a regular file that gives its group and others no
/// permission, opened once and checked on the open handle; the reason
/// otherwise.
pub(crate) fn read_private(path: &std::path::Path) -> Result<String, PrivateFileError> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let mut file = std::fs::File::open(path).map_err(PrivateFileError::Read)?;
    let meta = file.metadata().map_err(PrivateFileError::Read)?;
    if !meta.is_file() {
        return Err(PrivateFileError::NotAFile);
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(PrivateFileError::Readable { mode });
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(PrivateFileError::Read)?;
    Ok(text)
}

/// Why a bearer token is refused: the reason only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TokenError {
    /// Too short or too long.
    #[error(
        "a token must be {MIN_ADMIN_TOKEN_BYTES} to {MAX_ADMIN_TOKEN_BYTES} characters long (e.g. `openssl rand -hex 32`)"
    )]
    Length,
    /// Spaces, control or non-ASCII characters.
    #[error("a token must be visible ASCII characters only (no spaces)")]
    Characters,
}

/// Whether `token` is usable as a bearer token; the reason if not.
pub(super) fn check_admin_token(token: &str) -> Result<(), TokenError> {
    if !(MIN_ADMIN_TOKEN_BYTES..=MAX_ADMIN_TOKEN_BYTES).contains(&token.len()) {
        return Err(TokenError::Length);
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::Characters);
    }
    Ok(())
}

/// `[tls]`: the listener serves HTTPS (HTTP/1.1 over TLS 1.2 or 1.3).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// The certificate chain it presents (PEM, leaf first).
    pub cert_file: std::path::PathBuf,
    /// Its private key (PEM; mode 0600).
    pub key_file: std::path::PathBuf,
    /// Clients must present a certificate of this CA (PEM): mutual TLS.
    /// Default: none asked for.
    #[serde(default)]
    pub client_ca_file: Option<std::path::PathBuf>,
}

/// The token in the private file `path` (setting `field`): its contents,
/// trailing whitespace dropped, checked as an admin token is.
pub(super) fn read_token_file(field: &str, path: &std::path::Path) -> Result<String, ConfigError> {
    let shown = quoted(&path.display().to_string());
    let invalid = |reason: String| ConfigError::invalid(field, &shown, reason);
    let text = read_private(path).map_err(|reason| invalid(reason.to_string()))?;
    let token = text.trim_end().to_owned();
    check_admin_token(&token).map_err(|reason| invalid(format!("its contents: {reason}")))?;
    Ok(token)
}
