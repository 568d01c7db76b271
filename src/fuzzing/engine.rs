//! What an engine sends the gateway: its KV events (the ZMTP connection
//! and the msgpack batches in it) and its Prometheus `/metrics`.

use bytes::Bytes;
use rmpv::Value;

use super::{block_on, peak_allocation};
use crate::config::MetricsFlavor;
use crate::health::prometheus::{self, Sample};
use crate::kv_events::wire::{self, EngineHash, EventBatch, KvEvent};
use crate::kv_events::zmtp::{Connection, SocketType};
use shm_layout::LoadFigures;

/// Most bytes a parser may hold at once per input byte (a msgpack nil in
/// an array is one byte and a 32-byte value; an event a few more), beyond
/// [`ALLOCATION_SLACK`].
const BYTES_PER_INPUT_BYTE: usize = 64;
/// Allocation any input may cost (buffers, tables).
const ALLOCATION_SLACK: usize = 256 << 10;

/// A ZMTP peer's bytes (greeting, READY, then frames); byte 0 picks the
/// socket (bit 0: SUB or DEALER). Every message received holds no more
/// bytes than came in, reading never holds more than a bound per byte
/// received (a frame's announced size is not trusted), and the messages
/// sent again by semlb's writer read back the same.
pub fn zmtp(data: &[u8]) {
    let Some((&choice, peer)) = data.split_first() else {
        return;
    };
    let kind = if choice & 1 == 0 {
        SocketType::Sub
    } else {
        SocketType::Dealer
    };
    let (messages, peak) = peak_allocation(|| receive_all(peer, kind));
    let received: usize = messages.iter().flatten().map(Bytes::len).sum();
    assert!(
        received <= peer.len(),
        "{received} bytes of frames out of {}",
        peer.len()
    );
    if let Some(peak) = peak {
        assert!(
            peak <= 4 * peer.len() + ALLOCATION_SLACK,
            "reading {} bytes held {peak} bytes at once",
            peer.len()
        );
    }
    for message in &messages {
        assert!(!message.is_empty(), "a message has a frame");
        let parts: Vec<&[u8]> = message.iter().map(|f| &f[..]).collect();
        if let Ok((_, payload)) = wire::split_message(&parts) {
            let _ = wire::decode_batch(payload);
        }
    }
    // Sent by a connection of the same kind, read by another.
    let handshake = peer_handshake(kind);
    let Some(Ok(mut sender)) = block_on(Connection::over(tokio::io::join(&handshake[..], Vec::new()), kind)) else {
        panic!("a well-formed handshake is taken");
    };
    let ours = sender.stream().writer().len();
    for message in &messages {
        let frames: Vec<&[u8]> = message.iter().map(|f| &f[..]).collect();
        assert!(
            matches!(block_on(sender.send(&frames)), Some(Ok(()))),
            "sending to a Vec fails"
        );
    }
    let mut replay = handshake.clone();
    replay.extend_from_slice(&sender.stream().writer()[ours..]);
    assert_eq!(
        receive_all(&replay, kind),
        messages,
        "messages sent again read back the same"
    );
}

/// The messages a `kind` connection reads from `peer` before an error or
/// the end of its bytes.
fn receive_all(peer: &[u8], kind: SocketType) -> Vec<Vec<Bytes>> {
    let mut messages = Vec::new();
    if let Some(Ok(mut connection)) = block_on(Connection::over(tokio::io::join(peer, tokio::io::sink()), kind)) {
        while let Some(Ok(message)) = block_on(connection.recv()) {
            messages.push(message);
        }
    }
    messages
}

/// The greeting and READY command of a peer that a `kind` socket talks to
/// (a PUB for a SUB, a ROUTER for a DEALER).
fn peer_handshake(kind: SocketType) -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xff;
    out[9] = 0x7f;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let socket: &[u8] = match kind {
        SocketType::Sub => b"PUB",
        SocketType::Dealer => b"ROUTER",
    };
    let mut ready = b"\x05READY\x0bSocket-Type".to_vec();
    ready.extend_from_slice(&(socket.len() as u32).to_be_bytes());
    ready.extend_from_slice(socket);
    out.extend_from_slice(&[4, ready.len() as u8]);
    out.extend_from_slice(&ready);
    out
}

