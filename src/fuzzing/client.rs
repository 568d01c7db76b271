//! What clients send the gateway and what it rewrites on their behalf:
//! admin API bodies, key headers, the request body's rewrites, the usage
//! taken out of a stream.

use std::path::Path;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use crate::config::{BackendConfig, BackendUrl, ModelChanges, ModelConfig, ServeConfig};
use crate::dispatcher::{UsageStrip, with_cache_salt, with_include_usage, with_model, with_usage_option};
use crate::openai::body::Json;
use crate::openai::prompt;
use crate::response_cache::{API_KEY_HEADERS, Scope, Tenant};
use crate::tenancy::auth::{KeyEntry, Keys, KeysFile, Refusal};

/// The configuration an admin API change is made to: two backends and a
/// pool serving a model on both.
const ADMIN_BASE: &str = r#"
[[backend]]
url = "http://10.0.0.1:8000"
name = "gpu-a"

[[backend]]
url = "http://10.0.0.2:8000"
name = "gpu-b"

[[model]]
name = "llama-3-8b"
aliases = ["default"]
backends = ["gpu-a", "gpu-b"]
"#;

/// An admin API body after byte 0 (bit 0: `POST /admin/servers`, else a
/// pool; bit 1: the pool is `PUT` under a name in the path). A server's
/// address, once normalised, reads back as itself; a pool the gateway takes
/// (merged into a configuration that then validates) is written to
/// `admin.models_file` and read back as the same pool.
pub fn admin_body(data: &[u8]) {
    let Some((&choice, body)) = data.split_first() else {
        return;
    };
    let Ok(body) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if choice & 1 == 1 {
        let Ok(backend) = BackendConfig::from_admin_body(body) else {
            return;
        };
        let _ = (backend.check_name(), backend.display_name());
        if let Ok(address) = backend.server_address() {
            assert!(
                address.len() <= shm_layout::server_table::MAX_ADDRESS_BYTES,
                "address {address:?} does not fit the server table"
            );
            assert_eq!(
                BackendConfig::new(address.clone()).server_address().as_ref(),
                Ok(&address),
                "a normalised address normalises to itself"
            );
            assert!(address.parse::<BackendUrl>().is_ok());
        }
        return;
    }
    let named = (choice & 2 != 0).then_some("llama-3-8b-chat");
    let Ok(model) = ModelConfig::from_admin_body(body, named) else {
        return;
    };
    if let Some(named) = named {
        assert_eq!(model.name, named, "a PUT pool is named by its path");
    }
    let mut config = ServeConfig::from_toml(ADMIN_BASE, Path::new("/fuzz/semlb.toml")).expect("the base parses");
    let mut changes = ModelChanges::default();
    changes.set(model);
    changes.merge_into(&mut config);
    if config.validate().is_err() {
        return;
    }
    // What `ModelChanges::save` writes and `ModelChanges::load` reads.
    let text = toml::to_string(&changes).unwrap_or_else(|e| panic!("a pool the gateway took cannot be saved: {e}"));
    let read: ModelChanges =
        toml::from_str(&text).unwrap_or_else(|e| panic!("a saved pool does not read back: {e}\n{text}"));
    assert_eq!(read, changes, "a saved pool reads back as itself:\n{text}");
}

/// The two keys the keys file of [`key_headers`] lists (`\x01` and `\x02`
/// in its input stand for them).
const KEYS: [&str; 2] = [
    "sk-semlb-00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
    "sk-semlb-ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100",
];

