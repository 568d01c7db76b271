//! vLLM's KV cache events on the wire, decoded.
//!
//! vLLM (`--kv-events-config`, `vllm/distributed/kv_events.py`) publishes
//! on a ZeroMQ PUB socket one multipart message per batch:
//!
//! | frame | contents |
//! | --- | --- |
//! | 0 | the topic (often empty) |
//! | 1 | the sequence number: 8 bytes, big-endian, from 0, one per batch |
//! | 2 | the batch: msgpack, as msgspec encodes `EventBatch` |
//!
//! A batch is `ts` (float seconds), `events`, and `data_parallel_rank`
//! (left out when none). An event is one of:
//!
//! | event | fields |
//! | --- | --- |
//! | `BlockStored` | `block_hashes`, `parent_block_hash` (or nil), `token_ids` (every block's, in order), `block_size`, `lora_id`, `medium`, later `lora_name`, `extra_keys`, `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window` |
//! | `BlockRemoved` | `block_hashes`, `medium`, later `group_idx` |
//! | `AllBlocksCleared` | none |
//!
//! msgspec writes a struct as a positional array (`array_like`) or as a
//! map of field names; a tagged event's tag (its class name) is the first
//! element of its array or the map's `"type"`. vLLM's releases have used
//! three layouts, all read here ([`decode_batch`]): batch and events as
//! arrays (the first releases: integer hashes); a batch array of tagged
//! maps; and (vLLM's main today) maps throughout. A block hash is an
//! integer (Python's `hash`, signed 64-bit, or an unsigned 64-bit one) or
//! bytes (the `sha256` hashing: 32 bytes). Fields this module does not
//! know are skipped, an event type it does not know is
//! [`KvEvent::Unknown`], so a newer engine's batches still read.
//!
//! `testdata/` pins the format: `make_vectors.py` restates the structs of
//! each layout and encodes them with msgspec itself, and the unit tests
//! decode each vector to what the script says it holds.

use rmpv::Value;

/// The deepest msgpack nesting read (a batch nests 4 deep; `extra_keys`
/// a little more).
const MAX_DEPTH: usize = 16;

/// Why a message is not a batch of events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not msgpack, or nested deeper than [`MAX_DEPTH`].
    #[error("not msgpack: {0}")]
    Msgpack(String),
    /// msgpack, but not the shape of a batch.
    #[error("not a KV event batch: {0}")]
    Shape(String),
    /// A message with other than 3 frames, or a sequence frame of other
    /// than 8 bytes.
    #[error("not a KV event message: {0}")]
    Frames(String),
}

/// A block hash as the engine gives it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// An integer hash (signed or unsigned 64-bit on the wire).
    Int(i128),
    /// A byte-string hash (`sha256`: 32 bytes).
    Bytes(Box<[u8]>),
}

/// Blocks the engine now holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// Each block's hash, in prompt order.
    pub block_hashes: Vec<EngineHash>,
    /// The hash of the block before the first, if any.
    pub parent: Option<EngineHash>,
    /// The tokens of every block, in order (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's id (deprecated by vLLM for `lora_name`).
    pub lora_id: Option<i64>,
    /// The LoRA adapter's name.
    pub lora_name: Option<String>,
    /// Where the blocks are (`GPU`, `CPU`, ...).
    pub medium: Option<String>,
    /// The KV cache group (hybrid models have several).
    pub group: Option<u32>,
    /// Some block carries extra keys (a `cache_salt`, multimodal inputs):
    /// its hash covers more than its tokens.
    pub extra_keys: bool,
}

/// Blocks the engine no longer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The blocks' hashes.
    pub block_hashes: Vec<EngineHash>,
    /// Where they were.
    pub medium: Option<String>,
    /// The KV cache group.
    pub group: Option<u32>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `BlockStored`.
    Stored(BlockStored),
    /// `BlockRemoved`.
    Removed(BlockRemoved),
    /// `AllBlocksCleared`: the engine's cache is empty.
    Cleared,
    /// An event type this module does not know (its tag).
    Unknown(String),
}

/// One published batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// When the engine made it (seconds since the epoch).
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published it, if the engine said.
    pub data_parallel_rank: Option<u32>,
}

/// A PUB message's parts: its sequence number and its batch's bytes.
pub fn split_message<'m>(parts: &[&'m [u8]]) -> Result<(u64, &'m [u8]), WireError> {
    let [_topic, seq, payload] = parts else {
        return Err(WireError::Frames(format!("{} frames, not 3", parts.len())));
    };
    let seq: [u8; 8] = (*seq)
        .try_into()
        .map_err(|_| WireError::Frames(format!("a sequence frame of {} bytes, not 8", seq.len())))?;
    Ok((u64::from_be_bytes(seq), payload))
}

