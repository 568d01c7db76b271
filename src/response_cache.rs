//! The response cache's policy layer (the sLLM "exact match" path): the key
//! of an exact request, who may share an answer (tenants), which requests
//! may be cached at all, and the TTL-stamped entries stored in the shm
//! response log ([`shm_layout::ResponseLog`]).
//!
//! * **Key**: XXH3-128 over the tenant, the endpoint, and the request body
//!   in a canonical form (object keys sorted, a repeated key once with its
//!   last value, every value typed and length-prefixed) without the fields
//!   that do not change the answer's content (`stream`, `stream_options`).
//!   The model, the prompt or messages and every generation parameter are
//!   in the body, so any difference is a different key; a streamed and a
//!   non-streamed request share an entry (the stream is replayed from the
//!   stored JSON). The body's parsed tree ([`crate::openai::body`]) is fed to the
//!   hash as it is walked: nothing is cloned or serialised again.
//!   The URI's query string and the headers that may change an answer
//!   ([`ANSWER_HEADERS`]) are in the key too.
//! * **Tenant**: the hashed API key (every value of `Authorization:
//!   Bearer …`, `api-key`, `x-api-key`), so a cached answer never crosses
//!   tenants; requests without a key share the anonymous tenant;
//!   [`Scope::Global`] (operator's choice) shares answers among everyone
//!   with a key, never with requests without one.
//! * **Cacheability**: only deterministic requests by default —
//!   `temperature` 0, or a `seed` given; `Cache-Control: no-store` neither
//!   reads nor writes, `no-cache` skips the lookup but stores the fresh
//!   answer (HTTP semantics: revalidate).
//! * **Entries**: the stored value is `stored_at_ms` (8 bytes, LE, segment
//!   clock) followed by the response body; a lookup older than the TTL is a
//!   miss.

use xxhash_rust::xxh3::Xxh3;

use crate::openai::body::{Json, Object};
use crate::openai::prompt::Endpoint;

/// Who may share cached answers (`response_cache.scope` in the
/// configuration: `"tenant"` or `"global"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Callers with the same API key (the key is hashed into the cache key;
    /// requests without a key share one tenant). The default.
    #[default]
    Tenant,
    /// Every caller: a cached answer to one tenant may be returned to
    /// another. Only for deployments with a single trust domain.
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

    /// The tenant named `name` by the keys file ([`crate::tenancy::auth`]): every
    /// key of that tenant is the same tenant, under [`Scope::Tenant`].
    pub fn named(scope: Scope, name: &str) -> Tenant {
        match scope {
            Scope::Global => Tenant::GLOBAL,
            Scope::Tenant => Tenant(xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), !TENANT_SEED)),
        }
    }

    /// The tenant of a request: the hash of its API key, read from every
    /// value of every one of [`API_KEY_HEADERS`] (SDKs send it as
    /// `Authorization: Bearer`, Azure-style clients as `api-key`). The same
    /// key is the same tenant in any of these headers; a request carrying
    /// several different keys is a tenant of its own (never that of the
    /// first key alone, which another hop may not be the one checking).
    /// Without a key, [`Tenant::ANONYMOUS`], under either scope: a request
    /// with no identity never reads an answer stored for one.
    pub fn of(scope: Scope, headers: &http::HeaderMap) -> Tenant {
        let mut keys = api_keys(headers);
        let Some(first) = keys.next() else {
            return Tenant::ANONYMOUS;
        };
        if scope == Scope::Global {
            return Tenant::GLOBAL;
        }
        // The common case, one key (perhaps repeated), allocates nothing.
        if keys.all(|k| k == first) {
            return Tenant(xxhash_rust::xxh3::xxh3_64_with_seed(first, TENANT_SEED));
        }
        let mut several: Vec<&[u8]> = api_keys(headers).collect();
        several.sort_unstable();
        several.dedup();
        let mut h = Xxh3::with_seed(TENANT_SEED);
        for k in several {
            h.update(&(k.len() as u64).to_le_bytes());
            h.update(k);
        }
        Tenant(h.digest())
    }
}

/// The token of an `Authorization` value: after its `Bearer` scheme, which
/// is case-insensitive (RFC 9110: `bearer`, `BEARER` are the same), else
/// the value as it is.
pub fn bearer_token(value: &[u8]) -> &[u8] {
    match value.split_at_checked(7) {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case(b"bearer ") => token,
        _ => value,
    }
}

