//! Client authentication: the keys file, and who a request's key says it
//! is.
//!
//! Off unless `[auth] keys_file` is set. Then every `/v1/...` request must
//! carry a key the file lists, in `Authorization: Bearer`, `api-key` or
//! `x-api-key` (the headers OpenAI SDKs and Azure-style clients send):
//!
//! | request | answer |
//! | --- | --- |
//! | no key | 401 `missing_api_key` with `WWW-Authenticate: Bearer` |
//! | a key the file does not list (or several different keys) | 401 `invalid_api_key` |
//! | a model the key may not use | 403 `model_not_allowed` |
//!
//! A key's **tenant** then names the caller everywhere the gateway keeps
//! callers apart (the response cache's `scope = "tenant"`), instead of a
//! hash of whatever header came first; the keys never reach an engine.
//!
//! # The file
//!
//! TOML, written by `semlb keys` (add, list, revoke), read at start and on
//! every reload (SIGHUP). It holds SHA-256 digests of the keys, never the
//! keys: a key is shown once, when it is made. Keys are 32 random bytes
//! (`sk-semlb-` and 64 hex digits), so a fast hash is enough: there is no
//! password to guess.
//!
//! ```toml
//! [[key]]
//! id = "key_5f0c2a9b71d4"            # names it in `semlb keys list` and `revoke`
//! sha256 = "5f0c2a9b71d4..."          # of the whole key, in hex
//! tenant = "search-team"
//! models = ["Qwen/Qwen3-32B"]         # names or aliases it may use; none: every model
//! created = "2026-11-25T10:00:00Z"
//! ```
//!
//! A tenant's rate limits ([`crate::tenancy::rate_limit`]) are `[[tenant]]` tables
//! (`semlb keys limit`); `name = "*"` gives every tenant without its own
//! table those limits, each tenant its own buckets:
//!
//! ```toml
//! [[tenant]]
//! name = "search-team"
//! requests_per_minute = 600
//! tokens_per_minute = 200000
//! ```
//!
//! The same table sets the tenant's class and weight in the gateway queue
//! (`priority = "batch"`, `weight = 2`: [`crate::tenancy::fair_share`]) and
//! `isolate_prefixes = true`, which keeps its prompts' prefixes apart from
//! every other tenant's: its block chains are rooted in a salt of its own
//! (so the prefix table never matches another tenant's entries, in either
//! store), its cached answers are its own whatever the response cache's
//! scope, and engines that take vLLM's `cache_salt` (`[[backend]]
//! cache_salt = true`) get the salt with each of its requests, so their
//! prefix caches keep it apart too, as do the tokenizer's segment caches
//! (its lines are keyed by its salt: [`semlb_tokenizer::Tokenizer::encode_salted`]).
//! This closes the timing side channel of a shared prefix (another
//! tenant's prompt answered or tokenized faster because it is cached) at
//! the cost of sharing: the tenant's prompts reuse only its own prefixes. A tenant's own entry replaces the `*` entry whole.
//!
//! A file that does not parse, lists a digest twice, or a tenant twice, is
//! refused: at start the gateway does not start, on reload the running
//! keys stay.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::response_cache::API_KEY_HEADERS;
use crate::tenancy::fair_share::Priority;
use crate::tenancy::rate_limit::{Bucket, RateLimits, Scope};

/// Prefix of the keys `semlb keys add` makes.
pub const KEY_PREFIX: &str = "sk-semlb-";
/// Longest tenant name, in bytes.
pub const MAX_TENANT_BYTES: usize = 128;

/// Why a keys file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// It could not be read or written.
    #[error("keys file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// It is not a valid keys file.
    #[error("keys file {}: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the entry.
        reason: String,
    },
    /// Its entries are not usable.
    #[error("keys file {}: {reason}", path.display())]
    Entries {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the entry.
        reason: KeysFileError,
    },
}