/// A request's headers: entries split at `\n`, each a name (byte 0:
/// `authorization`, `api-key`, `x-api-key`, or another header) and a
/// value in which `\x01` and `\x02` stand for the keys the file lists. The
/// caller and the tenant do not depend on the headers' order; a caller is
/// let in exactly when its key is the one non-empty key presented.
pub fn key_headers(data: &[u8]) {
    let keys = known_keys();
    let mut entries = Vec::new();
    for entry in data.split(|b| *b == b'\n') {
        let Some((&name, value)) = entry.split_first() else {
            continue;
        };
        let name = match name % 4 {
            3 => HeaderName::from_static("x-request-id"),
            n => HeaderName::from_static(API_KEY_HEADERS[usize::from(n)]),
        };
        let mut expanded = Vec::with_capacity(value.len());
        for b in value {
            match b {
                1 | 2 => expanded.extend_from_slice(KEYS[usize::from(b - 1)].as_bytes()),
                _ => expanded.push(*b),
            }
        }
        if let Ok(value) = HeaderValue::from_bytes(&expanded) {
            entries.push((name, value));
        }
    }
    let headers = |order: &mut dyn Iterator<Item = &(HeaderName, HeaderValue)>| {
        let mut map = HeaderMap::new();
        for (name, value) in order {
            map.append(name, value.clone());
        }
        map
    };
    let forward = headers(&mut entries.iter());
    let backward = headers(&mut entries.iter().rev());
    let who = |h: &HeaderMap| keys.caller(h).map(|c| c.key_id.clone());
    assert_eq!(
        who(&forward),
        who(&backward),
        "the caller depends on the headers' order"
    );
    for scope in [Scope::Tenant, Scope::Global] {
        assert_eq!(
            Tenant::of(scope, &forward),
            Tenant::of(scope, &backward),
            "the tenant depends on the headers' order"
        );
    }
    // The keys presented, as the module docs of `auth` define them.
    let mut presented: Vec<&[u8]> = entries
        .iter()
        .filter(|(name, _)| API_KEY_HEADERS.contains(&name.as_str()))
        .map(|(name, value)| {
            let value = value.as_bytes();
            let key = if name == "authorization" {
                crate::response_cache::bearer_token(value)
            } else {
                value
            };
            key.trim_ascii()
        })
        .filter(|k| !k.is_empty())
        .collect();
    presented.sort_unstable();
    presented.dedup();
    let expected = match presented[..] {
        [] => Err(Refusal::Missing),
        [key] => KEYS
            .iter()
            .position(|k| k.as_bytes() == key)
            .map(|i| format!("key_{i}"))
            .ok_or(Refusal::Invalid),
        _ => Err(Refusal::Invalid),
    };
    assert_eq!(who(&forward), expected, "presented {presented:?}");
    if who(&forward).is_ok() {
        assert_ne!(Tenant::of(Scope::Tenant, &forward), Tenant::ANONYMOUS);
    }
}

/// The keys of [`KEYS`], `key_0` for tenant `a` and `key_1` for tenant
/// `b` (built once).
fn known_keys() -> &'static Keys {
    static K: std::sync::OnceLock<Keys> = std::sync::OnceLock::new();
    K.get_or_init(|| {
        let entry = |i: usize| KeyEntry {
            id: format!("key_{i}"),
            sha256: ring::digest::digest(&ring::digest::SHA256, KEYS[i].as_bytes())
                .as_ref()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            tenant: ["a", "b"][i].to_owned(),
            models: Vec::new(),
            created: None,
        };
        Keys::new(&KeysFile {
            keys: vec![entry(0), entry(1)],
            tenants: Vec::new(),
        })
    })
}

