//! KV cache events as vLLM publishes them (`--kv-events-config`), from the
//! simulated engine's own cache: every block stored, every block evicted,
//! and a cache cleared, so a gateway's event subscriber can be tested and
//! measured here without a GPU.
//!
//! vLLM's publisher (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`)
//! has two ZeroMQ sockets:
//!
//! | socket | frames | what |
//! | --- | --- | --- |
//! | PUB (`endpoint`) | topic, sequence (8 bytes, big-endian, from 0), payload | one message per engine step that changed the cache |
//! | ROUTER (`replay_endpoint`) | in: `[identity, "", start]`; out: `[identity, "", seq, payload]` per buffered batch from `start`, then `[identity, "", -1 as 8 bytes, ""]` | replay of the last `buffer_steps` batches |
//!
//! The payload is msgpack of an `EventBatch` as msgspec writes vLLM's
//! structs today ([`encode_batch`]): a map `{ts, events}` (and
//! `data_parallel_rank` when set), each event a map tagged by `"type"`:
//! `BlockStored` (`block_hashes`, `parent_block_hash`, `token_ids`,
//! `block_size`, `lora_id`, `medium`, `lora_name`, then `extra_keys`,
//! `group_idx` and `kv_cache_spec_kind` as vLLM writes them),
//! `BlockRemoved` (`block_hashes`, `medium`, `group_idx`) or
//! `AllBlocksCleared`. The simulator's block hashes are its chained
//! seahashes ([`crate::prefix_cache::chained_hashes`]), sent as signed 64-bit
//! integers as vLLM sends Python's `hash`; a request with a `cache_salt`
//! says so in its first block's `extra_keys`, as vLLM does.
//!
//! [`KvEventsConfig::from_vllm_json`] reads vLLM's flag;
//! [`Publisher::start`] binds the sockets and sends what the engine hands
//! it ([`crate::engine::Engine::kv_events`]).

use std::collections::VecDeque;

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's default replay buffer (`buffer_steps`).
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// The sequence number that ends a replay (`-1` as 8 big-endian bytes).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Where and how the engine publishes its KV cache events: vLLM's
/// `KVEventsConfig`, as far as the simulator uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// The PUB socket's endpoint (`tcp://*:5557` binds every address;
    /// port 0 picks a free one).
    pub endpoint: String,
    /// The ROUTER socket's endpoint for replays, if any.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// The topic frame of every message.
    pub topic: String,
}

impl KvEventsConfig {
    /// Reads vLLM's `--kv-events-config` JSON (`enable_kv_cache_events`,
    /// `publisher`, `endpoint`, `replay_endpoint`, `buffer_steps`,
    /// `topic`; other keys are vLLM's and ignored). `None` when events are
    /// not enabled or the publisher is `"null"`.
    pub fn from_vllm_json(text: &str) -> Result<Option<Self>, KvEventsConfigError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(KvEventsConfigError::NotJson)?;
        let field = |name: &str| v.get(name).filter(|f| !f.is_null());
        let wrong_type = |field, expected| KvEventsConfigError::WrongType { field, expected };
        let string = |name: &'static str| -> Result<Option<String>, KvEventsConfigError> {
            field(name)
                .map(|f| f.as_str().map(str::to_owned).ok_or(wrong_type(name, "a string")))
                .transpose()
        };
        let enabled = match field("enable_kv_cache_events") {
            None => false,
            Some(f) => f.as_bool().ok_or(wrong_type("enable_kv_cache_events", "a boolean"))?,
        };
        let publisher = string("publisher")?.unwrap_or_else(|| "zmq".to_owned());
        if !enabled || publisher == "null" {
            return Ok(None);
        }
        if publisher != "zmq" {
            return Err(KvEventsConfigError::UnknownPublisher(publisher));
        }
        let buffer_steps = match field("buffer_steps") {
            None => DEFAULT_BUFFER_STEPS,
            Some(f) => f
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or(wrong_type("buffer_steps", "a positive integer"))?,
        };
        Ok(Some(Self {
            endpoint: string("endpoint")?.unwrap_or_else(|| "tcp://*:5557".to_owned()),
            replay_endpoint: string("replay_endpoint")?,
            buffer_steps,
            topic: string("topic")?.unwrap_or_default(),
        }))
    }
}

/// Why vLLM's `--kv-events-config` JSON is refused
/// ([`KvEventsConfig::from_vllm_json`]).
#[derive(Debug, thiserror::Error)]
pub enum KvEventsConfigError {
    /// The text is not JSON.
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    /// A key holds a value of the wrong type.
    #[error("`{field}` must be {expected}")]
    WrongType {
        /// The key.
        field: &'static str,
        /// What it must be (`a string`, `a boolean`, `a positive integer`).
        expected: &'static str,
    },
    /// `publisher` is neither `"zmq"` nor `"null"` (the name given).
    #[error("publisher {0:?}: only \"zmq\" and \"null\" are known")]
    UnknownPublisher(String),
}

