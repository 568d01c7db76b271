//! `kind = "file"`: a YAML or JSON file of endpoints, for fleets without
//! Kubernetes (or a ConfigMap mounted as a file).
//!
//! ```yaml
//! endpoints:
//!   - url: http://10.0.0.11:8000
//!     model: qwen            # a [[model]] name or alias; default discovery.model
//!     role: prefill          # both (default), prefill or decode
//!     bootstrap_port: 8998   # SGLang prefill engines
//!     name: prefill-0        # default host:port
//!     weight: 1              # its share of the load, relative; 0 takes it out (drained)
//!     cache_salt: true       # default discovery.cache_salt
//!     metrics_flavor: vllm   # default discovery.metrics_flavor
//!     kv_events: tcp://10.0.0.11:5557        # on its own host; default discovery.kv_events_port
//!     kv_events_replay: tcp://10.0.0.11:5558 # default discovery.kv_events_replay_port
//! ```
//!
//! A bare list of entries is read too, and JSON is YAML. Unknown keys,
//! URLs that do not parse and repeated URLs are errors: the whole file is
//! then refused, logged once, and the last good set stays in force.
//!
//! The file is **polled** (every `discovery.poll_ms`): its inode, size and
//! modification time are compared, and it is read again only when one
//! changed, then parsed only if its content did. Polling rather than
//! inotify (the `notify` crate) because the two ways files are replaced in
//! production defeat a watch on the file: an atomic `rename` over it (the
//! watch follows the old inode), and a Kubernetes ConfigMap volume, whose
//! update swaps a `..data` symlink in the directory. A `stat` a second
//! costs nothing next to that.
//!
//! `weight` (1 to [`MAX_WEIGHT`], default 1) is the engine's capacity
//! relative to the others': the routing policies compare loads per unit
//! of weight (`[[backend]] weight`). 0 takes an engine out of the set (it
//! drains).

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;

use super::{Endpoint, Endpoints};
use crate::config::{BackendConfig, BackendRole, DiscoveryConfig, MAX_WEIGHT, MetricsFlavor};

/// Why a file of endpoints is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    /// Not YAML or JSON, or not the schema.
    #[error("{0}")]
    Parse(String),
    /// Entry `index` is wrong.
    #[error("endpoint {index} ({url:?}): {reason}")]
    Entry {
        /// Its position, from 0.
        index: usize,
        /// Its URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
}

/// One entry, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    url: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    role: BackendRole,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    cache_salt: Option<bool>,
    #[serde(default)]
    metrics_flavor: Option<MetricsFlavor>,
    #[serde(default)]
    kv_events: Option<String>,
    #[serde(default)]
    kv_events_replay: Option<String>,
}

/// The file's two forms.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    endpoints: Vec<Entry>,
}

/// The endpoints `text` lists (entries of weight 0 left out).
pub fn parse(text: &str) -> Result<Vec<Endpoint>, FileError> {
    let value: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).map_err(|e| FileError::Parse(e.to_string()))?;
    let entries: Vec<Entry> = match value {
        serde_yaml_ng::Value::Null => Ok(Vec::new()),
        serde_yaml_ng::Value::Sequence(_) => serde_yaml_ng::from_value(value),
        _ => serde_yaml_ng::from_value::<Document>(value).map(|d| d.endpoints),
    }
    .map_err(|e| FileError::Parse(e.to_string()))?;
    let mut endpoints: Vec<Endpoint> = Vec::with_capacity(entries.len());
    let mut addresses = Vec::with_capacity(entries.len());
    for (index, entry) in entries.into_iter().enumerate() {
        let wrong = |reason: String| FileError::Entry {
            index,
            url: entry.url.clone(),
            reason,
        };
        let endpoint = Endpoint {
            url: entry.url.clone(),
            name: entry.name.clone(),
            role: entry.role,
            bootstrap_port: entry.bootstrap_port,
            model: entry.model.clone(),
            cache_salt: entry.cache_salt,
            metrics_flavor: entry.metrics_flavor,
            weight: entry.weight.unwrap_or(1).max(1),
            kv_events: entry.kv_events.clone(),
            kv_events_replay: entry.kv_events_replay.clone(),
        };
        let backend: BackendConfig = endpoint.backend(&DiscoveryConfig::default());
        let address = backend.server_address().map_err(|e| wrong(e.to_string()))?;
        backend.check_name().map_err(|e| wrong(format!("name: {e}")))?;
        backend
            .check_events_on_own_host()
            .map_err(|e| wrong(format!("kv_events: {e}")))?;
        if entry.bootstrap_port == Some(0) {
            return Err(wrong("bootstrap_port: must be a port, 1 to 65535".into()));
        }
        if let Some(first) = addresses.iter().position(|a| *a == address) {
            return Err(wrong(format!("the same server as endpoint {first}")));
        }
        addresses.push(address);
        if entry.weight.is_some_and(|w| w > MAX_WEIGHT) {
            return Err(wrong(format!("weight: must be 0 (out) to {MAX_WEIGHT}")));
        }
        if entry.weight != Some(0) {
            endpoints.push(endpoint);
        }
    }
    Ok(endpoints)
}