/// A request body after byte 0 (bits 0-1: the pool name written in; bits
/// 2-3: the tenant's salt), as the dispatcher rewrites it for an engine:
/// each of the `model`, `stream_options` (of a streamed request) and
/// `cache_salt` rewrites gives a body that JSON parsers (last value of a
/// repeated key wins, as in `serde_json` and Python's `json`) read as the
/// client's with that member set, and nothing else changed.
pub fn body_rewrite(data: &[u8]) {
    let Some((&choice, body)) = data.split_first() else {
        return;
    };
    let bytes = Bytes::copy_from_slice(body);
    let Ok(Json::Object(parsed)) = Json::parse(&bytes) else {
        return;
    };
    let Ok(Value::Object(client)) = serde_json::from_slice::<Value>(&bytes) else {
        panic!("a body the gateway parses as an object is one for serde_json");
    };
    let with = |key: &str, value: Value| {
        let mut expected = client.clone();
        expected.insert(key.to_owned(), value);
        Value::Object(expected)
    };
    let reads_as = |out: &Bytes, expected: Value, what: &str| {
        let got: Value =
            serde_json::from_slice(out).unwrap_or_else(|e| panic!("{what}: the rewritten body does not parse: {e}"));
        // A body written again by serde_json (a rewrite's slow path) may
        // move a long number by an ulp: its float parsing is not exact
        // without its `float_roundtrip` feature
        // (tests/fuzz/regressions/body_rewrite).
        let written_again = || serde_json::from_slice::<Value>(&serde_json::to_vec(&expected).expect("serializes"));
        if got != expected && written_again().ok().as_ref() != Some(&got) {
            panic!(
                "{what}: {:?} became {:?}: {got:?}, not {expected:?}",
                String::from_utf8_lossy(&bytes),
                String::from_utf8_lossy(out)
            );
        }
    };
    if let Ok(model) = prompt::request_model(&parsed) {
        let name = ["llama-3-8b", "", "meta-llama/Llama \"3\"\n", "m\u{e9}\u{1f600}"][usize::from(choice & 3)];
        reads_as(&with_model(&bytes, &model, name), with("model", name.into()), "model");
    }
    // As the dispatcher asks it, whatever options the client sent: added
    // to a body without them (the empty object included:
    // tests/fuzz/regressions/body_rewrite), set in the client's own.
    let options = match client.get("stream_options") {
        None => {
            let out = with_include_usage(&bytes).expect("an object gets the option");
            Some((out, serde_json::json!({"include_usage": true})))
        }
        Some(theirs) => {
            let mut merged = theirs.as_object().cloned().unwrap_or_default();
            merged.insert("include_usage".into(), Value::Bool(true));
            with_usage_option(&bytes).map(|out| (out, Value::Object(merged)))
        }
    };
    let (out, options) = options.expect("an object's usage option is set");
    reads_as(&out, with("stream_options", options), "stream_options");
    let salt = ["tenant-salt-0123", "", "\"\\", "s\u{e9}l"][usize::from(choice >> 2 & 3)];
    reads_as(
        &with_cache_salt(&bytes, salt),
        with("cache_salt", salt.into()),
        "cache_salt",
    );
}

/// An event stream after a list of cut points (byte 0: how many, mod 16;
/// then two bytes each, little-endian, taken modulo the stream's length).
/// Stripping usage gives the same bytes however the stream is cut, never
/// more bytes than came in, and a stream that never says `usage` passes
/// as it is.
pub fn usage_strip(data: &[u8]) {
    let Some((&count, rest)) = data.split_first() else {
        return;
    };
    let (cuts, stream) = rest.split_at((usize::from(count % 16) * 2).min(rest.len()));
    let mut at: Vec<usize> = cuts
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) % (stream.len() + 1))
        .collect();
    at.push(0);
    at.push(stream.len());
    at.sort_unstable();
    let strip = |pieces: &mut dyn Iterator<Item = &[u8]>| {
        let mut strip = UsageStrip::default();
        let mut out = Vec::new();
        for piece in pieces {
            out.extend_from_slice(&strip.feed(piece));
        }
        out.extend_from_slice(&strip.finish());
        out
    };
    let whole = strip(&mut std::iter::once(stream));
    let cut = strip(&mut at.windows(2).map(|w| &stream[w[0]..w[1]]));
    assert_eq!(
        String::from_utf8_lossy(&cut),
        String::from_utf8_lossy(&whole),
        "usage stripping gives the same bytes however the stream is cut at {at:?}"
    );
    if stream.len() <= 512 {
        let bytewise = strip(&mut stream.chunks(1));
        assert_eq!(
            bytewise, whole,
            "usage stripping gives the same bytes fed a byte at a time"
        );
    }
    assert!(whole.len() <= stream.len(), "stripping added bytes");
    if memchr::memmem::find(stream, b"usage").is_none() {
        assert_eq!(whole, stream, "a stream without usage passes as it is");
    }
}