/// Decodes one batch (the third frame of a message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
        .map_err(|e| WireError::Msgpack(e.to_string()))?;
    if !reader.is_empty() {
        return Err(WireError::Msgpack(format!("{} bytes after the batch", reader.len())));
    }
    let fields = Fields::of(&value, &["ts", "events", "data_parallel_rank"], "the batch")?;
    let ts = match fields.get(0) {
        Some(Value::F64(v)) => *v,
        Some(Value::F32(v)) => f64::from(*v),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or_default(),
        other => return Err(shape("the batch's ts", other)),
    };
    let Some(Value::Array(events)) = fields.get(1) else {
        return Err(shape("the batch's events", fields.get(1)));
    };
    let data_parallel_rank = optional(fields.get(2), "data_parallel_rank", as_u32)?;
    let events = events.iter().map(event).collect::<Result<_, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// The fields of a struct msgspec wrote as an array (by position, after
/// `skip` leading elements: an array event's tag) or as a map (by
/// `names`).
struct Fields<'v> {
    values: Vec<Option<&'v Value>>,
}

impl<'v> Fields<'v> {
    fn of(value: &'v Value, names: &[&str], what: &str) -> Result<Self, WireError> {
        Self::skipping(value, names, 0, what)
    }

    fn skipping(value: &'v Value, names: &[&str], skip: usize, what: &str) -> Result<Self, WireError> {
        let values = match value {
            Value::Array(items) => (0..names.len()).map(|i| items.get(skip + i)).collect(),
            Value::Map(entries) => names
                .iter()
                .map(|name| entries.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v))
                .collect(),
            other => return Err(shape(what, Some(other))),
        };
        Ok(Self { values })
    }

    /// The field at `index` of the names given, if present and not nil.
    fn get(&self, index: usize) -> Option<&'v Value> {
        self.values.get(index).copied().flatten().filter(|v| !v.is_nil())
    }
}

fn shape(what: &str, found: Option<&Value>) -> WireError {
    match found {
        Some(v) => WireError::Shape(format!("{what} is {v}")),
        None => WireError::Shape(format!("{what} is missing")),
    }
}

/// An optional field read by `read` (nil or absent: `None`).
fn optional<T>(value: Option<&Value>, what: &str, read: impl Fn(&Value) -> Option<T>) -> Result<Option<T>, WireError> {
    value.map(|v| read(v).ok_or_else(|| shape(what, Some(v)))).transpose()
}

fn as_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

fn as_string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i
            .as_i64()
            .map(i128::from)
            .or_else(|| i.as_u64().map(i128::from))
            .map(EngineHash::Int),
        Value::Binary(b) => Some(EngineHash::Bytes(b.as_slice().into())),
        _ => None,
    }
}

fn hashes(value: Option<&Value>, what: &str) -> Result<Vec<EngineHash>, WireError> {
    let Some(Value::Array(items)) = value else {
        return Err(shape(what, value));
    };
    items
        .iter()
        .map(|v| hash(v).ok_or_else(|| shape(what, Some(v))))
        .collect()
}

/// The names of `BlockStored`'s fields, in the engine's order.
const STORED: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];