/// What tells that a file may have changed without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    inode: u64,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    // `metadata` follows symlinks: a ConfigMap's swapped `..data` shows.
    let m = std::fs::metadata(path)?;
    Ok(Stamp {
        inode: m.ino(),
        len: m.len(),
        modified: m.modified().ok(),
    })
}

/// Polls `config.path` and sends each new good set on `tx` until every
/// receiver is gone. The first read that fails or does not parse is
/// logged (once per content, or once while the file is missing) and
/// changes nothing.
pub async fn follow(config: DiscoveryConfig, tx: watch::Sender<Option<Endpoints>>) {
    let Some(path) = config.path.clone() else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(config.poll_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut seen_stamp, mut seen_text): (Option<Stamp>, Option<u64>) = (None, None);
    let mut missing_logged = false;
    loop {
        tick.tick().await;
        if tx.is_closed() {
            return;
        }
        let now = match stamp(&path) {
            Ok(s) => s,
            Err(e) => {
                if !missing_logged {
                    tracing::error!(file = %path.display(), "discovery: cannot read {}: {e}; keeping the endpoints found before", path.display());
                    missing_logged = true;
                }
                seen_stamp = None;
                continue;
            }
        };
        missing_logged = false;
        if seen_stamp == Some(now) {
            continue;
        }
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(file = %path.display(), "discovery: cannot read {}: {e}; keeping the endpoints found before", path.display());
                missing_logged = true;
                continue;
            }
        };
        seen_stamp = Some(now);
        let hash = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
        if seen_text == Some(hash) {
            continue;
        }
        seen_text = Some(hash);
        match parse(&text) {
            Ok(endpoints) => {
                tracing::info!(file = %path.display(), endpoints = endpoints.len(), "discovery: {} lists {} endpoints", path.display(), endpoints.len());
                tx.send_replace(Some(std::sync::Arc::new(endpoints)));
            }
            Err(e) => {
                tracing::error!(file = %path.display(), "discovery: {} is refused, keeping the endpoints found before: {e}", path.display())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Vec<Endpoint>, FileError> {
        parse(text)
    }

    #[test]
    fn both_forms_and_json_read_alike() {
        let yaml = "endpoints:\n  - url: http://10.0.0.1:8000\n    model: qwen\n    role: prefill\n    bootstrap_port: 8998\n  - url: http://10.0.0.2:8000\n    name: b\n";
        let list = "- url: http://10.0.0.1:8000\n  model: qwen\n  role: prefill\n  bootstrap_port: 8998\n- {url: 'http://10.0.0.2:8000', name: b}\n";
        let json = r#"{"endpoints": [{"url": "http://10.0.0.1:8000", "model": "qwen", "role": "prefill", "bootstrap_port": 8998},
            {"url": "http://10.0.0.2:8000", "name": "b"}]}"#;
        let a = read(yaml).unwrap();
        assert_eq!(a, read(list).unwrap());
        assert_eq!(a, read(json).unwrap());
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].role, BackendRole::Prefill);
        assert_eq!(a[0].model.as_deref(), Some("qwen"));
        assert_eq!(a[0].bootstrap_port, Some(8998));
        assert_eq!(a[1].name.as_deref(), Some("b"));
        assert_eq!(read("").unwrap(), []);
        assert_eq!(read("endpoints: []").unwrap(), []);
    }

    #[test]
    fn weight_zero_takes_an_endpoint_out_and_others_are_kept() {
        let e = parse("- {url: 'http://a:1', weight: 0}\n- {url: 'http://b:1', weight: 1}\n").unwrap();
        assert_eq!(e.iter().map(|e| e.url.as_str()).collect::<Vec<_>>(), ["http://b:1"]);
        assert_eq!(e[0].weight, 1);
        let e = parse("- {url: 'http://a:1', weight: 3}\n- url: http://b:1\n").unwrap();
        assert_eq!((e[0].weight, e[1].weight), (3, 1));
        assert_eq!(e[0].backend(&DiscoveryConfig::default()).weight, 3);
    }

    #[test]
    fn a_wrong_file_is_refused_whole_and_says_why() {
        for (text, says) in [
            (
                "endpoints:\n  - url: http://a:1\n    colour: red\n",
                "unknown field `colour`",
            ),
            ("endpoint: []", "unknown field `endpoint`"),
            ("- url: http://a\n", "endpoint 0"),
            ("- url: http://a:1/v1\n", "endpoint 0"),
            (
                "- url: http://a:1\n- url: http://a:1\n",
                "the same server as endpoint 0",
            ),
            ("- url: http://a:1\n  role: leader\n", "unknown variant"),
            ("- url: http://a:1\n  name: 'two words'\n", "name"),
            ("- url: http://a:1\n  bootstrap_port: 0\n", "bootstrap_port"),
            ("- url: http://a:1\n  weight: 1001\n", "weight"),
            ("- url: http://a:1\n  kv_events: tcp://b:5557\n", "own host"),
            ("[{", ""),
            ("42", "invalid type"),
        ] {
            let e = read(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }
}