/// Every non-empty API key a request carries, in [`API_KEY_HEADERS`]
/// order (a bearer token without its `Bearer `).
fn api_keys(headers: &http::HeaderMap) -> impl Iterator<Item = &[u8]> {
    API_KEY_HEADERS
        .iter()
        .flat_map(|name| headers.get_all(*name).iter().map(move |v| (*name, v.as_bytes())))
        .map(|(name, value)| {
            if name == "authorization" {
                bearer_token(value)
            } else {
                value
            }
        })
        .filter(|k| !k.is_empty())
}

/// Seed of the tenant hash.
const TENANT_SEED: u64 = 0x7465_6e61_6e74;

/// The headers a client's API key comes in: OpenAI's `Authorization:
/// Bearer <key>`, Azure OpenAI's `api-key`, and `x-api-key`.
pub const API_KEY_HEADERS: [&str; 3] = ["authorization", "api-key", "x-api-key"];

/// Request headers that may change an answer, so part of its key: OpenAI's
/// organization and project, which a deployment may map to other models or
/// policies behind the gateway.
pub const ANSWER_HEADERS: [&str; 2] = ["openai-organization", "openai-project"];

/// Fields that do not change the answer's content.
const PRESENTATION_ONLY: [&str; 2] = ["stream", "stream_options"];

/// The cache key of a request of `tenant` to `endpoint` with `query` (the
/// URI's query string, forwarded as it came) and `headers` (of which the
/// [`ANSWER_HEADERS`] count).
pub fn key(
    secret: &KeySecret,
    tenant: Tenant,
    endpoint: Endpoint,
    query: &str,
    headers: &http::HeaderMap,
    body: &Object<'_>,
) -> shm_layout::ResponseKey {
    let mut h = Xxh3::with_secret(secret.0);
    h.update(&tenant.0.to_le_bytes());
    h.update(endpoint.path().as_bytes());
    h.update(&[0]);
    hash_str(&mut h, query);
    for name in ANSWER_HEADERS {
        for value in headers.get_all(name) {
            hash_str(&mut h, name);
            h.update(&(value.len() as u64).to_le_bytes());
            h.update(value.as_bytes());
        }
    }
    hash_object(&mut h, body, &PRESENTATION_ONLY);
    shm_layout::ResponseKey(h.digest128())
}

/// The secret response-cache keys are hashed with (XXH3's 192-byte secret),
/// expanded from the chain seed: the segment's, or the Redis namespace's,
/// so every host sharing a namespace keys alike, and no client knows it. A
/// client cannot compute a key, so it cannot search offline for a request
/// whose key collides with another's (another tenant's answer served for
/// it). XXH3 keyed so is not a cryptographic MAC; the tenant is hashed in
/// too, and a collision needs the secret.
#[derive(Clone)]
pub struct KeySecret([u8; 192]);

impl KeySecret {
    /// The secret of chain seed `seed`.
    pub fn new(seed: u64) -> Self {
        let mut secret = [0u8; 192];
        for (i, chunk) in secret.chunks_exact_mut(8).enumerate() {
            let word = xxhash_rust::xxh3::xxh3_64_with_seed(&(i as u64).to_le_bytes(), seed ^ 0x7365_6372_6574);
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        Self(secret)
    }
}

impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySecret(..)")
    }
}

/// Feeds `object`'s canonical form to `h`, leaving out the keys in `skip`.
fn hash_object(h: &mut Xxh3, object: &Object<'_>, skip: &[&str]) {
    let mut entries = object.canonical();
    entries.retain(|(key, _)| !skip.contains(key));
    h.update(b"{");
    h.update(&(entries.len() as u64).to_le_bytes());
    for (key, value) in entries {
        hash_str(h, key);
        hash_value(h, value);
    }
    h.update(b"}");
}