/// A KV event batch (msgpack, the third frame of a message). Decoding
/// holds at most `BYTES_PER_INPUT_BYTE` per input byte, and a decoded
/// batch written in each of vLLM's layouts (arrays; a batch array of tagged
/// maps; maps throughout) decodes to itself.
pub fn kv_batch(data: &[u8]) {
    let (decoded, peak) = peak_allocation(|| wire::decode_batch(data));
    if let Some(peak) = peak {
        assert!(
            peak <= BYTES_PER_INPUT_BYTE * data.len() + ALLOCATION_SLACK,
            "decoding {} bytes held {peak} bytes at once",
            data.len()
        );
    }
    let Ok(batch) = decoded else {
        return;
    };
    for layout in [Layout::Arrays, Layout::TaggedMaps, Layout::Maps] {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &encode_batch(&batch, layout)).expect("writing to a Vec");
        let again = wire::decode_batch(&bytes).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
        assert_eq!(
            (again.ts.to_bits(), &again.events, again.data_parallel_rank),
            (batch.ts.to_bits(), &batch.events, batch.data_parallel_rank),
            "{layout:?}: a batch written again decodes to itself"
        );
    }
}

/// How msgspec laid a batch out, by vLLM release ([`wire`]'s module docs).
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Batch and events as arrays.
    Arrays,
    /// A batch array of events as tagged maps.
    TaggedMaps,
    /// Maps throughout.
    Maps,
}

/// `batch` as msgspec writes it in `layout`.
fn encode_batch(batch: &EventBatch, layout: Layout) -> Value {
    let events = Value::Array(
        batch
            .events
            .iter()
            .map(|e| encode_event(e, !matches!(layout, Layout::Arrays)))
            .collect(),
    );
    let rank = batch.data_parallel_rank.map_or(Value::Nil, Value::from);
    match layout {
        Layout::Arrays | Layout::TaggedMaps => Value::Array(vec![Value::F64(batch.ts), events, rank]),
        Layout::Maps => Value::Map(vec![
            ("ts".into(), Value::F64(batch.ts)),
            ("events".into(), events),
            ("data_parallel_rank".into(), rank),
        ]),
    }
}

/// `event` as a tagged array (`[tag, fields...]`) or a map with `"type"`.
fn encode_event(event: &KvEvent, as_map: bool) -> Value {
    let string = |s: &Option<String>| s.as_deref().map_or(Value::Nil, Value::from);
    let group = |g: Option<u32>| g.map_or(Value::Nil, Value::from);
    let (tag, fields): (&str, Vec<(&str, Value)>) = match event {
        KvEvent::Stored(s) => (
            "BlockStored",
            vec![
                ("block_hashes", encode_hashes(&s.block_hashes)),
                ("parent_block_hash", s.parent.as_ref().map_or(Value::Nil, encode_hash)),
                (
                    "token_ids",
                    Value::Array(s.token_ids.iter().map(|t| Value::from(*t)).collect()),
                ),
                ("block_size", Value::from(s.block_size)),
                ("lora_id", s.lora_id.map_or(Value::Nil, Value::from)),
                ("medium", string(&s.medium)),
                ("lora_name", string(&s.lora_name)),
                (
                    "extra_keys",
                    if s.extra_keys {
                        Value::Array(vec![Value::from(1)])
                    } else {
                        Value::Nil
                    },
                ),
                ("group_idx", group(s.group)),
            ],
        ),
        KvEvent::Removed(r) => (
            "BlockRemoved",
            vec![
                ("block_hashes", encode_hashes(&r.block_hashes)),
                ("medium", string(&r.medium)),
                ("group_idx", group(r.group)),
            ],
        ),
        KvEvent::Cleared => ("AllBlocksCleared", Vec::new()),
        KvEvent::Unknown(tag) => (tag.as_str(), Vec::new()),
    };
    if as_map {
        let mut entries = vec![("type".into(), Value::from(tag))];
        entries.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
        Value::Map(entries)
    } else {
        let mut items = vec![Value::from(tag)];
        items.extend(fields.into_iter().map(|(_, v)| v));
        Value::Array(items)
    }
}