/// Why a keys file's entries are not usable, or a key cannot be made: the
/// reason, naming the entry (`key[2].sha256`; `tenant[0].weight`, or
/// `tenant.weight` for an entry set on its own).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysFileError {
    /// Key `i`'s digest is not 64 lower-case hex digits.
    #[error("key[{0}].sha256 must be 64 lower-case hex digits")]
    Digest(usize),
    /// Key `i`'s tenant is not a tenant name.
    #[error("key[{0}].tenant must be 1 to {MAX_TENANT_BYTES} bytes without control characters")]
    KeyTenant(usize),
    /// A key's id is empty or an earlier key's.
    #[error("key[{index}].id {id:?} is empty or not unique")]
    KeyId {
        /// The key's index in the file.
        index: usize,
        /// Its id.
        id: String,
    },
    /// Key `i` has the digest of an earlier key.
    #[error("key[{0}] has the digest of an earlier key")]
    SameDigest(usize),
    /// A tenant has two entries.
    #[error("tenant[{index}] {name:?} is listed twice")]
    TenantTwice {
        /// The second entry's index in the file.
        index: usize,
        /// The tenant.
        name: String,
    },
    /// A tenant entry's name is not a tenant name.
    #[error("{entry}.name must be 1 to {MAX_TENANT_BYTES} bytes without control characters")]
    TenantName {
        /// The entry (`tenant[i]`, or `tenant`).
        entry: String,
    },
    /// A tenant entry sets a rate limit of 0.
    #[error("{entry}.{field} {}", RateLimits::AT_LEAST_ONE)]
    Limit {
        /// The entry (`tenant[i]`, or `tenant`).
        entry: String,
        /// The limit's key.
        field: &'static str,
    },
    /// A tenant entry's weight is out of range.
    #[error("{entry}.weight must be between 1 and {MAX_WEIGHT}")]
    Weight {
        /// The entry (`tenant[i]`, or `tenant`).
        entry: String,
    },
    /// A tenant entry sets `max_concurrent_requests = 0`.
    #[error("{entry}.max_concurrent_requests {}", RateLimits::AT_LEAST_ONE)]
    Concurrency {
        /// The entry (`tenant[i]`, or `tenant`).
        entry: String,
    },
    /// No random bytes for a new key.
    #[error("the system's random source failed")]
    Random,
}

/// One key's entry (a `[[key]]` table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    /// Its public id.
    pub id: String,
    /// SHA-256 of the key, lower-case hex.
    pub sha256: String,
    /// The caller it names.
    pub tenant: String,
    /// The model names or aliases it may use; empty: every model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// When it was made (RFC 3339, for people).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
}

/// One tenant's settings (a `[[tenant]]` table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantEntry {
    /// The tenant (`*`: every tenant without an entry of its own).
    pub name: String,
    /// Its requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Its prompt and output tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Its class in the gateway queue (default interactive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// Its weight in the gateway queue's fair share (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// Its prompts' prefixes are kept apart from every other tenant's:
    /// its block chains are salted, and so is its engines' prefix cache
    /// where they take vLLM's `cache_salt` (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolate_prefixes: Option<bool>,
    /// Its requests in flight at once on this gateway host (its streams
    /// included), across every dispatcher; one more gets 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_requests: Option<u64>,
}

impl TenantEntry {
    /// An entry for `name` that sets nothing.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            requests_per_minute: None,
            tokens_per_minute: None,
            priority: None,
            weight: None,
            isolate_prefixes: None,
            max_concurrent_requests: None,
        }
    }

    /// Whether it sets nothing.
    pub fn is_empty(&self) -> bool {
        self.limits().is_empty()
            && self.priority.is_none()
            && self.weight.is_none()
            && self.isolate_prefixes.is_none()
            && self.max_concurrent_requests.is_none()
    }

    /// Whether its settings are usable (`what` names it in the error).
    fn check(&self, what: &str) -> Result<(), KeysFileError> {
        let entry = || what.to_owned();
        if !is_tenant_name(&self.name) {
            return Err(KeysFileError::TenantName { entry: entry() });
        }
        self.limits()
            .check()
            .map_err(|field| KeysFileError::Limit { entry: entry(), field })?;
        if self.weight == Some(0) || self.weight.is_some_and(|w| w > MAX_WEIGHT) {
            return Err(KeysFileError::Weight { entry: entry() });
        }
        if self.max_concurrent_requests == Some(0) {
            return Err(KeysFileError::Concurrency { entry: entry() });
        }
        Ok(())
    }

    /// Its limits.
    pub fn limits(&self) -> RateLimits {
        RateLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
        }
    }
}