fn hash_str(h: &mut Xxh3, s: &str) {
    h.update(b"s");
    h.update(&(s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

/// Feeds a value's canonical form to `h`: a type tag, then its content
/// (numbers in serde_json's shortest text, so `0` and `0.0` differ as they
/// did in the serialised form).
fn hash_value(h: &mut Xxh3, value: &Json<'_>) {
    match value {
        Json::Null => h.update(b"n"),
        Json::Bool(b) => h.update(if *b { b"t" } else { b"f" }),
        Json::Number(n) => {
            struct Feed<'h>(&'h mut Xxh3);
            impl std::fmt::Write for Feed<'_> {
                fn write_str(&mut self, s: &str) -> std::fmt::Result {
                    self.0.update(s.as_bytes());
                    Ok(())
                }
            }
            h.update(b"#");
            let _ = std::fmt::Write::write_fmt(&mut Feed(h), format_args!("{n}"));
            h.update(b";");
        }
        Json::String(s) => hash_str(h, s),
        Json::Array(items) => {
            h.update(b"[");
            h.update(&(items.len() as u64).to_le_bytes());
            for item in items {
                hash_value(h, item);
            }
            h.update(b"]");
        }
        Json::Object(object) => hash_object(h, object, &[]),
    }
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
pub fn is_deterministic(body: &Object<'_>) -> bool {
    let zero_temperature = body.get("temperature").and_then(Json::as_f64) == Some(0.0);
    let seeded = body.get("seed").is_some_and(Json::is_integer);
    zero_temperature || seeded
}

/// What the cache may do for a request with this body and `Cache-Control`
/// header, when caching is `enabled` and non-deterministic requests are
/// cached only if `cache_nondeterministic`.
pub fn cacheability(
    enabled: bool,
    cache_nondeterministic: bool,
    body: &Object<'_>,
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

    /// The key without a query string or answer headers.
    fn key(t: Tenant, e: Endpoint, b: &Object<'_>) -> shm_layout::ResponseKey {
        super::key(&KeySecret::new(1), t, e, "", &http::HeaderMap::new(), b)
    }

    fn body(json: &str) -> Object<'_> {
        match Json::parse(json.as_bytes()).unwrap() {
            Json::Object(m) => m,
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
    fn keys_are_canonical_at_every_level_and_tell_types_apart() {
        let t = Tenant::ANONYMOUS;
        let e = Endpoint::ChatCompletions;
        let k = |json: &str| key(t, e, &body(json));
        // Nested key order does not matter; a repeated key counts once, with
        // its last value (as serde_json reads it).
        assert_eq!(
            k(r#"{"model":"m","response_format":{"type":"json_schema","schema":{"a":1,"b":[1,{"x":null,"y":true}]}}}"#),
            k(r#"{"response_format":{"schema":{"b":[1,{"y":true,"x":null}],"a":1},"type":"json_schema"},"model":"m"}"#)
        );
        assert_eq!(k(r#"{"model":"x","model":"m"}"#), k(r#"{"model":"m"}"#));
        // Values of different types or shapes never collide.
        let distinct = [
            r#"{"a":"1"}"#,
            r#"{"a":1}"#,
            r#"{"a":1.0}"#,
            r#"{"a":[1]}"#,
            r#"{"a":["1"]}"#,
            r#"{"a":{"1":null}}"#,
            r#"{"a":null}"#,
            r#"{"a":true}"#,
            r#"{"a":"ab","b":""}"#,
            r#"{"a":"a","b":"b"}"#,
            r#"{"a":[[],[1]]}"#,
            r#"{"a":[[1],[]]}"#,
            r#"{}"#,
            r#"{"stream":true,"a":1}"#,
        ];
        let keys: std::collections::HashSet<_> = distinct[..distinct.len() - 1].iter().map(|j| k(j)).collect();
        assert_eq!(keys.len(), distinct.len() - 1);
        assert_eq!(
            k(r#"{"stream":true,"a":1}"#),
            k(r#"{"a":1}"#),
            "presentation fields are left out"
        );
        assert_eq!(
            k(r#"{"stream_options":{"include_usage":true}}"#),
            k("{}"),
            "presentation fields are left out"
        );
    }

    #[test]
    fn tenants_never_share_keys_unless_global() {
        let b = body(r#"{"model":"m","prompt":"x","temperature":0}"#);
        let e = Endpoint::Completions;
        let of = |scope, header: Option<(&'static str, &'static str)>| {
            let mut headers = http::HeaderMap::new();
            if let Some((name, value)) = header {
                headers.insert(name, http::HeaderValue::from_static(value));
            }
            Tenant::of(scope, &headers)
        };
        let alice = of(Scope::Tenant, Some(("authorization", "Bearer sk-alice")));
        let bob = of(Scope::Tenant, Some(("authorization", "Bearer sk-bob")));
        assert_ne!(alice, bob);
        assert_ne!(alice, of(Scope::Tenant, None));
        assert_eq!(of(Scope::Tenant, None), Tenant::ANONYMOUS);
        assert_eq!(of(Scope::Tenant, Some(("authorization", "Bearer "))), Tenant::ANONYMOUS);
        assert_ne!(key(alice, e, &b), key(bob, e, &b));
        assert_eq!(
            of(Scope::Global, Some(("authorization", "Bearer sk-alice"))),
            of(Scope::Global, Some(("authorization", "Bearer sk-bob")))
        );
        assert_eq!(
            of(Scope::Global, None),
            Tenant::ANONYMOUS,
            "no identity never reads what one stored, even global"
        );
        assert_ne!(Tenant::ANONYMOUS, Tenant::GLOBAL);
        // The same key in any of the API-key headers is the same tenant;
        // other keys are other tenants.
        assert_eq!(of(Scope::Tenant, Some(("api-key", "sk-alice"))), alice);
        assert_eq!(of(Scope::Tenant, Some(("x-api-key", "sk-alice"))), alice);
        assert_ne!(of(Scope::Tenant, Some(("api-key", "sk-carol"))), Tenant::ANONYMOUS);
        assert_ne!(of(Scope::Tenant, Some(("api-key", "sk-carol"))), alice);
        // Every value counts: two keys are neither's tenant, whatever order
        // and header they come in; the same key twice is that key's.
        let mut two = http::HeaderMap::new();
        two.append("authorization", http::HeaderValue::from_static("Bearer sk-alice"));
        two.append("authorization", http::HeaderValue::from_static("Bearer sk-bob"));
        let both = Tenant::of(Scope::Tenant, &two);
        assert!(both != alice && both != bob && both != Tenant::ANONYMOUS);
        let mut swapped = http::HeaderMap::new();
        swapped.append("x-api-key", http::HeaderValue::from_static("sk-bob"));
        swapped.append("api-key", http::HeaderValue::from_static("sk-alice"));
        assert_eq!(Tenant::of(Scope::Tenant, &swapped), both);
        let mut again = http::HeaderMap::new();
        again.append("authorization", http::HeaderValue::from_static("Bearer sk-alice"));
        again.append("api-key", http::HeaderValue::from_static("sk-alice"));
        assert_eq!(Tenant::of(Scope::Tenant, &again), alice);
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token(b"Bearer sk-1"), b"sk-1");
        assert_eq!(bearer_token(b"bearer sk-1"), b"sk-1");
        assert_eq!(bearer_token(b"BEARER sk-1"), b"sk-1");
        assert_eq!(bearer_token(b"sk-1"), b"sk-1", "a bare key");
        assert_eq!(bearer_token(b"Bear"), b"Bear");
        assert_eq!(bearer_token("Bearer é".as_bytes()), "é".as_bytes());
    }

    #[test]
    fn keys_depend_on_the_secret() {
        let b = body(r#"{"model":"m","prompt":"x"}"#);
        let (t, e) = (Tenant(1), Endpoint::Completions);
        let none = http::HeaderMap::new();
        assert_ne!(
            super::key(&KeySecret::new(1), t, e, "", &none, &b),
            super::key(&KeySecret::new(2), t, e, "", &none, &b),
            "another seed, another key: a client cannot compute one"
        );
    }

    #[test]
    fn the_query_string_and_the_organization_are_in_the_key() {
        let b = body(r#"{"model":"m","prompt":"x","temperature":0}"#);
        let (t, e) = (Tenant::ANONYMOUS, Endpoint::Completions);
        let none = http::HeaderMap::new();
        let base = super::key(&KeySecret::new(1), t, e, "", &none, &b);
        assert_ne!(
            super::key(&KeySecret::new(1), t, e, "api-version=2024-10-21", &none, &b),
            base
        );
        let mut org = http::HeaderMap::new();
        org.insert("openai-organization", http::HeaderValue::from_static("org-a"));
        assert_ne!(super::key(&KeySecret::new(1), t, e, "", &org, &b), base);
        let mut other = http::HeaderMap::new();
        other.insert("openai-organization", http::HeaderValue::from_static("org-b"));
        assert_ne!(
            super::key(&KeySecret::new(1), t, e, "", &org, &b),
            super::key(&KeySecret::new(1), t, e, "", &other, &b)
        );
        let mut unrelated = http::HeaderMap::new();
        unrelated.insert("user-agent", http::HeaderValue::from_static("curl"));
        assert_eq!(
            super::key(&KeySecret::new(1), t, e, "", &unrelated, &b),
            base,
            "other headers do not count"
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