fn encode_hashes(hashes: &[EngineHash]) -> Value {
    Value::Array(hashes.iter().map(encode_hash).collect())
}

fn encode_hash(hash: &EngineHash) -> Value {
    match hash {
        EngineHash::Int(i) => match i64::try_from(*i) {
            Ok(i) => Value::from(i),
            Err(_) => Value::from(u64::try_from(*i).expect("a hash read from 64 bits")),
        },
        EngineHash::Bytes(b) => Value::Binary(b.to_vec()),
    }
}

/// An engine's `/metrics` text (read as the scraper reads it, lossily as
/// UTF-8): every sample line written again as the text format writes it
/// parses to the same sample, and every flavor's load figures are in
/// range.
pub fn prometheus(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for line in text.lines() {
        match prometheus::parse_line(line) {
            Ok(Some(sample)) => {
                let written = write_sample(&sample);
                let again = prometheus::parse_line(&written)
                    .unwrap_or_else(|e| panic!("{line:?} written as {written:?}: {e}"))
                    .unwrap_or_else(|| panic!("{line:?} written as {written:?} is not a sample"));
                assert!(
                    same_sample(&sample, &again),
                    "{line:?} written as {written:?} reads back as {again:?}, not {sample:?}"
                );
            }
            Ok(None) => {}
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
    for flavor in [
        MetricsFlavor::Auto,
        MetricsFlavor::Vllm,
        MetricsFlavor::Sglang,
        MetricsFlavor::Llamacpp,
    ] {
        let Ok(load) = prometheus::extract(&text, flavor) else {
            continue;
        };
        let figures = load.figures(12_345, 7);
        assert!(
            figures.kv_usage_permyriad <= 10_000 || figures.kv_usage_permyriad == LoadFigures::KV_USAGE_ABSENT,
            "KV usage {} per myriad from {load:?}",
            figures.kv_usage_permyriad
        );
        assert_eq!(figures.scraped_at_ms, 12_345);
    }
}

/// `sample` as one line of the text format: the name bare when it may be,
/// else quoted in the braces; label values and a quoted name escaped.
fn write_sample(sample: &Sample<'_>) -> String {
    let escape = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
    let bare = sample
        .name
        .bytes()
        .enumerate()
        .all(|(i, b)| (b.is_ascii_alphanumeric() || b == b'_' || b == b':') && !(i == 0 && b.is_ascii_digit()))
        && !sample.name.is_empty();
    let mut labels: Vec<String> = sample
        .labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    let mut line = String::new();
    if bare {
        line.push_str(&sample.name);
    } else {
        labels.insert(0, format!("\"{}\"", escape(&sample.name)));
    }
    if !labels.is_empty() || !bare {
        line.push('{');
        line.push_str(&labels.join(","));
        line.push('}');
    }
    line.push_str(&format!(" {:?}", sample.value));
    if let Some(t) = sample.timestamp {
        line.push_str(&format!(" {t:?}"));
    }
    line
}

/// Whether two samples are the same (a NaN value equals a NaN).
fn same_sample(a: &Sample<'_>, b: &Sample<'_>) -> bool {
    let same = |x: f64, y: f64| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    a.name == b.name
        && a.labels == b.labels
        && same(a.value, b.value)
        && match (a.timestamp, b.timestamp) {
            (Some(x), Some(y)) => same(x, y),
            (x, y) => x.is_none() && y.is_none(),
        }
}