/// Why the publisher's sockets could not be bound ([`Publisher::start`]).
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The PUB socket, at the configured endpoint.
    #[error("cannot bind the KV events socket {endpoint}: {reason}")]
    Events {
        /// The endpoint as configured.
        endpoint: String,
        /// What the ZeroMQ crate said.
        reason: zeromq::ZmqError,
    },
    /// The ROUTER socket of replays, at the configured endpoint.
    #[error("cannot bind the KV events replay socket {endpoint}: {reason}")]
    Replay {
        /// The endpoint as configured.
        endpoint: String,
        /// What the ZeroMQ crate said.
        reason: zeromq::ZmqError,
    },
}

/// Why events could not be published as `--kv-events-config` says
/// ([`publish`]): the flag's JSON, or the sockets.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The flag's JSON is refused.
    #[error(transparent)]
    Config(#[from] KvEventsConfigError),
    /// A socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
}

/// A block hash on the wire: an integer (Python's `hash`) or bytes
/// (vLLM's `sha256` hashing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireHash {
    /// A signed 64-bit hash.
    Int(i64),
    /// A byte-string hash.
    Bytes(Vec<u8>),
}

impl WireHash {
    fn value(&self) -> Value {
        match self {
            Self::Int(i) => Value::from(*i),
            Self::Bytes(b) => Value::Binary(b.clone()),
        }
    }
}

impl From<u64> for WireHash {
    /// The simulator's seahash, as the signed integer Python would send.
    fn from(h: u64) -> Self {
        Self::Int(h as i64)
    }
}

/// One event of a batch, as the engine publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `BlockStored`.
    Stored {
        /// The blocks' hashes, in prompt order.
        block_hashes: Vec<WireHash>,
        /// The hash of the block before the first, if any.
        parent: Option<WireHash>,
        /// Every block's tokens, in order.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The LoRA adapter the blocks belong to.
        lora_name: Option<String>,
        /// The first block carries extra keys (a `cache_salt`): its
        /// `extra_keys` list then names it, as vLLM's does.
        salt: Option<String>,
    },
    /// `BlockRemoved`.
    Removed(Vec<WireHash>),
    /// `AllBlocksCleared`.
    Cleared,
}

/// The msgpack payload of one batch, as vLLM's msgspec encoder writes it
/// today (maps throughout, `omit_defaults`: `data_parallel_rank`,
/// `extra_keys` and `kv_cache_spec_sliding_window` left out when unset).
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: Option<u32>) -> Vec<u8> {
    let text = |s: &str| Value::from(s);
    let hashes = |h: &[WireHash]| Value::Array(h.iter().map(WireHash::value).collect());
    let event = |e: &KvEvent| -> Value {
        let entries = match e {
            KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                salt,
            } => {
                let mut m = vec![
                    (text("type"), text("BlockStored")),
                    (text("block_hashes"), hashes(block_hashes)),
                    (
                        text("parent_block_hash"),
                        parent.as_ref().map_or(Value::Nil, WireHash::value),
                    ),
                    (
                        text("token_ids"),
                        Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
                    ),
                    (text("block_size"), Value::from(*block_size)),
                    (text("lora_id"), Value::Nil),
                    (text("medium"), text("GPU")),
                    (text("lora_name"), lora_name.as_deref().map_or(Value::Nil, text)),
                ];
                if let Some(salt) = salt {
                    // One entry per block: the first has the salt, the
                    // rest none (vLLM mixes the salt into the first only).
                    let mut keys = vec![Value::Nil; block_hashes.len()];
                    if let Some(first) = keys.first_mut() {
                        *first = Value::Array(vec![text(salt)]);
                    }
                    m.push((text("extra_keys"), Value::Array(keys)));
                }
                m.push((text("group_idx"), Value::from(0)));
                m.push((text("kv_cache_spec_kind"), text("full_attention")));
                m
            }
            KvEvent::Removed(h) => vec![
                (text("type"), text("BlockRemoved")),
                (text("block_hashes"), hashes(h)),
                (text("medium"), text("GPU")),
                (text("group_idx"), Value::from(0)),
            ],
            KvEvent::Cleared => vec![(text("type"), text("AllBlocksCleared"))],
        };
        Value::Map(entries)
    };
    let mut batch = vec![
        (text("ts"), Value::F64(ts)),
        (text("events"), Value::Array(events.iter().map(event).collect())),
    ];
    if let Some(rank) = data_parallel_rank {
        batch.push((text("data_parallel_rank"), Value::from(rank)));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Map(batch)).expect("writing to a Vec cannot fail");
    out
}

/// Seconds since the Unix epoch, as vLLM stamps a batch.
fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The bound endpoints of a running publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The PUB socket's (`tcp://ip:port`).
    pub endpoint: String,
    /// The ROUTER socket's, if it has one.
    pub replay_endpoint: Option<String>,
}

impl Bound {
    /// How the simulator's start line names the endpoints, before its
    /// `listening on http://ADDR` (which ends the line: scripts read the
    /// address there): `kv events on tcp://A replay tcp://B; `.
    pub fn describe(&self) -> String {
        let replay = self.replay_endpoint.as_deref().unwrap_or("none");
        format!("kv events on {} replay {replay}; ", self.endpoint)
    }
}