/// The names of `BlockRemoved`'s fields, in the engine's order.
const REMOVED: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn event(value: &Value) -> Result<KvEvent, WireError> {
    // The tag: an array's first element, or a map's "type".
    let (tag, skip) = match value {
        Value::Array(items) => (items.first().and_then(Value::as_str), 1),
        Value::Map(entries) => (
            entries
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str()),
            0,
        ),
        other => return Err(shape("an event", Some(other))),
    };
    let Some(tag) = tag else {
        return Err(WireError::Shape(format!("an event without a type tag: {value}")));
    };
    Ok(match tag {
        "BlockStored" => {
            let f = Fields::skipping(value, &STORED, skip, "BlockStored")?;
            let token_ids = match f.get(2) {
                Some(Value::Array(ids)) => ids
                    .iter()
                    .map(|v| as_u32(v).ok_or_else(|| shape("BlockStored.token_ids", Some(v))))
                    .collect::<Result<_, _>>()?,
                other => return Err(shape("BlockStored.token_ids", other)),
            };
            KvEvent::Stored(BlockStored {
                block_hashes: hashes(f.get(0), "BlockStored.block_hashes")?,
                parent: optional(f.get(1), "BlockStored.parent_block_hash", hash)?,
                token_ids,
                block_size: f
                    .get(3)
                    .and_then(as_u32)
                    .ok_or_else(|| shape("BlockStored.block_size", f.get(3)))?,
                lora_id: optional(f.get(4), "BlockStored.lora_id", Value::as_i64)?,
                medium: optional(f.get(5), "BlockStored.medium", as_string)?,
                lora_name: optional(f.get(6), "BlockStored.lora_name", as_string)?,
                group: optional(f.get(8), "BlockStored.group_idx", as_u32)?,
                extra_keys: match f.get(7) {
                    None => false,
                    Some(Value::Array(keys)) => keys.iter().any(|k| !k.is_nil()),
                    other => return Err(shape("BlockStored.extra_keys", other)),
                },
            })
        }
        "BlockRemoved" => {
            let f = Fields::skipping(value, &REMOVED, skip, "BlockRemoved")?;
            KvEvent::Removed(BlockRemoved {
                block_hashes: hashes(f.get(0), "BlockRemoved.block_hashes")?,
                medium: optional(f.get(1), "BlockRemoved.medium", as_string)?,
                group: optional(f.get(2), "BlockRemoved.group_idx", as_u32)?,
            })
        }
        "AllBlocksCleared" => KvEvent::Cleared,
        other => KvEvent::Unknown(other.to_owned()),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::Value as Json;

    use super::*;

    /// What `make_vectors.py` says an event holds, as this module reads it.
    fn expected_event(e: &Json) -> KvEvent {
        let hash = |h: &Json| match h {
            Json::String(s) => {
                let hex = s.strip_prefix("hex:").expect("hex:");
                let bytes: Vec<u8> = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect();
                EngineHash::Bytes(bytes.into())
            }
            n => EngineHash::Int(
                n.as_i64()
                    .map(i128::from)
                    .or_else(|| n.as_u64().map(i128::from))
                    .unwrap(),
            ),
        };
        let hashes = |v: &Json| v.as_array().unwrap().iter().map(hash).collect::<Vec<_>>();
        let text = |v: &Json| v.as_str().map(str::to_owned);
        let small = |v: &Json| v.as_u64().map(|n| u32::try_from(n).unwrap());
        match e["kind"].as_str().unwrap() {
            "stored" => KvEvent::Stored(BlockStored {
                block_hashes: hashes(&e["block_hashes"]),
                parent: (!e["parent"].is_null()).then(|| hash(&e["parent"])),
                token_ids: e["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| small(t).unwrap())
                    .collect(),
                block_size: small(&e["block_size"]).unwrap(),
                lora_id: e["lora_id"].as_i64(),
                lora_name: text(&e["lora_name"]),
                medium: text(&e["medium"]),
                group: small(&e["group"]),
                // No vector's extra keys name anything (`[None]` at most).
                extra_keys: false,
            }),
            "removed" => KvEvent::Removed(BlockRemoved {
                block_hashes: hashes(&e["block_hashes"]),
                medium: text(&e["medium"]),
                group: small(&e["group"]),
            }),
            _ => KvEvent::Cleared,
        }
    }

    fn vector(name: &str) -> (Vec<u8>, EventBatch) {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/kv_events/testdata");
        let payload = std::fs::read(format!("{dir}/{name}.msgpack")).unwrap();
        let json: Json = serde_json::from_slice(&std::fs::read(format!("{dir}/{name}.json")).unwrap()).unwrap();
        let expected = EventBatch {
            ts: json["ts"].as_f64().unwrap(),
            events: json["events"].as_array().unwrap().iter().map(expected_event).collect(),
            data_parallel_rank: small_rank(&json["data_parallel_rank"]),
        };
        (payload, expected)
    }

    fn small_rank(v: &Json) -> Option<u32> {
        v.as_u64().map(|n| u32::try_from(n).unwrap())
    }

    #[test]
    fn every_layout_of_the_vectors_decodes_to_what_msgspec_encoded() {
        for name in ["legacy", "legacy_dp", "tagged", "maps"] {
            let (payload, expected) = vector(name);
            let batch = decode_batch(&payload).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(batch, expected, "{name}");
        }
        // The vectors hold what they should: the layouts differ on the wire.
        let first = |name: &str| vector(name).0[0];
        assert_eq!(
            (first("legacy") & 0xf0, first("maps") & 0xf0),
            (0x90, 0x80),
            "array, map"
        );
        let (_, tagged) = vector("tagged");
        assert!(matches!(&tagged.events[1], KvEvent::Stored(s) if s.lora_name.as_deref() == Some("sql-adapter")));
        let (_, legacy) = vector("legacy");
        let KvEvent::Stored(s) = &legacy.events[1] else {
            panic!()
        };
        assert_eq!(s.block_hashes, [EngineHash::Int(i128::from(u64::MAX))]);
    }

    #[test]
    fn the_simulators_encoding_is_vllms_byte_for_byte() {
        use semlb_workers::kv_events::{KvEvent as Published, WireHash, encode_batch};
        // make_vectors.py's `maps` vector (vLLM's main), built by the
        // simulator's encoder from what the vector's JSON says it holds.
        let sha4: Vec<u8> = (0..32u32).map(|k| ((4 * 37 + k * 11) % 256) as u8).collect();
        let events = [
            Published::Stored {
                block_hashes: vec![WireHash::Bytes(sha4.clone())],
                parent: None,
                token_ids: (100..116).collect(),
                block_size: 16,
                lora_name: None,
                salt: None,
            },
            Published::Removed(vec![WireHash::Bytes(sha4)]),
            Published::Cleared,
        ];
        let (payload, _) = vector("maps");
        assert_eq!(encode_batch(1_732_000_002.0, &events, None), payload);
        // And what the simulator sends (integer hashes, a salt, a rank)
        // reads back.
        let salted = [Published::Stored {
            block_hashes: vec![WireHash::from(u64::MAX), WireHash::from(7u64)],
            parent: Some(WireHash::from(1u64 << 63)),
            token_ids: (0..32).collect(),
            block_size: 16,
            lora_name: Some("sql".into()),
            salt: Some("s".into()),
        }];
        let batch = decode_batch(&encode_batch(2.5, &salted, Some(3))).unwrap();
        assert_eq!(batch.data_parallel_rank, Some(3));
        let KvEvent::Stored(s) = &batch.events[0] else { panic!() };
        assert_eq!(s.block_hashes, [EngineHash::Int(-1), EngineHash::Int(7)]);
        assert_eq!(s.parent, Some(EngineHash::Int(i128::from(i64::MIN))));
        assert_eq!(
            (s.lora_name.as_deref(), s.extra_keys, s.group),
            (Some("sql"), true, Some(0))
        );
    }

    #[test]
    fn a_message_is_three_frames_with_a_big_endian_sequence() {
        let (payload, _) = vector("maps");
        let seq = 0x0102_0304_0506_0708u64.to_be_bytes();
        let topic: &[u8] = b"";
        assert_eq!(
            split_message(&[topic, &seq[..], &payload[..]]),
            Ok((0x0102_0304_0506_0708, &payload[..]))
        );
        assert!(matches!(split_message(&[topic, &seq[..]]), Err(WireError::Frames(_))));
        assert!(matches!(
            split_message(&[topic, &seq[..7], &payload[..]]),
            Err(WireError::Frames(_))
        ));
    }

    #[test]
    fn bad_batches_are_errors_and_unknown_events_are_kept_by_name() {
        let (payload, _) = vector("tagged");
        for cut in [1, payload.len() / 2, payload.len() - 1] {
            assert!(decode_batch(&payload[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = payload.clone();
        longer.push(0xc0);
        assert!(matches!(decode_batch(&longer), Err(WireError::Msgpack(_))));
        // 40 nested arrays: refused, not recursed into.
        let deep: Vec<u8> = std::iter::repeat_n(0x91, 40).chain([0xc0]).collect();
        assert!(decode_batch(&deep).is_err());
        let encode = |v: &Value| {
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, v).unwrap();
            out
        };
        let batch = |events: Vec<Value>| Value::Array(vec![Value::F64(1.0), Value::Array(events)]);
        let future = batch(vec![Value::Array(vec!["BlockPinned".into(), Value::Array(vec![])])]);
        assert_eq!(
            decode_batch(&encode(&future)).unwrap().events,
            [KvEvent::Unknown("BlockPinned".into())]
        );
        for wrong in [
            batch(vec![Value::Array(vec!["BlockStored".into(), "x".into()])]),
            batch(vec![Value::Array(vec![Value::from(3)])]),
            Value::Array(vec![Value::from("ts"), Value::Array(vec![])]),
            Value::from(7),
        ] {
            assert!(
                matches!(decode_batch(&encode(&wrong)), Err(WireError::Shape(_))),
                "{wrong}"
            );
        }
    }
}