/// Largest fair-share weight of a tenant.
pub const MAX_WEIGHT: u32 = 1000;

/// The name of the `[[tenant]]` entry for every tenant without one.
pub const EVERY_TENANT: &str = "*";

/// The keys file's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    /// Its entries, in the file's order.
    #[serde(default, rename = "key")]
    pub keys: Vec<KeyEntry>,
    /// Tenants' settings.
    #[serde(default, rename = "tenant", skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantEntry>,
}

impl KeysFile {
    /// Reads and checks the file at `path`; a missing file is an empty one
    /// only when `missing_ok` (`semlb keys add` making the first key).
    pub fn read(path: &Path, missing_ok: bool) -> Result<Self, KeysError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if missing_ok && e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(KeysError::Io {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let invalid = |reason: String| KeysError::Invalid {
            path: path.to_owned(),
            reason,
        };
        let file: Self = toml::from_str(&text).map_err(|e| invalid(e.to_string().trim_end().to_owned()))?;
        file.check().map_err(|reason| KeysError::Entries {
            path: path.to_owned(),
            reason,
        })?;
        Ok(file)
    }

    /// Whether the entries are usable: ids and digests well formed and
    /// unique, tenants named.
    pub fn check(&self) -> Result<(), KeysFileError> {
        let mut ids = std::collections::HashSet::new();
        let mut digests = std::collections::HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            if k.sha256.len() != 64
                || !k
                    .sha256
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            {
                return Err(KeysFileError::Digest(i));
            }
            if !is_tenant_name(&k.tenant) {
                return Err(KeysFileError::KeyTenant(i));
            }
            if k.id.is_empty() || !ids.insert(k.id.as_str()) {
                return Err(KeysFileError::KeyId {
                    index: i,
                    id: k.id.clone(),
                });
            }
            if !digests.insert(k.sha256.as_str()) {
                return Err(KeysFileError::SameDigest(i));
            }
        }
        let mut tenants = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if !tenants.insert(t.name.as_str()) {
                return Err(KeysFileError::TenantTwice {
                    index: i,
                    name: t.name.clone(),
                });
            }
            t.check(&format!("tenant[{i}]"))?;
        }
        Ok(())
    }

    /// The settings of `tenant`: its own entry, else the `*` entry, else
    /// none.
    pub fn tenant(&self, tenant: &str) -> Option<&TenantEntry> {
        let find = |name: &str| self.tenants.iter().find(|t| t.name == name);
        find(tenant).or_else(|| find(EVERY_TENANT))
    }

    /// The limits of `tenant` ([`tenant`](Self::tenant)'s).
    pub fn limits_of(&self, tenant: &str) -> RateLimits {
        self.tenant(tenant).map(TenantEntry::limits).unwrap_or_default()
    }

    /// Replaces the entry of `entry.name` (one that sets nothing removes
    /// it).
    pub fn set_tenant(&mut self, entry: TenantEntry) -> Result<(), KeysFileError> {
        entry.check("tenant")?;
        self.tenants.retain(|t| t.name != entry.name);
        if !entry.is_empty() {
            self.tenants.push(entry);
        }
        Ok(())
    }

    /// Writes the file to `path` whole (a new file renamed over the old
    /// one), readable by its owner only.
    pub fn write(&self, path: &Path) -> Result<(), KeysError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source| KeysError::Io {
            path: path.to_owned(),
            source,
        };
        let text = toml::to_string(self).map_err(|e| KeysError::Invalid {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        let written = file
            .write_all(b"# semlb API keys: SHA-256 digests only. Edit with `semlb keys`; apply with a reload.\n\n")
            .and_then(|()| file.write_all(text.as_bytes()))
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        Ok(())
    }

    /// Makes a new key for `tenant`, limited to `models` (empty: every
    /// model), adds its entry and returns the key (shown once) and the
    /// entry.
    pub fn add(
        &mut self,
        tenant: &str,
        models: Vec<String>,
        created: Option<String>,
    ) -> Result<(String, KeyEntry), KeysFileError> {
        let key = new_key()?;
        let sha256 = hex(&digest(key.as_bytes()));
        let entry = KeyEntry {
            id: format!("key_{}", &sha256[..12]),
            sha256,
            tenant: tenant.to_owned(),
            models,
            created,
        };
        self.keys.push(entry.clone());
        if let Err(e) = self.check() {
            self.keys.pop();
            return Err(e);
        }
        Ok((key, entry))
    }

    /// Removes the key with id `id`; false if there is none.
    pub fn revoke(&mut self, id: &str) -> bool {
        let before = self.keys.len();
        self.keys.retain(|k| k.id != id);
        self.keys.len() < before
    }
}