/// Publishes the events `subscribe` starts (an engine's
/// [`crate::engine::Engine::kv_events`]) as vLLM's `--kv-events-config`
/// JSON says (`None`: the flag was not given, or says no events; then
/// `subscribe` is not called). Returns the bound endpoints.
pub async fn publish(
    config_json: Option<&str>,
    subscribe: impl FnOnce() -> mpsc::UnboundedReceiver<Vec<KvEvent>>,
) -> Result<Option<Bound>, PublishError> {
    let Some(config) = config_json.map(KvEventsConfig::from_vllm_json).transpose()?.flatten() else {
        return Ok(None);
    };
    Ok(Some(Publisher::start(&config, subscribe()).await?))
}

/// An endpoint as the ZeroMQ crate binds it: vLLM's `*` is every IPv4
/// address.
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

/// The publisher: its sockets and the replay buffer, fed batches of events
/// by the engine.
pub struct Publisher {
    publisher: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    topic: Bytes,
    next_seq: u64,
}

impl Publisher {
    /// Binds `config`'s sockets and publishes every batch `batches` brings,
    /// each a message with the next sequence number, until the engine is
    /// gone. Returns the bound endpoints once listening.
    pub async fn start(
        config: &KvEventsConfig,
        batches: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    ) -> Result<Bound, BindError> {
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = publisher
            .bind(&bindable(&config.endpoint))
            .await
            .map_err(|reason| BindError::Events {
                endpoint: config.endpoint.clone(),
                reason,
            })?;
        let mut replay = None;
        let mut replay_endpoint = None;
        if let Some(at) = &config.replay_endpoint {
            let mut router = zeromq::RouterSocket::new();
            let bound = router.bind(&bindable(at)).await.map_err(|reason| BindError::Replay {
                endpoint: at.clone(),
                reason,
            })?;
            replay_endpoint = Some(bound.to_string());
            replay = Some(router);
        }
        let this = Self {
            publisher,
            replay,
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps,
            topic: Bytes::from(config.topic.clone().into_bytes()),
            next_seq: 0,
        };
        tokio::spawn(this.run(batches));
        Ok(Bound {
            endpoint: endpoint.to_string(),
            replay_endpoint,
        })
    }

    async fn run(mut self, mut batches: mpsc::UnboundedReceiver<Vec<KvEvent>>) {
        loop {
            let request = async {
                match &mut self.replay {
                    Some(router) => router.recv().await.ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = batches.recv() => match batch {
                    Some(events) => self.publish(&events).await,
                    None => return,
                },
                Some(request) = request => self.replay(request).await,
            }
        }
    }

    async fn publish(&mut self, events: &[KvEvent]) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(encode_batch(now_ts(), events, None));
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            // A PUB socket drops what no subscriber takes; so does vLLM's.
            let _ = self.publisher.send(message).await;
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    /// Answers `[identity, "", start]` with the buffered batches from
    /// `start`, then the end marker.
    async fn replay(&mut self, request: ZmqMessage) {
        let frames = request.into_vec();
        let [identity, _, start] = frames.as_slice() else {
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            return;
        };
        let Some(router) = &mut self.replay else { return };
        for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start) {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if let Ok(m) = ZmqMessage::try_from(frames) {
                let _ = router.send(m).await;
            }
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::from_static(&END_SEQ),
            Bytes::new(),
        ];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = router.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_flag() {
        assert_eq!(KvEventsConfig::from_vllm_json("{}").unwrap(), None);
        assert_eq!(
            KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#).unwrap(),
            None
        );
        let c = KvEventsConfig::from_vllm_json(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558", "buffer_steps": 50, "hwm": 1000, "topic": "kv"}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            c,
            KvEventsConfig {
                endpoint: "tcp://*:5557".to_owned(),
                replay_endpoint: Some("tcp://*:5558".to_owned()),
                buffer_steps: 50,
                topic: "kv".to_owned(),
            }
        );
        assert!(KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events": true, "publisher": "nats"}"#).is_err());
        assert!(KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events": true, "buffer_steps": 0}"#).is_err());
        assert!(KvEventsConfig::from_vllm_json("[").is_err());
        assert_eq!(bindable("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }

    #[test]
    fn a_refused_flag_says_why() {
        let message = |json: &str| KvEventsConfig::from_vllm_json(json).unwrap_err().to_string();
        assert_eq!(
            message(r#"{"enable_kv_cache_events": true, "publisher": "nats"}"#),
            r#"publisher "nats": only "zmq" and "null" are known"#
        );
        assert_eq!(
            message(r#"{"enable_kv_cache_events": "yes"}"#),
            "`enable_kv_cache_events` must be a boolean"
        );
        assert_eq!(
            message(r#"{"enable_kv_cache_events": true, "buffer_steps": 0}"#),
            "`buffer_steps` must be a positive integer"
        );
        assert_eq!(
            message(r#"{"enable_kv_cache_events": true, "topic": 5}"#),
            "`topic` must be a string"
        );
        assert_eq!(
            message("["),
            format!(
                "not JSON: {}",
                serde_json::from_str::<serde_json::Value>("[").unwrap_err()
            )
        );
    }
}
