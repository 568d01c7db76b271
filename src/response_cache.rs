//! The response cache's policy layer (the sLLM "exact match" path): the key
//! of an exact request, who may share an answer (tenants), which requests
//! may be cached at all, and the TTL-stamped entries stored in the shm
//! response log ([`shm_layout::ResponseLog`]).
//!
//! * **Key**: XXH3-128 over the tenant, the endpoint, and the request body
//!   in canonical JSON (object keys sorted) without the fields that do not
//!   change the answer's content (`stream`, `stream_options`). The model,
//!   the prompt or messages and every generation parameter are in the body,
//!   so any difference is a different key; a streamed and a non-streamed
//!   request share an entry (the stream is replayed from the stored JSON).
//! * **Tenant**: the hashed API key (`Authorization: Bearer …`), so a
//!   cached answer never crosses tenants; requests without a key share the
//!   anonymous tenant; [`Scope::Global`] (operator's choice) shares answers
//!   among everyone.
//! * **Cacheability**: only deterministic requests by default —
//!   `temperature` 0, or a `seed` given; `Cache-Control: no-store` neither
//!   reads nor writes, `no-cache` skips the lookup but stores the fresh
//!   answer (HTTP semantics: revalidate).
//! * **Entries**: the stored value is `stored_at_ms` (8 bytes, LE, segment
//!   clock) followed by the response body; a lookup older than the TTL is a
//!   miss.

use serde_json::{Map, Value};

use crate::prompt::Endpoint;

/// Who may share cached answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Per API key (the default).
    #[default]
    Tenant,
    /// Everyone shares (only for single-tenant deployments).
    Global,
}

/// A tenant: a 64-bit hash of its API key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tenant(pub u64);

impl Tenant {
    /// Requests without an API key.
    pub const ANONYMOUS: Tenant = Tenant(0x616e_6f6e_796d_6f75);
    /// Everyone, under [`Scope::Global`].
    pub const GLOBAL: Tenant = Tenant(0x676c_6f62_616c_0000);

    /// The tenant of a request, from its `Authorization` header.
    pub fn of(scope: Scope, authorization: Option<&[u8]>) -> Tenant {
        if scope == Scope::Global {
            return Tenant::GLOBAL;
        }
        let key = authorization
            .map(|a| a.strip_prefix(b"Bearer ").unwrap_or(a))
            .filter(|k| !k.is_empty());
        match key {
            Some(k) => Tenant(xxhash_rust::xxh3::xxh3_64_with_seed(k, 0x7465_6e61_6e74)),
            None => Tenant::ANONYMOUS,
        }
    }
}

/// Fields that do not change the answer's content.
const PRESENTATION_ONLY: [&str; 2] = ["stream", "stream_options"];

/// The cache key of a request.
pub fn key(tenant: Tenant, endpoint: Endpoint, body: &Map<String, Value>) -> shm_layout::ResponseKey {
    // serde_json's Map is a BTreeMap (no `preserve_order`), so serialising
    // it gives canonical JSON with sorted keys at every level.
    let mut canonical = Vec::with_capacity(256);
    canonical.extend_from_slice(&tenant.0.to_le_bytes());
    canonical.extend_from_slice(endpoint.path().as_bytes());
    canonical.push(0);
    let filtered: Map<String, Value> = body
        .iter()
        .filter(|(k, _)| !PRESENTATION_ONLY.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    serde_json::to_writer(&mut canonical, &filtered).expect("serialising JSON values into a Vec cannot fail");
    shm_layout::ResponseKey(xxhash_rust::xxh3::xxh3_128(&canonical))
}

/// What the cache may do for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cacheability {
    /// Look up, and store the answer on a miss.
    ReadWrite,
    /// Do not look up, but store the fresh answer (`Cache-Control: no-cache`).
    WriteOnly,
    /// Neither (`no-store`, a non-deterministic request, or caching off).
    Bypass,
}