/// Whether `name` may name a tenant: 1 to [`MAX_TENANT_BYTES`] bytes
/// without control characters.
fn is_tenant_name(name: &str) -> bool {
    !(name.is_empty() || name.len() > MAX_TENANT_BYTES || name.chars().any(char::is_control))
}

/// The SHA-256 digest of `bytes`.
fn digest(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new random key: [`KEY_PREFIX`] and 64 hex digits (32 bytes from the
/// system's random source).
fn new_key() -> Result<String, KeysFileError> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| KeysFileError::Random)?;
    Ok(format!("{KEY_PREFIX}{}", hex(&bytes)))
}

/// Who a request's key says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Its key's id.
    pub key_id: String,
    /// Its tenant (shared: each request's usage counts hold it).
    pub tenant: Arc<str>,
    /// The models it may use (`None`: every model).
    models: Option<Vec<String>>,
    /// Its tenant's rate-limit buckets.
    pub limits: Vec<Bucket>,
    /// Its tenant's class in the gateway queue.
    pub priority: Priority,
    /// Its tenant's fair-share weight.
    pub weight: u32,
    /// Its tenant's prefixes are kept apart from other tenants'.
    pub isolate_prefixes: bool,
    /// Its tenant's most requests in flight at once on this host.
    pub max_concurrent: Option<u64>,
}

impl Caller {
    /// Whether it may use the model a request names as `requested`, which
    /// the gateway serves as `served` (an alias's model; the same name
    /// otherwise): either name listed will do.
    pub fn may_use(&self, requested: &str, served: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|m| m.iter().any(|n| n == requested || n == served))
    }
}

/// Why a request is not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It carries no key.
    Missing,
    /// Its key is not listed (or it carries several different ones).
    Invalid,
}

impl Refusal {
    /// OpenAI's error code.
    pub fn code(self) -> &'static str {
        match self {
            Refusal::Missing => "missing_api_key",
            Refusal::Invalid => "invalid_api_key",
        }
    }

    /// The message, as OpenAI words it.
    pub fn message(self) -> &'static str {
        match self {
            Refusal::Missing => {
                "You didn't provide an API key. Send it in an Authorization header (Bearer), or in api-key or x-api-key."
            }
            Refusal::Invalid => "Incorrect API key provided.",
        }
    }
}

/// The keys a gateway lets in, by digest.
#[derive(Debug, Default)]
pub struct Keys {
    by_digest: HashMap<[u8; 32], Arc<Caller>>,
    /// The file's tenant rules, for requests a peer gateway forwards as a
    /// tenant ([`peer_caller`](Self::peer_caller)).
    file: KeysFile,
    /// How many tenants its keys name (read on the request path: counted
    /// once).
    tenants: usize,
}

impl Keys {
    /// The keys of `file`.
    pub fn new(file: &KeysFile) -> Self {
        let by_digest = file
            .keys
            .iter()
            .filter_map(|k| {
                let digest: Vec<u8> = (0..32)
                    .map(|i| u8::from_str_radix(&k.sha256[2 * i..2 * i + 2], 16))
                    .collect::<Result<_, _>>()
                    .ok()?;
                let caller = tenant_caller(file, k.id.clone(), &k.tenant, &k.models);
                Some((digest.try_into().ok()?, Arc::new(caller)))
            })
            .collect();
        Self {
            by_digest,
            file: file.clone(),
            tenants: {
                let mut names: Vec<&str> = file.keys.iter().map(|k| k.tenant.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                names.len()
            },
        }
    }

    /// The caller of a request a peer gateway forwarded as `tenant` (the
    /// peer checked its key and its models): this gateway's rules for the
    /// tenant (its `*` entry's if it lists none), every model.
    pub fn peer_caller(&self, tenant: &str) -> Arc<Caller> {
        Arc::new(tenant_caller(&self.file, format!("peer:{tenant}"), tenant, &[]))
    }

    /// The keys in the file at `path`.
    pub fn load(path: &Path) -> Result<Self, KeysError> {
        Ok(Self::new(&KeysFile::read(path, false)?))
    }

    /// How many tenants its keys name.
    pub fn tenants(&self) -> usize {
        self.tenants
    }

    /// How many keys it lets in.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether it lets no key in.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The caller of a request with `headers`: its key, from any of
    /// [`API_KEY_HEADERS`] (the same key repeated is one key).
    pub fn caller(&self, headers: &http::HeaderMap) -> Result<Arc<Caller>, Refusal> {
        let mut presented: Option<&[u8]> = None;
        for name in API_KEY_HEADERS {
            for value in headers.get_all(name) {
                let value = value.as_bytes();
                let key = if name == "authorization" {
                    crate::response_cache::bearer_token(value)
                } else {
                    value
                };
                let key = key.trim_ascii();
                if key.is_empty() {
                    continue;
                }
                match presented {
                    Some(p) if p != key => return Err(Refusal::Invalid),
                    _ => presented = Some(key),
                }
            }
        }
        let key = presented.ok_or(Refusal::Missing)?;
        self.by_digest.get(&digest(key)).cloned().ok_or(Refusal::Invalid)
    }
}

/// A caller of `tenant` under `file`'s tenant rules, with key `key_id`,
/// allowed `models` (empty: every model).
fn tenant_caller(file: &KeysFile, key_id: String, tenant: &str, models: &[String]) -> Caller {
    let entry = file.tenant(tenant);
    Caller {
        key_id,
        tenant: Arc::from(tenant),
        models: (!models.is_empty()).then(|| models.to_vec()),
        limits: file.limits_of(tenant).buckets(Scope::Tenant, tenant),
        priority: entry.and_then(|t| t.priority).unwrap_or_default(),
        weight: entry.and_then(|t| t.weight).unwrap_or(1),
        isolate_prefixes: entry.and_then(|t| t.isolate_prefixes).unwrap_or(false),
        max_concurrent: entry.and_then(|t| t.max_concurrent_requests),
    }
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths
/// only (not on where they differ).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.append(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_made_key_is_let_in_from_any_header_and_only_its_digest_is_kept() {
        let mut file = KeysFile::default();
        let (key, entry) = file.add("team-a", vec!["alpha".into()], None).unwrap();
        let (other, _) = file.add("team-b", vec![], None).unwrap();
        assert!(key.starts_with(KEY_PREFIX) && key.len() == KEY_PREFIX.len() + 64);
        let text = toml::to_string(&file).unwrap();
        assert!(!text.contains(&key[KEY_PREFIX.len()..]), "no key in the file: {text}");
        assert!(text.contains(&entry.sha256));
        let keys = Keys::new(&file);
        assert_eq!(keys.len(), 2);
        let bearer = format!("Bearer {key}");
        for h in [
            headers(&[("authorization", &bearer)]),
            headers(&[("api-key", &key)]),
            headers(&[("x-api-key", &key), ("authorization", &bearer)]),
        ] {
            let caller = keys.caller(&h).unwrap();
            assert_eq!((&*caller.tenant, caller.key_id.as_str()), ("team-a", entry.id.as_str()));
        }
        let caller = keys.caller(&headers(&[("api-key", &key)])).unwrap();
        assert!(caller.may_use("alpha", "alpha") && caller.may_use("default", "alpha"));
        assert!(!caller.may_use("beta", "beta"));
        assert!(
            keys.caller(&headers(&[("api-key", &other)]))
                .unwrap()
                .may_use("beta", "beta")
        );
        assert_eq!(keys.caller(&headers(&[])), Err(Refusal::Missing));
        assert_eq!(
            keys.caller(&headers(&[("authorization", "Bearer ")])),
            Err(Refusal::Missing)
        );
        assert_eq!(
            keys.caller(&headers(&[("api-key", "sk-semlb-nope")])),
            Err(Refusal::Invalid)
        );
        assert_eq!(
            keys.caller(&headers(&[("api-key", &key), ("x-api-key", &other)])),
            Err(Refusal::Invalid),
            "two different keys"
        );
    }