impl Cacheability {
    /// Whether a lookup may answer the request.
    pub fn reads(self) -> bool {
        self == Cacheability::ReadWrite
    }

    /// Whether the answer may be stored.
    pub fn writes(self) -> bool {
        self != Cacheability::Bypass
    }
}

/// Whether a request's answer is a function of the request alone:
/// `temperature` explicitly 0, or a `seed` given (`n` > 1 with a seed is
/// deterministic too).
pub fn is_deterministic(body: &Map<String, Value>) -> bool {
    let zero_temperature = body.get("temperature").and_then(Value::as_f64) == Some(0.0);
    let seeded = body.get("seed").is_some_and(|s| s.is_i64() || s.is_u64());
    zero_temperature || seeded
}

/// What the cache may do for a request with this body and `Cache-Control`
/// header, when caching is `enabled` and non-deterministic requests are
/// cached only if `cache_nondeterministic`.
pub fn cacheability(
    enabled: bool,
    cache_nondeterministic: bool,
    body: &Map<String, Value>,
    cache_control: Option<&[u8]>,
) -> Cacheability {
    if !enabled || !(cache_nondeterministic || is_deterministic(body)) {
        return Cacheability::Bypass;
    }
    let directives = cache_control
        .map(|h| String::from_utf8_lossy(h).to_ascii_lowercase())
        .unwrap_or_default();
    let has = |d: &str| directives.split(',').any(|x| x.trim() == d);
    if has("no-store") {
        Cacheability::Bypass
    } else if has("no-cache") {
        Cacheability::WriteOnly
    } else {
        Cacheability::ReadWrite
    }
}

/// A stored value: when it was stored, then the response body.
pub fn encode_entry(stored_at_ms: u64, body: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(8 + body.len());
    out.extend_from_slice(&stored_at_ms.to_le_bytes());
    out.extend_from_slice(body);
}

/// The body of a stored value if it is younger than `ttl_ms` at `now_ms`
/// (an expired or malformed entry is a miss).
pub fn fresh_body(entry: &[u8], now_ms: u64, ttl_ms: u64) -> Option<&[u8]> {
    let (stamp, body) = entry.split_first_chunk::<8>()?;
    let stored = u64::from_le_bytes(*stamp);
    (now_ms.saturating_sub(stored) <= ttl_ms).then_some(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> Map<String, Value> {
        match serde_json::from_str(json).unwrap() {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn keys_ignore_key_order_and_presentation_but_nothing_else() {
        let t = Tenant::ANONYMOUS;
        let e = Endpoint::ChatCompletions;
        let a = key(
            t,
            e,
            &body(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#),
        );
        let b = key(
            t,
            e,
            &body(
                r#"{"temperature":0,"messages":[{"content":"hi","role":"user"}],"model":"m","stream":true,"stream_options":{"include_usage":true}}"#,
            ),
        );
        assert_eq!(a, b);
        for other in [
            r#"{"model":"m2","messages":[{"role":"user","content":"hi"}],"temperature":0}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi!"}],"temperature":0}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,"max_tokens":5}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,"seed":1}"#,
        ] {
            assert_ne!(a, key(t, e, &body(other)), "{other}");
        }
        assert_ne!(
            a,
            key(
                t,
                Endpoint::Completions,
                &body(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#)
            )
        );
    }

    #[test]
    fn the_key_hashes_the_filtered_body_in_canonical_json() {
        let b = body(r#"{"stream":true,"model":"m","messages":[{"role":"user","content":"hi"}],"n":1}"#);
        let filtered: Map<String, Value> = b
            .iter()
            .filter(|(k, _)| *k != "stream")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut expected = Vec::new();
        expected.extend_from_slice(&Tenant::ANONYMOUS.0.to_le_bytes());
        expected.extend_from_slice(b"/v1/chat/completions\0");
        expected.extend_from_slice(&serde_json::to_vec(&filtered).unwrap());
        let want = shm_layout::ResponseKey(xxhash_rust::xxh3::xxh3_128(&expected));
        assert_eq!(key(Tenant::ANONYMOUS, Endpoint::ChatCompletions, &b), want);
        assert_eq!(
            key(Tenant::ANONYMOUS, Endpoint::ChatCompletions, &body("{\"stream\":true}")),
            {
                let mut e = Tenant::ANONYMOUS.0.to_le_bytes().to_vec();
                e.extend_from_slice(b"/v1/chat/completions\0{}");
                shm_layout::ResponseKey(xxhash_rust::xxh3::xxh3_128(&e))
            }
        );
    }

    #[test]
    fn tenants_never_share_keys_unless_global() {
        let b = body(r#"{"model":"m","prompt":"x","temperature":0}"#);
        let e = Endpoint::Completions;
        let alice = Tenant::of(Scope::Tenant, Some(b"Bearer sk-alice"));
        let bob = Tenant::of(Scope::Tenant, Some(b"Bearer sk-bob"));
        assert_ne!(alice, bob);
        assert_ne!(alice, Tenant::of(Scope::Tenant, None));
        assert_eq!(Tenant::of(Scope::Tenant, None), Tenant::ANONYMOUS);
        assert_eq!(Tenant::of(Scope::Tenant, Some(b"Bearer ")), Tenant::ANONYMOUS);
        assert_ne!(key(alice, e, &b), key(bob, e, &b));
        assert_eq!(
            Tenant::of(Scope::Global, Some(b"Bearer sk-alice")),
            Tenant::of(Scope::Global, Some(b"Bearer sk-bob"))
        );
    }

    #[test]
    fn only_deterministic_requests_are_cached_by_default() {
        let det = body(r#"{"model":"m","prompt":"x","temperature":0}"#);
        let seeded = body(r#"{"model":"m","prompt":"x","temperature":0.8,"seed":7}"#);
        let random = body(r#"{"model":"m","prompt":"x","temperature":0.8}"#);
        let default_temp = body(r#"{"model":"m","prompt":"x"}"#);
        assert_eq!(cacheability(true, false, &det, None), Cacheability::ReadWrite);
        assert_eq!(cacheability(true, false, &seeded, None), Cacheability::ReadWrite);
        assert_eq!(cacheability(true, false, &random, None), Cacheability::Bypass);
        assert_eq!(
            cacheability(true, false, &default_temp, None),
            Cacheability::Bypass,
            "default temperature is 1"
        );
        assert_eq!(cacheability(true, true, &random, None), Cacheability::ReadWrite);
        assert_eq!(cacheability(false, true, &det, None), Cacheability::Bypass);
    }

    #[test]
    fn cache_control_is_honoured() {
        let det = body(r#"{"model":"m","prompt":"x","temperature":0}"#);
        let cc = |h: &str| cacheability(true, false, &det, Some(h.as_bytes()));
        assert_eq!(cc("no-store"), Cacheability::Bypass);
        assert_eq!(cc("max-age=0, No-Cache"), Cacheability::WriteOnly);
        assert_eq!(cc("no-cache, no-store"), Cacheability::Bypass);
        assert_eq!(cc("max-age=60"), Cacheability::ReadWrite);
        assert!(Cacheability::WriteOnly.writes() && !Cacheability::WriteOnly.reads());
        assert!(!Cacheability::Bypass.writes());
    }

    #[test]
    fn entries_expire_after_their_ttl() {
        let mut e = Vec::new();
        encode_entry(1_000, b"{\"id\":1}", &mut e);
        assert_eq!(fresh_body(&e, 1_500, 600), Some(&b"{\"id\":1}"[..]));
        assert_eq!(fresh_body(&e, 1_600, 600), Some(&b"{\"id\":1}"[..]));
        assert_eq!(fresh_body(&e, 1_601, 600), None);
        assert_eq!(fresh_body(&e[..5], 1_000, 600), None, "malformed is a miss");
    }
}