    #[test]
    fn tenants_get_their_own_limits_else_the_default_ones() {
        let mut file = KeysFile::default();
        let (a, _) = file.add("a", vec![], None).unwrap();
        let (b, _) = file.add("b", vec![], None).unwrap();
        let limited = |rpm| RateLimits {
            requests_per_minute: Some(rpm),
            tokens_per_minute: None,
        };
        assert!(
            Keys::new(&file)
                .caller(&headers(&[("api-key", &a)]))
                .unwrap()
                .limits
                .is_empty()
        );
        let set = |file: &mut KeysFile, name: &str, limits: RateLimits| {
            file.set_tenant(TenantEntry {
                requests_per_minute: limits.requests_per_minute,
                tokens_per_minute: limits.tokens_per_minute,
                ..TenantEntry::named(name)
            })
        };
        set(&mut file, "a", limited(5)).unwrap();
        set(&mut file, EVERY_TENANT, limited(9)).unwrap();
        assert!(
            set(&mut file, "a", limited(0))
                .unwrap_err()
                .to_string()
                .contains("requests_per_minute")
        );
        let heavy = TenantEntry {
            weight: Some(0),
            ..TenantEntry::named("a")
        };
        assert!(file.set_tenant(heavy).unwrap_err().to_string().contains("weight"));
        assert_eq!(file.limits_of("a"), limited(5));
        assert_eq!(file.limits_of("b"), limited(9));
        let keys = Keys::new(&file);
        let of = |key: &str| keys.caller(&headers(&[("api-key", key)])).unwrap().limits.clone();
        let (la, lb) = (of(&a), of(&b));
        assert_eq!((la.len(), lb.len()), (1, 1));
        assert_eq!((la[0].quota.limit, lb[0].quota.limit), (5, 9));
        assert_ne!(
            la[0].key, lb[0].key,
            "the default gives each tenant a bucket of its own"
        );
        // Nothing set: the entry goes.
        file.set_tenant(TenantEntry::named("a")).unwrap();
        assert_eq!(file.limits_of("a"), limited(9));
        let text = toml::to_string(&file).unwrap();
        assert!(text.contains("[[tenant]]") && text.contains("name = \"*\""), "{text}");
        file.tenants.push(file.tenants[0].clone());
        assert!(file.check().unwrap_err().to_string().contains("twice"));
    }

    #[test]
    fn the_file_round_trips_and_bad_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("semlb-keys-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys.toml");
        assert_eq!(KeysFile::read(&path, true).unwrap(), KeysFile::default());
        assert!(KeysFile::read(&path, false).is_err());
        let mut file = KeysFile::default();
        let (_, entry) = file.add("t", vec![], Some("2026-11-25T00:00:00Z".into())).unwrap();
        file.write(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(KeysFile::read(&path, false).unwrap(), file);
        assert!(file.revoke(&entry.id) && !file.revoke(&entry.id));
        for (text, what) in [
            ("[[key]]\nid = \"a\"\nsha256 = \"ab\"\ntenant = \"t\"\n", "sha256"),
            (
                &format!("[[key]]\nid = \"a\"\nsha256 = \"{}\"\ntenant = \"\"\n", "a".repeat(64)),
                "tenant",
            ),
            (
                &format!(
                    "[[key]]\nid = \"a\"\nsha256 = \"{0}\"\ntenant = \"t\"\n[[key]]\nid = \"b\"\nsha256 = \"{0}\"\ntenant = \"u\"\n",
                    "a".repeat(64)
                ),
                "digest",
            ),
            ("[[key]]\nid = \"a\"\nkey = \"x\"\n", "unknown field"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = KeysFile::read(&path, false).unwrap_err().to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
